"""Phase-trace schema v1: the record contract, the registered phase names, the rank numbering, and the
tolerant line reader every trace consumer (converter, summary, diff, plot) shares.

A trace is a directory of append-only JSON-lines files `phase_trace_rank{N}.jsonl` (a forked child of a
rank writes `phase_trace_rank{N}-pid{P}.jsonl`). Each line is one record:

    schema    int, always 1 for this version
    name      str, phase name (see PHASES; other names are allowed and reported as unregistered)
    role      str, "controller" | "train" | "rollout" (other roles are allowed)
    rank      int, unique in the run (see RANK_BASE)
    step      int or null
    start_ns  int, Unix epoch nanoseconds
    end_ns    int, Unix epoch nanoseconds, >= start_ns
    attrs     object, optional

Optional fields written by Libra's writer: `kind` ("span" | "instant" | "counter", default "span"),
`pid`, `host`, `thread`. Readers ignore fields they do not know.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
REQUIRED_FIELDS = ("schema", "name", "role", "rank", "step", "start_ns", "end_ns")
KINDS = ("span", "instant", "counter")
TRACE_FILE_GLOB = "phase_trace_rank*.jsonl"
TRACE_SUBDIR = "traces"

# Rank numbering: unique across the run without coordination between pools.
RANK_BASE = {"controller": 0, "train": 1000, "rollout": 2000}
RANK_BLOCK = 1000


def rank_for(role: str, index: int = 0) -> int:
    """Run-unique rank of the `index`-th member of `role` (controller 0, train 1000+r, rollout 2000+i)."""
    if role not in RANK_BASE:
        raise ValueError(
            f"phase trace role {role!r} has no rank block; use one of {sorted(RANK_BASE)} "
            "or pass an explicit rank to PhaseTracer.open"
        )
    if not 0 <= index < RANK_BLOCK:
        raise ValueError(f"phase trace index {index} for role {role!r} must be in [0, {RANK_BLOCK})")
    return RANK_BASE[role] + index


@dataclass(frozen=True)
class PhaseInfo:
    name: str
    description: str
    container: bool = False  # groups other phases; not counted as busy time in idle accounting


PHASES: dict[str, PhaseInfo] = {
    p.name: p
    for p in (
        PhaseInfo("controller.tick", "one reconcile tick of the control loop"),
        PhaseInfo("controller.step", "the controller's view of one RL step, end to end", container=True),
        PhaseInfo("rollout.generate", "generation of a batch of responses on one rollout instance"),
        PhaseInfo("rollout.reward", "reward computation for generated responses"),
        PhaseInfo("batch.collect", "waiting for and assembling the training batch"),
        PhaseInfo("train.recompute_logprobs", "recomputing old/reference log-probs before the update"),
        PhaseInfo("train.forward_backward", "forward and backward passes of one step"),
        PhaseInfo("train.optimizer", "optimizer step (including gradient reduction and clipping)"),
        PhaseInfo("train.step", "one whole training step on a training rank", container=True),
        PhaseInfo("weight_sync.export", "a training rank writes its weights for the rollout side (HF format)"),
        PhaseInfo("weight_sync.publish", "the publisher hands a weight version to the rollout pool (flow source)"),
        PhaseInfo("weight_sync.reload", "a rollout instance loads a published weight version (flow sink)"),
        PhaseInfo("weight_sync.ack", "a rollout instance acknowledges a weight version (flow sink)"),
        PhaseInfo("reconfigure.plan", "planning a new split or layout"),
        PhaseInfo("reconfigure.drain", "draining in-flight work from pool members being changed"),
        PhaseInfo("reconfigure.stop", "stopping pool members"),
        PhaseInfo("reconfigure.start", "starting pool members"),
        PhaseInfo("reconfigure.swap", "switching traffic or roles to the new members"),
        PhaseInfo("reconfigure.change", "one whole reconfiguration, from its request to done", container=True),
        PhaseInfo("ehp.borrow", "one borrow of rollout GPUs by a training step, lend to give-back", container=True),
        PhaseInfo("ehp.lend", "rollout instances leave serving (drained, asleep) to lend their GPUs"),
        PhaseInfo("ehp.attach", "starting the borrowed training replicas on the lent GPUs"),
        PhaseInfo("ehp.step", "the training step shared with the borrowed replicas", container=True),
        PhaseInfo("ehp.detach", "stopping the borrowed training replicas"),
        PhaseInfo("ehp.return", "lent instances woken, brought to the current weights and serving again"),
        PhaseInfo("replan.decide", "one online re-planning decision: calibrate, search, request or keep"),
        PhaseInfo("checkpoint.save", "saving a checkpoint"),
        PhaseInfo("checkpoint.load", "loading a checkpoint"),
        PhaseInfo("eval", "an evaluation pass"),
    )
}

# Counter tracks (kind "counter"; attrs hold one number per series).
COUNTERS: dict[str, str] = {
    "pool.gpus": "GPUs assigned to each pool (series: pool name)",
    "queue.depth": "requests or samples waiting (series: queue name)",
}

# Flow arrows: a source record and every sink record sharing attrs.flow_id are linked.
FLOW_SOURCES = frozenset({"weight_sync.publish"})
FLOW_SINKS = frozenset({"weight_sync.reload", "weight_sync.ack"})


def is_registered(name: str) -> bool:
    return name in PHASES or name in COUNTERS


def is_container(name: str) -> bool:
    info = PHASES.get(name)
    return info is not None and info.container


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_KIND_SET = frozenset(KINDS)


def validation_error(obj: Any) -> str | None:
    """Why `obj` is not a valid v1 record, or None when it is."""
    if type(obj) is dict:  # fast path for what json.loads returns; any doubt goes to the full check
        try:
            name, role, step, start, end = obj["name"], obj["role"], obj["step"], obj["start_ns"], obj["end_ns"]
            if (
                type(obj["schema"]) is int and obj["schema"] == SCHEMA_VERSION
                and type(name) is str and name and type(role) is str and role
                and type(obj["rank"]) is int and (step is None or type(step) is int)
                and type(start) is int and type(end) is int and end >= start
                and type(obj.get("attrs", {})) is dict and obj.get("kind", "span") in _KIND_SET
            ):
                return None
        except (KeyError, TypeError):
            pass
    return _full_validation_error(obj)


def _full_validation_error(obj: Any) -> str | None:
    if not isinstance(obj, dict):
        return "not a JSON object"
    schema = obj.get("schema")
    if schema != SCHEMA_VERSION or not _is_int(schema):
        return f"unsupported schema {schema!r}" if "schema" in obj else "missing field 'schema'"
    for key in REQUIRED_FIELDS:
        if key not in obj:
            return f"missing field {key!r}"
    name, role = obj["name"], obj["role"]
    if not isinstance(name, str) or not name:
        return "'name' must be a non-empty string"
    if not isinstance(role, str) or not role:
        return "'role' must be a non-empty string"
    if not _is_int(obj["rank"]):
        return "'rank' must be an integer"
    step = obj["step"]
    if step is not None and not _is_int(step):
        return "'step' must be an integer or null"
    start, end = obj["start_ns"], obj["end_ns"]
    if not _is_int(start) or not _is_int(end):
        return "'start_ns' and 'end_ns' must be integers"
    if end < start:
        return "'end_ns' is before 'start_ns'"
    attrs = obj.get("attrs")
    if attrs is not None and not isinstance(attrs, dict):
        return "'attrs' must be an object"
    kind = obj.get("kind", "span")
    if kind not in KINDS:
        return f"unknown kind {kind!r}"
    return None


def trace_files(path: str | Path) -> list[Path]:
    """The trace files under `path`: a trace file, a trace directory, or a run directory with `traces/`."""
    root = Path(path)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise FileNotFoundError(f"trace path {str(root)!r} does not exist")
    files = sorted(root.glob(TRACE_FILE_GLOB))
    if not files and (root / TRACE_SUBDIR).is_dir():
        files = sorted((root / TRACE_SUBDIR).glob(TRACE_FILE_GLOB))
    if not files:
        raise FileNotFoundError(
            f"no {TRACE_FILE_GLOB} files in {str(root)!r} or {str(root / TRACE_SUBDIR)!r}; "
            "enable tracing with phase_trace_enabled: true or RL_TRAIN_PHASE_TRACE=1"
        )
    return files


@dataclass
class FileStats:
    """What reading one file kept and skipped."""

    path: str
    records: int = 0
    skipped: int = 0
    cut_off: bool = False  # the last line had no newline and did not parse
    reasons: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "records": self.records,
            "skipped": self.skipped,
            "cut_off": self.cut_off,
            "reasons": dict(self.reasons),
        }


_raw_decode = json.JSONDecoder().raw_decode


def _parse_line(line: str) -> Any:
    try:
        obj, end = _raw_decode(line)  # skips json.loads' per-call type and whitespace handling
        if end == len(line) or not line[end:].strip():
            return obj
    except ValueError:
        pass
    return json.loads(line)  # leading whitespace, or raises for a malformed line


def read_records(path: Path, stats: FileStats) -> Iterator[dict[str, Any]]:
    """Valid records of one file, line by line; invalid, malformed and cut-off lines are counted in
    `stats` and skipped. Bytes that are not UTF-8 become U+FFFD. Memory is bounded by the longest line."""
    with open(path, encoding="utf-8", errors="replace", newline="\n") as handle:
        for line in handle:
            if not line.strip():
                continue
            try:
                obj = _parse_line(line)
            except (ValueError, RecursionError):
                stats.skipped += 1
                if not line.endswith("\n"):
                    stats.cut_off = True
                    stats.reasons["cut-off last line"] += 1
                else:
                    stats.reasons["not valid JSON"] += 1
                continue
            reason = validation_error(obj)
            if reason is not None:
                stats.skipped += 1
                stats.reasons[reason] += 1
                continue
            stats.records += 1
            yield obj


def iter_trace(path: str | Path) -> tuple[list[FileStats], Iterator[dict[str, Any]]]:
    """All valid records of a trace (file by file) and the per-file statistics, filled while iterating."""
    files = trace_files(path)
    stats = [FileStats(str(p)) for p in files]

    def records() -> Iterator[dict[str, Any]]:
        for file_path, file_stats in zip(files, stats, strict=True):
            yield from read_records(file_path, file_stats)

    return stats, records()
