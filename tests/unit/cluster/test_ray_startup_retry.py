"""A local Ray start that times out (Ray's fixed 30 s for a node to register, or for the GCS to write its port
file, which a loaded machine can miss) is tried again after the processes it left behind are stopped; other errors are not retried."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from libra.cluster.ray_runtime import is_startup_timeout, start_with_retries, stop_processes_under

RAY_TIMEOUT = Exception("The current node timed out during startup. This could happen because some of the "
                        "raylet failed to startup or the GCS has become overloaded.")


@pytest.mark.parametrize(("exc", "retried"), [
    (RAY_TIMEOUT, True),
    (RuntimeError("Timed out waiting for file /tmp/libra-ray-t2wst70p/session_2026-12-02_04-02-47_862138_4739/"
                  "gcs_server_port_1cc45889b4fe5b1442636e3c8e6c549734facb0e2b156f92bcf2f4f7"), True),
    (RuntimeError("Failed to get node info b'RPC error: Deadline Exceeded'"), False),
    (ValueError("num_gpus must be >= 0"), False),
], ids=["startup-timeout", "gcs-port-file-timeout", "other-ray-error", "bad-argument"])
def test_which_errors_are_tried_again(exc: Exception, retried: bool) -> None:
    assert is_startup_timeout(exc) is retried


def _leftover(tmp: Path) -> subprocess.Popen[bytes]:
    """A child process that names the start's temp dir on its command line, as Ray's gcs_server does. Returned
    once its command line can be read: Popen returns as the child execs, and until the kernel has set up the
    new program's arguments /proc shows an empty command line (seen on a loaded machine), which no start
    leaves behind (Ray's processes run for seconds before a start times out)."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", f"--temp-dir={tmp}/session"])
    deadline = time.monotonic() + 10
    while not psutil.Process(process.pid).cmdline() and time.monotonic() < deadline:
        time.sleep(0.01)
    return process


def test_a_timed_out_start_is_retried_after_its_processes_are_stopped(tmp_path: Path) -> None:
    leftovers: list[subprocess.Popen[bytes]] = []
    unrelated = _leftover(tmp_path.parent / "another-cluster")
    try:
        def start() -> str:
            if len(leftovers) < 2:
                leftovers.append(_leftover(tmp_path))
                raise RAY_TIMEOUT
            assert all(p.poll() is not None for p in leftovers), "a failed attempt's processes still run"
            return "started"

        pauses: list[float] = []
        assert start_with_retries(start, str(tmp_path), attempts=3, pause_s=0.5, sleep=pauses.append) == "started"
        assert len(leftovers) == 2
        assert pauses == [0.5, 1.0]  # each retry waits longer for the load to pass
        assert unrelated.poll() is None  # only what names this start's directory is stopped
    finally:
        for proc in [*leftovers, unrelated]:
            proc.kill()
            proc.wait()


def test_the_last_timeout_and_other_errors_are_raised(tmp_path: Path) -> None:
    calls: list[int] = []

    def always_times_out() -> None:
        calls.append(1)
        raise RAY_TIMEOUT

    with pytest.raises(Exception, match="timed out during startup"):
        start_with_retries(always_times_out, str(tmp_path), attempts=2, pause_s=0.0)
    assert len(calls) == 2

    def bad_argument() -> None:
        calls.append(1)
        raise ValueError("num_gpus=-1")

    with pytest.raises(ValueError, match="num_gpus"):
        start_with_retries(bad_argument, str(tmp_path), attempts=3)
    assert len(calls) == 3


def test_stop_processes_under_leaves_this_process_alone(tmp_path: Path) -> None:
    assert stop_processes_under(str(tmp_path)) == []
    assert psutil.Process().is_running()
