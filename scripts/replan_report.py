"""The online re-planning decisions of one run, as a JSON result: every decision that was judged (kept,
requested, refused, plan only) with its numbers, how many were skipped and why, the reconfigurations they
requested with their measured duration, and the measured samples/s on each split the run trained on.

    python scripts/replan_report.py RUN_DIR --out benchmarks/results/replan_run.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from libra.run_dir import read_jsonl


def split_of(row: dict[str, Any]) -> str:
    return f"train {row.get('train_gpus')} GPUs | rollout {row.get('rollout_instances')} instance(s)"


def changes(events: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(requested, done) times of every reconfiguration (done: infinity while it never finished)."""
    started = {e.get("generation"): float(e["ts"]) for e in events if e.get("kind") == "reconfigure_requested"}
    done = {e.get("generation"): float(e["ts"]) for e in events if e.get("kind") == "reconfigure_done"}
    return [(t, done.get(g, float("inf"))) for g, t in started.items()]


def measured_splits(rows: list[dict[str, Any]], changing: list[tuple[float, float]]) -> list[dict[str, Any]]:
    """Consecutive runs of steps on one split, with their samples/s; a step that ended while a
    reconfiguration ran (rows record the split being moved to) is counted as `changing to` that split."""
    spans: list[dict[str, Any]] = []
    for row in rows:
        split = split_of(row)
        ended = float(row.get("wall_time") or 0.0)
        if any(start <= ended <= end for start, end in changing):
            split = f"changing to {split}"
        if not spans or spans[-1]["split"] != split:
            spans.append({"split": split, "first_step": row["step"], "samples": 0.0, "wall_s": 0.0})
        span = spans[-1]
        span["last_step"] = row["step"]
        span["samples"] += float(row.get("samples") or 0.0)
        span["wall_s"] += float(row.get("interval_s") or row.get("time_step_s") or 0.0)
    for span in spans:
        span["samples_per_s"] = round(span["samples"] / span["wall_s"], 3) if span["wall_s"] > 0 else None
        span["wall_s"] = round(span["wall_s"], 3)
    return spans


def report(run_dir: Path) -> dict[str, Any]:
    events = list(read_jsonl(run_dir / "events.jsonl"))
    rows = list(read_jsonl(run_dir / "metrics.jsonl"))
    decisions = [e for e in events if e.get("kind") == "replan_decision"]
    skipped = Counter(str(d.get("message", "")).split(" (")[0] for d in decisions if d.get("action") == "skipped")
    return {
        "run_dir": str(run_dir),
        "steps": len(rows),
        "decisions": len(decisions),
        "judged": [d for d in decisions if d.get("action") != "skipped"],
        "skipped": dict(skipped),
        "reconfigurations": [e for e in events if e.get("kind") in ("reconfigure_requested", "reconfigure_done")],
        "splits": measured_splits(rows, changes(events)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if not (args.run_dir / "events.jsonl").exists():
        print(f"error: {args.run_dir} has no events.jsonl; pass a run directory", file=sys.stderr)
        return 2
    args.out.write_text(json.dumps(report(args.run_dir), indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
