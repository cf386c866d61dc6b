"""Property-based fuzz test of the daemon's control API, with a real daemon process behind it.

1000 requests (about 30 s) to one run on the local backend (tests/local/test_api_boundary.py ``LiveRun``:
no Slurm; the daemon's poller sees its two tasks RUNNING on this host), served by one
``python -m pearlctl daemon RUN --foreground`` process. Hypothesis sends requests to every route of
pearlctl/daemon/api.py, GET and POST (and a few that are no route), each built by that route's strategy:

- bodies from the route's model field names (pearlctl.api.bodies), with values that look valid (the run's
  real job ids, allocation ids and node, a shipped engine profile, known policies) or are random JSON
  (None, booleans, integers far beyond 64 bits, floats with NaN, infinities and -0.0, strings with
  control characters or thousands long, nested lists and objects); a valid body with one to three values
  anywhere inside it replaced by junk, dropped, or an unknown key or item added; unknown ids (allocation,
  job, task, command); wrong JSON, JSON that is not an object, an empty body, deep nesting, and now and
  then a body over the 256 KiB limit (declared, or streamed chunked);
- headers: the run token, none, a wrong one, another run, no run header, an agent's own credential, its
  credential for another allocation, a well-formed credential for an allocation that does not exist, and
  junk allocation headers (latin-1, signs, exponents, "²");
- time: now and then nobody sends anything for a loss window, so silent agents' GPUs go LOST in between.

Routes whose bodies have more to get wrong (nested objects, free-form JSON) are drawn more often. One live
daemon carries state from one request to the next, so a failing request does not replay alone: there is no
shrinking; every 5xx is recorded with how its request was made, and the run goes on to report them all
(with the exceptions the daemon logged).

Properties, after every request: the status is never a 5xx other than 503 (every status is recorded), the
daemon process is alive and ``/v1/health`` answers 200. At the end: SQLite's integrity check passes; what
the run's JSON columns hold re-validates through the same models (the trainer report as a
``TrainerPhase``, the rollout report as a ``Progress``, the profile through ``planner.profile.from_dict``,
the borrowing settings with a known policy), every number in them is finite; every worker's URL is on
its allocation's node (or its agent's registered host); no tick or poll error was journaled; and the
control loop still ticks (``pearl_daemon_ticks_total`` grows, ``pearl_daemon_tick_errors_total`` and
``pearl_daemon_api_errors_total`` are 0). ``pytest -s`` prints the counts: examples per route and the
statuses each answered.
"""

from __future__ import annotations

import copy
import json
import math
import re
import string
import time
import tomllib
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from pearlctl.api import bodies
from pearlctl.daemon.agents import allocation_credential
from pearlctl.planner import profile as profiles
from pearlctl.planner.model import Work
from pearlctl.policies import known_policies
from pearlctl.vocabulary import Engine, Role
from tests.conftest import REPO
from tests.local.test_api_boundary import NODE, RUN_ID, LiveRun, wait_until

MAX_EXAMPLES = 1000
PAUSE_ONE_IN = 80  # now and then nobody sends anything for a loss window: silent agents' GPUs go LOST
PROFILE = tomllib.loads((REPO / "examples" / "profiles" / "qwen3-8b-h200.toml").read_text())
WORK_FIELDS = sorted(Work.__dataclass_fields__)

# --- random JSON ---------------------------------------------------------------------------------------------

CONTROL = [chr(c) for c in range(0x20)] + ["\x7f"]
huge_ints = st.sampled_from([2**63, -(2**63) - 1, 2**64, 10**30, -(10**30), 2**62 + 1, 10**12 + 1, -1, 0])
ints = st.one_of(st.integers(), st.integers(-(2**70), 2**70), huge_ints)
floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e308, 5e-324, 1e12 + 0.5]),
)
texts = st.one_of(
    st.text(max_size=20),
    st.builds(lambda a, c, b: a + c + b, st.text(max_size=5), st.sampled_from(CONTROL), st.text(max_size=5)),
    st.integers(257, 5000).map(lambda n: "x" * n),
    st.sampled_from(["", " ", "../../etc/passwd", "/tmp/x", "a/b", "\u2028", "\ud800", "NaN", "null", "0"]),
)
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts)
json_values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


