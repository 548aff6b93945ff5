"""The memory-budget dry run: one real log-prob recomputation on the training pool before the first step,
compared with the planner's estimate (`global_resource_planner.memory_budget_dry_run_enabled`).

The probe runs at recompute_micro_batch_size x max_model_len on every rank (the pool reports the largest
peak); the comparison and its projection come from `libra.planning.compare_recompute_probe`. The result is
written to `memory_dry_run.json` in the run directory and logged as an event. A projected peak that does not
fit the GPU stops the job before training starts, with the planner's advice.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from libra.config import Config
from libra.planning import ProbeComparison, RecomputeProbe, compare_recompute_probe, planner_inputs
from planner.layout import TrainLayout


class MemoryBudgetExceeded(RuntimeError):
    """The recompute probe projects a peak above the training GPU's memory."""


def run_memory_dry_run(cfg: Config, train_pool: Any, layout: TrainLayout, train_gpus: int,
                       out_file: Path) -> ProbeComparison:
    """Probe, compare, record; raise `MemoryBudgetExceeded` when the projected peak does not fit."""
    seq_len = cfg.max_model_len
    measured = train_pool.recompute_probe(seq_len, cfg.recompute_micro_batch_size)
    probe = RecomputeProbe(resident_bytes=int(measured["baseline_bytes"]), peak_bytes=int(measured["peak_bytes"]),
                           micro_batch=int(measured.get("micro_batch_size", cfg.recompute_micro_batch_size)),
                           seq_len=int(measured.get("seq_len", seq_len)))
    dp = max(1, train_gpus // layout.model_parallel)
    comparison = compare_recompute_probe(planner_inputs(cfg), layout, dp, probe)
    out_file.write_text(json.dumps({"probe": dataclasses.asdict(probe),
                                    "comparison": dataclasses.asdict(comparison)}, indent=2) + "\n")
    if comparison.projected_peak_bytes > comparison.capacity_bytes:
        raise MemoryBudgetExceeded(f"memory dry run: {comparison.message}")
    return comparison
