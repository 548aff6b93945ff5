"""A starting server whose processes use no CPU (stopped by SIGSTOP, or blocked for good) is declared hung after
`stall_s` and stopped (`ServerStalledError`) instead of being waited for until the start-up timeout, which is
what a hung restart reload held its publish for; one that keeps working without answering /health is waited for
until that timeout (a plain `ServerStartError`). Real processes in a session of their own, as a server's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from libra.proc_stat import group_stat_fields, pid_alive
from libra.rollout.server import ServerLaunch, ServerProcess, group_cpu_ticks, pick_free_port
from libra.rollout.spec import ServerStalledError, ServerStartError

BUSY = "while True: pass"
BLOCKED = "import time; time.sleep(600)"
TIMEOUT_S = 4.0
STALL_S = 1.5


def grows_within(pgid: int, since: int, within_s: float) -> bool:
    """Whether the group's count rises above `since` within `within_s` (an interpreter's start is slow on a
    loaded machine, so no fixed wait)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if group_cpu_ticks(pgid) > since:
            return True
        time.sleep(0.1)
    return False


def member_started_within(pgid: int, code: str, within_s: float) -> bool:
    """Whether a member of the group is the interpreter running `code` within `within_s` (executed, not the
    shell's fork before it, whose command line is the shell's and holds `code` too). A member that only sleeps
    may have started on less CPU than one clock tick, so its count need not grow."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        for pid in group_stat_fields(pgid):
            try:
                argv = psutil.Process(pid).cmdline()
            except psutil.Error:
                continue
            if pid != pgid and argv[:1] == [sys.executable] and code in argv:
                return True
        time.sleep(0.1)
    return False


def group_stopped_within(pgid: int, within_s: float) -> bool:
    """Whether every process of the group is stopped within `within_s` (SIGSTOP is delivered, not instant)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        states = [fields[0] for fields in group_stat_fields(pgid).values()]
        if states and all(state == "T" for state in states):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize(("code", "stop_it", "error", "message"), [
    (BUSY, True, ServerStalledError, "used no CPU for 2s while starting"),
    (BLOCKED, False, ServerStalledError, "used no CPU for 2s while starting"),
    (BUSY, False, ServerStartError, f"was not healthy within {TIMEOUT_S:.0f}s"),
], ids=["stopped-by-sigstop-is-hung", "blocked-for-good-is-hung", "working-is-waited-for-until-the-timeout"])
def test_a_start_that_uses_no_cpu_is_hung(tmp_path: Path, code: str, stop_it: bool, error: type[Exception],
                                         message: str) -> None:
    log = tmp_path / "server.log"
    log.write_text("starting\n")
    # the leader only waits, as a server's guard does; the worker is a member of its group
    popen = subprocess.Popen(["sh", "-c", f'{sys.executable} -c "{code}" & wait'], start_new_session=True)
    launch = ServerLaunch(model_path="/m", port=pick_free_port("127.0.0.1"), host="127.0.0.1", max_model_len=64,
                          kv_cache_bytes=0, log_path=str(log))
    server = ServerProcess(launch, popen.pid, popen)
    try:
        running = grows_within(popen.pid, 0, 30) if code == BUSY else member_started_within(popen.pid, code, 30)
        assert running, "the worker has started"
        if stop_it:
            os.killpg(popen.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(ServerStartError, match=message) as raised:
            server.wait_healthy(TIMEOUT_S, stall_s=STALL_S)
        waited = time.monotonic() - started
        assert type(raised.value) is error
        if error is ServerStalledError:
            assert waited < TIMEOUT_S, f"declared hung after {waited:.1f}s, not before the timeout"
        assert "starting" in str(raised.value), "the error quotes the server's log"
        assert not pid_alive(popen.pid), "the hung server was stopped"
    finally:
        server.kill()


def test_the_cpu_of_a_group_counts_its_members() -> None:
    popen = subprocess.Popen(["sh", "-c", f'{sys.executable} -c "{BUSY}" & wait'], start_new_session=True)
    try:
        assert grows_within(popen.pid, group_cpu_ticks(popen.pid), 30), "a busy member's CPU counts"
        os.killpg(popen.pid, signal.SIGSTOP)
        assert group_stopped_within(popen.pid, 10)
        stopped = group_cpu_ticks(popen.pid)
        time.sleep(0.5)
        assert group_cpu_ticks(popen.pid) == stopped, "a stopped group uses no CPU"
    finally:
        os.killpg(popen.pid, signal.SIGKILL)  # a stopped process dies of it too
        popen.wait(timeout=10)


def test_the_cpu_of_a_group_leaves_out_its_leader() -> None:
    """The leader is the server's guard, which only waits; a busy leader beside an idle member is no progress."""
    popen = subprocess.Popen(["sh", "-c", f'{sys.executable} -c "{BLOCKED}" & while :; do :; done'],
                             start_new_session=True)
    leader = psutil.Process(popen.pid)
    try:
        # the member uses CPU while its interpreter starts (long on a loaded machine), then only sleeps: from
        # then on the group's count stays, however busy the leader is
        deadline = time.monotonic() + 30
        first, leader_first = group_cpu_ticks(popen.pid), sum(leader.cpu_times()[:2])
        while True:
            time.sleep(0.5)
            now, leader_now = group_cpu_ticks(popen.pid), sum(leader.cpu_times()[:2])
            if now == first:
                break
            assert time.monotonic() < deadline, "the group's count kept growing: the busy leader counts"
            first, leader_first = now, leader_now
        assert leader_now > leader_first, "the leader was busy while the group's count stayed"
    finally:
        os.killpg(popen.pid, signal.SIGKILL)
        popen.wait(timeout=10)
