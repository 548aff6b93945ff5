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
