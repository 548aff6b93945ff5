"""The request model: KEY=VALUE overrides validated by the configuration's own rules against the running job
(its current split), every class of bad request with field, value, rule and fix, and the mapping of a valid
request onto a ReconfigureTarget."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libra.api import requests as rq
from libra.api.requests import STRATEGY_KEY, InvalidRequest, validate_request
from libra.config.errors import INVALID, NOT_IMPLEMENTED
from libra.controller.reconfigure import ReconfigureTarget
from libra.controller.state import DesiredState, TrainLayout

from .fake_job import job_config

# (request, strategy argument) -> expected (field, rule id or "" , kind) of every issue
BAD = [
    ("empty", [], "", [("request", "api.empty", INVALID)]),
    ("syntax", ["rollout_gpus"], "", [("--set rollout_gpus", "override.syntax", INVALID)]),
    ("unknown-key", ["rolout_gpus=1"], "", [("rolout_gpus", "unknown_key", INVALID)]),
    ("wrong-type", ["rollout_gpus=two"], "", [("rollout_gpus", "type", INVALID)]),
    ("below-bound", ["rollout_tp_size=0"], "", [("rollout_tp_size", "range", INVALID)]),
    ("exceeds-cluster", ["rollout_gpus=3"], "", [("train_gpus", "split.fits_cluster", INVALID)]),
    ("tp-not-dividing", ["rollout_tp_size=3", "rollout_gpus=3"], "",
     [("rollout_tp_size", "rollout.tp_heads", INVALID), ("train_gpus", "split.fits_cluster", INVALID)]),
    ("gpus-not-multiple", ["rollout_tp_size=2", "rollout_gpus=1"], "", [("rollout_gpus", "rollout.tp_divides_gpus", INVALID)]),
    ("unknown-strategy", [], "bogus", [(STRATEGY_KEY, "choice", INVALID)]),
    ("swap-strategy-without-switch", [], "cluster_swap", [(STRATEGY_KEY, "runtime.cluster_swap_strategy", INVALID)]),
    ("not-at-runtime", ["batch_size=8"], "", [("batch_size", "api.not_at_runtime", NOT_IMPLEMENTED)]),
    ("control-character-strategy", [], "\x1b", [(STRATEGY_KEY, "choice", INVALID)]),
    ("control-character-value", ["rollout_gpus=\x00"], "", [("rollout_gpus", "type", INVALID)]),
    ("every-error-at-once", ["batch_size=8", "rolout_gpus=1", "rollout_gpus=x"], "",
     [("batch_size", "api.not_at_runtime", NOT_IMPLEMENTED), ("rolout_gpus", "unknown_key", INVALID),
      ("rollout_gpus", "", INVALID)]),
]


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory):
    cfg = job_config(tmp_path_factory.mktemp("run"))
    desired = DesiredState(rollout_instances=2, rollout_tp=1, train_gpus=2, train_layout=TrainLayout(),
                           cluster_gpus=4)
    return cfg, desired


def _rule_ids(cfg_rule_ids: list[str]) -> None:
    from libra.config.rules import RULES

    known = {rule.id for rule in RULES}
    for rule_id in cfg_rule_ids:
        # cross-field rules are in the table; the rest are the loader's own checks of one option
        assert rule_id in known or rule_id.startswith(("api.", "override.")) or rule_id in (
            "unknown_key", "type", "range", "choice"), rule_id


@pytest.mark.parametrize(("request_", "strategy", "expected"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_request_reports_every_issue(running, request_: list[str], strategy: str,
                                         expected: list[tuple[str, str, str]]) -> None:
    cfg, desired = running
    with pytest.raises(InvalidRequest) as err:
        validate_request(cfg, desired, request_, strategy)
    issues = err.value.issues
    got = sorted((i.path, i.kind) for i in issues)
    assert got == sorted((field, kind) for field, _rule, kind in expected), [str(i) for i in issues]
    for field, rule_id, _kind in expected:
        if rule_id:
            assert any(i.path == field and i.rule_id == rule_id for i in issues), [str(i) for i in issues]
    assert all(i.rule and i.fix for i in issues)
    _rule_ids([i.rule_id for i in issues if i.rule_id])


GOOD = [
    ("shrink", ["rollout_gpus=1"], "", ReconfigureTarget(1, 1), None),
    ("tp-keeps-gpus", ["rollout_tp_size=2"], "", ReconfigureTarget(1, 2), None),
    ("last-wins", ["rollout_gpus=2", "rollout_gpus=1"], "", ReconfigureTarget(1, 1), None),
    ("strategy-by-key", ["rollout_gpus=1", f"{STRATEGY_KEY}=restart_all"], "", ReconfigureTarget(1, 1), "restart_all"),
    ("strategy-argument", ["rollout_gpus=1"], "restart_all", ReconfigureTarget(1, 1), "restart_all"),
    ("strategy-only", [], "restart_all", ReconfigureTarget(), "restart_all"),
]


@pytest.mark.parametrize(("request_", "strategy", "target", "chosen"), [g[1:] for g in GOOD], ids=[g[0] for g in GOOD])
def test_valid_request_maps_onto_a_target(running, request_: list[str], strategy: str, target: ReconfigureTarget,
                                          chosen: str | None) -> None:
    cfg, desired = running
    change = validate_request(cfg, desired, request_, strategy)
    assert change.target == target
    assert change.strategy == chosen


def test_validated_against_the_current_split_not_the_launch_file(running) -> None:
    """The job now runs 1 rollout GPU and 3 training GPUs: rollout_gpus=2 no longer fits."""
    cfg, _ = running
    now = DesiredState(rollout_instances=1, rollout_tp=1, train_gpus=3, train_layout=TrainLayout(), cluster_gpus=4)
    with pytest.raises(InvalidRequest, match="exceeds the cluster"):
        validate_request(cfg, now, ["rollout_gpus=2"])


def test_training_key_refused_until_the_target_has_training_fields(running, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, desired = running
    monkeypatch.setattr(rq, "target_fields", lambda: frozenset({"rollout_instances", "rollout_tp"}))
    with pytest.raises(InvalidRequest) as err:
        validate_request(cfg, desired, ["rollout_gpus=3", "train_gpus=1"])
    assert [(i.path, i.rule_id, i.kind) for i in err.value.issues] == [
        ("train_gpus", "api.training_not_yet", NOT_IMPLEMENTED)]
    assert "not implemented" in err.value.issues[0].rule


def test_training_key_unchanged_is_no_change(running) -> None:
    cfg, desired = running
    change = validate_request(cfg, desired, ["train_gpus=2", "rollout_gpus=1"])
    assert "train_gpus" not in change.changes and change.target == ReconfigureTarget(1, 1)


def test_training_keys_map_onto_the_target_fields(running) -> None:
    cfg, desired = running
    if "train_gpus" not in rq.target_fields():
        pytest.skip("ReconfigureTarget has no training fields in this tree")
    change = validate_request(cfg, desired, ["rollout_gpus=3", "train_gpus=1"])
    assert (change.target.rollout_instances, change.target.train_gpus) == (3, 1)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(overrides=st.lists(st.text(max_size=40) | st.sampled_from(["rollout_gpus=1", "rollout_tp_size=2", "train_gpus=",
                                                                   "=", "rollout_gpus=[1, 2]", "rollout_gpus={a: 1}"]),
                          max_size=5),
       strategy=st.text(max_size=12))
def test_any_request_is_valid_or_invalid_never_an_error(running, overrides: list[str], strategy: str) -> None:
    cfg, desired = running
    try:
        validate_request(cfg, desired, overrides, strategy)
    except InvalidRequest as err:
        assert err.issues and all(i.rule and i.fix for i in err.issues)
