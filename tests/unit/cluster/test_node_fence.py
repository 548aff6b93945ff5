"""The fence of nodes the job no longer uses: what it says about a node, the label selector that keeps new
placement groups off the fenced nodes (Ray's `!in(...)` form over the node-id label), and the rollout health
monitor's verdict on a host whose node is fenced."""

from __future__ import annotations

import asyncio

import pytest

from libra.cluster.node_fence import NODE_ID_LABEL, NodeFence, avoid_fenced
from libra.rollout.health import host_gone
from libra.rollout.spec import HealthRule

# (id, nodes fenced, selector of each bundle)
SELECTORS = [
    ("none", [], None),
    ("one", ["n1"], {NODE_ID_LABEL: "!in(n1)"}),
    ("two-sorted", ["n2", "n1"], {NODE_ID_LABEL: "!in(n1,n2)"}),
    ("fenced-twice-counts-once", ["n1", "n1"], {NODE_ID_LABEL: "!in(n1)"}),
]


@pytest.mark.parametrize(("nodes", "selector"), [case[1:] for case in SELECTORS], ids=[case[0] for case in SELECTORS])
def test_placement_groups_avoid_the_fenced_nodes(nodes: list[str], selector: dict[str, str] | None) -> None:
    fence = NodeFence()
    for node in nodes:
        fence.add(node, f"10.0.0.{node[-1]}", "cut off")
    assert avoid_fenced(3, fence) == (None if selector is None else [selector] * 3)


def test_a_fenced_node_says_why_and_is_fenced_once() -> None:
    fence = NodeFence()
    assert fence.add("n1", "10.0.0.3", "training ranks there could not reach 10.0.0.2")
    assert not fence.add("n1", "10.0.0.3", "again")
    assert fence.reason_for("n1") == ("its node 10.0.0.3 is fenced off: training ranks there could not reach "
                                      "10.0.0.2")
    assert fence.reason_for("n2") == ""
    fence.clear()
    assert fence.node_ids() == frozenset()


class AnsweringHost:
    """A host actor's handle that answers its status, on a node fenced or not."""

    def __init__(self, fenced: str) -> None:
        self._fenced = fenced

    def fenced(self) -> str:
        return self._fenced

    async def acall(self, method: str, *args: object) -> dict[str, str]:
        return {"state": "ready"}


@pytest.mark.parametrize(("fenced", "verdict"), [("", ""), ("its node 10.0.0.3 is fenced off: cut off",
                                                            "its node 10.0.0.3 is fenced off: cut off")],
                         ids=["answering-host-kept", "host-on-a-fenced-node-gone"])
def test_the_health_monitor_fails_a_host_on_a_fenced_node(fenced: str, verdict: str) -> None:
    rule = HealthRule(interval_s=1.0, timeout_s=1.0, failures_to_fail=1)
    assert asyncio.run(host_gone(AnsweringHost(fenced), rule)) == verdict
