"""The elastic gain: the drifting job on metered logical GPUs, elastic re-planning vs every static split.

    python benchmarks/elastic_gain.py --out benchmarks/results/elastic_gain.json           # 8 GPUs, 2 nodes
    python benchmarks/elastic_gain.py --out benchmarks/results/elastic_gain_quick.json --quick
    python benchmarks/elastic_gain.py --out benchmarks/results/elastic_gain_ehp.json --quick --only-ehp

Starts one local Ray cluster (`RayRuntime.start_nodes`: 2 nodes x 4 logical GPUs, or 1 x 4 with `--quick`)
and runs `libra launch configs/drift.yaml` on it once per policy, each with `--set` overrides, the same seed
and the same number of steps, on metered logical GPUs (`cluster.metered_cpu_per_gpu`):

- `static`: every train/rollout split that validates with `initial_allocation_strategy: configured` (two of
  them, spread out, with `--quick`); the best is the oracle baseline;
- `planner_initial`: the planner's split (`grp`), never re-planned, no rollout GPU lent to training;
- `elastic`: the planner's split with online re-planning (`runtime_online_replanning`) and elastic hybrid
  parallelism as configs/drift.yaml sets it (each training step borrows the idle rollout GPUs; the planner
  prices the training phase on them, so it chooses the split for the rollout pool).

Each run's figures come from its own `metrics.jsonl` and `events.jsonl` (benchmarks/elastic_gain_figures.py).
Then the `ehp` part: configs/dev.yaml made synchronous (`max_head_offpolicyness: 0`), 2 training and 2
rollout GPUs, without and with elastic hybrid parallelism borrowing both rollout GPUs; its figure is the
training phase's seconds per step (`time_train_s`, median after the first step; the first borrowing step
starts the borrowed workers, later ones re-attach them parked, and the first step's figures are written on
their own). Each of its two runs first waits (up to 3 minutes, `settle_s`) for the load average to fall to the
machine's cores or stop falling, as the policy runs' processes end. `--only-ehp` runs this part alone. Written
besides the issue's keys: `machine_load` (load average before and after each run: on a shared, loaded machine the
figures are not a gain measurement),
`slices_left` (metering slices found after each run; must be empty), `slice_cpu` (per run: the cores the
servers, borrowed replicas and training workers used inside their slices in each phase, and, in runs made since
the sampler reads the machine's busy time, `host_cores` and `outside_slices_cores`: the whole machine and what
ran outside the slices, benchmarks/slice_cpu.py), `speed_probe` (per run, before and after it: how fast a core
of the machine ran a fixed Python loop and how much of a core the loop got, benchmarks/speed_probe.py; runs of
one split have differed by 40 % on this machine with the same CPU in their slices) and `not_covered`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import elastic_gain_figures as fig  # noqa: E402
import slice_cpu  # noqa: E402
import speed_probe  # noqa: E402

from libra.metering.cgroup import CpuCgroup  # noqa: E402
from libra.metering.spec import PERIOD_US  # noqa: E402

GRP = fig.GRP


@dataclass(frozen=True)
class Shape:
    """The size of one form of the benchmark."""

    nodes: int
    gpus_per_node: int
    steps: int
    replan_interval: int
    static_runs: int  # 0 = every split that validates
    ehp_steps: int
    run_timeout_s: float
    extra: list[str] = field(default_factory=list)  # overrides of the drift job for this form

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


# The full form: 8 GPUs on 2 nodes, 40 steps of 24 prompts x 8 samples (training on 1, 2, 3, 4 or 6 GPUs divides
# the batch), the responses growing from 4 to 48 tokens over the first 24 steps (576 prompts), re-planned every
# 8 steps. 40 steps (not configs/drift.yaml's 60) keep the whole benchmark within its hour on 2 cores. The EHP
# part runs 20 steps: its steps take a few tenths of a second and spread widely, so the median of 5 (the earlier
# 6-step form) did not resolve its speed-up; 14 more steps cost about half a minute per run.
FULL = Shape(nodes=2, gpus_per_node=4, steps=40, replan_interval=8, static_runs=0, ehp_steps=20,
             run_timeout_s=1200.0,
             extra=["batch_size=24", "train_micro_batch_size=8", "recompute_micro_batch_size=8",
                    "task.params.ramp_prompts=576"])
# The quick form: 4 GPUs, 8 steps of 12 prompts x 4 samples, responses growing from 4 to 48 tokens over 5 steps.
QUICK = Shape(nodes=1, gpus_per_node=4, steps=8, replan_interval=3, static_runs=2, ehp_steps=3,
              run_timeout_s=600.0,
              extra=["batch_size=12", "n_samples=4", "train_micro_batch_size=4", "recompute_micro_batch_size=4",
                     "task.params.ramp_prompts=60"])


def common_overrides(shape: Shape, ray_address: str, model_dir: Path, cpu_per_gpu: float) -> list[str]:
    """What every run of the drift job shares: the cluster, metering, the step count, the model."""
    return [
        f"cluster.num_nodes={shape.nodes}", f"cluster.gpus_per_node={shape.gpus_per_node}",
        f"cluster.ray_address={ray_address}", f"cluster.metered_cpu_per_gpu={cpu_per_gpu}",
        f"model_path={model_dir}", f"total_steps={shape.steps}", "checkpoint.interval_steps=0",
        f"{GRP}.replan_interval_steps={shape.replan_interval}",
        "tracking.backends=[jsonl]", "tracking.console=plain", *shape.extra,
    ]


def replay_overrides(shape: Shape) -> list[str]:
    """The overrides of the drift job every run of `shape` shares that say what the job is (cluster shape,
    steps, batch, drift), without this machine's addresses and paths: what a replay of the runs
    (benchmarks/elastic_sim.py's calibration) loads the configuration with."""
    return [f"cluster.num_nodes={shape.nodes}", f"cluster.gpus_per_node={shape.gpus_per_node}",
            f"total_steps={shape.steps}", f"{GRP}.replan_interval_steps={shape.replan_interval}", *shape.extra]


def validate(config: Path, overrides: list[str]) -> str:
    """"" when `libra validate` would accept the job with `overrides`, else its report."""
    from libra.config import ConfigError, load

    try:
        load(str(config), overrides)
    except ConfigError as err:
        return err.report()
    return ""


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


SETTLE_MAX_S = 180.0  # the longest the EHP part waits for the machine to calm down after the policy runs
SETTLE_POLL_S = 5.0
SETTLE_WINDOW_S = 30.0  # the load has settled when it fell by less than SETTLE_FALL in this long
SETTLE_FALL = 0.1


def load_settled(samples: list[tuple[float, float]], cores: int) -> bool:
    """Whether the machine has calmed down, from (seconds, 1-minute load average) samples taken so far: the
    load is at most the cores, or it has stopped falling (less than SETTLE_FALL lower than SETTLE_WINDOW_S
    ago). The second rule ends the wait where something that stays (the benchmark's own Ray cluster) keeps
    the load above the cores: only the tail of the last run's processes is waited out."""
    if not samples:
        return False
    now, load = samples[-1]
    if load <= cores:
        return True
    earlier = [value for at, value in samples if now - at >= SETTLE_WINDOW_S]
    return bool(earlier) and earlier[-1] - load < SETTLE_FALL


def settle(max_s: float = SETTLE_MAX_S) -> float:
    """Wait until `load_settled`, at most `max_s`; the seconds waited. The EHP part's runs are short (steps of
    under a second each), so the tail of the policy runs' shutdown would otherwise weigh on the first of
    them."""
    started = time.monotonic()
    samples: list[tuple[float, float]] = []
    while True:
        samples.append((time.monotonic() - started, os.getloadavg()[0]))
        if load_settled(samples, os.cpu_count() or 1) or samples[-1][0] >= max_s:
            return round(samples[-1][0], 1)
        time.sleep(SETTLE_POLL_S)


def slices_left() -> list[str]:
    """The metering slices on this machine (every run must leave none)."""
    from libra.metering.cgroup import CgroupUnavailable, find_cpu_cgroup

    try:
        return find_cpu_cgroup().names()
    except CgroupUnavailable:
        return []


def server_pids(run_dir: Path) -> list[int]:
    path = run_dir / "rollout" / "registry.json"
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError:
        return []
    return [int(e["pid"]) for e in data.get("instances", {}).values() if e.get("pid")]


def stop_on_sigterm() -> None:
    """From now on a SIGTERM ends the benchmark as Ctrl-C does, through its `finally` blocks: the launch in
    progress is stopped (its servers and CPU slices with it) and the Ray cluster shut down. Set once the
    cluster is up: while Ray's driver starts it takes SIGTERM over (the process then dies at once)."""
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, interrupt)


