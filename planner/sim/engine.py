"""The event loop of one simulated job: rollout batches, training steps, weight syncs, reconfigurations, node
failures and repairs, under one policy.

Events (a heap ordered by time, then by `KIND_ORDER`, then by insertion, so equal times resolve the same way
every run): `bulk` (a rollout batch's requests are all admitted: the pool may start the next batch),
`done` (a batch's last response finished), `train` (a training step ended), `sync` (a weight version serves
everywhere), `resume` (a wait ended), `failure`, `rejoin`.

Rules, each the runtime's:
- Bounded staleness (`max_head_offpolicyness` s): batch k starts only once weight version >= k - s serves
  (s = 0: synchronous, batch k waits for the weights trained on batch k - 1).
- The rollout pool generates one batch at a time. Synchronous (s = 0): a batch is a fixed set of groups and
  completes with its longest response (the drain of `planner.sim.decode`; the slots idle as it empties).
  Asynchronous (s >= 1): groups stream as in `libra/controller/batching.py` (admission bounded by the policy
  lag; a step consumes finished groups; the slots are those of the part of the window that runs, a batch
  narrower from a training step's start until its weights serve, `planner.sim.decode.streaming_slots`), so
  when the next batch may be admitted as this one's requests are all admitted, its groups take the freed
  slots and this batch completes after its residual work at the full-batch rate; when admission is closed then, the slots idle through the drain until the next batch is
  admitted (or the drain ends): from then the next batch's groups fill the freed slots and its first finished
  groups stand in for the stragglers, so the batch completes once the residual work its running requests
  still held at that moment is done at the full-batch rate (the streaming rule, from the admission on; the
  stragglers count towards later steps). How late the admission comes thus shortens the drain continuously:
  a sync that arrives just after a batch's requests are all admitted costs little, not the whole drain.
- Training step k starts when batch k is done and step k - 1 ended; then the weights are synced
  (`PhaseCosts.sync_timing`): the rollout pool pauses for one reload (a pause stretches whatever it is
  generating) and version k + 1 serves after the reload (x nodes when serial).
- The policy is asked after every training step; a change of split is carried out by the configured
  reconfiguration strategy (`SWITCH_EFFECTS`).
- Node failures: a Poisson process at `node_failures_per_node_hour` per working node of the split (a node
  that is down does not fail again); the failed node belongs to a pool in proportion to the pool's live GPUs.
  Training loses the step in progress and the replicas on that node and re-forms (`train_restart_s`); the
  rollout pool loses the node's instances from its next batch on (in-flight requests are re-queued; no extra
  time is charged for them). The node comes back after `repair_s` and rejoins its pool after a restart;
  `repair_s = inf` means no repair.
- A job that has lost a whole pool with no node on its way back (no repair pending, no instance starting) can
  never finish: the run ends there with `outcome = "no_capacity"` and the steps it trained, instead of
  simulating a job that cannot move.
- EHP: when a training step starts while the rollout pool waits for the weights that step produces, the
  rollout GPUs (above `ehp_min_rollout_gpus`) join the step as extra data-parallel replicas of whole model
  copies (`planner.ehp.replica_unit`), paying `ehp_join_s`; they serve again after the step.

The per-batch aggregate's step times are checked against the per-request pipeline of `planner.sim.exact`
(tests/unit/planner/test_sim_exact.py).

GPU idle share = 1 - (useful GPU-seconds) / (GPUs x wall time): useful is decode at the full-batch rate plus
prefill on rollout GPUs, and training-side seconds on training GPUs (borrowed ones included).
"""

from __future__ import annotations

import copy
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Literal, Protocol

import numpy as np

from planner.ehp import replica_unit
from planner.plan import Candidate
from planner.replan import Observation
from planner.sim.costs import PhaseCosts
from planner.sim.decode import instance_generation, slots, streaming_slots
from planner.sim.lengths import BatchStats
from planner.workload import PlannerInputs

