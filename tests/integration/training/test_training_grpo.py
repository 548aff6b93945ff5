"""A training pool on Ray end to end: GRPO steps on a toy reward raise the rewarded token's probability (with
log-prob recomputation, reference KL, entropy bonus and IS correction all on), then export to HF (reloaded
by transformers, same checksum), checkpoint, resume and shut down; its rank's phase trace records each of
these phases."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from training_cases import PARITY_IDS, pool_spec

from libra.algo.advantages import compute_advantages
from libra.models.tiny import vocabulary
from libra.observability.phase_trace import TraceSettings
from libra.observability.trace_schema import iter_trace
from libra.rollout.weights_checksum import checksum_hf_weights
from libra.training.checkpoint import LATEST
from libra.training.spec import TrainSample

VOCAB = {tok: i for i, tok in enumerate(vocabulary())}
PROMPTS = [[VOCAB[w] for w in ("what", "is", "3", "+", "4", "?")], [VOCAB[w] for w in ("question", "7", "?")]]
REWARDED = VOCAB["7"]
OTHERS = [VOCAB["8"], VOCAB["9"], VOCAB["12"]]
STEPS = 5


def toy_batch(pool: Any) -> tuple[list[TrainSample], float]:
    """One group per prompt: the rewarded token and three others, with on-policy rollout log-probs; returns the
    samples and the policy's mean probability of the rewarded token (its expected reward)."""
    samples = []
    for prompt in PROMPTS:
        for token in (REWARDED, *OTHERS):
            samples.append(TrainSample(prompt, [token], [0.0], 0.0, 0, float(token == REWARDED)))
    logprobs = pool.compute_logprobs(samples)
    advantages = compute_advantages([s.reward for s in samples], 4, "group_zscore")
    for s, lp, adv in zip(samples, logprobs, advantages, strict=True):
        s.rollout_logprobs, s.advantage = lp, adv
    expected_reward = float(np.mean([math.exp(lp[0]) for s, lp in zip(samples, logprobs, strict=True) if s.reward]))
    return samples, expected_reward


def test_grpo_pool_end_to_end(start_pool: Any, training_models: dict[str, str], tmp_path: Any) -> None:
    algorithm = {
        "entropy_coef": 0.001,
        "clip_ratio_c": 10.0,
        "ref_kl": {"enable": True, "coef": 0.01, "kl_type": "k3"},
        "is_correction": {"enable": True, "action": "clip", "level": "token"},
    }
    traces = tmp_path / "traces"
    spec = pool_spec(
        training_models["llama"], 1, config={"algorithm": algorithm, "optimizer": {"lr": 5e-3, "weight_decay": 0.01}},
        micro_batch_size=2, recompute_micro_batch_size=4, recompute_logprobs=True,
        trace=TraceSettings(True, str(traces)),
    )
    pool = start_pool(spec)
    samples, first_reward = toy_batch(pool)
    initial = pool.compute_logprobs(samples)
    rewards, history = [first_reward], []
    for step in range(1, STEPS + 1):
        metrics = pool.train_step(samples, step)
        history.append(metrics)
        samples, reward = toy_batch(pool)
        rewards.append(reward)

    assert rewards[-1] > rewards[0] + 0.1, rewards
    assert sum(b > a for a, b in zip(rewards, rewards[1:], strict=False)) >= STEPS - 1, rewards
    first, last = history[0], history[-1]
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy starts at the reference
    assert last["kl"] > 0.0
    assert all(m["logprob_gap"] < 1e-4 for m in history)  # rollout log-probs were on-policy
    assert all(m["is_kept_frac"] == 1.0 and m["tokens"] == 8 for m in history)
    assert all(m["entropy"] > 0 and m["grad_norm"] > 0 and 0 <= m["clip_frac"] <= 1 for m in history)
    assert np.allclose(pool.compute_logprobs(samples, reference=True), initial, atol=1e-6)

    out = str(tmp_path / "hf")
    checksum = pool.export_hf(out)
    assert checksum == checksum_hf_weights(out) != checksum_hf_weights(training_models["llama"])
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= set(os.listdir(out))
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(torch.tensor(PARITY_IDS)).logits
    assert np.abs(np.array(pool.forward_logits(PARITY_IDS)) - reloaded.numpy()).max() < 1e-4

    ckpt = pool.save_checkpoint(str(tmp_path / "ckpt"), STEPS)
    assert os.path.isfile(os.path.join(os.path.dirname(ckpt), LATEST))
    # the save's writers were forked and joined, and its results passed within the worker: no helper process
    # (Megatron-Core's own results queue would live in a spawned manager process)
    (worker,) = pool.worker_pids()
    assert psutil.Process(worker).children(recursive=True) == []
    assert pool.load_checkpoint(str(tmp_path / "ckpt")) == STEPS
    probe = pool.recompute_probe(32)
    assert probe["micro_batch_size"] == 4 and probe["added_peak_bytes"] > 4 * 32 * len(VOCAB) * 4

    pool.shutdown()
    with pytest.raises(RuntimeError, match="not started"):
        pool.train_step(samples, STEPS + 1)
    assert_rank_trace(traces)


def assert_rank_trace(traces: Path) -> None:
    """The one rank wrote phase_trace_rank1000.jsonl (flushed by shutdown): every phase of every step, the
    export and the checkpoint I/O, each with its step."""
    assert [p.name for p in traces.iterdir()] == ["phase_trace_rank1000.jsonl"]
    stats, records = iter_trace(traces)
    steps: dict[str, list[int | None]] = {}
    for record in records:
        assert (record["role"], record["rank"]) == ("train", 1000)
        steps.setdefault(record["name"], []).append(record["step"])
    assert stats[0].skipped == 0
    every_step = list(range(1, STEPS + 1))
    assert steps == {
        "train.step": every_step,
        "train.recompute_logprobs": sorted(every_step * 2),  # the policy's and the reference's
        "train.forward_backward": every_step,
        "train.optimizer": every_step,
        "weight_sync.export": [STEPS],
        "checkpoint.save": [STEPS],
        "checkpoint.load": [STEPS],
    }
