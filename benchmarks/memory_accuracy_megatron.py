"""Memory-model accuracy on the path `libra plan` and `libra launch` use: the planner's
``implementation="megatron"`` estimate against real Megatron-Core training workers, measured on this CPU.

Each case builds a small HF model from its architecture (random weights), starts one process per rank
(`torch.multiprocessing` spawn, gloo) and runs the very `TrainingWorker` the training pool runs (Megatron-Core
`GPTModel` with the local layer spec, DDP with fp32 gradient buffers, Megatron's optimizer, the CPU
compatibility layer, the GRPO loss on vocab-parallel log-probs). After a warm-up step (it creates the Adam
state) each phase of a step runs once more under torch's `MemTracker` (`libra.training.memory_probe`):
the log-prob recomputation (forward only), the forward/backward of every micro-batch (1F1B when PP > 1) and
the optimizer step. A rank's measured peak is its resident state (weights, gradient buffers, Adam moments:
counted exactly from the tensors) plus the largest phase transient; the case's figure is the largest rank.

The estimate is `planner.memory.train_memory` with the options `libra.planning.planner_inputs` sets on a CPU
(fp32, Megatron-Core local layers with the unfused attention, sequence parallelism for MoE only, unfused
Adam) and the same memory_budget_workspace_factor as the configuration default.

Not covered on a CPU (Megatron-Core 0.16.1 needs CUDA for them; `not_covered` in the result says so): the
distributed optimizer, context parallelism, Transformer Engine layers with flash attention (the GPU path's
activation formulas), bf16 mixed precision with fp32 main parameters.

Usage: python benchmarks/memory_accuracy_megatron.py --out benchmarks/results/memory_accuracy.json
(merges its cases into the file next to the transformers cases of `benchmarks/memory_accuracy.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from planner.layout import TrainLayout  # noqa: E402
from planner.memory import MemoryEstimate, train_memory  # noqa: E402
from planner.workload import PlannerInputs  # noqa: E402

TARGET_ABS_REL_ERROR = 0.05
TARGET_MAX_UNDER_ESTIMATE = 0.02
NOT_COVERED = [
    "sequence parallelism (Megatron-Core 0.16.1's local layer spec refuses it: WrappedTorchNorm asserts; so MoE "
    "with TP > 1, which needs it, is refused on a CPU too)",
    "distributed optimizer (Megatron-Core 0.16.1 needs CUDA for it)",
    "context parallelism (needs Transformer Engine)",
    "Transformer Engine layers with flash attention (the GPU path's attention_backend='flash' formulas)",
    "bf16/fp16 mixed precision with fp32 main parameters (CPU workers train in fp32)",
    "CPU optimizer offload and the precision-aware optimizer",
    "virtual pipeline stages (VPP > 1)",
]


@dataclass(frozen=True)
class Arch:
    """A model shape: dense Llama, or Qwen3-MoE when `experts` > 0."""

    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    layers: int
    vocab: int
    experts: int = 0
    topk: int = 0
    moe_ffn: int = 0

    @property
    def label(self) -> str:
        moe = f"-e{self.experts}k{self.topk}f{self.moe_ffn}" if self.experts else ""
        return f"h{self.hidden}-a{self.heads}-g{self.kv_heads}-f{self.ffn}-l{self.layers}{moe}-v{self.vocab}"


@dataclass(frozen=True)
class Case:
    name: str
    arch: Arch
    tp: int = 1
    pp: int = 1
    seq_len: int = 256
    micro_batch: int = 1
    micro_batches: int = 2
    recompute_micro_batch: int = 2
    recompute: str = "none"  # "none" | "selective" | "full" (uniform, one layer per checkpoint)

    @property
    def world(self) -> int:
        return self.tp * self.pp


BASE = Arch(hidden=128, heads=4, kv_heads=2, ffn=352, layers=2, vocab=4096)


def cases() -> list[Case]:
    v256, v32k = replace(BASE, vocab=256), replace(BASE, vocab=32000)
    wide = Arch(hidden=192, heads=6, kv_heads=6, ffn=512, layers=3, vocab=4096)  # MHA, no GQA
    gqa4 = Arch(hidden=256, heads=8, kv_heads=2, ffn=704, layers=2, vocab=4096)
    deep = Arch(hidden=96, heads=3, kv_heads=1, ffn=256, layers=4, vocab=4096)  # MQA
    moe = Arch(hidden=128, heads=4, kv_heads=2, ffn=256, layers=2, vocab=4096, experts=4, topk=2, moe_ffn=96)
    return [
        Case("base-v256", v256),
        Case("base-v4096", BASE),
        Case("base-v32000", v32k, seq_len=128),
        Case("base-v4096-selective", BASE, recompute="selective"),
        Case("base-v4096-full", BASE, recompute="full"),
        Case("base-v32000-full", v32k, seq_len=128, recompute="full"),
        Case("base-v4096-tp2", BASE, tp=2),
        Case("base-v256-tp2-full", v256, tp=2, recompute="full"),
        Case("base-v256-pp2", v256, pp=2, micro_batches=4),
        Case("base-v4096-pp2-selective", BASE, pp=2, micro_batches=4, recompute="selective"),
        Case("base-v32000-pp2", v32k, pp=2, seq_len=128, micro_batches=4),
        Case("mha-v4096", wide, micro_batch=2),
        Case("gqa4-v4096-tp2", gqa4, tp=2, seq_len=192),
        Case("mqa-deep-v4096-full", deep, recompute="full", micro_batch=2),
        Case("moe-v4096", moe),
        # vocabularies Megatron pads (to a multiple of 128 x TP): the loss masks the padding in one more buffer
        Case("base-v1000-padded", replace(BASE, vocab=1000)),
        Case("gqa4-v4000-tp2-padded", replace(gqa4, vocab=4000), tp=2, seq_len=192),
    ]


# ------------------------------------------------------------------------------------------ the model
def hf_config(arch: Arch) -> dict[str, Any]:
    """The `config.json` fields of `arch` (Llama, or Qwen3-MoE with experts)."""
    config: dict[str, Any] = dict(
        model_type="qwen3_moe" if arch.experts else "llama",
        vocab_size=arch.vocab, hidden_size=arch.hidden, intermediate_size=arch.ffn, num_hidden_layers=arch.layers,
        num_attention_heads=arch.heads, num_key_value_heads=arch.kv_heads, head_dim=arch.hidden // arch.heads,
        max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )
    if arch.experts:
        config.update(moe_intermediate_size=arch.moe_ffn, num_experts=arch.experts, num_experts_per_tok=arch.topk,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    else:
        config.update(attention_bias=False)
    return config


def build_hf_model(arch: Arch, out_dir: str) -> str:
    """A random-weight HF model of `arch` with the tiny word-level tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

    from libra.models.tiny import build_tokenizer

    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    fields = {k: v for k, v in hf_config(arch).items() if k != "model_type"}
    config = (Qwen3MoeConfig if arch.experts else LlamaConfig)(dtype="float32", **fields)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out_dir)
    build_tokenizer(out_dir)
    return out_dir


