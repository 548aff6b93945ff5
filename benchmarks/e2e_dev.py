"""End-to-end benchmark of the development job: `libra launch configs/dev.yaml` as a newcomer runs it.

Launches the job in a subprocess on a fresh run directory, waits for it to finish (or for the time limit)
and computes, from the run directory it wrote:

- time_to_reward_0_8_s: seconds from the launch command until the moving average (5 steps) of the batch
  reward first reaches 0.8 (null if it never does); also given from the first training step;
- final_reward: mean batch reward of the last 5 steps;
- steps_per_s: training steps per second of the step loop;
- rollout_tokens_per_s: generated tokens per second of rollout (batch collection) time, and per second of
  the step loop;
- controller_overhead_frac: share of the step loop's wall time outside rollout (batch collection),
  training and weight sync. Evaluation and checkpoints count as overhead for the time the loop waits for
  them (an evaluation runs beside the next step's rollout, so only its unfinished part is waited for);
- final_eval_accuracy: the last evaluation's accuracy on copy_first's evaluation prompts, lists never trained on
  whose answer is one of the same 5 first values as in training (in-distribution; it does not measure
  generalisation).

    python benchmarks/e2e_dev.py --out benchmarks/results/e2e_dev.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TARGET = 0.8
WINDOW = 5


def moving_average(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1): i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def first_step_start(rows: list[dict[str, Any]]) -> float:
    """Wall-clock time the first step of these metrics rows started."""
    return float(rows[0]["wall_time"]) - float(rows[0].get("time_step_s", 0.0))


def loop_wall_s(rows: list[dict[str, Any]]) -> float:
    """Seconds of the step loop from the first row's step start to the last row's end."""
    return float(rows[-1]["elapsed_s"]) - (float(rows[0]["elapsed_s"]) - float(rows[0].get("time_step_s", 0.0)))


def summarize(rows: list[dict[str, Any]], launched_at: float) -> dict[str, Any]:
    """The benchmark figures from metrics.jsonl rows of one session."""
    if not rows:
        raise ValueError("the run wrote no metrics rows")
    rewards = [float(r["reward_mean"]) for r in rows]
    smooth = moving_average(rewards, WINDOW)
    first_start = first_step_start(rows)
    reached = next((i for i, v in enumerate(smooth) if v >= TARGET and i + 1 >= min(WINDOW, len(rows))), None)
    loop_wall = loop_wall_s(rows)
    phase = {p: sum(float(r.get(f"time_{p}_s", 0.0)) for r in rows) for p in ("rollout", "train", "sync", "eval",
                                                                            "checkpoint")}
    tokens = sum(float(r.get("response_tokens", 0.0)) for r in rows)
    busy = phase["rollout"] + phase["train"] + phase["sync"]
    evals = [r["eval_accuracy"] for r in rows if "eval_accuracy" in r]
    return {
        "time_to_reward_0_8_s": None if reached is None else round(float(rows[reached]["wall_time"]) - launched_at, 1),
        "time_to_reward_0_8_from_first_step_s": None if reached is None else round(
            float(rows[reached]["wall_time"]) - first_start, 1),
        "step_reached_0_8": None if reached is None else int(rows[reached]["step"]),
        "final_reward": round(sum(rewards[-WINDOW:]) / len(rewards[-WINDOW:]), 4),
        "initial_reward": round(sum(rewards[:WINDOW]) / len(rewards[:WINDOW]), 4),
        "final_eval_accuracy": evals[-1] if evals else None,
        "steps": len(rows),
        "steps_per_s": round(len(rows) / loop_wall, 4) if loop_wall > 0 else None,
        "rollout_tokens_per_s": round(tokens / phase["rollout"], 1) if phase["rollout"] > 0 else None,
        "rollout_tokens_per_wall_s": round(tokens / loop_wall, 1) if loop_wall > 0 else None,
        "controller_overhead_frac": round(max(0.0, 1.0 - busy / loop_wall), 4) if loop_wall > 0 else None,
        "startup_s": round(first_start - launched_at, 1),
        "loop_wall_s": round(loop_wall, 1),
        "phase_s": {k: round(v, 2) for k, v in phase.items()},
        "max_policy_lag": max(int(r.get("policy_lag_max", 0)) for r in rows),
        "discarded_samples": int(rows[-1].get("discarded_samples_total", 0)),
        "reward_curve": [round(v, 4) for v in rewards],
    }


def launch(config: str, run_dir: str, overrides: list[str], max_steps: int, time_limit_s: float,
           repo: Path = REPO) -> tuple[list[dict[str, Any]], int, float, float, list[str]]:
    """`libra launch CONFIG` on a fresh run directory, stopped (SIGINT) after `time_limit_s`: its metrics rows,
    exit code, launch and end times and command. `repo` is the checkout whose code runs (its working
    directory)."""
    command = [sys.executable, "-m", "libra.cli.main", "launch", config, "--run-dir", run_dir, "--console", "plain"]
    for override in overrides:
        command += ["--set", override]
    if max_steps:
        command += ["--max-steps", str(max_steps)]
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")
    launched_at = time.time()
    proc = subprocess.Popen(command, cwd=repo, env=env)
    try:
        returncode = proc.wait(timeout=time_limit_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        returncode = proc.wait(timeout=600)
    finished_at = time.time()
    metrics = Path(run_dir, "metrics.jsonl")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    return rows, returncode, launched_at, finished_at, command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON result file")
    parser.add_argument("--config", default=str(REPO / "configs" / "dev.yaml"))
    parser.add_argument("--run-dir", default="", help="fresh run directory (default: a new temporary one)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--max-steps", type=int, default=0)
    parser.add_argument("--time-limit-s", type=float, default=1800.0, help="stop the job (SIGINT) after this long")
    args = parser.parse_args(argv)

    run_dir = args.run_dir or tempfile.mkdtemp(prefix="libra-e2e-dev-")
    if Path(run_dir, "config.yaml").exists():
        parser.error(f"--run-dir {run_dir} already holds a run; the benchmark needs a fresh one")
    rows, returncode, launched_at, finished_at, command = launch(args.config, run_dir, args.overrides,
                                                                 args.max_steps, args.time_limit_s)
    if not rows:
        print(f"the launch exited with {returncode} before finishing a training step; see {run_dir}", file=sys.stderr)
        return 1
    result = summarize(rows, launched_at)
    result.update(
        command=" ".join(command[1:]),
        exit_code=returncode,
        total_wall_s=round(finished_at - launched_at, 1),
        run_dir=run_dir,
        target=TARGET,
        window_steps=WINDOW,
        machine={"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("time_to_reward_0_8_s", "final_reward", "steps_per_s",
                                             "rollout_tokens_per_s", "controller_overhead_frac")}))
    return 0 if returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
