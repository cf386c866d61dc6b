"""Docs that stay in the repository: every ``*.md`` file a tracked source, script, config or doc names must
be a file of this repository, so a comment that cites a doc can be followed by anyone with a checkout.

A name with a folder (``docs/router.md``, ``jobs/README.md``) resolves from the repository root or from the
citing file's folder; a bare name (``planner.md``) resolves to any tracked ``.md`` file of that name. Files
of other public repositories that docs/sources.md cites as sources are listed in ``EXTERNAL``."""

from __future__ import annotations

import posixpath
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("pearlctl/", "policies/", "examples/", "scripts/", "jobs/", "tests/", "docs/", "README.md")
SUFFIXES = (".py", ".sh", ".md", ".toml")
# a file name ending in .md, with an optional folder path before it; not part of a URL
MD_NAME = re.compile(r"(?<![\w./:-])([\w.-]+/)*[\w.-]*\w\.md\b")
# other repositories' files, cited by repository and path as the source of a number (docs/sources.md)
EXTERNAL = {
    "sglang/Model_Config.md",
    "Qwen__Qwen3-30B-A3B-GGUF/README.md",
    "docs/performance-lab/qwen3-8b/h100-latency.md",
    "benchmark_v0.md",
    "_posts/2025-10-26-sleep-mode.md",
    "docs/infrastructure/swe-rl-case-study.md",
    "recipe/dapo/README.md",
    "docs/tutorial/retool.md",
    "blog/AReaL_v0_3.md",
    "LongBench/task.md",
    "genrm_remote/README.md",
    "docs/nemotron/super3/rl/rlhf.md",
    "Guide/llm_as_judge_optimization.md",
    "reward_queue/README.md",
    "docs/performance-lab/qwen3-32b/h100.md",
}


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def _missing_references() -> list[str]:
    tracked = _tracked()
    tracked_set = set(tracked)
    md_basenames = {posixpath.basename(p) for p in tracked if p.endswith(".md")}
    missing = []
    for path in tracked:
        if not (path == "README.md" or (path.startswith(SCANNED) and path.endswith(SUFFIXES))):
            continue
        if not (REPO / path).is_file():  # deleted in the work tree, not yet committed
            continue
        for lineno, line in enumerate((REPO / path).read_text(errors="replace").splitlines(), 1):
            for m in MD_NAME.finditer(line):
                name = m.group(0)
                if name in EXTERNAL:
                    continue
                if "/" in name:
                    here = posixpath.normpath(posixpath.join(posixpath.dirname(path), name))
                    found = name in tracked_set or here in tracked_set
                else:
                    found = name in md_basenames
                if not found:
                    missing.append(f"{path}:{lineno}: {name}")
    return missing


def test_every_md_file_named_in_the_repository_is_in_the_repository():
    missing = _missing_references()
    assert not missing, "names of .md files that are not in the repository:\n" + "\n".join(missing)


def test_the_pattern_finds_md_names_with_or_without_a_folder_but_not_in_urls():
    found = [m.group(0) for m in MD_NAME.finditer("see docs/router.md, planner.md and https://x.org/a/b.md")]
    assert found == ["docs/router.md", "planner.md"]
