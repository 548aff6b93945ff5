"""Disk full while a real training pool (Megatron-Core on gloo, one rank on Ray) writes a job checkpoint into
a small tmpfs run directory (needs root to mount; skipped otherwise): the write fails with a `DiskFullError`
that names the folder, says the disk is full and what to do; the half-written folder is removed, the
previous checkpoint and its `latest` marker stay whole, and once space is freed the run resumes from that
checkpoint and saves the next one. The same for the export of a step's weights for the rollout servers: the
rank's error says the disk is full (so the controller need not guess from the free space), the folder goes,
and once space is freed the export is written whole."""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_training_grpo import toy_batch
from training_cases import pool_spec

from libra.controller.checkpoints import (
    CheckpointStore,
    ControllerState,
    DiskFullError,
    disk_full_error,
    restore_newest,
    says_disk_full,
    weights_disk_full_error,
)
from libra.run_dir import RunDir
from libra.training.checkpoint import LATEST

FILLER = "filler"


@pytest.fixture
def small_run_disk(tmpfs_disk: Callable[[str], Path]) -> Path:
    return tmpfs_disk("64m")


def fill_to_the_byte(disk: Path) -> None:
    with open(disk / FILLER, "wb", buffering=0) as fh:
        for chunk in (1 << 20, 512):
            try:
                while True:
                    fh.write(b"\0" * chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC


def save(store: CheckpointStore, pool: Any, step: int) -> Path:
    """What the RL loop does for a checkpoint: the pool's part, then the controller state last."""
    pool.save_checkpoint(str(store.begin(step)), step)
    return store.commit(ControllerState(step=step))


def job_on(disk: Path, start_pool: Callable[..., Any], model_dir: str) -> tuple[RunDir, CheckpointStore, Any]:
    """A run directory on `disk`, its checkpoint store and a training pool of one rank."""
    run = RunDir.at(disk / "run").create()
    return run, CheckpointStore(run, keep_last=3, keep_every=0), start_pool(pool_spec(model_dir, 1))


def test_a_full_disk_mid_checkpoint_keeps_the_previous_one_and_resumes_from_it(
    small_run_disk: Path, start_pool: Callable[..., Any], tiny_model_dir: str
) -> None:
    run, store, pool = job_on(small_run_disk, start_pool, tiny_model_dir)
    pool.train_step(toy_batch(pool)[0], 1)  # an optimizer with state, as a checkpoint of a running job has
    first = save(store, pool, 1)
    marker = next(first.glob(f"train/{LATEST}*"))
    marker_text = marker.read_text()

    fill_to_the_byte(small_run_disk)
    with pytest.raises(Exception) as failed:
        save(store, pool, 2)
    error = disk_full_error(store, 2, failed.value)

    assert isinstance(error, DiskFullError), failed.value
    message = str(error)
    assert "disk is full" in message and str(run.checkpoint_dir(2)) in message
    assert "step 1 is whole" in message and f"df -h {run.root}" in message
    assert not run.checkpoint_dir(2).exists()  # its space is given back
    assert marker.read_text() == marker_text
    assert [step for step, _ in run.checkpoints_by_step()] == [1]

    (small_run_disk / FILLER).unlink()
    warnings: list[str] = []
    restored = restore_newest(store, pool.load_checkpoint, warnings.append)
    assert restored is not None and restored[0].step == 1 and restored[2] == 1 and warnings == []
    save(store, pool, 2)
    assert [step for step, _ in run.checkpoints_by_step()] == [1, 2]


def test_a_full_disk_mid_weight_export_is_named_and_gives_its_space_back(
    small_run_disk: Path, start_pool: Callable[..., Any], tiny_model_dir: str
) -> None:
    run, store, pool = job_on(small_run_disk, start_pool, tiny_model_dir)
    pool.export_hf(str(run.weights_dir(1)))
    pool.train_step(toy_batch(pool)[0], 2)

    fill_to_the_byte(small_run_disk)
    with pytest.raises(Exception) as failed:
        pool.export_hf(str(run.weights_dir(2)))
    assert says_disk_full(failed.value), failed.value  # the rank's own error says so
    error = weights_disk_full_error(store, 2, failed.value)

    assert isinstance(error, DiskFullError)
    assert "disk is full" in str(error) and str(run.weights_dir(2)) in str(error)
    assert not run.weights_dir(2).exists() and run.weights_dir(1).is_dir()
    (small_run_disk / FILLER).unlink()
    checksum = pool.export_hf(str(run.weights_dir(2)))
    assert checksum and any(run.weights_dir(2).glob("*.safetensors"))


@pytest.mark.parametrize("failure", [
    pytest.param(OSError(errno.EACCES, "Permission denied"), id="permission-denied"),
    pytest.param(RuntimeError("worker raised ValueError: bad shape"), id="not-a-write-error"),
])
def test_other_failures_with_room_left_are_not_called_disk_full(failure: Exception, tmp_path: Path) -> None:
    run = RunDir.at(tmp_path / "run").create()
    store = CheckpointStore(run, keep_last=3, keep_every=0)
    (store.begin(2) / "part").write_bytes(b"w")
    assert disk_full_error(store, 2, failure) is None
    assert run.checkpoint_dir(2).exists()  # left for the caller's own handling
