"""`libra trace convert|summary|diff|plot` and scripts/phase_trace_to_chrome.py: outputs and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from libra.cli.main import main

REPO = Path(__file__).resolve().parents[3]


def write_run(directory: Path, fb_ns: int, steps: int = 2) -> Path:
    """An independent minimal-schema trace: one training rank, one rollout instance."""
    directory.mkdir(parents=True)
    t0 = 1_700_000_000_000_000_001
    train, rollout = [], []
    for step in range(steps):
        base = t0 + step * 10_000_000
        train.append({"schema": 1, "name": "train.forward_backward", "role": "train", "rank": 1000,
                      "step": step, "start_ns": base + 3_000_000, "end_ns": base + 3_000_000 + fb_ns})
        rollout.append({"schema": 1, "name": "rollout.generate", "role": "rollout", "rank": 2000,
                        "step": step, "start_ns": base, "end_ns": base + 2_000_000})
    (directory / "phase_trace_rank1000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    (directory / "phase_trace_rank2000.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rollout) + '{"schema": 1, "name": "rollout.gen')
    return directory


@pytest.fixture
def runs(tmp_path: Path) -> tuple[Path, Path, Path]:
    return (write_run(tmp_path / "base", fb_ns=1_000_000), write_run(tmp_path / "same", fb_ns=1_000_000),
            write_run(tmp_path / "slow", fb_ns=1_500_000))


def test_convert(runs: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "trace.json"
    assert main(["trace", "convert", str(runs[0]), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "4 spans" in printed and "skipped 1 line(s) (1 cut-off last line)" in printed
    events = json.loads(out.read_text())["traceEvents"]
    assert len([e for e in events if e["ph"] == "X"]) == 4
    assert main(["trace", "convert", str(runs[0]), "-o", str(tmp_path / "t.json"), "--gzip", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["skipped_lines"] == 1


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["trace", "convert", "{tmp}/missing", "-o", "{tmp}/o.json"], id="convert-missing-dir"),
        pytest.param(["trace", "convert", "{base}", "-o", "{tmp}/nodir/o.json"], id="convert-missing-out-dir"),
        pytest.param(["trace", "summary", "{tmp}/missing"], id="summary-missing-dir"),
        pytest.param(["trace", "summary", "{tmp}"], id="summary-no-trace-files"),
        pytest.param(["trace", "diff", "{base}", "{tmp}/missing"], id="diff-missing-dir"),
        pytest.param(["trace", "diff", "{base}", "{base}", "--threshold", "-1"], id="diff-bad-threshold"),
        pytest.param(["trace", "plot", "{tmp}/missing", "-o", "{tmp}/p.png"], id="plot-missing-dir"),
        pytest.param(["trace"], id="no-action"),
    ],
)
def test_bad_input_exits_2(runs: tuple[Path, Path, Path], tmp_path: Path, argv: list[str],
                           capsys: pytest.CaptureFixture[str]) -> None:
    args = [a.replace("{tmp}", str(tmp_path)).replace("{base}", str(runs[0])) for a in argv]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err


def test_summary_json_and_table(runs: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "summary", str(runs[0]), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    fb = summary["phases"]["train.forward_backward"]
    assert (fb["count"], fb["total_ns"], fb["p50_ns"]) == (2, 2_000_000, 1_000_000.0)
    assert summary["skipped_lines"] == 1
    assert main(["trace", "summary", str(runs[0])]) == 0
    table = capsys.readouterr().out
    assert "train.forward_backward" in table and "rollout.generate" in table and "idle" in table


@pytest.mark.parametrize(
    ("new", "extra", "code", "regressions"),
    [
        pytest.param("same", [], 0, [], id="unchanged"),
        pytest.param("slow", [], 0, ["train.forward_backward"], id="regression-reported"),
        pytest.param("slow", ["--fail-on-regression"], 1, ["train.forward_backward"], id="regression-fails"),
        pytest.param("slow", ["--fail-on-regression", "--threshold", "1.6"], 0, [], id="under-threshold"),
        pytest.param("same", ["--fail-on-regression"], 0, [], id="unchanged-with-fail-flag"),
    ],
)
def test_diff_exit_codes(runs: tuple[Path, Path, Path], new: str, extra: list[str], code: int,
                         regressions: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    new_dir = {"same": runs[1], "slow": runs[2]}[new]
    assert main(["trace", "diff", str(runs[0]), str(new_dir), "--json", *extra]) == code
    report = json.loads(capsys.readouterr().out)
    assert report["regressions"] == regressions
    assert main(["trace", "diff", str(runs[0]), str(new_dir), *extra]) == code
    assert f"{len(regressions)} regression(s)" in capsys.readouterr().out


def test_plot(runs: tuple[Path, Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "timeline.png"
    assert main(["trace", "plot", str(runs[0]), "-o", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_script_wrapper(runs: tuple[Path, Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "s.json.gz"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "phase_trace_to_chrome.py"), str(runs[0]),
                           "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:2] == b"\x1f\x8b"
    missing = subprocess.run([sys.executable, str(REPO / "scripts" / "phase_trace_to_chrome.py"),
                              str(tmp_path / "nope"), "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "does not exist" in missing.stderr
