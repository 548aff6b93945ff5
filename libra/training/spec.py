"""What a training pool is asked to run: `TrainingPoolSpec` (layout, batch, algorithm, optimizer, Megatron
options, checkpoint retention), `TrainSample`, and the checks that turn a bad spec into one clear error.

Parallel sizes are derived and checked by `planner.layout` (`derive_layout` names the spec field of each
problem), the code validation and the planner use too.
Problems are collected, not raised one by one: `InvalidTrainingSpecError` for a spec that cannot work
anywhere, `NotValidatedOnCPUError` for a layout or option that megatron-core 0.16.1 runs only on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from libra.algo.spec import AlgorithmSpec
from libra.metering.spec import CpuMetering
from libra.observability.phase_trace import TraceSettings
from libra.training.call_deadlines import HangRule
from planner.layout import TrainLayout
from planner.model_spec import ModelSpec

PARAMS_DTYPES = ("fp32", "bf16", "fp16")


class InvalidTrainingSpecError(ValueError):
    """Invalid configuration: the training spec cannot run on any machine."""


class NotValidatedOnCPUError(RuntimeError):
    """Not validated: megatron-core 0.16.1 runs this layout/option only with CUDA (the GPU path keeps it)."""


LRDecayStyle = Literal["constant", "linear", "cosine"]


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """Adam settings (Megatron `OptimizerConfig`) and the learning-rate schedule: linear warm-up to `lr`, then
    constant, or a linear / cosine decay that reaches `min_lr` after `lr_decay_steps` optimizer steps. Every field
    is the user's (`optimizer.*` and `total_steps`, built by `libra.config.mapping.optimizer_spec`): no defaults
    here."""

    lr: float
    min_lr: float
    lr_decay_style: LRDecayStyle
    lr_decay_steps: int
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    clip_grad: float
    lr_warmup_steps: int


RecomputeGranularity = Literal["none", "selective", "full"]


@dataclass(frozen=True, kw_only=True)
class MegatronOptions:
    """Megatron switches (OptimizerConfig / TransformerConfig / DDP config fields), from the `megatron_*`
    options (`libra.config.mapping.megatron_options`): no defaults here."""

    use_precision_aware_optimizer: bool
    optimizer_cpu_offload: bool
    optimizer_offload_fraction: float
    use_cpu_initialization: bool
    grouped_gemm: bool
    use_distributed_optimizer: bool
    recompute_granularity: RecomputeGranularity


@dataclass(frozen=True, kw_only=True)
class CheckpointRetention:
    """Keep the newest `keep_last` checkpoints and, in addition, every step that is a multiple of
    `keep_every` (0 = none)."""

    keep_last: int
    keep_every: int


@dataclass(frozen=True, kw_only=True)
class TrainingPoolSpec:
    """A Megatron-Core training pool: `num_gpus` workers laid out as TP x PP x CP x DP (EP inside DP).

    Built from a job configuration by `libra.config.mapping.training_pool_spec`; the fields a user can set
    have no defaults here, so none can be left behind on the way."""

    model_path: str
    num_gpus: int
    tp: int
    pp: int
    cp: int
    ep: int
    vpp: int
    micro_batch_size: int
    recompute_logprobs: bool
    recompute_micro_batch_size: int
    algorithm: AlgorithmSpec
    optimizer: OptimizerSpec
    megatron: MegatronOptions
    seed: int
    params_dtype: Literal["fp32", "bf16", "fp16"]
    retention: CheckpointRetention
    metering: CpuMetering  # each worker runs in a CPU slice of its GPU (metered logical GPUs)
    hang: HangRule  # how long a collective call may run before the pool counts as hung
    run_dir: str = ""
    # phase tracing of every rank (rank r writes phase_trace_rank{1000 + r}.jsonl); None = off
    trace: TraceSettings | None = None


@dataclass
class TrainSample:
    """One response with its prompt, the rollout engine's per-token log-probs and its advantage."""

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    advantage: float
    policy_version: int
    reward: float


# the spec field behind each degree a `planner.layout` rule names
_SPEC_FIELD = {"tp": "tp", "pp": "pp", "cp": "cp", "ep": "ep", "vpp": "vpp", "world": "num_gpus"}


def derive_layout(spec: TrainingPoolSpec, model: ModelSpec | None = None) -> tuple[TrainLayout | None, list[str]]:
    """The layout of `spec` and every problem with it (checked against `model` when given).

    The layout rules are `planner.layout`'s, the same validation and the planner apply; each problem names
    the spec field to change."""
    errors = [f"training.{name}={getattr(spec, name)} must be >= 1"
              for name in ("micro_batch_size", "recompute_micro_batch_size") if getattr(spec, name) < 1]
    layout = TrainLayout(tp=spec.tp, pp=spec.pp, cp=spec.cp, ep=spec.ep, vpp=spec.vpp)
    problems = layout.problems(model, world=spec.num_gpus)
    for problem in problems:
        name = _SPEC_FIELD.get(problem.degree, problem.degree)
        errors.append(f"training.{name}={getattr(spec, name)}: {problem.message}")
    if any(p.code in ("degree_positive", "split_divisibility") for p in problems):
        return None, errors
    return layout, errors


