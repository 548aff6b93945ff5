"""Session-scoped expensive fixtures for integration tests: one local Ray cluster with logical GPUs and
one tiny HF model directory, shared by every integration test and always torn down."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from libra.cluster.ray_runtime import RayRuntime
from libra.config.mapping import tiny_model_spec
from libra.config.sections import TinyModelConfig
from libra.models.tiny import build_tiny_model

LOGICAL_GPUS = 8


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that start a Ray cluster in the pytest process (marker `own_ray`) run first, before any test
    connects the process to the session's cluster (`ray_runtime`): a process is connected to one cluster at a
    time. The order is otherwise kept."""
    items.sort(key=lambda item: item.get_closest_marker("own_ray") is None)


@pytest.fixture(scope="session")
def ray_runtime() -> Iterator[RayRuntime]:
    """A local Ray cluster with 8 logical GPUs in its own temp dir, stopped at the end of the session."""
    tmp = tempfile.mkdtemp(prefix="libra-test-ray-")
    runtime = RayRuntime.start(num_gpus=LOGICAL_GPUS, num_cpus=16, tmp_dir=tmp, namespace="libra-tests")
    try:
        yield runtime
    finally:
        runtime.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama-architecture model + word-level tokenizer in HF format."""
    out = str(tmp_path_factory.mktemp("tiny-model"))
    return build_tiny_model(os.path.join(out, "llama"), tiny_model_spec(TinyModelConfig(
        arch="llama", hidden_size=64, intermediate_size=128, max_position_embeddings=512, init_std=0.2, seed=0)))
