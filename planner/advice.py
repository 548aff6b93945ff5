"""Explanations and advice: memory messages naming the largest terms, warnings on a chosen plan, and for an
infeasible job what to change, each suggestion checked by re-running the search with that change.

Config field names in messages are Libra's (megatron_*, global_resource_planner.*, cluster.*).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from planner.layout import enumerate_layouts, layout_rule_violation, rollout_rule_violation
from planner.memory import MemoryEstimate, kv_bytes_per_token, rollout_static_terms, train_memory
from planner.workload import PlannerInputs

if TYPE_CHECKING:
    from planner.plan import Evaluation, Plan

GB = 1e9
MAX_NODES = 1024


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
    static = sum(t.bytes for t in rollout_static_terms(inputs, rollout_tp))
    per_seq = kv_bytes_per_token(inputs.model, rollout_tp, inputs.rollout.kv_dtype_bytes) * inputs.workload.max_model_len
    if inputs.rollout.kv_cache_bytes > 0:
        return (f"rollout TP {rollout_tp}: rollout_kv_cache_bytes {inputs.rollout.kv_cache_bytes} holds no "
                f"sequence of max_model_len {inputs.workload.max_model_len} ({gb(per_seq)} each)")
    capacity = int(inputs.cluster.gpu.memory_bytes * inputs.rollout.gpu_memory_utilization)
    return (f"rollout TP {rollout_tp}: weights and engine workspace {gb(static)} + one {inputs.workload.max_model_len}"
            f"-token sequence's KV cache {gb(per_seq)} > {gb(capacity)} usable per GPU")


def plan_warnings(inputs: PlannerInputs, ev: Evaluation) -> list[str]:
    """Things worth knowing about a chosen candidate."""
    notes: list[str] = []
    w = inputs.workload
    wanted = -(-w.rollouts_in_flight // max(1, ev.candidate.rollout_instances))
    admitted = int(ev.rollout["batch_per_instance"])
    if ev.kv_capacity_sequences < min(wanted, 256):
        notes.append(f"KV cache admits {ev.kv_capacity_sequences} full-context sequences per rollout instance, "
                     f"{wanted} wanted: generation is KV-bound (more rollout GPUs or a shorter max_model_len help)")
    if not inputs.budget.check_enabled and w.recompute_logprobs:
        skipped = sum(t.bytes for t in ev.train_memory.terms if t.phase.startswith("logprob") and not t.counted)
        notes.append(f"global_resource_planner.memory_budget_check_enabled is false: {gb(skipped)} of log-prob "
                     "recomputation temporaries are not budgeted")
    headroom = ev.train_memory.headroom_bytes
    if 0 <= headroom < 0.05 * ev.train_memory.capacity_bytes:
        notes.append(f"training memory headroom is only {gb(headroom)} per GPU")
    if ev.train_memory.host_bytes:
        notes.append(f"optimizer offload keeps {gb(ev.train_memory.host_bytes)} per training GPU in host memory")
    if admitted < 1:
        notes.append("no rollout sequence fits the KV cache")
    return notes


def _best_training_floor(inputs: PlannerInputs) -> tuple[MemoryEstimate, str] | None:
    """Smallest training peak over structurally valid layouts that fit in the training pool's largest size."""
    s, total = inputs.space, inputs.cluster.total_gpus
    most = total - max(1, s.min_rollout_gpus)
    best: tuple[MemoryEstimate, str] | None = None
    for layout in enumerate_layouts(s.allowed_tp, s.allowed_pp, s.allowed_cp, s.allowed_ep, inputs.train.vpp):
        if layout.model_parallel > most or layout_rule_violation(
                inputs.model, layout, inputs.cluster.gpus_per_node, inputs.workload.max_model_len,
                inputs.train.attention_backend):
            continue
        gpus = most - most % layout.model_parallel
        est = train_memory(inputs, layout, gpus // layout.model_parallel)
        if best is None or est.peak_bytes < best[0].peak_bytes:
            best = (est, f"{layout.label()} on {gpus} GPUs")
    return best


def model_state_floor(inputs: PlannerInputs) -> str | None:
    """Weights + gradients + optimizer state of the whole model spread over every GPU of the cluster."""
    t, spec = inputs.train, inputs.model
    per_param = t.params_dtype_bytes + t.main_grad_bytes + t.optimizer_bytes_per_param * (1 - t.offloaded_fraction)
    total = spec.total_params * per_param
    per_gpu = total / inputs.cluster.total_gpus
    if per_gpu <= inputs.cluster.gpu.memory_bytes:
        return None
    return (f"memory: the training state alone ({spec.total_params / 1e9:.1f} B params x {per_param:g} B: weights "
            f"{t.params_dtype_bytes} + gradients {t.main_grad_bytes} + optimizer "
            f"{t.optimizer_bytes_per_param * (1 - t.offloaded_fraction):g}) is {total / 1e12:.2f} TB, "
            f"{gb(per_gpu)} per GPU even spread over all {inputs.cluster.total_gpus} GPUs "
            f"(capacity {gb(inputs.cluster.gpu.memory_bytes)})")


def _feasible(inputs: PlannerInputs) -> bool:
    from planner.search import plan_without_validation  # local: search imports this module

    try:
        inputs.validate()
    except ValueError:
        return False
    return plan_without_validation(inputs, advise=False).feasible


def minimum_nodes(inputs: PlannerInputs) -> int | None:
    """Fewest nodes (same GPU type) on which the search finds a feasible plan, or None up to MAX_NODES."""
    from planner.memory import kv_capacity_sequences

    gpn = inputs.cluster.gpus_per_node
    usable = [r for r in inputs.space.allowed_rollout_tp if not rollout_rule_violation(inputs.model, r, gpn)]
    if not any(kv_capacity_sequences(inputs, r) >= 1 for r in usable):
        return None  # a rollout instance does not fit whatever the cluster size
    coarse = replace(inputs, space=replace(inputs.space, allocation_granularity_gpus=max(
        inputs.space.allocation_granularity_gpus, gpn)))
    low, high = inputs.cluster.num_nodes, None
    n = max(1, low)
    while n < MAX_NODES:
        n = min(MAX_NODES, n * 2)
        if _feasible(coarse.with_cluster(n)):
            high = n
            break
        low = n
    if high is None:
        return None
    while high - low > 1:
        mid = (low + high) // 2
        if _feasible(coarse.with_cluster(mid)):
            high = mid
        else:
            low = mid
    return high


def _option_fixes(inputs: PlannerInputs) -> list[str]:
    """Single changes that make the job plan, each verified by a search."""
    t, w, s = inputs.train, inputs.workload, inputs.space
    trials: list[tuple[str, PlannerInputs]] = []
    if not (t.optimizer_cpu_offload and t.optimizer_offload_fraction >= 1.0):
        trials.append(("megatron_optimizer_cpu_offload: true with megatron_optimizer_offload_fraction: 1.0",
                       replace(inputs, train=replace(t, optimizer_cpu_offload=True, optimizer_offload_fraction=1.0))))
    if t.recompute_granularity != "full":
        trials.append(("megatron_recompute_granularity: full",
                       replace(inputs, train=replace(t, recompute_granularity="full"))))
    if w.train_micro_batch_size > 1:
        trials.append(("train_micro_batch_size: 1", replace(inputs, workload=replace(w, train_micro_batch_size=1))))
    if w.recompute_micro_batch_size > 1:
        trials.append(("recompute_micro_batch_size: 1",
                       replace(inputs, workload=replace(w, recompute_micro_batch_size=1))))
    half = w.max_model_len // 2
    if half > w.max_new_tokens:
        trials.append((f"max_model_len: {half}", replace(inputs, workload=replace(w, max_model_len=half))))
    layers = inputs.model.num_layers
    more_pp = tuple(sorted(set(s.allowed_pp) | {p for p in range(1, min(64, layers) + 1) if layers % p == 0}))
    if more_pp != tuple(sorted(set(s.allowed_pp))):
        trials.append((f"global_resource_planner.allowed_train_pp: {list(more_pp)}",
                       replace(inputs, space=replace(s, allowed_pp=more_pp))))
    trials += _threshold_trials(inputs)
    fixes = [f"{label} makes it plan on this cluster" for label, trial in trials if _feasible(trial)]
    return fixes


def _threshold_trials(inputs: PlannerInputs) -> list[tuple[str, PlannerInputs]]:
    """Raising a pruning threshold just above the smallest value that was pruned by it."""
    from planner.search import plan_without_validation

    plan = plan_without_validation(inputs, advise=False)
    s = inputs.space
    trials: list[tuple[str, PlannerInputs]] = []
    for code, config_name, current in (
            ("tp_comm_ratio", "train_comm_compute_ratio_threshold", s.comm_compute_ratio_threshold),
            ("ep_comm_ratio", "train_ep_comm_compute_ratio_threshold", s.ep_comm_compute_ratio_threshold),
            ("bubble_ratio", "train_pipeline_bubble_ratio_threshold", s.bubble_ratio_threshold)):
        values = [v for v in (_first_number(p.reason) for p in plan.pruned if p.code == code)
                  if v is not None and v > current]
        if not values:
            continue
        needed = round(min(values) * 1.05 + 0.005, 2)
        if code == "tp_comm_ratio":
            space = replace(s, comm_compute_ratio_threshold=needed)
        elif code == "ep_comm_ratio":
            space = replace(s, ep_comm_compute_ratio_threshold=needed)
        elif needed <= 1.0:
            space = replace(s, bubble_ratio_threshold=needed)
        else:
            continue
        trials.append((f"global_resource_planner.{config_name}: {needed}", replace(inputs, space=space)))
    return trials


def _first_number(text: str) -> float | None:
    for word in text.replace("-", " ").split():
        try:
            return float(word)
        except ValueError:
            continue
    return None


def infeasible_advice(inputs: PlannerInputs, plan: Plan) -> list[str]:
    """Why nothing fits and what to change."""
    lines: list[str] = []
    counts = plan.pruned_counts()
    if counts:
        lines.append("every candidate was pruned: " + ", ".join(f"{k} x{v}" for k, v in counts.items()))
    state = model_state_floor(inputs)
    if state:
        lines.append(state)
    floor = _best_training_floor(inputs)
    if floor is not None and not floor[0].fits:
        lines.append(f"memory: the smallest training layout ({floor[1]}) needs " + memory_message("a", floor[0])
                     .replace("a peak ", "a peak of ", 1))
    r_max = max((r for r in inputs.space.allowed_rollout_tp
                 if not rollout_rule_violation(inputs.model, r, inputs.cluster.gpus_per_node)), default=None)
    if r_max is not None and any(p.code == "rollout_memory" and p.rollout_tp == r_max for p in plan.pruned):
        lines.append("memory: " + rollout_memory_message(inputs, r_max))
    lines += _option_fixes(inputs)
    nodes = minimum_nodes(inputs)
    if nodes is not None:
        lines.append(f"cluster.num_nodes: {nodes} ({nodes * inputs.cluster.gpus_per_node} x "
                     f"{inputs.cluster.gpu.name}) is the smallest cluster on which this job plans")
    else:
        lines.append(f"more nodes of {inputs.cluster.gpu.name} alone do not help (a rollout instance must fit in one "
                     f"node, training was checked up to {MAX_NODES} nodes): change the options above or use a GPU "
                     "with more memory")
    return lines


def no_split_advice(inputs: PlannerInputs) -> list[str]:
    s, total = inputs.space, inputs.cluster.total_gpus
    lines = [f"no training-pool size: multiples of allocation_granularity_gpus {s.allocation_granularity_gpus} "
             f"between min_train_gpus {s.min_train_gpus} and {total} - min_rollout_gpus {max(1, s.min_rollout_gpus)}"
             " leave none; lower global_resource_planner.allocation_granularity_gpus or add nodes"]
    if s.allocation_granularity_gpus > 1:
        state = model_state_floor(inputs)
        if state:
            lines.append(state)
        finer = replace(inputs, space=replace(s, allocation_granularity_gpus=1))
        floor = _best_training_floor(finer)
        if floor is not None and not floor[0].fits:
            lines.append(f"memory: the smallest training layout ({floor[1]}) needs "
                         + memory_message("a", floor[0]).replace("a peak ", "a peak of ", 1))
        r_max = max((r for r in s.allowed_rollout_tp
                     if not rollout_rule_violation(inputs.model, r, inputs.cluster.gpus_per_node)), default=1)
        from planner.memory import kv_capacity_sequences

        if kv_capacity_sequences(inputs, r_max) < 1:
            lines.append("memory: " + rollout_memory_message(inputs, r_max))
    nodes = minimum_nodes(inputs)
    if nodes is not None:
        lines.append(f"cluster.num_nodes: {nodes} is the smallest cluster on which this job plans")
    return lines


def configured_advice(inputs: PlannerInputs) -> list[str]:
    """For a pinned split that does not work: single option changes that fix it, and what grp would pick."""
    from planner.search import plan_without_validation

    lines = _option_fixes(inputs)
    grp_inputs = replace(inputs, space=replace(inputs.space, strategy="grp", pinned=None))
    try:
        grp_inputs.validate()
        grp = plan_without_validation(grp_inputs, advise=False)
    except ValueError:
        return lines
    if grp.feasible and grp.chosen is not None:
        lines.append(f"initial_allocation_strategy: grp would choose {grp.chosen.candidate.label()}")
    return lines
