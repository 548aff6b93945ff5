"""Elastic hybrid parallelism at the step boundary (`libra.controller.ehp_borrow`): which rollout members lend
(a table of cases), and the borrow carried out with fake pool edges: lend, attach, step, detach, give back,
the events and the reconciler's view of the lent members; attach and core failures; plan-only."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from libra.config.elastic_hybrid import EhpSwitch
from libra.controller.ehp_borrow import EhpBorrower, decide_borrow, lendable_instances
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
]


@pytest.mark.parametrize(("members", "size", "keep", "residency", "busy", "lend", "replicas", "sleep"), DECISIONS)
def test_borrow_decision(members: list[Member], size: int, keep: int, residency: Any, busy: str,
                         lend: tuple[str, ...], replicas: tuple[tuple[str, ...], ...], sleep: bool) -> None:
    decision = decide_borrow(members, size, keep, residency, busy)
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

    def lent_gpus(self, key: str) -> list[Any]:
        return [Gpu(gpu_id=str(2 + int(key.rsplit("-", 1)[1])))]


@dataclass(frozen=True)
class Gpu:
    gpu_id: str


@dataclass
class Settings:
    min_rollout_gpus: int = 0


@dataclass
class FakePool:
    layout: TrainLayout = field(default_factory=TrainLayout)


@dataclass
class FakeSession:
    ops: list[str]
    fail: str = ""  # "attach" | "core"
    pool: FakePool = field(default_factory=FakePool)
    settings: Settings = field(default_factory=Settings)
    attached_to: list[str] = field(default_factory=list)

    def replica_size(self) -> int:
        return 1

    def attach(self, gpus: list[Gpu]) -> None:
        if self.fail == "attach":
            raise RuntimeError("a borrowed worker did not start")
        self.ops.append(f"attach {[g.gpu_id for g in gpus]}")
        self.attached_to = [g.gpu_id for g in gpus]

    def train_step(self, samples: list[Any], step: int) -> dict[str, float]:
        if self.attached_to and self.fail == "core":
            raise RuntimeError("training rank 0 died")
        self.ops.append(f"step {step} on {len(self.attached_to)} borrowed GPU(s)")
        metrics = {"loss": 0.5}
        if self.attached_to:
            metrics["ehp_replicas"] = float(len(self.attached_to))
        return metrics

    def detach(self, clean: bool = True) -> None:
        if self.attached_to:
            self.ops.append("detach")
        self.attached_to = []


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

    def kinds(self) -> list[str]:
        return [e["kind"] for e in self.events if e["kind"].startswith("ehp")]


def rig(mode: str = "on", fail: str = "", fail_lend: bool = False) -> Rig:
    events = EventLog(None)
    seen: list[dict[str, Any]] = []
    events.subscribe(seen.append)
    tracker = MemberTracker(events)
    tracker.observe(ROLLOUT, [MemberView(key=f"rollout-{i}", state=S.READY, gpu_ids=(str(2 + i),), serving=True,
                                         info={"host": "n0"}) for i in range(2)], time.time())
    ops: list[str] = []
    rollout = FakeRollout(ops, fail_lend=fail_lend)
    session = FakeSession(ops, fail=fail)
    desired = DesiredState(train_gpus=2, rollout_instances=2, rollout_tp=1, train_layout=TrainLayout())
    borrower = EhpBorrower(None, EhpSwitch(mode, "test"), rollout, FakeTrain(session),  # type: ignore[arg-type]
                           tracker, WeightGate(), events, lambda: desired)
    borrower._residency = lambda layout, replicas, tp: "resident"  # type: ignore[method-assign]
    return Rig(borrower, rollout, session, tracker, seen)


def serving(tracker: MemberTracker) -> list[str]:
    return sorted(m.id for m in tracker.members(ROLLOUT) if m.serving)


def test_a_step_borrows_and_gives_back() -> None:
    r = rig()
    metrics = r.borrower.train_step([object()] * 4, step=3)
    assert r.rollout.ops == ["lend ['rollout-0', 'rollout-1'] sleep=False", "attach ['2', '3']",
                             "step 3 on 2 borrowed GPU(s)", "detach", "give_back ['rollout-0', 'rollout-1']"]
    assert metrics["ehp_replicas"] == 2.0 and "ehp_fallback" not in metrics
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

    def observing(samples: list[Any], step: int) -> dict[str, float]:
        seen.append((serving(r.tracker), [m.busy for m in r.tracker.members(ROLLOUT)]))
        return train_step(samples, step)

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
    import dataclasses

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