def stop_group(proc: subprocess.Popen[bytes], run_dir: Path) -> None:
    """Stop a launch that outlived its time: Ctrl-C first (it stops at a step boundary and cleans up), then
    kill its process group and the rollout servers it registered (they lead sessions of their own)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            pass
    for pgid in [proc.pid, *server_pids(run_dir)]:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def metering_cgroup() -> CpuCgroup | None:
    """The CPU controller the job's metering slices are made in (None without a writable one)."""
    from libra.metering.cgroup import CgroupUnavailable, find_cpu_cgroup

    try:
        return find_cpu_cgroup()
    except CgroupUnavailable:
        return None


def launch(config: Path, run_dir: Path, overrides: list[str], steps: int, timeout_s: float,
           sampler: slice_cpu.SliceCpuSampler | None = None) -> dict[str, Any]:
    """`libra launch` as a user runs it; returns exit code, seconds and load around it. With `sampler`, the
    slices' processes are sampled while it runs."""
    cmd = [sys.executable, "-m", "libra.cli.main", "launch", str(config), "--run-dir", str(run_dir),
           "--max-steps", str(steps), "--console", "plain"]
    for item in overrides:
        cmd += ["--set", item]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log_path = run_dir.parent / f"{run_dir.name}.launch.log"
    load_before = load_average()
    probe_before = speed_probe.probe()
    started = time.monotonic()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "RAY_AUTH_MODE": "disabled"})
        if sampler is not None:
            sampler.start()
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if sampler is not None:
                sampler.stop()
            stop_group(proc, run_dir)
    launch_s = round(time.monotonic() - started, 1)
    out: dict[str, Any] = {"exit_code": code, "launch_s": launch_s, "load_before": load_before,
                           "load_after": load_average(), "slices_left": slices_left(),
                           "speed_probe": {"before": probe_before, "after": speed_probe.probe()}}
    if code != 0:
        tail = log_path.read_text(errors="replace")[-1500:]
        out["error"] = f"exit {code} (None: killed after {timeout_s:.0f} s); log tail: {tail}"
    return out


