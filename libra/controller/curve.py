"""The learning-curve picture of a run (`learning_curve.png`): batch reward per step, its moving average, and
held-out evaluation accuracy when the run evaluates. Drawn with matplotlib's file-only backend and written
atomically, so `libra status` or an image viewer never sees half a file."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def moving_average(values: Sequence[float], window: int) -> list[float]:
    out: list[float] = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_learning_curve(rows: Sequence[Mapping[str, Any]], path: Path, title: str = "") -> bool:
    """Draw the curve of `rows` (metrics.jsonl objects); False when there is nothing to draw yet."""
    points = [(r["step"], float(r["reward_mean"])) for r in rows if "step" in r and "reward_mean" in r]
    if not points:
        return False
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    steps = [p[0] for p in points]
    rewards = [p[1] for p in points]
    fig = Figure(figsize=(7, 4), dpi=100)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(steps, rewards, color="#9bb7d4", linewidth=1, label="batch reward")
    window = max(1, min(20, len(rewards) // 5 or 1))
    ax.plot(steps, moving_average(rewards, window), color="#1f4e79", linewidth=2,
            label=f"moving average ({window} steps)")
    # an evaluation overlapped with the next step is reported in that step's row, with the step it evaluated
    evals = [(r.get("eval_step", r["step"]), float(r["eval_accuracy"])) for r in rows if "eval_accuracy" in r]
    if evals:
        ax.plot([e[0] for e in evals], [e[1] for e in evals], "o-", color="#c0504d", markersize=4,
                label="held-out accuracy")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_ylim(bottom=min(0.0, min(rewards)), top=max(1.0, max(rewards)))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".curve.", suffix=".png", dir=path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return True
