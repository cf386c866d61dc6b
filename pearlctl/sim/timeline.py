"""A picture of GPU roles over simulated time: one stacked-area panel per policy (matplotlib, Agg backend,
written to a PNG), so a person can see borrowing, elastic grants and preemptions, PD layouts and the time
GPUs spend in transition. Timelines are sampled every ``pearlctl.sim.gpus.TIMELINE_EVERY_S`` simulated
seconds when a run records them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from pearlctl.sim.gpus import CATEGORIES
from pearlctl.sim.run import RunResult
from pearlctl.vocabulary import Role

COLORS = {
    Role.TRAIN: "#1f77b4",
    "TRAIN_IDLE": "#aec7e8",
    Role.ROLLOUT: "#2ca02c",
    Role.PREFILL: "#ff7f0e",
    Role.DECODE: "#d62728",
    Role.REWARD: "#9467bd",
    Role.IDLE: "#dddddd",
    "TRANSITION": "#7f7f7f",
}


def write_png(results: dict[str, RunResult], path: str | Path, *, title: str = "") -> Path:
    runs = [r for r in results.values() if r.timeline]
    if not runs:
        raise ValueError("no timeline was recorded (run with record_timeline=True)")
    panels = [(f"{r.policy}: {r.samples_per_s:.3f} samples/s, {r.transitions} transitions", r.timeline) for r in runs]
    return draw(panels, path, title=title)


def draw(
    panels: Sequence[tuple[str, Sequence[tuple[float, Mapping[str, int]]]]],
    path: str | Path,
    *,
    title: str = "",
    xlabel: str = "simulated minutes",
) -> Path:
    """One stacked-area panel per (heading, samples): samples are (seconds, GPUs per category), drawn as
    steps. The simulator's timelines and a real run's (``pearlctl status --timeline``, pearlctl.ops.timeline)
    both come here, so the two pictures compare."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a head node or in CI
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 2.3 * len(panels) + 0.6), sharex=True, squeeze=False)
    for ax, (heading, samples) in zip(axes[:, 0], panels, strict=True):
        t = [p[0] / 60.0 for p in samples]
        series = [[p[1].get(c, 0) for p in samples] for c in CATEGORIES]
        ax.stackplot(t, series, labels=CATEGORIES, colors=[COLORS[c] for c in CATEGORIES], step="post")
        ax.set_ylabel("GPUs")
        ax.set_title(heading, fontsize=9, loc="left")
        ax.margins(x=0)
    axes[-1, 0].set_xlabel(xlabel)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    if title:
        fig.suptitle(title, y=0.995, fontsize=10)
    fig.legend(
        handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.97), ncol=len(CATEGORIES), fontsize=8, frameon=False
    )
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
