"""Elastic hybrid parallelism (EHP), the planning side: which idle rollout GPUs the training step may borrow as
extra data-parallel replicas, how large one replica is, and whether a lending vLLM server must sleep.

Three pure functions, each a decision the runtime carries out (`libra/training/ehp.py`):

- `replica_size_gpus(configured, layout)`: GPUs in one borrowed replica. `elastic_hybrid_replica_size_gpus`
  when set (a multiple of the unit below); 0 derives the unit from the training layout, TP x PP x CP x EP:
  one complete copy of the model (EP folds into data parallelism, so a replica of a MoE model spans EP
  model-parallel groups; for a dense model EP = 1 and the unit is TP x PP x CP, one core DP replica).
- `plan_borrow(instances, replica_size, min_rollout_gpus)`: a rollout instance is lent whole (its TP group
  cannot serve with part of its GPUs), only a healthy one that may lend (`lendable`: the runtime holds back an
  instance whose node cannot reach the training pool's nodes; it serves and counts as serving), and never so
  many that fewer than `min_rollout_gpus` GPUs of healthy instances keep serving. A replica's GPUs are on one node (its TP / PP
  traffic stays inside the node); instances are taken in the order given, node by node, and an instance
  that would complete no replica is not lent. GPUs of a lent instance that no replica uses are reported
  as `idle_gpu_ids` (an instance with more GPUs than the replica needs, e.g. rollout TP 3 and replica 2).
- `lent_gpu_residency(inputs, layout, borrowed_dp, rollout_tp)`: a borrowed GPU holds one training rank of
  a borrowed replica beside the lending server. `resident` when the server's whole footprint (weights,
  engine workspace and KV cache, or all of `gpu_memory_utilization` when the KV cache is sized by it) fits
  beside the training rank; `sleep` when it fits only once the server releases its KV cache; `no_fit`
  when not even that: such a GPU is not lent. A borrowed rank computes gradients and never steps the
  optimizer, so its footprint is the training rank's peak without the Adam moments and the optimizer-step
  workspace (16-bit training keeps the fp32 main parameters, which Megatron's optimizer allocates at
  build time).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from planner.layout import TrainLayout
from planner.memory import MemoryEstimate, MemoryTerm, rollout_memory, rollout_static_terms, train_memory
from planner.workload import PlannerInputs

Residency = Literal["resident", "sleep", "no_fit"]
# terms of a training rank that a borrowed rank (gradients only, no optimizer step) does not hold
OPTIMIZER_ONLY_TERMS = ("optimizer_state", "optimizer_step_workspace", "optimizer_state_on_host")


class EhpPlanError(ValueError):
    """An elastic-hybrid-parallelism option or input that cannot be planned (the message names it)."""


def replica_unit(layout: TrainLayout) -> int:
    """GPUs of the smallest complete model replica: TP x PP x CP x EP."""
    return layout.tp * layout.pp * layout.cp * layout.ep


def replica_size_gpus(configured: int, layout: TrainLayout) -> int:
    """GPUs in one borrowed replica: `configured` (`elastic_hybrid_replica_size_gpus`), or the layout's unit
    when it is 0."""
    unit = replica_unit(layout)
    if configured < 0:
        raise EhpPlanError(f"elastic_hybrid_replica_size_gpus={configured}: must be >= 0 (0 derives it)")
    if configured == 0:
        return unit
    if configured % unit:
        raise EhpPlanError(
            f"elastic_hybrid_replica_size_gpus={configured}: one complete replica of {layout.label()} is "
            f"TPxPPxCPxEP = {unit} GPUs; set 0 (derive it) or a multiple of {unit}"
        )
    return configured


@dataclass(frozen=True)
class RolloutInstanceGpus:
    """What the planner needs of one rollout instance: its id, GPUs, node and whether it serves."""

    instance_id: str
    gpu_ids: tuple[str, ...]
    node: str = ""
    healthy: bool = True
    lendable: bool = True  # False: it serves (and counts as serving) but is not lent


@dataclass(frozen=True)
class BorrowPlan:
    """The outcome of `plan_borrow`: the replicas (GPU ids, node by node), the instances they come from,
    the instances that keep serving, and why no more were lent."""

    replicas: tuple[tuple[str, ...], ...]
    lent_instances: tuple[str, ...]
    serving_instances: tuple[str, ...]
    serving_gpus: int
    idle_gpu_ids: tuple[str, ...] = ()
    reason: str = ""
    # the lending instance of each GPU of each replica: GPU ids are per node, so on a cluster of several nodes
    # an id names a GPU only together with its instance
    replica_owners: tuple[tuple[str, ...], ...] = ()

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    @property
    def gpu_ids(self) -> tuple[str, ...]:
        return tuple(g for replica in self.replicas for g in replica)


def plan_borrow(
    instances: Sequence[RolloutInstanceGpus], replica_size: int, min_rollout_gpus: int
) -> BorrowPlan:
    """Which rollout instances to lend and the replicas their GPUs form (see the module docstring)."""
    if replica_size < 1:
        raise EhpPlanError(f"replica_size={replica_size}: must be >= 1 (derive it with replica_size_gpus)")
    if min_rollout_gpus < 0:
        raise EhpPlanError(f"elastic_hybrid_min_rollout_gpus={min_rollout_gpus}: must be >= 0")
    ids = [i.instance_id for i in instances]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise EhpPlanError(f"rollout instances {duplicates} are listed more than once")
    for inst in instances:
        if not inst.gpu_ids:
            raise EhpPlanError(f"rollout instance {inst.instance_id!r} lists no GPUs")
    healthy = [i for i in instances if i.healthy]
    serving_total = sum(len(i.gpu_ids) for i in healthy)
    budget = serving_total - min_rollout_gpus
    replicas: list[tuple[str, ...]] = []
    replica_owners: list[tuple[str, ...]] = []
    lent: list[str] = []
    idle: list[str] = []
    skipped_for_budget = False
    nodes: dict[str, list[RolloutInstanceGpus]] = {}
    for inst in healthy:
        nodes.setdefault(inst.node, []).append(inst)
    for node_instances in nodes.values():
        carry: list[tuple[str, str]] = []  # (GPU, its instance): lent GPUs of this node no replica uses yet
        for inst in node_instances:
            if not inst.lendable:
                continue
            lent_gpus = sum(len(r) for r in replicas) + len(idle) + len(carry)
            if lent_gpus + len(inst.gpu_ids) > budget:
                skipped_for_budget = True
                continue
            carry.extend((g, inst.instance_id) for g in inst.gpu_ids)
            while len(carry) >= replica_size:
                taken, carry = carry[:replica_size], carry[replica_size:]
                replicas.append(tuple(g for g, _ in taken))
                replica_owners.append(tuple(owner for _, owner in taken))
                for _, owner in taken:
                    if owner not in lent:
                        lent.append(owner)
        # what is left: idle GPUs of a lent instance, or an instance that completed no replica (not lent)
        idle.extend(g for g, owner in carry if owner in lent)
    lent_set = set(lent)
    serving = [i.instance_id for i in healthy if i.instance_id not in lent_set]
    serving_gpus = serving_total - sum(len(i.gpu_ids) for i in healthy if i.instance_id in lent_set)
    if not replicas:
        reason = _nothing_lent_reason(healthy, replica_size, min_rollout_gpus, serving_total)
    elif skipped_for_budget:
        reason = f"elastic_hybrid_min_rollout_gpus={min_rollout_gpus} keeps {serving_gpus} GPUs serving"
    else:
        reason = "every healthy rollout instance that completes a replica is lent"
    return BorrowPlan(
        replicas=tuple(replicas), lent_instances=tuple(lent), serving_instances=tuple(serving),
        serving_gpus=serving_gpus, idle_gpu_ids=tuple(idle), reason=reason, replica_owners=tuple(replica_owners),
    )


def _nothing_lent_reason(healthy: Sequence[RolloutInstanceGpus], size: int, keep: int, total: int) -> str:
    if not healthy:
        return "no healthy rollout instance"
    if not any(i.lendable for i in healthy):
        return "every healthy rollout instance is held back from lending"
    if total - keep < size:
        return (f"{total} serving GPUs less elastic_hybrid_min_rollout_gpus={keep} leave {max(0, total - keep)}, "
                f"fewer than one replica of {size}")
    return f"no node has {size} GPUs of lendable instances for one replica"


@dataclass(frozen=True)
class LentGpuMemory:
    """Bytes on one borrowed GPU: the training rank beside the lending server, awake or asleep."""

    decision: Residency
    capacity_bytes: int
    train_rank_bytes: int
    server_resident_bytes: int
    server_sleeping_bytes: int
    train_rank: MemoryEstimate

    @property
    def headroom_bytes(self) -> int:
        """Bytes left under the decision taken (negative for `no_fit`: what is missing when asleep)."""
        server = self.server_resident_bytes if self.decision == "resident" else self.server_sleeping_bytes
        return self.capacity_bytes - self.train_rank_bytes - server

    def explain(self) -> str:
        gib = 2**30
        return (f"{self.decision}: training rank {self.train_rank_bytes / gib:.2f} GiB + server "
                f"{self.server_resident_bytes / gib:.2f} GiB awake / {self.server_sleeping_bytes / gib:.2f} GiB "
                f"asleep, on {self.capacity_bytes / gib:.2f} GiB")


def borrowed_rank_memory(inputs: PlannerInputs, layout: TrainLayout, borrowed_dp: int) -> MemoryEstimate:
    """The worst training rank of a borrowed world of `borrowed_dp` replicas, without optimizer-only terms
    (a borrowed rank keeps no sharded optimizer state: it runs without the distributed optimizer)."""
    if borrowed_dp < 1:
        raise EhpPlanError(f"borrowed_dp={borrowed_dp}: must be >= 1")
    unsharded = inputs.train
    if unsharded.use_distributed_optimizer:
        unsharded = replace(unsharded, use_distributed_optimizer=False, precision_aware_optimizer=False,
                            optimizer_cpu_offload=False)
        inputs = replace(inputs, train=unsharded)
    full = train_memory(inputs, layout, borrowed_dp)
    terms: list[MemoryTerm] = [t for t in full.terms if t.name not in OPTIMIZER_ONLY_TERMS]
    main_params = full.term("weights").bytes // max(1, unsharded.params_dtype_bytes) * unsharded.main_params_bytes
    if main_params:
        terms.append(MemoryTerm("main_params", "static", main_params, True,
                                f"fp32 main copy of the 16-bit parameters ({unsharded.main_params_bytes} B each)"))
    return MemoryEstimate(tuple(terms), full.capacity_bytes, where=f"a borrowed rank ({full.where})")


def lent_gpu_residency(
    inputs: PlannerInputs, layout: TrainLayout, borrowed_dp: int, rollout_tp: int
) -> LentGpuMemory:
    """Whether the lending server of a borrowed GPU stays resident, must sleep, or the GPU cannot be lent."""
    if rollout_tp < 1:
        raise EhpPlanError(f"rollout_tp={rollout_tp}: must be >= 1")
    rank = borrowed_rank_memory(inputs, layout, borrowed_dp)
    capacity = inputs.cluster.gpu.memory_bytes
    static = sum(t.bytes for t in rollout_static_terms(inputs, rollout_tp) if t.phase != "reserve")
    if inputs.rollout.kv_cache_bytes > 0:
        admitted = rollout_memory(inputs, rollout_tp, 0)  # static terms; the KV cache is its explicit size
        resident = sum(t.bytes for t in admitted.terms if t.phase == "static") + inputs.rollout.kv_cache_bytes
    else:  # vLLM grows its KV cache into the whole gpu_memory_utilization fraction
        resident = max(static, int(capacity * inputs.rollout.gpu_memory_utilization))
    train_bytes = rank.peak_bytes
    if train_bytes + resident <= capacity:
        decision: Residency = "resident"
    elif train_bytes + static <= capacity:
        decision = "sleep"
    else:
        decision = "no_fit"
    return LentGpuMemory(decision, capacity, train_bytes, resident, static, rank)


def planned_borrowed_dp(inputs: PlannerInputs, layout: TrainLayout, rollout_gpus: int, rollout_tp: int) -> int:
    """The data-parallel ranks the training step of a candidate borrows, as the search prices it (0 when
    `inputs.ehp` is unset, the job is asynchronous, or nothing can be lent): whole rollout instances beyond
    `min_rollout_gpus`, grouped into replicas, as `plan_borrow` does on one node (the search does not place
    instances on nodes, so a replica split over two nodes counts here); none with expert parallelism (refused
    at attach) or where a lent GPU cannot hold a borrowed rank beside its server (`lent_gpu_residency`)."""
    return planned_borrowed_dp_each(inputs, layout, [rollout_gpus], [rollout_tp])[0]


def planned_borrowed_dp_each(inputs: PlannerInputs, layout: TrainLayout, rollout_gpus: Sequence[int],
                             rollout_tp: Sequence[int]) -> list[int]:
    """`planned_borrowed_dp` of many candidates of one layout (the vectorized search's splits): the memory
    check, a whole estimate, runs once per distinct (borrowed DP, rollout TP), not once per candidate."""
    if len(rollout_gpus) != len(rollout_tp):
        raise EhpPlanError(f"{len(rollout_gpus)} rollout sizes but {len(rollout_tp)} rollout TPs")
    ehp = inputs.ehp
    if ehp is None or inputs.workload.is_async or layout.ep > 1:
        return [0] * len(rollout_gpus)
    try:
        size = replica_size_gpus(ehp.replica_size_gpus, layout)
    except EhpPlanError:
        return [0] * len(rollout_gpus)
    fits: dict[tuple[int, int], bool] = {}
    found: list[int] = []
    for gpus, tp in zip(rollout_gpus, rollout_tp, strict=True):
        lendable = max(0, gpus - ehp.min_rollout_gpus) // tp * tp if tp >= 1 else 0
        borrowed = lendable // size * size // layout.model_parallel
        if borrowed >= 1 and (borrowed, tp) not in fits:
            fits[borrowed, tp] = lent_gpu_residency(inputs, layout, borrowed, tp).decision != "no_fit"
        found.append(borrowed if borrowed >= 1 and fits[borrowed, tp] else 0)
    return found


__all__ = [
    "BorrowPlan", "EhpPlanError", "LentGpuMemory", "RolloutInstanceGpus", "borrowed_rank_memory",
    "lent_gpu_residency", "plan_borrow", "planned_borrowed_dp", "planned_borrowed_dp_each", "replica_size_gpus",
    "replica_unit",
]
