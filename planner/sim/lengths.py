"""Response lengths of a drifting GRPO workload: seeded, long-tailed, with a mean that grows over the job,
and the drift curve itself (`DriftCurve`), the one curve family shared with the `drift` task of
`libra.data.drift_task` so that simulated runs can be calibrated against real ones.

The drift: a value ramps linearly from `start` to `end` over the first `ramp` units of progress and then
stays at `end`. The `drift` task ramps each prompt's response budget over prompts; the simulator ramps the
mean response length over the fraction of the job (`LengthModel.ramp`, 1.0: the whole job). Each step's
responses are drawn from a log-normal distribution (a long right tail, as response lengths of reasoning
models show) with that step's mean, clipped at `max_new_tokens`. Response length growing steadily during RL
training is reported for reasoning models (DeepSeek-R1, arXiv:2501.12948, Fig. 3: the average response
length grows roughly linearly over RL steps; DAPO, arXiv:2503.14476, Fig. 7); the numbers of a case are a
chosen workload, not a measurement.

Only per-step sufficient statistics are kept (`BatchStats`): count, sum, maximum and sum of squares of the
lengths, and the sum of each prompt group's longest response (a group of `n_samples` responses is finished,
and counts for a step, when its longest is). The simulator needs nothing else (see `planner.sim.decode`),
which keeps 10,000 GPUs x 1,000 steps cheap. A group's responses are drawn independently (responses to one
prompt are likely more alike, so a group's longest is likely shorter than drawn here). The same seed gives
the same lengths for every policy (common random numbers), so policies are compared on the same draws.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

DRAW_CHUNK = 1 << 20  # lengths drawn at once, bounding memory for very large steps


@dataclass(frozen=True)
class DriftCurve:
    """`start` at progress 0, rising (or falling) linearly to `end` at progress `ramp`, then `end`."""

    start: float
    end: float
    ramp: float

    def problems(self) -> list[str]:
        return [] if self.ramp > 0 else [f"ramp: {self.ramp}: must be > 0"]

    def at(self, progress: float) -> float:
        done = min(1.0, max(0.0, progress) / self.ramp)
        return self.start + (self.end - self.start) * done


@dataclass(frozen=True)
class LengthModel:
    """Response-length distribution over the job. The mean follows `DriftCurve(start_mean, end_mean, ramp)`
    over the fraction of the job; `sigma` is the log-normal shape (0.8 gives a p99 about 4.8x the median);
    `drift=False` keeps the mean at `start_mean`."""

    start_mean: float
    end_mean: float
    max_new_tokens: int
    sigma: float = 0.8
    ramp: float = 1.0
    drift: bool = True

    @property
    def curve(self) -> DriftCurve:
        return DriftCurve(self.start_mean, self.end_mean, self.ramp)

    def validate(self) -> None:
        problems = []
        for name in ("start_mean", "end_mean"):
            value = getattr(self, name)
            if not 1 <= value <= self.max_new_tokens:
                problems.append(f"{name}: {value}: must be within [1, max_new_tokens={self.max_new_tokens}]")
        if self.sigma < 0:
            problems.append(f"sigma: {self.sigma}: must be >= 0")
        problems += self.curve.problems()
        if problems:
            raise ValueError("; ".join(problems))

    def mean_at(self, fraction: float) -> float:
        """Target mean length (before truncation) at `fraction` of the job."""
        return self.curve.at(fraction) if self.drift else self.start_mean

    def draw(self, rng: np.random.Generator, mean: float, n: int) -> np.ndarray:
        """`n` lengths (whole tokens, >= 1, <= max_new_tokens) of a log-normal with mean `mean`."""
        mu = math.log(mean) - self.sigma**2 / 2.0
        raw = rng.lognormal(mu, self.sigma, n) if self.sigma > 0 else np.full(n, mean)
        return np.clip(np.rint(raw), 1, self.max_new_tokens)


@dataclass(frozen=True)
class BatchStats:
    """Per-step sufficient statistics of the response lengths (arrays of length `steps`). `group_longest`
    sums the longest response of each group of `group_size` (None: not known, taken as groups of one)."""

    count: np.ndarray
    total: np.ndarray
    longest: np.ndarray
    sum_squares: np.ndarray
    group_size: int = 1
    group_longest: np.ndarray | None = None

    @classmethod
    def of_lengths(cls, lengths: np.ndarray, group_size: int = 1) -> BatchStats:
        """The statistics of known lengths: one row per step, groups of `group_size` consecutive entries."""
        rows = np.asarray(lengths)
        if group_size < 1 or rows.ndim != 2 or rows.shape[1] % group_size:
            raise ValueError(f"lengths of shape {rows.shape}: need one row per step, a multiple of group_size "
                             f"{group_size} long")
        total, longest, squares, group_longest = _sums(rows, group_size)
        return cls(np.full(len(rows), rows.shape[1], dtype=np.int64), total, longest, squares, group_size,
                   group_longest)

    @property
    def steps(self) -> int:
        return len(self.count)

    def mean(self, step: int) -> float:
        return float(self.total[step] / self.count[step])

    def length_biased_mean(self, step: int) -> float:
        """E[L^2] / E[L]: the mean length of the request a decode slot holds at a random moment."""
        return float(self.sum_squares[step] / self.total[step])

    def group_fill(self, step: int) -> float:
        """The share of a group's responses still generating, averaged over the group's lifetime: E[sum L] /
        (size x E[longest L]) when its responses start together. A group reserves its admission room until its
        longest finishes, so this is the share of that room that holds running responses (1: groups of one)."""
        if self.group_longest is None or self.group_size == 1:
            return 1.0
        return float(min(1.0, self.total[step] / (self.group_size * self.group_longest[step])))


def _sums(lengths: np.ndarray, group_size: int) -> tuple[Any, Any, Any, Any]:
    """Along the last axis: the sum, the longest, the sum of squares, and the sum of each group's longest."""
    f = np.asarray(lengths, dtype=float)
    return (f.sum(axis=-1), f.max(axis=-1), (f * f).sum(axis=-1),
            f.reshape(*f.shape[:-1], -1, group_size).max(axis=-1).sum(axis=-1))


def draw_batches(model: LengthModel, steps: int, samples_per_step: int, seed: int, group_size: int = 1) -> BatchStats:
    """The lengths of every step of the job, reduced to `BatchStats` (deterministic under `seed`); each step's
    responses form groups of `group_size` consecutive draws."""
    model.validate()
    if steps < 1 or samples_per_step < 1:
        raise ValueError(f"steps {steps} and samples_per_step {samples_per_step} must be >= 1")
    if group_size < 1 or samples_per_step % group_size:
        raise ValueError(f"group_size {group_size}: must be >= 1 and divide samples_per_step {samples_per_step}")
    rng = np.random.default_rng(seed)
    count = np.full(steps, samples_per_step, dtype=np.int64)
    total = np.zeros(steps)
    longest = np.zeros(steps)
    squares = np.zeros(steps)
    group_longest = np.zeros(steps)
    chunk = max(group_size, DRAW_CHUNK // group_size * group_size)
    for k in range(steps):
        mean = model.mean_at((k + 0.5) / steps)
        left = samples_per_step
        while left:
            n = min(left, chunk)
            chunk_total, chunk_longest, chunk_squares, chunk_group_longest = _sums(model.draw(rng, mean, n), group_size)
            total[k] += chunk_total
            longest[k] = max(longest[k], chunk_longest)
            squares[k] += chunk_squares
            group_longest[k] += chunk_group_longest
            left -= n
    return BatchStats(count, total, longest, squares, group_size, group_longest)
