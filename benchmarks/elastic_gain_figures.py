"""The pure parts of `benchmarks/elastic_gain.py`: which static splits the planner allows, the overrides of
each policy's run, the figures of one run read from its own metrics rows and events, the gain, and the EHP
training-phase figures. Nothing here starts a process; the driver feeds it what the runs wrote.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GRP = "global_resource_planner"
POLICIES = ("static", "planner_initial", "elastic")


@dataclass(frozen=True)
class Split:
    """A rollout/train split of the cluster's logical GPUs."""

    train_gpus: int
    rollout_gpus: int

    def label(self) -> str:
        return f"train {self.train_gpus} | rollout {self.rollout_gpus}"


@dataclass(frozen=True)
class RefusedSplit:
    split: Split
    reason: str


def static_splits(total_gpus: int, validate: Callable[[list[str]], str]) -> tuple[list[Split], list[RefusedSplit]]:
    """Every train/rollout split of `total_gpus` (each pool at least one GPU) that the configuration accepts
    with `initial_allocation_strategy: configured`. `validate(overrides)` returns "" when the job validates with
    those overrides, else the reason; the planner's checks (memory fit, layouts, minimum pool sizes) run there."""
    if total_gpus < 2:
        raise ValueError(f"total_gpus={total_gpus}: a split needs at least one GPU per pool")
    allowed: list[Split] = []
    refused: list[RefusedSplit] = []
    for train in range(1, total_gpus):
        split = Split(train, total_gpus - train)
        reason = validate(static_overrides(split))
        if reason:
            refused.append(RefusedSplit(split, reason))
        else:
            allowed.append(split)
    return allowed, refused


