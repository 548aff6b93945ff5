"""libra.proc_stat against real processes: a running one, a zombie, one that is gone, a recorded start time
that does not match (a reused pid), and a process group."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from libra.proc_stat import group_members, pid_alive, process_start_ticks, running_start_ticks, stat_fields


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def zombie() -> subprocess.Popen[bytes]:
    """A child that exited and was not reaped (until the caller waits for it)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while (stat_fields(proc.pid) or ["Z"])[0] != "Z":
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.05)
    return proc


def test_a_running_process_is_alive_with_its_own_start_time(sleeper: subprocess.Popen[bytes]) -> None:
    ticks = process_start_ticks(sleeper.pid)
    assert ticks > 0 and running_start_ticks(sleeper.pid) == ticks
    assert pid_alive(sleeper.pid) and pid_alive(sleeper.pid, ticks)


def test_another_start_time_is_another_process(sleeper: subprocess.Popen[bytes]) -> None:
    assert not pid_alive(sleeper.pid, process_start_ticks(sleeper.pid) + 1)


@pytest.mark.parametrize("pid", [0, -1, 2**22 + 1], ids=["zero", "negative", "beyond-pid-max"])
def test_no_such_process(pid: int) -> None:
    assert not pid_alive(pid) and process_start_ticks(pid) == 0 and running_start_ticks(pid) == 0


def test_a_zombie_has_exited() -> None:
    proc = zombie()
    try:
        assert stat_fields(proc.pid) is not None  # it still has a stat line
        assert not pid_alive(proc.pid) and not pid_alive(proc.pid, process_start_ticks(proc.pid))
        assert running_start_ticks(proc.pid) == 0 < process_start_ticks(proc.pid)
    finally:
        proc.wait()
    assert stat_fields(proc.pid) is None


def test_group_members_are_the_live_processes_of_the_group(sleeper: subprocess.Popen[bytes]) -> None:
    assert group_members(sleeper.pid) == [sleeper.pid]  # it leads its own session and group
    fields = stat_fields(sleeper.pid)
    assert fields is not None and int(fields[2]) == sleeper.pid
