"""Elastic hybrid parallelism at the step boundary (`libra.controller.ehp_borrow`): which rollout members lend
(a table of cases), and the borrow carried out with fake pool edges: lend, attach, step, park or detach, give
back, the events and the reconciler's view of the lent members; attach and core failures; plan-only; when
parked borrowed replicas are re-attached and when they stop (a table row per stop reason)."""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from libra.cluster.ehp_workers import LendersUnreachableError
from libra.cluster.node_fence import FencedNode
from libra.config.elastic_hybrid import EhpSwitch
from libra.controller.ehp_borrow import (
    BorrowDecision,
    EhpBorrower,
    ParkedBorrow,
    decide_borrow,
    lendable_instances,
    parked_stop_reason,
)
from libra.controller.events import EventLog
from libra.controller.gate import WeightGate
from libra.controller.members import Member, MemberState
from libra.controller.state import ROLLOUT, DesiredState
from libra.controller.tracker import MemberTracker, MemberView
from planner.ehp import Residency
from planner.layout import TrainLayout

S = MemberState


def member(n: int, gpus: tuple[str, ...], state: MemberState = S.READY, serving: bool = True, busy: bool = False,
           node: str = "n0") -> Member:
    return Member(id=f"rollout-{n}", pool=ROLLOUT, state=state, since=0.0, key=f"rollout-{n}", busy=busy,
                  gpu_ids=gpus, serving=serving, info={"host": node})


def resident(replicas: int) -> Residency:
    return "resident"


def asleep(replicas: int) -> Residency:
    return "sleep"


def no_fit(replicas: int) -> Residency:
    return "no_fit"


TWO = [member(0, ("2",)), member(1, ("3",))]
# the node of rollout-1's GPU, cut from the training pool's node
UNREACHABLE = FencedNode("node-b", "10.0.0.3", "it could not reach 10.0.0.2 (timed out)", ("node-a",))

# (members, replica size, min rollout GPUs, residency, busy reason) -> (lent instances, replicas, sleep)
DECISIONS = [
    pytest.param(TWO, 1, 0, resident, "", ("rollout-0", "rollout-1"), (("2",), ("3",)), False, id="lend-all"),
    pytest.param(TWO, 1, 1, resident, "", ("rollout-0",), (("2",),), False, id="min-rollout-keeps-one"),
    pytest.param(TWO, 1, 2, resident, "", (), (), False, id="min-rollout-keeps-all"),
    pytest.param(TWO, 2, 0, resident, "", ("rollout-0", "rollout-1"), (("2", "3"),), False, id="two-gpu-replica"),
    pytest.param([member(0, ("2",)), member(1, ("3",), node="n1")], 2, 0, resident, "", (), (), False,
                 id="replica-never-spans-nodes"),
    pytest.param([member(0, ("2",), busy=True), member(1, ("3",))], 1, 0, resident, "", ("rollout-1",), (("3",),),
                 False, id="busy-member-stays"),
    pytest.param([member(0, ("2",), serving=False), member(1, ("3",))], 1, 0, resident, "", ("rollout-1",),
                 (("3",),), False, id="non-serving-member-stays"),
    pytest.param([member(0, ("2",), state=S.FAILED), member(1, ("3",))], 1, 0, resident, "", ("rollout-1",),
                 (("3",),), False, id="failed-member-stays"),
    pytest.param([member(0, ("2",), state=S.LOADING), member(1, ("3",))], 1, 0, resident, "", ("rollout-1",),
                 (("3",),), False, id="reloading-member-stays"),
    pytest.param(TWO, 1, 0, asleep, "", ("rollout-0", "rollout-1"), (("2",), ("3",)), True, id="servers-sleep"),
    pytest.param(TWO, 1, 0, no_fit, "", (), (), False, id="no-fit-lends-nothing"),
    pytest.param(TWO, 1, 0, resident, "the rollout pool is being reconfigured", (), (), False, id="busy-pools"),
    pytest.param(TWO, 1, 1, resident, "held:rollout-0", ("rollout-1",), (("3",),), False,
                 id="held-back-member-serves-and-counts"),
    pytest.param(TWO, 1, 0, resident, "held:rollout-0,rollout-1", (), (), False, id="all-held-back"),
]


@pytest.mark.parametrize(("members", "size", "keep", "residency", "busy", "lend", "replicas", "sleep"), DECISIONS)
def test_borrow_decision(members: list[Member], size: int, keep: int, residency: Any, busy: str,
                         lend: tuple[str, ...], replicas: tuple[tuple[str, ...], ...], sleep: bool) -> None:
    held = set(busy.removeprefix("held:").split(",")) if busy.startswith("held:") else set()
    busy = "" if held else busy
    decision = decide_borrow(members, size, keep, residency, busy, held_back=lambda m: m.key in held)
    assert (decision.lend, decision.replicas, decision.sleep) == (lend, replicas, sleep)
    assert decision.reason  # why it lends, or why not
    if busy:
        assert decision.reason == busy


