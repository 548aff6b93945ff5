"""Cross-field checks of the model, the cluster, the train/rollout split and the parallel layouts.

Each function takes the `RuleContext` and yields `Finding`s; the rule table in `rules.py` gives each one
its id, the options it reads, its class and its documentation. Whether a layout breaks a rule is
`planner.layout`'s verdict (the planner and the training pool ask the same code) and which model types are
supported is `planner.architectures`'; the checks here name the option and the fix.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator

from libra.config.context import Finding, RuleContext, common_divisors, divisors, one_of
from planner.architectures import (
    PLAN,
    ROLLOUT,
    TRAIN,
    missing_capabilities,
    supporting,
    training_gaps,
    unsupported_message,
)
from planner.hardware import ALIASES, CATALOG, CUSTOM, DESCRIBED_FIELDS
from planner.layout import Rule, TrainLayout

GRP = "global_resource_planner"


def model_config(c: RuleContext) -> Iterator[Finding]:
    if c.model_error:
        yield Finding(
            "model_path", f"cannot read the model architecture ({c.model_error.split(': point')[0]})",
            "point model_path at a Hugging Face model directory that holds config.json (relative paths are "
            "resolved against the YAML file's directory, then the working directory), or enable "
            "build_tiny_model for a model the launcher builds",
        )


def model_architecture(c: RuleContext) -> Iterator[Finding]:
    assert c.model is not None
    message = unsupported_message(c.model.model_type, (PLAN,))
    if message:
        yield Finding("model_path", message, f"use a model of type {', '.join(supporting(PLAN))}")


def model_runnable(c: RuleContext) -> Iterator[Finding]:
    """What `libra launch` needs beyond a plan: a training conversion and a rollout engine for the model."""
    assert c.model is not None
    if missing_capabilities(c.model.model_type, (PLAN,)):
        return  # model.architecture reports the unknown type
    if c.cfg.build_tiny_model.enabled:
        return  # Libra builds that model from trainable families; tiny.shape checks its shape
    gaps = training_gaps(c.model)
    rollout = unsupported_message(c.model.model_type, (ROLLOUT,))
    if gaps or rollout:
        runnable = sorted(set(supporting(TRAIN)) & set(supporting(ROLLOUT)))
        yield Finding("model_path", "; ".join(gaps + ([rollout] if rollout else [])),
                      f"use a model Libra can train and serve ({', '.join(runnable)}); `libra plan` still plans "
                      "this one")


def gpu_type_known(c: RuleContext) -> Iterator[Finding]:
    if c.gpu is not None:
        return
    cluster = c.cfg.cluster
    described = any(cluster.gpu_spec.figures().values())
    if not described and cluster.gpu_type.lower() != CUSTOM:
        names = sorted(CATALOG) + sorted(ALIASES)
        close = difflib.get_close_matches(cluster.gpu_type, names, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]}? " if close else ""
        yield Finding("cluster.gpu_type", "not in the planner's hardware catalog, and cluster.gpu_spec does not "
                      "describe it", f"{hint}choose one of {', '.join(names)}, or set gpu_type: custom and give "
                      f"cluster.gpu_spec ({', '.join(DESCRIBED_FIELDS)}) from the GPU's datasheet")
        return
    what = "custom" if cluster.gpu_type.lower() == CUSTOM else f"'{cluster.gpu_type}', not in the catalog,"
    for name in c.gpu_missing:
        yield Finding(f"cluster.gpu_spec.{name}", f"gpu_type {what} is described by cluster.gpu_spec, which needs "
                      f"{name}", f"set cluster.gpu_spec.{name} to the GPU's datasheet figure (unit in the name; bandwidths "
                      "per GPU and direction)")


def gpus_per_node_fit(c: RuleContext) -> Iterator[Finding]:
    assert c.gpu is not None
    if c.cfg.cluster.gpus_per_node > c.gpu.max_gpus_per_node:
        yield Finding("cluster.gpus_per_node",
                      f"a {c.gpu.name} node holds at most {c.gpu.max_gpus_per_node} GPUs",
                      f"set cluster.gpus_per_node <= {c.gpu.max_gpus_per_node} and raise cluster.num_nodes")


def logical_gpus_match(c: RuleContext) -> Iterator[Finding]:
    cpu_type = c.cfg.cluster.gpu_type == "cpu-logical"
    if c.is_cpu and not cpu_type:
        yield Finding("cluster.gpu_type", "logical GPUs are CPU processes, so gpu_type must be cpu-logical",
                      "set cluster.gpu_type: cpu-logical, or cluster.logical_gpus: false on a GPU cluster")
    elif cpu_type and not c.is_cpu:
        yield Finding("cluster.logical_gpus", "gpu_type cpu-logical describes Ray logical GPUs on a CPU machine",
                      "set cluster.logical_gpus: true, or choose a real gpu_type")


def split_fits_cluster(c: RuleContext) -> Iterator[Finding]:
    cfg = c.cfg
    used = cfg.train_gpus + cfg.rollout_gpus
    if used > c.total_gpus:
        yield Finding(
            "train_gpus",
            f"train_gpus + rollout_gpus ({cfg.train_gpus}+{cfg.rollout_gpus}={used}) exceeds the cluster "
            f"(cluster.num_nodes x cluster.gpus_per_node = {cfg.cluster.num_nodes}x{cfg.cluster.gpus_per_node}"
            f"={c.total_gpus})",
            f"reduce train_gpus or rollout_gpus to a sum of at most {c.total_gpus}, or add nodes",
        )


def split_pinned(c: RuleContext) -> Iterator[Finding]:
    if not c.pinned:
        return
    if c.cfg.train_gpus == 0:
        yield Finding("train_gpus", "initial_allocation_strategy configured pins the split, so train_gpus must be >= 1",
                      f"set train_gpus, or {GRP}.initial_allocation_strategy: grp to let the planner choose")
    if c.cfg.rollout_gpus == 0 and c.managed_rollout:
        yield Finding("rollout_gpus", "initial_allocation_strategy configured pins the split, so rollout_gpus must be "
                      ">= 1 when Libra manages the rollout servers",
                      f"set rollout_gpus, or {GRP}.initial_allocation_strategy: grp to let the planner choose")


def _layout_problems(c: RuleContext, *codes: str) -> list[Rule]:
    """The `planner.layout` problems of the configured layout with one of `codes` (the pool-size rules only
    when train_gpus is set)."""
    cfg = c.cfg
    layout = TrainLayout(tp=cfg.train_tp_size, pp=cfg.train_pp_size, cp=cfg.train_cp_size, ep=cfg.train_ep_size,
                         vpp=cfg.train_vpp_size)
    found = layout.problems(c.model, world=cfg.train_gpus or None, gpus_per_node=cfg.cluster.gpus_per_node,
                            max_model_len=cfg.max_model_len)
    return [p for p in found if p.code in codes]


def _joined(problems: list[Rule]) -> str:
    return "; ".join(p.message for p in problems)


def _head_ok_tp(c: RuleContext, limit: int | None = None) -> list[int]:
    if c.model is None:
        return divisors(c.cfg.cluster.gpus_per_node)
    return common_divisors(c.model.num_attention_heads, c.model.num_kv_heads, limit=limit)


def layout_divides_train_gpus(c: RuleContext) -> Iterator[Finding]:
    cfg = c.cfg
    problems = _layout_problems(c, "split_divisibility")
    if problems:
        mp = cfg.train_model_parallel_size
        rest = cfg.train_pp_size * cfg.train_cp_size
        tps = [t for t in divisors(cfg.train_gpus // rest) if t in _head_ok_tp(c)] if cfg.train_gpus % rest == 0 else []
        fix = f"choose train_tp_size from {one_of(tps)}" if tps else f"make train_gpus a multiple of {mp}"
        yield Finding("train_tp_size", _joined(problems), fix)


def tp_divides_heads(c: RuleContext) -> Iterator[Finding]:
    assert c.model is not None
    problems = _layout_problems(c, "tp_heads", "tp_kv_heads")
    if problems:
        yield Finding("train_tp_size", _joined(problems), f"choose train_tp_size from {one_of(_head_ok_tp(c))}")


def pp_divides_layers(c: RuleContext) -> Iterator[Finding]:
    assert c.model is not None
    layers, vpp = c.model.num_layers, c.cfg.train_vpp_size
    problems = _layout_problems(c, "pp_layers")
    if problems:
        choices = [p for p in divisors(layers) if (layers // p) % vpp == 0]
        yield Finding("train_pp_size", _joined(problems),
                      f"choose train_pp_size from {one_of(choices)}" if choices
                      else f"choose train_vpp_size dividing {layers}")


def vpp_needs_pp(c: RuleContext) -> Iterator[Finding]:
    problems = _layout_problems(c, "vpp_needs_pp")
    if problems:
        yield Finding("train_vpp_size", _joined(problems), "set train_vpp_size: 1, or train_pp_size >= 2")


def ep_for_moe(c: RuleContext) -> Iterator[Finding]:
    assert c.model is not None
    problems = _layout_problems(c, "ep_dense", "ep_experts")
    if problems:
        fix = f"choose train_ep_size from {one_of(divisors(c.model.num_experts, c.cfg.cluster.gpus_per_node * 8))}" \
            if c.model.is_moe else "set train_ep_size: 1"
        yield Finding("train_ep_size", _joined(problems), fix)


def ep_divides_train_gpus(c: RuleContext) -> Iterator[Finding]:
    cfg = c.cfg
    problems = _layout_problems(c, "ep_data_parallel")
    if problems:
        base = cfg.train_tp_size * cfg.train_pp_size
        unit = base * cfg.train_ep_size
        eps = divisors(cfg.train_gpus // base) if cfg.train_gpus % base == 0 else []
        if c.model is not None and c.model.is_moe:
            eps = [e for e in eps if c.model.num_experts % e == 0]
        yield Finding("train_ep_size", _joined(problems),
                      f"choose train_ep_size from {one_of(eps)}" if eps else f"make train_gpus a multiple of {unit}")


def train_tp_within_node(c: RuleContext) -> Iterator[Finding]:
    problems = _layout_problems(c, "tp_node")
    if problems:
        yield Finding("train_tp_size", _joined(problems) + ": TP traffic then crosses the slow inter-node network",
                      "choose a train_tp_size that divides cluster.gpus_per_node and use PP across nodes")



def rollout_tp_divides_gpus(c: RuleContext) -> Iterator[Finding]:
    cfg = c.cfg
    if cfg.rollout_gpus % cfg.rollout_tp_size:
        yield Finding("rollout_gpus", f"rollout_gpus ({cfg.rollout_gpus}) must be a multiple of rollout_tp_size "
                      f"({cfg.rollout_tp_size}): each rollout instance uses rollout_tp_size GPUs",
                      f"set rollout_gpus to a multiple of {cfg.rollout_tp_size}")


def rollout_tp_heads(c: RuleContext) -> Iterator[Finding]:
    assert c.model is not None
    m, tp = c.model, c.cfg.rollout_tp_size
    if m.num_attention_heads % tp or (m.num_kv_heads % tp and tp % m.num_kv_heads):
        ok = [t for t in divisors(m.num_attention_heads, c.cfg.cluster.gpus_per_node)
              if m.num_kv_heads % t == 0 or t % m.num_kv_heads == 0]
        yield Finding("rollout_tp_size", f"rollout_tp_size ({tp}) must divide the attention heads "
                      f"({m.num_attention_heads}) and divide or be a multiple of the KV heads ({m.num_kv_heads})",
                      f"choose rollout_tp_size from {one_of(ok)}")


def rollout_tp_within_node(c: RuleContext) -> Iterator[Finding]:
    if c.cfg.rollout_tp_size > c.cfg.cluster.gpus_per_node:
        yield Finding("rollout_tp_size", f"a rollout instance spanning nodes (rollout_tp_size {c.cfg.rollout_tp_size} "
                      f"> gpus_per_node {c.cfg.cluster.gpus_per_node}) is not supported by the rollout launcher",
                      f"set rollout_tp_size <= {c.cfg.cluster.gpus_per_node}")


# allowed_train_* lists are search spaces: the planner prunes a value the model or the node cannot use (with the
# same `planner.layout` verdict and reason), so such a value is a warning; a list with no usable value is an error
_ALLOWED_CODES = {"allowed_train_tp": ("tp_heads", "tp_kv_heads", "tp_node"), "allowed_train_pp": ("pp_layers",),
                  "allowed_train_ep": ("ep_dense", "ep_experts")}


def _allowed_problems(c: RuleContext, name: str, value: int) -> list[Rule]:
    """Why the planner prunes every layout with `value` from list `name` (empty: usable)."""
    vpp = c.cfg.train_vpp_size
    layout = {"allowed_train_tp": TrainLayout(tp=value), "allowed_train_pp": TrainLayout(pp=value, vpp=vpp),
              "allowed_train_ep": TrainLayout(ep=value)}[name]
    found = layout.problems(c.model, gpus_per_node=c.cfg.cluster.gpus_per_node)
    return [p for p in found if p.code in _ALLOWED_CODES[name]]


def _usable_degrees(c: RuleContext, name: str) -> list[int]:
    """Degrees the planner could use for list `name` (up to 64, or the expert count)."""
    assert c.model is not None
    limit = max(64, c.model.num_experts)
    return [v for v in range(1, limit + 1) if not _allowed_problems(c, name, v)]


def allowed_pruned(c: RuleContext) -> Iterator[Finding]:
    """Values of an allowed_train_* list that the planner prunes, when the list has a usable value."""
    for name in _ALLOWED_CODES:
        values = list(getattr(c.planner, name))
        problems = [(i, v, _allowed_problems(c, name, v)) for i, v in enumerate(values)]
        if all(found for _, _, found in problems):
            continue  # planner.allowed_usable reports the list
        for i, v, found in problems:
            if found:
                yield Finding(f"{GRP}.{name}[{i}]", f"{_joined(found)}: the planner prunes it",
                              f"drop {v} from {name} (a list shared between models may keep it: the planner skips it "
                              "for this model)", value=v)


def allowed_usable(c: RuleContext) -> Iterator[Finding]:
    """An allowed_train_* list none of whose values the planner can use."""
    for name in _ALLOWED_CODES:
        values = list(getattr(c.planner, name))
        if values and all(_allowed_problems(c, name, v) for v in values):
            reasons = "; ".join(_joined(_allowed_problems(c, name, v)) for v in values)
            yield Finding(f"{GRP}.{name}", f"no value is usable ({reasons})",
                          f"use values from {one_of(_usable_degrees(c, name))}, or leave it empty to derive them")


def allowed_unique(c: RuleContext) -> Iterator[Finding]:
    for name in ("allowed_train_tp", "allowed_train_ep", "allowed_train_pp", "allowed_train_cp"):
        values = getattr(c.planner, name)
        if len(set(values)) != len(values):
            yield Finding(f"{GRP}.{name}", "lists a degree more than once", "list each degree once")


def min_gpus_fit(c: RuleContext) -> Iterator[Finding]:
    p = c.planner
    if p.min_train_gpus + p.min_rollout_gpus > c.total_gpus:
        yield Finding(f"{GRP}.min_train_gpus", f"min_train_gpus + min_rollout_gpus ({p.min_train_gpus}+"
                      f"{p.min_rollout_gpus}) exceeds the cluster ({c.total_gpus} GPUs)",
                      f"lower the minimums to a sum of at most {c.total_gpus}")


def min_within_split(c: RuleContext) -> Iterator[Finding]:
    p, cfg = c.planner, c.cfg
    if not c.pinned:
        return
    if p.min_train_gpus > cfg.train_gpus:
        yield Finding(f"{GRP}.min_train_gpus", f"the pinned split gives training {cfg.train_gpus} GPUs, fewer than "
                      f"min_train_gpus ({p.min_train_gpus})", f"set min_train_gpus <= {cfg.train_gpus} or raise train_gpus")
    if p.min_rollout_gpus > cfg.rollout_gpus:
        yield Finding(f"{GRP}.min_rollout_gpus", f"the pinned split gives rollout {cfg.rollout_gpus} GPUs, fewer than "
                      f"min_rollout_gpus ({p.min_rollout_gpus})",
                      f"set min_rollout_gpus <= {cfg.rollout_gpus} or raise rollout_gpus")


def granularity_divides(c: RuleContext) -> Iterator[Finding]:
    g, cfg = c.planner.allocation_granularity_gpus, c.cfg
    if not g:
        return
    path = f"{GRP}.allocation_granularity_gpus"
    if c.total_gpus % g:
        yield Finding(path, f"must divide the cluster's {c.total_gpus} GPUs",
                      f"choose from {one_of(divisors(c.total_gpus))}")
    elif c.pinned and (cfg.train_gpus % g or cfg.rollout_gpus % g):
        yield Finding(path, f"must divide the pinned split (train_gpus {cfg.train_gpus}, rollout_gpus {cfg.rollout_gpus})",
                      f"choose from {one_of(common_divisors(c.total_gpus, cfg.train_gpus, cfg.rollout_gpus))}")


def min_rollout_multiple(c: RuleContext) -> Iterator[Finding]:
    m, tp = c.planner.min_rollout_gpus, c.cfg.rollout_tp_size
    if m % tp:
        yield Finding(f"{GRP}.min_rollout_gpus", f"must be a multiple of rollout_tp_size ({tp}): whole instances only",
                      f"set a multiple of {tp}")


def safety_margin_fits(c: RuleContext) -> Iterator[Finding]:
    assert c.gpu is not None
    margin = c.planner.memory_budget_safety_margin_bytes
    if margin >= c.gpu.memory_bytes:
        yield Finding(f"{GRP}.memory_budget_safety_margin_bytes",
                      f"reserves all of a {c.gpu.name}'s {c.gpu.memory_bytes} bytes",
                      f"set a margin well below {c.gpu.memory_bytes} (e.g. {c.gpu.memory_bytes // 16})")
