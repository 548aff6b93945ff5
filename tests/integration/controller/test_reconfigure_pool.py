"""The controller's reconfiguration on real vLLM-CPU servers: the reconciler, its executor and the real
rollout edge (no training pool), driven by reconfiguration requests as `Controller.request_reconfigure`
makes them.

1. `diff` 1 -> 2 instances: only the new instance starts (under the id the reconciler chose), it is given
   the current weights before it serves, and the first instance is never touched;
2. `blue_green` 2 -> 1 under a steady request stream: serving flips to one instance, the other drains;
   no request fails and a serving instance exists throughout;
3. `blue_green` TP 1 -> 2 under the stream: a TP 2 instance starts on spare GPUs, serving flips to it, the
   TP 1 instance drains; no request fails.

Two server starts beyond the first.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from libra.cluster.ray_runtime import RayRuntime
from libra.config.mapping import config_with, tiny_model_spec
from libra.config.sections import TinyModelConfig
from libra.controller.control_loop import ControlLoop
from libra.controller.desired_store import DesiredStore
from libra.controller.events import EventLog
from libra.controller.executor import Executor
from libra.controller.gate import WeightsRef
from libra.controller.pools import RolloutPoolEdge, rollout_fingerprint
from libra.controller.reconfigure import (
    ReconfigureLimits,
    ReconfigureTarget,
    finish_if_converged,
    plan_reconfigure,
)
from libra.controller.state import ROLLOUT, DesiredState, ObservedState, TrainLayout
from libra.controller.tracker import MemberTracker, MemberView
from libra.models.tiny import build_tiny_model
from libra.run_dir import RunDir
from planner.model_spec import load_model_spec

pytestmark = pytest.mark.slow
CHANGE_S = 420  # a vLLM-CPU server start on 2 loaded cores, with margin


class NoTraining:
    """This test runs the rollout side only (the desired state wants no training GPUs)."""

    def create(self, gpus: int, layout: TrainLayout) -> list[MemberView]:
        raise AssertionError("no training pool is wanted")

    def views(self) -> list[MemberView]:
        return []


@dataclass
class Rig:
    edge: RolloutPoolEdge
    tracker: MemberTracker
    executor: Executor
    loop: ControlLoop
    store: DesiredStore
    events: EventLog
    limits: ReconfigureLimits

    def request(self, instances: int | None, strategy: str, tp: int | None = None) -> DesiredState:
        observed = self.tracker.snapshot(time.time(), take_errors=False)
        return self.store.change(lambda d: plan_reconfigure(d, ReconfigureTarget(instances, tp), strategy,
                                                            self.limits, observed))

    def wait_done(self, timeout: float) -> None:
        assert self.loop.wait_until(lambda: not self.store.get().reconfiguring, timeout), (
            f"reconfiguration not done: {self.store.get().reconfiguring}; members "
            f"{[(m.id, m.state.value, m.serving) for m in self.tracker.members(ROLLOUT)]}; "
            f"events {self.events.recent(15)}")


@pytest.fixture(scope="module")
def rig(ray_runtime: RayRuntime, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    root = tmp_path_factory.mktemp("reconfigure")
    run = RunDir.at(root / "run").create()
    # head_dim 32: vLLM-CPU's attention has no kernel for the head_dim 16 of the shared tiny model
    tiny_model_dir = build_tiny_model(str(root / "model"), tiny_model_spec(TinyModelConfig(
        arch="llama", hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128,
        max_position_embeddings=256, init_std=0.02, seed=0)))
    cfg = config_with(tiny_model_dir, max_model_len=256, rollout_port_base=0, rollout_enforce_eager=True,
                      rollout_kv_cache_bytes=32 * 2**20, rollout_weight_reload_method="inplace", seed=0,
                      cluster={"num_nodes": 1, "gpus_per_node": 4, "gpu_type": "cpu-logical", "logical_gpus": True},
                      global_resource_planner={"runtime_dynamic_reconfiguration_enabled": True})
    events = EventLog(run.events_jsonl)
    tracker = MemberTracker(events)
    edge = RolloutPoolEdge(cfg, run, ray_runtime)
    executor = Executor(tracker, edge, NoTraining(), events)
    store = DesiredStore(run.desired_state_json, DesiredState(
        rollout_instances=1, rollout_tp=1, train_gpus=0, train_layout=TrainLayout(), generation=1,
        rollout_fingerprint=rollout_fingerprint(cfg, run, 1), cluster_gpus=4))

    def on_observed(observed: ObservedState, desired: DesiredState) -> None:
        done = finish_if_converged(observed, desired)
        if done is not None and store.replace_if(desired, done):
            events.emit("reconfigure_done", desired.reconfiguring)

    loop = ControlLoop(tracker, executor, edge, NoTraining(), store.get, events, interval_s=0.5,
                       on_observed=on_observed)
    limits = ReconfigureLimits(enabled=True, cluster_swap_enabled=False, gpus_per_node=4,
                               model=load_model_spec(tiny_model_dir), drain_before_stop=True,
                               fingerprint_for=lambda tp: rollout_fingerprint(cfg, run, tp))
    loop.start()
    try:
        yield Rig(edge, tracker, executor, loop, store, events, limits)
    finally:
        loop.stop()
        executor.wait_idle(300)
        executor.shutdown()
        if edge.pool is not None:
            edge.pool.shutdown()


def test_diff_starts_only_the_new_instance_on_current_weights(rig: Rig, tmp_path: Path) -> None:
    assert rig.loop.wait_until(lambda: rig.tracker.counts(ROLLOUT).get("READY", 0) == 1, CHANGE_S)
    pool = rig.edge.pool
    assert pool is not None
    first = pool.instances()[0]
    assert first.id == "rollout-0" and first.serving
    # weights v1 = the model itself, published through the executor's gate as the RL loop does
    from libra.rollout.weights_checksum import checksum_hf_weights

    weights = WeightsRef(1, str(Path(pool.spec.model_path)), checksum_hf_weights(pool.spec.model_path))
    rig.executor.publish_weights(weights)
    rig.store.update(weight_version=1)
    rig.request(2, "diff")
    rig.wait_done(CHANGE_S)
    infos = {i.id: i for i in pool.instances()}
    assert sorted(infos) == ["rollout-0", "rollout-1"]
    assert all(i.serving and i.weight_version == 1 for i in infos.values()), infos
    assert infos["rollout-0"].pid == first.pid  # the unchanged instance was not touched
    assert rig.tracker.member("rollout-1").weight_version == 1


class RequestStream:
    """Requests one after another from a thread of its own, counting answers and failures, and how many
    instances serve after each answer."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.failures: list[str] = []
        self.answered = 0
        self.serving_seen: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="request-stream")

    async def _run(self) -> None:
        while not self._stop.is_set():
            try:
                await self.pool.generate([5, 6, 7, 8], n=2, max_new_tokens=4, temperature=1.0, seed=self.answered)
                self.answered += 1
            except Exception as exc:
                self.failures.append(f"{type(exc).__name__}: {exc}")
            self.serving_seen.append(sum(1 for i in self.pool.instances() if i.serving and i.state == "ready"))

    def __enter__(self) -> RequestStream:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)


def test_blue_green_shrink_fails_no_request(rig: Rig) -> None:
    pool = rig.edge.pool
    assert pool is not None
    with RequestStream(pool) as stream:
        time.sleep(2)
        rig.request(1, "blue_green")
        rig.wait_done(CHANGE_S)
        time.sleep(1)
    assert stream.failures == []
    assert stream.answered > 0 and min(stream.serving_seen) >= 1
    assert sorted(i.id for i in pool.instances()) == ["rollout-0"]  # the oldest kept serving, the newer drained


def test_blue_green_tp_one_to_two_fails_no_request(rig: Rig) -> None:
    pool = rig.edge.pool
    assert pool is not None
    with RequestStream(pool) as stream:
        time.sleep(2)
        rig.request(None, "blue_green", tp=2)
        rig.wait_done(CHANGE_S)
        time.sleep(1)
    assert stream.failures == []
    assert stream.answered > 0 and min(stream.serving_seen) >= 1
    infos = pool.instances()
    assert [(i.tp_size, i.serving, len(i.gpu_ids)) for i in infos] == [(2, True, 2)], infos
    assert infos[0].fingerprint == rig.store.get().rollout_fingerprint