def test_lendable_instances_skip_members_without_gpus() -> None:
    starting = member(2, (), state=S.STARTING, serving=False)
    assert [i.instance_id for i in lendable_instances([*TWO, starting])] == ["rollout-0", "rollout-1"]


# ---- the borrow, with fake edges ---------------------------------------------------------------------------
@dataclass
class LendReport:
    instance_id: str
    sleep_s: float = 0.01


@dataclass
class ReturnReport:
    instance_id: str
    wake_s: float = 0.02
    reload_s: float = 0.0
    serving: bool = True
    error: str = ""


@dataclass
class FakeRollout:
    ops: list[str] = field(default_factory=list)
    lent: set[str] = field(default_factory=set)
    fail_lend: bool = False
    watchers: list[Any] = field(default_factory=list)

    def watch_stops(self, stopping: Any) -> None:
        self.watchers.append(stopping)

    def stop(self, key: str) -> None:
        for stopping in self.watchers:
            stopping(key)
        self.ops.append(f"stop {key}")

    def lend(self, keys: list[str], sleep: bool) -> list[LendReport]:
        if self.fail_lend:
            raise RuntimeError("rollout-0: is loading")
        self.ops.append(f"lend {keys} sleep={sleep}")
        self.lent.update(keys)
        return [LendReport(k) for k in keys]

    def give_back(self, keys: list[str]) -> list[ReturnReport]:
        self.ops.append(f"give_back {keys}")
        self.lent -= set(keys)
        return [ReturnReport(k) for k in keys]

    same_ids: bool = False  # every instance on a node of its own, each holding its node's GPU "2"

    def lent_gpus(self, key: str) -> list[Any]:
        index = int(key.rsplit("-", 1)[1])
        return [Gpu(gpu_id="2" if self.same_ids else str(2 + index), node=f"n{index}")]


@dataclass(frozen=True)
class Gpu:
    gpu_id: str
    holder: str = ""
    node: str = ""


@dataclass
class Settings:
    min_rollout_gpus: int = 0


@dataclass
class FakePool:
    layout: TrainLayout = field(default_factory=TrainLayout)


@dataclass
class FakeSession:
    ops: list[str]
    # "attach" | "core" | "borrowed" (a borrowed rank fails in the step: it falls back) | "borrowed_after" (a
    # borrowed rank's failure is seen once the step had finished with it: the step stands, the session detaches)
    fail: str = ""
    pool: FakePool = field(default_factory=FakePool)
    settings: Settings = field(default_factory=Settings)
    attached_to: list[str] = field(default_factory=list)
    parked_on: list[str] = field(default_factory=list)
    on_parked_stop: Any = None
    holders: list[str] = field(default_factory=list)  # the lending instance of each attached GPU
    last_fallback_reason: str = ""

    def replica_size(self) -> int:
        return 1

    attach_gate: threading.Event | None = None  # when set, attach waits for it (a slow worker start)

    @property
    def parked(self) -> bool:
        return bool(self.parked_on)

    @property
    def attached(self) -> bool:
        return bool(self.attached_to)

    def attach(self, gpus: list[Gpu]) -> bool:
        if self.attach_gate is not None:
            assert self.attach_gate.wait(10)
        if self.fail == "attach":
            raise RuntimeError("a borrowed worker did not start")
        if self.fail == "unreachable" and "rollout-1" in [g.holder for g in gpus]:
            raise LendersUnreachableError("ehp0: nodes of the lent GPUs cannot reach the training pool's nodes",
                                          [UNREACHABLE], {UNREACHABLE.node_id: ["rollout-1"]})
        ids = [g.gpu_id for g in gpus]
        self.holders = [g.holder for g in gpus]
        reused = self.parked_on == ids
        if self.parked_on and not reused:
            self.release(f"other GPUs {ids}")
        self.ops.append(f"{'re-attach' if reused else 'attach'} {ids}")
        self.attached_to, self.parked_on = ids, []
        return reused

    def park(self) -> None:
        self.ops.append("park")
        self.parked_on, self.attached_to = self.attached_to, []

    def release(self, reason: str) -> bool:
        if not self.parked_on:
            return False
        gpus, self.parked_on = self.parked_on, []
        self.ops.append(f"stop parked {gpus}: {reason}")
        if self.on_parked_stop is not None:
            self.on_parked_stop(reason, gpus)
        return True

    def train_step(self, samples: list[Any], step: int, to_park: bool = True) -> dict[str, float]:
        if self.attached_to and self.fail == "core":
            raise RuntimeError("training rank 0 died")
        if self.attached_to and self.fail in ("borrowed", "borrowed_after"):  # as `EhpSession._fall_back`
            self.last_fallback_reason = "ehp0.borrowed_forward_backward failed on rank 1: died"
            borrowed = len(self.attached_to)
            self.detach(clean=False)
            if self.fail == "borrowed_after":
                self.ops.append(f"step {step} on {borrowed} borrowed GPU(s)")
                return {"loss": 0.5}
            self.ops.append(f"step {step} on 0 borrowed GPU(s)")
            return {"loss": 0.5, "ehp_fallback": 1.0}
        self.ops.append(f"step {step} on {len(self.attached_to)} borrowed GPU(s)")
        metrics = {"loss": 0.5}
        if self.attached_to:
            metrics["ehp_replicas"] = float(len(self.attached_to))
        return metrics

    def detach(self, clean: bool = True) -> None:
        if self.attached_to or self.parked_on:
            self.ops.append("detach")
        self.attached_to, self.parked_on = [], []


