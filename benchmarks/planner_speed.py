"""Planner search speed: wall and CPU seconds of one `planner.search.search` call on one core, for clusters
of 8, 64, 512 and 4096 GPUs with a dense and a mixture-of-experts model.

The process is pinned to one CPU core and numpy to one thread before numpy is imported. Each case is run
`--repeat` times and the fastest run is reported; `cpu_s` is the CPU time on the pinned core (a shared
machine inflates wall time, not CPU time). Search spaces are wide: TP
1-8, PP every divisor of the layer count up to 16, CP 1-4, EP every power of two dividing the experts up to
64, rollout TP 1-8; splits on one node (8 GPUs) and, for the largest cluster, on every GPU.

Per case it also reports:
  candidates            the enumerated count: (train layouts + rollout TPs) x training-pool sizes
  candidates_costed     how many of them reached the cost and memory models: (layout, size) pairs that passed the
                        structural and divisibility rules, plus (rollout TP, size) pairs whose rollout TP passed
                        its rules (read from the plan's pruning records, see `costed_candidates`)
  cold_s                a fresh Python process, pinned to one core, that imports the planner, reads the model's
                        config.json and plans this case, timed from spawn to exit (median of --cold-repeat runs;
                        cold_import_s is the import part, measured inside the process)
and `libra_plan_cold_s`: `libra plan` on configs/qwen3-30b-a3b-64gpu.yaml in a fresh process (loads and validates
the YAML, plans, adds advice and prints the table), median of --cold-repeat runs.

Writes ``{"cases": [{"model", "gpus", "granularity", "search_s", "cpu_s", "cold_s", "candidates", ...}]}``.
Usage: python benchmarks/planner_speed.py --out benchmarks/results/planner_speed.json
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

_STARTED = time.perf_counter()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from planner.hardware import get_gpu  # noqa: E402
from planner.model_spec import ModelSpec, load_model_spec  # noqa: E402
from planner.plan import Plan  # noqa: E402
from planner.search import search  # noqa: E402
from planner.workload import ClusterSpec, PlannerInputs, SearchSpace, TrainOptions, Workload  # noqa: E402

IMPORT_S = time.perf_counter() - _STARTED  # the planner's imports, as a cold process pays them
MODELS = os.path.join(ROOT, "configs", "models")
MODEL_DIRS = {"qwen2.5-32b (dense)": "qwen2.5-32b", "qwen3-30b-a3b (MoE)": "qwen3-30b-a3b"}
SIZES = ((8, 1), (64, 8), (512, 8), (4096, 8), (4096, 1))
PLAN_CONFIG = os.path.join("configs", "qwen3-30b-a3b-64gpu.yaml")
TARGET_S = 1.0


def inputs_for(spec: ModelSpec, gpus: int, granularity: int) -> PlannerInputs:
    layers = spec.num_layers
    experts = spec.num_experts
    return PlannerInputs(
        model=spec,
        cluster=ClusterSpec(num_nodes=gpus // 8, gpus_per_node=8, gpu=get_gpu("H200")),
        workload=Workload(batch_size=max(8, gpus // 4), n_samples=16, max_model_len=8192, max_new_tokens=6144,
                          max_head_offpolicyness=1, recompute_logprobs=True),
        train=TrainOptions(recompute_granularity="full", use_distributed_optimizer=True),
        space=SearchSpace(
            allowed_tp=(1, 2, 4, 8),
            allowed_pp=tuple(p for p in range(1, 17) if layers % p == 0),
            allowed_cp=(1, 2, 4),
            allowed_ep=tuple(e for e in (1, 2, 4, 8, 16, 32, 64) if not experts or experts % e == 0)
            if experts else (1,),
            allowed_rollout_tp=(1, 2, 4, 8),
            allocation_granularity_gpus=granularity,
            bubble_ratio_threshold=0.25, comm_compute_ratio_threshold=0.5, ep_comm_compute_ratio_threshold=2.0,
        ),
    )


NOT_COSTED = frozenset({"split_divisibility", "ep_data_parallel", "batch_divisibility", "interleave_microbatches"})


def costed_candidates(plan: Plan) -> int:
    """Candidates that reached the cost and memory models, from what the plan records. Of the enumerated
    (layout + rollout TP) x size candidates, a layout or rollout TP pruned by a structural rule (or, for a
    rollout TP, by its KV capacity) never does, and neither does a (layout, size) pair pruned by a divisibility
    rule; the cost and memory rules (comm ratios, bubble, peak memory) prune only candidates that were costed.
    A rollout TP that passes its rules is costed at every size (sizes it cannot split are dropped after)."""
    sizes = len(plan.splits)
    if sizes == 0:
        return 0
    rollout_tps = len(set(plan.inputs.space.allowed_rollout_tp))
    layouts = plan.candidates_evaluated // sizes - rollout_tps
    structural = sum(1 for p in plan.pruned if p.kind == "train_layout")
    not_costed = sum(p.size or sizes for p in plan.pruned if p.kind == "train_split" and p.code in NOT_COSTED)
    rollout_dropped = sum(1 for p in plan.pruned if p.kind == "rollout" and p.code != "rollout_split")
    return (layouts - structural) * sizes - not_costed + (rollout_tps - rollout_dropped) * sizes


def run_case(name: str, spec: ModelSpec, gpus: int, granularity: int, repeat: int) -> dict[str, Any]:
    inputs = inputs_for(spec, gpus, granularity)
    walls, cpus = [], []
    plan = None
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        plan = search(inputs)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    assert plan is not None
    return {
        "model": name, "gpus": gpus, "granularity": granularity,
        "search_s": round(min(walls), 4), "cpu_s": round(min(cpus), 4),
        "candidates": plan.candidates_evaluated, "candidates_costed": costed_candidates(plan),
        "splits": len(plan.splits), "feasible": plan.feasible,
        "chosen": plan.chosen.candidate.label() if plan.chosen else None,
        "samples_per_s": round(plan.chosen.samples_per_s, 4) if plan.chosen else None,
    }


def _one_core() -> set[int]:
    return {min(os.sched_getaffinity(0))} if hasattr(os, "sched_getaffinity") else set()


def cold_run(command: list[str], core: set[int]) -> tuple[float, str]:
    """Wall seconds of `command` in a fresh process pinned to `core`, from spawn to exit, and its stdout."""
    def pin() -> None:
        if core:
            os.sched_setaffinity(0, core)

    env = dict(os.environ, PYTHONPATH=ROOT)
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, preexec_fn=pin,
                          timeout=600, check=False)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}: {done.stderr[-2000:]}")
    return wall, done.stdout


def cold_case(name: str, gpus: int, granularity: int, repeat: int, core: set[int]) -> dict[str, float]:
    """Median spawn-to-exit seconds of a fresh process that imports the planner and plans one case."""
    command = [sys.executable, os.path.abspath(__file__), "--cold-case", name, str(gpus), str(granularity)]
    walls, imports = [], []
    for _ in range(repeat):
        wall, stdout = cold_run(command, core)
        walls.append(wall)
        imports.append(json.loads(stdout.strip().splitlines()[-1])["import_s"])
    return {"cold_s": round(statistics.median(walls), 3), "cold_import_s": round(statistics.median(imports), 3)}


def _plan_once(name: str, gpus: int, granularity: int) -> int:
    """The child of `cold_case`: plan once and print the in-process import time."""
    spec = load_model_spec(os.path.join(MODELS, MODEL_DIRS[name]))
    plan = search(inputs_for(spec, gpus, granularity))
    print(json.dumps({"import_s": round(IMPORT_S, 4), "search_s": round(plan.search_s, 4)}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON file to write")
    parser.add_argument("--repeat", type=int, default=5, help="in-process searches per case (fastest reported)")
    parser.add_argument("--cold-repeat", type=int, default=3, help="fresh processes per case (median reported)")
    parser.add_argument("--cold-case", nargs=3, metavar=("MODEL", "GPUS", "GRANULARITY"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cold_case:
        name, gpus, granularity = args.cold_case
        return _plan_once(name, int(gpus), int(granularity))
    if not args.out:
        parser.error("--out is required")
    core = _one_core()
    if core:
        os.sched_setaffinity(0, core)
    cases = []
    for name, model_dir in MODEL_DIRS.items():
        spec = load_model_spec(os.path.join(MODELS, model_dir))
        for gpus, granularity in SIZES:
            row = run_case(name, spec, gpus, granularity, args.repeat)
            row.update(cold_case(name, gpus, granularity, args.cold_repeat, core))
            cases.append(row)
            print(f"{name:>20} {gpus:>5} GPUs g={granularity}: {row['search_s']:.3f} s wall, {row['cpu_s']:.3f} s CPU, "
                  f"{row['cold_s']:.2f} s cold, {row['candidates_costed']} of {row['candidates']} candidates "
                  f"costed, {row['chosen']}", flush=True)
    libra_plan = [cold_run([sys.executable, "-m", "libra.cli.main", "plan", PLAN_CONFIG], core)[0]
                  for _ in range(args.cold_repeat)]
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    out = {
        "benchmark": "planner_speed",
        "target_s": TARGET_S,
        "one_core": True,
        "note": "search_s is wall time (fastest in-process run, imports done and model spec loaded); cpu_s is the "
                "CPU time of the one pinned core, which does not include waiting for a core shared with other "
                "processes (see load_average); cold_s is a fresh pinned process (interpreter start, imports, "
                "config.json, one search) from spawn to exit, median of cold_repeat runs; candidates_costed of "
                "candidates reached the cost and memory models",
        "load_average": [round(x, 2) for x in load],
        "python": platform.python_version(),
        "repeat": args.repeat,
        "cold_repeat": args.cold_repeat,
        "cases": cases,
        "max_search_s": max(c["search_s"] for c in cases),
        "max_cpu_s": max(c["cpu_s"] for c in cases),
        "max_cold_s": max(c["cold_s"] for c in cases),
        "libra_plan_cold": {"command": f"libra plan {PLAN_CONFIG}",
                            "cold_s": round(statistics.median(libra_plan), 3),
                            "runs_s": [round(x, 3) for x in libra_plan]},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=2)
        fh.write("\n")
    return 0 if out["max_cpu_s"] < TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
