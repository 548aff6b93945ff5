"""Metric rows on a full disk (the real Reporter and RL loop, fake pools): a row that cannot be appended to
`metrics.jsonl` is held in memory with the rows after it and written, in order, once there is room; no
checkpoint is completed while a row is held, so every step a checkpoint holds has its row on disk, and
every step's row is written once."""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

import pytest

from libra.controller import reporting
from libra.controller.events import EventLog
from libra.controller.reporting import Reporter
from libra.observability.console import NullConsole
from libra.run_dir import RunDir

from .test_training_restart import END_STEP, Training, make_loop


class Disk:
    """`append_jsonl` of the reporter, failing with ENOSPC while `full`."""

    def __init__(self) -> None:
        self.full = False
        self.real = reporting.append_jsonl

    def append(self, path: Path, obj: dict[str, Any]) -> None:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.real(path, obj)


def _steps(run: RunDir) -> list[int]:
    return [int(r["step"]) for r in run.read_metrics()]


# per reported row: whether the disk is full while it is reported -> rows on disk after each, rows held
HELD = [
    pytest.param([False, True, True, False], [[1], [1], [1], [1, 2, 3, 4]], [0, 1, 2, 0], id="full-for-two-rows"),
    pytest.param([True, False], [[], [1, 2]], [1, 0], id="full-from-the-first-row"),
    pytest.param([False, True], [[1], [1]], [0, 1], id="still-full-at-the-last-row"),
]


@pytest.mark.parametrize(("full", "on_disk", "held"), HELD)
def test_rows_that_cannot_be_written_are_held_and_written_in_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, full: list[bool], on_disk: list[list[int]],
        held: list[int]) -> None:
    disk = Disk()
    monkeypatch.setattr(reporting, "append_jsonl", disk.append)
    run = RunDir.at(tmp_path / "run").create()
    reporter = Reporter(run, "t", len(full), NullConsole(), EventLog(run.events_jsonl), None)
    for step, is_full in enumerate(full, start=1):
        disk.full = is_full
        reporter.step({"step": step, "loss": 0.1}, {}, {}, {})
        assert (_steps(run), reporter.rows_pending) == (on_disk[step - 1], held[step - 1])


def _warnings(caplog: pytest.LogCaptureFixture, about: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and about in r.getMessage()]


def test_a_full_disk_is_warned_of_once_per_spell_not_at_every_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Two spells of a full disk over six steps, the last one still full at the end of the run: each of
    metrics.jsonl and status.json is warned of once per spell, and the end of the run says how many rows it
    could not write, once; status.json is current again after each spell."""
    disk = Disk()
    real_status_write = reporting.write_json_atomic

    def write_status(path: Path, obj: dict[str, Any]) -> None:
        if disk.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_status_write(path, obj)

    monkeypatch.setattr(reporting, "append_jsonl", disk.append)
    monkeypatch.setattr(reporting, "write_json_atomic", write_status)
    run = RunDir.at(tmp_path / "run").create()
    reporter = Reporter(run, "t", 6, NullConsole(), EventLog(run.events_jsonl), None)
    caplog.set_level("INFO", logger=reporting.__name__)
    for step, full in enumerate([False, True, True, False, True, True], start=1):
        disk.full = full
        reporter.step({"step": step, "loss": 0.1}, {}, {}, {})
        if step == 4:
            assert json.loads(run.status_json.read_text())["step"] == 4 and _steps(run) == [1, 2, 3, 4]
    reporter.finish("finished")
    assert len(_warnings(caplog, "cannot append to")) == 2
    assert len(_warnings(caplog, f"cannot write {run.status_json}")) == 2
    assert _warnings(caplog, "before the run ended") == [
        f"2 metric row(s) could not be written to {run.metrics_jsonl} before the run ended: the steps after the "
        "newest checkpoint are trained again by the next launch"]
    assert any("wrote 3 held metric row(s)" in r.getMessage() for r in caplog.records)


def test_held_rows_of_steps_trained_again_are_forgotten(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    disk = Disk()
    monkeypatch.setattr(reporting, "append_jsonl", disk.append)
    run = RunDir.at(tmp_path / "run").create()
    reporter = Reporter(run, "t", 4, NullConsole(), EventLog(run.events_jsonl), None)
    reporter.step({"step": 1}, {}, {}, {})
    disk.full = True
    reporter.step({"step": 2}, {}, {}, {})
    reporter.step({"step": 3}, {}, {}, {})
    reporter.drop_rows_after(2)  # the run goes back to the checkpoint of step 2
    disk.full = False
    assert reporter.flush_rows() and _steps(run) == [1, 2]


class FillsTheDisk(Training):
    """A training pool beside a disk that is full from step `full_from`'s training until step `room_at`'s."""

    def __init__(self, disk: Disk, full_from: int, room_at: int) -> None:
        super().__init__(set())
        self.disk, self.full_from, self.room_at = disk, full_from, room_at

    def train_step(self, samples: list[Any], step: int) -> dict[str, float]:
        if step == self.full_from:
            self.disk.full = True
        if step == self.room_at:
            self.disk.full = False
        return super().train_step(samples, step)


def test_a_job_whose_metrics_file_was_full_for_a_while_keeps_every_row_and_checkpoints_only_written_steps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    disk = Disk()
    monkeypatch.setattr(reporting, "append_jsonl", disk.append)
    loop, run = make_loop(tmp_path, FillsTheDisk(disk, full_from=2, room_at=4))  # checkpoints every 2 steps
    try:
        loop.run_steps()
        loop.final_checkpoint()
    finally:
        loop.stop_producer()
    assert _steps(run) == list(range(1, END_STEP + 1))  # every row, once, in order
    assert [step for step, _ in run.checkpoints_by_step()] == [4, 6]  # step 2's row was held at its checkpoint
    skipped = [json.loads(line) for line in run.events_jsonl.read_text().splitlines()]
    assert [e["step"] for e in skipped if e["kind"] == "checkpoint_skipped"] == [2]
