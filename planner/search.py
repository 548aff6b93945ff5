"""Layout and split search: enumerate -> estimate -> prune (a reason per candidate) -> select.

Candidates are (training-pool size on `allocation_granularity_gpus`, training layout TP x PP x CP x EP,
rollout instance TP). Rules that depend only on the layout prune a layout for every split; the rest are
evaluated for all splits of a layout at once with numpy. The rollout side is independent of the training
layout, so it is costed once per split and rollout TP; each layout and split takes the rollout TP of the
least step (under bounded staleness that need not be the least rollout side: `planner.cost.step_seconds`).
The selection maximises RL samples per second
(synchronous or bounded-staleness asynchronous step time); candidates within `THROUGHPUT_TIE_TOLERANCE` of
the best tie and are ordered by training-memory headroom, then fewer training GPUs (`planner.plan.rank`).
`brute_force` evaluates every candidate one by one with the scalar path; the tests check that both agree.
With `inputs.ehp` (a synchronous job that lends its idle rollout GPUs to training) the training side of each
split is priced on the training pool's DP ranks plus those its rollout GPUs lend (`planner.ehp`).

The search gives no advice (`planner.advice` does, and `planner.grp.plan` combines both), so advice can
re-run the search without an import cycle.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np

from planner.cost import rollout_costs, step_seconds, train_costs
from planner.ehp import planned_borrowed_dp, planned_borrowed_dp_each
from planner.explain import memory_message, rollout_memory_message
from planner.layout import Rule, TrainLayout, enumerate_layouts, layout_rule_violation, rollout_rule_violation
from planner.memory import kv_capacity_sequences, rollout_memory, train_memory, train_peak_bytes
from planner.plan import (
    HEADROOM_UNIT_BYTES,
    THROUGHPUT_TIE_TOLERANCE,
    Candidate,
    Evaluation,
    Plan,
    Pruned,
    rank,
)
from planner.workload import PlannerInputs

GB = 1e9
ALTERNATIVES = 5

# per-split training rules, in the order they are checked (the first failing one is the recorded reason)
SPLIT_CODES = ("split_divisibility", "ep_data_parallel", "batch_divisibility", "interleave_microbatches",
               "tp_comm_ratio", "ep_comm_ratio", "bubble_ratio", "train_memory")
THRESHOLD_CODES = frozenset({"tp_comm_ratio", "ep_comm_ratio", "bubble_ratio"})


def split_sizes(inputs: PlannerInputs) -> np.ndarray:
    """Training-pool sizes: multiples of the granularity leaving at least `min_rollout_gpus` (>= 1) GPUs."""
    s, total = inputs.space, inputs.cluster.total_gpus
    g = s.allocation_granularity_gpus
    sizes = np.arange(g, total + 1, g, dtype=np.int64)
    keep = (sizes >= s.min_train_gpus) & (total - sizes >= max(1, s.min_rollout_gpus))
    return sizes[keep]


# ------------------------------------------------------------------------------------------ scalar path
def split_rule_violations(inputs: PlannerInputs, layout: TrainLayout, train_gpus: int,
                          costs: dict[str, Any] | None = None, check_thresholds: bool = True) -> list[Rule]:
    """Rules that depend on the training-pool size, checked one candidate at a time."""
    w, s = inputs.workload, inputs.space
    found = layout.world_problems(train_gpus)
    if any(rule.code == "split_divisibility" for rule in found):
        return found
    dp = layout.dp(train_gpus)
    if w.samples_per_step % (dp * w.train_micro_batch_size):
        found.append(Rule("batch_divisibility", f"{w.samples_per_step} samples per step are not a multiple of "
                                                f"DP {dp} x micro-batch {w.train_micro_batch_size}"))
    microbatches = w.samples_per_step // (dp * w.train_micro_batch_size)
    if layout.vpp > 1 and microbatches % layout.pp:
        found.append(Rule("interleave_microbatches", f"interleaved pipeline needs micro-batches ({microbatches}) "
                                                     f"divisible by PP {layout.pp}"))
    if check_thresholds:
        costs = costs if costs is not None else train_costs(inputs, layout, dp)
        if float(costs["tp_comm_ratio"]) > s.comm_compute_ratio_threshold:
            found.append(Rule("tp_comm_ratio", f"TP communication/compute {float(costs['tp_comm_ratio']):.3f} > "
                                               f"train_comm_compute_ratio_threshold {s.comm_compute_ratio_threshold}"))
        if float(costs["ep_comm_ratio"]) > s.ep_comm_compute_ratio_threshold:
            found.append(Rule("ep_comm_ratio", f"EP all-to-all/compute {float(costs['ep_comm_ratio']):.3f} > "
                                               f"train_ep_comm_compute_ratio_threshold "
                                               f"{s.ep_comm_compute_ratio_threshold}"))
        if float(costs["bubble_ratio"]) > s.bubble_ratio_threshold:
            found.append(Rule("bubble_ratio", f"pipeline bubble {float(costs['bubble_ratio']):.3f} > "
                                              f"train_pipeline_bubble_ratio_threshold {s.bubble_ratio_threshold}"))
    return found


def evaluate(inputs: PlannerInputs, candidate: Candidate, check_thresholds: bool = True) -> Evaluation:
    """Every number the plan reports for one candidate, and every rule it breaks."""
    spec, gpn = inputs.model, inputs.cluster.gpus_per_node
    layout, r = candidate.layout, candidate.rollout_tp
    violations: list[Rule] = []
    if candidate.train_gpus + candidate.rollout_gpus > inputs.cluster.total_gpus:
        violations.append(Rule("split_exceeds_cluster", f"{candidate.train_gpus} + {candidate.rollout_gpus} GPUs "
                                                        f"exceed the {inputs.cluster.total_gpus} of the cluster"))
    violations += layout.problems(spec, gpus_per_node=gpn, max_model_len=inputs.workload.max_model_len,
                                  attention_backend=inputs.train.attention_backend)
    dp = max(1, candidate.train_gpus // layout.model_parallel)
    train = {k: float(v) for k, v in train_costs(inputs, layout, dp).items()}
    violations += split_rule_violations(inputs, layout, candidate.train_gpus, train, check_thresholds)
    train.update(_with_borrowed(inputs, layout, dp, candidate.rollout_gpus, r, train))
    t_mem = train_memory(inputs, layout, dp)
    if not t_mem.fits:
        violations.append(Rule("train_memory", memory_message("training", t_mem)))

    rule = rollout_rule_violation(spec, r, gpn)
    if rule:
        violations.append(rule)
    if candidate.rollout_gpus < r or candidate.rollout_gpus % r:
        violations.append(Rule("rollout_split", f"{candidate.rollout_gpus} rollout GPUs are not a multiple of "
                                                f"rollout TP {r}"))
    capacity = kv_capacity_sequences(inputs, r)
    rollout = {k: float(v) for k, v in rollout_costs(inputs, r, max(1, candidate.rollout_instances),
                                                     max(1, capacity)).items()}
    r_mem = rollout_memory(inputs, r, max(0, min(int(rollout["batch_per_instance"]), capacity)))
    if capacity < 1:
        violations.append(Rule("rollout_memory", rollout_memory_message(inputs, r)))
    side_train = train["train_s"] + train["logprob_recompute_s"]
    step = float(step_seconds(inputs, side_train, rollout["generation_s"] + rollout["weight_sync_s"],
                              rollout["batch_latency_s"] + rollout["weight_sync_s"]))
    w = inputs.workload
    return Evaluation(candidate=candidate, train_memory=t_mem, rollout_memory=r_mem, train=train, rollout=rollout,
                      step_s=step, samples_per_s=w.samples_per_step / step,
                      tokens_per_s=w.samples_per_step * w.mean_sequence_tokens / step,
                      kv_capacity_sequences=capacity, violations=tuple(violations))


def _with_borrowed(inputs: PlannerInputs, layout: TrainLayout, dp: int, rollout_gpus: int, rollout_tp: int,
                   own: dict[str, float]) -> dict[str, float]:
    """The training-side seconds on the pool's own DP ranks and the ranks elastic hybrid parallelism borrows
    (`planner.ehp.planned_borrowed_dp`): `train_s` and `logprob_recompute_s` of the step as it runs, the own
    pool's alone as `*_own`, and `ehp_borrowed_dp` (0: nothing borrowed, nothing changes). The rules and the
    memory check stay on the own pool (it steps the optimizer)."""
    borrowed = planned_borrowed_dp(inputs, layout, rollout_gpus, rollout_tp)
    if borrowed < 1:
        return {"ehp_borrowed_dp": 0.0} if inputs.ehp is not None else {}
    train_s, logprob_s = _training_side_with_borrowed(inputs, layout, dp, borrowed)
    return {"ehp_borrowed_dp": float(borrowed), "train_s_own": own["train_s"],
            "logprob_recompute_s_own": own["logprob_recompute_s"], "train_s": float(train_s),
            "logprob_recompute_s": float(logprob_s)}


def _training_side_with_borrowed(inputs: PlannerInputs, layout: TrainLayout, dp: int | np.ndarray,
                                 borrowed: int | np.ndarray) -> tuple[float | np.ndarray, float | np.ndarray]:
    """(train seconds, log-prob recomputation seconds) of a step on `dp` own and `borrowed` borrowed DP ranks,
    scalars or arrays alike (both search paths price the borrowed step here)."""
    joint = train_costs(inputs, layout, dp + borrowed)
    return joint["train_s"], joint["logprob_recompute_s"]


def brute_force(inputs: PlannerInputs) -> tuple[Evaluation | None, int]:
    """Best feasible candidate by evaluating every one (slow; for tests and small clusters)."""
    total = inputs.cluster.total_gpus
    s = inputs.space
    layouts = enumerate_layouts(s.allowed_tp, s.allowed_pp, s.allowed_cp, s.allowed_ep, inputs.train.vpp)
    feasible: list[Evaluation] = []
    count = 0
    for t, layout, r in itertools.product(split_sizes(inputs).tolist(), layouts, sorted(set(s.allowed_rollout_tp))):
        count += 1
        ev = evaluate(inputs, Candidate(int(t), total - int(t), layout, r))
        if ev.feasible:
            feasible.append(ev)
    best = rank(feasible, limit=1)
    return (best[0] if best else None), count


# ------------------------------------------------------------------------------------------ vectorized path
RolloutOption = tuple[int, np.ndarray, np.ndarray]  # rollout TP, per split: rollout side (inf: not possible), chain


def _rollout_side(inputs: PlannerInputs, splits: np.ndarray, pruned: list[Pruned]) -> list[RolloutOption]:
    """Per allowed rollout TP: the rollout-side seconds (generation + weight sync) of every split (inf where
    its rollout GPUs cannot hold that TP) and the rollout part of its weight-version chain (batch latency +
    weight sync, `step_seconds`)."""
    spec, gpn, total = inputs.model, inputs.cluster.gpus_per_node, inputs.cluster.total_gpus
    options: list[RolloutOption] = []
    rollout_gpus = total - splits
    for r in sorted(set(inputs.space.allowed_rollout_tp)):
        rule = rollout_rule_violation(spec, r, gpn)
        if rule:
            pruned.append(Pruned("rollout", rule.code, rule.message, rollout_tp=r))
            continue
        capacity = kv_capacity_sequences(inputs, r)
        if capacity < 1:
            pruned.append(Pruned("rollout", "rollout_memory", rollout_memory_message(inputs, r), rollout_tp=r))
            continue
        ok = (rollout_gpus % r == 0) & (rollout_gpus >= r)
        if not ok.all():
            pruned.append(Pruned("rollout", "rollout_split", f"the rollout GPUs left are not a multiple of TP {r}",
                                 rollout_tp=r, gpus=splits[~ok]))
        costs = rollout_costs(inputs, r, np.maximum(rollout_gpus // r, 1), capacity)
        options.append((r, np.where(ok, costs["generation_s"] + costs["weight_sync_s"], np.inf),
                        costs["batch_latency_s"] + costs["weight_sync_s"]))
    return options


def _least_rollout_side(splits: np.ndarray, options: list[RolloutOption]) -> np.ndarray:
    """Per split: the rollout TP of the least rollout-side seconds (0 where none fits)."""
    best = np.full(len(splits), np.inf)
    best_tp = np.zeros(len(splits), dtype=np.int64)
    for r, side, _ in options:
        better = side < best
        best = np.where(better, side, best)
        best_tp = np.where(better, r, best_tp)
    return best_tp


def _least_step(inputs: PlannerInputs, train_side: np.ndarray,
                options: list[RolloutOption]) -> tuple[np.ndarray, np.ndarray]:
    """Per layout and split: the least step seconds over the rollout TPs, and that TP (of equal steps, the one
    with the least rollout side). Under bounded staleness the TP with the least rollout side need not give the
    least step: a larger TP shortens the longest response on the weight-version chain."""
    step = np.full(train_side.shape, np.inf)
    rollout = np.full(train_side.shape, np.inf)
    tp = np.zeros(train_side.shape, dtype=np.int64)
    for r, side, chain in options:
        candidate = step_seconds(inputs, train_side, side[None, :], chain[None, :])
        better = (candidate < step) | ((candidate == step) & (side[None, :] < rollout))
        step = np.where(better, candidate, step)
        rollout = np.where(better, side[None, :], rollout)
        tp = np.where(better, r, tp)
    return step, tp


_DIVISIBILITY = SPLIT_CODES.index("split_divisibility") + 1
_EP_DP = SPLIT_CODES.index("ep_data_parallel") + 1
_BATCH = SPLIT_CODES.index("batch_divisibility") + 1


def _integer_codes(inputs: PlannerInputs, model_parallel: int, splits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(DP per split, code after the divisibility and batch rules), shared by layouts of one TP x PP x CP."""
    w = inputs.workload
    dp = np.maximum(splits // model_parallel, 1)
    code = np.where(splits % model_parallel != 0, _DIVISIBILITY,
                    np.where(w.samples_per_step % (dp * w.train_micro_batch_size) != 0, _BATCH, 0))
    return dp, code


def _split_codes(inputs: PlannerInputs, layout: TrainLayout, splits: np.ndarray,
                 base: tuple[np.ndarray, np.ndarray],
                 rollout_tp: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """Rule code per split (0 = feasible, i = SPLIT_CODES[i - 1]), the splits whose costs were computed, and
    the numbers behind the reasons for those splits: TP/EP ratios, bubble, peak bytes, training-side seconds
    (with the DP ranks elastic hybrid parallelism borrows from each split's rollout side, `rollout_tp`)."""
    w, s = inputs.workload, inputs.space
    dp, code = base[0], base[1].copy()
    if layout.ep > 1:
        code[(code != _DIVISIBILITY) & ((dp * layout.cp) % layout.ep != 0)] = _EP_DP
    if layout.vpp > 1:
        bad = (w.samples_per_step // (dp * w.train_micro_batch_size)) % layout.pp != 0
        code[(code == 0) & bad] = SPLIT_CODES.index("interleave_microbatches") + 1
    rows = np.flatnonzero(code == 0)
    if len(rows) == 0:
        return code, rows, {}
    costs = train_costs(inputs, layout, dp[rows])
    values = {"tp_comm_ratio": costs["tp_comm_ratio"] + np.zeros(len(rows)),
              "ep_comm_ratio": costs["ep_comm_ratio"] + np.zeros(len(rows)),
              "bubble_ratio": costs["bubble_ratio"] + np.zeros(len(rows)),
              "peak": train_peak_bytes(inputs, layout, dp[rows]) + np.zeros(len(rows)),
              "side": costs["train_s"] + costs["logprob_recompute_s"] + np.zeros(len(rows))}
    if inputs.ehp is not None and rollout_tp is not None:
        total = inputs.cluster.total_gpus
        borrowed = np.array(planned_borrowed_dp_each(inputs, layout, (total - splits[rows]).tolist(),
                                                     rollout_tp[rows].tolist()), dtype=np.int64)
        lends = borrowed > 0
        if lends.any():
            train_s, logprob_s = _training_side_with_borrowed(inputs, layout, dp[rows], borrowed)
            values["side"] = np.where(lends, train_s + logprob_s, values["side"])
    sub = np.zeros(len(rows), dtype=np.int64)
    for name, failed in (("tp_comm_ratio", values["tp_comm_ratio"] > s.comm_compute_ratio_threshold),
                         ("ep_comm_ratio", values["ep_comm_ratio"] > s.ep_comm_compute_ratio_threshold),
                         ("bubble_ratio", values["bubble_ratio"] > s.bubble_ratio_threshold),
                         ("train_memory", values["peak"] > inputs.cluster.gpu.memory_bytes)):
        sub[(sub == 0) & failed] = SPLIT_CODES.index(name) + 1
    code[rows] = sub
    return code, rows, values


def _split_reason(name: str, inputs: PlannerInputs, layout: TrainLayout, values: dict[str, np.ndarray],
                  picked: np.ndarray) -> tuple[str, float | None, float | None]:
    """Why splits were pruned, and for the cost and memory rules the smallest value among them and the limit
    it broke; `picked` indexes the computed values (cost-based rules only)."""
    def span(key: str, fmt: str, scale: float = 1.0) -> str:
        chosen = values[key][picked] / scale
        lo, hi = float(chosen.min()), float(chosen.max())
        return format(lo, fmt) if lo == hi else f"{lo:{fmt}}-{hi:{fmt}}"

    s, w = inputs.space, inputs.workload
    if name == "split_divisibility":
        return f"not a multiple of TP x PP x CP = {layout.model_parallel}", None, None
    if name == "ep_data_parallel":
        return f"EP {layout.ep} does not divide DP x CP", None, None
    if name == "batch_divisibility":
        return (f"{w.samples_per_step} samples per step not divisible by DP x micro-batch "
                f"{w.train_micro_batch_size}"), None, None
    if name == "interleave_microbatches":
        return f"interleaved pipeline needs micro-batches divisible by PP {layout.pp}", None, None
    key, threshold = {"tp_comm_ratio": ("tp_comm_ratio", s.comm_compute_ratio_threshold),
                      "ep_comm_ratio": ("ep_comm_ratio", s.ep_comm_compute_ratio_threshold),
                      "bubble_ratio": ("bubble_ratio", s.bubble_ratio_threshold),
                      "train_memory": ("peak", float(inputs.cluster.gpu.memory_bytes))}[name]
    smallest = float(values[key][picked].min())
    if name == "tp_comm_ratio":
        text = f"TP comm/compute {span('tp_comm_ratio', '.3f')} > threshold {threshold}"
    elif name == "ep_comm_ratio":
        text = f"EP all-to-all/compute {span('ep_comm_ratio', '.3f')} > threshold {threshold}"
    elif name == "bubble_ratio":
        text = f"pipeline bubble {span('bubble_ratio', '.3f')} > threshold {threshold}"
    else:
        text = f"peak training memory {span('peak', '.1f', GB)} GB > {threshold / GB:.1f} GB per GPU"
    return text, smallest, threshold


def _train_side(inputs: PlannerInputs, splits: np.ndarray, pruned: list[Pruned],
                rollout_tp: np.ndarray | None = None) -> tuple[list[TrainLayout], np.ndarray, np.ndarray, int]:
    """Layouts that pass the structural rules, their training-side seconds per split (inf = pruned; with the
    ranks borrowed from each split's rollout side of TP `rollout_tp`) and their peak training bytes per split
    (for the tie-break on headroom)."""
    s, spec = inputs.space, inputs.model
    layouts = enumerate_layouts(s.allowed_tp, s.allowed_pp, s.allowed_cp, s.allowed_ep, inputs.train.vpp)
    kept: list[TrainLayout] = []
    rows: list[np.ndarray] = []
    peaks: list[np.ndarray] = []
    shared: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for layout in layouts:
        rule = layout_rule_violation(spec, layout, inputs.cluster.gpus_per_node, inputs.workload.max_model_len,
                                     inputs.train.attention_backend)
        if rule:
            pruned.append(Pruned("train_layout", rule.code, rule.message, layout=layout))
            continue
        mp = layout.model_parallel
        if mp not in shared:
            shared[mp] = _integer_codes(inputs, mp, splits)
        code, computed, values = _split_codes(inputs, layout, splits, shared[mp], rollout_tp)
        for index in np.unique(code).tolist():
            if index == 0:
                continue
            name = SPLIT_CODES[index - 1]
            where = code == index
            picked = where[computed] if len(computed) else where[:0]
            gpus = () if where.all() else splits[where]
            reason, value, threshold = _split_reason(name, inputs, layout, values, picked)
            pruned.append(Pruned("train_split", name, reason, layout=layout, gpus=gpus, value=value,
                                 threshold=threshold))
        side = np.full(len(splits), np.inf)
        peak = np.full(len(splits), np.inf)
        if len(computed):
            ok = code[computed] == 0
            side[computed[ok]] = values["side"][ok]
            peak[computed] = values["peak"]
        kept.append(layout)
        rows.append(side)
        peaks.append(peak)
    empty = np.zeros((0, len(splits)))
    return kept, (np.vstack(rows) if rows else empty), (np.vstack(peaks) if peaks else empty), len(layouts)


def search(inputs: PlannerInputs) -> Plan:
    """The best feasible split and layouts, the alternatives and the pruned candidates, without advice
    (`planner.grp.plan` adds it)."""
    inputs.validate()
    started = time.perf_counter()
    plan = search_validated(inputs)
    plan.search_s = time.perf_counter() - started
    return plan


def search_validated(inputs: PlannerInputs) -> Plan:
    """`search` for inputs already validated."""
    if inputs.space.strategy == "configured":
        return _check_configured(inputs)
    return _search_grp(inputs)


def pinned_candidate(inputs: PlannerInputs) -> Candidate | None:
    pin = inputs.space.pinned
    if pin is None:
        return None
    layout = TrainLayout(pin.tp, pin.pp, pin.cp, pin.ep, inputs.train.vpp if pin.pp > 1 else 1)
    return Candidate(pin.train_gpus, pin.rollout_gpus, layout, pin.rollout_tp)


def preferred_order(samples_per_s: np.ndarray, tie_keys: tuple[np.ndarray, ...], count: int) -> list[int]:
    """Indices of the first `count` candidates in `planner.plan.rank` order, over arrays: `tie_keys` as for
    `np.lexsort` (last key first), the same order as `Evaluation.tie_key`."""
    left = np.ones(len(samples_per_s), dtype=bool)
    order: list[int] = []
    while len(order) < count and left.any():
        best = float(samples_per_s[left].max())
        tier = np.flatnonzero(left & (samples_per_s >= best * (1.0 - THROUGHPUT_TIE_TOLERANCE)))
        k = int(tier[np.lexsort(tuple(key[tier] for key in tie_keys))[0]])
        order.append(k)
        left[k] = False
    return order


def _search_grp(inputs: PlannerInputs) -> Plan:
    splits = split_sizes(inputs)
    total = inputs.cluster.total_gpus
    pruned: list[Pruned] = []
    plan = Plan(inputs=inputs, strategy="grp", feasible=False, chosen=None, splits=tuple(splits.tolist()))
    if len(splits) == 0:
        return plan
    options = _rollout_side(inputs, splits, pruned)
    # elastic hybrid parallelism lends in synchronous jobs only, where the least step is the least rollout side
    # (no chain): their training side is priced with the ranks that TP lends
    layouts, train_side, train_peak, n_layouts = _train_side(inputs, splits, pruned,
                                                             _least_rollout_side(splits, options))
    plan.pruned = pruned
    plan.candidates_evaluated = (n_layouts + len(set(inputs.space.allowed_rollout_tp))) * len(splits)
    if not layouts:
        return plan
    step, rollout_tp = _least_step(inputs, train_side, options)
    feasible = np.isfinite(step)
    if not feasible.any():
        return plan
    rows, cols = np.nonzero(feasible)
    throughput = inputs.workload.samples_per_step / step[rows, cols]
    headroom = np.floor((inputs.cluster.gpu.memory_bytes - train_peak[rows, cols]) / HEADROOM_UNIT_BYTES)
    # the same order as Evaluation.tie_key: layouts are enumerated in (tp, pp, cp, ep) order
    order = preferred_order(throughput, (rows, train_side[rows, cols], -throughput, splits[cols], -headroom),
                            ALTERNATIVES + 1)
    picked: list[Evaluation] = []
    for k in order:
        t = int(splits[cols[k]])
        candidate = Candidate(t, total - t, layouts[rows[k]], int(rollout_tp[rows[k], cols[k]]))
        picked.append(evaluate(inputs, candidate))
    plan.chosen, plan.alternatives = picked[0], picked[1:]
    plan.feasible = plan.chosen.feasible
    return plan


def _check_configured(inputs: PlannerInputs) -> Plan:
    pinned = pinned_candidate(inputs)
    assert pinned is not None  # validate() guarantees it
    ev = evaluate(inputs, pinned)
    blocking = [v for v in ev.violations if v.code not in THRESHOLD_CODES]
    plan = Plan(inputs=inputs, strategy="configured", feasible=not blocking, chosen=ev,
                candidates_evaluated=1, splits=(pinned.train_gpus,))
    plan.warnings = [f"{v.code}: {v.message}" for v in ev.violations if v.code in THRESHOLD_CODES]
    plan.suggestions = [f"{v.code}: {v.message}" for v in blocking]
    return plan