def dumps(doc) -> bytes:
    """JSON as a lax client writes it: NaN and Infinity literals included."""
    return json.dumps(doc, allow_nan=True).encode()


# --- what one example sends ----------------------------------------------------------------------------------


@dataclass
class Req:
    route: str  # the route's name in the counts
    method: str
    path: str
    auth: str  # which headers (see ``headers_for``)
    body: bytes | None = None
    chunked: bool = False  # streamed without Content-Length
    why: str = ""  # how the body was made

    def short(self) -> str:
        body = b"" if self.body is None else self.body
        return f"{self.method} {self.path} auth={self.auth} body[{len(body)}]={body[:300]!r} ({self.why})"


@dataclass
class Ids:
    """The live run's real ids, and an agent registered as the rollout allocation."""

    trainer: int  # the trainer allocation's id
    rollout: int  # the rollout allocation's id
    credential: str
    secret: str
    jobs: list[str] = field(default_factory=list)


ROUTES = {  # name -> (method, path, body model, agent route)
    "health": ("GET", "/v1/health", None, False),
    "register": ("POST", "/v1/agents/register", bodies.Register, False),
    "heartbeat": ("POST", "/v1/agents/heartbeat", bodies.Heartbeat, True),
    "status": ("GET", "/v1/status", None, False),
    "trainer_phase": ("POST", "/v1/trainer/phase", bodies.TrainerPhase, False),
    "trainer_ack": ("POST", "/v1/trainer/ack", bodies.Ack, False),
    "borrow": ("POST", "/v1/borrow", bodies.Borrow, False),
    "return": ("POST", "/v1/return", bodies.ReturnNow, False),
    "moves": ("POST", "/v1/moves", bodies.Move, False),
    "workers": ("GET", "/v1/workers", None, False),
    "weight_targets": ("GET", "/v1/weights/targets", None, False),
    "rollout_progress": ("POST", "/v1/rollout/progress", bodies.Progress, False),
    "profile": ("POST", "/v1/profile", bodies.ProfileBody, False),
    "metrics": ("GET", "/metrics", None, False),
}


