"""The task names the config accepts are exactly the tasks the data registry provides."""

from __future__ import annotations

from typing import get_args

from libra.config.sections import BUILTIN_TASKS, TaskName
from libra.data import task_names


def test_config_task_names_match_registry() -> None:
    assert set(get_args(TaskName)) == set(task_names())
    assert set(BUILTIN_TASKS) == set(task_names()) - {"dataset"}
