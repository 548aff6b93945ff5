"""What a change of the training pool costs, and whether training continues exactly through it.

    python benchmarks/train_resize.py --out benchmarks/results/train_resize.json [--sections resizes,swap]

Sections (each a key of the result; `SECTIONS` below is the list, in order):

`resizes`: TP2 -> TP1, DP2 -> DP3 and PP2 -> PP1 of a running training pool (real Megatron-Core on gloo,
Ray with logical GPUs, a tiny Llama), each after two optimizer steps, by `TrainingPool.relayout` (save ->
stop -> start -> load, resharded by Megatron-Core distributed checkpointing). Per resize:
  switch_s, save_s, stop_s, start_s, load_s   the phases as measured by the pool (seconds)
  first_step_s        the first optimizer step at the new layout
  next_loss_abs_diff  |loss of that step - loss of the same step in a fresh pool at the new layout resumed from
                      the same checkpoint| (the issue's reference)
  next_loss_vs_unchanged_abs_diff  |... - loss of the same step had the pool kept its old layout|
  lr_continues        the learning rate of that step equals the unchanged run's (warm-up in progress)

`swap`: cluster swap on a running job, training 2 + rollout 2 -> 3 + 1 -> 2 + 2 GPUs on a Ray cluster of
exactly 4 logical GPUs, through the controller's reconciler, executor and both real pool edges (the rig of
tests/integration/controller/train_swap_rig.py), with a training loop stepping and publishing weights every
step and a prompt stream (benchmarks/reconfigure.py's `PromptStream`) running through both changes:
  switch_s            request -> reconfigure_done, summed over both changes (each change in `changes`)
  samples_lost        prompts of the stream without a completion + samples of training steps that failed
  changes.*: switch_s, samples_lost, samples_duplicated, requests_failed, train_steps, rollout_unavailable_s
             (seconds with no READY serving instance), max_gpus_held, train_resizes (each resize's costs)

Other sections join through `SECTIONS`: a `Section(key, measure)` whose `measure(context)` returns the key's
JSON value (the elastic-hybrid-parallelism benchmark adds its `ehp` section this way). Each section runs on
its own; one that raises is recorded as {"error": ...} and the others still run.

Targets: next_loss_abs_diff < 1e-5 for every resize; samples_lost == 0.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_resize_ehp import measure_ehp  # noqa: E402

from libra.cluster.ray_runtime import RayRuntime  # noqa: E402
from libra.config.mapping import cpu_config, tiny_model_spec, training_pool_spec  # noqa: E402
from libra.config.sections import TinyModelConfig  # noqa: E402
from libra.models.tiny import build_tiny_model  # noqa: E402
from libra.training.pool import TrainingPool  # noqa: E402
from libra.training.resize import describe  # noqa: E402
from planner.layout import TrainLayout  # noqa: E402

LOGICAL_GPUS = 4
LOSS_TOLERANCE = 1e-5
RESIZES = (
    ("tp2_to_tp1", 2, TrainLayout(tp=2), 1, TrainLayout()),
    ("dp2_to_dp3", 2, TrainLayout(), 3, TrainLayout()),
    ("pp2_to_pp1", 2, TrainLayout(pp=2), 1, TrainLayout()),
)
TARGETS = {"resizes": f"next_loss_abs_diff < {LOSS_TOLERANCE} for every resize", "swap": "samples_lost == 0",
           "ehp": f"grad_max_abs_diff < {LOSS_TOLERANCE} (when the ehp section is present)"}
NOT_COVERED = [
    "a CPU machine of 2 shared cores: Megatron-Core workers and vLLM-CPU servers on logical GPUs share them, so "
    "start_s and the swap's switch_s are dominated by process starts on a busy machine and say nothing about a "
    "GPU cluster's; save_s and load_s move a 0.2M-parameter model and say nothing about the disk time of a "
    "large one",
    "resizes go through the checkpoint path (save -> stop -> start -> load); there is no in-memory path",
    "RNG state is re-derived from (seed, step) when the layout changes (dropout is off in these models, so the "
    "losses do not depend on it)",
    "the swap's training loop trains on random off-policy batches (not the rollout pool's samples): "
    "samples_lost counts the stream's prompts left without a completion and the samples of failed training "
    "steps, not an RL loop's buffer",
    "one swap shape (2 + 2 -> 3 + 1 -> 2 + 2 GPUs, rollout TP 1) and three resize shapes on a 2-layer model",
]


@dataclass
class Context:
    """What a section is given: the Ray runtime (LOGICAL_GPUS logical GPUs), a scratch directory, the tiny
    training model, the command-line arguments."""

    runtime: RayRuntime
    root: Path
    model_dir: str
    args: argparse.Namespace


@dataclass(frozen=True)
class Section:
    key: str
    measure: Callable[[Context], Any]


# ---- resizes ----------------------------------------------------------------------------------------------
def _samples(seed: int) -> list[Any]:
    from tests.integration.controller.train_swap_rig import train_samples

    return train_samples(seed)


def _pool(ctx: Context, gpus: int, layout: TrainLayout, name: str) -> TrainingPool:
    cfg = cpu_config(ctx.model_dir, optimizer={"lr": 1e-2, "weight_decay": 0.01, "lr_warmup_steps": 4,
                                               "clip_grad": 0.0},
                     train_micro_batch_size=1, recompute_micro_batch_size=2, recompute_logprobs=False)
    return TrainingPool(ctx.runtime, training_pool_spec(cfg, gpus, layout), name=name)


def measure_resize(ctx: Context, name: str, gpus: int, layout: TrainLayout, new_gpus: int,
                   new_layout: TrainLayout) -> dict[str, Any]:
    root = ctx.root / name
    pool = _pool(ctx, gpus, layout, f"bench-{name}")
    try:
        pool.start()
        pool.train_step(_samples(1), 1)
        pool.train_step(_samples(2), 2)
        kept = pool.save_checkpoint(str(root / "before"), 2)
        unchanged = pool.train_step(_samples(3), 3)
        pool.load_checkpoint(kept)  # back to step 2 at the same layout (an exact restore)
        cost = pool.relayout(new_gpus, new_layout, str(root / "resize"))
        resized = pool.train_step(_samples(3), 3)
    finally:
        pool.shutdown()
    reference = _pool(ctx, new_gpus, new_layout, f"bench-{name}-reference")
    try:
        reference.restart(cost.checkpoint)
        resumed = reference.train_step(_samples(3), 3)
    finally:
        reference.shutdown()
    return {
        "name": name,
        "from": describe(gpus, layout.dims(gpus)),
        "to": describe(new_gpus, new_layout.dims(new_gpus)),
        "switch_s": cost.switch_s, "save_s": cost.save_s, "stop_s": cost.stop_s, "start_s": cost.start_s,
        "load_s": cost.load_s, "first_step_s": cost.first_step_s,
        "next_loss_abs_diff": abs(resized["loss"] - resumed["loss"]),
        "next_loss_vs_unchanged_abs_diff": abs(resized["loss"] - unchanged["loss"]),
        "lr_continues": abs(resized["lr"] - unchanged["lr"]) <= 1e-12,
        "step": cost.step,
        "loss": resized["loss"],
    }


def measure_resizes(ctx: Context) -> list[dict[str, Any]]:
    out = []
    for case in RESIZES:
        print(f"  resize {case[0]}", flush=True)
        out.append(measure_resize(ctx, *case))
        print(f"    {out[-1]}", flush=True)
    return out


# ---- swap -------------------------------------------------------------------------------------------------
def measure_swap(ctx: Context) -> dict[str, Any]:
    from reconfigure import PromptStream
    from reconfigure_accounting import prompt_accounting

    from libra.controller.reconfigure import ReconfigureTarget
    from libra.run_dir import read_jsonl
    from tests.integration.controller.reconfigure_rig import running
    from tests.integration.controller.train_swap_rig import TrainingDriver, build_swap_rig

    rig = build_swap_rig(ctx.runtime, ctx.root / "swap", cluster_gpus=LOGICAL_GPUS, train_gpus=2, instances=2,
                         tick_s=0.2)
    changes: dict[str, Any] = {}
    with running(rig, sample_s=0.2):
        rig.wait_ready(1800)
        assert rig.edge.pool is not None
        with TrainingDriver(rig, publish_every=1) as driver:
            driver.wait_steps(2, 900)
            for change, instances in (("2+2_to_3+1", 1), ("3+1_to_2+2", 2)):
                print(f"  swap {change}", flush=True)
                with PromptStream(rig.edge.pool, 2) as stream:
                    time.sleep(2.0)
                    steps_before, samples_from = len(driver.steps), len(rig.held_samples)
                    requested_ts, requested = time.time(), time.monotonic()
                    rig.request_target(ReconfigureTarget(rollout_instances=instances), "cluster_swap")
                    rig.wait_done(1800)
                    done = time.monotonic()
                    driver.wait_steps(1, 900)  # a step at the new split (measures the first step)
                prompts = prompt_accounting(stream.outcomes)
                held = [s for s in rig.held_samples[samples_from:] if s[0] <= done]
                gaps = [b[0] - a[0] for a, b in zip(held, held[1:], strict=False) if a[3] == 0]
                resizes = [e for e in read_jsonl(rig.run.events_jsonl)
                           if e.get("kind") == "train_resize" and e["ts"] >= requested_ts]
                changes[change] = {
                    "switch_s": round(done - requested, 3),
                    "samples_lost": prompts.samples_lost,
                    "samples_duplicated": prompts.samples_duplicated,
                    "requests_failed": prompts.requests_failed,
                    "prompts": prompts.prompts,
                    "train_steps": len(driver.steps) - steps_before,
                    "rollout_unavailable_s": round(sum(gaps), 3),
                    "max_gpus_held": max((used for _, used, _, _ in held), default=0),
                    "train_resizes": [{k: e.get(k) for k in ("label", "switch_s", "save_s", "stop_s", "start_s",
                                                             "load_s")} for e in resizes],
                }
                print(f"    {changes[change]}", flush=True)
        train_failed = len(driver.errors)
    first_steps = {e["resize_id"]: e["first_step_s"] for e in read_jsonl(rig.run.events_jsonl)
                   if e.get("kind") == "train_resize_first_step"}
    batch = len(_samples(0))
    return {
        "switch_s": round(sum(c["switch_s"] for c in changes.values()), 3),
        "samples_lost": sum(c["samples_lost"] for c in changes.values()) + train_failed * batch,
        "train_steps_failed": train_failed,
        "train_errors": driver.errors[:3],
        "first_step_s_after_resizes": list(first_steps.values()),
        "changes": changes,
        "cluster_gpus": LOGICAL_GPUS,
    }


SECTIONS: list[Section] = [Section("resizes", measure_resizes), Section("swap", measure_swap),
                           Section("ehp", lambda ctx: measure_ehp(ctx.runtime, ctx.model_dir))]
"""The result's sections in order. Another benchmark joins by appending its Section, e.g.
`SECTIONS.append(Section("ehp", lambda ctx: measure_ehp(ctx.runtime, ctx.model_dir)))`."""


SUMMARY_KEYS = ("targets", "targets_met", "all_targets_met", "not_covered", "setup")


def targets_met(out: dict[str, Any]) -> dict[str, bool]:
    met: dict[str, bool] = {}
    if isinstance(out.get("ehp"), dict) and "grad_max_abs_diff" in out["ehp"]:
        met["ehp"] = out["ehp"]["grad_max_abs_diff"] < LOSS_TOLERANCE
    if isinstance(out.get("resizes"), list):
        met["resizes"] = all(r["next_loss_abs_diff"] < LOSS_TOLERANCE for r in out["resizes"])
    if isinstance(out.get("swap"), dict) and "samples_lost" in out["swap"]:
        met["swap"] = out["swap"]["samples_lost"] == 0
    return met


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--sections", default="", help="comma-separated subset of the sections (default: all)")
    args = parser.parse_args()
    wanted = [s for s in args.sections.split(",") if s] or [s.key for s in SECTIONS]
    unknown = sorted(set(wanted) - {s.key for s in SECTIONS})
    if unknown:
        parser.error(f"--sections: {unknown} unknown; choose from {[s.key for s in SECTIONS]}")
    tmp = Path(tempfile.mkdtemp(prefix="libra-bench-train-resize-"))
    model_dir = build_tiny_model(str(tmp / "llama"), tiny_model_spec(TinyModelConfig(
        arch="llama", hidden_size=64, intermediate_size=128, max_position_embeddings=512, init_std=0.2, seed=0)))
    runtime = RayRuntime.start(num_gpus=LOGICAL_GPUS, num_cpus=16, tmp_dir=str(tmp / "ray"),
                               namespace="libra-bench-train-resize")
    out: dict[str, Any] = {}
    started = time.monotonic()
    try:
        ctx = Context(runtime, tmp, model_dir, args)
        for section in SECTIONS:
            if section.key not in wanted:
                continue
            print(f"[{time.monotonic() - started:6.0f} s] {section.key}", flush=True)
            try:
                out[section.key] = section.measure(ctx)
            except Exception as exc:  # one failing section does not lose the others
                out[section.key] = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"    failed: {out[section.key]['error']}", flush=True)
    finally:
        runtime.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    previous = json.loads(Path(args.out).read_text()) if Path(args.out).is_file() else {}
    kept = {k: v for k, v in previous.items() if k not in out and k not in SUMMARY_KEYS}
    out = {**kept, **out}  # a run of some sections keeps the other sections' last results (e.g. "ehp")
    out.update(targets=TARGETS, targets_met=targets_met(out), not_covered=NOT_COVERED, setup={
        "logical_gpus": LOGICAL_GPUS, "model": "tiny Llama, 2 layers, hidden 64 (resizes: 4 heads / 2 KV heads; "
        "swap: 2 heads / 1 KV head for vLLM-CPU)", "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
        "sections_run": list(wanted), "total_s": round(time.monotonic() - started, 1)})
    out["all_targets_met"] = all(out["targets_met"].values()) and {"resizes", "swap"} <= set(out["targets_met"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(json.dumps(out["targets_met"], indent=2))


if __name__ == "__main__":
    main()
