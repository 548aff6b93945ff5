"""Advice: warnings on a chosen plan, for the phase that dominates the step which option changes it and by how
much, and for an infeasible job what to change. Every number comes from the same cost and memory model: each
suggestion is checked by re-running the search with that change.

Config field names in messages are Libra's (megatron_*, global_resource_planner.*, cluster.*). This module
imports the search; the search never imports it.
"""

from __future__ import annotations

from dataclasses import replace

from planner.explain import gb, memory_message, rollout_memory_message
from planner.layout import enumerate_layouts, layout_rule_violation, rollout_rule_violation
from planner.memory import MemoryEstimate, kv_capacity_sequences, train_memory
from planner.plan import Evaluation, PhaseAdvice, Plan
from planner.search import search_validated
from planner.workload import EhpOptions, PlannerInputs

MAX_NODES = 1024
# a phase dominates the step when it takes more than this share of the step time
DOMINANT_SHARE = 0.30
# phase advice lists an option only when the re-run search predicts at least this gain in samples per second
MIN_PHASE_GAIN = 0.01
# what turns elastic hybrid parallelism on in a synchronous job (libra.config.elastic_hybrid.ehp_switch)
EHP_SETTING = ("global_resource_planner.runtime_dynamic_reconfiguration_enabled: true with "
               "runtime_reconfigure_training: true")


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


def _searched(inputs: PlannerInputs) -> Plan | None:
    """The search on changed inputs, or None when the change makes them invalid."""
    try:
        inputs.validate()
    except ValueError:
        return None
    return search_validated(inputs)


def _feasible(inputs: PlannerInputs) -> bool:
    plan = _searched(inputs)
    return plan is not None and plan.feasible


def minimum_nodes(inputs: PlannerInputs) -> int | None:
    """Fewest nodes (same GPU type) on which the search finds a feasible plan, or None up to MAX_NODES."""
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
    plan = search_validated(inputs)
    s = inputs.space
    trials: list[tuple[str, PlannerInputs]] = []
    for code, config_name, current in (
            ("tp_comm_ratio", "train_comm_compute_ratio_threshold", s.comm_compute_ratio_threshold),
            ("ep_comm_ratio", "train_ep_comm_compute_ratio_threshold", s.ep_comm_compute_ratio_threshold),
            ("bubble_ratio", "train_pipeline_bubble_ratio_threshold", s.bubble_ratio_threshold)):
        values = [p.value for p in plan.pruned if p.code == code and p.value is not None and p.value > current]
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
        if kv_capacity_sequences(inputs, r_max) < 1:
            lines.append("memory: " + rollout_memory_message(inputs, r_max))
    nodes = minimum_nodes(inputs)
    if nodes is not None:
        lines.append(f"cluster.num_nodes: {nodes} is the smallest cluster on which this job plans")
    return lines


def configured_advice(inputs: PlannerInputs) -> list[str]:
    """For a pinned split that does not work: single option changes that fix it, and what grp would pick."""
    lines = _option_fixes(inputs)
    grp = _searched(replace(inputs, space=replace(inputs.space, strategy="grp", pinned=None)))
    if grp is not None and grp.feasible and grp.chosen is not None:
        lines.append(f"initial_allocation_strategy: grp would choose {grp.chosen.candidate.label()}")
    return lines


# ------------------------------------------------------------------------------------------- phase advice
def _phase_trials(inputs: PlannerInputs) -> list[tuple[tuple[str, ...], str, str, PlannerInputs]]:
    """(phases it shortens or hides, setting, what it does, changed inputs) for each option a user can change
    that moves a phase of the step."""
    w, ro = inputs.workload, inputs.rollout
    trials: list[tuple[tuple[str, ...], str, str, PlannerInputs]] = []
    if ro.reload_method != "inplace":
        trials.append((("weight_sync",), "rollout_weight_reload_method: inplace",
                       "reloads weights into the running rollout servers instead of restarting them",
                       replace(inputs, rollout=replace(ro, reload_method="inplace"))))
    interval = w.sync_interval * 2
    lag = max(w.max_head_offpolicyness, interval - 1)  # rule sync.offpolicy_covers_interval
    label = f"sync_interval: {interval}" + (f" with max_head_offpolicyness: {lag}"
                                           if lag != w.max_head_offpolicyness else "")
    trials.append((("weight_sync",), label, f"syncs weights every {interval} training steps",
                   replace(inputs, workload=replace(w, sync_interval=interval, max_head_offpolicyness=lag))))
    if inputs.train.recompute_granularity != "none":
        trials.append((("train",), "megatron_recompute_granularity: none",
                       "keeps activations instead of recomputing them in the backward pass; the search checks they fit",
                       replace(inputs, train=replace(inputs.train, recompute_granularity="none"))))
    if not w.is_async and inputs.ehp is None:
        # EHP borrows whole replicas of the layout, which an expert-parallel layout cannot lend (rule
        # ehp_expert_parallel): the search is re-run with EP 1 only
        lending = replace(inputs, ehp=EhpOptions(), space=replace(inputs.space, allowed_ep=(1,)))
        trials.append((("train", "logprob_recompute"), EHP_SETTING,
                       "elastic hybrid parallelism: in a synchronous job the rollout GPUs wait while a step trains, "
                       "so each step also trains on them as extra data-parallel replicas; the split is planned "
                       "for it", lending))
    more = w.max_head_offpolicyness + 1
    hidden = ("generation",) if w.is_async else ("generation", "weight_sync", "logprob_recompute", "train")
    trials.append((hidden, f"max_head_offpolicyness: {more}",
                   f"overlaps generation with training, samples up to {more} policy version{'s' if more > 1 else ''} old",
                   replace(inputs, workload=replace(w, max_head_offpolicyness=more))))
    return trials


def dominant_phases(ev: Evaluation) -> dict[str, float]:
    """Phases that take more than `DOMINANT_SHARE` of the step, with their share, largest first."""
    shares = {name: seconds / ev.step_s for name, seconds in ev.phases.items()}
    return {name: share for name, share in sorted(shares.items(), key=lambda kv: -kv[1]) if share > DOMINANT_SHARE}


def phase_advice(inputs: PlannerInputs, plan: Plan) -> list[PhaseAdvice]:
    """For the phases that dominate the chosen plan's step: each option that changes them, with the phase and
    step time the search predicts once it is set (best gain first; only gains of at least `MIN_PHASE_GAIN`)."""
    ev = plan.chosen
    if ev is None or not plan.feasible:
        return []
    dominant = dominant_phases(ev)
    found: list[PhaseAdvice] = []
    for phases, setting, effect, changed in _phase_trials(inputs):
        phase = next((p for p in dominant if p in phases), None)
        if phase is None:
            continue
        other = _searched(changed)
        if other is None or not other.feasible or other.chosen is None:
            continue
        new = other.chosen
        advice = PhaseAdvice(phase=phase, phase_s=ev.phases[phase], step_s=ev.step_s,
                             samples_per_s=ev.samples_per_s, option=setting, effect=effect,
                             new_phase_s=new.phases[phase], new_step_s=new.step_s,
                             new_samples_per_s=new.samples_per_s,
                             new_split="" if new.candidate == ev.candidate else new.candidate.label())
        if advice.gain >= MIN_PHASE_GAIN:
            found.append(advice)
    return sorted(found, key=lambda a: -a.gain)
