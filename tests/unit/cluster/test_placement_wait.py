"""A placement group's wait ends early when the cluster loses GPUs meanwhile (a node that died silently is
declared dead while a training restart waits to be placed there), and otherwise after the timeout; either way
the group is removed and the error says "was not placed", which the node-loss recovery re-plans on."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from libra.cluster import ray_runtime
from libra.cluster.ray_runtime import RayRuntime
from libra.controller.node_loss import _not_placed


class FakeGroup:
    def ready(self) -> str:
        return "ready-ref"


@pytest.mark.parametrize(("live", "placed_after", "guard", "expect"), [
    ([4, 4, 4, 4], 2, False, "placed"),
    ([4, 4, 2, 2], None, False, "lost GPUs while it waited: 4 -> 2"),
    ([4] * 10, None, False, "was not placed within"),
    ([2] * 10, None, True, "the cluster has 2 of the 4 GPUs this job holds"),
], ids=["placed-on-the-third-poll", "cluster-lost-gpus-while-waiting", "timeout",
        "guard-gives-up-on-a-loss-declared-before-the-wait"])
def test_a_placement_wait_gives_up_when_the_cluster_loses_gpus(
        monkeypatch: pytest.MonkeyPatch, live: list[int], placed_after: int | None, guard: bool, expect: str) -> None:
    clock = [0.0]
    polls: list[float] = []
    removed: list[Any] = []
    readings = iter(live)

    def wait(refs: list[str], timeout: float) -> tuple[list[str], list[str]]:
        polls.append(timeout)
        clock[0] += timeout
        return (refs, []) if placed_after is not None and len(polls) > placed_after else ([], refs)

    monkeypatch.setattr(ray_runtime, "PLACEMENT_TIMEOUT_S", 5.0)
    monkeypatch.setattr(ray_runtime, "placement_group", lambda bundles, strategy, name: FakeGroup())
    monkeypatch.setattr(ray_runtime, "remove_placement_group", removed.append)
    monkeypatch.setattr(ray_runtime.ray, "wait", wait)
    monkeypatch.setattr(ray_runtime.ray, "cluster_resources", lambda: {"GPU": 2.0})
    monkeypatch.setattr(ray_runtime, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(RayRuntime, "live_gpus", staticmethod(lambda: next(readings)))
    runtime = RayRuntime(address="fake", owned=False, namespace="ns")
    if guard:  # the caller planned with 4 GPUs; Ray declared 2 of them dead just before the wait began
        checks = iter(["", "the cluster has 2 of the 4 GPUs this job holds"])
        with runtime.placement_guard(lambda: next(checks)), pytest.raises(TimeoutError, match=expect):
            runtime.placement_group([{"GPU": 1.0}], name="train-pg")
        assert len(polls) == 2 and len(removed) == 1 and runtime._placement_check is None
        return
    if expect == "placed":
        assert isinstance(runtime.placement_group([{"GPU": 1.0}], name="train-pg"), FakeGroup)
        assert removed == [] and len(polls) == 3
        return
    with pytest.raises(TimeoutError, match=expect) as raised:
        runtime.placement_group([{"GPU": 1.0}], name="train-pg")
    assert len(removed) == 1 and _not_placed(raised.value)
    assert sum(polls) <= 5.0 and all(p <= ray_runtime.PLACEMENT_POLL_S for p in polls)
    if "lost" in expect:
        assert len(polls) == 2, "it stopped at the first reading that showed the loss"
