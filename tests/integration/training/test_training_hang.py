"""A training rank that stops answering (SIGSTOP: frozen, as a rank stuck in a collective or on a device that
no longer answers) on a real Megatron-Core pool of two ranks: the step fails as hung once it outlives the hang
rule's deadline, replacing the workers ends the frozen process and everything it started, and the new pool,
resumed from the checkpoint, trains the step as the uninterrupted pool did."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
from training_cases import offpolicy_samples, pool_spec, still_running

from libra.cluster.ray_runtime import RayRuntime
from libra.cluster.training_workers import WorkerHungError
from libra.training.pool import TrainingPool

TOLERANCE = 1e-5
HANG_TIMEOUT_S = 5.0
HANG_FACTOR = 4.0


def test_a_frozen_rank_fails_the_step_as_hung_and_the_replaced_pool_trains_it_again(
        ray_runtime: RayRuntime, training_models: dict[str, str], tmp_path) -> None:
    spec = pool_spec(training_models["llama"], 2,
                     config={"train_hang_timeout_s": HANG_TIMEOUT_S, "train_hang_timeout_factor": HANG_FACTOR},
                     micro_batch_size=1, recompute_logprobs=False)
    root = str(tmp_path / "ckpt")
    pool = TrainingPool(ray_runtime, spec, name="hang")
    frozen: list[int] = []
    try:
        pool.start()
        pool.train_step(offpolicy_samples(1), 1)
        pool.save_checkpoint(root, 1)
        expected = pool.train_step(offpolicy_samples(2), 2)
        pool.load_checkpoint(root)
        deadline = pool.deadlines.deadline("train_step")
        assert deadline == max(HANG_TIMEOUT_S, HANG_FACTOR * pool.deadlines.history()["train_step"])

        pids = pool.worker_pids()
        children = [c.pid for c in psutil.Process(pids[1]).children(recursive=True)]
        os.kill(pids[1], signal.SIGSTOP)
        frozen = [pids[1]]
        started = time.monotonic()
        with pytest.raises(WorkerHungError, match=f"did not finish within {deadline:.0f}s") as hung:
            pool.train_step(offpolicy_samples(2), 2)
        waited = time.monotonic() - started
        assert deadline - 0.5 <= waited <= deadline + 30, (waited, deadline)
        assert hung.value.ranks == [0, 1], "both ranks were waiting: the frozen one and the one blocked on it"

        cost = pool.replace_workers()
        assert cost.recovered and set(pool.worker_pids()).isdisjoint(pids)
        assert still_running(pids + children, wait_s=60) == [], "a process of the hung pool outlived its replacement"
        frozen = []
        assert pool.load_checkpoint(root) == 1
        again = pool.train_step(offpolicy_samples(2), 2)
        assert abs(again["loss"] - expected["loss"]) < TOLERANCE
        assert abs(again["grad_norm"] - expected["grad_norm"]) < TOLERANCE
    finally:
        for pid in frozen:  # whatever the test found, nothing it froze outlives it
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        pool.shutdown()
