"""The bridge between a job `Config` and the Global Resource Planner, and the dry-run recompute probe check.

`planner_inputs(cfg)` maps every option the planner uses (and derives the empty `allowed_train_*` lists, the
split granularity and the minimums as the configuration reference documents); `plan_job(cfg)` runs the
search. `compare_recompute_probe` compares one real log-prob recomputation, run by the training pool
before the first step when `memory_budget_dry_run_enabled` is set, with the planner's estimate for that
probe and says whether the budget holds at full context and what workspace factor the measurement implies.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from libra.config import Config
from libra.config.elastic_hybrid import ehp_switch
from libra.config.mapping import (
    planner_memory_budget,
    planner_rollout_options,
    planner_train_options,
    planner_workload,
)
from planner.grp import plan
from planner.layout import TrainLayout
from planner.memory import MemoryEstimate, model_logits_bytes, padded_vocab, train_memory
from planner.model_spec import ModelSpec
from planner.plan import Plan
from planner.workload import ClusterSpec, EhpOptions, PinnedLayout, PlannerInputs, SearchSpace

CPU_GPU_TYPE = "cpu-logical"
MAX_DERIVED_PP = 32


def _powers_of_two(limit: int) -> list[int]:
    values, v = [], 1
    while v <= limit:
        values.append(v)
        v *= 2
    return values


def derived_tp(spec: ModelSpec, gpus_per_node: int) -> tuple[int, ...]:
    """Powers of two up to a node that divide the attention and KV heads."""
    return tuple(t for t in _powers_of_two(gpus_per_node)
                 if spec.num_attention_heads % t == 0 and spec.num_kv_heads % t == 0)


def derived_pp(spec: ModelSpec) -> tuple[int, ...]:
    """Divisors of the layer count up to 32 (uneven pipelines are not planned)."""
    return tuple(p for p in range(1, min(MAX_DERIVED_PP, spec.num_layers) + 1) if spec.num_layers % p == 0)


def derived_ep(spec: ModelSpec) -> tuple[int, ...]:
    """Dense: 1. MoE: powers of two that divide the expert count."""
    if not spec.is_moe:
        return (1,)
    return tuple(e for e in _powers_of_two(spec.num_experts) if spec.num_experts % e == 0)


def is_cpu_job(cfg: Config) -> bool:
    return cfg.cluster.logical_gpus or cfg.cluster.gpu().name == CPU_GPU_TYPE


def granularity(cfg: Config) -> int:
    """`allocation_granularity_gpus`, with 0 meaning one node (one GPU when the cluster is a single node)."""
    g = cfg.global_resource_planner.allocation_granularity_gpus
    if g:
        return g
    return cfg.cluster.gpus_per_node if cfg.cluster.num_nodes > 1 else 1


def planner_inputs(cfg: Config) -> PlannerInputs:
    """Everything the planner needs from a validated configuration."""
    spec = cfg.model_spec()
    grp = cfg.global_resource_planner
    # the catalog entry of gpu_type, corrected or described by cluster.gpu_spec
    cluster = ClusterSpec(cfg.cluster.num_nodes, cfg.cluster.gpus_per_node, cfg.cluster.gpu())
    cpu = is_cpu_job(cfg)
    workload = planner_workload(cfg)
    train = planner_train_options(cfg, moe=spec.is_moe, cpu=cpu)
    rollout = planner_rollout_options(cfg)
    budget = planner_memory_budget(cfg)
    pinned = None
    if cfg.train_gpus and cfg.rollout_gpus:
        pinned = PinnedLayout(train_gpus=cfg.train_gpus, rollout_gpus=cfg.rollout_gpus, tp=cfg.train_tp_size,
                              pp=cfg.train_pp_size, cp=cfg.train_cp_size, ep=cfg.train_ep_size,
                              rollout_tp=cfg.rollout_tp_size)
    space = SearchSpace(
        allowed_tp=tuple(grp.allowed_train_tp) or derived_tp(spec, cfg.cluster.gpus_per_node) or (1,),
        allowed_pp=tuple(grp.allowed_train_pp) or derived_pp(spec),
        allowed_cp=tuple(grp.allowed_train_cp) or (1,),
        allowed_ep=tuple(grp.allowed_train_ep) or derived_ep(spec),
        allowed_rollout_tp=tuple(_powers_of_two(cfg.cluster.gpus_per_node)),
        allocation_granularity_gpus=granularity(cfg),
        min_train_gpus=grp.min_train_gpus or 1,
        min_rollout_gpus=grp.min_rollout_gpus or 1,
        comm_compute_ratio_threshold=grp.train_comm_compute_ratio_threshold,
        ep_comm_compute_ratio_threshold=grp.train_ep_comm_compute_ratio_threshold,
        bubble_ratio_threshold=grp.train_pipeline_bubble_ratio_threshold,
        strategy=grp.initial_allocation_strategy,
        pinned=pinned,
    )
    ehp = None
    if ehp_switch(cfg).mode == "on":  # the training phase runs on the GPUs the job lends it
        ehp = EhpOptions(min_rollout_gpus=grp.elastic_hybrid_min_rollout_gpus,
                         replica_size_gpus=grp.elastic_hybrid_replica_size_gpus)
    return PlannerInputs(model=spec, cluster=cluster, workload=workload, train=train, rollout=rollout,
                         budget=budget, space=space, ehp=ehp)


def plan_job(cfg: Config) -> Plan:
    """Run the planner for a job (grp search, or the check of the pinned split for `configured`) with advice."""
    return plan(planner_inputs(cfg))


# ------------------------------------------------------------------------------------- dry-run recompute probe
@dataclass(frozen=True)
class RecomputeProbe:
    """What one real log-prob recomputation measured on a training rank.

    `resident_bytes`: device bytes allocated before the probe (weights, gradients, optimizer state);
    `peak_bytes`: peak allocated during it (e.g. torch.cuda.max_memory_allocated after a reset);
    `micro_batch` and `seq_len`: the shape the probe ran (normally recompute_micro_batch_size x max_model_len).
    """

    resident_bytes: int
    peak_bytes: int
    micro_batch: int
    seq_len: int


@dataclass(frozen=True)
class ProbeComparison:
    """Probe vs estimate. `ok` = within tolerance and the projected full-context peak fits the GPU."""

    estimated_transient_bytes: int
    measured_transient_bytes: int
    rel_error: float
    projected_peak_bytes: int
    capacity_bytes: int
    implied_workspace_factor: float
    ok: bool
    message: str


def recompute_estimate(inputs: PlannerInputs, layout: TrainLayout, dp: int, micro_batch: int,
                       seq_len: int) -> MemoryEstimate:
    """The planner's training-rank estimate for a recompute probe of the given shape. The probe runs before any
    training micro-batch, so buffers sized by the largest micro-batch so far (the unfused attention's scores
    buffer) are sized by the probe: the training micro-batch is set to the probe's too."""
    w = replace(inputs.workload, recompute_micro_batch_size=micro_batch, train_micro_batch_size=micro_batch,
                max_model_len=seq_len, max_new_tokens=min(inputs.workload.max_new_tokens, max(1, seq_len - 1)),
                recompute_logprobs=True)
    return train_memory(replace(inputs, workload=w, budget=replace(inputs.budget, check_enabled=True)), layout, dp)