@dataclass
class FakeTrain:
    session: FakeSession

    def ehp_session(self) -> FakeSession:
        return self.session


@dataclass
class Rig:
    borrower: EhpBorrower
    rollout: FakeRollout
    session: FakeSession
    tracker: MemberTracker
    events: list[dict[str, Any]]
    desired: list[DesiredState]  # the last one is the desired state the borrower reads

    def kinds(self) -> list[str]:
        return [e["kind"] for e in self.events if e["kind"].startswith("ehp")]


def rollout_views(pids: tuple[int, int] = (100, 101)) -> list[MemberView]:
    return [MemberView(key=f"rollout-{i}", state=S.READY, gpu_ids=(str(2 + i),), serving=True,
                       info={"host": "n0", "pid": pids[i]}) for i in range(2)]


def rig(mode: str = "on", fail: str = "", fail_lend: bool = False, residency: Residency = "resident") -> Rig:
    events = EventLog(None)
    seen: list[dict[str, Any]] = []
    events.subscribe(seen.append)
    tracker = MemberTracker(events)
    tracker.observe(ROLLOUT, rollout_views(), time.time())
    ops: list[str] = []
    rollout = FakeRollout(ops, fail_lend=fail_lend)
    session = FakeSession(ops, fail=fail)
    desired = DesiredState(train_gpus=2, rollout_instances=2, rollout_tp=1, train_layout=TrainLayout())
    holder: list[DesiredState] = [desired]
    borrower = EhpBorrower(None, EhpSwitch(mode, "test"), rollout, FakeTrain(session),  # type: ignore[arg-type]
                           tracker, WeightGate(), events, lambda: holder[-1])
    borrower._residency = lambda layout, replicas, rollout_tp: residency  # type: ignore[method-assign]
    return Rig(borrower, rollout, session, tracker, seen, holder)


def serving(tracker: MemberTracker) -> list[str]:
    return sorted(m.id for m in tracker.members(ROLLOUT) if m.serving)


def test_a_step_borrows_and_gives_back() -> None:
    r = rig()
    metrics = r.borrower.train_step([object()] * 4, step=3)
    assert r.rollout.ops == ["lend ['rollout-0', 'rollout-1'] sleep=False", "attach ['2', '3']",
                             "step 3 on 2 borrowed GPU(s)", "park", "give_back ['rollout-0', 'rollout-1']"]
    assert metrics["ehp_replicas"] == 2.0 and "ehp_fallback" not in metrics
    assert r.session.holders == ["rollout-0", "rollout-1"]  # whose CPU slice each borrowed rank joins
    assert metrics["ehp_attach_s"] >= 0 and metrics["ehp_wake_s"] == 0.02
    assert r.kinds() == ["ehp_borrow", "ehp_return"]
    borrow, back = (e for e in r.events if e["kind"] in ("ehp_borrow", "ehp_return"))
    assert borrow["instances"] == ["rollout-0", "rollout-1"] and borrow["replicas"] == 2 and "attach_s" in borrow
    assert back["serving"] == ["rollout-0", "rollout-1"] and {"step_s", "detach_s", "wake_s"} <= set(back)
    assert not r.rollout.lent and serving(r.tracker) == ["rollout-0", "rollout-1"]
    assert not any(m.busy for m in r.tracker.members(ROLLOUT))


def test_lent_members_are_busy_and_not_serving_while_lent() -> None:
    r = rig()
    seen: list[tuple[list[str], list[bool]]] = []
    train_step = r.session.train_step

    def observing(samples: list[Any], step: int, to_park: bool = True) -> dict[str, float]:
        seen.append((serving(r.tracker), [m.busy for m in r.tracker.members(ROLLOUT)]))
        return train_step(samples, step, to_park)

    r.session.train_step = observing  # type: ignore[method-assign]
    r.borrower.train_step([object()], step=1)
    assert seen == [([], [True, True])]


def test_failed_attach_trains_on_the_pool_alone_and_gives_back() -> None:
    r = rig(fail="attach")
    metrics = r.borrower.train_step([object()], step=2)
    assert metrics["ehp_fallback"] == 1.0 and metrics["loss"] == 0.5
    assert r.rollout.ops[-2:] == ["give_back ['rollout-0', 'rollout-1']", "step 2 on 0 borrowed GPU(s)"]
    assert r.kinds() == ["ehp_failed", "ehp_return"]
    assert serving(r.tracker) == ["rollout-0", "rollout-1"] and not r.rollout.lent


def test_failed_lend_trains_on_the_pool_alone() -> None:
    r = rig(fail_lend=True)
    metrics = r.borrower.train_step([object()], step=2)
    assert metrics["ehp_fallback"] == 1.0 and r.rollout.ops == ["step 2 on 0 borrowed GPU(s)"]
    assert r.kinds() == ["ehp_failed"]
    assert not any(m.busy for m in r.tracker.members(ROLLOUT)) and serving(r.tracker) == ["rollout-0", "rollout-1"]


