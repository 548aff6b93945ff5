"""The example job files validate, and the generated documentation is fresh and complete."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from config_bases import REPO

from libra.config import RULES, load
from libra.config.fields import options
from libra.config.reference import STRUCTURAL_CHECKS, render_reference, render_validation
from libra.config.schema import Config

EXAMPLES = sorted((REPO / "configs").glob("*.yaml"))
MANUAL = REPO / "cluster_manual"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_config_reference", REPO / "scripts" / "gen_config_reference.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_expected_examples_exist() -> None:
    names = {p.stem for p in EXAMPLES}
    assert {"dev", "qwen2.5-7b-8gpu", "qwen2.5-32b-32gpu", "qwen3-30b-a3b-64gpu", "qwen3-235b-a22b-256gpu"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_validates_without_warnings(path: Path) -> None:
    cfg = load(str(path))
    assert cfg.warnings == []
    assert cfg.name == path.stem


def test_dev_example_runs_on_this_machine() -> None:
    cfg = load(str(REPO / "configs" / "dev.yaml"))
    assert cfg.cluster.logical_gpus and cfg.cluster.gpu_type == "cpu-logical" and cfg.total_gpus == 4
    assert cfg.build_tiny_model.enabled and cfg.phase_trace_enabled and cfg.task.name == "copy_first"
    assert cfg.global_resource_planner.initial_allocation_strategy == "grp"
    assert cfg.train_gpus == 2 and cfg.rollout_gpus == 2


def test_generated_files_are_fresh() -> None:
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_config_reference.py"), "--check"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_check_detects_a_stale_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = _script()
    monkeypatch.setattr(script, "ROOT", str(tmp_path))
    assert script.main([]) == 0                      # writes both files
    assert script.main(["--check"]) == 0
    (tmp_path / "cluster_manual" / "validation.md").write_text("stale\n")
    assert script.main(["--check"]) == 1


def _all_paths(cls: type = Config, prefix: str = "") -> list[str]:
    out = []
    for name, info in options(cls).items():
        if info.is_section:
            out += _all_paths(info.type, f"{prefix}{name}.")
        else:
            out.append(f"{prefix}{name}")
    return out


def test_reference_documents_every_option() -> None:
    text = render_reference()
    missing = [p for p in _all_paths() if f"| `{p}` |" not in text]
    assert missing == []


def test_reference_covers_the_contract_names() -> None:
    contract = (REPO.parent / "shared" / "reference" / "libra_configuration_reference.md")
    if not contract.exists():
        pytest.skip("reference contract not present in this checkout")
    text = render_reference()
    names = ["initial_allocation_strategy", "allocation_granularity_gpus", "min_train_gpus", "min_rollout_gpus",
             "elastic_hybrid_max_workers", "rollout_weight_reload_strategy", "sync_interval"]
    for name in names:
        assert name in contract.read_text() and name in text


def test_validation_doc_lists_every_rule_id() -> None:
    text = (MANUAL / "validation.md").read_text()
    assert text == render_validation()
    for rule in RULES:
        assert f"`{rule.id}`" in text
    for rule_id, _ in STRUCTURAL_CHECKS:
        assert f"`{rule_id}`" in text
