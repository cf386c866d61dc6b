"""The shipped policies, one module per policy, loaded by name from their files (pearlctl.policies); the core
never imports one. This folder is the package ``pearlctl._shipped_policies`` once installed (pyproject.toml's
``[tool.setuptools.package-dir]``); this file makes it a regular package, which an editable install needs."""
