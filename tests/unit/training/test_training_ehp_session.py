"""Elastic hybrid parallelism session, the parts that need no workers: how a global batch is shared between
the core pool and the borrowed worlds, the borrowed world's spec, the options it reads, the attach
requests it refuses before starting anything, when a parked group is re-attached or stopped instead (a
table row per reason; fake worker groups), and a borrowed rank joining the lending instance's CPU slice."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from libra.cluster.ehp_workers import LentGpu
from libra.config.mapping import cpu_config, training_pool_spec
from libra.config.sections import PlannerConfig
from libra.metering.spec import CpuMetering
from libra.observability.phase_trace import TraceSettings
from libra.training.batching import dp_block
from libra.training.call_deadlines import CallDeadlines, HangRule
from libra.training.ehp import (
    BorrowedWorld,
    EhpError,
    EhpSession,
    EhpSettings,
    borrowed_spec,
    borrowed_timings,
    borrowed_wait_s,
    split_shares,
    step_segments,
)
from libra.training.spec import TrainingPoolSpec
from planner.layout import TrainLayout

SHARE_CASES = [
    # id, samples, core DP, borrowed world DPs -> [core, world...] blocks
    ("one-core-two-worlds", 8, 1, [1, 1], [(0, 3), (3, 6), (6, 8)]),
    ("one-core-one-world-dp2", 8, 1, [2], [(0, 3), (3, 8)]),
    ("even", 12, 2, [2], [(0, 6), (6, 12)]),
    ("too-few-samples-world-sits-out", 2, 1, [1, 1], [(0, 1), (1, 2), (2, 2)]),
    ("one-sample", 1, 2, [1], [(0, 1), (1, 1)]),
]


@pytest.mark.parametrize(("n", "core_dp", "worlds", "expected"),
                         [pytest.param(*c[1:], id=c[0]) for c in SHARE_CASES])
def test_split_shares(n: int, core_dp: int, worlds: list[int], expected: list[tuple[int, int]]) -> None:
    shares = split_shares(n, core_dp, worlds)
    assert shares == expected
    covered = [i for a, b in shares for i in range(a, b)]
    assert covered == list(range(n))  # every sample exactly once, in order
    # the same blocks a fixed pool of the joint DP size would give its ranks
    total = core_dp + sum(worlds)
    assert shares[0] == (0, dp_block(n, total, core_dp - 1)[1])


@pytest.mark.parametrize(("n", "core_dp", "worlds"), [
    pytest.param(0, 1, [1], id="no-samples"), pytest.param(4, 0, [1], id="core-dp-0"),
    pytest.param(4, 1, [0], id="world-dp-0"),
])
def test_split_shares_refuses(n: int, core_dp: int, worlds: list[int]) -> None:
    with pytest.raises(ValueError):
        split_shares(n, core_dp, worlds)


BASE = training_pool_spec(cpu_config("/m"), num_gpus=2)


def test_borrowed_spec_keeps_the_model_and_drops_optimizer_sharding_and_traces() -> None:
    core = replace(BASE, tp=2, trace=TraceSettings(enabled=True, directory="/tmp/x"),
                   megatron=replace(BASE.megatron, use_distributed_optimizer=True),
                   metering=CpuMetering(cores_per_gpu=0.5, job="j", cgroup_root=""))
    spec = borrowed_spec(core, 4)
    assert spec.num_gpus == 4 and spec.tp == 2 and spec.model_path == core.model_path
    assert spec.algorithm == core.algorithm and spec.optimizer == core.optimizer
    assert not spec.megatron.use_distributed_optimizer and spec.trace is None
    assert not spec.metering.enabled


def test_settings_from_the_planner_section() -> None:
    options = PlannerConfig(elastic_hybrid_replica_size_gpus=4, elastic_hybrid_min_rollout_gpus=2,
                                          decouple_communication_domains=True)
    assert EhpSettings.from_planner_options(options) == EhpSettings(4, 2, True)
    assert EhpSettings.from_planner_options(PlannerConfig()) == EhpSettings()


@dataclass
class _StoppedPool:
    """Just what `attach` reads before it starts anything."""

    spec: TrainingPoolSpec
    layout: TrainLayout
    name: str = "pool"


@pytest.mark.parametrize(("layout", "settings", "gpus", "message"), [
    pytest.param(TrainLayout(tp=2), EhpSettings(), 3, "not a positive multiple of the replica size 2", id="odd"),
    pytest.param(TrainLayout(), EhpSettings(), 0, "not a positive multiple", id="none"),
    pytest.param(TrainLayout(ep=2), EhpSettings(), 2, "expert parallelism", id="moe-ep"),
])
def test_attach_refuses(layout: TrainLayout, settings: EhpSettings, gpus: int, message: str) -> None:
    session = EhpSession(_StoppedPool(BASE, layout), settings)  # type: ignore[arg-type]
    with pytest.raises(EhpError, match=message):
        session.attach([LentGpu(str(i)) for i in range(gpus)])
    assert not session.attached


def test_attach_refuses_repeated_gpus() -> None:
    session = EhpSession(_StoppedPool(BASE, TrainLayout()), EhpSettings())  # type: ignore[arg-type]
    with pytest.raises(EhpError, match="repeat"):
        session.attach([LentGpu("1"), LentGpu("1")])


def test_a_rank_refuses_an_unknown_operation() -> None:
    from libra.training import ehp_steps

    with pytest.raises(ValueError, match="unknown elastic-hybrid operation 'nope'"):
        ehp_steps.run(object(), "nope")  # type: ignore[arg-type]


# ---- parked borrowed groups: re-attached, or stopped and started afresh -------------------------------------
class _Method:
    def __init__(self, answer: object) -> None:
        self.answer = answer

    def remote(self, *args: object) -> object:
        return self.answer if args == ("shard_key",) else None


class _Actor:
    def __init__(self, key: tuple[int, int, int]) -> None:
        self.ehp = _Method(list(key))


class _Group:
    """A worker group that answers like parked borrowed ranks (or fails like a dead one); a call's "reference"
    is its answer."""

    def __init__(self, name: str, keys: list[tuple[int, int, int]], log: list[str]) -> None:
        self.name, self.keys, self.log = name, keys, log
        self.actors: list[object] = [_Actor(k) for k in keys]
        self.dead = False

    def _gather(self, method: str, refs: list[object], timeout: float | None) -> list[object]:
        if self.dead:
            raise RuntimeError(f"{self.name}.0 died")
        return refs

    def call(self, method: str, *args: object, timeout: float | None = None) -> list[object]:
        return self._gather(method, [None for _ in self.keys], timeout)

    def shutdown(self) -> None:
        self.log.append(f"stop {self.name}")
        self.actors = []


@dataclass
class _RunningPool:
    spec: TrainingPoolSpec
    layout: TrainLayout
    group: object
    name: str = "pool"
    running: bool = True
    weights_version: int = 0


def _parked_session(log: list[str]) -> tuple[EhpSession, _RunningPool, list[LentGpu]]:
    from libra.training.ehp import BorrowedWorld

    pool = _RunningPool(BASE, TrainLayout(), group=object())
    session = EhpSession(pool, EhpSettings())  # type: ignore[arg-type]
    gpus = [LentGpu("2", "rollout-0-pg"), LentGpu("3", "rollout-1-pg")]

    def start(gpus: Sequence[LentGpu]) -> None:  # what `_start` leaves behind, without Ray
        log.append(f"start {[g.gpu_id for g in gpus]}")
        session.worlds = [BorrowedWorld(_Group(f"w{i}", [(0, 0, 0)], log), BASE, [(0, 0, 0)])  # type: ignore[arg-type]
                          for i in range(len(gpus))]
        session.gpus = list(gpus)
        session._layout, session._core_gpus, session._core_group = pool.layout, pool.spec.num_gpus, pool.group

    session._start = start  # type: ignore[method-assign]
    assert session.attach(gpus) is False
    session.park()
    assert session.parked and not session.attached
    return session, pool, gpus


def _other_gpus(session: EhpSession, pool: _RunningPool, gpus: list[LentGpu]) -> list[LentGpu]:
    return gpus[:1]


def _resized(session: EhpSession, pool: _RunningPool, gpus: list[LentGpu]) -> list[LentGpu]:
    pool.layout = TrainLayout(tp=2)
    return gpus


def _restarted(session: EhpSession, pool: _RunningPool, gpus: list[LentGpu]) -> list[LentGpu]:
    pool.group = object()  # restart and relayout start a new worker group
    return gpus


def _worker_died(session: EhpSession, pool: _RunningPool, gpus: list[LentGpu]) -> list[LentGpu]:
    session.worlds[1].group.dead = True  # type: ignore[attr-defined]
    return gpus


# what changed while parked -> why the group is not re-attached ("" = it is)
REUSE = [
    pytest.param(lambda s, p, g: g, "", id="same-gpus-same-pool-reused"),
    pytest.param(_other_gpus, "the step borrows GPUs ['2']", id="other-gpus"),
    pytest.param(_resized, "the training pool was resized, re-laid-out or restarted", id="core-resized"),
    pytest.param(_restarted, "the training pool was resized, re-laid-out or restarted", id="core-restarted"),
    pytest.param(_worker_died, "a parked borrowed worker failed (RuntimeError: w1.0 died)", id="worker-died"),
]


@pytest.mark.parametrize(("change", "reason"), REUSE)
def test_a_parked_group_is_reattached_or_stopped(change: object, reason: str) -> None:
    log: list[str] = []
    session, pool, gpus = _parked_session(log)
    stops: list[tuple[str, list[str]]] = []
    session.on_parked_stop = lambda why, ids: stops.append((why, ids))
    wanted = change(session, pool, gpus)  # type: ignore[operator]
    reused = session.attach(wanted)
    assert session.attached and reused is (not reason) and session.last_attach_reused is reused
    if not reason:
        assert log == ["start ['2', '3']"] and stops == []
    else:
        assert stops == [(session.last_stop_reason, ["2", "3"])] and reason in session.last_stop_reason
        assert log == ["start ['2', '3']", "stop w0", "stop w1", f"start {[g.gpu_id for g in wanted]}"]


def test_release_stops_only_a_parked_group() -> None:
    log: list[str] = []
    session, _, gpus = _parked_session(log)
    assert session.release("the job ends") is True and not session.parked and not session.worlds
    assert log[-2:] == ["stop w0", "stop w1"] and session.last_stop_reason == "the job ends"
    assert session.release("again") is False
    session.attach(gpus)  # attached to a step: its own detach stops it, not a release
    assert session.release("the training pool is resized") is False and session.attached
    session.detach()
    assert not session.attached and not session.parked


# ---- parking starts the copy of the new parameters; the next step uses it while the weights are unchanged ------
def _weights_stepped(pool: _RunningPool) -> None:
    pool.weights_version += 1


def _pool_restarted(pool: _RunningPool) -> None:
    pool.group = object()


PREFETCH = [
    pytest.param(lambda pool: None, True, id="unchanged-weights-use-the-copy"),
    pytest.param(_weights_stepped, False, id="a-step-without-the-replicas-copies-again"),
    pytest.param(_pool_restarted, False, id="a-restarted-pool-copies-again"),
]


@pytest.mark.parametrize(("change", "used"), PREFETCH)
def test_the_parameters_copied_at_park_serve_the_next_step_only_if_current(
        monkeypatch: pytest.MonkeyPatch, change: Any, used: bool) -> None:
    from libra.cluster import ehp_workers

    monkeypatch.setattr(ehp_workers, "wait_done", lambda refs, timeout: True)
    session, pool, _ = _parked_session([])
    sent: list[int] = []

    def send(worlds: list[Any]) -> tuple[list[Any], list[list[Any]]]:
        sent.append(len(worlds))
        return ["export"], [[f"load-{w.group.name}"] for w in worlds]

    session._send_params = send  # type: ignore[method-assign]
    session._parked = False  # attached again, as after a step: park now copies
    session.park()
    assert sent == [2]
    change(pool)
    assert session._take_prefetched() == ([["load-w0"], ["load-w1"]] if used else None)
    assert session._take_prefetched() is None  # a copy serves one step


def test_a_failed_copy_at_park_leaves_the_step_to_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    from libra.cluster import ehp_workers

    monkeypatch.setattr(ehp_workers, "wait_done", lambda refs, timeout: False)  # the export timed out
    session, _, _ = _parked_session([])
    session._send_params = lambda worlds: (["export"], [["load"] for _ in worlds])  # type: ignore[method-assign]
    session._parked = False
    session.park()
    assert session.parked and session._take_prefetched() is None


# ---- a borrowed rank runs in the lending instance's CPU slice (metered logical GPUs) -------------------------
class _ProcsFs:
    """A directory standing in for a cgroup v1 mount: writing a pid to a group's `cgroup.procs` moves it there."""

    def __init__(self, root: str) -> None:
        self.root = root

    def read(self, path: str) -> str:
        with open(path, encoding="utf-8") as fh:
            return fh.read()

    def write(self, path: str, text: str) -> None:
        if os.path.basename(path) == "cgroup.procs":
            for parent, _, files in os.walk(self.root):
                if "cgroup.procs" in files:
                    procs = os.path.join(parent, "cgroup.procs")
                    kept = [p for p in self.read(procs).split() if p != text.strip()]
                    text_out = "\n".join(kept + ([text.strip()] if procs == path else []))
                    with open(procs, "w", encoding="utf-8") as fh:
                        fh.write(text_out)
            return
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)

    def listdir(self, path: str) -> list[str]:
        return sorted(os.listdir(path))

    def exists(self, path: str) -> bool:
        return os.path.exists(path)


