"""pearlctl: a Slurm control plane for agentic RL post-training.

The package is layered (docs/architecture.md, checked by import-linter in CI): ``cli`` renders, ``daemon``
decides, ``state`` alone touches SQLite, ``slurm`` alone runs Slurm commands, ``agent`` alone starts
engines, ``planner`` and ``sim`` are pure.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("pearlctl")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+source"
