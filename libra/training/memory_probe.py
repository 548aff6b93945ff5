"""Peak memory of a piece of work on this worker's device.

CUDA: the allocator's peak (`torch.cuda.max_memory_allocated`) around the call. CPU: torch's `MemTracker`,
which follows the live tensor storages created during the call (CPU has no allocator statistics). Both
report the peak of live bytes during the call and the bytes already live before it, so `added_peak_bytes` is
what the work itself needs on top of the resident model state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from libra.device import cuda_available


def measure_peak(fn: Callable[[], Any], modules: list[torch.nn.Module] | None = None) -> dict[str, int]:
    """Run `fn` once and return {"peak_bytes", "baseline_bytes", "added_peak_bytes"}."""
    if cuda_available():
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        return {"peak_bytes": int(peak), "baseline_bytes": int(baseline), "added_peak_bytes": int(peak - baseline)}
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    if modules:
        tracker.track_external(*modules)
    with tracker:
        baseline = _total(tracker.get_tracker_snapshot("current"))
        fn()
    peak = _total(tracker.get_tracker_snapshot("peak"))
    return {"peak_bytes": peak, "baseline_bytes": baseline, "added_peak_bytes": max(0, peak - baseline)}


def _total(snapshot: dict[Any, dict[Any, int]]) -> int:
    total = 0
    for per_device in snapshot.values():
        total += int(per_device.get("Total", 0))
    return total