@pytest.mark.parametrize(("holder", "joins"), [pytest.param("rollout-1", True, id="lender-slice"),
                                               pytest.param("rollout-7", False, id="no-slice-of-that-instance")])
def test_a_borrowed_rank_joins_the_lenders_slice(tmp_path: Any, holder: str, joins: bool) -> None:
    from libra.metering.cgroup import CpuCgroup
    from libra.metering.slices import SliceName
    from libra.proc_stat import process_start_ticks
    from libra.training.ehp_steps import join_holder_slice

    me, ticks = os.getpid(), process_start_ticks(os.getpid())
    cgroup = CpuCgroup(str(tmp_path), 1, str(tmp_path), fs=_ProcsFs(str(tmp_path)))  # type: ignore[arg-type]
    os.makedirs(cgroup.base)
    names = [SliceName("job", "rollout-0", me, ticks), SliceName("job", "rollout-1", me, ticks),
             SliceName("job", "rollout-1", 999_999_999, 1), SliceName("other", "rollout-1", me, ticks)]
    for name in names:  # rollout-1 of this job: one live slice, one whose owner is gone; another job's
        os.makedirs(cgroup.path(str(name)))
        (Path(cgroup.path(str(name))) / "cgroup.procs").write_text("")
    # the rank is a process of its own: this test process may have descendants (a session's Ray cluster) that
    # a join moves with it
    rank = subprocess.Popen(["sleep", "60"])
    try:
        (tmp_path / "cgroup.procs").write_text(str(rank.pid))
        if not joins:
            with pytest.raises(RuntimeError, match="rollout instance 'rollout-7' has no live CPU slice in job 'job'"):
                join_holder_slice(cgroup, "job", holder, rank.pid)
            return
        joined = join_holder_slice(cgroup, "job", holder, rank.pid)
        assert joined == str(names[1])
        assert (Path(cgroup.path(str(names[1]))) / "cgroup.procs").read_text().split() == [str(rank.pid)]
        assert (tmp_path / "cgroup.procs").read_text().split() == []
    finally:
        rank.kill()
        rank.wait()


