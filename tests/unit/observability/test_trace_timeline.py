"""Pool timelines of reconfigurations: rollout lifecycles, training-resize phases and rank steps, requests and
windows read from the executor's spans, and the pictures drawn from them (`libra trace timeline`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from trace_fixtures import T0, S, build_reconfiguration, build_train_resize

from libra.cli.main import main
from libra.observability import trace_timeline as tt


@pytest.fixture
def trace_dir(tmp_path: Path) -> Path:
    return build_reconfiguration(tmp_path / "traces").directory


def seconds(segments: list[tt.Segment]) -> list[tuple[str, float, float]]:
    return [(s.state, round((s.start_ns - T0) / S, 3), round((s.end_ns - T0) / S, 3)) for s in segments]


@pytest.mark.parametrize(("member", "lifecycle"), [
    ("rollout-0", [("starting", 0, 1), ("serving", 1, 32.1), ("draining", 32.1, 35)]),
    ("rollout-2", [("starting", 11, 30), ("up, not serving", 30, 32.1), ("serving", 32.1, 50), ("stopping", 50, 52)]),
    ("rollout-5", [("starting", 52, 65), ("up, not serving", 65, 66), ("serving", 66, 75.8)]),
], ids=["blue-drained", "green-then-aborted", "restarted-to-the-end"])
def test_lifecycles_follow_the_executor_spans(trace_dir: Path, member: str,
                                              lifecycle: list[tuple[str, float, float]]) -> None:
    assert seconds(tt.read_timeline(trace_dir).lifecycle(member)) == lifecycle


def test_reloads_are_placed_on_their_instance(trace_dir: Path) -> None:
    timeline = tt.read_timeline(trace_dir)
    assert sorted(timeline.members) == [f"rollout-{i}" for i in range(7)]
    assert timeline.members["rollout-3"].reloads == [(T0 + 30 * S, T0 + 31 * S)]
    assert timeline.members["rollout-0"].reloads == []


def test_requests_answered_failed_and_requeued(trace_dir: Path) -> None:
    timeline = tt.read_timeline(trace_dir)
    assert timeline.answered(T0, T0 + 4 * S, S) == [(T0 + i * S, 1.0) for i in range(4)]
    assert timeline.answered(T0, T0 + 3 * S, 2 * S) == [(T0, 1.0), (T0 + 2 * S, 1.0)]  # the last bin is whole
    # 50.8 s requeued, 53.8 and 54.8 s failed: not answered
    assert [r for _, r in timeline.answered(T0 + 50 * S, T0 + 56 * S, S)] == [0.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    assert timeline.ended_at("failed", T0 + 50 * S, T0 + 70 * S) == [T0 + int(53.8 * S), T0 + int(54.8 * S)]
    assert timeline.ended_at("requeued", T0 + 50 * S, T0 + 70 * S) == [T0 + int(50.8 * S)]
    assert timeline.ended_at("failed", T0, T0 + 45 * S) == []


@pytest.mark.parametrize(("window", "gaps"), [
    ((5, 45), []),  # blue_green: blue serves until green takes over
    ((45, 75), [(50, 66)]),  # restart_all: nothing serves from the stop to the new set's flip
    ((0, 80), [(0, 1), (50, 66), (75.8, 80)]),  # before the first instance is up, after the trace ends
], ids=["blue_green", "restart_all", "whole"])
def test_unserved_intervals(trace_dir: Path, window: tuple[float, float], gaps: list[tuple[float, float]]) -> None:
    lo, hi = (T0 + int(w * S) for w in window)
    found = tt.read_timeline(trace_dir).unserved(lo, hi)
    assert [(round((a - T0) / S, 3), round((b - T0) / S, 3)) for a, b in found] == gaps


@pytest.mark.parametrize(("match", "labels"), [
    ({}, ["blue_green grow_2_to_3", "restart_all shrink_3_to_2 (abort)"]),
    ({"strategy": "blue_green"}, ["blue_green grow_2_to_3"]),
    ({"drain": "False"}, ["restart_all shrink_3_to_2 (abort)"]),
    ({"strategy": "restart_all", "change": "shrink_3_to_2"}, ["restart_all shrink_3_to_2 (abort)"]),
], ids=["all", "by-strategy", "by-drain", "by-two-keys"])
def test_windows_select_changes(trace_dir: Path, match: dict[str, str], labels: list[str]) -> None:
    windows = tt.read_timeline(trace_dir).windows(match, 5 * S)
    assert [c.label() for _, _, c in windows if c is not None] == labels
    first = windows[0]
    assert first[2] is not None and (first[0], first[1]) == (first[2].start_ns - 5 * S, first[2].end_ns + 5 * S)


def test_a_margin_stops_at_the_neighbouring_changes(trace_dir: Path) -> None:
    first, second = tt.read_timeline(trace_dir).windows({}, 20 * S)
    assert (first[0], first[1]) == (T0, T0 + 50 * S)  # the trace's start; the next change's request
    assert (second[0], second[1]) == (T0 + 40 * S, T0 + int(75.8 * S))  # the change before's end; the trace's end


def test_a_match_that_selects_nothing_names_what_the_trace_has(trace_dir: Path) -> None:
    with pytest.raises(ValueError, match="no reconfigure.change span matches .*strategy=blue_green change=grow_2_to_3"):
        tt.read_timeline(trace_dir).windows({"strategy": "prewarm"}, 0)


@pytest.mark.parametrize(("match", "rows", "failed", "requeued"), [
    ({"strategy": "blue_green"}, [f"rollout-{i}" for i in range(5)], 0, 0),
    ({"strategy": "restart_all"}, [f"rollout-{i}" for i in (2, 3, 4, 5, 6)], 2, 1),
], ids=["blue_green", "restart_all"])
def test_render_draws_the_instances_of_the_window(trace_dir: Path, tmp_path: Path, match: dict[str, str],
                                                  rows: list[str], failed: int, requeued: int) -> None:
    out = tmp_path / "timeline.png"
    info = tt.render_timeline(trace_dir, out, match=match, title="t")
    assert info["rows"] == rows and (info["failed_requests"], info["requeued_requests"]) == (failed, requeued)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_a_trace_without_executor_spans_is_refused(tmp_path: Path) -> None:
    from trace_fixtures import build_run

    trace = build_run(tmp_path / "plain", steps=1)
    with pytest.raises(ValueError, match="no rollout instance has a lifecycle to draw"):
        tt.render_timeline(trace.directory, tmp_path / "x.png")


@pytest.mark.parametrize(("extra", "code", "said"), [
    (["--match", "strategy=blue_green"], 0, "5 instances, columns blue_green grow_2_to_3, 0 failed request(s)"),
    ([], 0, "columns blue_green grow_2_to_3, restart_all shrink_3_to_2 (abort), 2 failed request(s)"),
    (["--match", "strategy"], 2, "--match 'strategy': write KEY=VALUE"),
    (["--match", "strategy=prewarm"], 2, "no reconfigure.change span matches"),
    (["--margin", "-1"], 2, "margin_s=-1.0: must be >= 0"),
], ids=["match", "all", "bad-match", "no-match", "bad-margin"])
def test_cli(trace_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], code: int,
             said: str) -> None:
    assert main(["trace", "timeline", str(trace_dir), "--out", str(tmp_path / "t.png"), *extra]) == code
    captured = capsys.readouterr()
    assert said in (captured.out if code == 0 else captured.err)


def test_training_resize_phases_and_rank_steps(tmp_path: Path) -> None:
    timeline = tt.read_timeline(build_train_resize(tmp_path / "traces").directory)
    assert seconds(timeline.train_phases) == [("saving checkpoint", 12, 13), ("stopping ranks", 13, 14),
                                              ("starting ranks", 14, 26), ("loading checkpoint", 26, 28)]
    assert sorted(timeline.train_steps) == [0, 1, 2]
    assert len(timeline.train_steps[0]) == 12 and timeline.train_steps[2][0] == (T0 + 28 * S, T0 + int(29.5 * S))
    # the resize's phases are the training pool's, not a rollout member's lifecycle
    assert sorted(timeline.members) == ["rollout-0"]


@pytest.mark.parametrize(("build", "train_rows"), [
    (build_train_resize, ["training pool", "train rank 0", "train rank 1", "train rank 2"]),
    (build_reconfiguration, []),
], ids=["train-resize", "rollout-only"])
def test_render_draws_training_rows_of_a_resize(tmp_path: Path, build: Any, train_rows: list[str]) -> None:
    out = tmp_path / "timeline.png"
    info = tt.render_timeline(build(tmp_path / "traces").directory, out)
    assert info["train_rows"] == train_rows
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_window_without_a_resize_has_no_training_rows(tmp_path: Path) -> None:
    from trace_fixtures import build_run

    trace = build_run(tmp_path / "plain", steps=2)  # training steps, but no resize of the pool
    assert tt.read_timeline(trace.directory).train_steps and not tt.read_timeline(trace.directory).train_phases
    with pytest.raises(ValueError, match="no rollout instance has a lifecycle to draw"):
        tt.render_timeline(trace.directory, tmp_path / "x.png")
