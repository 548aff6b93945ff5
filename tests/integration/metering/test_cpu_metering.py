"""Metered logical GPUs on this machine's real CPU controller: busy processes get the CPU time of their slices,
a moved process gets its new share, slices are removed at the end and after their owner is SIGKILLed, and a
training worker of a metered job runs inside its slice. Skipped where no CPU controller can be written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from libra.cluster.ray_runtime import RayRuntime
from libra.config.mapping import cpu_config, training_pool_spec
from libra.metering.cgroup import CpuCgroup, availability, find_cpu_cgroup
from libra.metering.slices import CpuSlices, Slice
from libra.training.pool import TrainingPool

REPO = Path(__file__).resolve().parents[3]
UNAVAILABLE = availability()
pytestmark = [pytest.mark.skipif(bool(UNAVAILABLE), reason=f"CPU metering cannot run here: {UNAVAILABLE}"),
              pytest.mark.alone]
BUSY = [sys.executable, "-c", "while True: pass"]
TOLERANCE = 0.15


@pytest.fixture
def cgroup() -> CpuCgroup:
    return find_cpu_cgroup()


@pytest.fixture
def slices(cgroup: CpuCgroup) -> Iterator[CpuSlices]:
    """A job of this test's own; every slice it made is gone afterwards."""
    job = CpuSlices(cgroup, f"test-metering-{os.getpid()}-{time.monotonic_ns()}")
    yield job
    job.remove_job()
    assert job.names() == []
    assert_no_libra_group_left(cgroup)


def assert_no_libra_group_left(cgroup: CpuCgroup) -> None:
    """`<root>/libra` is gone with its last group; it may stay only while another job on this machine holds a
    group (or a process) in it."""
    base = Path(cgroup.base)
    if base.exists():
        others = cgroup.names() or cgroup.pids(cgroup.base)
        assert others, f"{base} is left empty on the machine"


@pytest.fixture
def busy() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def cpu_seconds(pids: list[int]) -> list[float]:
    return [sum(psutil.Process(p).cpu_times()[:2]) for p in pids]


def cores_used(pids: list[int], seconds: float) -> list[float]:
    """The cores each process used over `seconds` of wall time."""
    before, t0 = cpu_seconds(pids), time.monotonic()
    time.sleep(seconds)
    after, elapsed = cpu_seconds(pids), time.monotonic() - t0
    return [(a - b) / elapsed for a, b in zip(after, before, strict=True)]


def procs(piece: Slice) -> set[int]:
    return {int(p) for p in Path(piece.path, "cgroup.procs").read_text().split()}


def test_slices_share_the_cpu_as_their_quotas(slices: CpuSlices, busy: list) -> None:
    small, large = slices.open("rollout-0", 0.25), slices.open("rollout-1", 0.75)
    busy += [subprocess.Popen(BUSY), subprocess.Popen(BUSY)]
    a, b = busy[0].pid, busy[1].pid
    slices.join(small, a)
    slices.join(large, b)
    assert procs(small) == {a} and procs(large) == {b}
    used_a, used_b = cores_used([a, b], 3.0)
    assert used_a <= 0.25 * (1 + TOLERANCE), used_a
    assert abs((used_b / used_a) / 3.0 - 1) <= TOLERANCE, (used_a, used_b)
    # the GPUs move: the small holder's process joins a slice of twice its former quota
    moved = slices.open("train-0", 0.5)
    slices.join(moved, a)
    assert procs(small) == set() and procs(moved) == {a}
    (used_a,) = cores_used([a], 2.0)
    assert abs(used_a / 0.5 - 1) <= TOLERANCE, used_a
    for piece in (small, large, moved):
        slices.remove(piece)
    assert slices.names() == []
    home = {int(p) for p in Path(slices.cgroup.home, "cgroup.procs").read_text().split()}
    assert {a, b} <= home


def test_slice_of_a_killed_owner_is_removed_by_the_next_start(cgroup: CpuCgroup, slices: CpuSlices) -> None:
    owner_code = (
        "import subprocess, sys, time\n"
        "from libra.metering.cgroup import find_cpu_cgroup\n"
        "from libra.metering.slices import CpuSlices\n"
        f"job = CpuSlices(find_cpu_cgroup(), {slices.job!r})\n"
        "child = subprocess.Popen([sys.executable, '-c', 'while True: pass'])\n"
        "piece = job.open('rollout-0', 0.25)\n"
        "job.join(piece, child.pid)\n"
        "print(child.pid, piece.path, flush=True)\n"
        "time.sleep(120)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", owner_code], stdout=subprocess.PIPE, cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    child = 0
    try:
        assert owner.stdout is not None
        pid_text, path = owner.stdout.readline().decode().split()
        child = int(pid_text)
        assert Path(path).is_dir() and child in {int(p) for p in Path(path, "cgroup.procs").read_text().split()}
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        assert Path(path).is_dir()  # nobody cleaned up: the owner was killed
        CpuSlices(cgroup, f"next-start-{os.getpid()}").sweep_orphans()  # what every new slice does first
        assert not Path(path).exists()
        assert_no_libra_group_left(cgroup)
        assert psutil.pid_exists(child)  # its process went home, still running, no longer metered
    finally:
        owner.kill()
        owner.wait()
        if child:
            os.kill(child, signal.SIGKILL)


def test_training_worker_runs_in_its_slice(ray_runtime: RayRuntime, tiny_model_dir: str, tmp_path: Path,
                                           cgroup: CpuCgroup) -> None:
    cfg = cpu_config(tiny_model_dir, name=f"metered-{os.getpid()}", run_dir=str(tmp_path),
                     cluster={"metered_cpu_per_gpu": 0.5})
    spec = training_pool_spec(cfg, 1, run_dir=str(tmp_path / "training"))
    job = CpuSlices(cgroup, spec.metering.job)
    pool = TrainingPool(ray_runtime, spec, name="test-metered-train")
    try:
        pool.start()
        (worker,) = pool.worker_pids()
        (name,) = job.names()
        assert name.holder == "train-0" and name.owner_pid == worker
        path = cgroup.path(str(name))
        assert worker in {int(p) for p in Path(path, "cgroup.procs").read_text().split()}
        assert cgroup.quota(path) == 0.5
        assert os.getpid() not in {int(p) for p in Path(path, "cgroup.procs").read_text().split()}
    finally:
        pool.shutdown()
    assert job.names() == []  # a clean shutdown removes the worker's slice
    assert_no_libra_group_left(cgroup)
