"""Prompt datasets for real use: JSON-lines and parquet files read into prompts, and the `dataset` task.

A path may end with a row slice, `prompts.jsonl@[0:1000]` (Python slice rules, ends optional). Each row
gives a prompt text (`task.input_key`) and a reference answer (`task.label_key`); the other fields of the
row travel as prompt metadata for custom rewards. Every error names the file, and the line, row or column.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from libra.data.prompt import Encode, ParamValue, Prompt, TaskError, make_prompt
from libra.data.registry import TaskSpec, register_task, resolve_params
from libra.data.rewards import exact_match

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
_SLICE = re.compile(r"^(?P<path>.+)@\[(?P<start>-?\d*):(?P<stop>-?\d*)\]$")


@dataclass(frozen=True)
class PromptRecord:
    """One dataset row: prompt text, label and the row's other fields."""

    text: str
    label: str
    metadata: dict[str, Any]


def split_row_slice(path: str, field: str = "task.dataset_path") -> tuple[str, slice]:
    """(`file`, `slice`) from `file` or `file@[start:stop]`."""
    if "@[" not in path:
        return path, slice(None)
    match = _SLICE.match(path)
    if match is None:
        raise TaskError(
            f"'{path}' has a malformed row slice",
            field=field,
            value=path,
            fix="write it as file.jsonl@[start:stop] (integers, either end may be empty)",
        )
    start, stop = match["start"], match["stop"]
    return match["path"], slice(int(start) if start else None, int(stop) if stop else None)


def _label_text(value: Any) -> str | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    return None


def _missing_column(where: str, key: str, field: str, present: list[str], scope: str) -> TaskError:
    columns = ", ".join(present) or "(none)"
    return TaskError(
        f"{where}: no column '{key}'; columns {scope}: {columns}",
        field=field,
        value=key,
        fix=f"set {field} to one of {columns}, or give every row a '{key}' column",
    )


def _record(row: Any, where: str, input_key: str, label_key: str, field: str, path: str) -> PromptRecord:
    if not isinstance(row, dict):
        raise TaskError(
            f"{where}: expected a JSON object per line, got {type(row).__name__}",
            field=field,
            value=path,
            fix='write one JSON object per line, e.g. {"prompt": ..., "answer": ...}',
        )
    for key, key_field in ((input_key, "task.input_key"), (label_key, "task.label_key")):
        if key not in row:
            raise _missing_column(where, key, key_field, sorted(map(str, row)), "in this row")
    text = row[input_key]
    if not isinstance(text, str) or not text:
        raise TaskError(
            f"{where}, column '{input_key}': the prompt must be a non-empty string, got {text!r}",
            field=field,
            value=path,
            fix=f"give every row a non-empty text in column '{input_key}'",
        )
    label = _label_text(row[label_key])
    if label is None:
        raise TaskError(
            f"{where}, column '{label_key}': the label must be a string or a number, got {row[label_key]!r}",
            field=field,
            value=path,
            fix=f"give every row a string or number in column '{label_key}'",
        )
    extra = {k: v for k, v in row.items() if k not in (input_key, label_key)}
    return PromptRecord(text=text, label=label, metadata=extra)


def _read_jsonl(path: str, input_key: str, label_key: str, field: str) -> list[PromptRecord]:
    records = []
    try:
        with open(path, encoding="utf-8") as fh:
            for line_no, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise TaskError(
                        f"{path}:{line_no}:{exc.colno}: invalid JSON ({exc.msg})",
                        field=field,
                        value=path,
                        fix=f"correct line {line_no}: one JSON object per line",
                    ) from None
                except RecursionError:
                    raise TaskError(
                        f"{path}:{line_no}: JSON nested too deeply to read",
                        field=field,
                        value=path,
                        fix=f"correct line {line_no}: one flat JSON object per line",
                    ) from None
                records.append(_record(row, f"{path}:{line_no}", input_key, label_key, field, path))
    except (OSError, UnicodeDecodeError) as exc:
        raise TaskError(
            f"{path}: not readable as UTF-8 JSON lines ({exc})",
            field=field,
            value=path,
            fix="point it at a readable UTF-8 .jsonl file",
        ) from None
    return records


def _read_parquet(path: str, input_key: str, label_key: str, field: str) -> list[PromptRecord]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise TaskError(
            f"{path}: not a readable parquet file ({exc})",
            field=field,
            value=path,
            fix="point it at a parquet file (or write the data as .jsonl)",
        ) from None
    for key, key_field in ((input_key, "task.input_key"), (label_key, "task.label_key")):
        if key not in table.column_names:
            raise _missing_column(path, key, key_field, list(table.column_names), "of the file")
    return [
        _record(row, f"{path} row {i}", input_key, label_key, field, path)
        for i, row in enumerate(table.to_pylist())
    ]


