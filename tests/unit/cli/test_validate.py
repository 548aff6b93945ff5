"""`libra validate`: exit 0 with a summary for a valid file, exit 2 with every error and no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def run_validate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "libra.cli.main", "validate", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_valid_file_prints_summary_and_exits_0() -> None:
    result = run_validate("configs/dev.yaml")
    assert result.returncode == 0, result.stderr
    for word in ("valid", "model", "cluster", "split", "layout", "batch", "warnings"):
        assert word in result.stdout
    assert "DP2" in result.stdout


def test_override_that_breaks_the_layout_exits_2() -> None:
    result = run_validate("configs/qwen2.5-7b-8gpu.yaml", "--set", "train_tp_size=3", "--set", "rollout_weight_sync_mode=nccl")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "Invalid configuration: train_tp_size = 3: TP x PP x CP = 3 x 1 x 1 = 3 does not divide the 4 training " \
           "GPUs (DP = GPUs / (TP x PP x CP)). Fix: choose train_tp_size from {1, 2, 4}." in result.stderr
    assert "Not implemented (1):" in result.stderr


@pytest.mark.parametrize(("content", "expected"), [
    (None, "cannot read the configuration file"),
    ("model_path: [unclosed\n", "YAML syntax error"),
    ("model_pth: x\n", "did you mean model_path?"),
], ids=["missing-file", "syntax-error", "unknown-key"])
def test_bad_files_exit_2_without_traceback(tmp_path: Path, content: str | None, expected: str) -> None:
    path = tmp_path / "job.yaml"
    if content is not None:
        path.write_text(content)
    result = run_validate(str(path))
    assert result.returncode == 2
    assert expected in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
