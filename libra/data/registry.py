"""Task and reward registries: the `Task` protocol, `register_task` / `register_reward`, and `build_task`,
which turns the job's `task` section into a ready task with its reward.

A task factory is called as `factory(spec, encode)` and declares its parameters (with defaults) in a
`PARAMS` mapping; a reward is a function `fn(prompt, response_token_ids, response_text, *, p1=..., ...)`
whose keyword-only arguments are its parameters. Both read their parameters from `task.params`, and a key
that neither knows is an error naming the keys that are known. Modules named in the environment variable
LIBRA_TASK_MODULES (comma-separated) are imported before any lookup, so a job can bring its own.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast, runtime_checkable

from libra.data.prompt import Encode, ParamValue, Prompt, TaskError, as_encode

RewardFn = Callable[[Prompt, Sequence[int], str], float]

_BUILTIN_MODULES = ("libra.data.rewards", "libra.data.builtin_tasks", "libra.data.drift_task", "libra.data.datasets")
TASK_MODULES_ENV = "LIBRA_TASK_MODULES"  # comma-separated modules that register tasks / rewards of a job


@runtime_checkable
class Task(Protocol):
    """Where prompts come from and how a response is scored."""

    name: str

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        """An endless stream of training prompts, the same stream for the same seed."""
        ...

    def eval_prompts(self, n: int) -> list[Prompt]:
        """Up to `n` held-out prompts (all of them when n <= 0), never among the training prompts."""
        ...

    def reward(self, prompt: Prompt, response_token_ids: Sequence[int], response_text: str) -> float:
        """The scalar reward of one response."""
        ...


@dataclass(frozen=True)
class TaskSpec:
    """The job's `task` section as this package needs it (field names as in the configuration)."""

    name: str = "mod_add"
    params: Mapping[str, ParamValue] = field(default_factory=dict)
    dataset_path: str = ""
    eval_dataset_path: str = ""
    input_key: str = "prompt"
    label_key: str = "answer"
    reward: str = ""

    @classmethod
    def from_config(cls, task_config: Any) -> TaskSpec:
        """From the configuration's `task` section (`Config.task`): every field is read from it, none is
        filled in from this class's defaults, so a renamed option fails here instead of being dropped."""
        return cls(
            name=str(task_config.name),
            params=dict(task_config.params),
            dataset_path=str(task_config.dataset_path),
            eval_dataset_path=str(task_config.eval_dataset_path),
            input_key=str(task_config.input_key),
            label_key=str(task_config.label_key),
            reward=str(task_config.reward),
        )


TaskFactory = Callable[[TaskSpec, Encode], Task]

_TASKS: dict[str, TaskFactory] = {}
_REWARDS: dict[str, Callable[..., float]] = {}


def register_task(name: str) -> Callable[[TaskFactory], TaskFactory]:
    """Decorator: register a task factory (a class or function called as `factory(spec, encode)`)."""

    def decorate(factory: TaskFactory) -> TaskFactory:
        if name in _TASKS and _TASKS[name] is not factory:
            raise ValueError(f"task '{name}' is already registered by {_TASKS[name]!r}")
        _TASKS[name] = factory
        return factory

    return decorate


def register_reward(name: str) -> Callable[[Callable[..., float]], Callable[..., float]]:
    """Decorator: register `fn(prompt, response_token_ids, response_text, *, param=default, ...)`."""

    def decorate(fn: Callable[..., float]) -> Callable[..., float]:
        if name in _REWARDS and _REWARDS[name] is not fn:
            raise ValueError(f"reward '{name}' is already registered by {_REWARDS[name]!r}")
        _REWARDS[name] = fn
        return fn

    return decorate


def _load_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)
    for module in filter(None, (m.strip() for m in os.environ.get(TASK_MODULES_ENV, "").split(","))):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise TaskError(
                f"{TASK_MODULES_ENV}: cannot import '{module}' ({exc})",
                field="task",
                fix=f"install the module or remove it from {TASK_MODULES_ENV}",
            ) from exc


def task_names() -> list[str]:
    _load_builtins()
    return sorted(_TASKS)


def reward_names() -> list[str]:
    _load_builtins()
    return sorted(_REWARDS)


def _unknown(kind: str, field: str, name: str, known: list[str]) -> TaskError:
    return TaskError(
        f"unknown {kind} ({field}) '{name}'",
        field=field,
        value=name,
        fix=f"choose one of {', '.join(known)}, or register your own (module in {TASK_MODULES_ENV})",
    )