@pytest.mark.parametrize(("fail", "ran_on", "after"), [
    pytest.param("borrowed", 0, "the step ran on the training pool alone", id="fell-back-to-the-pool"),
    pytest.param("borrowed_after", 2, "the step had finished with the borrowed replicas", id="seen-after-the-step"),
])
def test_a_borrowed_failure_in_the_step_is_an_event_and_parks_nothing(fail: str, ran_on: int, after: str) -> None:
    r = rig(fail=fail)
    metrics = r.borrower.train_step([object()], step=4)
    assert bool(metrics.get("ehp_fallback")) is (fail == "borrowed")
    assert r.rollout.ops[-3:] == [f"step 4 on {ran_on} borrowed GPU(s)", "park",
                                  "give_back ['rollout-0', 'rollout-1']"]
    assert r.kinds() == ["ehp_borrow", "ehp_failed", "ehp_return"]
    failed = next(e for e in r.events if e["kind"] == "ehp_failed")
    assert failed["stage"] == "step" and "borrowed_forward_backward failed on rank 1" in failed["message"]
    assert after in failed["message"]
    back = next(e for e in r.events if e["kind"] == "ehp_return")
    assert back["parked"] is False and r.borrower._parked is None
    assert serving(r.tracker) == ["rollout-0", "rollout-1"] and not r.rollout.lent


def test_core_failure_raises_after_the_gpus_go_back() -> None:
    r = rig(fail="core")
    with pytest.raises(RuntimeError, match="training rank 0 died"):
        r.borrower.train_step([object()], step=5)
    assert r.rollout.ops[-1] == "give_back ['rollout-0', 'rollout-1']" and not r.rollout.lent
    assert r.kinds() == ["ehp_borrow", "ehp_return"]


def test_plan_only_lends_nothing() -> None:
    r = rig(mode="plan_only")
    r.borrower.train_step([object()], step=1)
    assert r.rollout.ops == ["step 1 on 0 borrowed GPU(s)"]
    assert r.kinds() == ["ehp_plan"]


def test_rollout_work_in_flight_borrows_nothing_once_per_reason() -> None:
    r = rig()
    for step in (1, 2):
        r.borrower.train_step([object()], step=step, rollout_in_flight=3)
    assert r.rollout.ops == ["step 1 on 0 borrowed GPU(s)", "step 2 on 0 borrowed GPU(s)"]
    assert r.kinds() == ["ehp_idle"]


def test_a_replica_size_the_layout_does_not_divide_borrows_nothing() -> None:
    from planner.ehp import EhpPlanError

    r = rig()

    def size() -> int:
        raise EhpPlanError("elastic_hybrid_replica_size_gpus=1: one complete replica of TP2 is 2 GPUs")

    r.session.replica_size = size  # type: ignore[method-assign]
    r.borrower.train_step([object()], step=4)
    assert r.rollout.ops == ["step 4 on 0 borrowed GPU(s)"]
    assert [e["message"] for e in r.events if e["kind"] == "ehp_idle"] == [
        "step 4 borrows no rollout GPUs: elastic_hybrid_replica_size_gpus=1: one complete replica of TP2 is 2 GPUs"]


# ---- the RL loop hands its step to the borrower ------------------------------------------------------------
@pytest.mark.parametrize("with_ehp", [True, False], ids=["ehp-on", "ehp-off"])
def test_rl_loop_trains_through_the_borrower_when_it_is_on(tmp_path: Any, with_ehp: bool) -> None:
    from libra.config import load_dict
    from libra.controller.desired_store import DesiredStore
    from libra.controller.reporting import Reporter
    from libra.controller.rl_loop import RLLoop
    from libra.controller.services import JobSession
    from libra.controller.signals import StopRequest
    from libra.observability.console import NullConsole
    from libra.run_dir import RunDir

    cfg = load_dict({"model_path": str(tmp_path / "m"), "rollout_kv_cache_bytes": 2**26,
                     "cluster": {"gpu_type": "cpu-logical", "logical_gpus": True, "gpus_per_node": 2},
                     "train_gpus": 1, "rollout_gpus": 1, "megatron_params_dtype": "fp32", "max_model_len": 256,
                     "max_new_tokens": 4, "megatron_use_cpu_initialization": True, "optimizer": {"clip_grad": 0},
                     "build_tiny_model": {"enabled": True, "num_heads": 2, "num_kv_heads": 1}})
    calls: list[tuple[str, int, int]] = []

    class Pool:
        def train_step(self, samples: list[Any], step: int) -> dict[str, float]:
            calls.append(("pool", step, -1))
            return {"loss": 1.0}

    def borrowing(samples: list[Any], step: int, in_flight: int) -> dict[str, float]:
        calls.append(("ehp", step, in_flight))
        return {"loss": 1.0, "ehp_replicas": 1.0}

    store = DesiredStore(None, DesiredState(rollout_instances=1, rollout_tp=1, train_gpus=1, train_layout=TrainLayout()))
    session = JobSession(training=Pool(), generation=None, desired=store,  # type: ignore[arg-type]
                         publish_weights=lambda *a: None, served_versions=list, wake_reconciler=lambda: None,
                         pool_status=dict, pool_text=dict, tick_errors=lambda: 0)
    if with_ehp:
        session = dataclasses.replace(session, ehp_train_step=borrowing)
    run = RunDir.at(tmp_path / "run").create()
    events = EventLog(run.events_jsonl)

    class Task:
        def train_prompts(self, seed: int) -> Any:
            yield from ()

    loop = RLLoop(cfg, run, session, events, Reporter(run, "t", 10, NullConsole(), events, None), Task(), None,
                  StopRequest(), 10)
    loop._make_producer()
    metrics = loop._train_step([object()], 3)
    assert calls == ([("ehp", 3, 0)] if with_ehp else [("pool", 3, -1)])
    assert ("ehp_replicas" in metrics) == with_ehp


