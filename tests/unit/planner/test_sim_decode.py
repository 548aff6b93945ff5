"""Continuous-batching decode: the exact per-request run (a hand-computed case, the KV-cache limit capping
concurrency, preemption) and the aggregate the simulator uses, checked against the exact run."""

from __future__ import annotations

import numpy as np
import pytest

from planner.sim.decode import (
    exact_instance_run,
    instance_generation,
    slots,
    streaming_slots,
    streaming_window,
)


def test_tiny_run_matches_hand_computation() -> None:
    # slots 2: step 1 runs r0 (3 tokens) and r1 (1); r1 ends, r2 (2) joins; steps 2-3 run r0 and r2; 3 steps
    run = exact_instance_run([3, 1, 2], prompt=1, max_seqs=2, kv_tokens=1000, step_s=lambda b: 1.0 + b)
    assert (run.steps, run.seconds, run.max_running, run.preemptions) == (3, 9.0, 2, 0)


@pytest.mark.parametrize("kv_tokens, prompt, cap", [
    pytest.param(10_000, 10, 64, id="slots-bound"),
    pytest.param(40 * 11, 10, 40, id="kv-bound-40"),
    pytest.param(12 * 11, 10, 12, id="kv-bound-12"),
])
def test_kv_cache_limit_caps_concurrency(kv_tokens: int, prompt: int, cap: int) -> None:
    run = exact_instance_run([50] * 200, prompt=prompt, max_seqs=64, kv_tokens=kv_tokens, step_s=lambda b: 1.0)
    assert run.max_running <= cap
    assert run.max_running >= min(cap, 64) // 2  # the cache is used, not left empty


def test_kv_overflow_preempts_and_recomputes() -> None:
    tight = exact_instance_run([40] * 20, prompt=10, max_seqs=20, kv_tokens=300, step_s=lambda b: 1.0)
    roomy = exact_instance_run([40] * 20, prompt=10, max_seqs=20, kv_tokens=10_000, step_s=lambda b: 1.0)
    assert tight.preemptions > 0 and roomy.preemptions == 0
    assert tight.steps > roomy.steps


@pytest.mark.parametrize("kv_tokens, lbm, requests, expected", [
    pytest.param(1e9, 100.0, 1000, 256, id="vllm-cap"),
    pytest.param(1e9, 100.0, 10, 10, id="few-requests"),
    pytest.param(60 * 150.0, 200.0, 1000, 60, id="kv-cap"),  # live context 50 + 200/2 = 150 tokens
    pytest.param(100.0, 200.0, 1000, 1, id="at-least-one"),
])
def test_slots(kv_tokens: float, lbm: float, requests: int, expected: int) -> None:
    assert slots(256, kv_tokens, 50.0, lbm, requests) == expected


CASES = [(n, c, mean, sigma) for n, c, mean, sigma in
         [(200, 16, 100, 0.8), (400, 32, 200, 0.5), (1000, 64, 80, 1.0), (600, 64, 150, 0.8), (500, 16, 300, 0.8)]]


def test_aggregate_decode_is_close_to_the_exact_run() -> None:
    rng = np.random.default_rng(1)
    errors = []
    for n, c, mean, sigma in CASES:
        for _ in range(2):
            lengths = np.clip(np.rint(rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, n)), 1, 2000).astype(int)
            exact = exact_instance_run(lengths.tolist(), 20, c, 10**9, lambda b: 1.0)
            lbm = float((lengths**2).sum() / lengths.sum())
            agg = instance_generation(n, float(lengths.sum()), float(lengths.max()), lbm,
                                      slots(c, 10**9, 20, lbm, n), lambda b: 1.0)
            errors.append((agg.bulk_steps + agg.drain_steps) / exact.steps - 1.0)
    assert max(abs(e) for e in errors) < 0.25, errors
    assert abs(float(np.mean(errors))) < 0.08, errors


def test_all_requests_fit_means_the_longest_decides() -> None:
    run = instance_generation(8, 8 * 50.0, 120.0, 80.0, 16, lambda b: 0.001 * b)
    assert (run.bulk_steps, run.drain_steps) == (0.0, 120.0)
    # every step runs the requests not yet finished: 400 sequence-steps over 120 steps
    assert (run.drain_batch, run.drain_s) == (pytest.approx(400.0 / 120.0), pytest.approx(0.4))


def test_streaming_conserves_work() -> None:
    run = instance_generation(20, 10_000.0, 500.0, 300.0, 50, lambda b: 0.0004 * b, streaming=True)
    # the step's work at the full-batch rate is bulk + the residual the next step overlaps
    assert run.bulk_s + run.drain_work_s == pytest.approx(10_000 / 50 * 0.02)
    assert run.drain_steps >= 500.0 - run.bulk_steps