def run_policy(policy: str, config: Path, run_dir: Path, overrides: list[str], shape: Shape) -> dict[str, Any]:
    print(f"[elastic_gain] {policy}: {' '.join(overrides)}", flush=True)
    cgroup = metering_cgroup()
    sampler = slice_cpu.SliceCpuSampler(cgroup) if cgroup is not None else None
    outcome = launch(config, run_dir, overrides, shape.steps, shape.run_timeout_s, sampler)
    rows = fig.read_jsonl(run_dir / "metrics.jsonl")
    events = fig.read_jsonl(run_dir / "events.jsonl")
    figures: dict[str, Any] = fig.run_figures(policy, rows, events) if rows else {"policy": policy, "steps": 0}
    figures.update(outcome, run_dir=str(run_dir))
    if sampler is not None and rows:
        # where the slices' CPU went in each phase (a parked replica beside its lending server, for one)
        figures["slice_cpu"] = slice_cpu.cpu_by_phase(sampler.snapshots, slice_cpu.phase_intervals(fig.last_session(rows)))
    if figures.get("samples_per_s") and figures.get("launch_s"):  # start-up and shutdown included
        figures["samples_per_s_whole_launch"] = round(
            float(figures["samples_per_s"]) * float(figures["wall_s"]) / float(figures["launch_s"]), 4)
    shown = {k: figures.get(k) for k in ("split", "steps", "samples_per_s", "exit_code")}
    print(f"[elastic_gain] {policy}: {json.dumps(shown)}", flush=True)
    return figures


