"""The swap rig: the reconfiguration rig (reconfigure_rig.py) with a training pool, for GPU exchanges between
the training and the rollout pool (cluster swap) and training-pool resizes, plus a `TrainingDriver` thread
that plays the RL loop: it trains one step after another on the training pool and publishes the weights to
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
from pathlib import Path
from typing import Any

from libra.cluster.ray_runtime import RayRuntime
from libra.controller.gate import WeightsRef

from .reconfigure_rig import Rig, RigShape, build_rig


def build_swap_rig(runtime: RayRuntime, root: Path, cluster_gpus: int = 4, train_gpus: int = 2,
                   instances: int = 2, tick_s: float = 0.5, trace_dir: Path | None = None) -> Rig:
    """A job of `train_gpus` training GPUs and `instances` rollout instances on one node of `cluster_gpus`
    GPUs, with cluster swap and training-pool reconfiguration on; run it with `running(rig, sample_s=...)`."""
    shape = RigShape(num_nodes=1, gpus_per_node=cluster_gpus, instances=instances, cluster_swap_enabled=True,
                     tick_s=tick_s, train_gpus=train_gpus)
    return build_rig(runtime, root, shape, trace_dir=trace_dir)


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

    def __init__(self, rig: Rig, publish_every: int = 1) -> None:
        if rig.train is None:
            raise ValueError("the rig has no training pool: build it with RigShape.train_gpus > 0")
        self.rig = rig
        self.train = rig.train
        self.publish_every = publish_every
        self.steps: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="training-driver", daemon=True)

    def _run(self) -> None:
        from libra.rollout.weights_checksum import checksum_hf_weights

        pool = self.train.pool
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
