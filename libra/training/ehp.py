"""Elastic hybrid parallelism (EHP): while the rollout pool is idle, the training step runs on borrowed rollout
GPUs as extra data-parallel replicas, and gives them back before the next rollout phase.

`EhpSession` is the entry point a controller calls at step boundaries: `plan(instances)` (which rollout GPUs
may be lent, `planner.ehp.plan_borrow`), `attach(gpus)`, `train_step(samples, step)` (the pool's step, with
the borrowed replicas when attached), then `park()` or `detach()`.

Parking. Starting borrowed workers (Ray actors, torch.distributed, the model) costs seconds while a step
costs a fraction of one, so when the lending server stays resident beside the borrowed rank, the workers may
stay alive between steps ("parked": idle, blocked on their actor's call queue) and the next `attach` of the
same GPUs to the same core pool re-attaches them without starting anything. Parking also starts copying the
core pool's new parameters into them, so that they load while their lending instances serve again; the next
step uses that copy when the pool's weights have not changed since (`TrainingPool.weights_version`), and
copies them itself otherwise. `release(reason)` stops a parked group; `attach` does so itself when the GPUs
differ, the core pool was resized, re-laid-out or restarted, or a parked worker no longer answers.

On metered logical GPUs a borrowed rank computes in the CPU slice of the GPU it borrows, beside the lending
server, while attached. Parked, it holds memory and no compute (as an idle process on a GPU does), so after its
parameter copy it leaves that slice for the host's share of the CPU: its idle threads (Ray's, gloo's) otherwise
take the lending servers' CPU in the rollout phase. The ping that checks it at the next `attach` answers from
the host's share, and the rank moves back into the slice as the first call of the step, ahead of its
parameter load and forward/backward (a rank runs its calls in order; the forward/backward takes the move's
result as an argument, so a rank that could not move back never computes unmetered). A ping answered inside
the slice would wait for the slice's quota, which the lending server spent in the rollout phase.

Design. Megatron's parallel state is fixed per torch.distributed world, so borrowed replicas do not join the
core pool's world: they are extra `TrainingWorker`s (same model, TP / PP / CP as the core pool, no
distributed optimizer, no trace) on the lent GPUs (`libra.cluster.ehp_workers`), forming worlds of their own:

- with `decouple_communication_domains`, one world of all borrowed replicas: they sum their gradients in
  their own DP group and one summed gradient per shard enters the core pool (its DP x CP rank 0);
- without it, one world per replica: each replica's gradient enters the core pool on its own (replica i on
  core DP rank i mod DP), so the core DP reduction carries the borrowed replicas' traffic, as if they were
  core DP ranks.

A step: the core ranks of DP x CP rank 0 export their parameters, which borrowed ranks of the same (TP, PP)
shard copy (object references, never through the driver; after a shared step the core ranks' finish exports
them as its second result, which parking hands to the borrowed ranks without another call); the global batch
is split in DP blocks over core and borrowed DP ranks (`split_shares`); both pools run forward/backward at once
with gradient finalization deferred; the borrowed gradients, units and metric sums are added on the core side and the core finalizes and
steps (`libra.training.ehp_steps` explains why that gradient equals the fixed pool's: the loss is a sum of
per-token numerators over a global unit count). The core ranks' finish is submitted with the rest of the step,
its arguments the borrowed ranks' results, so it starts when they exist rather than after a round trip through
the driver. A borrowed rank that fails costs the step its speed-up, not its correctness: the session detaches
(which fails the finish that waits on it before it runs) and the core pool reruns the step alone; so do borrowed
gradients that cannot reach the core ranks (`ehp_steps.GRADS_NOT_RECEIVED`: each core rank fetches its share within
a deadline and all agree before the finish's collectives). What borrowed ranks make is waited for
`borrowed_wait_s`: once shared steps have run, a multiple of the slowest (at least 30 s), not the pool's hang
deadline, since a borrowed failure costs a rerun on the pool alone rather than the pool. Before a borrowed world
forms, its nodes are probed against the core pool's (`_check_reach`): a node that cannot connect fails the attach
(`LendersUnreachableError`), so the controller holds its lenders back instead of meeting the partition in every
step.

Not covered: expert parallelism (EP > 1: expert gradients reduce over expert-DP groups that a borrowed
world would have to mirror rank by rank) is refused at `attach`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from libra.cluster import ehp_workers
from libra.cluster.ehp_workers import BorrowedWorkerGroup, LendersUnreachableError, LentGpu
from libra.cluster.node_fence import FencedNode
from libra.cluster.reachability import nodes_to_fence
from libra.cluster.training_workers import CollectiveCallError, probe_reach
from libra.device import pools_on_cuda
from libra.metering.spec import OFF as METERING_OFF
from libra.training.ehp_steps import GRADS_NOT_RECEIVED
from libra.training.pool import TrainingPool
from libra.training.spec import TrainingPoolSpec, TrainSample, check_spec
from libra.training.worker import TrainingWorker
from planner.ehp import BorrowPlan, RolloutInstanceGpus, plan_borrow, replica_size_gpus
from planner.layout import TrainLayout

log = logging.getLogger(__name__)

PING_TIMEOUT_S = 30.0  # a parked worker answers a call at once; one that does not is treated as failed
EHP_STEP = "ehp_train_step"  # the kind of call whose history sets the deadline of each wait of a shared step
# the share of that deadline a core rank waits for the borrowed gradients it adds: its error reaches the driver
# before the driver's own wait for the finish (which starts no earlier than the fetch) runs out
GRADS_WAIT_SHARE = 0.8
# A borrowed failure costs a step its speed-up (the step reruns on the pool alone), not the pool, so once shared
# steps have run at the pool's shape the waits for what borrowed ranks make are bounded by these times the
# slowest of them, at least the floor, rather than by the pool's hang deadline (train_hang_timeout_s, 300 s by
# default): a lending node cut off while its replicas are parked costs the next step seconds, not minutes
BORROWED_WAIT_FACTOR = 10.0
BORROWED_WAIT_FLOOR_S = 30.0


def borrowed_wait_s(deadline_s: float, slowest_step_s: float | None) -> float:
    """How long a shared step waits for what its borrowed ranks make (their parameter loads and summaries at
    the driver, their gradients at the core ranks) before it runs on the pool alone: `GRADS_WAIT_SHARE` of the
    step's deadline `deadline_s`, and, once a shared step has completed at this pool shape (`slowest_step_s`,
    the slowest), at most `BORROWED_WAIT_FACTOR` times that step but not less than `BORROWED_WAIT_FLOOR_S`."""
    bound = GRADS_WAIT_SHARE * deadline_s
    if slowest_step_s is None:
        return bound
    return min(bound, max(BORROWED_WAIT_FLOOR_S, BORROWED_WAIT_FACTOR * slowest_step_s))


class EhpError(RuntimeError):
    """Elastic hybrid parallelism cannot do what was asked (the message says why and what to do)."""


@dataclass(frozen=True)
class EhpSettings:
    """The `global_resource_planner` options of elastic hybrid parallelism."""

    replica_size_gpus: int = 0  # elastic_hybrid_replica_size_gpus (0 = derived from the training layout)
    min_rollout_gpus: int = 0  # elastic_hybrid_min_rollout_gpus
    decouple_communication_domains: bool = False

    @classmethod
    def from_planner_options(cls, options: Any) -> EhpSettings:
        """From the `global_resource_planner` config section."""
        return cls(
            replica_size_gpus=int(options.elastic_hybrid_replica_size_gpus),
            min_rollout_gpus=int(options.elastic_hybrid_min_rollout_gpus),
            decouple_communication_domains=bool(options.decouple_communication_domains),
        )


def split_shares(num_samples: int, core_dp: int, world_dps: Sequence[int]) -> list[tuple[int, int]]:
    """[start, stop) of the samples of the core pool (first) and of each borrowed world: the global batch in
    blocks of ceil(n / DP) over every DP rank, core ranks first (`batching.dp_block` over the joint DP size).
    A world whose share is empty sits the step out."""
    if core_dp < 1 or any(d < 1 for d in world_dps):
        raise ValueError(f"DP sizes must be >= 1: core {core_dp}, borrowed {list(world_dps)}")
    if num_samples < 1:
        raise ValueError("a step needs at least one sample")
    per = math.ceil(num_samples / (core_dp + sum(world_dps)))
    bounds = [0, core_dp]
    for dp in world_dps:
        bounds.append(bounds[-1] + dp)
    return [(min(num_samples, a * per), min(num_samples, b * per)) for a, b in zip(bounds, bounds[1:], strict=False)]


@dataclass
class BorrowedWorld:
    """One torch.distributed world of borrowed replicas."""

    group: BorrowedWorkerGroup
    spec: TrainingPoolSpec
    keys: list[tuple[int, int, int]] = field(default_factory=list)  # per rank: (TP, PP, DP x CP) rank
    holders: list[str] = field(default_factory=list)  # per rank: the lending instance ("" = a GPU of its own)

    @property
    def dp(self) -> int:
        return len({k[2] for k in self.keys})


class EhpSession:
    """Borrowed data-parallel replicas of `pool` (see the module docstring)."""

    def __init__(self, pool: TrainingPool, settings: EhpSettings, name: str = "") -> None:
        self.pool = pool
        self.settings = settings
        self.name = name or f"{pool.name}-ehp"
        self.worlds: list[BorrowedWorld] = []
        self.gpus: list[LentGpu] = []
        self._layout: TrainLayout | None = None
        self._core_gpus = 0
        self._core_group: Any = None  # the core pool's worker group at attach: a new one means restarted workers
        self._core_keys: list[tuple[int, int, int]] = []
        self._parked = False
        # loads of the core pool's parameters into every world's ranks, started when the group was parked, and
        # the (core worker group, weights version) they copy: the next step uses them while that still holds
        self._prefetched: list[list[Any]] | None = None
        self._prefetched_for: tuple[Any, int] | None = None
        # per world: the parked ranks' calls leaving their lent GPUs' CPU slices (metered logical GPUs)
        self._left_slices: list[tuple[BorrowedWorld, list[Any]]] = []
        # the worlds whose re-attached ranks move back into their lent GPUs' CPU slices at the next step
        self._rejoin: list[BorrowedWorld] = []
        # per core rank: the parameters the last shared step's finish exported (None off DP x CP rank 0)
        self._finish_exports: list[Any] = []
        self._lock = threading.RLock()
        self.last_attach_reused = False  # the last attach re-attached a parked group (started nothing)
        self.last_stop_reason = ""  # why the last parked group was stopped
        self.last_fallback_reason = ""  # why the last step that fell back to the pool alone lost its replicas
        # called with the reason whenever a parked group is stopped (for the job's event log)
        self.on_parked_stop: Callable[[str, list[str]], None] | None = None

    # ---- planning ----------------------------------------------------------------------------------
    def replica_size(self) -> int:
        """GPUs in one borrowed replica for the pool's current layout."""
        return replica_size_gpus(self.settings.replica_size_gpus, self.pool.layout)

    def plan(self, instances: Sequence[RolloutInstanceGpus]) -> BorrowPlan:
        """Which of `instances` may lend their GPUs now, and the replicas they form."""
        return plan_borrow(instances, self.replica_size(), self.settings.min_rollout_gpus)

    @property
    def attached(self) -> bool:
        return bool(self.worlds) and not self._parked

    @property
    def parked(self) -> bool:
        """Borrowed workers are alive between steps, not attached to a step."""
        return bool(self.worlds) and self._parked

    def parked_pids(self) -> list[int]:
        """The process ids of the parked workers (empty when nothing is parked)."""
        if not self.parked:
            return []
        return [int(pid) for w in self.worlds for pid in w.group.call("process_id", timeout=60)]

    @property
    def replicas(self) -> int:
        return len(self.gpus) // self.replica_size() if self.gpus else 0

    # ---- attach / detach ---------------------------------------------------------------------------
    def attach(self, gpus: Sequence[LentGpu]) -> bool:
        """Borrowed replicas on `gpus` (a multiple of the replica size; consecutive GPUs form a replica) for the
        next `train_step`, which copies the pool's current parameters into them. A group parked on exactly
        these GPUs for this core pool is re-attached (returns True: nothing started); otherwise a parked group
        is stopped and new workers start (returns False)."""
        with self._lock:
            if self.attached:
                raise EhpError(f"{self.name}: already attached to {len(self.gpus)} GPUs; detach() first")
            self.last_attach_reused = False
            if self.parked:
                problem = self.reuse_problem(gpus)
                if not problem:
                    self._parked = False
                    self.last_attach_reused = True
                    log.info("%s: re-attached the %d parked borrowed replica(s)", self.name, self.replicas)
                    return True
                self.release(problem)
            self._start(gpus)
            return False

    def reuse_problem(self, gpus: Sequence[LentGpu]) -> str:
        """Why the parked group cannot serve a borrow of `gpus` now ("" when it can): other GPUs, a changed core
        pool, or a parked worker that does not answer."""
        wanted, parked = [g.gpu_id for g in gpus], [g.gpu_id for g in self.gpus]
        if list(gpus) != self.gpus:
            return f"the step borrows GPUs {wanted}, the parked replicas hold {parked}"
        pool = self.pool
        if (not pool.running or pool.group is not self._core_group or pool.layout != self._layout
                or pool.spec.num_gpus != self._core_gpus):
            return "the training pool was resized, re-laid-out or restarted since the replicas were parked"
        left, self._left_slices = self._left_slices, []
        try:  # every world asked at once: one round trip, not one per world
            pings = [ehp_workers.call_refs(w.group, "ehp", "shard_key") for w in self.worlds]
            for world, refs in zip(self.worlds, pings, strict=True):
                keys = [tuple(k) for k in ehp_workers.gather(world.group, "shard_key", refs, PING_TIMEOUT_S)]
                if keys != world.keys:
                    return f"{world.group.name} answers as another layout ({keys} != {world.keys})"
        except Exception as exc:
            return f"a parked borrowed worker failed ({type(exc).__name__}: {exc})"
        self._report_failed_leaves(left)
        self._rejoin = [world for world, _ in left]
        return ""

    def _submit_rejoins(self, worlds: list[BorrowedWorld]) -> dict[int, list[Any]]:
        """Metered logical GPUs: the re-attached ranks of `worlds` that left their lent GPUs' CPU slices at park
        move back into them, as the first call of the step (not waited for here); per world (by id), one
        reference per rank. A world whose ranks never left (unmetered, or on GPUs of its own) has no entry."""
        rejoin, self._rejoin = {id(w) for w in self._rejoin}, []
        metering = self.pool.spec.metering
        return {id(w): ehp_workers.call_each(w.group, "ehp", [("join_lent_slice", metering, h) for h in w.holders])
                for w in worlds if id(w) in rejoin}

    def _leave_lent_slices(self) -> None:
        """Metered logical GPUs: each parked rank on a lent GPU leaves the lending instance's CPU slice after its
        parameter copy (a rank runs its calls in order); not waited for here."""
        metering = self.pool.spec.metering
        self._left_slices = [] if not metering.enabled else [
            (w, ehp_workers.call_each(w.group, "ehp", [("leave_lent_slice", metering, h) for h in w.holders]))
            for w in self.worlds if any(w.holders)]

    def _report_failed_leaves(self, left: list[tuple[BorrowedWorld, list[Any]]]) -> None:
        """Leaving a slice is done by the time the rank answers a later call; a failed one only meant the parked
        rank stayed in the slice, so it is logged, not raised."""
        for world, refs in left:
            try:
                ehp_workers.gather(world.group, "leave_lent_slice", refs, PING_TIMEOUT_S)
            except Exception as exc:
                log.warning("%s: a parked rank of %s could not leave its lent GPU's CPU slice (%s)", self.name,
                            world.group.name, exc)

    def park(self) -> None:
        """After a step: keep the attached workers alive for the next `attach` of the same GPUs (the lending
        servers stay resident beside them), and start copying the pool's new parameters into them: after a
        shared step, those its finish exported; otherwise (parked without a step, as at prewarm) the core ranks
        export them now, which is waited for here. The borrowed ranks load while the lending instances serve
        again, so the next step does not wait for the copy (unless the weights changed)."""
        with self._lock:
            if self.attached:
                self._parked = True
                self._prefetch_params()
                self._leave_lent_slices()
                log.info("%s: %d borrowed replica(s) parked on GPUs %s", self.name, self.replicas,
                         [g.gpu_id for g in self.gpus])

    def _prefetch_params(self) -> None:
        pool = self.pool
        exports, self._finish_exports = self._finish_exports, []
        if exports:  # the step's finish exported them: the loads start without another call to the core ranks
            self._prefetched = self._load_params(self.worlds, exports)
            self._prefetched_for = (pool.group, pool.weights_version)
            return
        try:
            exported, self._prefetched = self._send_params(self.worlds)
            self._prefetched_for = (pool.group, pool.weights_version)
            if not ehp_workers.wait_done(exported, pool.spec.hang.first_call_s):
                raise TimeoutError(f"the core ranks did not export their parameters within "
                                   f"{pool.spec.hang.first_call_s:.0f}s")
        except Exception as exc:  # the next step copies them itself
            log.warning("%s: copying the parameters into the parked replicas failed (%s)", self.name, exc)
            self._prefetched = self._prefetched_for = None

    def _take_prefetched(self) -> list[list[Any]] | None:
        """The parameter loads started at park, per world, if they copy the pool's current weights."""
        prefetched, self._prefetched = self._prefetched, None
        current = (self.pool.group, self.pool.weights_version) == self._prefetched_for
        self._prefetched_for = None
        return prefetched if current else None

    def release(self, reason: str) -> bool:
        """Stop a parked group (`reason` says why, for the log and `on_parked_stop`); False when none is
        parked. An attached group is left to its step's `detach`."""
        if not self.parked:  # no wait for an attach in progress (seconds when it starts workers)
            return False
        with self._lock:
            if not self.parked:
                return False
            gpu_ids = [g.gpu_id for g in self.gpus]
            log.info("%s: stopping the parked borrowed replicas on GPUs %s: %s", self.name, gpu_ids, reason)
            self.last_stop_reason = reason
            self.detach()
        if self.on_parked_stop is not None:
            try:
                self.on_parked_stop(reason, gpu_ids)
            except Exception:
                log.exception("%s: reporting the stop of the parked replicas failed", self.name)
        return True

    def _start(self, gpus: Sequence[LentGpu]) -> None:
        pool, layout = self.pool, self.pool.layout
        if layout.ep > 1:
            raise EhpError(f"{self.name}: elastic hybrid parallelism with expert parallelism (ep={layout.ep}) is "
                           "not implemented; train without borrowed replicas or with ep=1")
        size = self.replica_size()
        if not gpus or len(gpus) % size:
            raise EhpError(f"{self.name}: {len(gpus)} lent GPUs are not a positive multiple of the replica size "
                           f"{size} (elastic_hybrid_replica_size_gpus={self.settings.replica_size_gpus}, "
                           f"layout {layout.label()})")
        ids = [(g.placement_group, g.bundle_index, g.gpu_id) for g in gpus]  # an id alone is per node
        if len(set(ids)) != len(ids):
            raise EhpError(f"{self.name}: lent GPUs {[g.gpu_id for g in gpus]} repeat (placement group, bundle, id)")
        chunks = [list(gpus)] if self.settings.decouple_communication_domains else [
            list(gpus[i:i + size]) for i in range(0, len(gpus), size)]
        timeout = pool.spec.hang.first_call_s
        t0 = time.perf_counter()
        try:
            for i, world_gpus in enumerate(chunks):
                spec = borrowed_spec(pool.spec, len(world_gpus))
                check_spec(spec, pool.arch, pools_on_cuda())
                group = BorrowedWorkerGroup(pool.runtime, TrainingWorker, (spec,), world_gpus, f"{self.name}{i}")
                world = BorrowedWorld(group, spec, holders=[g.holder for g in world_gpus])
                self.worlds.append(world)
                group.start()
                self._check_reach(world, timeout)
                addr = group.rendezvous_host()
                if pool.spec.metering.enabled:  # each rank computes on its lent GPU's share of the CPU
                    refs = ehp_workers.call_each(group, "ehp", [("join_lent_slice", pool.spec.metering, g.holder)
                                                                for g in world_gpus])
                    ehp_workers.gather(group, "join_lent_slice", refs, timeout)
                port = group.call_rank(0, "rendezvous_port", addr, timeout=timeout)
                group.call("setup", addr, port, timeout=timeout)
                world.keys = [tuple(k) for k in group.call("ehp", "shard_key", timeout=timeout)]  # type: ignore[misc]
            self._core_keys = [tuple(k) for k in pool.group.call("ehp", "shard_key", timeout=timeout)]  # type: ignore[misc]
        except BaseException:
            self.detach()
            raise
        self.gpus = list(gpus)
        self._layout, self._core_gpus, self._core_group = layout, pool.spec.num_gpus, pool.group
        log.info("%s: %d borrowed replicas of %d GPUs in %d world(s) attached in %.1fs", self.name,
                 len(gpus) // size, size, len(self.worlds), time.perf_counter() - t0)

    def _check_reach(self, world: BorrowedWorld, timeout: float) -> None:
        """Before a borrowed world forms (its rendezvous, then each step's parameter copy and gradient transfer
        between its nodes and the core pool's): every node of it reaches every node of the core pool and, for a
        world on several nodes, the world's other nodes. Raises `LendersUnreachableError` naming the nodes to
        leave out (the lending instances there) and the peers each could not reach."""
        core, nodes = self.pool.group, world.group.rank_nodes()
        if len(set(nodes) | set(core.rank_nodes())) <= 1:
            return
        broken, hosts = probe_reach(core, world.group, timeout)  # (world node, core node) -> why
        out = {node for node, _ in broken}
        if len(set(nodes) - out) > 1:  # the world's other nodes: the fewest to leave out so that the rest connect
            inner, inner_hosts = probe_reach(world.group, world.group, timeout)
            hosts.update(inner_hosts)
            pairs = sorted({(min(a, b), max(a, b)) for a, b in inner if a not in out and b not in out})
            if pairs:
                out.update(nodes_to_fence(pairs, {n: nodes.count(n) for n in set(nodes)}))
                broken.update(inner)
        if not out:
            return
        unreachable = []
        for node in sorted(out):
            peers = sorted({peer for (a, b) in broken for here, peer in ((a, b), (b, a)) if here == node})
            why = "; ".join(sorted({why for (a, b), why in broken.items() if node in (a, b)}))
            unreachable.append(FencedNode(node, hosts.get(node, node), f"it could not reach "
                                          f"{', '.join(hosts.get(p, p) for p in peers)} ({why})", tuple(peers)))
        instances = {node: sorted({h for h, n in zip(world.holders, nodes, strict=True) if n == node and h})
                     for node in out}
        said = "; ".join(f"{n.address} (lent by {', '.join(instances[n.node_id]) or 'no instance'}): {n.reason}"
                         for n in unreachable)
        raise LendersUnreachableError(
            f"{self.name}: nodes of the lent GPUs cannot reach the training pool's nodes, so a shared step would "
            f"hang (a network partition between nodes that Ray still counts alive): {said}", unreachable, instances)

    def detach(self, clean: bool = True) -> None:
        """Stop every borrowed worker; the lent GPUs go back to their rollout instances. `clean=False` kills
        the workers without their collective tear-down (after one of them failed). Also stops a parked group."""
        with self._lock:
            worlds, self.worlds = self.worlds, []
            self.gpus = []
            self._parked = False
            self._core_group = None
            self._prefetched = self._prefetched_for = None
            self._left_slices = []
            self._rejoin = []
            self._finish_exports = []
            for world in worlds:
                try:
                    if clean and world.group.actors and world.keys:
                        world.group.call("shutdown", timeout=60)
                except Exception as exc:
                    log.warning("%s: clean shutdown of %s failed (%s); killing it", self.name, world.group.name,
                                exc)
                finally:
                    world.group.shutdown()

    # ---- the step ----------------------------------------------------------------------------------
    def train_step(self, samples: list[TrainSample], step: int, to_park: bool = True) -> dict[str, float]:
        """One optimizer step on `samples`: on the pool alone when detached, else shared with the borrowed
        replicas (same gradient as the pool alone; metrics add `ehp_replicas` and `ehp_borrowed_samples`).
        `to_park`: the replicas will be parked after it, so the core ranks' finish exports the stepped
        parameters for their copy (a clone of every parameter, not made for replicas that are stopped)."""
        if not self.attached:
            return self.pool.train_step(samples, step)
        pool = self.pool
        if (not pool.running or pool.group is not self._core_group or pool.layout != self._layout
                or pool.spec.num_gpus != self._core_gpus):
            raise EhpError(f"{self.name}: the training pool changed (now {pool.layout.describe(pool.spec.num_gpus)}) "
                           "since the borrowed replicas were attached; detach() and attach() again")
        t0 = time.perf_counter()
        core_dp = pool.layout.dp(pool.spec.num_gpus)
        shares = split_shares(len(samples), core_dp, [w.dp for w in self.worlds])
        active = [(w, s) for w, s in zip(self.worlds, shares[1:], strict=True) if s[1] > s[0]]
        core_samples = samples[shares[0][0]:shares[0][1]]
        timeout = pool.deadlines.deadline(EHP_STEP)  # each wait of the core ranks
        # each wait of the borrowed ranks: a world past it falls back
        borrowed_wait = borrowed_wait_s(timeout, pool.deadlines.history().get(EHP_STEP))
        core_refs: list[Any] = []
        finish_refs: list[Any] = []
        self._finish_exports = []
        try:
            # Every call of the step is submitted at once and awaited later: a (synchronous) actor runs its calls
            # in the order they were submitted, so each borrowed rank loads the parameters before its forward,
            # while the core ranks already compute theirs (parked replicas had the parameters loaded at park,
            # unless the weights changed since). The core ranks' finish takes the borrowed ranks' results as
            # arguments, so it runs as soon as they exist, without a round trip through this driver.
            rejoins = self._submit_rejoins([w for w, _ in active])  # first in each re-attached rank's queue
            prefetched = self._take_prefetched()
            if prefetched is not None:
                loads = [prefetched[self.worlds.index(w)] for w, _ in active]
            else:
                loads = self._send_params([w for w, _ in active])[1]
            core_refs = ehp_workers.call_refs(pool.group, "ehp", "core_forward_backward",
                                              ehp_workers.share(core_samples), step)
            results = []  # per active world, per rank: (summary, grads)
            for (w, (a, b)), world_loads in zip(active, loads, strict=True):
                share = ehp_workers.share(samples[a:b])
                moved = rejoins.get(id(w)) or [None] * len(world_loads)
                results.append(ehp_workers.call_each(
                    w.group, "ehp", [("borrowed_forward_backward", share, step, load, join)
                                     for load, join in zip(world_loads, moved, strict=True)], num_returns=2))
            finishes = self._submit_finish(step, core_dp, active, results, to_park, borrowed_wait)
            finish_refs = [metrics for metrics, _ in finishes]
            marks = {"submit": time.perf_counter()}
            for (w, _), refs in zip(active, loads, strict=True):  # a failed load or move fails the step's borrow
                ehp_workers.gather(w.group, "load_params", refs, borrowed_wait)
                if id(w) in rejoins:
                    ehp_workers.gather(w.group, "join_lent_slice", rejoins[id(w)], borrowed_wait)
            marks["params"] = time.perf_counter()
            summaries = [ehp_workers.gather(w.group, "borrowed_forward_backward", [ref for ref, _ in refs],
                                            borrowed_wait) for (w, _), refs in zip(active, results, strict=True)]
            marks["borrowed_forward_backward"] = time.perf_counter()
        except CollectiveCallError as exc:
            return self._fall_back(samples, step, core_refs, finish_refs, exc)
        ehp_workers.gather(pool.group, "core_forward_backward", core_refs, timeout)
        marks["core_forward_backward"] = time.perf_counter()
        try:
            metrics = dict(ehp_workers.gather(pool.group, "core_finish", finish_refs, timeout)[0])
        except CollectiveCallError as exc:
            said = next((line for line in str(exc).splitlines() if GRADS_NOT_RECEIVED in line), "")
            if said:  # every core rank stopped before the finish's collectives: the borrowed side failed
                said = said[said.index(GRADS_NOT_RECEIVED):]
                return self._fall_back(samples, step, [], [], CollectiveCallError(f"{pool.group.name}.core_finish: "
                                                                                  f"{said}"), borrowed=True)
            self.detach(clean=False)
            raise
        self._finish_exports = [params for _, params in finishes] if to_park else []
        pool.stepped(step)
        marks["finish"] = time.perf_counter()
        pool.deadlines.completed(EHP_STEP, marks["finish"] - t0)
        metrics.update(time_step_s=marks["finish"] - t0, ehp_replicas=float(self.replicas),
                       ehp_borrowed_samples=float(sum(b - a for _, (a, b) in active)),
                       ehp_params_prefetched=float(prefetched is not None),
                       **step_segments(t0, marks), **borrowed_timings(summaries))
        return metrics

    def _submit_finish(self, step: int, core_dp: int, active: list[tuple[BorrowedWorld, tuple[int, int]]],
                       results: list[list[tuple[Any, Any]]], export: bool,
                       grads_timeout_s: float) -> list[tuple[Any, Any]]:
        """Submit every core rank's `core_finish` of `step`: the summary of every borrowed rank of the active
        worlds (so that every core rank finishes or none does: `libra.training.ehp_steps`, step 3), object
        references the ranks receive as values once the borrowed ranks made them, and, per core shard, the
        summed grads of the borrowed leaders of that shard, as references each rank fetches within
        `grads_timeout_s`. Per core rank: (metrics, the stepped parameters it exports for the next step's copy,
        or None without `export`)."""
        sizes = [len(refs) for refs in results]
        summaries = [summary for refs in results for summary, _ in refs]
        per_rank: list[list[Any]] = [["core_finish", step, export, sizes, grads_timeout_s, *summaries]
                                     for _ in self._core_keys]
        for i, ((world, _), refs) in enumerate(zip(active, results, strict=True)):
            target_dp = 0 if self.settings.decouple_communication_domains else i % core_dp
            for key, (_, grads) in zip(world.keys, refs, strict=True):
                if key[2] == 0:  # a leader: its shard's sum over the world (in a list: fetched by the rank)
                    per_rank[self._core_keys.index((key[0], key[1], target_dp))].append([grads])
        return ehp_workers.call_each(self.pool.group, "ehp", per_rank, num_returns=2)

    def _send_params(self, worlds: list[BorrowedWorld]) -> tuple[list[Any], list[list[Any]]]:
        """Start copying the core pool's current parameters into every rank of `worlds`, shard by shard (the
        core ranks export them, the borrowed ranks load them, never through the driver); the references of the
        exports, and per world those of the loads."""
        exported = ehp_workers.call_refs(self.pool.group, "ehp", "export_params")
        return exported, self._load_params(worlds, exported)

    def _load_params(self, worlds: list[BorrowedWorld], exported: list[Any]) -> list[list[Any]]:
        """Start loading the core ranks' exported parameters (`exported`: per core rank, a reference to its
        export, None off DP x CP rank 0) into every rank of `worlds`, shard by shard; per world, the loads."""
        by_shard = {(k[0], k[1]): ref for k, ref in zip(self._core_keys, exported, strict=True) if k[2] == 0}
        return [ehp_workers.call_each(world.group, "ehp", [("load_params", by_shard[(k[0], k[1])])
                                                          for k in world.keys]) for world in worlds]

    def _fall_back(self, samples: list[TrainSample], step: int, core_refs: list[Any], finish_refs: list[Any],
                   exc: CollectiveCallError, borrowed: bool = False) -> dict[str, float]:
        """A borrowed rank failed: detach (the borrowed calls still pending fail, and with them the core ranks'
        finish that waits on their results), let the core ranks finish what they started, and run the step
        on the pool alone (same gradient, without the speed-up). Only where the core ranks' finish ran after
        all (every borrowed rank had made its results before the failure was seen, e.g. a wait that outlived
        its deadline by a little) is the step already done: its metrics are returned, the step is not run
        twice. A core rank's failure is raised (`borrowed`: the error is known to be the borrowed side's)."""
        if not borrowed and not any(f"{w.group.name}." in str(exc) for w in self.worlds):
            self.detach(clean=False)
            raise exc
        log.warning("%s: a borrowed replica failed (%s); step %d runs on the training pool alone", self.name, exc,
                    step)
        self.last_fallback_reason = str(exc)
        self.detach(clean=False)  # its other ranks may wait in a collective of their own world
        wait = self.pool.spec.hang.first_call_s
        if core_refs:
            ehp_workers.gather(self.pool.group, "core_forward_backward", core_refs, wait)
        if finish_refs:
            try:
                finished = dict(ehp_workers.gather(self.pool.group, "core_finish", finish_refs, wait)[0])
            except CollectiveCallError:
                pass  # it never ran: a borrowed result it needed had failed
            else:
                log.warning("%s: step %d had finished with the borrowed replicas before their failure was seen",
                            self.name, step)
                self.pool.stepped(step)
                return finished
        metrics = self.pool.train_step(samples, step)
        metrics["ehp_fallback"] = 1.0
        return metrics


def step_segments(t0: float, marks: dict[str, float]) -> dict[str, float]:
    """The wall time of a borrowed step as the driver saw it, in consecutive segments ending at each mark (in
    order): `ehp_wait_<mark>_s`. `submit` is the split of the batch and the submission of every call; `params`
    the wait until every borrowed rank loaded the parameters (the core ranks' export included); then the waits
    for the borrowed and the core forward/backward; `finish` the core ranks' gradient combination and
    optimizer step, with the borrowed gradients' export and transfer. The segments add up to the step."""
    out, last = {}, t0
    for name, at in marks.items():
        out[f"ehp_wait_{name}_s"] = at - last
        last = at
    return out


def borrowed_timings(summaries: list[list[dict[str, Any]]]) -> dict[str, float]:
    """The slowest borrowed rank's own recomputation and forward/backward seconds, wall and CPU (measured
    inside it; each the largest over the ranks)."""
    ranks = [rank.get("timings", {}) for world in summaries for rank in world]
    return {f"ehp_borrowed_{part}": max(float(t.get(part, 0.0)) for t in ranks)
            for part in ("recompute_s", "forward_backward_s", "recompute_cpu_s", "forward_backward_cpu_s")
            } if ranks else {}


def borrowed_spec(core: TrainingPoolSpec, gpus: int) -> TrainingPoolSpec:
    """The spec of a borrowed world of `gpus` GPUs: the core pool's model, layout, batch and algorithm, without
    the distributed optimizer (a borrowed rank never steps), and without phase traces and the worker's own
    CPU slice: both name a rank's files and slices by its rank number, which would be a core rank's. A
    borrowed rank joins the lending GPU's slice instead, which the rollout instance owns (`attach`,
    `ehp_steps.join_lent_slice`)."""
    meg = dataclasses.replace(core.megatron, use_distributed_optimizer=False, use_precision_aware_optimizer=False,
                              optimizer_cpu_offload=False)
    return dataclasses.replace(core, num_gpus=gpus, megatron=meg, trace=None, metering=METERING_OFF)


def shard_state(pool: TrainingPool, timeout_s: float | None = None) -> dict[str, Any]:
    """Every gradient and parameter shard of `pool` (its DP rank 0) after a step, keyed
    "grad|param/tp{r}pp{p}/{chunk}/{name}": what a parity check compares between two pools."""
    out: dict[str, Any] = {}
    timeout = pool.spec.hang.first_call_s if timeout_s is None else timeout_s
    for part in pool.group.call("ehp", "gradients", timeout=timeout):
        if part is None:
            continue
        for kind, chunks in (("grad", part["grads"]), ("param", part["params"])):
            for i, named in enumerate(chunks):
                for name, tensor in named.items():
                    out[f"{kind}/tp{part['tp_rank']}pp{part['pp_rank']}/{i}/{name}"] = tensor
    return out


def max_abs_diff(a: dict[str, Any], b: dict[str, Any], kind: str) -> float:
    """The largest element difference of the `kind` ("grad" or "param") shards of two `shard_state`s."""
    keys = sorted(k for k in a if k.startswith(kind + "/"))
    if not keys or keys != sorted(k for k in b if k.startswith(kind + "/")):
        raise ValueError(f"the two pools hold different {kind} shards")
    return max(float((a[k] - b[k]).abs().max()) for k in keys)