@pytest.mark.parametrize(
    ("marks", "expected"),
    [
        ({"submit": 10.5, "params": 11.0, "finish": 12.25},
         {"ehp_wait_submit_s": 0.5, "ehp_wait_params_s": 0.5, "ehp_wait_finish_s": 1.25}),
        ({}, {}),
    ],
    ids=["consecutive-segments", "no-marks"],
)
def test_step_segments_are_consecutive_and_add_up(marks: dict[str, float], expected: dict[str, float]) -> None:
    segments = step_segments(10.0, marks)
    assert segments == pytest.approx(expected)
    assert sum(segments.values()) == pytest.approx(max(marks.values(), default=10.0) - 10.0)


def test_borrowed_timings_take_the_slowest_rank() -> None:
    summaries = [[{"timings": {"recompute_s": 0.1, "forward_backward_s": 0.4}},
                  {"timings": {"recompute_s": 0.3, "forward_backward_s": 0.2}}],
                 [{"timings": {"forward_backward_s": 0.5}}]]
    assert borrowed_timings(summaries) == {"ehp_borrowed_recompute_s": 0.3, "ehp_borrowed_forward_backward_s": 0.5,
                                           "ehp_borrowed_recompute_cpu_s": 0.0,
                                           "ehp_borrowed_forward_backward_cpu_s": 0.0}
    assert borrowed_timings([]) == {}


