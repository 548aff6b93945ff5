"""Resume from a run directory whose checkpoints have truncated tensor shards (a disk that filled up, a copy
cut short), in a job that keeps a checkpoint mirror (`checkpoint.mirror_dir`): the newest checkpoint is cut
short in both copies, so the launch skips it with a warning naming the damaged shard of each; the one before it
is cut short in the run directory only, so the launch takes the mirror's copy of that step and keeps the damaged
folder beside it. It resumes there, recomputes the later steps and finishes, every step counted once in the
metrics. (A damaged newest checkpoint whose mirror copy is whole, resumed with nothing trained again, is
measured by benchmarks/reliability.py, `truncated_newest_checkpoint_mirrored`.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..controller.conftest import events, job_file, metric_rows

STARTUP_S = 420  # Ray + a vLLM-CPU server + Megatron init on 2 loaded cores


def session_events(run_dir: Path) -> list[dict[str, Any]]:
    found = events(run_dir)
    start = max(i for i, e in enumerate(found) if e["kind"] == "launch")
    return found[start:]


def cut_shard(checkpoint: Path) -> Path:
    shards = sorted((checkpoint / "train").glob("step_*/*.distcp"))
    assert shards, f"{checkpoint} holds tensor shards"
    shards[0].write_bytes(shards[0].read_bytes()[: shards[0].stat().st_size // 2])
    return shards[0]


def test_resume_skips_a_checkpoint_damaged_in_both_copies_and_restores_one_from_the_mirror(
        job_workspace: dict[str, Any]) -> None:
    ws = job_workspace
    run_dir: Path = ws["run_dir"]
    mirror = run_dir.parent / "mirror"
    with job_file(ws["config"]) as data:
        data["checkpoint"]["mirror_dir"] = str(mirror)  # checkpoints at steps 2 and 4 (keep_last 2), then at the end
    first = ws["launch"]("--max-steps", "4")
    assert first.wait(timeout=STARTUP_S + 300) == 0, first.output()[-4000:]
    assert sorted(p.name for p in mirror.iterdir()) == ["step_000002", "step_000004"]
    newest = cut_shard(run_dir / "checkpoints" / "step_000004")
    newest_mirrored = cut_shard(mirror / "step_000004")
    older = cut_shard(run_dir / "checkpoints" / "step_000002")

    second = ws["launch"]("--max-steps", "6")
    assert second.wait(timeout=STARTUP_S + 300) == 0, second.output()[-4000:]
    output = second.output()
    assert "Traceback" not in output, output[-4000:]
    session = session_events(run_dir)
    warnings = [e["message"] for e in session if e["kind"] == "warning"]
    assert len(warnings) == 2, warnings
    skipped, restored = warnings
    assert skipped.startswith("checkpoint of step 4 skipped") and "its mirror copy is damaged too" in skipped
    assert str(newest) in skipped and str(newest_mirrored) in skipped and "truncated" in skipped
    assert restored.startswith(f"checkpoint of step 2 restored from the mirror {mirror / 'step_000002'}")
    assert str(older) in restored
    assert [e["step"] for e in session if e["kind"] == "resumed"] == [2]
    # the damaged step-2 folder is kept beside its restored copy; the step-4 one was put back, then saved anew
    assert [p.name.split(".damaged-")[0] for p in (run_dir / "checkpoints").glob("*.damaged-*")] == ["step_000002"]
    assert [r["step"] for r in metric_rows(run_dir)] == [1, 2, 3, 4, 5, 6]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "finished" and status["step"] == 6
    assert "finished at step 6 (--max-steps); newest checkpoint: step 6;" in output
    assert sorted(p.name for p in mirror.iterdir()) == ["step_000004", "step_000006"]  # keep_last 2, as run_dir
