"""Prometheus metrics (served on loopback and scraped), the plain console line and the event log."""

from __future__ import annotations

import io
import json
import socket
import urllib.request
from pathlib import Path

import pytest

from libra.controller.events import EventLog
from libra.observability.console import PlainConsole, make_console, step_line
from libra.observability.metrics import ALL, DISCARDED_SAMPLES, LibraMetrics, MetricsExporterError

ROW = {
    "step": 7, "reward_mean": 0.625, "rollout_tokens_per_s": 812.0, "train_tokens_per_s": 300.0,
    "policy_lag_max": 1, "policy_version": 7, "rollout_version": 6, "time_rollout_s": 1.2, "time_train_s": 0.8,
    "time_sync_s": 0.1, "time_step_s": 2.2, "sync_reload_s": 0.05, "discarded_samples": 4, "eval_accuracy": 0.5,
}


def test_metric_names_are_unique_and_prefixed() -> None:
    names = [m.name for m in ALL]
    assert len(names) == len(set(names))
    assert all(n.startswith("libra_") for n in names)


@pytest.mark.parametrize("where", ["taken-port", "address-not-on-this-machine"])
def test_an_exporter_that_cannot_listen_names_the_options_and_the_value(where: str) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        address, port = ("127.0.0.1", held.getsockname()[1]) if where == "taken-port" else ("192.0.2.123", 9464)
        with pytest.raises(MetricsExporterError) as raised:
            LibraMetrics().serve(port, address)
    message = str(raised.value)
    assert f"{address}:{port}" in message and "tracking.prometheus_port" in message, message
    assert "tracking.prometheus_bind_address" in message and "choose a free tracking.prometheus_port" in message


def test_prometheus_endpoint_serves_step_figures() -> None:
    metrics = LibraMetrics()
    port = metrics.serve(0)
    try:
        metrics.record_step(ROW)
        metrics.set_pools({"rollout": 2, "train": 2}, {"rollout": {"READY": 2}, "train": {"READY": 2}})
        metrics.set_queue({"running_groups": 3, "buffered_groups": 1})
        metrics.raise_counter(DISCARDED_SAMPLES, 10)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        metrics.close()
    expected = [
        "libra_step 7.0", "libra_reward_mean 0.625", 'libra_tokens_per_second{pool="rollout"} 812.0',
        'libra_pool_gpus{pool="train"} 2.0', 'libra_queue_depth{queue="running_groups"} 3.0',
        "libra_policy_lag 1.0", 'libra_pool_members{pool="rollout",state="READY"} 2.0',
        "libra_discarded_samples_total 10.0", "libra_weight_reload_seconds_count 1.0",
        'libra_step_phase_seconds_count{phase="train"} 1.0', "libra_eval_accuracy 0.5",
    ]
    for line in expected:
        assert line in text, line


def test_two_controllers_do_not_collide() -> None:
    a, b = LibraMetrics(), LibraMetrics()
    a.record_step(ROW)
    assert b.get(DISCARDED_SAMPLES)._value.get() == 0


def test_plain_console_prints_one_line_per_step() -> None:
    stream = io.StringIO()
    console = PlainConsole(stream)
    console.start(50, 0, "libra dev")
    console.update(ROW, {"rollout": "2/2 ready", "train": "2 GPUs"}, [])
    lines = stream.getvalue().splitlines()
    assert lines[0] == "libra dev: steps 0..50"
    assert lines[1].startswith("step 7/50  reward 0.625  eval 0.500  2.20s/step  rollout 812 tok/s  lag 1")
    assert "rollout 2/2 ready" in lines[1]
    assert step_line({"step": 1, "reward_mean": 0.0}, 3) == "step 1/3  reward 0.000"


def test_console_falls_back_to_plain_without_a_terminal() -> None:
    assert isinstance(make_console("rich", io.StringIO()), PlainConsole)
    assert not isinstance(make_console("off"), PlainConsole)


def test_event_log_writes_lines_and_keeps_recent(tmp_path: Path) -> None:
    events = EventLog(tmp_path / "events.jsonl", keep=3)
    for i in range(5):
        events.emit("transition", member=f"m{i}")
    lines = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["member"] for e in lines] == [f"m{i}" for i in range(5)]
    assert [e["member"] for e in events.recent(10)] == ["m2", "m3", "m4"]
    assert EventLog(tmp_path / "missing-dir" / "e.jsonl").emit("x")["kind"] == "x"