# ---- a transient refusal is decided again -----------------------------------------------------------------
@pytest.mark.parametrize(("hold", "clears_after_s", "borrows"), [
    ("member", 0.3, True),
    ("pool", 0.3, True),
    ("loading", 0.3, True),
    ("member", None, False),
], ids=["busy-member-clears", "pool-action-clears", "weight-reload-clears", "busy-member-stays"])
def test_a_step_waits_for_a_transient_refusal_to_clear(hold: str, clears_after_s: float | None,
                                                       borrows: bool) -> None:
    r = rig()
    r.borrower.settle_s = 1.0
    members = [m.id for m in r.tracker.members(ROLLOUT)]

    def set_held(value: bool) -> None:
        if hold == "pool":
            r.tracker.set_pool(ROLLOUT, busy=value)
        elif hold == "loading":  # the instances reload the step's weights
            views = rollout_views()
            r.tracker.observe(ROLLOUT, [dataclasses.replace(v, state=S.LOADING if value else S.READY) for v in views],
                              time.time())
        else:
            for member_id in members:
                r.tracker.set_busy(member_id, value)

    set_held(True)
    decided = 0
    decide_now = r.borrower._decide_now

    def counted(*args: Any) -> Any:
        nonlocal decided
        decided += 1
        return decide_now(*args)

    r.borrower._decide_now = counted  # type: ignore[method-assign]
    timer = threading.Timer(clears_after_s, set_held, (False,)) if clears_after_s is not None else None
    if timer is not None:
        timer.start()
    started = time.monotonic()
    metrics = r.borrower.train_step([object()], step=1)
    waited = time.monotonic() - started
    if timer is not None:
        timer.join()
    assert ("ehp_replicas" in metrics) is borrows
    assert r.kinds() == (["ehp_borrow", "ehp_return"] if borrows else ["ehp_idle"])
    assert waited >= (clears_after_s or r.borrower.settle_s) * 0.9
    # decided again only when the tracker changed (each member's flag is a change of its own) and once more at
    # the deadline, never on a clock
    if clears_after_s is not None:
        assert 1 <= decided <= 1 + (len(members) if hold == "member" else 1)
    else:
        assert decided == 2


@pytest.mark.parametrize("fresh", [S.READY, S.LOADING], ids=["reload-done-since", "still-reloading"])
def test_a_refusal_on_members_seen_reloading_asks_for_an_observation_at_once(fresh: S) -> None:
    """The tracker's last observation fell inside the weight publish (members LOADING); the first refusal asks
    the control loop to observe now, once, instead of waiting up to a control interval for its next tick: an
    instance that serves again is borrowed at once; one still reloading is waited for as before."""
    r = rig()
    r.borrower.settle_s = 30.0 if fresh == S.READY else 0.5  # a missed observation would wait the whole settle
    views = rollout_views()
    r.tracker.observe(ROLLOUT, [dataclasses.replace(v, state=S.LOADING) for v in views], time.time())
    asked: list[float] = []

    def observe_now() -> None:
        asked.append(time.monotonic())
        r.tracker.observe(ROLLOUT, [dataclasses.replace(v, state=fresh) for v in views], time.time())

    r.borrower.observe_now = observe_now
    metrics = r.borrower.train_step([object()], step=1)
    assert len(asked) == 1
    if fresh == S.READY:
        assert "ehp_replicas" in metrics and r.kinds() == ["ehp_borrow", "ehp_return"]
    else:
        assert "ehp_replicas" not in metrics and r.kinds() == ["ehp_idle"]


def test_rollout_work_in_flight_is_not_waited_for() -> None:
    r = rig()
    started = time.monotonic()
    r.borrower.train_step([object()], step=1, rollout_in_flight=2)
    assert time.monotonic() - started < r.borrower.settle_s / 2 and r.kinds() == ["ehp_idle"]


# ---- parked borrowed replicas: when they stay, when they stop ------------------------------------------------
def lender(n: int, pid: int = 0, **kw: Any) -> Member:
    m = member(n, (str(2 + n),), **kw)
    m.info["pid"] = pid or 100 + n
    return m


