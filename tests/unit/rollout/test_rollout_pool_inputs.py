"""Bad input to the pool is refused before anything is sent, with the field, the value and the rule."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from libra.config.mapping import config_with, rollout_pool_spec
from libra.rollout.pool import RolloutPool
from libra.rollout.spec import RolloutError, RolloutPoolSpec, RolloutSpecError


def spec_with(**fields: object) -> RolloutPoolSpec:
    """The rollout spec of a default job configuration with `fields` changed."""
    return replace(rollout_pool_spec(config_with("/m"), num_instances=1, kv_cache_bytes=64 * 2**20), **fields)  # type: ignore[arg-type]


def pool(tmp_path: os.PathLike[str]) -> RolloutPool:
    return RolloutPool(None, spec_with(max_model_len=64, run_dir=str(tmp_path)))


@pytest.mark.parametrize(
    ("prompts", "n", "tokens", "sampling", "message"),
    [
        ([[]], 1, 4, {}, "non-empty list of token ids"),
        ([[1, -2]], 1, 4, {}, "token ids >= 0"),
        ([[1, 2]], 0, 4, {}, "n=0"),
        ([[1, 2]], 1, 0, {}, "max_new_tokens=0"),
        ([[1] * 60], 1, 8, {}, "exceeds max_model_len=64"),
        ([[1, 2]], 1, 4, {"temperature": -0.1}, "temperature=-0.1"),
        ([[1, 2]], 1, 4, {"top_p": 0.0}, "top_p=0.0"),
    ],
    ids=["empty", "negative-id", "n", "tokens", "too-long", "temperature", "top-p"],
)
def test_invalid_generation_requests(
    tmp_path: os.PathLike[str],
    prompts: list[list[int]],
    n: int,
    tokens: int,
    sampling: dict[str, float],
    message: str,
) -> None:
    with pytest.raises(ValueError, match=message):
        pool(tmp_path).generate_batch(prompts, n=n, max_new_tokens=tokens, **sampling)


def test_unknown_sampling_option(tmp_path: os.PathLike[str]) -> None:
    with pytest.raises(TypeError, match="top_k"):
        pool(tmp_path).generate_batch([[1, 2]], n=1, max_new_tokens=4, top_k=5)


@pytest.mark.parametrize(
    ("version", "hf_dir", "checksum", "overrides", "message"),
    [
        (-1, "DIR", "sha256t1:x", {}, "version=-1"),
        (1, "/no/such/dir", "sha256t1:x", {}, "not a directory"),
        (1, "DIR", "md5:x", {}, "must come from checksum_hf_weights"),
        (1, "DIR", "sha256t1:x", {"method": "hot"}, "method='hot'"),
        (1, "DIR", "sha256t1:x", {"strategy": "rolling"}, "strategy='rolling'"),
    ],
    ids=["version", "dir", "checksum", "method", "strategy"],
)
def test_invalid_publish(
    tmp_path: os.PathLike[str],
    version: int,
    hf_dir: str,
    checksum: str,
    overrides: dict[str, str],
    message: str,
) -> None:
    directory = str(tmp_path) if hf_dir == "DIR" else hf_dir
    with pytest.raises(ValueError, match=message):
        pool(tmp_path).publish_weights(version, directory, checksum, **overrides)  # type: ignore[arg-type]


def test_restart_needs_managed_servers(tmp_path: os.PathLike[str]) -> None:
    spec = spec_with(num_instances=0, manage_processes=False, endpoints=("http://h:1",), reload_method="inplace")
    with pytest.raises(ValueError, match="needs manage_processes=True"):
        RolloutPool(None, spec).publish_weights(1, str(tmp_path), "sha256t1:x", method="restart")


def test_invalid_spec_is_refused_at_construction() -> None:
    with pytest.raises(RolloutSpecError, match="tp_size=0"):
        RolloutPool(None, spec_with(tp_size=0))


@pytest.mark.parametrize("call", ["instances", "stats", "abort_all", "add_instance"])
def test_calls_before_start_are_clear_errors(tmp_path: os.PathLike[str], call: str) -> None:
    with pytest.raises(RolloutError, match="not started"):
        getattr(pool(tmp_path), call)()
