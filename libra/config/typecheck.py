"""Strict, error-collecting conversion of parsed YAML into the values of the config dataclasses.

Never casts: a string where an int is expected is an error, and a boolean is not an int. The only
widening is int -> float. Unknown keys get a "did you mean" suggestion (same section first, then any
section that has an option of that name). Every problem becomes a `ConfigIssue`; a field with a bad value
falls back to its default and is remembered in `bad_paths`, so cross-field rules can skip it instead of
reporting follow-on errors.
"""

from __future__ import annotations

import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from libra.config.errors import INVALID, MISSING_VALUE, ConfigIssue, format_value
from libra.config.fields import Bounds, OptionInfo, describe_type, options


@dataclass
class WalkResult:
    """What the walk produced: constructor kwargs per section plus every issue found."""

    issues: list[ConfigIssue] = field(default_factory=list)
    bad_paths: set[str] = field(default_factory=set)
    provided: set[str] = field(default_factory=set)


def all_option_paths(cls: type, prefix: str = "") -> list[str]:
    """Every dotted option path of a config class (sections themselves included)."""
    paths: list[str] = []
    for name, info in options(cls).items():
        path = f"{prefix}{name}"
        paths.append(path)
        if info.is_section:
            paths.extend(all_option_paths(info.type, f"{path}."))
    return paths


def suggest(key: str, section_cls: type, prefix: str, root_cls: type) -> str:
    """A "did you mean" fix for an unknown key, or the list of valid keys."""
    names = list(options(section_cls))
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    if close:
        return f"did you mean {prefix}{close[0]}?"
    elsewhere = [p for p in all_option_paths(root_cls) if p.rsplit(".", 1)[-1] == key and p != f"{prefix}{key}"]
    if elsewhere:
        return f"did you mean {elsewhere[0]}? (the option lives in another section)"
    leaf_paths = all_option_paths(root_cls)
    close = difflib.get_close_matches(key, [p.rsplit(".", 1)[-1] for p in leaf_paths], n=1, cutoff=0.75)
    if close:
        target = next(p for p in leaf_paths if p.rsplit(".", 1)[-1] == close[0])
        return f"did you mean {target}?"
    where = f"section {prefix.rstrip('.')}" if prefix else "the top level"
    return f"remove it; the options of {where} are: {', '.join(names)}"


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number with a fraction"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


def _type_fix(value: Any, tp: Any) -> str:
    want = describe_type(tp)
    if isinstance(value, str) and want == "bool":
        return "write true or false, without quotes"
    if isinstance(value, str) and want in ("int", "float"):
        try:
            float(value)
        except ValueError:
            return f"give a number of type {want}"
        return f"write the number without quotes: {value.strip()}"
    if isinstance(value, bool) and want in ("int", "float"):
        return f"give a number; true/false are booleans, not {want}s"
    if isinstance(value, float) and want == "int":
        return f"write a whole number without a decimal point, e.g. {int(value)}" if value.is_integer() \
            else "give a whole number"
    if isinstance(value, list | tuple):
        return f"give a single {want}, not a list"
    if isinstance(value, dict):
        return f"give a single {want}, not a mapping"
    return f"give a value of type {want}"


class _Mismatch(Exception):
    def __init__(self, rule: str, fix: str, rule_id: str = "type") -> None:
        super().__init__(rule)
        self.rule, self.fix, self.rule_id = rule, fix, rule_id


def _scalar(value: Any, tp: Any) -> Any:
    """Check one value against a non-container type; return it (ints widened for floats)."""
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise _Mismatch("must be a finite number", "give a finite number", "range")
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif typing.get_origin(tp) is Literal:
        allowed = typing.get_args(tp)
        if any(type(value) is type(c) and value == c for c in allowed):
            return value
        listing = ", ".join(str(c) for c in allowed)
        close = difflib.get_close_matches(str(value), [str(c) for c in allowed], n=1, cutoff=0.5)
        hint = f"did you mean {close[0]}? Otherwise choose" if close and isinstance(value, str) else "choose"
        raise _Mismatch(f"must be one of {{{listing}}}", f"{hint} one of {listing}", "choice")
    elif typing.get_origin(tp) in (types.UnionType, typing.Union):
        if value is None and type(None) in typing.get_args(tp):
            return None
        for member in typing.get_args(tp):
            if member is type(None):
                continue
            try:
                return _scalar(value, member)
            except _Mismatch:
                continue
    else:  # pragma: no cover - schema uses only the types above
        raise TypeError(f"unsupported option type {tp!r}")
    raise _Mismatch(f"expected {describe_type(tp)}, got {_kind(value)}", _type_fix(value, tp))


