"""The re-planner's memory across controller restarts: `replan_state.json` in the run directory.

Written whole after every re-planning decision (and when a reconfiguration reports its seconds), read when the
re-planner starts. A controller that was killed, restarted on the run directory or resumed from a checkpoint
goes on reviewing the change it made before (and undoes it if it did not deliver), keeps what the model
over-predicted (`planner.replan_review`), the seconds the last rollout switch took and the last step that ran
while the pools changed. Without it, a restarted controller would judge the change as if it had started on
it and could make again a change it had undone.

A file that cannot be read is not trusted: the re-planner starts without it and says so (a
`replan_state_unreadable` event naming the file and what is wrong), and the file is kept beside as
`replan_state.json.unreadable` for a look; the memory only makes the re-planner more careful, so nothing else
is stopped for it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from libra.run_dir import write_json_atomic
from planner.replan_review import OnlineReplanning, number_field
from planner.workload import PlannerInputs

FILE_NAME = "replan_state.json"
VERSION = 1

log = logging.getLogger(__name__)


@dataclass
class ReplanMemory:
    """What one decision leaves for the next, also across a restart."""

    online: OnlineReplanning
    rollout_switch_s: float | None = None  # seconds the last rollout reconfiguration took (None: none measured)
    settled_after: int = 0  # steps up to this one ran while the pools were changing

    def to_dict(self) -> dict[str, Any]:
        return {"version": VERSION, "online": self.online.to_dict(), "rollout_switch_s": self.rollout_switch_s,
                "settled_after": self.settled_after}


def beside(events_path: Path | None) -> Path | None:
    """The memory file of the run whose event log is `events_path` (None: no run directory)."""
    return None if events_path is None else events_path.parent / FILE_NAME


def load(path: Path, inputs: PlannerInputs) -> ReplanMemory:
    """The memory in `path` on the job's `inputs`; a fresh one when there is no file; ValueError naming what
    is wrong otherwise."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return ReplanMemory(OnlineReplanning(inputs))
    except OSError as exc:
        raise ValueError(f"cannot read it: {exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"not an object: {type(data).__name__}")
    if data.get("version") != VERSION:
        raise ValueError(f"version {data.get('version')!r}, this Libra reads version {VERSION}")
    switch = None if data.get("rollout_switch_s") is None else number_field(data, "rollout_switch_s")
    settled = number_field(data, "settled_after", kind=int) if "settled_after" in data else 0
    return ReplanMemory(OnlineReplanning.from_dict(inputs, data.get("online")), switch, settled)


def set_aside(path: Path) -> Path | None:
    """Move an unreadable memory file out of the way, kept for a look; where it went (None: it could not be
    moved, or there was none)."""
    aside = path.with_name(path.name + ".unreadable")
    try:
        path.replace(aside)
    except OSError as exc:
        log.warning("cannot set the unreadable re-planner memory %s aside: %s", path, exc)
        return None
    return aside


def save(path: Path, memory: ReplanMemory) -> None:
    """Replace `path` with `memory`, whole; a failure is logged, never raised into the job."""
    try:
        write_json_atomic(path, memory.to_dict())
    except OSError as exc:
        log.error("cannot write the re-planner's memory %s: %s", path, exc)