def job_config(case: Case, model_dir: str) -> Any:
    """The job this case runs, as a user would configure it on a CPU machine: the workers and the planner's
    estimate are both built from it (`training_pool_spec` and `libra.planning.planner_inputs`)."""
    from libra.config.mapping import cpu_config

    return cpu_config(model_dir, train_tp_size=case.tp, train_pp_size=case.pp, train_micro_batch_size=case.micro_batch,
                      recompute_micro_batch_size=case.recompute_micro_batch, megatron_recompute_granularity=case.recompute,
                      batch_size=1, n_samples=case.micro_batch * case.micro_batches,
                      max_model_len=case.seq_len, max_new_tokens=case.seq_len - case.seq_len // 4,
                      cluster={"num_nodes": 1, "gpus_per_node": max(2, case.world), "gpu_type": "cpu-logical",
                               "logical_gpus": True})


def _samples(case: Case) -> list[Any]:
    import random

    from libra.training.spec import TrainSample

    rng = random.Random(0)
    prompt = case.seq_len // 4
    out = []
    for i in range(case.micro_batch * case.micro_batches):
        ids = [rng.randrange(4, case.arch.vocab) for _ in range(case.seq_len)]
        out.append(TrainSample(prompt_ids=ids[:prompt], response_ids=ids[prompt:],
                               rollout_logprobs=[-1.0] * (case.seq_len - prompt),
                               advantage=1.0 if i % 2 else -1.0, policy_version=0, reward=0.0))
    return out


