"""Build runtime spec dataclasses from config sections by copying the fields they share by name."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")


def build_from(cls: type[T], source: Any, prefix: str = "", **overrides: Any) -> T:
    """An instance of the dataclass `cls` whose init fields come from the attributes `prefix + name` of
    `source`, then from `overrides`; fields `source` lacks keep their defaults.

    `prefix` maps a flat config family onto a spec: `build_from(MegatronOptions, cfg, "megatron_")`."""
    values = {
        f.name: getattr(source, prefix + f.name)
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if f.init and hasattr(source, prefix + f.name)
    }
    values.update(overrides)
    return cls(**values)
