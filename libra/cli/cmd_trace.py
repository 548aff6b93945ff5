"""`libra trace convert|summary|diff|plot|timeline`: phase traces to Perfetto JSON, tables, comparisons,
pictures (the pools' Gantt, the rollout instances through reconfigurations).

Exit codes: 0 success; 1 only for `diff --fail-on-regression` when a phase regressed; 2 bad input (missing
trace, no trace files, bad option value).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from libra.observability import trace_analysis, trace_convert, trace_timeline
from libra.observability.trace_analysis import PhaseDiff, TraceSummary

EXIT_OK, EXIT_REGRESSION, EXIT_USAGE = 0, 1, 2


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("trace", help="convert, summarize, compare and plot phase traces")
    sub = parser.add_subparsers(dest="trace_command", metavar="ACTION")
    parser.set_defaults(func=lambda args: (parser.print_help(), EXIT_USAGE)[1])

    convert = sub.add_parser("convert", help="merge rank files into Chrome Trace JSON (Perfetto)")
    trace_convert.add_arguments(convert)
    convert.set_defaults(func=_guard(trace_convert.run))

    summary = sub.add_parser("summary", help="per-phase durations, share of step time, idle time per pool")
    summary.add_argument("trace", help="trace directory (or run directory with traces/)")
    summary.add_argument("--json", action="store_true", help="print JSON instead of a table")
    summary.set_defaults(func=_guard(_summary))

    diff = sub.add_parser("diff", help="compare two runs phase by phase")
    diff.add_argument("base", help="baseline trace directory")
    diff.add_argument("new", help="new trace directory")
    diff.add_argument("--threshold", type=float, default=1.1,
                      help="flag a phase whose p50 or total per step grew beyond this ratio (default 1.1)")
    diff.add_argument("--fail-on-regression", action="store_true", help="exit 1 when a phase regressed")
    diff.add_argument("--json", action="store_true", help="print JSON instead of a table")
    diff.set_defaults(func=_guard(_diff))

    plot = sub.add_parser("plot", help="draw a Gantt timeline of the pools (PNG, SVG or PDF)")
    plot.add_argument("trace", help="trace directory (or run directory with traces/)")
    plot.add_argument("-o", "--output", required=True, help="output image file, e.g. timeline.png")
    plot.add_argument("--title", default=None)
    plot.add_argument("--from-s", type=float, default=None, help="draw from this second since the trace start")
    plot.add_argument("--to-s", type=float, default=None, help="draw up to this second since the trace start")
    plot.set_defaults(func=_guard(_plot))

    timeline = sub.add_parser("timeline", help="draw the rollout instances' lifecycles through reconfigurations",
                              description="One row per rollout instance (starting, up, serving, draining, loading "
                                          "weights), with a training-pool resize in the trace its phases and one row "
                                          "per training rank's steps, and the requests in flight, one column per "
                                          "reconfigure.change span that every --match selects (the whole trace "
                                          "without such spans).")
    timeline.add_argument("trace", help="trace directory (or run directory with traces/)")
    timeline.add_argument("-o", "--out", required=True, help="output image file, e.g. blue_green.png")
    timeline.add_argument("--match", action="append", default=[], metavar="KEY=VALUE",
                          help="keep the changes whose attribute KEY is VALUE, e.g. strategy=blue_green (repeatable)")
    timeline.add_argument("--margin", type=float, default=5.0, help="seconds drawn before and after each change")
    timeline.add_argument("--title", default=None)
    timeline.set_defaults(func=_guard(_timeline))


def _guard(func: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        try:
            return int(func(args))
        except (FileNotFoundError, NotADirectoryError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_USAGE

    return run


def _console() -> Console:
    # piped output gets a fixed width wide enough for the tables instead of rich's 80 columns
    return Console() if sys.stdout.isatty() else Console(width=150)


def _ms(ns: float | None) -> str:
    if ns is None:
        return "-"
    return f"{ns / 1e6:,.3f}"


def _ratio(value: float | None) -> str:
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else f"{value:.2f}x"


def _summary(args: argparse.Namespace) -> int:
    summary = trace_analysis.summarize(args.trace)
    if args.json:
        print(json.dumps(summary.as_dict(), indent=2))
        return EXIT_OK
    _print_summary(summary)
    return EXIT_OK


def _print_summary(summary: TraceSummary) -> None:
    console = _console()
    table = Table(title=f"Phases ({summary.steps} steps, step time {_ms(summary.step_time_ns)} ms per rank)")
    table.add_column("phase", no_wrap=True)
    for col in ("count", "ranks", "p50 ms", "p95 ms", "max ms", "total ms", "share of step"):
        table.add_column(col, justify="right")
    for p in summary.phases.values():
        share = "-" if p.share_of_step is None else f"{100 * p.share_of_step:.1f}%"
        name = p.name if p.registered else f"{p.name} (unregistered)"
        approx = "" if p.percentiles_exact else "~"
        table.add_row(name, str(p.count), str(p.ranks), approx + _ms(p.p50_ns), approx + _ms(p.p95_ns),
                      _ms(p.max_ns), _ms(p.total_ns), share)
    console.print(table)
    pools = Table(title="Pools")
    for col in ("pool", "ranks", "wall ms", "busy ms", "idle ms", "idle"):
        pools.add_column(col, justify="left" if col == "pool" else "right")
    for pool in summary.pools.values():
        approx = "" if pool.idle_exact else "~"
        pools.add_row(pool.pool, str(pool.ranks), _ms(pool.wall_ns), approx + _ms(pool.busy_ns),
                      approx + _ms(pool.idle_ns), f"{approx}{100 * pool.idle_fraction:.1f}%")
    console.print(pools)
    if summary.unregistered:
        console.print(f"unregistered phase names: {', '.join(summary.unregistered)}")
    if summary.skipped_lines:
        console.print(f"skipped {summary.skipped_lines} malformed or cut-off line(s)")


def _diff(args: argparse.Namespace) -> int:
    base = trace_analysis.summarize(args.base)
    new = trace_analysis.summarize(args.new)
    rows = trace_analysis.diff_summaries(base, new, threshold=args.threshold)
    regressions = [r.name for r in rows if r.regressed]
    if args.json:
        print(json.dumps({"threshold": args.threshold, "regressions": regressions,
                          "phases": [_diff_json(r) for r in rows]}, indent=2))
    else:
        _print_diff(rows, args.threshold, base.steps > 0 and new.steps > 0)
    return EXIT_REGRESSION if regressions and args.fail_on_regression else EXIT_OK


def _diff_json(row: PhaseDiff) -> dict[str, Any]:
    out = dict(row.__dict__)
    for key in ("p50_ratio", "total_ratio"):
        if out[key] is not None and math.isinf(out[key]):
            out[key] = "inf"
    return out


def _print_diff(rows: list[PhaseDiff], threshold: float, per_step: bool) -> None:
    console = _console()
    total_label = "total/step ms" if per_step else "total ms"
    table = Table(title=f"Phase diff (regression: ratio > {threshold:g})")
    table.add_column("phase", no_wrap=True)
    for col in ("base p50 ms", "new p50 ms", "p50", f"base {total_label}", f"new {total_label}", "total", ""):
        table.add_column(col, justify="right")
    for r in rows:
        flag = "[red]REGRESSION[/red]" if r.regressed else ("" if r.status == "both" else r.status)
        table.add_row(r.name, _ms(r.base_p50_ns), _ms(r.new_p50_ns), _ratio(r.p50_ratio),
                      _ms(r.base_total_per_step_ns), _ms(r.new_total_per_step_ns), _ratio(r.total_ratio), flag)
    console.print(table)
    regressed = [r.name for r in rows if r.regressed]
    console.print(f"{len(regressed)} regression(s)" + (f": {', '.join(regressed)}" if regressed else ""))


def _timeline(args: argparse.Namespace) -> int:
    match = {}
    for item in args.match:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--match {item!r}: write KEY=VALUE, e.g. strategy=blue_green")
        match[key] = value
    info = trace_timeline.render_timeline(args.trace, args.out, match=match, margin_s=args.margin, title=args.title)
    print(f"wrote {info['output']}: {len(info['rows'])} instances, columns {', '.join(info['columns'])}, "
          f"{info['failed_requests']} failed request(s)")
    return EXIT_OK


def _plot(args: argparse.Namespace) -> int:
    if args.from_s is not None and args.to_s is not None and args.from_s >= args.to_s:
        print(f"error: --from-s {args.from_s:g} must be below --to-s {args.to_s:g}", file=sys.stderr)
        return EXIT_USAGE
    info = trace_analysis.plot_timeline(args.trace, args.output, title=args.title,
                                        window_s=(args.from_s, args.to_s))
    print(f"wrote {info['output']}: {info['rows']} rows, {len(info['phases'])} phases, "
          f"{info['counters']} counter series")
    return EXIT_OK
