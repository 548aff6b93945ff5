"""The one place that decides the accelerator: CUDA where torch sees a GPU, else the CPU.

Everything that needs a device string, a torch.distributed backend or "are we on a CPU machine" asks here,
so the same code runs on a GPU cluster (CUDA vLLM, NCCL) and on a CPU machine (vLLM-CPU, gloo).
"""

from __future__ import annotations

import functools
import os

FORCE_CPU_ENV = "LIBRA_FORCE_CPU"


@functools.cache
def cuda_available() -> bool:
    if os.environ.get(FORCE_CPU_ENV) == "1":
        return False
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def device_type() -> str:
    """`"cuda"` or `"cpu"`."""
    return "cuda" if cuda_available() else "cpu"


def dist_backend() -> str:
    """torch.distributed backend for training process groups."""
    return "nccl" if cuda_available() else "gloo"


def torch_device(local_rank: int = 0) -> str:
    """The device string a worker places its tensors on."""
    return f"cuda:{local_rank}" if cuda_available() else "cpu"
