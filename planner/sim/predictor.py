"""The simulated elastic policy's step-time predictor: what a split would take per step for the response
lengths the job is heading to, long tail included.

`planner.replan` predicts a split's throughput from the mean response length alone (tokens / rate), so to it a
rollout phase lasts as long as its mean response. It does not: a synchronous batch completes with its longest
response, continuous batching leaves an instance's slots idle as the batch drains (`planner.sim.decode`), and
under bounded staleness the reload pauses and the weight-version waits set a pace of their own. The tail's
share of a step changes as lengths drift (a log-normal tail is clipped at `max_new_tokens` once the mean
grows), so the split that balances the two pools moves in a way the mean does not show.

This predictor runs the engine itself on projected lengths, from where the job stands: `outlook` keeps the
lengths of the steps trained so far and continues the last window's mean along its linear trend from there,
with the window's tail ratios (E[L^2]/E[L], longest over mean, clipped at `max_new_tokens`, and the groups'
longest responses over all responses); `fork_step_s` forks the live engine (`Engine.fork`: the batches
draining, the reload in progress, the instances starting), switches the fork to the candidate with the
configured strategy, lets it settle for `SETTLE_STEPS` steps and times `MEASURED_STEPS` steps of it (the
switch's own pause is priced by the policy, not here). Starting from the job's own pipeline matters: where it
stands when a switch comes (which batch is draining when a reload pauses the pool, which weights the next
batch waits for) shapes the steps after it, and a replay from an empty pipeline does not see that. The
current split is forked the same way, with no switch, so both sides of a decision are the same kind of
prediction.

It uses the simulator's own cost model, so it is the predictor of a planner that knows its costs and observes
only the lengths of the steps trained: what it gains bounds what a calibrated tail-aware planner could reach in
this model.
"""

from __future__ import annotations

import math

import numpy as np

from planner.plan import Candidate
from planner.sim.engine import Engine
from planner.sim.lengths import BatchStats

SETTLE_STEPS = 4  # steps after the switch before timing starts (the new pools re-fill the pipeline)
MEASURED_STEPS = 24  # steps timed: about half the horizon a switch is paid back over (50 steps), long enough to
                     # average over the stalls a switch leaves, and a multiple of 2, 3 and 4 so that a pattern of
                     # that many steps counts whole
MIN_MEASURED_STEPS = 4  # fewer steps left to time: no prediction


def outlook(batches: BatchStats, lo: int, hi: int, max_new_tokens: int) -> BatchStats:
    """The job's lengths with the steps from `hi` on projected from the window [lo, hi): the window's mean
    continued along its linear trend, with the window's tail ratios (E[L^2]/E[L] and the longest response
    over the mean, both clipped at `max_new_tokens`, and the sum of the groups' longest responses over the
    sum of all); the steps before `hi` keep their own."""
    if not 0 <= lo < hi <= batches.steps:
        raise ValueError(f"window [{lo}, {hi}): must be a non-empty range of the job's {batches.steps} steps")
    count = batches.count[lo:hi]
    means = batches.total[lo:hi] / count
    trend = float(np.polyfit(np.arange(hi - lo), means, 1)[0]) if hi - lo >= 3 else 0.0
    biased_ratio = float(np.mean(batches.sum_squares[lo:hi] / batches.total[lo:hi] / means))
    longest_ratio = float(np.mean(batches.longest[lo:hi] / means))
    cap = float(max_new_tokens)
    ahead = np.arange(hi, batches.steps)
    mean = np.clip(float(means.mean()) + trend * (ahead - (lo + hi - 1) / 2.0), 1.0, cap)
    projected_count = np.full(len(ahead), int(count[-1]), dtype=np.int64)
    total = projected_count * mean
    biased = np.clip(mean * biased_ratio, mean, cap)
    group_longest = None
    if batches.group_longest is not None:
        ratio = float(np.mean(batches.group_longest[lo:hi] / batches.total[lo:hi]))
        group_longest = np.concatenate([batches.group_longest[:hi], total * ratio])
    return BatchStats(np.concatenate([batches.count[:hi], projected_count]),
                      np.concatenate([batches.total[:hi], total]),
                      np.concatenate([batches.longest[:hi], np.clip(mean * longest_ratio, mean, cap)]),
                      np.concatenate([batches.sum_squares[:hi], total * biased]), batches.group_size, group_longest)


def fork_step_s(engine: Engine, candidate: Candidate, lengths: BatchStats) -> float | None:
    """Seconds per step of `candidate` from where `engine` stands, on `lengths` (an `outlook`), timed over
    `MEASURED_STEPS` steps once the new pools have settled (`candidate == engine.alloc`: no switch); None when
    fewer than `MIN_MEASURED_STEPS` steps of the job are left to time."""
    if candidate.rollout_instances < 1 or candidate.dp < 1:
        return math.inf
    first = engine.trained + SETTLE_STEPS
    last = min(engine.steps - 1, first + MEASURED_STEPS)  # the last batch drains with none behind it: untimed
    if last - first < MIN_MEASURED_STEPS:
        return None
    fork = engine.fork(lengths, last + 1)
    if candidate != engine.alloc:
        fork.reconfigure(candidate)
    fork.run()
    return float(fork.step_end[last - 1] - fork.step_end[first - 1]) / (last - first)
