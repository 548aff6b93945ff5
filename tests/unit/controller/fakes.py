"""Fake pool edges for controller unit tests: in-memory stand-ins for the rollout and training pools at the
executor's edge (the real pools are exercised by tests/integration/controller)."""

from __future__ import annotations

import threading

from libra.controller.members import MemberState
from libra.controller.state import TrainLayout
from libra.controller.tracker import MemberView


class FakeRolloutEdge:
    """Instances are dict entries; `fail_next` makes the next create/add/remove raise."""

    def __init__(self, preexisting: int = 0) -> None:
        self.instances: dict[str, MemberState] = {}
        self.counter = 0
        self.fail_next: set[str] = set()
        self.removed: list[tuple[str, bool]] = []
        self.gate: threading.Event | None = None  # when set, add() blocks until the event is set
        self._lock = threading.Lock()
        for _ in range(preexisting):
            self._new()

    def _new(self) -> str:
        with self._lock:
            key = f"inst-{self.counter}"
            self.counter += 1
            self.instances[key] = MemberState.READY
            return key

    def _maybe_fail(self, op: str) -> None:
        if op in self.fail_next:
            self.fail_next.discard(op)
            raise RuntimeError(f"fake {op} failure")

    def create(self, num_instances: int) -> list[MemberView]:
        self._maybe_fail("create")
        while len(self.instances) < num_instances:
            self._new()
        return self.views()

    def add(self) -> MemberView:
        self._maybe_fail("add")
        if self.gate is not None:
            self.gate.wait(10)
        key = self._new()
        return MemberView(key, MemberState.READY)

    def remove(self, key: str, drain: bool) -> None:
        self._maybe_fail("remove")
        self.removed.append((key, drain))
        with self._lock:
            self.instances.pop(key, None)

    def views(self) -> list[MemberView]:
        with self._lock:
            return [MemberView(k, s) for k, s in sorted(self.instances.items())]


class FakeTrainingEdge:
    def __init__(self) -> None:
        self.workers: list[str] = []
        self.layouts: list[tuple[int, TrainLayout]] = []
        self.fail_next = False

    def create(self, gpus: int, layout: TrainLayout) -> list[MemberView]:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("fake training start failure")
        self.layouts.append((gpus, layout))
        self.workers = [f"rank-{i}" for i in range(gpus)]
        return self.views()

    def views(self) -> list[MemberView]:
        return [MemberView(w, MemberState.READY) for w in self.workers]
