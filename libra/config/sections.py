"""The sections of a Libra job configuration (cluster, planner, algorithm, optimizer, task, checkpoint,
tracking, tiny model): one frozen dataclass per YAML section, declared with `opt()`.

The top-level `Config` that holds them lives in `schema.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dataclasses_json import DataClassJsonMixin

from libra.config.fields import opt
from planner.hardware import GPUSpec, describe_gpu

GiB = 1024**3

ConsoleMode = Literal["rich", "plain", "off"]
TrackingBackend = Literal["jsonl", "prometheus"]
TaskName = Literal["mod_add", "copy_first", "max_of", "drift", "dataset"]
BUILTIN_TASKS: tuple[str, ...] = ("mod_add", "copy_first", "max_of", "drift")


@dataclass(frozen=True, kw_only=True)
class GpuSpecConfig(DataClassJsonMixin):
    """Figures of a GPU for the planner, in datasheet units. With a gpu_type from the catalog, each figure set
    (non-zero) replaces the catalog's (e.g. a slower network); with gpu_type custom or a type not in the
    catalog, every figure is required. Bandwidths are per GPU and per direction."""

    name: str = opt("", "Name shown in plans for a described GPU; empty = the gpu_type.")
    memory_gb: float = opt(0.0, "Device memory per GPU in GB (10^9 bytes); 0 = from the catalog.", ge=0)
    bf16_dense_tflops: float = opt(
        0.0, "Dense (no 2:4 sparsity) bf16 tensor throughput per GPU in TFLOP/s; 0 = from the catalog.", ge=0
    )
    hbm_tb_per_s: float = opt(0.0, "Device memory bandwidth per GPU in TB/s; 0 = from the catalog.", ge=0)
    intra_node_gb_per_s: float = opt(
        0.0,
        "Bandwidth from one GPU to its node peers in GB/s per direction (NVLink, Infinity Fabric or PCIe: half "
        "the bidirectional datasheet figure); 0 = from the catalog.",
        ge=0,
    )
    inter_node_gb_per_s: float = opt(
        0.0, "Network bandwidth per GPU in GB/s per direction (a 400 Gb/s NIC per GPU = 50); 0 = from the catalog.",
        ge=0,
    )

    def figures(self) -> dict[str, float]:
        """The numeric figures by name (0 = not given), as `planner.hardware.describe_gpu` takes them."""
        return {"memory_gb": self.memory_gb, "bf16_dense_tflops": self.bf16_dense_tflops,
                "hbm_tb_per_s": self.hbm_tb_per_s, "intra_node_gb_per_s": self.intra_node_gb_per_s,
                "inter_node_gb_per_s": self.inter_node_gb_per_s}


@dataclass(frozen=True, kw_only=True)
class ClusterConfig(DataClassJsonMixin):
    """The machines of the job. A CPU development machine is described with `logical_gpus: true` and
    `gpu_type: cpu-logical`: Ray then hands out logical GPUs that are CPU processes."""

    num_nodes: int = opt(1, "Number of nodes in the cluster.", ge=1)
    gpus_per_node: int = opt(8, "GPUs (or logical GPUs) per node.", ge=1)
    gpu_type: str = opt(
        "H100",
        "GPU model, a name or alias from the planner's hardware catalog (H100, H100-PCIe, H100-NVL, H800, H20, "
        "H200, A100, A100-40GB, A800, A10, L20, L40, L40S, B200, GB200, MI300X, MI325X, cpu-logical, or a full "
        "name such as H100-SXM-80GB; case-insensitive), or custom (then cluster.gpu_spec describes it). Sets "
        "memory and speed figures for planning (catalog listed in cluster_manual/planner.md; figures and their "
        "datasheet sources in planner/hardware.py).",
    )
    gpu_spec: GpuSpecConfig = opt(
        factory=GpuSpecConfig,
        doc="Figures of a GPU not in the catalog (gpu_type custom or any other name), or corrections to a "
        "catalog entry.",
    )
    logical_gpus: bool = opt(
        False,
        "Run on a CPU machine with Ray logical GPUs (development and CI). Requires gpu_type cpu-logical; "
        "several features are Not validated there (see cluster_manual/validation.md).",
    )
    ray_address: str = opt("", "Address of an existing Ray cluster; empty starts a local Ray instance.")
    cpus_per_gpu: float = opt(1.0, "CPU cores reserved per GPU worker (Ray num_cpus of each actor).", gt=0)
    metered_cpu_per_gpu: float = opt(
        0.0,
        "Logical GPUs only: CPU cores per logical GPU, enforced by the kernel's CPU controller (cgroup v2 cpu.max "
        "or v1 cpu.cfs_quota_us). Each rollout instance and training worker runs in a slice of GPUs held x this "
        "many cores, so a pool's capacity follows its GPU count as on a real cluster; the controller and Ray "
        "keep the other cores. 0 = off (every logical GPU shares all cores). See cluster_manual/metering.md.",
        ge=0,
    )
    metered_cgroup_root: str = opt(
        "",
        "With metered_cpu_per_gpu: the cgroup directory under which the job's CPU slices are made (a cgroup v1 "
        "cpu hierarchy directory, or a cgroup v2 directory with the cpu controller delegated); empty = the cgroup "
        "this process runs in on the mounted CPU controller.",
    )

    def gpu(self) -> GPUSpec:
        """The GPU the planner plans for: the catalog entry of gpu_type, corrected or described by gpu_spec.
        Raises `planner.hardware.UnknownGPUError` naming the missing gpu_spec figures."""
        return describe_gpu(self.gpu_type, self.gpu_spec.figures(), self.gpu_spec.name)


@dataclass(frozen=True, kw_only=True)
class PlannerConfig(DataClassJsonMixin):
    """Global Resource Planner (GRP): memory budget checks, the initial train/rollout split, candidate
    layouts, and the runtime planner and elastic options (resizing pools while the job runs)."""

    memory_budget_check_enabled: bool = opt(
        True, "Include recompute-logprobs temporary memory (logits and workspace) in GRP candidate budgets."
    )
    memory_budget_dry_run_enabled: bool = opt(
        False, "Run one complete runtime recompute-logprobs probe before training to confirm the budget."
    )
    memory_budget_safety_margin_bytes: int = opt(
        2 * GiB, "Device memory per GPU reserved outside the analytic estimate (bytes).", ge=0
    )
    memory_budget_logits_dtype_bytes: Literal[2, 4] = opt(
        4, "Dtype width of the logits temporary in the estimate: 2 (bf16/fp16) or 4 (fp32)."
    )
    memory_budget_workspace_factor: float = opt(
        3.0, "Multiplier for simultaneous logits/workspace temporaries in the estimate: fp32 vocabulary-sized "
        "tensors live at once in the log-prob recomputation (3: the logits or their fp32 copy, the shifted "
        "logits and their exp, as measured by benchmarks/memory_accuracy_megatron.py).", ge=1.0
    )
    runtime_dynamic_reconfiguration_enabled: bool = opt(
        False, "Master switch for runtime reconfiguration; every runtime_* switch below needs it."
    )
    initial_allocation_strategy: Literal["grp", "configured"] = opt(
        "grp",
        "grp runs planning before launch (train_gpus/rollout_gpus and train_*_size are the fallback and "
        "the baseline the plan is compared with); configured preserves the explicitly pinned split.",
    )
    allocation_granularity_gpus: int = opt(
        0,
        "Granularity of the initial train/rollout split, normally one node or one DP replica; "
        "0 derives it: one node on a multi-node cluster, one GPU on a single node.",
        ge=0,
    )
    min_train_gpus: int = opt(
        0, "Minimum training capacity retained during startup planning, and when a lost node makes the job "
        "re-plan onto the GPUs left (it stops when this does not fit); 0 = one training replica.", ge=0
    )
    min_rollout_gpus: int = opt(
        0, "Minimum rollout capacity retained during startup planning, and when a lost node makes the job "
        "re-plan onto the GPUs left (it stops when this does not fit); 0 = one rollout instance.", ge=0
    )
    allowed_train_tp: tuple[int, ...] = opt(
        (),
        "Candidate training TP degrees (a search space: values that do not divide the attention and KV heads "
        "or exceed a node are pruned with a warning; at least one must be usable). Empty derives them "
        "(powers of two up to gpus_per_node that divide the heads).",
        item_ge=1,
    )
    allowed_train_ep: tuple[int, ...] = opt(
        (),
        "Candidate training EP degrees (a search space: EP > 1 on a dense model or not dividing the expert "
        "count is pruned with a warning; at least one must be usable). Empty derives them.",
        item_ge=1,
    )
    allowed_train_pp: tuple[int, ...] = opt(
        (),
        "Candidate training PP degrees (a search space: values whose PP x train_vpp_size does not divide the "
        "layer count are pruned with a warning; at least one must be usable). Empty derives them.",
        item_ge=1,
    )
    allowed_train_cp: tuple[int, ...] = opt(
        (), "Candidate training CP (context-parallel) degrees. Empty = [1] (no context parallelism).", item_ge=1
    )
    train_comm_compute_ratio_threshold: float = opt(
        0.5, "Prune TP branches whose estimated communication/compute ratio exceeds this value.", gt=0
    )
    train_ep_comm_compute_ratio_threshold: float = opt(
        0.5, "Prune EP branches whose estimated All-to-All/compute ratio exceeds this value.", gt=0
    )
    train_pipeline_bubble_ratio_threshold: float = opt(
        0.25, "Prune PP branches whose analytical bubble ratio exceeds this value.", gt=0, le=1
    )
    runtime_online_replanning: bool = opt(
        False,
        "Every replan_interval_steps steps, calibrate the planner on what the job measured (rollout tok/s, "
        "train step time, queue depth, response-length trend, idle shares) and reconfigure the pools when "
        "the best split promises replan_min_gain more samples/s and pays for its switch.",
    )
    runtime_manage_rollout_processes: bool = opt(
        True,
        "Let Libra start, stop and adopt rollout processes. When false, Libra uses the servers listed in "
        "rollout_endpoints and never starts or stops them.",
    )
    runtime_rollout_reconfigure_strategy: Literal["diff", "restart_all", "blue_green", "prewarm", "cluster_swap"] = (
        opt(
            "diff",
            "How the rollout pool changes size: diff (start/stop only the changed instances), restart_all, "
            "blue_green and prewarm (start the new set on spare GPUs first), cluster_swap (exchange GPUs "
            "with the training pool, no spare GPUs needed).",
        )
    )
    runtime_cluster_swap_enabled: bool = opt(
        False, "Enable rollout/training pool exchange without spare GPUs."
    )
    runtime_reconfigure_training: bool = opt(False, "Enable training-side pool changes.")
    runtime_training_pool_plan_only: bool = opt(
        False, "Record training-pool changes in the event log without attaching workers."
    )
    decouple_communication_domains: bool = opt(
        False, "Keep elastic gradient traffic off the core training DP process group."
    )
    elastic_hybrid_replica_size_gpus: int = opt(
        0,
        "GPUs in one replica that elastic hybrid parallelism borrows from idle rollout instances in a "
        "synchronous job with runtime_reconfigure_training (a multiple of TPxEPxPPxCP); 0 derives it from the "
        "training topology (one complete TPxEPxPPxCP replica).",
        ge=0,
    )
    elastic_hybrid_min_rollout_gpus: int = opt(
        0, "Rollout capacity (GPUs) that elastic hybrid parallelism may never borrow.", ge=0
    )
    elastic_hybrid_max_workers: int | None = opt(
        None,
        "Deprecated and ignored; elastic hybrid parallelism has no policy maximum.",
        deprecated="deprecated and ignored: elastic hybrid parallelism has no policy maximum",
    )
    runtime_batch_collection_timeout_s: float = opt(
        600.0, "Timeout (seconds) for collecting one training batch from the rollout pool.", gt=0
    )
    runtime_batch_collection_max_retries: int = opt(
        3, "Retries after a batch collection timeout before the step fails.", ge=0
    )
    runtime_drain_before_reconfigure: bool = opt(
        True, "Drain in-flight rollout work before a runtime change."
    )
    replan_interval_steps: int = opt(
        10, "Training steps between online re-planning decisions (runtime_online_replanning).", ge=1
    )
    replan_min_gain: float = opt(
        0.05,
        "Hysteresis: the relative throughput gain a new plan must promise before the pools are resized.",
        ge=0,
    )
    runtime_node_loss_policy: Literal["replan", "wait"] = opt(
        "replan",
        "What a running job does when a lost node leaves fewer GPUs than its pools hold: replan (at once onto "
        "the GPUs left, at least min_train_gpus / min_rollout_gpus) or wait (up to runtime_node_loss_wait_s for "
        "the GPUs to come back, keeping its pools; then replan).",
    )
    runtime_node_loss_wait_s: float = opt(
        600.0,
        "Seconds a job waits for lost GPUs: with runtime_node_loss_policy wait, for all of them before it "
        "re-plans; with either policy, for its smallest pools to fit before it stops.",
        ge=0,
    )
    runtime_training_restart_limit: int = opt(
        3,
        "Times in a row a running job restarts its training pool after a lost training worker (each restart "
        "resumes from the newest complete checkpoint) before it stops; a checkpoint saved in between starts the "
        "count again. 0 stops the job at the first lost worker.",
        ge=0,
    )


@dataclass(frozen=True, kw_only=True)
class RefKLConfig(DataClassJsonMixin):
    """KL penalty against the frozen reference policy (the initial model_path weights)."""

    enable: bool = opt(False, "Add coef x KL(policy || reference) to the loss.")
    coef: float = opt(0.001, "KL coefficient.", ge=0)
    kl_type: Literal["k1", "k2", "k3"] = opt("k3", "KL estimator: k1, k2 or k3 (low-variance, non-negative).")


@dataclass(frozen=True, kw_only=True)
class ISCorrectionConfig(DataClassJsonMixin):
    """Importance-sampling correction between the rollout engine's and the trainer's log-probabilities."""

    enable: bool = opt(False, "Enable importance-sampling correction (needs recompute_logprobs).")
    level: Literal["token", "sequence"] = opt("token", "Weight granularity: token or sequence.")
    action: Literal["clip", "mask"] = opt(
        "clip", "Out-of-bound weights: clip (clamp to the bounds) or mask (drop from the loss)."
    )
    lower_bound: float = opt(0.5, "IS weight lower bound; must be < 1.", ge=0, lt=1)
    upper_bound: float = opt(2.0, "IS weight upper bound; must be > 1.", gt=1)


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig(DataClassJsonMixin):
    """GRPO-family algorithm: advantages, policy loss, clipping and regularizers."""

    advantage_estimator: Literal["grpo"] = opt("grpo", "Advantage estimator.")
    advantage_norm_mode: Literal["none", "group_mean", "group_zscore", "batch_mean", "batch_zscore"] = opt(
        "group_zscore",
        "Advantage normalization: none, group_mean / group_zscore (per prompt group, needs n_samples >= 2), "
        "batch_mean / batch_zscore (over the whole step).",
    )
    policy_loss: Literal["grpo"] = opt("grpo", "Policy loss.")
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean"] = opt(
        "token-mean", "Loss aggregation: token-mean or seq-mean-token-mean."
    )
    clip_ratio_low: float = opt(0.2, "Lower PPO clip ratio (ratio >= 1 - clip_ratio_low).", ge=0, lt=1)
    clip_ratio_high: float = opt(
        0.28, "Upper PPO clip ratio (ratio <= 1 + clip_ratio_high); larger than low = clip-higher.", ge=0
    )
    clip_ratio_c: float = opt(3.0, "Dual-clip bound for negative advantages; must be > 1.", gt=1)
    entropy_coef: float = opt(0.0, "Entropy bonus coefficient (subtracts coef x entropy from the loss).", ge=0)
    ref_kl: RefKLConfig = opt(factory=RefKLConfig, doc="Reference-model KL penalty.")
    is_correction: ISCorrectionConfig = opt(factory=ISCorrectionConfig, doc="Importance-sampling correction.")


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig(DataClassJsonMixin):
    """Adam optimizer of the training pool."""

    lr: float = opt(1e-6, "Peak learning rate.", gt=0)
    min_lr: float = opt(
        0.0, "Learning rate reached at total_steps by a linear or cosine lr_decay_style; must be <= lr.", ge=0
    )
    lr_warmup_steps: int = opt(0, "Linear warm-up steps; must be <= total_steps.", ge=0)
    lr_decay_style: Literal["constant", "linear", "cosine"] = opt(
        "constant",
        "Learning rate after the warm-up: constant (stays at lr), linear or cosine (from lr down to min_lr "
        "at total_steps).",
    )
    weight_decay: float = opt(0.0, "Decoupled weight decay (AdamW).", ge=0)
    adam_beta1: float = opt(0.9, "Adam beta1.", ge=0, lt=1)
    adam_beta2: float = opt(0.999, "Adam beta2.", ge=0, lt=1)
    adam_eps: float = opt(1e-8, "Adam epsilon.", gt=0)
    clip_grad: float = opt(1.0, "Gradient clipping by global L2 norm; 0 disables clipping.", ge=0)


@dataclass(frozen=True, kw_only=True)
class TaskConfig(DataClassJsonMixin):
    """Prompts and rewards: a built-in task or a prompt dataset."""

    name: TaskName = opt(
        "mod_add", "Built-in task (mod_add: modular addition with a verifiable answer; drift: copy_first with "
        "responses that grow over training, see cluster_manual/tasks.md) or dataset."
    )
    dataset_path: str = opt(
        "", "Prompt dataset (.jsonl or .parquet); required when name is dataset.", path=True
    )
    eval_dataset_path: str = opt("", "Evaluation prompts (.jsonl or .parquet).", path=True)
    input_key: str = opt("prompt", "Dataset column holding the prompt.")
    label_key: str = opt("answer", "Dataset column holding the reference answer.")
    reward: str = opt("", "Reward function from the reward registry; empty uses the task's own reward.")
    eval_interval: int = opt(0, "Training steps between evaluations; 0 = no evaluation.", ge=0)
    eval_size: int = opt(0, "Evaluation prompts per evaluation; 0 = all.", ge=0)
    params: dict[str, int | float | str] = opt(
        factory=dict, doc="Task and reward parameters (scalars), e.g. {modulus: 10} for mod_add."
    )


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig(DataClassJsonMixin):
    """Training checkpoints under run_dir."""

    interval_steps: int = opt(0, "Training steps between checkpoints; 0 = only at the end.", ge=0)
    keep_last: int = opt(2, "Checkpoints kept from the most recent ones; 0 keeps all.", ge=0)
    keep_every: int = opt(
        0, "Also keep every checkpoint whose step is a multiple of this; 0 = none.", ge=0
    )
    resume: bool = opt(True, "Resume from the newest checkpoint in run_dir when one exists.")
    mirror_dir: str = opt(
        "", "A second folder each complete checkpoint is copied to in the background, with the same retention "
        "(best on another file system); a resume whose checkpoint in run_dir is damaged or missing takes the "
        "mirror's copy of that step before an older checkpoint. Empty = no mirror."
    )


@dataclass(frozen=True, kw_only=True)
class TrackingConfig(DataClassJsonMixin):
    """Metrics output."""

    backends: tuple[TrackingBackend, ...] = opt(
        ("jsonl",), "Metric sinks: jsonl (run_dir/metrics.jsonl) and/or prometheus."
    )
    prometheus_port: int = opt(0, "Port of the Prometheus exporter; 0 = off.", ge=0, le=65535)
    prometheus_bind_address: str = opt(
        "127.0.0.1", "IP address the Prometheus exporter listens on: loopback by default; 0.0.0.0 (or a node "
        "address) lets a cluster's Prometheus scrape it."
    )
    console: ConsoleMode = opt("rich", "Console progress output: rich, plain or off.")


@dataclass(frozen=True, kw_only=True)
class OperatorApiConfig(DataClassJsonMixin):
    """The operator API (gRPC) a running job serves; `libra reconfigure / pause / resume / drain / events /
    status` reach the job through it. Every call carries the token the job writes to run_dir/api_token
    (readable by its owner only); the address is written to run_dir/api_address.json."""

    enabled: bool = opt(True, "Serve the operator API while the job runs.")
    bind_address: str = opt(
        "127.0.0.1", "IP address the API listens on; anything but loopback needs tls_cert_path and tls_key_path."
    )
    port: int = opt(0, "Port of the API; 0 = any free port (the address file says which).", ge=0, le=65535)
    tls_cert_path: str = opt("", "PEM certificate (chain) the API presents; required off loopback.", path=True)
    tls_key_path: str = opt("", "PEM private key of tls_cert_path; required off loopback.", path=True)


@dataclass(frozen=True, kw_only=True)
class TinyModelConfig(DataClassJsonMixin):
    """A tiny randomly initialised model that the launcher builds at model_path when it is missing
    (development and CI). When enabled, validation reads the architecture from these fields."""

    enabled: bool = opt(False, "Build a tiny random model at model_path if none exists there.")
    arch: Literal["llama", "qwen2", "qwen3"] = opt("llama", "Architecture family of the tiny model.")
    hidden_size: int = opt(128, "Hidden size.", ge=1)
    num_layers: int = opt(2, "Decoder layers.", ge=1)
    num_heads: int = opt(4, "Attention heads; must divide hidden_size.", ge=1)
    num_kv_heads: int = opt(2, "Key/value heads; must divide num_heads.", ge=1)
    intermediate_size: int = opt(256, "MLP intermediate size.", ge=1)
    vocab_size: int = opt(256, "Embedding rows of the tiny model; at least the word-level tokenizer's 219 words "
                           "(ids past them are never produced).", ge=219)
    max_position_embeddings: int = opt(2048, "Maximum positions of the model.", ge=16)
    init_std: float = opt(0.02, "Standard deviation of the random weight initialisation.", gt=0)
    seed: int = opt(0, "Seed of the weight initialisation and tokenizer training.")

    def hf_config(self) -> dict[str, object]:
        """The HF `config.json` contents this section describes."""
        return {
            "model_type": self.arch,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.hidden_size // self.num_heads,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": self.init_std,
            "tie_word_embeddings": False,
        }
