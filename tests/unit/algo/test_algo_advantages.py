"""GRPO advantage normalization against hand-computed values."""

from __future__ import annotations

import math

import pytest

from libra.algo.advantages import compute_advantages

S = 1 / math.sqrt(2)  # (1 - 0.5) / std([1, 0], ddof=1)
B = 0.5 / math.sqrt(1 / 3)  # (1 - 0.5) / std([1, 0, 1, 0], ddof=1)

CASES = {
    "none-passthrough": ([1.0, 0.0, 2.0, 0.0], 2, "none", [1.0, 0.0, 2.0, 0.0]),
    "group-mean": ([1.0, 0.0, 3.0, 1.0], 2, "group_mean", [0.5, -0.5, 1.0, -1.0]),
    "group-zscore": ([1.0, 0.0, 0.0, 1.0], 2, "group_zscore", [S, -S, -S, S]),
    "group-zscore-constant-group-is-zero": ([1.0, 1.0, 0.0, 1.0], 2, "group_zscore", [0.0, 0.0, -S, S]),
    "group-of-one-keeps-reward": ([3.0, -1.0], 1, "group_zscore", [3.0, -1.0]),
    "batch-mean": ([1.0, 0.0, 1.0, 0.0], 2, "batch_mean", [0.5, -0.5, 0.5, -0.5]),
    "batch-zscore": ([1.0, 0.0, 1.0, 0.0], 4, "batch_zscore", [B, -B, B, -B]),
    "batch-ignores-group-size": ([2.0, 0.0, 1.0], 2, "batch_mean", [1.0, -1.0, 0.0]),
}


@pytest.mark.parametrize("rewards,group,mode,expected", CASES.values(), ids=CASES.keys())
def test_advantages(rewards: list[float], group: int, mode: str, expected: list[float]) -> None:
    assert compute_advantages(rewards, group, mode) == pytest.approx(expected, abs=1e-5)


ERRORS = {
    "unknown-mode": ([1.0], 1, "rank", "advantage_norm_mode='rank'"),
    "uneven-groups": ([1.0, 0.0, 1.0], 2, "group_mean", "not a multiple of group_size=2"),
    "bad-group-size": ([1.0], 0, "group_zscore", "group_size=0"),
}


@pytest.mark.parametrize("rewards,group,mode,message", ERRORS.values(), ids=ERRORS.keys())
def test_advantage_errors(rewards: list[float], group: int, mode: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        compute_advantages(rewards, group, mode)
