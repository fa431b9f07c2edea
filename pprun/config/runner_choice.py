"""Choose the model runner (V1 or V2) for a configuration (docs/design.md contract 5).

V2 is the default wherever it can run; every configuration it cannot serve has a reason here, and
``runner=auto`` falls back to V1 with one warning naming those reasons.
"""

from __future__ import annotations

import logging

from pprun.config.config import PprunConfig

logger = logging.getLogger(__name__)

RUNNERS: tuple[str, ...] = ("auto", "v1", "v2")
"""Allowed values of ``PprunConfig.runner``."""

# Reason lists already warned about in this process: a process that starts several engines of one
# configuration (a sweep, a test session) logs the fallback once, not once per engine.
_warned: set[tuple[str, ...]] = set()


def unsupported_v2_features(cfg: PprunConfig, executor: str) -> list[str]:
    """Human-readable reasons the V2 runner cannot run ``cfg`` under ``executor`` (resolved); empty if it can."""
    reasons: list[str] = []
    if executor == "external_launcher" and cfg.parallel.pipeline_parallel_size > 1:
        reasons.append(
            f"executor=external_launcher with pipeline_parallel_size={cfg.parallel.pipeline_parallel_size} > 1 "
            "(the V2 runner samples on the last stage only, while SPMD torchrun ranks each need every "
            "step's output)"
        )
    return reasons


def choose_runner(cfg: PprunConfig, executor: str) -> tuple[str, list[str]]:
    """Return ``("v1"|"v2", reasons V2 cannot run)`` for ``cfg.runner`` under the resolved ``executor``.

    ``v1`` always gives V1; ``v2`` with reasons raises ValueError naming them; ``auto`` gives V2 when
    there are no reasons, else V1 and logs one warning naming them.
    """
    if cfg.runner not in RUNNERS:
        raise ValueError(f"runner={cfg.runner!r} is not allowed; choose one of {', '.join(RUNNERS)}")
    reasons = unsupported_v2_features(cfg, executor)
    if cfg.runner == "v1":
        return "v1", reasons
    if cfg.runner == "v2":
        if reasons:
            raise ValueError(
                "runner='v2' cannot run this configuration: "
                + "; ".join(reasons)
                + ". Use runner=v1 or auto."
            )
        return "v2", reasons
    if reasons:
        key = tuple(reasons)
        if key not in _warned:
            _warned.add(key)
            logger.warning(
                "runner=auto: using the V1 runner because V2 does not support: %s", "; ".join(reasons)
            )
        return "v1", reasons
    return "v2", reasons
