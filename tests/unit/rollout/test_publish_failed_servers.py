"""A weight publish that meets failed servers: with `leave_out_failed`, an instance whose server is gone (FAILED
already, killed or hung during its reload or while its requests drain before it: /health does not answer; or a
restart reload whose new server hung while it started) is left out, stays FAILED with its requests sent
elsewhere, and the publish validates the others and moves the pool's version (also when every server failed:
their replacements start on it); a live server that refused the reload, or a restarted one that exited loading
the weights, still fails it."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest

from libra.metering.spec import CpuMetering
from libra.rollout.client import InstanceFailure
from libra.rollout.publisher import CurrentWeights, WeightPublisher
from libra.rollout.reload import AckExpectation, WeightSyncError, leave_out_failed_servers
from libra.rollout.router import FAILED, READY, InstanceSlot, Router
from libra.rollout.spec import HealthRule, RolloutPoolSpec, ServerStalledError, ServerStartError
from libra.rollout.tracing import InstanceTracers

SUM = "sha256t1:" + "ab" * 32


class FakeServer:
    """A server's control endpoints; `mode`: ok | dies (the reload breaks and /health stops answering) |
    refuses (the reload breaks, the server stays up) | hung (nothing answers /health) | hangs-in-reload (the
    reload never returns and /health stops answering once it began, as a SIGSTOP mid-reload does) |
    hangs-while-draining (answers the check before the reload, then nothing, a request of its own still in
    flight: a SIGSTOP just after that check) |
    restart-stalls / restart-crashes (answers until its host restarts it: see `FakeHost`) | gone."""

    def __init__(self, instance_id: str, mode: str) -> None:
        self.instance_id = instance_id
        self.mode = mode
        self.reloaded = False
        self.reload_began = False
        self.health_checks = 0

    async def health(self, timeout_s: float = 5.0) -> bool:
        self.health_checks += 1
        if self.mode == "hangs-in-reload":
            return not self.reload_began
        if self.mode == "hangs-while-draining":
            return self.health_checks == 1
        return self.mode in ("ok", "refuses", "restart-stalls", "restart-crashes")

    async def pause(self, mode: str = "wait", timeout_s: float = 60.0) -> None:
        return None

    async def rpc(self, method: str, kwargs: dict[str, str], timeout_s: float) -> list[dict[str, Any]]:
        if self.mode in ("dies", "refuses"):
            raise InstanceFailure(f"{self.instance_id}: /collective_rpc failed: ServerDisconnectedError")
        if self.mode == "hangs-in-reload":
            self.reload_began = True
            await asyncio.sleep(3600)  # the reload timeout (900 s) is what a publish waited for before
        self.reloaded = True
        return [{"weight_version": int(kwargs["weight_version"]), "checksum": SUM, "load_s": 0.01}]

    async def reset_prefix_cache(self, timeout_s: float = 60.0) -> bool:
        return True

    async def resume(self, timeout_s: float = 60.0) -> None:
        return None


class FakeHost:
    """The host of a managed server whose restart reload fails: its new server hangs while it starts
    (restart-stalls: `ServerStalledError`) or exits loading the weights (restart-crashes: `ServerStartError`);
    either way the host stopped it, so nothing answers /health afterwards."""

    def __init__(self, server: FakeServer) -> None:
        self.server = server

    async def acall(self, method: str, *args: Any) -> Any:
        assert method == "restart", method
        mode, self.server.mode = self.server.mode, "gone"
        if mode == "restart-stalls":
            raise ServerStalledError("vLLM server for /w/1 on port 1 used no CPU for 60s while starting")
        raise ServerStartError("vLLM server for /w/1 on port 1 exited (code 1) before becoming healthy")


def spec() -> RolloutPoolSpec:
    return RolloutPoolSpec(
        model_path="/m", num_instances=2, tp_size=1, max_model_len=64, kv_cache_bytes=0, port_base=0,
        enforce_eager=True, manage_processes=False, endpoints=("http://a", "http://b"), reload_method="inplace",
        reload_strategy="parallel", max_concurrent_requests=4, seed=0, gpu_memory_utilization=0.5,
        metering=CpuMetering(cores_per_gpu=0.0, job="", cgroup_root=""),
        health=HealthRule(interval_s=0.001),  # no pause between a publish's health checks
        reload_timeout_s=40.0,  # above the 30 s a case may take: a wait the health rule misses fails it soon
    )  # fmt: skip


def publish(modes: dict[str, str], leave_out_failed: bool, failed_before: tuple[str, ...] = ()) -> tuple[
        Any, dict[str, str], int]:  # fmt: skip
    """Publish v1 to instances in `modes`; (report or the WeightSyncError, states after, pool version)."""

    async def scenario() -> tuple[Any, dict[str, str], int]:
        router = Router(max_concurrent=4, request_timeout_s=5, wait_for_instance_s=0.1)
        restart = any(mode.startswith("restart") for mode in modes.values())
        for iid, mode in modes.items():
            server = FakeServer(iid, mode)
            router.slots[iid] = InstanceSlot(id=iid, client=server, host="h", port=1,  # type: ignore[arg-type]
                                             weight_version=0, state=FAILED if iid in failed_before else READY)
            if mode == "hangs-while-draining":
                router.slots[iid].outstanding = 1  # a request its stopped server never answers
            router.slots[iid].handle = FakeHost(server) if restart else None
        current = CurrentWeights(version=0, model_path="/m", checksum=SUM)
        # a restart reload needs a manager of processes, which records the pool's weights after a publish
        manager: Any = SimpleNamespace(record=SimpleNamespace(), save=lambda: None) if restart else None
        publisher = WeightPublisher(spec(), router, manager, InstanceTracers(None), current)
        method = "restart" if restart else "inplace"
        try:
            outcome: Any = await publisher.publish(AckExpectation(1, SUM, method, "parallel"), "/w/1", None,
                                                   leave_out_failed)
        except WeightSyncError as exc:
            outcome = exc
        return outcome, {iid: s.state for iid, s in router.slots.items()}, current.version

    return asyncio.run(scenario())


CASES = {
    # name: (modes, leave_out_failed, failed before the publish, left out, states after, pool version)
    "killed-mid-reload-left-out": ({"a": "ok", "b": "dies"}, True, (), {"b"}, {"a": READY, "b": FAILED}, 1),
    "hung-before-reload-left-out": ({"a": "ok", "b": "hung"}, True, (), {"b"}, {"a": READY, "b": FAILED}, 1),
    "failed-before-left-out": ({"a": "ok", "b": "ok"}, True, ("b",), {"b"}, {"a": READY, "b": FAILED}, 1),
    "hung-mid-reload-left-out": ({"a": "ok", "b": "hangs-in-reload"}, True, (), {"b"},
                                 {"a": READY, "b": FAILED}, 1),
    "hung-while-its-requests-drain-left-out": ({"a": "ok", "b": "hangs-while-draining"}, True, (), {"b"},
                                               {"a": READY, "b": FAILED}, 1),
    "the-only-server-hung-while-its-requests-drain": ({"a": "hangs-while-draining"}, True, (), {"a"},
                                                      {"a": FAILED}, 1),
    "every-server-failed-all-left-out": ({"a": "dies", "b": "hung"}, True, (), {"a", "b"},
                                         {"a": FAILED, "b": FAILED}, 1),
    "the-only-server-killed-mid-reload": ({"a": "dies"}, True, (), {"a"}, {"a": FAILED}, 1),
    "the-only-server-failed-before": ({"a": "ok"}, True, ("a",), {"a"}, {"a": FAILED}, 1),
    "a-restart-that-hung-while-starting-left-out": ({"a": "restart-stalls"}, True, (), {"a"}, {"a": FAILED}, 1),
}
ERRORS = {
    # name: (modes, leave_out_failed, failed before, instances the error names)
    "without-leave-out-a-dead-server-fails-it": ({"a": "ok", "b": "dies"}, False, (), {"b"}),
    "a-live-server-refusing-fails-it": ({"a": "ok", "b": "refuses"}, True, (), {"b"}),
    "without-leave-out-no-server-took-the-weights": ({"a": "dies", "b": "hung"}, False, (), {"a", "b"}),
    "one-dead-one-refusing": ({"a": "dies", "b": "refuses"}, True, (), {"b"}),
    "a-restart-that-exited-loading-the-weights-fails-it": ({"a": "restart-crashes"}, True, (), {"a"}),
}


@pytest.mark.parametrize(("modes", "leave_out", "before", "left_out", "states", "version"), CASES.values(),
                         ids=CASES.keys())
def test_a_failed_server_is_left_out(modes: dict[str, str], leave_out: bool, before: tuple[str, ...],
                                     left_out: set[str], states: dict[str, str], version: int) -> None:
    began = time.monotonic()
    report, after, pool_version = publish(modes, leave_out, before)
    assert time.monotonic() - began < 30, "a hung server is failed by the health rule, not the reload timeout"
    assert not isinstance(report, WeightSyncError), report
    assert {iid for iid, _ in report.left_out} == left_out
    assert all("reload failed" in why for _, why in report.left_out)
    assert report.acks_expected == report.acks_validated == len(modes) - len(left_out)
    assert after == states and pool_version == version


@pytest.mark.parametrize(("modes", "leave_out", "before", "named"), ERRORS.values(), ids=ERRORS.keys())
def test_a_publish_still_fails(modes: dict[str, str], leave_out: bool, before: tuple[str, ...],
                               named: set[str]) -> None:
    error, _, pool_version = publish(modes, leave_out, before)
    assert isinstance(error, WeightSyncError) and set(error.failures) == named
    assert pool_version == 0, "the pool's version moves only with a validated publish"


def test_leave_out_leaves_out_everything_when_every_server_failed() -> None:
    from libra.rollout.reload import ReloadAck

    expect = AckExpectation(1, SUM, "inplace", "parallel", ["a", "b"])
    acks = [ReloadAck(iid, "h", "inplace", "parallel", 0, "", 0.0, 0.0, 0.0, 0.0, error="gone", server_failed=True)
            for iid in ("a", "b")]
    kept, kept_acks, left_out = leave_out_failed_servers(expect, acks)
    assert (kept.instance_ids, kept_acks, sorted(left_out)) == ([], [], ["a", "b"])
