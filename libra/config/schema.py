"""The configuration schema of a Libra job: the top-level `Config` (a frozen dataclass tree).

Names are user-facing and fixed (see the configuration reference). Each option carries its type, default
(or is required), bounds and doc string through `opt()`; the reference in
`cluster_manual/configuration_reference.md` is generated from these classes. The sections live in
`sections.py`. Rules that involve more than one option live in the rule table (`rules.py`), not here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from dataclasses_json import DataClassJsonMixin

from libra.config.fields import internal, opt
from libra.config.sections import (
    BUILTIN_TASKS,
    AlgorithmConfig,
    CheckpointConfig,
    ClusterConfig,
    ISCorrectionConfig,
    OperatorApiConfig,
    OptimizerConfig,
    PlannerConfig,
    RefKLConfig,
    TaskConfig,
    TinyModelConfig,
    TrackingConfig,
)
from planner.model_spec import ModelSpec, load_model_spec, model_spec_from_dict

__all__ = [
    "BUILTIN_TASKS",
    "AlgorithmConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "Config",
    "ISCorrectionConfig",
    "OptimizerConfig",
    "PlannerConfig",
    "RefKLConfig",
    "TaskConfig",
    "TinyModelConfig",
    "TrackingConfig",
]


@dataclass(frozen=True, kw_only=True)
class Config(DataClassJsonMixin):
    """A Libra job: model, cluster, the train/rollout split and layout, batch geometry, and sections."""

    name: str = opt("", "Job name; empty = the YAML file name without extension.")
    run_dir: str = opt("", "Directory for checkpoints, traces and metrics; empty = runs/<name>.")
    log_level: Literal["debug", "info", "warning", "error"] = opt("info", "Log level of the controller.")
    seed: int = opt(1234, "Global random seed.")
    total_steps: int = opt(100, "Training steps of the job.", ge=1)

    model_path: str = opt(doc="Policy model path: a Hugging Face model directory with config.json.", path=True)
    tokenizer_path: str = opt("", "Tokenizer path; defaults to model_path when empty.", path=True)
    train_backend: str = opt("megatron_core", "Training backend; only megatron_core is implemented.")

    train_gpus: int = opt(
        0, "GPUs assigned to the core training pool; 0 = the planner decides (initial_allocation_strategy grp).",
        ge=0,
    )
    rollout_gpus: int = opt(
        0, "GPUs assigned to rollout at launch; 0 = the planner decides (initial_allocation_strategy grp).",
        ge=0,
    )
    train_tp_size: int = opt(1, "Tensor-parallel size for training.", ge=1)
    train_pp_size: int = opt(1, "Pipeline-parallel size for training.", ge=1)
    train_cp_size: int = opt(1, "Context-parallel size for Megatron-Core.", ge=1)
    train_ep_size: int = opt(1, "Expert-parallel size for training (MoE models only).", ge=1)
    train_vpp_size: int = opt(1, "Virtual pipeline stages per PP rank (interleaved schedule).", ge=1)
    train_micro_batch_size: int = opt(1, "Samples per training micro batch.", ge=1)

    batch_size: int = opt(
        8, "Global training batch size in prompt groups per step; samples per step = batch_size x n_samples.",
        ge=1,
    )
    n_samples: int = opt(8, "Rollouts per prompt group for GRPO.", ge=1)
    max_model_len: int = opt(4096, "vLLM context length (prompt + response tokens).", ge=1)
    max_new_tokens: int = opt(1024, "Maximum generated tokens per rollout request.", ge=1)
    max_concurrent_rollouts: int = opt(
        0,
        "Maximum in-flight rollout requests; 0 = batch_size x n_samples x (max_head_offpolicyness + 1).",
        ge=0,
    )
    max_head_offpolicyness: int = opt(
        0, "Maximum accepted policy-version lag of a sample; 0 = synchronous on-policy.", ge=0
    )
    recompute_logprobs: bool = opt(True, "Recompute log-probabilities with the current model before the update.")
    recompute_micro_batch_size: int = opt(
        1, "Temporary batch size used only by recompute-logprobs; defaults to 1 to bound logits memory.", ge=1
    )
    phase_trace_enabled: bool = opt(
        False,
        "Each rank writes append-only phase_trace_rank*.jsonl spans under run_dir. RL_TRAIN_PHASE_TRACE=1 "
        "also enables them (RL_TRAIN_PHASE_TRACE_DIR sets the directory) for long runs; convert them for "
        "Perfetto / Chrome Trace with scripts/phase_trace_to_chrome.py.",
    )
    sync_interval: int = opt(1, "Training steps between weight sync attempts.", ge=1)

    rollout_weight_sync_mode: Literal["restart", "nccl"] = opt(
        "restart",
        "restart: publish HF safetensors and send one reload request to the complete rollout instance set, "
        "then wait for the whole ACK batch. nccl: Not implemented.",
    )
    rollout_weight_reload_method: Literal["restart", "inplace"] = opt(
        "restart",
        "How each vLLM instance applies a checkpoint: restart replaces the server process, inplace calls the "
        "guarded reload endpoint and keeps the server resident.",
    )
    rollout_weight_reload_strategy: Literal["parallel", "serial"] = opt(
        "parallel",
        "Reload rollout instances concurrently (parallel) or node-serialized (serial, an operational fallback).",
    )
    rollout_tp_size: int = opt(1, "Tensor-parallel size of each rollout (vLLM) instance.", ge=1)
    rollout_endpoints: tuple[str, ...] = opt(
        (),
        "Existing rollout servers (http://host:port) used when "
        "global_resource_planner.runtime_manage_rollout_processes is false; must be empty otherwise.",
    )
    rollout_kv_cache_bytes: int = opt(
        0, "KV-cache size per rollout instance in bytes; 0 = engine default (GPU only).", ge=0
    )
    rollout_gpu_memory_utilization: float = opt(
        0.9, "Fraction of GPU memory vLLM may use (GPU only; ignored on logical GPUs).", gt=0, le=1
    )
    rollout_port_base: int = opt(8100, "First HTTP port of the rollout servers (one port per instance).",
                                 ge=1024, le=65535)
    rollout_enforce_eager: bool = opt(False, "Run vLLM without graph capture/compilation (faster start).")
    rollout_health_check_interval_s: float = opt(
        5.0, "Seconds between /health checks of each serving rollout instance (and between a publish's checks "
        "before it reloads an instance).", gt=0)
    rollout_health_check_timeout_s: float = opt(10.0, "Seconds one /health check may take.", gt=0)
    rollout_health_check_failures: int = opt(
        3, "/health checks in a row without an answer that make a rollout instance failed (it is replaced, its "
        "requests re-sent). A hung server is failed within failures x (interval + timeout) seconds.", ge=1)
    rollout_stall_timeout_s: float = opt(
        120.0, "Seconds a serving rollout instance with requests in flight may process no token (by its engine's "
        "own token counters on the server's /metrics) before it is failed (replaced, its requests re-sent): an "
        "engine that hangs while its front end still answers /health. Checked every "
        "rollout_health_check_interval_s. 0 = not watched (a hung engine is then found when a request times out).",
        ge=0)
    restart_backoff_s: float = opt(
        5.0, "Seconds a pool (rollout or training) waits before starting a new member after one failed within "
        "120 s of becoming ready (e.g. a server that crashes on its first requests); the wait doubles with each "
        "such failure in a row, up to 300 s, and a member that served longer resets it. 0 = replace at once.",
        ge=0)
    train_hang_timeout_s: float = opt(
        300.0, "Seconds a training call (a step, a log-prob pass, a checkpoint save or load, a weight export) may "
        "run at least before the training pool counts as hung (a rank stopped answering, or a collective never "
        "completed): its workers are killed and the pool started again from the newest complete checkpoint, as "
        "after a lost worker (runtime_training_restart_limit counts it). A kind of call not yet completed at the "
        "pool's size and layout (a first step, a load) may run an hour, or this when longer.", gt=0)
    train_hang_timeout_factor: float = opt(
        10.0, "A training call may also run this many times the slowest call of its kind completed at the pool's "
        "size and layout, when that is longer than train_hang_timeout_s. 0 = train_hang_timeout_s alone.", ge=0)
    rollout_temperature: float = opt(1.0, "Sampling temperature of rollouts.", ge=0)
    rollout_top_p: float = opt(1.0, "Nucleus sampling top_p of rollouts.", gt=0, le=1)
    expected_response_tokens: int = opt(
        0, "The planner's expected mean response length in tokens; 0 = max_new_tokens / 2.", ge=0
    )

    megatron_use_precision_aware_optimizer: bool = opt(
        False, "Keep optimizer-state precision aligned with mixed precision (needs the distributed optimizer)."
    )
    megatron_optimizer_cpu_offload: bool = opt(False, "Offload optimizer state to CPU.")
    megatron_optimizer_offload_fraction: float = opt(
        0.0, "Fraction of optimizer state to offload (0..1); only with megatron_optimizer_cpu_offload.",
        ge=0, le=1,
    )
    megatron_use_cpu_initialization: bool = opt(
        False, "Build model weights through CPU initialization (required on logical GPUs)."
    )
    megatron_grouped_gemm: bool = opt(False, "Enable grouped GEMM for MoE experts when available.")
    megatron_use_distributed_optimizer: bool = opt(
        False, "Shard optimizer state across data-parallel ranks (Megatron distributed optimizer)."
    )
    megatron_recompute_granularity: Literal["none", "selective", "full"] = opt(
        "none", "Activation recomputation: none, selective (attention core) or full (whole layers)."
    )
    megatron_params_dtype: Literal["bf16", "fp16", "fp32"] = opt("bf16", "Training parameter dtype.")

    cluster: ClusterConfig = opt(factory=ClusterConfig, doc="Cluster shape.")
    global_resource_planner: PlannerConfig = opt(factory=PlannerConfig, doc="Global Resource Planner.")
    algorithm: AlgorithmConfig = opt(factory=AlgorithmConfig, doc="RL algorithm.")
    optimizer: OptimizerConfig = opt(factory=OptimizerConfig, doc="Optimizer.")
    task: TaskConfig = opt(factory=TaskConfig, doc="Task, data and reward.")
    checkpoint: CheckpointConfig = opt(factory=CheckpointConfig, doc="Checkpointing.")
    tracking: TrackingConfig = opt(factory=TrackingConfig, doc="Metrics.")
    operator_api: OperatorApiConfig = opt(factory=OperatorApiConfig, doc="Operator API of the running job.")
    build_tiny_model: TinyModelConfig = opt(factory=TinyModelConfig, doc="Tiny local model for development.")

    warnings: list[str] = internal(list, "Non-fatal findings of validation (deprecated or ignored options).")
    source: str = internal(str, "The YAML file this configuration was loaded from ('' for a dict).")

    @property
    def train_model_parallel_size(self) -> int:
        """GPUs of one training model replica: TP x PP x CP."""
        return self.train_tp_size * self.train_pp_size * self.train_cp_size

    @property
    def train_dp_size(self) -> int:
        """Data-parallel size of the configured training pool: train_gpus // (TP x PP x CP)."""
        return self.train_gpus // self.train_model_parallel_size

    @property
    def samples_per_step(self) -> int:
        return self.batch_size * self.n_samples

    @property
    def num_rollout_instances(self) -> int:
        return self.rollout_gpus // self.rollout_tp_size

    @property
    def total_gpus(self) -> int:
        return self.cluster.num_nodes * self.cluster.gpus_per_node

    @property
    def effective_max_concurrent_rollouts(self) -> int:
        if self.max_concurrent_rollouts:
            return self.max_concurrent_rollouts
        return self.samples_per_step * (self.max_head_offpolicyness + 1)

    @property
    def effective_expected_response_tokens(self) -> int:
        return self.expected_response_tokens or max(1, self.max_new_tokens // 2)

    def model_dir(self) -> str:
        """The resolved model directory (model_path after loading is absolute)."""
        return os.path.abspath(self.model_path)

    def model_spec(self) -> ModelSpec:
        """Architecture facts: from build_tiny_model when enabled, else from model_path/config.json."""
        if self.build_tiny_model.enabled:
            name = os.path.basename(self.model_dir().rstrip(os.sep)) or "tiny-model"
            return model_spec_from_dict(self.build_tiny_model.hf_config(), name=name, source="build_tiny_model")
        return load_model_spec(self.model_dir())
