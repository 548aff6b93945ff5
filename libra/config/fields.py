"""Field declarations for the configuration dataclasses: `opt()` and the metadata it records.

Every option is declared with `opt(default, doc, ...)`. The metadata (doc, bounds, path resolution,
deprecation) drives three things from one place: the strict loader (`typecheck.py`), the generated
reference (`reference.py`) and the single-field range checks. Choices are not stored here: they come
from `Literal[...]` annotations, so the type is the only source of allowed values.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, Field
from functools import cache
from typing import Any, Literal

from dataclasses_json import Exclude
from dataclasses_json import config as json_config


@dataclasses.dataclass(frozen=True)
class Bounds:
    """Numeric bounds of an option (or of each item of a list option). None = unbounded."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def violated(self, value: float) -> str:
        """The broken bound as text ("must be >= 1"), or "" when `value` is within bounds."""
        if self.ge is not None and value < self.ge:
            return f"must be >= {_num(self.ge)}"
        if self.gt is not None and value <= self.gt:
            return f"must be > {_num(self.gt)}"
        if self.le is not None and value > self.le:
            return f"must be <= {_num(self.le)}"
        if self.lt is not None and value >= self.lt:
            return f"must be < {_num(self.lt)}"
        return ""

    def describe(self) -> str:
        low = f">= {_num(self.ge)}" if self.ge is not None else f"> {_num(self.gt)}" if self.gt is not None else ""
        high = f"<= {_num(self.le)}" if self.le is not None else f"< {_num(self.lt)}" if self.lt is not None else ""
        return ", ".join(part for part in (low, high) if part)

    def __bool__(self) -> bool:
        return any(v is not None for v in (self.ge, self.gt, self.le, self.lt))


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e15 else repr(value)


def opt(
    default: Any = MISSING,
    doc: str = "",
    *,
    factory: Callable[[], Any] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    item_ge: float | None = None,
    path: bool = False,
    deprecated: str = "",
) -> Any:
    """Declare one option. No default and no factory = required.

    `ge/gt/le/lt` bound the value, `item_ge` each item of a list; `path=True` marks a filesystem path that
    the loader resolves (YAML directory first, then the working directory); `deprecated` is the warning
    shown whenever the option is present in the input.
    """
    if not doc:
        raise ValueError("every configuration option needs a doc string")
    meta = {
        "doc": doc,
        "bounds": Bounds(ge=ge, gt=gt, le=le, lt=lt),
        "item_bounds": Bounds(ge=item_ge),
        "path": path,
        "deprecated": deprecated,
    }
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def internal(factory: Callable[[], Any], doc: str) -> Any:
    """A field the loader fills in (not an option): never read from YAML, never dumped, not compared."""
    meta = {**json_config(exclude=Exclude.ALWAYS), "doc": doc, "internal": True}
    return dataclasses.field(default_factory=factory, compare=False, repr=False, metadata=meta)


@dataclasses.dataclass(frozen=True)
class OptionInfo:
    """One option as the loader and the reference generator see it."""

    name: str
    type: Any
    field: Field[Any]

    @property
    def doc(self) -> str:
        return str(self.field.metadata.get("doc", ""))

    @property
    def required(self) -> bool:
        return self.field.default is MISSING and self.field.default_factory is MISSING

    @property
    def default(self) -> Any:
        if self.field.default is not MISSING:
            return self.field.default
        if self.field.default_factory is not MISSING:
            return self.field.default_factory()
        return MISSING

    @property
    def bounds(self) -> Bounds:
        return self.field.metadata.get("bounds") or Bounds()

    @property
    def item_bounds(self) -> Bounds:
        return self.field.metadata.get("item_bounds") or Bounds()

    @property
    def is_path(self) -> bool:
        return bool(self.field.metadata.get("path"))

    @property
    def deprecated(self) -> str:
        return str(self.field.metadata.get("deprecated", ""))

    @property
    def is_section(self) -> bool:
        return dataclasses.is_dataclass(self.type)


@cache
def options(cls: type) -> dict[str, OptionInfo]:
    """The options of a config dataclass in declaration order (internal fields left out)."""
    hints = typing.get_type_hints(cls)
    return {
        f.name: OptionInfo(f.name, hints[f.name], f)
        for f in dataclasses.fields(cls)
        if not f.metadata.get("internal")
    }


def choices_of(tp: Any) -> tuple[Any, ...]:
    """Allowed values of a `Literal[...]` type (also inside `tuple[Literal[...], ...]`), else ()."""
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    if typing.get_origin(tp) is tuple:
        return choices_of(typing.get_args(tp)[0])
    return ()


def describe_type(tp: Any) -> str:
    """Short human name of an option type, as written in the reference and in type errors."""
    origin = typing.get_origin(tp)
    if tp is bool:
        return "bool"
    if tp is int:
        return "int"
    if tp is float:
        return "float"
    if tp is str:
        return "str"
    if origin is Literal:
        kinds = {type(v) for v in typing.get_args(tp)}
        return "int" if kinds == {int} else "str"
    if origin is tuple:
        return f"list[{describe_type(typing.get_args(tp)[0])}]"
    if origin is dict:
        key, value = typing.get_args(tp)
        return f"map[{describe_type(key)}, {describe_type(value)}]"
    if origin in (types.UnionType, typing.Union):
        parts = [describe_type(a) for a in typing.get_args(tp) if a is not type(None)]
        text = " | ".join(parts)
        return f"{text} or null" if type(None) in typing.get_args(tp) else text
    if dataclasses.is_dataclass(tp):
        return "section"
    return getattr(tp, "__name__", str(tp))