ReconfigureStrategy = Literal["diff", "restart_all", "blue_green", "prewarm", "cluster_swap"]
STRATEGIES: tuple[str, ...] = ("diff", "restart_all", "blue_green", "prewarm", "cluster_swap")
KIND_ORDER = {"failure": 0, "rejoin": 1, "train": 2, "sync": 3, "done": 4, "bulk": 5, "resume": 6}
HOUR = 3600.0

# What each strategy does to the pools when the split changes (the strategies of libra/controller/strategies.py;
# restart and re-form times are CostParams.rollout_restart_s and train_restart_s):
SWITCH_EFFECTS = {
    "diff": "unchanged instances keep serving; added instances serve after a restart; removed ones stop at "
            "once; a change of instance TP outdates every instance (as restart_all); a changed training pool "
            "re-forms",
    "restart_all": "every instance stops and the new set serves after a restart; a changed training pool "
                   "re-forms",
    "blue_green": "the new set starts on spare GPUs beside the serving one and takes over after a restart (no "
                  "rollout downtime); without enough spare GPUs it falls back to diff",
    "prewarm": "as blue_green (the flip waits for a trigger, which the simulated runtime gives at once)",
    "cluster_swap": "the training pool lends GPUs for the new set (training pauses for the restart and then "
                    "re-forms); the serving set keeps serving until the new one takes over",
}


@dataclass(frozen=True)
class SimOptions:
    """Everything about a run that is not the job: length of the run, seed, strategy, failures, EHP, policy
    knobs. Defaults are Libra's option defaults where one exists."""

    steps: int = 200
    seed: int = 0
    reconfigure_strategy: ReconfigureStrategy = "diff"
    node_failures_per_node_hour: float = 0.0
    repair_s: float = 4 * HOUR
    ehp_min_rollout_gpus: int = 0
    ehp_join_s: float = 5.0
    replan_interval_steps: int = 10
    replan_min_gain: float = 0.05
    replan_horizon_steps: int = 50
    record_events: bool = False

    def validate(self) -> None:
        problems = []
        if self.steps < 1:
            problems.append(f"steps: {self.steps}: must be >= 1")
        if self.reconfigure_strategy not in STRATEGIES:
            problems.append(f"reconfigure_strategy: {self.reconfigure_strategy!r}: choose one of {', '.join(STRATEGIES)}")
        if self.node_failures_per_node_hour < 0:
            problems.append(f"node_failures_per_node_hour: {self.node_failures_per_node_hour}: must be >= 0")
        if not self.repair_s > 0:
            problems.append(f"repair_s: {self.repair_s}: must be > 0 (inf: failed nodes never come back)")
        if self.replan_interval_steps < 1:
            problems.append(f"replan_interval_steps: {self.replan_interval_steps}: must be >= 1")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass(frozen=True)
class SimJob:
    """One job: planner inputs (reload method included), the drawn response lengths and the cost cache."""

    inputs: PlannerInputs
    batches: BatchStats
    costs: PhaseCosts

    @property
    def total_gpus(self) -> int:
        return self.inputs.cluster.total_gpus


class Policy(Protocol):
    """How the split is chosen. `decide` is called after every training step with the engine."""

    name: str
    ehp: bool

    def initial(self) -> Candidate: ...

    def decide(self, engine: Engine) -> Candidate | None: ...


