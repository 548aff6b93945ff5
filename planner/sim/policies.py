"""Policies that choose the split, the colocated baseline, and the search for the best static split.

- `static`: one split for the whole job.
- `planner_initial`: the split `planner.grp.plan` chooses from the job's declared inputs (it does not know
  the drift), kept for the whole job.
- `elastic`: the planner's initial split, then every `replan_interval_steps` the split is chosen again among
  the static splits of the training layout (Libra's runtime resizes data parallelism and the rollout pool, not
  the training layout) by the tail-aware predictor of `planner.sim.predictor` (the last interval's lengths,
  long tail included, projected along their trend; each split run on them from where the job's pipeline
  stands), with hysteresis `replan_min_gain` and a switch that must pay back within `replan_horizon_steps` (or
  the steps left); a change is carried out by the reconfiguration strategy of `SimOptions`.
  `predictor="replan"` replays the runtime's re-planner instead: `planner.replan_review.OnlineReplanning` (its
  review of the last change, then `planner.replan.replan`: calibrated cost model, mean response length only)
  with the running job's policy (`ReplanPolicy.of_running_job`) on what the runtime measures
  (`Engine.observation` of the steps begun after the last switch was done), to show what the tail changes.
- `online_replanning`: the planner's initial split, re-planned as Libra's runtime does it (`elastic` with
  `predictor="replan"`); `libra simulate` runs it, the default comparison of `POLICIES` does not (the
  simulator benchmark runs it beside as `elastic:replan_predictor`).
- `ehp`: the planner's initial split with elastic hybrid parallelism (`planner.sim.engine`).
- `elastic_ehp`: `elastic` with elastic hybrid parallelism: the predictor times every split with EHP on, so a
  rollout-heavy split whose rollout GPUs train while the rollout pool waits for the weights of a step (a
  synchronous job, or an asynchronous one whose rollout runs ahead to its staleness bound) can win.
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
from functools import partial
from typing import Any, Literal

import numpy as np

from planner.grp import plan
from planner.plan import Candidate
from planner.replan import ReplanPolicy, switch_cost_s
from planner.replan_review import OnlineReplanning, Review
from planner.sim.allocation import static_splits
from planner.sim.decode import instance_generation, slots
from planner.sim.engine import Engine, SimJob, SimOptions, SimResult
from planner.sim.predictor import MIN_MEASURED_STEPS, fork_step_s, outlook
from planner.workload import PlannerInputs

POLICIES: tuple[str, ...] = ("best_static", "planner_initial", "elastic", "ehp", "elastic_ehp", "colocated")
ONLINE_REPLANNING = "online_replanning"  # the runtime's re-planner replayed (`ElasticPolicy(predictor="replan")`)
ALL_POLICIES: tuple[str, ...] = (*POLICIES, ONLINE_REPLANNING)  # what `libra simulate --policy` may name


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
    _online: OnlineReplanning | None = None  # predictor "replan": the running job's memory between decisions
    _switch_done_s: float = 0.0

    def initial(self) -> Candidate:
        return self.start

    def decide(self, engine: Engine) -> Candidate | None:
        if engine.trained % self.interval:
            return None
        if self.predictor == "replan":
            return self._replan(engine)
        return self._tail(engine)

    @property
    def reviews(self) -> list[Review]:
        """The reviews of the changes the replayed runtime re-planner made (predictor "replan")."""
        return self._online.reviews if self._online is not None else []

    def splits(self) -> list[Candidate]:
        """The splits the policy chooses from: every static split of the start layout, and the start."""
        if not self._splits:
            found = static_splits(self.inputs, self.start.layout, tuple(self.inputs.space.allowed_rollout_tp))
            self._splits = sorted(set(found) | {self.start})
        return self._splits

    def _tail(self, engine: Engine) -> Candidate | None:
        job, current = engine.job, engine.alloc
        lo, hi, max_new = max(0, engine.trained - self.interval), engine.trained, job.inputs.workload.max_new_tokens
        lengths = outlook(job.batches, lo, hi, max_new)
        predicted = {a: fork_step_s(engine, a, lengths) for a in self.splits()}
        now_s = predicted[current]
        if now_s is None:
            engine.result.decisions.append({
                "step": engine.trained, "time_s": round(engine.now, 1), "change": False,
                "reason": f"fewer than {MIN_MEASURED_STEPS} steps are left to time a split", "predicted_gain": 0.0,
                "target": None})
            return None
        best, best_s = min(((a, s) for a, s in predicted.items() if s is not None), key=lambda p: p[1])
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
            "projected_mean_response_tokens": round(float(lengths.mean(min(hi + self.horizon_steps // 2,
                                                                             lengths.steps - 1))), 1),
            "target": best.label() if change else None})
        return best if change else None

    def _replan(self, engine: Engine) -> Candidate | None:
        # as the runtime: a window holds only steps begun after the last switch was done, half an interval
        # at least
        window = min(self.interval, engine.steps_begun_since(self._switch_done_s))
        needed = max(1, self.interval // 2)
        record: dict[str, Any] = {"step": engine.trained, "time_s": round(engine.now, 1)}
        if window < needed:
            engine.result.decisions.append(record | {
                "change": False, "predicted_gain": 0.0, "target": None,
                "reason": f"{window} step(s) on the current split since the last change, {needed} needed"})
            return None
        obs = engine.observation(window)
        policy = ReplanPolicy.of_running_job(engine.trained, engine.steps, self.interval, self.min_gain,
                                             allow_train_resize=True)
        if self._online is None:
            self._online = OnlineReplanning(self.inputs)
        decision = self._online.decide(engine.trained, engine.alloc, obs, policy)
        target = decision.target.candidate if decision.change else None
        if target is not None:
            self._switch_done_s = engine.now + switch_cost_s(self.inputs, engine.alloc, target)
        engine.result.decisions.append(record | {
            "change": decision.change, "undo": decision.undo,
            "reason": decision.reason, "predicted_gain": round(decision.predicted_gain, 4),
            "mean_response_tokens": round(obs.mean_response_tokens, 1),
            "step_wall_s": round(obs.step_wall_s or 0.0, 2),
            "rollout_idle_share": None if obs.rollout_idle_share is None else round(obs.rollout_idle_share, 3),
            "train_idle_share": None if obs.train_idle_share is None else round(obs.train_idle_share, 3),
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
        run = instance_generation(requests, float(b.total[k]) / instances, float(b.longest[k]), lbm, slot_count,
                                  partial(c.decode_step, tp, lbm))
        prefill = c.prefill_s(tp, instances)
        train = c.train_side_s(layout, dp, b.mean(k))
        now += prefill + run.bulk_s + run.drain_s + switch + train + inputs.cost.weight_reload_inplace_s
        busy += (prefill + float(b.total[k]) / instances / slot_count * run.step_full_s) * instances * tp
        busy += train * dp * layout.model_parallel
        tokens += float(b.total[k])
        ends.append(now)
    result = SimResult("colocated", f"all {total} GPUs time-shared ({layout.label()} dp={dp} | "
                                    f"{instances} x tp={tp})", options.steps, now,
                       int(b.count[: options.steps].sum()), tokens, max(0.0, 1.0 - busy / (total * now)))
    result.splits = [(0.0, total, total)]
    result.step_end_s = np.asarray(ends)
    return result
