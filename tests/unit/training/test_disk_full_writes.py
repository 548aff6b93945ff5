"""Disk full in the run directory (a small tmpfs filled up; needs root to mount, skipped otherwise): every
write of a checkpoint's bookkeeping either replaces its file whole or leaves the old one, the `latest`
marker is never cut, no temp file is left, a checkpoint whose controller state could not be written is not
resumed from, and phase traces count the lost records instead of raising into training."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from libra.controller.checkpoints import CheckpointStore, ControllerState, restore_newest
from libra.observability.phase_trace import PhaseTracer
from libra.run_dir import RunDir, write_json_atomic
from libra.training.checkpoint import LATEST, _write_atomic

SIZE = "512k"


@pytest.fixture
def small_disk(tmpfs_disk: Callable[[str], Path]) -> Path:
    return tmpfs_disk(SIZE)


def fill(disk: Path) -> None:
    """Write until the file system is full."""
    with open(disk / "filler", "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"x" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


def leftovers(folder: Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name not in keep and p.name != "filler")


def test_json_state_file_is_kept_whole_when_the_disk_is_full(small_disk: Path) -> None:
    path = small_disk / "desired_state.json"
    write_json_atomic(path, {"generation": 1})
    fill(small_disk)
    with pytest.raises(OSError) as err:
        write_json_atomic(path, {"generation": 2, "pad": "y" * 65536})
    assert err.value.errno == errno.ENOSPC
    assert json.loads(path.read_text()) == {"generation": 1}
    assert leftovers(small_disk, {path.name}) == []


def test_latest_marker_is_never_cut_and_leaves_no_temp(small_disk: Path) -> None:
    marker = small_disk / LATEST
    _write_atomic(str(marker), "step_00000002")
    fill(small_disk)
    with pytest.raises(OSError):
        _write_atomic(str(marker), "step_00000004" + " " * 65536)
    assert marker.read_text() == "step_00000002"
    assert leftovers(small_disk, {LATEST}) == []


def test_a_checkpoint_whose_state_could_not_be_written_is_not_resumed_from(small_disk: Path) -> None:
    run = RunDir.at(small_disk / "run").create()
    store = CheckpointStore(run, keep_last=0, keep_every=0)
    (store.begin(2) / "model.bin").write_bytes(b"w")
    store.commit(ControllerState(step=2))
    (store.begin(4) / "model.bin").write_bytes(b"w")
    fill(small_disk)
    with pytest.raises(OSError):
        store.commit(ControllerState(step=4, extra={"pad": "y" * 65536}))
    os.unlink(small_disk / "filler")
    state, _, _ = restore_newest(store, lambda train_dir: 2, lambda message: None)  # type: ignore[misc]
    assert state.step == 2


def test_phase_traces_count_lost_records_instead_of_raising(small_disk: Path) -> None:
    tracer = PhaseTracer.open(small_disk, role="controller", rank=0, enabled=True, trace_dir=small_disk / "traces")
    fill(small_disk)
    for step in range(2000):
        tracer.record("controller.step", 0, 10, step=step, note="z" * 200)
    tracer.flush()
    tracer.close()
    assert tracer.write_errors > 0
