"""Lending rollout instances to the training step (`libra.rollout.lending`) on a real router with fake server
clients: a lent instance leaves serving, sleeps when asked, may not serve until given back; given back it
wakes, is reloaded when its weights are old, and serves again; what may not be lent is refused whole."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from libra.rollout import lending
from libra.rollout.membership import serving_problems
from libra.rollout.publisher import CurrentWeights
from libra.rollout.router import READY, STARTING, InstanceSlot, Router


@dataclass
class FakeClient:
    calls: list[str] = field(default_factory=list)
    fail_wake: bool = False

    async def sleep(self, level: int = 1) -> None:
        self.calls.append(f"sleep {level}")

    async def wake_up(self) -> None:
        if self.fail_wake:
            raise RuntimeError("wake_up -> HTTP 500")
        self.calls.append("wake_up")


@dataclass
class FakePublisher:
    published: list[tuple[int, str, list[str]]] = field(default_factory=list)
    router: Router | None = None

    async def publish(self, expect: Any, hf_dir: str, instance_ids: list[str]) -> None:
        self.published.append((expect.version, hf_dir, list(instance_ids)))
        assert self.router is not None
        for iid in instance_ids:
            self.router.slots[iid].weight_version = expect.version


def router_with(*states: str, version: int = 4) -> Router:
    router = Router(8, 30.0, 30.0)
    for i, state in enumerate(states):
        router.slots[f"rollout-{i}"] = InstanceSlot(id=f"rollout-{i}", client=FakeClient(),  # type: ignore[arg-type]
                                                    host="127.0.0.1", port=8100 + i, weight_version=version,
                                                    state=state, gpu_ids=(str(i),))
    router.serving = frozenset(i for i, s in router.slots.items() if s.state == READY)
    return router


def client(router: Router, iid: str) -> FakeClient:
    return router.slots[iid].client  # type: ignore[return-value]


def test_lend_then_give_back() -> None:
    router = router_with(READY, READY)
    reports = asyncio.run(lending.lend(router, ["rollout-1"], sleep=True, drain_timeout_s=5))
    assert [(r.instance_id, r.gpu_ids, r.asleep) for r in reports] == [("rollout-1", ("1",), True)]
    assert router.serving == {"rollout-0"} and router.slots["rollout-1"].lent
    assert client(router, "rollout-1").calls == ["sleep 1"]
    assert serving_problems(["rollout-0", "rollout-1"], router.slots, 4) == [
        "'rollout-1': its GPUs are lent to the training step; it serves again once given back"]

    publisher = FakePublisher(router=router)
    back = asyncio.run(lending.give_back(router, publisher, CurrentWeights(4, "/w/4", "c4"),  # type: ignore[arg-type]
                                         ["rollout-1"]))
    assert [(r.instance_id, r.serving, r.error) for r in back] == [("rollout-1", True, "")]
    assert client(router, "rollout-1").calls == ["sleep 1", "wake_up"]
    assert publisher.published == []  # it held the current weights
    assert router.serving == {"rollout-0", "rollout-1"} and not router.slots["rollout-1"].lent


def test_given_back_with_old_weights_is_reloaded_first() -> None:
    router = router_with(READY, READY, version=3)
    asyncio.run(lending.lend(router, ["rollout-0"], sleep=False, drain_timeout_s=5))
    publisher = FakePublisher(router=router)
    back = asyncio.run(lending.give_back(router, publisher, CurrentWeights(4, "/w/4", "c4"),  # type: ignore[arg-type]
                                         ["rollout-0"]))
    assert publisher.published == [(4, "/w/4", ["rollout-0"])] and back[0].serving
    assert client(router, "rollout-0").calls == []  # resident: it never slept


def test_an_instance_that_does_not_wake_stays_out_of_serving() -> None:
    router = router_with(READY, READY)
    asyncio.run(lending.lend(router, ["rollout-0", "rollout-1"], sleep=True, drain_timeout_s=5))
    client(router, "rollout-0").fail_wake = True
    back = asyncio.run(lending.give_back(router, None, None, ["rollout-0", "rollout-1"]))
    assert {r.instance_id: (r.serving, bool(r.error)) for r in back} == {"rollout-0": (False, True),
                                                                          "rollout-1": (True, False)}
    assert router.serving == {"rollout-1"} and not router.slots["rollout-0"].lent


@pytest.mark.parametrize(("states", "lend", "problem"), [
    pytest.param((READY, STARTING), ["rollout-1"], "'rollout-1': is starting, not serving", id="not-ready"),
    pytest.param((READY,), ["rollout-7"], "'rollout-7': no such instance", id="unknown"),
    pytest.param((READY,), ["rollout-0", "rollout-0"], "names an instance more than once", id="twice"),
    pytest.param((READY,), [], "no instance named", id="none"),
])
def test_what_cannot_be_lent_is_refused_whole(states: tuple[str, ...], lend: list[str], problem: str) -> None:
    router = router_with(*states)
    before = router.serving
    with pytest.raises(lending.LendingError, match=problem):
        asyncio.run(lending.lend(router, [*lend, "rollout-0"] if lend == ["rollout-1"] else lend, sleep=True,
                                 drain_timeout_s=5))
    assert router.serving == before and not any(s.lent for s in router.slots.values())


def test_a_lent_instance_is_not_lent_twice() -> None:
    router = router_with(READY, READY)
    asyncio.run(lending.lend(router, ["rollout-0"], sleep=False, drain_timeout_s=5))
    with pytest.raises(lending.LendingError, match="'rollout-0': is already lent"):
        asyncio.run(lending.lend(router, ["rollout-0"], sleep=False, drain_timeout_s=5))
