"""`forked_engine_main`: vLLM's CPU platform sets the `spawn` start method when it configures a server; the
entry point wraps that hook so the start method is `fork` after it, and leaves the rest of it to vLLM."""

from __future__ import annotations

import os
from typing import Any

import pytest
from vllm.platforms.cpu import CpuPlatform

from libra.rollout import forked_engine_main


def test_the_platform_hook_still_runs_and_the_start_method_is_fork_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []

    def as_vllm_does(cls: type, vllm_config: Any) -> None:  # what the real hook does to the start method
        seen.append((cls, vllm_config))
        monkeypatch.setenv(forked_engine_main.START_METHOD_ENV, "spawn")

    monkeypatch.setattr(CpuPlatform, "check_and_update_config", classmethod(as_vllm_does))
    monkeypatch.delenv(forked_engine_main.START_METHOD_ENV, raising=False)
    config = object()
    assert forked_engine_main.fork_after_platform_config()
    CpuPlatform.check_and_update_config(config)  # type: ignore[arg-type]
    assert seen == [(CpuPlatform, config)]
    assert os.environ[forked_engine_main.START_METHOD_ENV] == "fork"


def test_vllms_cpu_platform_has_the_hook_the_entry_point_wraps() -> None:
    """The real hook is a classmethod that takes the server's config (what the wrapper calls through)."""
    hook = CpuPlatform.__dict__.get("check_and_update_config")
    assert isinstance(hook, classmethod)
    assert hook.__func__.__code__.co_varnames[:2] == ("cls", "vllm_config")
