"""Prompt datasets: JSON lines and parquet, row slices, errors naming file/line/column, the dataset task."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from libra.data import TaskError, TaskSpec, build_task, load_records, split_row_slice

ROWS = [{"question": f"what is {i} + {i} ?", "answer": 2 * i, "level": i % 3} for i in range(20)]


def _write(path: Path, rows: list[dict[str, Any]]) -> str:
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


@pytest.fixture(params=["jsonl", "parquet"])
def dataset_file(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return _write(tmp_path / f"train.{request.param}", ROWS)


@pytest.mark.parametrize(
    ("suffix", "expected"),
    [
        pytest.param("", list(range(20)), id="whole-file"),
        pytest.param("@[0:5]", list(range(5)), id="head"),
        pytest.param("@[15:]", list(range(15, 20)), id="open-end"),
        pytest.param("@[:3]", list(range(3)), id="open-start"),
        pytest.param("@[-2:]", [18, 19], id="negative-start"),
        pytest.param("@[18:100]", [18, 19], id="stop-past-end"),
    ],
)
def test_rows_and_slices(dataset_file: str, suffix: str, expected: list[int]) -> None:
    records = load_records(dataset_file + suffix, input_key="question", label_key="answer")
    assert [int(r.label) // 2 for r in records] == expected
    assert records[0].text == f"what is {expected[0]} + {expected[0]} ?"
    assert records[0].metadata == {"level": expected[0] % 3}


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        pytest.param("a.jsonl", ("a.jsonl", slice(None)), id="plain"),
        pytest.param("dir@x/a.jsonl@[1:2]", ("dir@x/a.jsonl", slice(1, 2)), id="at-in-directory"),
        pytest.param("a.parquet@[:]", ("a.parquet", slice(None, None)), id="empty-bounds"),
    ],
)
def test_split_row_slice(path: str, expected: tuple[str, slice]) -> None:
    assert split_row_slice(path) == expected


BAD_JSONL = [
    pytest.param(
        '{"q": "a", "a": "1"}\n{"q": "b", "a": }\n',
        "train.jsonl:2:17: invalid JSON \\(Expecting value\\)",
        id="invalid-json",
    ),
    pytest.param(
        '{"q": "a", "a": "1"}\n[1, 2]\n', "train.jsonl:2: expected a JSON object", id="not-an-object"
    ),
    pytest.param(
        '{"q": "a", "a": "1"}\n\n{"x": "b", "a": "2"}\n',
        r"task.input_key: .*train.jsonl:3: no column 'q'; columns in this row: a, x",
        id="missing-input",
    ),
    pytest.param('{"q": "a"}\n', r"task.label_key: .*train.jsonl:1: no column 'a'", id="missing-label"),
    pytest.param(
        '{"q": 5, "a": "1"}\n',
        "train.jsonl:1, column 'q': the prompt must be a non-empty string",
        id="prompt-not-string",
    ),
    pytest.param(
        '{"q": "", "a": "1"}\n', "column 'q': the prompt must be a non-empty string", id="empty-prompt"
    ),
    pytest.param('{"q": "a", "a": null}\n', "train.jsonl:1, column 'a': the label must be", id="null-label"),
    pytest.param(
        '{"q": "a", "a": [1]}\n', "column 'a': the label must be a string or a number", id="list-label"
    ),
    pytest.param("", "holds no rows", id="empty-file"),
]


@pytest.mark.parametrize(("content", "message"), BAD_JSONL)
def test_bad_jsonl_names_file_line_and_column(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(TaskError, match=message):
        load_records(str(path), input_key="q", label_key="a")


@pytest.mark.parametrize(
    ("make", "path_suffix", "message"),
    [
        pytest.param(None, "missing.jsonl", "task.dataset_path: no such file", id="missing-file"),
        pytest.param("csv", "data.csv", "neither JSON lines", id="unknown-format"),
        pytest.param("garbage", "data.parquet", "not a readable parquet file", id="corrupt-parquet"),
        pytest.param(
            "parquet",
            "data.parquet",
            r"task.input_key: .*data.parquet: no column 'prompt'; columns of the file: question",
            id="parquet-missing-column",
        ),
        pytest.param(
            "parquet-null", "data.parquet", "data.parquet row 1, column 'answer'", id="parquet-null-label"
        ),
        pytest.param("jsonl", "data.jsonl@[1-2]", "malformed row slice", id="bad-slice"),
        pytest.param("jsonl", "data.jsonl@[30:40]", "holds no rows in that slice", id="empty-slice"),
    ],
)
def test_file_errors(tmp_path: Path, make: str | None, path_suffix: str, message: str) -> None:
    file_path = tmp_path / path_suffix.split("@")[0]
    if make == "csv":
        file_path.write_text("prompt,answer\n", encoding="utf-8")
    elif make == "garbage":
        file_path.write_bytes(b"not parquet at all")
    elif make == "parquet":
        _write(file_path, [{"question": "q", "answer": "1"}])
    elif make == "parquet-null":
        _write(file_path, [{"prompt": "q", "answer": "1"}, {"prompt": "r", "answer": None}])
    elif make == "jsonl":
        _write(file_path, [{"prompt": "q", "answer": "1"}])
    with pytest.raises(TaskError, match=message):
        load_records(str(tmp_path / path_suffix))


@pytest.mark.parametrize(
    ("label", "expected"),
    [
        pytest.param(3, "3", id="int"),
        pytest.param(3.0, "3", id="integral-float"),
        pytest.param(0.25, "0.25", id="float"),
        pytest.param("x", "x", id="string"),
    ],
)
def test_label_text(tmp_path: Path, label: Any, expected: str) -> None:
    path = _write(tmp_path / "d.jsonl", [{"prompt": "p", "answer": label}])
    assert load_records(path)[0].label == expected


def test_dataset_task_with_eval_file(tmp_path: Path, tiny_tokenizer: Any) -> None:
    train = _write(tmp_path / "train.jsonl", [{"prompt": f"{i} + {i} =", "answer": 2 * i} for i in range(10)])
    held = _write(tmp_path / "eval.parquet", [{"prompt": f"{i} + {i} =", "answer": 2 * i} for i in (3, 50)])
    spec = TaskSpec(name="dataset", dataset_path=train, eval_dataset_path=held)
    task = build_task(spec, tiny_tokenizer)
    eval_texts = [p.text for p in task.eval_prompts(0)]
    assert eval_texts == ["3 + 3 =", "50 + 50 ="]
    train_texts = [p.text for p in itertools.islice(task.train_prompts(0), 27)]
    assert "3 + 3 =" not in train_texts  # a prompt of the eval file is dropped from training
    assert len(set(train_texts[:9])) == 9
    prompt = task.eval_prompts(1)[0]
    assert prompt.token_ids == tiny_tokenizer.encode("3 + 3 =")
    assert task.reward(prompt, tiny_tokenizer.encode("6"), "6") == 1.0  # default reward: exact_match
    assert task.reward(prompt, tiny_tokenizer.encode("6 ,"), "6 ,") == 0.0


def test_dataset_task_holdout_and_reward(tmp_path: Path, tiny_tokenizer: Any) -> None:
    path = _write(tmp_path / "train.jsonl", [{"q": f"what is {i} ?", "a": f"it is {i}"} for i in range(40)])
    spec = TaskSpec(
        name="dataset",
        dataset_path=path,
        input_key="q",
        label_key="a",
        reward="numeric_match",
        params={"eval_holdout_fraction": 0.25},
    )
    task = build_task(spec, tiny_tokenizer)
    held = task.eval_prompts(0)
    assert len(held) == 10
    train = {p.text for p in itertools.islice(task.train_prompts(5), 60)}
    assert len(train) == 30 and train.isdisjoint(p.text for p in held)
    assert task.reward(held[0], [], f"the answer : {held[0].label.split()[-1]}") == 1.0
    first = [p.text for p in itertools.islice(task.train_prompts(5), 30)]
    assert first == [p.text for p in itertools.islice(task.train_prompts(5), 30)]


@pytest.mark.parametrize(
    ("spec_fields", "message"),
    [
        pytest.param({}, "task.dataset_path: required", id="no-path"),
        pytest.param(
            {"eval_dataset_path": "EVAL", "params": {"eval_holdout_fraction": 0.1}},
            "held-out prompts come from one place",
            id="two-eval-sources",
        ),
        pytest.param({"params": {"eval_holdout_fraction": 1.5}}, "eval_holdout_fraction", id="bad-fraction"),
        pytest.param(
            {"eval_dataset_path": "TRAIN"},
            "task.eval_dataset_path: every one of the 1 prompts",
            id="eval-equals-train",
        ),
        pytest.param(
            {"eval_dataset_path": "missing.jsonl"},
            "task.eval_dataset_path: no such file",
            id="missing-eval-file",
        ),
    ],
)
def test_dataset_task_errors(
    tmp_path: Path, tiny_tokenizer: Any, spec_fields: dict[str, Any], message: str
) -> None:
    train = _write(tmp_path / "train.jsonl", [{"prompt": "1 + 1 =", "answer": 2}])
    fields = dict(spec_fields)
    if spec_fields:
        fields["dataset_path"] = train
    for key in ("eval_dataset_path",):
        if fields.get(key) == "EVAL":
            fields[key] = train
        elif fields.get(key) == "TRAIN":
            fields[key] = train
        elif fields.get(key):
            fields[key] = str(tmp_path / fields[key])
    with pytest.raises(TaskError, match=message):
        build_task(TaskSpec(name="dataset", **fields), tiny_tokenizer)


def test_eval_without_held_out_prompts_is_an_error(tmp_path: Path, tiny_tokenizer: Any) -> None:
    train = _write(tmp_path / "train.jsonl", [{"prompt": "1 + 1 =", "answer": 2}])
    task = build_task(TaskSpec(name="dataset", dataset_path=train), tiny_tokenizer)
    with pytest.raises(TaskError, match="task.eval_dataset_path or task.params.eval_holdout_fraction"):
        task.eval_prompts(4)
