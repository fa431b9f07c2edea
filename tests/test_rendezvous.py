"""Closed by default, Ray side (docs/security.md): the stages' rendezvous across hosts is a store
that authenticates every connection (``pprun.distributed.rendezvous``), and the local Ray cluster
pprun starts listens on loopback and asks for its own token."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import threading
import traceback
from datetime import timedelta

import pytest
from leftovers import LOOPBACK, listening_addresses

from pprun import LLM, SamplingParams
from pprun.distributed import auth
from pprun.distributed.rendezvous import RendezvousServer, RendezvousStore

KEY = b"k" * 32
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5, 17, 42, 9]}, {"prompt_token_ids": [11, 3]}]


def _stage(rank: int, init_method: str, out) -> None:
    """One of two stages: joins the process groups through ``init_method`` as the executors'
    stages do (PipelineTransport.init, with the first and last stage's extra group), then sends
    rank 0's tensor to rank 1."""
    try:
        import torch
        import torch.distributed as dist

        from pprun.distributed.layout import StageLayout
        from pprun.distributed.transport import PipelineTransport

        transport = PipelineTransport.init(StageLayout.from_partition([1, 1], rank), torch.device("cpu"),
                                           init_method, 60.0, feedback=True, authkey=KEY)  # fmt: skip
        t = torch.tensor([7.0, 8.0]) if rank == 0 else torch.zeros(2)
        if rank == 0:
            dist.send(t, 1)
        else:
            dist.recv(t, 0)
        host = transport.feedback_host
        transport.close()
        out.put((rank, {"tensor": t.tolist(), "feedback_host": host}))
    except BaseException:
        out.put((rank, {"error": traceback.format_exc()}))


def _run_stages(init_method: str, timeout_s: float = 120.0) -> dict[int, dict]:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_stage, args=(rank, init_method, out)) for rank in (0, 1)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=timeout_s) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return results


def test_strangers_at_the_rendezvous_are_refused_and_the_stages_form_their_group(monkeypatch):
    """Before the stages come, four strangers reach the rendezvous port: one sends junk, one says
    nothing, one is torch's own TCPStore client (what would join an unauthenticated
    ``tcp://`` rendezvous), one a pprun client with the wrong key.  Each is refused (the silent
    one after the handshake timeout), no stranger gets a reply to a request, and the two stages,
    connecting meanwhile, form their groups and exchange a tensor."""
    import torch.distributed as dist

    monkeypatch.setattr(auth, "HANDSHAKE_TIMEOUT_S", 1.0)
    server = RendezvousServer("127.0.0.1", KEY)
    assert server.init_method == f"pprun://127.0.0.1:{server.port}"
    strangers: list[socket.socket] = []
    outcomes: dict[str, object] = {}
    try:
        junk = socket.create_connection(("127.0.0.1", server.port))
        junk.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 4)
        silent = socket.create_connection(("127.0.0.1", server.port))
        strangers += [junk, silent]

        def tcpstore_client():
            try:
                store = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=3))
                store.set("0//cpu//0/0", b"stranger")
                outcomes["tcpstore"] = "accepted"
            except Exception as e:  # noqa: BLE001 - whatever torch raises when the server never answers
                outcomes["tcpstore"] = e

        thread = threading.Thread(target=tcpstore_client)
        thread.start()
        with pytest.raises(auth.PeerAuthError):
            RendezvousStore("127.0.0.1", server.port, b"x" * 32, timeout_s=5)

        results = _run_stages(server.init_method)
        thread.join(timeout=30)
        for rank in (0, 1):
            assert "error" not in results[rank], results[rank]["error"]
        assert results[1]["tensor"] == [7.0, 8.0]
        assert results[0]["feedback_host"] == "127.0.0.1"  # the sampled-ids socket meets at the store's host
        assert outcomes["tcpstore"] != "accepted" and isinstance(outcomes["tcpstore"], Exception)
        junk.settimeout(5)
        # The junk sender got at most the server's challenge, then the connection closed: no reply.
        data = b""
        try:
            while chunk := junk.recv(1024):
                data += chunk
        except ConnectionResetError:
            pass  # closed with the junk unread
        assert len(data) <= auth.NONCE_BYTES
        # Junk, silence, the wrong key, and torch's client once per attempt (it retries).
        assert server.refused >= 4
        assert "stranger" not in {v.decode(errors="replace") for v in server._data.values()}
    finally:
        for s in strangers:
            s.close()
        server.close()