def ehp_runs(work: Path, shape: Shape, ray_address: str, cpu_per_gpu: float, rounds: int = 1) -> dict[str, Any]:
    """configs/dev.yaml, synchronous, 2 training + 2 rollout GPUs, without and with EHP borrowing both; with
    `rounds` > 1 the pair runs that many times, in alternating order (without first in the first round), and
    the figures pool every round (`elastic_gain_figures.ehp_rounds`); the first round's own figures stay
    beside them (`first_round`)."""
    config = REPO / "configs" / "dev.yaml"
    base = ["cluster.num_nodes=1", "cluster.gpus_per_node=4", f"cluster.ray_address={ray_address}",
            f"cluster.metered_cpu_per_gpu={cpu_per_gpu}", f"model_path={work / 'dev-model'}",
            "train_gpus=2", "rollout_gpus=2", "max_head_offpolicyness=0", f"total_steps={shape.ehp_steps}",
            f"{GRP}.initial_allocation_strategy=configured", f"{GRP}.memory_budget_dry_run_enabled=false",
            f"{GRP}.runtime_dynamic_reconfiguration_enabled=true", f"{GRP}.runtime_reconfigure_training=true",
            f"{GRP}.elastic_hybrid_replica_size_gpus=1", "task.eval_interval=0", "checkpoint.interval_steps=0",
            "tracking.backends=[jsonl]", "tracking.console=plain"]
    keep = {"without": 2, "with": 0}  # rollout GPUs EHP may never borrow
    played: list[dict[str, dict[str, Any]]] = []
    for index in range(rounds):
        order = ("without", "with") if index % 2 == 0 else ("with", "without")
        runs: dict[str, dict[str, Any]] = {}
        for name in order:
            run_dir = work / (f"ehp-{name}" if index == 0 else f"ehp-{name}-{index + 1}")
            overrides = [*base, f"{GRP}.elastic_hybrid_min_rollout_gpus={keep[name]}"]
            waited = settle()
            print(f"[elastic_gain] ehp {name}, round {index + 1} of {rounds} (after {waited:g} s for the load to "
                  "settle)", flush=True)
            runs[name] = launch(config, run_dir, overrides, shape.ehp_steps, shape.run_timeout_s)
            runs[name]["settle_s"] = waited
            runs[name]["rows"] = fig.read_jsonl(run_dir / "metrics.jsonl")
        played.append(runs)
    result: dict[str, Any] = {"job": "configs/dev.yaml, synchronous (max_head_offpolicyness 0), train 2 | rollout 2"}
    try:
        first = fig.ehp_figures(played[0]["without"]["rows"], played[0]["with"]["rows"], borrowed_gpus=2)
        if rounds == 1:
            result.update(first)
        else:
            pooled = fig.ehp_rounds([(r["without"]["rows"], r["with"]["rows"]) for r in played])
            for entry, runs in zip(pooled["rounds"], played, strict=True):
                entry["order"] = list(runs)
            result.update({**first, **pooled, "first_round": first})
    except ValueError as exc:
        result["error"] = str(exc)
    for index, runs in enumerate(played):
        for name, outcome in runs.items():
            outcome.pop("rows")
            result[f"run_{name}" if index == 0 else f"run_{name}_{index + 1}"] = outcome
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="result JSON file")
    parser.add_argument("--quick", action="store_true", help="the small form: 4 GPUs on one node, 8 steps, two "
                                                             "static splits, 3 EHP steps")
    parser.add_argument("--config", default=str(REPO / "configs" / "drift.yaml"), help="the drifting job")
    parser.add_argument("--cpu-per-gpu", type=float, default=0.2, help="cluster.metered_cpu_per_gpu")
    parser.add_argument("--work-dir", default="", help="where the runs go (default: a temporary folder, removed)")
    parser.add_argument("--skip-ehp", action="store_true", help="leave out the EHP part")
    parser.add_argument("--only-ehp", action="store_true", help="run the EHP part alone (no policy runs)")
    parser.add_argument("--ehp-steps", type=int, default=0, help="steps of each EHP run (default: 3 quick, 20 full)")
    parser.add_argument("--ehp-rounds", type=int, default=1, help="run the EHP pair (without, with) this many times, "
                                                                  "in alternating order, and pool the figures")
    parser.add_argument("--image", default="", help="also draw the split-over-time picture to this PNG "
                                                     "(benchmarks/elastic_gain_plot.py)")
    parser.add_argument("--rerun", nargs="+", default=[], metavar="RUN",
                        help="run only these runs again (static-T-R, planner-initial, elastic) and replace them in "
                             "the result at --out, keeping its other runs and its EHP part; --reason says why")
    parser.add_argument("--repeat", nargs="+", default=[], metavar="RUN",
                        help="run these runs once more and add them to the result at --out beside the earlier ones "
                             "(as RUN-repeat-K), keeping every other run and its EHP part; --reason says why")
    parser.add_argument("--reason", default="", help="why the --rerun or --repeat runs were run (written to the "
                                                     "result)")
    args = parser.parse_args(argv)
    if args.rerun and args.repeat:
        parser.error("--rerun and --repeat exclude each other")
    again = args.rerun or args.repeat
    if again and (args.only_ehp or not args.reason or not Path(args.out).exists()):
        parser.error("--rerun and --repeat need an existing --out result, a --reason, and no --only-ehp")
    if args.only_ehp and args.skip_ehp:
        parser.error("--only-ehp and --skip-ehp exclude each other")
    if args.ehp_rounds < 1:
        parser.error(f"--ehp-rounds {args.ehp_rounds}: give at least 1")
    if args.ehp_steps < 0 or args.ehp_steps == 1:
        parser.error(f"--ehp-steps {args.ehp_steps}: give at least 2 (the first step is the warm-up)")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    shape = QUICK if args.quick else FULL
    if args.ehp_steps:
        shape = replace(shape, ehp_steps=args.ehp_steps)
    config = Path(args.config).resolve()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="libra-gain-")).resolve()
    from libra.cluster.ray_runtime import RayRuntime

    earlier: dict[str, Any] = json.loads(Path(args.out).read_text()) if again else {}
    started = time.monotonic()
    ray_tmp = tempfile.mkdtemp(prefix="libra-gain-ray-")  # short: Ray's socket paths must fit AF_UNIX
    runtime = RayRuntime.start_nodes(num_nodes=shape.nodes, gpus_per_node=shape.gpus_per_node, tmp_dir=ray_tmp,
                                     namespace="libra-gain")
    stop_on_sigterm()
    if args.only_ehp:
        return only_ehp(args, shape, runtime, ray_tmp, work, started)
    try:
        base = common_overrides(shape, runtime.address, work / "drift-model", args.cpu_per_gpu)
        allowed, refused = fig.static_splits(shape.gpus, lambda extra: validate(config, [*base, *extra]))
        if not allowed:
            raise SystemExit("no static split validates: " + "; ".join(r.reason for r in refused))
        chosen = fig.pick_spread(allowed, shape.static_runs) if shape.static_runs else allowed
        plans: list[tuple[str, str, list[str]]] = [
            ("static", f"static-{s.train_gpus}-{s.rollout_gpus}", fig.static_overrides(s)) for s in chosen]
        plans += [("planner_initial", "planner-initial", fig.planner_overrides(False, shape.gpus)),
                  ("elastic", "elastic", fig.planner_overrides(True, shape.gpus))]
        if again:
            unknown = sorted(set(again) - {name for _, name, _ in plans})
            if unknown:
                raise SystemExit(f"--{'rerun' if args.rerun else 'repeat'} {' '.join(unknown)}: not a run of this "
                                 f"form; runs: {', '.join(name for _, name, _ in plans)}")
            plans = [plan for plan in plans if plan[1] in again]
        if args.repeat:
            earlier_names = {Path(r.get("run_dir", "")).name for r in earlier.get("runs", [])}
            plans = [(policy, repeat_name(name, earlier_names), extra) for policy, name, extra in plans]
        for policy, _, extra in plans:
            reason = validate(config, [*base, *extra])
            if reason:
                raise SystemExit(f"the {policy} run does not validate: {reason}")
        runs = [run_policy(policy, config, work / name, [*base, *extra], shape) for policy, name, extra in plans]
        ehp = {} if args.skip_ehp or again else ehp_runs(work, shape, runtime.address, args.cpu_per_gpu,
                                                         args.ehp_rounds)
    finally:
        runtime.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    if args.rerun:
        runs = replaced_runs(earlier, runs, args.reason)
    elif args.repeat:
        runs = repeated_runs(earlier, runs, args.reason)
    complete = [r for r in runs if r.get("steps") == shape.steps and r.get("exit_code") == 0]
    result: dict[str, Any] = {
        "metered": True,
        "cpu_per_gpu": args.cpu_per_gpu,
        "gpus": shape.gpus,
        "nodes": shape.nodes,
        "form": "quick" if args.quick else "full",
        "config": str(config.relative_to(REPO)) if config.is_relative_to(REPO) else str(config),
        "steps": shape.steps,
        "overrides": replay_overrides(shape),
        "static_splits_allowed": [s.label() for s in allowed],
        "static_splits_refused": [{"split": r.split.label(), "reason": r.reason} for r in refused],
        "runs": runs,
    }
    try:
        result.update(fig.gain(complete))
    except ValueError as exc:
        result.update(static_best_samples_per_s=None, elastic_samples_per_s=None, gain=None, gain_error=str(exc))
    result["ehp"] = earlier.get("ehp", {}) if again else ehp
    result["machine_load"] = [{"run": r.get("run_dir", ""), "before": r.get("load_before"),
                               "after": r.get("load_after")} for r in runs]
    result["not_covered"] = not_covered(args.quick, shape, allowed, chosen, result)
    result["benchmark_wall_s"] = round(time.monotonic() - started, 1)
    if again:
        result["benchmark_wall_s"] = earlier.get("benchmark_wall_s")
        kind = {"repeated": list(args.repeat)} if args.repeat else {}
        result["reruns"] = [*earlier.get("reruns", []), {"runs": list(again), **kind, "reason": args.reason,
                                                         "wall_s": round(time.monotonic() - started, 1)}]
        result["not_covered"].append(
            "Some runs were run again after the others, in a separate launch of the benchmark on the same machine "
            "(`reruns` says which and why; a repeated run is added beside the first, as RUN-repeat-K); "
            "benchmark_wall_s is the first, whole run's.")
    result["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"[elastic_gain] wrote {args.out}", flush=True)
    if args.image:
        import elastic_gain_plot

        elastic_gain_plot.draw(result, Path(args.image))
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if len(complete) == len(runs) else 1


def repeat_name(name: str, taken: set[str]) -> str:
    """`name-repeat-K` for the first K >= 1 not in `taken`."""
    k = 1
    while f"{name}-repeat-{k}" in taken:
        k += 1
    return f"{name}-repeat-{k}"


def repeated_runs(earlier: dict[str, Any], fresh: list[dict[str, Any]], reason: str) -> list[dict[str, Any]]:
    """Every run of an earlier result, then the `fresh` repeats (named RUN-repeat-K), each marked with why."""
    return [*earlier.get("runs", []), *({**run, "repeat": {"reason": reason}} for run in fresh)]


def replaced_runs(earlier: dict[str, Any], fresh: list[dict[str, Any]], reason: str) -> list[dict[str, Any]]:
    """The runs of an earlier result with those of the same folder name replaced by `fresh` (in their place),
    each replacement marked with why it was run again and what the replaced run had reached."""
    by_name = {Path(r["run_dir"]).name: r for r in fresh}
    out = []
    for run in earlier.get("runs", []):
        name = Path(run.get("run_dir", "")).name
        if name in by_name:
            new = dict(by_name.pop(name))
            new["rerun"] = {"reason": reason, "replaced": {k: run.get(k) for k in
                                                          ("steps", "samples_per_s", "exit_code", "error")}}
            out.append(new)
        else:
            out.append(run)
    return out + list(by_name.values())


def only_ehp(args: argparse.Namespace, shape: Shape, runtime: Any, ray_tmp: str, work: Path,
             started: float) -> int:
    """`--only-ehp`: the EHP part alone, written with the machine and the load it ran under."""
    try:
        ehp = ehp_runs(work, shape, runtime.address, args.cpu_per_gpu, args.ehp_rounds)
    finally:
        runtime.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    cores = os.cpu_count() or 1
    launched = [run for name, run in ehp.items() if name.startswith("run_") and isinstance(run, dict)]
    loads = [x for run in launched for key in ("load_before", "load_after") for x in (run.get(key) or [0.0])[:1]]
    notes = [
        "train_phase_s_without / train_phase_s_with are medians over the steps after the first: the first "
        "borrowing step starts the borrowed workers (first_attach_s, train_phase_s_with_first_step); the later "
        "ones re-attach them parked (steps_that_reused). train_phase_s_*_mean_all_steps include the first step.",
        "Logical GPUs are CPU slices of cluster.metered_cpu_per_gpu cores; a borrowed rank runs in the slice of "
        "the GPU it borrows, beside the lending server (resident, idle while the training phase runs).",
        period_note(args.cpu_per_gpu),
    ]
    if args.ehp_rounds > 1:
        notes.append(f"The pair of runs ran {args.ehp_rounds} times, in alternating order (rounds[].order); "
                     "train_phase_s_without / train_phase_s_with / speedup / breakdown pool every round's steps "
                     "after its warm-up step, speedup_per_round gives each round's own ratio, and first_round (also "
                     "the top-level fields other than those) the first round's figures.")
    if loads and max(loads) > 0.5 * cores:
        notes.append(f"The machine was shared and loaded (1-minute load average up to {max(loads)} on {cores} "
                     "cores, see run_without/run_with): other work competed for the cores the metered slices "
                     "share, so the figures carry that noise.")
    result: dict[str, Any] = {
        "metered": True,
        "cpu_per_gpu": args.cpu_per_gpu,
        "form": "quick" if args.quick else "full",
        "ehp_steps": shape.ehp_steps,
        "ehp_rounds": args.ehp_rounds,
        "ehp": ehp,
        "not_covered": notes,
        "benchmark_wall_s": round(time.monotonic() - started, 1),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"[elastic_gain] wrote {args.out}", flush=True)
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    ok = all(run.get("exit_code") == 0 for run in launched) and "error" not in ehp
    return 0 if ok else 1


def period_note(cpu_per_gpu: float) -> str:
    """How the kernel meters a slice within its CFS period, which a GPU does not do."""
    period_ms = PERIOD_US / 1000
    return (f"A slice's quota is counted per CFS period ({period_ms:g} ms, libra.metering.spec.PERIOD_US): a slice "
            f"that idled may spend one period's quota ({cpu_per_gpu * period_ms:g} ms of CPU per logical GPU) at "
            "full core speed, a burst a GPU does not have; breakdown keeps CPU seconds (*_cpu_s) beside wall "
            "seconds, so their ratio shows the share of a core each part ran at.")


def not_covered(quick: bool, shape: Shape, allowed: list[fig.Split], chosen: list[fig.Split],
                result: dict[str, Any]) -> list[str]:
    """What the figure does not say, written into the result so it travels with it."""
    notes = []
    runs = result["runs"]
    # Each run's own load (its metered slices, the controller, Ray) shows in the next run's load_before, so
    # other work is judged from the load before the first run, and the runs' load against the core count.
    first = (runs[0].get("load_before") or [0.0])[0] if runs else 0.0
    loads = [x for r in runs for x in (r.get("load_before") or [0.0])[:1] + (r.get("load_after") or [0.0])[:1]]
    cores = os.cpu_count() or 1
    if first > 0.5 * cores or (loads and max(loads) > cores):
        notes.append(f"The machine was shared and loaded (1-minute load average {first} before the first run, up "
                     f"to {max(loads)} on {cores} cores, see machine_load): the metered slices competed with other "
                     "work, so these figures are not a gain measurement.")
    by_split: dict[str, list[float]] = {}
    for r in runs:
        if not r.get("reconfigurations") and not r.get("ehp_borrowing_steps") and r.get("samples_per_s"):
            by_split.setdefault(r["split"], []).append(float(r["samples_per_s"]))
    repeated = {split: (min(v), max(v)) for split, v in by_split.items() if len(v) > 1}
    if repeated:
        split, (low, high) = max(repeated.items(), key=lambda kv: kv[1][1] / kv[1][0])
        notes.append(f"Runs of the same split with no reconfiguration differ by run-to-run spread alone: {split} "
                     f"ran at {low} to {high} samples/s ({high / low - 1:.0%} apart), so a gain below that spread "
                     "is not resolved by this form.")
    if quick:
        notes.append(f"Quick form: {shape.gpus} logical GPUs on {shape.nodes} node, {shape.steps} steps, "
                     f"{len(chosen)} of the {len(allowed)} static splits that validate; it shows the benchmark "
                     "works, it does not measure the gain (the full form runs 8 GPUs on 2 nodes).")
    notes.append("Logical GPUs are CPU slices of cluster.metered_cpu_per_gpu cores: a pool's capacity follows its "
                 "GPU count, but memory bandwidth, caches and the unmetered controller and Ray are shared.")
    notes.append(period_note(result["cpu_per_gpu"]))
    if any("slice_cpu" in r for r in runs):
        notes.append("slice_cpu (cores each kind of process used in the rollout and training slices, per phase, steps "
                     "after the first) comes from samples every 0.5 s of the slices' processes; a process that "
                     "started and ended between two samples is missed, and the sampler itself runs outside the "
                     "slices, beside the controller. A process counts for a slice in an interval only if it was in that "
                     "slice at both of its samples: parked borrowed ranks leave their lent slices after each step "
                     "and join them again at the next attach, so their CPU while parked shows under left_slices "
                     "and the part of a step's work done in the interval of the join under moving (both outside "
                     "the slices, in outside_slices_cores; runs sampled before this split show neither); "
                     "borrowed_rank_cores (the slowest borrowed rank's "
                     "CPU seconds over its wall seconds while it computed) shows the share of a core it ran at. "
                     "Where a phase has host_cores (the machine's busy cores) and "
                     "outside_slices_cores (host_cores less the slices' processes: the controller, Ray, this "
                     "benchmark and anything else on the machine), they come from the same samples.")
    notes.append("wall_s is the step loop (first step start to last step end); start-up (Ray join, vLLM-CPU "
                 "servers, Megatron init, and in the elastic run the borrowed training replicas started and parked "
                 "before the first step) is in launch_s and not in samples_per_s; samples_per_s_whole_launch "
                 "divides by the whole launch instead.")
    if result.get("gain") is None:
        notes.append("No gain is given: " + result.get("gain_error", "the runs did not all reach the same number "
                                                                       "of steps"))
    return notes


if __name__ == "__main__":
    sys.exit(main())