def test_a_parked_rank_leaves_the_lenders_slice_for_home_and_joins_it_again(tmp_path: Any) -> None:
    from libra.metering.cgroup import CpuCgroup
    from libra.metering.slices import CpuSlices, SliceName
    from libra.proc_stat import process_start_ticks
    from libra.training.ehp_steps import join_holder_slice

    me = os.getpid()
    cgroup = CpuCgroup(str(tmp_path), 1, str(tmp_path), fs=_ProcsFs(str(tmp_path)))  # type: ignore[arg-type]
    os.makedirs(cgroup.base)
    lender = SliceName("job", "rollout-1", me, process_start_ticks(me))
    os.makedirs(cgroup.path(str(lender)))
    slice_procs = Path(cgroup.path(str(lender))) / "cgroup.procs"
    slice_procs.write_text("")
    rank = subprocess.Popen(["sleep", "60"])
    try:
        (tmp_path / "cgroup.procs").write_text(str(rank.pid))
        join_holder_slice(cgroup, "job", "rollout-1", rank.pid)
        assert slice_procs.read_text().split() == [str(rank.pid)]
        assert CpuSlices(cgroup, "job").leave(rank.pid) == [rank.pid]  # parked: the host's share of the CPU
        assert slice_procs.read_text().split() == []
        assert (tmp_path / "cgroup.procs").read_text().split() == [str(rank.pid)]
        join_holder_slice(cgroup, "job", "rollout-1", rank.pid)  # attached to the next step
        assert slice_procs.read_text().split() == [str(rank.pid)]
    finally:
        rank.kill()
        rank.wait()


class _RecordingMethod:
    """An actor method whose slice calls are written to a shared log; a call's "reference" is its answer."""

    def __init__(self, rank: str, log: list[str], refuse: set[str]) -> None:
        self.rank, self.log, self.refuse = rank, log, refuse

    def remote(self, op: str, *args: object) -> object:
        if op == "shard_key":
            self.log.append(f"{self.rank} shard_key")
            return [0, 0, 0]
        self.log.append(f"{self.rank} {op} {args[-1] if args else ''}".strip())
        if op in self.refuse:
            return RuntimeError(f"{self.rank} {op} refused")
        return op


class _RecordingGroup(_Group):
    def __init__(self, name: str, holders: list[str], log: list[str], refuse: set[str]) -> None:
        super().__init__(name, [(0, 0, 0)] * len(holders), log)
        self.actors = [type("A", (), {"ehp": _RecordingMethod(f"{name}.{r}", log, refuse)})()
                       for r in range(len(holders))]

    def _gather(self, method: str, refs: list[object], timeout: float | None) -> list[object]:
        for ref in refs:
            if isinstance(ref, Exception):
                raise ref
        return refs


LEAVES = ["w0.0 leave_lent_slice rollout-0", "w0.1 leave_lent_slice rollout-1"]
PINGS = ["w0.0 shard_key", "w0.1 shard_key"]
REJOINS = ["w0.0 join_lent_slice rollout-0", "w0.1 join_lent_slice rollout-1"]


@pytest.mark.parametrize(("metered", "refuse", "expect_calls"), [
    pytest.param(True, set(), LEAVES + PINGS + REJOINS, id="metered-leaves-at-park-and-rejoins-with-the-step"),
    pytest.param(False, set(), PINGS, id="unmetered-stays-put"),
    pytest.param(True, {"leave_lent_slice"}, LEAVES + PINGS + REJOINS,
                 id="a-rank-that-could-not-leave-is-still-reattached"),
])
def test_parked_ranks_leave_their_lent_slices_and_rejoin_them_with_the_next_step(
        monkeypatch: pytest.MonkeyPatch, metered: bool, refuse: set[str], expect_calls: list[str]) -> None:
    """The attach ping answers from the host's share (a plain `shard_key`); the move back into the slice is
    submitted with the step, once."""
    from libra.cluster import ehp_workers
    from libra.training.ehp import BorrowedWorld

    monkeypatch.setattr(ehp_workers, "wait_done", lambda refs, timeout: True)
    metering = CpuMetering(cores_per_gpu=0.5, job="j", cgroup_root="") if metered else BASE.metering
    spec = replace(BASE, metering=metering)
    pool = _RunningPool(spec, TrainLayout(), group=object())
    session = EhpSession(pool, EhpSettings(decouple_communication_domains=True))  # type: ignore[arg-type]
    gpus = [LentGpu("2", "rollout-0-pg", holder="rollout-0"), LentGpu("3", "rollout-1-pg", holder="rollout-1")]
    calls: list[str] = []

    def start(wanted: Sequence[LentGpu]) -> None:  # what `_start` leaves behind, without Ray: one world of 2 ranks
        holders = [g.holder for g in wanted]
        session.worlds = [BorrowedWorld(_RecordingGroup("w0", holders, calls, refuse), spec,  # type: ignore[arg-type]
                                        [(0, 0, 0), (0, 0, 0)], holders)]
        session.gpus = list(wanted)
        session._layout, session._core_gpus, session._core_group = pool.layout, pool.spec.num_gpus, pool.group

    session._start = start  # type: ignore[method-assign]
    session._send_params = lambda worlds: (["export"], [["load"] for _ in worlds])  # type: ignore[method-assign]
    assert session.attach(gpus) is False
    session.park()
    assert session.parked
    assert session.attach(gpus) is True and session.attached
    rejoins = session._submit_rejoins(session.worlds)
    assert calls == expect_calls
    assert list(rejoins.values()) == ([["join_lent_slice", "join_lent_slice"]] if metered else [])
    assert session._submit_rejoins(session.worlds) == {} and calls == expect_calls  # once per re-attach


