"""Cost model: seconds per RL step for training, log-prob recomputation, generation and weight sync.

Training time per step = (compute + TP + CP + EP + pipeline point-to-point communication) x (1 + bubble)
+ data-parallel gradient traffic + optimizer step (+ host traffic for an offloaded optimizer). Communication
uses ring collectives over intra-node bandwidth when the group fits in a node and the per-GPU network
bandwidth otherwise (rank order tp-cp-ep-dp-pp). Generation uses a roofline decode model per rollout
instance: a decode step reads the weights and the KV cache of the running batch from HBM or is bound by
compute, plus TP all-reduces and a fixed scheduling overhead. Formulas and assumptions are written out in
cluster_manual/planner.md.

Training functions take the data-parallel size as an int or a numpy array and rollout functions the instance
count likewise, so the search evaluates every split of a layout in one call. Pure: numpy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from planner.layout import TrainLayout, group_is_intra_node
from planner.memory import kv_bytes_per_token, max_batch, microbatches_per_step, stage_params
from planner.model_spec import ModelSpec
from planner.workload import PlannerInputs

BF16 = 2


def linear_params(spec: ModelSpec) -> float:
    """Parameters that take part in a matmul per token (active experts only; the input embedding is a lookup,
    the output layer is a matmul)."""
    embedding_lookup = spec.embedding_params
    output = spec.embedding_params if spec.tie_word_embeddings else 0
    return float(spec.active_params - embedding_lookup + output)


def forward_flops_per_token(spec: ModelSpec, seq_len: float) -> float:
    """Matmul FLOPs of one token's forward pass, with causal attention over `seq_len` tokens on average."""
    attention = 2.0 * spec.num_layers * spec.num_attention_heads * spec.head_dim * seq_len
    return 2.0 * linear_params(spec) + attention


def _bandwidth(inputs: PlannerInputs, span: Any) -> tuple[Any, Any]:
    """(bytes/s, latency) for a group of consecutive ranks spanning `span` GPUs (int or array)."""
    gpu, cost = inputs.cluster.gpu, inputs.cost
    intra = group_is_intra_node(span, inputs.cluster.gpus_per_node)
    bandwidth = np.where(intra, gpu.intra_node_bytes_per_s, gpu.inter_node_bytes_per_s) * cost.comm_efficiency
    latency = np.where(intra, cost.intra_node_latency_s, cost.inter_node_latency_s)
    return bandwidth, latency


