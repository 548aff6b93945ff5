"""Cross-field checks of the model, the cluster, the train/rollout split and the parallel layouts.

Each function takes the `RuleContext` and yields `Finding`s; the rule table in `rules.py` gives each one
its id, the options it reads, its class and its documentation.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator

from libra.config.context import Finding, RuleContext, common_divisors, divisors, one_of
from planner.hardware import ALIASES, CATALOG
from planner.model_spec import SUPPORTED_MODEL_TYPES

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
    if c.model.model_type not in SUPPORTED_MODEL_TYPES:
        yield Finding("model_path", f"model_type '{c.model.model_type}' has no Megatron-Core conversion in Libra",
                      f"use a model of type {', '.join(SUPPORTED_MODEL_TYPES)}")


def gpu_type_known(c: RuleContext) -> Iterator[Finding]:
    if c.gpu is None:
        names = sorted(CATALOG) + sorted(ALIASES)
        close = difflib.get_close_matches(c.cfg.cluster.gpu_type, names, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]}? " if close else ""
        yield Finding("cluster.gpu_type", "not in the planner's hardware catalog",
                      f"{hint}choose one of {', '.join(names)}")


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


def _head_ok_tp(c: RuleContext, limit: int | None = None) -> list[int]:
    if c.model is None:
        return divisors(c.cfg.cluster.gpus_per_node)
    return common_divisors(c.model.num_attention_heads, c.model.num_kv_heads, limit=limit)


def layout_divides_train_gpus(c: RuleContext) -> Iterator[Finding]:
    cfg = c.cfg
    mp = cfg.train_model_parallel_size
    if cfg.train_gpus and cfg.train_gpus % mp:
        rest = cfg.train_pp_size * cfg.train_cp_size
        tps = [t for t in divisors(cfg.train_gpus // rest) if t in _head_ok_tp(c)] if cfg.train_gpus % rest == 0 else []
        fix = f"choose train_tp_size from {one_of(tps)}" if tps else f"make train_gpus a multiple of {mp}"
        yield Finding(
            "train_tp_size",
            f"train_tp_size x train_pp_size x train_cp_size ({cfg.train_tp_size}x{cfg.train_pp_size}x"
            f"{cfg.train_cp_size}={mp}) must divide train_gpus ({cfg.train_gpus})",
            fix,
        )


def tp_divides_heads(c: RuleContext) -> Iterator[Finding]:
    assert c.model is not None
    m, tp = c.model, c.cfg.train_tp_size
    if m.num_attention_heads % tp or m.num_kv_heads % tp:
        yield Finding("train_tp_size",
                      f"train_tp_size ({tp}) must divide the model's attention heads ({m.num_attention_heads}) "
                      f"and KV heads ({m.num_kv_heads})",
                      f"choose train_tp_size from {one_of(_head_ok_tp(c))}")


def pp_divides_layers(c: RuleContext) -> Iterator[Finding]:
    assert c.model is not None
    layers, pp, vpp = c.model.num_layers, c.cfg.train_pp_size, c.cfg.train_vpp_size
    if layers % (pp * vpp):
        choices = [p for p in divisors(layers) if (layers // p) % vpp == 0]
        yield Finding("train_pp_size",
                      f"train_pp_size x train_vpp_size ({pp}x{vpp}={pp * vpp}) must divide the model's layers ({layers})",
                      f"choose train_pp_size from {one_of(choices)}" if choices
                      else f"choose train_vpp_size dividing {layers}")


def vpp_needs_pp(c: RuleContext) -> Iterator[Finding]:
    if c.cfg.train_vpp_size > 1 and c.cfg.train_pp_size == 1:
        yield Finding("train_vpp_size", "virtual pipeline stages need pipeline parallelism (train_pp_size > 1)",
                      "set train_vpp_size: 1, or train_pp_size >= 2")


def _ep_problem(c: RuleContext, ep: int) -> str:
    assert c.model is not None
    if ep <= 1:
        return ""
    if not c.model.is_moe:
        return f"expert parallelism needs an MoE model; {c.model.name} is dense"
    if c.model.num_experts % ep:
        return f"EP ({ep}) must divide the model's expert count ({c.model.num_experts})"
    return ""


def ep_for_moe(c: RuleContext) -> Iterator[Finding]:
    assert c.model is not None
    problem = _ep_problem(c, c.cfg.train_ep_size)
    if problem:
        fix = f"choose train_ep_size from {one_of(divisors(c.model.num_experts, c.cfg.cluster.gpus_per_node * 8))}" \
            if c.model.is_moe else "set train_ep_size: 1"
        yield Finding("train_ep_size", problem, fix)


def ep_divides_train_gpus(c: RuleContext) -> Iterator[Finding]:
    cfg = c.cfg
    base = cfg.train_tp_size * cfg.train_pp_size
    unit = base * cfg.train_ep_size
    if cfg.train_ep_size > 1 and cfg.train_gpus and cfg.train_gpus % unit:
        eps = divisors(cfg.train_gpus // base) if cfg.train_gpus % base == 0 else []
        if c.model is not None and c.model.is_moe:
            eps = [e for e in eps if c.model.num_experts % e == 0]
        yield Finding("train_ep_size",
                      f"train_tp_size x train_ep_size x train_pp_size ({cfg.train_tp_size}x{cfg.train_ep_size}x"
                      f"{cfg.train_pp_size}={unit}) must divide train_gpus ({cfg.train_gpus}) for the expert layout",
                      f"choose train_ep_size from {one_of(eps)}" if eps else f"make train_gpus a multiple of {unit}")


def train_tp_within_node(c: RuleContext) -> Iterator[Finding]:
    if c.cfg.train_tp_size > c.cfg.cluster.gpus_per_node:
        yield Finding("train_tp_size", f"TP {c.cfg.train_tp_size} spans nodes (gpus_per_node "
                      f"{c.cfg.cluster.gpus_per_node}): TP traffic then crosses the slow inter-node network",
                      "keep train_tp_size <= cluster.gpus_per_node and use PP across nodes")


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


def _items(c: RuleContext, name: str) -> list[tuple[int, int]]:
    return list(enumerate(getattr(c.planner, name)))


def allowed_tp(c: RuleContext) -> Iterator[Finding]:
    assert c.model is not None
    ok = _head_ok_tp(c)
    for i, tp in _items(c, "allowed_train_tp"):
        if tp not in ok:
            yield Finding(f"{GRP}.allowed_train_tp[{i}]",
                          f"TP {tp} must divide the attention heads ({c.model.num_attention_heads}) and KV heads "
                          f"({c.model.num_kv_heads})", f"use values from {one_of(ok)}", value=tp)


def allowed_ep(c: RuleContext) -> Iterator[Finding]:
    assert c.model is not None
    for i, ep in _items(c, "allowed_train_ep"):
        problem = _ep_problem(c, ep)
        if problem:
            fix = f"use divisors of {c.model.num_experts}" if c.model.is_moe else "use [1] for a dense model"
            yield Finding(f"{GRP}.allowed_train_ep[{i}]", problem, fix, value=ep)


def allowed_pp(c: RuleContext) -> Iterator[Finding]:
    assert c.model is not None
    for i, pp in _items(c, "allowed_train_pp"):
        if c.model.num_layers % pp:
            yield Finding(f"{GRP}.allowed_train_pp[{i}]", f"PP {pp} must divide the model's layers ({c.model.num_layers})",
                          f"use values from {one_of(divisors(c.model.num_layers, 64))}", value=pp)


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
