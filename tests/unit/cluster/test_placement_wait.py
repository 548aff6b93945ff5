"""A placement group's wait ends early when the cluster loses GPUs meanwhile (a node that died silently is
declared dead while a training restart waits to be placed there), and otherwise after the timeout; either way
the group is removed and the error says "was not placed", which the node-loss recovery re-plans on. A rollout
host's bundle waits the same way."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from libra.cluster import ray_runtime, rollout_hosts
from libra.cluster.node_fence import FENCE
from libra.cluster.ray_runtime import RayRuntime
from libra.controller.node_loss import _not_placed


class FakeGroup:
    def ready(self) -> str:
        return "ready-ref"


def fake_cluster(monkeypatch: pytest.MonkeyPatch, live: list[int],
                 placed_after: int | None) -> tuple[list[float], list[Any]]:
    """Ray as a placement wait sees it: the GPUs alive at each reading are `live`, a group is placed after
    `placed_after` polls (None = never), the timeout is 5 s on a clock that each poll moves on; the polls'
    timeouts and the groups removed."""
    clock = [0.0]
    polls: list[float] = []
    removed: list[Any] = []
    readings = iter(live)

    def wait(refs: list[str], timeout: float) -> tuple[list[str], list[str]]:
        polls.append(timeout)
        clock[0] += timeout
        return (refs, []) if placed_after is not None and len(polls) > placed_after else ([], refs)

    monkeypatch.setattr(ray_runtime, "PLACEMENT_TIMEOUT_S", 5.0)
    monkeypatch.setattr(ray_runtime, "remove_placement_group", removed.append)
    monkeypatch.setattr(ray_runtime.ray, "wait", wait)
    monkeypatch.setattr(ray_runtime.ray, "cluster_resources", lambda: {"GPU": 2.0})
    monkeypatch.setattr(ray_runtime.ray, "available_resources", lambda: {"GPU": 0.0})
    monkeypatch.setattr(ray_runtime, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(RayRuntime, "live_gpus", staticmethod(lambda: next(readings)))
    return polls, removed


@pytest.mark.parametrize(("live", "placed_after", "guard", "expect"), [
    ([4, 4, 4, 4], 2, False, "placed"),
    ([4, 4, 2, 2], None, False, "lost GPUs while it waited: 4 -> 2"),
    ([4] * 10, None, False, "was not placed within"),
    ([2] * 10, None, True, "the cluster has 2 of the 4 GPUs this job holds"),
], ids=["placed-on-the-third-poll", "cluster-lost-gpus-while-waiting", "timeout",
        "guard-gives-up-on-a-loss-declared-before-the-wait"])
def test_a_placement_wait_gives_up_when_the_cluster_loses_gpus(
        monkeypatch: pytest.MonkeyPatch, live: list[int], placed_after: int | None, guard: bool, expect: str) -> None:
    polls, removed = fake_cluster(monkeypatch, live, placed_after)
    monkeypatch.setattr(ray_runtime, "placement_group",
                        lambda bundles, strategy, name, bundle_label_selector: FakeGroup())
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


@pytest.mark.parametrize(("live", "expect", "polls_at_most"), [
    ([4, 4, 2, 2], "lost GPUs while it waited: 4 -> 2", 2),
    ([4] * 10, "was not placed within 5s", 5),
], ids=["a-rollout-host-gives-up-when-the-cluster-loses-gpus", "a-rollout-host-waits-out-the-timeout"])
def test_a_rollout_hosts_bundle_waits_as_a_training_pools_does(
        monkeypatch: pytest.MonkeyPatch, live: list[int], expect: str, polls_at_most: int) -> None:
    """A replacement rollout instance placed on a node that died without a word gives up its wait once Ray
    declares the node dead, instead of waiting out the timeout; its group is removed, and no host is started."""
    polls, removed = fake_cluster(monkeypatch, live, placed_after=None)
    monkeypatch.setattr(rollout_hosts, "placement_group",
                        lambda bundles, strategy, name, lifetime, bundle_label_selector: FakeGroup())
    monkeypatch.setattr(rollout_hosts.ray, "remote", lambda cls: pytest.fail("a host started without its GPUs"))
    runtime = RayRuntime(address="fake", owned=False, namespace="ns")
    with pytest.raises(TimeoutError, match=expect) as raised:
        rollout_hosts.spawn_host(object, name="rollout-3", namespace="ns", tp_size=1, detached=True, runtime=runtime)
    assert "rollout instance rollout-3: 1 GPU(s) in one bundle" in str(raised.value)
    assert len(removed) == 1 and len(polls) <= polls_at_most


@pytest.mark.parametrize(("fenced", "selector"), [([], None), (["n2"], [{"ray.io/node-id": "!in(n2)"}] * 2)],
                         ids=["no-fence-no-selector", "fenced-node-avoided-by-every-bundle"])
def test_a_training_pools_bundles_avoid_the_fenced_nodes(monkeypatch: pytest.MonkeyPatch, fenced: list[str],
                                                         selector: list[dict[str, str]] | None) -> None:
    fake_cluster(monkeypatch, [4] * 4, placed_after=0)
    asked: list[Any] = []

    def placement_group(bundles, strategy, name, bundle_label_selector):  # type: ignore[no-untyped-def]
        asked.append(bundle_label_selector)
        return FakeGroup()

    monkeypatch.setattr(ray_runtime, "placement_group", placement_group)
    for node in fenced:  # the process's fence, as the controller's node-loss recovery fills it
        FENCE.add(node, "10.0.0.3", "cut off")
    try:
        RayRuntime(address="fake", owned=False, namespace="ns").placement_group([{"GPU": 1.0}] * 2, name="train-pg")
    finally:
        FENCE.clear()
    assert asked == [selector]
