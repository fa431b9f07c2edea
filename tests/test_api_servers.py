"""``serve.api_servers=2``: two front-end processes over one engine process
(``pprun.serve.api_servers``).

One server for the module (the tiny Llama with the two-letter tokenizer, one stage): HTTP and gRPC
calls, each on a connection of its own, land on both front ends (the ``pprun-api-server`` header or
trailer names the one that served) and equal offline generation, streamed or not; request ids
stay unique across front ends, even a caller's own id sent to both; a client that leaves frees its
request; SIGTERM drains both front ends and the parent exits 0 (the module's last test).  A second
server shows a front end killed mid-stream: its request is aborted in the engine, the other front
end drains and the parent exits 1.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import grpc
import pytest
from serve_helpers import ServerProcess

from pprun import LLM
from pprun.sampling.params import SamplingParams
from pprun.serve._proto.pprun.v1 import pprun_pb2 as pb
from pprun.serve._proto.pprun.v1 import pprun_pb2_grpc as pb_grpc

try:  # the HTTP client the openai package is built on (httpx2 in its recent releases)
    import httpx2 as httpx
except ImportError:
    import httpx

PROMPT_IDS = [5, 9, 14, 3, 22, 7]
MAX_TOKENS = 6
MAX_CALLS = 40
"""Calls, each on a new connection, within which both front ends must have served one (the kernel
spreads connections over the two listeners by a hash of their addresses: 2**-39 to miss one)."""


@pytest.fixture(scope="module")
def chat_llama_dir(tmp_path_factory):
    """The tiny Llama with a tokenizer."""
    from tiny_models import make_tiny_llama
    from tiny_tokenizer import make_two_letter_tokenizer

    return make_two_letter_tokenizer(make_tiny_llama(tmp_path_factory.mktemp("api_llama"), num_layers=4))


def start_server(model_dir, tmp) -> ServerProcess:
    return ServerProcess(tmp, [
        f"model.model={model_dir}", "model.dtype=float32", "parallel=single", "scheduler.max_num_seqs=8",
        "serve.http_port=0", "serve.api_servers=2", "serve.model_name=tiny", "serve.drain_timeout_s=60",
    ])  # fmt: skip


@pytest.fixture(scope="module")
def server(chat_llama_dir, tmp_path_factory):
    proc = start_server(chat_llama_dir, tmp_path_factory.mktemp("api_servers"))
    yield proc
    proc.kill()


@pytest.fixture(scope="module")
def offline_ids(chat_llama_dir) -> list[int]:
    """The offline engine's greedy tokens for PROMPT_IDS (the reference)."""
    with LLM(str(chat_llama_dir), dtype="float32") as llm:
        out = llm.generate([{"prompt_token_ids": PROMPT_IDS}],
                           SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return list(out[0].outputs[0].token_ids)


def http_url(server: ServerProcess, path: str) -> str:
    return f"http://{server.info['http_address']}{path}"


def completion_body(stream: bool, max_tokens: int = MAX_TOKENS) -> dict:
    return {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "ignore_eos": True, "return_token_ids": True}


def metrics(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(http_url(server, "/metrics"), timeout=30).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(pprun\w*[:_]\w+) (\S+)$", text, re.M)}


def wait_idle(server: ServerProcess, free_at_start: float) -> dict[str, float]:
    """Poll /metrics until no request is unfinished and every KV block is back (30 s at most)."""
    deadline = time.monotonic() + 30
    while True:
        m = metrics(server)
        if (m["pprun_requests_unfinished"] == 0 and m["pprun_kv_blocks_free"] == free_at_start) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def http_completion(server: ServerProcess, stream: bool) -> tuple[str, str, list[int]]:
    """One completion on a new connection: (front end, response id, token ids)."""
    with httpx.Client(timeout=60) as client:
        if not stream:
            r = client.post(http_url(server, "/v1/completions"), json=completion_body(False))
            assert r.status_code == 200, r.text
            body = r.json()
            return r.headers["pprun-api-server"], body["id"], body["choices"][0]["token_ids"]
        ids, rid = [], None
        with client.stream("POST", http_url(server, "/v1/completions"), json=completion_body(True)) as r:
            assert r.status_code == 200
            front_end = r.headers["pprun-api-server"]
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    rid = chunk["id"]
                    for choice in chunk["choices"]:
                        ids += choice.get("token_ids") or []
        return front_end, rid, ids


def grpc_generate(server: ServerProcess, request_id: str = "") -> tuple[str, str, list[int]]:
    """One streaming Generate on a new channel: (front end, request id, token ids)."""
    with grpc.insecure_channel(server.address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        call = pb_grpc.PprunStub(channel).Generate(pb.GenerateRequest(
            request_id=request_id, token_ids=pb.TokenIds(ids=PROMPT_IDS),
            sampling=pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)), timeout=60)  # fmt: skip
        ids, rid = [], None
        for resp in call:
            ids += resp.token_ids
            rid = resp.request_id
        return dict(call.trailing_metadata())["pprun-api-server"], rid, ids


def until_both(call) -> list[tuple[str, str, list[int]]]:
    """``call()`` until both front ends have answered (MAX_CALLS at most)."""
    results = []
    while len(results) < MAX_CALLS and len({r[0] for r in results}) < 2:
        results.append(call())
    return results


def test_api_servers_validates():
    from pprun.config.config import ServeConfig

    for value in (0, -1, True, "2", 1.5):
        with pytest.raises(ValueError, match=r"serve\.api_servers=.* is invalid: must be an integer >= 1"):
            ServeConfig(api_servers=value).validate()
    with pytest.raises(ValueError, match=r"serve\.api_servers=2 needs serve\.engine_process=true"):
        ServeConfig(api_servers=2, engine_process=False).validate()
    ServeConfig(api_servers=3).validate()


def test_serving_line_names_both_front_ends(server):
    assert server.info["api_servers"] == 2
    pids = server.info["api_server_pids"]
    assert len(set(pids)) == 2 and server.proc.pid not in pids


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_http_lands_on_both_front_ends(server, offline_ids, stream):
    results = until_both(lambda: http_completion(server, stream))
    assert {r[0] for r in results} == {"0", "1"}
    assert all(r[2] == offline_ids for r in results)
    ids = [r[1] for r in results]
    assert len(set(ids)) == len(ids)  # unique across front ends


def test_grpc_lands_on_both_front_ends(server, offline_ids):
    results = until_both(lambda: grpc_generate(server))
    assert {r[0] for r in results} == {"0", "1"}
    assert all(r[2] == offline_ids for r in results)
    ids = [r[1] for r in results]
    assert len(set(ids)) == len(ids)


def test_a_callers_id_on_both_front_ends(server, offline_ids):
    """One caller-given request id used on both front ends: each runs its own request (the engine
    keys a request by its front end too) with the offline tokens; while one runs, the same id on
    the same front end is refused as on one server."""
    free_at_start = metrics(server)["pprun_kv_blocks_free"]
    results = until_both(lambda: grpc_generate(server, request_id="same-id"))
    assert {r[0] for r in results} == {"0", "1"}
    assert all(r[1] == "same-id" and r[2] == offline_ids for r in results)
    m = wait_idle(server, free_at_start)
    assert (m["pprun_requests_unfinished"], m["pprun_kv_blocks_free"]) == (0, free_at_start)


def test_metrics_sum_over_front_ends(server):
    """The latency histograms count every front end's requests: after one more request on each,
    the time-to-first-token count is up by at least two (a scrape reaches either front end)."""
    before = metrics(server)["pprun:time_to_first_token_seconds_count"]
    results = until_both(lambda: http_completion(server, False))
    after = metrics(server)["pprun:time_to_first_token_seconds_count"]
    assert after - before == len(results)


def test_disconnect_frees_the_request(server):
    """A streamed request whose client leaves is aborted in the engine, on either front end:
    nothing stays unfinished and every KV block is back (the abort is logged: it did not run to
    its end)."""
    free_at_start = metrics(server)["pprun_kv_blocks_free"]
    aborted = "aborted: its HTTP client went away"
    front_ends = set()
    for _ in range(MAX_CALLS):
        num_aborted = server.log().count(aborted)
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", http_url(server, "/v1/completions"), json=completion_body(True, 1500)) as r:
                front_ends.add(r.headers["pprun-api-server"])
                next(r.iter_lines())
        m = wait_idle(server, free_at_start)
        assert (m["pprun_requests_unfinished"], m["pprun_kv_blocks_free"]) == (0, free_at_start)
        assert server.log().count(aborted) == num_aborted + 1  # aborted, not run to its end
        if len(front_ends) == 2:
            break
    assert front_ends == {"0", "1"}


class LongStream(threading.Thread):
    """A streamed completion of ``max_tokens`` on a connection of its own; :attr:`front_end` is set
    (and :attr:`started` set) once its first event came."""

    def __init__(self, server: ServerProcess, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.server, self.max_tokens = server, max_tokens
        self.started = threading.Event()
        self.front_end: str | None = None
        self.events: list[str] = []
        self.error: Exception | None = None
        self.start()

    def run(self) -> None:
        try:
            with httpx.Client(timeout=120) as client:
                with client.stream("POST", http_url(self.server, "/v1/completions"),
                                   json=completion_body(True, self.max_tokens)) as r:
                    self.front_end = r.headers["pprun-api-server"]
                    for line in r.iter_lines():
                        if line:
                            self.events.append(line)
                            self.started.set()
        except Exception as e:  # noqa: BLE001 (the test reads it)
            self.error = e
        finally:
            self.started.set()


def streams_on_both(server: ServerProcess, max_tokens: int) -> list[LongStream]:
    """Long streams, one after another, until both front ends run one (MAX_CALLS at most)."""
    streams: list[LongStream] = []
    while len(streams) < MAX_CALLS and len({s.front_end for s in streams}) < 2:
        stream = LongStream(server, max_tokens)
        assert stream.started.wait(60) and stream.error is None, stream.error
        streams.append(stream)
    assert {s.front_end for s in streams} == {"0", "1"}
    return streams


def test_sigterm_drains_every_front_end(server):
    """SIGTERM to the parent while streams run on both front ends: each stream ends whole (its
    last event ``[DONE]``), then the parent exits 0 (the module's server ends here)."""
    streams = streams_on_both(server, 300)
    server.proc.send_signal(signal.SIGTERM)
    for stream in streams:
        stream.join(timeout=120)
        assert stream.error is None and stream.events[-1] == "data: [DONE]"
        assert json.loads(stream.events[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(timeout=120) == 0
    assert server.log().count("draining") == 2  # each front end drained


def test_killed_front_end_ends_the_server(chat_llama_dir, tmp_path):
    """A front end SIGKILLed while it streams: the engine aborts its request, the other front end
    drains (its stream ends whole) and the parent exits 1, naming the dead one."""
    server = start_server(chat_llama_dir, tmp_path)
    try:
        streams = streams_on_both(server, 300)
        victim = next(s for s in streams if s.front_end == "1")
        pid = server.info["api_server_pids"][1]
        os.kill(pid, signal.SIGKILL)
        assert server.proc.wait(timeout=120) == 1
        for stream in streams:
            stream.join(timeout=60)
        survivors = [s for s in streams if s.front_end == "0"]
        assert all(s.error is None and s.events[-1] == "data: [DONE]" for s in survivors)
        assert victim.error is not None or victim.events[-1] != "data: [DONE]"
        log = server.log()
        assert f"front end 1 (pid {pid}) exited with code -9" in log
        assert "front end 1 is gone: its" in log and "request(s) aborted" in log
    finally:
        server.kill()
