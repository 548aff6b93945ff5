"""Fixtures of the training pool integration tests: tiny models of every supported family and a pool factory
that always shuts its pools down."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
from training_cases import build_tiny_qwen3_moe, tiny_spec

from libra.cluster.ray_runtime import RayRuntime
from libra.models.tiny import build_tiny_model
from libra.training.pool import TrainingPool
from libra.training.spec import TrainingPoolSpec


@pytest.fixture(scope="session")
def training_models(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str) -> dict[str, str]:
    root = str(tmp_path_factory.mktemp("training-models"))
    return {
        "llama": tiny_model_dir,
        "qwen2": build_tiny_model(os.path.join(root, "qwen2"), tiny_spec(arch="qwen2", init_std=0.2)),
        "qwen3": build_tiny_model(  # tied: the output layer on the last PP stage shares the embedding
            os.path.join(root, "qwen3"), tiny_spec(arch="qwen3", init_std=0.2, tie_word_embeddings=True)
        ),
        "llama4": build_tiny_model(
            os.path.join(root, "llama4"), tiny_spec(arch="llama", num_layers=4, init_std=0.2, seed=1)
        ),
        "qwen3_moe": build_tiny_qwen3_moe(os.path.join(root, "qwen3_moe")),
    }


@pytest.fixture
def start_pool(ray_runtime: RayRuntime) -> Iterator[Callable[[TrainingPoolSpec], TrainingPool]]:
    """Start pools on the shared Ray cluster; every pool started here is shut down afterwards."""
    pools: list[TrainingPool] = []

    def start(spec: TrainingPoolSpec) -> TrainingPool:
        pool = TrainingPool(ray_runtime, spec, name=f"test-train-{len(pools)}")
        pools.append(pool)
        pool.start()
        return pool

    try:
        yield start
    finally:
        for pool in pools:
            pool.shutdown()
