"""Phase trace -> Chrome Trace Event JSON (opened by Perfetto and chrome://tracing), streamed.

Layout of the output: one process per role (or per host with `group_by="host"`), one thread per rank (and
per pid/thread of that rank when a rank had several), complete events ("X") for spans, thread instants for
instant records, global step markers, counter tracks ("C") for counter records, and flow arrows ("s"/"f")
from each flow source (weight_sync.publish) to every sink (weight_sync.reload / weight_sync.ack) sharing
its `attrs.flow_id`.

Timestamps are rebased to the earliest record start (stored as `otherData.origin_unix_ns`) and written as
exact decimal microseconds (`ns // 1000` "." `ns % 1000`), so no nanosecond is lost to float rounding.
(Only a record spelling its `start_ns` key with escapes could start before the origin; it would get a
negative `ts`, which is still valid JSON.)

Memory: records are read line by line and their events written out at once; only per-thread, per-step and
per-flow bookkeeping is kept, so memory does not grow with the number of spans. A first cheap pass finds the
time origin, parsing only lines that may hold an earlier start.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from libra.observability.trace_schema import (
    FLOW_SINKS,
    FLOW_SOURCES,
    FileStats,
    read_records,
    trace_files,
    validation_error,
)

_START_RE = re.compile(rb'"start_ns"\s*:\s*(-?\d+)')
_ROLE_ORDER = {"controller": 1, "train": 2, "rollout": 3}
_STEP_ANCHOR = "train.step"
_PREFIX_CACHE_MAX = 50_000


def _us(ns: int) -> str:
    """Exact decimal microseconds of a nanosecond count."""
    if ns < 0:
        return "-" + _us(-ns)
    return f"{ns // 1000}.{ns % 1000:03d}"


def _raise_type_error(value: Any) -> Any:
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _make_args_encoder() -> Callable[[Any], str]:
    """Strict compact JSON encoder. The C encoder object is built once: JSONEncoder.encode builds a new
    one on every call, which doubles the cost of a small object."""
    c_make_encoder = getattr(json.encoder, "c_make_encoder", None)
    if c_make_encoder is None:  # pure-Python json build
        return json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
    c_encode = c_make_encoder(None, _raise_type_error, json.encoder.encode_basestring_ascii,  # type: ignore[attr-defined]
                              None, ":", ",", False, False, False)
    return lambda value: "".join(c_encode(value, 0))


_encode_args = _make_args_encoder()


def find_origin(files: Sequence[Path]) -> int:
    """Earliest start_ns of any valid record. A regex pre-screens each line and only lines that might
    lower the minimum are parsed and validated, so this pass costs a fraction of a full parse."""
    origin: int | None = None
    for path in files:
        with open(path, "rb") as handle:
            for raw in handle:
                candidates = [int(m.group(1)) for m in _START_RE.finditer(raw)]
                if not candidates or (origin is not None and min(candidates) >= origin):
                    continue
                try:
                    obj = json.loads(raw)
                except (ValueError, RecursionError):
                    continue
                if validation_error(obj) is None and (origin is None or obj["start_ns"] < origin):
                    origin = obj["start_ns"]
    return 0 if origin is None else origin


@dataclass
class ConvertReport:
    output: str
    files: list[FileStats]
    events: int = 0
    spans: int = 0
    flows: int = 0
    unmatched_flow_sinks: int = 0
    origin_unix_ns: int = 0

    @property
    def skipped(self) -> int:
        return sum(f.skipped for f in self.files)

    def as_dict(self) -> dict[str, Any]:
        return {
            "output": self.output,
            "events": self.events,
            "spans": self.spans,
            "flows": self.flows,
            "unmatched_flow_sinks": self.unmatched_flow_sinks,
            "skipped_lines": self.skipped,
            "origin_unix_ns": self.origin_unix_ns,
            "files": [f.as_dict() for f in self.files],
        }


def _label(value: Any) -> Any:
    """An optional track field as a dict key: scalars as they are, anything else (a list or object a broken
    writer put there) as its JSON text."""
    if value is None or isinstance(value, (str, int, float)):
        return value
    return json.dumps(value, sort_keys=True, default=str)


@dataclass
class _Layout:
    """Process and thread ids, assigned as records arrive."""

    group_by: str
    processes: dict[str, int] = field(default_factory=dict)
    tracks: dict[tuple[str, int, Any, Any, Any], tuple[int, int]] = field(default_factory=dict)
    thread_info: dict[int, tuple[int, str, int, Any, Any]] = field(default_factory=dict)

    def pid(self, record: dict[str, Any]) -> int:
        role = record["role"]
        key = str(record.get("host") or "unknown-host") if self.group_by == "host" else role
        pid = self.processes.get(key)
        if pid is None:
            base = _ROLE_ORDER.get(key, 10) if self.group_by == "role" else 1
            pid = self.processes[key] = base * 1000 + len(self.processes)
        return pid

    def ids(self, record: dict[str, Any]) -> tuple[int, int]:
        """(pid, tid) of a record's track; a new track is numbered on first sight."""
        host = record.get("host") if self.group_by == "host" else None
        key = (record["role"], record["rank"], _label(record.get("pid")), _label(record.get("thread")), _label(host))
        found = self.tracks.get(key)
        if found is None:
            pid = self.pid(record)
            tid = len(self.tracks) + 1
            found = self.tracks[key] = (pid, tid)
            self.thread_info[tid] = (pid, key[0], key[1], key[2], key[3])
        return found

    def metadata(self) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for name, pid in self.processes.items():
            events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
            events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                           "args": {"sort_index": pid}})
        pids_per_rank: dict[int, set[Any]] = {}
        for _, _, rank, proc, _ in self.thread_info.values():
            pids_per_rank.setdefault(rank, set()).add(proc)
        for tid, (pid, role, rank, proc, thread) in self.thread_info.items():
            label = f"{role} rank {rank}"
            if len(pids_per_rank[rank]) > 1 and proc is not None:
                label += f" pid {proc}"
            if thread:
                label += f" {thread}"
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": label}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                           "args": {"sort_index": rank}})
        return events


