"""What a training pool is asked to run: `TrainingPoolSpec` (layout, batch, algorithm, optimizer, Megatron
options, checkpoint retention), `TrainSample`, and the checks that turn a bad spec into one clear error.

Parallel sizes are derived and checked here in one place (`derive_layout`), every factor printed.
Problems are collected, not raised one by one: `InvalidTrainingSpecError` for a spec that cannot work
anywhere, `NotValidatedOnCPUError` for a layout or option that megatron-core 0.16.1 runs only on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from libra.algo.spec import AlgorithmSpec
from libra.observability.phase_trace import TraceSettings
from libra.training.hf_arch import HFArch

PARAMS_DTYPES = ("fp32", "bf16", "fp16")


class InvalidTrainingSpecError(ValueError):
    """Invalid configuration: the training spec cannot run on any machine."""


class NotValidatedOnCPUError(RuntimeError):
    """Not validated: megatron-core 0.16.1 runs this layout/option only with CUDA (the GPU path keeps it)."""


@dataclass(frozen=True)
class OptimizerSpec:
    """Adam settings (Megatron `OptimizerConfig`) and a linear-warmup-then-constant learning rate."""

    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 0.0
    lr_warmup_steps: int = 0


@dataclass(frozen=True)
class MegatronOptions:
    """Megatron switches passed through by name (OptimizerConfig / TransformerConfig / DDP config fields)."""

    use_precision_aware_optimizer: bool = False
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 1.0
    use_cpu_initialization: bool = False
    grouped_gemm: bool = False
    use_distributed_optimizer: bool = False


@dataclass(frozen=True)
class CheckpointRetention:
    """Keep the newest `keep_last` checkpoints and, in addition, every step that is a multiple of
    `keep_every` (0 = none)."""

    keep_last: int = 2
    keep_every: int = 0


@dataclass(frozen=True)
class TrainingPoolSpec:
    """A Megatron-Core training pool: `num_gpus` workers laid out as TP x PP x CP x DP (EP inside DP)."""

    model_path: str
    num_gpus: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    vpp: int = 1
    micro_batch_size: int = 1
    recompute_logprobs: bool = True
    recompute_micro_batch_size: int = 1
    algorithm: AlgorithmSpec = field(default_factory=AlgorithmSpec)
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    megatron: MegatronOptions = field(default_factory=MegatronOptions)
    seed: int = 0
    run_dir: str = ""
    params_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    retention: CheckpointRetention = field(default_factory=CheckpointRetention)
    call_timeout_s: float = 3600.0
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


@dataclass(frozen=True)
class Layout:
    """Derived parallel sizes of a pool."""

    world: int
    tp: int
    pp: int
    cp: int
    ep: int
    vpp: int
    dp: int

    def describe(self) -> str:
        return (
            f"world={self.world} = TP {self.tp} x PP {self.pp} x CP {self.cp} x DP {self.dp} "
            f"(EP {self.ep} inside TPxDP, VPP {self.vpp})"
        )


def derive_layout(spec: TrainingPoolSpec, arch: HFArch | None = None) -> tuple[Layout | None, list[str]]:
    """The layout of `spec` and every problem with it (checked against `arch` when given)."""
    errors: list[str] = []
    for name in ("num_gpus", "tp", "pp", "cp", "ep", "vpp", "micro_batch_size", "recompute_micro_batch_size"):
        value = getattr(spec, name)
        if value < 1:
            errors.append(f"training.{name}={value} must be >= 1")
    if errors:
        return None, errors
    model_parallel = spec.tp * spec.pp * spec.cp
    if spec.num_gpus % model_parallel:
        errors.append(
            f"training.num_gpus={spec.num_gpus} is not divisible by TP x PP x CP = {spec.tp} x {spec.pp} x {spec.cp}"
            f" = {model_parallel}; choose num_gpus as a multiple of {model_parallel}"
        )
        return None, errors
    layout = Layout(
        world=spec.num_gpus, tp=spec.tp, pp=spec.pp, cp=spec.cp, ep=spec.ep, vpp=spec.vpp,
        dp=spec.num_gpus // model_parallel,
    )
    if spec.vpp > 1 and spec.pp == 1:
        errors.append(f"training.vpp={spec.vpp} needs pp > 1")
    if spec.ep > 1 and (spec.num_gpus // spec.pp) % (spec.ep * spec.tp):
        errors.append(
            f"training.ep={spec.ep}: num_gpus / PP = {spec.num_gpus // spec.pp} must be divisible by EP x TP "
            f"= {spec.ep * spec.tp}"
        )
    if arch is not None:
        chunks = spec.pp * spec.vpp
        if arch.num_layers % chunks:
            errors.append(
                f"training.pp x vpp = {chunks} does not divide the model's num_hidden_layers={arch.num_layers}"
            )
        if arch.num_heads % spec.tp or arch.num_kv_heads % spec.tp:
            errors.append(
                f"training.tp={spec.tp} must divide num_attention_heads={arch.num_heads} and "
                f"num_key_value_heads={arch.num_kv_heads}"
            )
        if spec.ep > 1 and not arch.is_moe:
            errors.append(f"training.ep={spec.ep} needs a mixture-of-experts model; {arch.model_type} is dense")
        if arch.is_moe and arch.num_experts % spec.ep:
            errors.append(f"training.ep={spec.ep} must divide num_experts={arch.num_experts}")
    return layout, errors


def spec_errors(spec: TrainingPoolSpec, arch: HFArch | None = None) -> list[str]:
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


def cpu_not_validated(spec: TrainingPoolSpec, arch: HFArch | None = None) -> list[str]:
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


def check_spec(spec: TrainingPoolSpec, arch: HFArch | None, cuda: bool) -> Layout:
    """The layout of `spec`, or the error listing every problem."""
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
