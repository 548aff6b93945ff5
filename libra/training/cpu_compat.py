"""CPU compatibility layer for megatron-core 0.16.1: the only module that bends Megatron to run without CUDA.

megatron-core hard-codes CUDA in a few places that a training step passes through. On a machine where
`libra.device.cuda_available()` is False, `install()` redirects exactly those places to the CPU; where CUDA
exists it does nothing, so the GPU code path is Megatron's own. What it redirects and why:

1. RNG tracker. `tensor_parallel.random` keeps per-parallel-group RNG states through `torch.cuda`
   (`get_rng_state`, `manual_seed`, `_get_cuda_rng_state`, `_set_cuda_rng_state`). The tracker class and the
   two state helpers are replaced by versions on the CPU generator, so `model_parallel_cuda_manual_seed`,
   `get_cuda_rng_tracker().fork()` and the checkpointed RNG state work unchanged.
2. Current device. The global memory buffer, the DDP gradient buffers, the optimizer and the backward of
   the tensor-parallel mappings allocate with `device=torch.cuda.current_device()`, which asserts on a CPU
   build. `torch.cuda.current_device` returns `torch.device("cpu")` (autograd runs backward functions
   outside any `TorchFunctionMode`, so the mode below cannot catch those). `torch.cuda.synchronize` and
   `empty_cache` become no-ops (nothing is queued on a CPU).
3. Device arguments. A `torch.overrides.TorchFunctionMode` (`device_scope()`) rewrites `device="cuda"`,
   `device=<int>`, `torch.device("cuda")`, `Tensor.cuda()`, `Tensor.to("cuda")` and `pin_memory()` to the CPU.
   This covers the causal-mask helpers (`device="cuda"`), the pipeline schedules' tensors and the DDP /
   optimizer scalars. The mode is thread-local: every worker entry point runs inside `device_scope()`.

Independent of the device, `install_without_te()` defines `moe_utils.te_general_gemm = None` when
TransformerEngine is not installed: 0.16.1 only binds that name inside its TE import, so the MoE router's
`te_general_gemm is not None` check raises NameError without TE.

Still CUDA-only in 0.16.1 even with this layer (callers get a *Not validated on CPU* error instead):
gradient clipping (`clip_grad_by_total_norm_fp32` asserts on `torch.cuda.FloatTensor`), the distributed
optimizer, CPU optimizer offload and the precision-aware optimizer, and context parallelism.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from libra.device import cuda_available

_CPU = torch.device("cpu")
_install_lock = threading.Lock()
_installed = False


def active() -> bool:
    """True when the layer applies (no CUDA device)."""
    return not cuda_available()


def _is_cuda_device(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    if isinstance(value, str):
        return value.startswith("cuda")
    if isinstance(value, torch.device):
        return value.type == "cuda"
    return False


class CpuDeviceMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of torch calls to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        if "pin_memory" in kwargs:
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _make_tracker_class() -> type:
    from megatron.core.tensor_parallel import random as mrandom

    base = mrandom.CudaRNGStatesTracker

    class _CpuTracker(base):  # type: ignore[valid-type, misc]
        """Megatron's RNG-states tracker on the CPU generator."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    _CpuTracker.__name__ = "CpuRNGStatesTracker"
    return _CpuTracker


def install() -> bool:
    """Apply the redirections once per process when CUDA is absent; returns whether the layer is active."""
    global _installed
    if not active():
        return False
    with _install_lock:
        if _installed:
            return True
        from megatron.core.tensor_parallel import random as mrandom

        tracker_cls = _make_tracker_class()
        mrandom.CudaRNGStatesTracker = tracker_cls
        mrandom._get_cuda_rng_state = _cpu_get_rng_state
        mrandom._set_cuda_rng_state = _cpu_set_rng_state
        # model_parallel_cuda_manual_seed seeds the default generator through torch.cuda.manual_seed.
        # The "CUDA" generator is the CPU generator here. torch.manual_seed itself calls
        # torch.cuda.manual_seed_all, so that one must not re-enter torch.manual_seed.
        torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))  # type: ignore[assignment]
        torch.cuda.manual_seed_all = lambda seed: None  # type: ignore[assignment]
        torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()  # type: ignore[assignment]
        torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)  # type: ignore[assignment]
        # A device object, not an index: autograd runs backward functions outside the device mode, and
        # their `device=torch.cuda.current_device()` allocations must land on the CPU as well.
        torch.cuda.current_device = lambda: _CPU  # type: ignore[assignment,return-value]
        torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
        torch.cuda.empty_cache = lambda: None  # type: ignore[assignment]
        _install_cpu_causal_mask()
        _installed = True
        return True


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, device=_CPU), diagonal=1).bool()


def _install_cpu_causal_mask() -> None:
    """Activation recomputation (megatron_recompute_granularity) reruns attention inside autograd, outside the
    device mode; the default causal mask it builds there (`device="cuda"`) must land on the CPU too."""
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    utils.get_default_causal_mask = _cpu_causal_mask
    fused_softmax.get_default_causal_mask = _cpu_causal_mask


def install_without_te() -> None:
    """Bind the TransformerEngine names megatron-core 0.16.1 reads unconditionally (see module docstring)."""
    from megatron.core.transformer.moe import moe_utils

    if not getattr(moe_utils, "HAVE_TE", False) and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


@contextlib.contextmanager
def device_scope() -> Iterator[None]:
    """Run a block with the CUDA-to-CPU device rewriting (no-op where CUDA exists)."""
    if not active():
        install_without_te()
        yield
        return
    install()
    install_without_te()
    with CpuDeviceMode():
        yield
