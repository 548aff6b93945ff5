"""Entry point of a TP-1 vLLM-CPU server: vLLM's OpenAI server with its engine core forked, not spawned.

    python -m libra.rollout.forked_engine_main <the arguments of vllm.entrypoints.openai.api_server>

vLLM's CPU platform sets the `spawn` start method for every process it starts, so the engine core of a CPU
server imports vLLM and torch a second time before it loads a model: on this project's 2-core CPU machines that
import is about 40% of a server's start (`benchmarks/server_start.py`). A forked engine core inherits them.

Why a fork is safe where this entry point is used (`server.server_module` decides):
- TP 1 with the `uni` executor: the engine core runs the model itself and starts no further process, so no
  worker is forked from a process that already runs a model;
- the API server imports, builds configs and loads the tokenizer before the engine core starts, and runs no
  model: the engine core loads the model and binds its OpenMP threads itself, as a spawned one does (every
  TP-1 server of the test suite and of the benchmarks starts this way);
- this is vLLM's own default start method wherever its platform allows it (CUDA servers fork unless CUDA is
  initialized), so the API server's path to the engine core supports it.
TP > 1 CPU servers and GPU servers run `vllm.entrypoints.openai.api_server` unchanged.
"""

from __future__ import annotations

import logging
import os
import runpy
from typing import Any

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"


def fork_after_platform_config() -> bool:
    """Make vLLM's CPU platform leave the start method at `fork` after it configures a server (it sets `spawn`
    there); False, with a warning, where this vLLM has no such hook (the server then starts as shipped)."""
    try:
        from vllm.platforms.cpu import CpuPlatform
    except ImportError:
        return False
    configure = getattr(CpuPlatform, "check_and_update_config", None)
    original = getattr(configure, "__func__", None)
    if original is None:
        logging.getLogger(__name__).warning("vLLM's CPU platform has no check_and_update_config: the engine core "
                                            "is spawned as vLLM ships")
        return False

    def configure_then_fork(cls: type, vllm_config: Any) -> None:
        original(cls, vllm_config)
        os.environ[START_METHOD_ENV] = "fork"

    CpuPlatform.check_and_update_config = classmethod(configure_then_fork)  # type: ignore[method-assign,assignment]
    return True


def main() -> None:
    fork_after_platform_config()
    runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
