"""CPU slices of GPU holders: one cgroup per holder (a rollout instance's server, a training worker) with a
quota of (GPUs held) x (cores per GPU), named so that whoever finds it knows whose it is.

A slice is named `<job>@<holder>@<owner pid>-<owner start ticks>`: the owner is the process whose life the
slice lasts (the Ray actor holding the GPUs). A slice whose owner is gone (the start ticks guard against a
reused pid) is an orphan of a crash; `sweep_orphans` removes every one, and each new slice sweeps first, so
the next start cleans up after a killed job. `CpuSlices.remove_job` removes all slices of one job.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass

import psutil

from libra.metering.cgroup import PROBE_NAME, CpuCgroup
from libra.proc_stat import pid_alive, running_start_ticks

log = logging.getLogger(__name__)

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")
_NAME = re.compile(r"^(?P<job>[A-Za-z0-9_.-]+)@(?P<holder>[A-Za-z0-9_.-]+)@(?P<pid>\d+)-(?P<ticks>\d+)$")
PART_MAX = 80
_PROBE = re.compile(rf"^{PROBE_NAME}-(?P<pid>\d+)$")


def safe_part(text: str) -> str:
    """`text` as a part of a slice name (letters, digits, '_', '.', '-'; at most 80 characters)."""
    return (_UNSAFE.sub("-", text).strip("-") or "x")[:PART_MAX]


@dataclass(frozen=True)
class SliceName:
    """Whose slice a cgroup is."""

    job: str
    holder: str
    owner_pid: int
    owner_ticks: int

    def __str__(self) -> str:
        return f"{self.job}@{self.holder}@{self.owner_pid}-{self.owner_ticks}"

    @classmethod
    def parse(cls, name: str) -> SliceName | None:
        """The slice a directory name describes, None for anything that is not a slice."""
        m = _NAME.match(name)
        if m is None:
            return None
        return cls(m["job"], m["holder"], int(m["pid"]), int(m["ticks"]))

    def owner_alive(self) -> bool:
        return self.owner_ticks != 0 and pid_alive(self.owner_pid, self.owner_ticks)


@dataclass(frozen=True)
class Slice:
    """One made slice: its name, cgroup path and quota."""

    name: SliceName
    path: str
    cores: float


class CpuSlices:
    """The slices of job `job` under a CPU controller."""

    def __init__(self, cgroup: CpuCgroup, job: str) -> None:
        self.cgroup = cgroup
        self.job = safe_part(job)

    def open(self, holder: str, cores: float, owner_pid: int | None = None) -> Slice:
        """The slice of `holder` owned by `owner_pid` (default: this process) with a quota of `cores`, made
        if missing (its quota set if it exists). Orphaned slices of any job are removed first."""
        owner = os.getpid() if owner_pid is None else owner_pid
        ticks = running_start_ticks(owner)
        if not ticks:
            raise ProcessLookupError(f"the owner of slice {holder!r} (pid {owner}) does not run")
        self.sweep_orphans()
        name = SliceName(self.job, safe_part(holder), owner, ticks)
        return Slice(name, self.cgroup.make(str(name), cores), cores)

    def resize(self, piece: Slice, cores: float) -> Slice:
        """The same slice with a quota of `cores` (the holder's GPU count changed)."""
        self.cgroup.set_quota(piece.path, cores)
        return Slice(piece.name, piece.path, cores)

    def join(self, piece: Slice, pid: int, children: bool = True) -> list[int]:
        """Move `pid` and (with `children`) every descendant into the slice; returns the pids moved. A parent
        moves before its children are listed, so a child forked meanwhile is born inside."""
        return self._move_tree(pid, piece.path, children)

    def leave(self, pid: int, children: bool = True) -> list[int]:
        """Move `pid` and (with `children`) every descendant out of any slice, to the home group (unmetered,
        where the controller and Ray run); returns the pids moved."""
        return self._move_tree(pid, self.cgroup.home, children)

    def _move_tree(self, pid: int, path: str, children: bool) -> list[int]:
        moved: list[int] = []
        pending = [pid]
        while pending:
            current = pending.pop()
            if not self.cgroup.move(current, path):
                continue
            moved.append(current)
            if children:
                try:
                    pending += [c.pid for c in psutil.Process(current).children()]
                except psutil.NoSuchProcess:
                    pass
        return moved

    def remove(self, piece: Slice) -> None:
        """Remove the slice; whatever still runs in it goes back to the controller's home group."""
        self.cgroup.remove(piece.path)

    def names(self) -> list[SliceName]:
        """This job's slices."""
        return [n for n in self._all() if n.job == self.job]

    def remove_job(self, wait_s: float = 0.0) -> list[SliceName]:
        """Remove every slice of this job (the job has ended), after waiting up to `wait_s` for their owners
        to exit (holders killed at the end of a job take a moment to go); returns them."""
        deadline = time.monotonic() + wait_s
        while any(n.owner_alive() for n in self.names()) and time.monotonic() < deadline:
            time.sleep(0.1)
        gone = self.names()
        for name in gone:
            self.cgroup.remove(self.cgroup.path(str(name)))
        return gone

    def sweep_orphans(self) -> list[SliceName]:
        """Remove the slices (of any job) whose owner no longer runs; returns them."""
        return sweep_orphans(self.cgroup)

    def _all(self) -> list[SliceName]:
        return [n for n in map(SliceName.parse, self.cgroup.names()) if n is not None]


def sweep_orphans(cgroup: CpuCgroup) -> list[SliceName]:
    """Remove every slice under `cgroup` whose owner no longer runs (and the probe group of a process that
    died while probing); returns the slices."""
    gone = []
    for entry in cgroup.names():
        probe = _PROBE.match(entry)
        if probe and not pid_alive(int(probe["pid"])):
            cgroup.remove(cgroup.path(entry))
        name = SliceName.parse(entry)
        if name is None or name.owner_alive():
            continue
        try:
            cgroup.remove(cgroup.path(str(name)))
        except FileNotFoundError:
            continue  # removed at the same moment by another sweep
        log.info("removed CPU slice %s: its owner (pid %d) is gone", name, name.owner_pid)
        gone.append(name)
    return gone
