"""The picture of the measured-gain benchmark: the training pool's GPUs over the step loop (its own GPUs, plus
the rollout GPUs its steps borrowed) next to samples per second, for the elastic run, the planner's initial
split and the best static split.

    python benchmarks/elastic_gain_plot.py benchmarks/results/elastic_gain.json cluster_manual/images/elastic_gain.png

Reads each run's `per_step` series from the result; a result written before runs carried them is completed
from the run's own `metrics.jsonl` when its `run_dir` still exists (`--from-run-dirs`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import elastic_gain_figures as fig  # noqa: E402

WINDOW = 4  # steps in the moving window of samples/s


def windowed_rate(series: dict[str, list[float]], window: int = WINDOW) -> tuple[list[float], list[float]]:
    """(end of each step, samples/s over the last `window` steps up to it): the first window starts at 0."""
    ends, samples = series["elapsed_s"], series["samples"]
    times, rates = [], []
    for i, end in enumerate(ends):
        first = max(0, i - window + 1)
        start = ends[first - 1] if first > 0 else 0.0
        if end > start:
            times.append(end)
            rates.append(sum(samples[first:i + 1]) / (end - start))
    return times, rates


def chosen_runs(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The elastic run, the planner's initial split and the best static split, in that order."""
    runs = result["runs"]
    best = result.get("static_best_split")
    picked = [r for r in runs if r["policy"] == "elastic"] + [r for r in runs if r["policy"] == "planner_initial"]
    picked += [r for r in runs if r["policy"] == "static" and r["split"] == best][:1]
    return picked


def fill_from_run_dirs(result: dict[str, Any]) -> None:
    for run in result["runs"]:
        run_dir = Path(run.get("run_dir", ""))
        if "per_step" not in run and (run_dir / "metrics.jsonl").exists():
            run["per_step"] = fig.step_series(fig.last_session(fig.read_jsonl(run_dir / "metrics.jsonl")))


def draw(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in chosen_runs(result) if r.get("per_step")]
    if not runs:
        raise SystemExit("no run of the result carries per_step series: rerun the benchmark, or pass "
                         "--from-run-dirs while the runs' folders exist")
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for run in runs:
        series = run["per_step"]
        label = f"{run['policy']} ({run['split']})"
        training = [t + b for t, b in zip(series["train_gpus"], series["borrowed_gpus"], strict=True)]
        top.step(series["elapsed_s"], training, where="pre", label=label)
        times, rates = windowed_rate(series)
        bottom.plot(times, rates, label=label)
    top.set_ylabel("training GPUs\n(own + borrowed)")
    top.set_ylim(0, max(result.get("gpus", 8), 1) + 0.5)
    top.legend(loc="lower right", fontsize=8)
    bottom.set_ylabel(f"samples/s ({WINDOW}-step window)")
    bottom.set_xlabel("seconds into the step loop")
    figure.suptitle(f"{result.get('config', '')}: {result.get('gpus')} metered logical GPUs, "
                    f"gain {result.get('gain')}", fontsize=10)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("result", help="benchmarks/results/elastic_gain.json")
    parser.add_argument("out", help="the PNG to write")
    parser.add_argument("--from-run-dirs", action="store_true",
                        help="complete runs without per_step series from their run folders")
    args = parser.parse_args(argv)
    result = json.loads(Path(args.result).read_text())
    if args.from_run_dirs:
        fill_from_run_dirs(result)
    draw(result, Path(args.out))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