def _flow_key(record: dict[str, Any]) -> tuple[str, str] | None:
    """('out'|'in', id) when the record is a flow endpoint."""
    attrs = record.get("attrs") or {}
    if "flow_out" in attrs:
        return "out", json.dumps(attrs["flow_out"], sort_keys=True)
    if "flow_in" in attrs:
        return "in", json.dumps(attrs["flow_in"], sort_keys=True)
    if "flow_id" in attrs:
        name = record["name"]
        if name in FLOW_SOURCES:
            return "out", json.dumps(attrs["flow_id"], sort_keys=True)
        if name in FLOW_SINKS:
            return "in", json.dumps(attrs["flow_id"], sort_keys=True)
    return None


def _event_prefix(kind: str, name: str, pid: int, tid: int) -> str:
    """The constant start of a record's event, up to and including '"ts":'."""
    name_json = json.dumps(name)
    if kind == "counter":  # counter tracks belong to a process
        return f'{{"ph":"C","name":{name_json},"pid":{pid},"ts":'
    cat = json.dumps(name.split(".", 1)[0])
    ph = '"ph":"X"' if kind == "span" else '"ph":"i","s":"t"'
    return f'{{{ph},"name":{name_json},"cat":{cat},"pid":{pid},"tid":{tid},"ts":'


class _Writer:
    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.count = 0

    def raw(self, event_json: str) -> None:
        self.out.write(",\n" if self.count else "\n")
        self.out.write(event_json)
        self.count += 1

    def event(self, event: dict[str, Any]) -> None:
        self.raw(json.dumps(event, separators=(",", ":")))


def _args_json(record: dict[str, Any]) -> str:
    step, rank, attrs = record["step"], record["rank"], record.get("attrs")
    if not attrs:
        return f'{{"step":{"null" if step is None else step},"rank":{rank}}}'
    args = {**attrs, "step": step, "rank": rank}
    try:
        return _encode_args(args)
    except ValueError:  # NaN or Infinity read from a lenient writer
        return _encode_args({k: v if isinstance(v, str | int | None) else str(v) for k, v in args.items()})


def _open_output(path: Path, use_gzip: bool) -> tuple[IO[str], str]:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    if use_gzip:
        return gzip.open(tmp, "wt", encoding="utf-8", compresslevel=6), tmp
    return open(tmp, "w", encoding="utf-8", buffering=1 << 20), tmp


