"""The live console view of a running job: progress over the steps, the latest figures, the pools and the
last controller events.

`rich` draws a live panel on a terminal; `plain` prints one line per step (also used when stdout is not a
terminal, e.g. in CI logs); `off` prints nothing. Drawing never raises into the training loop.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

log = logging.getLogger(__name__)


class ConsoleView(Protocol):
    def start(self, total_steps: int, start_step: int, title: str) -> None: ...
    def status(self, message: str) -> None: ...
    def update(self, row: Mapping[str, Any], pools: Mapping[str, str], events: Sequence[Mapping[str, Any]]) -> None: ...
    def stop(self) -> None: ...


def step_line(row: Mapping[str, Any], total_steps: int) -> str:
    """One line summarising a metrics row (the plain view, and the status command)."""
    parts = [f"step {row.get('step', '?')}/{total_steps}", f"reward {row.get('reward_mean', 0.0):.3f}"]
    if "eval_accuracy" in row:
        parts.append(f"eval {row['eval_accuracy']:.3f}")
    if "time_step_s" in row:
        parts.append(f"{row['time_step_s']:.2f}s/step")
    if "rollout_tokens_per_s" in row:
        parts.append(f"rollout {row['rollout_tokens_per_s']:.0f} tok/s")
    if "policy_lag_max" in row:
        parts.append(f"lag {int(row['policy_lag_max'])}")
    if row.get("discarded_samples"):
        parts.append(f"discarded {int(row['discarded_samples'])}")
    return "  ".join(parts)


class NullConsole:
    def start(self, total_steps: int, start_step: int, title: str) -> None:
        pass

    def status(self, message: str) -> None:
        pass

    def update(self, row: Mapping[str, Any], pools: Mapping[str, str], events: Sequence[Mapping[str, Any]]) -> None:
        pass

    def stop(self) -> None:
        pass


class PlainConsole:
    def __init__(self, stream: Any = None) -> None:
        self.stream = stream or sys.stdout
        self.total_steps = 0

    def _print(self, text: str) -> None:
        try:
            print(text, file=self.stream, flush=True)
        except (OSError, ValueError):
            pass

    def start(self, total_steps: int, start_step: int, title: str) -> None:
        self.total_steps = total_steps
        self._print(f"{title}: steps {start_step}..{total_steps}")

    def status(self, message: str) -> None:
        self._print(message)

    def update(self, row: Mapping[str, Any], pools: Mapping[str, str], events: Sequence[Mapping[str, Any]]) -> None:
        pool_text = "  ".join(f"{name} {text}" for name, text in pools.items())
        self._print(f"{step_line(row, self.total_steps)}  |  {pool_text}")

    def stop(self) -> None:
        pass


class RichConsole:
    """A live panel redrawn a few times a second by rich."""

    def __init__(self) -> None:
        from rich.console import Console

        self.console = Console()
        self._lock = threading.Lock()
        self._live: Any = None
        self._progress: Any = None
        self._task: Any = None
        self._row: Mapping[str, Any] = {}
        self._pools: Mapping[str, str] = {}
        self._events: Sequence[Mapping[str, Any]] = ()
        self._status = "starting"
        self._title = ""
        self._started = time.monotonic()

    def start(self, total_steps: int, start_step: int, title: str) -> None:
        from rich.live import Live
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._title = title
        self._progress = Progress(
            TextColumn("[bold]steps"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), expand=False
        )
        self._task = self._progress.add_task("steps", total=total_steps, completed=start_step)
        self._live = Live(self._render(), console=self.console, refresh_per_second=4, transient=False)
        self._live.start()

    def _render(self) -> Any:
        from rich.console import Group
        from rich.panel import Panel
        from rich.table import Table

        figures = Table.grid(padding=(0, 2))
        figures.add_column(style="dim")
        figures.add_column()
        row = self._row
        if row:
            figures.add_row("reward", f"{row.get('reward_mean', 0.0):.3f}")
            if "eval_accuracy" in row:
                figures.add_row("eval accuracy", f"{row['eval_accuracy']:.3f}")
            figures.add_row("step time", f"{row.get('time_step_s', 0.0):.2f} s")
            figures.add_row("rollout", f"{row.get('rollout_tokens_per_s', 0.0):.0f} tok/s")
            figures.add_row("policy lag", f"{int(row.get('policy_lag_max', 0))} (discarded "
                            f"{int(row.get('discarded_samples_total', 0))})")
        for name, text in self._pools.items():
            figures.add_row(f"{name} pool", text)
        figures.add_row("status", self._status)
        events = Table.grid()
        for event in list(self._events)[-5:]:
            when = time.strftime("%H:%M:%S", time.localtime(float(event.get("ts", 0))))
            text = event.get("message") or " ".join(
                f"{k}={v}" for k, v in event.items() if k not in ("ts", "kind", "history", "info")
            )
            events.add_row(f"[dim]{when}[/dim] {event.get('kind')}: {str(text)[:100]}")
        return Panel(Group(self._progress, figures, events), title=self._title, expand=False)

    def _refresh(self) -> None:
        if self._live is not None:
            self._live.update(self._render())

    def status(self, message: str) -> None:
        with self._lock:
            self._status = message
            try:
                self._refresh()
            except Exception:  # drawing must never break the job
                log.debug("console refresh failed", exc_info=True)

    def update(self, row: Mapping[str, Any], pools: Mapping[str, str], events: Sequence[Mapping[str, Any]]) -> None:
        with self._lock:
            self._row, self._pools, self._events = row, pools, events
            self._status = "training"
            try:
                if self._progress is not None:
                    self._progress.update(self._task, completed=int(row.get("step", 0)))
                self._refresh()
            except Exception:
                log.debug("console refresh failed", exc_info=True)

    def stop(self) -> None:
        with self._lock:
            if self._live is not None:
                try:
                    self._refresh()
                    self._live.stop()
                except Exception:
                    log.debug("console stop failed", exc_info=True)
                self._live = None


def make_console(mode: str, stream: Any = None) -> ConsoleView:
    """The view for `tracking.console` (rich falls back to plain when stdout is not a terminal)."""
    if mode == "off":
        return NullConsole()
    if mode == "rich" and (stream or sys.stdout).isatty():
        return RichConsole()
    return PlainConsole(stream)
