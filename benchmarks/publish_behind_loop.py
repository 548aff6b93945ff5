"""The weight publish behind the RL loop: how much of a publish's seconds the loop still waits for.

    python benchmarks/publish_behind_loop.py --out benchmarks/results/publish_behind_loop.json

Runs `libra launch configs/dev.yaml` (the launch of benchmarks/e2e_dev.py) three times on fresh run directories:

- `sync_inplace`: the job as it is (synchronous, `max_head_offpolicyness: 0`, in-place reload): the loop waits
  for every ACK batch before the next step;
- `lag1_inplace`: the same job with a policy lag of one step: the training ranks export at the step boundary
  and the rollout servers reload while the next step collects and trains; the loop waits for the ACKs at the
  next step's sync point;
- `lag1_restart`: the lag-1 job with process-restart reload (a new vLLM-CPU server per publish), a reload far
  longer than the dev job's steps, so most of it is still waited for.

With `--baseline-commit REV` the two lag-1 runs are also made with the code of commit REV (a git worktree of it
in a temporary folder, removed after), as `lag1_inplace_baseline` and `lag1_restart_baseline`: the same job
and the same machine, with the loop of that commit (one from before the publish ran behind the loop waits for
every ACK batch at the step boundary).

Figures per run, from its `metrics.jsonl` rows: `publishes` (rows with `sync_total_s`), `publish_s` (sum of
`sync_total_s`: from the export to the last ACK), `loop_sync_s` (sum of `time_sync_s`: what the loop waited at
sync points, the export and what was left of a reload), `export_s` (sum of `sync_export_s`, lag runs only),
`wait_share` = loop_sync_s / publish_s, `steps`, `steps_per_s` of the step loop, medians of `time_step_s`,
`time_train_s` and `time_rollout_s`, `exit_code`. `loop_sync_s` also holds the bookkeeping after the last ACK
(the served version marked, older exports pruned, the event written), so a loop that waits for every ACK batch
has a `wait_share` a little above 1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e_dev  # noqa: E402


@dataclass(frozen=True)
class Run:
    """One launch of the dev job: its overrides, whether its reloads restart the server (it then runs
    `--restart-steps` steps, else `--inplace-steps`), and whether `--baseline-commit` runs it too."""

    overrides: tuple[str, ...]
    restart_reload: bool
    with_baseline: bool


RUNS: dict[str, Run] = {
    "sync_inplace": Run(("max_head_offpolicyness=0", "rollout_weight_reload_method=inplace"), False, False),
    "lag1_inplace": Run(("max_head_offpolicyness=1", "rollout_weight_reload_method=inplace"), False, True),
    "lag1_restart": Run(("max_head_offpolicyness=1", "rollout_weight_reload_method=restart"), True, True),
}
NOT_COVERED = [
    "Logical GPUs are not metered here: the reload running behind the loop and the training step share the "
    "machine's two cores, so the overlap is of wall time; on GPUs the reload and the training step run on "
    "different devices.",
    "steps_per_s of the synchronous and the lag-1 runs also differ by the lag itself (the next batch is "
    "generated while this one trains); wait_share is the publish's own figure.",
    "The dev job's steps last well under a second, far shorter than a restart reload: a job whose training "
    "step is as long as its reload (the cluster examples: 30 s restart reload) waits for little of it; "
    "these runs do not show that case.",
    "The loop has no switch for a publish in the foreground under a lag: the lag-1 job waiting for every ACK "
    "batch is run only with --baseline-commit, on an earlier commit's code (the `*_baseline` runs).",
]


def figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The publish figures of one run's metrics rows."""
    def total(key: str) -> float:
        return sum(float(r[key]) for r in rows if isinstance(r.get(key), int | float))

    def median(key: str) -> float | None:
        values = [float(r[key]) for r in rows if isinstance(r.get(key), int | float)]
        return round(statistics.median(values), 4) if values else None

    publish_s, loop_sync_s = total("sync_total_s"), total("time_sync_s")
    loop_wall = e2e_dev.loop_wall_s(rows)
    return {
        "steps": len(rows),
        "publishes": sum(1 for r in rows if isinstance(r.get("sync_total_s"), int | float)),
        "publish_s": round(publish_s, 3),
        "loop_sync_s": round(loop_sync_s, 3),
        "export_s": round(total("sync_export_s"), 3),
        "wait_share": round(loop_sync_s / publish_s, 4) if publish_s > 0 else None,
        "steps_per_s": round(len(rows) / loop_wall, 4) if loop_wall > 0 else None,
        "median_step_s": median("time_step_s"),
        "median_train_s": median("time_train_s"),
        "median_rollout_s": median("time_rollout_s"),
        "median_publish_s": median("sync_total_s"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON result file")
    parser.add_argument("--inplace-steps", type=int, default=200, help="steps of each in-place run")
    parser.add_argument("--restart-steps", type=int, default=6, help="steps of the restart runs (a process restart each)")
    parser.add_argument("--time-limit-s", type=float, default=1200.0, help="per run")
    parser.add_argument("--baseline-commit", default="", metavar="REV",
                        help="also run the lag-1 jobs on this commit's code (see the module docstring)")
    args = parser.parse_args(argv)

    started = time.monotonic()
    result: dict[str, Any] = {"config": "configs/dev.yaml", "runs": {}}
    baseline = Path(tempfile.mkdtemp(prefix="libra-publish-baseline-")) / "repo" if args.baseline_commit else None
    plan = planned_runs(baseline)
    if baseline is not None:
        rev = subprocess.run(["git", "rev-parse", args.baseline_commit], cwd=e2e_dev.REPO, check=True,
                             capture_output=True, text=True).stdout.strip()
        subprocess.run(["git", "worktree", "add", "--detach", str(baseline), rev], cwd=e2e_dev.REPO, check=True)
        result["baseline_commit"] = rev
    failed = False
    try:
        for name, run, repo in plan:
            steps = args.restart_steps if run.restart_reload else args.inplace_steps
            failed = run_one(name, list(run.overrides), steps, repo, args, result) or failed
    finally:
        if baseline is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(baseline)], cwd=e2e_dev.REPO, check=False)
            shutil.rmtree(baseline.parent, ignore_errors=True)
    result.update(
        not_covered=NOT_COVERED,
        benchmark_wall_s=round(time.monotonic() - started, 1),
        machine={"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 1 if failed else 0


def planned_runs(baseline: Path | None) -> list[tuple[str, Run, Path]]:
    """(name, run, repository) in launch order: each baseline run right after its own, so that both meet the
    same load."""
    plan = []
    for name, run in RUNS.items():
        plan.append((name, run, e2e_dev.REPO))
        if baseline is not None and run.with_baseline:
            plan.append((f"{name}_baseline", run, baseline))
    return plan


def run_one(name: str, overrides: list[str], steps: int, repo: Path, args: argparse.Namespace,
            result: dict[str, Any]) -> bool:
    """One launch of the dev job with `overrides` for `steps` steps on `repo`'s code, its figures into `result`;
    True if it failed."""
    run_dir = tempfile.mkdtemp(prefix=f"libra-publish-{name}-")
    config = str(repo / "configs" / "dev.yaml")
    rows, code, launched_at, _, _ = e2e_dev.launch(config, run_dir, overrides, steps, args.time_limit_s, repo)
    run: dict[str, Any] = {"overrides": overrides, "max_steps": steps, "exit_code": code, "run_dir": run_dir}
    if rows:
        run.update(figures(rows), startup_s=round(e2e_dev.first_step_start(rows) - launched_at, 1))
    result["runs"][name] = run
    print(json.dumps({name: {k: run.get(k) for k in ("steps", "publishes", "wait_share", "steps_per_s")}}))
    return code != 0 or not rows


if __name__ == "__main__":
    sys.exit(main())
