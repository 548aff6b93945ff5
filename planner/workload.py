"""Planner inputs other than the model and the GPU: cluster shape, RL workload, training and rollout options,
memory-budget knobs, the search space and the cost-model constants, bundled as `PlannerInputs`.

Every dataclass is frozen; `PlannerInputs.validate()` collects every bad value with its field name so a caller
can report them all at once. Pure: stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from planner.architectures import PLAN, unsupported_message
from planner.hardware import GPUSpec
from planner.model_spec import ModelSpec

Implementation = Literal["megatron", "hf"]
AttentionBackend = Literal["flash", "eager"]
RecomputeGranularity = Literal["none", "selective", "full"]
Strategy = Literal["grp", "configured"]

IMPLEMENTATIONS: tuple[str, ...] = ("megatron", "hf")
ATTENTION_BACKENDS: tuple[str, ...] = ("flash", "eager")
RECOMPUTE_GRANULARITIES: tuple[str, ...] = ("none", "selective", "full")
STRATEGIES: tuple[str, ...] = ("grp", "configured")


class PlannerInputError(ValueError):
    """Planner inputs that cannot be planned; `.problems` lists every `field: value: what to do`."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class ClusterSpec:
    """Homogeneous GPU cluster: `num_nodes` x `gpus_per_node` GPUs of one type."""

    num_nodes: int
    gpus_per_node: int
    gpu: GPUSpec

    @property
    def total_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node


@dataclass(frozen=True)
class Workload:
    """One RL step: `batch_size` prompt groups x `n_samples` responses, trained in one optimizer step."""

    batch_size: int
    n_samples: int
    max_model_len: int
    max_new_tokens: int
    expected_response_tokens: int = 0  # 0 -> max_new_tokens / 2
    expected_prompt_tokens: int = 0  # 0 -> (max_model_len - max_new_tokens) / 2
    max_concurrent_rollouts: int = 0  # 0 -> no cap beyond what the step and the off-policy bound admit
    max_head_offpolicyness: int = 0  # 0 = synchronous on-policy
    recompute_logprobs: bool = True
    recompute_micro_batch_size: int = 1
    train_micro_batch_size: int = 1
    sync_interval: int = 1  # training steps between weight syncs to the rollout pool

    @property
    def samples_per_step(self) -> int:
        return self.batch_size * self.n_samples

    @property
    def is_async(self) -> bool:
        return self.max_head_offpolicyness > 0

    @property
    def response_tokens(self) -> float:
        if self.expected_response_tokens > 0:
            return float(min(self.expected_response_tokens, self.max_new_tokens))
        return self.max_new_tokens / 2.0

    @property
    def prompt_tokens(self) -> float:
        if self.expected_prompt_tokens > 0:
            return float(self.expected_prompt_tokens)
        return max(1.0, (self.max_model_len - self.max_new_tokens) / 2.0)

    @property
    def mean_sequence_tokens(self) -> float:
        return min(float(self.max_model_len), self.prompt_tokens + self.response_tokens)

    @property
    def rollouts_in_flight(self) -> int:
        """Sequences generating at once over the whole rollout pool (the async bound lets later steps start)."""
        wanted = self.samples_per_step * (1 + self.max_head_offpolicyness)
        if self.max_concurrent_rollouts > 0:
            return min(wanted, self.max_concurrent_rollouts)
        return wanted


@dataclass(frozen=True)
class TrainOptions:
    """Megatron-Core options that change memory or speed.

    `implementation`/`attention_backend` select the activation formula: Megatron-Core (TE, sequence parallel
    when TP > 1) or Hugging Face transformers modules; flash-style attention (O(s) saved state) or eager
    attention (s x s scores and probabilities saved).
    """

    params_dtype_bytes: int = 2
    main_grad_bytes: int = 4
    use_distributed_optimizer: bool = True
    precision_aware_optimizer: bool = False
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 1.0
    recompute_granularity: RecomputeGranularity = "none"
    sequence_parallel: bool = True
    vpp: int = 1
    implementation: Implementation = "megatron"
    attention_backend: AttentionBackend = "flash"
    fused_optimizer: bool = True  # fused/multi-tensor Adam: no per-step temporaries

    @property
    def main_params_bytes(self) -> int:
        """fp32 main copy of 16-bit parameters; fp32 training keeps none."""
        return 0 if self.params_dtype_bytes >= 4 else 4

    @property
    def exp_avg_bytes(self) -> int:
        return 2 if self.precision_aware_optimizer else 4

    @property
    def exp_avg_sq_bytes(self) -> int:
        return 2 if self.precision_aware_optimizer else 4

    @property
    def optimizer_bytes_per_param(self) -> int:
        return self.main_params_bytes + self.exp_avg_bytes + self.exp_avg_sq_bytes

    @property
    def offloaded_fraction(self) -> float:
        return self.optimizer_offload_fraction if self.optimizer_cpu_offload else 0.0


