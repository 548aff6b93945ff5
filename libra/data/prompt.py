"""The prompt record that travels from a task to the rollout pool, and the tokenizer adapter.

Token ids travel, not text: a task turns its text into ids once, with the model's own tokenizer (an HF
tokenizer object or any `encode(text) -> list[int]` callable), and the rollout pool only ever sees ids.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Encode = Callable[[str], list[int]]
ParamValue = int | float | str


UNSET: Any = object()  # TaskError.value when the error does not carry the option's value


class TaskError(ValueError):
    """A task, reward or dataset was set up wrongly. `field` names the option to change (`task.input_key`),
    `value` its value, `problem` what is wrong (with the file, line or row) and `fix` what to do; the message
    says all of it. Configuration validation turns the same error into a finding on `field`."""

    def __init__(self, problem: str, *, field: str = "", value: Any = UNSET, fix: str = "") -> None:
        self.problem = problem
        self.field = field
        self.value = value
        self.fix = fix
        text = f"{field}: {problem}" if field else problem
        super().__init__(f"{text}; fix: {fix}" if fix else text)


@dataclass(frozen=True)
class Prompt:
    """One prompt: its text, its token ids, the reference answer and free-form metadata.

    `label_token_ids` is the label as the model's tokenizer writes it, so a reward can compare ids directly.
    """

    text: str
    token_ids: list[int]
    label: str
    label_token_ids: list[int] = field(default_factory=list)
    metadata: Mapping[str, Any] = field(default_factory=dict)


def as_encode(tokenizer: Any) -> Encode:
    """An `encode(text) -> list[int]` callable from an HF tokenizer (anything with `.encode`) or a callable.

    HF tokenizers are called with their defaults, the way an inference server tokenizes a text prompt.
    """
    method = getattr(tokenizer, "encode", None)
    if callable(method):

        def encode_with_tokenizer(text: str) -> list[int]:
            return [int(i) for i in method(text)]

        return encode_with_tokenizer
    if callable(tokenizer):

        def encode_with_callable(text: str) -> list[int]:
            return [int(i) for i in tokenizer(text)]

        return encode_with_callable
    raise TypeError(
        f"expected a tokenizer with an encode(text) method or an encode(text) -> list[int] callable, "
        f"got {type(tokenizer).__name__}"
    )


def make_prompt(encode: Encode, text: str, label: str, metadata: Mapping[str, Any] | None = None) -> Prompt:
    """A `Prompt` with the text and the label both tokenized by `encode`."""
    return Prompt(
        text=text,
        token_ids=encode(text),
        label=label,
        label_token_ids=encode(label) if label else [],
        metadata=dict(metadata or {}),
    )


def first_word(text: str) -> str:
    """The first whitespace-separated word of a response ("" for an empty response)."""
    words = text.split()
    return words[0] if words else ""


def starts_with_ids(response_token_ids: Sequence[int], expected: Sequence[int]) -> bool:
    """Whether the response begins with exactly the `expected` token ids (never true for an empty label)."""
    return bool(expected) and list(response_token_ids[: len(expected)]) == list(expected)


# The key of `Prompt.metadata` by which a task asks for a smaller response budget than the job's
# `max_new_tokens` for one prompt (a workload whose response length drifts over training).
RESPONSE_BUDGET_KEY = "max_new_tokens"


def response_budget(prompt: Any, max_new_tokens: int) -> int:
    """The tokens the rollout may generate for `prompt`: the job's `max_new_tokens`, or less where the task's
    prompt asks for less (`metadata[RESPONSE_BUDGET_KEY]`); never more, never below 1."""
    asked = getattr(prompt, "metadata", {}).get(RESPONSE_BUDGET_KEY)
    return max_new_tokens if asked is None else max(1, min(max_new_tokens, int(asked)))
