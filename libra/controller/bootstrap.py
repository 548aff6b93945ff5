"""What a controller sets up before its first tick: logging into the run directory, the tiny development
model, the tokenizer and the task (checked before Ray starts), the Ray runtime (local with logical GPUs, or an
existing cluster)."""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

from libra.config import Config
from libra.observability.log_file import DroppingFileHandler
from libra.run_dir import RunDir

log = logging.getLogger(__name__)

_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _BriefFormatter(logging.Formatter):
    """One line per record: tracebacks go to the log file only (the CLI shows them with --debug)."""

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        try:
            return super().format(record).split("\n", 1)[0]  # the rest (asyncio adds the task) is in the file
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved


def setup_logging(run: RunDir, level: str, stderr_level: int = logging.WARNING,
                  debug: bool = False) -> list[logging.Handler]:
    """Controller log into `<run_dir>/controller.log` at `level`; only warnings and errors on stderr (the
    console view owns stdout), one line each, with their tracebacks only when `debug`. Returns the handlers
    so they can be removed again."""
    root = logging.getLogger()
    file_handler = DroppingFileHandler(str(run.controller_log), encoding="utf-8")
    file_handler.setFormatter(logging.Formatter(_LOG_FORMAT))
    file_handler.setLevel(getattr(logging, level.upper(), logging.INFO))
    err_handler = logging.StreamHandler()
    err_format = "%(levelname)s %(name)s: %(message)s"
    err_handler.setFormatter(logging.Formatter(err_format) if debug else _BriefFormatter(err_format))
    err_handler.setLevel(stderr_level)
    root.addHandler(file_handler)
    root.addHandler(err_handler)
    root.setLevel(min(file_handler.level, stderr_level))
    return [file_handler, err_handler]


def remove_logging(handlers: list[logging.Handler]) -> None:
    root = logging.getLogger()
    for handler in handlers:
        root.removeHandler(handler)
        handler.close()


def ensure_tiny_model(cfg: Config) -> str | None:
    """Build the tiny random model at model_path when `build_tiny_model.enabled` (reused when it exists)."""
    tiny = cfg.build_tiny_model
    if not tiny.enabled:
        return None
    from libra.config.mapping import tiny_model_spec
    from libra.models.tiny import build_tiny_model

    spec = tiny_model_spec(tiny)
    try:
        return build_tiny_model(cfg.model_dir(), spec)
    except FileExistsError as exc:
        raise FileExistsError(
            f"model_path {cfg.model_dir()} holds a tiny model built with other build_tiny_model settings; "
            f"remove that folder, point model_path elsewhere, or restore the settings ({exc})"
        ) from exc


def start_ray(cfg: Config, namespace: str) -> Any:
    """Join `cluster.ray_address`, or start a local Ray with the configured (logical) GPUs."""
    from libra.cluster.ray_runtime import RayRuntime

    c = cfg.cluster
    if c.ray_address:
        return RayRuntime.start(address=c.ray_address, namespace=namespace)
    gpus = c.num_nodes * c.gpus_per_node
    cpus = max(4, int(gpus * max(1.0, c.cpus_per_gpu) * 2))
    return RayRuntime.start(num_gpus=gpus, num_cpus=cpus, namespace=namespace)


def stop_ray(runtime: Any) -> None:
    tmp = getattr(runtime, "tmp_dir", "")
    owned = getattr(runtime, "owned", False)
    runtime.shutdown()
    if owned and tmp and os.path.basename(tmp).startswith("libra-ray-"):
        shutil.rmtree(tmp, ignore_errors=True)


def load_tokenizer(cfg: Config) -> Any:
    from transformers import AutoTokenizer

    from libra.data.preflight import check_tokenizer_dir

    path = cfg.tokenizer_path or cfg.model_dir()
    check_tokenizer_dir(path, "tokenizer_path" if cfg.tokenizer_path != cfg.model_path else "model_path")
    return AutoTokenizer.from_pretrained(path)


def load_task(cfg: Config, tokenizer: Any) -> Any:
    """The job's task, checked as `libra validate` checks it (libra.data.preflight owns both)."""
    from libra.data.preflight import PromptDemand, build_checked_task

    return build_checked_task(cfg.task, tokenizer, PromptDemand(cfg.batch_size, cfg.task.eval_interval))
