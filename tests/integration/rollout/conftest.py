"""Fixtures of the rollout pool integration tests: two tiny models of one shape (the weights a reload swaps).

vLLM-CPU's attention kernels need a head dimension of at least 32, so these models use 2 heads of 32
(hidden 64); the shared `tiny_model_dir` (4 heads of 16) loads but fails at its first generation.
"""

from __future__ import annotations

import os

import pytest

from libra.config.mapping import tiny_model_spec
from libra.config.sections import TinyModelConfig
from libra.models.tiny import TinyModelSpec, build_tiny_model
from libra.rollout.weights_checksum import checksum_hf_weights


def rollout_model_spec(seed: int) -> TinyModelSpec:
    return tiny_model_spec(TinyModelConfig(arch="llama", hidden_size=64, num_heads=2, num_kv_heads=1,
                                           intermediate_size=128, max_position_embeddings=512, init_std=0.2,
                                           seed=seed))


@pytest.fixture(scope="session")
def rollout_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    """{"a": (dir, checksum), "b": (dir, checksum)}: same architecture and shape, different random weights."""
    root = tmp_path_factory.mktemp("rollout-models")
    models = {}
    for name, seed in (("a", 0), ("b", 1)):
        path = build_tiny_model(os.path.join(root, name), rollout_model_spec(seed))
        models[name] = (path, checksum_hf_weights(path))
    return models
