"""Carrying a running job onto the GPUs that remain after the cluster lost some (a Ray node died or was removed).

Two threads take part:

- the control loop (`observe_capacity`, every tick, throttled) keeps `DesiredState.cluster_gpus` at the GPUs Ray
  counts alive, so the rollout strategies start no replacement for a lost instance on GPUs that are gone
  (starts never ask for more than the spare GPUs);
- the RL loop (`replan`, at a step boundary or after a training call lost a rank) re-plans the pools onto what
  remains (`libra.controller.capacity.fit_to_capacity`); a step boundary asks Ray only once the control loop's
  reading shows GPUs gone. It waits, bounded by the health rule, until the
  rollout instances of the lost node are failed (so `diff` stops only surplus live ones), then:
  * the training ranks all answer: the whole new desired state is set and the control loop carries it out
    as any reconfiguration (a training change by the checkpoint resize, nothing repeated);
  * a rank was lost: the rollout pool is shrunk first and its surplus stopped (a stop takes the weight gate,
    which the training restart holds), then the training pool is restarted at its new size and the RL loop
    goes back to the newest complete checkpoint.

With `runtime_node_loss_policy: wait` the RL loop first waits (up to `runtime_node_loss_wait_s`) for every GPU
the pools hold to be alive again and, when they are, changes nothing (a lost training rank is restarted at its
size, lost rollout instances are replaced); it re-plans only when they are not. When even `min_train_gpus` +
`min_rollout_gpus` do not fit, the job waits up to `runtime_node_loss_wait_s` for them, then stops with
`CapacityLost`, which says what is left and how to resume. A training restart that cannot be placed because Ray
had not marked the node dead yet gives up its placement wait once the cluster shows fewer GPUs than the job
holds (the runtime's `placement_guard`), waits for that at most `NODE_DEATH_SEEN_S`, and re-plans. A training
restart whose ranks' nodes cannot reach each other (a partition between worker nodes that Ray counts alive,
`NodesUnreachableError`) fences off the fewest nodes that lets the rest connect (`libra.cluster.node_fence`:
their GPUs no longer count) and re-plans the same way (`node_fenced`); a fenced node that reaches its peers
again is the job's again (`node_unfenced`), as a lost node that came back. At the first start there is no
training pool to restart: the controller hands the error of the pool's start to `fence_at_start`, which fences
the same way and sets the pools' new sizes, and the control loop creates the training pool on the rest. Events:
`capacity_changed` (the cluster's GPUs moved), `capacity_wait` / `capacity_wait_over`, `capacity_lost` (the
decision, with its numbers), `capacity_replan` (done, with its seconds).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from libra.cluster.node_fence import FENCE, FencedNode, NodeFence
from libra.config import Config
from libra.controller.capacity import (
    CapacityFit,
    CapacityLost,
    fit_to_capacity,
    gpus_in_use,
    shrink_to_capacity,
)
from libra.controller.desired_store import DesiredStore
from libra.controller.events import EventLog
from libra.controller.executor import Executor
from libra.controller.members import MemberState as S
from libra.controller.rechecks import NodeRechecks
from libra.controller.state import ROLLOUT, DesiredState
from libra.controller.tracker import MemberTracker
from libra.error_chain import causes
from planner.layout import TrainLayout

if TYPE_CHECKING:
    from libra.cluster.training_workers import NodesUnreachableError

log = logging.getLogger(__name__)

CAPACITY_CHECK_S = 2.0  # the control loop reads the cluster's GPUs at most this often
NODE_DEATH_SEEN_S = 90.0  # how long a training restart that could not be placed waits for Ray to mark a node dead
FENCE_RECHECK_S = 20.0  # how often a fenced node is checked for whether it reaches its peers again
MAX_FENCE_ROUNDS = 4  # restarts that may each fence nodes off (one partition found per restart) before giving up
SURPLUS_STOPPED_S = 180.0  # how long the training restart waits for the rollout pool to give up its surplus


class NodeLossRecovery:
    """Watches the cluster's GPUs (control loop) and re-plans the job onto them (RL loop)."""

    def __init__(self, cfg: Config, live_gpus: Callable[[], int], store: DesiredStore, tracker: MemberTracker,
                 executor: Executor, events: EventLog, fingerprint_for: Callable[[int], str],
                 train_problems: Callable[[int, TrainLayout], list[str]] | None, wake: Callable[[], None],
                 rollout_failed_within_s: float, training_answers: Callable[[], bool],
                 stopping: threading.Event | None = None,
                 placement_guard: Callable[[Callable[[], str]], AbstractContextManager[None]] | None = None,
                 fence: NodeFence = FENCE, reaches_again: Callable[[FencedNode], bool] | None = None) -> None:
        self.cfg = cfg
        self.live_gpus = live_gpus
        self.store = store
        self.tracker = tracker
        self.executor = executor
        self.events = events
        self.fingerprint_for = fingerprint_for
        self.train_problems = train_problems
        self.wake = wake
        self.rollout_failed_within_s = rollout_failed_within_s
        self.training_answers = training_answers
        self._checked_at = 0.0
        self._lost_seen_at: float | None = None  # when the control loop last saw the cluster lose GPUs
        self.stopping = stopping or threading.Event()  # a stop request ends every wait here at once
        # a training restart's placement wait gives up when the cluster no longer has the job's GPUs
        self.placement_guard = placement_guard or (lambda check: contextlib.nullcontext())
        self.fence = fence  # nodes left out after training ranks on them could not reach their peers
        # whether a fenced node reaches its peers again (`libra.cluster.fence_probe`); None: fenced for good
        self.rechecks = NodeRechecks("libra-fence-rechecks", FENCE_RECHECK_S, self.fence.fenced, reaches_again,
                                     self._unfenced, self.stopping)

    # ---- control loop ---------------------------------------------------------------------------------
    def observe_capacity(self, now: float | None = None, force: bool = False) -> None:
        """Keep `cluster_gpus` at the GPUs alive (never above the configured cluster); `force` reads them
        whatever the throttle says (a member just failed: its node may be gone). Never raises."""
        now = time.monotonic() if now is None else now
        if not force and now - self._checked_at < CAPACITY_CHECK_S:
            return
        self._checked_at = now
        try:
            live = self._live()
        except Exception:
            log.debug("reading the cluster's GPUs failed", exc_info=True)
            return
        self._record_capacity(live, now)

    def _record_capacity(self, live: int, now: float) -> None:
        """Set `cluster_gpus` to `live` with a `capacity_changed` event when it differs: once per change,
        from whichever loop reads the cluster first (the control loop's throttled reading, or the RL loop's
        re-plan after a step failed on a lost node)."""
        while True:  # a change made in between (by the other loop, or any other) is read again
            desired = self.store.get()
            if not desired.cluster_gpus or live == desired.cluster_gpus:
                return
            if self.store.replace_if(desired, dataclasses.replace(desired, cluster_gpus=live)):
                break
        if live < desired.cluster_gpus:
            self._lost_seen_at = now
        self.events.emit("capacity_changed", f"the cluster has {live} GPUs alive (was {desired.cluster_gpus})",
                         live_gpus=live, was_gpus=desired.cluster_gpus, in_use=gpus_in_use(desired))

    # ---- RL loop --------------------------------------------------------------------------------------
    def replan(self, training_lost: bool, reason: str = "", observed: bool = False,
               starting: bool = False) -> dict[str, Any] | None:
        """Re-plan onto the GPUs alive when the pools hold more; None when nothing was lost. Returns
        `{"training_restarted": bool, ...the restart's cost}`; raises CapacityLost when the minimums do not fit.
        `observed` (a step boundary): trust the control loop's reading of the cluster (`cluster_gpus`, at most
        `CAPACITY_CHECK_S` old) when it shows nothing lost, instead of asking Ray again every step. `starting`:
        the training pool has not started yet, so nothing is restarted; the control loop creates it at the
        size this sets."""
        desired = self.store.get()
        held = gpus_in_use(desired)
        if observed and desired.cluster_gpus >= held > 0:
            return None
        live = self._live()
        if live >= held:
            return None
        started = time.monotonic()
        self._record_capacity(live, started)
        gpr = self.cfg.global_resource_planner
        if gpr.runtime_node_loss_policy == "wait":
            live = self._wait_for_gpus(held, f"all {held} GPUs its pools hold")
            if live >= held:
                return None  # back: a lost training rank is restarted at its size, rollout replacements start
        training_lost = training_lost or not self.training_answers()
        self._wait_for_lost_rollout(live, 0 if training_lost else desired.train_gpus)
        need = max(1, gpr.min_train_gpus) + max(1, gpr.min_rollout_gpus, desired.rollout_tp)
        fit = self._fit(desired, live, training_lost)
        if fit is None and live < need:
            live = self._wait_for_gpus(need, f"the {need} GPUs of its smallest pools")
            fit = self._fit(desired, live, training_lost)
        if fit is None:
            message = (f"the cluster has {live} GPUs alive{self._fenced_words()} of the {held} this job holds, "
                       f"fewer than its smallest pools need ({need}: min_train_gpus={gpr.min_train_gpus}, "
                       f"min_rollout_gpus={gpr.min_rollout_gpus}, rollout TP {desired.rollout_tp}); the job stops. "
                       "Launch it again on this run directory once the cluster has the GPUs back: it resumes "
                       "from its newest checkpoint")
            self.events.emit("capacity_lost", message, live_gpus=live, was_gpus=held, fits=False)
            raise CapacityLost(message)
        self.events.emit("capacity_lost", f"the cluster has {live} of the {held} GPUs this job holds: "
                         f"{fit.describe(desired)}", live_gpus=live, was_gpus=held, fits=True,
                         training_lost=training_lost, train_gpus=fit.train_gpus,
                         rollout_instances=fit.rollout_instances, reason=reason)
        fingerprint = self.fingerprint_for(desired.rollout_tp)
        cost: dict[str, Any] | None = None
        if not training_lost or starting:
            self.store.change(lambda d: shrink_to_capacity(d, fit, fingerprint))
            self.wake()
        else:
            # the rollout pool first: its stops take the weight gate the training restart holds
            self.store.change(lambda d: dataclasses.replace(
                d, cluster_gpus=live, rollout_instances=fit.rollout_instances, rollout_fingerprint=fingerprint,
                reconfigure_strategy="diff", switch_now=True,
                reason=f"capacity: rollout {d.rollout_instances} -> {fit.rollout_instances} instances"))
            self.wake()
            self._wait_for_rollout_gpus(fit.rollout_instances * max(1, desired.rollout_tp))
            why = f"the cluster lost GPUs ({reason})" if reason else "the cluster lost GPUs"
            cost = self.executor.training.restart(
                why, fit.train_gpus, fit.train_layout,
                before=lambda: self.store.change(lambda d: shrink_to_capacity(d, fit, fingerprint, desired)))
            self.wake()
        seconds = round(time.monotonic() - started, 3)
        self.events.emit("capacity_replan", fit.describe(desired), training_restarted=cost is not None,
                         seconds=seconds, live_gpus=live)
        return {"training_restarted": cost is not None, "seconds": seconds, **(cost or {})}

    def _fit(self, desired: DesiredState, live: int, training_lost: bool) -> CapacityFit | None:
        gpr = self.cfg.global_resource_planner
        return fit_to_capacity(desired, live, training_lost=training_lost, min_train_gpus=gpr.min_train_gpus,
                               min_rollout_gpus=gpr.min_rollout_gpus, model=self.cfg.model_spec(),
                               gpus_per_node=self.cfg.cluster.gpus_per_node, train_problems=self.train_problems)

    def _wait_for_gpus(self, gpus: int, what: str) -> int:
        """Wait up to `runtime_node_loss_wait_s` for `gpus` GPUs alive; the GPUs alive then."""
        wait_s = self.cfg.global_resource_planner.runtime_node_loss_wait_s
        live = self._live()
        if live >= gpus or wait_s <= 0:
            return live
        self.events.emit("capacity_wait", f"the cluster has {live} GPUs alive; waiting up to {wait_s:g}s for {what}",
                         live_gpus=live, need_gpus=gpus, wait_s=wait_s)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and live < gpus and not self.stopping.is_set():
            self.stopping.wait(min(CAPACITY_CHECK_S, max(0.0, deadline - time.monotonic())))
            live = self._live()
        self.events.emit("capacity_wait_over", f"the cluster has {live} GPUs alive ({what}: "
                         f"{'back' if live >= gpus else 'not back'})", live_gpus=live, need_gpus=gpus)
        return live

    def restart_training(self, reason: str) -> dict[str, Any]:
        """After a training call lost a rank: re-plan when the cluster lost GPUs, else restart the pool at its
        size; a restart that cannot be placed (the rank's node is gone, Ray has not marked it dead yet) waits
        for the loss to show and re-plans. A restart whose nodes cannot reach each other (a partition between
        worker nodes, `NodesUnreachableError`) fences off the fewest nodes that lets the rest connect and
        re-plans onto the rest, as for a lost node."""
        from libra.cluster.training_workers import nodes_unreachable

        for _ in range(MAX_FENCE_ROUNDS):
            try:
                return self._restart_training(reason)
            except Exception as exc:
                unreachable = nodes_unreachable(exc)
                if unreachable is None:
                    raise
                reason = self._fence_off(unreachable, reason)
        return self._restart_training(reason)

    def fence_at_start(self, unreachable: NodesUnreachableError) -> None:
        """The training pool's first start found nodes whose ranks cannot reach each other (`unreachable`):
        fence off the fewest that lets the rest connect and set the pools' sizes for the GPUs left, as
        `restart_training` does after a step (the control loop then creates the training pool at its new
        size, off the fenced nodes). Raises CapacityLost when the smallest pools do not fit on the rest."""
        reason = self._fence_off(unreachable, "the training pool's first start")
        self.replan(training_lost=True, reason=reason, starting=True)

    def _fenced_words(self) -> str:
        """How the fence stands, for a message about the GPUs the job has ("" while no node is fenced)."""
        fenced = self.fence.fenced()
        if not fenced:
            return ""
        return " (not counting nodes fenced off: " + "; ".join(f"{f.address}, {f.reason}" for f in fenced) + ")"

    def _fence_off(self, unreachable: NodesUnreachableError, reason: str) -> str:
        """Fence off the nodes `unreachable` (a `NodesUnreachableError`) names; the restart's reason after it."""
        addresses = unreachable.addresses
        for node in unreachable.fence:
            peer_ids = sorted({b if a == node else a for a, b in unreachable.pairs if node in (a, b)})
            peers = sorted(addresses.get(p, p) for p in peer_ids)
            why = f"training ranks there could not reach {', '.join(peers)}"
            if self.fence.add(node, addresses.get(node, node), why, tuple(peer_ids)):
                self.events.emit("node_fenced", f"node {addresses.get(node, node)} is fenced off: {why}; the job "
                                 "re-plans onto the other nodes, as for a lost node", node_id=node,
                                 address=addresses.get(node, ""), unreachable=peers, reason=why)
        self.rechecks.start()
        return f"{reason}; nodes fenced off: {', '.join(addresses.get(n, n) for n in unreachable.fence)}"

    def _unfenced(self, fenced: FencedNode) -> None:
        """`fenced` reaches its peers again (`NodeRechecks`): lift the fence (`node_unfenced`); its GPUs then count
        again (the control loop's next reading raises `cluster_gpus`), and the pools keep their size, as after a
        lost node came back."""
        if self.fence.lift(fenced.node_id) is not None:
            self.events.emit("node_unfenced", f"node {fenced.address} reaches the nodes it could not again: its "
                             "GPUs count for the job again (the pools keep their size)", node_id=fenced.node_id,
                             address=fenced.address)
            self.wake()

    def _restart_training(self, reason: str) -> dict[str, Any]:
        replanned = self.replan(training_lost=True, reason=reason)
        if replanned is not None:
            return replanned
        held = gpus_in_use(self.store.get())

        def lost() -> str:  # Ray declared the node dead after the re-plan above read the cluster
            live = self._live()
            return f"the cluster has {live} of the {held} GPUs this job holds" if live < held else ""

        try:
            with self.placement_guard(lost):
                return self.executor.training.restart(reason)
        except Exception as exc:
            if not _not_placed(exc):
                raise
            log.warning("the training pool could not be placed again (%s); waiting for the cluster to show "
                        "what it lost", exc)
            deadline = time.monotonic() + NODE_DEATH_SEEN_S
            while time.monotonic() < deadline and not self.stopping.is_set():
                replanned = self.replan(training_lost=True, reason=reason)
                if replanned is not None:
                    return replanned
                self.stopping.wait(CAPACITY_CHECK_S)
            raise

    def _rollout_gpus_live(self, desired: DesiredState) -> int:
        return sum(m.gpus(desired.rollout_tp) for m in self.tracker.members(ROLLOUT) if m.live)

    def _rollout_gpus_held(self, desired: DesiredState) -> int:
        """The GPUs the rollout members still hold in Ray: live ones, and draining or failed ones whose stop has
        not ended (their placement groups are released by it; Ray places a lost node's groups again elsewhere
        until then)."""
        return sum(m.gpus(desired.rollout_tp) for m in self.tracker.members(ROLLOUT) if m.state != S.STOPPED)

    def _live(self) -> int:
        """The GPUs alive, never more than the configured cluster (a larger Ray cluster loses nothing of ours
        while it still has room for the job)."""
        return min(self.live_gpus(), self.cfg.total_gpus)

    def _rollout_holds_at_most(self, gpus: int, deadline: float,
                               held: Callable[[DesiredState], int] | None = None) -> bool:
        """Wait until the rollout members hold at most `gpus` GPUs (`held`, the live members' by default), until
        `deadline` (monotonic) or a stop; whether they do."""
        count = held or self._rollout_gpus_live
        while time.monotonic() < deadline and not self.stopping.is_set():
            if count(self.store.get()) <= gpus:
                return True
            self.stopping.wait(0.2)
        return count(self.store.get()) <= gpus

    def _wait_for_lost_rollout(self, live: int, training_kept: int) -> None:
        """Until the rollout instances of the lost GPUs are failed: the rollout pool and what training keeps
        fit the GPUs alive, or the health rule's bound (and a margin) has passed since the loss was seen (the
        survivors then hold more than fits, and the re-plan stops some)."""
        seen = self._lost_seen_at if self._lost_seen_at is not None else time.monotonic()
        if not self._rollout_holds_at_most(live - training_kept, seen + self.rollout_failed_within_s + 5.0):
            log.info("the rollout pool still holds more GPUs than are alive; the re-plan stops the surplus")

    def _wait_for_rollout_gpus(self, gpus: int) -> None:
        """Until the surplus stops have ended, not just begun: a stop in flight still holds its GPUs and waits for
        the weight gate, which the training restart then holds while its placement group cannot be placed."""
        if not self._rollout_holds_at_most(gpus, time.monotonic() + SURPLUS_STOPPED_S, self._rollout_gpus_held):
            log.warning("the rollout pool still holds more than %d GPUs; restarting the training pool anyway", gpus)


def _not_placed(exc: BaseException) -> bool:
    """Whether `exc` (or an error it came from) says a placement group was not placed in time."""
    return any(isinstance(seen, TimeoutError) and "was not placed" in str(seen) for seen in causes(exc))