def test_store_operations_round_trip():
    """The store's operations as torch calls them, against the server: set/get, add, check,
    wait with a timeout, compare_set, delete, num_keys."""
    import torch.distributed as dist

    server = RendezvousServer("127.0.0.1", KEY)
    try:
        a = RendezvousStore("127.0.0.1", server.port, KEY, timeout_s=5)
        b = RendezvousStore("127.0.0.1", server.port, KEY, timeout_s=5)
        a.set("x", b"1")
        assert b.get("x") == b"1"
        assert a.add("n", 2) == 2 and b.add("n", 3) == 5
        assert b.check(["x", "n"]) and not b.check(["x", "missing"])
        with pytest.raises(dist.DistStoreError, match="not all set"):
            b.wait(["missing"], timedelta(seconds=0.3))
        threading.Timer(0.2, lambda: a.set("late", b"v")).start()
        b.wait(["late"], timedelta(seconds=10))
        assert b.compare_set("x", b"1", b"2") == b"2" and a.get("x") == b"2"
        assert b.compare_set("x", b"1", b"3") == b"2"
        assert b.delete_key("x") and not b.delete_key("x")
        assert a.num_keys() == 2  # n, late
        a.close()
        b.close()
    finally:
        server.close()


def test_ray_stages_across_nodes_meet_at_the_authenticated_rendezvous(tiny_llama_dir, ray_cluster, monkeypatch):
    """The Ray executor's multi-node path on one host (its nodes' addresses taken as different):
    the stages meet at stage 0's ``pprun://`` store, not a TCP store, and the tokens are uni's."""
    from pprun.executor import ray_executor

    with LLM(str(tiny_llama_dir), dtype="float32", executor="uni", runner="v1") as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    init_methods = []
    real_spec = ray_executor.WorkerSpec

    def spec(*args, **kwargs):
        init_methods.append(kwargs["init_method"])
        return real_spec(*args, **kwargs)

    monkeypatch.setattr(ray_executor, "WorkerSpec", spec)
    monkeypatch.setattr(ray_executor.RayExecutor, "stages_on_driver_node", lambda self, driver_ip: False)
    with LLM(str(tiny_llama_dir), dtype="float32", executor="ray", pipeline_parallel_size=2, runner="v1") as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    assert len(init_methods) == 2 and init_methods[0] == init_methods[1]
    assert init_methods[0].startswith("pprun://127.0.0.1:")


def test_local_ray_cluster_is_on_loopback_and_asks_for_its_token(ray_cluster):
    """The local cluster pprun starts (the session's, started the same way): node address
    127.0.0.1, every process of it listens on loopback only, its token is a 0600 file in its
    private 0700 directory, and a client with another token is refused where one with the file
    gets in."""
    import psutil

    ray = ray_cluster
    from pprun.executor.ray_executor import LOCAL_NODE_ADDRESS, ray_supports_token_auth

    assert ray.util.get_node_ip_address() == LOCAL_NODE_ADDRESS
    node = ray._private.worker._global_node
    pids = {info.process.pid for infos in node.all_processes.values() for info in infos}
    assert pids
    for pid in pids:
        for child in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
            try:
                addrs = listening_addresses(child.pid)
            except psutil.NoSuchProcess:
                continue
            assert all(a in LOOPBACK for a in addrs), (child.pid, child.name(), addrs)
    if not ray_supports_token_auth():
        pytest.skip("the installed Ray has no token authentication")
    assert os.environ["RAY_AUTH_MODE"] == "token"
    token_path = os.environ["RAY_AUTH_TOKEN_PATH"]
    assert stat.S_IMODE(os.stat(token_path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(token_path)).st_mode) == 0o700
    gcs = ray.get_runtime_context().gcs_address
    probe = f"import ray; ray.init(address={gcs!r}, log_to_driver=False); print(len(ray.nodes()))"
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    # The probe keeps the loopback address as given (Ray would otherwise replace it by the host's
    # network address, where nothing of this cluster listens).
    base.update(RAY_AUTH_MODE="token", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    # RAY_gcs_server_port_wait_time_s: Ray's client tries the GCS once a second, 20 times by
    # default, and a refused token is refused every time; three tries, not 20 seconds of them.
    wrong = subprocess.run([sys.executable, "-c", probe],
                           env=dict(base, RAY_AUTH_TOKEN="0" * 64, RAY_gcs_server_port_wait_time_s="3"),
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert wrong.returncode != 0 and "InvalidAuthToken" in wrong.stderr, wrong.stderr[-2000:]
    right = subprocess.run([sys.executable, "-c", probe], env=dict(base, RAY_AUTH_TOKEN_PATH=token_path),
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert right.returncode == 0, right.stderr[-2000:]
    assert right.stdout.strip().endswith("1")
    # A process this one starts, given the cluster's address, attaches as pprun does (over
    # loopback, with the inherited token) without any Ray variable of its own.
    from pprun.executor.ray_executor import LOCAL_ADDRESS_VAR

    assert os.environ[LOCAL_ADDRESS_VAR] == gcs
    attach = "from pprun.executor.ray_executor import ensure_ray; import ray; ensure_ray(None, 0); print(len(ray.nodes()))"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    child = subprocess.run([sys.executable, "-c", attach], env=dict(env, RAY_ADDRESS=gcs),
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.strip().endswith("1")