def valid_values(ids: Ids) -> dict[str, dict[str, st.SearchStrategy]]:
    """Per route, per field: values that look like what a real client sends (with real and unknown ids)."""
    job_ids = st.sampled_from([*ids.jobs, "local-nope0001", "12345", "0"])
    alloc_ids = st.one_of(st.sampled_from([ids.rollout, ids.trainer]), st.integers(1, 2**62), st.just(99999))
    gpus = st.lists(st.integers(0, 7), max_size=4, unique=True)
    names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:+-]{0,12}", fullmatch=True)
    seconds = st.floats(0, 1000, allow_nan=False)
    stamp = st.floats(0, 2e9, allow_nan=False)
    worker = st.fixed_dictionaries(
        {
            "key": st.from_regex(r"[a-z][a-z0-9-]{0,8}(#[0-9]{1,3})?", fullmatch=True),
            "role": st.sampled_from([r.value for r in Role]),
            "engine": st.sampled_from([e.value for e in Engine]),
            "state": st.sampled_from(["STARTING", "READY", "DRAINING", "SLEEPING", "STOPPED", "FAILED", "LOST"]),
        },
        optional={
            "gpus": gpus,
            "url": st.sampled_from([f"http://{NODE}:8000", f"http://{NODE.upper()}:9", "http://evil.example:1"]),
            "pid": st.integers(1, 2**31),
            "weight_version": names,
            "error": texts,  # a FAILED worker's reason: control characters or over 256 are refused
            "ready_s": seconds,  # its measured cold start (bad values: tests/unit/test_policy_costs.py)
        },
    )
    self_return = st.fixed_dictionaries(
        {
            "gpus": gpus,
            "worker_key": st.text(string.ascii_lowercase + "-", max_size=12),
            "deadline": stamp,
            "at": stamp,
            "how": st.sampled_from(["stopped", "parked"]),
        }
    )
    counts = st.one_of(st.integers(0, 10**6), st.integers(0, 10**12))
    return {
        "register": {
            "job_id": job_ids,
            "task_id": st.sampled_from([0, 0, 1, 10**6]),
            "node": st.sampled_from([NODE, NODE, "other-node", NODE.upper()]),
            "host": st.sampled_from([NODE, "evil.example"]),
            "pool": st.sampled_from(["trainer", "rollout", "nope"]),
            "gpus": gpus,
            "restarts": st.integers(0, 10),
            "pid": st.integers(1, 2**31),
        },
        "heartbeat": {
            "allocation_id": alloc_ids,
            "workers": st.lists(worker, max_size=3),
            "leaving": st.sampled_from([False, False, False, True]),
            "draining": st.booleans(),
            "desired_hash": st.from_regex(r"[0-9a-f]{1,16}", fullmatch=True),
            "wait_s": st.floats(0, 0.2),
            "epoch_seen": st.integers(0, 5),
            "self_returns": st.lists(self_return, max_size=2),
        },
        "trainer_phase": {
            "phase": st.sampled_from(["training", "waiting", "stopped"]),
            "step": st.integers(0, 10**6),
            "expected_wait_s": seconds,
            "metrics": st.dictionaries(names, st.one_of(st.integers(-100, 100), seconds, names), max_size=3),
            "released": st.booleans(),
            "release_mode": st.sampled_from(["offload", "checkpoint"]),
            "blocked_s": seconds,
            "weight_version": names,
            "weights_path": st.sampled_from(["/tmp/w/1", "w", "/nonexistent/weights"]),
            "world_size": st.integers(1, 8),
            "zero_stage": st.integers(0, 3),
            "ts": stamp,
            "wait_s": st.floats(0, 0.2),
        },
        "trainer_ack": {
            "command_id": st.one_of(
                st.sampled_from(["local-return:1", "orphan-reclaim:1.5", "1:0:OFFLOAD", "7:3:RELOAD"]), names
            ),
            "result": st.fixed_dictionaries({"ok": st.booleans()}, optional={"error": names, "s": seconds}),
        },
        "borrow": {
            # known ones, and names no policy has: unknown, a path out of policies/, too long for a file name
            "policy": st.sampled_from(
                [*known_policies(), "greedy", "nope", "../tests/conftest", "/nonexistent/p", "p" * 300]
            ),
            "gpus": st.integers(1, 4),
            "dry_run": st.sampled_from([True, True, False]),
            "keep_warm": st.booleans(),
        },
        "return": {"now": st.booleans(), "keep_warm": st.booleans()},
        "moves": {
            "kind": st.sampled_from(["start", "wake", "retire", "switch"]),
            "gpus": st.lists(
                st.one_of(
                    st.fixed_dictionaries(
                        {"node": st.sampled_from([NODE, NODE, "other-node"]), "index": st.integers(0, 8)}
                    ),
                    st.fixed_dictionaries({"id": st.integers(1, 12)}),
                ),
                min_size=1,
                max_size=3,
            ),
            "role": st.sampled_from([r.value for r in Role]),  # the served ones and two the move refuses
            "keep_warm": st.booleans(),
        },
        "rollout_progress": {
            "step": st.integers(0, 10**6),
            "queued": counts,
            "generating": counts,
            "tool_wait": counts,
            "done": counts,
            "tokens": counts,
            "work": st.dictionaries(st.sampled_from(WORK_FIELDS), st.floats(0, 1e6), max_size=4),
            "judge": st.fixed_dictionaries(
                {}, optional={"waiting": counts, "judging": counts, "done": counts, "failed": counts}
            ),
            "tools": st.fixed_dictionaries({"slowest_s": seconds}),
        },
        # with every optional key set, so that mutations reach each of them too
        "profile": {
            "profile": st.just(
                {
                    "profile": {**PROFILE["profile"], "request_overhead_s": 0.004, "request_serial_s": 0.002},
                    "sources": PROFILE["sources"],
                }
            ),
            "judge": st.booleans(),  # the judge's profile (refused by name where the run has no judge)
        },
    }


