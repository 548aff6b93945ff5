"""Configuration findings: `ConfigIssue` (one problem, with field path, value, rule and fix) and
`ConfigError`, which carries every issue of one validation run and renders them grouped by class.

Issue classes follow the operator manual (cluster_manual/validation.md):
Invalid configuration (contradictory or impossible settings), Not implemented (a feature Libra does not
have yet) and Not validated (outside the combinations qualified on this platform). All three stop a job.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

INVALID = "Invalid configuration"
NOT_IMPLEMENTED = "Not implemented"
NOT_VALIDATED = "Not validated"
WARNING = "Warning"
ERROR_KINDS = (INVALID, NOT_IMPLEMENTED, NOT_VALIDATED)


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


MISSING_VALUE: Any = _Missing()


def format_value(value: Any) -> str:
    """A value as the user would write it in YAML (strings quoted, lists in brackets)."""
    if value is MISSING_VALUE:
        return "<missing>"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, tuple | list):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {format_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


@dataclass(frozen=True)
class ConfigIssue:
    """One configuration problem: where (`path`), what (`value`), which rule, how to fix it."""

    path: str
    value: Any
    rule: str
    fix: str
    kind: str = INVALID
    rule_id: str = ""

    def __str__(self) -> str:
        return f"{self.kind}: {self.path} = {format_value(self.value)}: {self.rule.rstrip('.')}. Fix: {sentence(self.fix)}"


def sentence(text: str) -> str:
    """`text` ending in exactly one full stop (a question keeps its question mark)."""
    text = text.rstrip().rstrip(".")
    return text if text.endswith("?") else f"{text}."


class ConfigError(ValueError):
    """Every problem found in one configuration; the CLI prints `str(err)` and exits 2."""

    def __init__(self, errors: list[ConfigIssue], warnings: list[str] | None = None, source: str = "") -> None:
        self.errors = list(errors)
        self.warnings = list(warnings or [])
        self.source = source
        super().__init__(self.report())

    def report(self) -> str:
        where = f" in {self.source}" if self.source else ""
        count = len(self.errors)
        lines = [f"{count} configuration error{'s' if count != 1 else ''}{where}:"]
        for kind in ERROR_KINDS:
            group = [e for e in self.errors if e.kind == kind]
            if group:
                lines.append(f"{kind} ({len(group)}):")
                lines.extend(f"  {issue}" for issue in group)
        if self.warnings:
            lines.append(f"Warnings ({len(self.warnings)}):")
            lines.extend(f"  {w}" for w in self.warnings)
        return "\n".join(lines)
