"""Property tests: no run spec, however malformed, gets past validation into a broken sbatch script.

Random spec documents (valid ones with a few keys replaced by junk: strings with control characters,
huge integers, nan and inf, wrong types) either fail validation with a SpecError and nothing else, or
render, pool by pool through the launcher's own request building, into scripts whose ``#SBATCH`` block
is intact (sbatch stops reading directives at the first line that is not a comment) and in which no
line holds a control character. ``pytest -s`` shows how many documents were accepted and rejected.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pearlctl.config import ROUTER_POLICIES, SpecError, parse_spec
from pearlctl.config.tables import POOL_KEYS, RUN_KEYS
from pearlctl.ops.launcher import requests_for
from pearlctl.slurm.script import SubmitRequest, render_script
from pearlctl.vocabulary import PACED_ENGINE_ARGS

POLICIES = ("never", "greedy")
CONTROL = [chr(c) for c in range(0x20)] + ["\x7f"]
CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")

# --- values ------------------------------------------------------------------------------------------

printable = st.text(st.characters(blacklist_categories=("Cc", "Cs")), max_size=12)
word = st.from_regex(r"[A-Za-z0-9_.+-]{1,12}", fullmatch=True)
ident = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True)
tainted = st.builds(
    lambda head, c, tail: head + c + tail,
    st.sampled_from(["t1", "debug", "01:00:00", "16G", "m", "run", "USR2", "python", "gpu[1-2]", ""]),
    st.sampled_from(CONTROL),
    st.sampled_from(["", "echo pwned", "#SBATCH --x", "\n", "rm -rf /"]),
)
scalar_junk = st.one_of(
    tainted,
    st.text(max_size=12),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.sampled_from([2**63 - 1, -(2**63), 0, -1, 4097, 10**12]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf]),
    st.booleans(),
    st.datetimes(min_value=dt.datetime(1, 1, 1), max_value=dt.datetime(9999, 1, 1)),
    st.none(),
)
junk = st.one_of(
    scalar_junk,
    st.lists(scalar_junk, max_size=3),
    st.dictionaries(st.one_of(ident, tainted), scalar_junk, max_size=3),
)

GOOD_RUN = {
    "name": st.from_regex(r"[A-Za-z][A-Za-z0-9_-]{0,12}", fullmatch=True),
    "model": st.just("m"),
    "run_dir": st.from_regex(r"run/[A-Za-z0-9_.-]{1,8}", fullmatch=True),
    "policy": st.sampled_from(POLICIES),
    "backend": st.sampled_from(["auto", "slurm", "local"]),
    "poll_interval_s": st.one_of(st.floats(min_value=1, max_value=3600), st.integers(1, 3600)),
}


GOOD_ROUTER = {
    "enabled": st.booleans(),
    "port": st.integers(0, 65535),
    "policy": st.sampled_from(ROUTER_POLICIES),
}


PACED_PROFILE = Path(__file__).resolve().parents[1] / "data" / "paced-fast.toml"


def good_pool(kind: str, paced: bool = False) -> dict:
    pool = {
        "nodes": st.integers(1, 4096),
        "gpus_per_node": st.integers(1 if kind == "trainer" else 0, 64),
        "partition": word,
        "time_limit": st.sampled_from(["30", "01:00:00", "1-00:00:00", "2-12", "UNLIMITED", "365-00:00:00"]),
        "account": word,
        "qos": word,
        "cpus_per_task": st.integers(1, 4096),
        "mem": st.sampled_from(["16G", "1024", "512M", "2T", "64T"]),
        "constraint": st.sampled_from(["h100", "a100|h100", "[rack1|rack2]&nvlink", "gpu*2", "(a&b)|c"]),
        "exclude": st.sampled_from(["gpu7", "gpu[1-3],head", "n-01.cluster"]),
        "requeue": st.booleans(),
        "preempt_signal": st.sampled_from(["USR2", "TERM", "INT", "HUP", "URG"]),
        "preempt_notice_s": st.integers(1, 65535),
        "command": st.lists(printable, min_size=1, max_size=4),
        "engine_args": (
            st.dictionaries(st.sampled_from(PACED_ENGINE_ARGS), st.integers(1, 4096), max_size=2)
            if paced
            else st.dictionaries(ident, st.one_of(printable, st.integers(), st.booleans()), max_size=3)
        ),
        "env": st.dictionaries(ident, printable, max_size=3),
    }
    if kind == "reward":  # the judge's own model (its path is checked as [run] model's)
        pool["model"] = st.sampled_from(["m", "judge", "/models/judge-8b"])
    if kind == "trainer":
        pool["train_command"] = st.lists(
            st.one_of(st.sampled_from(["{python}", "{repo}/t.py", "--out={run_dir}", "{model}"]), word),
            min_size=1,
            max_size=4,
        )
    return pool


@st.composite
def documents(draw) -> dict:
    """A valid spec document, then up to 4 keys replaced (or added) with junk."""
    kinds = ["trainer", draw(st.sampled_from(["rollout", "elastic"]))]
    kinds += draw(st.lists(st.sampled_from(["rollout", "elastic", "reward"]), max_size=2, unique=True))
    run = {k: draw(v) for k, v in GOOD_RUN.items() if k in ("name", "model", "run_dir") or draw(st.booleans())}
    paced = draw(st.booleans())  # the paced engine: its profile, and only the engine_args it reads
    if paced:
        run |= {"engine": "paced", "engine_profile": str(PACED_PROFILE)}
    pools = {}
    for kind in dict.fromkeys(kinds):
        strategies = good_pool(kind, paced)
        pool = {k: draw(v) for k, v in strategies.items() if k in ("nodes", "gpus_per_node") or draw(st.booleans())}
        if kind == "elastic" and draw(st.booleans()):
            pool["max_nodes"] = draw(st.integers(pool["nodes"], 4096))
        if kind == "elastic" and draw(st.booleans()):
            pool["pending_timeout_s"] = draw(st.one_of(st.integers(10, 86400), st.floats(10, 86400)))
        pools[kind] = pool
    doc = {"run": run, "pools": pools}
    if draw(st.booleans()):
        doc["router"] = {k: draw(v) for k, v in GOOD_ROUTER.items() if draw(st.booleans())}
    for _ in range(draw(st.integers(0, 4))):
        where = draw(st.sampled_from(["doc", "run", "pools", "router", *pools]))
        if where == "doc":
            doc[draw(st.sampled_from(["run", "pools", "router", "extra"]))] = draw(junk)
        elif where == "router":
            if not isinstance(doc.get("router"), dict):
                doc["router"] = {}
            doc["router"][draw(st.sampled_from([*GOOD_ROUTER, "prot"]))] = draw(junk)
        elif where == "run":
            run[draw(st.sampled_from([*RUN_KEYS, "nmae"]))] = draw(junk)
        elif where == "pools":
            pools[draw(st.sampled_from(["trainer", "rollout", "elastic", "reward", "bogus"]))] = draw(junk)
        elif isinstance(pools.get(where), dict):  # (not already replaced by junk)
            pools[where][draw(st.sampled_from([*POOL_KEYS, "gpus"]))] = draw(junk)
    return doc


# --- what a rendered script must look like --------------------------------------------------------------


def assert_clean(script: str) -> None:
    lines = script.split("\n")  # bash and sbatch split on \n only
    assert not any(CONTROL_RE.search(line) for line in lines), script
    first = next(i for i, line in enumerate(lines) if line.startswith("#SBATCH "))
    assert all(line.startswith("#") for line in lines[:first]), script  # only comments before
    blank = lines.index("", first)
    assert all(line.startswith("#SBATCH ") for line in lines[first:blank]), script
    assert lines[blank + 1].startswith("export ") and not any(line.startswith("#") for line in lines[blank:]), script


FUZZ = settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)


def test_random_specs_are_refused_with_a_spec_error_or_render_clean_scripts(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    counts: Counter[str] = Counter()

    @FUZZ
    @given(doc=documents())
    def check(doc: dict) -> None:
        try:
            spec = parse_spec(doc, tmp_path / "run.toml", POLICIES)
        except SpecError as exc:
            counts["rejected"] += 1
            assert exc.problems and all("\n" not in str(p) for p in exc.problems)
            return
        counts["accepted"] += 1
        counts["accepted paced"] += spec.engine == "paced"
        for req in requests_for(spec, f"{spec.name}-abc123"):
            script = render_script(req)
            assert_clean(script)
            assert ("PEARL_ENGINE=paced" in script) == (spec.engine == "paced")

    check()
    print(
        f"\nspec fuzz: {counts['accepted']} accepted ({counts['accepted paced']} paced), {counts['rejected']} rejected"
    )
    assert counts["accepted"] and counts["rejected"] and counts["accepted paced"]


REQUEST_FIELDS = {
    "run_id": word,
    "pool": st.sampled_from(["trainer", "rollout", "elastic", "reward", "daemon"]),
    "role": st.sampled_from(["TRAIN", "ROLLOUT"]),
    "array_size": st.integers(1, 4096),
    "gpus_per_node": st.integers(0, 64),
    "run_dir": st.just("/runs/x"),
    "model": st.just("/models/x"),
    "python": st.just("/venv/bin/python"),
    "worker_script": st.just("/repo/jobs/worker.sh"),
    "partition": st.one_of(st.none(), word),
    "time_limit": st.one_of(st.none(), st.just("01:00:00")),
    "account": st.one_of(st.none(), word),
    "qos": st.one_of(st.none(), word),
    "mem": st.one_of(st.none(), st.just("16G")),
    "nodelist": st.one_of(st.none(), st.just("gpu[1-3],head")),
    "constraint": st.one_of(st.none(), st.just("[rack1|rack2]&nvlink")),
    "exclude": st.one_of(st.none(), st.just("gpu[1-3],head")),
    "preempt_signal": st.just("USR2"),
    "command": st.one_of(st.none(), st.lists(printable, min_size=1, max_size=3).map(tuple)),
    "train_command": st.one_of(st.none(), st.lists(printable, min_size=1, max_size=3).map(tuple)),
    "engine_args": st.dictionaries(ident, st.one_of(printable, tainted), max_size=2),
    "env": st.dictionaries(ident, printable, max_size=3),
    "array": st.booleans(),
}
STRING_FIELDS = [k for k in REQUEST_FIELDS if k not in ("array_size", "gpus_per_node", "array", "engine_args")]


@st.composite
def requests(draw) -> dict:
    """A well-formed request, then up to 2 of its strings tainted with a control character."""
    fields = {k: draw(v) for k, v in REQUEST_FIELDS.items()}
    for _ in range(draw(st.integers(0, 2))):
        key = draw(st.sampled_from(STRING_FIELDS))
        if key == "env":
            fields["env"] = {**fields["env"], draw(st.one_of(ident, tainted)): draw(tainted)}
        elif key in ("command", "train_command"):
            fields[key] = (*(fields[key] or ()), draw(tainted))
        else:
            fields[key] = draw(tainted)
    return fields


def test_render_script_never_writes_a_control_character_whatever_the_request() -> None:
    """Defence in depth: a request built without the spec's validation is refused, never rendered broken."""
    counts: Counter[str] = Counter()

    @FUZZ
    @given(fields=requests())
    def check(fields: dict) -> None:
        try:
            script = render_script(SubmitRequest(**fields))
        except ValueError as exc:
            counts["refused"] += 1
            assert "refusing to render" in str(exc)
            return
        counts["rendered"] += 1
        assert_clean(script)

    check()
    print(f"\nrender fuzz: {counts['rendered']} rendered, {counts['refused']} refused")
    assert counts["rendered"] and counts["refused"]
