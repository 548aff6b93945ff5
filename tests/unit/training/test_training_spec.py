"""Training spec checks: derived layout, invalid configurations, and what is not validated on CPU."""

from __future__ import annotations

from dataclasses import replace

import pytest

from libra.algo.spec import AlgorithmSpec, ISCorrectionSpec
from libra.training.hf_arch import HFArch
from libra.training.spec import (
    CheckpointRetention,
    InvalidTrainingSpecError,
    MegatronOptions,
    NotValidatedOnCPUError,
    OptimizerSpec,
    TrainingPoolSpec,
    check_spec,
    derive_layout,
)

DENSE = HFArch(
    model_type="llama", vocab_size=219, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
    ffn_hidden_size=128, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1e4,
    tie_word_embeddings=False, qkv_bias=False, qk_layernorm=False,
)
MOE = replace(DENSE, model_type="qwen3_moe", num_experts=4, moe_ffn_hidden_size=32, moe_topk=2, qk_layernorm=True)
BASE = TrainingPoolSpec(model_path="/m", num_gpus=8)

LAYOUTS = {
    "dp8": (BASE, (8, 1, 1, 1, 8)),
    "tp2-pp2-dp2": (replace(BASE, tp=2, pp=2), (8, 2, 2, 1, 2)),
    "tp2-cp2-dp2": (replace(BASE, tp=2, cp=2), (8, 2, 1, 2, 2)),
    "pp2-vpp2": (replace(BASE, num_gpus=2, pp=2, vpp=2), (2, 1, 2, 1, 1)),
}


