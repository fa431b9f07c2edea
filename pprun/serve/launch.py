"""``pprun serve``'s entry: one front end in this process (:func:`pprun.serve.server.serve`), or
with ``serve.api_servers`` > 1 this process as the parent of that many front-end processes
(:func:`pprun.serve.api_servers.serve_api_servers`).  Kept apart from both so that neither imports
the other."""

from __future__ import annotations

import asyncio

from pprun.config.config import ServeAppConfig
from pprun.config.validate import ResolvedConfig
from pprun.serve.settings import ServeSettings, resolve_serve_settings


def serve(settings: ServeSettings | ServeAppConfig, resolved: ResolvedConfig | None = None,
          stop: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM/SIGINT (or ``stop`` is set, with one front end); returns after
    draining.  ``settings``: checked already (:func:`~pprun.serve.settings.resolve_serve_settings`)
    or an app configuration checked here (with ``resolved``, its engine's configuration)."""
    if not isinstance(settings, ServeSettings):
        settings = resolve_serve_settings(settings, resolved)
    api_servers = settings.serve.api_servers
    if api_servers == 1:
        from pprun.serve.server import serve as serve_one

        serve_one(settings, stop=stop)
        return
    if stop is not None:
        raise ValueError(f"serve.api_servers={api_servers}: the front-end processes stop on SIGTERM to this "
                         "process, not on a `stop` event (give serve.api_servers=1 to drive one in-process)")
    from pprun.serve.api_servers import serve_api_servers

    serve_api_servers(settings)