def convert(
    trace_path: str | Path, output: str | Path, *, use_gzip: bool | None = None, group_by: str = "role"
) -> ConvertReport:
    """Convert the trace at `trace_path` (directory or file) into Chrome Trace JSON at `output`.
    The output appears atomically (written to a temporary file, then renamed)."""
    if group_by not in ("role", "host"):
        raise ValueError(f"group_by must be 'role' or 'host', got {group_by!r}")
    files = trace_files(trace_path)
    out_path = Path(output)
    if not out_path.parent.is_dir():
        raise FileNotFoundError(f"output directory {str(out_path.parent)!r} does not exist")
    gz = out_path.suffix == ".gz" if use_gzip is None else use_gzip
    origin = find_origin(files)
    report = ConvertReport(str(out_path), [FileStats(str(p)) for p in files], origin_unix_ns=origin)
    layout = _Layout(group_by)
    step_anchor: dict[int, int] = {}
    step_first: dict[int, int] = {}
    # flow endpoints: (start, binding ts, pid, tid); the binding ts is the middle of the record so the flow
    # event falls strictly inside its slice whatever order a viewer sorts equal timestamps in
    flow_sources: dict[str, list[tuple[int, int, int, int]]] = {}
    flow_sinks: dict[str, list[tuple[int, int, int, int]]] = {}

    handle, tmp_name = _open_output(out_path, gz)
    try:
        handle.write('{"displayTimeUnit":"ms","traceEvents":[')
        writer = _Writer(handle)
        prefixes: dict[tuple[int, str, str], str] = {}
        for path, stats in zip(files, report.files, strict=True):
            for rec in read_records(path, stats):
                pid, tid = layout.ids(rec)
                name, step = rec["name"], rec["step"]
                kind = rec.get("kind", "span")
                start = rec["start_ns"] - origin
                ts = f"{start // 1000}.{start % 1000:03d}" if start >= 0 else _us(start)
                prefix = prefixes.get((tid, name, kind))
                if prefix is None:
                    if len(prefixes) > _PREFIX_CACHE_MAX:
                        prefixes.clear()
                    prefix = prefixes[(tid, name, kind)] = _event_prefix(kind, name, pid, tid)
                if kind == "span":
                    dur = rec["end_ns"] - rec["start_ns"]
                    writer.raw(f'{prefix}{ts},"dur":{dur // 1000}.{dur % 1000:03d},"args":{_args_json(rec)}}}')
                    report.spans += 1
                elif kind == "instant":
                    writer.raw(f'{prefix}{ts},"args":{_args_json(rec)}}}')
                else:
                    values = {k: v for k, v in (rec.get("attrs") or {}).items()
                              if type(v) in (int, float) and math.isfinite(v)}
                    writer.raw(f'{prefix}{ts},"args":{_encode_args(values)}}}')
                    continue
                if step is not None:
                    if step not in step_first or start < step_first[step]:
                        step_first[step] = start
                    if name == _STEP_ANCHOR and (step not in step_anchor or start < step_anchor[step]):
                        step_anchor[step] = start
                if "attrs" in rec:
                    flow = _flow_key(rec)
                    if flow is not None:
                        table = flow_sources if flow[0] == "out" else flow_sinks
                        mid = start + (rec["end_ns"] - rec["start_ns"]) // 2
                        table.setdefault(flow[1], []).append((start, mid, pid, tid))

        for step, first in sorted(step_first.items()):
            marker_ns = step_anchor.get(step, first)
            writer.raw(f'{{"ph":"i","s":"g","name":"step {step}","cat":"step","pid":0,"tid":0,'
                       f'"ts":{_us(marker_ns)},"args":{{"step":{step}}}}}')
        flow_id = 0
        for key, sinks in flow_sinks.items():
            sources = sorted(flow_sources.get(key, []))
            if not sources:
                report.unmatched_flow_sinks += len(sinks)
                continue
            for sink_start, sink_ts, sink_pid, sink_tid in sinks:
                # link each sink to the latest source that started before it (a re-published version wins)
                earlier = [s for s in sources if s[0] <= sink_start]
                _, src_ts, src_pid, src_tid = earlier[-1] if earlier else sources[0]
                flow_id += 1
                writer.raw(f'{{"ph":"s","id":{flow_id},"name":"weight_sync","cat":"flow",'
                           f'"pid":{src_pid},"tid":{src_tid},"ts":{_us(src_ts)}}}')
                writer.raw(f'{{"ph":"f","bp":"e","id":{flow_id},"name":"weight_sync","cat":"flow",'
                           f'"pid":{sink_pid},"tid":{sink_tid},"ts":{_us(sink_ts)}}}')
        report.flows = flow_id
        for event in layout.metadata():
            writer.event(event)
        report.events = writer.count
        other = {"origin_unix_ns": origin, "schema": 1, "skipped_lines": report.skipped}
        handle.write(f'\n],"otherData":{json.dumps(other)}}}\n')
        handle.close()
        os.replace(tmp_name, out_path)
    except BaseException:
        handle.close()
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return report


def format_report(report: ConvertReport) -> str:
    lines = [f"wrote {report.output}: {report.spans} spans, {report.events} events, {report.flows} flow arrows"]
    for stats in report.files:
        if stats.skipped:
            why = ", ".join(f"{n} {reason}" for reason, n in stats.reasons.most_common())
            lines.append(f"  {stats.path}: skipped {stats.skipped} line(s) ({why}); kept {stats.records}")
    if report.skipped:
        lines.append(f"skipped {report.skipped} malformed or cut-off line(s) in total")
    if report.unmatched_flow_sinks:
        lines.append(f"{report.unmatched_flow_sinks} flow sink(s) had no matching source")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="trace directory (or run directory with traces/, or one .jsonl file)")
    parser.add_argument("-o", "--output", required=True, help="output Chrome Trace JSON file")
    parser.add_argument("--gzip", action="store_true", help="gzip the output (implied by a .gz name)")
    parser.add_argument("--group-by", choices=("role", "host"), default="role",
                        help="one process per role (default) or per host")
    parser.add_argument("--json", action="store_true", help="print the conversion report as JSON")


def run(args: argparse.Namespace) -> int:
    """Convert as asked by parsed arguments; exit 0, or 2 for a missing input or output directory."""
    try:
        report = convert(args.trace, args.output, use_gzip=True if args.gzip else None, group_by=args.group_by)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.as_dict(), indent=2) if args.json else format_report(report))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="phase_trace_to_chrome.py",
        description="Merge phase_trace_rank*.jsonl files into Chrome Trace JSON for Perfetto / chrome://tracing.",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
