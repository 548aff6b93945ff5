"""Shared cases of the training pool integration tests: tiny model builders, parity inputs, off-policy samples."""

from __future__ import annotations

import os
import random
import time
from dataclasses import replace
from typing import Any

import psutil

from libra.algo.spec import AlgorithmSpec
from libra.config.mapping import cpu_config, tiny_model_spec, training_pool_spec
from libra.config.sections import TinyModelConfig
from libra.models.tiny import TinyModelSpec, build_tokenizer, vocabulary
from libra.training.spec import TrainingPoolSpec, TrainSample

# The shape of the tests' tiny models (hidden 64: about 0.2M parameters).
TEST_SHAPE: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, max_position_embeddings=512)


def tiny_spec(**changes: Any) -> TinyModelSpec:
    """A tiny model of the tests' shape (`build_tiny_model` options, plus `tie_word_embeddings`)."""
    tied = bool(changes.pop("tie_word_embeddings", False))
    return replace(tiny_model_spec(TinyModelConfig(**{**TEST_SHAPE, **changes})), tie_word_embeddings=tied)


def pool_spec(model_path: str, num_gpus: int, config: dict[str, Any] | None = None,
              **spec_changes: Any) -> TrainingPoolSpec:
    """The training spec of a CPU job configuration with `config` option changes, then `spec_changes`
    (layout, batch sizes, retention, trace) applied to the spec."""
    spec = training_pool_spec(cpu_config(model_path, **(config or {})), num_gpus)
    return replace(spec, **spec_changes)

PARITY_IDS = [[5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42, 43, 44, 45, 46, 47]]


def build_tiny_qwen3_moe(out_dir: str) -> str:
    """A 2-layer Qwen3-MoE (4 experts, top 2) with random weights and the tiny word-level tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    if os.path.isfile(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    config = Qwen3MoeConfig(  # type: ignore[call-arg]
        vocab_size=len(vocabulary()), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=512, initializer_range=0.2, norm_topk_prob=True, rms_norm_eps=1e-6,
        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False, dtype="float32",
    )
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out_dir)
    build_tokenizer(out_dir)
    return out_dir


def offpolicy_samples(seed: int, n: int = 4) -> list[TrainSample]:
    """Random samples whose rollout log-probs are not the model's, so the PPO ratio is not 1 and the loss
    depends on the weights."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        response = [rng.randrange(4, 200) for _ in range(rng.randrange(2, 6))]
        out.append(
            TrainSample(
                prompt_ids=[rng.randrange(4, 200) for _ in range(rng.randrange(3, 7))],
                response_ids=response,
                rollout_logprobs=[rng.uniform(-7.0, -4.0) for _ in response],
                advantage=rng.uniform(-1.0, 1.0),
                policy_version=0,
                reward=0.0,
            )
        )
    return out


def hf_reference_step(model_dir: str, samples: list[TrainSample], spec: AlgorithmSpec) -> tuple[float, float]:
    """The GRPO loss and gradient norm of `samples` computed with the HF transformers model (single process,
    old log-probs = rollout log-probs): what the first Megatron step must report."""
    import torch
    from transformers import AutoModelForCausalLM

    from libra.algo.grpo import LossInputs, grpo_loss
    from libra.training import batching

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = batching.pack(samples, len(samples), batching.step_seq_len(samples))
    logits = model(batch.tokens).logits
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, batch.labels.unsqueeze(-1)).squeeze(-1)
    inputs = LossInputs(
        logp=logp, old_logp=batch.rollout_logp, rollout_logp=batch.rollout_logp, advantages=batch.advantages,
        mask=batch.mask,
    )
    loss = grpo_loss(inputs, spec)
    loss.backward()
    squares = [(p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None]
    grad_norm = torch.stack(squares).sum().sqrt()
    return float(loss.detach()), float(grad_norm)


def still_running(pids: list[int], wait_s: float = 30.0) -> list[int]:
    """The pids of `pids` still running (not gone, not a zombie) after up to `wait_s` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = [p for p in pids if _running(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
