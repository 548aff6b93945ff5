"""Messages that explain a memory verdict: the largest terms of a training peak that does not fit, and why no
full-context sequence fits a rollout instance. The search records them as pruning reasons; the advice quotes
them. Pure: stdlib and the memory model.
"""

from __future__ import annotations

from planner.memory import MemoryEstimate, kv_bytes_per_sequence, rollout_static_terms
from planner.workload import PlannerInputs

GB = 1e9


def gb(value: float) -> str:
    return f"{value / GB:.1f} GB"


def memory_message(kind: str, est: MemoryEstimate) -> str:
    """`peak X > capacity Y (largest terms ...) on <where>`."""
    counted = [t for t in est.terms if t.counted and t.bytes > 0 and t.phase in ("static", "reserve", est.peak_phase)]
    top = sorted(counted, key=lambda t: -t.bytes)[:4]
    terms = ", ".join(f"{t.name} {gb(t.bytes)}" for t in top)
    return (f"{kind} peak {gb(est.peak_bytes)} > {gb(est.capacity_bytes)} per GPU on {est.where} "
            f"(during {est.peak_phase}; {terms})")


def rollout_memory_message(inputs: PlannerInputs, rollout_tp: int) -> str:
    """Why one rollout instance of TP `rollout_tp` holds no sequence of max_model_len tokens."""
    static = sum(t.bytes for t in rollout_static_terms(inputs, rollout_tp))
    per_seq = kv_bytes_per_sequence(inputs, rollout_tp)
    if inputs.rollout.kv_cache_bytes > 0:
        return (f"rollout TP {rollout_tp}: rollout_kv_cache_bytes {inputs.rollout.kv_cache_bytes} holds no "
                f"sequence of max_model_len {inputs.workload.max_model_len} ({gb(per_seq)} each)")
    capacity = int(inputs.cluster.gpu.memory_bytes * inputs.rollout.gpu_memory_utilization)
    return (f"rollout TP {rollout_tp}: weights and engine workspace {gb(static)} + one {inputs.workload.max_model_len}"
            f"-token sequence's KV cache {gb(per_seq)} > {gb(capacity)} usable per GPU")