def _paths(doc, prefix=()):
    """Every path into a JSON document (object keys and list indices): leaves and inner values alike."""
    if prefix:
        yield prefix
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for k, v in items:
        yield from _paths(v, (*prefix, k))


def _get(doc, path):
    for k in path:
        doc = doc[k]
    return doc


@st.composite
def mutated(draw, doc: dict) -> tuple[dict, str]:
    """``doc`` with one value somewhere inside replaced by junk (an inner object or list, often), one key or
    item dropped, or an unknown key or item added."""
    doc = copy.deepcopy(doc)
    paths = list(_paths(doc))
    containers = [p for p in paths if isinstance(_get(doc, p), (dict, list))]
    how = draw(st.sampled_from(["replace", "replace", "replace", "drop", "add"] if paths else ["add"]))
    if how == "add":
        path = draw(st.sampled_from([(), *containers]))
        at = _get(doc, path)
        if isinstance(at, list):
            at.append(draw(json_values))
        else:
            at[draw(st.text(max_size=8).filter(lambda k: k not in at))] = draw(json_values)
        return doc, f"{'.'.join(map(str, path)) or 'body'}: unknown item added"
    path = draw(
        st.one_of(st.sampled_from(containers), st.sampled_from(paths)) if containers else st.sampled_from(paths)
    )
    parent, key = _get(doc, path[:-1]), path[-1]
    where = ".".join(map(str, path))
    if how == "drop":
        del parent[key]
        return doc, f"{where} dropped"
    parent[key] = draw(st.one_of(json_values, floats, huge_ints, texts, st.lists(scalars, max_size=2)))
    return doc, f"{where} replaced"


@st.composite
def route_body(draw, name: str, ids: Ids) -> tuple[bytes | None, str]:
    """A body for route ``name``, and how it was made."""
    model = ROUTES[name][2]
    kind = draw(
        st.sampled_from(
            ["valid"] * 5 + ["mutated"] * 5 + ["fields"] * 2 + ["raw", "non_object", "empty", "oversized", "nested"]
        )
    )
    if model is None:  # a GET route: whatever body comes along is ignored (but still read and size-checked)
        kind = draw(st.sampled_from(["empty"] * 6 + ["raw", "oversized"]))
    if kind == "empty":
        return draw(st.sampled_from([None, b"", b"{}", b"  "])), kind
    if kind == "raw":
        return draw(
            st.one_of(
                st.binary(max_size=64),
                st.sampled_from([b"{", b'{"a":', b"{'a': 1}", b"\xff\xfe{}", b'{"a": 1,}', b"[1, 2", b"NaN"]),
                st.text(max_size=40).map(str.encode),
            )
        ), kind
    if kind == "non_object":
        return dumps(draw(st.one_of(scalars, st.lists(json_values, max_size=3)))), kind
    if kind == "nested":
        depth = draw(st.sampled_from([9, 64, 300, 5000]))
        key = draw(st.sampled_from(sorted(model.model_fields)))
        return (f'{{"{key}": ' + "[" * depth + "]" * depth + "}").encode(), f"nested {depth}"
    if kind == "oversized":
        size = bodies.MAX_BODY_BYTES + draw(st.sampled_from([1, 1024, 200_000]))
        key = draw(st.sampled_from(sorted(model.model_fields))) if model else "x"
        return dumps({key: "a" * size}), f"oversized {size}"
    fields = sorted(model.model_fields)
    if kind == "fields":  # the route's field names, random JSON values
        chosen = draw(st.lists(st.sampled_from(fields), max_size=len(fields), unique=True))
        doc = {k: draw(json_values) for k in chosen}
        return dumps(doc), kind
    values = valid_values(ids)[name]
    required = [k for k, f in model.model_fields.items() if f.is_required()]
    doc = {k: draw(values[k]) for k in fields if k in required or draw(st.booleans())}
    if name == "heartbeat" and draw(st.integers(0, 3)):
        doc["allocation_id"] = ids.rollout  # mostly the agent's own allocation: the body gets looked at
    if kind == "valid":
        return dumps(doc), kind
    hows = []
    for _ in range(draw(st.integers(1, 3))):
        doc, how = draw(mutated(doc))
        hows.append(how)
    return dumps(doc), "; ".join(hows)


