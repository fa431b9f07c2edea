"""What ``pprun serve`` checks about the engine's configuration before anything starts (no gRPC
or protobuf import here: a process that holds other copies of the KServe messages can call it)."""

from __future__ import annotations

from dataclasses import fields

from pprun.config.config import PprunConfig, ServeAppConfig
from pprun.config.validate import ResolvedConfig


def engine_config(cfg: ServeAppConfig) -> PprunConfig:
    """The engine's part of ``cfg`` (built without OmegaConf, so a script can serve without Hydra)."""
    return PprunConfig.from_kwargs(**{f.name: getattr(cfg, f.name) for f in fields(PprunConfig)})


def check_servable(resolved: ResolvedConfig) -> None:
    """Raise ValueError when the engine's layout (``resolved``, the run's resolved config) cannot
    sit behind one server.

    Under ``external_launcher`` every torchrun rank runs its own engine in lockstep (SPMD) and
    must see every request, while a server hands each request to the one process it reached:
    the other ranks never schedule it, and the first step waits on them until the stage timeout.
    """
    executor = resolved.executor
    if executor == "external_launcher":
        given = resolved.cfg.parallel.executor
        how = "" if given == executor else f" (resolved from {given!r}: this process runs under torchrun)"
        raise ValueError(
            f"parallel.executor={executor!r}{how} cannot serve: every torchrun rank runs its own engine "
            "and must see every request, but a gRPC server hands each request to one process; start "
            "`pprun serve` without torchrun, with parallel.executor=mp or ray (or uni for one stage)"
        )
