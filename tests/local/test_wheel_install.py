"""A wheel install works (issue 12, item 5): build pearlctl's wheel, install it into a clean venv, and run
`pearlctl doctor` and `pearlctl simulate` from it, from a working directory outside the repository.

The clean venv holds the wheel (``pip install --no-deps``) and pearlctl's own dependencies only (pyproject's
``dependencies``, followed through their requirements, no extras): each of those distributions is linked in
from this interpreter's site-packages, so nothing is downloaded and no CUDA torch comes along; the editable
install of the repository (its finder and its .pth) is not linked, nor torch, vLLM or DeepSpeed. Doctor runs
without Slurm on PATH (one `slurm` warning) and without engines (warnings): what it checks is the wheel's
jobs/worker.sh and policies, the state file, and the absent engines.
"""

from __future__ import annotations

import email
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

from tests.conftest import REPO

SCENARIO = REPO / "examples" / "scenarios" / "short-steps-8b.toml"


def requirements_of(wheel: Path) -> list[str]:
    """The wheel's Requires-Dist lines (what pyproject's dependencies and extras became)."""
    with zipfile.ZipFile(wheel) as z:
        (metadata,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        return email.message_from_bytes(z.read(metadata)).get_all("Requires-Dist") or []


def dependency_closure(wheel: Path) -> list[importlib.metadata.Distribution]:
    """The distributions the wheel needs to run: its requirements without extras, and theirs, as installed here."""
    seen: dict[str, importlib.metadata.Distribution] = {}
    todo = [Requirement(r) for r in requirements_of(wheel)]
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra (cpu, test, ...) or another platform's
        try:
            dist = importlib.metadata.distribution(req.name)
        except importlib.metadata.PackageNotFoundError:
            raise AssertionError(
                f"{req} (a dependency of the wheel) is not installed here: run scripts/setup"
            ) from None
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        seen[key] = dist
        todo += [Requirement(r) for r in dist.requires or []]
    return list(seen.values())


def link_dependencies(wheel: Path, site: Path) -> list[str]:
    """Link every top-level file and folder of the wheel's dependency closure into ``site``; the names linked."""
    linked = []
    for dist in dependency_closure(wheel):
        assert dist.files, f"{dist.metadata['Name']} has no RECORD: cannot tell its files"
        for top in sorted({f.parts[0] for f in dist.files if not f.parts[0].startswith("..")}):
            source = Path(dist.locate_file(top))
            if source.exists() and not (site / top).exists() and top != "__pycache__":
                (site / top).symlink_to(source)
                linked.append(top)
    return linked


def build_wheel(tmp_path: Path) -> Path:
    """pearlctl's wheel, built from a copy of the sources (the build leaves build/ and egg-info where it runs)."""
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("pearlctl", "jobs"):
        shutil.copytree(REPO / folder, src / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    dist = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-build-isolation",
            "--no-deps",
            "--no-index",
            "-w",
            dist,
            src,
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    (wheel,) = dist.glob("pearlctl-*.whl")
    return wheel


def test_a_wheel_installed_in_a_clean_venv_runs_doctor_and_simulate_with_its_shipped_files(tmp_path):
    wheel = build_wheel(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=60)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], capture_output=True, text=True
    )
    site = Path(purelib.stdout.strip())
    assert site.is_relative_to(venv)
    linked = link_dependencies(wheel, site)
    assert not any(n.startswith(("pearlctl", "__editable__")) for n in linked), linked
    assert not {"torch", "vllm", "deepspeed"} & set(linked), "an engine is not one of pearlctl's dependencies"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel],
        check=True,
        capture_output=True,
        timeout=120,
    )

    elsewhere = tmp_path / "elsewhere"  # a working directory outside the repository
    elsewhere.mkdir()
    assert not elsewhere.resolve().is_relative_to(REPO)
    env = {
        "PATH": str(venv / "bin"),  # no sbatch/squeue: doctor needs no cluster
        "HOME": str(tmp_path / "home"),
        "PEARL_STATE_DIR": str(tmp_path / "state"),
        "MPLCONFIGDIR": str(tmp_path / "mpl"),
        "LANG": os.environ.get("LANG", "C.UTF-8"),
    }

    def run(*args: str, extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            args, cwd=elsewhere, env={**env, **(extra or {})}, capture_output=True, text=True, timeout=120
        )

    shipped = site / "pearlctl"
    probe = run("python", "-c", "import pearlctl, sys; print(pearlctl.__file__); print(sys.path)")
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.splitlines()[0] == str(shipped / "__init__.py")
    assert str(REPO) not in probe.stdout, "the repository is on the clean venv's sys.path"
    assert (venv / "bin" / "pearlctl").read_text().startswith(f"#!{python}")  # the console script is the venv's

    doctor = run("pearlctl", "doctor", "--json")
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    checks = {c["name"]: c for c in json.loads(doctor.stdout)}
    assert checks["jobs/worker.sh"] == {
        "name": "jobs/worker.sh",
        "status": "ok",
        "detail": str(shipped / "_shipped_jobs" / "worker.sh"),
    }
    assert checks["policies"]["status"] == "ok"
    shipped_policies = shipped / "policies" / "shipped"
    names = sorted(f.stem for f in (REPO / "pearlctl" / "policies" / "shipped").glob("*.py") if f.stem != "__init__")
    assert checks["policies"]["detail"] == f"{', '.join(names)} in {shipped_policies}"  # every one the repo ships
    assert "pivot" in names
    assert checks["slurm"]["status"] == "warn"  # not on PATH
    assert checks["state file"]["status"] == "ok"
    for engine in ("vllm", "deepspeed", "torch"):  # the cpu extra is not installed
        assert checks[f"engine {engine}"]["status"] == "warn"
        assert "not importable here" in checks[f"engine {engine}"]["detail"]
    assert (shipped / "_shipped_jobs" / "worker.sh").read_bytes() == (REPO / "jobs" / "worker.sh").read_bytes()

    # -v (PYTHONVERBOSE) names the file behind every module Python loads, the policies' files among them.
    sim = run(
        "pearlctl", "simulate", str(SCENARIO), "--compare", "static,pearl", "--steps", "2", "--json",
        extra={"PYTHONVERBOSE": "1"},
    )  # fmt: skip
    assert sim.returncode == 0, sim.stderr[-3000:]
    doc = json.loads(sim.stdout)
    assert set(doc["policies"]) == {"static", "pearl"}
    assert all(p["finished"] and p["steps"] == 2 for p in doc["policies"].values())
    loaded = [line for line in sim.stderr.splitlines() if line.startswith("# ") and line.rstrip("'").endswith(".py")]
    for name in ("static", "pearl"):
        policy_file = shipped / "policies" / "shipped" / f"{name}.py"
        assert any(line.endswith(f"{policy_file}") or line.endswith(f"'{policy_file}'") for line in loaded), name
    assert any(str(shipped / "cli" / "__init__.py") in line for line in loaded)
    assert not [line for line in loaded if str(REPO) in line], "a module was loaded from the repository"
