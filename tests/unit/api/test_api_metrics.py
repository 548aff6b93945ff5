"""Reconfiguration, action and operator metrics are counted from the event log, and every metric name is
listed in the manual."""

from __future__ import annotations

from pathlib import Path

from libra.controller.events import EventLog
from libra.observability.metrics import ACTIONS, ALL, OPERATOR_REQUESTS, RECONFIGURATIONS, LibraMetrics

REPO = Path(__file__).resolve().parents[3]


def value(metrics: LibraMetrics, name: str, **labels: str) -> float:
    found = metrics.registry.get_sample_value(name, labels)
    return 0.0 if found is None else found


def test_events_are_counted(tmp_path: Path) -> None:
    metrics = LibraMetrics()
    events = EventLog(tmp_path / "events.jsonl")
    events.subscribe(metrics.record_event)
    events.emit("action_done", action="StartRolloutInstance")
    events.emit("action_error", "boom", action="StartRolloutInstance")
    events.emit("reconfigure_requested", "g1", strategy="diff", generation=1)
    events.emit("reconfigure_done", "g1", strategy="diff", generation=1, seconds=12.5)
    events.emit("operator", "Pause: ok", call="Pause", outcome="ok")
    events.emit("operator", "Status refused", call="Status", outcome="unauthenticated")
    actions = ACTIONS.name
    assert value(metrics, actions, action="StartRolloutInstance", result="ok") == 1
    assert value(metrics, actions, action="StartRolloutInstance", result="error") == 1
    assert value(metrics, RECONFIGURATIONS.name, strategy="diff", outcome="requested") == 1
    assert value(metrics, RECONFIGURATIONS.name, strategy="diff", outcome="done") == 1
    assert value(metrics, "libra_reconfiguration_seconds_sum", strategy="diff") == 12.5
    assert value(metrics, OPERATOR_REQUESTS.name, call="Status", outcome="unauthenticated") == 1


def test_a_failing_listener_never_stops_the_event_log(tmp_path: Path) -> None:
    events = EventLog(tmp_path / "events.jsonl")

    def broken(event: dict) -> None:
        raise RuntimeError("listener bug")

    unsubscribe = events.subscribe(broken)
    assert events.emit("step", step=1)["kind"] == "step"
    unsubscribe()
    assert (tmp_path / "events.jsonl").read_text().count("\n") == 1


def test_every_metric_is_in_the_manual() -> None:
    manual = "\n".join(p.read_text() for p in (REPO / "cluster_manual").glob("*.md"))
    missing = [m.name for m in ALL if f"`{m.name}" not in manual]
    assert missing == [], f"list {missing} in cluster_manual/launch.md"
