"""Policies that choose the split, the colocated baseline, and the search for the best static split.

- `static`: one split for the whole job.
- `planner_initial`: the split `planner.grp.plan` chooses from the job's declared inputs (it does not know
  the drift), kept for the whole job.
- `elastic`: the planner's initial split, then every `replan_interval_steps` the split is chosen again among
  the static splits of the training layout (Libra's runtime resizes data parallelism only) by the tail-aware
  predictor of `planner.sim.predictor` (the last interval's lengths, long tail included, projected half a
  horizon ahead), with hysteresis `replan_min_gain` and a switch that must pay back within
  `replan_horizon_steps` (or the steps left); a change is carried out by the reconfiguration strategy of
  `SimOptions`. `predictor="replan"` asks `planner.replan.replan` instead (calibrated cost model, mean
  response length only): the predictor the runtime uses today, kept to show what the tail changes.
- `ehp`: the planner's initial split with elastic hybrid parallelism (`planner.sim.engine`).
- `colocated`: every GPU both generates and trains, one after the other (time-shared, synchronous, as
  colocated RL systems run): generation on all GPUs, a switch (rollout weights and the training state moved
  off and back onto the GPUs over the host link, `CostParams.host_link_bytes_per_s`), training on all GPUs,
  an in-place weight update (`CostParams.weight_reload_inplace_s`, no network transfer).

`best_static` simulates every static split (each one a full run on the same lengths) and keeps the best.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np

from planner.grp import plan
from planner.plan import Candidate
from planner.replan import ReplanPolicy, replan, switch_cost_s
from planner.sim.allocation import static_splits
from planner.sim.decode import drain_batch, instance_generation, slots
from planner.sim.engine import Engine, SimJob, SimOptions, SimResult
from planner.sim.predictor import SETTLE_STEPS, outlook, replay_step_s
from planner.workload import PlannerInputs

POLICIES: tuple[str, ...] = ("best_static", "planner_initial", "elastic", "ehp", "colocated")


@dataclass
class StaticPolicy:
    """One split for the whole job."""

    allocation: Candidate
    name: str = "static"
    ehp: bool = False

    def initial(self) -> Candidate:
        return self.allocation

    def decide(self, engine: Engine) -> Candidate | None:
        return None


@dataclass
class ElasticPolicy:
    """Re-planning every `interval` steps with the tail-aware predictor (`predictor="tail"`) or with
    `planner.replan.replan` (`predictor="replan"`)."""

    inputs: PlannerInputs
    start: Candidate
    interval: int
    min_gain: float
    horizon_steps: int
    name: str = "elastic"
    ehp: bool = False
    predictor: Literal["tail", "replan"] = "tail"
    decisions: list[dict[str, Any]] = field(default_factory=list)
    _splits: list[Candidate] = field(default_factory=list)
    _failures_seen: int = 0

    def initial(self) -> Candidate:
        return self.start

    def decide(self, engine: Engine) -> Candidate | None:
        if engine.trained % self.interval:
            return None
        if self.predictor == "replan":
            return self._replan(engine)
        return self._tail(engine)

    def splits(self) -> list[Candidate]:
        """The splits the policy chooses from: every static split of the start layout, and the start."""
        if not self._splits:
            found = static_splits(self.inputs, self.start.layout, tuple(self.inputs.space.allowed_rollout_tp))
            self._splits = sorted(set(found) | {self.start})
        return self._splits

    def _tail(self, engine: Engine) -> Candidate | None:
        job, current = engine.job, engine.alloc
        lo, hi, max_new = max(0, engine.trained - self.interval), engine.trained, job.inputs.workload.max_new_tokens
        lengths = outlook(job.batches, lo, hi, self.horizon_steps / 2.0, max_new)
        now_s = replay_step_s(job, current, current, lengths)
        observed = self._observed(engine, lo, hi)
        if observed is not None:  # what the split measured, grown as the replay grows over the lengths ahead
            since, step_s = observed
            past = replay_step_s(job, current, current,
                                 outlook(job.batches, since, hi, -(hi - since) / 2.0, max_new))
            now_s = min(now_s, step_s * now_s / past)
        strategy = engine.options.reconfigure_strategy
        best, best_s = min(((a, replay_step_s(job, current, a, lengths, strategy)) for a in self.splits()),
                           key=lambda p: p[1])
        gain = now_s / best_s - 1.0 if best_s > 0 else 0.0
        steps = min(self.horizon_steps, engine.steps - engine.trained)
        saved = steps * (now_s - best_s)
        cost = switch_cost_s(job.inputs, current, best)
        if best == current:
            change, reason = False, "the current split is still the best"
        elif gain < self.min_gain:
            change, reason = False, (f"predicted gain {gain:+.1%} is inside the hysteresis band (replan_min_gain "
                                     f"{self.min_gain:.1%})")
        elif saved <= cost:
            change, reason = False, f"saves {saved:.0f} s over {steps} steps, less than the {cost:.0f} s switch"
        else:
            change, reason = True, f"{gain:+.1%} samples/s; saves {saved:.0f} s over {steps} steps for a {cost:.0f} s switch"
        engine.result.decisions.append({
            "step": engine.trained, "time_s": round(engine.now, 1), "change": change, "reason": reason,
            "predicted_gain": round(gain, 4), "predicted_step_s": round(now_s, 2),
            "projected_mean_response_tokens": round(float(lengths.total.sum() / lengths.count.sum()), 1),
            "target": best.label() if change else None})
        return best if change else None

    def _observed(self, engine: Engine, lo: int, hi: int) -> tuple[int, float] | None:
        """(first step, seconds per step) the current split took over the steps since `lo` that followed its
        last reconfiguration by `SETTLE_STEPS`, or None when fewer than 4 such steps (an even number, so a
        two-step rhythm counts whole) ran, or a failure fell in the window (its time is not the split's pace)."""
        failures, self._failures_seen = self._failures_seen, engine.result.failures
        if failures != engine.result.failures or engine.failed_train or engine.failed_rollout:
            return None
        since = max(lo, 1, *(s["step"] + SETTLE_STEPS for s in engine.result.switches))
        since += (hi - since) % 2
        if hi - since < 4:
            return None
        return since, float(engine.step_end[hi - 1] - engine.step_end[since - 1]) / (hi - since)

    def _replan(self, engine: Engine) -> Candidate | None:
        obs = engine.observation(self.interval)
        policy = ReplanPolicy(min_gain=self.min_gain, horizon_steps=self.horizon_steps,
                              allow_train_layout_change=False)
        decision = replan(self.inputs, engine.alloc, obs, policy)
        target = decision.target.candidate if decision.change else None
        engine.result.decisions.append({
            "step": engine.trained, "time_s": round(engine.now, 1), "change": decision.change,
            "reason": decision.reason, "predicted_gain": round(decision.predicted_gain, 4),
            "mean_response_tokens": round(obs.mean_response_tokens, 1),
            "target": target.label() if target else None})
        return target


def planner_allocation(inputs: PlannerInputs) -> Candidate:
    """The split the planner chooses for the job as declared (grp search)."""
    searched = replace(inputs, space=replace(inputs.space, strategy="grp", pinned=None))
    result = plan(searched)
    if result.chosen is None:
        problems = "; ".join(result.suggestions[:3]) or "no feasible split"
        raise ValueError(f"the planner finds no feasible split for {inputs.cluster.total_gpus} GPUs: {problems}")
    return result.chosen.candidate


def run_policy(job: SimJob, policy: Any, options: SimOptions) -> SimResult:
    return Engine(job, policy, options).run()


def best_static(job: SimJob, start: Candidate, options: SimOptions,
                rollout_tps: Sequence[int] | None = None) -> tuple[SimResult, list[SimResult]]:
    """Simulate every static split of `start`'s training layout (and each rollout TP in `rollout_tps`,
    default the planner's allowed ones) and return the best run and all of them."""
    tps = tuple(rollout_tps) if rollout_tps else tuple(job.inputs.space.allowed_rollout_tp)
    splits = static_splits(job.inputs, start.layout, tps)
    if not splits:
        raise ValueError(f"no static split admits layout {start.layout.label()} on {job.total_gpus} GPUs")
    runs = [run_policy(job, StaticPolicy(a, name="static"), options) for a in splits]
    best = max(runs, key=lambda r: r.samples_per_s)
    return replace(best, policy="best_static"), runs


def colocate_switch_s(inputs: PlannerInputs, allocation: Candidate) -> float:
    """Seconds per step to move the rollout weights and the training state off and back onto every GPU."""
    spec, opts = inputs.model, inputs.train
    rollout_bytes = spec.total_params * inputs.rollout.weight_dtype_bytes / allocation.rollout_tp
    per_param = opts.params_dtype_bytes + opts.main_grad_bytes + opts.optimizer_bytes_per_param
    train_bytes = spec.total_params * per_param / max(1, allocation.train_gpus)
    return 2.0 * (rollout_bytes + train_bytes) / inputs.cost.host_link_bytes_per_s


def colocated(job: SimJob, start: Candidate, options: SimOptions) -> SimResult:
    """Every GPU generates, then trains (time-shared, synchronous). Node failures are not simulated here."""
    total, layout, tp = job.total_gpus, start.layout, start.rollout_tp
    dp = total // layout.model_parallel
    whole = Candidate(dp * layout.model_parallel, total, layout, tp)
    b, c, inputs = job.batches, job.costs, job.inputs
    instances = total // tp
    switch = colocate_switch_s(inputs, whole)
    now, busy, tokens = 0.0, 0.0, 0.0
    ends = []
    for k in range(options.steps):
        requests = math.ceil(int(b.count[k]) / instances)
        lbm = b.length_biased_mean(k)
        slot_count = slots(c.max_seqs, c.kv_tokens(tp), c.prompt_tokens, lbm, requests)
        full = c.decode_step(tp, lbm, slot_count)
        per_instance = float(b.total[k]) / instances
        drain = c.decode_step(tp, lbm, drain_batch(requests, per_instance, float(b.longest[k]), lbm, slot_count))
        run = instance_generation(requests, per_instance, float(b.longest[k]), lbm, slot_count, full, drain)
        prefill = c.prefill_s(tp, instances)
        train = c.train_side_s(layout, dp, b.mean(k))
        now += prefill + run.bulk_s + run.drain_s + switch + train + inputs.cost.weight_reload_inplace_s
        busy += (prefill + float(b.total[k]) / instances / slot_count * full) * instances * tp
        busy += train * dp * layout.model_parallel
        tokens += float(b.total[k])
        ends.append(now)
    result = SimResult("colocated", f"all {total} GPUs time-shared ({layout.label()} dp={dp} | "
                                    f"{instances} x tp={tp})", options.steps, now,
                       int(b.count[: options.steps].sum()), tokens, max(0.0, 1.0 - busy / (total * now)))
    result.splits = [(0.0, total, total)]
    result.step_end_s = np.asarray(ends)
    return result