def transient_bytes(est: MemoryEstimate) -> int:
    """The part of an estimate a recompute probe measures: the larger of the two log-prob phases."""
    return max(est.phase_bytes("logprob_recompute"), est.phase_bytes("logprob_forward"))


def compare_recompute_probe(inputs: PlannerInputs, layout: TrainLayout, dp: int, probe: RecomputeProbe,
                            tolerance: float = 0.15) -> ProbeComparison:
    """Compare a probe with the estimate and project it to recompute_micro_batch_size x max_model_len."""
    w, budget = inputs.workload, inputs.budget
    at_probe = recompute_estimate(inputs, layout, dp, probe.micro_batch, probe.seq_len)
    at_full = recompute_estimate(inputs, layout, dp, w.recompute_micro_batch_size, w.max_model_len)
    estimated = transient_bytes(at_probe)
    measured = max(0, probe.peak_bytes - probe.resident_bytes)
    rel_error = (estimated - measured) / measured if measured else 0.0
    scale = transient_bytes(at_full) / estimated if estimated else 1.0
    projected = probe.resident_bytes + int(measured * scale) + budget.safety_margin_bytes
    capacity = inputs.cluster.gpu.memory_bytes
    vocab = padded_vocab(inputs.model, layout.tp, inputs.train.implementation) / layout.tp
    logits = probe.micro_batch * probe.seq_len / layout.cp * vocab
    logits_bytes = logits * budget.logits_dtype_bytes
    model_logits = logits * model_logits_bytes(inputs.train, budget)  # not scaled by the workspace factor
    implied = (measured - model_logits) / logits_bytes if logits_bytes else 0.0
    fits = projected <= capacity
    ok = fits and abs(rel_error) <= tolerance
    parts = [f"recompute probe ({probe.micro_batch} x {probe.seq_len} tokens): measured {measured / 1e9:.2f} GB "
             f"above resident, estimated {estimated / 1e9:.2f} GB ({rel_error:+.1%})",
             f"projected peak at {w.recompute_micro_batch_size} x {w.max_model_len}: {projected / 1e9:.2f} GB of "
             f"{capacity / 1e9:.2f} GB"]
    if abs(rel_error) > tolerance:
        parts.append(f"the measurement implies global_resource_planner.memory_budget_workspace_factor "
                     f"{implied:.2f} (configured {budget.workspace_factor:g})")
    if not fits:
        parts.append("lower recompute_micro_batch_size or max_model_len, or raise the training TP")
    return ProbeComparison(estimated, measured, rel_error, projected, capacity, implied, ok, "; ".join(parts))
