"""Cross-field checks of the CPU development platform (logical GPUs), the task's options (its data files are
checked in checks_data.py), checkpoint retention, tracking, ports and the tiny development model."""

from __future__ import annotations

import os
from collections.abc import Iterator

from libra.config.context import Finding, RuleContext
from libra.config.schema import BUILTIN_TASKS

GRP = "global_resource_planner"
_CPU_LIMIT = "Megatron-Core 0.16.1 on a CPU-only torch still needs CUDA for this (see the platform notes)"


def cpu_context_parallel(c: RuleContext) -> Iterator[Finding]:
    if c.is_cpu and c.cfg.train_cp_size > 1:
        yield Finding("train_cp_size", f"context parallelism is not qualified on logical GPUs: {_CPU_LIMIT}",
                      "set train_cp_size: 1 on a CPU run")
    if c.is_cpu and any(cp > 1 for cp in c.planner.allowed_train_cp):
        yield Finding(f"{GRP}.allowed_train_cp", "context parallelism is not qualified on logical GPUs",
                      "use [1] (or leave it empty) on a CPU run")


def cpu_distributed_optimizer(c: RuleContext) -> Iterator[Finding]:
    if c.is_cpu and c.cfg.megatron_use_distributed_optimizer:
        yield Finding("megatron_use_distributed_optimizer", f"the distributed optimizer is not qualified on logical "
                      f"GPUs: {_CPU_LIMIT}", "set megatron_use_distributed_optimizer: false on a CPU run")


def cpu_clip_grad(c: RuleContext) -> Iterator[Finding]:
    if c.is_cpu and c.cfg.optimizer.clip_grad > 0:
        yield Finding("optimizer.clip_grad", f"gradient clipping is not qualified on logical GPUs: {_CPU_LIMIT}",
                      "set optimizer.clip_grad: 0 on a CPU run")


def cpu_grouped_gemm(c: RuleContext) -> Iterator[Finding]:
    if c.is_cpu and c.cfg.megatron_grouped_gemm:
        yield Finding("megatron_grouped_gemm", "grouped GEMM kernels are GPU-only",
                      "set megatron_grouped_gemm: false on a CPU run")


def cpu_initialization(c: RuleContext) -> Iterator[Finding]:
    if c.is_cpu and not c.cfg.megatron_use_cpu_initialization:
        yield Finding("megatron_use_cpu_initialization", "on logical GPUs there is no CUDA device to initialize "
                      "weights on", "set megatron_use_cpu_initialization: true")


def cpu_kv_cache_size(c: RuleContext) -> Iterator[Finding]:
    if c.is_cpu and c.managed_rollout and c.cfg.rollout_kv_cache_bytes == 0:
        yield Finding("rollout_kv_cache_bytes", "vLLM on CPU needs an explicit KV-cache size (its default takes "
                      "gigabytes per server)", "set rollout_kv_cache_bytes, e.g. 67108864 (64 MiB)")


VLLM_CPU_MIN_HEAD_DIM = 32


def cpu_attention_head_dim(c: RuleContext) -> Iterator[Finding]:
    if not (c.is_cpu and c.managed_rollout and c.model is not None):
        return
    if c.model.head_dim < VLLM_CPU_MIN_HEAD_DIM:
        tiny = c.cfg.build_tiny_model
        path = "build_tiny_model.num_heads" if tiny.enabled else "model_path"
        yield Finding(path, f"vLLM-CPU's attention kernels need a head dimension of at least "
                      f"{VLLM_CPU_MIN_HEAD_DIM}; this model has {c.model.head_dim} "
                      f"(hidden {c.model.hidden_size} / {c.model.num_attention_heads} heads)",
                      f"use at most {max(1, c.model.hidden_size // VLLM_CPU_MIN_HEAD_DIM)} heads "
                      f"(or a larger hidden size) on a CPU run", value=c.model.num_attention_heads)


def cpu_memory_utilization_ignored(c: RuleContext) -> Iterator[Finding]:
    if c.is_cpu and c.is_set("rollout_gpu_memory_utilization"):
        yield Finding("rollout_gpu_memory_utilization", "is ignored on logical GPUs (the KV cache is sized by "
                      "rollout_kv_cache_bytes)", "remove it from CPU configurations")


def builtin_ignores_dataset(c: RuleContext) -> Iterator[Finding]:
    task = c.cfg.task
    if task.name in BUILTIN_TASKS and task.dataset_path:
        yield Finding("task.dataset_path", f"is ignored by the built-in task {task.name}",
                      "remove it, or set task.name: dataset")


