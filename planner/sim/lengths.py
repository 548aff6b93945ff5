"""Response lengths of a drifting GRPO workload: seeded, long-tailed, with a mean that grows over the job.

Each step's responses are drawn from a log-normal distribution (a long right tail, as response lengths of
reasoning models show) truncated at `max_new_tokens`, whose mean moves from `start_mean` to `end_mean` along
a logistic curve centred at `midpoint` (fraction of the job) with width `width`. Response length growing
during RL training is reported for reasoning models (DeepSeek-R1, arXiv:2501.12948, Fig. 3: the average
response length grows steadily during RL; DAPO, arXiv:2503.14476, Fig. 7); the numbers of a case are a
chosen workload, not a measurement.

Only per-step sufficient statistics are kept (`BatchStats`): count, sum, maximum and sum of squares of the
lengths. The simulator needs nothing else (see `planner.sim.decode`), which keeps 10,000 GPUs x 1,000 steps
cheap. The same seed gives the same lengths for every policy (common random numbers), so policies are
compared on the same draws.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

DRAW_CHUNK = 1 << 20  # lengths drawn at once, bounding memory for very large steps


@dataclass(frozen=True)
class LengthModel:
    """Response-length distribution over the job. `sigma` is the log-normal shape (0.8 gives a p99 about
    4.8x the median); `drift=False` keeps the mean at `start_mean`."""

    start_mean: float
    end_mean: float
    max_new_tokens: int
    sigma: float = 0.8
    midpoint: float = 0.5
    width: float = 0.12
    drift: bool = True

    def validate(self) -> None:
        problems = []
        for name in ("start_mean", "end_mean"):
            value = getattr(self, name)
            if not 1 <= value <= self.max_new_tokens:
                problems.append(f"{name}: {value}: must be within [1, max_new_tokens={self.max_new_tokens}]")
        if self.sigma < 0:
            problems.append(f"sigma: {self.sigma}: must be >= 0")
        if self.width <= 0:
            problems.append(f"width: {self.width}: must be > 0")
        if problems:
            raise ValueError("; ".join(problems))

    def mean_at(self, fraction: float) -> float:
        """Target mean length (before truncation) at `fraction` of the job."""
        if not self.drift:
            return self.start_mean
        lo = 1.0 / (1.0 + math.exp(self.midpoint / self.width))
        hi = 1.0 / (1.0 + math.exp(-(1.0 - self.midpoint) / self.width))
        s = 1.0 / (1.0 + math.exp(-(fraction - self.midpoint) / self.width))
        return self.start_mean + (self.end_mean - self.start_mean) * (s - lo) / (hi - lo)

    def draw(self, rng: np.random.Generator, mean: float, n: int) -> np.ndarray:
        """`n` lengths (whole tokens, >= 1, <= max_new_tokens) of a log-normal with mean `mean`."""
        mu = math.log(mean) - self.sigma**2 / 2.0
        raw = rng.lognormal(mu, self.sigma, n) if self.sigma > 0 else np.full(n, mean)
        return np.clip(np.rint(raw), 1, self.max_new_tokens)


@dataclass(frozen=True)
class BatchStats:
    """Per-step sufficient statistics of the response lengths (arrays of length `steps`)."""

    count: np.ndarray
    total: np.ndarray
    longest: np.ndarray
    sum_squares: np.ndarray

    @property
    def steps(self) -> int:
        return len(self.count)

    def mean(self, step: int) -> float:
        return float(self.total[step] / self.count[step])

    def length_biased_mean(self, step: int) -> float:
        """E[L^2] / E[L]: the mean length of the request a decode slot holds at a random moment."""
        return float(self.sum_squares[step] / self.total[step])


def draw_batches(model: LengthModel, steps: int, samples_per_step: int, seed: int) -> BatchStats:
    """The lengths of every step of the job, reduced to `BatchStats` (deterministic under `seed`)."""
    model.validate()
    if steps < 1 or samples_per_step < 1:
        raise ValueError(f"steps {steps} and samples_per_step {samples_per_step} must be >= 1")
    rng = np.random.default_rng(seed)
    count = np.full(steps, samples_per_step, dtype=np.int64)
    total = np.zeros(steps)
    longest = np.zeros(steps)
    squares = np.zeros(steps)
    for k in range(steps):
        mean = model.mean_at((k + 0.5) / steps)
        left = samples_per_step
        while left:
            n = min(left, DRAW_CHUNK)
            lengths = model.draw(rng, mean, n)
            total[k] += lengths.sum()
            longest[k] = max(longest[k], lengths.max())
            squares[k] += np.dot(lengths, lengths)
            left -= n
    return BatchStats(count, total, longest, squares)
