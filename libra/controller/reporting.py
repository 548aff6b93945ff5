"""Where a step's figures go: `metrics.jsonl`, `status.json` (what `libra status` reads), the Prometheus
exporter, the live console and, every `curve_interval_s` seconds, the learning-curve picture. Drawing it
takes a few hundred milliseconds (a second the first time, with matplotlib's import), so it is paced by time
and drawn on a background thread; the last picture is drawn in the foreground when the run finishes.

Reporting never stops training: a failing sink is logged and skipped. Metric rows are the exception to
skipping: a row that cannot be appended to `metrics.jsonl` (a full disk) is held in memory, with every row
after it, and written in order with the next row once there is room (`rows_pending`); the RL loop completes
no checkpoint while a row is held, so a checkpoint never holds a step whose row is not on disk. `status.json`
is rewritten whole from memory at every change, so one that cannot be written is current again at the next
write that can. Each sink that cannot be written says so once per spell of failed writes (and once more when
it is written again), not at every step.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

from libra.controller.curve import plot_learning_curve
from libra.controller.events import EventLog
from libra.observability.console import ConsoleView
from libra.observability.metrics import ROLLOUT_FAILURES, TICK_ERRORS, TOTAL_STEPS, LibraMetrics
from libra.run_dir import RunDir, append_jsonl, read_json, write_json_atomic

log = logging.getLogger(__name__)


class Reporter:
    def __init__(self, run: RunDir, name: str, total_steps: int, console: ConsoleView, events: EventLog,
                 metrics: LibraMetrics | None, write_jsonl: bool = True, curve_interval_s: float = 120.0) -> None:
        self.run = run
        self.name = name
        self.total_steps = total_steps
        self.console = console
        self.events = events
        self.metrics = metrics
        self.write_jsonl = write_jsonl
        self.curve_interval_s = curve_interval_s
        self.last_row: dict[str, Any] = {}
        self._pending_rows: list[dict[str, Any]] = []  # rows not yet in metrics.jsonl, oldest first
        self._failing: set[str] = set()  # the files whose last write failed (warned once per spell)
        self._status: dict[str, Any] = {}
        self._last_curve = time.monotonic()
        self._curve_thread: threading.Thread | None = None

    def start(self, start_step: int, state: str = "starting") -> None:
        self._status = {
            "name": self.name,
            "run_dir": str(self.run.root),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started_at": time.time(),
            "total_steps": self.total_steps,
            "step": start_step,
        }
        previous = read_json(self.run.status_json) or {}
        if "last_row" in previous:
            self._status["last_row"] = previous["last_row"]
        self.set_state(state)
        if self.metrics is not None:
            self.metrics.get(TOTAL_STEPS).set(self.total_steps)
        self.console.start(self.total_steps, start_step, f"libra {self.name}")

    def set_state(self, state: str, **fields: Any) -> None:
        self._status.update(fields)
        self._status["state"] = state
        self._status["updated_at"] = time.time()
        self._write_status()
        self.console.status(state if not fields.get("message") else f"{state}: {fields['message']}")

    def _write_status(self) -> None:
        try:
            write_json_atomic(self.run.status_json, self._status)
        except OSError as exc:
            self._failed("status", "cannot write %s (%s); it is written again, current, once there is room",
                         self.run.status_json, exc)
        else:
            self._written_again("status", "%s is written again", self.run.status_json)

    def _failed(self, sink: str, message: str, *args: Any) -> None:
        """A write to `sink` failed: warn unless the last one had failed too."""
        if sink not in self._failing:
            self._failing.add(sink)
            log.warning(message, *args)

    def _written_again(self, sink: str, message: str, *args: Any) -> None:
        if sink in self._failing:
            self._failing.discard(sink)
            log.info(message, *args)

    def pools(self, pools: Mapping[str, Any]) -> None:
        """Current pool picture (desired sizes, member states, GPUs) for status.json and Prometheus."""
        self._status["pools"] = dict(pools)  # written with the next state change or step
        if self.metrics is not None:
            try:
                self.metrics.set_pools(
                    {name: int(p.get("gpus", 0)) for name, p in pools.items()},
                    {name: dict(p.get("members", {})) for name, p in pools.items()},
                )
            except Exception:
                log.debug("prometheus pool update failed", exc_info=True)

    def step(self, row: dict[str, Any], pool_text: Mapping[str, str], queue: Mapping[str, int],
             counters: Mapping[str, float]) -> None:
        self.last_row = row
        if self.write_jsonl:
            self._pending_rows.append(row)
            self.flush_rows()
        self._status.update(step=row["step"], last_row=row, state="running", updated_at=time.time())
        self._write_status()
        if self.metrics is not None:
            try:
                self.metrics.record_step(row)
                self.metrics.set_queue(queue)
                self.metrics.raise_counter(TICK_ERRORS, counters.get("tick_errors", 0))
                self.metrics.raise_counter(ROLLOUT_FAILURES, counters.get("rollout_failures", 0))
            except Exception:
                log.debug("prometheus update failed", exc_info=True)
        self.console.update(row, pool_text, self.events.recent(5))
        if time.monotonic() - self._last_curve >= self.curve_interval_s and not self.drawing_curve:
            self._last_curve = time.monotonic()
            self._curve_thread = threading.Thread(target=self._draw_curve, name="libra-curve", daemon=True)
            self._curve_thread.start()

    @property
    def rows_pending(self) -> int:
        """Metric rows held in memory because `metrics.jsonl` could not be appended to."""
        return len(self._pending_rows)

    def flush_rows(self) -> bool:
        """Append the held rows to `metrics.jsonl`, oldest first, up to the first that cannot be written; True
        when none is left."""
        held = len(self._pending_rows)
        while self._pending_rows:
            try:
                append_jsonl(self.run.metrics_jsonl, self._pending_rows[0])
            except OSError as exc:
                self._failed("metrics", "cannot append to %s (%s); its rows are held in memory and written once "
                             "there is room (free space on that file system)", self.run.metrics_jsonl, exc)
                return False
            self._pending_rows.pop(0)
        self._written_again("metrics", "wrote %d held metric row(s) to %s", held, self.run.metrics_jsonl)
        return True

    def drop_rows_after(self, step: int) -> None:
        """Forget held rows of steps after `step` (the run goes back to that step's checkpoint)."""
        self._pending_rows = [r for r in self._pending_rows if int(r.get("step", 0)) <= step]

    @property
    def drawing_curve(self) -> bool:
        return self._curve_thread is not None and self._curve_thread.is_alive()

    def curve(self) -> None:
        """Draw the learning curve now (after any drawing in progress)."""
        if self._curve_thread is not None:
            self._curve_thread.join()
            self._curve_thread = None
        self._last_curve = time.monotonic()
        self._draw_curve()

    def _draw_curve(self) -> None:
        try:
            plot_learning_curve(self.run.read_metrics(), self.run.learning_curve_png, title=self.name)
        except Exception as exc:
            log.warning("cannot draw the learning curve: %s", exc)

    def finish(self, outcome: str, **fields: Any) -> None:
        if not self.flush_rows():
            log.warning("%d metric row(s) could not be written to %s before the run ended: the steps after "
                        "the newest checkpoint are trained again by the next launch", self.rows_pending,
                        self.run.metrics_jsonl)
        self.curve()
        self.set_state(outcome, finished_at=time.time(), **fields)
        self.console.stop()