# every route, and those whose bodies have more to get wrong (nested objects, free-form JSON) more often
ROUTE_DRAWS = [*ROUTES, "heartbeat", "heartbeat", "profile", "profile", "register", "trainer_phase"]
ROUTE_DRAWS += ["rollout_progress", "trainer_ack", "unknown_path", "wrong_method"]

# mostly the credential the route takes, so that bodies get looked at; every wrong one now and then
BAD_AUTHS = ["none", "wrong_token", "other_run", "no_run_header", "agent_other", "agent_unknown", "agent_junk"]
RUN_AUTHS = ["run"] * 20 + BAD_AUTHS + ["agent_own"]
AGENT_AUTHS = ["agent_own"] * 20 + BAD_AUTHS + ["run", "agent_junk", "agent_junk"]


@st.composite
def requests(draw, ids: Ids) -> Req:
    if draw(st.integers(0, PAUSE_ONE_IN - 1)) == PAUSE_ONE_IN // 2:  # (0 and the ends come up more often)
        return Req("pause", "", "", "", why="every agent silent for a loss window")
    name = draw(st.sampled_from(ROUTE_DRAWS))
    if name == "unknown_path":
        path = draw(st.from_regex(r"(/v1)?(/[a-z0-9._-]{1,12}){0,3}/?", fullmatch=True)) or "/"
        return Req(name, draw(st.sampled_from(["GET", "POST", "PUT"])), path, "run", b"{}", why="no such route")
    if name == "wrong_method":
        method, path, _, _ = ROUTES[draw(st.sampled_from(sorted(ROUTES)))]
        other = {"GET": "POST", "POST": "GET"}[method]
        return Req(name, draw(st.sampled_from([other, "PUT", "DELETE"])), path, "run", b"{}", why="wrong method")
    method, path, _, agent = ROUTES[name]
    auth = draw(st.sampled_from(AGENT_AUTHS if agent else RUN_AUTHS))
    body, why = draw(route_body(name, ids))
    chunked = body is not None and len(body) > bodies.MAX_BODY_BYTES and draw(st.booleans())
    return Req(name, method, path, auth, body, chunked=chunked, why=why)


# what a header value may be (latin-1, no surrounding blanks): random, and shapes an id parser trips on —
# "²" and "¹" are str.isdigit() but not int(), 19 digits overflow 18, signs, exponents, blanks inside
header_junk = st.one_of(
    st.text(string.printable.strip(), max_size=24),
    st.text(st.characters(min_codepoint=0x21, max_codepoint=0xFF, exclude_characters="\x7f"), min_size=1, max_size=8),
    st.sampled_from(["\xb2", "\xb9\xb2", "1\xb3", "0", "-1", "+2", "1e3", "2 2", "9" * 19, "00002", "0x2"]),
)


def headers_for(req: Req, ids: Ids, draw_junk: str) -> dict[str, str | bytes]:
    run_token = f"Bearer {ids.secret}"
    own = {"Authorization": f"Bearer {ids.credential}", "X-Pearl-Allocation": str(ids.rollout)}
    h = {
        "run": {"Authorization": run_token},
        "none": {},
        "wrong_token": {"Authorization": ("Bearer " + (draw_junk or "x")).encode("latin-1")},
        "other_run": {"Authorization": run_token},
        "no_run_header": {"Authorization": run_token},
        "agent_own": own,
        # the rollout agent's credential, presented for the trainer's allocation
        "agent_other": {**own, "X-Pearl-Allocation": str(ids.trainer)},
        # a well-formed credential of an allocation that does not exist
        "agent_unknown": {
            "Authorization": f"Bearer {allocation_credential(ids.secret, RUN_ID, 99999)}",
            "X-Pearl-Allocation": "99999",
        },
        "agent_junk": {**own, "X-Pearl-Allocation": (draw_junk or "-1").encode("latin-1")},
    }[req.auth]
    if req.auth == "other_run":
        h["X-Pearl-Run"] = "another-run"
    elif req.auth != "no_run_header":
        h["X-Pearl-Run"] = RUN_ID
    return {**h, "Content-Type": "application/json"}


