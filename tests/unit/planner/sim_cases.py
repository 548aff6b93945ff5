"""Jobs for the simulator tests: a small real job (planner inputs of a repository model), a job whose phase
times are fixed numbers, so a run can be computed by hand, and measured runs made by the simulator itself
(for the calibration fit)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from planner_cases import inputs

from planner.layout import TrainLayout
from planner.plan import Candidate
from planner.sim.calibration import MeasuredRun
from planner.sim.costs import MeasuredCosts, PhaseCosts
from planner.sim.engine import Engine, SimJob
from planner.sim.fit import Replayer, SliceCap
from planner.sim.lengths import BatchStats, LengthModel
from planner.sim.scenario import build_job
from planner.workload import CostParams, PlannerInputs


@dataclass
class FixedCosts(PhaseCosts):
    """Phase times that are plain numbers: decode step, training seconds x (reference DP / DP), reload."""

    step_s: float = 0.01
    train_s_at_dp1: float = 2.0
    reload: float = 1.0
    slots_cap: int = 1 << 20

    @property
    def max_seqs(self) -> int:
        return self.slots_cap

    def kv_tokens(self, rollout_tp: int) -> int:
        return 1 << 40

    def decode_step(self, rollout_tp: int, length_biased_mean: float, batch: float) -> float:
        return self.step_s

    def prefill_s(self, rollout_tp: int, instances: int) -> float:
        return 0.0

    def train_side_s(self, layout: TrainLayout, dp: int, mean_response: float) -> float:
        return self.train_s_at_dp1 / dp

    def reload_s(self, rollout_tp: int) -> float:
        return self.reload


def constant_batches(steps: int, samples: int, length: int) -> BatchStats:
    """Every response exactly `length` tokens."""
    count = np.full(steps, samples, dtype=np.int64)
    return BatchStats(count, count * float(length), np.full(steps, float(length)), count * float(length) ** 2)


def fixed_job(steps: int = 2, samples: int = 8, length: int = 100, offpolicy: int = 0,
              cost: CostParams | None = None, **fixed: float) -> SimJob:
    """8 GPUs of one node; phase times from `FixedCosts`."""
    base = inputs("qwen2.5-7b", nodes=1, batch_size=samples // 8 or 1, n_samples=8, max_head_offpolicyness=offpolicy)
    if cost is not None:
        base = replace(base, cost=cost)
    return SimJob(base, constant_batches(steps, samples, length), FixedCosts(base, **fixed))  # type: ignore[arg-type]


def real_inputs(nodes: int = 4, lag: int = 1) -> PlannerInputs:
    """Qwen2.5-7B on `nodes` x 8 H100, `lag` steps of policy lag (1: asynchronous; 0: synchronous), in-place
    reload."""
    base = inputs("qwen2.5-7b", nodes=nodes, batch_size=96, n_samples=8, max_model_len=8192, max_new_tokens=4096,
                  max_head_offpolicyness=lag, allocation_granularity_gpus=8)
    return replace(base, rollout=replace(base.rollout, reload_method="inplace"))


def real_job(steps: int = 30, start: float = 400, end: float = 3000, drift: bool = True, seed: int = 0,
             nodes: int = 4, lag: int = 1) -> SimJob:
    base = real_inputs(nodes, lag)
    lengths = LengthModel(start, end, base.workload.max_new_tokens, drift=drift)
    return build_job(base, lengths, steps, seed)


def split(job: SimJob, train: int, tp: int = 1, pp: int = 1, rollout_tp: int = 1) -> Candidate:
    return Candidate(train, job.total_gpus - train, TrainLayout(tp=tp, pp=pp), rollout_tp)


@dataclass
class Scripted:
    """A policy that runs `first` and moves to `changes[k]` once step k has trained."""

    first: Candidate
    changes: dict[int, Candidate]
    name: str = "scripted"
    ehp: bool = False

    def initial(self) -> Candidate:
        return self.first

    def decide(self, engine: Engine) -> Candidate | None:
        return self.changes.get(engine.trained)


SYNTHETIC_SPLITS = ((1, 7), (2, 6), (3, 5), (4, 4), (6, 2))


def sync_job(steps: int = 12, seed: int = 0) -> SimJob:
    """A synchronous job on 8 GPUs of one node with drifting, long-tailed lengths (batches of 24 x 8)."""
    base = inputs("qwen2.5-7b", nodes=1, batch_size=24, n_samples=8, max_model_len=4096, max_new_tokens=1024,
                  max_head_offpolicyness=0)
    return build_job(base, LengthModel(40, 600, base.workload.max_new_tokens, sigma=0.6), steps, seed)


def synthetic_run(result_wall_s: float, rollout_s: float, train_s: float, samples: int, steps: int,
                  split: tuple[int, int], policy: str = "static") -> MeasuredRun:
    """A measured run with the totals a simulated run produced."""
    return MeasuredRun(policy, split[0], split[1], result_wall_s / steps, samples / result_wall_s, steps,
                       f"{policy} {split[0]}+{split[1]}", rollout_s, train_s)


def runs_made_by_the_simulator(job: SimJob, costs: MeasuredCosts,
                               splits: tuple[tuple[int, int], ...] = SYNTHETIC_SPLITS,
                               slice_cap: SliceCap | None = None) -> list[MeasuredRun]:
    """'Measured' runs of every split of `splits`: the simulator's own replays with `costs` (on metered slices
    that the host caps at `slice_cap`, when given)."""
    replayer = Replayer(job, slice_cap=slice_cap)
    out = []
    for train, rollout in splits:
        probe = MeasuredRun("static", train, rollout, 1.0, 1.0, job.batches.steps)
        result = replayer.replay(probe, costs)
        out.append(synthetic_run(result.wall_s, float(result.rollout_s.sum()), float(result.train_s.sum()),
                                 result.samples, result.steps, (train, rollout)))
    return out
