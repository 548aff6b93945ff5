"""Pool members (rollout instances, training workers) and the transition table every member moves through.

```
PENDING -> STARTING -> LOADING -> READY -> DRAINING -> STOPPED
   any live state -> FAILED -> STOPPED            READY -> LOADING (weight reload)
```

A member records each transition with its time and reason; a state held longer than its timeout is a
failure the reconciler acts on. Only this module changes a member's state, and only along the table.

A rollout member also carries its spec (TP, launch fingerprint), the GPUs it runs on, whether it receives
traffic, the desired-state generation it was started for, and the weight version it serves (taken from
publish ACKs only). Member ids are one id space, `<pool>-<n>`, handed out by `next_member_ids`; the
rollout pool uses the same id for the instance.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class MemberState(StrEnum):
    PENDING = "PENDING"  # wanted, nothing started yet
    STARTING = "STARTING"  # process / actor being created
    LOADING = "LOADING"  # process up, loading weights or waiting for health
    READY = "READY"  # serving (rollout) or initialised (training)
    DRAINING = "DRAINING"  # finishing in-flight work before it stops
    STOPPED = "STOPPED"  # gone (terminal)
    FAILED = "FAILED"  # broken; the reconciler stops and replaces it


S = MemberState

TRANSITIONS: dict[MemberState, frozenset[MemberState]] = {
    S.PENDING: frozenset({S.STARTING, S.STOPPED, S.FAILED}),
    S.STARTING: frozenset({S.LOADING, S.READY, S.DRAINING, S.STOPPED, S.FAILED}),
    S.LOADING: frozenset({S.READY, S.DRAINING, S.STOPPED, S.FAILED}),
    S.READY: frozenset({S.LOADING, S.DRAINING, S.STOPPED, S.FAILED}),
    S.DRAINING: frozenset({S.STOPPED, S.FAILED}),
    S.FAILED: frozenset({S.STOPPED}),
    S.STOPPED: frozenset(),
}

LIVE_STATES = frozenset({S.PENDING, S.STARTING, S.LOADING, S.READY})
"""States that count towards a pool's size (a draining or failed member is on its way out)."""


class InvalidTransition(RuntimeError):
    def __init__(self, member_id: str, current: MemberState, target: MemberState) -> None:
        allowed = ", ".join(sorted(s.value for s in TRANSITIONS[current])) or "none (terminal)"
        super().__init__(
            f"member {member_id}: {current.value} -> {target.value} is not in the transition table "
            f"(allowed from {current.value}: {allowed})"
        )
        self.member_id, self.current, self.target = member_id, current, target


@dataclass(frozen=True)
class StateTimeouts:
    """Longest time (s) a member may stay in a state before it counts as failed (0 = no limit)."""

    pending_s: float = 60.0
    starting_s: float = 600.0
    loading_s: float = 900.0
    draining_s: float = 180.0

    def limit(self, state: MemberState) -> float:
        return {
            S.PENDING: self.pending_s,
            S.STARTING: self.starting_s,
            S.LOADING: self.loading_s,
            S.DRAINING: self.draining_s,
        }.get(state, 0.0)


@dataclass(frozen=True)
class Transition:
    at: float
    source: MemberState
    target: MemberState
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"at": self.at, "from": self.source.value, "to": self.target.value, "reason": self.reason}


def next_member_ids(used: Collection[str], pool: str, count: int) -> tuple[str, ...]:
    """The `count` lowest free ids `<pool>-<n>`: the only place member (and rollout instance) ids are made."""
    ids: list[str] = []
    index = 0
    while len(ids) < count:
        candidate = f"{pool}-{index}"
        if candidate not in used:
            ids.append(candidate)
        index += 1
    return tuple(ids)


@dataclass
class Member:
    """One pool member. `key` is the pool's own id once known (rollout instance id, training rank)."""

    id: str
    pool: str  # "rollout" | "train"
    state: MemberState
    since: float
    key: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    busy: bool = False  # an action on this member is in flight
    history: list[Transition] = field(default_factory=list)
    # ---- rollout members: spec and generation ----
    tp: int = 0  # 0 = unknown (then the desired TP is assumed)
    fingerprint: str = ""  # launch settings; "" = unknown
    gpu_ids: tuple[str, ...] = ()
    generation: int = 0  # the desired-state generation it was started for (0 = adopted, unknown)
    weight_version: int | None = None  # the publish version it holds, from ACKs (None = unknown)
    serving: bool = False  # receives generation requests

    @classmethod
    def new(cls, member_id: str, pool: str, now: float, reason: str = "wanted", key: str = "") -> Member:
        member = cls(id=member_id, pool=pool, state=S.PENDING, since=now, key=key)
        member.history.append(Transition(now, S.PENDING, S.PENDING, reason))
        return member

    def gpus(self, default_tp: int) -> int:
        """GPUs this member holds (its TP, or `default_tp` while the pool has not reported it)."""
        return len(self.gpu_ids) or self.tp or default_tp

    def can_move_to(self, target: MemberState) -> bool:
        return target in TRANSITIONS[self.state]

    def move(self, target: MemberState, now: float, reason: str) -> Transition | None:
        """Apply one transition along the table; moving to the current state is a no-op (returns None)."""
        if target == self.state:
            return None
        if not self.can_move_to(target):
            raise InvalidTransition(self.id, self.state, target)
        transition = Transition(now, self.state, target, reason)
        self.history.append(transition)
        self.state = target
        self.since = now
        if target == S.FAILED:
            self.error = reason
        return transition

    def path_to(self, target: MemberState) -> list[MemberState]:
        """States to pass through to reach `target` along the main line (e.g. PENDING->READY passes
        STARTING and LOADING), so an observation that skipped steps is still recorded as legal moves."""
        order = [S.PENDING, S.STARTING, S.LOADING, S.READY]
        if self.state in order and target in order:
            i, j = order.index(self.state), order.index(target)
            if j > i:
                return order[i + 1 : j + 1]
        return [target]

    def advance(self, target: MemberState, now: float, reason: str) -> list[Transition]:
        return [t for state in self.path_to(target) if (t := self.move(state, now, reason)) is not None]

    def age(self, now: float) -> float:
        return max(0.0, now - self.since)

    def timed_out(self, now: float, timeouts: StateTimeouts) -> bool:
        limit = timeouts.limit(self.state)
        return limit > 0 and self.age(now) > limit

    @property
    def live(self) -> bool:
        return self.state in LIVE_STATES

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "pool": self.pool,
            "key": self.key,
            "state": self.state.value,
            "since": self.since,
            "error": self.error,
            "info": self.info,
            "tp": self.tp,
            "fingerprint": self.fingerprint,
            "gpu_ids": list(self.gpu_ids),
            "generation": self.generation,
            "weight_version": self.weight_version,
            "serving": self.serving,
            "history": [t.to_dict() for t in self.history],
        }
