"""Who may talk to a pprun process: peer authentication and loopback-only rendezvous.

Every socket pprun opens either binds to loopback or authenticates its peer before it reads
anything else from it (``docs/failures.md``, "Sockets"):

* the driver's control sockets use ``multiprocessing.connection``'s HMAC challenge-response with
  the run's key; :func:`accept_authenticated` bounds that handshake, so a stranger that connects
  and says nothing (or the wrong thing) is dropped and the stages still get in;
* the sampled-ids socket between the last and the first stage runs :func:`authenticate` (the same
  kind of challenge-response, both ways) before any id is read;
* with every stage on one host the ``torch.distributed`` rendezvous is a file in a private
  directory (no TCP store, which listens on every interface) and gloo and NCCL open their
  sockets on the loopback interface (:func:`loopback_env`);
* with stages on several hosts the rendezvous is stage 0's store
  (``pprun.distributed.rendezvous``), whose connections run :func:`authenticate` first.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import socket
import struct
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge

logger = logging.getLogger(__name__)

NONCE_BYTES = 32
"""Bytes of each side's random challenge."""
_DOMAIN = b"pprun-peer-auth-1:"
"""Prefix of every signed challenge (a MAC made here cannot be replayed into another protocol)."""
HANDSHAKE_TIMEOUT_S = 10.0
"""How long a connecting peer has to complete its side of a handshake before it is dropped."""


class PeerAuthError(ConnectionError):
    """A peer did not prove that it holds the run's key (or did not answer in time)."""


def new_key() -> bytes:
    """A fresh per-run secret (given to the stages with their start-up, never logged)."""
    return secrets.token_bytes(32)


def _mac(key: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, _DOMAIN + role + nonce, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise PeerAuthError(f"the peer closed the connection during the handshake ({len(data)} of {n} bytes)")
        data += chunk
    return bytes(data)


def authenticate(sock: socket.socket, key: bytes, server: bool, timeout_s: float | None = None) -> None:
    """Mutual HMAC-SHA256 challenge-response on a fresh TCP connection; raises
    :class:`PeerAuthError` when the peer does not hold ``key``.

    The server sends a nonce; the client answers with its own nonce and the MAC of the server's;
    the server checks it (a fixed-size read: nothing from the peer is parsed before that) and
    answers with the MAC of the client's nonce, which the client checks.  The socket's timeout
    is ``timeout_s`` (default :data:`HANDSHAKE_TIMEOUT_S`) during the handshake, restored after.
    """
    if not key:
        raise ValueError("authenticate needs the run's key (got an empty one)")
    if timeout_s is None:
        timeout_s = HANDSHAKE_TIMEOUT_S
    previous = sock.gettimeout()
    sock.settimeout(timeout_s)
    try:
        if server:
            nonce = secrets.token_bytes(NONCE_BYTES)
            sock.sendall(nonce)
            answer = _recv_exact(sock, NONCE_BYTES + 32)
            peer_nonce, mac = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
            if not hmac.compare_digest(mac, _mac(key, b"client", nonce)):
                raise PeerAuthError("the connecting peer does not hold the run's key")
            sock.sendall(_mac(key, b"server", peer_nonce))
        else:
            server_nonce = _recv_exact(sock, NONCE_BYTES)
            nonce = secrets.token_bytes(NONCE_BYTES)
            sock.sendall(nonce + _mac(key, b"client", server_nonce))
            if not hmac.compare_digest(_recv_exact(sock, 32), _mac(key, b"server", nonce)):
                raise PeerAuthError("the listening peer does not hold the run's key")
    except TimeoutError:
        raise PeerAuthError(f"the peer did not complete the handshake within {timeout_s:.0f} s") from None
    except PeerAuthError:
        raise
    except OSError as e:
        raise PeerAuthError(f"the handshake failed: {e}") from e
    finally:
        try:
            sock.settimeout(previous)
        except OSError:
            pass


def _set_recv_timeout(conn: Connection, timeout_s: float) -> None:
    """Bound blocking reads on ``conn`` (0: unbounded) without making the socket non-blocking
    (``Connection`` reads with plain blocking ``read`` calls)."""
    sec = int(timeout_s)
    usec = int((timeout_s - sec) * 1e6)
    with socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM) as sock:  # a dup: same socket
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", sec, usec))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", sec, usec))


def accept_authenticated(listener: Listener, authkey: bytes, timeout_s: float | None = None) -> Connection | None:
    """Accept one connection on a ``multiprocessing.connection.Listener`` made without an
    ``authkey`` and run its HMAC challenge-response (both ways) within ``timeout_s`` (default
    :data:`HANDSHAKE_TIMEOUT_S`).

    Returns the connection, or None when the peer failed the handshake (wrong key, silence,
    garbage): it is closed and logged, and the caller keeps accepting.  Raises ``TimeoutError``
    when nobody connected within the listening socket's own timeout.
    """
    if timeout_s is None:
        timeout_s = HANDSHAKE_TIMEOUT_S
    conn = listener._listener.accept()  # the raw connection: nothing read from it yet
    try:
        _set_recv_timeout(conn, timeout_s)
        deliver_challenge(conn, authkey)
        answer_challenge(conn, authkey)
        _set_recv_timeout(conn, 0.0)
        return conn
    except Exception as e:  # noqa: BLE001 - AuthenticationError, a timeout, EOF, a bad length
        logger.warning("refused a control connection from %s: %s", listener.last_accepted, e)
    conn.close()
    return None


def loopback_interface() -> str | None:
    """Name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS), if found."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return None
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return None


def loopback_env() -> dict[str, str]:
    """Environment that makes gloo and NCCL open their sockets on the loopback interface (stages
    that all run on one host); a variable the user set already is left as it is."""
    iface = loopback_interface()
    if iface is None:
        return {}
    return {k: iface for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if k not in os.environ}