class Walker:
    """Walks raw YAML data along the schema, producing constructor kwargs and issues."""

    def __init__(self, root_cls: type) -> None:
        self.root_cls = root_cls
        self.result = WalkResult()

    def issue(self, path: str, value: Any, rule: str, fix: str, rule_id: str) -> None:
        self.result.issues.append(ConfigIssue(path, value, rule, fix, INVALID, rule_id))
        self.result.bad_paths.add(path)

    def section(self, cls: type, data: Any, prefix: str = "") -> dict[str, Any]:
        """Kwargs for `cls` from `data` (a mapping); bad or missing values are left out (defaults)."""
        opts = options(cls)
        if data is None:
            data = {}
        if not isinstance(data, dict):
            where = prefix.rstrip(".") or "<top level>"
            self.issue(where, data, f"expected a section (mapping of options), got {_kind(data)}",
                       f"write {where} as a mapping with keys such as {', '.join(list(opts)[:3])}", "type")
            data = {}
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            path = f"{prefix}{key}"
            if not isinstance(key, str) or key not in opts:
                self.issue(path, value, "unknown option", suggest(str(key), cls, prefix, self.root_cls), "unknown_key")
                continue
            self.result.provided.add(path)
            converted = self.value(opts[key], value, path)
            if converted is not MISSING_VALUE:
                kwargs[key] = converted
        for name, info in opts.items():
            if info.required and name not in data:
                self.issue(f"{prefix}{name}", MISSING_VALUE, "required option is missing",
                           f"set {prefix}{name} ({info.doc.rstrip('.')})", "required")
            if info.required and name not in kwargs:
                kwargs[name] = placeholder(info)
        return kwargs

    def value(self, info: OptionInfo, value: Any, path: str) -> Any:
        tp = info.type
        if info.is_section:
            return info.type(**self.section(info.type, value, f"{path}."))
        origin = typing.get_origin(tp)
        try:
            if origin is tuple:
                return self._list(value, typing.get_args(tp)[0], info.item_bounds, path)
            if origin is dict:
                return self._mapping(value, typing.get_args(tp)[1], path)
            converted = _scalar(value, tp)
        except _Mismatch as exc:
            self.issue(path, value, exc.rule, exc.fix, exc.rule_id)
            return MISSING_VALUE
        return self._bounded(converted, info.bounds, path)

    def _bounded(self, value: Any, bounds: Bounds, path: str) -> Any:
        if bounds and isinstance(value, int | float) and not isinstance(value, bool):
            broken = bounds.violated(value)
            if broken:
                self.issue(path, value, f"{path.rsplit('.', 1)[-1]} {broken}",
                           f"set a value {bounds.describe()}", "range")
                return MISSING_VALUE
        return value

    def _list(self, value: Any, item_tp: Any, bounds: Bounds, path: str) -> Any:
        if not isinstance(value, list):
            raise _Mismatch(f"expected a list of {describe_type(item_tp)}, got {_kind(value)}",
                            f"write a YAML list, e.g. [{format_value(value)}]")
        items = []
        ok = True
        for i, item in enumerate(value):
            try:
                checked = self._bounded(_scalar(item, item_tp), bounds, f"{path}[{i}]")
            except _Mismatch as exc:
                self.issue(f"{path}[{i}]", item, exc.rule, exc.fix, exc.rule_id)
                checked = MISSING_VALUE
            ok = ok and checked is not MISSING_VALUE
            items.append(checked)
        if not ok:
            self.result.bad_paths.add(path)
            return MISSING_VALUE
        return tuple(items)

    def _mapping(self, value: Any, value_tp: Any, path: str) -> Any:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise _Mismatch(f"expected a mapping, got {_kind(value)}", "write a YAML mapping, e.g. {key: 1}")
        out: dict[str, Any] = {}
        ok = True
        for key, item in value.items():
            if not isinstance(key, str):
                self.issue(f"{path}.{key}", item, "keys must be strings", "quote the key", "type")
                ok = False
                continue
            try:
                out[key] = _scalar(item, value_tp)
            except _Mismatch as exc:
                self.issue(f"{path}.{key}", item, exc.rule, exc.fix, exc.rule_id)
                ok = False
        if not ok:
            self.result.bad_paths.add(path)
            return MISSING_VALUE
        return out


def placeholder(info: OptionInfo) -> Any:
    """A stand-in for a required option that is missing or bad, so the tree can still be built."""
    if info.is_section:
        section: Any = info.type
        return section()
    return {str: "", int: 0, float: 0.0, bool: False}.get(info.type, "")
