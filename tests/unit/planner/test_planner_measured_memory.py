"""The memory model against real transformers code under fake tensors (small shapes; the benchmark runs the
real ones): every phase within 2% of the measured peak."""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)

from benchmarks import memory_accuracy as bench  # noqa: E402
from planner.model_spec import model_spec_from_dict  # noqa: E402

DENSE = {"model_type": "qwen2", "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2,
         "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 8192, "tie_word_embeddings": False}
MOE = {"model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 768, "moe_intermediate_size": 128,
       "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
       "num_experts": 16, "num_experts_per_tok": 4, "vocab_size": 8192}

CASES = {
    "dense-eager-tp2-full-recompute": bench.Case("dense", model_spec_from_dict(DENSE), tp=2, seq_len=256,
                                                 attention="eager", recompute="full", recompute_micro_batch=2),
    "moe-sdpa-two-micro-batches": bench.Case("moe", model_spec_from_dict(MOE), tp=1, seq_len=256, micro_batch=2),
}


@pytest.mark.parametrize("name", CASES, ids=list(CASES))
def test_estimate_matches_measured_peak(name: str) -> None:
    row = bench.compare(CASES[name])
    assert abs(row["rel_error"]) < 0.02, row
    for term in row["terms"]:
        assert abs(term["error_of_peak"]) < 0.02, term
    exact = {t["term"]: t for t in row["terms"]}
    for static in ("weights", "gradients"):
        assert exact[static]["estimated_bytes"] == exact[static]["measured_bytes"]