def _rank_main(rank: int, case: Case, model_dir: str, port: int, out_dir: str) -> None:
    import torch

    torch.set_num_threads(1)
    from libra.config.mapping import training_pool_spec
    from libra.training import cpu_compat
    from libra.training.memory_probe import resident_bytes, transient_peak
    from libra.training.worker import TrainingWorker

    cfg = job_config(case, model_dir)
    spec = training_pool_spec(cfg, num_gpus=case.world, run_dir=os.path.join(out_dir, "run"))
    worker = TrainingWorker(spec, rank, case.world)
    worker.setup("127.0.0.1", port)
    samples = _samples(case)
    worker.train_step(samples, 1)  # warm-up: creates the Adam state
    chunks, optimizer = worker.unwrapped_chunks, worker.optimizer
    with cpu_compat.device_scope():
        batch, _ = worker.local_batch(samples, case.micro_batch, case.recompute_micro_batch)
        holder: dict[str, Any] = {}
        peaks = {
            "logprob": transient_peak(lambda: holder.update(
                old=worker.logprob_pass(worker.chunks, batch, case.recompute_micro_batch)), chunks),
            "train": transient_peak(lambda: worker.forward_backward(batch, holder["old"], None), chunks),
            "optimizer_step": transient_peak(lambda: optimizer.step(), chunks, optimizer),
        }
        resident = resident_bytes(worker.chunks, optimizer)
    from megatron.core import parallel_state as ps

    result = {"rank": rank, "pp_rank": ps.get_pipeline_model_parallel_rank(), "resident": resident, "peaks": peaks}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(case: Case, model_dir: str, work: str) -> list[dict[str, Any]]:
    """Per-rank resident bytes and phase transients of one training step of `case`."""
    import torch.multiprocessing as mp

    out_dir = tempfile.mkdtemp(prefix=f"{case.name}-", dir=work)
    mp.spawn(_rank_main, args=(case, model_dir, _free_port(), out_dir), nprocs=case.world, join=True)
    ranks = []
    for rank in range(case.world):
        with open(os.path.join(out_dir, f"rank{rank}.json"), encoding="utf-8") as fh:
            ranks.append(json.load(fh))
    return ranks


# ------------------------------------------------------------------------------------------ the estimate
def workspace_factor() -> float:
    """The configuration default of global_resource_planner.memory_budget_workspace_factor."""
    from libra.config.sections import PlannerConfig

    return float(PlannerConfig().memory_budget_workspace_factor)


def planner_inputs(case: Case) -> PlannerInputs:
    """What `libra plan` gives the planner for this job (`libra.planning.planner_inputs` of `job_config`), with
    no safety margin: the figure compared is the estimate itself. Needs only the model's config.json."""
    from libra.planning import planner_inputs as job_planner_inputs

    with tempfile.TemporaryDirectory() as model_dir:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(hf_config(case.arch), f)
        inputs = job_planner_inputs(job_config(case, model_dir))
    return replace(inputs, model=replace(inputs.model, name=case.arch.label),
                   budget=replace(inputs.budget, safety_margin_bytes=0))


MEASURED_TO_MOMENTS = {"logprob": ("logprob_recompute", "logprob_forward"),
                       "train": ("loss_backward", "layer_backward"), "optimizer_step": ("optimizer_step",)}


