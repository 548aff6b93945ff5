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

`EhpBorrower.prewarm` starts, at the job's start, the replicas the first borrow will ask for and parks them.
`EhpBorrower.train_step` carries one borrow out: lend (under the executor's weight gate, so no serving-set
change of the reconciler interleaves; the lent members are marked busy, so the reconciler neither admits nor
stops them) -> attach the borrowed replicas -> the step (`EhpSession.train_step`) -> park or detach -> give
back (woken, brought to the current weights, serving again). Each borrow is an `ehp_borrow` and an
`ehp_return` event with the seconds measured, and `ehp.*` spans in the controller's phase trace.

Parked replicas. When the lending servers stay resident (`lent_gpu_residency` says `resident`), the borrowed
workers are parked after the step instead of stopped, and the next step that borrows the same GPUs
re-attaches them without starting a process (its `ehp_borrow` says `reused: true`, `attach_s` ~0; the first
attach pays the start, unless `prewarm` parked them at the job's start). `parked_stop_reason` says when a
parked group must stop instead: the borrow wants other GPUs or sleeping servers, a lending instance stopped,
failed or was replaced, or the rollout pool is (being) reconfigured; the session itself refuses reuse after a
core pool change or a failed parked worker, the rollout edge reports an instance it stops (`watch_stops`), and
the training edge stops a parked group when it resizes the pool or the job ends. Each stop is an `ehp_release`
event naming the reason.

A failure while borrowed costs the step its borrowed replicas, never the step: the session reruns it on the
training pool alone (a borrowed rank failed), or the step runs there after a failed lend or attach; the job
continues. An attach that found lending nodes unable to reach the training pool's nodes holds them back from
lending (`libra.controller.ehp_lenders`) until they reach them again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from libra.cluster.ehp_workers import LendersUnreachableError
from libra.cluster.node_fence import FencedNode
from libra.config import Config
from libra.config.elastic_hybrid import EhpSwitch
from libra.controller.ehp_lenders import HeldBackLenders
from libra.controller.events import EventLog
from libra.controller.gate import WeightGate
from libra.controller.members import Member, MemberState
from libra.controller.state import ROLLOUT, TRAIN, DesiredState
from libra.controller.tracker import MemberTracker
from libra.observability.phase_trace import get_tracer
from planner.ehp import Residency, RolloutInstanceGpus, plan_borrow

log = logging.getLogger(__name__)

SETTLE_S = 10.0  # how long a step waits for a transient refusal to clear before training without borrowing


def lendable_instances(members: Sequence[Member],
                       held_back: Callable[[Member], bool] = lambda m: False) -> list[RolloutInstanceGpus]:
    """The live rollout members as the borrow planner sees them: an instance may lend only when it is READY,
    serving and has no action in flight (`healthy`) and is not `held_back` (it then serves, not lends);
    ordered by member id, node by node in `plan_borrow`."""
    return [
        RolloutInstanceGpus(instance_id=m.key or m.id, gpu_ids=tuple(m.gpu_ids), node=str(m.info.get("host", "")),
                            healthy=m.state == MemberState.READY and m.serving and not m.busy,
                            lendable=not held_back(m))
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
    owners: tuple[tuple[str, ...], ...] = ()  # the lending instance of each replica GPU (ids are per node)


def decide_borrow(
    members: Sequence[Member], replica_size: int, min_rollout_gpus: int, residency: Callable[[int], Residency],
    busy_reason: str = "", held_back: Callable[[Member], bool] = lambda m: False,
) -> BorrowDecision:
    """The borrow of one step boundary (pure). `residency(replicas)` is the planner's memory decision for a
    lending GPU; `busy_reason` (a reconfiguration, a training pool change, rollout work in flight) borrows
    nothing; a `held_back` member serves and does not lend."""
    if busy_reason:
        return BorrowDecision((), (), False, "", busy_reason)
    plan = plan_borrow(lendable_instances(members, held_back), replica_size, min_rollout_gpus)
    if not plan.replicas:
        return BorrowDecision((), (), False, "", plan.reason, plan.serving_gpus)
    decision = residency(plan.num_replicas)
    if decision == "no_fit":
        return BorrowDecision((), (), False, decision, f"a borrowed training rank does not fit beside a sleeping "
                              f"rollout server on one GPU (planner memory model, {plan.num_replicas} replica(s))",
                              plan.serving_gpus)
    return BorrowDecision(plan.lent_instances, plan.replicas, decision == "sleep", decision, plan.reason,
                          plan.serving_gpus, plan.replica_owners)


Lender = tuple[str, tuple[str, ...], str]  # (instance key, its GPU ids, its server's pid)


def lender_identity(m: Member) -> Lender:
    """What names one lending instance's server: a replaced server has another pid (or other GPUs)."""
    return (m.key or m.id, tuple(m.gpu_ids), str(m.info.get("pid", "")))


@dataclass(frozen=True)
class ParkedBorrow:
    """Borrowed replicas kept alive after a step: who lent their GPUs, the replicas, and the rollout pool's
    shape when they were parked."""

    lenders: tuple[Lender, ...]
    replicas: tuple[tuple[str, ...], ...]
    rollout_shape: tuple[int, int]  # (instances, TP) of the desired state


def parked_stop_reason(parked: ParkedBorrow, members: Sequence[Member], desired: DesiredState,
                       decision: BorrowDecision | None = None) -> str:
    """Why the parked replicas must stop now, "" when they may stay (pure). `decision`: this step boundary's
    borrow (None between steps)."""
    if desired.reconfiguring:
        return f"the rollout pool is being reconfigured ({desired.reconfiguring})"
    shape = (desired.rollout_instances, desired.rollout_tp)
    if shape != parked.rollout_shape:
        return (f"the rollout pool was reconfigured ({parked.rollout_shape[0]} x TP{parked.rollout_shape[1]} -> "
                f"{shape[0]} x TP{shape[1]})")
    by_key = {m.key or m.id: m for m in members}
    for key, gpus, pid in parked.lenders:
        m = by_key.get(key)
        if m is None or m.state in (MemberState.DRAINING, MemberState.STOPPED):
            return f"lending instance {key} stopped"
        if m.state == MemberState.FAILED:
            return f"lending instance {key} failed"
        if lender_identity(m) != (key, gpus, pid):
            return (f"lending instance {key} was replaced (GPUs {list(gpus)}, pid {pid or '?'} -> "
                    f"GPUs {list(m.gpu_ids)}, pid {m.info.get('pid', '?')})")
    if decision is not None and decision.lend:
        if decision.sleep:
            return ("the lending servers must sleep this step (residency sleep): a borrowed rank fits only "
                    "beside a sleeping server, so none stays between steps")
        if decision.replicas != parked.replicas:
            return (f"the step borrows GPUs {[list(r) for r in decision.replicas]}, the parked replicas hold "
                    f"{[list(r) for r in parked.replicas]}")
    return ""


class EhpBorrower:
    """Runs the training step of a step boundary with borrowed rollout GPUs (see the module docstring).
    `rollout` / `train` are the controller's pool edges (`libra.controller.pools`)."""

    def __init__(self, cfg: Config, switch: EhpSwitch, rollout: Any, train: Any, tracker: MemberTracker,
                 gate: WeightGate, events: EventLog, desired: Callable[[], DesiredState],
                 observe_now: Callable[[], None] = lambda: None,
                 reaches_again: Callable[[FencedNode], bool] | None = None) -> None:
        self.cfg = cfg
        self.switch = switch
        self.rollout = rollout
        self.train = train
        self.tracker = tracker
        self.gate = gate
        self.events = events
        self.desired = desired
        self.observe_now = observe_now  # asks the control loop for an observation now rather than at its next tick
        self.settle_s = SETTLE_S
        self._last_skip = ""
        self._parked: ParkedBorrow | None = None
        self._session: Any = None  # the session whose replicas may be parked
        self._lock = threading.Lock()
        self.held_back = HeldBackLenders(events, reaches_again)
        watch = getattr(rollout, "watch_stops", None)
        if watch is not None:
            watch(self.instance_stopping)

    # ---- deciding ---------------------------------------------------------------------------------------
    def decide(self, session: Any, rollout_in_flight: int) -> BorrowDecision:
        """The borrow of this step boundary. What an action in flight holds up (a publish ACK, a serving-set
        flip, an instance given back a moment ago) clears within seconds while the synchronous job's rollout
        pool idles, so a transient refusal is decided again for up to `settle_s` before the step gives up its
        borrowed replicas; each retry waits for the tracker's next change (an action done, a member moved or
        observed), not for a clock. The first refusal also asks for an observation at once: the members the
        tracker holds are the last tick's view, and a tick that fell inside the last weight publish saw the
        instances reloading (LOADING) until the next tick, up to a control interval later, although they
        serve the new weights since the publish's ACKs."""
        deadline = time.monotonic() + self.settle_s
        observed_now = False
        while True:
            seen = self.tracker.version
            decision, transient = self._decide_now(session, rollout_in_flight)
            remaining = deadline - time.monotonic()
            if decision.lend or not transient or remaining <= 0:
                return decision
            if not observed_now:  # once: an observation changes the tracker, which would wake this loop again
                observed_now = True
                self.observe_now()
            self.tracker.wait_changed(seen, remaining)

    def _decide_now(self, session: Any, rollout_in_flight: int) -> tuple[BorrowDecision, bool]:
        """This moment's decision, and whether its refusal is transient: an action in flight, or a live rollout
        member that is busy, READY between serving sets or LOADING (the step boundary's weight reload), outside
        a reconfiguration, which takes longer."""
        desired = self.desired()
        observed = self.tracker.snapshot(time.time(), take_errors=False)
        busy = ""
        if desired.reconfiguring:
            busy = f"the rollout pool is being reconfigured ({desired.reconfiguring})"
        elif observed.train.busy or observed.rollout.busy:
            busy = "an action on the " + ("training" if observed.train.busy else "rollout") + " pool is in flight"
        elif rollout_in_flight:
            busy = f"{rollout_in_flight} rollout group(s) are still generating"
        transient = not desired.reconfiguring and not rollout_in_flight and (
            observed.train.busy or observed.rollout.busy
            or any(m.busy or m.state == MemberState.LOADING or (m.state == MemberState.READY and not m.serving)
                   for m in observed.of(ROLLOUT) if m.live))
        decision, sized = self._borrow_of(session, observed.of(ROLLOUT), desired, busy)
        return decision, transient and sized

    def _borrow_of(self, session: Any, members: Sequence[Member], desired: DesiredState,
                   busy: str) -> tuple[BorrowDecision, bool]:
        """`decide_borrow` for the session's replica size and the planner's residency; False with a refusal when
        the configured replica size does not divide the pool's current layout."""
        layout = session.pool.layout
        try:
            size = session.replica_size()
        except ValueError as exc:
            return BorrowDecision((), (), False, "", str(exc)), False

        def residency(replicas: int) -> Residency:
            return self._residency(layout, replicas, desired.rollout_tp)

        return decide_borrow(members, size, session.settings.min_rollout_gpus, residency, busy,
                             self.held_back.held_back), True

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
        self._adopt(session)
        decision = self.decide(session, rollout_in_flight)
        self._check_parked(session, decision)
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
        lent = reused = False
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
                with tracer.span("ehp.attach", step, gpus=sum(len(r) for r in decision.replicas)) as span:
                    t = time.monotonic()
                    reused = bool(session.attach(self._lent_gpus(decision)))
                    times["attach_s"] = time.monotonic() - t
                    span.set(reused=reused)
                self.events.emit("ehp_borrow", f"step {step} borrows {len(decision.replicas)} replica(s) on "
                                 f"{', '.join(keys)} ({decision.residency}"
                                 f"{', parked replicas re-attached' if reused else ''})", step=step, instances=keys,
                                 replicas=len(decision.replicas), gpus=[g for r in decision.replicas for g in r],
                                 residency=decision.residency, serving_gpus=decision.serving_gpus, reused=reused,
                                 **{k: round(v, 3) for k, v in times.items()})
                stage = "step"
                with tracer.span("ehp.step", step, replicas=len(decision.replicas)):
                    t = time.monotonic()
                    metrics = dict(session.train_step(samples, step, to_park=not decision.sleep))
                    times["step_s"] = time.monotonic() - t
                if metrics.get("ehp_fallback") or not session.attached:  # the session detached: a rank failed
                    after = ("the step ran on the training pool alone" if metrics.get("ehp_fallback") else
                             "the step had finished with the borrowed replicas before the failure was seen")
                    self.events.emit("ehp_failed", f"a borrowed replica failed in step {step} "
                                     f"({session.last_fallback_reason or 'see the controller log'}); {after}",
                                     step=step, stage="step", instances=keys)
                stage = "detach"
                park = not decision.sleep
                with tracer.span("ehp.detach", step, parked=park):
                    t = time.monotonic()
                    self._park_or_detach(session, decision, members, keys, park)
                    times["detach_s"] = time.monotonic() - t
            except Exception as exc:
                with self._lock:
                    self._parked = None
                session.detach(clean=False)
                if stage == "step":  # a core rank failed: the job's own failure path, after the GPUs go back
                    self._give_back(keys, member_ids, lent, step, times, failed=stage)
                    raise
                after = "the step ran" if metrics is not None else f"step {step} trains on the training pool alone"
                self.events.emit("ehp_failed", f"{stage} of the borrowed replicas failed ({type(exc).__name__}: "
                                 f"{exc}); {after}", step=step, stage=stage, instances=keys)
                if isinstance(exc, LendersUnreachableError):
                    self.held_back.hold_back(exc.nodes, exc.instances, step)
            self._give_back(keys, member_ids, lent, step, times, failed="" if metrics is not None else stage)
        if metrics is None:
            metrics = dict(session.train_step(samples, step))
            metrics["ehp_fallback"] = 1.0
        metrics.update({f"ehp_{k}": round(v, 4) for k, v in times.items()})
        metrics["ehp_reused"] = 1.0 if reused and "ehp_fallback" not in metrics else 0.0
        return metrics

    # ---- parked replicas ------------------------------------------------------------------------------
    def prewarm(self) -> bool:
        """Start the replicas the first borrow will ask for now, at start-up, parked beside their serving
        lenders, so that the first borrowing step re-attaches them instead of starting workers inside the
        step (seconds to minutes of process start and framework init): they are part of the job's start, like
        its pools. Only where lent GPUs stay resident: a sleeping lender frees its GPU at the borrow alone. A
        step boundary that comes meanwhile waits for it (the borrower's lock). True when replicas were parked;
        never raises (a failure leaves the first borrow to start them). Plan-only lends nothing, so starts
        nothing either."""
        if self.switch.mode != "on":
            return False
        session = self.train.ehp_session()
        with self._lock:
            self._adopt_locked(session)
            try:
                members = {m.key or m.id: m for m in self.tracker.members(ROLLOUT)}
                desired = self.desired()
                reconfiguring = f"the rollout pool is being reconfigured ({desired.reconfiguring})" \
                    if desired.reconfiguring else ""
                decision, _ = self._borrow_of(session, list(members.values()), desired, reconfiguring)
                if not decision.lend or decision.sleep or session.parked or session.attached:
                    why = decision.reason if not decision.lend else "lending servers sleep" if decision.sleep \
                        else "replicas are already started"
                    self.events.emit("ehp_prewarm", f"no borrowed replicas started ahead of the first step: {why}",
                                     started=False)
                    return False
                started = time.monotonic()
                session.attach(self._lent_gpus(decision))
                session.park()
                self._parked = ParkedBorrow(tuple(lender_identity(members[k]) for k in decision.lend),
                                            decision.replicas, (desired.rollout_instances, desired.rollout_tp))
            except Exception as exc:
                log.warning("EHP: starting the borrowed replicas ahead of the first step failed", exc_info=True)
                session.detach(clean=False)
                self._parked = None
                self.events.emit("ehp_prewarm", f"starting the borrowed replicas ahead of the first step failed "
                                 f"({type(exc).__name__}: {exc}); the first borrow starts them", started=False)
                if isinstance(exc, LendersUnreachableError):  # the first borrow leaves those nodes out
                    self.held_back.hold_back(exc.nodes, exc.instances, step=0)
                return False
        seconds = time.monotonic() - started
        self.events.emit("ehp_prewarm", f"{len(decision.replicas)} borrowed replica(s) started on "
                         f"{', '.join(decision.lend)} in {seconds:.1f} s, parked beside their serving lenders",
                         started=True, instances=list(decision.lend), replicas=len(decision.replicas),
                         seconds=round(seconds, 3))
        return True

    def _adopt(self, session: Any) -> None:
        """Follow the training edge's session: a new one (the pool was replaced) starts with nothing parked."""
        with self._lock:
            self._adopt_locked(session)

    def _adopt_locked(self, session: Any) -> None:
        if session is not self._session:
            self._session, self._parked = session, None
        session.on_parked_stop = self._parked_stopped

    def _check_parked(self, session: Any, decision: BorrowDecision) -> None:
        """Stop the parked replicas when this step boundary's state or borrow says so (`parked_stop_reason`)."""
        with self._lock:
            if not session.parked:
                self._parked = None
                return
            parked = self._parked
        if parked is None:  # parked by someone else: whose GPUs they hold is not known here
            session.release("parked replicas of unknown lenders")
            return
        reason = parked_stop_reason(parked, self.tracker.members(ROLLOUT), self.desired(), decision)
        if reason:
            session.release(reason)

    def _park_or_detach(self, session: Any, decision: BorrowDecision, members: dict[str, Member],
                        keys: list[str], park: bool) -> None:
        """After the step: park the replicas (and remember who lent their GPUs) or stop them."""
        if not park:
            session.detach()
            return
        session.park()
        if not session.parked:  # the step lost its borrowed replicas (it fell back to the pool alone)
            return
        desired = self.desired()
        with self._lock:
            self._parked = ParkedBorrow(tuple(lender_identity(members[k]) for k in keys), decision.replicas,
                                        (desired.rollout_instances, desired.rollout_tp))

    def instance_stopping(self, key: str) -> None:
        """The rollout edge is about to stop instance `key`: parked replicas on its GPUs stop first."""
        with self._lock:
            parked, session = self._parked, self._session
        if parked is not None and session is not None and key in {lender[0] for lender in parked.lenders}:
            session.release(f"lending instance {key} is being stopped")

    def stop_rechecks(self) -> None:
        """No more checks of held-back lending nodes (the job's control loop stops)."""
        self.held_back.close()

    def close(self, reason: str = "the job ends") -> None:
        """Stop parked replicas (nothing left running) and the checks of held-back nodes."""
        self.stop_rechecks()
        with self._lock:
            session = self._session
        if session is not None:
            session.release(reason)

    def _parked_stopped(self, reason: str, gpu_ids: list[str]) -> None:
        with self._lock:
            self._parked = None
        self.events.emit("ehp_release", f"parked borrowed replicas on GPU(s) {', '.join(gpu_ids)} stopped: {reason}",
                         gpus=gpu_ids, reason=reason)

    def _lent_gpus(self, decision: BorrowDecision) -> list[Any]:
        """The `LentGpu`s of the decision's replicas, replica by replica (consecutive GPUs form one), each
        naming the instance that lends it (a borrowed rank joins that instance's CPU slice when metered). GPU ids
        are per node: a GPU is found by its instance and its id."""
        by_owner = {(key, str(g.gpu_id)): replace(g, holder=key) for key in decision.lend
                    for g in self.rollout.lent_gpus(key)}
        return [by_owner[(owner, gpu)] for replica, owners in zip(decision.replicas, decision.owners, strict=True)
                for gpu, owner in zip(replica, owners, strict=True)]

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
            parked = self._parked is not None and not failed
            self.events.emit("ehp_return", f"step {step} gave {', '.join(keys)} back; serving again: "
                             f"{', '.join(sorted(serving)) or 'none'}"
                             f"{'; the borrowed replicas stay parked beside them' if parked else ''}", step=step,
                             instances=keys, serving=sorted(serving), errors=errors, failed=failed, parked=parked,
                             **{k: round(v, 3) for k, v in times.items()})
        finally:
            for member_id in member_ids:
                self.tracker.set_busy(member_id, False)


__all__ = ["BorrowDecision", "EhpBorrower", "ParkedBorrow", "decide_borrow", "lendable_instances", "lender_identity",
           "parked_stop_reason"]
