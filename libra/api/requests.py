"""The one request model for changing a running job: `KEY=VALUE` overrides, exactly as `--set` takes them.

A request is validated by the same loader and rule table as a configuration file, against the running job's
configuration with its current split and layout filled in (what the desired state says now, not what the file
said at launch). An invalid request changes nothing and reports every problem with field, value, rule and fix.
A valid request becomes a `ReconfigureTarget` and a strategy for `Controller.request_reconfigure`.

Which keys a running job can take, and how each reaches the target, is decided here and only here
(`RUNTIME_KEYS`, `TRAINING_KEYS`): a training key is accepted only once `ReconfigureTarget` carries a training
field, otherwise it is refused as Not implemented.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from libra.config import Config, ConfigError, dump
from libra.config.errors import INVALID, MISSING_VALUE, NOT_IMPLEMENTED, ConfigIssue
from libra.config.loader import load_dict
from libra.config.yaml_io import parse_scalar
from libra.controller.reconfigure import ReconfigureTarget
from libra.controller.state import DesiredState

STRATEGY_KEY = "global_resource_planner.runtime_rollout_reconfigure_strategy"
ROLLOUT_KEYS = ("rollout_gpus", "rollout_tp_size")
RUNTIME_KEYS = (*ROLLOUT_KEYS, STRATEGY_KEY)
# training-side keys -> the ReconfigureTarget field each one sets (refused while the target has no such field)
TRAINING_FIELDS = {"train_gpus": "train_gpus", "train_tp_size": "train_tp", "train_pp_size": "train_pp",
                   "train_cp_size": "train_cp", "train_ep_size": "train_ep"}
TRAINING_KEYS = tuple(TRAINING_FIELDS)
_LAYOUT_KEYS = {"train_tp_size": "tp", "train_pp_size": "pp", "train_cp_size": "cp", "train_ep_size": "ep"}


class InvalidRequest(ValueError):
    """Every problem of one request; nothing was changed."""

    def __init__(self, issues: Sequence[ConfigIssue]) -> None:
        self.issues = list(issues)
        count = len(self.issues)
        super().__init__(f"{count} problem{'s' if count != 1 else ''} in the request: "
                         + "; ".join(str(issue) for issue in self.issues))


@dataclass(frozen=True)
class ValidatedChange:
    """A valid request: what changes (option -> (now, requested)), the target and the strategy."""

    request: tuple[str, ...]
    changes: dict[str, tuple[Any, Any]]
    target: ReconfigureTarget
    strategy: str | None
    config: Config  # the running configuration with the change applied

    def describe(self) -> str:
        return ", ".join(f"{key} {before} -> {after}" for key, (before, after) in self.changes.items()) or "no change"


def target_fields() -> frozenset[str]:
    """The fields `ReconfigureTarget` has today (training fields arrive with elastic training)."""
    return frozenset(f.name for f in dataclasses.fields(ReconfigureTarget))


def running_config_data(cfg: Config, desired: DesiredState) -> dict[str, Any]:
    """The running job's configuration as YAML data, with the split and layout it has now."""
    data = dump(cfg)
    layout = desired.train_layout
    data.update(train_gpus=desired.train_gpus, rollout_gpus=desired.rollout_gpus, rollout_tp_size=desired.rollout_tp,
                train_tp_size=layout.tp, train_pp_size=layout.pp, train_cp_size=layout.cp, train_ep_size=layout.ep)
    planner = dict(data.get("global_resource_planner") or {})
    # the split is what runs now: check it as a pinned one, with the strategy the job uses now
    planner["initial_allocation_strategy"] = "configured"
    planner["runtime_rollout_reconfigure_strategy"] = desired.reconfigure_strategy
    data["global_resource_planner"] = planner
    return data


def _key(text: str) -> str:
    return text.partition("=")[0].strip()