# --- the test ------------------------------------------------------------------------------------------------


class Tally:
    def __init__(self):
        self.examples: Counter[str] = Counter()
        self.statuses: dict[str, Counter[int]] = defaultdict(Counter)
        self.failures: Counter[str] = Counter()  # distinct failing requests (route, status, how made)
        self.examples_failed: dict[str, str] = {}  # route -> its first failing request, in full

    def report(self) -> str:
        lines = [f"api fuzz: {sum(self.examples.values())} requests"]
        for name in sorted(self.examples):
            seen = ", ".join(f"{s or 'closed'}x{n}" for s, n in sorted(self.statuses[name].items()))
            lines.append(f"  {name:18} {self.examples[name]:4}  {seen}")
        total = Counter()
        for c in self.statuses.values():
            total.update(c)
        lines.append("  statuses: " + ", ".join(f"{s or 'closed'}x{n}" for s, n in sorted(total.items())))
        if self.failures:
            lines.append(f"  failures ({sum(self.failures.values())}, {len(self.failures)} distinct):")
            lines += [f"    {n}x {f}" for f, n in self.failures.most_common(12)]
        return "\n".join(lines)

    def examples_report(self) -> str:
        return "first failing request per route:\n" + "\n".join(f"  {r}" for r in self.examples_failed.values())


def errors_logged(run: LiveRun) -> str:
    """The distinct exceptions the daemon logged (its log's last traceback lines)."""
    lines = run.log_path.read_text(errors="replace").splitlines() if run.log_path.exists() else []
    seen = dict.fromkeys(ln for ln in lines if re.match(r"^[A-Za-z_.]+(Error|Exception|Exit|Transition)\b", ln))
    return "exceptions in the daemon's log:\n" + "\n".join(f"  {ln[:300]}" for ln in seen)


def send(run: LiveRun, req: Req, headers: dict) -> int | str:
    """The status, or what went wrong on the wire."""
    content = req.body if req.body is not None else b""
    if req.chunked:
        body = req.body

        def stream():
            for i in range(0, len(body), 64 * 1024):
                yield body[i : i + 64 * 1024]

        content = stream()
    try:
        return run.http.request(req.method, req.path, content=content, headers=headers).status_code
    except httpx.HTTPError as exc:
        # the daemon may answer 413 and close before an oversized body is all written: that is fine
        # only for oversized bodies, and only if the daemon still serves (checked right after)
        if req.body is not None and len(req.body) > bodies.MAX_BODY_BYTES:
            return f"closed early ({type(exc).__name__})"
        raise


def _finite(value, where: str) -> list[str]:
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        return [f"{where} holds a NaN or an infinity: {str(value)[:200]}"]
    return []