def test_only_worlds_that_left_a_slice_rejoin_with_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A world on GPUs of its own never left a slice, so only the lent world's rank moves back."""
    from libra.cluster import ehp_workers
    from libra.training.ehp import BorrowedWorld

    monkeypatch.setattr(ehp_workers, "wait_done", lambda refs, timeout: True)
    spec = replace(BASE, metering=CpuMetering(cores_per_gpu=0.5, job="j", cgroup_root=""))
    pool = _RunningPool(spec, TrainLayout(), group=object())
    session = EhpSession(pool, EhpSettings())  # type: ignore[arg-type]
    gpus = [LentGpu("2", "rollout-0-pg", holder="rollout-0"), LentGpu("3", "spare-pg", holder="")]
    calls: list[str] = []

    def start(wanted: Sequence[LentGpu]) -> None:  # one world per replica (communication domains not decoupled)
        session.worlds = [BorrowedWorld(_RecordingGroup(f"w{i}", [g.holder], calls, set()), spec,  # type: ignore[arg-type]
                                        [(0, 0, 0)], [g.holder]) for i, g in enumerate(wanted)]
        session.gpus = list(wanted)
        session._layout, session._core_gpus, session._core_group = pool.layout, pool.spec.num_gpus, pool.group

    session._start = start  # type: ignore[method-assign]
    session._send_params = lambda worlds: (["export"], [["load"] for _ in worlds])  # type: ignore[method-assign]
    session.attach(gpus)
    session.park()
    assert session.attach(gpus) is True
    session._submit_rejoins(session.worlds)
    assert [c for c in calls if "slice" in c] == ["w0.0 leave_lent_slice rollout-0", "w0.0 join_lent_slice rollout-0"]


class _CorePool(_RunningPool):
    """A running core pool of one rank (DP 1) as a shared step sees it."""

    def __init__(self, spec: TrainingPoolSpec) -> None:
        super().__init__(spec, TrainLayout(), group=_Group("core", [(0, 0, 0)], []))
        self.deadlines = CallDeadlines(HangRule(timeout_s=60.0, factor=0.0, first_call_s=60.0))
        self.told: list[int] = []

    def stepped(self, step: int) -> None:
        self.told.append(step)
        self.weights_version += 1


def _one_world_session(pool: _CorePool, spec: TrainingPoolSpec, holder: str) -> EhpSession:
    """A session on `pool` whose attach forms one borrowed world of one rank ("w0", on a GPU `holder` lends)
    without starting a process."""
    from libra.training.ehp import BorrowedWorld

    session = EhpSession(pool, EhpSettings())  # type: ignore[arg-type]

    def start(wanted: Sequence[LentGpu]) -> None:
        session.worlds = [BorrowedWorld(_Group("w0", [(0, 0, 0)], []), spec, [(0, 0, 0)], [holder])]  # type: ignore[arg-type]
        session.gpus = list(wanted)
        session._layout, session._core_gpus, session._core_group = pool.layout, pool.spec.num_gpus, pool.group
        session._core_keys = [(0, 0, 0)]

    session._start = start  # type: ignore[method-assign]
    return session


def _recorded_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, tuple[Any, ...]]]:
    """Replace the worker calls of a shared step with a log: (group, op, args) per call; a call's reference is
    "<group>.<rank>:<op>" (two of them, "/0" and "/1", for calls with two results)."""
    from libra.cluster import ehp_workers

    log: list[tuple[str, str, tuple[Any, ...]]] = []

    def call_each(group: Any, method: str, per_rank: Sequence[Sequence[Any]], num_returns: int = 1) -> list[Any]:
        refs: list[Any] = []
        for rank, (op, *args) in enumerate(per_rank):
            log.append((group.name, op, tuple(args)))
            ref = f"{group.name}.{rank}:{op}"
            refs.append(tuple(f"{ref}/{i}" for i in range(num_returns)) if num_returns > 1 else ref)
        return refs

    def gather(group: Any, method: str, refs: list[Any], timeout: float | None) -> list[Any]:
        if method == "shard_key":
            return [[0, 0, 0] for _ in refs]
        if method == "borrowed_forward_backward":
            return [{"units": 1, "timings": {}} for _ in refs]
        return [{"loss": 0.5} for _ in refs] if method == "core_finish" else refs

    monkeypatch.setattr(ehp_workers, "call_each", call_each)
    monkeypatch.setattr(ehp_workers, "call_refs", lambda group, method, op, *args: call_each(
        group, method, [(op, *args)] * len(group.actors)))
    monkeypatch.setattr(ehp_workers, "gather", gather)
    monkeypatch.setattr(ehp_workers, "share", lambda value: value)
    monkeypatch.setattr(ehp_workers, "wait_done", lambda refs, timeout: True)
    return log


