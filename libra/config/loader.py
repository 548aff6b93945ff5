"""Loading a job configuration: YAML file + `--set` overrides -> validated, frozen `Config`.

Order: read YAML -> apply overrides (last wins) -> strict type walk -> fill derived defaults (name,
run_dir, tokenizer_path) and resolve paths -> cross-field rules. Every problem of every stage is collected
and raised together as one `ConfigError`; non-fatal findings land on `Config.warnings`.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from collections.abc import Iterable
from typing import Any

from libra.config.context import RuleContext
from libra.config.errors import INVALID, MISSING_VALUE, ConfigError, ConfigIssue
from libra.config.fields import options
from libra.config.rules import run_rules
from libra.config.schema import Config
from libra.config.typecheck import Walker, all_option_paths
from libra.config.yaml_io import parse_scalar, read_yaml


def load(path: str, overrides: Iterable[str] = (), planning: bool = False) -> Config:
    """Load and validate a YAML job file; `overrides` are "dotted.key=yaml-value" strings (last wins).
    `planning` (for `libra plan`) reports what only a launch needs as warnings (see `rules.Rule.launch_only`)."""
    data, issues = read_yaml(path)
    base_dir = os.path.dirname(os.path.abspath(path))
    stem = os.path.splitext(os.path.basename(path))[0]
    return _build(data, path, base_dir, stem, overrides, issues, planning)


def load_dict(data: dict[str, Any], source: str = "<dict>", overrides: Iterable[str] = (),
              base_dir: str | None = None) -> Config:
    """Validate an already parsed configuration mapping (relative paths resolve against `base_dir`, then
    the working directory)."""
    return _build(data, source, base_dir, "libra", overrides, [])


def dump(cfg: Config) -> dict[str, Any]:
    """The configuration as plain YAML-ready data; `load_dict(dump(cfg)) == cfg`."""
    return cfg.to_dict(encode_json=False)


def _build(data: Any, source: str, base_dir: str | None, default_name: str, overrides: Iterable[str],
           issues: list[ConfigIssue], planning: bool = False) -> Config:
    issues = list(issues)
    if data is None and not issues:
        data = {}
    if data is None:
        raise ConfigError(issues, source=source)
    if isinstance(data, dict):
        data = _deep_copy(data)
        issues += apply_overrides(data, overrides)
    walker = Walker(Config)
    kwargs = walker.section(Config, data)
    issues += walker.result.issues
    kwargs = _derive(kwargs, base_dir, default_name)
    cfg = Config(**kwargs, source=source if source != "<dict>" else "")
    errors, warnings = run_rules(RuleContext(cfg, walker.result.provided), walker.result.bad_paths, planning=planning)
    issues += errors
    if issues:
        raise ConfigError(issues, warnings, source)
    return dataclasses.replace(cfg, warnings=warnings)


def _deep_copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> list[ConfigIssue]:
    """Apply `KEY=VALUE` overrides in order (YAML-typed values, last wins); bad ones become issues."""
    issues: list[ConfigIssue] = []
    for text in overrides:
        key, sep, raw = text.partition("=")
        key = key.strip()
        if not sep or not key:
            issues.append(ConfigIssue(f"--set {text}", MISSING_VALUE, "an override must have the form KEY=VALUE",
                                      "write it as KEY=VALUE, e.g. --set train_tp_size=2 or --set cluster.num_nodes=4", INVALID,
                                      "override.syntax"))
            continue
        problem = _override_target_problem(key)
        if problem:
            issues.append(ConfigIssue(key, parse_scalar(raw), f"unknown option (from --set {key}=...)", problem,
                                      INVALID, "unknown_key"))
            continue
        parts = key.split(".")
        node = data
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = parse_scalar(raw)
    return issues


def _override_target_problem(key: str) -> str:
    """"" when `key` names an option (or an entry of a mapping option), else a did-you-mean fix."""
    cls: Any = Config
    parts = key.split(".")
    for i, part in enumerate(parts):
        opts = options(cls)
        if part not in opts:
            break
        info = opts[part]
        if info.is_section:
            cls = info.type
            if i == len(parts) - 1:
                return ""  # a whole section, e.g. --set 'cluster={num_nodes: 2}'
            continue
        if i == len(parts) - 1 or (typing.get_origin(info.type) is dict and i == len(parts) - 2):
            return ""
        break
    paths = all_option_paths(Config)
    close = difflib.get_close_matches(key, paths, n=1, cutoff=0.6)
    if not close:
        leaf = parts[-1]
        close = [p for p in paths if p.rsplit(".", 1)[-1] == leaf] or \
            difflib.get_close_matches(leaf, paths, n=1, cutoff=0.6)
    return f"did you mean {close[0]}?" if close else "use a dotted option path such as cluster.num_nodes"


def resolve_path(value: str, base_dir: str | None) -> str:
    """Absolute path: relative paths resolve against `base_dir` when they exist there, else the CWD."""
    if not value:
        return value
    value = os.path.expanduser(value)
    if os.path.isabs(value):
        return os.path.normpath(value)
    if base_dir and os.path.exists(os.path.join(base_dir, value)):
        return os.path.normpath(os.path.join(base_dir, value))
    return os.path.abspath(value)


def _resolve_section(cls: type, kwargs: dict[str, Any], base_dir: str | None) -> dict[str, Any]:
    out = dict(kwargs)
    for name, info in options(cls).items():
        if info.is_path and isinstance(out.get(name), str):
            out[name] = resolve_path(out[name], base_dir)
        elif info.is_section and name in out:
            sub = out[name]
            resolved = _resolve_section(info.type, {f.name: getattr(sub, f.name) for f in dataclasses.fields(sub)},
                                        base_dir)
            out[name] = info.type(**resolved)
    return out


def _derive(kwargs: dict[str, Any], base_dir: str | None, default_name: str) -> dict[str, Any]:
    out = _resolve_section(Config, kwargs, base_dir)
    if not out.get("name"):
        out["name"] = default_name
    if not out.get("run_dir"):
        out["run_dir"] = os.path.join("runs", out["name"])
    if not out.get("tokenizer_path"):
        out["tokenizer_path"] = out.get("model_path", "")
    return out