def pick_spread(splits: list[Split], count: int) -> list[Split]:
    """`count` splits spread evenly over `splits` (the first and last among them), for the quick form."""
    if count <= 0 or not splits:
        return []
    if count >= len(splits):
        return list(splits)
    if count == 1:
        return [splits[len(splits) // 2]]
    picks = [round(i * (len(splits) - 1) / (count - 1)) for i in range(count)]
    return [splits[i] for i in sorted(set(picks))]


def static_overrides(split: Split) -> list[str]:
    """A fixed split: configured, never re-planned, no rollout GPU lent to training (EHP is measured apart)."""
    return [f"train_gpus={split.train_gpus}", f"rollout_gpus={split.rollout_gpus}",
            f"{GRP}.initial_allocation_strategy=configured", f"{GRP}.runtime_online_replanning=false",
            f"{GRP}.elastic_hybrid_min_rollout_gpus={split.rollout_gpus}"]


def planner_overrides(elastic: bool, total_gpus: int) -> list[str]:
    """The planner's initial split: never re-planned and no rollout GPU lent to training (`planner_initial`), or
    with online re-planning and elastic hybrid parallelism as the job configures them (`elastic`)."""
    if elastic:
        return [f"{GRP}.initial_allocation_strategy=grp", f"{GRP}.runtime_online_replanning=true"]
    return [f"{GRP}.initial_allocation_strategy=grp", f"{GRP}.runtime_online_replanning=false",
            f"{GRP}.elastic_hybrid_min_rollout_gpus={total_gpus}"]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of `path` ([] when missing); a line cut short by a killed writer is skipped."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def last_session(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per step, the newest where a step was written twice (a resumed run)."""
    by_step: dict[int, dict[str, Any]] = {}
    for row in rows:
        if "step" in row:
            by_step[int(row["step"])] = row
    return [by_step[s] for s in sorted(by_step)]


def split_of_row(row: dict[str, Any]) -> str:
    return Split(int(row.get("train_gpus", 0)), int(row.get("rollout_gpus", 0))).label()


def step_series(steps: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per step of a run, for the picture of its split over time: when the step ended (seconds into the step
    loop), the samples it trained on, the GPUs of each pool, and the rollout GPUs its training borrowed (one
    GPU per borrowed replica of a TP-1 layout; 0 without elastic hybrid parallelism)."""
    return {
        "elapsed_s": [round(float(r.get("elapsed_s") or 0.0), 3) for r in steps],
        "samples": [float(r.get("samples") or 0.0) for r in steps],
        "train_gpus": [float(r.get("train_gpus") or 0.0) for r in steps],
        "rollout_gpus": [float(r.get("rollout_gpus") or 0.0) for r in steps],
        "borrowed_gpus": [float(r.get("train_ehp_replicas") or 0.0) for r in steps],
    }


def run_figures(policy: str, rows: list[dict[str, Any]], events: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's figures of one run from its metrics rows and events.

    wall_s is the step loop's wall time (the last row's `elapsed_s`: from the loop's start to the last step's
    end, start-up excluded, the same for every policy); tokens and samples are those trained on."""
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r}: one of {', '.join(POLICIES)}")
    steps = last_session(rows)
    if not steps:
        raise ValueError(f"the {policy} run wrote no metrics rows: see its controller.log")
    wall = float(steps[-1]["elapsed_s"])
    if wall <= 0:
        raise ValueError(f"the {policy} run's last row has elapsed_s={wall}: expected > 0")
    tokens = sum(float(r.get("response_tokens") or 0.0) for r in steps)
    samples = sum(float(r.get("samples") or 0.0) for r in steps)
    splits: list[str] = []
    for row in steps:
        label = split_of_row(row)
        if not splits or splits[-1] != label:
            splits.append(label)
    done = [e for e in events if e.get("kind") == "reconfigure_done"]
    decisions = [e for e in events if e.get("kind") == "replan_decision"]
    return {
        "policy": policy,
        "split": splits[0],
        "splits_over_time": splits,
        "tokens_per_s": round(tokens / wall, 3),
        "samples_per_s": round(samples / wall, 4),
        "wall_s": round(wall, 2),
        "steps": len(steps),
        "reconfigurations": len(done),
        "reconfiguration_s": [round(float(e["seconds"]), 1) for e in done if isinstance(e.get("seconds"), int | float)],
        "replan_decisions": {a: sum(1 for d in decisions if d.get("action") == a)
                             for a in sorted({str(d.get("action")) for d in decisions})},
        "ehp_borrowing_steps": sum(1 for r in steps if float(r.get("train_ehp_replicas") or 0.0) > 0),
        "train_phase_s": round(sum(float(r.get("time_train_s") or 0.0) for r in steps), 3),
        "rollout_phase_s": round(sum(float(r.get("time_rollout_s") or 0.0) for r in steps), 3),
        "per_step": step_series(steps),
        "borrowed_rank_cores": borrowed_rank_cores(steps),
    }


BORROWED_PARTS = ("recompute", "forward_backward")


def borrowed_rank_cores(steps: list[dict[str, Any]]) -> float | None:
    """The share of a core the slowest borrowed rank ran at while it computed (its CPU seconds over its wall
    seconds in recomputation and forward/backward, summed over the borrowing steps); on metered logical GPUs it
    stays at or below the slice's cores per GPU, whatever slice the rank sat in between steps. None when no step
    borrowed."""
    cpu = wall = 0.0
    for row in steps:
        for part in BORROWED_PARTS:
            seconds, cpu_s = row.get(f"train_ehp_borrowed_{part}_s"), row.get(f"train_ehp_borrowed_{part}_cpu_s")
            if isinstance(seconds, int | float) and isinstance(cpu_s, int | float):
                wall += float(seconds)
                cpu += float(cpu_s)
    return round(cpu / wall, 4) if wall > 0 else None


def gain(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """`static_best_samples_per_s` (the oracle static split), `elastic_samples_per_s` and their ratio.
    A ratio is only given when every run reached the same number of steps (else the figures compare
    different stretches of the drift); `same_steps` says whether they did."""
    static = [r for r in runs if r["policy"] == "static"]
    elastic = [r for r in runs if r["policy"] == "elastic"]
    if not static or len(elastic) != 1:
        raise ValueError(f"need static runs and one elastic run, got {len(static)} static and {len(elastic)} "
                         "elastic")
    best = max(static, key=lambda r: r["samples_per_s"])
    same_steps = len({r["steps"] for r in runs}) == 1
    ratio = elastic[0]["samples_per_s"] / best["samples_per_s"] if best["samples_per_s"] > 0 else None
    return {
        "static_best_split": best["split"],
        "static_best_samples_per_s": best["samples_per_s"],
        "elastic_samples_per_s": elastic[0]["samples_per_s"],
        "gain": round(ratio, 4) if ratio is not None and same_steps else None,
        "same_steps": same_steps,
    }


# the parts of a training phase the training pool reports per step (metrics.jsonl), for `ehp_figures`
PHASE_PARTS = ("train_time_forward_backward_s", "train_time_combine_optimizer_s", "train_time_train_s",
               "train_time_recompute_s", "train_time_step_s", "train_ehp_step_s",
               # the borrow around the step: attach, and park (the core ranks' parameter export for the next step)
               "train_ehp_attach_s", "train_ehp_detach_s",
               # a borrowed step as the driver waits for it, in consecutive segments (libra.training.ehp)
               "train_ehp_wait_submit_s", "train_ehp_wait_params_s", "train_ehp_wait_borrowed_forward_backward_s",
               "train_ehp_wait_core_forward_backward_s", "train_ehp_wait_finish_s",
               # the slowest borrowed rank's own compute, and CPU seconds beside the wall seconds
               "train_ehp_borrowed_recompute_s", "train_ehp_borrowed_forward_backward_s",
               "train_time_recompute_cpu_s", "train_time_forward_backward_cpu_s", "train_time_train_cpu_s",
               "train_ehp_borrowed_recompute_cpu_s", "train_ehp_borrowed_forward_backward_cpu_s")


def median_of(rows: list[dict[str, Any]], key: str) -> float | None:
    """The median of `key` over the rows that report it (3 decimals), None when none does."""
    values = [float(r[key]) for r in rows if isinstance(r.get(key), int | float)]
    return round(statistics.median(values), 3) if values else None


def median_train_s(rows: list[dict[str, Any]], warmup_steps: int) -> float:
    """The median training-phase seconds (`time_train_s`, unrounded) of the steps after `warmup_steps`."""
    return statistics.median(float(r["time_train_s"]) for r in rows[warmup_steps:])


def ehp_figures(without: list[dict[str, Any]], with_ehp: list[dict[str, Any]], borrowed_gpus: int,
                warmup_steps: int = 1) -> dict[str, Any]:
    """Training-phase seconds per step (median of `time_train_s` after `warmup_steps`) of the same
    synchronous job without and with elastic hybrid parallelism, the part of the phase with EHP spent attaching
    the borrowed replicas and stepping, and how many steps really borrowed. The warm-up steps are left out of
    both medians; with EHP the borrowed workers are started with the job and parked (or, where that could not
    be done, by the first borrowing step), and every borrowing step re-attaches them, so the first attach is
    reported on its own (`first_attach_s`, `train_phase_s_with_first_step`) and in the mean over every step
    (`train_phase_s_with_mean_all_steps`), never hidden."""
    a, b = last_session(without), last_session(with_ehp)
    if len(a) <= warmup_steps or len(b) <= warmup_steps:
        raise ValueError(f"the EHP runs wrote {len(a)} and {len(b)} steps: need more than {warmup_steps} each")

    borrowed = [r for r in b if float(r.get("train_ehp_replicas") or 0) > 0]
    first = borrowed[0] if borrowed else None
    slow, fast = median_train_s(a, warmup_steps), median_train_s(b, warmup_steps)
    return {
        "train_phase_s_without": round(slow, 3),
        "train_phase_s_with": round(fast, 3),
        "speedup": round(slow / fast, 3) if fast > 0 else None,
        # where the phase with EHP goes: attaching the borrowed replicas, and the step itself
        "ehp_attach_s": median_of(b[warmup_steps:], "train_ehp_attach_s"),
        "ehp_step_s": median_of(b[warmup_steps:], "train_ehp_step_s"),
        "borrowed_gpus": borrowed_gpus,
        "steps": [len(a), len(b)],
        "steps_that_borrowed": len(borrowed),
        # steps whose borrowed replicas were parked ones re-attached, not started
        "steps_that_reused": sum(1 for r in borrowed if float(r.get("train_ehp_reused") or 0) > 0),
        # steps that trained on the parameters copied into the parked replicas at the previous park
        "steps_with_params_copied_at_park": sum(1 for r in borrowed
                                                if float(r.get("train_ehp_params_prefetched") or 0) > 0),
        "first_attach_s": round(float(first["train_ehp_attach_s"]), 3)
        if first is not None and isinstance(first.get("train_ehp_attach_s"), int | float) else None,
        "train_phase_s_with_first_step": round(float(b[0]["time_train_s"]), 3),
        "train_phase_s_without_first_step": round(float(a[0]["time_train_s"]), 3),
        "train_phase_s_with_mean_all_steps": round(statistics.fmean(float(r["time_train_s"]) for r in b), 3),
        "train_phase_s_without_mean_all_steps": round(statistics.fmean(float(r["time_train_s"]) for r in a), 3),
        "warmup_steps_excluded": warmup_steps,
        # where each run's training phase goes (medians after the warm-up; a part the run did not report is left
        # out), and every step's phase, so the spread the medians hide stays visible
        "breakdown": {name: {part: value for part in PHASE_PARTS
                             if (value := median_of(rows[warmup_steps:], part)) is not None}
                      for name, rows in (("without", a), ("with", b))},
        "train_phase_s_per_step": {"without": [round(float(r["time_train_s"]), 3) for r in a],
                                   "with": [round(float(r["time_train_s"]), 3) for r in b]},
    }


def ehp_rounds(rounds: list[tuple[list[dict[str, Any]], list[dict[str, Any]]]], warmup_steps: int = 1
               ) -> dict[str, Any]:
    """Several rounds of the same pair of runs (without and with EHP), run in alternating order so that a
    machine slowing down or speeding up over the benchmark weighs on both sides: the training phase's median
    over every step after the warm-up of every run of each side (`train_phase_s_without`, `train_phase_s_with`,
    `speedup` their ratio), each round's own figures and ratio, the median of those ratios, and the pooled
    breakdown (medians of the parts over the same steps)."""
    if not rounds:
        raise ValueError("no EHP rounds")
    pooled: dict[str, list[dict[str, Any]]] = {"without": [], "with": []}
    per_round = []
    for without, with_ehp in rounds:
        a, b = last_session(without), last_session(with_ehp)
        if len(a) <= warmup_steps or len(b) <= warmup_steps:
            raise ValueError(f"an EHP round wrote {len(a)} and {len(b)} steps: need more than {warmup_steps} each")
        pooled["without"] += a[warmup_steps:]
        pooled["with"] += b[warmup_steps:]
        slow, fast = median_train_s(a, warmup_steps), median_train_s(b, warmup_steps)
        per_round.append({"train_phase_s_without": round(slow, 3), "train_phase_s_with": round(fast, 3),
                          "speedup": round(slow / fast, 3) if fast > 0 else None})

    without_s, with_s = median_of(pooled["without"], "time_train_s"), median_of(pooled["with"], "time_train_s")
    ratios = [r["speedup"] for r in per_round if r["speedup"] is not None]
    return {
        "train_phase_s_without": without_s,
        "train_phase_s_with": with_s,
        "speedup": round(without_s / with_s, 3) if without_s is not None and with_s else None,
        "speedup_per_round": ratios,
        "speedup_median_of_rounds": round(statistics.median(ratios), 3) if ratios else None,
        "steps_pooled": [len(pooled["without"]), len(pooled["with"])],
        "rounds": per_round,
        "breakdown": {name: {part: value for part in PHASE_PARTS if (value := median_of(rows, part)) is not None}
                      for name, rows in pooled.items()},
    }