def check_state(run: LiveRun) -> list[str]:
    """What must hold in state after any sequence of requests; the problems found."""
    problems = []
    with run.read() as store:
        health = store.health()
        if health["integrity"] != "ok":
            problems.append(f"integrity check: {health['integrity']}")
        r = store.runs.get(RUN_ID)
        for column in ("spec", "trainer", "rollout", "borrow", "profile", "judge_profile"):
            problems += _finite(r.get(column), f"runs.{column}")
        trainer = r.get("trainer")
        if trainer is not None:
            doc = {k: v for k, v in trainer.items() if k not in ("reported_at", "phase_since")}
            try:
                bodies.parse(bodies.TrainerPhase, doc)
            except bodies.ValidationError as exc:
                problems.append(f"stored trainer report is not a TrainerPhase: {bodies.describe(exc)}")
            for k in ("reported_at", "phase_since"):
                if not (isinstance(trainer.get(k), float) and math.isfinite(trainer[k])):
                    problems.append(f"trainer.{k} = {trainer.get(k)!r}")
            wait = trainer.get("expected_wait_s")
            if not (wait is None or (isinstance(wait, (int, float)) and math.isfinite(wait))):
                problems.append(f"trainer.expected_wait_s = {wait!r}")
        rollout = r.get("rollout")
        if rollout is not None:
            # the daemon's own fields beside the driver's report: when it came, its rate, when the work emptied,
            # the batch's work as it began (a planner Work, or None), and the judges' load and capacity
            judged = ("judge_saturated", "judge_busy", "judge_capacity_per_judge_s")
            own = ("reported_at", "tokens_per_s", "verdicts_per_s", "emptied_at", "batch_work", *judged)
            if "judge_busy" in rollout and not isinstance(rollout["judge_busy"], bool):
                problems.append(f"rollout.judge_busy = {rollout['judge_busy']!r}")
            run = rollout.get("judge_saturated")  # reports in a row at which every judge had work
            if run is not None and (isinstance(run, bool) or not isinstance(run, int) or run < 0):
                problems.append(f"rollout.judge_saturated = {run!r}")
            capacity = rollout.get("judge_capacity_per_judge_s")
            if not (
                capacity is None or (isinstance(capacity, (int, float)) and math.isfinite(capacity) and capacity >= 0)
            ):
                problems.append(f"rollout.judge_capacity_per_judge_s = {capacity!r}")
            doc = {k: v for k, v in rollout.items() if k not in own}
            emptied = rollout.get("emptied_at")
            if not (emptied is None or (isinstance(emptied, (int, float)) and math.isfinite(emptied))):
                problems.append(f"rollout.emptied_at = {emptied!r}")
            began = rollout.get("batch_work")
            try:
                if began is not None:
                    Work(**began)
            except TypeError as exc:
                problems.append(f"rollout.batch_work = {began!r}: {exc}")
            try:
                bodies.parse(bodies.Progress, doc)
            except bodies.ValidationError as exc:
                problems.append(f"stored rollout report is not a Progress: {bodies.describe(exc)}")
            tokens = rollout.get("tokens")
            if not (tokens is None or (isinstance(tokens, int) and not isinstance(tokens, bool))):
                problems.append(f"rollout.tokens = {tokens!r}")
            for k in ("reported_at", "tokens_per_s", "verdicts_per_s"):
                v = rollout.get(k)
                if k in rollout and not (isinstance(v, (int, float)) and math.isfinite(v)):
                    problems.append(f"rollout.{k} = {v!r}")
        if r.get("profile") is not None:
            try:
                profiles.from_dict(r["profile"])
            except Exception as exc:
                problems.append(f"stored profile does not load: {type(exc).__name__}: {exc}")
        policies = set(known_policies())
        if r.get("policy") not in policies:
            problems.append(f"runs.policy = {r.get('policy')!r}")
        borrow = r.get("borrow")
        if borrow is not None:
            if borrow.get("policy") not in policies:
                problems.append(f"borrow.policy = {borrow.get('policy')!r}")
            gpus = borrow.get("max_gpus")
            if not (gpus is None or (isinstance(gpus, int) and gpus >= 1)):
                problems.append(f"borrow.max_gpus = {gpus!r}")
        # a worker's URL names its allocation's node, or the host its agent registered from (api.py's rule)
        hosts = {a.id: {h.lower() for h in (a.node, a.agent_host) if h} for a in store.fleet.allocations(RUN_ID)}
        for w in store.fleet.workers(RUN_ID):
            if w.url and httpx.URL(w.url).host not in hosts[w.allocation_id]:
                problems.append(f"worker {w.id} has url {w.url} (not on {hosts[w.allocation_id]})")
            if not (isinstance(w.gpu_idx, tuple) and all(isinstance(i, int) for i in w.gpu_idx)):
                problems.append(f"worker {w.id} gpu_idx = {w.gpu_idx!r}")
        errors = [j for j in store.journal.read(RUN_ID) if j["event"] in ("tick error", "poll error")]
        problems += [f"journaled {j['event']}: {j['data']}" for j in errors]
    return problems


