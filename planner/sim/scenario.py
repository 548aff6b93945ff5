"""A case of the simulator: a job's planner inputs scaled to a cluster size, a drifting workload, and the
comparison of every policy on the same drawn lengths.

Scaling: a case at G GPUs keeps the example's node size, GPU type, model and per-GPU batch (samples per step
per GPU), so a larger cluster runs a proportionally larger batch (weak scaling, as large RL jobs grow their
batch with the cluster); the batch size (prompt groups) is rounded to the nearest 2^a x 3^b with a >= 3 and
b >= 1, so that the data-parallel sizes the planner's batch-divisibility rule admits are not only powers of two
(with a power-of-two batch the splits would move in steps of 2x). This is a choice of the case.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from planner.plan import Candidate
from planner.sim.costs import PhaseCosts, ReloadMethod, ReloadStrategy
from planner.sim.engine import SimJob, SimOptions, SimResult
from planner.sim.lengths import LengthModel, draw_batches
from planner.sim.policies import (
    ALL_POLICIES,
    ONLINE_REPLANNING,
    POLICIES,
    ElasticPolicy,
    StaticPolicy,
    best_static,
    colocated,
    planner_allocation,
    run_policy,
)
from planner.workload import PlannerInputs


def nearest_smooth(value: float) -> int:
    """The 2^a x 3^b (a >= 3, b >= 1) nearest to `value` (ties: the smaller)."""
    best = 24
    power3 = 3
    while power3 <= 2 * value:
        n = power3 * 8
        while n <= 2 * value:
            if abs(n - value) < abs(best - value) or (abs(n - value) == abs(best - value) and n < best):
                best = n
            n *= 2
        power3 *= 3
    return best


def scaled_inputs(inputs: PlannerInputs, gpus: int) -> PlannerInputs:
    """`inputs` on `gpus` GPUs (whole nodes) with the same samples per step per GPU; pinned splits dropped."""
    gpn = inputs.cluster.gpus_per_node
    if gpus < 2 * gpn or gpus % gpn:
        raise ValueError(f"gpus: {gpus}: must be a multiple of the node size {gpn} and at least two nodes")
    w = inputs.workload
    per_gpu = w.batch_size / inputs.cluster.total_gpus
    batch = nearest_smooth(max(1.0, per_gpu * gpus))
    space = replace(inputs.space, strategy="grp", pinned=None)
    return replace(inputs.with_cluster(gpus // gpn), workload=replace(w, batch_size=batch), space=space)


def build_job(inputs: PlannerInputs, lengths: LengthModel, steps: int, seed: int,
              reload_method: ReloadMethod | None = None, reload_strategy: ReloadStrategy = "parallel") -> SimJob:
    """The job with its lengths drawn for `steps` steps."""
    if reload_method is not None:
        inputs = replace(inputs, rollout=replace(inputs.rollout, reload_method=reload_method))
    inputs.validate()
    batches = draw_batches(lengths, steps, inputs.workload.samples_per_step, seed, inputs.workload.n_samples)
    return SimJob(inputs, batches, PhaseCosts(inputs, reload_strategy))


@dataclass
class Comparison:
    """Every policy's run on one job, and what each took to simulate."""

    job: SimJob
    start: Candidate
    results: dict[str, SimResult] = field(default_factory=dict)
    statics: list[SimResult] = field(default_factory=list)
    sim_s: dict[str, float] = field(default_factory=dict)

    def gain(self, policy: str = "elastic", over: str = "best_static") -> float | None:
        if policy not in self.results or over not in self.results:
            return None
        return self.results[policy].samples_per_s / self.results[over].samples_per_s

    def phase_oracle(self, phases: int = 5) -> dict[str, Any]:
        """The most a policy that follows the drift could gain: the job cut into `phases` equal runs of steps,
        each phase run at the pace of the static split that was fastest in it, with free switches (each
        static run's own pace in the phase; bounds any elastic policy with the same splits)."""
        if not self.statics:
            return {}
        steps = len(self.statics[0].step_end_s)
        bounds = np.linspace(0, steps, phases + 1).astype(int)
        best_total, picks = 0.0, []
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            def span(r: SimResult, lo: int = int(lo), hi: int = int(hi)) -> float:
                return float(r.step_end_s[hi - 1] - (r.step_end_s[lo - 1] if lo else 0.0))
            fastest = min(self.statics, key=span)
            best_total += span(fastest)
            picks.append({"steps": [int(lo), int(hi)], "split": fastest.initial, "seconds": round(span(fastest), 1)})
        best_static = self.results["best_static"].wall_s if "best_static" in self.results else best_total
        return {"gain_over_best_static": round(best_static / best_total, 4), "phases": picks}

    def rows(self) -> list[dict[str, Any]]:
        return [{**r.summary(), "sim_s": round(self.sim_s.get(name, 0.0), 3)} for name, r in self.results.items()]


def compare(job: SimJob, options: SimOptions, policies: Sequence[str] = POLICIES) -> Comparison:
    """Run each of `policies` on `job` (same lengths, same seed). A job that lends (`PlannerInputs.ehp`: Libra
    runs a synchronous job with elastic hybrid parallelism on, and plans its split for it) lends in the policies
    that stand for Libra's runtime too (`planner_initial`, `elastic`, `online_replanning`), as it would run;
    the best static split stays the baseline without any elasticity."""
    unknown = [p for p in policies if p not in ALL_POLICIES]
    if unknown:
        raise ValueError(f"policy: {', '.join(unknown)}: choose from {', '.join(ALL_POLICIES)}")
    start = planner_allocation(job.inputs)
    lends = job.inputs.ehp is not None
    out = Comparison(job, start)
    for name in policies:
        began = time.process_time()
        if name == "best_static":
            out.results[name], out.statics = best_static(job, start, options)
        elif name == "planner_initial":
            out.results[name] = run_policy(job, StaticPolicy(start, name="planner_initial", ehp=lends), options)
        elif name == "ehp":
            out.results[name] = run_policy(job, StaticPolicy(start, name="ehp", ehp=True), options)
        elif name in ("elastic", "elastic_ehp", ONLINE_REPLANNING):
            policy = ElasticPolicy(job.inputs, start, options.replan_interval_steps, options.replan_min_gain,
                                   options.replan_horizon_steps, name=name, ehp=lends or name == "elastic_ehp",
                                   predictor="replan" if name == ONLINE_REPLANNING else "tail")
            out.results[name] = run_policy(job, policy, options)
        else:
            out.results[name] = colocated(job, start, options)
        out.sim_s[name] = time.process_time() - began
    return out
