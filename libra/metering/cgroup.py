"""The kernel's CPU controller, cgroup v2 or v1, behind one small interface (`CpuCgroup`).

`find_cpu_cgroup(root)` returns the controller at `root` (a cgroup directory) or, with no root, at the cgroup
this process runs in on a mounted CPU controller, choosing cgroup v2 (`cpu.max`) where its `cpu` controller is
available and writable and cgroup v1 (`cpu.cfs_quota_us`) otherwise. It proves writability by making and
removing a probe group; where neither works it raises `CgroupUnavailable` saying why, so a job never runs
unmetered without knowing.

All groups are made under `<root>/libra`, which outweighs its siblings so that each slice gets its quota on a
busy machine (the quotas cap what the slices take; the rest of the cores stay with the others). The removal of
the last group under it removes `<root>/libra` too, so no group (and no weight) is left on the machine after a
job; other jobs on the machine may make and remove groups under it at the same moment, so it goes only when
empty, and a group being made in a `<root>/libra` that has just been removed makes it again. A process
written into a group's `cgroup.procs` moves with all its threads; the children it starts afterwards are born
in the same group. Every file access goes through `CgroupFs`, the real filesystem by default (a test passes
a directory that stands in for the mount).
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass, field
from functools import lru_cache

from libra.metering.spec import MIN_QUOTA_US, PERIOD_US

LIBRA_DIR = "libra"
PROBE_NAME = "probe"
REMOVE_ATTEMPTS = 20
# The weight of `<root>/libra` against its siblings (the controller, Ray and anything else on the machine), in
# cores: the largest the kernel takes, so that each slice gets its quota however busy the machine is. A
# slice is capped by its quota, so the others keep every core the slices do not hold.
BASE_WEIGHT_CORES = 256.0


class CgroupUnavailable(RuntimeError):
    """No CPU controller can be written here; the message says what was tried and why it failed."""


class CgroupFs:
    """File operations on a cgroup filesystem (the kernel's, through `os`)."""

    def read(self, path: str) -> str:
        with open(path, encoding="utf-8") as fh:
            return fh.read()

    def write(self, path: str, text: str) -> None:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)

    def mkdir(self, path: str) -> None:
        os.mkdir(path)

    def rmdir(self, path: str) -> None:
        os.rmdir(path)

    def listdir(self, path: str) -> list[str]:
        return [n for n in os.listdir(path) if os.path.isdir(os.path.join(path, n))]

    def exists(self, path: str) -> bool:
        return os.path.exists(path)


