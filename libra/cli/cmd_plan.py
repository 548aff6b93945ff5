"""`libra plan CONFIG [--set KEY=VALUE ...] [--json] [--explain]`: run the Global Resource Planner.

Prints the chosen train/rollout split and layouts, the per-GPU memory breakdown against capacity, the
predicted phase times and throughput, the options that would change a phase dominating the step (and by how
much), the next best alternatives and the pruning summary (`--explain`: every pruned candidate and why). `--json` prints the stable document described in cluster_manual/planner.md.
Exit 0 when a feasible plan exists, 2 for an invalid configuration or an infeasible job (with what to change).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from typing import TYPE_CHECKING, Any

from libra.cli.config_args import add_config_arguments, load_or_report

if TYPE_CHECKING:  # the heavy modules load when the command runs, not when `libra` builds its parser
    from rich.console import Console
    from rich.table import Table

    from planner.memory import MemoryEstimate
    from planner.plan import Evaluation, Plan

EXIT_OK = 0
EXIT_INVALID = 2


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan", help="plan the train/rollout split and parallel layouts of a job",
        description="Search the train/rollout GPU split and the training layout (TP x PP x CP x EP) that "
                    "maximise RL throughput within memory, and print the plan (exit 2 if none fits).",
    )
    add_config_arguments(parser, example="configs/qwen2.5-7b-8gpu.yaml")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON (schema in planner.md)")
    parser.add_argument("--explain", action="store_true", help="list every pruned candidate and why")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from libra.planning import plan_job
    from planner.hardware import UnknownGPUError
    from planner.model_spec import ModelSpecError
    from planner.report import plan_dict
    from planner.workload import PlannerInputError

    cfg = load_or_report(args, planning=True)
    if cfg is None:
        return EXIT_INVALID
    for warning in cfg.warnings:  # includes what a launch would refuse (a model Libra can plan but not run)
        print(f"{args.config}: warning: {warning}", file=sys.stderr)
    try:
        plan = plan_job(cfg)
    except (ModelSpecError, UnknownGPUError, PlannerInputError) as err:
        problems = getattr(err, "problems", None) or [str(err)]
        print(f"{args.config}: cannot plan:", file=sys.stderr)
        for line in problems:
            print(f"  {line}", file=sys.stderr)
        return EXIT_INVALID
    if args.json:
        print(json.dumps(plan_dict(plan, explain=args.explain), indent=2))
    else:
        width = shutil.get_terminal_size((140, 40)).columns if sys.stdout.isatty() else 140
        render(plan, Console(width=max(width, 100), highlight=False), args.config, args.explain)
    return EXIT_OK if plan.feasible else EXIT_INVALID


# --------------------------------------------------------------------------------------------------- render
def _size(value: float) -> str:
    """Bytes in decimal units, 3 significant digits (GB, MB, kB)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.0f} B"


def _params(count: float) -> str:
    return f"{count / 1e9:.2f} B" if count >= 1e9 else f"{count / 1e6:.2f} M"


def _title(plan: Plan, source: str) -> str:
    m, c, w = plan.inputs.model, plan.inputs.cluster, plan.inputs.workload
    moe = f", MoE {m.num_experts} experts / {m.num_experts_per_tok} active" if m.is_moe else ""
    mode = (f"async (max_head_offpolicyness {w.max_head_offpolicyness})" if w.is_async else "sync")
    return (f"[bold]Plan[/bold] for {source}: {m.name} ({_params(m.total_params)} params{moe}) on "
            f"{c.num_nodes} x {c.gpus_per_node} {c.gpu.name} -- strategy {plan.strategy}, {mode}")


def _split_lines(ev: Evaluation) -> list[str]:
    c, lay = ev.candidate, ev.candidate.layout
    vpp = f" x VPP {lay.vpp}" if lay.vpp > 1 else ""
    return [
        f"training  {c.train_gpus:>5} GPUs  TP {lay.tp} x PP {lay.pp}{vpp} x CP {lay.cp} x EP {lay.ep}, DP {c.dp}, "
        f"{int(ev.train['microbatches'])} micro-batches per DP rank per step",
        f"rollout   {c.rollout_gpus:>5} GPUs  {c.rollout_instances} instances x TP {c.rollout_tp}, "
        f"{int(ev.rollout['batch_per_instance'])} concurrent sequences per instance "
        f"(KV cache holds {ev.kv_capacity_sequences} full-context sequences)",
    ]


def _memory_table(title: str, est: MemoryEstimate) -> Table:
    from rich.table import Table

    from planner.memory import MOMENTS

    table = Table(title=f"{title} -- {est.where}", title_justify="left", show_lines=False)
    table.add_column("term")
    table.add_column("phase")
    table.add_column("size", justify="right")
    table.add_column("how")
    at_peak = MOMENTS.get(est.peak_phase, ())
    for t in est.terms:
        if t.bytes == 0 and t.phase != "reserve":
            continue
        mark = "" if t.counted else " (not counted)"
        peak = " *" if t.phase in at_peak else ""
        table.add_row(t.name, t.phase + peak, _size(t.bytes), t.formula + mark)
    status = "fits" if est.fits else "[bold red]DOES NOT FIT[/bold red]"
    moment = "static" if est.peak_phase == "static" else f"static + {est.peak_phase} (*)"
    table.add_row("[bold]peak[/bold]", moment, f"[bold]{_size(est.peak_bytes)}[/bold]",
                  f"of {_size(est.capacity_bytes)} capacity, headroom {_size(est.headroom_bytes)}: {status}")
    if est.host_bytes:
        table.add_row("host memory", "host", _size(est.host_bytes), "offloaded optimizer state per GPU")
    return table


