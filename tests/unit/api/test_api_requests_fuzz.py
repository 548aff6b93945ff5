"""Fuzzed operator requests built from real option names and YAML values of every shape (the existing
fuzz of `test_api_requests` draws free text): a request is valid or an `InvalidRequest` whose every issue
has a rule and a fix; nothing else is raised and nothing of the running job is changed."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from libra.api.requests import RUNTIME_KEYS, STRATEGY_KEY, TRAINING_KEYS, InvalidRequest, validate_request
from libra.config.schema import Config
from libra.config.typecheck import all_option_paths
from libra.controller.state import DesiredState, TrainLayout

from .fake_job import job_config

yaml_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**66), 2**66), st.floats(), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=2)),
    max_leaves=4,
)
keys = st.one_of(st.sampled_from([*RUNTIME_KEYS, *TRAINING_KEYS]), st.sampled_from(all_option_paths(Config)))
requests = st.lists(st.builds(lambda k, v: f"{k}={yaml.safe_dump(v, default_flow_style=True).strip()}",
                              keys, yaml_values), max_size=4)


@pytest.fixture(scope="module")
def running_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Config, DesiredState]:
    cfg = job_config(tmp_path_factory.mktemp("run"))
    desired = DesiredState(rollout_instances=2, rollout_tp=1, train_gpus=2, train_layout=TrainLayout(),
                           cluster_gpus=4)
    return cfg, desired


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(request=requests, strategy=st.one_of(st.just(""), st.sampled_from(["diff", "prewarm", "x"]), st.text(max_size=6)))
@example(request=[f"{STRATEGY_KEY}=[diff]"], strategy="")
@example(request=["rollout_gpus=9223372036854775808"], strategy="")
@example(request=["cluster={num_nodes: 2}"], strategy="")
def test_structured_requests_are_valid_or_reported(running_job: tuple[Config, DesiredState], request: list[str],
                                                   strategy: str) -> None:
    cfg, desired = running_job
    before = (cfg, desired)
    try:
        change = validate_request(cfg, desired, request, strategy)
    except InvalidRequest as err:
        assert err.issues and all(issue.rule and issue.fix for issue in err.issues), err
    else:
        assert change.describe()
    assert (cfg, desired) == before