@dataclass
class CpuCgroup:
    """The CPU controller of cgroup `version` (1 or 2) at `root`; groups live under `<root>/libra`.

    `home` is where the processes of a removed group go: `root` on cgroup v1; on cgroup v2 the top of the
    mount, the one cgroup that may hold processes while its children have the cpu controller."""

    root: str
    version: int
    home: str
    fs: CgroupFs = field(default_factory=CgroupFs)

    @property
    def base(self) -> str:
        return os.path.join(self.root, LIBRA_DIR)

    def path(self, name: str) -> str:
        return os.path.join(self.base, name)

    # ---- groups ------------------------------------------------------------------------------------------
    def ensure_base(self) -> None:
        """Make `<root>/libra` (on cgroup v2 with the cpu controller enabled for it and its children)."""
        if self.version == 2:
            self._enable_cpu(self.root)
        if not self.fs.exists(self.base):
            try:
                self.fs.mkdir(self.base)
            except FileExistsError:
                pass  # made at the same moment by another holder
        if self.version == 2:
            self._enable_cpu(self.base)
        self._set_weight(self.base, BASE_WEIGHT_CORES)

    def _enable_cpu(self, directory: str) -> None:
        control = os.path.join(directory, "cgroup.subtree_control")
        if "cpu" not in self.fs.read(control).split():
            self.fs.write(control, "+cpu")

    def make(self, name: str, cores: float) -> str:
        """The group `name` with a quota of `cores` (made if missing); returns its path."""
        path = self.path(name)
        for _ in range(REMOVE_ATTEMPTS - 1):
            try:
                return self._make(path, cores)
            except FileNotFoundError:
                continue  # `<root>/libra` went with another job's last group between our steps: make it again
        return self._make(path, cores)

    def _make(self, path: str, cores: float) -> str:
        self.ensure_base()
        if not self.fs.exists(path):
            try:
                self.fs.mkdir(path)
            except FileExistsError:
                pass
        self.set_quota(path, cores)
        return path

    def names(self) -> list[str]:
        """The groups under `<root>/libra`."""
        return sorted(self.fs.listdir(self.base)) if self.fs.exists(self.base) else []

    def set_quota(self, path: str, cores: float) -> None:
        """At most `cores` cores for the group, and a weight in proportion, so that slices that compete for
        the CPU share it as their quotas do."""
        quota = max(MIN_QUOTA_US, round(cores * PERIOD_US))
        if self.version == 2:
            self.fs.write(os.path.join(path, "cpu.max"), f"{quota} {PERIOD_US}")
        else:
            self.fs.write(os.path.join(path, "cpu.cfs_period_us"), str(PERIOD_US))
            self.fs.write(os.path.join(path, "cpu.cfs_quota_us"), str(quota))
        self._set_weight(path, cores)

    def _set_weight(self, path: str, cores: float) -> None:
        if self.version == 2:  # cpu.weight: 1..10000, 100 = one default group
            self.fs.write(os.path.join(path, "cpu.weight"), str(min(10_000, max(1, round(cores * 100)))))
        else:  # cpu.shares: 2..262144, 1024 = one default group
            self.fs.write(os.path.join(path, "cpu.shares"), str(min(262_144, max(2, round(cores * 1024)))))

    def quota(self, path: str) -> float:
        """The group's quota in cores (0 = unlimited)."""
        if self.version == 2:
            quota, period = self.fs.read(os.path.join(path, "cpu.max")).split()[:2]
            return 0.0 if quota == "max" else int(quota) / int(period)
        quota_us = int(self.fs.read(os.path.join(path, "cpu.cfs_quota_us")))
        period_us = int(self.fs.read(os.path.join(path, "cpu.cfs_period_us")))
        return 0.0 if quota_us < 0 else quota_us / period_us

    # ---- processes -------------------------------------------------------------------------------------
    def pids(self, path: str) -> list[int]:
        return [int(p) for p in self.fs.read(os.path.join(path, "cgroup.procs")).split()]

    def move(self, pid: int, path: str) -> bool:
        """Move process `pid` (all its threads) into the group at `path`; False when it has exited."""
        try:
            self.fs.write(os.path.join(path, "cgroup.procs"), str(pid))
        except ProcessLookupError:
            return False
        except OSError as exc:
            if exc.errno == errno.ESRCH:
                return False
            raise
        return True

    def remove(self, path: str) -> None:
        """Move what still runs in the group to `home` and remove the group, and `<root>/libra` with it when
        nothing else is left there. A process may fork while its siblings move, so this repeats until the group
        is empty (a few rounds at most)."""
        self._remove_group(path)
        self.remove_base_if_empty()

    def _remove_group(self, path: str) -> None:
        for _ in range(REMOVE_ATTEMPTS):
            if not self.fs.exists(path):
                return
            try:
                for pid in self.pids(path):
                    self.move(pid, self.home)
                self.fs.rmdir(path)
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                if exc.errno not in (errno.EBUSY, errno.ENOTEMPTY):
                    raise
            time.sleep(0.05)
        raise OSError(errno.EBUSY, f"cgroup {path} still holds processes {self.pids(path)} after "
                                   f"{REMOVE_ATTEMPTS} attempts to empty it")

    def remove_base_if_empty(self) -> bool:
        """Remove `<root>/libra` when no group and no process is left in it; True when it is gone. Another
        job may make a group in it at any moment: then the kernel refuses the removal (EBUSY) and it stays."""
        try:
            if self.fs.listdir(self.base) or self.pids(self.base):
                return False
            self.fs.rmdir(self.base)
        except FileNotFoundError:
            return True  # removed at the same moment by another job
        except OSError as exc:
            if exc.errno in (errno.EBUSY, errno.ENOTEMPTY):
                return False  # a group or a process arrived between the look and the removal
            raise
        return True


# ---- finding the controller ----------------------------------------------------------------------------
def _cgroup_version(root: str, fs: CgroupFs) -> int:
    """2 or 1 for a cgroup directory with the CPU controller's files, 0 otherwise."""
    controllers = os.path.join(root, "cgroup.controllers")
    if fs.exists(controllers):
        return 2 if "cpu" in fs.read(controllers).split() else 0
    return 1 if fs.exists(os.path.join(root, "cpu.cfs_quota_us")) else 0


