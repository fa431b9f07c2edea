"""No unauthenticated door: strangers connecting to pprun's sockets are refused unread and the run
carries on; stages on one host listen on loopback only (docs/failures.md, "Sockets").  The
sampled-ids socket's own tests are in tests/test_feedback.py."""

from __future__ import annotations

import os
import pickle
import socket
import struct

import pytest
from leftovers import LOOPBACK, Snapshot, listening_addresses

from pprun import LLM, SamplingParams
from pprun.distributed import auth
from pprun.executor import remote

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5, 17, 42, 9]}, {"prompt_token_ids": [11, 3]}]


def _listening(pid: int) -> set[tuple[str, int]]:
    import psutil

    return {tuple(c.laddr) for c in psutil.Process(pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN}


class Bomb:
    """Unpickling this makes a directory: proof that nothing from a stranger was unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        import os

        return (os.mkdir, (self.path,))


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    with LLM(str(tiny_llama_dir), dtype="float32", executor="uni", runner="v1") as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("executor", ["mp", "ray"])
def test_control_listener_refuses_strangers_and_the_run_carries_on(
    tiny_llama_dir, reference, executor, request, tmp_path, monkeypatch
):
    """Three strangers reach the driver's control listener before any stage: one sends a framed
    pickle that would make a directory if loaded, one junk, one nothing.  Each is dropped after a
    failed (or timed-out) handshake, the stages connect, the tokens are right, nothing was
    unpickled, and the listener is closed once the stages are in."""
    if executor == "ray":
        request.getfixturevalue("ray_cluster")
    monkeypatch.setattr(auth, "HANDSHAKE_TIMEOUT_S", 1.0)
    bomb = tmp_path / "unpickled"
    payload = pickle.dumps(Bomb(str(bomb)))
    strangers: list[socket.socket] = []
    addresses = []
    real_listen = remote.RemoteStagesExecutor._listen

    def listen(self, host):
        listener = real_listen(self, host)
        addresses.append(listener.address)
        for data in (struct.pack("!i", len(payload)) + payload, b"junk" * 16, None):
            s = socket.create_connection(listener.address)
            if data is not None:
                s.sendall(data)
            strangers.append(s)
        return listener

    monkeypatch.setattr(remote.RemoteStagesExecutor, "_listen", listen)
    try:
        with LLM(str(tiny_llama_dir), dtype="float32", executor=executor, pipeline_parallel_size=2,
                 runner="v1") as llm:  # fmt: skip
            assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
            # Nobody listens on it once the stages are in.
            assert addresses[0][1] not in {port for _, port in _listening(os.getpid())}
    finally:
        for s in strangers:
            s.close()
    assert not bomb.exists()


def test_mp_stages_listen_on_loopback_only_and_leave_nothing(tiny_llama_dir, reference, monkeypatch):
    """mp with async pipeline steps (the sampled-ids socket open): every socket the driver and the
    stages listen on is a loopback one (the rendezvous is a file, not a TCP store), the
    rendezvous directory is private and gone once the stages are in, and after shutdown nothing
    is left."""
    modes = []
    real_rendezvous = remote.RemoteStagesExecutor._local_rendezvous

    def rendezvous(self):
        init_method = real_rendezvous(self)
        modes.append(os.stat(self.rendezvous_dir).st_mode)
        return init_method

    monkeypatch.setattr(remote.RemoteStagesExecutor, "_local_rendezvous", rendezvous)
    before = Snapshot()
    llm = LLM(str(tiny_llama_dir), dtype="float32", executor="mp", pipeline_parallel_size=2, runner="v2",
              async_pipeline=True)  # fmt: skip
    ex = llm.engine.executor
    pids, rendezvous = list(ex.stage_pids), ex.rendezvous_dir
    try:
        assert ex.async_steps
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
        assert len(modes) == 1 and modes[0] & 0o077 == 0
        assert not os.path.exists(rendezvous)  # every stage joined: the store is not read again
        # The driver's own new sockets are checked by the snapshot (its Ray client's are Ray's).
        assert not [c for c in before.new_sockets() if c[0] == "LISTEN"]
        for pid in pids:
            addrs = listening_addresses(pid)
            assert all(a in LOOPBACK for a in addrs), (pid, addrs)
    finally:
        llm.shutdown()
    assert before.left_behind(pids, [rendezvous]) == []


def test_authenticate_refuses_a_wrong_key_both_ways():
    """The sampled-ids handshake alone, on a socket pair: the right key passes, a wrong one is a
    PeerAuthError on the side that checks it."""
    import threading

    def pair(server_key: bytes, client_key: bytes) -> tuple[object, object]:
        a, b = socket.socketpair()
        result: dict[str, object] = {}

        def serve():
            try:
                auth.authenticate(a, server_key, server=True, timeout_s=5)
                result["server"] = "ok"
            except auth.PeerAuthError as e:
                result["server"] = e
            a.close()

        t = threading.Thread(target=serve)
        t.start()
        try:
            auth.authenticate(b, client_key, server=False, timeout_s=5)
            result["client"] = "ok"
        except auth.PeerAuthError as e:
            result["client"] = e
        t.join()
        b.close()
        return result["server"], result["client"]

    assert pair(b"k" * 32, b"k" * 32) == ("ok", "ok")
    server, client = pair(b"k" * 32, b"x" * 32)
    assert isinstance(server, auth.PeerAuthError) and "does not hold the run's key" in str(server)
    assert isinstance(client, auth.PeerAuthError)
