"""Peak memory of a piece of work on this worker's device.

CUDA: the allocator's peak (`torch.cuda.max_memory_allocated`) around the call. CPU: torch's `MemTracker`,
which follows the live tensor storages created during the call (CPU has no allocator statistics). Both
report the peak of live bytes during the call and the bytes already live before it, so `added_peak_bytes` is
what the work itself needs on top of the resident model state. `resident_bytes` counts that resident state
(weights, gradient buffers, optimizer state) from the tensors themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from libra.device import cuda_available


def measure_peak(fn: Callable[[], Any], modules: list[Any] | None = None) -> dict[str, int]:
    """Run `fn` once and return {"peak_bytes", "baseline_bytes", "added_peak_bytes"}."""
    if cuda_available():
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        return {"peak_bytes": int(peak), "baseline_bytes": int(baseline), "added_peak_bytes": int(peak - baseline)}
    tracker = _tracker_class()()
    if modules:
        tracker.track_external(*modules)
    with tracker:
        baseline = _total(tracker.get_tracker_snapshot("current"))
        fn()
    peak = _total(tracker.get_tracker_snapshot("peak"))
    return {"peak_bytes": peak, "baseline_bytes": baseline, "added_peak_bytes": max(0, peak - baseline)}


def _tracker_class() -> type:
    from torch.distributed._tools.mem_tracker import MemTracker

    class _Tracker(MemTracker):  # type: ignore[misc]
        """MemTracker for a whole Megatron-Core schedule in one tracked call. Only the global peak is read, so
        per-module statistics are restarted when a root module runs again (the next micro-batch), and module
        hooks of statistics already restarted are skipped (a pipeline schedule runs backward of an earlier
        micro-batch after the forward of a later one). Modules whose `buffers` is not the nn.Module method
        are walked past: Megatron-Core's DistributedDataParallel keeps its gradient buffers in a list
        attribute of that name (the wrapped module's own parameters are tracked when it runs)."""

        def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                name = self._mod_tracker.get_known_fqn(module)
                if set(self._mod_tracker.parents) - {name} == {"Global"}:
                    self.reset_mod_stats()
            super()._pre_fw_hook(module, inputs)

        def _post_fw_hook(self, module: torch.nn.Module, inputs: Any, outputs: Any) -> None:
            if module in self.memory_tracking:
                super()._post_fw_hook(module, inputs, outputs)

        def _pre_bw_hook(self, module: torch.nn.Module, args: Any) -> None:
            if module in self.memory_tracking:
                super()._pre_bw_hook(module, args)

        def _post_bw_hook(self, module: torch.nn.Module, args: Any) -> None:
            if module in self.memory_tracking:
                super()._post_bw_hook(module, args)

        def _track_module_params_and_buffers(self, module: torch.nn.Module, install_grad_hooks: bool = True
                                             ) -> tuple[int, int]:
            if not callable(getattr(module, "buffers", None)):
                return 0, 0
            return super()._track_module_params_and_buffers(module, install_grad_hooks)  # type: ignore[no-any-return]

    return _Tracker


def _total(snapshot: dict[Any, dict[Any, int]]) -> int:
    total = 0
    for per_device in snapshot.values():
        total += int(per_device.get("Total", 0))
    return total


def transient_peak(fn: Callable[[], Any], modules: list[torch.nn.Module], optimizer: Any = None) -> int:
    """Bytes `fn` needs at its peak on top of what was live before it (`measure_peak`'s added peak); the
    optimizer's state is tracked as already live, so an optimizer step counts only its temporaries."""
    return measure_peak(fn, [*modules, *_torch_optimizers(optimizer)])["added_peak_bytes"]


def resident_bytes(modules: list[torch.nn.Module], optimizer: Any) -> dict[str, int]:
    """Bytes of the state a training rank keeps between steps, counted once per storage: the parameters,
    the gradient buffers the parameters' `main_grad` (Megatron DDP) or `grad` point into, and the optimizer
    state (a Megatron optimizer wrapper, a chain of them, or a torch optimizer)."""
    seen: set[int] = set()

    def count(tensors: Sequence[torch.Tensor]) -> int:
        total = 0
        for t in tensors:
            storage = t.untyped_storage()
            key = storage.data_ptr() or id(storage)
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
        return total

    params = [p for m in modules for p in m.parameters()]
    grads = [g for p in params for g in (getattr(p, "main_grad", None), p.grad) if isinstance(g, torch.Tensor)]
    state = [t for opt in _torch_optimizers(optimizer) for s in opt.state.values() for t in s.values()
             if isinstance(t, torch.Tensor)]
    out = {"weights": count(params), "gradients": count(grads), "optimizer_state": count(state)}
    out["total"] = sum(out.values())
    return out


def _torch_optimizers(optimizer: Any) -> list[Any]:
    if optimizer is None:
        return []
    if hasattr(optimizer, "chained_optimizers"):
        return [o for inner in optimizer.chained_optimizers for o in _torch_optimizers(inner)]
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None and inner is not optimizer:
        return _torch_optimizers(inner)
    return [optimizer]
