"""`libra launch` refuses bad input before anything starts (exit 2, the problem named)."""

from __future__ import annotations

from pathlib import Path

import pytest

from libra.cli.main import main


def test_missing_config_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err


def test_invalid_option_exits_2_with_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "job.yaml"
    config.write_text("model_path: /nonexistent\nbatch_size: 0\n")
    assert main(["launch", str(config), "--run-dir", str(tmp_path / "run")]) == 2
    assert "batch_size" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_negative_max_steps_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", str(tmp_path / "job.yaml"), "--max-steps", "-1"]) == 2
    assert "--max-steps" in capsys.readouterr().err


def _dataset_job(tmp_path: Path, eval_rows: range) -> Path:
    """A CPU job on a dataset of 32 prompts whose evaluation file holds the prompts `eval_rows`."""
    for name, rows in (("train.jsonl", range(32)), ("eval.jsonl", eval_rows)):
        (tmp_path / name).write_text("".join(f'{{"prompt": "{i} + 1 =", "answer": {i + 1}}}\n' for i in rows))
    config = tmp_path / "job.yaml"
    config.write_text(
        "model_path: tiny-model\nbuild_tiny_model: {enabled: true}\n"
        "cluster: {num_nodes: 1, gpus_per_node: 4, gpu_type: cpu-logical, logical_gpus: true}\n"
        "train_gpus: 2\nrollout_gpus: 2\nbatch_size: 8\nn_samples: 4\nmax_model_len: 512\nmax_new_tokens: 16\n"
        "rollout_kv_cache_bytes: 67108864\nmegatron_use_cpu_initialization: true\nmegatron_params_dtype: fp32\n"
        "optimizer: {clip_grad: 0.0}\n"
        "global_resource_planner: {memory_budget_safety_margin_bytes: 268435456}\n"
        "task: {name: dataset, dataset_path: train.jsonl, eval_dataset_path: eval.jsonl}\n"
    )
    return config


def _ray_must_not_start(*args: object, **kwargs: object) -> None:
    raise AssertionError("Ray was started before the task's files were checked")


def test_dataset_that_is_all_eval_prompts_exits_2_before_ray(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from libra.controller import bootstrap

    monkeypatch.setattr(bootstrap, "start_ray", _ray_must_not_start)
    config = _dataset_job(tmp_path, range(32))
    assert main(["launch", str(config), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "task.eval_dataset_path" in err and "none is left to train on" in err and "Fix:" in err
    assert not (tmp_path / "run").exists()


def test_controller_builds_the_task_before_ray(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files that change between validation and launch (or a resumed run) still stop the job before Ray."""
    from libra.config import load
    from libra.controller import Controller, LaunchOptions, bootstrap
    from libra.data import TaskError
    from libra.data.preflight import preflight_encode
    from libra.run_dir import RunDir

    config = _dataset_job(tmp_path, range(100, 104))
    cfg = load(str(config), [f"run_dir={tmp_path / 'run'}"])
    (tmp_path / "eval.jsonl").write_text((tmp_path / "train.jsonl").read_text())  # now every prompt is eval
    monkeypatch.setattr(bootstrap, "start_ray", _ray_must_not_start)
    monkeypatch.setattr(bootstrap, "ensure_tiny_model", lambda cfg: None)
    monkeypatch.setattr(bootstrap, "load_tokenizer", lambda cfg: preflight_encode)
    controller = Controller(
        cfg, RunDir.at(cfg.run_dir), LaunchOptions(console="off", install_signal_handlers=False)
    )
    with pytest.raises(TaskError) as info:
        controller.run_job()
    assert info.value.field == "task.eval_dataset_path"


class _StopBeforeTheModel(Exception):
    pass


def _stop_before_the_model(*args: object, **kwargs: object) -> None:
    raise _StopBeforeTheModel


@pytest.mark.parametrize(("backends", "serves"), [(["jsonl"], False), (["jsonl", "prometheus"], True)],
                         ids=["port-without-the-backend-serves-nothing", "the-backend-serves-on-the-port"])
def test_the_exporter_starts_only_with_the_prometheus_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              backends: list[str], serves: bool) -> None:
    """What `tracking.port_unused` tells the user (a port without the backend is ignored) is what runs."""
    import socket

    from libra.config import load
    from libra.controller import Controller, LaunchOptions, bootstrap
    from libra.run_dir import RunDir

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = _dataset_job(tmp_path, range(100, 104))
    cfg = load(str(config), [f"run_dir={tmp_path / 'run'}", f"tracking.backends={backends}",
                             f"tracking.prometheus_port={port}"])
    assert any("tracking.port_unused" in w for w in cfg.warnings) is not serves
    monkeypatch.setattr(bootstrap, "ensure_tiny_model", _stop_before_the_model)  # the exporter started before
    controller = Controller(cfg, RunDir.at(cfg.run_dir), LaunchOptions(console="off", install_signal_handlers=False))
    with pytest.raises(_StopBeforeTheModel):
        controller.run_job()
    assert (controller.metrics is not None and controller.metrics.port == port) is serves


def test_the_controller_declares_its_pools_device_while_its_job_runs_and_withdraws_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`libra.device.pools_on_cuda` answers from the configuration while the job runs (logical GPUs here) and
    from this process again once it ended, a failed job included, as the environment the controller set is
    restored."""
    from libra import device
    from libra.config import load
    from libra.controller import Controller, LaunchOptions, bootstrap
    from libra.run_dir import RunDir

    declared: list[bool | None] = []

    def note_then_stop(*args: object) -> None:
        declared.append(device._declared_logical_gpus)
        raise _StopBeforeTheModel

    cfg = load(str(_dataset_job(tmp_path, range(100, 104))), [f"run_dir={tmp_path / 'run'}"])
    monkeypatch.setattr(device, "_declared_logical_gpus", None)
    monkeypatch.setattr(bootstrap, "ensure_tiny_model", note_then_stop)
    controller = Controller(cfg, RunDir.at(cfg.run_dir), LaunchOptions(console="off", install_signal_handlers=False))
    with pytest.raises(_StopBeforeTheModel):
        controller.run_job()
    assert declared == [cfg.cluster.logical_gpus] == [True]
    assert device._declared_logical_gpus is None