@pytest.mark.parametrize("spec,expected", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_derive_layout(spec: TrainingPoolSpec, expected: tuple[int, ...]) -> None:
    layout, errors = derive_layout(spec, DENSE)
    assert errors == []
    assert layout is not None
    assert (layout.world, layout.tp, layout.pp, layout.cp, layout.dp) == expected
    assert f"DP {layout.dp}" in layout.describe()


INVALID = {
    "gpus-not-multiple": (replace(BASE, num_gpus=6, tp=4), DENSE, "num_gpus=6 is not divisible by TP x PP x CP"),
    "tp-does-not-divide-kv-heads": (replace(BASE, tp=4), DENSE, "must divide num_attention_heads=4 and num_key_value_heads=2"),
    "pp-does-not-divide-layers": (replace(BASE, num_gpus=3, pp=3), DENSE, "does not divide the model's num_hidden_layers=4"),
    "vpp-without-pp": (replace(BASE, vpp=2), DENSE, "vpp=2 needs pp > 1"),
    "ep-on-dense": (replace(BASE, ep=2), DENSE, "needs a mixture-of-experts model"),
    "ep-does-not-divide-experts": (replace(BASE, ep=8), MOE, "ep=8 must divide num_experts=4"),
    "zero-micro-batch": (replace(BASE, micro_batch_size=0), DENSE, "micro_batch_size=0 must be >= 1"),
    "bad-dtype": (replace(BASE, params_dtype="fp8"), DENSE, "params_dtype='fp8'"),  # type: ignore[arg-type]
    "zero-lr": (replace(BASE, optimizer=OptimizerSpec(lr=0.0)), DENSE, "optimizer.lr=0.0 must be > 0"),
    "precision-aware-needs-dist-opt": (
        replace(BASE, megatron=MegatronOptions(use_precision_aware_optimizer=True)), DENSE,
        "use_precision_aware_optimizer=true needs use_distributed_optimizer=true",
    ),
    "offload-fraction-range": (
        replace(BASE, megatron=MegatronOptions(optimizer_offload_fraction=1.5)), DENSE, "optimizer_offload_fraction=1.5",
    ),
    "is-needs-recompute": (
        replace(BASE, recompute_logprobs=False, algorithm=AlgorithmSpec(is_correction=ISCorrectionSpec(enable=True))),
        DENSE, "is_correction.enable=true needs recompute_logprobs=true",
    ),
    "algorithm-errors-included": (
        replace(BASE, algorithm=AlgorithmSpec(clip_ratio_c=0.5)), DENSE, "training.algorithm.clip_ratio_c=0.5",
    ),
    "retention-keep-last": (
        replace(BASE, retention=CheckpointRetention(keep_last=0)), DENSE, "retention.keep_last=0 must be >= 1",
    ),
}


@pytest.mark.parametrize("spec,arch,message", INVALID.values(), ids=INVALID.keys())
def test_invalid_specs(spec: TrainingPoolSpec, arch: HFArch, message: str) -> None:
    with pytest.raises(InvalidTrainingSpecError) as info:
        check_spec(spec, arch, cuda=True)
    assert message in str(info.value)
    assert str(info.value).startswith("Invalid configuration")


CPU_ONLY_ON_CUDA = {
    "context-parallel": (replace(BASE, cp=2), DENSE, "training.cp=2"),
    "distributed-optimizer": (
        replace(BASE, megatron=MegatronOptions(use_distributed_optimizer=True)), DENSE, "use_distributed_optimizer",
    ),
    "cpu-offload": (
        replace(BASE, megatron=MegatronOptions(use_distributed_optimizer=True, optimizer_cpu_offload=True)),
        DENSE, "optimizer_cpu_offload=true",
    ),
    "gradient-clipping": (replace(BASE, optimizer=OptimizerSpec(clip_grad=1.0)), DENSE, "clip_grad=1.0"),
    "grouped-gemm-moe": (replace(BASE, megatron=MegatronOptions(grouped_gemm=True)), MOE, "grouped_gemm=true"),
    "moe-with-tp": (replace(BASE, tp=2), MOE, "training.tp=2 with a mixture-of-experts model"),
    "bf16": (replace(BASE, params_dtype="bf16"), DENSE, "params_dtype='bf16'"),
}


@pytest.mark.parametrize("spec,arch,message", CPU_ONLY_ON_CUDA.values(), ids=CPU_ONLY_ON_CUDA.keys())
def test_not_validated_on_cpu_but_kept_on_gpu(spec: TrainingPoolSpec, arch: HFArch, message: str) -> None:
    assert check_spec(spec, arch, cuda=True).world == 8  # the GPU path accepts it
    with pytest.raises(NotValidatedOnCPUError) as info:
        check_spec(spec, arch, cuda=False)
    assert message in str(info.value)
    assert str(info.value).startswith("Not validated on CPU")


def test_grouped_gemm_on_dense_model_runs_on_cpu() -> None:
    spec = replace(BASE, megatron=MegatronOptions(grouped_gemm=True))
    assert check_spec(spec, DENSE, cuda=False).dp == 8


def test_every_problem_is_listed_once() -> None:
    spec = replace(BASE, micro_batch_size=0, optimizer=OptimizerSpec(lr=-1.0), params_dtype="fp64")  # type: ignore[arg-type]
    with pytest.raises(InvalidTrainingSpecError) as info:
        check_spec(spec, DENSE, cuda=True)
    assert str(info.value).count("\n  - ") == 3


def test_pool_refuses_cpu_only_gaps_before_placing_workers() -> None:
    """The pool checks the spec against the model's config.json in its constructor: nothing is started."""
    import os

    from libra.cluster.ray_runtime import RayRuntime
    from libra.training.pool import TrainingPool

    model = os.path.join(os.path.dirname(__file__), "..", "..", "..", "configs", "models", "qwen2.5-7b")
    runtime = RayRuntime(address="", owned=False, namespace="unused")
    spec = TrainingPoolSpec(model_path=model, num_gpus=4, tp=2, cp=2)
    if torch_cuda():
        assert TrainingPool(runtime, spec).layout.cp == 2
        return
    with pytest.raises(NotValidatedOnCPUError, match="training.cp=2"):
        TrainingPool(runtime, spec)
    with pytest.raises(InvalidTrainingSpecError, match="num_gpus=3"):
        TrainingPool(runtime, replace(spec, num_gpus=3, cp=1))


def torch_cuda() -> bool:
    from libra.device import cuda_available

    return cuda_available()
