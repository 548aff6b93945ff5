"""Memory-model accuracy: run real transformers model code through one RL training step and compare the
measured peak, term by term, with the planner's estimate.

Each case builds a model from its architecture (no weights are downloaded) at the shapes one tensor-parallel
rank holds (attention heads, KV heads, MLP width and vocabulary divided by TP; sequence parallelism is not
simulated, so the planner runs with ``sequence_parallel=False``) and runs, under ``FakeTensorMode`` (real
code, real shapes, nothing allocated) with ``MemTracker`` counting live tensor storage:

1. a warm-up optimizer step (creates the Adam state, outside the measurement);
2. the log-prob recomputation: forward without autograd in micro-batches of ``recompute_micro_batch``,
   bf16 logits -> fp32 log-softmax -> gather;
3. training: forward, GRPO-style clipped loss on the token log-probs, backward, for every micro-batch;
   gradients are accumulated into fp32 main-gradient buffers by a post-accumulate hook (as Megatron's DDP);
4. the optimizer step: fused AdamW on fp32 main parameters, copied back into the bf16 model.

Mixed precision mirrors Megatron-Core: bf16 weights, fp32 main gradients, fp32 main parameters and moments.
Writes ``{"cases": [{"model", "implementation": "hf", "tp", "estimated_bytes", "measured_bytes", "rel_error",
"terms": ...}]}``, keeping the Megatron-Core cases `benchmarks/memory_accuracy_megatron.py` wrote to the file.

Usage: python benchmarks/memory_accuracy.py --out benchmarks/results/memory_accuracy.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.distributed._tools.mem_tracker import MemTracker  # noqa: E402

from planner.hardware import GPUSpec  # noqa: E402
from planner.layout import TrainLayout  # noqa: E402
from planner.memory import MemoryEstimate, train_memory  # noqa: E402
from planner.model_spec import ModelSpec, load_model_spec, model_spec_from_dict  # noqa: E402
from planner.workload import (  # noqa: E402
    AttentionBackend,
    ClusterSpec,
    MemoryBudget,
    PlannerInputs,
    RecomputeGranularity,
    TrainOptions,
    Workload,
)

MODELS_DIR = os.path.join(ROOT, "configs", "models")
LOGITS_DTYPE_BYTES = 4  # log-probs are computed in fp32
# Recompute peak of this benchmark's transformers log-prob code: bf16 logits (2 B) + fp32 copy (4 B) + fp32
# log-softmax (4 B) = 2.5 x 4 B per vocab entry. The configuration default (3.0) is the Megatron path's
# (libra.training.logprobs), measured by benchmarks/memory_accuracy_megatron.py.
WORKSPACE_FACTOR = 2.5

SMALL_DENSE = {  # a 0.5B-class dense shape with tied embeddings (Qwen2.5-0.5B architecture facts)
    "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
    "max_position_embeddings": 32768,
}

LLAMA_8B = {  # Llama-3.1-8B architecture facts (no attention bias, GQA 32/8, vocabulary 128256)
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
    "max_position_embeddings": 131072,
}


@dataclass(frozen=True)
class Case:
    name: str
    spec: ModelSpec
    tp: int
    seq_len: int
    micro_batch: int = 1
    micro_batches: int = 2
    recompute_micro_batch: int = 1
    attention: AttentionBackend = "flash"  # "flash" -> transformers sdpa, "eager" -> eager attention
    recompute: RecomputeGranularity = "none"  # "full" -> transformers gradient checkpointing of every layer


def reduced(spec: ModelSpec, layers: int) -> ModelSpec:
    from dataclasses import replace

    return replace(spec, num_layers=layers, name=f"{spec.name} ({layers} layers)")


def cases() -> list[Case]:
    small = model_spec_from_dict(SMALL_DENSE, name="dense-0.5b")
    q7 = reduced(load_model_spec(os.path.join(MODELS_DIR, "qwen2.5-7b")), 4)
    q32 = reduced(load_model_spec(os.path.join(MODELS_DIR, "qwen2.5-32b")), 4)
    moe = reduced(load_model_spec(os.path.join(MODELS_DIR, "qwen3-30b-a3b")), 4)
    llama8b = reduced(model_spec_from_dict(LLAMA_8B, name="llama-3.1-8b"), 4)
    return [
        Case("dense-0.5b", small, tp=1, seq_len=2048, micro_batch=2),
        Case("dense-0.5b-eager", small, tp=1, seq_len=1024, attention="eager"),
        Case("qwen2.5-7b", q7, tp=1, seq_len=4096),
        Case("qwen2.5-7b", q7, tp=4, seq_len=4096, recompute_micro_batch=2),
        Case("qwen2.5-7b-full-recompute", q7, tp=2, seq_len=8192, recompute="full"),
        Case("qwen2.5-32b", q32, tp=8, seq_len=4096),
        Case("llama-3.1-8b", llama8b, tp=2, seq_len=8192),
        Case("qwen3-30b-a3b", moe, tp=1, seq_len=2048),
        Case("qwen3-30b-a3b", moe, tp=2, seq_len=4096),
    ]


# ------------------------------------------------------------------------------------------ the model
def hf_config(spec: ModelSpec, tp: int, attention: str) -> Any:
    """transformers config of one TP rank's shard of `spec`."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3MoeConfig

    common: dict[str, Any] = dict(
        hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads // tp, num_key_value_heads=spec.num_kv_heads // tp,
        head_dim=spec.head_dim, vocab_size=spec.vocab_size // tp, tie_word_embeddings=spec.tie_word_embeddings,
        max_position_embeddings=max(spec.max_position_embeddings, 1), use_cache=False,
    )
    cfg: Any
    if spec.is_moe:
        cfg = Qwen3MoeConfig(intermediate_size=spec.intermediate_size // tp,
                             moe_intermediate_size=spec.moe_intermediate_size // tp, num_experts=spec.num_experts,
                             num_experts_per_tok=spec.num_experts_per_tok, decoder_sparse_step=1,
                             norm_topk_prob=True, **common)
        cfg._experts_implementation = "grouped_mm"  # static shapes: what Megatron's grouped GEMM does
    elif spec.model_type == "llama":
        cfg = LlamaConfig(intermediate_size=spec.intermediate_size // tp, attention_bias=False, **common)
    else:
        cfg = Qwen2Config(intermediate_size=spec.intermediate_size // tp, **common)
    cfg._attn_implementation = "sdpa" if attention == "flash" else "eager"
    return cfg


def build_model(spec: ModelSpec, tp: int, attention: str, recompute: str = "none") -> torch.nn.Module:
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3MoeForCausalLM

    cfg = hf_config(spec, tp, attention)
    cls = Qwen3MoeForCausalLM if spec.is_moe else LlamaForCausalLM if spec.model_type == "llama" else Qwen2ForCausalLM
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = cls(cfg)
    finally:
        torch.set_default_dtype(previous)
    model.train()
    if recompute == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def grpo_loss(logprobs: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    ratio = torch.exp(logprobs - old)
    clipped = torch.clamp(ratio, 0.8, 1.28)
    return -torch.minimum(ratio * advantages, clipped * advantages).mean()


def storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def total_bytes(snapshot: dict[Any, dict[Any, int]]) -> int:
    return int(sum(v["Total"] for v in snapshot.values()))


def tracked_peak(run: Any, tracked: list[Any]) -> int:
    """Peak bytes while `run(tracker)` runs; `run` calls `tracker.reset_mod_stats()` between iterations."""
    tracker = MemTracker()
    tracker.track_external(*tracked)
    with tracker, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass")
        run(tracker)
    return total_bytes(tracker.get_tracker_snapshot("peak"))


@contextlib.contextmanager
def unpacked_sequences() -> Iterator[None]:
    """transformers looks at position ids to detect packed sequences; fake tensors carry no values, so the
    check would fall back to a materialised mask. Real runs on these unpacked inputs find no packing and use
    the causal kernel; tell the fake run the same."""
    import transformers.masking_utils as masking

    original = masking.find_packed_sequence_indices
    masking.find_packed_sequence_indices = lambda position_ids: None  # type: ignore[assignment]
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original  # type: ignore[assignment]


def measure(case: Case) -> dict[str, int]:
    """Peak bytes of each phase and the exact bytes of each resident category."""
    with FakeTensorMode(), unpacked_sequences():
        torch.manual_seed(0)
        model = build_model(case.spec, case.tp, case.attention, case.recompute)
        params = [p for p in model.parameters()]
        main_grads = [torch.zeros(p.shape, dtype=torch.float32) for p in params]
        main_params = [p.detach().float().requires_grad_(True) for p in params]
        for p, g in zip(params, main_grads, strict=True):
            def accumulate(param: torch.Tensor, buf: torch.Tensor = g) -> None:
                assert param.grad is not None
                buf.add_(param.grad)
                param.grad = None
            p.register_post_accumulate_grad_hook(accumulate)
        optimizer = torch.optim.AdamW(main_params, lr=1e-6, fused=True)

        def optimizer_step() -> None:
            for mp, g in zip(main_params, main_grads, strict=True):
                mp.grad = g
            optimizer.step()
            with torch.no_grad():
                for p, mp in zip(params, main_params, strict=True):
                    p.copy_(mp)
                for g in main_grads:
                    g.zero_()

        optimizer_step()  # warm-up: the Adam state now exists
        vocab = case.spec.vocab_size // case.tp
        batch = case.micro_batch * case.micro_batches
        ids = torch.randint(0, vocab, (batch, case.seq_len))
        advantages = torch.randn(batch, case.seq_len)
        old_logprobs: list[torch.Tensor] = []

        after_forward: list[int] = []

        def recompute(tracker: MemTracker) -> None:
            with torch.no_grad():
                for chunk in ids.split(case.recompute_micro_batch):
                    old_logprobs.append(token_logprobs(model(input_ids=chunk).logits, chunk))
                    tracker.reset_mod_stats()

        def train(tracker: MemTracker) -> None:
            old = torch.cat(old_logprobs)
            for i in range(case.micro_batches):
                rows = slice(i * case.micro_batch, (i + 1) * case.micro_batch)
                logprobs = token_logprobs(model(input_ids=ids[rows]).logits, ids[rows])
                loss = grpo_loss(logprobs, old[rows], advantages[rows])
                after_forward.append(total_bytes(tracker.get_tracker_snapshot("current")))
                loss.backward()
                del logprobs, loss
                tracker.reset_mod_stats()

        state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        resident = [model, optimizer, *main_grads, *main_params, ids, advantages]
        peaks = {"logprob_recompute": tracked_peak(recompute, resident)}
        resident += old_logprobs
        peaks["train"] = tracked_peak(train, resident)
        peaks["optimizer_step"] = tracked_peak(lambda _tracker: optimizer_step(), resident)
        inputs_bytes = storage_bytes([ids, advantages, *old_logprobs])
        return {
            "weights": storage_bytes(params),
            "gradients": storage_bytes(main_grads),
            "optimizer_state": storage_bytes(main_params) + storage_bytes(state),
            "inputs": inputs_bytes,
            "after_forward": max(after_forward),
            **{f"peak_{k}": v for k, v in peaks.items()},
        }


# ------------------------------------------------------------------------------------------ the estimate
def planner_inputs(case: Case) -> PlannerInputs:
    gpu = GPUSpec("measurement", 10**15, 1e15, 1e12, 1e11, 1e10)  # capacity is irrelevant here
    workload = Workload(batch_size=1, n_samples=case.micro_batch * case.micro_batches,
                        max_model_len=case.seq_len, max_new_tokens=case.seq_len // 2,
                        recompute_logprobs=True, recompute_micro_batch_size=case.recompute_micro_batch,
                        train_micro_batch_size=case.micro_batch)
    train = TrainOptions(sequence_parallel=False, implementation="hf", attention_backend=case.attention,
                         use_distributed_optimizer=True, fused_optimizer=True,
                         recompute_granularity=case.recompute)
    budget = MemoryBudget(check_enabled=True, safety_margin_bytes=0, logits_dtype_bytes=LOGITS_DTYPE_BYTES,
                          workspace_factor=WORKSPACE_FACTOR)
    return PlannerInputs(model=case.spec, cluster=ClusterSpec(1, case.tp, gpu), workload=workload, train=train,
                         budget=budget)


def estimate(case: Case) -> MemoryEstimate:
    return train_memory(planner_inputs(case), TrainLayout(tp=case.tp), dp=1)


def compare(case: Case) -> dict[str, Any]:
    est = estimate(case)
    t0 = time.perf_counter()
    got = measure(case)
    elapsed = time.perf_counter() - t0
    static_measured = got["weights"] + got["gradients"] + got["optimizer_state"] + got["inputs"]
    measured = {
        "weights": got["weights"], "gradients": got["gradients"], "optimizer_state": got["optimizer_state"],
        # kept for backward at the end of a micro-batch's forward (activations, output layer input, log-softmax)
        "train:after_forward": got["after_forward"] - static_measured,
        "train:peak": got["peak_train"] - static_measured,
        "logprob_recompute:peak": got["peak_logprob_recompute"] - static_measured,
        "optimizer_step:peak": got["peak_optimizer_step"] - static_measured,
    }
    kept = sum(est.term(n).bytes for n in ("activations", "embedding_activations", "output_activations",
                                            "loss_logits"))
    estimated = {
        "weights": est.term("weights").bytes, "gradients": est.term("gradients").bytes,
        "optimizer_state": est.term("optimizer_state").bytes,
        "train:after_forward": kept,
        "train:peak": max(est.phase_bytes("loss_backward"), est.phase_bytes("layer_backward")),
        "logprob_recompute:peak": max(est.phase_bytes("logprob_recompute"), est.phase_bytes("logprob_forward")),
        "optimizer_step:peak": est.phase_bytes("optimizer_step"),
    }
    phase_peaks = {"train": got["peak_train"], "logprob": got["peak_logprob_recompute"],
                   "optimizer_step": got["peak_optimizer_step"]}
    moment = max(phase_peaks, key=lambda k: phase_peaks[k])
    measured_peak = phase_peaks[moment]
    estimated_peak = est.peak_bytes
    terms = []
    for name, m in measured.items():
        e = int(estimated[name])
        terms.append({"term": name, "estimated_bytes": e, "measured_bytes": int(m),
                      "rel_error": round((e - m) / m, 5) if m else None,
                      "error_of_peak": round((e - m) / measured_peak, 5)})
    return {
        "model": case.name, "implementation": "hf", "pp": 1, "vocab": case.spec.vocab_size, "peak_moment": moment,
        "tp": case.tp, "seq_len": case.seq_len, "micro_batch": case.micro_batch,
        "micro_batches": case.micro_batches, "recompute_micro_batch": case.recompute_micro_batch,
        "layers": case.spec.num_layers, "attention": case.attention, "recompute": case.recompute,
        "estimated_bytes": int(estimated_peak), "measured_bytes": int(measured_peak),
        "rel_error": round((estimated_peak - measured_peak) / measured_peak, 5),
        "estimated_peak_moment": est.peak_phase,
        "inputs_bytes_not_modelled": got["inputs"],
        "terms": terms, "measure_s": round(elapsed, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--only", default="", help="run only cases whose model name contains this")
    args = parser.parse_args(argv)
    results = []
    for case in cases():
        if args.only and args.only not in case.name:
            continue
        row = compare(case)
        results.append(row)
        print(f"{row['model']:>18} tp={row['tp']} est={row['estimated_bytes'] / 2**30:8.3f} GiB "
              f"meas={row['measured_bytes'] / 2**30:8.3f} GiB err={row['rel_error']:+.2%}  "
              + " ".join(f"{t['term']}={t['error_of_peak']:+.2%}" for t in row["terms"]), flush=True)
    out: dict[str, Any] = {}
    if os.path.isfile(args.out):  # keep the Megatron-Core cases and their summary
        with open(args.out, encoding="utf-8") as fh:
            out = json.load(fh)
    megatron = [c for c in out.get("cases", []) if c.get("implementation") == "megatron"]
    out.update({
        "benchmark": "memory_accuracy",
        "method": "torch FakeTensorMode + torch.distributed._tools.mem_tracker.MemTracker on transformers models",
        "target_rel_error": 0.05,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cases": results + megatron,
        "max_abs_rel_error": max((abs(r["rel_error"]) for r in results + megatron), default=0.0),
    })
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=2)
        fh.write("\n")
    return 0 if out["max_abs_rel_error"] <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
