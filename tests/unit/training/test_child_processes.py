"""A child forked from a training worker (Megatron-Core's checkpoint writers) ends with it, after the worker is
killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[3]

FORKED = """
import multiprocessing as mp, sys, time
from libra.training import child_processes
if sys.argv[1] == "on":
    child_processes.install_for_forks()
child = mp.get_context("fork").Process(target=time.sleep, args=(120,))
child.start()
print(child.pid, flush=True)
time.sleep(120)
"""

def _gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.1)
    return False


def _run_then_kill(code: str, *args: str) -> list[int]:
    """Run `code`, read the child pids it prints, SIGKILL it; the child pids."""
    proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert pids, "the script started no child"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    return pids


@pytest.mark.parametrize(("hook", "ends"), [pytest.param("on", True, id="installed"),
                                              pytest.param("off", False, id="not-installed")])
def test_a_forked_child_dies_with_its_killed_parent(hook: str, ends: bool) -> None:
    pids = _run_then_kill(FORKED, hook)
    try:
        assert _gone_within(pids, 2.0) is ends
    finally:
        for pid in pids:
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)
