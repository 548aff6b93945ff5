"""Every configuration option reaches a consumer, or is refused or warned about by a named rule, or is a named
exemption (`libra.config.consumers`). Each declared consumer is checked for real: the option is changed from
its default and the pool spec / planner input / desired state / task spec built from the configuration must
change with it; code named as a reader must read it."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import os
import textwrap
import types
import typing
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from config_bases import gpu_base

from libra.config import RULES, Config, load_dict
from libra.config.consumers import CONSUMERS, EXEMPT
from libra.config.fields import choices_of, options
from libra.config.mapping import tiny_model_spec
from libra.controller.allocation import configured_allocation
from libra.controller.pools import rollout_spec, training_spec
from libra.data.registry import TaskSpec
from libra.planning import planner_inputs
from libra.run_dir import RunDir


def _leaves(cls: type, prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for name, info in options(cls).items():
        if info.is_section:
            out += _leaves(info.type, f"{prefix}{name}.")
        else:
            out.append((f"{prefix}{name}", info))
    return out


OPTIONS = dict(_leaves(Config))
RULE_IDS = {r.id: r for r in RULES}
BUILT_KINDS = ("TrainingPoolSpec", "RolloutPoolSpec", "TinyModelSpec", "PlannerInputs", "DesiredState", "TaskSpec")

# Another valid value where the generic choice (flip a bool, the next Literal choice, +1, x0.5) does not fit.
OTHER_VALUES: dict[str, Any] = {
    "model_path": "/elsewhere/model",
    "tokenizer_path": "/elsewhere/tokenizer",
    "rollout_endpoints": ("http://10.0.0.5:8100",),
    "cluster.gpu_type": "H200",
    "cluster.ray_address": "10.0.0.1:6379",
    "cluster.gpu_spec.name": "my-gpu",
    "megatron_params_dtype": "fp32",
    "global_resource_planner.min_train_gpus": 2,
    "global_resource_planner.min_rollout_gpus": 2,
    "global_resource_planner.allowed_train_tp": (1, 2),
    "global_resource_planner.allowed_train_ep": (1, 2),
    "global_resource_planner.allowed_train_pp": (1, 2),
    "global_resource_planner.allowed_train_cp": (1, 2),
    "task.dataset_path": "/data/train.jsonl",
    "task.eval_dataset_path": "/data/eval.jsonl",
    "task.params": {"modulus": 7},
}


# Options that act only together with another one: the other one is set in both configurations compared.
CONTEXT: dict[str, dict[str, Any]] = {
    "cluster.gpu_spec.name": {"cluster.gpu_spec.memory_gb": 70.0},  # names a catalog GPU only when corrected
}


def other_value(path: str, info: Any, default: Any) -> Any:
    if path in OTHER_VALUES:
        return OTHER_VALUES[path]
    choices = choices_of(info.type)
    if choices:
        return next(c for c in choices if c != default)
    if info.type is bool:
        return not default
    if info.type is int or typing.get_origin(info.type) in (typing.Union, types.UnionType):
        return (default or 0) + 1
    if info.type is float:
        return default / 2 if default else 0.5
    if info.type is str:
        return f"{default}-other" if default else "other"
    raise AssertionError(f"{path}: give another value in OTHER_VALUES")


@cache
def base_config() -> Config:
    """Qwen2.5-7B on 2 x 8 H100, pinned split 8 + 8 (validated)."""
    return load_dict(gpu_base())


def with_option(cfg: Config, path: str, value: Any) -> Config:
    """`cfg` with one option changed (not validated: the consumers are what is tested)."""
    *sections, leaf = path.split(".")
    if not sections:
        return dataclasses.replace(cfg, **{leaf: value})
    section = getattr(cfg, sections[0])
    return dataclasses.replace(cfg, **{sections[0]: with_option(section, ".".join(sections[1:] + [leaf]), value)})


def built(kind: str, cfg: Config, tmp: Path) -> Any:
    """The object of `kind` as the launcher builds it from `cfg`."""
    run = RunDir.at(tmp)
    desired = configured_allocation(cfg).desired_state(cfg)
    if kind == "TrainingPoolSpec":
        return training_spec(cfg, run, desired.train_gpus, desired.train_layout)
    if kind == "RolloutPoolSpec":
        return rollout_spec(cfg, run, desired.rollout_instances)
    if kind == "TinyModelSpec":
        return tiny_model_spec(cfg.build_tiny_model)
    if kind == "PlannerInputs":
        return planner_inputs(cfg)
    if kind == "DesiredState":
        return dataclasses.replace(desired, updated_at=0.0)
    if kind == "TaskSpec":
        return TaskSpec.from_config(cfg.task)
    raise AssertionError(kind)


def attribute(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _comparable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def test_registry_names_only_real_options() -> None:
    stale = sorted((set(CONSUMERS) | set(EXEMPT)) - set(OPTIONS))
    assert stale == [], f"entries for options that do not exist: {stale}"
    both = sorted(set(CONSUMERS) & set(EXEMPT))
    assert both == [], f"options both consumed and exempt: {both}"


@pytest.mark.parametrize("path", list(OPTIONS), ids=list(OPTIONS))
def test_option_has_a_consumer_rule_or_named_exemption(path: str) -> None:
    if path in EXEMPT:
        assert EXEMPT[path].strip(), f"{path}: an exemption needs its reason"
        return
    assert path in CONSUMERS, (f"{path} reaches nothing: map it in libra/config/mapping.py and declare it in "
                               "libra/config/consumers.py, or refuse it with a rule in libra/config/rules.py")
    for consumer in CONSUMERS[path]:
        kind = consumer.split(".")[0].split(" ")[0]
        assert kind in (*BUILT_KINDS, "reads", "rule"), f"{path}: unknown consumer {consumer!r}"
        if kind == "rule":
            rule = RULE_IDS.get(consumer.split(" ", 1)[1])
            assert rule is not None, f"{path}: {consumer} is not in the rule table"
            assert path in rule.fields, f"{path}: rule {rule.id} does not read it"


BUILT = [(path, consumer) for path, consumers in CONSUMERS.items() for consumer in consumers
         if consumer.split(".")[0] in BUILT_KINDS]


@pytest.mark.parametrize(("path", "consumer"), BUILT, ids=[f"{p}->{c}" for p, c in BUILT])
def test_changed_option_changes_its_consumer(path: str, consumer: str, tmp_path: Path) -> None:
    """The option is changed from its default to another valid value; the consumer follows it."""
    kind, _, field = consumer.rstrip("~").partition(".")
    base = base_config()
    for other, context_value in CONTEXT.get(path, {}).items():
        base = with_option(base, other, context_value)
    default = attribute(base, path)
    value = other_value(path, OPTIONS[path], default)
    assert value != default
    before = attribute(built(kind, base, tmp_path), field)
    after = attribute(built(kind, with_option(base, path, value), tmp_path), field)
    assert after != before, f"{path}: {default!r} -> {value!r} leaves {consumer} at {before!r}"
    if not consumer.endswith("~"):
        expected = os.path.abspath(value) if path.endswith("_path") else value  # paths arrive resolved
        assert _comparable(after) == _comparable(expected), (path, after, value)


READS = [(path, consumer.split(" ", 1)[1]) for path, consumers in CONSUMERS.items() for consumer in consumers
         if consumer.startswith("reads ")]


@cache
def attributes_read(target: str) -> frozenset[str]:
    module_name, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
    return frozenset(node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute))


@pytest.mark.parametrize(("path", "reader"), READS, ids=[f"{p}->{r}" for p, r in READS])
def test_reader_reads_option(path: str, reader: str) -> None:
    leaf = path.rsplit(".", 1)[-1]
    assert leaf in attributes_read(reader), f"{reader} does not read {path}"
