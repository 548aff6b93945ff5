"""CPU slices on a temporary directory standing in for the cgroup mount: the directory gets the files the
kernel would show (`cgroup.procs`, the quota files) and `DirCgroupFs` gives writes the kernel's meaning (a pid
written to a group's `cgroup.procs` leaves every other group; a group holding processes cannot be removed).
The processes are real (sleeping children), so owner liveness is the real check."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from libra.metering.cgroup import CgroupFs, CgroupUnavailable, CpuCgroup, cgroup_at
from libra.metering.holder import GpuHolderSlice, MeteringError, end_job
from libra.metering.slices import CpuSlices, SliceName, safe_part, sweep_orphans
from libra.metering.spec import CpuMetering
from libra.proc_stat import process_start_ticks

V1_FILES = {"cgroup.procs": "", "cpu.cfs_quota_us": "-1", "cpu.cfs_period_us": "100000", "cpu.shares": "1024"}
V2_FILES = {"cgroup.procs": "", "cgroup.controllers": "cpu io memory", "cgroup.subtree_control": "",
            "cpu.max": "max 100000", "cpu.weight": "100"}


class DirCgroupFs(CgroupFs):
    """A directory tree that behaves like a cgroup mount for what the metering code does with it."""

    def __init__(self, root: Path, files: dict[str, str]) -> None:
        self.root = root
        self.files = files
        self.removals: list[str] = []

    def mkdir(self, path: str) -> None:
        os.mkdir(path)
        for name, text in self.files.items():
            Path(path, name).write_text(text)

    def write(self, path: str, text: str) -> None:
        if os.path.basename(path) == "cgroup.procs":
            pid = text.strip()
            if not Path(f"/proc/{pid}").exists():
                raise ProcessLookupError(errno.ESRCH, "no such process")
            for procs in self.root.rglob("cgroup.procs"):
                kept = [p for p in procs.read_text().split() if p != pid]
                procs.write_text("\n".join(kept + ([pid] if str(procs) == path else [])))
            return
        if os.path.basename(path) == "cgroup.subtree_control":
            text = " ".join(sorted(set(Path(path).read_text().split()) | {text.lstrip("+")}))
        super().write(path, text)

    def rmdir(self, path: str) -> None:
        if Path(path, "cgroup.procs").read_text().split() or self.listdir(path):
            raise OSError(errno.EBUSY, "busy", path)
        for name in self.files:
            Path(path, name).unlink()
        os.rmdir(path)
        self.removals.append(os.path.basename(path))


def mount(tmp_path: Path, version: int) -> tuple[CpuCgroup, DirCgroupFs]:
    files = V1_FILES if version == 1 else V2_FILES
    fs = DirCgroupFs(tmp_path, files)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return cgroup_at(str(tmp_path), fs), fs


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Start sleeping processes on demand (`sleepers.append(...)` via `spawn`); all are killed at the end."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def spawn(procs: list[subprocess.Popen[bytes]], code: str = "import time; time.sleep(60)") -> int:
    procs.append(subprocess.Popen([sys.executable, "-c", code]))
    return procs[-1].pid


def procs_of(path: str) -> set[int]:
    return {int(p) for p in Path(path, "cgroup.procs").read_text().split()}


@pytest.mark.parametrize("version", [1, 2], ids=["cgroup-v1", "cgroup-v2"])
def test_slice_quota_join_resize_remove(version: int, tmp_path: Path, sleepers: list) -> None:
    cgroup, _ = mount(tmp_path, version)
    assert cgroup.version == version and cgroup.names() == []  # the probe group is gone
    slices = CpuSlices(cgroup, "dev job/run")
    pid = spawn(sleepers)
    piece = slices.open("rollout-0", 0.5)
    assert piece.name == SliceName("dev-job-run", "rollout-0", os.getpid(), process_start_ticks(os.getpid()))
    assert cgroup.quota(piece.path) == 0.5
    # Written literally, not from PERIOD_US: a slice's period is 20 ms (metering.md says why not 100 ms)
    if version == 2:
        assert Path(piece.path, "cpu.max").read_text().split() == ["10000", "20000"]
    else:
        assert Path(piece.path, "cpu.cfs_quota_us").read_text().strip() == "10000"
        assert Path(piece.path, "cpu.cfs_period_us").read_text().strip() == "20000"
    assert slices.join(piece, pid) == [pid] and procs_of(piece.path) == {pid}
    piece = slices.resize(piece, 1.5)
    assert cgroup.quota(piece.path) == 1.5
    if version == 2:
        assert "cpu" in (tmp_path / "cgroup.subtree_control").read_text().split()
        assert "cpu" in (tmp_path / "libra" / "cgroup.subtree_control").read_text().split()
    slices.remove(piece)
    assert not Path(piece.path).exists()
    assert pid in procs_of(cgroup.home)  # what still ran went home


def test_join_moves_the_whole_process_tree(tmp_path: Path, sleepers: list) -> None:
    cgroup, _ = mount(tmp_path, 1)
    slices = CpuSlices(cgroup, "job")
    child_code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; "
                  "time.sleep(60)']); print('up', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", child_code], stdout=subprocess.PIPE)
    sleepers.append(proc)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"up"
    import psutil

    grandchild = psutil.Process(proc.pid).children()[0].pid
    try:
        piece = slices.open("train-0", 1.0)
        assert set(slices.join(piece, proc.pid)) == {proc.pid, grandchild}
        assert procs_of(piece.path) == {proc.pid, grandchild}
    finally:
        psutil.Process(grandchild).kill()


def test_sweep_removes_slices_of_gone_owners_only(tmp_path: Path, sleepers: list) -> None:
    cgroup, fs = mount(tmp_path, 1)
    owner, other_owner = spawn(sleepers), spawn(sleepers)
    mine, theirs = CpuSlices(cgroup, "job-a"), CpuSlices(cgroup, "job-b")
    orphan = mine.open("rollout-0", 0.25, owner_pid=owner)
    worker = spawn(sleepers)
    mine.join(orphan, worker)  # a process left running in the orphaned slice
    live = theirs.open("train-0", 0.25, owner_pid=other_owner)
    sleepers[0].kill()
    sleepers[0].wait()
    assert [n.holder for n in sweep_orphans(cgroup)] == ["rollout-0"]
    assert not Path(orphan.path).exists() and Path(live.path).exists()
    assert worker in procs_of(cgroup.home)
    # a reused pid is not the owner: the start ticks differ
    stale = SliceName("job-b", "train-1", other_owner, process_start_ticks(other_owner) + 1)
    cgroup.make(str(stale), 0.25)
    assert mine.open("train-2", 0.5).name.holder == "train-2"  # opening a slice sweeps first
    assert str(stale) in fs.removals


def test_remove_job_removes_only_that_job(tmp_path: Path) -> None:
    cgroup, _ = mount(tmp_path, 2)
    a, b = CpuSlices(cgroup, "job-a"), CpuSlices(cgroup, "job-b")
    a.open("rollout-0", 0.25)
    a.open("train-0", 0.25)
    b.open("train-0", 0.25)
    assert sorted(n.holder for n in a.remove_job()) == ["rollout-0", "train-0"]
    assert [n.job for n in map(SliceName.parse, cgroup.names()) if n] == ["job-b"]


@pytest.mark.parametrize(("name", "parsed"), [
    ("job@rollout-0@123-456", SliceName("job", "rollout-0", 123, 456)),
    ("probe-12", None),
    ("job@holder@12", None),
    ("a/b@c@1-2", None),
], ids=["slice", "probe", "no-ticks", "slash"])
def test_slice_names_parse(name: str, parsed: SliceName | None) -> None:
    assert SliceName.parse(name) == parsed
    if parsed is not None:
        assert str(parsed) == name


@pytest.mark.parametrize(("text", "safe"), [("dev", "dev"), ("my job/run 1", "my-job-run-1"), ("@@", "x"),
                                             ("a" * 100, "a" * 80)], ids=["plain", "spaces", "empty", "long"])
def test_safe_part(text: str, safe: str) -> None:
    assert safe_part(text) == safe


@pytest.mark.parametrize(("files", "reason"), [
    ({}, "not a cgroup directory"),
    ({"cgroup.controllers": "io memory"}, "not a cgroup directory"),
], ids=["plain-directory", "v2-without-cpu"])
def test_no_cpu_controller_is_reported(files: dict[str, str], reason: str, tmp_path: Path) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(CgroupUnavailable, match=reason):
        cgroup_at(str(tmp_path), DirCgroupFs(tmp_path, V1_FILES))
    with pytest.raises(CgroupUnavailable, match="does not exist"):
        cgroup_at(str(tmp_path / "missing"))


def test_unwritable_controller_is_reported(tmp_path: Path) -> None:
    class ReadOnly(DirCgroupFs):
        def mkdir(self, path: str) -> None:
            raise PermissionError(errno.EACCES, "Permission denied", path)

    for name, text in V1_FILES.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(CgroupUnavailable, match="cannot make a CPU-limited group .*Permission denied"):
        cgroup_at(str(tmp_path), ReadOnly(tmp_path, V1_FILES))


def test_holder_hook(tmp_path: Path, sleepers: list, monkeypatch: pytest.MonkeyPatch) -> None:
    cgroup, _ = mount(tmp_path, 1)
    monkeypatch.setattr("libra.metering.holder.find_cpu_cgroup", lambda root: cgroup)
    pid = spawn(sleepers)
    off = GpuHolderSlice(CpuMetering(cores_per_gpu=0.0, job="j", cgroup_root=""), "rollout-0")
    assert off.hold(pid, 2) is None and cgroup.names() == []
    holder = GpuHolderSlice(CpuMetering(cores_per_gpu=0.25, job="j", cgroup_root=""), "rollout-0")
    piece = holder.hold(pid, 2)
    assert piece is not None and cgroup.quota(piece.path) == 0.5 and procs_of(piece.path) == {pid}
    piece = holder.hold(pid, 4)  # the holder's GPUs changed: same slice, new quota
    assert piece is not None and cgroup.quota(piece.path) == 1.0 and len(cgroup.names()) == 1
    holder.release()
    assert cgroup.names() == []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(MeteringError, match="holds no logical GPU"):
        holder.hold(pid)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4,5")
    piece = holder.hold(pid)
    assert piece is not None and cgroup.quota(piece.path) == 0.75
    holder.release()


def test_holder_without_controller_refuses_to_run_unmetered(tmp_path: Path) -> None:
    holder = GpuHolderSlice(CpuMetering(cores_per_gpu=0.25, job="j", cgroup_root=str(tmp_path)), "train-0")
    with pytest.raises(MeteringError, match="not a cgroup directory.*metered_cpu_per_gpu: 0"):
        holder.hold(os.getpid(), 1)


def test_end_job_waits_for_killed_owners(tmp_path: Path, sleepers: list, monkeypatch: pytest.MonkeyPatch) -> None:
    cgroup, _ = mount(tmp_path, 1)
    monkeypatch.setattr("libra.metering.holder.find_cpu_cgroup", lambda root: cgroup)
    metering = CpuMetering(cores_per_gpu=0.5, job="ended", cgroup_root="")
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    sleepers.append(owner)
    CpuSlices(cgroup, "ended").open("train-0", 0.5, owner_pid=owner.pid)
    CpuSlices(cgroup, "other").open("train-0", 0.5)
    assert end_job(CpuMetering(cores_per_gpu=0.0, job="ended", cgroup_root=""), wait_s=0) == 0
    assert end_job(metering, wait_s=30) == 1
    assert owner.poll() is not None  # it waited for the owner to exit
    assert [n.job for n in map(SliceName.parse, cgroup.names()) if n] == ["other"]


def test_sweep_removes_the_probe_of_a_dead_prober(tmp_path: Path, sleepers: list) -> None:
    cgroup, _ = mount(tmp_path, 1)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = spawn(sleepers)
    cgroup.make(f"probe-{dead.pid}", 0.5)
    cgroup.make(f"probe-{live}", 0.5)
    assert sweep_orphans(cgroup) == []  # probes are not slices
    assert cgroup.names() == [f"probe-{live}"]


def remove_one(slices: CpuSlices, piece: Any) -> None:
    slices.remove(piece)


def remove_job(slices: CpuSlices, piece: Any) -> None:
    slices.remove_job()


def sweep(slices: CpuSlices, piece: Any) -> None:
    sweep_orphans(slices.cgroup)


@pytest.mark.parametrize("version", [1, 2], ids=["cgroup-v1", "cgroup-v2"])
@pytest.mark.parametrize("remove", [remove_one, remove_job, sweep], ids=["remove", "remove-job", "sweep-orphans"])
def test_last_slice_removes_the_libra_group(version: int, remove: Callable[[CpuSlices, Any], None],
                                            tmp_path: Path, sleepers: list) -> None:
    cgroup, fs = mount(tmp_path, version)
    assert not Path(cgroup.base).exists()  # the probe left nothing behind
    owner = spawn(sleepers)
    mine, theirs = CpuSlices(cgroup, "job-a"), CpuSlices(cgroup, "job-b")
    piece = mine.open("rollout-0", 0.25, owner_pid=owner)
    other = theirs.open("train-0", 0.25)
    sleepers[0].kill()
    sleepers[0].wait()
    remove(mine, piece)
    assert cgroup.names() == [str(other.name)]  # another job's slice keeps the group
    theirs.remove(other)
    assert not Path(cgroup.base).exists() and "libra" in fs.removals
    assert theirs.open("train-0", 0.5).path == other.path  # made again on demand


def test_libra_group_with_a_process_stays(tmp_path: Path, sleepers: list) -> None:
    cgroup, _ = mount(tmp_path, 1)
    slices = CpuSlices(cgroup, "job")
    piece = slices.open("rollout-0", 0.25)
    pid = spawn(sleepers)
    assert cgroup.move(pid, cgroup.base)  # cgroup v1: a process may live in the group itself
    slices.remove(piece)
    assert Path(cgroup.base).is_dir() and procs_of(cgroup.base) == {pid}
    assert cgroup.remove_base_if_empty() is False


class Racing(DirCgroupFs):
    """Another job acts on the mount at one moment: `before_rmdir_of_base` just before `libra` is removed,
    `before_mkdir` just before a slice directory is made (once each)."""

    def __init__(self, root: Path, files: dict[str, str]) -> None:
        super().__init__(root, files)
        self.before_rmdir_of_base: Callable[[], None] | None = None
        self.before_mkdir: Callable[[], None] | None = None

    def rmdir(self, path: str) -> None:
        if os.path.basename(path) == "libra" and self.before_rmdir_of_base is not None:
            hook, self.before_rmdir_of_base = self.before_rmdir_of_base, None
            hook()
        super().rmdir(path)

    def mkdir(self, path: str) -> None:
        if os.path.basename(os.path.dirname(path)) == "libra" and self.before_mkdir is not None:
            hook, self.before_mkdir = self.before_mkdir, None
            hook()
        super().mkdir(path)


def racing_mount(tmp_path: Path) -> tuple[CpuCgroup, Racing]:
    fs = Racing(tmp_path, V2_FILES)
    for name, text in V2_FILES.items():
        (tmp_path / name).write_text(text)
    return cgroup_at(str(tmp_path), fs), fs


def test_a_slice_made_during_the_removal_keeps_the_group(tmp_path: Path) -> None:
    cgroup, fs = racing_mount(tmp_path)
    mine, theirs = CpuSlices(cgroup, "job-a"), CpuSlices(cgroup, "job-b")
    piece = mine.open("rollout-0", 0.25)
    made: list[str] = []
    fs.before_rmdir_of_base = lambda: made.append(str(theirs.open("train-0", 0.25).name))
    mine.remove(piece)  # the kernel refuses to remove the group now holding job-b's slice: no error
    assert cgroup.names() == made and len(made) == 1


def test_a_group_removed_by_another_job_is_made_again(tmp_path: Path) -> None:
    cgroup, fs = racing_mount(tmp_path)
    fs.before_mkdir = lambda: cgroup.remove_base_if_empty()  # another job's last slice went just now
    piece = CpuSlices(cgroup, "job").open("train-0", 0.5)
    assert Path(piece.path).is_dir() and cgroup.quota(piece.path) == 0.5
    assert fs.removals.count("libra") == 2  # after the probe, and by the other job


def test_a_group_removed_by_another_job_at_the_same_moment(tmp_path: Path) -> None:
    cgroup, fs = racing_mount(tmp_path)
    slices = CpuSlices(cgroup, "job")
    piece = slices.open("train-0", 0.5)
    # both see the last slice gone; the other removes `libra` first
    fs.before_rmdir_of_base = lambda: DirCgroupFs.rmdir(fs, cgroup.base)
    slices.remove(piece)
    assert not Path(cgroup.base).exists()
    assert cgroup.remove_base_if_empty() is True
