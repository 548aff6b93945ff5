"""Loading: many mistakes in one report, unknown keys, strict types, enums, --set overrides, YAML 1.2
scalars, path resolution, round trips and the Config helpers."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from config_bases import MODELS, REPO, gpu_base, with_changes

from libra.config import Config, ConfigError, ConfigIssue, dump, load, load_dict
from libra.config.errors import INVALID, NOT_IMPLEMENTED, NOT_VALIDATED
from libra.config.fields import OptionInfo, choices_of, options
from libra.config.typecheck import Walker
from libra.config.yaml_io import dump_yaml

GRP = "global_resource_planner"


def write(tmp_path: Path, text: str, name: str = "job.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def errors_of(data: dict[str, Any], overrides: list[str] | None = None) -> list[ConfigIssue]:
    with pytest.raises(ConfigError) as info:
        load_dict(data, overrides=overrides or [])
    return info.value.errors


# --- many mistakes at once -------------------------------------------------------------------------------

FIVE_MISTAKES = f"""
model_path: {MODELS / 'qwen2.5-7b'}
cluster: {{num_nodes: 2, gpus_per_node: 8, gpu_type: H100}}
train_gpus: 8
rollout_gpus: 8
train_tp_size: 2
batch_size: 3            # 3 x 2 = 6 samples, not divisible by DP 4
n_samples: 2
max_new_tokens: "512"    # a string
rollout_weight_sync_mode: nccl
algorithm:
  clip_ratio_c: 0.5      # must be > 1
optimizer:
  learning_rate: 1.0e-6  # unknown key
global_resource_planner:
  initial_allocation_strategy: configured
