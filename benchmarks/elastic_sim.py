"""Cluster-scale evidence from the simulator (`planner.sim`): elastic re-planning against the best static split
on a drifting workload at 512 and 4096 GPUs, the speed of the simulator at 10,000 GPUs x 1,000 steps, and the
calibration against measured runs.

Cases: the Qwen3-30B-A3B (configs/qwen3-30b-a3b-64gpu.yaml) and Qwen2.5-32B (configs/qwen2.5-32b-32gpu.yaml)
examples scaled to 512 and 4096 GPUs (`planner.sim.scenario.scaled_inputs`: same GPU type, node size and
per-GPU batch), run for the example's `total_steps` on one drifting workload: log-normal response lengths
(sigma 0.8, clipped at max_new_tokens) whose mean ramps linearly from 0.1 to 0.8 x max_new_tokens over the
whole job (`planner.sim.lengths.DriftCurve`, the curve of the `drift` task; the defaults of `libra simulate`),
node failures at the rate of the Llama 3 report (419 unexpected
interruptions in 54 days on 16,384 GPUs: 1.58e-4 per 8-GPU node-hour, arXiv:2407.21783 section 3.3.4). Every
policy of a case runs on the same drawn lengths. Each case runs with the example's own weight reload method
(`restart`) and again with `inplace`; `gain_512` / `gain_4096` are the smallest gain over the two models with
the example's reload method, and `gains` lists every one.

Evidence for the gain (`case_details[]`): the elastic policy's decisions, the seconds of switches it paid, a
per-interval split of best static and elastic runs (`planner.sim.report.intervals`: split, seconds per step,
rollout and training busy shares, also of the planner's initial split and of the runtime's re-planner), the
runtime's re-planner replayed (`elastic:replan_predictor`: `planner.replan_review.OnlineReplanning`, which
reviews each change on what the new split measured, undoes one that did not deliver and discounts the next
prediction for growing that pool by what the model over-predicted, then calls `planner.replan.replan`, with
the running job's policy on the window the runtime judges; its changes and undos in
`replan_predictor_changes`, its reviews in `replan_predictor_reviews`, the decisions that predicted a gain past
`replan_min_gain` and were declined in `replan_predictor_declined`), and the phase oracle: the job cut into 20
runs of steps, each run at the pace of the static split fastest in it, switches free (`gain_bound_512` /
`gain_bound_4096`: the largest over the cases of that size with the example's reload method).

On-policy variants (`on_policy`): the same cases with `max_head_offpolicyness` 0 (each step generates on the
weights of the step before, as synchronous GRPO runs), where each pool waits while the other works, so elastic
hybrid parallelism has idle rollout GPUs to lend: every policy again, `elastic_ehp` (re-planning with EHP on)
among them; `gain_with_ehp_512` / `gain_with_ehp_4096` are the smallest gain of `elastic_ehp` over the best
static split over the two models with the example's reload method. The headline gains stay those of the
examples as configured (asynchronous).

Calibration: computed from benchmarks/results/elastic_gain.json when it exists, else null with the reason. The
measured runs are replayed on their job's configuration (the document's `config`, else `--gain-config`) at the
split each ran; the simulator's measured-cost constants (`planner.sim.costs.MeasuredCosts`: decode step =
fixed + per-sequence part, training step = overhead + per-token part / replicas, sync pause) are fitted to the
runs of every other split and predict the runs of the remaining splits (`planner.sim.fit`); the headline errors
are those held-out predictions, and `leave_one_split_out` predicts each split from all the others.

Usage: python benchmarks/elastic_sim.py --out benchmarks/results/elastic_sim.json [--images DIR] [--quick]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import replace  # noqa: E402
from typing import Any, Literal  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from slice_cpu import SLICE_KINDS  # noqa: E402

from libra.config import load  # noqa: E402
from libra.planning import planner_inputs  # noqa: E402
from planner.plan import Candidate  # noqa: E402
from planner.sim.calibration import MeasuredRun, calibration_errors, measured_runs  # noqa: E402
from planner.sim.engine import Engine, SimOptions  # noqa: E402
from planner.sim.fit import Replayer, alternate_splits, holdout, leave_one_split_out, slice_cap_sweep  # noqa: E402
from planner.sim.lengths import LengthModel  # noqa: E402
from planner.sim.policies import (  # noqa: E402
    POLICIES,
    ElasticPolicy,
    StaticPolicy,
    planner_allocation,
    run_policy,
)
from planner.sim.report import intervals  # noqa: E402
from planner.sim.scenario import build_job, compare, scaled_inputs  # noqa: E402
from planner.workload import EhpOptions, PlannerInputs  # noqa: E402

MODELS = (("qwen3-30b-a3b", "configs/qwen3-30b-a3b-64gpu.yaml"), ("qwen2.5-32b", "configs/qwen2.5-32b-32gpu.yaml"))
GPUS = (512, 4096)
START_FRACTION, END_FRACTION, SIGMA, RAMP = 0.1, 0.8, 0.8, 1.0
ORACLE_PHASES = 20
INTERVAL_STEPS = 40
LLAMA3_FAILURES_PER_NODE_HOUR = 419 / (54 * 24 * 16384) * 8
SEED = 0
EHP_POLICIES = ("ehp", "elastic_ehp")  # on-policy: planned with EHP on
Strategy = Literal["diff", "restart_all", "blue_green", "prewarm", "cluster_swap"]
Reload = Literal["restart", "inplace"]
STRATEGIES: tuple[Strategy, ...] = ("diff", "restart_all", "blue_green", "prewarm", "cluster_swap")
GAIN_RESULT = os.path.join(ROOT, "benchmarks", "results", "elastic_gain.json")
NOT_COVERED = [
    "the cluster-scale cases run on the planner's cost model (roofline decode, MFU constants) driven through the "
    "dynamics, not measurements: calibration fits the simulator's constants to the CPU runs of the measured-gain "
    "benchmark only, so it checks the simulator's dynamics and cost structure, not the GPU constants",
    "response lengths are a chosen drifting log-normal workload, not a recorded trace",
    "a rollout batch's decode is aggregated per instance and its requests are balanced evenly over instances "
    "(decode.py states the approximation; its step times against a per-request reference of one instance and "
    "of pools of 2 and 4 that routes whole groups as the runtime does, with in-place reload pauses only, are "
    "benchmarks/results/sim_fidelity.json); a restart reload is taken as a pause of the pool, not as the loss of "
    "its requests in flight",
    "failed rollout instances' in-flight requests cost no extra time; the colocated baseline has no failures",
    "the training layout (TP, PP, CP, EP) is fixed per policy: elastic resizes training data parallelism and the "
    "rollout pool (instances and their TP); Libra's runtime re-planner (elastic:replan_predictor) also keeps the "
    "rollout TP, which only an operator's reconfiguration changes",
    "case_details[].oracle estimates what following the drift could gain here: each twentieth of the job run at "
    "the pace of the static split fastest in it, switches free; it is an estimate, not a strict bound (a phase's "
    "pace depends a little on the pipeline state the phase before leaves)",
    "the elastic policy's predictor replays the simulator's own cost model: it knows the costs and observes only "
    "the lengths, so its gains are what a calibrated tail-aware planner could reach in this model, not what "
    "the runtime's re-planner reaches today (elastic:replan_predictor rows: planner.replan_review.OnlineReplanning "
    "with the running job's policy on the figures the runtime measures, each change reviewed on the new split's "
    "second window and undone when its steps ran slower than the old split's expected, the next prediction for "
    "growing that pool discounted by what the model over-predicted)",
    "sim_10k_gpus_1000_steps_s is CPU time of one process (numpy single-threaded) on the shared machine",
    "EHP in the asynchronous cases (the ehp and elastic_ehp rows of `cases`) is the simulator's: Libra's runtime "
    "lends rollout GPUs only in a synchronous job, as the on_policy cases run it",
]


def drifting(inputs: PlannerInputs) -> LengthModel:
    max_new = inputs.workload.max_new_tokens
    return LengthModel(START_FRACTION * max_new, END_FRACTION * max_new, max_new, sigma=SIGMA, ramp=RAMP)


def case_inputs(config: str, gpus: int, offpolicyness: int | None = None) -> tuple[PlannerInputs, int]:
    """The example `config` scaled to `gpus` GPUs (`offpolicyness`: its `max_head_offpolicyness` instead of the
    example's), and its total_steps."""
    cfg = load(os.path.join(ROOT, config), [], planning=True)
    inputs = scaled_inputs(planner_inputs(cfg), gpus)
    if offpolicyness is not None:
        inputs = replace(inputs, workload=replace(inputs.workload, max_head_offpolicyness=offpolicyness))
    return inputs, cfg.total_steps


def policy_rows(model: str, gpus: int, reload: str, results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row of the result's `cases` per policy's run in `results` (by policy name)."""
    return [{"model": model, "gpus": gpus, "policy": name, "reload": reload,
             "samples_per_s": round(r.samples_per_s, 3), "gpu_idle_frac": round(r.gpu_idle_frac, 4),
             "wall_h": round(r.wall_s / 3600, 3), "reconfigurations": r.reconfigurations, "failures": r.failures,
             "split": r.initial} for name, r in results.items()]


def on_policy_case(model: str, config: str, gpus: int, steps: int | None, reload: Reload | None) -> dict[str, Any]:
    """The example at `gpus` GPUs run on-policy (`max_head_offpolicyness` 0): every policy, each one's ratio to
    the best static split, and the changes `elastic_ehp` made. The EHP policies start from the split the planner
    chooses with EHP on (`PlannerInputs.ehp`: the training phase priced on the GPUs the rollout pool lends, as
    Libra plans a synchronous job that lends), the others from its split without; both runs draw the same
    lengths."""
    inputs, total_steps = case_inputs(config, gpus, offpolicyness=0)
    steps = steps or total_steps
    options = SimOptions(steps=steps, seed=SEED, node_failures_per_node_hour=LLAMA3_FAILURES_PER_NODE_HOUR)
    job = build_job(inputs, drifting(inputs), steps, SEED, reload_method=reload)
    comparison = compare(job, options, [p for p in POLICIES if p not in EHP_POLICIES])
    lending = build_job(replace(inputs, ehp=EhpOptions()), drifting(inputs), steps, SEED, reload_method=reload)
    with_ehp = compare(lending, options, EHP_POLICIES)
    comparison.results.update(with_ehp.results)
    label = job.inputs.rollout.reload_method
    best = comparison.results["best_static"].samples_per_s
    return {"rows": policy_rows(model, gpus, label, comparison.results), "comparison": comparison,
            "gain": {"model": model, "gpus": gpus, "reload": label,
                     **{name: round(r.samples_per_s / best, 4) for name, r in comparison.results.items()
                        if name != "best_static"}},
            "planner_split_with_ehp": with_ehp.start.label(),
            "elastic_ehp_changes": {"model": model, "gpus": gpus, "reload": label,
                                    "changes": [d for d in comparison.results["elastic_ehp"].decisions
                                                if d["change"]]}}


def run_case(model: str, config: str, gpus: int, steps: int | None, reload: Reload | None) -> dict[str, Any]:
    inputs, total_steps = case_inputs(config, gpus)
    steps = steps or total_steps
    job = build_job(inputs, drifting(inputs), steps, SEED, reload_method=reload)
    options = SimOptions(steps=steps, seed=SEED, node_failures_per_node_hour=LLAMA3_FAILURES_PER_NODE_HOUR)
    began = time.process_time()
    comparison = compare(job, options)
    rows = policy_rows(model, gpus, job.inputs.rollout.reload_method, comparison.results)
    others = [(f"elastic:{strategy}", run_policy(job, elastic_policy(job, comparison.start, options), replace(
        options, reconfigure_strategy=strategy))) for strategy in STRATEGIES[1:]]
    replay = elastic_policy(job, comparison.start, options, "replan")
    mean_only = run_policy(job, replay, options)
    variants = dict([*others, ("elastic:replan_predictor", mean_only)])
    rows += [{**row, "strategy_fallbacks": variants[row["policy"]].strategy_fallbacks}
             for row in policy_rows(model, gpus, job.inputs.rollout.reload_method, variants)]
    early = slice(0, max(1, steps // 5))
    late = slice(steps - max(1, steps // 5), steps)
    elastic = comparison.results["elastic"]
    return {"rows": rows, "gain": comparison.gain(), "gain_with_ehp": comparison.gain("elastic_ehp"),
            "comparison": comparison, "sim_cpu_s": time.process_time() - began,
            "samples_per_step": inputs.workload.samples_per_step, "steps": steps,
            "mean_response_early": round(float(job.batches.total[early].sum() / job.batches.count[early].sum()), 1),
            "mean_response_late": round(float(job.batches.total[late].sum() / job.batches.count[late].sum()), 1),
            "best_static": comparison.results["best_static"].initial,
            "oracle": comparison.phase_oracle(ORACLE_PHASES),
            "elastic_changes": [d for d in elastic.decisions if d["change"]],
            "elastic_switch_pause_s": round(sum(max(s["train_pause_s"], s["rollout_pause_s"])
                                                for s in elastic.switches), 1),
            "gain_with_replan_predictor": round(mean_only.samples_per_s / comparison.results["best_static"].samples_per_s, 4),
            "replan_predictor_changes": [d for d in mean_only.decisions if d["change"]],
            "replan_predictor_reviews": [r.to_dict() for r in replay.reviews],
            "replan_predictor_declined": [d for d in mean_only.decisions
                                          if not d["change"] and d["predicted_gain"] >= options.replan_min_gain],
            "intervals": {**{name: intervals(comparison.results[name], INTERVAL_STEPS)
                             for name in ("best_static", "planner_initial", "elastic")},
                          "elastic:replan_predictor": intervals(mean_only, INTERVAL_STEPS)}}


def elastic_policy(job: Any, start: Candidate, options: SimOptions, predictor: Literal["tail", "replan"] = "tail") -> ElasticPolicy:
    return ElasticPolicy(job.inputs, start, options.replan_interval_steps, options.replan_min_gain,
                         options.replan_horizon_steps, predictor=predictor)


def sim_10k(steps: int = 1000) -> dict[str, Any]:
    """CPU seconds to draw the lengths of and simulate 10,000 GPUs x 1,000 steps with the elastic policy."""
    inputs, _ = case_inputs(MODELS[0][1], 10_000)
    began = time.process_time()
    job = build_job(inputs, drifting(inputs), steps, SEED)
    drawn = time.process_time()
    options = SimOptions(steps=steps, seed=SEED, node_failures_per_node_hour=LLAMA3_FAILURES_PER_NODE_HOUR)
    start = planner_allocation(job.inputs)
    result = Engine(job, ElasticPolicy(job.inputs, start, options.replan_interval_steps, options.replan_min_gain,
                                       options.replan_horizon_steps), options).run()
    done = time.process_time()
    return {"cpu_s": round(done - began, 2), "draw_cpu_s": round(drawn - began, 2),
            "simulate_cpu_s": round(done - drawn, 2), "samples_per_step": inputs.workload.samples_per_step,
            "policy": "elastic", "reconfigurations": result.reconfigurations, "failures": result.failures}


def replayed_overrides(document: dict[str, Any]) -> list[str] | None:
    """The overrides the measured runs shared, as benchmarks/elastic_gain.py records them (`overrides`); None
    for a result written before it did, which cannot be replayed as the job it ran."""
    overrides = document.get("overrides")
    return [str(item) for item in overrides] if isinstance(overrides, list) else None


def drift_workload(cfg: Any, steps: int) -> dict[str, float]:
    """The response lengths of the `drift` task as the simulator's length model: the budget grows from
    start_tokens to end_tokens over ramp_prompts prompts (a fraction of the job's prompts), then holds, and
    every response fills its budget (the task's model rarely samples its end token, so there is no long tail:
    sigma 0); {} for another task."""
    if cfg.task.name != "drift":
        return {}
    params = cfg.task.params
    prompts = max(1, cfg.batch_size * steps)
    return {"start_mean": float(params.get("start_tokens", 4)), "end_mean": float(params.get("end_tokens", 48)),
            "ramp": min(1.0, float(params.get("ramp_prompts", prompts)) / prompts), "sigma": 0.0}


CALIBRATION_COVERS = (
    "Whole measured runs as benchmarks/elastic_gain.json records them: wall_s, rollout_phase_s and "
    "train_phase_s are totals over every step, step 1 included. The simulator has no warm-up term: whatever "
    "step 1 costs beyond the others (the rollout servers no longer compile at their first request) goes into "
    "the fitted decode_fixed_s, together with each batch's dispatch and prefill, spread over the job's decode "
    "steps (whole-run totals of one length schedule cannot tell these apart). Errors are held-out: a run's "
    "figure comes from constants fitted without any run of its split.")
CALIBRATION_NOT_COVERED = [
    "the constants are fitted to this one job (model, batch, length schedule) on this machine: decode_fixed_s "
    "carries the first step's extra cost and per-batch overheads of this length schedule, so another job needs its own fit",
    "runs were replayed at the split they ran, with the simulator's synchronous engine; a run that changed "
    "split or whose training borrowed rollout GPUs (elastic hybrid parallelism) is left out, so the figures "
    "test the splits' predictions, not the elastic policy's decisions or EHP",
    "the measured runs shared a loaded machine: runs of one split differ in samples/s by "
    "spread_within_split (largest over smallest - 1), which bounds how close one prediction can come to all "
    "of them",
    "response lengths are the drift task's budgets (sigma 0), not the recorded per-step lengths",
]


def spread_within_split(runs: list[MeasuredRun]) -> dict[str, float]:
    """For each split with several measured runs: the largest samples/s over the smallest, minus 1."""
    rates: dict[str, list[float]] = {}
    for run in runs:
        rates.setdefault(run.split_label, []).append(run.samples_per_s)
    return {split: round(max(r) / min(r) - 1.0, 4) for split, r in rates.items() if len(r) > 1}


SLICE_CAPS: tuple[float | None, ...] = (None, 1.2, 1.1, 1.0, 0.9, 0.8)  # cores; None = no cap


def slice_cores_measured(document: dict[str, Any]) -> list[dict[str, Any]]:
    """The cores the metered slices used together in each phase of the runs that sampled them (`slice_cpu`)."""
    rows = []
    for run in document.get("runs", []):
        for phase, sample in (run.get("slice_cpu") or {}).items():
            cores = sum(v for where, pools in sample.get("cores", {}).items() if where in SLICE_KINDS
                        for v in pools.values())
            rows.append({"run": f"{run['policy']} {run['split']}", "phase": phase, "cores": round(cores, 4)})
    return rows


def slice_cap(replayer: Replayer, runs: list[MeasuredRun], fitted_splits: list[tuple[int, int]],
              document: dict[str, Any]) -> dict[str, Any]:
    """The calibration again with a cap on what the host gives the busy slices together (`planner.sim.fit.
    SliceCap`), for each cap of SLICE_CAPS: a diagnostic beside the headline (which is uncapped)."""
    rows = slice_cap_sweep(replayer, runs, fitted_splits, float(document["cpu_per_gpu"]), SLICE_CAPS)
    return {
        "cpu_per_gpu": document["cpu_per_gpu"],
        "caps": rows,
        "chosen_by_fitted_runs": min(rows, key=lambda r: r["fitted_runs_residual"])["cap_cores"],
        "best_on_every_run": min(rows, key=lambda r: r["all_runs_residual"])["cap_cores"],
        "slice_cores_measured": slice_cores_measured(document),
        "note": "cap_cores: the cores the busy pool's slices run together at most (None: each slice at its quota); "
                "held-out errors as the headline's design; fitted_runs_residual is what a calibration may choose a "
                "cap by (the smallest wins, a tie the larger cap), all_runs_residual includes the "
                "predicted runs and so cannot choose one; slice_cores_measured: the CPU the slices used together, "
                "sampled in the runs that recorded slice_cpu",
    }


def calibration(gain_path: str, gain_config: str) -> dict[str, Any]:
    """Fit the simulator's measured-cost constants to some measured runs of the measured-gain result and
    predict the others (`planner.sim.fit`): the held-out errors, what was fitted and predicted, the constants,
    and whether the splits rank as measured."""
    if not os.path.exists(gain_path):
        return {"rel_error_step_s": None, "rel_error_throughput": None,
                "reason": f"{os.path.relpath(gain_path, ROOT)} does not exist yet: the measured-gain runs "
                          "(benchmarks/elastic_gain.py) have not been made"}
    with open(gain_path, encoding="utf-8") as fh:
        document = json.load(fh)
    overrides = replayed_overrides(document)
    if overrides is None:
        return {"rel_error_step_s": None, "rel_error_throughput": None,
                "reason": f"{os.path.relpath(gain_path, ROOT)} does not record the overrides its runs shared "
                          "(`overrides`, which benchmarks/elastic_gain.py writes): "
                          "run the measured-gain benchmark again to calibrate on it"}
    runs = measured_runs(document)
    # a run that changed split, or whose training borrowed rollout GPUs, is not a static split's run
    replayable = [run for run in runs if run.splits_over_time == 1 and run.borrowing_steps == 0]
    config = document.get("config", gain_config)
    cfg = load(os.path.join(ROOT, config), overrides, planning=True)
    inputs = planner_inputs(cfg)
    steps = max(r.steps for r in runs)
    workload = {**drift_workload(cfg, steps), **document.get("workload", {})}
    max_new = inputs.workload.max_new_tokens
    lengths = LengthModel(float(workload.get("start_mean", START_FRACTION * max_new)),
                          float(workload.get("end_mean", END_FRACTION * max_new)), max_new,
                          sigma=float(workload.get("sigma", SIGMA)), ramp=float(workload.get("ramp", RAMP)))
    job = build_job(inputs, lengths, steps, SEED)
    start = planner_allocation(job.inputs)
    replayer = Replayer(job, start.layout, start.rollout_tp)
    fitted_splits = alternate_splits(replayable)
    headline = holdout(replayer, replayable, fitted_splits)
    on_cost_model = []
    for run in replayable:
        split = Candidate(run.train_gpus, run.rollout_gpus, start.layout, start.rollout_tp)
        result = run_policy(job, StaticPolicy(split), SimOptions(steps=run.steps, seed=SEED))
        on_cost_model.append((run, result.wall_s / run.steps, result.samples_per_s))
    uncalibrated = calibration_errors(on_cost_model)
    return {
        "rel_error_step_s": headline["rel_error_step_s"],
        "rel_error_throughput": headline["rel_error_throughput"],
        "max_rel_error_step_s": headline["max_rel_error_step_s"],
        "max_rel_error_throughput": headline["max_rel_error_throughput"],
        "design": "fit on every other split by training GPUs (" + ", ".join(f"{t}+{r}" for t, r in fitted_splits)
                  + "), predict every run of the other splits; medians over the predicted runs",
        "fitted_runs": headline["fitted_runs"],
        "predicted_runs": headline["predicted_runs"],
        "constants": headline["constants"],
        "model": {"decode step of one instance running n sequences": "decode_fixed_s + decode_per_seq_s x n",
                  "training side of a step on dp replicas": "train_step_s + train_token_s x samples x (prompt + "
                                                            "mean response tokens) / dp",
                  "weight sync (rollout pause)": "sync_s",
                  "fitted to": "each run's measured rollout_phase_s, train_phase_s and the rest of wall_s, by "
                               "non-negative least squares on relative residuals"},
        "runs": headline["runs"],
        "ranking": {**headline["ranking"], "note": "static runs' splits, fastest first, simulated with the "
                                                   "fitted constants (in-sample for the fitted splits)"},
        "leave_one_split_out": {**leave_one_split_out(replayer, replayable),
                                "note": "each split's runs predicted by constants fitted on every other split: "
                                        "the splits at both ends are extrapolated"},
        "slice_cap": slice_cap(replayer, replayable, fitted_splits, document),
        "spread_within_split": spread_within_split(replayable),
        "uncalibrated": {k: uncalibrated[k] for k in ("rel_error_step_s", "rel_error_throughput")}
                        | {"note": "every run replayed with the planner's cost model (no fitted constants)"},
        "not_replayed": [run.name for run in runs if run.splits_over_time > 1],
        "covers": CALIBRATION_COVERS,
        "not_covered": CALIBRATION_NOT_COVERED,
        "replayed_job": {"config": config, "overrides": overrides, "lengths": workload, "steps": steps},
        "source": os.path.relpath(gain_path, ROOT),
    }


def on_policy_cases(steps: int | None, images: str = "") -> dict[str, Any]:
    """Every case again on-policy (`on_policy_case`), with the smallest gain of `elastic_ehp` per size; with
    `images`, the pictures of the cases with the example's reload method drawn into that folder."""
    began = time.process_time()
    rows: list[dict[str, Any]] = []
    gains: list[dict[str, Any]] = []
    changes: list[dict[str, Any]] = []
    reloads: tuple[Reload | None, ...] = (None, "inplace")
    for reload in reloads:
        for gpus in GPUS:
            for model, config in MODELS:
                out = on_policy_case(model, config, gpus, steps, reload)
                rows += out["rows"]
                gains.append(out["gain"])
                changes.append({**out["elastic_ehp_changes"], "planner_split_with_ehp": out["planner_split_with_ehp"]})
                print(f"{model} {gpus} GPUs reload {out['gain']['reload']}, on-policy: elastic_ehp/best static "
                      f"{out['gain']['elastic_ehp']:.3f}, colocated {out['gain']['colocated']:.3f}", flush=True)
                if images and reload is None:
                    from libra.cli.cmd_simulate import draw

                    os.makedirs(images, exist_ok=True)
                    draw(out["comparison"], os.path.join(images, f"sim_on_policy_{model}_{gpus}.png"),
                         title=f"{model}, {gpus} GPUs, on-policy, drifting response lengths")
    example_reload = [g for g in gains if g["reload"] != "inplace"] or gains
    return {
        "max_head_offpolicyness": 0,
        "cases": rows,
        "gains": gains,
        "gain_with_ehp_512": min(g["elastic_ehp"] for g in example_reload if g["gpus"] == 512),
        "gain_with_ehp_4096": min(g["elastic_ehp"] for g in example_reload if g["gpus"] == 4096),
        "elastic_ehp_changes": changes,
        "sim_cpu_s": round(time.process_time() - began, 2),
        "note": "the examples run on-policy instead of with their own max_head_offpolicyness (2 and 1); gains are "
                "each policy's samples/s over the best static split of the same on-policy job; ehp and "
                "elastic_ehp start from the planner's split with EHP on (planner_split_with_ehp), the others from "
                "its split without; the headline gain_512 / gain_4096 remain the examples' as configured",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--images", default="", help="write the cases' pictures (PNG) into this folder")
    parser.add_argument("--quick", action="store_true", help="60 steps per case (a smoke run, not the result)")
    parser.add_argument("--gain-result", default=GAIN_RESULT)
    parser.add_argument("--gain-config", default="configs/dev.yaml")
    args = parser.parse_args()
    began = time.time()
    steps = 60 if args.quick else None
    cases: list[dict[str, Any]] = []
    gains: list[dict[str, Any]] = []
    details: list[dict[str, Any]] = []
    for reload in (None, "inplace"):
        for gpus in GPUS:
            for model, config in MODELS:
                out = run_case(model, config, gpus, steps, reload)
                cases += out["rows"]
                label = out["rows"][0]["reload"]
                gains.append({"model": model, "gpus": gpus, "reload": label, "gain": round(out["gain"] or 0.0, 4),
                              "gain_with_ehp": round(out["gain_with_ehp"] or 0.0, 4)})
                details.append({k: out[k] for k in ("samples_per_step", "steps", "mean_response_early",
                                                    "mean_response_late", "best_static", "oracle",
                                                    "elastic_changes", "elastic_switch_pause_s",
                                                    "gain_with_replan_predictor", "replan_predictor_changes",
                                                    "replan_predictor_reviews", "replan_predictor_declined",
                                                    "intervals")}
                               | {"model": model, "gpus": gpus, "reload": label,
                                  "sim_cpu_s": round(out["sim_cpu_s"], 2)})
                print(f"{model} {gpus} GPUs reload {label}: elastic/best static {out['gain']:.3f} "
                      f"({out['sim_cpu_s']:.1f} s)", flush=True)
                if args.images and reload is None:
                    from libra.cli.cmd_simulate import draw

                    os.makedirs(args.images, exist_ok=True)
                    draw(out["comparison"], os.path.join(args.images, f"sim_{model}_{gpus}.png"),
                         title=f"{model}, {gpus} GPUs, drifting response lengths")
    example_reload = [g for g in gains if g["reload"] != "inplace"] or gains
    on_policy = on_policy_cases(steps, args.images)
    speed = sim_10k(60 if args.quick else 1000)
    result = {
        "benchmark": "elastic_sim",
        "quick": args.quick,
        "python": platform.python_version(),
        "calibration": calibration(args.gain_result, args.gain_config),
        "cases": cases,
        "gain_512": min(g["gain"] for g in example_reload if g["gpus"] == 512),
        "gain_4096": min(g["gain"] for g in example_reload if g["gpus"] == 4096),
        "gains": gains,
        "gain_bound_512": max(d["oracle"]["gain_over_best_static"] for d in details
                              if d["gpus"] == 512 and d["reload"] != "inplace"),
        "gain_bound_4096": max(d["oracle"]["gain_over_best_static"] for d in details
                               if d["gpus"] == 4096 and d["reload"] != "inplace"),
        "on_policy": on_policy,
        "targets": {"gain": 1.3, "sim_10k_gpus_1000_steps_s": 60.0, "calibration_rel_error": 0.15},
        "sim_10k_gpus_1000_steps_s": speed["cpu_s"],
        "sim_10k": speed,
        "case_details": details,
        "workload": {"lengths": "log-normal, clipped at max_new_tokens", "sigma": SIGMA,
                     "drift": "mean ramps linearly from start to end over the ramp fraction of the job "
                              "(planner.sim.lengths.DriftCurve)",
                     "start_mean_fraction_of_max_new_tokens": START_FRACTION,
                     "end_mean_fraction_of_max_new_tokens": END_FRACTION, "ramp_fraction_of_job": RAMP,
                     "seed": SEED,
                     "node_failures_per_node_hour": round(LLAMA3_FAILURES_PER_NODE_HOUR, 7)},
        "not_covered": NOT_COVERED,
        "benchmark_wall_s": round(time.time() - began, 1),
    }
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2)
    print(json.dumps({k: result[k] for k in ("gain_512", "gain_4096", "gain_bound_512", "gain_bound_4096",
                                             "sim_10k_gpus_1000_steps_s")}
                     | {k: on_policy[k] for k in ("gain_with_ehp_512", "gain_with_ehp_4096")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