PARKED = ParkedBorrow(lenders=(("rollout-0", ("2",), "100"), ("rollout-1", ("3",), "101")),
                      replicas=(("2",), ("3",)), rollout_shape=(2, 1))
SHAPE = DesiredState(rollout_instances=2, rollout_tp=1, train_gpus=2, train_layout=TrainLayout())
LENDERS = [lender(0), lender(1)]


def borrow(*replicas: tuple[str, ...], sleep: bool = False) -> BorrowDecision:
    return BorrowDecision(tuple(f"rollout-{int(r[0]) - 2}" for r in replicas), replicas, sleep,
                          "sleep" if sleep else "resident", "idle")


NO_BORROW = BorrowDecision((), (), False, "", "2 rollout group(s) are still generating")

# (members, desired state, this step's decision) -> the stop reason ("" = the parked replicas stay)
PARK_STOPS = [
    pytest.param(LENDERS, SHAPE, borrow(("2",), ("3",)), "", id="same-borrow-reuses"),
    pytest.param(LENDERS, SHAPE, None, "", id="between-steps-stays"),
    pytest.param(LENDERS, SHAPE, NO_BORROW, "", id="a-step-without-borrow-keeps-them"),
    pytest.param([lender(0, state=S.LOADING), lender(1)], SHAPE, None, "", id="lender-reloading-weights-stays"),
    pytest.param(LENDERS, SHAPE, borrow(("2",)), "the step borrows GPUs [['2']]", id="other-gpus"),
    pytest.param(LENDERS, SHAPE, borrow(("2",), ("3",), sleep=True), "residency sleep", id="residency-sleep"),
    pytest.param([lender(0)], SHAPE, None, "lending instance rollout-1 stopped", id="lender-gone"),
    pytest.param([lender(0), lender(1, state=S.DRAINING)], SHAPE, None, "lending instance rollout-1 stopped",
                 id="lender-draining"),
    pytest.param([lender(0, state=S.FAILED), lender(1)], SHAPE, None, "lending instance rollout-0 failed",
                 id="lender-failed"),
    pytest.param([lender(0, pid=555), lender(1)], SHAPE, None, "lending instance rollout-0 was replaced",
                 id="lender-replaced"),
    pytest.param(LENDERS, dataclasses.replace(SHAPE, reconfiguring="rollout 2 x TP1 -> 1 x TP2"), None,
                 "the rollout pool is being reconfigured", id="rollout-reconfiguring"),
    pytest.param(LENDERS, dataclasses.replace(SHAPE, rollout_instances=3), None, "the rollout pool was reconfigured",
                 id="rollout-reconfigured"),
]


@pytest.mark.parametrize(("members", "desired", "decision", "reason"), PARK_STOPS)
def test_parked_stop_reason(members: list[Member], desired: DesiredState, decision: BorrowDecision | None,
                            reason: str) -> None:
    got = parked_stop_reason(PARKED, members, desired, decision)
    assert (got == "") if not reason else reason in got, got


def test_the_next_step_re_attaches_the_parked_replicas() -> None:
    r = rig()
    first = r.borrower.train_step([object()] * 4, step=1)
    second = r.borrower.train_step([object()] * 4, step=2)
    assert r.rollout.ops == [
        "lend ['rollout-0', 'rollout-1'] sleep=False", "attach ['2', '3']", "step 1 on 2 borrowed GPU(s)", "park",
        "give_back ['rollout-0', 'rollout-1']",
        "lend ['rollout-0', 'rollout-1'] sleep=False", "re-attach ['2', '3']", "step 2 on 2 borrowed GPU(s)", "park",
        "give_back ['rollout-0', 'rollout-1']"]
    borrows = [e for e in r.events if e["kind"] == "ehp_borrow"]
    assert [e["reused"] for e in borrows] == [False, True] and all("attach_s" in e for e in borrows)
    assert [e["parked"] for e in r.events if e["kind"] == "ehp_return"] == [True, True]
    assert first["ehp_replicas"] == second["ehp_replicas"] == 2.0
    assert (first["ehp_reused"], second["ehp_reused"]) == (0.0, 1.0)
    assert r.session.parked and "ehp_release" not in r.kinds()


def test_sleeping_servers_never_keep_replicas_parked() -> None:
    r = rig(residency="sleep")
    for step in (1, 2):
        r.borrower.train_step([object()], step=step)
    assert [op for op in r.rollout.ops if op.split()[0] in ("attach", "re-attach", "park", "detach")] == [
        "attach ['2', '3']", "detach", "attach ['2', '3']", "detach"]
    assert [e["parked"] for e in r.events if e["kind"] == "ehp_return"] == [False, False]
    assert not r.session.parked


def _replace_lender(r: Rig) -> None:
    r.tracker.observe(ROLLOUT, rollout_views(pids=(100, 999)), time.time())


def _reconfigure(r: Rig) -> None:
    r.desired.append(dataclasses.replace(r.desired[-1], reconfiguring="rollout 2 x TP1 -> 1 x TP2"))


