"""The errors of a rollout host actor keep their class across Ray: the publisher tells a restart whose new server
hung while it started (`ServerStalledError`: the instance has failed) from one whose server crashed loading the
weights (a plain `ServerStartError`: the publish fails) by the class of what `RayHostHandle.acall` raises, and
its error names that class and message, not Ray's wrapper."""

from __future__ import annotations

import asyncio

import pytest
import ray

from libra.cluster.ray_runtime import RayRuntime
from libra.cluster.rollout_hosts import RayHostHandle
from libra.rollout.spec import ServerStalledError, ServerStartError


@pytest.mark.parametrize(("raised", "stalled"), [
    pytest.param(ServerStalledError, True, id="hung-start-is-a-failed-server"),
    pytest.param(ServerStartError, False, id="crashed-start-fails-the-publish"),
])
def test_a_hosts_start_error_keeps_its_class(ray_runtime: RayRuntime, raised: type[ServerStartError],
                                             stalled: bool) -> None:
    @ray.remote(num_cpus=0)
    class FailingHost:  # defined here so that Ray ships it by value to its worker
        def restart(self, hf_dir: str) -> None:
            raise raised(f"vLLM server for {hf_dir} on port 1: the log says why")

    actor = FailingHost.remote()  # type: ignore[attr-defined]
    handle = RayHostHandle(actor, None, "failing-host")
    try:
        with pytest.raises(ServerStartError) as caught:
            asyncio.run(handle.acall("restart", "/models/v2"))
        assert isinstance(caught.value, ServerStalledError) is stalled
        # itself, not Ray's wrapper: a publish's error names the class and quotes the message alone
        assert f"{type(caught.value).__name__}: {caught.value}" == \
            f"{raised.__name__}: vLLM server for /models/v2 on port 1: the log says why"
        with pytest.raises(raised, match="the log says why"):
            handle.call("restart", "/models/v3")
    finally:
        handle.kill()
