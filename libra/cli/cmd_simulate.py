"""`libra simulate CONFIG [--steps N] [--policy P ...] [--gpus N] [--out FILE]`: simulate the job at cluster scale.

Maps the configuration to the planner's inputs (`libra.planning.planner_inputs`), optionally scales it to
`--gpus` GPUs (same node, GPU type and per-GPU batch: `planner.sim.scenario.scaled_inputs`), draws a drifting,
long-tailed workload of response lengths, runs each policy of `planner.sim` on the same draws, prints a
comparison table, and with `--out FILE` writes the comparison as JSON and the split-over-time and throughput
picture beside it (`FILE` with the suffix `.png`, or `--plot`). Assumptions: cluster_manual/simulator.md.
Exit 0 when the simulation ran, 2 for an invalid configuration or arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Any

from libra.cli.config_args import add_config_arguments, load_or_report

if TYPE_CHECKING:  # the heavy modules load when the command runs, not when `libra` builds its parser
    from planner.sim.scenario import Comparison

EXIT_OK = 0
EXIT_INVALID = 2
# planner.sim.policies.ALL_POLICIES, spelled out so that building the parser does not load the simulator
POLICY_CHOICES = ("best_static", "planner_initial", "elastic", "ehp", "elastic_ehp", "colocated",
                  "online_replanning")
STRATEGY_CHOICES = ("diff", "restart_all", "blue_green", "prewarm", "cluster_swap")
DEFAULT_START_FRACTION = 0.1  # of max_new_tokens: mean response length at the start of the job
DEFAULT_END_FRACTION = 0.8  # ... and at its end (before truncation at max_new_tokens)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "simulate", help="simulate the job at cluster scale and compare split policies",
        description="Discrete-event simulation of the job (continuous-batching rollout with KV-cache limits, "
                    "drifting long-tailed response lengths, training steps from the cost model, weight syncs, "
                    "reconfigurations, node failures) under each split policy; prints a comparison table.",
    )
    add_config_arguments(parser, example="configs/qwen3-30b-a3b-64gpu.yaml")
    parser.add_argument("--steps", type=int, default=0, help="training steps to simulate (default: total_steps)")
    parser.add_argument("--policy", dest="policies", action="append", choices=POLICY_CHOICES, default=[],
                        help="a policy to run; repeatable (default: all)")
    parser.add_argument("--gpus", type=int, default=0,
                        help="scale the job to this many GPUs (whole nodes; the per-GPU batch is kept)")
    parser.add_argument("--strategy", choices=STRATEGY_CHOICES, default=None,
                        help="reconfiguration strategy of the re-planning policies (elastic, elastic_ehp, "
                             "online_replanning) "
                             "(default: global_resource_planner.runtime_rollout_reconfigure_strategy)")
    parser.add_argument("--reload-method", choices=("restart", "inplace"), default=None,
                        help="weight reload method (default: rollout_weight_reload_method)")
    parser.add_argument("--start-mean", type=float, default=0.0,
                        help=f"mean response tokens at the start (default {DEFAULT_START_FRACTION} x max_new_tokens)")
    parser.add_argument("--end-mean", type=float, default=0.0,
                        help=f"mean response tokens at the end (default {DEFAULT_END_FRACTION} x max_new_tokens)")
    parser.add_argument("--sigma", type=float, default=0.8, help="log-normal shape of the response lengths")
    parser.add_argument("--ramp", type=float, default=1.0,
                        help="fraction of the job over which the mean rises linearly from --start-mean to "
                             "--end-mean, then stays (the `drift` task's curve; default 1.0: the whole job)")
    parser.add_argument("--no-drift", action="store_true", help="keep the mean response length at --start-mean")
    parser.add_argument("--failures-per-node-hour", type=float, default=0.0, help="node failure rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the response lengths and failures")
    parser.add_argument("--out", default="", help="write the comparison as JSON here (and the picture beside it)")
    parser.add_argument("--plot", default="", help="write the picture here (PNG)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from libra.planning import planner_inputs
    from planner.hardware import UnknownGPUError
    from planner.model_spec import ModelSpecError
    from planner.sim.engine import SimOptions
    from planner.sim.lengths import LengthModel
    from planner.sim.scenario import build_job, compare, scaled_inputs
    from planner.workload import PlannerInputError

    cfg = load_or_report(args, planning=True)
    if cfg is None:
        return EXIT_INVALID
    grp = cfg.global_resource_planner
    try:
        inputs = planner_inputs(cfg)
        if args.gpus:
            inputs = scaled_inputs(inputs, args.gpus)
        max_new = inputs.workload.max_new_tokens
        start = args.start_mean or DEFAULT_START_FRACTION * max_new
        lengths = LengthModel(start_mean=start, end_mean=args.end_mean or DEFAULT_END_FRACTION * max_new,
                              max_new_tokens=max_new, sigma=args.sigma, ramp=args.ramp, drift=not args.no_drift)
        steps = args.steps or cfg.total_steps
        options = SimOptions(steps=steps, seed=args.seed,
                             reconfigure_strategy=args.strategy or grp.runtime_rollout_reconfigure_strategy,
                             node_failures_per_node_hour=args.failures_per_node_hour,
                             ehp_min_rollout_gpus=grp.elastic_hybrid_min_rollout_gpus,
                             replan_interval_steps=grp.replan_interval_steps, replan_min_gain=grp.replan_min_gain)
        job = build_job(inputs, lengths, steps, args.seed, reload_method=args.reload_method or
                        cfg.rollout_weight_reload_method, reload_strategy=cfg.rollout_weight_reload_strategy)
        result = compare(job, options, tuple(args.policies) or POLICY_CHOICES)
    except (ModelSpecError, UnknownGPUError, PlannerInputError, ValueError) as err:
        problems = getattr(err, "problems", None) or [str(err)]
        print(f"{args.config}: cannot simulate:", file=sys.stderr)
        for line in problems:
            print(f"  {line}", file=sys.stderr)
        return EXIT_INVALID
    console = Console(width=160, highlight=False)
    render(result, console, args.config)
    plot = args.plot or (os.path.splitext(args.out)[0] + ".png" if args.out else "")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(document(result), fh, indent=2)
        console.print(f"comparison written to {args.out}")
    if plot:
        draw(result, plot, title=f"{os.path.basename(args.config)} on {job.total_gpus} GPUs")
        console.print(f"picture written to {plot}")
    return EXIT_OK


def document(result: Comparison) -> dict[str, Any]:
    """The comparison as JSON: the job, each policy's totals, split timeline, step ends and decisions."""
    job = result.job
    w = job.inputs.workload
    policies = {}
    for name, r in result.results.items():
        policies[name] = {**r.summary(), "splits": [list(s) for s in r.splits],
                          "step_end_s": [round(float(t), 3) for t in r.step_end_s],
                          "decisions": r.decisions}
    return {"gpus": job.total_gpus, "model": job.inputs.model.name, "gpu": job.inputs.cluster.gpu.name,
            "samples_per_step": w.samples_per_step, "max_head_offpolicyness": w.max_head_offpolicyness,
            "reload_method": job.inputs.rollout.reload_method, "planner_initial": result.start.label(),
            "mean_response_tokens": [round(job.batches.mean(k), 1) for k in range(job.batches.steps)],
            "gain_elastic_over_best_static": result.gain(), "policies": policies,
            "statics": [{"split": s.initial, "samples_per_s": round(s.samples_per_s, 4)} for s in result.statics]}


