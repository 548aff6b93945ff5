"""The controller of a job: desired vs observed state, the transition table of pool members, the pure
reconciler, its executor, the never-dying control loop, lag-bounded batch collection and the RL loop.

    from libra.controller import Controller, LaunchOptions
    result = Controller(cfg, RunDir.at(cfg.run_dir), LaunchOptions(max_steps=10)).run_job()

Heavy dependencies (Ray, vLLM, Megatron-Core) are imported only when a job starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from libra.controller.controller import Controller, LaunchOptions, RunResult

__all__ = ["Controller", "LaunchOptions", "RunResult"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from libra.controller import controller

        return getattr(controller, name)
    raise AttributeError(name)
