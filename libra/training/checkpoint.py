"""Training checkpoints with `megatron.core.dist_checkpointing`: atomic publish, layout-independent resume,
retention.

Layout of a checkpoint root:

    <root>/latest                 text: the directory name of the newest complete checkpoint
    <root>/step_00000012/         dist_checkpointing files (model + optimizer, resharded on load),
                                  libra_meta.json (step, layout, scheduler state), rng/rank_00000.pt ...
    <root>/.tmp-step_00000014/    a save in progress; never read, replaced by the next save of that step

A save writes everything into the `.tmp-` directory, then rank 0 renames it to `step_*` and replaces `latest`
(write + fsync + `os.replace`), so a crash leaves either the old or the new checkpoint published, never a
partial one. Model and optimizer states are saved as sharded tensors keyed by their global shape, so a
checkpoint written at TP2/PP2/DP1 loads at TP1/PP1/DP2. RNG states are per rank; they are restored when the
layout is unchanged and re-derived from (seed, step) otherwise.

Megatron-Core's writer forks one process per write bucket and hands their results back through a module-level
queue that, left to itself, it creates on first use in a spawned manager process (one more process, which
imports torch, for every process that saves). Libra's saves are synchronous: the writes are
collected, and their results read, in the saving process itself, so `save` gives Megatron a plain in-process
queue instead and no helper process is started.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import shutil
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

LATEST = "latest"
META = "libra_meta.json"
STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoints_to_delete(steps: Iterable[int], keep_last: int, keep_every: int, protect: int | None = None) -> list[int]:
    """Steps whose checkpoints retention removes: all but the newest `keep_last`, the multiples of
    `keep_every` (when > 0) and `protect` (the published one). Sorted ascending."""
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last} must be >= 1")
    ordered = sorted(set(steps))
    keep = set(ordered[-keep_last:])
    if keep_every > 0:
        keep |= {s for s in ordered if s % keep_every == 0}
    if protect is not None:
        keep.add(protect)
    return [s for s in ordered if s not in keep]


def list_steps(root: str) -> list[int]:
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for name in os.listdir(root) if (m := STEP_DIR.match(name)))


class CorruptCheckpointError(RuntimeError):
    """A checkpoint file is unreadable or shorter than its index says: the checkpoint cannot be loaded."""


def resolve(path: str) -> str:
    """A checkpoint directory from a root (via `latest`) or a `step_*` directory itself."""
    marker = os.path.join(path, LATEST)
    if os.path.isfile(marker):
        with open(marker, encoding="utf-8", errors="replace") as fh:
            name = fh.read().strip()
        target = os.path.join(path, name)
        if not STEP_DIR.match(name) or not os.path.isfile(os.path.join(target, META)):
            raise FileNotFoundError(
                f"{marker} points to {name[:80]!r}, which is not a complete checkpoint (complete ones here: "
                f"{[step_dir_name(s) for s in list_steps(path)]}); write the name of one of them into the file, "
                "or load an earlier checkpoint")
        return target
    if os.path.isfile(os.path.join(path, META)):
        return path
    raise FileNotFoundError(f"'{path}' is neither a checkpoint root (no '{LATEST}' file) nor a checkpoint ({META})")


def read_meta(ckpt: str) -> dict[str, Any]:
    path = os.path.join(ckpt, META)
    try:
        with open(path, encoding="utf-8") as fh:
            meta = json.load(fh)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(f"{path} is not valid JSON ({exc}): the checkpoint cannot be loaded; "
                                     "load an earlier checkpoint") from exc
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int) or "scheduler" not in meta:
        raise CorruptCheckpointError(f"{path} lacks the checkpoint's step or scheduler state: the checkpoint "
                                     "cannot be loaded; load an earlier checkpoint")
    return meta


def file_problems(ckpt: str) -> list[str]:
    """What makes the files of checkpoint directory `ckpt` unloadable, each naming its file: unreadable
    metadata, a missing or truncated tensor shard (shorter than the sharded index says), unreadable common or
    RNG state. Cheap (sizes and small files only), and the same on every rank, so a collective load can
    refuse before any rank enters it. Flipped bytes inside a shard are not detected."""
    from torch.distributed.checkpoint import FileSystemReader

    problems: list[str] = []
    try:
        read_meta(ckpt)
    except (OSError, CorruptCheckpointError) as exc:
        problems.append(str(exc))
    try:
        index = FileSystemReader(ckpt).read_metadata()
    except Exception as exc:  # pickle raises many kinds on a damaged file
        problems.append(f"{os.path.join(ckpt, '.metadata')} is unreadable ({type(exc).__name__}: {exc})")
        index = None
    if index is not None:
        needed: dict[str, int] = {}
        for item in (index.storage_data or {}).values():
            needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
        for name, size in sorted(needed.items()):
            shard = os.path.join(ckpt, name)
            actual = os.path.getsize(shard) if os.path.isfile(shard) else None
            if actual is None:
                problems.append(f"{shard} is missing (the checkpoint's index lists it)")
            elif actual < size:
                problems.append(f"{shard} is truncated: {actual} bytes, the checkpoint's index needs {size}")
    small = [os.path.join(ckpt, "common.pt")] if os.path.exists(os.path.join(ckpt, "common.pt")) else []
    rng = os.path.join(ckpt, "rng")
    small += sorted(os.path.join(rng, n) for n in os.listdir(rng)) if os.path.isdir(rng) else []
    for path in small:
        try:
            torch.load(path, weights_only=False)
        except Exception as exc:
            problems.append(f"{path} is unreadable ({type(exc).__name__}: {str(exc)[:120]})")
    return problems


def verify(path: str) -> str:
    """The checkpoint directory of `path` (see `resolve`) once its files pass `file_problems`; raises
    FileNotFoundError (no checkpoint there) or CorruptCheckpointError listing every problem."""
    ckpt = resolve(path)
    problems = file_problems(ckpt)
    if problems:
        raise CorruptCheckpointError(f"checkpoint {ckpt} cannot be loaded: " + "; ".join(problems)
                                     + "; load an earlier checkpoint")
    return ckpt


def _write_atomic(path: str, text: str) -> None:
    """Replace `path` with `text` or leave it as it was (a full disk leaves neither a cut file nor the temp)."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state: dict[str, Any] = {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def use_in_process_results_queue() -> int:
    """Have Megatron-Core's checkpoint writer pass its write results through an in-process queue (a
    `queue.Queue`) instead of one in a spawned manager process, and empty the queue of results an earlier save
    left there (one that failed between writing and reading its results): the writer reads the oldest result,
    which would describe the files of that earlier save. Right for synchronous saves only: the results are put
    and read by the saving process (`AsyncRequest.execute_sync`). Returns how many stale results were dropped."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    # private in megatron-core 0.16.1: the module's queue, created on first use by every save
    results = getattr(filesystem_async, "_results_queue", None)
    if results is None:
        filesystem_async._results_queue = queue.Queue()
        return 0
    dropped = 0
    while True:
        try:
            results.get_nowait()
        except queue.Empty:
            return dropped
        dropped += 1


def model_sharded_state_dict(chunks: list[Any]) -> dict[str, Any]:
    """`{"model": ...}` or, with VPP, `{"model0": ..., "model1": ...}` of the unwrapped GPTModel chunks."""
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}


def save(
    root: str,
    step: int,
    chunks: list[Any],
    optimizer: Any,
    scheduler: Any,
    layout: dict[str, int],
    extra_meta: dict[str, Any],
    keep_last: int,
    keep_every: int,
) -> str:
    """Collective: save model + optimizer + RNG + step atomically under `root`; returns the step directory."""
    from megatron.core import dist_checkpointing

    rank = dist.get_rank()
    final = os.path.join(root, step_dir_name(step))
    tmp = os.path.join(root, ".tmp-" + step_dir_name(step))
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    state = model_sharded_state_dict(chunks)
    state["optimizer"] = optimizer.sharded_state_dict(state)
    stale = use_in_process_results_queue()
    if stale:
        log.warning("checkpoint step %d: dropped %d write result(s) an earlier failed save left", step, stale)
    dist_checkpointing.save(state, tmp)
    os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
    torch.save(rng_state(), os.path.join(tmp, "rng", f"rank_{rank:05d}.pt"))
    dist.barrier()
    if rank == 0:
        meta = {
            "step": step,
            "layout": layout,
            "scheduler": scheduler.state_dict(),
            **extra_meta,
        }
        _write_atomic(os.path.join(tmp, META), json.dumps(meta, indent=2, default=str))
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
        _write_atomic(os.path.join(root, LATEST), step_dir_name(step))
        for old in checkpoints_to_delete(list_steps(root), keep_last, keep_every, protect=step):
            shutil.rmtree(os.path.join(root, step_dir_name(old)), ignore_errors=True)
    dist.barrier()
    return final


def load(
    path: str, chunks: list[Any], optimizer: Any, scheduler: Any, layout: dict[str, int], seed: int
) -> tuple[int, bool]:
    """Collective: load model + optimizer (+ RNG when the layout matches) from `path`; returns
    (step, rng_restored)."""
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    ckpt = verify(path)  # every rank refuses a damaged checkpoint before the collective load
    meta = read_meta(ckpt)
    template = model_sharded_state_dict(chunks)
    template["optimizer"] = optimizer.sharded_state_dict(template, is_loading=True)
    loaded = dist_checkpointing.load(template, ckpt)
    if len(chunks) == 1:
        chunks[0].load_state_dict(loaded["model"])
    else:
        for i, chunk in enumerate(chunks):
            chunk.load_state_dict(loaded[f"model{i}"])
    optimizer.load_state_dict(loaded["optimizer"])
    # Megatron's scheduler adds the saved step count to its own (load_state_dict calls step(increment=n)):
    # start from zero, or a pool that already stepped would resume with its schedule ahead
    scheduler.num_steps = 0
    scheduler.load_state_dict(meta["scheduler"])
    step = int(meta["step"])
    rank = dist.get_rank()
    rng_file = os.path.join(ckpt, "rng", f"rank_{rank:05d}.pt")
    same_layout = meta.get("layout") == layout
    if same_layout and os.path.isfile(rng_file):
        set_rng_state(torch.load(rng_file, weights_only=False))
        return step, True
    torch.manual_seed(seed + step)
    model_parallel_cuda_manual_seed(seed + step, force_reset_rng=True)
    return step, False
