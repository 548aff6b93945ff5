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
