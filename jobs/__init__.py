"""The sbatch wrappers (jobs/README.md), no Python. This folder is the package ``pearlctl._shipped_jobs`` once
installed (pyproject.toml's ``[tool.setuptools.package-dir]``), so pearlctl.host.home finds ``worker.sh`` with
importlib.resources; this file makes it a regular package, which an editable install needs."""
