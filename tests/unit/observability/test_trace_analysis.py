"""Summary, diff and timeline of phase traces, checked against figures computed independently here."""

from __future__ import annotations

import json
import math
import random
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from trace_fixtures import SyntheticTrace, build_run

from libra.observability import trace_analysis as ta
from libra.observability.trace_schema import is_container


def percentile(values: list[int], q: float) -> float:
    """Linear interpolation between closest ranks (the definition the summary documents)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def merged_length(intervals: list[tuple[int, int]]) -> int:
    merged: list[list[int]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return sum(e - s for s, e in merged)


def test_phase_statistics_match_independent_figures(synthetic_trace: SyntheticTrace) -> None:
    summary = ta.summarize(synthetic_trace.directory)
    durations: dict[str, list[int]] = defaultdict(list)
    ranks: dict[str, set[int]] = defaultdict(set)
    for r in synthetic_trace.spans():
        durations[r["name"]].append(r["end_ns"] - r["start_ns"])
        ranks[r["name"]].add(r["rank"])
    assert set(summary.phases) == set(durations)
    step_time = sum(durations["train.step"]) / len(ranks["train.step"])
    assert summary.step_time_ns == int(step_time)
    for name, values in durations.items():
        p = summary.phases[name]
        assert (p.count, p.total_ns, p.min_ns, p.max_ns) == (len(values), sum(values), min(values), max(values))
        assert p.p50_ns == pytest.approx(percentile(values, 0.5), abs=1e-6)
        assert p.p95_ns == pytest.approx(percentile(values, 0.95), abs=1e-6)
        assert p.ranks == len(ranks[name]) and p.percentiles_exact and p.registered
        assert p.share_of_step == pytest.approx(sum(values) / len(ranks[name]) / int(step_time))
    assert summary.steps == 3
    assert summary.skipped_lines == sum(synthetic_trace.bad_lines.values())


def test_pool_idle_is_wall_minus_union_of_busy(synthetic_trace: SyntheticTrace) -> None:
    summary = ta.summarize(synthetic_trace.directory)
    for role in ("controller", "train", "rollout"):
        spans = [r for r in synthetic_trace.spans() if r["role"] == role]
        wall = max(r["end_ns"] for r in spans) - min(r["start_ns"] for r in spans)
        busy = merged_length([(r["start_ns"], r["end_ns"]) for r in spans if not is_container(r["name"])])
        pool = summary.pools[role]
        assert (pool.wall_ns, pool.busy_ns, pool.idle_ns) == (wall, busy, wall - busy)
        assert pool.idle_fraction == pytest.approx((wall - busy) / wall) and pool.idle_exact


def test_unregistered_names_instants_and_reservoir(tmp_path: Path) -> None:
    lines = []
    rng = random.Random(4)
    durations = [rng.randrange(1, 10_000) for _ in range(500)]
    for i, d in enumerate(durations):
        lines.append({"schema": 1, "name": "custom.phase", "role": "train", "rank": 1000, "step": None,
                      "start_ns": 10_000 * i, "end_ns": 10_000 * i + d})
    lines.append({"schema": 1, "name": "checkpoint.save", "role": "train", "rank": 1000, "step": 1,
                  "start_ns": 5, "end_ns": 5, "kind": "instant"})
    (tmp_path / "phase_trace_rank1000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    summary = ta.summarize(tmp_path, sample_cap=50)
    phase = summary.phases["custom.phase"]
    assert summary.unregistered == ["custom.phase"] and not phase.registered
    assert summary.instants == {"checkpoint.save": 1}
    assert (phase.count, phase.total_ns, phase.max_ns) == (500, sum(durations), max(durations))
    assert not phase.percentiles_exact and min(durations) <= phase.p50_ns <= max(durations)
    assert phase.p50_ns == pytest.approx(percentile(durations, 0.5), rel=0.35)
    assert summary.step_time_ns == 0 and phase.share_of_step is None


@pytest.mark.parametrize("seed", range(5))
def test_interval_union_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    intervals = []
    for _ in range(300):
        s = rng.randrange(0, 100_000)
        intervals.append((s, s + rng.randrange(0, 2_000)))
    union = ta.IntervalUnion()
    for s, e in intervals:
        union.add(s, e)
    assert union.total() == merged_length([iv for iv in intervals if iv[1] > iv[0]])
    assert all(a < b for a, b in zip(union.ends[:-1], union.starts[1:], strict=True))
    assert (union.lo, union.hi) == (min(s for s, _ in intervals), max(e for _, e in intervals))
    capped = ta.IntervalUnion(cap=8)
    for s, e in intervals:
        capped.add(s, e)
    assert len(capped.starts) <= 8 and not capped.exact and capped.total() >= union.total()


@pytest.mark.parametrize(
    ("intervals", "total"),
    [
        pytest.param([(0, 10), (10, 20)], 20, id="touching-merge"),
        pytest.param([(5, 6), (0, 10)], 10, id="contained"),
        pytest.param([(20, 30), (0, 5), (4, 21)], 30, id="bridge"),
        pytest.param([(3, 3)], 0, id="zero-length"),
    ],
)
def test_interval_union_cases(intervals: list[tuple[int, int]], total: int) -> None:
    union = ta.IntervalUnion()
    for s, e in intervals:
        union.add(s, e)
    assert union.total() == total


def test_diff_flags_slower_phases(tmp_path: Path) -> None:
    base = build_run(tmp_path / "base", steps=4)
    new = build_run(tmp_path / "new", steps=2, slow=1.5)
    rows = {r.name: r for r in ta.diff_summaries(ta.summarize(base.directory), ta.summarize(new.directory))}
    assert {n for n, r in rows.items() if r.regressed} == {"rollout.generate", "train.forward_backward",
                                                           "train.step"}

    def p50(trace: SyntheticTrace, name: str) -> float:
        return percentile([r["end_ns"] - r["start_ns"] for r in trace.spans() if r["name"] == name], 0.5)

    gen = rows["rollout.generate"]
    assert gen.p50_ratio == pytest.approx(p50(new, "rollout.generate") / p50(base, "rollout.generate"))
    opt = rows["train.optimizer"]  # same per-step work in a run half as long: totals are per step
    assert opt.total_ratio == pytest.approx(1.0) and not opt.regressed
    assert all(r.status == "both" for r in rows.values())


def test_diff_added_removed_and_threshold(tmp_path: Path) -> None:
    base = ta.summarize(build_run(tmp_path / "b", steps=1).directory)
    new = ta.summarize(build_run(tmp_path / "n", steps=1).directory)
    new.phases.pop("rollout.reward")
    rows = {r.name: r for r in ta.diff_summaries(base, new, threshold=1.0001)}
    assert rows["rollout.reward"].status == "removed" and not rows["rollout.reward"].regressed
    assert not any(r.regressed for r in rows.values())
    with pytest.raises(ValueError, match="threshold"):
        ta.diff_summaries(base, new, threshold=0)


@pytest.mark.parametrize("max_rank_rows", [48, 2], ids=["row-per-rank", "row-per-pool"])
def test_plot_writes_a_png(synthetic_trace: SyntheticTrace, tmp_path: Path, max_rank_rows: int) -> None:
    out = tmp_path / "timeline.png"
    info: dict[str, Any] = ta.plot_timeline(synthetic_trace.directory, out, max_rank_rows=max_rank_rows)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert info["rows"] == (5 if max_rank_rows == 48 else 3)
    assert info["counters"] == 2 and "train.forward_backward" in info["phases"]  # pool.gpus, queue.depth
    assert "train.step" not in info["phases"]  # containers are drawn as step lines, not bars


def test_share_of_step_counts_concurrent_spans_once_against_the_controller_step(tmp_path: Path) -> None:
    """Per-request spans overlap on one rank; the share is the time the phase covers, and the step time is
    the controller's step when the trace has one."""
    def rec(name: str, role: str, rank: int, start: int, end: int) -> dict[str, Any]:
        return {"schema": 1, "name": name, "role": role, "rank": rank, "step": 1, "start_ns": start, "end_ns": end}

    controller = [rec("controller.step", "controller", 0, 0, 1_000), rec("batch.collect", "controller", 0, 0, 600)]
    # three requests, 0-500, 100-400 and 450-550 on one instance: 550 ns covered, 900 ns summed
    rollout = [rec("rollout.generate", "rollout", 2000, s, e) for s, e in ((0, 500), (100, 400), (450, 550))]
    rollout.append(rec("rollout.generate", "rollout", 2001, 0, 350))
    train = [rec("train.step", "train", 1000, 600, 900)]
    for rank, recs in ((0, controller), (2000, rollout[:3]), (2001, rollout[3:]), (1000, train)):
        (tmp_path / f"phase_trace_rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    summary = ta.summarize(tmp_path)
    assert summary.step_time_ns == 1_000
    generate = summary.phases["rollout.generate"]
    assert generate.total_ns == 900 + 350 and generate.ranks == 2
    assert generate.share_of_step == pytest.approx((550 + 350) / 2 / 1_000)
    assert summary.phases["controller.step"].share_of_step == 1.0
    assert summary.phases["train.step"].share_of_step == pytest.approx(0.3)
