"""Where a simulated run's time went, interval by interval: the split that ran, the seconds per step, how busy
each pool was, and the reconfigurations it paid for. This is the evidence for comparing policies (why an
elastic run is faster or slower than a static one), read from a `SimResult`.

Pool busy shares are per pool, over the interval's wall time: the rollout pool counts the seconds it was
generating anything (`Engine.pool_busy`), the training pool the training-side seconds of its steps (a step
lost to a failure is not counted). An idle share is one minus the busy share.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from planner.sim.engine import SimResult


def split_at(result: SimResult, time_s: float) -> tuple[int, int]:
    """(training GPUs, rollout GPUs) of the split in force at `time_s`."""
    current = result.splits[0][1:]
    for at, train, rollout in result.splits:
        if at > time_s:
            break
        current = (train, rollout)
    return current


def intervals(result: SimResult, every: int) -> list[dict[str, Any]]:
    """One row per `every` steps of `result` (the last row may be shorter)."""
    if every < 1:
        raise ValueError(f"every: {every}: must be >= 1")
    ends, busy = result.step_end_s, result.rollout_busy_s
    if len(ends) == 0 or len(busy) != len(ends) or len(result.train_s) != len(ends):
        raise ValueError(f"{result.policy}: the result carries no per-step timeline")
    rows = []
    for lo in range(0, len(ends), every):
        hi = min(len(ends), lo + every)
        began = float(ends[lo - 1]) if lo else 0.0
        seconds = float(ends[hi - 1]) - began
        busy_before = float(busy[lo - 1]) if lo else 0.0
        paid = [s for s in result.switches if lo <= s["step"] < hi]
        train, rollout = split_at(result, began)
        rows.append({
            "steps": [lo, hi], "train_gpus": train, "rollout_gpus": rollout,
            "step_s": round(seconds / (hi - lo), 2),
            "rollout_busy_share": round(min(1.0, (float(busy[hi - 1]) - busy_before) / seconds), 3) if seconds else 0.0,
            "train_busy_share": round(min(1.0, float(np.sum(result.train_s[lo:hi])) / seconds), 3) if seconds else 0.0,
            "switches": len(paid),
            "switch_pause_s": round(sum(max(s["train_pause_s"], s["rollout_pause_s"]) for s in paid), 1)})
    return rows
