"""``pprun serve``: serve one model over gRPC and, with ``serve.http_port``, the OpenAI HTTP API
(``pprun.serve``) until SIGTERM, then drain and exit 0.

The model, parallel, scheduler, cache, compilation and runner keys are ``pprun generate``'s; the
server's own are under ``serve.`` (``pprun.config.ServeConfig``).
"""

from __future__ import annotations

from pprun.apps import run_hydra_app
from pprun.config.config import ServeAppConfig


def run(cfg: ServeAppConfig) -> None:
    """Validate the server settings, resolve the engine's configuration (once: the server and the
    engine take the result), start the engine and serve (returns after draining)."""
    cfg.serve.validate()
    from pprun.engine.resolve import resolve_config
    from pprun.serve.layout import check_servable, engine_config

    resolved = resolve_config(engine_config(cfg))
    check_servable(resolved)
    from pprun.serve.server import serve

    serve(cfg, resolved)


def main() -> None:
    """Entry point of ``pprun serve`` (Hydra overrides from ``sys.argv``)."""
    run_hydra_app("serve", run)


if __name__ == "__main__":
    main()
