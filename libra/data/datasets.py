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
        raise TaskError(f"{field}: '{path}' has a malformed row slice; write it as file.jsonl@[start:stop]")
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


def _record(row: Any, where: str, input_key: str, label_key: str) -> PromptRecord:
    if not isinstance(row, dict):
        raise TaskError(f"{where}: expected a JSON object per line, got {type(row).__name__}")
    for key, field in ((input_key, "task.input_key"), (label_key, "task.label_key")):
        if key not in row:
            present = ", ".join(sorted(map(str, row))) or "(none)"
            raise TaskError(f"{where}: no column '{key}' ({field}); columns in this row: {present}")
    text = row[input_key]
    if not isinstance(text, str) or not text:
        raise TaskError(f"{where}, column '{input_key}': the prompt must be a non-empty string, got {text!r}")
    label = _label_text(row[label_key])
    if label is None:
        raise TaskError(
            f"{where}, column '{label_key}': the label must be a string or a number, got {row[label_key]!r}"
        )
    extra = {k: v for k, v in row.items() if k not in (input_key, label_key)}
    return PromptRecord(text=text, label=label, metadata=extra)


def _read_jsonl(path: str, input_key: str, label_key: str) -> list[PromptRecord]:
    records = []
    with open(path, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TaskError(f"{path}:{line_no}:{exc.colno}: invalid JSON ({exc.msg})") from None
            records.append(_record(row, f"{path}:{line_no}", input_key, label_key))
    return records


def _read_parquet(path: str, input_key: str, label_key: str) -> list[PromptRecord]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise TaskError(f"{path}: not a readable parquet file ({exc})") from None
    for key, field in ((input_key, "task.input_key"), (label_key, "task.label_key")):
        if key not in table.column_names:
            raise TaskError(f"{path}: no column '{key}' ({field}); columns: {', '.join(table.column_names)}")
    return [_record(row, f"{path} row {i}", input_key, label_key) for i, row in enumerate(table.to_pylist())]


def load_records(
    path: str, input_key: str = "prompt", label_key: str = "answer", field: str = "task.dataset_path"
) -> list[PromptRecord]:
    """The rows of a .jsonl / .parquet file (optionally `@[start:stop]`-sliced) as prompt records."""
    file_path, rows = split_row_slice(path, field)
    if not os.path.isfile(file_path):
        raise TaskError(f"{field}: no such file '{file_path}'")
    lower = file_path.lower()
    if lower.endswith(JSONL_SUFFIXES):
        records = _read_jsonl(file_path, input_key, label_key)
    elif lower.endswith(PARQUET_SUFFIXES):
        records = _read_parquet(file_path, input_key, label_key)
    else:
        raise TaskError(
            f"{field}: '{file_path}' is neither JSON lines ({', '.join(JSONL_SUFFIXES)}) "
            f"nor parquet ({', '.join(PARQUET_SUFFIXES)})"
        )
    selected = records[rows]
    if not selected:
        raise TaskError(f"{field}: '{path}' holds no rows" + (" in that slice" if "@[" in path else ""))
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
                "task.dataset_path: required when task.name is 'dataset'; give a .jsonl or .parquet"
            )
        self.encode = encode
        records = load_records(spec.dataset_path, spec.input_key, spec.label_key)
        fraction = float(params["eval_holdout_fraction"])
        if not 0.0 <= fraction < 1.0:
            raise TaskError(f"task.params.eval_holdout_fraction: {fraction} must be in [0, 1)")
        if spec.eval_dataset_path and fraction > 0.0:
            raise TaskError(
                "task.params.eval_holdout_fraction: set it to 0 when task.eval_dataset_path is given "
                "(held-out prompts come from one place)"
            )
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
                f"task.dataset_path: every prompt of '{spec.dataset_path}' is also an eval prompt"
            )

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
                "no held-out prompts: set task.eval_dataset_path or task.params.eval_holdout_fraction"
            )
        chosen = self.eval_records if n <= 0 else self.eval_records[:n]
        return [self._prompt(r) for r in chosen]

    def reward(self, prompt: Prompt, response_token_ids: Sequence[int], response_text: str) -> float:
        return exact_match(prompt, response_token_ids, response_text)
