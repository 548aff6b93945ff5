"""Fake pool edges for controller unit tests: in-memory stand-ins for the rollout and training pools at the
executor's edge (the real pools are exercised by tests/integration/controller).

The fake rollout pool behaves like the actuator: instances are named by the caller, hold GPUs, start
without traffic, serve only once `set_serving` names them (refused unless READY and on the published
weights), and report the weight version of their last ACK."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from libra.controller.executor import PublishOutcome
from libra.controller.gate import WeightsRef
from libra.controller.members import MemberState
from libra.controller.state import RolloutSpec, TrainLayout
from libra.controller.tracker import MemberView


@dataclass
class FakeInstance:
    state: MemberState
    tp: int
    gpu_ids: tuple[int, ...]
    fingerprint: str = ""
    serving: bool = False
    weight_version: int = 0


class FakeRolloutEdge:
    """`gpus` GPUs for rollout (0 = unlimited); `fail_next` makes the next create/start/stop/publish/serve
    raise; `ops` records every call in order; `gate`, when set, makes start() block until it is set, and
    `stop_gate` stop() (a drain that takes a while)."""

    def __init__(self, preexisting: int = 0, gpus: int = 0, spec: RolloutSpec = RolloutSpec(1)) -> None:
        self.instances: dict[str, FakeInstance] = {}
        self.gpus = gpus
        self.published = 0
        self.launch_version: int | None = None  # the version new instances load (None: the published one)
        self.fail_next: set[str] = set()
        self.removed: list[tuple[str, bool]] = []
        self.ops: list[tuple[str, ...]] = []
        self.gate: threading.Event | None = None
        self.stop_gate: threading.Event | None = None
        self._lock = threading.Lock()
        for index in range(preexisting):
            self._new(f"rollout-{index}", spec, serving=True)

    def _free_gpus(self) -> list[int]:
        used = {int(g) for i in self.instances.values() for g in i.gpu_ids}
        limit = self.gpus or 1024
        return [g for g in range(limit) if g not in used]

    def _new(self, key: str, spec: RolloutSpec = RolloutSpec(1), serving: bool = False) -> FakeInstance:
        with self._lock:
            free = self._free_gpus()
            if len(free) < spec.tp:
                raise RuntimeError(f"fake pool: {key} needs {spec.tp} GPUs, {len(free)} free")
            version = self.published if self.launch_version is None else self.launch_version
            instance = FakeInstance(MemberState.READY, spec.tp, tuple(str(g) for g in free[: spec.tp]),
                                    spec.fingerprint, serving, version)
            self.instances[key] = instance
            return instance

    def _maybe_fail(self, op: str) -> None:
        if op in self.fail_next:
            self.fail_next.discard(op)
            raise RuntimeError(f"fake {op} failure")

    def create(self, member_ids: Sequence[str], spec: RolloutSpec) -> list[MemberView]:
        self.ops.append(("create", *member_ids))
        self._maybe_fail("create")
        for member_id in member_ids:
            if len(self.instances) >= len(member_ids):
                break
            if member_id not in self.instances:
                self._new(member_id, spec, serving=True)
        return self.views()

    def start(self, member_id: str, spec: RolloutSpec) -> MemberView:
        self.ops.append(("start", member_id))
        self._maybe_fail("start")
        if self.gate is not None:
            self.gate.wait(10)
        if member_id not in self.instances:
            self._new(member_id, spec)
        return self._view(member_id, self.instances[member_id])

    def stop(self, key: str, drain: bool) -> None:
        self.ops.append(("stop", key))
        self._maybe_fail("stop")
        if self.stop_gate is not None:
            self.stop_gate.wait(10)
        self.removed.append((key, drain))
        with self._lock:
            self.instances.pop(key, None)

    def publish(self, weights: WeightsRef, keys: Sequence[str] | None) -> PublishOutcome:
        self.ops.append(("publish", str(weights.version), *(keys or ["*"])))
        self._maybe_fail("publish")
        with self._lock:
            targets = list(self.instances) if keys is None else list(keys)
            for key in targets:
                self.instances[key].weight_version = weights.version
            if keys is None:
                self.published = weights.version
            return PublishOutcome({key: weights.version for key in targets}, {"acks_validated": len(targets)})

    def set_serving(self, keys: Sequence[str]) -> None:
        self.ops.append(("serve", *keys))
        self._maybe_fail("serve")
        with self._lock:
            for key in keys:
                instance = self.instances[key]
                if instance.state != MemberState.READY or instance.weight_version != self.published:
                    raise RuntimeError(f"fake pool: {key} is not READY on weights v{self.published}")
            for key, instance in self.instances.items():
                instance.serving = key in keys

    def serving(self) -> list[str]:
        return sorted(k for k, i in self.instances.items() if i.serving)

    @staticmethod
    def _view(key: str, i: FakeInstance) -> MemberView:
        return MemberView(key, i.state, tp=i.tp, gpu_ids=i.gpu_ids, fingerprint=i.fingerprint, serving=i.serving,
                          weight_version=i.weight_version)

    def views(self) -> list[MemberView]:
        with self._lock:
            return [self._view(k, i) for k, i in sorted(self.instances.items())]


class FakeTrainingEdge:
    """Ranks `rank-<i>@<epoch>` that report their layout; `resize` replaces them all (like the checkpoint
    path), records each call in `resizes`, fails once when `fail_resize` is set (the pool is then down) and
    blocks while `gate` is set and not released."""

    def __init__(self) -> None:
        self.workers: list[str] = []
        self.layouts: list[tuple[int, TrainLayout]] = []
        self.layout = TrainLayout()
        self.fail_next = False
        self.fail_resize = False
        self.resizes: list[tuple[int, TrainLayout]] = []
        self.gate: threading.Event | None = None
        self.epoch = 0

    def create(self, gpus: int, layout: TrainLayout) -> list[MemberView]:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("fake training start failure")
        self.layouts.append((gpus, layout))
        self.layout = layout
        self.workers = [f"rank-{i}" for i in range(gpus)]
        return self.views()

    def resize(self, gpus: int, layout: TrainLayout, on_measured=None):  # type: ignore[no-untyped-def]
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail_resize:
            self.fail_resize = False
            self.workers = []
            raise RuntimeError("fake training resize failure")
        self.resizes.append((gpus, layout))
        self.epoch += 1
        before = (len(self.workers), self.layout.dims(len(self.workers)))
        self.layouts.append((gpus, layout))
        self.layout = layout
        self.workers = [f"rank-{i}@{self.epoch}" for i in range(gpus)]
        cost = {"from_gpus": before[0], "from_layout": before[1], "to_gpus": gpus, "to_layout": layout.dims(gpus),
                "step": 0, "save_s": 0.1, "stop_s": 0.1, "start_s": 0.2, "load_s": 0.1, "switch_s": 0.5,
                "first_step_s": None, "label": f"{before[0]} -> {gpus}"}
        if on_measured is not None:
            on_measured({**cost, "first_step_s": 0.3})
        return self.views(), cost

    @property
    def gpus(self) -> int:
        return len(self.workers)

    def restart(self, gpus=None, layout=None):  # type: ignore[no-untyped-def]
        """Every rank replaced, at the same size and layout or at `gpus` under `layout` (after a worker was
        lost, or its node)."""
        before = self.gpus
        self.epoch += 1
        self.layout = layout or self.layout
        self.workers = [f"rank-{i}@{self.epoch}" for i in range(gpus or len(self.workers))]
        return self.views(), {"from_gpus": before, "to_gpus": self.gpus, "stop_s": 0.1, "start_s": 0.2,
                              "switch_s": 0.3, "recovered": True}

    def views(self) -> list[MemberView]:
        return [MemberView(w, MemberState.READY, fingerprint=self.layout.label()) for w in self.workers]
