"""Memory model: bytes per training rank and per rollout instance GPU, as named terms.

Each term carries a phase tag. ``static`` terms (weights, gradients, optimizer state) are resident for the
whole step and ``reserve`` is the safety margin. The transient terms belong to moments that happen one after
the other (`MOMENTS`): the loss backward (activations kept for backward + the loss's logits buffers), a
layer's backward (activations kept + the recomputed layer + one layer's activation gradients), the log-prob
recomputation (logits temporaries, or one layer's forward transients) and the optimizer step. The peak is
``static + reserve + max(moment sums)``. The worst rank is the larger of the first pipeline stage (embedding,
most micro-batches in flight) and the last (output layer, logits).

The training functions accept the data-parallel size as an int or a numpy array, so the search evaluates
every pool size of a layout in one call; `train_memory` wraps the scalar case into a `MemoryEstimate`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

from planner import activations as act
from planner.layout import TrainLayout
from planner.model_spec import ModelSpec
from planner.workload import MemoryBudget, PlannerInputs, TrainOptions

PHASES = ("static", "train", "train_loss", "train_backward", "logprob_recompute", "logprob_forward",
          "optimizer_step", "attention_buffer", "reserve", "host")
# moment -> the phase tags whose terms are live together at that moment
MOMENTS: dict[str, tuple[str, ...]] = {
    "loss_backward": ("train", "train_loss", "attention_buffer"),
    "layer_backward": ("train", "train_backward", "attention_buffer"),
    "logprob_recompute": ("logprob_recompute", "attention_buffer"),
    "logprob_forward": ("logprob_forward",),
    "optimizer_step": ("optimizer_step",),
}
RawTerm = tuple[str, str, Any, bool, Callable[[], str]]  # name, phase, bytes, counted, formula
# fp32 vocabulary-sized tensors live at once at the loss. hf (transformers' log-softmax): the log-softmax kept
# for backward, its gradient and the gradient of the logits. megatron (libra.training.logprobs with the
# entropy, in the loss's forward): the logits (or their fp32 copy), the shifted logits, their exp and the
# product exp x shifted. A padded vocabulary adds no buffer at the peak (measured: the padded cases of
# benchmarks/memory_accuracy_megatron.py).
TRAIN_LOGITS_BUFFERS = {"hf": 3, "megatron": 4}


@dataclass(frozen=True)
class MemoryTerm:
    """One named contribution to a GPU's memory."""

    name: str
    phase: str
    bytes: int
    counted: bool = True
    formula: str = ""


@dataclass(frozen=True)
class MemoryEstimate:
    """Named terms for one GPU, its capacity and the resulting peak."""

    terms: tuple[MemoryTerm, ...]
    capacity_bytes: int
    where: str = ""  # which rank/stage this is
    host_bytes: int = 0  # optimizer state offloaded to CPU memory
    extra: dict[str, Any] = field(default_factory=dict)

    def phase_bytes(self, phase: str) -> int:
        """Counted bytes of the terms tagged `phase`, or of every term live at moment `phase`."""
        tags = MOMENTS.get(phase, (phase,))
        return sum(t.bytes for t in self.terms if t.phase in tags and t.counted)

    @property
    def peak_phase(self) -> str:
        """The moment with the most transient memory ("static" when there is none)."""
        order = tuple(MOMENTS)
        best = max(order, key=lambda m: (self.phase_bytes(m), -order.index(m)))
        return best if self.phase_bytes(best) > 0 else "static"

    @property
    def peak_bytes(self) -> int:
        transient = 0 if self.peak_phase == "static" else self.phase_bytes(self.peak_phase)
        return self.phase_bytes("static") + self.phase_bytes("reserve") + transient

    @property
    def headroom_bytes(self) -> int:
        return self.capacity_bytes - self.peak_bytes

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.capacity_bytes

    def term(self, name: str) -> MemoryTerm:
        for t in self.terms:
            if t.name == name:
                return t
        raise KeyError(name)


