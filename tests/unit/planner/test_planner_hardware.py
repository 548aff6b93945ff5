"""Any GPU can be planned: the catalog (each entry with its source), `cluster.gpu_spec` for a GPU that is not in
it (or to correct one that is) carried from the configuration to the planner, and allowed_train_* values the
model cannot use pruned with a reason instead of refusing the job."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from planner_cases import ROOT

from libra.config import ConfigError, load_dict
from libra.planning import plan_job, planner_inputs
from planner.hardware import ALIASES, CATALOG, DESCRIBED_FIELDS, UnknownGPUError, describe_gpu, get_gpu

sys.path.insert(0, str(Path(ROOT) / "tests" / "unit" / "config"))
from config_bases import gpu_base  # noqa: E402

GB = 10**9
FULL = {"memory_gb": 64.0, "bf16_dense_tflops": 400.0, "hbm_tb_per_s": 2.5, "intra_node_gb_per_s": 200.0,
        "inter_node_gb_per_s": 25.0}


def test_catalog_entries_have_a_source_and_sane_figures() -> None:
    for name, gpu in CATALOG.items():
        assert gpu.name == name and gpu.source, name
        assert gpu.memory_bytes >= 4 * 2**30 and gpu.bf16_flops > 1e10 and gpu.hbm_bytes_per_s > 1e10, name
        assert gpu.intra_node_bytes_per_s >= gpu.inter_node_bytes_per_s > 0, name
    assert set(ALIASES.values()) <= set(CATALOG)


@pytest.mark.parametrize(("alias", "name", "memory_gb", "tflops"), [
    ("A800", "A800-SXM-80GB", 80, 312), ("H800", "H800-SXM-80GB", 80, 989), ("H20", "H20-96GB", 96, 148),
    ("A100-40GB", "A100-SXM-40GB", 40, 312), ("H100-PCIe", "H100-PCIe-80GB", 80, 756),
    ("H100-NVL", "H100-NVL-94GB", 94, 835), ("L20", "L20-48GB", 48, 119.5), ("L40", "L40-48GB", 48, 181),
    ("A10", "A10-24GB", 24, 125), ("MI300X", "MI300X-192GB", 192, 1307.4), ("mi325x", "MI325X-256GB", 256, 1307.4),
    ("GB200", "GB200-NVL72-186GB", 186, 2500), ("h200", "H200-SXM-141GB", 141, 989),
])
def test_common_gpus_are_in_the_catalog(alias: str, name: str, memory_gb: float, tflops: float) -> None:
    gpu = get_gpu(alias)
    assert (gpu.name, gpu.memory_bytes, gpu.bf16_flops) == (name, memory_gb * GB, pytest.approx(tflops * 1e12))


# (id, gpu_type, figures, expected GPUSpec fields or the missing figures)
DESCRIBE_CASES: list[tuple[str, str, dict[str, float], dict[str, Any] | tuple[str, ...]]] = [
    ("custom-complete", "custom", FULL, {"name": "custom", "memory_bytes": 64 * GB, "bf16_flops": 400e12,
                                         "inter_node_bytes_per_s": 25 * GB}),
    ("other-name-complete", "Gaudi3", FULL, {"name": "Gaudi3", "hbm_bytes_per_s": 2.5e12}),
    ("custom-missing-two", "custom", {"memory_gb": 64.0, "bf16_dense_tflops": 400.0, "hbm_tb_per_s": 2.5},
     ("intra_node_gb_per_s", "inter_node_gb_per_s")),
    ("unknown-undescribed", "H999", {}, tuple(DESCRIBED_FIELDS)),
    ("catalog-corrected", "H100", {"inter_node_gb_per_s": 12.5},
     {"name": "H100-SXM-80GB", "inter_node_bytes_per_s": 12.5 * GB, "memory_bytes": 80 * GB}),
    ("catalog-unchanged", "H100", {k: 0.0 for k in FULL}, {"name": "H100-SXM-80GB", "bf16_flops": 989e12}),
]


@pytest.mark.parametrize(("gpu_type", "figures", "expected"), [c[1:] for c in DESCRIBE_CASES],
                         ids=[c[0] for c in DESCRIBE_CASES])
def test_describe_gpu(gpu_type: str, figures: dict[str, float], expected: dict[str, Any] | tuple[str, ...]) -> None:
    if isinstance(expected, tuple):
        with pytest.raises(UnknownGPUError) as info:
            describe_gpu(gpu_type, figures)
        assert info.value.missing == expected
        assert all(name in str(info.value) for name in expected)
        return
    gpu = describe_gpu(gpu_type, figures)
    assert {k: getattr(gpu, k) for k in expected} == expected


def _config(**cluster: Any) -> dict[str, Any]:
    data = gpu_base()
    data["cluster"].update(cluster)
    data["global_resource_planner"] = {"initial_allocation_strategy": "grp"}
    return data


def test_gpu_spec_reaches_the_planner_and_changes_the_plan() -> None:
    described = planner_inputs(load_dict(_config(gpu_type="custom", gpu_spec={"name": "lab-gpu", **FULL})))
    gpu = described.cluster.gpu
    assert (gpu.name, gpu.memory_bytes, gpu.bf16_flops, gpu.hbm_bytes_per_s) == ("lab-gpu", 64 * GB, 400e12, 2.5e12)
    assert (gpu.intra_node_bytes_per_s, gpu.inter_node_bytes_per_s) == (200 * GB, 25 * GB)
    slow = plan_job(load_dict(_config(gpu_spec={"bf16_dense_tflops": 100.0})))
    fast = plan_job(load_dict(_config()))
    assert slow.chosen is not None and fast.chosen is not None
    assert slow.inputs.cluster.gpu.bf16_flops == 100e12
    assert slow.chosen.train["compute_s"] > fast.chosen.train["compute_s"]


def test_h20_and_a800_jobs_plan() -> None:
    for gpu_type in ("H20", "A800"):
        job = plan_job(load_dict(_config(gpu_type=gpu_type)))
        assert job.feasible and job.inputs.cluster.gpu.name == get_gpu(gpu_type).name


def test_incomplete_gpu_spec_names_each_missing_field() -> None:
    with pytest.raises(ConfigError) as info:
        load_dict(_config(gpu_type="custom", gpu_spec={"memory_gb": 64.0, "bf16_dense_tflops": 400.0}))
    paths = sorted(e.path for e in info.value.errors)
    assert paths == sorted(f"cluster.gpu_spec.{n}" for n in ("hbm_tb_per_s", "intra_node_gb_per_s",
                                                              "inter_node_gb_per_s"))


# ------------------------------------------------------------------------------------ allowed lists prune
MOE_8_EXPERTS = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 1024,
                 "intermediate_size": 3072, "moe_intermediate_size": 512, "num_hidden_layers": 8,
                 "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64, "num_experts": 8,
                 "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 32000,
                 "max_position_embeddings": 8192, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                 "hidden_act": "silu"}


def _moe_config(tmp_path: Path, **planner: Any) -> dict[str, Any]:
    (tmp_path / "moe8").mkdir()
    (tmp_path / "moe8" / "config.json").write_text(json.dumps(MOE_8_EXPERTS))
    data = _config()
    data.update(model_path=str(tmp_path / "moe8"), max_model_len=4096, max_new_tokens=2048)
    data["global_resource_planner"].update(planner)
    return data


def test_allowed_values_the_model_cannot_use_are_pruned_with_a_reason(tmp_path: Path) -> None:
    cfg = load_dict(_moe_config(tmp_path, allowed_train_ep=[1, 2, 4, 8, 16], allowed_train_tp=[1, 2, 4, 8],
                                allowed_train_pp=[1, 2, 3]))
    warned = [w for w in cfg.warnings if w.endswith("[planner.allowed_pruned]")]
    assert [w.split(" =")[0] for w in warned] == ["global_resource_planner.allowed_train_tp[3]",
                                                  "global_resource_planner.allowed_train_pp[2]",
                                                  "global_resource_planner.allowed_train_ep[4]"]
    job = plan_job(cfg)
    assert job.feasible and job.chosen is not None
    codes = {(p.code, p.layout.ep if p.code == "ep_experts" else None) for p in job.pruned if p.layout is not None}
    assert ("ep_experts", 16) in codes and ("tp_kv_heads", None) in codes and ("pp_layers", None) in codes
    assert job.chosen.candidate.layout.ep in (1, 2, 4, 8)


def test_an_allowed_list_with_no_usable_value_is_an_error_naming_what_works(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_dict(_moe_config(tmp_path, allowed_train_ep=[16, 32]))
    (issue,) = info.value.errors
    assert issue.path == "global_resource_planner.allowed_train_ep" and issue.rule_id == "planner.allowed_usable"
    assert "{1, 2, 4, 8}" in issue.fix
