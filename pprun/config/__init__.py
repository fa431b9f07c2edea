"""Configuration: dataclasses (mirrored in Hydra's ConfigStore and the top-level conf/), validation, runner choice.

Importing this package does not import torch or Hydra (the scheduler uses the dataclasses).
"""

from pprun.config.config import (
    BenchAppConfig,
    CacheConfig,
    CompilationConfig,
    GenerateAppConfig,
    ModelConfig,
    ParallelConfig,
    PprunConfig,
    SamplingAppConfig,
    SchedulerConfig,
    UnknownConfigKeyError,
    default_conf_dir,
    register_configs,
)
from pprun.config.runner_choice import choose_runner, unsupported_v2_features
from pprun.config.validate import ResolvedConfig, even_partition, resolve_executor, validate_config

__all__ = [
    "BenchAppConfig",
    "CacheConfig",
    "CompilationConfig",
    "GenerateAppConfig",
    "ModelConfig",
    "ParallelConfig",
    "PprunConfig",
    "ResolvedConfig",
    "SamplingAppConfig",
    "SchedulerConfig",
    "UnknownConfigKeyError",
    "choose_runner",
    "default_conf_dir",
    "even_partition",
    "register_configs",
    "resolve_executor",
    "unsupported_v2_features",
    "validate_config",
]
