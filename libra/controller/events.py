"""The controller's event log: one JSON object per line in `<run_dir>/events.jsonl`, mirrored to the
Python log and kept in memory (the last few) for the console view.

Each event has `ts` (Unix seconds), `kind` (e.g. `transition`, `action`, `action_error`, `tick_error`,
`step`, `checkpoint`, `weight_sync`, `shutdown`) and free fields. Writing never raises: a failed write
is logged and counted, because the event log must not be what stops a job.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from libra.run_dir import append_jsonl

log = logging.getLogger("libra.events")

_WARNING_KINDS = frozenset({"action_error", "tick_error", "member_failed", "batch_timeout", "error"})


class EventLog:
    def __init__(self, path: Path | None, keep: int = 50) -> None:
        self.path = path
        self.write_errors = 0
        self._recent: deque[dict[str, Any]] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def emit(self, kind: str, message: str = "", **fields: Any) -> dict[str, Any]:
        event: dict[str, Any] = {"ts": round(time.time(), 3), "kind": kind}
        if message:
            event["message"] = message
        event.update(fields)
        level = logging.WARNING if kind in _WARNING_KINDS else logging.INFO
        log.log(level, "%s %s %s", kind, message, {k: v for k, v in fields.items() if k != "history"})
        with self._lock:
            self._recent.append(event)
            if self.path is not None:
                try:
                    append_jsonl(self.path, event)
                except OSError as exc:
                    self.write_errors += 1
                    log.error("cannot write event log %s: %s", self.path, exc)
        return event

    def recent(self, count: int = 10) -> list[dict[str, Any]]:
        with self._lock:
            items = list(self._recent)
        return items[-count:]
