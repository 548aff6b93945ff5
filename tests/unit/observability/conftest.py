"""Fixtures for phase-trace tests (helpers live in trace_fixtures.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from trace_fixtures import BAD_LINES, SyntheticTrace, build_run


@pytest.fixture
def synthetic_trace(tmp_path: Path) -> SyntheticTrace:
    """The synthetic run with malformed lines in one file and a cut-off last line in another."""
    trace = build_run(tmp_path / "traces")
    train = trace.directory / "phase_trace_rank1000.jsonl"
    lines = train.read_bytes().splitlines(keepends=True)
    train.write_bytes(b"".join(lines[:2] + BAD_LINES[:4] + lines[2:5] + BAD_LINES[4:] + lines[5:]))
    trace.bad_lines[train.name] = len(BAD_LINES)
    rollout = trace.directory / "phase_trace_rank2001.jsonl"
    with open(rollout, "a") as handle:
        handle.write('{"schema": 1, "name": "rollout.generate", "role": "rollout", "rank": 20')
    trace.bad_lines[rollout.name] = 1
    trace.cut_off_files.add(rollout.name)
    return trace
