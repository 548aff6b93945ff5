"""The gain benchmark's account of where the slices' CPU goes: phases from metrics rows, cores per kind of
process and slice, and the reading of a slice tree (a folder laid out as the cgroup is, holding this process)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from benchmark_modules import load_benchmark_module

sc = load_benchmark_module("slice_cpu")

ROWS = [  # step 1 starts the borrowed workers and is left out
    {"wall_time": 100.0, "time_step_s": 10.0, "time_rollout_s": 6.0, "time_train_s": 3.0},
    {"wall_time": 110.0, "time_step_s": 10.0, "time_rollout_s": 4.0, "time_train_s": 5.0},
]


def proc(holder: str, pid: int, cpu_s: float, ray: bool = False, inside: bool = True) -> object:
    return sc.ProcessSample(holder, pid, cpu_s, ray, inside)


def test_phase_intervals_follow_the_rows() -> None:
    assert sc.phase_intervals(ROWS) == [("rollout", 100.0, 104.0), ("train", 104.0, 109.0)]


@pytest.mark.parametrize(("snapshots", "expect"), [
    pytest.param(
        [sc.Snapshot(100.0, [proc("rollout-1", 7, 1.0), proc("rollout-1", 8, 5.0, ray=True)]),
         sc.Snapshot(102.0, [proc("rollout-1", 7, 1.3), proc("rollout-1", 8, 5.02, ray=True)])],
        {"rollout": {"sampled_s": 2.0, "cores": {"rollout_slices": {"borrowed_worker": 0.01, "server": 0.15}}},
         "train": {"sampled_s": 0.0, "cores": {}}},
        id="server-and-parked-replica-in-a-rollout-phase"),
    pytest.param(
        [sc.Snapshot(104.5, [proc("train-0", 3, 2.0), proc("rollout-2", 9, 1.0, ray=True)]),
         sc.Snapshot(105.5, [proc("train-0", 3, 2.2), proc("rollout-2", 9, 1.19, ray=True)])],
        {"rollout": {"sampled_s": 0.0, "cores": {}},
         "train": {"sampled_s": 1.0, "cores": {"rollout_slices": {"borrowed_worker": 0.19},
                                                "train_slices": {"training_worker": 0.2}}}},
        id="borrowed-and-core-ranks-in-a-training-phase"),
    pytest.param(
        [sc.Snapshot(95.0, [proc("rollout-1", 7, 1.0)]), sc.Snapshot(96.0, [proc("rollout-1", 7, 1.5)])],
        {"rollout": {"sampled_s": 0.0, "cores": {}}, "train": {"sampled_s": 0.0, "cores": {}}},
        id="in-the-first-step"),
    pytest.param(
        [sc.Snapshot(109.2, [proc("rollout-1", 7, 1.6)]), sc.Snapshot(110.5, [proc("rollout-1", 7, 1.7)])],
        {"rollout": {"sampled_s": 0.0, "cores": {}}, "train": {"sampled_s": 0.0, "cores": {}}},
        id="between-the-training-phase-and-the-row"),
    pytest.param(
        [sc.Snapshot(100.0, [proc("rollout-1", 7, 1.0)]), sc.Snapshot(101.0, [proc("rollout-1", 8, 0.4)]),
         sc.Snapshot(102.0, [proc("rollout-1", 8, 0.5)])],
        {"rollout": {"sampled_s": 2.0, "cores": {"rollout_slices": {"server": 0.05}}},
         "train": {"sampled_s": 0.0, "cores": {}}},
        id="a-process-counts-from-its-first-sample"),
    pytest.param(
        [sc.Snapshot(100.0, [proc("rollout-1", 7, 1.0), proc("rollout-1", 9, 3.0, ray=True, inside=False)]),
         sc.Snapshot(102.0, [proc("rollout-1", 7, 1.3), proc("rollout-1", 9, 3.1, ray=True, inside=False)])],
        {"rollout": {"sampled_s": 2.0, "cores": {"left_slices": {"borrowed_worker": 0.05},
                                                  "rollout_slices": {"server": 0.15}}},
         "train": {"sampled_s": 0.0, "cores": {}}},
        id="a-parked-rank-outside-its-slice"),
    pytest.param(
        [sc.Snapshot(104.5, [proc("rollout-2", 9, 1.0, ray=True, inside=False)]),
         sc.Snapshot(105.5, [proc("rollout-2", 9, 1.15, ray=True)]),
         sc.Snapshot(106.5, [proc("rollout-2", 9, 1.35, ray=True)])],
        {"rollout": {"sampled_s": 0.0, "cores": {}},
         "train": {"sampled_s": 2.0, "cores": {"moving": {"borrowed_worker": 0.075},
                                                "rollout_slices": {"borrowed_worker": 0.1}}}},
        id="a-rank-joining-its-slice-counts-as-moving-for-that-interval"),
    pytest.param(
        [sc.Snapshot(100.0, [proc("rollout-1", 7, 1.0)]), sc.Snapshot(101.0, [proc("rollout-2", 7, 1.2)])],
        {"rollout": {"sampled_s": 1.0, "cores": {"moving": {"server": 0.2}}},
         "train": {"sampled_s": 0.0, "cores": {}}},
        id="from-one-slice-to-another-is-moving"),
])
def test_cpu_by_phase(snapshots: list[object], expect: dict[str, object]) -> None:
    assert sc.cpu_by_phase(snapshots, sc.phase_intervals(ROWS)) == expect


@pytest.mark.parametrize(("host", "steal", "expect"), [
    pytest.param((50.0, 53.0), (None, None), {"host_cores": 1.5, "outside_slices_cores": 1.34}, id="host-read"),
    pytest.param((None, 53.0), (None, None), {}, id="host-not-read-at-the-first-sample"),
    pytest.param((50.0, 53.0), (4.0, 4.5), {"host_cores": 1.5, "outside_slices_cores": 1.34,
                                            "host_steal_cores": 0.25}, id="steal-read"),
    pytest.param((None, None), (4.0, 4.0), {"host_steal_cores": 0.0}, id="no-steal"),
])
def test_the_host_and_what_runs_outside_the_slices(host: tuple[float | None, float | None],
                                                    steal: tuple[float | None, float | None],
                                                    expect: dict[str, float]) -> None:
    snapshots = [sc.Snapshot(100.0, [proc("rollout-1", 7, 1.0), proc("train-0", 3, 2.0)], host[0], steal[0]),
                 sc.Snapshot(102.0, [proc("rollout-1", 7, 1.3), proc("train-0", 3, 2.02)], host[1], steal[1])]
    rollout = sc.cpu_by_phase(snapshots, sc.phase_intervals(ROWS))["rollout"]
    assert rollout["cores"] == {"rollout_slices": {"server": 0.15}, "train_slices": {"training_worker": 0.01}}
    assert {k: v for k, v in rollout.items() if k not in ("sampled_s", "cores")} == pytest.approx(expect)


def test_the_hosts_busy_seconds_grow_with_work() -> None:
    before = sc.host_cpu_s()[0]
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    assert sc.host_cpu_s()[0] - before >= 0.15


def test_read_slices_finds_the_processes_of_slices_only(tmp_path: Path) -> None:
    from libra.metering.cgroup import CpuCgroup

    me = os.getpid()
    cgroup = CpuCgroup(str(tmp_path), 1, str(tmp_path))
    slice_dir = Path(cgroup.path(f"job@rollout-3@{me}-1"))
    slice_dir.mkdir(parents=True)
    (slice_dir / "cgroup.procs").write_text(f"{me}\n999999999\n")  # the second pid does not exist
    (Path(cgroup.base) / "not-a-slice").mkdir()
    (Path(cgroup.base) / "not-a-slice" / "cgroup.procs").write_text(f"{me}\n")
    (found,) = sc.read_slices(cgroup)
    assert (found.slice_holder, found.pid, found.ray_worker) == ("rollout-3", me, False)
    assert 0.0 < found.cpu_s <= sum(os.times()[:2]) + 0.05
    assert sc.read_slices(CpuCgroup(str(tmp_path / "missing"), 1, str(tmp_path))) == []


def test_follow_left_samples_processes_that_left_their_slice() -> None:
    me = os.getpid()
    seen = {999999999: "rollout-1"}  # a process that has exited since
    assert sc.follow_left([sc.ProcessSample("rollout-3", me, 1.0, False)], seen) == []  # this one is inside
    assert seen == {me: "rollout-3"}  # the exited one is forgotten
    (left,) = sc.follow_left([], seen)  # it left every slice
    assert (left.slice_holder, left.pid, left.inside) == ("rollout-3", me, False) and left.cpu_s > 0
    assert sc.follow_left([sc.ProcessSample("rollout-3", me, 1.0, False)], seen) == []  # back in a slice


def test_the_sampler_takes_snapshots_until_stopped(tmp_path: Path) -> None:
    from libra.metering.cgroup import CpuCgroup

    sampler = sc.SliceCpuSampler(CpuCgroup(str(tmp_path), 1, str(tmp_path)), interval_s=0.01).start()
    try:
        time.sleep(0.1)
    finally:
        snapshots = sampler.stop()
    count = len(snapshots)
    assert count >= 2 and all(s.processes == [] for s in snapshots)
    assert len(sampler.snapshots) == count
