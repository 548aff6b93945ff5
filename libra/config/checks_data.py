"""Cross-field checks that read the files a job names: the task, built from its dataset files exactly as the
launcher builds it, and the tokenizer directory.

Each check is owned by `libra.data.preflight` (the task's constructor, the registry, the dataset reader), which
the controller also calls before it starts Ray; this module only turns its `TaskError` into a finding.
"""

from __future__ import annotations

from collections.abc import Iterator

from libra.config.context import Finding, RuleContext
from libra.config.errors import MISSING_VALUE
from libra.data.drift_task import DRIFT_PARAMS
from libra.data.preflight import PromptDemand, check_tokenizer_dir, preflight_task
from libra.data.prompt import UNSET, TaskError
from libra.data.registry import TaskSpec


def _finding(err: TaskError, default_field: str) -> Finding:
    return Finding(
        err.field or default_field,
        err.problem,
        err.fix or "correct the task section",
        value=MISSING_VALUE if err.value is UNSET else err.value,
    )


def task_builds(c: RuleContext) -> Iterator[Finding]:
    task = c.cfg.task
    err = preflight_task(TaskSpec.from_config(task), PromptDemand(c.cfg.batch_size, task.eval_interval))
    if err is not None:
        yield _finding(err, "task")


def drift_budget_fits(c: RuleContext) -> Iterator[Finding]:
    """The drifting task's largest response budget is one the job allows (it would be cut silently)."""
    task = c.cfg.task
    end = task.params.get("end_tokens", DRIFT_PARAMS["end_tokens"])
    if task.name == "drift" and isinstance(end, int) and end > c.cfg.max_new_tokens:
        yield Finding("task.params.end_tokens", f"asks for responses of up to {end} tokens, but max_new_tokens is "
                      f"{c.cfg.max_new_tokens}", f"set max_new_tokens to at least {end}, or lower end_tokens",
                      value=end)


def tokenizer_readable(c: RuleContext) -> Iterator[Finding]:
    cfg = c.cfg
    if cfg.build_tiny_model.enabled or cfg.tokenizer_path == cfg.model_path:
        return  # the launcher writes the tiny model's tokenizer; model_path is checked by model.config
    try:
        check_tokenizer_dir(cfg.tokenizer_path)
    except TaskError as err:
        yield _finding(err, "tokenizer_path")