def _times_table(ev: Evaluation) -> Table:
    from rich.table import Table

    t, r = ev.train, ev.rollout
    table = Table(title="Predicted phase times per step", title_justify="left")
    table.add_column("phase")
    table.add_column("seconds", justify="right")
    table.add_column("detail")
    table.add_row("generation", f"{r['generation_s']:.2f}",
                  f"{r['tokens_per_s']:,.0f} tok/s over the pool, decode step {r['decode_step_s'] * 1e3:.1f} ms")
    table.add_row("weight sync", f"{r['weight_sync_s']:.2f}", "publish + reload on every instance (per step)")
    table.add_row("log-prob recompute", f"{t['logprob_recompute_s']:.2f}", "forward of every sample on the training pool")
    detail = (f"compute {t['compute_s']:.2f}, TP {t['tp_comm_s']:.2f}, CP {t['cp_comm_s']:.2f}, EP {t['ep_comm_s']:.2f}, "
              f"PP p2p {t['pp_comm_s']:.2f}, DP {t['dp_comm_s']:.2f}, bubble {t['bubble_ratio']:.1%}")
    table.add_row("train", f"{t['train_s']:.2f}", detail)
    table.add_row("[bold]step[/bold]", f"[bold]{ev.step_s:.2f}[/bold]",
                  f"[bold]{ev.samples_per_s:.3f} samples/s, {ev.tokens_per_s:,.0f} tokens/s[/bold]")
    table.add_row("ratios", "", f"TP comm/compute {t['tp_comm_ratio']:.3f}, EP all-to-all/compute "
                                f"{t['ep_comm_ratio']:.3f}, pipeline bubble {t['bubble_ratio']:.3f}")
    return table


def _alternatives_table(plan: Plan) -> Table:
    from rich.table import Table

    assert plan.chosen is not None
    best = plan.chosen.samples_per_s
    table = Table(title="Next best alternatives", title_justify="left")
    for name in ("#", "training", "rollout", "samples/s", "vs chosen", "train peak"):
        table.add_column(name, justify="right" if name in ("#", "samples/s", "vs chosen", "train peak") else "left")
    rows = [("baseline", plan.baseline)] if plan.baseline is not None else []
    rows += [(str(i), a) for i, a in enumerate(plan.alternatives, 1)]
    for label, ev in rows:
        c = ev.candidate
        extra = "" if ev.feasible else " (" + ", ".join(v.code for v in ev.violations) + ")"
        table.add_row(label, f"{c.train_gpus} GPUs {c.layout.label()} dp={c.dp}",
                      f"{c.rollout_gpus} GPUs {c.rollout_instances} x tp={c.rollout_tp}{extra}",
                      f"{ev.samples_per_s:.3f}", f"{ev.samples_per_s / best - 1:+.1%}",
                      _size(ev.train_memory.peak_bytes))
    return table


def _pruned_table(plan: Plan) -> Table:
    from rich.table import Table

    table = Table(title="Pruned candidates", title_justify="left")
    table.add_column("candidates")
    table.add_column("reason")
    table.add_column("why")
    for p in plan.pruned:
        table.add_row(p.subject(), p.code, p.reason)
    return table


def render(plan: Plan, console: Console, source: str, explain: bool) -> None:
    console.print(_title(plan, source))
    ev = plan.chosen
    if ev is not None:
        heading = "Chosen split" if plan.feasible else "Configured split (not feasible)"
        console.print(f"\n[bold]{heading}[/bold]")
        for line in _split_lines(ev):
            console.print("  " + line)
        console.print()
        console.print(_memory_table("Memory per training GPU", ev.train_memory))
        console.print(_memory_table("Memory per rollout GPU", ev.rollout_memory))
        console.print(_times_table(ev))
        if plan.alternatives or plan.baseline is not None:
            console.print(_alternatives_table(plan))
    if plan.phase_advice:
        console.print("\n[bold]Options that change the largest phases[/bold] (the search re-run with each)")
        for a in plan.phase_advice:
            console.print(f"  - {a.message()}")
    if plan.warnings:
        console.print("\n[bold yellow]Warnings[/bold yellow]")
        for w in plan.warnings:
            console.print(f"  - {w}")
    counts = plan.pruned_counts()
    console.print(f"\n{plan.candidates_evaluated} candidates evaluated in {plan.search_s * 1e3:.0f} ms; pruned: "
                  + (", ".join(f"{k} {v}" for k, v in counts.items()) or "none")
                  + ("" if explain or not counts else " (--explain lists each)"))
    if explain and plan.pruned:
        console.print(_pruned_table(plan))
    if not plan.feasible:
        console.print("\n[bold red]No feasible plan.[/bold red] What to change:")
        for s in plan.suggestions:
            console.print(f"  - {s}")
