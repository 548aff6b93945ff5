"""GRPO advantages: per-sample scalar advantages from rewards of response groups.

Samples come in consecutive groups of `group_size` responses to the same prompt. Modes:

- `none`: A_i = r_i
- `group_mean`: A_i = r_i - mean(group)
- `group_zscore`: A_i = (r_i - mean(group)) / (std(group) + eps)
- `batch_mean`: A_i = r_i - mean(batch)
- `batch_zscore`: A_i = (r_i - mean(batch)) / (std(batch) + eps)

`std` is the unbiased (n - 1) standard deviation; a group of one sample has mean 0 and std 1, so its
advantage is its reward (the convention of the widely used GRPO implementations).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from libra.algo.spec import ADVANTAGE_NORM_MODES

DEFAULT_EPS = 1e-6


def _mean_std(values: np.ndarray) -> tuple[float, float]:
    if values.size == 1:
        return 0.0, 1.0
    return float(values.mean()), float(values.std(ddof=1))


def compute_advantages(
    rewards: Sequence[float], group_size: int, mode: str, eps: float = DEFAULT_EPS
) -> list[float]:
    """Advantages for `rewards` laid out as consecutive groups of `group_size`."""
    if mode not in ADVANTAGE_NORM_MODES:
        raise ValueError(f"advantage_norm_mode='{mode}' is not one of {', '.join(ADVANTAGE_NORM_MODES)}")
    r = np.asarray(list(rewards), dtype=np.float64)
    if mode == "none":
        return r.tolist()
    if mode.startswith("batch"):
        if r.size == 0:
            return []
        mean, std = _mean_std(r)
        out = r - mean
        if mode == "batch_zscore":
            out = out / (std + eps)
        return out.tolist()
    if group_size < 1:
        raise ValueError(f"group_size={group_size} must be >= 1")
    if r.size % group_size:
        raise ValueError(
            f"advantage_norm_mode='{mode}' needs equal groups: {r.size} rewards are not a multiple of "
            f"group_size={group_size}; pass whole groups or use a batch_* mode"
        )
    groups = r.reshape(-1, group_size)
    out_groups = np.empty_like(groups)
    for i, g in enumerate(groups):
        mean, std = _mean_std(g)
        out_groups[i] = g - mean
        if mode == "group_zscore":
            out_groups[i] = out_groups[i] / (std + eps)
    return out_groups.reshape(-1).tolist()
