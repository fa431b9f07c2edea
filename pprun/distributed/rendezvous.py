"""An authenticated ``torch.distributed`` rendezvous store for stages on several hosts.

torch's ``TCPStore`` answers anyone who connects (it even lists its keys): a stranger who reaches
its port can read the group's addresses or write its own into them.  pprun's executors therefore
never start one.  Stages that all run on one host meet in a file store in a private directory
(``RemoteStagesExecutor._local_rendezvous``); stages on several hosts (Ray) meet here:

* :class:`RendezvousServer` runs in stage 0's process.  It binds port 0 on the address the stages
  use and keeps that socket (no probe-then-bind race), and each connection must pass the run's
  HMAC challenge-response (:func:`pprun.distributed.auth.authenticate`) before a byte of a
  request is read.  A peer that fails it (wrong key, garbage, silence for the handshake timeout)
  is dropped and logged; the stages' own connections are served meanwhile.
* :class:`RendezvousStore` is the client: a ``torch.distributed.Store`` (the Python trampoline
  torch offers) that every stage, stage 0 included, hands to ``init_process_group``.

Requests and replies are length-prefixed byte fields (no pickle, no JSON needed): an operation
code, then its fields.  The ``init_method`` that names such a store is
``pprun://HOST:PORT`` (:func:`store_from_init_method`).
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from datetime import timedelta
from urllib.parse import urlsplit

import torch.distributed as dist

from pprun.distributed.auth import PeerAuthError, authenticate

logger = logging.getLogger(__name__)

SCHEME = "pprun://"
"""``init_method`` prefix of a rendezvous served by :class:`RendezvousServer`."""
MAX_FIELD_BYTES = 16 * 2**20
"""Largest field a request or reply may carry (gloo's and NCCL's addresses are a few hundred
bytes); a longer length prefix is a protocol error that ends the connection."""
MAX_FIELDS = 1024
"""Most fields in one message (keys of one ``wait`` or ``check``)."""

_SET, _GET, _ADD, _CHECK, _WAIT, _COMPARE_SET, _DELETE, _NUM_KEYS = range(1, 9)
_OK, _TIMEOUT, _ERROR = range(3)


def _send_message(sock: socket.socket, code: int, fields: list[bytes]) -> None:
    parts = [struct.pack("!BI", code, len(fields))]
    for f in fields:
        parts.append(struct.pack("!I", len(f)))
        parts.append(f)
    sock.sendall(b"".join(parts))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(min(n - len(data), 1 << 20))
        if not chunk:
            raise ConnectionError(f"the rendezvous peer closed the connection ({len(data)} of {n} bytes read)")
        data += chunk
    return bytes(data)


def _recv_message(sock: socket.socket) -> tuple[int, list[bytes]]:
    code, count = struct.unpack("!BI", _recv_exact(sock, 5))
    if count > MAX_FIELDS:
        raise ConnectionError(f"rendezvous message with {count} fields (at most {MAX_FIELDS})")
    fields = []
    for _ in range(count):
        (size,) = struct.unpack("!I", _recv_exact(sock, 4))
        if size > MAX_FIELD_BYTES:
            raise ConnectionError(f"rendezvous field of {size} bytes (at most {MAX_FIELD_BYTES})")
        fields.append(_recv_exact(sock, size))
    return code, fields


class RendezvousServer:
    """The key-value store stage 0 serves to the run's stages; see the module docstring.

    ``host`` is the address the stages reach stage 0 at (never a wildcard: the store is for the
    stages, not for every interface).  The listening socket is bound at once, on port 0 (the
    kernel's choice, kept: nothing can take it in between), and served by a daemon thread until
    :meth:`close`."""

    def __init__(self, host: str, key: bytes, handshake_timeout_s: float | None = None) -> None:
        if not key:
            raise ValueError("RendezvousServer needs the run's key (got an empty one)")
        self.key = key
        self.handshake_timeout_s = handshake_timeout_s
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, 0), family=family, backlog=64)
        self.host = host
        self.port: int = self._listener.getsockname()[1]
        """The port the kernel chose (published to the other stages with the ``init_method``)."""
        self.refused = 0
        """Connections dropped because they failed the handshake (strangers)."""
        self._data: dict[str, bytes] = {}
        self._changed = threading.Condition()
        self._closed = False
        self._conns: set[socket.socket] = set()
        threading.Thread(target=self._accept_loop, name="pprun-rendezvous", daemon=True).start()

    @property
    def init_method(self) -> str:
        """What the stages pass to :func:`store_from_init_method` to reach this store."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{SCHEME}{host}:{self.port}"

    def close(self) -> None:
        """Stop listening and drop every connection (the stages hold their process groups by
        then; the store is read only while they form)."""
        self._closed = True
        try:
            self._listener.close()
        except OSError:
            pass
        with self._changed:
            conns = list(self._conns)
            self._changed.notify_all()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn, peer), name="pprun-rendezvous-conn", daemon=True).start()

    def _serve(self, conn: socket.socket, peer) -> None:
        with conn:
            try:
                authenticate(conn, self.key, server=True, timeout_s=self.handshake_timeout_s)
            except PeerAuthError as e:
                with self._changed:
                    self.refused += 1
                logger.warning("refused a rendezvous connection from %s: %s", peer, e)
                return
            with self._changed:
                if self._closed:
                    return
                self._conns.add(conn)
            try:
                while not self._closed:
                    code, fields = _recv_message(conn)
                    status, reply = self._handle(code, fields)
                    _send_message(conn, status, reply)
            except (ConnectionError, OSError, struct.error):
                pass  # the stage went away (or the store closed)
            finally:
                with self._changed:
                    self._conns.discard(conn)

    def _wait_for(self, keys: list[str], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not all(k in self._data for k in keys):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    return False
                self._changed.wait(remaining)
            return True

    def _handle(self, code: int, fields: list[bytes]) -> tuple[int, list[bytes]]:
        try:
            if code == _SET:
                key, value = fields[0].decode(), fields[1]
                with self._changed:
                    self._data[key] = value
                    self._changed.notify_all()
                return _OK, []
            if code == _GET:
                key, timeout_s = fields[0].decode(), float(fields[1])
                if not self._wait_for([key], timeout_s):
                    return _TIMEOUT, [f"key {key!r} not set within {timeout_s:.0f} s".encode()]
                with self._changed:
                    return _OK, [self._data[key]]
            if code == _ADD:
                key, amount = fields[0].decode(), int(fields[1])
                with self._changed:
                    value = int(self._data.get(key, b"0")) + amount
                    self._data[key] = str(value).encode()
                    self._changed.notify_all()
                return _OK, [str(value).encode()]
            if code == _CHECK:
                with self._changed:
                    return _OK, [b"1" if all(k.decode() in self._data for k in fields) else b"0"]
            if code == _WAIT:
                timeout_s, keys = float(fields[0]), [k.decode() for k in fields[1:]]
                if not self._wait_for(keys, timeout_s):
                    return _TIMEOUT, [f"keys {keys} not all set within {timeout_s:.0f} s".encode()]
                return _OK, []
            if code == _COMPARE_SET:
                key, expected, desired = fields[0].decode(), fields[1], fields[2]
                with self._changed:
                    current = self._data.get(key)
                    if current is None and expected == b"" or current == expected:
                        self._data[key] = desired
                        self._changed.notify_all()
                        return _OK, [desired]
                    return _OK, [current if current is not None else expected]
            if code == _DELETE:
                with self._changed:
                    return _OK, [b"1" if self._data.pop(fields[0].decode(), None) is not None else b"0"]
            if code == _NUM_KEYS:
                with self._changed:
                    return _OK, [str(len(self._data)).encode()]
            return _ERROR, [f"unknown rendezvous operation {code}".encode()]
        except (IndexError, ValueError, UnicodeDecodeError) as e:
            return _ERROR, [f"malformed rendezvous request (operation {code}): {e}".encode()]


class RendezvousStore(dist.Store):
    """Client of a :class:`RendezvousServer`, usable wherever torch takes a ``Store``.

    Connects (retrying until ``timeout_s``: stage 0 may still be starting its server) and proves
    that it holds the run's key, checking that the server holds it too.  One connection, used
    under a lock (torch may call a store from its own threads).  Keep a reference to this
    object for as long as torch may use it: torch holds only its C++ half."""

    def __init__(self, host: str, port: int, key: bytes, timeout_s: float) -> None:
        super().__init__()
        self.host = host
        self.port = port
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=max(1.0, min(10.0, timeout_s)))
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise ConnectionError(f"cannot reach the stages' rendezvous at {host}:{port}: {e}") from e
                time.sleep(0.2)
        try:
            authenticate(sock, key, server=False)
        except BaseException:
            sock.close()
            raise
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock

    def _timeout(self, timeout: timedelta | None = None) -> float:
        if timeout is not None:
            return timeout.total_seconds()
        try:
            return self.timeout.total_seconds()  # set by init_process_group
        except Exception:  # noqa: BLE001 - an older torch without the property
            return self._timeout_s

    def _call(self, code: int, fields: list[bytes], wait_s: float = 0.0) -> list[bytes]:
        with self._lock:
            self._sock.settimeout(wait_s + 30.0)
            _send_message(self._sock, code, fields)
            status, reply = _recv_message(self._sock)
        if status == _TIMEOUT:
            raise dist.DistStoreError(f"rendezvous at {self.host}:{self.port}: {reply[0].decode()}")
        if status != _OK:
            raise RuntimeError(f"rendezvous at {self.host}:{self.port}: {reply[0].decode() if reply else status}")
        return reply

    def set(self, key: str, value) -> None:  # noqa: D102 - torch.distributed.Store's interface
        self._call(_SET, [key.encode(), value.encode() if isinstance(value, str) else bytes(value)])

    def get(self, key: str) -> bytes:  # noqa: D102
        wait_s = self._timeout()
        return self._call(_GET, [key.encode(), str(wait_s).encode()], wait_s)[0]

    def add(self, key: str, value: int) -> int:  # noqa: D102
        return int(self._call(_ADD, [key.encode(), str(int(value)).encode()])[0])

    def check(self, keys: list[str]) -> bool:  # noqa: D102
        return self._call(_CHECK, [k.encode() for k in keys])[0] == b"1"

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:  # noqa: D102
        wait_s = self._timeout(timeout)
        self._call(_WAIT, [str(wait_s).encode()] + [k.encode() for k in keys], wait_s)

    def compare_set(self, key: str, expected_value, desired_value) -> bytes:  # noqa: D102
        def as_bytes(v) -> bytes:
            return v.encode() if isinstance(v, str) else bytes(v)

        return self._call(_COMPARE_SET, [key.encode(), as_bytes(expected_value), as_bytes(desired_value)])[0]

    def delete_key(self, key: str) -> bool:  # noqa: D102
        return self._call(_DELETE, [key.encode()])[0] == b"1"

    def num_keys(self) -> int:  # noqa: D102
        return int(self._call(_NUM_KEYS, [])[0])

    def close(self) -> None:
        """Drop the connection (after the process groups are made)."""
        try:
            self._sock.close()
        except OSError:
            pass


def store_from_init_method(init_method: str, key: bytes | None, timeout_s: float) -> RendezvousStore:
    """The :class:`RendezvousStore` a ``pprun://HOST:PORT`` ``init_method`` names."""
    if not key:
        raise ValueError(f"the rendezvous {init_method} needs the run's key; none was given to this stage")
    parts = urlsplit(init_method)
    if parts.hostname is None or parts.port is None:
        raise ValueError(f"malformed rendezvous address {init_method!r}: expected {SCHEME}HOST:PORT")
    return RendezvousStore(parts.hostname, parts.port, key, timeout_s)
