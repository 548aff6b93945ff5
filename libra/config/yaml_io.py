"""YAML reading with YAML 1.2 scalars: only true/false are booleans and 1e-6 is a float.

PyYAML implements YAML 1.1, where `off`, `no`, `yes`, `on` are booleans (so `console: off` would become
False) and `1e-6` is a string. Configuration files are read with a loader that resolves scalars the
YAML 1.2 way, and duplicate keys are reported instead of silently keeping the last one.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from libra.config.errors import INVALID, MISSING_VALUE, ConfigIssue

_BOOL_TAG = "tag:yaml.org,2002:bool"
_FLOAT_TAG = "tag:yaml.org,2002:float"
_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_FLOAT = re.compile(
    r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
    |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 booleans/floats that records duplicate mapping keys."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self.duplicate_keys: list[tuple[str, int]] = []

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)  # type: ignore[no-untyped-call]
            if not isinstance(key, str):
                continue  # a list or mapping as a key is refused by the base class with a position
            if key in seen:
                self.duplicate_keys.append((key, key_node.start_mark.line + 1))
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_BOOL_TAG, _FLOAT_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(_BOOL_TAG, _BOOL, list("tTfF"))
_Loader.add_implicit_resolver(_FLOAT_TAG, _FLOAT, list("-+0123456789."))


def parse_yaml(text: str, where: str) -> tuple[Any, list[ConfigIssue]]:
    """Parse YAML text; syntax errors and duplicate keys come back as issues (data is None on syntax error)."""
    loader: _Loader | None = None
    try:
        loader = _Loader(text)  # the reader rejects control characters here already
        data = loader.get_single_data()
    except RecursionError:
        issue = ConfigIssue(where, MISSING_VALUE, "YAML nested too deeply to read",
                            "flatten the nesting: no option of a job file is nested more than a few levels", INVALID,
                            "yaml.syntax")
        return None, [issue]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        issue = ConfigIssue(where, MISSING_VALUE, f"YAML syntax error{at}: {problem}",
                            "correct the YAML syntax at that position", INVALID, "yaml.syntax")
        return None, [issue]
    finally:
        if loader is not None:
            loader.dispose()
    issues = [
        ConfigIssue(f"{where}:{line}", key, f"key '{key}' appears more than once in the same mapping",
                    "keep exactly one entry for the key", INVALID, "yaml.duplicate_key")
        for key, line in loader.duplicate_keys
    ]
    return data, issues


def read_yaml(path: str) -> tuple[Any, list[ConfigIssue]]:
    """Read a configuration file; an unreadable file is one issue naming the path."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        reason = (exc.strerror if isinstance(exc, OSError) else None) or f"{type(exc).__name__}: {exc}"
        return None, [ConfigIssue(path, MISSING_VALUE, f"cannot read the configuration file ({reason})",
                                  "pass the path of an existing YAML file", INVALID, "yaml.unreadable")]
    return parse_yaml(text, path)


def parse_scalar(text: str) -> Any:
    """Parse the value of a `--set KEY=VALUE` override as YAML (1.2 scalars); bad YAML stays a string."""
    if text.strip() == "":
        return ""
    data, issues = parse_yaml(text, "--set")
    if issues and data is None:
        return text
    return data


def dump_yaml(data: dict[str, Any]) -> str:
    """Render a plain dict as YAML in declaration order."""
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=None)
