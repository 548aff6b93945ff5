"""A weight export for a publish that meets a full run directory (fake pools, the real RL loop): the job stops
with a `DiskFullError` that names the weights folder, the checkpoint a new launch resumes from and what to do;
the half-written folder is removed, no checkpoint is tried after it, and the checkpoint before stays whole.
An export that fails otherwise, or because a worker died, is not called a full disk."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from libra.cluster.training_workers import WorkerLostError
from libra.controller.checkpoints import (
    DETAIL_CHARS,
    CheckpointStore,
    DiskFullError,
    _detail,
    says_disk_full,
    weights_disk_full_error,
)
from libra.run_dir import RunDir

from .test_training_restart import Training, make_loop, raised_from

FULL_AT = 3  # the export of step 3 meets the full disk; checkpoints every 2 steps


def _enospc() -> Exception:
    return OSError(errno.ENOSPC, "No space left on device")


def _worker_text() -> Exception:  # as a full disk reaches the controller from a training rank over Ray
    return RuntimeError("libra-train.export_hf failed on rank 0: SafetensorError: Error while serializing: "
                        "IoError(Os { code: 28, kind: StorageFull, message: \"No space left on device\" })")


class FullDiskExport(Training):
    """A training pool whose export of step `FULL_AT` writes part of its folder, then fails with `error`."""

    def __init__(self, error: Exception) -> None:
        super().__init__(set())
        self.error = error

    def export_hf(self, out_dir: str) -> str:
        if self.step == FULL_AT:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            (Path(out_dir) / "model.safetensors").write_bytes(b"half")
            raise self.error
        return super().export_hf(out_dir)


@pytest.mark.parametrize("error", [pytest.param(_enospc(), id="enospc"),
                                   pytest.param(_worker_text(), id="a-ranks-error-text")])
def test_a_full_disk_at_the_weight_export_stops_the_job_and_keeps_the_checkpoint_before(
        tmp_path: Path, error: Exception) -> None:
    loop, run = make_loop(tmp_path, FullDiskExport(error))
    try:
        with pytest.raises(DiskFullError) as stopped:
            loop.run_steps()
        loop.final_checkpoint()  # what the launch does on its way out: nothing is written on a full disk
    finally:
        loop.stop_producer()
    message = str(stopped.value)
    assert str(run.weights_dir(FULL_AT)) in message and "could not be exported" in message
    assert "the checkpoint of step 2 is whole and a new launch resumes from it" in message
    assert f"df -h {run.root}" in message
    assert stopped.value.__cause__ is error
    assert not run.weights_dir(FULL_AT).exists()  # its space is given back
    assert run.weights_dir(FULL_AT - 1).is_dir()  # the servers' weights stay
    assert [step for step, _ in run.checkpoints_by_step()] == [2]
    assert [int(r["step"]) for r in run.read_metrics()] == [1, 2]


@pytest.mark.parametrize(("error", "full"), [
    pytest.param(_enospc(), True, id="enospc"),
    pytest.param(OSError(errno.EDQUOT, "Disk quota exceeded"), True, id="quota"),
    pytest.param(_worker_text(), True, id="text-from-another-process"),
    pytest.param(RuntimeError("export failed") , False, id="other"),
    pytest.param(OSError(errno.EACCES, "Permission denied"), False, id="permission-denied"),
])
def test_says_disk_full_reads_the_chain_of_causes(error: Exception, full: bool) -> None:
    assert says_disk_full(raised_from(error, "libra-train.export_hf failed")) is full


def test_another_export_failure_with_room_left_is_raised_unchanged(tmp_path: Path) -> None:
    loop, run = make_loop(tmp_path, FullDiskExport(ValueError("a bug in the export")))
    try:
        with pytest.raises(ValueError, match="a bug in the export"):
            loop.run_steps()
    finally:
        loop.stop_producer()
    assert run.weights_dir(FULL_AT).is_dir()  # left as it was for whoever looks into the bug
    assert weights_disk_full_error(CheckpointStore(run, keep_last=2, keep_every=0), 1,
                                   ValueError("not a write error")) is None


def test_a_worker_lost_in_the_export_is_not_called_a_full_disk(tmp_path: Path) -> None:
    """A rank that died mid-export goes to the training pool's recovery, not to the disk's error."""
    lost = RuntimeError("export_hf failed")
    lost.__cause__ = WorkerLostError("libra-train.export_hf: the process of rank(s) [0] died", [0])
    assert not says_disk_full(lost)
    loop, _ = make_loop(tmp_path / "job", Training({("export_hf", 2)}))
    try:
        loop.run_steps()
    finally:
        loop.stop_producer()
    assert loop.training_restarts == 1  # recovered as a lost worker, not stopped as a full disk


def _write(run: RunDir, version: int, size: int) -> None:
    folder = run.weights_dir(version)
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"\0" * size)


def test_a_nearly_full_disk_makes_a_write_error_a_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch or a library may say only "write failed": with less room left than the last export took, the
    failure is taken for a full disk."""
    import shutil

    run = RunDir.at(tmp_path / "run").create()
    store = CheckpointStore(run, keep_last=2, keep_every=0)
    _write(run, 1, 1 << 20)  # the last export (the room needed is at least 64 MiB whatever its size)
    _write(run, 2, 10)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1 << 10))
    error = weights_disk_full_error(store, 2, RuntimeError("file write failed"))
    assert isinstance(error, DiskFullError) and "1024 bytes free" in str(error)
    assert "no earlier checkpoint exists, so a new launch starts from step 0" in str(error)
    assert not run.weights_dir(2).exists() and run.weights_dir(1).is_dir()


LONG_PATH = "/mnt/" + "/".join(f"runs-of-team-{i:02d}" for i in range(20)) + "/weights/step_000003/model.safetensors"


@pytest.mark.parametrize(("text", "quoted"), [
    pytest.param(f"[Errno 28] No space left on device: '{LONG_PATH}'",
                 f"[Errno 28] No space left on device: '{LONG_PATH}'", id="a-long-path-whole"),
    pytest.param(f"Traceback (most recent call last):\n  File x\nOSError: [Errno 28] at {LONG_PATH}",
                 f"OSError: [Errno 28] at {LONG_PATH}", id="the-last-line-of-a-traceback"),
    pytest.param("word " * 300, ("word " * 300)[:DETAIL_CHARS].rsplit(" ", 1)[0] + " ...", id="past-the-limit-at-a-space"),
    pytest.param("", "OSError", id="no-text"),
])
def test_the_error_quoted_in_a_disk_full_error_keeps_its_paths_whole(text: str, quoted: str) -> None:
    assert len(LONG_PATH) > 200  # longer than the cut the quote had before
    assert _detail(OSError(text) if text else OSError()) == quoted