# --------------------------------------------------------------------------------------------- parameters
def padded_vocab(spec: ModelSpec, tp: int, implementation: str) -> int:
    """Megatron pads the vocabulary to a multiple of 128 * TP; transformers keeps it as is."""
    if implementation != "megatron":
        return spec.vocab_size
    unit = 128 * tp
    return -(-spec.vocab_size // unit) * unit


@dataclass(frozen=True)
class StageParams:
    """Parameters held by one rank of a pipeline stage, split into dense and expert parameters."""

    dense: float
    expert: float

    @property
    def total(self) -> float:
        return self.dense + self.expert


@lru_cache(maxsize=4096)
def stage_params(spec: ModelSpec, layout: TrainLayout, implementation: str, first: bool, last: bool) -> StageParams:
    """Parameters on one rank of the first/last stage (TP-sharded, experts EP- and TP-sharded)."""
    tp, pp, ep = layout.tp, layout.pp, layout.ep
    h = spec.hidden_size
    layers = spec.num_layers // pp
    moe_layers = min(layers, -(-spec.num_moe_layers // pp))
    dense_layers = layers - moe_layers
    norms = 2 * h + (2 * spec.head_dim if spec.qk_norm else 0)
    attention = (spec.attention_params_per_layer - norms) / tp + norms
    dense = layers * attention + dense_layers * spec.dense_mlp_params / tp
    expert = 0.0
    if spec.is_moe:
        shared = spec.moe_mlp_params - spec.num_experts * spec.expert_params - h * spec.num_experts
        dense += moe_layers * (h * spec.num_experts + shared / tp)
        expert = moe_layers * (spec.num_experts / ep) * spec.expert_params / tp
    vocab_shard = padded_vocab(spec, tp, implementation) * h / tp
    if first:
        dense += vocab_shard
    if last:
        dense += h  # final norm
        if not spec.tie_word_embeddings or not first:
            dense += vocab_shard  # output layer (a tied copy lives on the last stage when PP > 1)
    return StageParams(dense=dense, expert=expert)


def model_logits_bytes(opts: TrainOptions, budget: MemoryBudget) -> int:
    """Bytes per logit of the model's own logits kept beside the fp32 log-prob temporaries: megatron computes
    log-probs on an fp32 copy of lower-precision logits, so both are live; 0 when no copy is made."""
    if opts.implementation == "megatron" and opts.params_dtype_bytes < budget.logits_dtype_bytes:
        return opts.params_dtype_bytes
    return 0


def largest_param_tensor(spec: ModelSpec, layout: TrainLayout, implementation: str, first: bool, last: bool) -> float:
    """Elements of the largest single parameter tensor on one rank of the stage."""
    h, tp = spec.hidden_size, layout.tp
    qkv = (spec.num_attention_heads + 2 * spec.num_kv_heads) * spec.head_dim * h / tp
    mlp = 2 * max(spec.intermediate_size, spec.moe_intermediate_size if spec.is_moe else 0) * h / tp
    vocab = padded_vocab(spec, tp, implementation) * h / tp if (first or last) else 0.0
    return float(max(qkv, mlp, vocab))


# --------------------------------------------------------------------------------------------- training
def in_flight_chunks(layout: TrainLayout, microbatches: Any, rank: int) -> Any:
    """Micro-batch x model-chunk activations pipeline rank `rank` holds at its peak (1F1B / interleaved)."""
    pp, vpp = layout.pp, layout.vpp
    if vpp == 1:
        return np.minimum(microbatches, pp - rank)
    return np.minimum(microbatches * vpp, (pp - rank - 1) * 2 + (vpp - 1) * pp + 1)


def _layer_bytes_per_token(inputs: PlannerInputs, layout: TrainLayout, seq_len: int) -> tuple[float, float]:
    """(bytes kept per token per layer in flight, one layer's full activations recomputed during backward)."""
    return _layer_bytes(inputs.model, inputs.train, layout, seq_len)


@lru_cache(maxsize=4096)
def _layer_bytes(spec: ModelSpec, opts: TrainOptions, layout: TrainLayout, seq_len: int) -> tuple[float, float]:
    shape = rank_shape(opts, layout)
    dense_parts = act.layer_parts(spec, shape, seq_len, moe=False)
    parts = act.layer_parts(spec, shape, seq_len, moe=True) if spec.is_moe else dense_parts
    n_moe = spec.num_moe_layers
    full = (sum(parts.values()) * n_moe + sum(dense_parts.values()) * (spec.num_layers - n_moe)) / spec.num_layers
    if opts.recompute_granularity == "full":
        return act.full_recompute_layer_bytes(spec, shape), max(sum(parts.values()), sum(dense_parts.values()))
    if opts.recompute_granularity == "selective":
        if act.is_megatron_local(shape):
            return full - act.megatron_local_selective_dropped(spec, shape, seq_len), 0.0
        return full - act.selective_recompute_dropped(parts), 0.0
    return full, 0.0


def rank_shape(opts: TrainOptions, layout: TrainLayout) -> act.RankShape:
    """The activation formula's view of one training rank; activations are in the parameters' dtype."""
    return act.RankShape(tp=layout.tp, ep=layout.ep, sequence_parallel=opts.sequence_parallel,
                         implementation=opts.implementation, attention_backend=opts.attention_backend,
                         act_bytes=opts.params_dtype_bytes)


def microbatches_per_step(inputs: PlannerInputs, dp: Any) -> Any:
    """Micro-batches each data-parallel rank runs in one optimizer step."""
    return np.maximum(1, inputs.workload.samples_per_step // (dp * inputs.workload.train_micro_batch_size))


def train_terms(inputs: PlannerInputs, layout: TrainLayout, dp: Any, stage: str) -> list[RawTerm]:
    """Terms for the first (`stage="first"`) or last (`"last"`) pipeline stage: (name, phase, bytes, counted,
    formula). Bytes are floats or arrays shaped like `dp`; formulas are built only when asked for."""
    spec, opts, w, budget = inputs.model, inputs.train, inputs.workload, inputs.budget
    first = stage == "first" or layout.pp == 1
    last = stage == "last" or layout.pp == 1
    rank = 0 if stage == "first" else layout.pp - 1
    params = stage_params(spec, layout, opts.implementation, first, last)
    dense_shard = dp * layout.cp if opts.use_distributed_optimizer else 1
    expert_shard = np.maximum(1, dp * layout.cp // layout.ep) if opts.use_distributed_optimizer else 1
    sharded = params.dense / dense_shard + params.expert / expert_shard
    opt_bytes = opts.optimizer_bytes_per_param
    keep = 1.0 - opts.offloaded_fraction
    seq = w.max_model_len
    tokens = w.train_micro_batch_size * seq / layout.cp
    shape = rank_shape(opts, layout)
    vocab = padded_vocab(spec, layout.tp, opts.implementation) / layout.tp
    per_layer, recompute_layer = _layer_bytes_per_token(inputs, layout, seq)
    model_logits = model_logits_bytes(opts, budget)
    rows = max(w.train_micro_batch_size, w.recompute_micro_batch_size if w.recompute_logprobs else 0)
    layers_per_chunk = spec.num_layers / (layout.pp * layout.vpp)
    chunks = in_flight_chunks(layout, microbatches_per_step(inputs, dp), rank)
    terms: list[RawTerm] = [
        ("weights", "static", params.total * opts.params_dtype_bytes, True,
         lambda: f"{params.total:.4g} params x {opts.params_dtype_bytes} B"),
        ("gradients", "static", params.total * opts.main_grad_bytes, True,
         lambda: f"{params.total:.4g} params x {opts.main_grad_bytes} B (main grads)"),
        ("optimizer_state", "static", sharded * opt_bytes * keep, True,
         lambda: f"params / DP shard x {opt_bytes} B (main params + Adam moments)"
         + (f" x {keep:.2f} kept on GPU" if keep < 1 else "")),
        ("activations", "train", chunks * layers_per_chunk * per_layer * tokens, True,
         lambda: f"{layers_per_chunk:g} layers x {_count(chunks)} micro-batch chunks in flight x "
         f"{per_layer:.0f} B/token x {tokens:g} tokens ({opts.implementation}/{opts.attention_backend}, "
         f"recompute={opts.recompute_granularity})"),
    ]
    if opts.offloaded_fraction > 0:
        terms.append(("optimizer_state_on_host", "host", sharded * opt_bytes * opts.offloaded_fraction, False,
                      lambda: f"offloaded fraction {opts.offloaded_fraction:g} of the optimizer state (CPU memory)"))
    if first:
        embed_token = sum(act.embedding_stage_parts(spec, shape).values())
        terms.append(("embedding_activations", "train", chunks * embed_token * tokens, True,
                      lambda: f"{embed_token:.0f} B/token per micro-batch in flight"))
    if recompute_layer:
        terms.append(("recompute_layer_workspace", "train_backward", recompute_layer * tokens, True,
                      lambda: "one layer's activations rebuilt during backward (full recomputation)"))
    if act.is_megatron_local(shape):
        layer_grads = max(act.megatron_local_backward_workspace(spec, shape, seq, moe)
                          for moe in ((False, True) if spec.is_moe else (False,)))
        grads_formula = "the attention core's softmax-backward temporaries (less the layer's MLP tensors, already " \
            "freed) or the MLP's gradients, with the residual stream's"
    else:
        layer_grads = max(per_layer, recompute_layer)
        grads_formula = "activation gradients of one layer, bounded by its activations"
    terms.append(("layer_backward_workspace", "train_backward", layer_grads * tokens, True,
                  lambda: f"{grads_formula} ({layer_grads:.0f} B/token)"))
    if last:
        if layout.pp > 1:
            p2p = 2 * opts.params_dtype_bytes * spec.hidden_size / shape.sp_divisor
            terms.append(("pipeline_receive_buffers", "train", p2p * tokens, True,
                          lambda: "1F1B on the last stage: the next micro-batch's received activation and the "
                          f"gradient being sent back, {p2p:.0f} B/token"))
        output_token = sum(act.output_stage_parts(spec, shape).values())
        terms.append(("output_activations", "train_loss", output_token * tokens, True,
                      lambda: f"final norm + output-layer input, {output_token:.0f} B/token"))
        logits = tokens * vocab * budget.logits_dtype_bytes
        buffers = TRAIN_LOGITS_BUFFERS[opts.implementation]
        terms.append(("loss_logits", "train_loss", logits + tokens * vocab * model_logits, True,
                      lambda: f"logits: micro-batch x seq x vocab/TP ({vocab:g}) x {budget.logits_dtype_bytes} B"
                      + (f" + the model's {model_logits} B logits beside their fp32 copy" if model_logits else "")))
        terms.append(("loss_logits_grad", "train_loss", logits * (buffers - 1), True,
                      lambda: f"the loss's other vocabulary-sized temporaries ({opts.implementation}), "
                      f"{buffers - 1} x {_count(logits / 2**20)} MiB"))
        if w.recompute_logprobs:
            rtokens = w.recompute_micro_batch_size * seq / layout.cp
            if layout.pp > 1:
                hidden = 2 * opts.params_dtype_bytes * spec.hidden_size / shape.sp_divisor
                terms.append(("logprob_pipeline_buffers", "logprob_recompute", rtokens * hidden,
                              budget.check_enabled,
                              lambda: f"the pipeline's received activations beside the logits, {hidden:.0f} B/token"))
            terms.append(("logprob_recompute_logits", "logprob_recompute",
                          rtokens * vocab * (budget.logits_dtype_bytes * budget.workspace_factor + model_logits),
                          budget.check_enabled,
                          lambda: f"recompute micro-batch {w.recompute_micro_batch_size} x seq {seq} x vocab/TP "
                          f"{vocab:g} x {budget.logits_dtype_bytes} B x workspace {budget.workspace_factor:g}"
                          + (f" + the model's {model_logits} B logits" if model_logits else "")))
    if w.recompute_logprobs:
        rtokens = w.recompute_micro_batch_size * seq / layout.cp
        ws = act.forward_workspace_per_token(spec, shape, seq)
        terms.append(("logprob_forward_workspace", "logprob_forward", rtokens * ws, budget.check_enabled,
                      lambda: f"one layer's forward transients, {ws:.0f} B/token"))
    scores = act.megatron_scores_buffer_bytes(spec, shape, rows, int(seq / layout.cp))
    if scores:
        terms.append(("attention_scores_buffer", "attention_buffer", scores, True,
                      lambda: f"unfused attention's persistent scores buffer: {rows} rows x heads/TP x seq^2 x "
                      f"{opts.params_dtype_bytes} B"))
    if not opts.fused_optimizer:
        largest = largest_param_tensor(spec, layout, opts.implementation, first, last)
        terms.append(("optimizer_step_workspace", "optimizer_step",
                      sharded * opts.main_params_bytes * keep + 2 * act.FP32 * largest, True,
                      lambda: "unfused Adam, tensor by tensor: the square root of the second moment and its "
                      f"scaled copy for the largest tensor ({largest:.4g} params)"
                      + (", and one fp32 temporary per parameter" if opts.main_params_bytes else "")))
    terms.append(("safety_margin", "reserve", float(budget.safety_margin_bytes), True,
                  lambda: "global_resource_planner.memory_budget_safety_margin_bytes"))
    return terms


def _count(value: Any) -> str:
    return str(int(value)) if np.ndim(value) == 0 else "the"


def _peak(terms: list[RawTerm]) -> Any:
    fixed: Any = 0.0
    by_phase: dict[str, Any] = {}
    for _name, phase, value, counted, _ in terms:
        if not counted or phase == "host":
            continue
        if phase in ("static", "reserve"):
            fixed = fixed + value
        else:
            by_phase[phase] = by_phase.get(phase, 0.0) + value
    transient: Any = 0.0
    for tags in MOMENTS.values():
        moment: Any = 0.0
        for tag in tags:
            moment = moment + by_phase.get(tag, 0.0)
        transient = np.maximum(transient, moment)
    return fixed + transient


def train_peak_bytes(inputs: PlannerInputs, layout: TrainLayout, dp: Any) -> Any:
    """Peak bytes of the worst training rank; `dp` may be an array (vectorized search)."""
    peak = _peak(train_terms(inputs, layout, dp, "first"))
    if layout.pp > 1:
        peak = np.maximum(peak, _peak(train_terms(inputs, layout, dp, "last")))
    return peak


def train_memory(inputs: PlannerInputs, layout: TrainLayout, dp: int) -> MemoryEstimate:
    """Named terms of the worst training rank for a pool with `dp` data-parallel replicas."""
    stages = ["first"] if layout.pp == 1 else ["first", "last"]
    best: MemoryEstimate | None = None
    for stage in stages:
        raw = train_terms(inputs, layout, dp, stage)
        terms = tuple(MemoryTerm(n, p, int(round(float(v))), c, f()) for n, p, v, c, f in raw)
        host = sum(t.bytes for t in terms if t.phase == "host")
        where = "every training rank" if layout.pp == 1 else f"the {stage} pipeline stage"
        est = MemoryEstimate(terms, inputs.cluster.gpu.memory_bytes, where=where, host_bytes=host)
        if best is None or est.peak_bytes > best.peak_bytes:
            best = est
    assert best is not None
    return best


# --------------------------------------------------------------------------------------------- rollout
def kv_bytes_per_token(spec: ModelSpec, rollout_tp: int, kv_dtype_bytes: int) -> float:
    """K and V of every layer for one token on one GPU (KV heads replicated when TP exceeds them)."""
    kv_heads = max(1.0, spec.num_kv_heads / rollout_tp)
    return 2.0 * spec.num_layers * kv_heads * spec.head_dim * kv_dtype_bytes


def rollout_static_terms(inputs: PlannerInputs, rollout_tp: int) -> list[MemoryTerm]:
    """Weights, engine workspace and safety margin of one rollout GPU (everything but the KV cache)."""
    spec, ro = inputs.model, inputs.rollout
    weights = spec.total_params * ro.weight_dtype_bytes / rollout_tp
    inter = spec.intermediate_size if not spec.is_moe else spec.moe_intermediate_size * spec.num_experts_per_tok
    seqs = max_batch(inputs)
    workspace = (ro.max_num_batched_tokens * act.ACT_BYTES * (2 * spec.hidden_size + 3 * inter / rollout_tp)
                 + seqs * spec.vocab_size * act.FP32 * 2)
    return [
        MemoryTerm("weights", "static", int(weights), True,
                   f"{spec.total_params:.4g} params x {ro.weight_dtype_bytes} B / rollout TP {rollout_tp}"),
        MemoryTerm("engine_workspace", "static", int(workspace), True,
                   f"forward of {ro.max_num_batched_tokens} batched tokens + fp32 sampler logits for {seqs} sequences"),
        MemoryTerm("safety_margin", "reserve", inputs.budget.safety_margin_bytes, True,
                   "global_resource_planner.memory_budget_safety_margin_bytes"),
    ]


def max_batch(inputs: PlannerInputs) -> int:
    """vLLM's running-sequence cap (max_num_seqs) for this workload."""
    return int(min(256, inputs.workload.rollouts_in_flight))


def rollout_capacity_bytes(inputs: PlannerInputs) -> int:
    return int(inputs.cluster.gpu.memory_bytes * inputs.rollout.gpu_memory_utilization)


def kv_bytes_per_sequence(inputs: PlannerInputs, rollout_tp: int) -> float:
    """The KV cache of one full-context (`max_model_len`) sequence on one rollout GPU."""
    return kv_bytes_per_token(inputs.model, rollout_tp, inputs.rollout.kv_dtype_bytes) * inputs.workload.max_model_len


def kv_capacity_sequences(inputs: PlannerInputs, rollout_tp: int) -> int:
    """How many full-context sequences the KV cache of one instance holds."""
    per_seq = kv_bytes_per_sequence(inputs, rollout_tp)
    if inputs.rollout.kv_cache_bytes > 0:
        return int(inputs.rollout.kv_cache_bytes // per_seq)
    free = rollout_capacity_bytes(inputs) - sum(t.bytes for t in rollout_static_terms(inputs, rollout_tp))
    return max(0, int(free // per_seq))


def rollout_memory(inputs: PlannerInputs, rollout_tp: int, admitted: int) -> MemoryEstimate:
    """Named terms of one rollout GPU with `admitted` concurrent sequences of full context."""
    per_token = kv_bytes_per_token(inputs.model, rollout_tp, inputs.rollout.kv_dtype_bytes)
    context = inputs.workload.max_model_len
    kv = MemoryTerm("kv_cache", "static", int(admitted * context * per_token), True,
                    f"{admitted} sequences x {context} tokens x {per_token:.0f} B/token")
    terms = tuple(rollout_static_terms(inputs, rollout_tp)) + (kv,)
    return MemoryEstimate(terms, rollout_capacity_bytes(inputs), where=f"every rollout GPU (TP {rollout_tp})")
