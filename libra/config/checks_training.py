"""Cross-field checks of batch geometry, sequence lengths, the algorithm, the optimizer and the
Megatron-Core options."""

from __future__ import annotations

import math
from collections.abc import Iterator

from libra.config.context import Finding, RuleContext, divisors

GRP = "global_resource_planner"


def _dp(c: RuleContext) -> int:
    """DP size of the configured training pool, or 0 when it is not determined (planner decides / bad layout)."""
    cfg = c.cfg
    mp = cfg.train_model_parallel_size
    return cfg.train_gpus // mp if cfg.train_gpus and cfg.train_gpus % mp == 0 else 0


def batch_geometry(c: RuleContext) -> Iterator[Finding]:
    cfg, dp = c.cfg, _dp(c)
    if not dp:
        return
    unit = dp * cfg.train_micro_batch_size
    if cfg.samples_per_step % unit:
        step = unit // math.gcd(unit, cfg.n_samples)
        yield Finding(
            "batch_size",
            f"batch_size x n_samples ({cfg.batch_size}x{cfg.n_samples}={cfg.samples_per_step}) must be divisible by "
            f"DP x train_micro_batch_size ({dp}x{cfg.train_micro_batch_size}={unit}), "
            f"DP = train_gpus / (TP x PP x CP) = {cfg.train_gpus}/{cfg.train_model_parallel_size}",
            f"set batch_size to a multiple of {step}, or change train_micro_batch_size or the layout",
        )


def recompute_micro_batch(c: RuleContext) -> Iterator[Finding]:
    cfg, dp = c.cfg, _dp(c)
    if not (cfg.recompute_logprobs and dp) or cfg.samples_per_step % dp:
        return
    per_dp = cfg.samples_per_step // dp
    if per_dp % cfg.recompute_micro_batch_size:
        choices = divisors(per_dp)
        yield Finding("recompute_micro_batch_size",
                      f"must divide the per-DP batch (batch_size x n_samples / DP = {cfg.samples_per_step}/{dp}"
                      f"={per_dp})", f"choose from {{{', '.join(map(str, choices))}}}")


def group_norm_needs_samples(c: RuleContext) -> Iterator[Finding]:
    mode = c.cfg.algorithm.advantage_norm_mode
    if mode.startswith("group_") and c.cfg.n_samples < 2:
        yield Finding("n_samples", f"advantage_norm_mode {mode} normalizes within a prompt group, which needs at "
                      "least 2 samples per prompt", "set n_samples >= 2, or algorithm.advantage_norm_mode: "
                      "batch_mean / batch_zscore")


def new_tokens_below_model_len(c: RuleContext) -> Iterator[Finding]:
    cfg = c.cfg
    if cfg.max_new_tokens >= cfg.max_model_len:
        yield Finding("max_new_tokens", f"must be smaller than max_model_len ({cfg.max_model_len}) to leave room "
                      "for the prompt", f"set max_new_tokens < {cfg.max_model_len}, or raise max_model_len")


def model_len_within_positions(c: RuleContext) -> Iterator[Finding]:
    assert c.model is not None
    limit = c.model.max_position_embeddings
    if limit and c.cfg.max_model_len > limit:
        yield Finding("max_model_len", f"exceeds the model's max_position_embeddings ({limit})",
                      f"set max_model_len <= {limit}")


def expected_response_len(c: RuleContext) -> Iterator[Finding]:
    cfg = c.cfg
    if cfg.expected_response_tokens > cfg.max_new_tokens:
        yield Finding("expected_response_tokens", f"a response never exceeds max_new_tokens ({cfg.max_new_tokens})",
                      f"set expected_response_tokens <= {cfg.max_new_tokens} (0 = max_new_tokens / 2)")


def concurrency_holds_group(c: RuleContext) -> Iterator[Finding]:
    cfg = c.cfg
    if cfg.max_concurrent_rollouts and cfg.max_concurrent_rollouts < cfg.n_samples:
        yield Finding("max_concurrent_rollouts", f"a prompt group of n_samples ({cfg.n_samples}) is issued at once, "
                      "so the limit must hold one group", f"set max_concurrent_rollouts >= {cfg.n_samples}, or 0")


def is_needs_recompute(c: RuleContext) -> Iterator[Finding]:
    if c.cfg.algorithm.is_correction.enable and not c.cfg.recompute_logprobs:
        yield Finding("algorithm.is_correction.enable", "the IS weight compares the trainer's recomputed log-probs "
                      "with the rollout's, so recompute_logprobs must be true", "set recompute_logprobs: true")


def ref_kl_coef(c: RuleContext) -> Iterator[Finding]:
    kl = c.cfg.algorithm.ref_kl
    if kl.enable and kl.coef == 0:
        yield Finding("algorithm.ref_kl.coef", "the reference model is loaded but its KL term is multiplied by 0",
                      "set a positive coef or algorithm.ref_kl.enable: false")