def load_records(
    path: str, input_key: str = "prompt", label_key: str = "answer", field: str = "task.dataset_path"
) -> list[PromptRecord]:
    """The rows of a .jsonl / .parquet file (optionally `@[start:stop]`-sliced) as prompt records."""
    file_path, rows = split_row_slice(path, field)
    lower = file_path.lower()
    if not lower.endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES):
        raise TaskError(
            f"'{file_path}' is neither JSON lines ({', '.join(JSONL_SUFFIXES)}) "
            f"nor parquet ({', '.join(PARQUET_SUFFIXES)})",
            field=field,
            value=path,
            fix="convert the data to JSON lines or parquet",
        )
    if not os.path.isfile(file_path):
        raise TaskError(
            f"no such file '{file_path}' (a relative path resolves against the YAML file's "
            "directory, then the working directory)",
            field=field,
            value=path,
            fix="point it at an existing file",
        )
    if lower.endswith(JSONL_SUFFIXES):
        records = _read_jsonl(file_path, input_key, label_key, field)
    else:
        records = _read_parquet(file_path, input_key, label_key, field)
    selected = records[rows]
    if not selected:
        sliced = "@[" in path
        raise TaskError(
            f"'{path}' holds no rows" + (f" in that slice (the file has {len(records)})" if sliced else ""),
            field=field,
            value=path,
            fix="choose a slice within the file's rows" if sliced else "point it at a file with rows",
        )
    return selected


@register_task("dataset")
class DatasetTask:
    """Prompts from `task.dataset_path`; held-out prompts from `task.eval_dataset_path`, or else a held-out
    share (`eval_holdout_fraction`) of the training file. Training never sees a held-out prompt text."""

    name = "dataset"
    PARAMS: ClassVar[dict[str, ParamValue]] = {"eval_holdout_fraction": 0.0, "split_seed": 0}

    def __init__(self, spec: TaskSpec, encode: Encode) -> None:
        params = resolve_params("task 'dataset'", self.PARAMS, spec.params)
        if not spec.dataset_path:
            raise TaskError(
                "required when task.name is 'dataset'",
                field="task.dataset_path",
                value="",
                fix="set it to a .jsonl or .parquet file, or choose a built-in task",
            )
        self.encode = encode
        fraction = float(params["eval_holdout_fraction"])
        if not 0.0 <= fraction < 1.0:
            raise TaskError(
                f"{fraction} must be in [0, 1)",
                field="task.params.eval_holdout_fraction",
                value=fraction,
                fix="use a share such as 0.1, or 0 for no held-out prompts",
            )
        if spec.eval_dataset_path and fraction > 0.0:
            raise TaskError(
                "set together with task.eval_dataset_path (held-out prompts come from one place)",
                field="task.params.eval_holdout_fraction",
                value=fraction,
                fix="set it to 0, or remove task.eval_dataset_path",
            )
        records = load_records(spec.dataset_path, spec.input_key, spec.label_key)
        self.eval_records: list[PromptRecord] = []
        if spec.eval_dataset_path:
            self.eval_records = load_records(
                spec.eval_dataset_path, spec.input_key, spec.label_key, field="task.eval_dataset_path"
            )
        elif fraction > 0.0:
            order = np.random.default_rng(int(params["split_seed"])).permutation(len(records))
            n_eval = min(len(records) - 1, max(1, round(len(records) * fraction)))
            held = {int(i) for i in order[:n_eval]}
            self.eval_records = [records[i] for i in sorted(held)]
        held_texts = {r.text for r in self.eval_records}
        self.train_records = [r for r in records if r.text not in held_texts]
        self.dropped_overlap = len(records) - len(self.train_records)
        if not self.train_records:
            raise TaskError(
                f"every one of the {len(records)} prompts of task.dataset_path '{spec.dataset_path}' is also an "
                "evaluation prompt, and training never sees an evaluation prompt, so none is left to train on",
                field="task.eval_dataset_path",
                value=spec.eval_dataset_path,
                fix="point task.eval_dataset_path at prompts other than the training prompts (or use "
                "task.params.eval_holdout_fraction to hold out a share of task.dataset_path)",
            )

    @property
    def num_train_prompts(self) -> int:
        return len(self.train_records)

    @property
    def num_eval_prompts(self) -> int:
        return len(self.eval_records)

    def _prompt(self, record: PromptRecord) -> Prompt:
        return make_prompt(self.encode, record.text, record.label, record.metadata)

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        rng = np.random.default_rng(seed)
        while True:
            for index in rng.permutation(len(self.train_records)):
                yield self._prompt(self.train_records[int(index)])

    def eval_prompts(self, n: int) -> list[Prompt]:
        if not self.eval_records:
            raise TaskError(
                "the dataset task has no held-out prompts to evaluate on",
                field="task.eval_interval",
                fix="set task.eval_dataset_path or task.params.eval_holdout_fraction, or "
                "task.eval_interval: 0",
            )
        chosen = self.eval_records if n <= 0 else self.eval_records[:n]
        return [self._prompt(r) for r in chosen]

    def reward(self, prompt: Prompt, response_token_ids: Sequence[int], response_text: str) -> float:
        return exact_match(prompt, response_token_ids, response_text)
