"""The measured cost of every pool change of a job, as the online re-planner reads it: one JSON object per
line in `<run_dir>/switch_costs.jsonl`, beside the event log.

A training resize writes a `train_resize` record when it finishes (GPU counts and layouts before and after,
`save_s`, `stop_s`, `start_s`, `load_s`, `switch_s`, the step) and a `train_resize_first_step` record once
the first optimizer step at the new layout has run (`first_step_s`); `read_switch_costs` joins the two by
`resize_id`. Writing never raises: a cost that cannot be written is logged, never what stops a job.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from libra.run_dir import append_jsonl, read_jsonl

log = logging.getLogger(__name__)

FILE_NAME = "switch_costs.jsonl"
RESIZE = "train_resize"
FIRST_STEP = "train_resize_first_step"


class SwitchCostLog:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._lock = threading.Lock()

    @classmethod
    def beside(cls, events_path: Path | None) -> SwitchCostLog:
        """The log next to an event log (none when the event log is in memory only)."""
        return cls(None if events_path is None else events_path.parent / FILE_NAME)

    def append(self, kind: str, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        with self._lock:
            try:
                append_jsonl(self.path, {"kind": kind, **record})
            except OSError as exc:
                log.error("cannot write switch cost log %s: %s", self.path, exc)


def read_switch_costs(path: Path) -> list[dict[str, Any]]:
    """Every training resize of the log, oldest first, with `first_step_s` joined in (None when no step
    followed it)."""
    if not path.exists():
        return []
    resizes: dict[str, dict[str, Any]] = {}
    first_steps: dict[str, Any] = {}
    for record in read_jsonl(path):
        key = str(record.get("resize_id", ""))
        if record.get("kind") == RESIZE:
            resizes[key] = record
        elif record.get("kind") == FIRST_STEP:
            first_steps[key] = record.get("first_step_s")
    return [{**r, "first_step_s": first_steps.get(key, r.get("first_step_s"))} for key, r in resizes.items()]