# what happens between step 1 and step 2 -> the reason the parked replicas stop with, and whether step 2 borrows
BETWEEN_STEPS = [
    pytest.param(lambda r: r.rollout.stop("rollout-1"), "lending instance rollout-1 is being stopped", True,
                 id="lender-stopped-by-the-reconciler"),
    pytest.param(_replace_lender, "lending instance rollout-1 was replaced", True, id="lender-replaced"),
    pytest.param(_reconfigure, "the rollout pool is being reconfigured", False, id="rollout-reconfigured"),
    pytest.param(lambda r: r.borrower.close(), "the job ends", True, id="job-ends"),
]


@pytest.mark.parametrize(("between", "reason", "borrows_again"), BETWEEN_STEPS)
def test_parked_replicas_stop_and_say_why(between: Any, reason: str, borrows_again: bool) -> None:
    r = rig()
    r.borrower.train_step([object()], step=1)
    assert r.session.parked
    between(r)
    metrics = r.borrower.train_step([object()], step=2)
    releases = [e for e in r.events if e["kind"] == "ehp_release"]
    assert len(releases) == 1 and reason in releases[0]["reason"] and releases[0]["gpus"] == ["2", "3"]
    assert any(op.startswith("stop parked ['2', '3']") for op in r.rollout.ops)
    assert "re-attach ['2', '3']" not in r.rollout.ops  # never reused after a stop
    assert ("ehp_replicas" in metrics) is borrows_again
    if borrows_again:
        assert [e["reused"] for e in r.events if e["kind"] == "ehp_borrow"] == [False, False]


def test_a_failed_step_leaves_nothing_parked() -> None:
    r = rig()
    r.borrower.train_step([object()], step=1)
    r.session.fail = "core"
    with pytest.raises(RuntimeError, match="training rank 0 died"):
        r.borrower.train_step([object()], step=2)
    assert not r.session.parked and not r.session.attached_to
    assert r.rollout.ops[-2:] == ["detach", "give_back ['rollout-0', 'rollout-1']"]
    assert [e["parked"] for e in r.events if e["kind"] == "ehp_return"] == [True, False]


# ---- borrowed replicas started during the first rollout ------------------------------------------------------
def test_prewarm_parks_the_first_borrows_replicas_and_the_first_step_re_attaches_them() -> None:
    r = rig()
    assert r.borrower.prewarm() is True
    assert r.rollout.ops == ["attach ['2', '3']", "park"]  # nothing lent: the lenders keep serving
    assert serving(r.tracker) == ["rollout-0", "rollout-1"] and r.session.holders == ["rollout-0", "rollout-1"]
    prewarm = [e for e in r.events if e["kind"] == "ehp_prewarm"]
    assert len(prewarm) == 1 and prewarm[0]["started"] is True and prewarm[0]["replicas"] == 2
    metrics = r.borrower.train_step([object()] * 4, step=1)
    assert r.rollout.ops[2:] == ["lend ['rollout-0', 'rollout-1'] sleep=False", "re-attach ['2', '3']",
                                 "step 1 on 2 borrowed GPU(s)", "park", "give_back ['rollout-0', 'rollout-1']"]
    assert metrics["ehp_reused"] == 1.0 and "ehp_release" not in r.kinds()


def _sleeping(r: Rig) -> None:
    r.borrower._residency = lambda layout, replicas, rollout_tp: "sleep"  # type: ignore[method-assign]


def _failing_attach(r: Rig) -> None:
    r.session.fail = "attach"


def _all_kept(r: Rig) -> None:
    r.session.settings = dataclasses.replace(r.session.settings, min_rollout_gpus=2)


# what is true before the prewarm -> what its event says, and what the first step's borrow then does
NO_PREWARM = [
    pytest.param(_sleeping, "lending servers sleep", "attach ['2', '3']", id="lenders-sleep"),
    pytest.param(_reconfigure, "the rollout pool is being reconfigured", None, id="rollout-reconfiguring"),
    pytest.param(_failing_attach, "failed (RuntimeError: a borrowed worker did not start)", None,
                 id="worker-start-fails"),
    pytest.param(_all_kept, "no borrowed replicas started", None, id="every-gpu-kept-serving"),
]


@pytest.mark.parametrize(("before", "says", "first_attach"), NO_PREWARM)
def test_no_prewarm_leaves_the_first_borrow_to_start_the_replicas(before: Any, says: str,
                                                                  first_attach: str | None) -> None:
    r = rig()
    before(r)
    assert r.borrower.prewarm() is False
    prewarm = [e for e in r.events if e["kind"] == "ehp_prewarm"]
    assert len(prewarm) == 1 and prewarm[0]["started"] is False and says in prewarm[0]["message"], prewarm
    assert not r.session.parked and not r.session.attached and "park" not in r.rollout.ops
    r.borrower.train_step([object()], step=1)
    attaches = [op for op in r.rollout.ops if op.split()[0] in ("attach", "re-attach")]
    assert attaches == ([first_attach] if first_attach else [])