def checkpoint_keep_every(c: RuleContext) -> Iterator[Finding]:
    ck = c.cfg.checkpoint
    if ck.keep_every and not ck.interval_steps:
        yield Finding("checkpoint.keep_every", "needs periodic checkpoints (checkpoint.interval_steps > 0)",
                      "set checkpoint.interval_steps, or keep_every: 0")
    elif ck.keep_every and ck.keep_every % ck.interval_steps:
        yield Finding("checkpoint.keep_every", f"must be a multiple of checkpoint.interval_steps ({ck.interval_steps})",
                      f"set a multiple of {ck.interval_steps}")


def checkpoint_mirror_dir(c: RuleContext) -> Iterator[Finding]:
    mirror = c.cfg.checkpoint.mirror_dir
    if not mirror:
        return
    path = os.path.abspath(mirror)
    checkpoints = os.path.abspath(os.path.join(c.cfg.run_dir, "checkpoints"))
    if path == os.path.abspath(c.cfg.run_dir) or path == checkpoints or path.startswith(checkpoints + os.sep):
        yield Finding("checkpoint.mirror_dir", f"{mirror!r} is the run directory or inside its checkpoints folder, "
                      "where the mirror's copies would be taken for the checkpoints themselves",
                      "choose a folder outside run_dir's checkpoints, best on another file system")
        return
    existing = path
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        what = "is not a writable folder" if existing == path else f"cannot be created: {existing} is not a writable folder"
        yield Finding("checkpoint.mirror_dir", f"{mirror!r} {what}",
                      "choose a folder the job can write, or leave mirror_dir empty")


def prometheus_port(c: RuleContext) -> Iterator[Finding]:
    tr = c.cfg.tracking
    if "prometheus" in tr.backends and tr.prometheus_port == 0:
        yield Finding("tracking.prometheus_port", "the prometheus backend needs a port",
                      "set tracking.prometheus_port, e.g. 9400")


def prometheus_port_unused(c: RuleContext) -> Iterator[Finding]:
    tr = c.cfg.tracking
    if tr.prometheus_port and "prometheus" not in tr.backends:
        yield Finding("tracking.prometheus_port", "is ignored without the prometheus backend",
                      "add prometheus to tracking.backends, or set the port to 0")


def tracking_unique(c: RuleContext) -> Iterator[Finding]:
    backends = c.cfg.tracking.backends
    if len(set(backends)) != len(backends):
        yield Finding("tracking.backends", "lists a backend more than once", "list each backend once")


def rollout_ports(c: RuleContext) -> Iterator[Finding]:
    cfg = c.cfg
    instances = max(1, cfg.num_rollout_instances, c.total_gpus // cfg.rollout_tp_size)
    last = cfg.rollout_port_base + instances - 1
    if last > 65535:
        yield Finding("rollout_port_base", f"{instances} rollout instances would need ports up to {last}",
                      f"set rollout_port_base <= {65535 - instances + 1}")
    elif cfg.rollout_port_base <= cfg.tracking.prometheus_port <= last:
        yield Finding("tracking.prometheus_port", f"collides with the rollout server ports "
                      f"({cfg.rollout_port_base}..{last})", "choose a port outside that range")


def tiny_model_shape(c: RuleContext) -> Iterator[Finding]:
    tiny = c.cfg.build_tiny_model
    if not tiny.enabled:
        return
    if tiny.hidden_size % tiny.num_heads:
        yield Finding("build_tiny_model.num_heads", f"must divide hidden_size ({tiny.hidden_size})",
                      "choose num_heads dividing hidden_size")
    if tiny.num_heads % tiny.num_kv_heads:
        yield Finding("build_tiny_model.num_kv_heads", f"must divide num_heads ({tiny.num_heads})",
                      "choose num_kv_heads dividing num_heads")


def tiny_model_not_overwriting(c: RuleContext) -> Iterator[Finding]:
    cfg = c.cfg
    if cfg.build_tiny_model.enabled and os.path.isdir(cfg.model_path) and \
            not os.path.isfile(os.path.join(cfg.model_path, "config.json")) and os.listdir(cfg.model_path):
        yield Finding("model_path", "build_tiny_model would write into a non-empty directory that is not a model",
                      "point model_path at an empty or missing directory")
