"""vLLM worker extension: the guarded in-place weight reload and the weight report of a started server.

vLLM mixes this class into every worker of a server started with
`--worker-extension-cls libra.rollout.worker_extension.LibraWorkerExtension`; its methods are reached with
`POST /collective_rpc {"method": "libra_reload", "kwargs": {...}}` (string arguments only) and return one
JSON-able dict per worker.

What the reported checksum proves (definition in `weights_checksum.py`):
- `libra_reload`: the checksum is computed from the very tensors vLLM's checkpoint iterator handed to the
  model's `load_weights` during this reload, and every model parameter is reported loaded by that call
  (names it did not load are returned in `params_not_loaded`). Equal to the publisher's checksum means the
  model was rebuilt from exactly the published tensors.
- `libra_verify` (after a process start): vLLM's start-up loader fails on any parameter it could not load;
  the checksum is computed by streaming the checkpoint the server was started on through the same loader
  iterator, inside the server.
- Both also compare the values of the parameters that keep their checkpoint layout in memory (embeddings,
  norms and, on GPUs, the linear weights incl. packed qkv/gate_up) with the streamed tensors; differences are
  returned in `param_value_mismatches`. On CPU the linear weights are repacked into oneDNN kernels and
  cannot be read back, so they are covered by the load check only.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from libra.rollout import idle_wait
from libra.rollout.weights_checksum import TensorDigest, combine_digests

if idle_wait.requested() and not idle_wait.install():  # imported in each worker before its queues exist
    logging.getLogger(__name__).warning(
        "this vLLM has no shared-memory queue condition to patch: TP workers spin between steps as shipped"
    )

STATE_ATTR = "_libra_weight_state"
HASH_WORKERS = min(8, os.cpu_count() or 1)
HASH_WINDOW_BYTES = 1 << 30  # tensors held ahead of the model's loader while they are hashed


class _DigestingStream:
    """Wraps a checkpoint iterator: digests every (name, tensor) before handing it to the model.

    Digests run in a small thread pool over a bounded look-ahead window (hashlib releases the GIL), so a
    large checkpoint is hashed on several cores; a tensor is still only yielded once its digest is done, so
    the digest is of exactly what the model then loads.
    """

    def __init__(
        self,
        source: Iterable[tuple[str, Any]],
        model_dtype: Any,
        workers: int = HASH_WORKERS,
        window_bytes: int = HASH_WINDOW_BYTES,
    ) -> None:
        self._source = source
        self._model_dtype = model_dtype
        self._workers = max(1, workers)
        self._window_bytes = window_bytes
        self.digests: list[TensorDigest] = []
        self.value_digests: dict[str, TensorDigest] = {}
        self.hash_s = 0.0  # summed over the hashing threads
        self.bytes = 0

    def _digest(self, name: str, tensor: Any) -> tuple[TensorDigest, TensorDigest, float]:
        start = time.perf_counter()
        digest = TensorDigest.of_tensor(name, tensor)
        value = digest
        # Parameters hold the model dtype; compare their values against the tensor cast the same way.
        if tensor.is_floating_point() and tensor.dtype != self._model_dtype:
            value = TensorDigest.of_tensor(name, tensor.to(self._model_dtype))
        return digest, value, time.perf_counter() - start

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        window: deque[tuple[str, Any, Future[tuple[TensorDigest, TensorDigest, float]], int]] = deque()
        held = 0
        with ThreadPoolExecutor(self._workers, thread_name_prefix="libra-digest") as pool:
            for name, tensor in self._source:
                size = tensor.numel() * tensor.element_size()
                window.append((name, tensor, pool.submit(self._digest, name, tensor), size))
                held += size
                while window and (held > self._window_bytes or len(window) > 2 * self._workers):
                    held -= window[0][3]
                    yield self._emit(window.popleft())
            while window:
                yield self._emit(window.popleft())

    def _emit(
        self, item: tuple[str, Any, Future[tuple[TensorDigest, TensorDigest, float]], int]
    ) -> tuple[str, Any]:
        name, tensor, future, size = item
        digest, value, seconds = future.result()
        self.digests.append(digest)
        self.value_digests[name] = value
        self.hash_s += seconds
        self.bytes += size
        return name, tensor


def _value_sources(
    param_name: str, digests: dict[str, TensorDigest], packed: dict[str, list[str]]
) -> list[TensorDigest] | None:
    """The streamed tensors a parameter was built from, in order along dim 0, if the name says so."""
    if param_name in digests:
        return [digests[param_name]]
    for fused, parts in packed.items():
        marker = f".{fused}."
        if marker in param_name:
            names = [param_name.replace(marker, f".{part}.") for part in parts]
            if all(n in digests for n in names):
                return [digests[n] for n in names]
    return None


def check_parameter_values(
    model: Any, digests: dict[str, TensorDigest], model_dtype: Any
) -> tuple[int, list[str]]:
    """Compare readable parameters with the streamed tensors: (number compared, names that differ).

    A parameter is compared when its tensors are found by name (directly or through the model's
    `packed_modules_mapping`), it keeps the model dtype, and its shape is the tensors stacked along dim 0
    (a single tensor may be padded at the end, as vocabulary embeddings are). Sharded (TP > 1) or repacked
    parameters do not satisfy that and are skipped, never reported as different.
    """
    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    compared, mismatched = 0, []
    for name, param in model.named_parameters():
        if param.is_meta or param.dim() == 0 or param.numel() == 0 or param.dtype != model_dtype:
            continue
        sources = _value_sources(name, digests, packed)
        if not sources or any(len(s.shape) != param.dim() for s in sources):
            continue
        if any(tuple(s.shape[1:]) != tuple(param.shape[1:]) for s in sources):
            continue
        rows = sum(s.shape[0] for s in sources)
        if rows > param.shape[0] or (len(sources) > 1 and rows != param.shape[0]):
            continue
        offset, equal = 0, True
        for source in sources:
            part = param.detach()[offset : offset + source.shape[0]]
            equal = equal and TensorDigest.of_tensor(source.name, part).sha256 == source.sha256
            offset += source.shape[0]
        compared += 1
        if not equal:
            mismatched.append(name)
    return compared, mismatched


class LibraWorkerExtension:
    """Methods added to vLLM's worker (`self` is the worker: `model_runner`, `vllm_config`, ...)."""

    model_runner: Any
    vllm_config: Any

    def libra_reload(self, weights_path: str, weight_version: str) -> dict[str, Any]:
        """Reload every weight from `weights_path` in place, digesting the tensors as they load."""
        from vllm.model_executor.model_loader import get_model_loader

        if not os.path.isdir(weights_path):
            raise FileNotFoundError(f"weights directory '{weights_path}' does not exist on this host")
        start = time.perf_counter()
        model = self.model_runner.get_model()
        model_config = self.vllm_config.model_config
        expected = {name for name, _ in model.named_parameters()}
        model_config.model = weights_path
        model_config.model_weights = ""
        model_config.revision = None
        loader: Any = get_model_loader(self.vllm_config.load_config)
        stream = _DigestingStream(loader.get_all_weights(model_config, model), model_config.dtype)

        loaded: set[str] = set()
        original_load = model.load_weights

        def load_and_record(weights: Iterable[tuple[str, Any]]) -> Any:
            names = original_load(weights)
            loaded.update(names or ())
            return names

        model.load_weights = load_and_record
        try:
            self.reload_weights(weights_iterator=iter(stream), is_checkpoint_format=True)  # type: ignore[attr-defined]
        finally:
            del model.load_weights
        load_s = time.perf_counter() - start
        return self._libra_finish(
            stream,
            weights_path,
            weight_version,
            load_s,
            loaded_by="reload",
            not_loaded=sorted(expected - loaded),
        )

    def libra_verify(self, weight_version: str) -> dict[str, Any]:
        """Report the weights of a freshly started server: checksum of its checkpoint, streamed in-server."""
        from vllm.model_executor.model_loader import get_model_loader

        start = time.perf_counter()
        model = self.model_runner.get_model()
        model_config = self.vllm_config.model_config
        loader: Any = get_model_loader(self.vllm_config.load_config)
        stream = _DigestingStream(loader.get_all_weights(model_config, model), model_config.dtype)
        for _ in stream:
            pass
        return self._libra_finish(
            stream, str(model_config.model), weight_version, time.perf_counter() - start, "startup", []
        )

    def libra_state(self) -> dict[str, Any]:
        """The weight version and checksum this worker last reported (empty before the first report)."""
        return dict(getattr(self, STATE_ATTR, {}))

    def _libra_finish(
        self,
        stream: _DigestingStream,
        weights_path: str,
        weight_version: str,
        load_s: float,
        loaded_by: str,
        not_loaded: list[str],
    ) -> dict[str, Any]:
        model = self.model_runner.get_model()
        compared, mismatched = check_parameter_values(
            model, stream.value_digests, self.vllm_config.model_config.dtype
        )
        checksum = combine_digests(stream.digests)
        state = {"weight_version": int(weight_version), "checksum": checksum, "model_path": weights_path}
        setattr(self, STATE_ATTR, state)
        return {
            **state,
            "loaded_by": loaded_by,
            "load_s": load_s,
            "hash_s": stream.hash_s,
            "tensors": len(stream.digests),
            "bytes": stream.bytes,
            "params_total": sum(1 for _ in model.named_parameters()),
            "params_not_loaded": not_loaded,
            "params_value_checked": compared,
            "param_value_mismatches": mismatched,
            "pid": os.getpid(),
        }
