"""Elastic hybrid parallelism (EHP) in a running job: at the step boundary of a synchronous job, while the
rollout pool idles, the training step borrows idle rollout instances' GPUs as extra data-parallel replicas
and gives them back before the next rollout phase.

Where each decision is made:
- whether EHP acts at all: `libra.config.elastic_hybrid.ehp_switch` (training-side changes on, in a synchronous job;
  plan-only records the borrows and lends nothing);
- which rollout members may lend now: `lendable_instances` (READY, serving, no action in flight);
- which of them lend and the replicas they form, never leaving fewer than `elastic_hybrid_min_rollout_gpus`
  serving: `planner.ehp.plan_borrow`; whether their servers sleep or stay resident beside the borrowed rank
  (or the GPU cannot be lent): `planner.ehp.lent_gpu_residency`. `decide_borrow` combines them, purely.

`EhpBorrower.train_step` carries one borrow out: lend (under the executor's weight gate, so no serving-set
change of the reconciler interleaves; the lent members are marked busy, so the reconciler neither admits nor
stops them) -> attach the borrowed replicas -> the step (`EhpSession.train_step`) -> detach -> give back
(woken, brought to the current weights, serving again). Each borrow is an `ehp_borrow` and an `ehp_return`
event with the seconds measured, and `ehp.*` spans in the controller's phase trace. A failure while borrowed
costs the step its borrowed replicas, never the step: the session reruns it on the training pool alone (a
borrowed rank failed), or the step runs there after a failed lend or attach; the job continues.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from libra.config import Config
from libra.config.elastic_hybrid import EhpSwitch
from libra.controller.events import EventLog
from libra.controller.gate import WeightGate
from libra.controller.members import Member, MemberState
from libra.controller.state import ROLLOUT, TRAIN, DesiredState
from libra.controller.tracker import MemberTracker
from libra.observability.phase_trace import get_tracer
from planner.ehp import Residency, RolloutInstanceGpus, plan_borrow

log = logging.getLogger(__name__)


def lendable_instances(members: Sequence[Member]) -> list[RolloutInstanceGpus]:
    """The live rollout members as the borrow planner sees them: an instance may lend only when it is READY,
    serving and has no action in flight (`healthy`); ordered by member id, node by node in `plan_borrow`."""
    return [
        RolloutInstanceGpus(instance_id=m.key or m.id, gpu_ids=tuple(m.gpu_ids), node=str(m.info.get("host", "")),
                            healthy=m.state == MemberState.READY and m.serving and not m.busy)
        for m in sorted(members, key=lambda m: m.id) if m.live and m.gpu_ids
    ]


@dataclass(frozen=True)
class BorrowDecision:
    """What one step boundary borrows: the instances that lend (instance ids), the replicas' GPU ids, whether
    the lending servers sleep, and why (also why nothing is borrowed)."""

    lend: tuple[str, ...]
    replicas: tuple[tuple[str, ...], ...]
    sleep: bool
    residency: str
    reason: str
    serving_gpus: int = 0


def decide_borrow(
    members: Sequence[Member], replica_size: int, min_rollout_gpus: int, residency: Callable[[int], Residency],
    busy_reason: str = "",
) -> BorrowDecision:
    """The borrow of one step boundary (pure). `residency(replicas)` is the planner's memory decision for a
    lending GPU; `busy_reason` (a reconfiguration, a training pool change, rollout work in flight) borrows
    nothing."""
    if busy_reason:
        return BorrowDecision((), (), False, "", busy_reason)
    plan = plan_borrow(lendable_instances(members), replica_size, min_rollout_gpus)
    if not plan.replicas:
        return BorrowDecision((), (), False, "", plan.reason, plan.serving_gpus)
    decision = residency(plan.num_replicas)
    if decision == "no_fit":
        return BorrowDecision((), (), False, decision, f"a borrowed training rank does not fit beside a sleeping "
                              f"rollout server on one GPU (planner memory model, {plan.num_replicas} replica(s))",
                              plan.serving_gpus)
    return BorrowDecision(plan.lent_instances, plan.replicas, decision == "sleep", decision, plan.reason,
                          plan.serving_gpus)


class EhpBorrower:
    """Runs the training step of a step boundary with borrowed rollout GPUs (see the module docstring).
    `rollout` / `train` are the controller's pool edges (`libra.controller.pools`)."""

    def __init__(self, cfg: Config, switch: EhpSwitch, rollout: Any, train: Any, tracker: MemberTracker,
                 gate: WeightGate, events: EventLog, desired: Callable[[], DesiredState]) -> None:
        self.cfg = cfg
        self.switch = switch
        self.rollout = rollout
        self.train = train
        self.tracker = tracker
        self.gate = gate
        self.events = events
        self.desired = desired
        self._last_skip = ""

    # ---- deciding ---------------------------------------------------------------------------------------
    def decide(self, session: Any, rollout_in_flight: int) -> BorrowDecision:
        desired = self.desired()
        observed = self.tracker.snapshot(time.time(), take_errors=False)
        busy = ""
        if desired.reconfiguring:
            busy = f"the rollout pool is being reconfigured ({desired.reconfiguring})"
        elif observed.train.busy or observed.rollout.busy:
            busy = "an action on the " + ("training" if observed.train.busy else "rollout") + " pool is in flight"
        elif rollout_in_flight:
            busy = f"{rollout_in_flight} rollout group(s) are still generating"
        layout = session.pool.layout
        try:
            size = session.replica_size()
        except ValueError as exc:  # a configured size that the pool's current layout does not divide
            return BorrowDecision((), (), False, "", str(exc))

        def residency(replicas: int) -> Residency:
            return self._residency(layout, replicas, desired.rollout_tp)

        return decide_borrow(observed.of(ROLLOUT), size, session.settings.min_rollout_gpus, residency, busy)

    def _residency(self, layout: Any, replicas: int, rollout_tp: int) -> Residency:
        from libra.planning import planner_inputs
        from planner.ehp import lent_gpu_residency

        borrowed_dp = replicas if self.cfg.global_resource_planner.decouple_communication_domains else 1
        try:
            return lent_gpu_residency(planner_inputs(self.cfg), layout, borrowed_dp, rollout_tp).decision
        except Exception as exc:  # the memory model cannot say: sleeping is what always frees the memory
            log.warning("EHP: no residency decision from the planner (%s); lending servers sleep", exc)
            return "sleep"

    # ---- the step ---------------------------------------------------------------------------------------
    def train_step(self, samples: list[Any], step: int, rollout_in_flight: int = 0) -> dict[str, float]:
        """One training step at this step boundary, with borrowed replicas when the plan lends any."""
        session = self.train.ehp_session()
        decision = self.decide(session, rollout_in_flight)
        if not decision.lend:
            if decision.reason != self._last_skip:  # once per reason, not once per step
                self.events.emit("ehp_idle", f"step {step} borrows no rollout GPUs: {decision.reason}", step=step)
                self._last_skip = decision.reason
            return dict(session.train_step(samples, step))
        self._last_skip = ""
        gpus = sum(len(r) for r in decision.replicas)
        if self.switch.mode == "plan_only":
            self.events.emit("ehp_plan", f"plan only: step {step} would borrow {gpus} GPU(s) of {list(decision.lend)}",
                             step=step, instances=list(decision.lend), replicas=len(decision.replicas), gpus=gpus,
                             residency=decision.residency)
            get_tracer().record("reconfigure.plan", time.time_ns(), time.time_ns(), step=step, pool=TRAIN,
                                change="ehp", instances=list(decision.lend))
            return dict(session.train_step(samples, step))
        return self._borrowed_step(session, decision, samples, step)

    def _borrowed_step(self, session: Any, decision: BorrowDecision, samples: list[Any],
                       step: int) -> dict[str, float]:
        tracer = get_tracer()
        members = {m.key or m.id: m for m in self.tracker.members(ROLLOUT)}
        keys = list(decision.lend)
        member_ids = [members[k].id for k in keys]
        times: dict[str, float] = {}
        metrics: dict[str, float] | None = None
        lent = False
        stage = "lend"
        for member_id in member_ids:  # the reconciler leaves them alone while lent
            self.tracker.set_busy(member_id, True)
        with tracer.span("ehp.borrow", step, instances=keys, replicas=len(decision.replicas)):
            try:
                with tracer.span("ehp.lend", step, instances=keys, sleep=decision.sleep), \
                        self.gate.hold(f"lend {', '.join(keys)} to the training step"):
                    t = time.monotonic()
                    reports = self.rollout.lend(keys, decision.sleep)
                    lent = True
                    self.tracker.set_serving([m.id for m in self.tracker.members(ROLLOUT)
                                              if m.serving and m.id not in member_ids])
                    times["lend_s"] = time.monotonic() - t
                times["sleep_s"] = max((float(r.sleep_s) for r in reports), default=0.0)
                stage = "attach"
                with tracer.span("ehp.attach", step, gpus=sum(len(r) for r in decision.replicas)):
                    t = time.monotonic()
                    session.attach(self._lent_gpus(decision))
                    times["attach_s"] = time.monotonic() - t
                self.events.emit("ehp_borrow", f"step {step} borrows {len(decision.replicas)} replica(s) on "
                                 f"{', '.join(keys)} ({decision.residency})", step=step, instances=keys,
                                 replicas=len(decision.replicas), gpus=[g for r in decision.replicas for g in r],
                                 residency=decision.residency, serving_gpus=decision.serving_gpus,
                                 **{k: round(v, 3) for k, v in times.items()})
                stage = "step"
                with tracer.span("ehp.step", step, replicas=len(decision.replicas)):
                    t = time.monotonic()
                    metrics = dict(session.train_step(samples, step))
                    times["step_s"] = time.monotonic() - t
                stage = "detach"
                with tracer.span("ehp.detach", step):
                    t = time.monotonic()
                    session.detach()
                    times["detach_s"] = time.monotonic() - t
            except Exception as exc:
                session.detach(clean=False)
                if stage == "step":  # a core rank failed: the job's own failure path, after the GPUs go back
                    self._give_back(keys, member_ids, lent, step, times, failed=stage)
                    raise
                after = "the step ran" if metrics is not None else f"step {step} trains on the training pool alone"
                self.events.emit("ehp_failed", f"{stage} of the borrowed replicas failed ({type(exc).__name__}: "
                                 f"{exc}); {after}", step=step, stage=stage, instances=keys)
            self._give_back(keys, member_ids, lent, step, times, failed="" if metrics is not None else stage)
        if metrics is None:
            metrics = dict(session.train_step(samples, step))
            metrics["ehp_fallback"] = 1.0
        metrics.update({f"ehp_{k}": round(v, 4) for k, v in times.items()})
        return metrics

    def _lent_gpus(self, decision: BorrowDecision) -> list[Any]:
        """The `LentGpu`s of the decision's replicas, replica by replica (consecutive GPUs form one)."""
        by_id = {str(g.gpu_id): g for key in decision.lend for g in self.rollout.lent_gpus(key)}
        return [by_id[gpu] for replica in decision.replicas for gpu in replica]

    def _give_back(self, keys: list[str], member_ids: list[str], lent: bool, step: int, times: dict[str, float],
                   failed: str) -> None:
        """Give the lent instances back (woken, current weights, serving) and let the reconciler see them."""
        try:
            if not lent:
                return
            with get_tracer().span("ehp.return", step, instances=keys), \
                    self.gate.hold(f"give {', '.join(keys)} back to the rollout pool"):
                t = time.monotonic()
                reports = self.rollout.give_back(keys)
                times["return_s"] = time.monotonic() - t
                serving = {r.instance_id for r in reports if r.serving}
                back = {m.id for m in self.tracker.members(ROLLOUT) if (m.key or m.id) in serving}
                self.tracker.set_serving([m.id for m in self.tracker.members(ROLLOUT) if m.serving] + sorted(back))
            times["wake_s"] = max((float(r.wake_s) for r in reports), default=0.0)
            times["reload_s"] = max((float(r.reload_s) for r in reports), default=0.0)
            errors = {r.instance_id: r.error for r in reports if r.error}
            self.events.emit("ehp_return", f"step {step} gave {', '.join(keys)} back; serving again: "
                             f"{', '.join(sorted(serving)) or 'none'}", step=step, instances=keys,
                             serving=sorted(serving), errors=errors, failed=failed,
                             **{k: round(v, 3) for k, v in times.items()})
        finally:
            for member_id in member_ids:
                self.tracker.set_busy(member_id, False)


__all__ = ["BorrowDecision", "EhpBorrower", "decide_borrow", "lendable_instances"]