def _not_at_runtime(text: str) -> ConfigIssue | None:
    """An issue when `text` names a real option a running job cannot change (unknown keys and bad syntax
    are left to the loader, which says "did you mean")."""
    from libra.config.loader import _override_target_problem

    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or key in RUNTIME_KEYS or key in TRAINING_KEYS or _override_target_problem(key):
        return None
    return ConfigIssue(key, parse_scalar(raw), "cannot be changed while the job runs",
                       f"change one of {', '.join(RUNTIME_KEYS + TRAINING_KEYS)}, or stop the job (libra drain) and "
                       f"launch it again with --set {key}=...", NOT_IMPLEMENTED, "api.not_at_runtime")


def _issue_key(issue: ConfigIssue) -> tuple[str, str, str]:
    return issue.path, issue.rule_id, issue.rule


def _load(data: dict[str, Any], overrides: Sequence[str]) -> tuple[Config | None, list[ConfigIssue]]:
    try:
        return load_dict(data, source="request", overrides=overrides), []
    except ConfigError as err:
        return None, err.errors


def validate_request(cfg: Config, desired: DesiredState, overrides: Sequence[str],
                     strategy: str = "") -> ValidatedChange:
    """Check a request against the running job; InvalidRequest lists every problem."""
    request = tuple(overrides) + ((f"{STRATEGY_KEY}={strategy}",) if strategy else ())
    if not request:
        raise InvalidRequest([ConfigIssue("request", MISSING_VALUE, "names no change",
                                          "pass at least one KEY=VALUE, e.g. --set rollout_gpus=3", INVALID,
                                          "api.empty")])
    issues = [issue for text in request if (issue := _not_at_runtime(text)) is not None]
    refused = {issue.path for issue in issues}
    applicable = [text for text in request if _key(text) not in refused]
    base = running_config_data(cfg, desired)
    _, base_issues = _load(base, ())
    new_cfg, found = _load(base, applicable)
    # a problem the running configuration already has is not the request's
    known = {_issue_key(issue) for issue in base_issues}
    issues += [issue for issue in found if _issue_key(issue) not in known]
    if new_cfg is None and not issues:
        issues = found
    if issues or new_cfg is None:
        raise InvalidRequest(issues)
    return _change(cfg, desired, request, new_cfg)


def _change(cfg: Config, desired: DesiredState, request: tuple[str, ...], new: Config) -> ValidatedChange:
    layout = desired.train_layout
    now: dict[str, Any] = {
        "rollout_gpus": desired.rollout_gpus, "rollout_tp_size": desired.rollout_tp,
        STRATEGY_KEY: desired.reconfigure_strategy, "train_gpus": desired.train_gpus,
        **{key: getattr(layout, name) for key, name in _LAYOUT_KEYS.items()},
    }
    after = {key: _value(new, key) for key in now}
    changes = {key: (now[key], after[key]) for key in now if after[key] != now[key]}
    fields = target_fields()
    missing = [key for key in changes if key in TRAINING_FIELDS and TRAINING_FIELDS[key] not in fields]
    if missing:
        raise InvalidRequest([
            ConfigIssue(key, changes[key][1], "the training pool cannot be resized or re-laid out while the job "
                        "runs yet (elastic training is not implemented)",
                        "leave it at its current value; change the rollout pool (rollout_gpus, rollout_tp_size), "
                        "or stop the job (libra drain) and launch it again with the new value",
                        NOT_IMPLEMENTED, "api.training_not_yet")
            for key in missing
        ])
    values: dict[str, Any] = {}
    if "rollout_gpus" in changes or "rollout_tp_size" in changes:
        values["rollout_instances"] = new.rollout_gpus // new.rollout_tp_size
        values["rollout_tp"] = new.rollout_tp_size
    for key, name in TRAINING_FIELDS.items():
        if key in changes:
            values[name] = changes[key][1]
    strategy = after[STRATEGY_KEY] if STRATEGY_KEY in changes or any(_key(t) == STRATEGY_KEY for t in request) else None
    return ValidatedChange(request, changes, ReconfigureTarget(**values), strategy, new)


def _value(cfg: Config, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node
