"""From a :class:`PprunConfig` to the one :class:`ResolvedConfig` a run hands down.

Two steps, once per run, in the entry point (``LLM``, ``AsyncEngine``, ``EngineProcess``,
``pprun serve``, the apps), before any process starts:

1. model resolution: a known model alias is converted into its cached Hugging Face directory
   (``pprun.models.demo.resolve_model``; a no-op once converted, or for a directory), with the
   converter's own errors (a missing pip package named);
2. validation: ``validate_config`` reads that directory and resolves every automatic choice,
   with no side effects.

Everything below the entry point (``LLMEngine``, ``InputProcessor``, executors, stage processes)
takes the resolved config and never validates again.
"""

from __future__ import annotations

from pprun.config.config import PprunConfig
from pprun.config.validate import ResolvedConfig


def resolve_config(config: PprunConfig | ResolvedConfig) -> ResolvedConfig:
    """``config`` resolved: a :class:`ResolvedConfig` as is; a :class:`PprunConfig` with its model
    resolved (converted once where it is a known alias) and then validated."""
    if isinstance(config, ResolvedConfig):
        return config
    if not isinstance(config, PprunConfig):
        raise TypeError(
            f"config has type {type(config).__name__}: must be a PprunConfig or a ResolvedConfig"
        )
    from pprun.config import validate
    from pprun.models.demo import known_model_aliases, resolve_model

    if isinstance(config.model.model, str) and config.model.model in known_model_aliases():
        resolve_model(config.model.model)
    return validate.validate_config(config)
