"""What a wheel ships (pyproject.toml's [tool.setuptools]): every package under pearlctl/ (the shipped policies
among them, pearlctl.policies.shipped), and the top-level jobs/ as pearlctl._shipped_jobs, which
pearlctl.host.home finds through the import system (here: the editable install, which maps it onto the folder).
The wheel itself is built and installed in tests/local/test_wheel_install.py."""

from __future__ import annotations

import tomllib

from pearlctl import policies
from pearlctl.host import home
from tests.conftest import REPO

SETUPTOOLS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_under_pearlctl_is_listed():
    on_disk = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "pearlctl").rglob("__init__.py")}
    assert on_disk <= set(SETUPTOOLS["packages"]), "add these to [tool.setuptools] packages"


def test_the_shipped_folders_are_mapped_packages_found_through_the_import_system():
    assert SETUPTOOLS["package-dir"] == {"pearlctl._shipped_jobs": "jobs"}
    assert "pearlctl._shipped_jobs" in SETUPTOOLS["packages"]
    assert policies.SHIPPED_POLICIES_DIR == REPO / "pearlctl" / "policies" / "shipped"
    assert home.WORKER_SCRIPT == REPO / "jobs" / "worker.sh"


def test_package_data_covers_every_wrapper():
    globs = SETUPTOOLS["package-data"]["pearlctl._shipped_jobs"]
    for path in (REPO / "jobs").iterdir():
        if path.is_file() and path.suffix != ".py":
            assert any(path.match(g) for g in globs), f"{path.name} would be left out of the wheel"
