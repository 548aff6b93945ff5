"""Prompts and verifiable rewards: the task and reward registries, built-in tasks, JSONL / parquet prompt
datasets and held-out evaluation."""

from libra.data.datasets import DatasetTask, PromptRecord, load_records, split_row_slice
from libra.data.evaluation import evaluate
from libra.data.prompt import Encode, Prompt, TaskError, as_encode, make_prompt
from libra.data.registry import (
    RewardFn,
    Task,
    TaskSpec,
    build_task,
    make_reward,
    register_reward,
    register_task,
    reward_names,
    reward_params,
    task_names,
    task_params,
)

__all__ = [
    "DatasetTask",
    "Encode",
    "Prompt",
    "PromptRecord",
    "RewardFn",
    "Task",
    "TaskError",
    "TaskSpec",
    "as_encode",
    "build_task",
    "evaluate",
    "load_records",
    "make_prompt",
    "make_reward",
    "register_reward",
    "register_task",
    "reward_names",
    "reward_params",
    "split_row_slice",
    "task_names",
    "task_params",
]