@dataclass
class SimResult:
    """Totals and timeline of one simulated run."""

    policy: str
    initial: str
    steps: int
    wall_s: float
    samples: int
    tokens: float
    gpu_idle_frac: float
    reconfigurations: int = 0
    strategy_fallbacks: int = 0
    failures: int = 0
    outcome: Literal["completed", "no_capacity"] = "completed"
    outcome_detail: str = ""
    step_end_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    splits: list[tuple[float, int, int]] = field(default_factory=list)  # (time, train GPUs, rollout GPUs)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    events: list[tuple[float, str, int]] = field(default_factory=list)
    train_s: np.ndarray = field(default_factory=lambda: np.zeros(0))  # training-side seconds of each step
    rollout_busy_s: np.ndarray = field(default_factory=lambda: np.zeros(0))  # pool busy seconds by each batch's end
    rollout_s: np.ndarray = field(default_factory=lambda: np.zeros(0))  # each batch's start to its last response
    switches: list[dict[str, Any]] = field(default_factory=list)  # what each reconfiguration stopped, for how long

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        return {"policy": self.policy, "initial": self.initial, "steps": self.steps, "wall_s": round(self.wall_s, 3),
                "samples_per_s": round(self.samples_per_s, 4), "tokens_per_s": round(self.tokens_per_s, 1),
                "gpu_idle_frac": round(self.gpu_idle_frac, 4), "reconfigurations": self.reconfigurations,
                "strategy_fallbacks": self.strategy_fallbacks, "failures": self.failures, "outcome": self.outcome}


@dataclass
class _Keep:
    """The policy of a fork: keep the split."""

    ehp: bool
    name: str = "fork"

    def initial(self) -> Candidate:
        raise AssertionError("a fork starts from its run's split")

    def decide(self, engine: Engine) -> Candidate | None:
        return None


