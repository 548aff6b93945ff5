"""The server guard clears the server's process group when the server exits or its owner dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from libra.proc_stat import group_members, pid_alive

# A "server" that leaves a long-lived grandchild behind (as vLLM's API server leaves its engine core).
SERVER_WITH_ORPHAN = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
time.sleep(float(sys.argv[1]))
sys.exit(int(sys.argv[2]))
"""

GUARD = [sys.executable, "-m", "libra.rollout.server_guard", "--poll-s", "0.1"]

# A server that marks when it runs, so a test never signals an interpreter that is still starting up.
SLEEPER = "import pathlib, sys, time; pathlib.Path(sys.argv[1]).touch(); time.sleep(60)"


def wait_file(path: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"the server did not start within {timeout_s}s"
        time.sleep(0.05)


def wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_server_exit_clears_the_group_and_keeps_the_exit_code() -> None:
    guard = subprocess.Popen(
        [*GUARD, "--", sys.executable, "-c", SERVER_WITH_ORPHAN, "0.3", "3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert guard.stdout is not None
        orphan = int(guard.stdout.readline())
        assert guard.wait(timeout=20) == 3
        assert wait_gone(orphan), "the server's leftover child must not survive it"
        assert group_members(guard.pid) == []
        assert guard.stderr is not None and b"server exited with code 3" in guard.stderr.read()
    finally:
        if guard.poll() is None:
            os.killpg(guard.pid, signal.SIGKILL)


OWNER = """
import subprocess, sys, time
guard = subprocess.Popen(sys.argv[1:] + ["--owner-pid", str(__import__("os").getpid()), "--", sys.executable,
                          "-c", "import time; time.sleep(60)"], start_new_session=True)
print(guard.pid, flush=True)
time.sleep(60)
"""


def test_owner_death_stops_the_server() -> None:
    owner = subprocess.Popen([sys.executable, "-c", OWNER, *GUARD], stdout=subprocess.PIPE)
    guard_pid = 0
    try:
        assert owner.stdout is not None
        guard_pid = int(owner.stdout.readline())
        deadline = time.monotonic() + 30
        while len(members := group_members(guard_pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert guard_pid in members and len(members) == 2, "guard + server"
        owner.kill()  # the host actor dies: its GPUs are released, the server must go
        owner.wait()
        assert wait_gone(guard_pid) and all(wait_gone(pid) for pid in members)
    finally:
        if owner.poll() is None:
            owner.kill()
        if guard_pid and group_members(guard_pid):
            os.killpg(guard_pid, signal.SIGKILL)


def test_a_command_is_required() -> None:
    result = subprocess.run([*GUARD], capture_output=True, timeout=30)
    assert result.returncode == 2 and b"no server command" in result.stderr


def ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize(("signum", "started_ignoring_sigint"), [
    (signal.SIGTERM, False),
    (signal.SIGINT, False),
    (signal.SIGINT, True),
], ids=["sigterm", "sigint", "sigint-guard-started-by-a-background-job"])
def test_signals_to_the_guard_reach_the_server(signum: int, started_ignoring_sigint: bool, tmp_path: Path) -> None:
    """A shell starts background jobs with SIGINT ignored, and an ignored signal stays ignored across exec: the
    guard must not hand that on to the server, or a forwarded SIGINT would never stop it."""
    started = tmp_path / "started"
    guard = subprocess.Popen([*GUARD, "--", sys.executable, "-c", SLEEPER, str(started)], start_new_session=True,
                             preexec_fn=ignore_sigint if started_ignoring_sigint else None)
    try:
        wait_file(started)
        guard.send_signal(signum)
        code = guard.wait(timeout=20)
        assert code == 128 + signum or code == -signum or code == 128 - (-signum)
        assert group_members(guard.pid) == []
    finally:
        if guard.poll() is None:
            os.killpg(guard.pid, signal.SIGKILL)


def test_a_killed_guard_takes_its_server_with_it(tmp_path: Path) -> None:
    """Ray kills the children of a killed host actor, the guard among them: the server, whose parent the guard
    is, must not run on without it (it would hold the GPUs and port of an instance nobody tracks)."""
    started = tmp_path / "started"
    guard = subprocess.Popen([*GUARD, "--", sys.executable, "-c", SLEEPER, str(started)], start_new_session=True)
    try:
        wait_file(started)
        server = [pid for pid in group_members(guard.pid) if pid != guard.pid]
        assert len(server) == 1
        guard.kill()
        guard.wait(timeout=10)
        assert wait_gone(server[0]), "the server outlived its killed guard"
    finally:
        if group_members(guard.pid):
            os.killpg(guard.pid, signal.SIGKILL)
