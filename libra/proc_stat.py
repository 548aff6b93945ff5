"""A process's /proc stat line read once and cut after the command name: its state, process group and kernel
start time, and whether a recorded process still runs (standard library only: the server guard runs it as a
small process of its own, and the CPU meter and the rollout pool read it too)."""

from __future__ import annotations

import os


def stat_fields(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (the state first; `proc(5)` numbers them from 3),
    None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            stat = fh.read()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2 :].split()


def group_stat_fields(pgid: int) -> dict[int, list[str]]:
    """Per process of process group `pgid`: its `stat_fields`."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = stat_fields(entry)
        if fields is not None and len(fields) > 2 and int(fields[2]) == pgid:
            found[int(entry)] = fields
    return found


def group_members(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes in process group `pgid`."""
    return [pid for pid, fields in group_stat_fields(pgid).items() if fields[0] != "Z"]


def process_start_ticks(pid: int) -> int:
    """The kernel start time of `pid` (clock ticks since boot), 0 if unknown; guards against pid reuse."""
    fields = stat_fields(pid)
    return int(fields[19]) if fields is not None and len(fields) > 19 else 0


def running_start_ticks(pid: int) -> int:
    """The kernel start time of `pid` while it runs; 0 when it is gone or a zombie (it has exited)."""
    fields = stat_fields(pid) if pid > 0 else None
    if not fields or fields[0] == "Z" or len(fields) <= 19:
        return 0
    return int(fields[19])


def pid_alive(pid: int, start_ticks: int = 0) -> bool:
    """True when `pid` runs (and, given `start_ticks`, is the same process that was recorded)."""
    ticks = running_start_ticks(pid)
    return ticks != 0 and (not start_ticks or ticks == start_ticks)
