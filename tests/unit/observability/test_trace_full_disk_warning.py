"""Phase traces on a full disk (a small tmpfs filled up; needs root to mount, skipped otherwise): training
goes on, the records are dropped, and exactly one warning names the trace file and what to do."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from libra.observability.phase_trace import PhaseTracer


@pytest.fixture
def full_disk(tmpfs_disk: Callable[[str], Path]) -> Path:
    return tmpfs_disk("256k")


@pytest.mark.parametrize("flushes", [1, 5], ids=["one-flush", "five-flushes"])
def test_one_warning_names_the_trace_file(full_disk: Path, flushes: int, caplog: pytest.LogCaptureFixture) -> None:
    tracer = PhaseTracer.open(full_disk, role="controller", rank=0, enabled=True, trace_dir=full_disk / "traces")
    with open(full_disk / "filler", "wb", buffering=0) as fh:
        for chunk in (4096, 1):
            try:
                while True:
                    fh.write(b"x" * chunk)
            except OSError:
                pass
    with caplog.at_level(logging.WARNING, logger="libra.observability.phase_trace"):
        for _ in range(flushes):
            for step in range(500):
                tracer.record("controller.step", 0, 10, step=step, note="z" * 200)
            tracer.flush()
        tracer.close()
    warnings = [r.getMessage() for r in caplog.records if r.name == "libra.observability.phase_trace"]
    assert tracer.write_errors >= flushes
    assert len(warnings) == 1 and str(tracer.path) in warnings[0] and "dropped" in warnings[0]
