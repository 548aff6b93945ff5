"""The model a training pool builds: a model directory's `config.json`, parsed by the one parser
(`planner.model_spec`) and refused when the HF <-> Megatron-Core conversion cannot reproduce it exactly.

Which model types and features training supports is `planner.architectures` (the list validation and the
planner read too); this module only applies it before anything is built, and pads the vocabulary for TP.
"""

from __future__ import annotations

import os
from typing import Any

from planner.architectures import training_gaps
from planner.model_spec import ModelSpec, ModelSpecError, load_model_spec, model_spec_from_dict


class UnsupportedArchitectureError(ValueError):
    """The HF config describes a model the Megatron conversion does not reproduce exactly."""


def trainable(spec: ModelSpec, source: str) -> ModelSpec:
    """`spec` itself, or the error naming every feature of it training cannot reproduce."""
    gaps = training_gaps(spec)
    if gaps:
        raise UnsupportedArchitectureError(f"{source}: " + "; ".join(gaps))
    return spec


def training_spec_from_config(cfg: dict[str, Any], source: str = "config.json") -> ModelSpec:
    """The `ModelSpec` of parsed `config.json` contents, checked for training."""
    return trainable(model_spec_from_dict(cfg, source=source), source)


def read_training_model(model_path: str) -> ModelSpec:
    """Read `<model_path>/config.json` and check that training can build it."""
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model_path '{model_path}' has no config.json; point it at an HF model directory")
    try:
        spec = load_model_spec(path)
    except ModelSpecError as exc:
        raise UnsupportedArchitectureError(str(exc)) from exc
    return trainable(spec, path)


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Smallest multiple of `tp` >= `vocab_size`: the vocab-parallel embedding needs equal shards.

    The padded rows are zero in the embedding and the output layer and are masked out of every softmax,
    so log-probs equal those of the unpadded HF model.
    """
    return -(-vocab_size // tp) * tp