def _v2_home(root: str, fs: CgroupFs) -> str:
    home = root
    while fs.exists(os.path.join(os.path.dirname(home), "cgroup.controllers")) and os.path.dirname(home) != home:
        home = os.path.dirname(home)
    return home


def cgroup_at(root: str, fs: CgroupFs | None = None) -> CpuCgroup:
    """The CPU controller at the cgroup directory `root`, proven writable by a probe group."""
    fs = fs or CgroupFs()
    if not fs.exists(root):
        raise CgroupUnavailable(f"{root} does not exist")
    version = _cgroup_version(root, fs)
    if version == 0:
        raise CgroupUnavailable(f"{root} is not a cgroup directory with the CPU controller (no cgroup v2 "
                                "cgroup.controllers listing cpu, no cgroup v1 cpu.cfs_quota_us)")
    cgroup = CpuCgroup(root=root, version=version, home=root if version == 1 else _v2_home(root, fs), fs=fs)
    probe = cgroup.path(f"{PROBE_NAME}-{os.getpid()}")
    try:
        cgroup.make(os.path.basename(probe), 0.5)
        cgroup.remove(probe)
    except OSError as exc:
        raise CgroupUnavailable(f"cannot make a CPU-limited group under {root} (cgroup v{version}): "
                                f"{exc.strerror or exc}") from exc
    return cgroup


def _own_cgroups() -> tuple[str, str]:
    """This process's cgroup v2 path and its cgroup v1 path on the hierarchy with the cpu controller."""
    v2 = v1 = ""
    with open("/proc/self/cgroup", encoding="utf-8") as fh:
        for line in fh:
            number, controllers, path = line.rstrip("\n").split(":", 2)
            if number == "0" and not controllers:
                v2 = path
            elif "cpu" in controllers.split(","):
                v1 = path
    return v2, v1


def _mounts() -> list[tuple[str, str, str]]:
    """(filesystem type, mount point, mount root) of every cgroup mount, the cgroup v1 ones only when they
    carry the cpu controller."""
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8") as fh:
        for line in fh:
            before, _, after = line.partition(" - ")
            fields, tail = before.split(), after.split()
            if len(fields) < 5 or len(tail) < 3:
                continue
            fstype, options = tail[0], tail[2].split(",")
            if fstype == "cgroup2" or (fstype == "cgroup" and "cpu" in options):
                found.append((fstype, fields[4], fields[3]))
    return found


def _under_mount(mount_point: str, mount_root: str, own: str) -> str:
    """Where this process's cgroup `own` is under a mount; a process already in one of our groups gets the
    cgroup above `libra`."""
    parts = own.strip("/").split("/") if own.strip("/") else []
    if LIBRA_DIR in parts:
        parts = parts[: parts.index(LIBRA_DIR)]
    own = "/" + "/".join(parts)
    rel = os.path.relpath(own, mount_root) if own.startswith(mount_root) else "."
    return os.path.normpath(os.path.join(mount_point, rel))


def candidate_roots() -> list[str]:
    """The cgroup directories this process could meter under, cgroup v2 first."""
    try:
        v2, v1 = _own_cgroups()
        mounts = _mounts()
    except OSError:
        return []
    roots = [_under_mount(point, root, v2) for kind, point, root in mounts if kind == "cgroup2" and v2]
    roots += [_under_mount(point, root, v1) for kind, point, root in mounts if kind == "cgroup" and v1]
    return roots


@lru_cache(maxsize=8)
def find_cpu_cgroup(root: str = "") -> CpuCgroup:
    """The writable CPU controller at `root`, or (empty `root`) the first writable one of `candidate_roots`.
    Raises `CgroupUnavailable` with every reason. Cached per process: the probe runs once."""
    if root:
        return cgroup_at(root)
    reasons = []
    for candidate in candidate_roots():
        try:
            return cgroup_at(candidate)
        except CgroupUnavailable as exc:
            reasons.append(str(exc))
    if not reasons:
        reasons.append("no cgroup filesystem with a CPU controller is mounted")
    raise CgroupUnavailable("no writable CPU controller: " + "; ".join(reasons))


def availability(root: str = "") -> str:
    """Why CPU metering cannot work here ("" when it can)."""
    try:
        find_cpu_cgroup(root)
    except CgroupUnavailable as exc:
        return str(exc)
    return ""