@pytest.mark.parametrize("lengths", [
    pytest.param([48] * 24, id="equal-lengths"),
    pytest.param([5, 17, 48, 3, 30, 30, 12], id="mixed"),
    pytest.param(np.clip(np.rint(np.random.default_rng(3).lognormal(4.0, 0.8, 60)), 1, 1000).astype(int).tolist(),
                 id="log-normal"),
])
def test_when_every_request_fits_the_drain_is_exact_for_an_affine_step(lengths: list[int]) -> None:
    fixed, per_seq = 0.02, 0.001
    exact = exact_instance_run(lengths, prompt=10, max_seqs=256, kv_tokens=10**9, step_s=lambda b: fixed + per_seq * b)
    n, total, longest = len(lengths), float(sum(lengths)), float(max(lengths))
    run = instance_generation(n, total, longest, total / n, n, lambda b: fixed + per_seq * b)
    assert run.drain_batch == pytest.approx(total / longest)
    assert run.bulk_s + run.drain_s == pytest.approx(exact.seconds, rel=1e-12)


@pytest.mark.parametrize("requests, total, slot_count, expected", [
    pytest.param(8, 400.0, 16, 400.0 / 120.0, id="all-fit-tokens-over-longest"),
    # queued: r = 30, T / C = 250, bulk 220 steps, drain max(120, 250 + 45) - 220 = 75 steps, 4000 - 220 x 16
    # = 480 tokens left
    pytest.param(100, 4000.0, 16, 480.0 / 75.0, id="queued-tokens-left-over-drain-steps"),
    pytest.param(100, 4000.0, 1, 1.0, id="one-slot"),
])
def test_drain_batch(requests: int, total: float, slot_count: int, expected: float) -> None:
    assert instance_generation(requests, total, 120.0, 60.0, slot_count, lambda b: 1.0).drain_batch == pytest.approx(
        expected)


def test_a_queued_batch_takes_the_exact_runs_seconds_for_an_affine_step() -> None:
    # the drain's long tail runs the few requests left: priced at a half-full batch, a step cost that grows
    # with the batch made the run up to about 25% too long on these cases
    rng = np.random.default_rng(1)
    errors = []
    for n, c, mean, sigma in CASES:
        for fixed, per_seq in ((0.02, 0.0005), (0.005, 0.001), (0.03, 0.0001)):
            lengths = np.clip(np.rint(rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, n)), 1, 2000).astype(int)
            exact = exact_instance_run(lengths.tolist(), 20, c, 10**9,
                                       lambda b, fixed=fixed, per_seq=per_seq: fixed + per_seq * b)
            total, longest = float(lengths.sum()), float(lengths.max())
            lbm = float((lengths**2).sum()) / total
            slot_count = slots(c, 10**9, 20, lbm, n)
            run = instance_generation(n, total, longest, lbm, slot_count,
                                      lambda b, fixed=fixed, per_seq=per_seq: fixed + per_seq * b)
            errors.append((run.bulk_s + run.drain_s) / exact.seconds - 1.0)
    assert max(abs(e) for e in errors) < 0.12, errors
    assert float(np.mean(np.abs(errors))) < 0.06, errors


@pytest.mark.parametrize("requests, lag, fill, expected", [
    pytest.param(100, 1, 1.0, 150.0, id="lag-1-half-a-batch-waits"),
    pytest.param(100, 2, 0.5, 125.0, id="lag-2-groups-half-running"),
    pytest.param(1, 1, 0.1, 1.0, id="at-least-one"),
])
def test_streaming_window(requests: int, lag: int, fill: float, expected: float) -> None:
    assert streaming_window(requests, lag, fill) == pytest.approx(expected)


@pytest.mark.parametrize("requests, fill, share, expected", [
    pytest.param(512, 0.5, 0.0, 256, id="no-training-share-is-the-window-rule"),
    pytest.param(512, 0.5, 0.5, 192, id="window-binds-while-training"),  # 512 x 1/2 x 1/2 = 128, then 256
    pytest.param(512, 0.5, 1.0, 128, id="always-training"),
    pytest.param(2048, 0.5, 0.5, 256, id="cap-binds-in-both-phases"),
])
def test_streaming_slots(requests: int, fill: float, share: float, expected: int) -> None:
    assert streaming_slots(256, 1e9, 50.0, 200.0, requests, 1, fill, share) == expected
