"""Every supported model family on real Megatron-Core: logits equal the HF model's, the first GRPO step's loss
and gradient norm equal those computed with the HF model, and exporting the untouched weights reproduces the
original checkpoint bit for bit (same checksum)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from training_cases import PARITY_IDS, hf_reference_step, offpolicy_samples, pool_spec

from libra.rollout.weights_checksum import checksum_hf_weights

CASES = {
    "qwen2-tp2-qkv-bias": ("qwen2", dict(num_gpus=2, tp=2)),
    "qwen3-pp2-qk-norm-tied-embeddings": ("qwen3", dict(num_gpus=2, pp=2)),
    "qwen3-moe-ep2": ("qwen3_moe", dict(num_gpus=2, ep=2)),
    "llama-pp2-vpp2": ("llama4", dict(num_gpus=2, pp=2, vpp=2, micro_batch_size=1)),
}


@pytest.mark.parametrize("model,layout", CASES.values(), ids=CASES.keys())
def test_model_family(
    start_pool: Any, training_models: dict[str, str], tmp_path: Any, model: str, layout: dict[str, int]
) -> None:
    from transformers import AutoModelForCausalLM

    path = training_models[model]
    spec = pool_spec(path, config={"optimizer": {"lr": 1e-3, "weight_decay": 0.01}}, recompute_logprobs=False,
                     **layout)
    pool = start_pool(spec)
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(torch.tensor(PARITY_IDS)).logits
    assert np.abs(np.array(pool.forward_logits(PARITY_IDS)) - expected.numpy()).max() < 1e-4

    assert pool.export_hf(str(tmp_path / "export")) == checksum_hf_weights(path)

    samples = offpolicy_samples(3)
    hf_loss, hf_grad_norm = hf_reference_step(path, samples, spec.algorithm)
    metrics = pool.train_step(samples, 1)
    assert abs(metrics["loss"] - hf_loss) < 1e-5
    assert metrics["grad_norm"] == pytest.approx(hf_grad_norm, rel=1e-4)