@dataclass(frozen=True)
class RolloutOptions:
    """vLLM instance options that change memory or speed."""

    weight_dtype_bytes: int = 2
    kv_dtype_bytes: int = 2
    gpu_memory_utilization: float = 0.9
    kv_cache_bytes: int = 0  # explicit KV-cache size per instance; 0 = what the memory budget leaves
    max_num_batched_tokens: int = 8192
    reload_method: str = "restart"  # "restart" (new server process) | "inplace" (reload into the live server)


@dataclass(frozen=True)
class MemoryBudget:
    """The `global_resource_planner.memory_budget_*` knobs."""

    check_enabled: bool = True
    safety_margin_bytes: int = 0
    logits_dtype_bytes: int = 4
    workspace_factor: float = 2.5


@dataclass(frozen=True)
class PinnedLayout:
    """A split and layout fixed by the user (`initial_allocation_strategy: configured`)."""

    train_gpus: int
    rollout_gpus: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    rollout_tp: int = 1


@dataclass(frozen=True)
class SearchSpace:
    """Allowed parallel degrees, split granularity and pruning thresholds."""

    allowed_tp: tuple[int, ...] = (1, 2, 4, 8)
    allowed_pp: tuple[int, ...] = (1, 2, 4, 8)
    allowed_cp: tuple[int, ...] = (1,)
    allowed_ep: tuple[int, ...] = (1,)
    allowed_rollout_tp: tuple[int, ...] = (1, 2, 4, 8)
    allocation_granularity_gpus: int = 1
    min_train_gpus: int = 1
    min_rollout_gpus: int = 1
    comm_compute_ratio_threshold: float = 0.5
    ep_comm_compute_ratio_threshold: float = 1.0
    bubble_ratio_threshold: float = 0.5
    strategy: Strategy = "grp"
    pinned: PinnedLayout | None = None


@dataclass(frozen=True)
class CostParams:
    """Efficiency constants of the cost model (see cluster_manual/planner.md); the speed factors are what
    online re-planning calibrates from observed metrics."""

    train_mfu: float = 0.40
    recompute_mfu: float = 0.45
    prefill_mfu: float = 0.50
    decode_mfu: float = 0.50
    hbm_efficiency: float = 0.75
    comm_efficiency: float = 0.80
    intra_node_latency_s: float = 10e-6
    inter_node_latency_s: float = 30e-6
    decode_step_overhead_s: float = 0.002
    host_link_bytes_per_s: float = 25e9  # PCIe between GPU and host memory (offloaded optimizer)
    weight_reload_restart_s: float = 30.0  # vLLM server restart to ready, without reading the weights
    weight_reload_inplace_s: float = 1.0
    rollout_restart_s: float = 60.0
    train_restart_s: float = 120.0
    rollout_speed_factor: float = 1.0
    train_speed_factor: float = 1.0


def _positive(problems: list[str], name: str, value: float, minimum: float = 1) -> None:
    if value < minimum:
        problems.append(f"{name}: {value!r}: must be >= {minimum}")


@dataclass(frozen=True)
class EhpOptions:
    """Elastic hybrid parallelism as a job runs it (`planner.ehp`): in a synchronous job the training step
    borrows the rollout GPUs beyond `min_rollout_gpus` as extra data-parallel replicas of `replica_size_gpus`
    GPUs (0 = one complete replica of the layout). Set only where the job lends (not plan-only)."""

    min_rollout_gpus: int = 0
    replica_size_gpus: int = 0


