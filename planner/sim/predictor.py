"""The simulated elastic policy's step-time predictor: what a split would take per step for the response
lengths the job is heading to, long tail included.

`planner.replan` predicts a split's throughput from the mean response length alone (tokens / rate), so to it a
rollout phase lasts as long as its mean response. It does not: a synchronous batch completes with its longest
response, continuous batching leaves an instance's slots idle as the batch drains (`planner.sim.decode`), and
under bounded staleness the reload pauses and the weight-version waits set a rhythm of their own. The tail's
share of a step changes as lengths drift (a log-normal tail is clipped at `max_new_tokens` once the mean
grows), so the split that balances the two pools moves in a way the mean does not show.

This predictor replays the engine itself on projected lengths: `outlook` continues the last window's mean
along its linear trend and keeps the window's tail ratios (E[L^2]/E[L], longest over mean, clipped at
`max_new_tokens`, and the groups' longest responses over all responses); `replay_step_s` runs the current
split for `WARM_STEPS` steps, switches to the candidate with the configured switch costs, lets it settle for
`SETTLE_STEPS` steps, and times `MEASURED_STEPS` steps of it (the switch's own pause is priced by the policy,
not here). Replaying the switch matters: a switch stops pools (a re-formed training pool, restarted
instances) and the pipeline of a few steps of policy lag refills after it. The policy measures the current split's own pace and uses the replay only to grow it with the
lengths ahead (`planner.sim.policies.ElasticPolicy`). The replay starts from an empty pipeline, not from the
job's: where the pipeline stands when the real switch comes (which batch is draining when a reload pauses the
pool) shapes the steps after it, and the replay does not see that (cluster_manual/simulator.md).

It uses the simulator's own cost model, so it is the predictor of a planner that knows its costs and observes
only the lengths: what it gains bounds what a calibrated tail-aware planner could reach in this model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from planner.plan import Candidate
from planner.sim.engine import Engine, ReconfigureStrategy, SimJob, SimOptions
from planner.sim.lengths import BatchStats

WARM_STEPS = 8  # steps the current split runs before the switch: the pipeline of a few steps of lag fills
SETTLE_STEPS = 4  # steps after the switch before timing starts (the new pools re-fill the pipeline)
MEASURED_STEPS = 12  # steps timed: a multiple of 2, 3 and 4, so a rhythm of that many steps counts whole
REPLAY_STEPS = WARM_STEPS + SETTLE_STEPS + MEASURED_STEPS + 1  # the last batch drains with none behind it: untimed


@dataclass
class _SwitchAfterWarmUp:
    """`current` for `WARM_STEPS` steps, then `candidate`."""

    current: Candidate
    candidate: Candidate
    name: str = "replay"
    ehp: bool = False

    def initial(self) -> Candidate:
        return self.current

    def decide(self, engine: Engine) -> Candidate | None:
        return self.candidate if engine.trained == WARM_STEPS else None


def outlook(batches: BatchStats, lo: int, hi: int, ahead: float, max_new_tokens: int) -> BatchStats:
    """The lengths of a replay whose measured steps are centred `ahead` steps past the window [lo, hi): the
    window's mean continued along its linear trend, with the window's tail ratios (E[L^2]/E[L] and the
    longest response over the mean, both clipped at `max_new_tokens`, and the sum of the groups' longest
    responses over the sum of all)."""
    if not 0 <= lo < hi <= batches.steps:
        raise ValueError(f"window [{lo}, {hi}): must be a non-empty range of the job's {batches.steps} steps")
    count = batches.count[lo:hi]
    means = batches.total[lo:hi] / count
    trend = float(np.polyfit(np.arange(hi - lo), means, 1)[0]) if hi - lo >= 3 else 0.0
    biased_ratio = float(np.mean(batches.sum_squares[lo:hi] / batches.total[lo:hi] / means))
    longest_ratio = float(np.mean(batches.longest[lo:hi] / means))
    centre = WARM_STEPS + SETTLE_STEPS + MEASURED_STEPS / 2.0  # the middle of the measured span, in replay steps
    offsets = (hi - 1 - (lo + hi - 1) / 2.0) + ahead + (np.arange(REPLAY_STEPS) + 0.5 - centre)
    cap = float(max_new_tokens)
    mean = np.clip(float(means.mean()) + trend * offsets, 1.0, cap)
    replay_count = np.full(REPLAY_STEPS, int(count[-1]), dtype=np.int64)
    total = replay_count * mean
    biased = np.clip(mean * biased_ratio, mean, cap)
    group_longest = None
    if batches.group_longest is not None:
        group_longest = total * float(np.mean(batches.group_longest[lo:hi] / batches.total[lo:hi]))
    return BatchStats(replay_count, total, np.clip(mean * longest_ratio, mean, cap), total * biased,
                      batches.group_size, group_longest)


def replay_step_s(job: SimJob, current: Candidate, candidate: Candidate, lengths: BatchStats,
                  strategy: ReconfigureStrategy = "diff") -> float:
    """Seconds per step of `candidate` on `lengths` (an `outlook`) when the job moves to it from `current` by
    `strategy`, timed over `MEASURED_STEPS` steps once the new pools have settled (`current == candidate`: no
    switch)."""
    if candidate.rollout_instances < 1 or candidate.dp < 1:
        return math.inf
    if lengths.steps != REPLAY_STEPS:
        raise ValueError(f"lengths: {lengths.steps} steps: a replay runs {REPLAY_STEPS} (use outlook())")
    replayed = SimJob(job.inputs, lengths, job.costs)
    ends = Engine(replayed, _SwitchAfterWarmUp(current, candidate),
                  SimOptions(steps=REPLAY_STEPS, reconfigure_strategy=strategy)).run().step_end_s
    first = WARM_STEPS + SETTLE_STEPS
    return float(ends[first + MEASURED_STEPS - 1] - ends[first - 1]) / MEASURED_STEPS