"""


def test_five_independent_mistakes_reported_together(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load(write(tmp_path, FIVE_MISTAKES))
    found = {(e.path, e.kind) for e in info.value.errors}
    assert found == {
        ("batch_size", INVALID),
        ("max_new_tokens", INVALID),
        ("rollout_weight_sync_mode", NOT_IMPLEMENTED),
        ("algorithm.clip_ratio_c", INVALID),
        ("optimizer.learning_rate", INVALID),
    }
    report = str(info.value)
    assert report.startswith("5 configuration errors in ")
    assert report.index("Invalid configuration (4):") < report.index("Not implemented (1):")


def test_mistakes_of_every_class_in_one_report(tmp_path: Path) -> None:
    data = {
        "model_path": str(tmp_path / "tiny"),
        "build_tiny_model": {"enabled": True, "num_kv_heads": 3},
        "cluster": {"num_nodes": 1, "gpus_per_node": 4, "gpu_type": "cpu-logical", "logical_gpus": True},
        "train_gpus": 2, "rollout_gpus": 2, "batch_size": 8, "n_samples": 4, "max_model_len": 512,
        "max_new_tokens": 16, "rollout_kv_cache_bytes": 1 << 26, "megatron_use_cpu_initialization": True,
        "megatron_use_distributed_optimizer": True,     # Not validated on CPU
        "optimizer": {"clip_grad": 1.0},                # Not validated on CPU
        "train_backend": "deepspeed",                   # Not implemented
        "sync_interval": 0,                             # range
        "tracking": {"consol": "plain"},                # unknown key
    }
    errors = errors_of(data)
    by_path = {e.path: e for e in errors}
    assert by_path["megatron_use_distributed_optimizer"].kind == NOT_VALIDATED
    assert by_path["optimizer.clip_grad"].kind == NOT_VALIDATED
    assert by_path["train_backend"].kind == NOT_IMPLEMENTED
    assert by_path["sync_interval"].rule_id == "range"
    assert by_path["tracking.consol"].fix == "did you mean tracking.console?"
    assert by_path["build_tiny_model.num_kv_heads"].rule_id == "tiny.shape"
    assert len(errors) == 6


def test_bad_option_does_not_cascade_into_cross_field_errors() -> None:
    errors = errors_of(with_changes(gpu_base(), {"train_tp_size": "two", "batch_size": "16"}))
    assert sorted(e.path for e in errors) == ["batch_size", "train_tp_size"]


# --- unknown keys ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("changes", "path", "fix"), [
    ({"n_sample": 8}, "n_sample", "did you mean n_samples?"),
    ({"cluster.num_node": 2}, "cluster.num_node", "did you mean cluster.num_nodes?"),
    ({"num_nodes": 2}, "num_nodes", "did you mean cluster.num_nodes? (the option lives in another section)"),
    ({"initial_allocation_strategy": "grp"}, "initial_allocation_strategy",
     f"did you mean {GRP}.initial_allocation_strategy? (the option lives in another section)"),
    ({"algorithm.ref_kl.kl_typ": "k2"}, "algorithm.ref_kl.kl_typ", "did you mean algorithm.ref_kl.kl_type?"),
], ids=["top-level", "in-section", "wrong-section", "planner-option-at-top", "nested-section"])
def test_unknown_keys_suggest_the_option(changes: dict[str, Any], path: str, fix: str) -> None:
    (issue,) = errors_of(with_changes(gpu_base(), changes))
    assert (issue.path, issue.rule_id, issue.fix) == (path, "unknown_key", fix)


def test_unknown_key_without_close_match_lists_the_section() -> None:
    (issue,) = errors_of(with_changes(gpu_base(), {"tracking.zzzzzz": 1}))
    assert issue.fix.startswith("remove it; the options of section tracking are: backends, prometheus_port")


# --- strict types ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("path", "value", "rule"), [
    ("train_gpus", "8", "expected int, got a string"),
    ("train_gpus", True, "expected int, got a boolean"),
    ("train_gpus", 8.0, "expected int, got a number with a fraction"),
    ("train_gpus", [8], "expected int, got a list"),
    ("train_gpus", None, "expected int, got null"),
    ("recompute_logprobs", 1, "expected bool, got an integer"),
    ("recompute_logprobs", "true", "expected bool, got a string"),
    ("model_path", 7, "expected str, got an integer"),
    ("algorithm.clip_ratio_high", "0.3", "expected float, got a string"),
    ("algorithm.clip_ratio_high", False, "expected float, got a boolean"),
    ("rollout_endpoints", "http://a:1", "expected a list of str, got a string"),
    ("task.params", [1], "expected a mapping, got a list"),
    ("cluster", [1, 2], "expected a section (mapping of options), got a list"),
], ids=lambda v: str(v)[:20])
def test_type_errors_are_never_cast(path: str, value: Any, rule: str) -> None:
    errors = errors_of(with_changes(gpu_base(), {path: value}))
    assert [(e.path, e.rule, e.rule_id) for e in errors] == [(path, rule, "type")]


def test_int_widens_to_float_only() -> None:
    cfg = load_dict(with_changes(gpu_base(), {"algorithm.clip_ratio_c": 3, "optimizer.weight_decay": 0}))
    assert isinstance(cfg.algorithm.clip_ratio_c, float) and cfg.algorithm.clip_ratio_c == 3.0
    assert isinstance(cfg.optimizer.weight_decay, float)


def test_optional_int_accepts_null_and_int() -> None:
    assert load_dict(with_changes(gpu_base(), {f"{GRP}.elastic_hybrid_max_workers": None})).warnings
    cfg = load_dict(with_changes(gpu_base(), {f"{GRP}.elastic_hybrid_max_workers": 3}))
    assert cfg.global_resource_planner.elastic_hybrid_max_workers == 3


# --- every enum: valid and invalid values ----------------------------------------------------------------

def _enum_options(cls: type = Config, prefix: str = "") -> list[tuple[str, OptionInfo]]:
    found: list[tuple[str, OptionInfo]] = []
    for name, info in options(cls).items():
        if info.is_section:
            found += _enum_options(info.type, f"{prefix}{name}.")
        elif choices_of(info.type):
            found.append((f"{prefix}{name}", info))
    return found


ENUMS = _enum_options()
ENUM_VALUES = [(path, value) for path, info in ENUMS for value in choices_of(info.type)]


def _walk(path: str, value: Any) -> list[ConfigIssue]:
    data: dict[str, Any] = with_changes({"model_path": "m"}, {path: value})
    walker = Walker(Config)
    walker.section(Config, data)
    return walker.result.issues


def test_enum_table_covers_the_schema() -> None:
    assert len(ENUMS) >= 20
    assert "tracking.console" in dict(ENUMS) and "algorithm.is_correction.level" in dict(ENUMS)
    assert {"initial_allocation_strategy", "runtime_rollout_reconfigure_strategy"} <= {p.split(".")[-1] for p, _ in ENUMS}


@pytest.mark.parametrize(("path", "value"), ENUM_VALUES, ids=[f"{p}={v}" for p, v in ENUM_VALUES])
def test_every_enum_value_is_accepted(path: str, value: Any) -> None:
    is_list = typing.get_origin(dict(ENUMS)[path].type) is tuple
    assert _walk(path, [value] if is_list else value) == []


@pytest.mark.parametrize("path", [p for p, _ in ENUMS])
def test_every_enum_rejects_other_values(path: str) -> None:
    is_list = typing.get_origin(dict(ENUMS)[path].type) is tuple
    issues = _walk(path, ["not-a-choice"] if is_list else "not-a-choice")
    assert [(i.path, i.rule_id) for i in issues] == [(f"{path}[0]" if is_list else path, "choice")]
    assert "one of" in issues[0].fix


def test_enum_suggests_closest_choice() -> None:
    (issue,) = errors_of(with_changes(gpu_base(), {f"{GRP}.runtime_rollout_reconfigure_strategy": "blue-green"}))
    assert issue.fix.startswith("did you mean blue_green?")


# --- --set overrides -------------------------------------------------------------------------------------

def test_overrides_are_yaml_typed_and_last_wins(tmp_path: Path) -> None:
    path = write(tmp_path, yaml.safe_dump(gpu_base()))
    cfg = load(path, [
        "train_tp_size=4", "train_tp_size=1",            # last wins
        "algorithm.clip_ratio_high=0.3",
        "recompute_logprobs=false",
        "global_resource_planner.allowed_train_tp=[1, 2]",
        "tracking.console=off",
        "task.params.modulus=7",
        "name=my-run",
        "optimizer.lr=2e-6",
    ])
    assert cfg.train_tp_size == 1 and cfg.train_dp_size == 8
    assert cfg.algorithm.clip_ratio_high == 0.3
    assert cfg.recompute_logprobs is False
    assert cfg.global_resource_planner.allowed_train_tp == (1, 2)
    assert cfg.tracking.console == "off"
    assert cfg.task.params == {"modulus": 7}
    assert cfg.name == "my-run" and cfg.run_dir == "runs/my-run"
    assert cfg.optimizer.lr == 2e-6


def test_override_creates_missing_section() -> None:
    data = gpu_base()
    del data["cluster"]
    cfg = load_dict(data, overrides=["cluster.num_nodes=2"])
    assert cfg.cluster.num_nodes == 2


@pytest.mark.parametrize(("override", "path", "rule_id", "fix_part"), [
    ("train_tp_sise=2", "train_tp_sise", "unknown_key", "did you mean train_tp_size?"),
    ("cluster.gpu_typ=H100", "cluster.gpu_typ", "unknown_key", "did you mean cluster.gpu_type?"),
    ("num_nodes=2", "num_nodes", "unknown_key", "did you mean cluster.num_nodes?"),
    ("train_tp_size", "--set train_tp_size", "override.syntax", "KEY=VALUE"),
    ("train_tp_size=two", "train_tp_size", "type", "number"),
], ids=["typo", "section-typo", "wrong-section", "no-equals", "typed-value"])
def test_bad_overrides(override: str, path: str, rule_id: str, fix_part: str) -> None:
    errors = errors_of(gpu_base(), [override])
    assert [(e.path, e.rule_id) for e in errors] == [(path, rule_id)]
    assert fix_part in errors[0].fix


# --- YAML reading ----------------------------------------------------------------------------------------

def test_yaml_12_scalars(tmp_path: Path) -> None:
    text = yaml.safe_dump(gpu_base()) + "tracking: {console: off}\noptimizer: {lr: 1e-6, min_lr: 0}\n"
    cfg = load(write(tmp_path, text))
    assert cfg.tracking.console == "off" and cfg.optimizer.lr == 1e-6


def test_yaml_11_booleans_are_strings(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load(write(tmp_path, yaml.safe_dump(gpu_base()) + "recompute_logprobs: yes\n"))
    (issue,) = info.value.errors
    assert (issue.path, issue.value, issue.rule_id) == ("recompute_logprobs", "yes", "type")
    assert issue.fix == "write true or false, without quotes"


def test_duplicate_keys_are_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load(write(tmp_path, yaml.safe_dump(gpu_base()) + "batch_size: 32\n"))
    assert [e.rule_id for e in info.value.errors] == ["yaml.duplicate_key"]


def test_yaml_syntax_error_names_the_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load(write(tmp_path, "model_path: x\ncluster: [1, 2\n"))
    (issue,) = info.value.errors
    assert issue.rule_id == "yaml.syntax" and "line" in issue.rule


def test_missing_file_is_one_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load(str(tmp_path / "absent.yaml"))
    assert [e.rule_id for e in info.value.errors] == ["yaml.unreadable"]


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load(write(tmp_path, "- 1\n- 2\n"))
    assert [e.rule_id for e in info.value.errors] == ["type", "required"]


def test_empty_section_is_accepted(tmp_path: Path) -> None:
    cfg = load(write(tmp_path, yaml.safe_dump(gpu_base()) + "checkpoint:\n"))
    assert cfg.checkpoint.keep_last == 2


# --- paths -----------------------------------------------------------------------------------------------

def test_relative_model_path_resolves_against_yaml_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = load(str(REPO / "configs" / "qwen2.5-7b-8gpu.yaml"))
    assert cfg.model_path == str(MODELS / "qwen2.5-7b") == cfg.model_dir() == cfg.tokenizer_path


def test_relative_path_falls_back_to_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    data = with_changes(gpu_base(), {"model_path": "configs/models/qwen2.5-7b"})
    path = write(tmp_path, yaml.safe_dump(data))
    assert load(path).model_path == str(MODELS / "qwen2.5-7b")


def test_dataset_path_resolves_against_yaml_dir(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("".join(f'{{"prompt": "{i}", "answer": "{i}"}}\n' for i in range(16)))
    data = with_changes(gpu_base(), {"task.name": "dataset", "task.dataset_path": "data/train.jsonl"})
    cfg = load(write(tmp_path, yaml.safe_dump(data)))
    assert cfg.task.dataset_path == str(tmp_path / "data" / "train.jsonl")


# --- round trip, helpers, immutability -------------------------------------------------------------------

@pytest.mark.parametrize("name", ["dev", "qwen3-235b-a22b-256gpu"])
def test_dump_round_trips(name: str) -> None:
    cfg = load(str(REPO / "configs" / f"{name}.yaml"))
    data = dump(cfg)
    assert load_dict(data) == cfg
    assert load_dict(yaml.safe_load(dump_yaml(data))) == cfg
    assert "warnings" not in data and "source" not in data


def test_config_is_frozen_and_has_helpers() -> None:
    cfg = load_dict(gpu_base())
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train_gpus = 4  # type: ignore[misc]
    assert cfg.train_dp_size == 4 and cfg.samples_per_step == 128 and cfg.num_rollout_instances == 8
    assert cfg.effective_max_concurrent_rollouts == 128 and cfg.effective_expected_response_tokens == 512
    assert cfg.model_spec().num_layers == 28
    assert cfg.name == "libra" and cfg.run_dir == "runs/libra"


def test_config_error_is_a_value_error_listing_every_issue() -> None:
    with pytest.raises(ValueError) as info:
        load_dict(with_changes(gpu_base(), {"train_gpus": "x", "n_samples": 0}))
    err = info.value
    assert isinstance(err, ConfigError) and len(err.errors) == 2
    assert all(str(e) in str(err) for e in err.errors)
