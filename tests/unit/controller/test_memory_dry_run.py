"""The memory dry run compares a probe with the planner's estimate, records it and stops an over-budget job."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from libra.config import load
from libra.controller.memory_dry_run import MemoryBudgetExceeded, run_memory_dry_run
from planner.layout import TrainLayout

REPO = Path(__file__).resolve().parents[3]
GiB = 1024**3


class FakeProbingTrainPool:
    """Stands in for the training pool's `recompute_probe` (the real one runs Megatron-Core on Ray)."""

    def __init__(self, baseline: int, added: int) -> None:
        self.baseline, self.added = baseline, added
        self.calls: list[tuple[int, int]] = []

    def recompute_probe(self, seq_len: int, micro_batch_size: int = 0) -> dict[str, Any]:
        self.calls.append((seq_len, micro_batch_size))
        return {"peak_bytes": self.baseline + self.added, "baseline_bytes": self.baseline,
                "added_peak_bytes": self.added, "micro_batch_size": micro_batch_size, "seq_len": seq_len}


@pytest.mark.parametrize(
    ("baseline", "added", "fits"),
    [
        pytest.param(1_000_000, 2_000_000, True, id="small-probe-fits"),
        pytest.param(5 * GiB, 2_000_000, False, id="resident-state-over-capacity"),
    ],
)
def test_dry_run_records_and_enforces_the_budget(tmp_path: Path, baseline: int, added: int, fits: bool) -> None:
    cfg = load(str(REPO / "configs" / "dev.yaml"), ["global_resource_planner.memory_budget_dry_run_enabled=true"])
    pool = FakeProbingTrainPool(baseline, added)
    out = tmp_path / "memory_dry_run.json"
    if fits:
        comparison = run_memory_dry_run(cfg, pool, TrainLayout(), 2, out)
        assert comparison.measured_transient_bytes == added
        assert comparison.projected_peak_bytes <= comparison.capacity_bytes
    else:
        with pytest.raises(MemoryBudgetExceeded, match="projected peak"):
            run_memory_dry_run(cfg, pool, TrainLayout(), 2, out)
    assert pool.calls == [(cfg.max_model_len, cfg.recompute_micro_batch_size)]
    record = json.loads(out.read_text())
    assert record["probe"]["peak_bytes"] == baseline + added
    assert record["comparison"]["measured_transient_bytes"] == added