def test_a_reattached_step_moves_back_first_and_parking_loads_the_finishs_export(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Metered: the re-attached rank's forward/backward takes its move back into the slice as an argument (a rank
    that could not move back never computes), and the parameters the next step copies come from the core
    finish's second result, with no export call at park."""

    log = _recorded_calls(monkeypatch)
    spec = replace(BASE, metering=CpuMetering(cores_per_gpu=0.5, job="j", cgroup_root=""))
    pool = _CorePool(spec)
    session = _one_world_session(pool, spec, "rollout-0")
    gpus = [LentGpu("2", "rollout-0-pg", holder="rollout-0")]
    session.attach(gpus)
    session.park()  # parked without a step (as at prewarm): the core ranks export, the borrowed rank loads
    assert [(g, op) for g, op, _ in log] == [("core", "export_params"), ("w0", "load_params"),
                                             ("w0", "leave_lent_slice")]
    assert session.attach(gpus) is True
    assert [(g, op) for g, op, _ in log[3:]] == [("w0", "shard_key")]  # the ping: no move into the slice yet
    del log[:]
    metrics = session.train_step(list(range(8)), step=3)
    assert metrics["loss"] == 0.5 and metrics["ehp_params_prefetched"] == 1.0 and pool.told == [3]
    ops = [(g, op) for g, op, _ in log]
    assert ops == [("w0", "join_lent_slice"), ("core", "core_forward_backward"), ("w0", "borrowed_forward_backward"),
                   ("core", "core_finish")]
    fb_args = log[2][2]
    assert fb_args[-2:] == ("w0.0:load_params", "w0.0:join_lent_slice")  # the copy at park, then the move
    # the finish: the step, export, world sizes, the wait for the grads (a share of the step's 60 s deadline),
    # the borrowed summary (resolved by Ray), and the grads as a reference in a list (fetched by the rank)
    assert log[3][2] == (3, True, [1], 48.0, "w0.0:borrowed_forward_backward/0", ["w0.0:borrowed_forward_backward/1"])
    del log[:]
    session.park()
    assert [(g, op, args) for g, op, args in log] == [
        ("w0", "load_params", ("core.0:core_finish/1",)), ("w0", "leave_lent_slice", (spec.metering, "rollout-0"))]
    assert session._take_prefetched() == [["w0.0:load_params"]]


# (id, the step's deadline, the slowest shared step at this shape or None, the wait for what borrowed ranks make)
BORROWED_WAITS = [
    ("no-shared-step-yet-a-share-of-the-deadline", 300.0, None, 240.0),
    ("first-call-deadline-without-history", 3600.0, None, 2880.0),
    ("fast-steps-the-floor", 300.0, 0.4, 30.0),
    ("slower-steps-ten-times-the-slowest", 300.0, 12.0, 120.0),
    ("slow-steps-never-past-the-deadlines-share", 300.0, 100.0, 240.0),
    ("a-deadline-made-by-the-hang-factor", 1000.0, 60.0, 600.0),
    ("a-short-hang-timeout-keeps-its-share", 30.0, 0.4, 24.0),
]


@pytest.mark.parametrize(("deadline", "slowest", "expected"), [pytest.param(*c[1:], id=c[0]) for c in BORROWED_WAITS])
def test_borrowed_wait(deadline: float, slowest: float | None, expected: float) -> None:
    assert borrowed_wait_s(deadline, slowest) == pytest.approx(expected)


def test_once_a_shared_step_ran_borrowed_work_is_waited_for_a_multiple_of_it_not_the_hang_deadline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The first shared step at the pool's shape waits for the borrowed ranks' loads, summaries and gradients a
    share of the step's deadline; later ones `borrowed_wait_s` of the slowest shared step (the floor, for steps
    this fast); the core ranks' own calls keep the deadline."""
    from libra.cluster import ehp_workers
    from libra.training.ehp import BORROWED_WAIT_FLOOR_S

    log = _recorded_calls(monkeypatch)
    waits: list[tuple[str, float | None]] = []
    recorded_gather = ehp_workers.gather

    def gather(group: Any, method: str, refs: list[Any], timeout: float | None) -> list[Any]:
        waits.append((method, timeout))
        return recorded_gather(group, method, refs, timeout)

    monkeypatch.setattr(ehp_workers, "gather", gather)
    pool = _CorePool(BASE)
    pool.deadlines = CallDeadlines(HangRule(timeout_s=300.0, factor=0.0, first_call_s=3600.0))
    session = _one_world_session(pool, BASE, "")
    expected = {1: (2880.0, 3600.0), 2: (BORROWED_WAIT_FLOOR_S, 300.0)}  # step: (borrowed wait, core deadline)
    for step, (borrowed, core) in expected.items():
        del log[:], waits[:]
        session.attach([LentGpu("2", "rollout-0-pg")])
        session.train_step(list(range(8)), step=step, to_park=False)
        session.detach()
        finish = next(args for _, op, args in log if op == "core_finish")
        assert finish[3] == pytest.approx(borrowed), step  # the core ranks' wait for the borrowed gradients
        assert waits == [("load_params", borrowed), ("borrowed_forward_backward", borrowed),
                         ("core_forward_backward", core), ("core_finish", core)], step