def disabled_options_ignored(c: RuleContext) -> Iterator[Finding]:
    for section, names in (("ref_kl", ("coef", "kl_type")),
                           ("is_correction", ("level", "action", "lower_bound", "upper_bound"))):
        if getattr(c.cfg.algorithm, section).enable:
            continue
        for name in names:
            path = f"algorithm.{section}.{name}"
            if c.is_set(path):
                yield Finding(path, f"is ignored while algorithm.{section}.enable is false",
                              f"remove it or set algorithm.{section}.enable: true")


def temperature_zero(c: RuleContext) -> Iterator[Finding]:
    if c.cfg.rollout_temperature == 0 and c.cfg.n_samples > 1:
        yield Finding("rollout_temperature", "greedy sampling makes all n_samples of a group identical, so group "
                      "advantages are zero", "use a temperature > 0 (typically 1.0)")


def offload_fraction_needs_offload(c: RuleContext) -> Iterator[Finding]:
    cfg = c.cfg
    if cfg.megatron_optimizer_offload_fraction > 0 and not cfg.megatron_optimizer_cpu_offload:
        yield Finding("megatron_optimizer_offload_fraction", "only applies with megatron_optimizer_cpu_offload",
                      "set megatron_optimizer_cpu_offload: true, or the fraction to 0")
    if cfg.megatron_optimizer_cpu_offload and cfg.megatron_optimizer_offload_fraction == 0:
        yield Finding("megatron_optimizer_offload_fraction", "CPU offload with fraction 0 offloads nothing",
                      "set a fraction in (0, 1], e.g. 1.0")


def offload_needs_precision_aware(c: RuleContext) -> Iterator[Finding]:
    cfg = c.cfg
    if cfg.megatron_optimizer_cpu_offload and not cfg.megatron_use_precision_aware_optimizer:
        yield Finding("megatron_optimizer_cpu_offload", "Megatron-Core's CPU optimizer offload runs through the "
                      "precision-aware optimizer path", "set megatron_use_precision_aware_optimizer: true")


def precision_aware_needs_distributed(c: RuleContext) -> Iterator[Finding]:
    cfg = c.cfg
    if cfg.megatron_use_precision_aware_optimizer and not cfg.megatron_use_distributed_optimizer:
        yield Finding("megatron_use_precision_aware_optimizer", "Megatron-Core supports the precision-aware "
                      "optimizer only with the distributed optimizer", "set megatron_use_distributed_optimizer: true")


def grouped_gemm_dense(c: RuleContext) -> Iterator[Finding]:
    assert c.model is not None
    if c.cfg.megatron_grouped_gemm and not c.model.is_moe:
        yield Finding("megatron_grouped_gemm", f"only affects MoE experts; {c.model.name} is dense",
                      "remove it for a dense model")


def min_lr_below_lr(c: RuleContext) -> Iterator[Finding]:
    opt = c.cfg.optimizer
    if opt.min_lr > opt.lr:
        yield Finding("optimizer.min_lr", f"exceeds optimizer.lr ({opt.lr})", f"set min_lr <= {opt.lr}")


def min_lr_needs_decay(c: RuleContext) -> Iterator[Finding]:
    opt = c.cfg.optimizer
    if opt.min_lr > 0 and opt.lr_decay_style == "constant":
        yield Finding("optimizer.min_lr", "has no effect: the learning rate stays at lr after the warm-up "
                      "(optimizer.lr_decay_style is constant)",
                      "set optimizer.lr_decay_style to linear or cosine to decay to min_lr, or remove min_lr")


def warmup_within_steps(c: RuleContext) -> Iterator[Finding]:
    if c.cfg.optimizer.lr_warmup_steps > c.cfg.total_steps:
        yield Finding("optimizer.lr_warmup_steps", f"exceeds total_steps ({c.cfg.total_steps})",
                      f"set lr_warmup_steps <= {c.cfg.total_steps}")


def dry_run_needs_recompute(c: RuleContext) -> Iterator[Finding]:
    if c.planner.memory_budget_dry_run_enabled and not c.cfg.recompute_logprobs:
        yield Finding(f"{GRP}.memory_budget_dry_run_enabled", "probes recompute-logprobs memory, but "
                      "recompute_logprobs is false", "remove it or set recompute_logprobs: true")


def recompute_options_ignored(c: RuleContext) -> Iterator[Finding]:
    if c.is_set("recompute_micro_batch_size") and not c.cfg.recompute_logprobs:
        yield Finding("recompute_micro_batch_size", "is ignored while recompute_logprobs is false",
                      "remove it or set recompute_logprobs: true")
