"""Chrome Trace conversion of independently written traces: every valid span kept with exact timing,
bad lines skipped and reported, flows, counters, step markers, gzip, bounded memory."""

from __future__ import annotations

import gzip
import json
import threading
import tracemalloc
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from trace_fixtures import T0, SyntheticTrace, build_run

from libra.observability import phase_trace, trace_convert


def load(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:  # type: ignore[operator]
        return json.load(handle, parse_float=Decimal)


def by_phase(events: list[dict[str, Any]], ph: str) -> list[dict[str, Any]]:
    return [e for e in events if e["ph"] == ph]


@pytest.fixture
def converted(synthetic_trace: SyntheticTrace, tmp_path: Path) -> tuple[SyntheticTrace, dict, Any]:
    report = trace_convert.convert(synthetic_trace.directory, tmp_path / "trace.json")
    return synthetic_trace, load(tmp_path / "trace.json"), report


def test_every_valid_span_is_kept_with_exact_timing(converted: tuple) -> None:
    trace, doc, report = converted
    origin = doc["otherData"]["origin_unix_ns"]
    assert origin == min(r["start_ns"] for r in trace.records) == T0
    events = doc["traceEvents"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    got = {(e["name"], e["args"]["rank"], e["args"]["step"]): e for e in by_phase(events, "X")}
    spans = trace.spans()
    assert len(by_phase(events, "X")) == len(spans) == report.spans
    for span in spans:
        event = got[(span["name"], span["rank"], span["step"])]
        assert event["ts"] == Decimal(span["start_ns"] - origin) / 1000
        assert event["dur"] == Decimal(span["end_ns"] - span["start_ns"]) / 1000
        assert threads[(event["pid"], event["tid"])] == f"{span['role']} rank {span['rank']}"
        assert {k: v for k, v in event["args"].items() if k not in ("step", "rank")} == span.get("attrs", {})


def test_bad_lines_are_skipped_and_reported_per_file(converted: tuple) -> None:
    trace, doc, report = converted
    skipped = {Path(f.path).name: f.skipped for f in report.files}
    assert skipped == {name: trace.bad_lines.get(name, 0) for name in skipped}
    assert {Path(f.path).name for f in report.files if f.cut_off} == trace.cut_off_files
    assert doc["otherData"]["skipped_lines"] == sum(trace.bad_lines.values()) == report.skipped
    text = trace_convert.format_report(report)
    assert "phase_trace_rank1000.jsonl: skipped 7 line(s)" in text and "cut-off last line" in text


def test_processes_per_role_and_sorted_threads(converted: tuple) -> None:
    _, doc, _ = converted
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "process_name"}
    assert sorted(names.values()) == ["controller", "rollout", "train"]
    by_name = {v: k for k, v in names.items()}
    assert by_name["controller"] < by_name["train"] < by_name["rollout"]


def test_flow_arrows_link_publish_to_each_reload(converted: tuple) -> None:
    trace, doc, report = converted
    events = doc["traceEvents"]
    starts = {e["id"]: e for e in by_phase(events, "s")}
    finishes = {e["id"]: e for e in by_phase(events, "f")}
    assert starts.keys() == finishes.keys() and report.flows == len(starts) == 3 * 2
    slices = by_phase(events, "X")

    def enclosing(flow_event: dict[str, Any]) -> dict[str, Any]:
        """The one slice on the flow event's track that strictly contains its timestamp."""
        (found,) = [x for x in slices if (x["pid"], x["tid"]) == (flow_event["pid"], flow_event["tid"])
                    and x["ts"] < flow_event["ts"] < x["ts"] + x["dur"]]
        return found

    for flow_id, finish in finishes.items():
        source, sink = enclosing(starts[flow_id]), enclosing(finish)
        assert finish["bp"] == "e"
        assert (source["name"], sink["name"]) == ("weight_sync.publish", "weight_sync.reload")
        assert source["args"]["flow_id"] == sink["args"]["flow_id"]
    assert report.unmatched_flow_sinks == 0


def test_counter_tracks_and_step_markers(converted: tuple) -> None:
    trace, doc, _ = converted
    origin = doc["otherData"]["origin_unix_ns"]
    counters = by_phase(doc["traceEvents"], "C")
    assert [c["args"] for c in counters if c["name"] == "pool.gpus"] == [{"train": 2, "rollout": 2}] * 3
    assert [c["args"]["prompts"] for c in counters if c["name"] == "queue.depth"] == [8, 7, 6]
    markers = [e for e in by_phase(doc["traceEvents"], "i") if e.get("s") == "g"]
    expected: dict[int, int] = {}
    for r in trace.records:
        if r["name"] == "train.step":
            expected[r["step"]] = min(expected.get(r["step"], r["start_ns"]), r["start_ns"])
    assert {m["name"]: m["ts"] for m in markers} == {
        f"step {s}": Decimal(t - origin) / 1000 for s, t in expected.items()}


def test_gzip_output_matches_plain(synthetic_trace: SyntheticTrace, tmp_path: Path) -> None:
    trace_convert.convert(synthetic_trace.directory, tmp_path / "plain.json")
    trace_convert.convert(synthetic_trace.directory, tmp_path / "packed.json.gz")
    trace_convert.convert(synthetic_trace.directory, tmp_path / "forced.json", use_gzip=True)
    plain = load(tmp_path / "plain.json")
    assert load(tmp_path / "packed.json.gz") == plain
    with gzip.open(tmp_path / "forced.json", "rt") as handle:
        assert json.load(handle, parse_float=Decimal) == plain
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")) == []


def test_group_by_host(tmp_path: Path) -> None:
    trace = build_run(tmp_path / "t", steps=1)
    trace_convert.convert(trace.directory, tmp_path / "h.json", group_by="host")
    names = [e["args"]["name"] for e in load(tmp_path / "h.json")["traceEvents"] if e.get("name") == "process_name"]
    assert names == ["unknown-host"]
    with pytest.raises(ValueError, match="group_by"):
        trace_convert.convert(trace.directory, tmp_path / "x.json", group_by="rack")


def test_writer_trace_with_threads_gets_a_track_per_thread(tmp_path: Path) -> None:
    tracer = phase_trace.PhaseTracer.open(tmp_path, role="rollout", rank=2000, enabled=True, env={})

    def work() -> None:
        for i in range(3):
            with tracer.span("rollout.generate", step=i):
                pass

    with tracer.span("rollout.reward", step=0):
        worker = threading.Thread(target=work, name="engine-loop")
        worker.start()
        worker.join()
    tracer.close()
    trace_convert.convert(tmp_path, tmp_path / "w.json")
    events = load(tmp_path / "w.json")["traceEvents"]
    labels = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert sorted(labels.values()) == ["rollout rank 2000", "rollout rank 2000 engine-loop"]
    tracks = {e["name"]: labels[e["tid"]] for e in by_phase(events, "X")}
    assert tracks == {"rollout.generate": "rollout rank 2000 engine-loop", "rollout.reward": "rollout rank 2000"}


def test_missing_inputs_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        trace_convert.convert(tmp_path / "nope", tmp_path / "o.json")
    build_run(tmp_path / "t", steps=1)
    with pytest.raises(FileNotFoundError, match="output directory"):
        trace_convert.convert(tmp_path / "t", tmp_path / "no" / "o.json")


def _peak_bytes(directory: Path, out: Path) -> int:
    tracemalloc.start()
    try:
        trace_convert.convert(directory, out)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _write_spans(directory: Path, n: int) -> None:
    directory.mkdir()
    with open(directory / "phase_trace_rank1000.jsonl", "w") as handle:
        for i in range(n):
            start = T0 + 1000 * i
            handle.write(json.dumps({"schema": 1, "name": "rollout.generate", "role": "rollout", "rank": 2000,
                                     "step": None, "start_ns": start, "end_ns": start + 500,
                                     "attrs": {"i": i}}) + "\n")


def test_memory_does_not_grow_with_span_count(tmp_path: Path) -> None:
    # keeping each span would cost over 1 KiB per span (event text plus the parsed record)
    _write_spans(tmp_path / "small", 200)
    _write_spans(tmp_path / "large", 2_000)
    small = _peak_bytes(tmp_path / "small", tmp_path / "small.json")
    large = _peak_bytes(tmp_path / "large", tmp_path / "large.json")
    assert large < small + 64 * 1024, (small, large)  # keeping only the event texts would add ~400 KiB
    assert (tmp_path / "large.json").read_text().count('{"ph":"X"') == 2_000
