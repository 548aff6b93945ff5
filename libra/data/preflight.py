"""The checks of a job's task that need only the files the configuration names, done before anything starts.

`libra validate` (and `libra launch`, which validates first) runs them through the configuration rules
`task.builds` and `model.tokenizer` (libra/config/checks_data.py); the controller builds its task with
`build_checked_task` before it starts Ray. Both call the same code, the task's own constructor, the registry
and the dataset reader, so what validation accepts is what the launcher builds, and a problem is reported
once, by its owner, with the option to change, its value and the fix (`TaskError`).

Validation builds the task with `preflight_encode`, a stand-in tokenizer (the model's tokenizer may exist only
once the launcher has built the tiny model), so no check here may depend on token ids.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from libra.data.prompt import TaskError
from libra.data.registry import Task, TaskSpec, build_task

# Any of these makes a directory loadable by transformers' AutoTokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)


@dataclass(frozen=True)
class PromptDemand:
    """What the job asks of its task: prompt groups per training step, and whether it evaluates."""

    batch_size: int
    eval_interval: int = 0


def preflight_encode(text: str) -> list[int]:
    """The stand-in tokenizer of validation: one id per character."""
    return [ord(ch) for ch in text]


def _counted(task: Task) -> Any:
    return getattr(task, "inner", task)  # a task wrapped with a registry reward keeps its counts inside


def check_prompt_supply(task: Task, spec: TaskSpec, demand: PromptDemand) -> None:
    """A dataset task leaves at least `batch_size` training prompts; a task that is evaluated has
    evaluation prompts. Raises `TaskError`."""
    count = getattr(_counted(task), "num_train_prompts", None)
    if spec.name == "dataset" and count is not None and count < demand.batch_size:
        held = getattr(_counted(task), "num_eval_prompts", 0)
        raise TaskError(
            f"task.dataset_path '{spec.dataset_path}' leaves {count} training prompt(s)"
            + (f" after removing the {held} evaluation prompt(s)" if held else "")
            + f", fewer than batch_size {demand.batch_size}: every step would repeat prompts",
            field="batch_size",
            value=demand.batch_size,
            fix=f"lower batch_size to at most {count}, or add training prompts",
        )
    if demand.eval_interval > 0:
        task.eval_prompts(1)  # the task raises its own error when it has none


def build_checked_task(spec: TaskSpec | Any, tokenizer: Any, demand: PromptDemand) -> Task:
    """`build_task`, then `check_prompt_supply`: the task the controller runs."""
    if not isinstance(spec, TaskSpec):
        spec = TaskSpec.from_config(spec)
    task = build_task(spec, tokenizer)
    check_prompt_supply(task, spec, demand)
    return task


def preflight_task(spec: TaskSpec | Any, demand: PromptDemand) -> TaskError | None:
    """The first problem `build_checked_task` would raise at launch, found without the model's tokenizer."""
    try:
        build_checked_task(spec, preflight_encode, demand)
    except TaskError as err:
        return err
    return None


def check_tokenizer_dir(path: str, field: str = "tokenizer_path") -> None:
    """`path` is a readable directory holding tokenizer files (see TOKENIZER_FILES); raises `TaskError`."""
    if not os.path.isdir(path):
        raise TaskError(
            "no such directory" if not os.path.exists(path) else "is a file, not a tokenizer directory",
            field=field,
            value=path,
            fix="point it at a directory saved with save_pretrained, or leave it empty to use model_path",
        )
    try:
        names = set(os.listdir(path))
    except OSError as exc:
        raise TaskError(
            f"cannot be read ({exc.strerror})",
            field=field,
            value=path,
            fix="make the directory readable by the user who runs the job",
        ) from None
    found = [name for name in TOKENIZER_FILES if name in names]
    if not found:
        raise TaskError(
            f"holds none of the tokenizer files {', '.join(TOKENIZER_FILES)}",
            field=field,
            value=path,
            fix="point it at the tokenizer saved with the model (save_pretrained writes them)",
        )
    unreadable = [name for name in found if not os.access(os.path.join(path, name), os.R_OK)]
    if unreadable:
        raise TaskError(
            f"{', '.join(unreadable)} cannot be read",
            field=field,
            value=path,
            fix="make the tokenizer files readable by the user who runs the job",
        )
