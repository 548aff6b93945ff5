"""The elastic-gain benchmark's pure parts: static splits from validation, one run's figures from its rows and
events, the gain over the best static split, and the EHP training-phase figures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from benchmark_modules import REPO, load_benchmark_module

CONFIG = REPO / "configs" / "drift.yaml"


fig = load_benchmark_module("elastic_gain_figures")


def row(step: int, elapsed: float, samples: float = 16, tokens: float = 64, train: int = 2, rollout: int = 2,
        **extra: Any) -> dict[str, Any]:
    return {"step": step, "elapsed_s": elapsed, "samples": samples, "response_tokens": tokens,
            "train_gpus": train, "rollout_gpus": rollout, "time_train_s": 0.5, "time_rollout_s": 1.0, **extra}


def refuse_odd_train(overrides: list[str]) -> str:
    train = int(next(o for o in overrides if o.startswith("train_gpus=")).split("=")[1])
    return "" if train % 2 == 0 else f"train_gpus={train}: odd"


SPLIT_CASES = [
    pytest.param(4, lambda _: "", ["train 1 | rollout 3", "train 2 | rollout 2", "train 3 | rollout 1"], [],
                 id="every split validates"),
    pytest.param(6, refuse_odd_train, ["train 2 | rollout 4", "train 4 | rollout 2"],
                 ["train 1 | rollout 5", "train 3 | rollout 3", "train 5 | rollout 1"], id="refused splits kept with reason"),
    pytest.param(2, lambda _: "", ["train 1 | rollout 1"], [], id="smallest cluster"),
]


@pytest.mark.parametrize(("gpus", "validate", "allowed", "refused"), SPLIT_CASES)
def test_static_splits_are_the_ones_that_validate(gpus: int, validate: Any, allowed: list[str],
                                                  refused: list[str]) -> None:
    ok, bad = fig.static_splits(gpus, validate)
    assert [s.label() for s in ok] == allowed
    assert [r.split.label() for r in bad] == refused
    assert all(r.reason for r in bad)


def test_static_splits_need_two_gpus() -> None:
    with pytest.raises(ValueError, match="total_gpus=1"):
        fig.static_splits(1, lambda _: "")


def test_static_splits_of_the_drift_job_come_from_the_real_validation() -> None:
    from libra.config import ConfigError, load

    def validate(extra: list[str]) -> str:
        try:
            load(str(CONFIG), ["batch_size=16", "n_samples=8", "train_micro_batch_size=16", *extra])
        except ConfigError as err:
            return err.report()
        return ""

    ok, bad = fig.static_splits(4, validate)
    assert [s.label() for s in ok] == ["train 1 | rollout 3", "train 2 | rollout 2"]
    assert [r.split.label() for r in bad] == ["train 3 | rollout 1"]  # 128 samples do not split over DP 3
    assert "divisible" in bad[0].reason


SPREAD_CASES = [
    pytest.param(5, 2, [0, 4], id="two: the extremes"),
    pytest.param(5, 3, [0, 2, 4], id="three: evenly"),
    pytest.param(3, 5, [0, 1, 2], id="more than there are: all"),
    pytest.param(3, 1, [1], id="one: the middle"),
    pytest.param(3, 0, [], id="none"),
]


@pytest.mark.parametrize(("count", "pick", "indices"), SPREAD_CASES)
def test_pick_spread(count: int, pick: int, indices: list[int]) -> None:
    splits = [fig.Split(t, count + 1 - t) for t in range(1, count + 1)]
    assert fig.pick_spread(splits, pick) == [splits[i] for i in indices]


def test_overrides_pin_or_plan_the_split() -> None:
    static = fig.static_overrides(fig.Split(3, 5))
    assert {"train_gpus=3", "rollout_gpus=5", "global_resource_planner.initial_allocation_strategy=configured",
            "global_resource_planner.runtime_online_replanning=false"} <= set(static)
    assert "global_resource_planner.runtime_online_replanning=true" in fig.planner_overrides(True, 8)
    assert "global_resource_planner.initial_allocation_strategy=grp" in fig.planner_overrides(False, 8)


FIGURE_CASES = [
    pytest.param(
        "static", [row(1, 2.0), row(2, 4.0)], [],
        {"split": "train 2 | rollout 2", "steps": 2, "samples_per_s": 8.0, "tokens_per_s": 32.0, "wall_s": 4.0,
         "reconfigurations": 0, "splits_over_time": ["train 2 | rollout 2"]},
        id="static: samples and tokens over the loop's wall time"),
    pytest.param(
        "elastic", [row(1, 2.0, train=3, rollout=1), row(2, 5.0, train=3, rollout=1), row(3, 6.0, train=2, rollout=2)],
        [{"kind": "replan_decision", "action": "kept"}, {"kind": "replan_decision", "action": "requested"},
         {"kind": "reconfigure_requested"}, {"kind": "reconfigure_done", "seconds": 12.34}],
        {"split": "train 3 | rollout 1", "splits_over_time": ["train 3 | rollout 1", "train 2 | rollout 2"],
         "reconfigurations": 1, "reconfiguration_s": [12.3], "replan_decisions": {"kept": 1, "requested": 1},
         "samples_per_s": 8.0, "steps": 3},
        id="elastic: split over time, reconfigurations from events"),
    pytest.param(
        "planner_initial", [row(1, 2.0, samples=10), row(2, 3.0), row(1, 9.0, samples=10), row(2, 10.0)], [],
        {"steps": 2, "samples_per_s": 2.6, "wall_s": 10.0},
        id="a resumed run counts each step once, the newest row"),
]


@pytest.mark.parametrize(("policy", "rows", "events", "expected"), FIGURE_CASES)
def test_run_figures(policy: str, rows: list[dict[str, Any]], events: list[dict[str, Any]],
                     expected: dict[str, Any]) -> None:
    got = fig.run_figures(policy, rows, events)
    assert got["policy"] == policy
    assert {k: got[k] for k in expected} == expected


BAD_RUN_CASES = [
    pytest.param("static", [], "wrote no metrics rows", id="no rows"),
    pytest.param("static", [row(1, 0.0)], "elapsed_s=0.0", id="no wall time"),
    pytest.param("oracle", [row(1, 1.0)], "policy 'oracle'", id="unknown policy"),
]


@pytest.mark.parametrize(("policy", "rows", "message"), BAD_RUN_CASES)
def test_run_figures_refuse_what_they_cannot_read(policy: str, rows: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fig.run_figures(policy, rows, [])


def borrowing(fb_s: float, fb_cpu_s: float, recompute_s: float, recompute_cpu_s: float) -> dict[str, float]:
    return {"train_ehp_borrowed_forward_backward_s": fb_s, "train_ehp_borrowed_forward_backward_cpu_s": fb_cpu_s,
            "train_ehp_borrowed_recompute_s": recompute_s, "train_ehp_borrowed_recompute_cpu_s": recompute_cpu_s}


@pytest.mark.parametrize(("steps", "cores"), [
    pytest.param([borrowing(1.0, 0.2, 0.5, 0.1)], 0.2, id="one-step"),
    pytest.param([borrowing(1.0, 0.1, 0.0, 0.0), borrowing(0.5, 0.2, 0.5, 0.2)], 0.25, id="summed-over-steps"),
    pytest.param([{}, borrowing(2.0, 0.3, 0.0, 0.0)], 0.15, id="a-step-without-borrowing-adds-nothing"),
    pytest.param([{}, {}], None, id="no-borrowing"),
])
def test_borrowed_rank_cores(steps: list[dict[str, Any]], cores: float | None) -> None:
    assert fig.borrowed_rank_cores(steps) == cores


def run(policy: str, samples_per_s: float, steps: int = 8, split: str = "s") -> dict[str, Any]:
    return {"policy": policy, "samples_per_s": samples_per_s, "steps": steps, "split": split}


GAIN_CASES = [
    pytest.param([run("static", 4.0, split="a"), run("static", 5.0, split="b"), run("planner_initial", 4.5),
                  run("elastic", 6.0)], {"static_best_split": "b", "static_best_samples_per_s": 5.0,
                                         "elastic_samples_per_s": 6.0, "gain": 1.2, "same_steps": True},
                 id="elastic over the best static split"),
    pytest.param([run("static", 5.0), run("elastic", 4.0)], {"gain": 0.8, "same_steps": True},
                 id="a loss is a gain below 1"),
    pytest.param([run("static", 5.0), run("elastic", 6.0, steps=7)], {"gain": None, "same_steps": False},
                 id="no gain when the runs reached different steps"),
]


@pytest.mark.parametrize(("runs", "expected"), GAIN_CASES)
def test_gain(runs: list[dict[str, Any]], expected: dict[str, Any]) -> None:
    got = fig.gain(runs)
    assert {k: got[k] for k in expected} == expected


@pytest.mark.parametrize("runs", [
    pytest.param([run("elastic", 1.0)], id="no static run"),
    pytest.param([run("static", 1.0)], id="no elastic run"),
])
def test_gain_needs_both(runs: list[dict[str, Any]]) -> None:
    with pytest.raises(ValueError, match="need static runs and one elastic run"):
        fig.gain(runs)


def test_ehp_figures_compare_median_training_phase_after_warmup() -> None:
    without = [row(s, s, time_train_s=t) for s, t in ((1, 9.0), (2, 2.0), (3, 2.2), (4, 1.8))]
    with_ehp = [row(s, s, time_train_s=t, train_ehp_replicas=2.0, train_ehp_attach_s=t / 2, train_ehp_step_s=t / 4)
                for s, t in ((1, 9.0), (2, 1.0), (3, 1.2), (4, 0.9))]
    got = fig.ehp_figures(without, with_ehp, borrowed_gpus=2)
    assert got["train_phase_s_without"] == 2.0 and got["train_phase_s_with"] == 1.0
    assert got["speedup"] == 2.0 and got["borrowed_gpus"] == 2 and got["steps_that_borrowed"] == 4
    assert got["ehp_attach_s"] == 0.5 and got["ehp_step_s"] == 0.25
    assert got["breakdown"] == {"without": {}, "with": {"train_ehp_attach_s": 0.5, "train_ehp_step_s": 0.25}}
    assert got["train_phase_s_per_step"] == {"without": [9.0, 2.0, 2.2, 1.8], "with": [9.0, 1.0, 1.2, 0.9]}


def test_ehp_figures_break_each_phase_down() -> None:
    parts = {"train_time_forward_backward_s": 0.5, "train_time_recompute_s": 0.1, "train_time_step_s": 0.8}
    without = [row(s, s, time_train_s=1.0, **{k: v * 2 for k, v in parts.items()}) for s in (1, 2, 3)]
    with_ehp = [row(s, s, time_train_s=0.5, train_ehp_replicas=1.0, **parts) for s in (1, 2, 3)]
    got = fig.ehp_figures(without, with_ehp, borrowed_gpus=1)
    assert got["breakdown"] == {"without": {k: v * 2 for k, v in parts.items()}, "with": parts}


def test_ehp_figures_report_the_first_attach_on_its_own() -> None:
    """Step 1 starts the borrowed workers (attach 8 s); steps 2-4 re-attach them parked; steps 3 and 4 train on
    the parameters copied in at the park before them (step 2 found the weights changed since)."""
    without = [row(s, s, time_train_s=t) for s, t in ((1, 3.0), (2, 2.0), (3, 2.0), (4, 2.0))]
    with_ehp = [row(s, s, time_train_s=t, train_ehp_replicas=2.0, train_ehp_attach_s=a, train_ehp_reused=float(u),
                    train_ehp_params_prefetched=float(s > 2))
                for s, t, a, u in ((1, 9.0, 8.0, 0), (2, 1.0, 0.01, 1), (3, 1.0, 0.01, 1), (4, 1.0, 0.01, 1))]
    got = fig.ehp_figures(without, with_ehp, borrowed_gpus=2)
    assert got["train_phase_s_with"] == 1.0 and got["speedup"] == 2.0  # the median leaves the warm-up step out
    assert got["first_attach_s"] == 8.0 and got["train_phase_s_with_first_step"] == 9.0
    assert got["train_phase_s_with_mean_all_steps"] == 3.0 and got["train_phase_s_without_mean_all_steps"] == 2.25
    assert got["steps_that_reused"] == 3 and got["steps_that_borrowed"] == 4
    assert got["steps_with_params_copied_at_park"] == 2


def test_ehp_figures_without_a_breakdown_say_none() -> None:
    rows = [row(s, s, time_train_s=1.0) for s in (1, 2, 3)]
    got = fig.ehp_figures(rows, rows, borrowed_gpus=2)
    assert got["ehp_attach_s"] is None and got["ehp_step_s"] is None and got["steps_that_borrowed"] == 0


def test_ehp_figures_need_steps_after_warmup() -> None:
    with pytest.raises(ValueError, match="need more than 1"):
        fig.ehp_figures([row(1, 1.0)], [row(1, 1.0), row(2, 2.0)], borrowed_gpus=2)


def test_ehp_rounds_pool_every_rounds_steps_after_its_warmup() -> None:
    """Two rounds: a slow machine in the second (both sides slower); the pooled medians take every step after
    each run's warm-up step, and each round keeps its own ratio."""
    def run(times: tuple[float, ...], **extra: float) -> list[dict[str, Any]]:
        return [row(s, s, time_train_s=t, **extra) for s, t in enumerate(times, start=1)]

    rounds = [(run((9.0, 2.0, 2.0, 2.0)), run((9.0, 1.0, 1.0, 1.0), train_ehp_step_s=0.5)),
              (run((9.0, 4.0, 4.0, 4.0)), run((9.0, 2.5, 2.5, 2.5), train_ehp_step_s=1.5))]
    got = fig.ehp_rounds(rounds)
    assert got["speedup_per_round"] == [2.0, 1.6] and got["speedup_median_of_rounds"] == 1.8
    assert got["steps_pooled"] == [6, 6]
    assert got["train_phase_s_without"] == 3.0 and got["train_phase_s_with"] == 1.75 and got["speedup"] == 1.714
    assert got["breakdown"] == {"without": {}, "with": {"train_ehp_step_s": 1.0}}
    assert [r["train_phase_s_without"] for r in got["rounds"]] == [2.0, 4.0]


@pytest.mark.parametrize(("rounds", "message"), [
    pytest.param([], "no EHP rounds", id="none"),
    pytest.param([([row(1, 1.0), row(2, 2.0)], [row(1, 1.0)])], "need more than 1", id="a-run-with-only-its-warmup"),
])
def test_ehp_rounds_refuse(rounds: list[Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fig.ehp_rounds(rounds)


def test_read_jsonl_skips_a_line_cut_short(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"ste')
    assert fig.read_jsonl(path) == [{"step": 1}, {"step": 2}]
    assert fig.read_jsonl(tmp_path / "missing.jsonl") == []
