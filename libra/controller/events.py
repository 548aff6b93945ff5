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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from libra.run_dir import append_jsonl, read_jsonl

log = logging.getLogger("libra.events")

_WARNING_KINDS = frozenset({"action_error", "tick_error", "member_failed", "batch_timeout", "error", "node_fenced",
                            "ehp_held_back"})


class EventLog:
    def __init__(self, path: Path | None, keep: int = 50) -> None:
        self.path = path
        self.write_errors = 0
        self._recent: deque[dict[str, Any]] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self._listeners: list[Callable[[dict[str, Any]], None]] = []

    def subscribe(self, listener: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
        """Call `listener` with every event from now on (it must not block); returns the unsubscribe."""
        with self._lock:
            self._listeners.append(listener)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return unsubscribe

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
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(event)
            except Exception:  # a listener (metrics, an API stream) never stops the event log
                log.debug("event listener failed", exc_info=True)
        return event

    def recent(self, count: int = 10) -> list[dict[str, Any]]:
        with self._lock:
            items = list(self._recent)
        return items[-count:]


def started_generations(path: Path, pool: str) -> dict[str, int]:
    """The desired-state generation each member of `pool` was started for, by member id, as earlier
    controllers of this run recorded it (`member_added`; the latest event of an id wins). A restarted
    controller gives these back to the instances it adopts, so `restart_all` knows which of them already
    belong to the change in progress."""
    generations: dict[str, int] = {}
    for event in read_jsonl(path):
        if event.get("kind") == "member_added" and event.get("pool") == pool and "member" in event:
            generations[str(event["member"])] = int(event.get("generation") or 0)
    return generations