def task_params(name: str) -> dict[str, ParamValue]:
    """The declared parameters of a task with their defaults (empty when the factory declares none)."""
    _load_builtins()
    if name not in _TASKS:
        raise _unknown("task", "task.name", name, task_names())
    return dict(getattr(_TASKS[name], "PARAMS", {}))


def reward_params(name: str) -> dict[str, ParamValue]:
    """The keyword-only parameters of a registered reward with their defaults."""
    _load_builtins()
    if name not in _REWARDS:
        raise _unknown("reward", "task.reward", name, reward_names())
    signature = inspect.signature(_REWARDS[name])
    return {
        p.name: p.default
        for p in signature.parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is not inspect.Parameter.empty
    }


def coerce_param(owner: str, key: str, value: Any, default: ParamValue) -> ParamValue:
    """`value` checked against the type of its default (an int is accepted where a float is expected, 0 / 1
    where a bool is)."""
    expected: type = type(default)
    if expected is bool and isinstance(value, int) and value in (0, 1):
        return bool(value)
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) or not isinstance(value, expected):
        raise TaskError(
            f"{value!r} is not of type {expected.__name__} that {owner} expects (default {default!r})",
            field=f"task.params.{key}",
            value=value,
            fix=f"give a value of type {expected.__name__}, such as {default!r}",
        )
    return cast(ParamValue, value)


def resolve_params(
    owner: str, declared: Mapping[str, ParamValue], given: Mapping[str, Any]
) -> dict[str, Any]:
    """The declared parameters, defaults overridden by the given ones that `owner` declares."""
    resolved: dict[str, Any] = dict(declared)
    for key, value in given.items():
        if key in declared:
            resolved[key] = coerce_param(owner, key, value, declared[key])
    return resolved


def make_reward(name: str, params: Mapping[str, Any] | None = None) -> RewardFn:
    """The registered reward `name` with its parameters bound from `params` (keys it does not take ignored)."""
    declared = reward_params(name)
    bound = resolve_params(f"reward '{name}'", declared, params or {})
    return functools.partial(_REWARDS[name], **bound)


class _WithReward:
    """A task whose prompts come from `inner` and whose responses are scored by a registry reward."""

    def __init__(self, inner: Task, reward_fn: RewardFn) -> None:
        self.inner = inner
        self.name = inner.name
        self._reward_fn = reward_fn

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        return self.inner.train_prompts(seed)

    def eval_prompts(self, n: int) -> list[Prompt]:
        return self.inner.eval_prompts(n)

    def reward(self, prompt: Prompt, response_token_ids: Sequence[int], response_text: str) -> float:
        return float(self._reward_fn(prompt, response_token_ids, response_text))


def default_reward_name(spec: TaskSpec) -> str:
    """The reward a dataset task uses when `task.reward` is empty; built-in tasks score with their own."""
    return spec.reward or ("exact_match" if spec.name == "dataset" else "")


def build_task(spec: TaskSpec | Any, tokenizer: Any) -> Task:
    """A ready task from a `TaskSpec` (or the configuration's `task` section) and the model's tokenizer.

    Unknown `task.params` keys (known neither by the task nor by its reward) are an error.
    """
    if not isinstance(spec, TaskSpec):
        spec = TaskSpec.from_config(spec)
    _load_builtins()
    if spec.name not in _TASKS:
        raise _unknown("task", "task.name", spec.name, task_names())
    factory = _TASKS[spec.name]
    reward_name = default_reward_name(spec)
    known = dict(getattr(factory, "PARAMS", {}))
    if reward_name:
        known.update(reward_params(reward_name))
    if hasattr(factory, "PARAMS"):
        unknown = sorted(set(spec.params) - set(known))
        if unknown:
            raise TaskError(
                f"unknown key(s) {', '.join(unknown)} for task '{spec.name}'"
                + (f" with reward '{reward_name}'" if reward_name else "")
                + f"; known keys: {', '.join(sorted(known)) or '(none)'}",
                field=f"task.params.{unknown[0]}",
                value=spec.params[unknown[0]],
                fix="remove the key or correct its spelling",
            )
    task = factory(spec, as_encode(tokenizer))
    if reward_name:
        return _WithReward(task, make_reward(reward_name, spec.params))
    return task
