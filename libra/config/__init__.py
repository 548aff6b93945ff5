"""Libra job configuration: frozen dataclasses loaded from YAML with `--set` overrides and validated
with every error collected (field path, value, rule, fix).

    from libra.config import load, load_dict, dump, Config, ConfigError
    cfg = load("configs/dev.yaml", ["train_tp_size=2"])
"""

from libra.config.errors import (
    ERROR_KINDS,
    INVALID,
    NOT_IMPLEMENTED,
    NOT_VALIDATED,
    ConfigError,
    ConfigIssue,
)
from libra.config.loader import apply_overrides, dump, load, load_dict, resolve_path
from libra.config.rules import RULES, Rule
from libra.config.schema import (
    AlgorithmConfig,
    CheckpointConfig,
    ClusterConfig,
    Config,
    ISCorrectionConfig,
    OptimizerConfig,
    PlannerConfig,
    RefKLConfig,
    TaskConfig,
    TinyModelConfig,
    TrackingConfig,
)

__all__ = [
    "ERROR_KINDS",
    "INVALID",
    "NOT_IMPLEMENTED",
    "NOT_VALIDATED",
    "RULES",
    "AlgorithmConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "ConfigIssue",
    "ISCorrectionConfig",
    "OptimizerConfig",
    "PlannerConfig",
    "RefKLConfig",
    "Rule",
    "TaskConfig",
    "TinyModelConfig",
    "TrackingConfig",
    "apply_overrides",
    "dump",
    "load",
    "load_dict",
    "resolve_path",
]
