"""`cluster.metered_*` reach both pools' specs as one `CpuMetering`, named after the job and its run directory."""

from __future__ import annotations

from libra.config.mapping import config_with, cpu_metering, rollout_pool_spec, training_pool_spec


def test_both_pools_carry_the_same_metering() -> None:
    cfg = config_with("/models/tiny", name="drift", run_dir="/runs/a",
                      cluster={"metered_cpu_per_gpu": 0.25, "metered_cgroup_root": "/sys/fs/cgroup/cpu"})
    metering = cpu_metering(cfg)
    assert metering.enabled and metering.cores_per_gpu == 0.25 and metering.cores_for(4) == 1.0
    assert metering.cgroup_root == "/sys/fs/cgroup/cpu" and metering.job.startswith("drift-")
    assert training_pool_spec(cfg, 2).metering == metering
    assert rollout_pool_spec(cfg, 2, 64 * 2**20).metering == metering


def test_two_runs_of_one_job_name_have_their_own_slices() -> None:
    a = cpu_metering(config_with("/m", name="dev", run_dir="/runs/a"))
    b = cpu_metering(config_with("/m", name="dev", run_dir="/runs/b"))
    assert a.job != b.job and not a.enabled