def compare(case: Case, model_dir: str, work: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    ranks = measure(case, model_dir, work)
    return evaluate(case, ranks, time.perf_counter() - t0)


def estimate(case: Case) -> MemoryEstimate:
    """The planner's worst training rank for `case`."""
    return train_memory(planner_inputs(case), TrainLayout(tp=case.tp, pp=case.pp), dp=1)


def evaluate(case: Case, ranks: list[dict[str, Any]], elapsed: float) -> dict[str, Any]:
    """The case's row: the planner's estimate against the measured ranks."""
    inputs = planner_inputs(case)
    est = estimate(case)

    def total(r: dict[str, Any]) -> int:
        return int(r["resident"]["total"] + max(r["peaks"].values()))

    worst = max(ranks, key=total)
    measured = total(worst)
    moment = max(worst["peaks"], key=lambda k: worst["peaks"][k])
    static = est.phase_bytes("static")
    phases = []
    for name, value in worst["peaks"].items():
        e = max(est.phase_bytes(m) for m in MEASURED_TO_MOMENTS[name])
        phases.append({"phase": name, "estimated_bytes": int(e), "measured_bytes": int(value),
                       "rel_error": round((e - value) / value, 5) if value else None})
    estimated = est.peak_bytes
    return {
        "model": case.name, "implementation": "megatron", "tp": case.tp, "pp": case.pp, "vocab": case.arch.vocab,
        "recompute": case.recompute, "arch": case.arch.label, "sequence_parallel": inputs.train.sequence_parallel,
        "seq_len": case.seq_len, "micro_batch": case.micro_batch, "micro_batches": case.micro_batches,
        "recompute_micro_batch": case.recompute_micro_batch, "attention": "eager",
        "estimated_bytes": int(estimated), "measured_bytes": measured,
        "rel_error": round((estimated - measured) / measured, 5),
        "peak_moment": moment, "peak_rank": worst["rank"], "estimated_peak_moment": est.peak_phase,
        "estimated_where": est.where,
        "static": {"estimated_bytes": int(static), "measured_bytes": int(worst["resident"]["total"])},
        "phases": phases,
        "ranks": ranks, "measure_s": round(elapsed, 2),
    }


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    errors = [r["rel_error"] for r in rows]
    worst_under = min(errors, default=0.0)
    max_abs = max((abs(e) for e in errors), default=0.0)
    return {
        "megatron_cases": len(rows),
        "max_abs_rel_error": max_abs,
        "worst_under_estimate": min(0.0, worst_under),
        "target_abs_rel_error": TARGET_ABS_REL_ERROR,
        "target_max_under_estimate": TARGET_MAX_UNDER_ESTIMATE,
        "targets_met": bool(rows) and max_abs <= TARGET_ABS_REL_ERROR and -worst_under <= TARGET_MAX_UNDER_ESTIMATE,
        "peak_moments": sorted({r["peak_moment"] for r in rows}),
    }


def merge(out_path: str, rows: list[dict[str, Any]], factor: float, wall_s: float | None) -> dict[str, Any]:
    """Write the megatron cases into the result file, keeping the transformers ("hf") cases it holds."""
    existing: dict[str, Any] = {}
    if os.path.isfile(out_path):
        with open(out_path, encoding="utf-8") as fh:
            existing = json.load(fh)
    hf = [c for c in existing.get("cases", []) if c.get("implementation") == "hf"]
    names = {r["model"] for r in rows}
    kept = [c for c in existing.get("cases", []) if c.get("implementation") == "megatron" and c["model"] not in names]
    megatron = kept + rows
    out = dict(existing)
    out.update({
        "benchmark": "memory_accuracy",
        "cases": hf + megatron,
        "megatron": {
            "method": "real Megatron-Core TrainingWorker processes (gloo, CPU, fp32) under torch MemTracker",
            "workspace_factor": factor,
            "not_covered": NOT_COVERED,
            # --estimate-only measures nothing: the wall time stays that of the measuring run
            "wall_s": round(wall_s, 1) if wall_s is not None else existing.get("megatron", {}).get("wall_s"),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            **summary(megatron),
        },
    })
    out["max_abs_rel_error"] = max((abs(c["rel_error"]) for c in hf + megatron), default=0.0)
    out["not_covered"] = NOT_COVERED
    out["targets_met"] = out["megatron"]["targets_met"]
    with open(out_path, "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=2)
        fh.write("\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON result file (merged)")
    parser.add_argument("--only", default="", help="run only cases whose name contains this")
    parser.add_argument("--estimate-only", action="store_true",
                        help="recompute the estimates of the cases already in --out (no measurement)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    factor = workspace_factor()
    rows = []
    stored: dict[str, dict[str, Any]] = {}
    if args.estimate_only and os.path.isfile(args.out):
        with open(args.out, encoding="utf-8") as fh:
            stored = {c["model"]: c for c in json.load(fh).get("cases", []) if c.get("implementation") == "megatron"}
    with tempfile.TemporaryDirectory(prefix="libra-memory-megatron-") as work:
        for case in cases():
            if args.only and args.only not in case.name:
                continue
            if args.estimate_only:
                if case.name not in stored:
                    continue
                row = evaluate(case, stored[case.name]["ranks"], stored[case.name]["measure_s"])
            else:
                row = compare(case, build_hf_model(case.arch, os.path.join(work, case.arch.label)), work)
            rows.append(row)
            print(f"{row['model']:>26} tp={row['tp']} pp={row['pp']} est={row['estimated_bytes'] / 2**20:8.2f} MiB "
                  f"meas={row['measured_bytes'] / 2**20:8.2f} MiB err={row['rel_error']:+.2%} "
                  f"at={row['peak_moment']}/{row['estimated_peak_moment']} "
                  + " ".join(f"{p['phase']}={p['rel_error']:+.1%}" for p in row["phases"] if p["rel_error"] is not None),
                  flush=True)
    out = merge(args.out, rows, factor, None if args.estimate_only else time.monotonic() - started)
    print(json.dumps({k: v for k, v in out["megatron"].items() if k != "not_covered"}))
    return 0 if out["megatron"]["targets_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
