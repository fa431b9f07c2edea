"""Who may reach a server pprun starts: the one rule every server of ``pprun serve`` applies to
its address before it starts (``docs/security.md``).

* on loopback (``127.0.0.1``, ``::1``, ``localhost``) anything goes: only this host reaches it;
* any other address without a bearer token is refused, unless the user opts out by name
  (``serve.allow_unauthenticated=true``, logged);
* a token on such an address without TLS starts, with a warning that the token travels in clear.

Nothing here imports gRPC or an HTTP stack: the config validation calls it too.
"""

from __future__ import annotations

import ipaddress

LOOPBACK_NAMES = ("localhost",)
"""Host names taken as loopback without resolving them."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address, bracketed IPv6 allowed, or ``localhost``) is a loopback
    address: ``127.0.0.0/8``, ``::1``.  A wildcard (``0.0.0.0``, ``::``) or any other name is not."""
    name = host.strip()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    if name.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def check_network_exposure(
    host: str,
    *,
    has_token: bool,
    tls: bool,
    allow_unauthenticated: bool,
    host_field: str = "serve.host",
) -> str | None:
    """Apply the rule above to a server about to listen on ``host``.

    Raises ValueError (naming ``host_field``, its value, and the ways out) for a non-loopback
    address with no token and no opt-out.  Returns the warning the server logs when it starts
    (a token in clear, or the opt-out in force), or None when there is nothing to say."""
    if is_loopback(host):
        return None
    if not has_token and not allow_unauthenticated:
        raise ValueError(
            f"{host_field}={host!r} listens beyond this host, and no bearer token is set: anyone who "
            "reaches it could use the model. Add a token: serve.auth_token_file=PATH (a file whose first "
            "line is the token, e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))' > "
            "token.txt && chmod 600 token.txt`; clients send `authorization: Bearer <token>`), best with "
            "TLS (serve.tls_cert_file=cert.pem serve.tls_key_file=key.pem); or listen on loopback "
            "(serve.host=127.0.0.1); or, on a network you trust, opt out explicitly with "
            "serve.allow_unauthenticated=true"
        )
    if not has_token:
        return (
            f"{host_field}={host!r}: serving WITHOUT authentication (serve.allow_unauthenticated=true): "
            "anyone who reaches this address can use the model"
        )
    if not tls:
        return (
            f"{host_field}={host!r}: the bearer token travels in clear (no TLS): anyone on the path can "
            "read it and reuse it; add serve.tls_cert_file and serve.tls_key_file"
        )
    return None