def test_control_api_fuzz(tmp_path):
    run = LiveRun(tmp_path)
    tally = Tally()
    try:
        registered = run.register("rollout")
        ids = Ids(
            trainer=run.allocations["trainer"].id,
            rollout=run.allocations["rollout"].id,
            credential=registered["credential"],
            secret=run.secret,
            jobs=sorted(run.jobs.values()),
        )
        assert registered["allocation_id"] == ids.rollout
        ticks_before = run.ticks()
        started = time.monotonic()

        loss_window = 2 * run.heartbeat_s + 0.3  # DaemonSettings.lost_after (2) heartbeats, and a tick

        # One live daemon carries state from one example to the next, so a failing example does not replay
        # alone: no shrinking; every 5xx is recorded (route, status, how the body was made) and the run goes
        # on, to report them all at the end. A dead or unhealthy daemon stops it at once.
        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            database=None,
            phases=(Phase.explicit, Phase.generate),
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
        )
        @given(req=requests(ids), junk=header_junk)
        def one_request(req: Req, junk: str):
            tally.examples[req.route] += 1
            if req.route == "pause":
                time.sleep(loss_window)
                return
            status = send(run, req, headers_for(req, ids, junk))
            tally.statuses[req.route][status if isinstance(status, int) else 0] += 1  # 0: closed before answering
            if isinstance(status, int) and status >= 500 and status != 503:
                tally.failures[f"{status} <- {req.method} {req.path} auth={req.auth} ({req.why})"] += 1
                tally.examples_failed.setdefault(req.route, req.short())
            assert run.alive(), f"the daemon exited after {req.short()}:\n{run.log()}"
            health = run.get("/v1/health")
            assert health.status_code == 200, f"/v1/health answered {health.status_code} after {req.short()}"

        try:
            one_request()
        finally:
            print("\n" + tally.report() + f"\n  ({time.monotonic() - started:.1f}s)")

        # afterwards: state is intact, the daemon lives, answers and ticks without errors
        problems = check_state(run)
        assert not tally.failures and not problems, (
            f"{tally.report()}\n{tally.examples_report()}\n{errors_logged(run)}\nstate after the fuzz:\n  "
            + "\n  ".join(problems or ["intact"])
        )
        assert run.alive(), run.log()
        assert run.get("/v1/health").status_code == 200
        wait_until(lambda: run.ticks() > ticks_before, 10, what="the control loop ticks")
        seen = run.ticks()
        wait_until(lambda: run.ticks() > seen, 10, what="the control loop keeps ticking after the fuzz")
        assert run.tick_errors() == 0, f"tick errors after the fuzz:\n{run.log()}\n{tally.report()}"
        assert run.api_errors() == 0, f"requests answered 500:\n{run.log()}\n{tally.report()}"
        assert sum(tally.examples.values()) >= MAX_EXAMPLES * 0.9, tally.report()
        assert set(ROUTES) <= set(tally.examples), f"some routes were never tried:\n{tally.report()}"
    finally:
        run.stop()


def test_the_strategies_cover_every_route_of_the_api():
    """Every route the daemon's app serves has a strategy here, whose valid bodies name its model's fields."""
    from types import SimpleNamespace

    from pearlctl.daemon.api import build_app

    sides = {
        "agents": ["register", "report", "remembered", "hold", "routable_workers"],
        "trainer": ["report", "hold", "ack", "rollout_progress"],
        "operator": ["borrow", "give_back", "set_profile", "move"],
    }
    answer = {side: SimpleNamespace(**{n: (lambda *a: {}) for n in names}) for side, names in sides.items()}
    controller = SimpleNamespace(run_id=RUN_ID, epoch=1, **answer)
    app = build_app(controller, secret="s", status=lambda: {})
    served = {(m, r.path) for r in app.routes for m in r.methods if m != "HEAD"}
    assert served == {(m, p) for m, p, _, _ in ROUTES.values()}
    values = valid_values(Ids(1, 2, "", "", ["j"]))
    for name, (_, _, model, _) in ROUTES.items():
        if model is not None:
            assert set(values[name]) == set(model.model_fields), name