# ---- the core ranks' finish: every borrowed world's totals, and a fall-back that never steps twice -----------
@pytest.mark.parametrize(("sizes", "summaries", "expected"), [
    pytest.param([1, 1], [{"units": 3, "sums": [1.0, 2.0], "loss_scale": 1.0},
                          {"units": 5, "sums": [0.5, 0.5], "loss_scale": 1.0}],
                 {"units": 8, "sums": [1.5, 2.5], "loss_scale": 1.0}, id="two-worlds-of-one-rank"),
    pytest.param([2], [{"units": 4, "sums": [1.0], "loss_scale": 2.0}, {"units": 4, "sums": [1.0], "loss_scale": 2.0}],
                 {"units": 4, "sums": [1.0], "loss_scale": 2.0}, id="one-world-of-two-ranks-counted-once"),
    pytest.param([], [], {"units": 0, "sums": [], "loss_scale": 1.0}, id="none"),
])
def test_combine_summaries_counts_each_world_once(sizes: list[int], summaries: list[dict[str, Any]],
                                                   expected: dict[str, Any]) -> None:
    from libra.training.ehp_steps import combine_summaries

    assert combine_summaries(sizes, summaries) == expected


def test_combine_summaries_refuses_a_count_that_does_not_match() -> None:
    from libra.training.ehp_steps import combine_summaries

    with pytest.raises(RuntimeError, match=r"1 borrowed summaries for worlds of \[2\] ranks"):
        combine_summaries([2], [{"units": 1, "sums": [], "loss_scale": 1.0}])


class _SteppingPool(_RunningPool):
    """A running pool that records its own steps (the fall-back's rerun) and the steps it was told of."""

    def __init__(self) -> None:
        super().__init__(BASE, TrainLayout(), group=object())
        self.trained: list[int] = []
        self.told: list[int] = []

    def train_step(self, samples: list[Any], step: int) -> dict[str, float]:
        self.trained.append(step)
        return {"loss": 1.0}

    def stepped(self, step: int) -> None:
        self.told.append(step)


@pytest.mark.parametrize("finish_ran", [False, True], ids=["finish-failed-with-the-borrowed-rank",
                                                           "finish-had-run-before-the-failure-was-seen"])
def test_a_fall_back_reruns_the_step_only_if_the_finish_did_not_run(monkeypatch: pytest.MonkeyPatch,
                                                                     finish_ran: bool) -> None:
    from libra.cluster import ehp_workers
    from libra.cluster.training_workers import CollectiveCallError

    pool = _SteppingPool()
    session = EhpSession(pool, EhpSettings())  # type: ignore[arg-type]
    session.worlds = [BorrowedWorld(_Group("pool-ehp0", [(0, 0, 0)], []), BASE, [(0, 0, 0)])]  # type: ignore[arg-type]

    def gather(group: Any, method: str, refs: list[Any], timeout: float | None) -> list[Any]:
        if method == "core_finish" and not finish_ran:
            raise CollectiveCallError("pool.core_finish failed on rank 0: pool-ehp0.borrowed_forward_backward died")
        return [{"loss": 0.5}] if method == "core_finish" else refs

    monkeypatch.setattr(ehp_workers, "gather", gather)
    failure = CollectiveCallError("pool-ehp0.borrowed_forward_backward failed on rank 0: died")
    metrics = session._fall_back([object()], 4, ["core"], ["finish"], failure)
    assert not session.worlds and session.last_fallback_reason == str(failure)  # detached either way
    if finish_ran:
        assert metrics == {"loss": 0.5} and pool.trained == [] and pool.told == [4]
    else:
        assert metrics == {"loss": 1.0, "ehp_fallback": 1.0} and pool.trained == [4] and pool.told == []


@pytest.mark.parametrize(("error", "falls_back"), [
    pytest.param("core.core_finish failed on rank 0: RuntimeError: the borrowed replicas' gradients did not reach "
                 "every core rank (rank 0 waited 48s for them)", True, id="grads-not-received-falls-back"),
    pytest.param("core.core_finish failed on rank 0: RuntimeError: grad norm is nan", False, id="other-error-raised"),
])
def test_a_finish_without_the_borrowed_grads_reruns_the_step_on_the_pool_alone(
        monkeypatch: pytest.MonkeyPatch, error: str, falls_back: bool) -> None:
    """Grads that could not reach the core ranks (all of them raise before the finish's collectives) cost the step
    its borrowed replicas, not the training pool: the step runs on the pool alone. Any other failure of the
    finish is the pool's own and is raised."""
    from libra.cluster import ehp_workers
    from libra.cluster.training_workers import CollectiveCallError

    _recorded_calls(monkeypatch)
    recorded_gather = ehp_workers.gather

    def gather(group: Any, method: str, refs: list[Any], timeout: float | None) -> list[Any]:
        if method == "core_finish":
            raise CollectiveCallError(error)
        return recorded_gather(group, method, refs, timeout)

    monkeypatch.setattr(ehp_workers, "gather", gather)
    pool = _CorePool(BASE)
    trained: list[int] = []
    pool.train_step = lambda samples, step: trained.append(step) or {"loss": 1.0}  # type: ignore[attr-defined]
    session = EhpSession(pool, EhpSettings())  # type: ignore[arg-type]
    session.worlds = [BorrowedWorld(_Group("w0", [(0, 0, 0)], []), BASE, [(0, 0, 0)])]  # type: ignore[arg-type]
    session.gpus = [LentGpu("2", "rollout-0-pg")]
    session._layout, session._core_gpus, session._core_group = pool.layout, pool.spec.num_gpus, pool.group
    session._core_keys = [(0, 0, 0)]
    if falls_back:
        assert session.train_step(list(range(8)), step=5) == {"loss": 1.0, "ehp_fallback": 1.0}
        assert trained == [5] and session.last_fallback_reason == (
            "core.core_finish: the borrowed replicas' gradients did not reach every core rank (rank 0 waited 48s "
            "for them)")
    else:
        with pytest.raises(CollectiveCallError, match="grad norm is nan"):
            session.train_step(list(range(8)), step=5)
        assert trained == []
    assert not session.worlds and pool.told == []