def render(result: Comparison, console: Any, source: str) -> None:
    from rich.table import Table

    job = result.job
    w = job.inputs.workload
    console.print(f"[bold]Simulation[/bold] of {source}: {job.inputs.model.name} on {job.total_gpus} "
                  f"{job.inputs.cluster.gpu.name}, {w.samples_per_step} samples per step, "
                  f"{f'async (max_head_offpolicyness {w.max_head_offpolicyness})' if w.is_async else 'sync'}, "
                  f"reload {job.inputs.rollout.reload_method}; mean response "
                  f"{job.batches.mean(0):.0f} -> {job.batches.mean(job.batches.steps - 1):.0f} tokens")
    table = Table(title_justify="left")
    for column in ("policy", "samples/s", "vs best static", "GPU idle", "wall h", "reconfig.", "failures",
                   "split (initial)"):
        table.add_column(column, justify="left" if column in ("policy", "split (initial)") else "right")
    best = result.results.get("best_static")
    for name, r in result.results.items():
        ratio = f"{r.samples_per_s / best.samples_per_s:.2f}x" if best else "-"
        table.add_row(name, f"{r.samples_per_s:.1f}", ratio, f"{r.gpu_idle_frac:.0%}", f"{r.wall_s / 3600:.2f}",
                      str(r.reconfigurations), str(r.failures), r.initial)
    console.print(table)
    for name, r in result.results.items():
        if r.outcome != "completed":
            console.print(f"{name}: ended early ({r.outcome}): {r.outcome_detail}")
    for name in ("elastic", "elastic_ehp", "online_replanning"):
        replanned = result.results.get(name)
        if replanned is None or not replanned.decisions:
            continue
        changes = [d for d in replanned.decisions if d["change"]]
        undone = sum(1 for d in changes if d.get("undo"))
        console.print(f"{name}: {len(replanned.decisions)} re-planning decisions, {len(changes)} changes"
                      + (f" ({undone} of them undoing the one before)" if undone else ""))
        for d in changes[:10]:
            console.print(f"  step {d['step']}: {d['target']} ({d['reason']})")


def draw(result: Comparison, path: str, title: str = "") -> None:
    """Two panels: training GPUs over time per policy, and samples per second over time per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    per_step = result.job.batches.count
    for name, r in result.results.items():
        if name == "colocated":
            continue
        hours = [t / 3600 for t, _, _ in r.splits] + [r.wall_s / 3600]
        train = [g for _, g, _ in r.splits] + [r.splits[-1][1]]
        top.step(hours, train, where="post", label=f"{name}: {r.initial.split(' (')[0]}")
    for name, r in result.results.items():
        ends = np.asarray(r.step_end_s)
        if len(ends) < 2:
            continue
        window = max(1, len(ends) // 20)
        rate = per_step[window: len(ends)] * window / np.maximum(ends[window:] - ends[:-window], 1e-9)
        bottom.plot(ends[window:] / 3600, rate, label=name)
    top.set_ylabel("training GPUs")
    top.legend(fontsize=7, loc="best")
    bottom.set_ylabel(f"samples/s (moving, {max(1, len(per_step) // 20)} steps)")
    bottom.set_xlabel("hours")
    bottom.legend(fontsize=7, loc="best")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
