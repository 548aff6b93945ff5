"""The learnability benchmark's GRPO mirror: padded log-probs, a short run, and recommended config values."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
import typing
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from libra.config import Config
from libra.config.mapping import tiny_model_spec
from libra.config.sections import TinyModelConfig
from libra.models.tiny import build_tiny_model

BENCHMARK = Path(__file__).resolve().parents[3] / "benchmarks" / "learnability.py"


@pytest.fixture(scope="module")
def learnability() -> ModuleType:
    spec = importlib.util.spec_from_file_location("learnability_benchmark", BENCHMARK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoModelForCausalLM

    out = build_tiny_model(str(tmp_path_factory.mktemp("sim-model")), tiny_model_spec(TinyModelConfig(
        hidden_size=64, intermediate_size=128, max_position_embeddings=512, init_std=0.2, seed=1)))
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


def test_padded_logprobs_equal_unpadded_ones(learnability: ModuleType, tiny_model: Any) -> None:
    """Left padding with explicit positions gives every row the log-probs of its own unpadded sequence."""
    prompts = [[10, 204, 11, 208, 9, 207], [5, 6, 212], [7]]
    responses = [[3], [4, 8, 2], [9, 9]]
    logp, entropy, mask = learnability.response_logprobs(tiny_model, prompts, responses, pad_id=0)
    assert mask.tolist() == [[1, 0, 0], [1, 1, 1], [1, 1, 0]]
    for row, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        with torch.no_grad():
            logits = tiny_model(input_ids=torch.tensor([prompt + response])).logits[0].float()
        all_logp = torch.log_softmax(logits, dim=-1)
        for k, token in enumerate(response):
            position = len(prompt) + k - 1
            assert logp[row, k].item() == pytest.approx(all_logp[position, token].item(), abs=1e-4)
            expected_entropy = -(all_logp[position].exp() * all_logp[position]).sum().item()
            assert entropy[row, k].item() == pytest.approx(expected_entropy, abs=1e-4)


def test_sampling_respects_the_token_limit(learnability: ModuleType, tiny_model: Any) -> None:
    torch.manual_seed(0)
    responses = learnability.sample(tiny_model, [[10, 11, 12]] * 16, 3, 1.0, eos_id=2, pad_id=0)
    assert all(1 <= len(r) <= 3 for r in responses)
    assert all(2 not in r[:-1] for r in responses)  # nothing after an EOS


def test_short_run_records_a_curve(learnability: ModuleType, tmp_path: Path) -> None:
    setting = dataclasses.replace(learnability.CANDIDATES["copy_first_bs32"], batch_size=2, n_samples=4)
    result = learnability.run(setting, seed=0, max_steps=6, work_dir=str(tmp_path))
    assert result["steps_run"] == len(result["reward_curve"]) == len(result["entropy_curve"]) == 6
    assert all(0.0 <= r <= 1.0 for r in result["reward_curve"])
    assert result["initial_reward"] < 0.5  # a random model is far from the target
    assert 0.0 <= result["heldout_greedy_accuracy"] <= 1.0


@pytest.mark.parametrize(
    ("worst_steps", "total_steps"),
    [
        pytest.param(66, 200, id="66"),
        pytest.param(50, 150, id="50"),
        pytest.param(101, 300, id="101"),
        pytest.param(10, 50, id="at-least-50"),
    ],
)
def test_recommendation_uses_real_config_keys(
    learnability: ModuleType, worst_steps: int, total_steps: int
) -> None:
    setting = learnability.CANDIDATES["copy_first_bs32"]
    recommended = learnability.recommend_dev_yaml(setting, worst_steps)
    assert recommended["total_steps"] == total_steps
    hints = typing.get_type_hints(Config)
    for key, value in recommended.items():
        assert key in hints, key
        if isinstance(value, dict) and dataclasses.is_dataclass(hints[key]):
            section_fields = {f.name for f in dataclasses.fields(hints[key])}
            assert set(value) <= section_fields, (key, set(value) - section_fields)
    assert recommended["optimizer"]["lr_decay_style"] == "constant"


def test_benchmark_file_exists() -> None:
    assert os.path.isfile(BENCHMARK)