@dataclass(frozen=True)
class PlannerInputs:
    """Everything one search needs. `ehp`: the training phase is priced on the GPUs elastic hybrid
    parallelism lends it (None: on the training pool's own)."""

    model: ModelSpec
    cluster: ClusterSpec
    workload: Workload
    train: TrainOptions = field(default_factory=TrainOptions)
    rollout: RolloutOptions = field(default_factory=RolloutOptions)
    budget: MemoryBudget = field(default_factory=MemoryBudget)
    space: SearchSpace = field(default_factory=SearchSpace)
    cost: CostParams = field(default_factory=CostParams)
    ehp: EhpOptions | None = None

    def with_cluster(self, num_nodes: int) -> PlannerInputs:
        return replace(self, cluster=replace(self.cluster, num_nodes=num_nodes))

    def validate(self) -> None:
        """Raise `PlannerInputError` naming every bad value."""
        p: list[str] = []
        c, w, t, s = self.cluster, self.workload, self.train, self.space
        unplannable = unsupported_message(self.model.model_type, (PLAN,))
        if unplannable:
            p.append(f"model_path: {unplannable}")
        _positive(p, "cluster.num_nodes", c.num_nodes)
        _positive(p, "cluster.gpus_per_node", c.gpus_per_node)
        for name in ("batch_size", "n_samples", "max_model_len", "max_new_tokens",
                     "recompute_micro_batch_size", "train_micro_batch_size"):
            _positive(p, name, getattr(w, name))
        if w.max_new_tokens >= w.max_model_len:
            p.append(f"max_new_tokens: {w.max_new_tokens}: must be below max_model_len ({w.max_model_len}) "
                     "to leave room for the prompt")
        _positive(p, "max_head_offpolicyness", w.max_head_offpolicyness, 0)
        _positive(p, "max_concurrent_rollouts", w.max_concurrent_rollouts, 0)
        _positive(p, "train_vpp_size", t.vpp)
        if t.recompute_granularity not in RECOMPUTE_GRANULARITIES:
            p.append(f"megatron_recompute_granularity: {t.recompute_granularity!r}: choose one of "
                     f"{', '.join(RECOMPUTE_GRANULARITIES)}")
        if t.implementation not in IMPLEMENTATIONS:
            p.append(f"implementation: {t.implementation!r}: choose one of {', '.join(IMPLEMENTATIONS)}")
        if t.attention_backend not in ATTENTION_BACKENDS:
            p.append(f"attention_backend: {t.attention_backend!r}: choose one of {', '.join(ATTENTION_BACKENDS)}")
        if not 0.0 <= t.optimizer_offload_fraction <= 1.0:
            p.append(f"megatron_optimizer_offload_fraction: {t.optimizer_offload_fraction}: must be in [0, 1]")
        for name in ("allowed_tp", "allowed_pp", "allowed_cp", "allowed_ep", "allowed_rollout_tp"):
            values = getattr(s, name)
            if not values or any(v < 1 for v in values):
                p.append(f"global_resource_planner.{name}: {list(values)}: needs at least one value, all >= 1")
        _positive(p, "global_resource_planner.allocation_granularity_gpus", s.allocation_granularity_gpus)
        _positive(p, "global_resource_planner.min_train_gpus", s.min_train_gpus)
        _positive(p, "global_resource_planner.min_rollout_gpus", s.min_rollout_gpus, 0)
        if s.strategy not in STRATEGIES:
            p.append(f"global_resource_planner.initial_allocation_strategy: {s.strategy!r}: choose one of "
                     f"{', '.join(STRATEGIES)}")
        if s.strategy == "configured" and s.pinned is None:
            p.append("initial_allocation_strategy: 'configured' needs train_gpus and rollout_gpus pinned")
        if self.budget.workspace_factor <= 0 or self.budget.logits_dtype_bytes <= 0:
            p.append("global_resource_planner.memory_budget_workspace_factor/logits_dtype_bytes: must be > 0")
        if s.strategy == "grp" and s.min_train_gpus + max(1, s.min_rollout_gpus) > c.total_gpus:
            p.append(f"global_resource_planner.min_train_gpus + min_rollout_gpus: "
                     f"{s.min_train_gpus} + {max(1, s.min_rollout_gpus)} > {c.total_gpus} GPUs in the cluster: "
                     "lower the minimums or add nodes")
        if self.ehp is not None:
            _positive(p, "global_resource_planner.elastic_hybrid_min_rollout_gpus", self.ehp.min_rollout_gpus, 0)
            _positive(p, "global_resource_planner.elastic_hybrid_replica_size_gpus", self.ehp.replica_size_gpus, 0)
        if p:
            raise PlannerInputError(p)
