"""Schema v1 validation, rank numbering, registry and the tolerant line reader."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from trace_fixtures import SyntheticTrace

from libra.observability import trace_schema as ts

GOOD = {"schema": 1, "name": "train.step", "role": "train", "rank": 1000, "step": 3,
        "start_ns": 10, "end_ns": 20}


@pytest.mark.parametrize(
    ("change", "error"),
    [
        pytest.param({}, None, id="minimal-valid"),
        pytest.param({"step": None}, None, id="null-step"),
        pytest.param({"attrs": {"a": 1}, "kind": "instant", "pid": 4, "host": "h"}, None, id="extra-fields"),
        pytest.param({"end_ns": 10}, None, id="zero-duration"),
        pytest.param({"schema": 2}, "unsupported schema 2", id="future-schema"),
        pytest.param({"schema": True}, "unsupported schema True", id="bool-schema"),
        pytest.param({"name": ""}, "'name' must be a non-empty string", id="empty-name"),
        pytest.param({"role": 5}, "'role' must be a non-empty string", id="role-int"),
        pytest.param({"rank": "0"}, "'rank' must be an integer", id="rank-str"),
        pytest.param({"rank": True}, "'rank' must be an integer", id="rank-bool"),
        pytest.param({"step": 1.5}, "'step' must be an integer or null", id="step-float"),
        pytest.param({"start_ns": 1.0}, "'start_ns' and 'end_ns' must be integers", id="start-float"),
        pytest.param({"end_ns": 9}, "'end_ns' is before 'start_ns'", id="end-before-start"),
        pytest.param({"attrs": [1]}, "'attrs' must be an object", id="attrs-list"),
        pytest.param({"kind": "bogus"}, "unknown kind 'bogus'", id="bad-kind"),
    ],
)
def test_validation_error(change: dict[str, Any], error: str | None) -> None:
    assert ts.validation_error({**GOOD, **change}) == error


@pytest.mark.parametrize("field", ts.REQUIRED_FIELDS)
def test_every_required_field_is_required(field: str) -> None:
    record = {k: v for k, v in GOOD.items() if k != field}
    assert ts.validation_error(record) == f"missing field {field!r}"


@pytest.mark.parametrize(
    ("role", "index", "rank"),
    [("controller", 0, 0), ("train", 0, 1000), ("train", 7, 1007), ("rollout", 3, 2003)],
)
def test_rank_for(role: str, index: int, rank: int) -> None:
    assert ts.rank_for(role, index) == rank


@pytest.mark.parametrize(("role", "index"), [("critic", 0), ("train", 1000), ("rollout", -1)])
def test_rank_for_rejects(role: str, index: int) -> None:
    with pytest.raises(ValueError, match=role):
        ts.rank_for(role, index)


def test_registry() -> None:
    for name in ("rollout.generate", "train.forward_backward", "weight_sync.publish", "reconfigure.drain",
                 "checkpoint.save", "eval", "pool.gpus"):
        assert ts.is_registered(name)
    assert not ts.is_registered("train.mystery")
    assert ts.is_container("train.step") and not ts.is_container("train.optimizer")


def test_every_registered_name_is_documented() -> None:
    manual = (Path(__file__).resolve().parents[3] / "cluster_manual" / "phase_traces.md").read_text()
    missing = [name for name in [*ts.PHASES, *ts.COUNTERS] if f"`{name}`" not in manual]
    assert not missing, f"add these names to cluster_manual/phase_traces.md: {missing}"


def test_reader_keeps_valid_and_counts_bad(synthetic_trace: SyntheticTrace) -> None:
    stats, records = ts.iter_trace(synthetic_trace.directory)
    kept = list(records)
    assert sorted(map(json.dumps, kept)) == sorted(map(json.dumps, synthetic_trace.records))
    by_name = {Path(s.path).name: s for s in stats}
    for name, bad in synthetic_trace.bad_lines.items():
        assert by_name[name].skipped == bad
        assert by_name[name].cut_off == (name in synthetic_trace.cut_off_files)
    assert by_name["phase_trace_rank1000.jsonl"].reasons["not valid JSON"] == 2


def test_complete_last_line_without_newline_is_kept(tmp_path: Path) -> None:
    (tmp_path / "phase_trace_rank5.jsonl").write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD))
    stats, records = ts.iter_trace(tmp_path)
    assert len(list(records)) == 2 and stats[0].skipped == 0


def test_trace_files_finds_traces_subdir_and_explains_absence(tmp_path: Path) -> None:
    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / "phase_trace_rank0.jsonl").write_text("")
    assert [p.name for p in ts.trace_files(tmp_path)] == ["phase_trace_rank0.jsonl"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="phase_trace_enabled"):
        ts.trace_files(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ts.trace_files(tmp_path / "missing")
