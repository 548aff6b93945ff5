"""A split of the cluster between the training pool and the rollout pool, and the splits a policy may choose.

A split is the planner's `Candidate` (training GPUs and layout, rollout GPUs and instance TP). The simulated
elastic runtime resizes the training pool by data-parallel replicas and keeps its TP x PP x CP x EP layout (as
Libra's elastic training does); the rollout instance TP may change with a restart of the
instances. `static_splits` lists every split that the planner's own rules admit for a layout: training GPUs
on the allocation granularity, the layout's divisibility and batch rules (`planner.search.split_rule_violations`
without the cost thresholds) and the training memory model; rollout GPUs a multiple of the instance TP.
"""

from __future__ import annotations

import numpy as np

from planner.layout import TrainLayout, rollout_rule_violation
from planner.memory import kv_capacity_sequences, train_peak_bytes
from planner.plan import Candidate
from planner.search import split_rule_violations, split_sizes
from planner.workload import PlannerInputs


def static_splits(inputs: PlannerInputs, layout: TrainLayout, rollout_tps: tuple[int, ...]) -> list[Candidate]:
    """Every split of the whole cluster for `layout` and each rollout TP that the planner's rules admit."""
    total, gpn = inputs.cluster.total_gpus, inputs.cluster.gpus_per_node
    sizes = split_sizes(inputs)
    fits: list[int] = []
    for train in sizes.tolist():
        if split_rule_violations(inputs, layout, int(train), check_thresholds=False):
            continue
        peak = float(np.asarray(train_peak_bytes(inputs, layout, layout.dp(int(train)))))
        if inputs.budget.check_enabled and peak > inputs.cluster.gpu.memory_bytes:
            continue
        fits.append(int(train))
    out: list[Candidate] = []
    for tp in sorted(set(rollout_tps)):
        if rollout_rule_violation(inputs.model, tp, gpn) or kv_capacity_sequences(inputs, tp) < 1:
            continue
        out += [Candidate(t, total - t, layout, tp) for t in fits if (total - t) % tp == 0 and total - t >= tp]
    return out
