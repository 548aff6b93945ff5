"""Phase-trace analysis: per-phase summary, run-to-run diff, and a Gantt timeline of the pools.

Summary (spans only; instants and counters are not phases):
  count, total, min, max          exact
  p50, p95                        numpy linear percentiles of the durations; exact while a phase has at
                                  most `sample_cap` spans, beyond that of a uniform reservoir sample
  share_of_step                   (time covered by the phase per rank that ran it) / step time, where
                                  concurrent spans of one phase on one rank (per-request spans) count
                                  once, and step time is the controller.step total (the step loop's wall
                                  time), else the train.step total per training rank, else the wall
                                  span of all step-tagged records
  pool idle                       wall span of a pool (role) minus the union of its busy spans (container
                                  phases such as train.step are not busy time). The union keeps one entry
                                  per idle gap; past `gap_cap` gaps the shortest are merged and
                                  `idle_exact` becomes false.
Diff flags a phase when its p50 or its total per step grew by more than `threshold` times.
"""

from __future__ import annotations

import bisect
import random
from array import array
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from libra.observability.trace_schema import is_container, is_registered, iter_trace

DEFAULT_SAMPLE_CAP = 200_000
DEFAULT_GAP_CAP = 100_000


class IntervalUnion:
    """Union of [start, end) intervals as sorted disjoint int64 arrays (8 bytes an entry); optional coarsening
    past `cap` gaps."""

    def __init__(self, cap: int | None = None) -> None:
        self.starts = array("q")
        self.ends = array("q")
        self.cap = cap
        self.resolution = 0  # gaps shorter than this have been merged
        self.lo: int | None = None
        self.hi: int | None = None

    def add(self, start: int, end: int) -> None:
        if self.lo is None or start < self.lo:
            self.lo = start
        if self.hi is None or end > self.hi:
            self.hi = end
        if end <= start:
            return
        starts, ends = self.starts, self.ends
        if not starts or start > ends[-1] + self.resolution:
            starts.append(start)
            ends.append(end)
        else:
            i = bisect.bisect_left(ends, start - self.resolution)
            j = bisect.bisect_right(starts, end + self.resolution)
            if i == j:
                starts.insert(i, start)
                ends.insert(i, end)
            else:
                new_start, new_end = min(start, starts[i]), max(end, ends[j - 1])
                starts[i:j] = array("q", (new_start,))
                ends[i:j] = array("q", (new_end,))
        if self.cap is not None and len(starts) > self.cap:
            self._coarsen()

    def _coarsen(self) -> None:
        gaps = sorted(s - e for s, e in zip(self.starts[1:], self.ends[:-1], strict=True))
        self.resolution = max(self.resolution, gaps[len(gaps) // 2] + 1)
        starts, ends = array("q", self.starts[:1]), array("q", self.ends[:1])
        for s, e in zip(self.starts[1:], self.ends[1:], strict=True):
            if s - ends[-1] < self.resolution:
                ends[-1] = max(ends[-1], e)
            else:
                starts.append(s)
                ends.append(e)
        self.starts, self.ends = starts, ends

    def total(self) -> int:
        return sum(e - s for s, e in zip(self.starts, self.ends, strict=True))

    @property
    def exact(self) -> bool:
        return self.resolution == 0


@dataclass
class PhaseStats:
    name: str
    registered: bool
    count: int
    ranks: int
    total_ns: int
    min_ns: int
    max_ns: int
    p50_ns: float
    p95_ns: float
    share_of_step: float | None
    percentiles_exact: bool


@dataclass
class PoolStats:
    pool: str
    ranks: int
    wall_ns: int
    busy_ns: int
    idle_ns: int
    idle_fraction: float
    idle_exact: bool


@dataclass
class TraceSummary:
    phases: dict[str, PhaseStats]
    pools: dict[str, PoolStats]
    steps: int
    step_time_ns: int
    instants: dict[str, int]
    unregistered: list[str]
    skipped_lines: int
    files: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _PhaseAcc:
    __slots__ = ("count", "total", "min", "max", "samples", "covered")

    def __init__(self) -> None:
        self.count = 0
        self.total = 0
        self.min = 0
        self.max = 0
        self.samples = array("q")  # 8 bytes per duration
        self.covered: dict[int, IntervalUnion] = {}  # per rank: the union of its spans of this phase

    def covered_per_rank(self) -> float:
        return sum(u.total() for u in self.covered.values()) / len(self.covered)


def summarize(
    trace_path: str | Path, *, sample_cap: int = DEFAULT_SAMPLE_CAP, gap_cap: int = DEFAULT_GAP_CAP
) -> TraceSummary:
    """Stream the trace at `trace_path` once and summarize it (see the module docstring)."""
    stats, records = iter_trace(trace_path)
    rng = random.Random(0)
    phases: dict[str, _PhaseAcc] = {}
    pools: dict[str, IntervalUnion] = {}
    pool_ranks: dict[str, set[int]] = {}
    instants: Counter[str] = Counter()
    steps: set[int] = set()
    step_lo: int | None = None
    step_hi: int | None = None
    for rec in records:
        kind = rec.get("kind", "span")
        name, start, end, rank = rec["name"], rec["start_ns"], rec["end_ns"], rec["rank"]
        if rec["step"] is not None:
            steps.add(rec["step"])
            step_lo = start if step_lo is None else min(step_lo, start)
            step_hi = end if step_hi is None else max(step_hi, end)
        if kind == "instant":
            instants[name] += 1
            continue
        if kind != "span":
            continue
        dur = end - start
        acc = phases.get(name)
        if acc is None:
            acc = phases[name] = _PhaseAcc()
            acc.min = dur
        acc.count += 1
        acc.total += dur
        acc.min = min(acc.min, dur)
        acc.max = max(acc.max, dur)
        covered = acc.covered.get(rank)
        if covered is None:
            covered = acc.covered[rank] = IntervalUnion(cap=gap_cap)
        covered.add(start, end)
        if len(acc.samples) < sample_cap:
            acc.samples.append(dur)
        else:
            slot = rng.randrange(acc.count)
            if slot < sample_cap:
                acc.samples[slot] = dur
        pool = pools.get(rec["role"])
        if pool is None:
            pool = pools[rec["role"]] = IntervalUnion(cap=gap_cap)
            pool_ranks[rec["role"]] = set()
        pool_ranks[rec["role"]].add(rank)
        if is_container(name):
            pool.add(start, start)
            pool.add(end, end)
        else:
            pool.add(start, end)

    anchor = phases.get("controller.step") or phases.get("train.step")
    if anchor is not None:
        step_time = int(anchor.covered_per_rank())
    else:
        step_time = 0 if step_lo is None or step_hi is None else step_hi - step_lo
    phase_stats: dict[str, PhaseStats] = {}
    for name, acc in sorted(phases.items()):
        p50, p95 = np.percentile(np.frombuffer(acc.samples, dtype=np.int64).astype(np.float64), [50, 95])
        per_rank = acc.covered_per_rank()
        phase_stats[name] = PhaseStats(
            name=name, registered=is_registered(name), count=acc.count, ranks=len(acc.covered),
            total_ns=acc.total, min_ns=acc.min, max_ns=acc.max, p50_ns=float(p50), p95_ns=float(p95),
            share_of_step=per_rank / step_time if step_time > 0 else None,
            percentiles_exact=acc.count <= sample_cap,
        )
    pool_stats: dict[str, PoolStats] = {}
    for role, union in sorted(pools.items()):
        wall = 0 if union.lo is None or union.hi is None else union.hi - union.lo
        busy = union.total()
        pool_stats[role] = PoolStats(
            pool=role, ranks=len(pool_ranks[role]), wall_ns=wall, busy_ns=busy, idle_ns=wall - busy,
            idle_fraction=(wall - busy) / wall if wall else 0.0, idle_exact=union.exact,
        )
    return TraceSummary(
        phases=phase_stats, pools=pool_stats, steps=len(steps), step_time_ns=step_time,
        instants=dict(instants), unregistered=sorted(n for n in phases if not is_registered(n)),
        skipped_lines=sum(s.skipped for s in stats), files=[s.as_dict() for s in stats],
    )


# ---- diff -------------------------------------------------------------------------------------------


@dataclass
class PhaseDiff:
    name: str
    status: str  # "both" | "added" | "removed"
    base_p50_ns: float | None
    new_p50_ns: float | None
    p50_ratio: float | None
    base_total_per_step_ns: float | None
    new_total_per_step_ns: float | None
    total_ratio: float | None
    regressed: bool


def _ratio(new: float | None, base: float | None) -> float | None:
    if new is None or base is None:
        return None
    if base == 0:
        return None if new == 0 else float("inf")
    return new / base


def diff_summaries(base: TraceSummary, new: TraceSummary, threshold: float = 1.1) -> list[PhaseDiff]:
    """Phase-by-phase comparison; totals are per step when both runs have steps (runs differ in length)."""
    if threshold <= 0:
        raise ValueError(f"threshold must be positive (e.g. 1.1 for +10%), got {threshold}")
    per_step = base.steps > 0 and new.steps > 0
    rows: list[PhaseDiff] = []
    for name in sorted(set(base.phases) | set(new.phases)):
        b, n = base.phases.get(name), new.phases.get(name)
        b_total = None if b is None else b.total_ns / (base.steps if per_step else 1)
        n_total = None if n is None else n.total_ns / (new.steps if per_step else 1)
        p50_ratio = _ratio(None if n is None else n.p50_ns, None if b is None else b.p50_ns)
        total_ratio = _ratio(n_total, b_total)
        regressed = any(r is not None and r > threshold for r in (p50_ratio, total_ratio))
        rows.append(PhaseDiff(
            name=name, status="both" if b and n else ("added" if n else "removed"),
            base_p50_ns=None if b is None else b.p50_ns, new_p50_ns=None if n is None else n.p50_ns,
            p50_ratio=p50_ratio, base_total_per_step_ns=b_total, new_total_per_step_ns=n_total,
            total_ratio=total_ratio, regressed=regressed,
        ))
    return rows


# ---- timeline picture -------------------------------------------------------------------------------


PHASE_COLORS = {
    "controller.tick": "#7f7f7f",
    "batch.collect": "#bcbd22",
    "rollout.generate": "#1f77b4",
    "rollout.reward": "#17becf",
    "train.recompute_logprobs": "#98df8a",
    "train.forward_backward": "#2ca02c",
    "train.optimizer": "#0b5d1e",
    "weight_sync.publish": "#d62728",
    "weight_sync.reload": "#ff9896",
    "weight_sync.ack": "#e377c2",
    "reconfigure.plan": "#c5b0d5",
    "reconfigure.drain": "#9467bd",
    "reconfigure.stop": "#8c564b",
    "reconfigure.start": "#c49c94",
    "reconfigure.swap": "#5254a3",
    "checkpoint.save": "#ff7f0e",
    "checkpoint.load": "#ffbb78",
    "eval": "#f7b6d2",
}


def _plot_counter(ax: Any, name: str, series: dict[str, list[tuple[int, float]]], origin: int, end: int) -> None:
    """Stacked step areas of one counter's series (e.g. GPUs per pool add up to the cluster)."""
    times = sorted({t for points in series.values() for t, _ in points})
    labels, stacks = [], []
    for label, points in sorted(series.items()):
        points.sort()
        values, i, current = [], 0, 0.0
        for t in times:
            while i < len(points) and points[i][0] <= t:
                current = points[i][1]
                i += 1
            values.append(current)
        labels.append(label)
        stacks.append(values + [values[-1]])
    xs = [(t - origin) / 1e9 for t in times] + [(max(end, times[-1]) - origin) / 1e9]
    ax.stackplot(xs, stacks, labels=labels, step="post", alpha=0.8)
    ax.set_ylabel(name)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.grid(alpha=0.3)


def plot_timeline(
    trace_path: str | Path, output: str | Path, *, max_rank_rows: int = 48, title: str | None = None,
    window_s: tuple[float | None, float | None] = (None, None),
) -> dict[str, Any]:
    """Draw a Gantt of the pools over time (one row per rank, or per pool when there are more than
    `max_rank_rows` ranks) with counter tracks below; returns what was drawn. `window_s` limits the x axis to
    (from, to) seconds since the trace start (None: the trace's own edge)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    stats, records = iter_trace(trace_path)
    bars: dict[tuple[str, int], dict[str, IntervalUnion]] = {}
    counters: dict[tuple[str, str], list[tuple[int, float]]] = {}
    step_starts: dict[int, int] = {}
    origin: int | None = None
    last_end = 0
    for rec in records:
        start, end = rec["start_ns"], rec["end_ns"]
        origin = start if origin is None else min(origin, start)
        last_end = max(last_end, end)
        kind = rec.get("kind", "span")
        if kind == "counter":
            for series, value in (rec.get("attrs") or {}).items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    points = counters.setdefault((rec["name"], series), [])
                    points.append((start, float(value)))
                    if len(points) > 20_000:
                        del points[::2]
            continue
        if rec["name"] == "train.step" and rec["step"] is not None:
            step_starts[rec["step"]] = min(start, step_starts.get(rec["step"], start))
        if kind != "span" or is_container(rec["name"]):
            continue
        lane = bars.setdefault((rec["role"], rec["rank"]), {})
        union = lane.get(rec["name"])
        if union is None:
            union = lane[rec["name"]] = IntervalUnion(cap=5_000)
        union.add(start, end)
    if origin is None:
        raise ValueError(f"trace {str(trace_path)!r} has no valid records to plot")

    by_pool = len(bars) > max_rank_rows
    rows: dict[str, dict[str, list[tuple[int, int]]]] = {}
    order = {"controller": 0, "train": 1, "rollout": 2}
    for (role, rank), phases in sorted(bars.items(), key=lambda kv: (order.get(kv[0][0], 9), kv[0])):
        label = f"{role} pool" if by_pool else f"{role} {rank}"
        row = rows.setdefault(label, {})
        for name, union in phases.items():
            row.setdefault(name, []).extend(zip(union.starts, union.ends, strict=True))
    names = sorted({n for row in rows.values() for n in row})
    extra = iter(plt.get_cmap("tab20b").colors)  # type: ignore[attr-defined]
    colors = {n: PHASE_COLORS.get(n) or next(extra, "0.5") for n in names}

    counter_names = sorted({cname for cname, _ in counters})[:4]
    n_counter_axes = len(counter_names)
    fig_height = max(3.0, 0.45 * len(rows) + 1.8) + 1.8 * n_counter_axes
    fig, axes = plt.subplots(
        1 + n_counter_axes, 1, figsize=(14, fig_height), sharex=True, squeeze=False,
        gridspec_kw={"height_ratios": [max(2.0, 0.45 * len(rows))] + [1.6] * n_counter_axes},
    )
    ax = axes[0][0]
    labels = list(rows)
    for y, label in enumerate(labels):
        for name, spans in rows[label].items():
            ax.broken_barh([((s - origin) / 1e9, (e - s) / 1e9) for s, e in spans], (y - 0.4, 0.8),
                           facecolors=colors[name], edgecolor="none")
    steps_sorted = sorted(step_starts.items())
    if len(steps_sorted) <= 200:
        for _, ts in steps_sorted:
            ax.axvline((ts - origin) / 1e9, color="0.6", linewidth=0.6, linestyle=":", zorder=0)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_ylabel("pool / rank")
    run_name = Path(trace_path).resolve()
    run_name = run_name.parent if run_name.name == "traces" else run_name
    ax.set_title(title or f"Phase timeline: {run_name.name}")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(handles=[Patch(color=colors[n], label=n) for n in names], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    for cax, cname in zip((row[0] for row in axes[1:]), counter_names, strict=True):
        _plot_counter(cax, cname, {k[1]: v for k, v in counters.items() if k[0] == cname}, origin, last_end)
    axes[-1][0].set_xlabel("seconds since trace start")
    if window_s != (None, None):
        ax.set_xlim(left=window_s[0], right=window_s[1])
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return {"output": str(output), "rows": len(rows), "phases": names, "counters": len(counter_names),
            "skipped_lines": sum(s.skipped for s in stats)}