def test_a_core_failure_is_raised_not_fallen_back() -> None:
    from libra.cluster.training_workers import CollectiveCallError

    pool = _SteppingPool()
    session = EhpSession(pool, EhpSettings())  # type: ignore[arg-type]
    session.worlds = [BorrowedWorld(_Group("pool-ehp0", [(0, 0, 0)], []), BASE, [(0, 0, 0)])]  # type: ignore[arg-type]
    with pytest.raises(CollectiveCallError, match="pool.core_forward_backward"):
        session._fall_back([object()], 4, ["core"], ["finish"],
                           CollectiveCallError("pool.core_forward_backward failed on rank 1: died"))
    assert pool.trained == [] and not session.worlds


@dataclass
class _NodeGroup:
    """A worker group whose ranks sit on the nodes given (by node id)."""

    nodes: list[str]
    name: str = "group"

    def rank_nodes(self) -> list[str]:
        return list(self.nodes)


HOSTS = {"a": "10.0.0.2", "b": "10.0.0.3", "c": "10.0.0.4"}
REACH_CASES = [
    # id, core pool nodes, the world's nodes, pairs that cannot connect (core probe, probe inside the world)
    #   -> nodes left out, their peers
    ("one-node-no-probe", ["a"], ["a"], None, None, {}),
    ("reached", ["a"], ["b"], {}, None, {}),
    ("world-cut-from-core", ["a"], ["b"], {("b", "a"): "timed out"}, None, {"b": ("a",)}),
    ("world-beside-a-core-rank", ["a", "b"], ["b"], {("b", "a"): "timed out"}, None, {"b": ("a",)}),
    ("world-across-nodes-cut-inside", ["a"], ["b", "c"], {}, {("b", "c"): "timed out", ("c", "b"): "timed out"},
     {"b": ("c",)}),
    ("one-node-cut-from-core-no-inner-probe", ["a"], ["b", "c"], {("b", "a"): "refused"}, None, {"b": ("a",)}),
]


@pytest.mark.parametrize(("core", "world", "cross", "inner", "left_out"),
                         [pytest.param(*c[1:], id=c[0]) for c in REACH_CASES])
def test_a_borrowed_world_that_cannot_reach_the_pool_is_not_formed(
        monkeypatch: pytest.MonkeyPatch, core: list[str], world: list[str],
        cross: dict[tuple[str, str], str] | None, inner: dict[tuple[str, str], str] | None,
        left_out: dict[str, tuple[str, ...]]) -> None:
    """Before a borrowed world forms, its nodes are probed against the core pool's (and, when it spans nodes,
    against each other's): a node that cannot connect is named with the lending instances on it and the peers
    it could not reach (`LendersUnreachableError`); nothing is probed when everything is on one node."""
    from libra.cluster.ehp_workers import LendersUnreachableError
    from libra.training import ehp

    core_group, world_group = _NodeGroup(core, "core"), _NodeGroup(world, "w0")
    probes: list[str] = []

    def probe(listening: _NodeGroup, connecting: _NodeGroup, timeout: float) -> tuple[dict[Any, str], dict[str, str]]:
        inside = listening is connecting
        probes.append("inner" if inside else "cross")
        found = inner if inside else cross
        assert found is not None, f"an unexpected {probes[-1]} probe"
        return dict(found), dict(HOSTS)

    monkeypatch.setattr(ehp, "probe_reach", probe)
    pool = _RunningPool(BASE, TrainLayout(), group=core_group)
    session = EhpSession(pool, EhpSettings())  # type: ignore[arg-type]
    holders = [f"rollout-{i + 1}" for i in range(len(world))]
    borrowed = BorrowedWorld(world_group, BASE, holders=holders)  # type: ignore[arg-type]
    if not left_out:
        session._check_reach(borrowed, 5.0)
    else:
        with pytest.raises(LendersUnreachableError) as err:
            session._check_reach(borrowed, 5.0)
        assert {n.node_id: n.peers for n in err.value.nodes} == left_out
        assert err.value.instances == {n: [holders[world.index(n)]] for n in left_out}
        for node in err.value.nodes:
            assert node.address == HOSTS[node.node_id] and HOSTS[node.peers[0]] in node.reason
            assert f"{node.address} (lent by {holders[world.index(node.node_id)]})" in str(err.value)
    assert probes == [p for p, found in (("cross", cross), ("inner", inner)) if found is not None]
