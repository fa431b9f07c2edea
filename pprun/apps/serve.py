"""``pprun serve``: serve one model over gRPC and, with ``serve.http_port``, the OpenAI HTTP API
(``pprun.serve``) until SIGTERM, then drain and exit 0.

The model, parallel, scheduler, cache, compilation and runner keys are ``pprun generate``'s; the
server's own are under ``serve.`` (``pprun.config.ServeConfig``).
"""

from __future__ import annotations

from pprun.apps import run_hydra_app
from pprun.config.config import ServeAppConfig


def run(cfg: ServeAppConfig) -> None:
    """Check every setting once (the server's, the token, the engine's configuration resolved:
    ``pprun.serve.settings``), start the engine and serve (returns after draining)."""
    from pprun.serve.settings import resolve_serve_settings

    settings = resolve_serve_settings(cfg)
    from pprun.serve.launch import serve

    serve(settings)


def main() -> None:
    """Entry point of ``pprun serve`` (Hydra overrides from ``sys.argv``)."""
    run_hydra_app("serve", run)


if __name__ == "__main__":
    main()
