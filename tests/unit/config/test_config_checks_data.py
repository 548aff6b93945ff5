"""What can be checked from the files a job names is checked by validation, by the same code the launcher runs:
each bad task section gives one error with the field, its value and the fix, and the runtime's task builder
raises the same error on the same field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from config_bases import gpu_base, with_changes

from libra.config import ConfigError, load, load_dict
from libra.data import TaskError, TaskSpec
from libra.data.preflight import PromptDemand, build_checked_task


def _rows(start: int, stop: int, key: str = "prompt") -> list[dict[str, Any]]:
    return [{key: f"{i} + 1 =", "answer": i + 1} for i in range(start, stop)]


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


@pytest.fixture()
def files(tmp_path: Path) -> Path:
    _jsonl(tmp_path / "train.jsonl", _rows(0, 32))
    _jsonl(tmp_path / "eval.jsonl", _rows(100, 104))
    _jsonl(tmp_path / "overlap20.jsonl", _rows(0, 20))
    _jsonl(tmp_path / "question.jsonl", _rows(0, 32, key="question"))
    (tmp_path / "train.ndjson").write_text((tmp_path / "train.jsonl").read_text())
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a", "answer": 1}\n{"prompt": "b", "answer": }\n')
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "train.csv").write_text("prompt,answer\n1 + 1 =,2\n")
    pq.write_table(pa.Table.from_pylist(_rows(0, 32)), tmp_path / "train.parquet")
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "README").write_text("no tokenizer here\n")
    return tmp_path


DATASET = {"task.name": "dataset", "task.dataset_path": "{tmp}/train.jsonl"}

# (id, changes, field, value ("{tmp}" = the test's folder), a phrase of the fix)
BAD: list[tuple[str, dict[str, Any], str, Any, str]] = [
    (
        "every-prompt-is-eval",
        {**DATASET, "task.eval_dataset_path": "{tmp}/train.jsonl"},
        "task.eval_dataset_path",
        "{tmp}/train.jsonl",
        "prompts other than the training prompts",
    ),
    (
        "eval-leaves-too-few",
        {**DATASET, "task.eval_dataset_path": "{tmp}/overlap20.jsonl"},
        "batch_size",
        16,
        "lower batch_size to at most 12",
    ),
    (
        "slice-too-small",
        {**DATASET, "task.dataset_path": "{tmp}/train.jsonl@[0:8]"},
        "batch_size",
        16,
        "lower batch_size to at most 8",
    ),
    (
        "input-key-missing",
        {**DATASET, "task.dataset_path": "{tmp}/question.jsonl"},
        "task.input_key",
        "prompt",
        "set task.input_key to one of answer, question",
    ),
    (
        "label-key-missing",
        {**DATASET, "task.label_key": "solution"},
        "task.label_key",
        "solution",
        "give every row a 'solution' column",
    ),
    (
        "parquet-key-missing",
        {**DATASET, "task.dataset_path": "{tmp}/train.parquet", "task.input_key": "q"},
        "task.input_key",
        "q",
        "set task.input_key to one of prompt, answer",
    ),
    (
        "invalid-json",
        {**DATASET, "task.dataset_path": "{tmp}/broken.jsonl"},
        "task.dataset_path",
        "{tmp}/broken.jsonl",
        "correct line 2",
    ),
    (
        "empty-file",
        {**DATASET, "task.dataset_path": "{tmp}/empty.jsonl"},
        "task.dataset_path",
        "{tmp}/empty.jsonl",
        "a file with rows",
    ),
    (
        "empty-slice",
        {**DATASET, "task.dataset_path": "{tmp}/train.jsonl@[40:50]"},
        "task.dataset_path",
        "{tmp}/train.jsonl@[40:50]",
        "a slice within the file's rows",
    ),
    (
        "malformed-slice",
        {**DATASET, "task.dataset_path": "{tmp}/train.jsonl@[1-2]"},
        "task.dataset_path",
        "{tmp}/train.jsonl@[1-2]",
        "file.jsonl@[start:stop]",
    ),
    (
        "csv",
        {**DATASET, "task.dataset_path": "{tmp}/train.csv"},
        "task.dataset_path",
        "{tmp}/train.csv",
        "JSON lines or parquet",
    ),
    (
        "missing-eval-file",
        {**DATASET, "task.eval_dataset_path": "{tmp}/nope.jsonl"},
        "task.eval_dataset_path",
        "{tmp}/nope.jsonl",
        "an existing file",
    ),
    (
        "eval-without-prompts",
        {**DATASET, "task.eval_interval": 5},
        "task.eval_interval",
        5,
        "task.params.eval_holdout_fraction",
    ),
    (
        "two-eval-sources",
        {
            **DATASET,
            "task.eval_dataset_path": "{tmp}/eval.jsonl",
            "task.params": {"eval_holdout_fraction": 0.1},
        },
        "task.params.eval_holdout_fraction",
        0.1,
        "remove task.eval_dataset_path",
    ),
    ("reward-unknown", {**DATASET, "task.reward": "exact"}, "task.reward", "exact", "exact_match"),
    ("param-unknown", {"task.params": {"modulos": 7}}, "task.params.modulos", 7, "spelling"),
    (
        "param-type",
        {"task.params": {"modulus": "five"}},
        "task.params.modulus",
        "five",
        "of type int, such as 5",
    ),
    (
        "param-range",
        {"task.name": "copy_first", "task.params": {"length": 0}},
        "task.params.length",
        0,
        "set it to 1 or more",
    ),
    (
        "tokenizer-without-files",
        {"tokenizer_path": "{tmp}/tokenizer"},
        "tokenizer_path",
        "{tmp}/tokenizer",
        "saved with the model",
    ),
]


def _sub(value: Any, tmp: Path) -> Any:
    return value.replace("{tmp}", str(tmp)) if isinstance(value, str) else value


@pytest.mark.parametrize(("changes", "field", "value", "fix"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_task_files_give_field_value_and_fix(
    files: Path, changes: dict[str, Any], field: str, value: Any, fix: str
) -> None:
    data = with_changes(gpu_base(), changes, files)
    with pytest.raises(ConfigError) as info:
        load_dict(data)
    assert len(info.value.errors) == 1, str(info.value)
    issue = info.value.errors[0]
    assert (issue.path, issue.value) == (field, _sub(value, files)), str(issue)
    assert fix in issue.fix, str(issue)
    if field == "tokenizer_path":
        return
    # the launcher's builder (same owner) refuses the same section on the same field, with a real tokenizer
    task = with_changes(
        {"name": "mod_add"}, {k[5:]: v for k, v in changes.items() if k.startswith("task.")}, files
    )
    with pytest.raises(TaskError) as runtime:
        build_checked_task(
            TaskSpec(**{k: v for k, v in task.items() if k != "eval_interval"}),
            lambda text: [len(word) for word in text.split()],
            PromptDemand(data["batch_size"], task.get("eval_interval", 0)),
        )
    assert runtime.value.field == field


GOOD: list[tuple[str, dict[str, Any]]] = [
    (
        "eval-from-holdout",
        {**DATASET, "task.eval_interval": 5, "task.params": {"eval_holdout_fraction": 0.25}},
    ),
    ("eval-file", {**DATASET, "task.eval_dataset_path": "{tmp}/eval.jsonl", "task.eval_interval": 5}),
    ("row-slice", {**DATASET, "task.dataset_path": "{tmp}/train.jsonl@[0:16]"}),
    ("ndjson", {**DATASET, "task.dataset_path": "{tmp}/train.ndjson"}),
    ("parquet", {**DATASET, "task.dataset_path": "{tmp}/train.parquet", "task.reward": "numeric_match"}),
    ("builtin-task-param", {"task.name": "copy_first", "task.params": {"num_values": 6}}),
]


@pytest.mark.parametrize("changes", [c[1] for c in GOOD], ids=[c[0] for c in GOOD])
def test_task_sections_the_launcher_can_build_validate(files: Path, changes: dict[str, Any]) -> None:
    cfg = load_dict(with_changes(gpu_base(), changes, files))
    assert cfg.warnings == []


def test_plan_only_warns_about_task_files(files: Path) -> None:
    """Planning reads no data: `libra plan` on a machine without the dataset reports it as a warning."""
    job = files / "job.yaml"
    job.write_text(
        yaml.safe_dump(
            with_changes(gpu_base(), {**DATASET, "task.dataset_path": "{tmp}/elsewhere.jsonl"}, files)
        )
    )
    with pytest.raises(ConfigError):
        load(str(job))
    cfg = load(str(job), planning=True)
    assert [w for w in cfg.warnings if w.startswith("task.dataset_path = ") and w.endswith("[task.builds]")]
