"""The disk-full faults of the reliability suite on a real job.

`disk_full_mid_checkpoint`: the run directory of `libra launch` is a size-limited tmpfs, filled up while the training worker writes the first checkpoint it is seen writing after
step 2 (checkpoint every step; the worker is held with SIGSTOP while the disk fills, so that the fault lands
inside the write). The launch must stop with a line that names the path and says the disk is full, and the
checkpoint before and its `latest` marker must stay whole; once the filler is removed, a new launch on the
same run directory resumes from that checkpoint and runs to the last step.

`disk_full_mid_publish`: the same, filled while the training worker exports a step's weights for the rollout
servers (`export_hf`, the first one seen after step 2): the launch stops the same way, naming the weights
folder, which is removed; the servers' weights of the step before and every complete checkpoint stay.

`disk_full_mid_trace`: only the phase-trace folder of the run directory is a size-limited tmpfs, filled after
step 2 while every rank writes its trace. Tracing is best effort: the writers drop their records with one
warning each, and the same launch trains on to the last step with nothing lost (metrics, events and
checkpoints are on the run directory's own disk).

Both need root (mount); without it the fault fails with the reason.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from reliability_accounting import fault_figures, in_run_figures

from libra.observability.trace_schema import TRACE_SUBDIR
from libra.run_dir import read_jsonl
from tests.integration.controller.conftest import (
    make_workspace,
    metric_rows,
    stop_everything,
    wait_for,
)
from tests.integration.reliability.test_worker_faults import when_worker_runs

DISK_SIZE = "256m"
TRACE_DISK_SIZE = "8m"
FILLER = "filler"


@contextmanager
def small_disk(mount: Path, size: str = DISK_SIZE) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `mount` (created), unmounted on exit; RuntimeError with the reason when
    it cannot be mounted."""
    mount.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise RuntimeError(f"cannot mount a size-limited tmpfs at {mount}: {done.stderr.strip() or done.returncode}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path) -> int:
    """Write `disk/filler` until the file system is full; the bytes written."""
    written = 0
    with open(disk / FILLER, "wb", buffering=0) as fh:
        try:
            while True:
                written += fh.write(b"\0" * (1 << 20))
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    # the last partial block: down to the byte, so that no later write of the job finds room
    with open(disk / FILLER, "ab", buffering=0) as fh:
        try:
            while True:
                written += fh.write(b"\0" * 512)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    return written


def checkpoint_state(run_dir: Path) -> dict[str, Any]:
    """Per checkpoint folder: whether its controller state is there and what its `latest` marker says."""
    found: dict[str, Any] = {}
    for folder in sorted((run_dir / "checkpoints").glob("step_*")):
        train = folder / "train"
        markers = {p.name: p.read_text(errors="replace")[:64] for p in train.glob("latest*") if p.is_file()}
        found[folder.name] = {"controller_state": (folder / "controller_state.json").is_file(), "markers": markers}
    return found


def disk_full_mid_checkpoint(root: Path, end_step: int, samples_per_step: int, startup_s: float,
                             with_checkpoint_every_step: Any, method: str = "save_checkpoint") -> dict[str, Any]:
    """The fault (module docstring), the disk filled while a training worker runs `method` (`save_checkpoint`,
    or `export_hf` for `disk_full_mid_publish`); its figures, with what the failed launch said and left in
    `details`."""
    ws, launches = make_workspace(root)
    run_dir: Path = ws["run_dir"]
    with_checkpoint_every_step(ws["config"])
    with small_disk(run_dir) as disk:
        try:
            first = ws["launch"]("--max-steps", str(end_step))
            wait_for(lambda: len(metric_rows(run_dir)) >= 2, startup_s, "step 2", first)
            note: dict[str, Any] = {}

            def fill_noting(worker: int) -> None:
                os.kill(worker, signal.SIGSTOP)  # held inside its checkpoint write while the disk fills
                try:
                    note["before"] = metric_rows(run_dir)
                    note["filled_bytes"] = fill(disk)
                finally:
                    os.kill(worker, signal.SIGCONT)

            fault_at = when_worker_runs(run_dir, method, fill_noting, first, startup_s)
            first_code = first.wait(timeout=600)
            output = first.output()
            left = checkpoint_state(run_dir)
            weights_left = sorted(p.name for p in (run_dir / "weights").glob("v*"))
            (disk / FILLER).unlink()
            second = ws["launch"]("--max-steps", str(end_step))
            last_code = second.wait(timeout=startup_s + 600)
            found = list(read_jsonl(run_dir / "events.jsonl"))  # skips a line the full disk cut, if any
            starts = [i for i, e in enumerate(found) if e["kind"] == "launch"]
            resumed = [e["step"] for e in found[starts[-1]:] if e["kind"] == "resumed"] if starts else []
            resumed_step = int(resumed[-1]) if resumed else None
            figures = fault_figures("", note["before"], metric_rows(run_dir), resumed_step, end_step,
                                    samples_per_step, fault_at, last_code)
            complete = [name for name, what in left.items() if what["controller_state"]]
            figures["details"] = {
                "disk": f"tmpfs size={DISK_SIZE}", "filled_bytes": note["filled_bytes"], "filled_in": method,
                "first_exit_code": first_code, "stop_traceback_shown": "Traceback" in output,
                "stop_line": [line for line in output.splitlines() if line.startswith("libra: ")][-1:],
                "stop_line_says_disk_full": any("disk" in line and "full" in line and str(run_dir) in line
                                                for line in output.splitlines() if line.startswith("libra: ")),
                "last_step_before_fault": max((int(r["step"]) for r in note["before"]), default=0),
                "checkpoints_after_fault": left, "complete_checkpoints_after_fault": complete,
                "weights_after_fault": weights_left,
                "resumed_from_step": resumed_step, "last_exit_code": last_code,
            }
            return figures
        finally:
            stop_everything(run_dir, launches)


def disk_full_mid_trace(root: Path, end_step: int, samples_per_step: int, startup_s: float) -> dict[str, Any]:
    """The trace folder fills after step 2; the same launch runs to `end_step` (module docstring)."""
    ws, launches = make_workspace(root)
    run_dir: Path = ws["run_dir"]
    traces = run_dir / TRACE_SUBDIR
    with small_disk(traces, TRACE_DISK_SIZE) as disk:
        try:
            launch = ws["launch"]("--max-steps", str(end_step))
            wait_for(lambda: len(metric_rows(run_dir)) >= 2, startup_s, "step 2", launch)
            before = metric_rows(run_dir)
            fault_at = time.time()
            filled = fill(disk)
            code = launch.wait(timeout=startup_s + 600)
            output = launch.output()
            final = metric_rows(run_dir)
            last_before = max(int(r["step"]) for r in before)
            after = sorted(float(r["wall_time"]) for r in final if int(r["step"]) > last_before)
            figures = in_run_figures("", final, samples_per_step, end_step, last_before + 1, end_step, fault_at,
                                     after[0] if after else None, code)
            log = (run_dir / "controller.log").read_text(errors="replace") if (run_dir / "controller.log").exists() else ""
            warnings = [line for line in (output + log).splitlines() if "cannot write phase trace" in line]
            figures["details"] = {
                "disk": f"tmpfs size={TRACE_DISK_SIZE} at {TRACE_SUBDIR}/ only", "filled_bytes": filled,
                "exit_code": code, "traceback_shown": "Traceback" in output,
                "steps_in_figures": [last_before + 1, end_step],
                "trace_write_warnings": len(warnings), "trace_warning_sample": warnings[:1],
                "trace_files": sorted(p.name for p in traces.glob("*.jsonl")),
            }
            return figures
        finally:
            stop_everything(run_dir, launches)
