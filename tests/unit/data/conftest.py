"""Fixtures for the data tests: the tiny models' word-level tokenizer, built once per session."""

from __future__ import annotations

from typing import Any

import pytest

from libra.models.tiny import build_tokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    out = str(tmp_path_factory.mktemp("tiny-tokenizer"))
    build_tokenizer(out)
    return AutoTokenizer.from_pretrained(out)


@pytest.fixture(autouse=True)
def _registries_restored() -> Any:
    """Tasks and rewards a test registers are removed after it, so later tests see the built-in registry."""
    from libra.data import registry

    registry.task_names()  # built-ins loaded before the snapshot
    tasks, rewards = dict(registry._TASKS), dict(registry._REWARDS)
    yield
    registry._TASKS.clear()
    registry._TASKS.update(tasks)
    registry._REWARDS.clear()
    registry._REWARDS.update(rewards)