def train_costs(inputs: PlannerInputs, layout: TrainLayout, dp: Any) -> dict[str, Any]:
    """Seconds of each part of one training step and of the log-prob recomputation; `dp` int or array."""
    spec, w, opts, cost, gpu = inputs.model, inputs.workload, inputs.train, inputs.cost, inputs.cluster.gpu
    tp, pp, cp, ep, vpp = layout.tp, layout.pp, layout.cp, layout.ep, layout.vpp
    seq = w.mean_sequence_tokens
    tokens_step = w.samples_per_step * seq
    gpus = dp * tp * pp * cp
    f_fwd = forward_flops_per_token(spec, seq)
    passes = 3.0
    if opts.recompute_granularity == "full":
        passes += 1.0
    elif opts.recompute_granularity == "selective":
        passes += (2.0 * spec.num_layers * spec.num_attention_heads * spec.head_dim * seq) / f_fwd
    flops_per_s = gpu.bf16_flops * cost.train_mfu * cost.train_speed_factor
    compute = passes * f_fwd * tokens_step / (gpus * flops_per_s)

    tokens_rank = tokens_step / (dp * cp)  # tokens one TP group of one stage processes per step
    layers_stage = spec.num_layers / pp
    microbatches = microbatches_per_step(inputs, dp)
    sp = tp if (opts.sequence_parallel and tp > 1) else 1

    tp_comm: Any = 0.0
    if tp > 1:
        bw, lat = _bandwidth(inputs, tp)
        allreduces = 4.0 + (2.0 if opts.recompute_granularity == "full" else 0.0)
        volume = 2.0 * (tp - 1) / tp * tokens_rank * spec.hidden_size * BF16
        tp_comm = allreduces * layers_stage * (volume / bw + lat * microbatches)

    cp_comm: Any = 0.0
    if cp > 1:
        bw, lat = _bandwidth(inputs, tp * cp)
        kv_heads = max(1.0, spec.num_kv_heads / tp)
        volume = (cp - 1) * tokens_rank * 2 * kv_heads * spec.head_dim * BF16
        cp_comm = 3.0 * layers_stage * (volume / bw + lat * microbatches * (cp - 1))

    ep_comm: Any = 0.0
    if ep > 1 and spec.is_moe:
        bw, lat = _bandwidth(inputs, tp * ep)
        moe_layers = spec.num_moe_layers / pp
        volume = (ep - 1) / ep * (tokens_rank / sp) * spec.num_experts_per_tok * spec.hidden_size * BF16
        ep_comm = 4.0 * moe_layers * (volume / bw + lat * microbatches)

    pp_comm: Any = 0.0
    if pp > 1:
        bw, lat = _bandwidth(inputs, tp * cp * dp * 2)
        per_mb = w.train_micro_batch_size * seq / cp * spec.hidden_size * BF16 / sp
        pp_comm = 2.0 * vpp * microbatches * (per_mb / bw + lat)

    bubble = (pp - 1) / (vpp * microbatches)

    params = stage_params(spec, layout, opts.implementation, first=True, last=pp == 1)
    dense_group = dp * cp
    expert_group = np.maximum(1, dp * cp // ep)
    bw_dp, _ = _bandwidth(inputs, tp * cp * dp)
    per_param = (opts.main_grad_bytes + opts.params_dtype_bytes) if opts.use_distributed_optimizer \
        else 2.0 * opts.main_grad_bytes
    dp_comm = per_param * (params.dense * (dense_group - 1) / dense_group
                           + params.expert * (expert_group - 1) / expert_group) / bw_dp

    shard = params.dense / (dense_group if opts.use_distributed_optimizer else 1) \
        + params.expert / (expert_group if opts.use_distributed_optimizer else 1)
    step_bytes = shard * (opts.optimizer_bytes_per_param * 2 + opts.main_grad_bytes + opts.params_dtype_bytes)
    optimizer = step_bytes / (gpu.hbm_bytes_per_s * cost.hbm_efficiency)
    offload: Any = 0.0
    if opts.offloaded_fraction > 0:
        moved = shard * opts.offloaded_fraction * (opts.optimizer_bytes_per_param + opts.main_grad_bytes
                                                   + opts.params_dtype_bytes)
        offload = moved / cost.host_link_bytes_per_s

    train = (compute + tp_comm + cp_comm + ep_comm + pp_comm) * (1.0 + bubble) + dp_comm + optimizer + offload

    recompute: Any = 0.0
    if w.recompute_logprobs:
        r_flops = gpu.bf16_flops * cost.recompute_mfu * cost.train_speed_factor
        r_compute = f_fwd * tokens_step / (gpus * r_flops)
        r_micro = np.maximum(1, w.samples_per_step // (dp * w.recompute_micro_batch_size))
        r_bubble = (pp - 1) / (vpp * r_micro)
        recompute = (r_compute + (tp_comm + ep_comm) / 2.0 + cp_comm / 3.0) * (1.0 + r_bubble)

    return {
        "compute_s": compute, "tp_comm_s": tp_comm, "cp_comm_s": cp_comm, "ep_comm_s": ep_comm,
        "pp_comm_s": pp_comm, "dp_comm_s": dp_comm, "optimizer_s": optimizer, "offload_s": offload,
        "bubble_ratio": bubble, "train_s": train, "logprob_recompute_s": recompute,
        "tp_comm_ratio": tp_comm / compute, "ep_comm_ratio": ep_comm / compute,
        "microbatches": microbatches,
    }


# ------------------------------------------------------------------------------------------------ rollout
def weight_bytes_read_per_decode_step(spec: ModelSpec, batch: Any, weight_bytes: int) -> Any:
    """Bytes of weights one decode step reads: all dense weights, and for MoE the experts the batch hits."""
    lookup = 0 if spec.tie_word_embeddings else spec.embedding_params  # the input embedding is a gather
    if not spec.is_moe:
        return (spec.total_params - lookup) * weight_bytes + 0.0 * batch
    per_layer = spec.num_experts * spec.expert_params
    non_expert = spec.total_params - lookup - spec.num_moe_layers * per_layer
    hit = spec.num_experts * (1.0 - np.power(1.0 - spec.num_experts_per_tok / spec.num_experts, batch))
    return (non_expert + spec.num_moe_layers * hit * spec.expert_params) * weight_bytes


def decode_step_s(inputs: PlannerInputs, rollout_tp: int, batch: Any) -> Any:
    """Seconds of one decode step of an instance running `batch` sequences."""
    spec, w, cost, gpu, ro = inputs.model, inputs.workload, inputs.cost, inputs.cluster.gpu, inputs.rollout
    context = w.prompt_tokens + w.response_tokens / 2.0
    weights = weight_bytes_read_per_decode_step(spec, batch, ro.weight_dtype_bytes) / rollout_tp
    kv = batch * context * kv_bytes_per_token(spec, rollout_tp, ro.kv_dtype_bytes)
    memory = (weights + kv) / (gpu.hbm_bytes_per_s * cost.hbm_efficiency)
    flops = batch * forward_flops_per_token(spec, 2.0 * context) / rollout_tp
    compute = flops / (gpu.bf16_flops * cost.decode_mfu)
    comm: Any = 0.0
    if rollout_tp > 1:
        bw, lat = _bandwidth(inputs, rollout_tp)
        volume = 2.0 * (rollout_tp - 1) / rollout_tp * batch * spec.hidden_size * BF16
        comm = 2.0 * spec.num_layers * (lat + volume / bw)
    return (np.maximum(memory, compute) + comm + cost.decode_step_overhead_s) / cost.rollout_speed_factor


def synchronous_decode_s(inputs: PlannerInputs, rollout_tp: int, instances: Any, batch: Any) -> Any:
    """Decode seconds of one instance's share of a synchronous batch with continuous batching on `batch`
    slots: all slots decode while requests wait (the bulk), then the batch drains as its responses finish,
    down to the longest, assumed to reach `max_new_tokens`, alone. `planner.sim.decode`'s aggregate on the
    planner's lengths: for T tokens on C slots the run lasts max(L, T / C + (L - r) / 2) decode steps, of which
    T / C - r are the bulk's (r: a running response's mean residual length, taken as the mean response, as for
    an exponential tail: the planner knows the mean only), and the drain's steps run the tokens left at their
    average batch. More instances shorten the bulk, not the drain."""
    w = inputs.workload
    requests = w.samples_per_step / instances
    longest = float(w.max_new_tokens)
    residual = min(w.response_tokens, longest)
    tokens = requests * w.response_tokens
    slots = np.minimum(batch, np.maximum(requests, 1.0))
    bulk = np.where(requests > slots, np.maximum(0.0, tokens / slots - residual), 0.0)
    drain = np.maximum(1.0, np.maximum(longest, tokens / slots + (longest - residual) / 2.0) - bulk)
    drain_batch = np.clip((tokens - bulk * slots) / drain, 1.0, slots)
    return bulk * decode_step_s(inputs, rollout_tp, slots) + drain * decode_step_s(inputs, rollout_tp, drain_batch)


def rollout_costs(inputs: PlannerInputs, rollout_tp: int, instances: Any, kv_capacity: int) -> dict[str, Any]:
    """Generation seconds per step for `instances` instances of TP `rollout_tp` (int or array)."""
    spec, w, cost, gpu = inputs.model, inputs.workload, inputs.cost, inputs.cluster.gpu
    instances = np.maximum(instances, 1)
    wanted = -(-w.rollouts_in_flight // instances)
    batch = np.minimum(np.minimum(wanted, kv_capacity), max_batch(inputs))
    batch = np.maximum(batch, 1)
    step = decode_step_s(inputs, rollout_tp, batch)
    per_instance = batch / step
    prefill_tokens = w.batch_size * w.prompt_tokens  # the n samples of a group share the prompt (prefix cache)
    prefill = prefill_tokens * forward_flops_per_token(spec, w.prompt_tokens) / (
        instances * rollout_tp * gpu.bf16_flops * cost.prefill_mfu * cost.rollout_speed_factor)
    # a batch is complete with its longest response, assumed to reach max_new_tokens
    if w.is_async:
        # the admission window keeps the slots full with later steps' requests: the pool's throughput sets the
        # pace, and the longest response, on the weight-version chain (`step_seconds`), decodes beside a full
        # batch (more instances shorten it only through a smaller batch)
        generation = w.samples_per_step * w.response_tokens / (instances * per_instance) + prefill
        latency = np.maximum(generation, w.max_new_tokens * decode_step_s(inputs, rollout_tp, batch) + prefill)
    else:  # the step waits for the drain down to the longest response, which the generation includes
        generation = latency = synchronous_decode_s(inputs, rollout_tp, instances, batch) + prefill
    model_bytes = spec.total_params * inputs.rollout.weight_dtype_bytes
    reload = cost.weight_reload_inplace_s if inputs.rollout.reload_method == "inplace" else cost.weight_reload_restart_s
    sync = (reload + model_bytes / (rollout_tp * gpu.inter_node_bytes_per_s * cost.comm_efficiency)) / w.sync_interval
    return {
        "batch_per_instance": batch, "decode_step_s": step, "tokens_per_s": instances * per_instance,
        "generation_s": generation, "weight_sync_s": sync + 0.0 * instances,
        "batch_latency_s": latency,
        # what a running job measures: tokens over the seconds the pool was generating (drain included)
        "generation_tokens_per_s": w.samples_per_step * w.response_tokens / generation,
    }


def step_seconds(inputs: PlannerInputs, train_side_s: Any, rollout_side_s: Any, chain_rollout_s: Any = 0.0) -> Any:
    """Seconds per RL step from the training side (log-prob recomputation + training) and the rollout side
    (generation + weight sync). Synchronous: one after the other. Asynchronous (bounded staleness s):
    generation of later steps overlaps training; rollout pauses while weights reload; and batch k may start
    only once the weights trained on batch k - s - 1 serve, so s + 1 steps take at least one batch's latency
    to its longest response, one training step and one weight sync (`chain_rollout_s`: the batch latency plus
    the weight sync; 0 leaves the chain out, as it never exceeds the training side then)."""
    if inputs.workload.is_async:
        chain = (chain_rollout_s + train_side_s) / (1 + inputs.workload.max_head_offpolicyness)
        return np.maximum(np.maximum(rollout_side_s, train_side_s), chain)
    return rollout_side_s + train_side_s
