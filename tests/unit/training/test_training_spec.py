"""Training spec checks: derived layout, invalid configurations, and what is not validated on CPU."""

from __future__ import annotations

from dataclasses import replace

import pytest

from libra.config.mapping import cpu_config, training_pool_spec
from libra.training.spec import (
    InvalidTrainingSpecError,
    NotValidatedOnCPUError,
    TrainingPoolSpec,
    check_spec,
    derive_layout,
)
from planner.model_spec import ModelSpec

DENSE = ModelSpec(
    name="dense", model_type="llama", vocab_size=219, hidden_size=64, num_layers=4, num_attention_heads=4,
    num_kv_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1e4,
)
MOE = replace(DENSE, name="moe", model_type="qwen3_moe", num_experts=4, moe_intermediate_size=32, num_experts_per_tok=2,
              qk_norm=True)
BASE = training_pool_spec(cpu_config("/m"), num_gpus=8)

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
    dp = layout.dp(spec.num_gpus)
    assert (spec.num_gpus, layout.tp, layout.pp, layout.cp, dp) == expected
    assert f"DP{dp}" in layout.describe(spec.num_gpus)


INVALID = {
    "gpus-not-multiple": (replace(BASE, num_gpus=6, tp=4), DENSE,
                          "num_gpus=6: TP x PP x CP = 4 x 1 x 1 = 4 does not divide the 6 training GPUs"),
    "tp-does-not-divide-kv-heads": (replace(BASE, tp=4), DENSE, "tp=4: TP 4 does not divide the 2 KV heads"),
    "pp-does-not-divide-layers": (replace(BASE, num_gpus=3, pp=3), DENSE,
                                  "pp=3: PP 3 x virtual stages 1 = 3 does not divide the 4 layers"),
    "vpp-without-pp": (replace(BASE, vpp=2), DENSE, "vpp=2: 2 virtual stages need pipeline parallelism"),
    "ep-on-dense": (replace(BASE, ep=2), DENSE, "ep=2: EP 2 needs a mixture-of-experts model (dense is dense)"),
    "ep-does-not-divide-experts": (replace(BASE, ep=8), MOE, "ep=8: EP 8 does not divide the 4 experts"),
    "ep-outside-dp": (replace(BASE, num_gpus=4, tp=2, ep=4), MOE, "ep=4: EP 4 does not divide DP x CP = 2 x 1 = 2"),
    "zero-micro-batch": (replace(BASE, micro_batch_size=0), DENSE, "micro_batch_size=0 must be >= 1"),
    "bad-dtype": (replace(BASE, params_dtype="fp8"), DENSE, "params_dtype='fp8'"),  # type: ignore[arg-type]
    "zero-lr": (replace(BASE, optimizer=replace(BASE.optimizer, lr=0.0)), DENSE, "optimizer.lr=0.0 must be > 0"),
    "precision-aware-needs-dist-opt": (
        replace(BASE, megatron=replace(BASE.megatron, use_precision_aware_optimizer=True)), DENSE,
        "use_precision_aware_optimizer=true needs use_distributed_optimizer=true",
    ),
    "offload-fraction-range": (
        replace(BASE, megatron=replace(BASE.megatron, optimizer_offload_fraction=1.5)), DENSE, "optimizer_offload_fraction=1.5",
    ),
    "is-needs-recompute": (
        replace(BASE, recompute_logprobs=False, algorithm=replace(BASE.algorithm, is_correction=replace(BASE.algorithm.is_correction, enable=True))),
        DENSE, "is_correction.enable=true needs recompute_logprobs=true",
    ),
    "algorithm-errors-included": (
        replace(BASE, algorithm=replace(BASE.algorithm, clip_ratio_c=0.5)), DENSE, "training.algorithm.clip_ratio_c=0.5",
    ),
    "retention-keep-last": (
        replace(BASE, retention=replace(BASE.retention, keep_last=0)), DENSE, "retention.keep_last=0 must be >= 1",
    ),
}


@pytest.mark.parametrize("spec,arch,message", INVALID.values(), ids=INVALID.keys())
def test_invalid_specs(spec: TrainingPoolSpec, arch: ModelSpec, message: str) -> None:
    with pytest.raises(InvalidTrainingSpecError) as info:
        check_spec(spec, arch, cuda=True)
    assert message in str(info.value)
    assert str(info.value).startswith("Invalid configuration")


