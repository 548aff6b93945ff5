"""Verifiable rewards for real use, registered by name (`task.reward`): exact_match, numeric_match, contains
and first_tokens_match. Each returns 1.0 for a correct response and 0.0 otherwise; their keyword-only
arguments are read from `task.params`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from libra.data.prompt import Prompt, first_word, starts_with_ids
from libra.data.registry import register_reward

_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def normalize_text(text: str, ignore_case: bool) -> str:
    """Whitespace collapsed and trimmed; lower-cased when `ignore_case`."""
    collapsed = " ".join(text.split())
    return collapsed.lower() if ignore_case else collapsed


def last_number(text: str) -> float | None:
    """The last number written in `text` (thousands separators allowed), or None when there is none."""
    for match in reversed(_NUMBER.findall(text)):
        try:
            return float(match.replace(",", ""))
        except ValueError:
            continue
    return None


@register_reward("exact_match")
def exact_match(
    prompt: Prompt,
    response_token_ids: Sequence[int],
    response_text: str,
    *,
    ignore_case: bool = False,
    first_word_only: bool = False,
) -> float:
    """1.0 when the response text (whitespace-normalized; only its first word if `first_word_only`) equals
    the label."""
    answer = first_word(response_text) if first_word_only else response_text
    return float(normalize_text(answer, ignore_case) == normalize_text(prompt.label, ignore_case))


@register_reward("numeric_match")
def numeric_match(
    prompt: Prompt,
    response_token_ids: Sequence[int],
    response_text: str,
    *,
    rel_tol: float = 1e-6,
    abs_tol: float = 1e-9,
) -> float:
    """1.0 when the last number in the response equals the label's number within the tolerances."""
    expected = last_number(prompt.label)
    got = last_number(response_text)
    if expected is None or got is None:
        return 0.0
    return float(math.isclose(got, expected, rel_tol=rel_tol, abs_tol=abs_tol))


@register_reward("contains")
def contains(
    prompt: Prompt,
    response_token_ids: Sequence[int],
    response_text: str,
    *,
    ignore_case: bool = False,
) -> float:
    """1.0 when the (non-empty, whitespace-normalized) label appears in the response text."""
    label = normalize_text(prompt.label, ignore_case)
    return float(bool(label) and label in normalize_text(response_text, ignore_case))


@register_reward("first_tokens_match")
def first_tokens_match(
    prompt: Prompt,
    response_token_ids: Sequence[int],
    response_text: str,
) -> float:
    """1.0 when the response starts with the label's token ids, or its first word is the label."""
    if starts_with_ids(response_token_ids, prompt.label_token_ids):
        return 1.0
    return float(bool(prompt.label) and first_word(response_text) == prompt.label.strip())
