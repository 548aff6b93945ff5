"""The engine's per-batch aggregate against the per-request reference of `planner.sim.exact`, on jobs of one
rollout pool: `PipelineCase` runs one job both ways and returns their seconds per step, for the tests
(tests/unit/planner/test_sim_exact.py) and the benchmark (benchmarks/sim_fidelity.py).

A case: the given model on one node of 8 H100 (`instances` rollout instances at TP 1, the other GPUs
training, in-place reload), a step of `groups` prompt groups of `group_size` responses drawn from a drifting
log-normal (`LengthModel`), phase times of the measured form (`MeasuredCosts`: a decode step of n sequences
costs `decode_fixed_s + decode_per_seq_s x n`, a training step `train_s`, a weight sync pauses every instance
for `sync_s`). The engine gets the lengths' sufficient statistics, the reference every length. Step seconds are
timed from the first quarter of the run to its last step but one (the last batch drains with nothing behind
it, the same in both, and would weigh on a short run's average).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from planner.hardware import get_gpu
from planner.layout import TrainLayout
from planner.model_spec import ModelSpec
from planner.plan import Candidate
from planner.sim.costs import MeasuredCosts, PhaseCosts
from planner.sim.engine import Engine, SimJob, SimOptions
from planner.sim.exact import exact_pipeline_run
from planner.sim.lengths import BatchStats, LengthModel
from planner.sim.policies import StaticPolicy
from planner.workload import ClusterSpec, PlannerInputs, SearchSpace, Workload

NODE_GPUS = 8


@dataclass(frozen=True)
class PipelineCase:
    """One job on one rollout instance, run by the engine and by the per-request reference."""

    lag: int
    groups: int
    group_size: int
    start_mean: float
    end_mean: float
    train_s: float
    sync_s: float
    sigma: float = 0.8
    decode_fixed_s: float = 0.02
    decode_per_seq_s: float = 0.0002
    steps: int = 30
    seed: int = 0
    max_new_tokens: int = 2048
    max_model_len: int = 4096
    instances: int = 1

    def inputs(self, model: ModelSpec) -> PlannerInputs:
        workload = Workload(batch_size=self.groups, n_samples=self.group_size, max_model_len=self.max_model_len,
                            max_new_tokens=self.max_new_tokens, max_head_offpolicyness=self.lag)
        base = PlannerInputs(model=model, cluster=ClusterSpec(1, NODE_GPUS, get_gpu("H100")), workload=workload,
                             space=SearchSpace(allowed_ep=(1,)))
        return replace(base, rollout=replace(base.rollout, reload_method="inplace"))

    def lengths(self) -> np.ndarray:
        """Every response's length: one row per step, groups of `group_size` consecutive entries."""
        model = LengthModel(self.start_mean, self.end_mean, self.max_new_tokens, sigma=self.sigma)
        rng = np.random.default_rng(self.seed)
        per_step = self.groups * self.group_size
        return np.array([model.draw(rng, model.mean_at((k + 0.5) / self.steps), per_step)
                         for k in range(self.steps)], dtype=np.int64)

    def step_seconds(self, model: ModelSpec) -> tuple[float, float]:
        """(engine, reference) seconds per step."""
        inputs = self.inputs(model)
        lengths = self.lengths()
        stats = BatchStats.of_lengths(lengths, self.group_size)
        measured = MeasuredCosts(self.decode_fixed_s, self.decode_per_seq_s, self.train_s, 0.0, self.sync_s)
        job = SimJob(inputs, stats, PhaseCosts(inputs, measured=measured))
        split = Candidate(NODE_GPUS - self.instances, self.instances, TrainLayout(), 1)
        engine = Engine(job, StaticPolicy(split), SimOptions(steps=self.steps)).run().step_end_s
        reference = exact_pipeline_run(list(lengths), self.group_size, self.lag, job.costs.max_seqs,
                                       inputs.workload.rollouts_in_flight,
                                       lambda n: self.decode_fixed_s + self.decode_per_seq_s * n,
                                       self.train_s, self.sync_s, self.instances)
        lo, hi = self.steps // 4, self.steps - 2
        return (float(engine[hi] - engine[lo]) / (hi - lo), float(reference[hi] - reference[lo]) / (hi - lo))

    def label(self) -> str:
        pool = f"{self.instances} instances, " if self.instances > 1 else ""
        return (f"{pool}lag {self.lag}, {self.groups} x {self.group_size}, mean {self.start_mean:g}->{self.end_mean:g} "
                f"sigma {self.sigma:g}, train {self.train_s:g} s, sync {self.sync_s:g} s, decode "
                f"{self.decode_fixed_s:g} + {self.decode_per_seq_s:g} n s, seed {self.seed}")