def spec_errors(spec: TrainingPoolSpec, arch: ModelSpec | None = None) -> list[str]:
    """Invalid-configuration problems of `spec` (machine independent)."""
    _, errors = derive_layout(spec, arch)
    errors += spec.algorithm.errors("training.algorithm")
    if spec.params_dtype not in PARAMS_DTYPES:
        errors.append(f"training.params_dtype='{spec.params_dtype}' is not one of {', '.join(PARAMS_DTYPES)}")
    opt = spec.optimizer
    if opt.lr <= 0:
        errors.append(f"training.optimizer.lr={opt.lr} must be > 0")
    if opt.clip_grad < 0:
        errors.append(f"training.optimizer.clip_grad={opt.clip_grad} must be >= 0 (0 disables clipping)")
    if opt.lr_warmup_steps < 0:
        errors.append(f"training.optimizer.lr_warmup_steps={opt.lr_warmup_steps} must be >= 0")
    meg = spec.megatron
    if not 0.0 <= meg.optimizer_offload_fraction <= 1.0:
        errors.append(
            f"training.megatron.optimizer_offload_fraction={meg.optimizer_offload_fraction} must be in [0, 1]"
        )
    if meg.use_precision_aware_optimizer and not meg.use_distributed_optimizer:
        errors.append(
            "training.megatron.use_precision_aware_optimizer=true needs use_distributed_optimizer=true "
            "(Megatron supports it only with the distributed optimizer)"
        )
    if meg.optimizer_cpu_offload and not meg.use_distributed_optimizer:
        errors.append(
            "training.megatron.optimizer_cpu_offload=true needs use_distributed_optimizer=true "
            "(Megatron offloads the sharded optimizer state)"
        )
    isc = spec.algorithm.is_correction
    if isc.enable and not spec.recompute_logprobs:
        errors.append(
            "training.algorithm.is_correction.enable=true needs recompute_logprobs=true: the IS weight is "
            "pi_old / pi_rollout and without recomputation pi_old is the rollout policy"
        )
    if spec.retention.keep_last < 1:
        errors.append(f"training.retention.keep_last={spec.retention.keep_last} must be >= 1")
    if spec.retention.keep_every < 0:
        errors.append(f"training.retention.keep_every={spec.retention.keep_every} must be >= 0")
    return errors


def cpu_not_validated(spec: TrainingPoolSpec, arch: ModelSpec | None = None) -> list[str]:
    """Settings megatron-core 0.16.1 runs only with CUDA; empty when the spec runs on a CPU machine."""
    out: list[str] = []
    if spec.cp > 1:
        out.append(f"training.cp={spec.cp}: context parallelism needs CUDA attention kernels; use cp=1 on CPU")
    meg = spec.megatron
    if meg.use_distributed_optimizer:
        out.append("training.megatron.use_distributed_optimizer=true: the distributed optimizer needs CUDA")
    if meg.optimizer_cpu_offload:
        out.append("training.megatron.optimizer_cpu_offload=true: the hybrid-device optimizer needs CUDA")
    if meg.use_precision_aware_optimizer:
        out.append(
            "training.megatron.use_precision_aware_optimizer=true: needs TransformerEngine's FusedAdam on CUDA"
        )
    if spec.optimizer.clip_grad > 0:
        out.append(
            f"training.optimizer.clip_grad={spec.optimizer.clip_grad}: megatron-core 0.16.1 clips only CUDA "
            "gradients; use clip_grad=0 on CPU (grad_norm is still reported)"
        )
    if meg.grouped_gemm and arch is not None and arch.is_moe:
        out.append("training.megatron.grouped_gemm=true: grouped GEMM kernels need CUDA")
    if arch is not None and arch.is_moe and spec.tp > 1:
        out.append(
            f"training.tp={spec.tp} with a mixture-of-experts model: Megatron needs sequence parallelism there, "
            "which the local layer spec's torch norm does not support; use ep for the experts and tp=1 on CPU"
        )
    if spec.params_dtype != "fp32":
        out.append(f"training.params_dtype='{spec.params_dtype}': mixed precision is validated on CUDA only")
    return out


def check_spec(spec: TrainingPoolSpec, arch: ModelSpec | None, cuda: bool) -> TrainLayout:
    """The layout of `spec` (DP = `layout.dp(spec.num_gpus)`), or the error listing every problem."""
    layout, _ = derive_layout(spec, arch)
    errors = spec_errors(spec, arch)
    if errors:
        raise InvalidTrainingSpecError("Invalid configuration:\n  - " + "\n  - ".join(errors))
    if not cuda:
        problems = cpu_not_validated(spec, arch)
        if problems:
            raise NotValidatedOnCPUError("Not validated on CPU:\n  - " + "\n  - ".join(problems))
    assert layout is not None
    return layout