def test_plan_only_starts_no_replicas_ahead_of_the_first_step() -> None:
    r = rig(mode="plan_only")
    assert r.borrower.prewarm() is False
    assert r.rollout.ops == [] and "ehp_prewarm" not in r.kinds()


def test_the_first_step_waits_for_the_prewarm_in_progress() -> None:
    r = rig()
    r.session.attach_gate = threading.Event()
    prewarm = threading.Thread(target=r.borrower.prewarm)
    prewarm.start()
    step = threading.Thread(target=r.borrower.train_step, args=([object()], 1))
    deadline = time.monotonic() + 5
    while not r.borrower._lock.locked() and time.monotonic() < deadline:
        time.sleep(0.01)
    step.start()
    time.sleep(0.3)
    assert r.rollout.ops == [], "the step lent its GPUs while the replicas were still starting"
    r.session.attach_gate.set()
    prewarm.join(10)
    step.join(10)
    assert r.rollout.ops[:3] == ["attach ['2', '3']", "park", "lend ['rollout-0', 'rollout-1'] sleep=False"]
    assert "re-attach ['2', '3']" in r.rollout.ops


def test_lenders_on_two_nodes_with_the_same_gpu_id_each_lend_their_own_gpu() -> None:
    """GPU ids are per node: two lenders on two nodes both hold a GPU "2"; each borrowed rank gets its own."""
    r = rig()
    r.rollout.same_ids = True
    r.tracker.observe(ROLLOUT, [MemberView(key=f"rollout-{i}", state=S.READY, gpu_ids=("2",), serving=True,
                                           info={"host": f"n{i}", "pid": 100 + i}) for i in range(2)],
                      time.time())
    gpus: list[Any] = []
    attach = r.session.attach
    r.session.attach = lambda lent: gpus.extend(lent) or attach(lent)  # type: ignore[method-assign]
    metrics = r.borrower.train_step([object()] * 4, step=1)
    assert metrics["ehp_replicas"] == 2.0
    assert [(g.gpu_id, g.node, g.holder) for g in gpus] == [("2", "n0", "rollout-0"), ("2", "n1", "rollout-1")]


def test_lenders_that_cannot_reach_the_training_pool_are_held_back_until_they_do() -> None:
    """Borrowed replicas could not start on rollout-1's node (it cannot reach the training pool's node): that
    step trains alone, the node is held back (a warning event) and the next steps borrow rollout-0 alone while
    rollout-1 keeps serving; once the node's check says it reaches its peers again, both lend again."""
    r = rig(fail="unreachable")
    reachable = threading.Event()
    checked: list[str] = []

    def reaches_again(node: FencedNode) -> bool:
        checked.append(node.node_id)
        return reachable.is_set()

    r.borrower.held_back.rechecks.check, r.borrower.held_back.rechecks.interval_s = reaches_again, 0.02
    first = r.borrower.train_step([object()] * 4, step=1)
    assert first["ehp_fallback"] == 1.0 and r.kinds() == ["ehp_failed", "ehp_held_back", "ehp_return"]
    held = next(e for e in r.events if e["kind"] == "ehp_held_back")
    assert (held["address"], held["instances"], held["unreachable"]) == ("10.0.0.3", ["rollout-1"], ["node-a"])
    assert "rollout node 10.0.0.3 no longer lends" in held["message"] and "keep serving" in held["message"]
    second = r.borrower.train_step([object()] * 4, step=2)
    assert second["ehp_replicas"] == 1.0 and "ehp_fallback" not in second
    assert r.rollout.ops[-5:] == ["lend ['rollout-0'] sleep=False", "attach ['2']", "step 2 on 1 borrowed GPU(s)", "park",
                                 "give_back ['rollout-0']"]
    assert serving(r.tracker) == ["rollout-0", "rollout-1"]
    deadline = time.monotonic() + 5
    while len(checked) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert checked[:2] == ["node-b", "node-b"]  # checked again and again while it does not reach them
    r.session.fail = ""
    reachable.set()
    while "ehp_lender_back" not in r.kinds() and time.monotonic() < deadline:
        time.sleep(0.01)
    back = next(e for e in r.events if e["kind"] == "ehp_lender_back")
    assert (back["address"], back["instances"]) == ("10.0.0.3", ["rollout-1"])
    third = r.borrower.train_step([object()] * 4, step=3)
    assert third["ehp_replicas"] == 2.0
    r.borrower.close()


def test_lenders_found_unreachable_at_prewarm_are_held_back_from_the_first_borrow() -> None:
    r = rig(fail="unreachable")
    assert r.borrower.prewarm() is False
    assert r.kinds() == ["ehp_prewarm", "ehp_held_back"]
    assert next(e for e in r.events if e["kind"] == "ehp_held_back")["step"] == 0
    metrics = r.borrower.train_step([object()] * 4, step=1)
    assert metrics["ehp_replicas"] == 1.0 and "ehp_fallback" not in metrics
    assert r.rollout.ops[-5:-2] == ["lend ['rollout-0'] sleep=False", "attach ['2']", "step 1 on 1 borrowed GPU(s)"]
    r.borrower.close()