CPU_ONLY_ON_CUDA = {
    "context-parallel": (replace(BASE, cp=2), DENSE, "training.cp=2"),
    "distributed-optimizer": (
        replace(BASE, megatron=replace(BASE.megatron, use_distributed_optimizer=True)), DENSE, "use_distributed_optimizer",
    ),
    "cpu-offload": (
        replace(BASE, megatron=replace(BASE.megatron, use_distributed_optimizer=True, optimizer_cpu_offload=True)),
        DENSE, "optimizer_cpu_offload=true",
    ),
    "gradient-clipping": (replace(BASE, optimizer=replace(BASE.optimizer, clip_grad=1.0)), DENSE, "clip_grad=1.0"),
    "grouped-gemm-moe": (replace(BASE, megatron=replace(BASE.megatron, grouped_gemm=True)), MOE, "grouped_gemm=true"),
    "moe-with-tp": (replace(BASE, tp=2), MOE, "training.tp=2 with a mixture-of-experts model"),
    "bf16": (replace(BASE, params_dtype="bf16"), DENSE, "params_dtype='bf16'"),
}


@pytest.mark.parametrize("spec,arch,message", CPU_ONLY_ON_CUDA.values(), ids=CPU_ONLY_ON_CUDA.keys())
def test_not_validated_on_cpu_but_kept_on_gpu(spec: TrainingPoolSpec, arch: ModelSpec, message: str) -> None:
    assert check_spec(spec, arch, cuda=True).dp(spec.num_gpus) * spec.tp * spec.cp == 8  # the GPU path accepts it
    with pytest.raises(NotValidatedOnCPUError) as info:
        check_spec(spec, arch, cuda=False)
    assert message in str(info.value)
    assert str(info.value).startswith("Not validated on CPU")


def test_grouped_gemm_on_dense_model_runs_on_cpu() -> None:
    spec = replace(BASE, megatron=replace(BASE.megatron, grouped_gemm=True))
    assert check_spec(spec, DENSE, cuda=False).dp(spec.num_gpus) == 8


def test_every_problem_is_listed_once() -> None:
    spec = replace(BASE, micro_batch_size=0, optimizer=replace(BASE.optimizer, lr=-1.0), params_dtype="fp64")  # type: ignore[arg-type]
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
    spec = replace(BASE, model_path=model, num_gpus=4, tp=2, cp=2)
    if torch_cuda():
        assert TrainingPool(runtime, spec).layout.cp == 2
        return
    with pytest.raises(NotValidatedOnCPUError, match="training.cp=2"):
        TrainingPool(runtime, spec)
    with pytest.raises(InvalidTrainingSpecError, match="num_gpus=3"):
        TrainingPool(runtime, replace(spec, num_gpus=3, cp=1))


@pytest.mark.parametrize(("logical_gpus", "refused"), [pytest.param(False, False, id="gpu-cluster"),
                                                      pytest.param(True, True, id="logical-gpus")])
def test_a_controller_checks_the_pool_for_the_cluster_its_configuration_declares(
        monkeypatch: pytest.MonkeyPatch, logical_gpus: bool, refused: bool) -> None:
    """A controller on a node without CUDA (a CPU-only Ray head) that drives a GPU cluster: its pool accepts the
    GPU-only settings its workers will run; with logical GPUs declared it refuses them, naming each."""
    import os

    from libra import device
    from libra.cluster.ray_runtime import RayRuntime
    from libra.training.pool import TrainingPool

    monkeypatch.setattr(device, "cuda_available", lambda: False)
    monkeypatch.setattr(device, "_declared_logical_gpus", None)
    device.declare_pools_device(logical_gpus)
    model = os.path.join(os.path.dirname(__file__), "..", "..", "..", "configs", "models", "qwen2.5-7b")
    runtime = RayRuntime(address="", owned=False, namespace="unused")
    spec = replace(BASE, model_path=model, num_gpus=4, tp=2, cp=2, params_dtype="bf16",
                   optimizer=replace(BASE.optimizer, clip_grad=1.0))
    if not refused:
        assert TrainingPool(runtime, spec).layout.cp == 2
        return
    with pytest.raises(NotValidatedOnCPUError) as info:
        TrainingPool(runtime, spec)
    assert all(part in str(info.value) for part in ("training.cp=2", "clip_grad=1.0", "params_dtype='bf16'"))


def torch_cuda() -> bool:
    from libra.device import cuda_available

    return cuda_available()
