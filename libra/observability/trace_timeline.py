"""Pool timelines of reconfigurations, read from a phase trace and drawn with matplotlib.

What a reconfiguration looks like from both pools: one row per rollout member with its lifecycle (starting,
up but not serving, serving, draining or stopping, loading weights), the stretches in which no instance
serves, and, where the trace has a training-pool resize, a row of the resize's phases and one row per
training rank with its optimizer steps; below, the requests answered per second and the ones failed or
requeued. The lifecycle comes from the spans the executor's actions leave in the controller's trace:

  reconfigure.start  (attrs member_id)  the instance is being started, until it is up
  reconfigure.drain / reconfigure.stop  (attrs member_id)  a serving instance drained / aborted, then gone
  reconfigure.swap   (attrs serving: member ids)  the serving set from the span's end on
  weight_sync.reload (a rollout instance's own file, attrs instance_id)  the instance loads weights
  rollout.generate   requests of the controller's rank (attrs outcome: completed, requeued or failed; a span
                     with an `error` attr and no outcome failed)
  reconfigure.change (attrs strategy, change, drain, trigger_ns)  one change, request to done
  checkpoint.save / reconfigure.stop / reconfigure.start / checkpoint.load (attrs pool "train", phase
                     "train_resize.<phase>")  the phases of a training-pool resize (save, stop, start, load)
  train.step         (a training rank's own file)  one optimizer step of that rank

A trace with `reconfigure.change` spans is drawn one column per change that `match` selects (e.g.
{"strategy": "blue_green"}), each from a little before its request to a little after it was done (never into
the change before or after), on its own time axis (seconds since its request); a trace without them in one
column over the whole trace.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libra.observability.trace_schema import RANK_BASE, iter_trace

STATES = ("starting", "up, not serving", "serving", "draining", "stopping")
STATE_COLORS = {
    "starting": "#c49c94",
    "up, not serving": "#aec7e8",
    "serving": "#2ca02c",
    "draining": "#9467bd",
    "stopping": "#8c564b",
}
RELOAD_COLOR = "#d62728"
UNSERVED_COLOR = "#ff9896"
OUTCOME_MARKERS = (("failed", "x", "#d62728"), ("requeued", "^", "#ff7f0e"))  # completed ones are not marked
_STOP_STATES = {"reconfigure.drain": "draining", "reconfigure.stop": "stopping"}
# a training-pool resize's phases (attr `phase` "train_resize.<key>") as drawn, in order, with their colours
TRAIN_PHASES = {"save": "saving checkpoint", "stop": "stopping ranks", "start": "starting ranks",
                "load": "loading checkpoint", "resume": "loading checkpoint"}
TRAIN_PHASE_COLORS = {"saving checkpoint": "#ffbb78", "stopping ranks": "#7f7f7f", "starting ranks": "#dbdb8d",
                      "loading checkpoint": "#e377c2"}
TRAIN_STEP_COLOR = "#17becf"
TRAIN_POOL_ROW = "training pool"


@dataclass(frozen=True)
class Segment:
    """One member in one state from `start_ns` to `end_ns` (epoch nanoseconds)."""

    state: str
    start_ns: int
    end_ns: int


@dataclass(frozen=True)
class Change:
    """One `reconfigure.change` span."""

    start_ns: int
    end_ns: int
    attrs: dict[str, Any]

    def label(self) -> str:
        a = self.attrs
        parts = [str(a.get("strategy", "?")), str(a.get("change", ""))]
        if a.get("drain") is False:
            parts.append("(abort)")
        return " ".join(p for p in parts if p)

    def matches(self, match: Mapping[str, str]) -> bool:
        return all(_text(self.attrs.get(key)) == _text(value) for key, value in match.items())


@dataclass
class _Member:
    starts: list[tuple[int, int]] = field(default_factory=list)
    stops: list[tuple[str, int, int]] = field(default_factory=list)
    reloads: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class Timeline:
    """Everything the pictures need, read from one trace."""

    origin_ns: int
    end_ns: int
    members: dict[str, _Member]
    swaps: list[tuple[int, frozenset[str]]]  # (time, serving set from then on), in time order
    requests: list[tuple[int, int, str]]  # (start, end, outcome: completed | requeued | failed)
    changes: list[Change]
    train_steps: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # training rank -> its steps
    train_phases: list[Segment] = field(default_factory=list)  # a training resize's phases (TRAIN_PHASES)

    def lifecycle(self, member_id: str) -> list[Segment]:
        """The member's states over the whole trace, in time order."""
        member = self.members[member_id]
        starts = sorted(member.starts)
        stops = sorted(member.stops, key=lambda s: s[1])
        begin = starts[0][0] if starts else self.origin_ns
        up = starts[0][1] if starts else self.origin_ns
        stop_state, stop_begin, gone = stops[-1] if stops else ("", self.end_ns, self.end_ns)
        segments = []
        if starts and up > begin:
            segments.append(Segment("starting", begin, up))
        cursor = up
        for t in [t for t, _ in self.swaps if up < t < stop_begin] + [stop_begin]:
            if t > cursor:
                segments.append(Segment(self._serving_state(member_id, cursor), cursor, t))
                cursor = t
        if stops and gone > stop_begin:
            segments.append(Segment(stop_state, stop_begin, gone))
        return _merged(segments)

    def _serving_state(self, member_id: str, t: int) -> str:
        times = [s[0] for s in self.swaps]
        i = bisect.bisect_right(times, t) - 1
        return "serving" if i >= 0 and member_id in self.swaps[i][1] else "up, not serving"

    def unserved(self, start_ns: int, end_ns: int) -> list[tuple[int, int]]:
        """The intervals within [start_ns, end_ns] in which no instance serves."""
        serving = sorted((s.start_ns, s.end_ns) for member_id in self.members
                         for s in self.lifecycle(member_id) if s.state == "serving")
        gaps, cursor = [], start_ns
        for a, b in serving:
            if a > cursor:
                gaps.append((cursor, min(a, end_ns)))
            cursor = max(cursor, b)
            if cursor >= end_ns:
                break
        if cursor < end_ns:
            gaps.append((cursor, end_ns))
        return [(a, b) for a, b in gaps if b > a]

    def answered(self, start_ns: int, end_ns: int, bin_ns: int) -> list[tuple[int, float]]:
        """(bin start, completed requests per second) of the bins of `bin_ns` from `start_ns` to `end_ns`."""
        bins = max(1, -(-(end_ns - start_ns) // bin_ns))
        counts = [0] * bins
        for _, end, outcome in self.requests:
            if outcome == "completed" and start_ns <= end < start_ns + bins * bin_ns:
                counts[(end - start_ns) // bin_ns] += 1
        return [(start_ns + i * bin_ns, n * 1e9 / bin_ns) for i, n in enumerate(counts)]

    def ended_at(self, outcome: str, start_ns: int, end_ns: int) -> list[int]:
        """When the requests with `outcome` that ended within [start_ns, end_ns] ended."""
        return [e for _, e, o in self.requests if o == outcome and start_ns <= e <= end_ns]

    def windows(self, match: Mapping[str, str], margin_ns: int) -> list[tuple[int, int, Change | None]]:
        """(from, to, change) of each column: the matching changes with a margin, or the whole trace."""
        if not self.changes:
            if match:
                raise ValueError(f"the trace has no reconfigure.change span to match {dict(match)}; drop the "
                                 "match to draw the whole trace")
            return [(self.origin_ns, self.end_ns, None)]
        chosen = [i for i, c in enumerate(self.changes) if c.matches(match)]
        if not chosen:
            known = sorted({f"strategy={c.attrs.get('strategy')} change={c.attrs.get('change')} "
                            f"drain={_text(c.attrs.get('drain'))}" for c in self.changes})
            raise ValueError(f"no reconfigure.change span matches {dict(match)}; the trace has: {'; '.join(known)}")
        windows: list[tuple[int, int, Change | None]] = []
        for i in chosen:  # a margin never reaches into the change before or after
            c = self.changes[i]
            lo = max(self.origin_ns, c.start_ns - margin_ns, self.changes[i - 1].end_ns if i else self.origin_ns)
            hi = min(self.end_ns, c.end_ns + margin_ns,
                     self.changes[i + 1].start_ns if i + 1 < len(self.changes) else self.end_ns)
            windows.append((lo, hi, c))
        return windows


def _text(value: Any) -> str:
    return str(value).lower()


def _merged(segments: list[Segment]) -> list[Segment]:
    out: list[Segment] = []
    for seg in segments:
        if out and out[-1].state == seg.state and out[-1].end_ns == seg.start_ns:
            out[-1] = Segment(seg.state, out[-1].start_ns, seg.end_ns)
        else:
            out.append(seg)
    return out


def _member_of(rec: dict[str, Any]) -> str | None:
    attrs = rec.get("attrs") or {}
    if isinstance(attrs.get("member_id"), str):
        return str(attrs["member_id"])
    if isinstance(attrs.get("instance_id"), str):
        return str(attrs["instance_id"])
    if rec["role"] == "rollout" and rec["rank"] >= RANK_BASE["rollout"]:
        return f"rollout-{rec['rank'] - RANK_BASE['rollout']}"
    return None


def read_timeline(trace_path: str | Path) -> Timeline:
    """The reconfiguration records of a trace directory (or of a run directory with traces/)."""
    _, records = iter_trace(trace_path)
    return timeline_of(records)


def timeline_of(records: Iterable[dict[str, Any]]) -> Timeline:
    members: dict[str, _Member] = {}
    swaps: list[tuple[int, frozenset[str]]] = []
    requests: list[tuple[int, int, str]] = []
    changes: list[Change] = []
    train_steps: dict[int, list[tuple[int, int]]] = {}
    train_phases: list[Segment] = []
    origin, end = None, 0
    for rec in records:
        start, stop = rec["start_ns"], rec["end_ns"]
        origin = start if origin is None else min(origin, start)
        end = max(end, stop)
        name = rec["name"]
        attrs = rec.get("attrs") or {}
        if rec.get("kind", "span") != "span":
            continue
        if attrs.get("pool") == "train" and rec["role"] == "controller":
            phase = TRAIN_PHASES.get(str(attrs.get("phase", "")).removeprefix("train_resize."))
            if phase is not None:
                train_phases.append(Segment(phase, start, stop))
        elif name == "train.step" and rec["role"] == "train":
            train_steps.setdefault(rec["rank"] - RANK_BASE["train"], []).append((start, stop))
        elif name == "reconfigure.change":
            changes.append(Change(start, stop, dict(attrs)))
        elif name == "reconfigure.swap":
            swaps.append((stop, frozenset(str(m) for m in attrs.get("serving") or ())))
        elif name == "rollout.generate" and rec["role"] == "controller":
            requests.append((start, stop, str(attrs.get("outcome") or ("failed" if "error" in attrs else "completed"))))
        elif name in ("reconfigure.start", "weight_sync.reload") or name in _STOP_STATES:
            member_id = _member_of(rec)
            if member_id is None:
                continue
            member = members.setdefault(member_id, _Member())
            if name == "reconfigure.start":
                member.starts.append((start, stop))
            elif name == "weight_sync.reload":
                member.reloads.append((start, stop))
            else:
                member.stops.append((_STOP_STATES[name], start, stop))
    if origin is None:
        raise ValueError("the trace has no valid records")
    for _, serving in swaps:
        for member_id in serving:
            members.setdefault(member_id, _Member())
    swaps.sort(key=lambda s: s[0])
    changes.sort(key=lambda c: c.start_ns)
    train_phases.sort(key=lambda seg: seg.start_ns)
    return Timeline(origin, end, members, swaps, requests, changes, train_steps, train_phases)


def _member_order(member_id: str) -> tuple[int, str]:
    tail = member_id.rsplit("-", 1)[-1]
    return (int(tail) if tail.isdigit() else 1 << 30, member_id)


def render_timeline(
    trace_path: str | Path,
    output: str | Path,
    *,
    match: Mapping[str, str] | None = None,
    margin_s: float = 5.0,
    title: str | None = None,
) -> dict[str, Any]:
    """Draw the rollout instances' lifecycles (and, with a training resize in the trace, the training pool's
    phases and ranks) of the changes `match` selects (all when empty) into `output` (PNG, SVG or PDF by its
    suffix); returns what was drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.artist import Artist
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    if margin_s < 0:
        raise ValueError(f"margin_s={margin_s}: must be >= 0")
    timeline = read_timeline(trace_path)
    if not timeline.swaps and not any(m.starts or m.stops for m in timeline.members.values()) \
            and not timeline.train_phases:
        raise ValueError(f"trace {str(trace_path)!r} has no reconfigure.start / .stop / .drain / .swap span, so no "
                         "rollout instance has a lifecycle to draw (use `libra trace plot` for the pools' Gantt)")
    windows = timeline.windows(match or {}, int(margin_s * 1e9))
    rows: list[str] = []
    for lo, hi, _ in windows:
        for member_id in timeline.members:
            if member_id not in rows and any(s.start_ns < hi and s.end_ns > lo
                                             for s in timeline.lifecycle(member_id)):
                rows.append(member_id)
    rows.sort(key=_member_order)
    train_rows = _train_rows(timeline, windows)
    if not rows and not train_rows:
        raise ValueError("no rollout instance has a lifecycle in the selected window(s): the trace holds no "
                         "reconfigure.start / reconfigure.swap spans (was it written with the executor's spans?)")
    labels = rows + train_rows
    lengths = [hi - lo for lo, hi, _ in windows]
    widths = [max(length, max(lengths) / 4) for length in lengths]
    fig, axes = plt.subplots(2, len(windows), figsize=(min(4 + 5 * len(windows), 16), 1.6 + 0.42 * len(labels) + 1.6),
                             squeeze=False, sharey="row",
                             gridspec_kw={"width_ratios": widths, "height_ratios": [max(1.5, 0.42 * len(labels)), 1.2]})
    max_rate, counted = 0.0, {outcome: 0 for outcome, _, _ in OUTCOME_MARKERS}
    any_unserved = False
    for column, (lo, hi, change) in enumerate(windows):
        zero = change.start_ns if change is not None else timeline.origin_ns
        ax, req_ax = axes[0][column], axes[1][column]

        def seconds(t: int, zero: int = zero) -> float:
            return (t - zero) / 1e9

        unserved = timeline.unserved(lo, hi)
        for a, b in unserved:
            ax.axvspan(seconds(a), seconds(b), color=UNSERVED_COLOR, alpha=0.25, linewidth=0)
        any_unserved = any_unserved or bool(unserved)
        for y, member_id in enumerate(rows):
            for seg in timeline.lifecycle(member_id):
                a, b = max(seg.start_ns, lo), min(seg.end_ns, hi)
                if b > a:
                    ax.broken_barh([(seconds(a), (b - a) / 1e9)], (y - 0.35, 0.7), facecolors=STATE_COLORS[seg.state])
            reloads = [(seconds(max(s, lo)), (min(e, hi) - max(s, lo)) / 1e9)
                       for s, e in timeline.members[member_id].reloads if e > lo and s < hi]
            if reloads:
                ax.broken_barh(reloads, (y - 0.12, 0.24), facecolors=RELOAD_COLOR)
        _draw_training(ax, timeline, train_rows, len(rows), lo, hi, seconds)
        bin_ns = max(int(1e9), (hi - lo) // 120)
        rates = timeline.answered(lo, hi, bin_ns)
        req_ax.bar([seconds(t) for t, _ in rates], [r for _, r in rates], width=bin_ns / 1e9, align="edge",
                   color="#1f77b4", linewidth=0)
        max_rate = max(max_rate, *(r for _, r in rates))
        for outcome, marker, color in OUTCOME_MARKERS:
            ended = timeline.ended_at(outcome, lo, hi)
            counted[outcome] += len(ended)
            if ended:
                req_ax.plot([seconds(t) for t in ended], [0] * len(ended), marker, color=color, markersize=7)
        for axis in (ax, req_ax):
            axis.set_xlim(seconds(lo), seconds(hi))
            axis.grid(axis="x", alpha=0.3)
            if change is not None:
                axis.axvline(0, color="black", linewidth=0.8, linestyle="--")
                axis.axvline(seconds(change.end_ns), color="black", linewidth=0.8)
                trigger = change.attrs.get("trigger_ns")
                if isinstance(trigger, int):
                    axis.axvline(seconds(trigger), color="#ff7f0e", linewidth=1.0, linestyle="--")
        ax.set_title(change.label() if change is not None else "whole trace", fontsize=10)
        req_ax.set_xlabel("seconds since the request" if change is not None else "seconds since trace start")
    axes[0][0].set_yticks(range(len(labels)), labels)
    axes[0][0].set_ylim(len(labels) - 0.5, -0.5)
    axes[1][0].set_ylabel("requests\nanswered / s")
    axes[1][0].set_ylim(-0.05 * max(1.0, max_rate), 1.1 * max(1.0, max_rate))
    handles: list[Artist] = [Patch(color=STATE_COLORS[s], label=s) for s in STATES]
    handles.append(Patch(color=RELOAD_COLOR, label="loading weights"))
    if train_rows:
        handles.append(Patch(color=TRAIN_STEP_COLOR, label="training step"))
        handles += [Patch(color=color, label=phase) for phase, color in TRAIN_PHASE_COLORS.items()]
    if any_unserved:
        handles.append(Patch(color=UNSERVED_COLOR, alpha=0.25, label="no instance serving"))
    if windows[0][2] is not None:
        handles += [Line2D([], [], color="black", linestyle="--", label="request"),
                    Line2D([], [], color="black", label="done")]
        if any(isinstance(c.attrs.get("trigger_ns"), int) for _, _, c in windows if c is not None):
            handles.append(Line2D([], [], color="#ff7f0e", linestyle="--", label="trigger"))
    handles += [Line2D([], [], color=color, marker=marker, linestyle="", label=f"{outcome} request")
                for outcome, marker, color in OUTCOME_MARKERS if counted[outcome]]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=8, frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return {"output": str(output), "rows": rows, "train_rows": train_rows,
            "columns": [c.label() if c else "whole trace" for _, _, c in windows],
            "failed_requests": counted["failed"], "requeued_requests": counted["requeued"]}


def _train_rows(timeline: Timeline, windows: list[tuple[int, int, Change | None]]) -> list[str]:
    """The training rows of the windows: the pool's row when a resize phase falls in one, then the ranks
    that step in one (none without a resize: the ranks alone are no reconfiguration)."""
    def inside(a: int, b: int) -> bool:
        return any(a < hi and b > lo for lo, hi, _ in windows)

    if not any(inside(seg.start_ns, seg.end_ns) for seg in timeline.train_phases):
        return []
    ranks = sorted(rank for rank, steps in timeline.train_steps.items() if any(inside(a, b) for a, b in steps))
    return [TRAIN_POOL_ROW, *(f"train rank {rank}" for rank in ranks)]


def _draw_training(ax: Any, timeline: Timeline, train_rows: list[str], first_y: int, lo: int, hi: int,
                   seconds: Any) -> None:
    """The training rows from `first_y` down: the resize's phases, then each rank's steps."""
    if not train_rows:
        return
    ax.axhline(first_y - 0.5, color="grey", linewidth=0.6)
    for seg in timeline.train_phases:
        a, b = max(seg.start_ns, lo), min(seg.end_ns, hi)
        if b > a:
            ax.broken_barh([(seconds(a), (b - a) / 1e9)], (first_y - 0.35, 0.7),
                           facecolors=TRAIN_PHASE_COLORS[seg.state])
    for offset, row in enumerate(train_rows[1:], start=1):
        steps = timeline.train_steps[int(row.rsplit(" ", 1)[1])]
        bars = [(seconds(max(a, lo)), (min(b, hi) - max(a, lo)) / 1e9) for a, b in steps if b > lo and a < hi]
        ax.broken_barh(bars, (first_y + offset - 0.3, 0.6), facecolors=TRAIN_STEP_COLOR)