class Engine:
    """One run of one policy over one job. `run()` returns the `SimResult`."""

    def __init__(self, job: SimJob, policy: Policy, options: SimOptions) -> None:
        options.validate()
        if options.steps > job.batches.steps:
            raise ValueError(f"steps: {options.steps}: the job drew lengths for {job.batches.steps} steps only")
        self.job, self.policy, self.options = job, policy, options
        self.alloc = policy.initial()
        if self.alloc.total_gpus > job.total_gpus:
            raise ValueError(f"{policy.name}: split {self.alloc.label()} exceeds the {job.total_gpus} GPUs")
        self.now = 0.0
        self.steps = options.steps
        self.staleness = job.inputs.workload.max_head_offpolicyness
        self.gpn = job.inputs.cluster.gpus_per_node
        self._heap: list[tuple[float, int, int, str, tuple[Any, ...]]] = []
        self._seq = 0
        self.version = 0
        self.trained = 0
        self.next_batch = 0
        self.batch_done = np.zeros(self.steps, dtype=bool)
        self.in_bulk = False
        self.training = False
        self.train_token = 0
        self.pause_total = 0.0
        self.rollout_available_at = 0.0
        self.train_available_at = 0.0
        self.train_reform_pending = False
        self.serving_gpus, self.serving_tp = self.alloc.rollout_gpus, self.alloc.rollout_tp
        self.flip_at = math.inf
        self.starting: list[tuple[float, int]] = []  # (serving from, GPUs) of instances being started
        self.failed_train = 0
        self.failed_rollout = 0
        self.prev_done_at = 0.0
        self.prev_drain_s = 0.0
        self.prev_drain_work = 0.0
        self._pending = (0.0, 0.0)  # (drain seconds, drain work) of the batch in bulk
        self.gen_start = np.zeros(self.steps)
        self.gen_wall = np.zeros(self.steps)
        self.bulk_end = np.zeros(self.steps)
        self.pool_busy = 0.0  # seconds the rollout pool generated anything (union of its busy intervals)
        self.pool_busy_until = 0.0
        self.pool_busy_at_done = np.zeros(self.steps)
        self.train_s = np.zeros(self.steps)
        self.train_start = np.full(self.steps, np.nan)
        self.sync_s = np.zeros(self.steps)  # seconds from each step's end until its weights serve everywhere
        # the share of the last step's cycle (training start to training start) from its training start to its
        # weights serving, while which the admission window is one batch smaller (planner.sim.decode)
        self.training_share = 0.0
        self.step_end = np.zeros(self.steps)
        self.busy_gpu_s = 0.0
        self.tokens = 0.0
        self.result = SimResult(policy.name, self.alloc.label(), self.steps, 0.0, 0, 0.0, 0.0)
        self.result.splits.append((0.0, self.alloc.train_gpus, self.alloc.rollout_gpus))
        self._fail_rng = np.random.default_rng(options.seed + 7919)
        self._failure_token = 0
        self._rejoins_pending = 0
        self._arm_failure()

    # ------------------------------------------------------------------------------------------ plumbing
    def _push(self, at: float, kind: str, *payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at, KIND_ORDER[kind], self._seq, kind, payload))

    def _log(self, kind: str, step: int) -> None:
        if self.options.record_events:
            self.result.events.append((self.now, kind, step))

    def _refresh(self) -> None:
        if self.flip_at <= self.now:
            self.serving_gpus, self.serving_tp, self.flip_at = self.alloc.rollout_gpus, self.alloc.rollout_tp, math.inf
        self.starting = [(t, g) for t, g in self.starting if t > self.now]

    def live_rollout_gpus(self) -> int:
        starting = sum(g for _, g in self.starting)
        return max(0, self.serving_gpus - self.failed_rollout - starting)

    def live_dp(self) -> int:
        return max(0, (self.alloc.train_gpus - self.failed_train) // self.alloc.layout.model_parallel)

    def fork(self, batches: BatchStats, until_step: int) -> Engine:
        """This run as it stands now, continued on its own: batches that have not started take their lengths
        from `batches` (same number of steps as the job), the split is kept unless the caller reconfigures the
        fork, no node fails, nothing is recorded, and `run()` ends once `until_step` steps have trained. For
        predictors: the fork starts where the job's pipeline stands (batches draining, a reload in progress)."""
        if batches.steps != self.job.batches.steps:
            raise ValueError(f"batches: {batches.steps} steps: the job has {self.job.batches.steps}")
        if not self.trained < until_step <= self.steps:
            raise ValueError(f"until_step: {until_step}: must be after step {self.trained} and at most {self.steps}")
        fork = copy.copy(self)
        fork.job = SimJob(self.job.inputs, batches, self.job.costs)
        fork.policy = _Keep(self.policy.ehp)
        fork.options = replace(self.options, node_failures_per_node_hour=0.0, record_events=False)
        fork.steps = until_step
        fork._heap = list(self._heap)
        fork.starting = list(self.starting)
        for name in ("batch_done", "gen_start", "gen_wall", "bulk_end", "pool_busy_at_done", "train_s", "train_start",
                     "sync_s", "step_end"):
            setattr(fork, name, getattr(self, name).copy())
        fork.result = SimResult("fork", self.alloc.label(), until_step, 0.0, 0, 0.0, 0.0)
        fork._failure_token += 1  # failures drawn for this run do not happen in the fork
        return fork

    # ------------------------------------------------------------------------------------------ run
    def run(self) -> SimResult:
        handlers: dict[str, Callable[..., None]] = {
            "bulk": self._on_bulk, "done": self._on_done, "train": self._on_train, "sync": self._on_sync,
            "resume": self._on_resume, "failure": self._on_failure, "rejoin": self._on_rejoin}
        self._try_rollout()
        while self.trained < self.steps and self.result.outcome == "completed":
            if not self._heap:
                raise RuntimeError(f"{self.policy.name}: the simulation stalled at step {self.trained} "
                                   f"(t={self.now:.1f} s, split {self.alloc.label()}, failed train "
                                   f"{self.failed_train} rollout {self.failed_rollout} GPUs)")
            at, _, _, kind, payload = heapq.heappop(self._heap)
            self.now = at
            handlers[kind](*payload)
        r = self.result
        r.wall_s = self.now
        r.steps = self.trained
        r.samples = int(self.job.batches.count[: self.trained].sum())
        r.tokens = self.tokens
        r.step_end_s = self.step_end[: self.trained].copy()
        r.train_s = self.train_s[: self.trained].copy()
        r.rollout_busy_s = self.pool_busy_at_done[: self.trained].copy()
        r.rollout_s = self.gen_wall[: self.trained].copy()
        r.gpu_idle_frac = max(0.0, 1.0 - self.busy_gpu_s / (self.job.total_gpus * self.now)) if self.now else 0.0
        return r

    def _busy(self, start: float, end: float) -> None:
        self.pool_busy += max(0.0, end - max(start, self.pool_busy_until))
        self.pool_busy_until = max(self.pool_busy_until, end)

    def _lazy(self, kind: str, step: int, mark: float) -> bool:
        """Stretch a generation event by the pauses that began since it was scheduled; True when moved."""
        if self.pause_total > mark:
            self._push(self.now + self.pause_total - mark, kind, step, self.pause_total)
            return True
        return False

    # ------------------------------------------------------------------------------------------ rollout
    def _try_rollout(self) -> None:
        k = self.next_batch
        if self.in_bulk or k >= self.steps or self.version < k - self.staleness:
            return
        if self.now < self.rollout_available_at:
            self._push(self.rollout_available_at, "resume")
            return
        self._refresh()
        tp = self.serving_tp
        instances = self.live_rollout_gpus() // tp
        if instances < 1:
            waits = [t for t, _ in self.starting] + ([self.flip_at] if self.flip_at < math.inf else [])
            if waits:
                self._push(min(waits), "resume")
            return  # else a rejoin or a reconfiguration wakes the pool
        b, c = self.job.batches, self.job.costs
        requests = math.ceil(int(b.count[k]) / instances)
        lbm = b.length_biased_mean(k)
        if self.staleness > 0:  # the admission window's room that holds running responses (planner.sim.decode)
            slot_count = streaming_slots(c.max_seqs, c.kv_tokens(tp), c.prompt_tokens, lbm, requests,
                                         self.staleness, b.group_fill(k), self.training_share)
        else:
            slot_count = slots(c.max_seqs, c.kv_tokens(tp), c.prompt_tokens, lbm, requests)
        run = instance_generation(requests, float(b.total[k]) / instances, float(b.longest[k]), lbm, slot_count,
                                  partial(c.decode_step, tp, lbm), streaming=self.staleness > 0)
        prefill = c.prefill_s(tp, instances)
        carry = 0.0
        if self.prev_done_at > self.now and self.prev_drain_s > 0:
            carry = self.prev_drain_work * (self.prev_done_at - self.now) / self.prev_drain_s
        self.gen_start[k] = self.now
        self.in_bulk = True
        self.next_batch += 1
        self._pending = (run.drain_s, run.drain_work_s)
        self.busy_gpu_s += (prefill + float(b.total[k]) / instances / slot_count * run.step_full_s) * instances * tp
        self.tokens += float(b.total[k])
        self._log("rollout_start", k)
        self._push(self.now + carry + prefill + run.bulk_s, "bulk", k, self.pause_total)
        if k > 0 and not self.batch_done[k - 1] and self.prev_done_at > self.now + carry:
            # the previous batch drains with its slots idle: from now on this batch's groups fill them, and a
            # step consumes finished groups, so the stragglers' count is made up once the work they still
            # held is done at the full-batch rate, as while streaming
            self._push(self.now + carry, "done", k - 1, self.pause_total)

    def _on_bulk(self, k: int, mark: float) -> None:
        if self._lazy("bulk", k, mark):
            return
        drain_s, drain_work = self._pending
        self.in_bulk = False
        self.bulk_end[k] = self.now
        self._busy(self.gen_start[k], self.now)
        nxt = k + 1
        if (self.staleness > 0 and nxt < self.steps and self.version >= nxt - self.staleness
                and self.now >= self.rollout_available_at):
            drain_s = drain_work  # streaming: later groups keep the slots full while this batch's last finish
        self.prev_done_at, self.prev_drain_s, self.prev_drain_work = self.now + drain_s, drain_s, drain_work
        self._push(self.now + drain_s, "done", k, self.pause_total)
        self._try_rollout()

    def _on_done(self, k: int, mark: float) -> None:
        if self.batch_done[k] or self._lazy("done", k, mark):
            return
        self.batch_done[k] = True
        self.gen_wall[k] = self.now - self.gen_start[k]
        self._busy(self.bulk_end[k], self.now)
        self.pool_busy_at_done[k] = self.pool_busy
        self._log("rollout_done", k)
        self._try_train()

    def _on_sync(self, version: int) -> None:
        k = version - 1
        if version > self.version and k >= 1:
            cycle = self.train_start[k] - self.train_start[k - 1]
            if cycle > 0:
                self.training_share = min(1.0, (self.now - self.train_start[k]) / cycle)
        self.version = max(self.version, version)
        self._log("sync", version)
        self._try_rollout()

    def _on_resume(self) -> None:
        self._try_rollout()
        self._try_train()

    # ------------------------------------------------------------------------------------------ training
    def _rollout_waits_for(self, step: int) -> bool:
        """Whether the rollout pool is idle until the weights of training step `step` serve."""
        k = self.next_batch
        return not self.in_bulk and (k >= self.steps or k - self.staleness > step)

    def _try_train(self) -> None:
        k = self.trained
        if self.training or k >= self.steps or not self.batch_done[k]:
            return
        if self.train_reform_pending:
            self.train_reform_pending = False
            self.train_available_at = max(self.train_available_at,
                                          self.now + self.job.inputs.cost.train_restart_s)
        if self.now < self.train_available_at:
            self._push(self.train_available_at, "resume")
            return
        dp = self.live_dp()
        if dp < 1:
            return  # a rejoin or a reconfiguration wakes training
        layout, c, b = self.alloc.layout, self.job.costs, self.job.batches
        mean = b.mean(k)
        seconds = c.train_side_s(layout, dp, mean)
        gpus = dp * layout.model_parallel
        self.train_s[k] = seconds
        if self.policy.ehp and self._rollout_waits_for(k):
            self._refresh()
            lendable = self.live_rollout_gpus() - self.options.ehp_min_rollout_gpus
            unit = replica_unit(layout)
            extra = max(0, lendable) // unit * unit // layout.model_parallel
            if extra > 0:
                borrowed = c.train_side_s(layout, dp + extra, mean) + self.options.ehp_join_s
                if borrowed < seconds:
                    seconds, gpus = borrowed, (dp + extra) * layout.model_parallel
                    self.rollout_available_at = max(self.rollout_available_at, self.now + seconds)
                    self._log("ehp_borrow", k)
        self.busy_gpu_s += (seconds - (self.options.ehp_join_s if gpus > dp * layout.model_parallel else 0.0)) * gpus
        self.training = True
        self.train_start[k] = self.now
        self.train_token += 1
        self._log("train_start", k)
        self._push(self.now + seconds, "train", k, self.train_token)

    def _on_train(self, k: int, token: int) -> None:
        if token != self.train_token:
            return  # the step was lost to a failure and is redone
        self.training = False
        self.trained = k + 1
        self.step_end[k] = self.now
        self._log("train_done", k)
        self._refresh()
        pause, ready = self.job.costs.sync_timing(self.serving_tp, max(self.serving_gpus, 1))
        self.sync_s[k] = ready
        self.pause_total += pause
        self.rollout_available_at = max(self.rollout_available_at, self.now + pause)
        self._push(self.now + ready, "sync", k + 1)
        if self.trained < self.steps:
            target = self.policy.decide(self)
            if target is not None and target != self.alloc:
                self.reconfigure(target)
        self._try_train()

    # ------------------------------------------------------------------------------------------ changes
    def reconfigure(self, target: Candidate) -> None:
        """Move to `target` with the configured strategy (at a step boundary: training is idle)."""
        if target.total_gpus > self.job.total_gpus:
            raise ValueError(f"{self.policy.name}: target {target.label()} exceeds the cluster")
        old, cost = self.alloc, self.job.inputs.cost
        strategy = self.options.reconfigure_strategy
        spare = self.job.total_gpus - old.total_gpus
        if strategy in ("blue_green", "prewarm") and spare < target.rollout_gpus:
            strategy = "diff"
            self.result.strategy_fallbacks += 1
        if strategy == "diff" and target.rollout_tp != old.rollout_tp:
            strategy = "restart_all"
        train_changes = (old.train_gpus, old.layout) != (target.train_gpus, target.layout)
        rollout_changes = (old.rollout_gpus, old.rollout_tp) != (target.rollout_gpus, target.rollout_tp)
        self._refresh()
        self.alloc = target
        self.failed_train = min(self.failed_train, target.train_gpus)
        self.failed_rollout = min(self.failed_rollout, target.rollout_gpus)
        self._arm_failure()
        if train_changes:  # training is idle at a step boundary: the pool re-forms from now on
            self.train_available_at = max(self.train_available_at, self.now + cost.train_restart_s)
        if rollout_changes:
            if strategy == "restart_all":
                self.starting = []
                self.serving_gpus, self.serving_tp = target.rollout_gpus, target.rollout_tp
                self.rollout_available_at = max(self.rollout_available_at, self.now + cost.rollout_restart_s)
            elif strategy == "diff":
                grow = target.rollout_gpus - self.serving_gpus
                self.serving_gpus = target.rollout_gpus
                if grow > 0:
                    self.starting.append((self.now + cost.rollout_restart_s, grow))
            else:  # blue_green / prewarm on spare GPUs, or cluster_swap on GPUs lent by training
                self.flip_at = self.now + cost.rollout_restart_s
                self.serving_gpus = min(self.serving_gpus, old.rollout_gpus)
                if strategy == "cluster_swap":  # training lends GPUs to the new set until the flip, then re-forms
                    self.train_available_at = max(self.train_available_at, self.flip_at + cost.train_restart_s)
        train_pause = cost.train_restart_s if train_changes else 0.0
        rollout_pause = cost.rollout_restart_s if rollout_changes and strategy == "restart_all" else 0.0
        if rollout_changes and strategy == "cluster_swap":
            train_pause += cost.rollout_restart_s
        self.result.switches.append({"step": self.trained, "time_s": round(self.now, 1), "strategy": strategy,
                                     "train_pause_s": train_pause, "rollout_pause_s": rollout_pause})
        self.result.reconfigurations += 1
        self.result.splits.append((self.now, target.train_gpus, target.rollout_gpus))
        self._log("reconfigure", self.trained)
        self._push(self.now, "resume")

    def _arm_failure(self) -> None:
        """Schedule the next node failure at the rate of the split's working nodes (memoryless, so drawing
        again whenever that number changes is exact); earlier schedules become stale."""
        self._failure_token += 1
        working = (self.alloc.total_gpus - self.failed_train - self.failed_rollout) / self.gpn
        rate = self.options.node_failures_per_node_hour / HOUR * working
        if rate > 0:
            self._push(self.now + self._fail_rng.exponential(1.0 / rate), "failure", self._failure_token)

    def _end_without_capacity(self) -> None:
        """End the run when a pool has no capacity and nothing will bring any back."""
        self._refresh()
        starting = sum(g for _, g in self.starting) + (self.alloc.rollout_gpus if self.flip_at < math.inf else 0)
        lost = [name for name, live in (("training", self.live_dp()),
                                         ("rollout", self.live_rollout_gpus() // self.serving_tp + starting))
                if live < 1]
        if not lost or self._rejoins_pending:
            return
        self.result.outcome = "no_capacity"
        self.result.outcome_detail = (
            f"the {' and '.join(lost)} pool{'s' if len(lost) > 1 else ''} lost every GPU at t={self.now:.0f} s "
            f"with no node on its way back (repair_s={self.options.repair_s}); {self.trained} of {self.steps} "
            f"steps trained")

    def _on_failure(self, token: int) -> None:
        if token != self._failure_token:
            return  # drawn for a number of working nodes that has changed since
        self.result.failures += 1
        self._refresh()
        train_live = self.alloc.train_gpus - self.failed_train
        rollout_live = self.live_rollout_gpus()
        if train_live + rollout_live <= 0:
            self._arm_failure()
            return
        pool = "train" if self._fail_rng.random() < train_live / (train_live + rollout_live) else "rollout"
        lost = min(self.gpn, train_live if pool == "train" else rollout_live)
        if pool == "train":
            self.failed_train += lost
            if self.training:
                self.training = False
                self.train_token += 1  # the step in progress is lost and redone on the re-formed pool
            self.train_available_at = max(self.train_available_at, self.now + self.job.inputs.cost.train_restart_s)
        else:
            self.failed_rollout += lost
        self._log(f"failure_{pool}", self.trained)
        if math.isfinite(self.options.repair_s):
            self._rejoins_pending += 1
            self._push(self.now + self.options.repair_s, "rejoin", pool, lost)
        self._arm_failure()
        self._end_without_capacity()
        self._push(self.now, "resume")

    def _on_rejoin(self, pool: str, gpus: int) -> None:
        self._rejoins_pending -= 1
        if pool == "train":
            self.failed_train = max(0, self.failed_train - gpus)
            self.train_reform_pending = True
        else:
            self.failed_rollout = max(0, self.failed_rollout - gpus)
            self.starting.append((self.now + self.job.inputs.cost.rollout_restart_s, gpus))
        self._log(f"rejoin_{pool}", self.trained)
        self._arm_failure()
        self._push(self.now, "resume")

    # ------------------------------------------------------------------------------------------ for policies
    def observation(self, window: int) -> Observation:
        """What the runtime measures over the last `window` steps, as `libra.controller.replanner` turns its
        metric rows into the inputs of `planner.replan.replan`: the pool's generation rate (tokens over the time
        it was generating), training seconds per step, the response lengths' mean and trend, each pool's idle
        share of the window, the seconds of a weight publish and the wall seconds per step."""
        hi = self.trained
        lo = max(0, hi - window)
        b = self.job.batches
        if hi <= lo:
            return Observation(rollout_tokens_per_s=0.0, train_step_s=0.0, mean_response_tokens=0.0)
        tokens = float(b.total[lo:hi].sum())
        # batches overlap in their drains, so the busy time is the union of their generation (between the
        # completions of the window's first and last batch: about one step ahead of the window's steps)
        busy = float(self.pool_busy_at_done[hi - 1] - (self.pool_busy_at_done[lo - 1] if lo else 0.0))
        wall = float(self.step_end[hi - 1] - (self.step_end[lo - 1] if lo else 0.0))
        means = b.total[lo:hi] / b.count[lo:hi]
        trend = float(np.polyfit(np.arange(len(means)), means, 1)[0]) if len(means) >= 3 else 0.0
        training = min(wall, float(self.train_s[lo:hi].sum()))
        return Observation(rollout_tokens_per_s=tokens / busy if busy > 0 else 0.0,
                           train_step_s=float(self.train_s[lo:hi].mean()),
                           mean_response_tokens=float(means.mean()), response_tokens_per_step=trend,
                           rollout_idle_share=1.0 - min(wall, busy) / wall if wall > 0 else None,
                           train_idle_share=1.0 - training / wall if wall > 0 else None,
                           weight_sync_s=float(self.sync_s[lo:hi].mean()), step_wall_s=wall / (hi - lo))

    def steps_begun_since(self, time_s: float) -> int:
        """How many of the trained steps began (the step before them ended) at `time_s` or later."""
        if self.trained == 0:
            return 0
        began = np.concatenate(([0.0], self.step_end[: self.trained - 1]))
        return int(np.count_nonzero(began >= time_s))
