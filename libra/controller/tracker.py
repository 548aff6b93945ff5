"""The passive half of the reconciler: the controller's record of every pool member, updated from what the
pools report (observation) and from the executor (action begun, done, failed).

It never calls a pool itself. Observations are given as `MemberView`s; a view whose key no member has is a
server started by an earlier controller and is adopted as a new member (keeping its id when the id is one
of ours, `<pool>-<n>`); a live member whose key disappears from the views has failed (unless the report was
asked before its start ended). Every state change
goes through the transition table and into the event log. A member's weight version changes only through
`record_acks` (publish ACKs); its GPUs, TP, fingerprint and serving flag are what the pool reports.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from libra.config import Config
from libra.controller.events import EventLog
from libra.controller.members import InvalidTransition, Member, MemberState, Transition, next_member_ids
from libra.controller.state import ROLLOUT, TRAIN, ObservedState, PoolObservation, RolloutSpec

S = MemberState

EARLY_FAILURE_S = 120.0  # a member failing this soon after becoming READY counts towards the start back-off
EARLY_FAILURE_BACKOFF_S: float = Config.restart_backoff_s
EARLY_FAILURE_MAX_BACKOFF_S = 300.0
EARLY_FAILURE_FORGET_S = 1800.0  # an early failure this long after the previous one starts a new count


@dataclass(frozen=True)
class MemberView:
    """What a pool says about one of its members."""

    key: str
    state: MemberState
    info: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    tp: int = 0  # rollout instances: TP degree (0 = not reported)
    gpu_ids: tuple[str, ...] = ()
    fingerprint: str = ""
    serving: bool | None = None  # None: the pool does not route per instance (every live instance serves)
    weight_version: int | None = None  # as the pool's last ACK says; read at start and adoption only


@dataclass
class _Pool:
    created: bool = False
    busy: bool = False
    error: str = ""
    size: int = 0
    retry_at: float = 0.0
    failures: int = 0
    early_failures: int = 0  # members that failed soon after becoming READY, in a row
    last_early_failure: float = 0.0
    start_after: float = 0.0


class MemberTracker:
    def __init__(self, events: EventLog, started_for: dict[str, int] | None = None,
                 early_failure_backoff_s: float = EARLY_FAILURE_BACKOFF_S) -> None:
        """`started_for`: the generation each instance left by an earlier controller was started for, by
        instance key (see `events.started_generations`); an adopted member takes it over.
        `early_failure_backoff_s`: the first wait of the start back-off (`_count_failure_after_ready`)."""
        self.events = events
        self._early_failure_backoff_s = early_failure_backoff_s
        self._started_for = dict(started_for or {})
        self._members: dict[str, Member] = {}
        self._pools = {ROLLOUT: _Pool(), TRAIN: _Pool()}
        self._errors: list[str] = []
        self._adopted = 0
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._version = 0  # counts changes, for `wait_changed`
        self._settled_at: dict[str, int] = {}  # member id: the change that last bound it or ended its action

    @contextmanager
    def _changing(self) -> Iterator[None]:
        """Hold the lock for a change; waiters of `wait_changed` wake when it is made."""
        with self._changed:
            try:
                yield
            finally:
                self._version += 1
                self._changed.notify_all()

    @property
    def version(self) -> int:
        """A number that grows with every change (pass it to `wait_changed`, or to `observe` as `asked_at`)."""
        with self._lock:
            return self._version

    def wait_changed(self, since: int, timeout_s: float) -> bool:
        """Block until something changed after `version` was `since`, or `timeout_s` passed; True on a change."""
        with self._changed:
            return self._changed.wait_for(lambda: self._version != since, timeout=max(0.0, timeout_s))

    # ---- snapshot for the reconciler ------------------------------------------------------------------
    def snapshot(self, now: float, take_errors: bool = True) -> ObservedState:
        """The observation of one tick; it takes the action errors since the last one (unless told not to:
        a look from outside the control loop leaves them for the next tick)."""
        with self._lock:
            errors = tuple(self._errors)
            if take_errors:
                self._errors = []
            return ObservedState(
                now=now,
                rollout=self._pool_observation(ROLLOUT),
                train=self._pool_observation(TRAIN),
                members=tuple(copy.deepcopy(m) for m in self._members.values()),
                errors=errors,
            )

    def _pool_observation(self, pool: str) -> PoolObservation:
        p = self._pools[pool]
        return PoolObservation(created=p.created, busy=p.busy, error=p.error, size=p.size, retry_at=p.retry_at,
                               start_after=p.start_after)

    def members(self, pool: str | None = None) -> list[Member]:
        with self._lock:
            return [copy.deepcopy(m) for m in self._members.values() if pool is None or m.pool == pool]

    def member(self, member_id: str) -> Member:
        with self._lock:
            return copy.deepcopy(self._members[member_id])

    def counts(self, pool: str) -> dict[str, int]:
        with self._lock:
            counts: dict[str, int] = {}
            for m in self._members.values():
                if m.pool == pool:
                    counts[m.state.value] = counts.get(m.state.value, 0) + 1
            return counts

    @property
    def adopted(self) -> int:
        return self._adopted

    # ---- changes (executor) ---------------------------------------------------------------------------
    def add_member(self, member_id: str, pool: str, now: float, reason: str, spec: RolloutSpec | None = None,
                   generation: int = 0) -> None:
        with self._changing():
            if member_id in self._members:
                return
            member = Member.new(member_id, pool, now, reason)
            if spec is not None:
                member.tp, member.fingerprint = spec.tp, spec.fingerprint
            member.generation = generation
            self._members[member_id] = member
            described: dict[str, Any] = {"tp": spec.tp, "fingerprint": spec.fingerprint} if spec else {}
            self.events.emit("member_added", member=member_id, pool=pool, reason=reason, generation=generation,
                             **described)

    def record_acks(self, versions: dict[str, int]) -> None:
        """The weight version each member ACKed (member id -> publish version)."""
        with self._changing():
            for member_id, version in versions.items():
                if member_id in self._members:
                    self._members[member_id].weight_version = version

    def set_serving(self, member_ids: Iterable[str], pool: str = ROLLOUT) -> None:
        """Exactly `member_ids` of `pool` receive traffic (after the pool flipped routing)."""
        wanted = set(member_ids)
        with self._changing():
            for member in self._members.values():
                if member.pool == pool:
                    member.serving = member.id in wanted

    def move(self, member_id: str, target: MemberState, now: float, reason: str) -> list[Transition]:
        """Move a member along the table (through intermediate states when an observation skipped them).
        An illegal move is logged and ignored: observed reality never crashes the tracker."""
        with self._changing():
            member = self._members.get(member_id)
            if member is None:
                return []
            try:
                transitions = member.advance(target, now, reason)
            except InvalidTransition as exc:
                self.events.emit("invalid_transition", str(exc), member=member_id)
                return []
            for t in transitions:
                self.events.emit(
                    "member_failed" if t.target == S.FAILED else "transition",
                    member=member_id,
                    pool=member.pool,
                    source=t.source.value,
                    target=t.target.value,
                    reason=reason,
                )
                if t.target == S.FAILED:
                    self._count_failure_after_ready(member, now)
            return transitions

    def _count_failure_after_ready(self, member: Member, now: float) -> None:
        """Back off new starts in a pool whose members keep failing soon after becoming READY (e.g. a server
        that crashes on its first request): without it the reconciler would replace such a member every tick.
        The wait doubles with each early failure in a row; a member that served for a while resets it."""
        ready_at = [t.at for t in member.history if t.target == S.READY]
        if not ready_at:
            return  # failed while starting: the failed action already backs off the pool
        p = self._pools[member.pool]
        served_s = now - ready_at[-1]
        if served_s >= EARLY_FAILURE_S or now - p.last_early_failure >= EARLY_FAILURE_FORGET_S:
            p.early_failures = 0
        if served_s >= EARLY_FAILURE_S:
            return
        p.early_failures += 1
        p.last_early_failure = now
        wait = min(EARLY_FAILURE_MAX_BACKOFF_S, self._early_failure_backoff_s * 2 ** (p.early_failures - 1))
        p.start_after = max(p.start_after, now + wait)
        self.events.emit("start_backoff", f"{member.id} failed {served_s:.0f}s after becoming ready "
                         f"({p.early_failures} such failure(s) in a row); no new {member.pool} member starts for "
                         f"{wait:.0f}s", member=member.id, pool=member.pool, failures=p.early_failures,
                         wait_s=round(wait, 1))

    def set_busy(self, member_id: str, busy: bool) -> None:
        with self._changing():
            if member_id in self._members:
                self._members[member_id].busy = busy
                if not busy:
                    self._settled_at[member_id] = self._version

    def bind(self, member_id: str, key: str, info: dict[str, Any] | None = None) -> None:
        with self._changing():
            member = self._members[member_id]
            member.key = key
            self._settled_at[member_id] = self._version
            if info:
                member.info.update(info)

    def bind_view(self, member_id: str, view: MemberView) -> None:
        """Bind a member to what the pool reports after starting it, including the weights it loaded."""
        with self._changing():
            self.bind(member_id, view.key, view.info)
            member = self._members[member_id]
            _apply_view(member, view)
            if view.info.get("adopted"):
                member.generation = self._started_for.get(view.key, 0)
            if view.weight_version is not None:
                member.weight_version = view.weight_version

    def set_pool(self, pool: str, *, created: bool | None = None, busy: bool | None = None,
                 error: str | None = None, size: int | None = None) -> None:
        with self._changing():
            p = self._pools[pool]
            if created is not None:
                p.created = created
            if busy is not None:
                p.busy = busy
            if error is not None:
                p.error = error
            if size is not None:
                p.size = size

    def action_result(self, pool: str, now: float, error: str = "", backoff_s: float = 5.0,
                      max_backoff_s: float = 120.0) -> None:
        """Count consecutive failed actions on a pool; each failure doubles the wait before the next try."""
        with self._changing():
            p = self._pools[pool]
            if not error:
                p.failures, p.retry_at = 0, 0.0
                return
            p.failures += 1
            p.error = error
            p.retry_at = now + min(max_backoff_s, backoff_s * 2 ** (p.failures - 1))
            self._errors.append(error)

    def record_error(self, message: str) -> None:
        with self._changing():
            self._errors.append(message)

    # ---- observation (passive step) -------------------------------------------------------------------
    def observe(self, pool: str, views: Iterable[MemberView], now: float, asked_at: int | None = None) -> None:
        """Fold one pool report into the members: bind, adopt, advance, and fail the vanished. `asked_at`: the
        tracker's `version` when the report was asked; a member bound, or whose action ended, since then is
        not failed for missing from it (the report may predate its start: a pool busy with a publish answers
        late, and the start ends meanwhile)."""
        views = list(views)
        with self._changing():
            by_key = {m.key: m for m in self._members.values() if m.pool == pool and m.key}
            unbound = sorted(
                (m for m in self._members.values() if m.pool == pool and not m.key and not m.busy and m.live),
                key=lambda m: m.id,
            )
            # while a member is being started its server may already be listed: never adopt it twice
            starting = any(m.pool == pool and m.busy and not m.key for m in self._members.values())
            for view in views:
                member = by_key.get(view.key)
                if member is None and unbound:
                    member = unbound.pop(0)
                    self.bind(member.id, view.key)
                if member is None:
                    if starting:
                        continue
                    member = self._adopt(pool, view, now)
                member.info.update(view.info)
                _apply_view(member, view)
                if member.state in (S.STOPPED, S.FAILED) or member.busy:
                    continue
                if view.state != member.state:
                    reason = view.error or f"observed {view.state.value}"
                    self.move(member.id, view.state, now, reason)
            seen = {v.key for v in views}
            for member in list(self._members.values()):
                if member.pool != pool or member.busy or not member.key or member.key in seen:
                    continue
                if asked_at is not None and self._settled_at.get(member.id, -1) >= asked_at:
                    continue
                if member.state in (S.STARTING, S.LOADING, S.READY, S.DRAINING):
                    self.move(member.id, S.FAILED, now, "no longer reported by the pool")

    def _adopt(self, pool: str, view: MemberView, now: float) -> Member:
        own_id = view.key.startswith(f"{pool}-") and view.key not in self._members
        member_id = view.key if own_id else next_member_ids(self._members, pool, 1)[0]
        member = Member.new(member_id, pool, now, reason="adopted a running member", key=view.key)
        member.weight_version = view.weight_version
        member.generation = self._started_for.get(view.key, 0)
        self._members[member_id] = member
        self._adopted += 1
        self.events.emit("member_adopted", member=member_id, pool=pool, key=view.key, info=view.info)
        return member


def _apply_view(member: Member, view: MemberView) -> None:
    """What the pool reports about a member's placement, spec and routing (never its weight version)."""
    if view.tp:
        member.tp = view.tp
    if view.gpu_ids:
        member.gpu_ids = tuple(view.gpu_ids)
    if view.fingerprint:
        member.fingerprint = view.fingerprint
    member.serving = member.live if view.serving is None else view.serving
