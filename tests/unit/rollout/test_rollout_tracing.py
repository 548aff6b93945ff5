"""Reload traces written by the pool for its instances: one span per ACK in the instance's rank file, placed
from the ACK's offsets, linked by `libra trace convert` to the publish that caused it."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from libra.cli.main import main
from libra.observability.phase_trace import PhaseTracer, TraceSettings
from libra.observability.trace_schema import iter_trace
from libra.rollout.reload import ReloadAck
from libra.rollout.tracing import InstanceTracers

PUBLISH_NS = 1_700_000_000_000_000_000
SECOND = 1_000_000_000


def ack(instance_id: str, started_s: float, finished_s: float, version: int = 3, error: str = "") -> ReloadAck:
    return ReloadAck(
        instance_id=instance_id, host="h", method="inplace", strategy="serial", weight_version=version,
        checksum="sha256t1:x", lock_wait_s=0.0, process_stop_s=0.0, model_load_s=finished_s - started_s,
        total_s=finished_s - started_s, started_s=started_s, finished_s=finished_s, error=error,
    )


def records_by_rank(directory: Path) -> dict[int, list[dict[str, object]]]:
    _, records = iter_trace(directory)
    out: dict[int, list[dict[str, object]]] = {}
    for record in records:
        out.setdefault(int(record["rank"]), []).append(record)  # type: ignore[call-overload]
    return out


@pytest.mark.parametrize(
    ("acks", "ranks"),
    [
        pytest.param([ack("rollout-0", 0.0, 1.5), ack("rollout-1", 1.5, 2.0)], [2000, 2001], id="serial"),
        pytest.param([ack("rollout-0", 0.0, 2.0), ack("rollout-7", 0.0, 1.0)], [2000, 2007], id="parallel"),
        pytest.param([ack("endpoint-1", 0.0, 0.5, version=2, error="boom")], [2001], id="failed-ack"),
    ],
)
def test_one_reload_span_per_ack_in_the_instance_file(tmp_path: Path, acks: list[ReloadAck], ranks: list[int]) -> None:
    tracers = InstanceTracers(TraceSettings(True, str(tmp_path)))
    tracers.record_reloads(acks, 3, PUBLISH_NS)
    tracers.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"phase_trace_rank{r}.jsonl" for r in ranks]
    by_rank = records_by_rank(tmp_path)
    for rank, sent in zip(ranks, acks, strict=True):
        (record,) = by_rank[rank]
        attrs = record["attrs"]
        assert isinstance(attrs, dict)
        assert (record["name"], record["role"], record["step"]) == ("weight_sync.reload", "rollout", 3)
        assert record["start_ns"] == PUBLISH_NS + round(sent.started_s * SECOND)
        assert record["end_ns"] == PUBLISH_NS + round(sent.finished_s * SECOND)
        assert attrs["flow_id"] == 3 and attrs["instance_id"] == sent.instance_id
        assert attrs["weight_version"] == sent.weight_version and attrs["total_s"] == sent.total_s
        assert attrs.get("error", "") == sent.error


@pytest.mark.parametrize(
    "settings", [None, TraceSettings(False, None), TraceSettings(True, None)], ids=["none", "off", "no-directory"]
)
def test_disabled_settings_write_nothing(tmp_path: Path, settings: TraceSettings | None) -> None:
    tracers = InstanceTracers(settings)
    tracers.record_reloads([ack("rollout-0", 0.0, 1.0)], 1, PUBLISH_NS)
    tracers.close()
    assert not list(tmp_path.iterdir())


def test_an_untraceable_instance_is_skipped_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tracers = InstanceTracers(TraceSettings(True, str(tmp_path)))
    with caplog.at_level(logging.WARNING):
        tracers.record_reloads([ack("rollout-1000", 0.0, 1.0), ack("odd", 0.0, 1.0), ack("rollout-2", 0.0, 1.0)],
                               1, PUBLISH_NS)
    tracers.close()
    assert [p.name for p in tmp_path.iterdir()] == ["phase_trace_rank2002.jsonl"]
    assert "rollout-1000 writes no phase trace" in caplog.text and "odd writes no phase trace" in caplog.text


def test_convert_links_the_publish_to_every_reload(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The publisher's span (rank 0) is the flow source of each instance's reload of the same version; a later
    version's reloads link to their own publish."""
    traces = tmp_path / "traces"
    publisher = PhaseTracer.open(None, role="controller", rank=0, enabled=True, trace_dir=traces)
    tracers = InstanceTracers(publisher.settings())
    for version in (1, 2):
        start = PUBLISH_NS + version * 10 * SECOND
        publisher.record("weight_sync.publish", start, start + 3 * SECOND, step=version, flow_id=version)
        tracers.record_reloads([ack("rollout-0", 0.0, 1.0, version), ack("rollout-1", 1.0, 2.0, version)],
                               version, start)
    publisher.close()
    tracers.close()

    out = tmp_path / "trace.json"
    assert main(["trace", "convert", str(traces), "-o", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["flows"], report["unmatched_flow_sinks"]) == (4, 0)
    events = json.loads(out.read_text())["traceEvents"]
    role_of = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    spans = [e for e in events if e["ph"] == "X"]

    def span_at(event: dict[str, Any]) -> dict[str, Any]:
        """The flow-endpoint span on the event's track that contains its timestamp."""
        ts = float(event["ts"])
        (found,) = [s for s in spans if (s["pid"], s["tid"]) == (event["pid"], event["tid"])
                    and s["ts"] <= ts <= s["ts"] + s["dur"]]
        return found

    arrows = {}
    for start in (e for e in events if e["ph"] == "s"):
        (finish,) = [e for e in events if e["ph"] == "f" and e["id"] == start["id"]]
        source, sink = span_at(start), span_at(finish)
        assert (role_of[start["pid"]], role_of[finish["pid"]]) == ("controller", "rollout")
        arrows[(sink["args"]["rank"], sink["args"]["flow_id"])] = source["args"]["flow_id"]
    assert arrows == {(2000, 1): 1, (2001, 1): 1, (2000, 2): 2, (2001, 2): 2}
