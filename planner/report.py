"""The stable JSON form of a plan (`schema_version` 1, documented in cluster_manual/planner.md).

Only JSON types (dict, list, str, int, float, bool, None). Keys are never removed within a schema version;
new keys may be added.
"""

from __future__ import annotations

from typing import Any

from planner.memory import MemoryEstimate
from planner.plan import Evaluation, PhaseAdvice, Plan, Pruned
from planner.workload import PlannerInputs

SCHEMA_VERSION = 1


def memory_dict(est: MemoryEstimate) -> dict[str, Any]:
    return {
        "where": est.where,
        "capacity_bytes": int(est.capacity_bytes),
        "peak_bytes": int(est.peak_bytes),
        "headroom_bytes": int(est.headroom_bytes),
        "peak_phase": est.peak_phase,
        "fits": est.fits,
        "host_bytes": int(est.host_bytes),
        "terms": [{"name": t.name, "phase": t.phase, "bytes": int(t.bytes), "counted": t.counted,
                   "formula": t.formula} for t in est.terms],
    }


def evaluation_dict(ev: Evaluation) -> dict[str, Any]:
    c = ev.candidate
    return {
        "train": {"gpus": c.train_gpus, "dp": c.dp, **c.layout.as_dict(),
                  "microbatches_per_step": int(ev.train["microbatches"])},
        "rollout": {"gpus": c.rollout_gpus, "tp": c.rollout_tp, "instances": c.rollout_instances,
                    "batch_per_instance": int(ev.rollout["batch_per_instance"]),
                    "kv_capacity_sequences": int(ev.kv_capacity_sequences),
                    "tokens_per_s": float(ev.rollout["tokens_per_s"])},
        "memory": {"train": memory_dict(ev.train_memory), "rollout": memory_dict(ev.rollout_memory)},
        "times": {
            "generation_s": float(ev.rollout["generation_s"]),
            "weight_sync_s": float(ev.rollout["weight_sync_s"]),
            "logprob_recompute_s": float(ev.train["logprob_recompute_s"]),
            "train_s": float(ev.train["train_s"]),
            "step_s": float(ev.step_s),
            "train_breakdown": {k: float(ev.train[k]) for k in (
                "compute_s", "tp_comm_s", "cp_comm_s", "ep_comm_s", "pp_comm_s", "dp_comm_s", "optimizer_s",
                "offload_s")},
        },
        "ratios": {"tp_comm_compute": float(ev.train["tp_comm_ratio"]),
                   "ep_comm_compute": float(ev.train["ep_comm_ratio"]),
                   "pipeline_bubble": float(ev.train["bubble_ratio"])},
        "throughput": {"samples_per_s": float(ev.samples_per_s), "tokens_per_s": float(ev.tokens_per_s)},
        "violations": [{"code": v.code, "reason": v.message} for v in ev.violations],
    }


def pruned_dict(p: Pruned) -> dict[str, Any]:
    return {"kind": p.kind, "code": p.code, "reason": p.reason,
            "train": p.layout.as_dict() if p.layout is not None else None,
            "rollout_tp": p.rollout_tp,
            "train_gpus": list(p.train_gpus) if p.train_gpus else "all",
            "value": p.value, "threshold": p.threshold}


def phase_advice_dict(a: PhaseAdvice) -> dict[str, Any]:
    return {"phase": a.phase, "phase_s": float(a.phase_s), "step_s": float(a.step_s), "share": float(a.share),
            "option": a.option, "effect": a.effect, "new_phase_s": float(a.new_phase_s),
            "new_step_s": float(a.new_step_s), "samples_per_s": float(a.samples_per_s),
            "new_samples_per_s": float(a.new_samples_per_s), "gain": float(a.gain),
            "new_split": a.new_split or None, "message": a.message()}


def inputs_dict(inputs: PlannerInputs) -> dict[str, Any]:
    m, c, w = inputs.model, inputs.cluster, inputs.workload
    return {
        "model": {"name": m.name, "model_type": m.model_type, "params_total": int(m.total_params),
                  "params_active": int(m.active_params), "layers": m.num_layers, "hidden_size": m.hidden_size,
                  "attention_heads": m.num_attention_heads, "kv_heads": m.num_kv_heads, "vocab_size": m.vocab_size,
                  "experts": m.num_experts, "experts_per_token": m.num_experts_per_tok},
        "cluster": {"num_nodes": c.num_nodes, "gpus_per_node": c.gpus_per_node, "total_gpus": c.total_gpus,
                    "gpu_type": c.gpu.name, "gpu_memory_bytes": int(c.gpu.memory_bytes)},
        "workload": {"samples_per_step": w.samples_per_step, "max_model_len": w.max_model_len,
                     "max_new_tokens": w.max_new_tokens, "expected_prompt_tokens": w.prompt_tokens,
                     "expected_response_tokens": w.response_tokens,
                     "rollouts_in_flight": w.rollouts_in_flight,
                     "max_head_offpolicyness": w.max_head_offpolicyness},
        "activation_model": {"implementation": inputs.train.implementation,
                             "attention_backend": inputs.train.attention_backend,
                             "recompute_granularity": inputs.train.recompute_granularity},
    }


def plan_dict(plan: Plan, explain: bool = False) -> dict[str, Any]:
    """The `libra plan --json` document. `explain` adds every pruned candidate group."""
    out: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "feasible": plan.feasible,
        "strategy": plan.strategy,
        "mode": plan.mode,
        **inputs_dict(plan.inputs),
        "chosen": evaluation_dict(plan.chosen) if plan.chosen is not None else None,
        "alternatives": [evaluation_dict(a) for a in plan.alternatives],
        "baseline": evaluation_dict(plan.baseline) if plan.baseline is not None else None,
        "candidates_evaluated": plan.candidates_evaluated,
        "pruned_counts": plan.pruned_counts(),
        "warnings": list(plan.warnings),
        "suggestions": list(plan.suggestions),
        "phase_advice": [phase_advice_dict(a) for a in plan.phase_advice],
        "search_s": round(plan.search_s, 6),
    }
    if explain:
        out["pruned"] = [pruned_dict(p) for p in plan.pruned]
    return out
