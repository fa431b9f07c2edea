"""``pprun serve`` end to end: real servers on loopback in their own processes, real clients.

Servers (each stepping its engine in an engine process unless said otherwise): the tiny random
Llama in one stage (bearer token, small message limit: load, bad input, disconnects, token, bind
address, SIGTERM), the same with its engine on a thread of the server's process (TLS), one whose
engine process is killed, the tiny Llama at pp=2 on local processes (queue bound, a stage
killed), and the demo model at pp=2 on Ray actors (pprun.v1 and tritonclient texts against
offline ``LLM.generate``, abort, health, reflection).
"""

from __future__ import annotations

import asyncio
import json
import queue
import socket
import threading
import time

import grpc
import numpy as np
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serve_helpers import (
    ClientProcess,
    ServerProcess,
    kserve_request,
    make_self_signed_cert,
    requests_then_hold,
)

from pprun import LLM
from pprun.sampling.params import SamplingParams
from pprun.serve._proto.pprun.v1 import pprun_pb2 as pb
from pprun.serve._proto.pprun.v1 import pprun_pb2_grpc as pb_grpc

TOKEN = "s3cret-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
LOAD_PROMPTS = [[(11 * i + j) % 250 + 1 for j in range(2 + i % 5)] for i in range(20)]
LOAD_MAX_TOKENS = 6
MESSAGE_LIMIT = 64 * 1024
TINY_KV_BLOCKS = 160
"""The tiny server's KV pool: room for one max_model_len request (128 blocks) or 64 short ones."""
TINY_KV_BLOCK_BYTES = 2 * 4 * 16 * 2 * 16 * 4
"""Keys and values, 4 layers, 16 tokens, 2 KV heads of 16 dims, float32."""
Code = grpc.StatusCode


def greedy_proto(max_tokens: int, **kw) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def model_info(stub: pb_grpc.PprunStub, metadata=()) -> pb.ModelInfo:
    return stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=30)


def wait_idle(stub: pb_grpc.PprunStub, free_at_start: int, metadata=()) -> pb.ModelInfo:
    """Poll until no request is unfinished and every KV block is back (bounded: 30 s)."""
    deadline = time.monotonic() + 30
    while True:
        info = model_info(stub, metadata)
        if (info.num_unfinished_requests == 0 and info.kv_blocks_free == free_at_start) or time.monotonic() > deadline:
            return info
        time.sleep(0.05)


def test_serve_config_composes_and_validates(tmp_path) -> None:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from pprun.config.config import ServeConfig, default_conf_dir, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(default_conf_dir()), version_base="1.3"):
        cfg = OmegaConf.to_object(compose("serve", ["parallel=single", "serve.port=0", "scheduler.max_num_seqs=8"]))
    assert (cfg.serve.host, cfg.serve.port, cfg.serve.auth_token, cfg.serve.engine_process) == ("127.0.0.1", 0, None, True)
    assert cfg.pprun_config().scheduler.max_num_seqs == 8
    cfg.serve.validate()
    for kwargs, message in [
        ({"port": 70000}, r"serve.port=70000 is invalid"),
        ({"tls_cert_file": str(tmp_path)}, r"TLS needs both"),
        ({"auth_token": "a", "auth_token_file": "b"}, r"both set"),
        ({"auth_token_file": str(tmp_path / "missing")}, r"serve.auth_token_file=.* is not a file"),
        ({"max_queued_requests": -1}, r"serve.max_queued_requests=-1 is invalid"),
        ({"engine_process": "yes"}, r"serve.engine_process='yes' is invalid"),
    ]:
        with pytest.raises(ValueError, match=message):
            ServeConfig(**kwargs).validate()


# --- the tiny model in process ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_server(tiny_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tiny_server")
    (tmp / "token").write_text(TOKEN + "\n")
    server = ServerProcess(tmp, [
        f"model.model={tiny_llama_dir}", "model.dtype=float32", "parallel=single", "scheduler.max_num_seqs=64",
        f"serve.auth_token_file={tmp / 'token'}", f"serve.max_message_bytes={MESSAGE_LIMIT}",
        f"cache.kv_cache_memory_bytes={TINY_KV_BLOCKS * TINY_KV_BLOCK_BYTES}",
    ])  # fmt: skip
    yield server
    server.kill()


@pytest.fixture(scope="module")
def tiny_reference(tiny_llama_dir):
    """Offline greedy outputs of LOAD_PROMPTS."""
    with LLM(str(tiny_llama_dir), dtype="float32") as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in LOAD_PROMPTS],
                            SamplingParams(temperature=0.0, max_tokens=LOAD_MAX_TOKENS, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def test_default_bind_is_loopback(tiny_server):
    host, port = tiny_server.address.rsplit(":", 1)
    assert host == "127.0.0.1"
    others = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
              if a.family == socket.AF_INET and not a.address.startswith("127.")]
    if not others:
        pytest.skip("this machine has no non-loopback address to try")
    for other in others:
        with pytest.raises(OSError), socket.create_connection((other, int(port)), timeout=2):
            pass


def test_missing_or_wrong_token_is_refused(tiny_server):
    import tritonclient.grpc as tc
    from tritonclient.utils import InferenceServerException

    with tiny_server.channel() as ch:
        stub = pb_grpc.PprunStub(ch)
        health = health_pb2_grpc.HealthStub(ch)
        for metadata, why in [((), "needs 'authorization: Bearer <token>'"),
                              ((("authorization", "Bearer wrong"),), "is wrong")]:
            for call in (lambda md: model_info(stub, md),
                         lambda md: list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1])), metadata=md)),
                         lambda md: health.Check(health_pb2.HealthCheckRequest(), metadata=md)):
                with pytest.raises(grpc.RpcError) as info:
                    call(metadata)
                assert info.value.code() == Code.UNAUTHENTICATED and why in info.value.details()
        assert model_info(stub, AUTH).model == tiny_server.info["model"]
    client = tc.InferenceServerClient(url=tiny_server.address)
    with pytest.raises(InferenceServerException, match="UNAUTHENTICATED"):
        client.is_server_live()
    assert client.is_server_live(headers={"authorization": f"Bearer {TOKEN}"})
    client.close()


RSS_TOLERANCE_BYTES = 32 * 2**20
"""How far the server's RSS may rise over two 200-client rounds above its baseline after a warm-up.

Memory a server's first requests take stays taken (allocator arenas of each thread that touches a
tensor or a message, gRPC's connection buffers, the batch shapes the runner meets), so the
baseline is read after a warm-up through those paths (twenty streams on ten channels) and the
rounds are compared with it, not with each other.  Above it, measured over ten rounds of 200:
8 MiB after the first (200 calls at once and full 64-request batches need more buffers than the
warm-up did), then flat at 9-13 MiB, the allocator taking and returning pages.  KV-cache pages
count too: the CPU cache is mapped lazily and its blocks are handed out in turn, so a large pool
grows RSS until every block has been used once, which would look like a leak; the tiny server's
pool is TINY_KV_BLOCKS blocks (2.5 MiB).  32 MiB over 400 requests is 80 KiB each: requests that
each left a tensor or their stream's buffers of that size behind fail it (leaked KV blocks fail
the free-block check); leaks of a few hundred bytes a request would need far more rounds than a
test should take."""


async def stream_round(address: str, n: int, num_channels: int = 10) -> list[list[int]]:
    """``n`` concurrent streaming Generate calls of LOAD_PROMPTS over ``num_channels`` channels;
    each one's token ids (its final response checked)."""
    channels = [grpc.aio.insecure_channel(address) for _ in range(num_channels)]
    stubs = [pb_grpc.PprunStub(c) for c in channels]

    async def client(i: int) -> list[int]:
        call = stubs[i % num_channels].Generate(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=LOAD_PROMPTS[i % 20]), sampling=greedy_proto(LOAD_MAX_TOKENS)),
            metadata=AUTH, timeout=120)  # fmt: skip
        ids, final = [], None
        async for resp in call:
            ids += resp.token_ids
            final = resp.final if resp.HasField("final") else final
        assert final is not None and final.finish_reason == "length"
        return ids

    try:
        return await asyncio.gather(*(client(i) for i in range(n)))
    finally:
        for c in channels:
            await c.close()


def test_load_200_concurrent_streams(tiny_server, tiny_reference):
    """200 streaming clients at once (ten channels, twenty calls each), twice: none lost, each
    equal to the offline output; KV blocks back to the start and the server's RSS within
    RSS_TOLERANCE_BYTES of its baseline after a warm-up."""
    n = 200
    with tiny_server.channel() as ch:
        stub = pb_grpc.PprunStub(ch)
        free_at_start = model_info(stub, AUTH).kv_blocks_free
        warm = asyncio.run(stream_round(tiny_server.address, 20))
        assert all(out == tiny_reference[i] for i, out in enumerate(warm))
        wait_idle(stub, free_at_start, AUTH)
        rss_baseline = tiny_server.rss_bytes()
        rounds = [asyncio.run(stream_round(tiny_server.address, n)) for _ in range(2)]
        for outs in rounds:
            assert len(outs) == n
            assert all(out == tiny_reference[i % 20] for i, out in enumerate(outs))
        info = wait_idle(stub, free_at_start, AUTH)
        assert info.num_unfinished_requests == 0 and info.kv_blocks_free == free_at_start
        growth = tiny_server.rss_bytes() - rss_baseline
        assert growth < RSS_TOLERANCE_BYTES, (
            f"server RSS grew by {growth / 2**20:.1f} MiB over two rounds of {n} from its warmed-up baseline")


def _expect(code: grpc.StatusCode, fragment: str, call) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, (info.value.code(), info.value.details())
    assert fragment in info.value.details(), info.value.details()


def test_bad_input_battery_pprun_api(tiny_server):
    """Every bad request gets its status code and the Python API's message; the server keeps
    serving after each."""
    with tiny_server.channel() as ch:
        stub = pb_grpc.PprunStub(ch)
        free_at_start = model_info(stub, AUTH).kv_blocks_free

        def gen(**kw):
            return lambda: list(stub.Generate(pb.GenerateRequest(**kw), metadata=AUTH, timeout=30))

        ids = pb.TokenIds(ids=[1, 2])
        cases = [
            (Code.INVALID_ARGUMENT, "GenerateRequest.input is unset", gen()),
            (Code.INVALID_ARGUMENT, "a text prompt needs a tokenizer", gen(text="hello")),
            (Code.INVALID_ARGUMENT, "prompt has 0 tokens", gen(token_ids=pb.TokenIds(ids=[]))),
            (Code.INVALID_ARGUMENT, "prompt_token_ids[1]=256 is outside the vocabulary",
             gen(token_ids=pb.TokenIds(ids=[1, 256]))),
            (Code.INVALID_ARGUMENT, "prompt_token_ids[0]=-3 is outside", gen(token_ids=pb.TokenIds(ids=[-3]))),
            (Code.INVALID_ARGUMENT, "with max_model_len=2048", gen(token_ids=pb.TokenIds(ids=[5] * 2100))),
            (Code.INVALID_ARGUMENT, "SamplingParams.top_p=3.0 is invalid", gen(token_ids=ids, sampling=pb.SamplingParams(top_p=3))),
            (Code.INVALID_ARGUMENT, "SamplingParams.temperature=-1.0", gen(token_ids=ids, sampling=pb.SamplingParams(temperature=-1))),
            (Code.INVALID_ARGUMENT, "SamplingParams.max_tokens=0", gen(token_ids=ids, sampling=pb.SamplingParams(max_tokens=0))),
            (Code.INVALID_ARGUMENT, "SamplingParams.stop_token_ids", gen(token_ids=ids, sampling=pb.SamplingParams(stop_token_ids=[-1]))),
            (Code.INVALID_ARGUMENT, "has no chat template",
             gen(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")]))),
            (Code.NOT_FOUND, "GenerateRequest.model='other' is not served here", gen(token_ids=ids, model="other")),
            (Code.NOT_FOUND, "request_id='nope' is not running",
             lambda: stub.Abort(pb.AbortRequest(request_id="nope"), metadata=AUTH)),
            (Code.INVALID_ARGUMENT, "AbortRequest.request_id is empty", lambda: stub.Abort(pb.AbortRequest(), metadata=AUTH)),
            # Over serve.max_message_bytes: refused by gRPC itself before the handler runs.
            (Code.RESOURCE_EXHAUSTED, "", gen(token_ids=pb.TokenIds(ids=[200] * MESSAGE_LIMIT))),
            # Bytes that are no GenerateRequest at all.
            (Code.INVALID_ARGUMENT, "the request to /pprun.v1.Pprun/Generate is not a valid message",
             lambda: list(ch.unary_stream("/pprun.v1.Pprun/Generate")(b"\xff\xff\xff\xff", metadata=AUTH))),
            (Code.INVALID_ARGUMENT, "the request to /pprun.v1.Pprun/Abort is not a valid message",
             lambda: ch.unary_unary("/pprun.v1.Pprun/Abort")(b"\x0a\xff", metadata=AUTH)),
        ]
        for code, fragment, call in cases:
            _expect(code, fragment, call)
            assert model_info(stub, AUTH).model == tiny_server.info["model"]  # still serving
        # A request id already running is refused; the running one is unharmed.
        running = stub.Generate(pb.GenerateRequest(request_id="dup", token_ids=ids, sampling=greedy_proto(300)),
                                metadata=AUTH, timeout=60)
        next(running)
        _expect(Code.INVALID_ARGUMENT, "request_id='dup' is invalid: a request with this id is running",
                gen(request_id="dup", token_ids=ids))
        assert sum(len(r.token_ids) for r in running) > 0
        assert wait_idle(stub, free_at_start, AUTH).kv_blocks_free == free_at_start


def test_bad_input_battery_kserve(tiny_server):
    import tritonclient.grpc as tc
    from tritonclient.utils import InferenceServerException

    headers = {"authorization": f"Bearer {TOKEN}"}
    client = tc.InferenceServerClient(url=tiny_server.address)
    name = tiny_server.info["model"]

    def tensor(tname, dtype, value, shape=(1,)):
        t = tc.InferInput(tname, list(shape), dtype)
        t.set_data_from_numpy(np.array(value, dtype=np.object_ if dtype == "BYTES" else None).reshape(shape))
        return t

    text = tensor("text_input", "BYTES", [b"hello"])
    cases = [
        ("StatusCode.NOT_FOUND", "model_name='nope' is not served here", "nope", [text]),
        ("StatusCode.INVALID_ARGUMENT", "input 'text_input' (BYTES) is missing", name,
         [tensor("sampling_parameters", "BYTES", [b"{}"])]),
        ("StatusCode.INVALID_ARGUMENT", "input 'text_input' has datatype 'INT32'", name,
         [tensor("text_input", "INT32", np.array([3], dtype=np.int32))]),
        ("StatusCode.INVALID_ARGUMENT", "input 'prompt' is unknown", name, [tensor("prompt", "BYTES", [b"x"])]),
        ("StatusCode.INVALID_ARGUMENT", "has shape [2]", name, [tensor("text_input", "BYTES", [b"a", b"b"], (2,))]),
        ("StatusCode.INVALID_ARGUMENT", "sampling_parameters is not valid JSON", name,
         [text, tensor("sampling_parameters", "BYTES", [b"{nope"])]),
        ("StatusCode.INVALID_ARGUMENT", "sampling_parameters key 'temprature' is unknown; did you mean 'temperature'", name,
         [text, tensor("sampling_parameters", "BYTES", [json.dumps({"temprature": 0}).encode()])]),
        ("StatusCode.INVALID_ARGUMENT", "SamplingParams.top_p='x' is invalid", name,
         [text, tensor("sampling_parameters", "BYTES", [json.dumps({"top_p": "x"}).encode()])]),
        ("StatusCode.INVALID_ARGUMENT", "a text prompt needs a tokenizer", name, [text]),
        ("StatusCode.INVALID_ARGUMENT", "streaming needs ModelStreamInfer", name,
         [text, tensor("stream", "BOOL", np.array([True]))]),
        ("StatusCode.RESOURCE_EXHAUSTED", "", name, [tensor("text_input", "BYTES", [b"x" * MESSAGE_LIMIT])]),
    ]
    for code, fragment, model, inputs in cases:
        with pytest.raises(InferenceServerException) as info:
            client.infer(model, inputs, headers=headers)
        assert info.value.status() == code and fragment in info.value.message(), (info.value.status(), info.value.message())
        assert client.is_server_ready(headers=headers)
    # On the decoupled stream a bad request is an error response; the stream goes on.
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)), headers=headers)
    client.async_stream_infer(name, [text, tensor("stream", "BOOL", np.array([True]))], request_id="bad")
    result, error = results.get(timeout=30)
    assert result is None and "a text prompt needs a tokenizer" in str(error)
    client.stop_stream()
    assert client.is_server_live(headers=headers)

    # Bytes that are no ModelInferRequest: INVALID_ARGUMENT on both methods.  On the stream the
    # requests read before them are answered first (here: an error response, this model having
    # no tokenizer), then the call ends.
    from tritonclient.grpc import service_pb2

    infer = "/inference.GRPCInferenceService/ModelInfer"
    stream_infer = "/inference.GRPCInferenceService/ModelStreamInfer"
    valid = kserve_request(name, "before-garbage", "hi")
    with tiny_server.channel() as ch:
        for garbage in (b"\xff\xff\xff\xff", b"\x0a\xff"):
            _expect(Code.INVALID_ARGUMENT, f"the request to {infer} is not a valid message",
                    lambda g=garbage: ch.unary_unary(infer)(g, metadata=AUTH, timeout=30))
            _expect(Code.INVALID_ARGUMENT, f"the request to {stream_infer} is not a valid message",
                    lambda g=garbage: list(ch.stream_stream(stream_infer)(iter([g]), metadata=AUTH, timeout=30)))
            assert client.is_server_ready(headers=headers)
        call = ch.stream_stream(stream_infer)(iter([valid.SerializeToString(), b"\xff\xff"]), metadata=AUTH, timeout=30)
        answered = []
        with pytest.raises(grpc.RpcError) as info:
            for raw in call:
                answered.append(service_pb2.ModelStreamInferResponse.FromString(raw))
        assert info.value.code() == Code.INVALID_ARGUMENT and "not a valid message" in info.value.details()
        assert len(answered) == 1 and "a text prompt needs a tokenizer" in answered[0].error_message, answered
    assert client.is_server_ready(headers=headers)
    client.close()


def test_client_that_leaves_mid_stream_is_aborted(tiny_server):
    """A cancelled call and one past its deadline: both requests are aborted and every KV block
    comes back."""
    with tiny_server.channel() as ch:
        stub = pb_grpc.PprunStub(ch)
        free_at_start = model_info(stub, AUTH).kv_blocks_free
        call = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[3, 4, 5]), sampling=greedy_proto(1900)),
                             metadata=AUTH)
        next(call), next(call)
        assert model_info(stub, AUTH).num_unfinished_requests == 1
        call.cancel()
        info = wait_idle(stub, free_at_start, AUTH)
        assert info.num_unfinished_requests == 0 and info.kv_blocks_free == free_at_start
        with pytest.raises(grpc.RpcError) as err:
            for _ in stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[3, 4]), sampling=greedy_proto(1900)),
                                   metadata=AUTH, timeout=0.5):
                pass
        assert err.value.code() == Code.DEADLINE_EXCEEDED
        info = wait_idle(stub, free_at_start, AUTH)
        assert info.num_unfinished_requests == 0 and info.kv_blocks_free == free_at_start


GENERATE_CLIENT = """
import sys, time
import grpc
from pprun.serve._proto.pprun.v1 import pprun_pb2 as pb, pprun_pb2_grpc as pb_grpc
stub = pb_grpc.PprunStub(grpc.insecure_channel(sys.argv[1]))
call = stub.Generate(pb.GenerateRequest(request_id="killed-client", token_ids=pb.TokenIds(ids=[3, 4, 5]),
                     sampling=pb.SamplingParams(temperature=0.0, max_tokens=1900, ignore_eos=True)),
                     metadata=(("authorization", "Bearer " + sys.argv[2]),))
next(call)
print("streaming", flush=True)
time.sleep(600)
"""


def test_killed_client_process_is_aborted(tiny_server):
    """A client process SIGKILLed while its Generate streams: the server sees the connection go,
    aborts the request and every KV block comes back."""
    with tiny_server.channel() as ch:
        stub = pb_grpc.PprunStub(ch)
        free_at_start = model_info(stub, AUTH).kv_blocks_free
        client = ClientProcess(GENERATE_CLIENT, tiny_server.address, TOKEN)
        try:
            client.wait_for("streaming")
            assert model_info(stub, AUTH).num_unfinished_requests == 1
        finally:
            client.kill()
        info = wait_idle(stub, free_at_start, AUTH)
        assert info.num_unfinished_requests == 0 and info.kv_blocks_free == free_at_start
        assert "request killed-client aborted" in tiny_server.log()


DRAIN_MAX_TOKENS = 1900


def test_sigterm_drains_and_exits_0(tiny_server, tiny_reference):
    """SIGTERM while a long stream runs: health turns NOT_SERVING and a new request is refused
    UNAVAILABLE while that stream is still going; it then completes (all its tokens, greedy, so
    starting with the offline output of the same prompt), and the process exits 0."""
    with tiny_server.channel() as ch:
        stub = pb_grpc.PprunStub(ch)
        health = health_pb2_grpc.HealthStub(ch)
        call = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=LOAD_PROMPTS[0]),
                                                sampling=greedy_proto(DRAIN_MAX_TOKENS)), metadata=AUTH)
        responses = [next(call)]
        reader = threading.Thread(target=lambda: responses.extend(call))
        reader.start()
        tiny_server.proc.send_signal(15)
        deadline = time.monotonic() + 30
        while (status := health.Check(health_pb2.HealthCheckRequest(), metadata=AUTH, timeout=10).status) == \
                health_pb2.HealthCheckResponse.SERVING and time.monotonic() < deadline:
            time.sleep(0.01)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        _expect(Code.UNAVAILABLE, "the engine is shutting down and takes no new requests",
                lambda: list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), sampling=greedy_proto(2)),
                                           metadata=AUTH, timeout=30)))
        # Both answers came while the old stream was still running (it has no final response yet).
        assert not any(r.HasField("final") for r in list(responses)), "the old stream ended before the checks"
        reader.join(timeout=120)
        ids = [t for r in responses for t in r.token_ids]
        assert len(ids) == DRAIN_MAX_TOKENS and ids[:LOAD_MAX_TOKENS] == tiny_reference[0]
        assert responses[-1].final.finish_reason == "length"
    assert tiny_server.proc.wait(timeout=120) == 0, tiny_server.log()[-3000:]  # the one SIGTERM was enough
    assert "draining" in tiny_server.log()


def test_tls_end_to_end(tiny_llama_dir, tiny_reference, tmp_path):
    """A TLS server (a self-signed certificate made here): a client trusting that certificate
    streams the offline output; a plaintext client and one that does not trust it are refused.
    This server steps its engine on a thread of its own process (``serve.engine_process=false``)."""
    cert, key = make_self_signed_cert(tmp_path)
    server = ServerProcess(tmp_path, [
        f"model.model={tiny_llama_dir}", "model.dtype=float32", "parallel=single", "serve.engine_process=false",
        f"serve.tls_cert_file={cert}", f"serve.tls_key_file={key}",
    ])  # fmt: skip
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=LOAD_PROMPTS[0]), sampling=greedy_proto(LOAD_MAX_TOKENS))
    try:
        assert server.info["tls"] is True
        trusted = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(server.address, trusted) as ch:
            responses = list(pb_grpc.PprunStub(ch).Generate(request, timeout=60))
            assert [t for r in responses for t in r.token_ids] == tiny_reference[0]
        for channel in (server.channel(), grpc.secure_channel(server.address, grpc.ssl_channel_credentials())):
            with channel as ch:
                _expect(Code.UNAVAILABLE, "", lambda: model_info(pb_grpc.PprunStub(ch)))
        with grpc.secure_channel(server.address, trusted) as ch:  # still serving
            assert model_info(pb_grpc.PprunStub(ch)).model == server.info["model"]
        assert server.terminate() == 0, server.log()[-3000:]
    finally:
        server.kill()


def test_external_launcher_is_refused(tiny_llama_dir, tmp_path, monkeypatch):
    """``pprun serve`` under torchrun cannot work (each rank would serve its own requests while
    the SPMD ranks must all see every one): a configuration error naming the field and value,
    before the model loads; also when ``auto`` resolves to it."""
    import subprocess
    import sys

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from pprun.apps.serve import run  # refuses before it imports the server (and its KServe protos)
    from pprun.config.config import default_conf_dir, register_configs

    register_configs()
    base = [f"model.model={tiny_llama_dir}", "serve.port=0"]
    with initialize_config_dir(config_dir=str(default_conf_dir()), version_base="1.3"):
        explicit = OmegaConf.to_object(compose("serve", [*base, "parallel=pp2_mp", "parallel.executor=external_launcher"]))
        auto = OmegaConf.to_object(compose("serve", [*base, "parallel=single"]))
    with pytest.raises(ValueError, match=r"parallel.executor='external_launcher' cannot serve"):
        run(explicit)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    with pytest.raises(ValueError, match=r"parallel.executor='external_launcher' \(resolved from 'auto'"):
        run(auto)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    proc = subprocess.run([sys.executable, "-m", "pprun", "serve", *base, "parallel.executor=external_launcher",
                           f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "pprun serve: error: parallel.executor='external_launcher' cannot serve" in proc.stderr
    assert "KV cache" not in proc.stderr  # refused before the engine started


# --- the tiny model at pp=2 on local processes -------------------------------------------------------


def _processes(server: ServerProcess, module: str) -> list[psutil.Process]:
    """The server's descendants running ``python -m <module>``."""
    found = []
    for p in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            if module in p.cmdline():
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def _streams_end_unavailable_after(server: ServerProcess, kill, pp_size: int, queue_bound: bool = False) -> None:
    """Two long streams run; ``kill()`` ends part of the engine: both streams end UNAVAILABLE,
    health turns NOT_SERVING, new requests are refused UNAVAILABLE, GetModelInfo still answers and
    SIGTERM still exits 0."""
    with server.channel() as ch:
        stub = pb_grpc.PprunStub(ch)
        health = health_pb2_grpc.HealthStub(ch)
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
        calls = [stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[i + 1, 2]), sampling=greedy_proto(1900)),
                               timeout=120) for i in range(2)]
        for c in calls:
            next(c)
        if queue_bound:
            _expect(Code.RESOURCE_EXHAUSTED, "2 requests are unfinished",
                    lambda: list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1])))))
        kill()
        for c in calls:
            with pytest.raises(grpc.RpcError) as err:
                list(c)
            assert err.value.code() == Code.UNAVAILABLE
        deadline = time.monotonic() + 10
        while (status := health.Check(health_pb2.HealthCheckRequest()).status) == \
                health_pb2.HealthCheckResponse.SERVING and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        _expect(Code.UNAVAILABLE, "the engine has failed",
                lambda: list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), sampling=greedy_proto(2)))))
        assert model_info(stub).pipeline_parallel_size == pp_size
    assert server.terminate() == 0, server.log()[-3000:]


def test_queue_bound_then_stage_failure(tiny_llama_dir, tmp_path):
    """Past max_num_seqs + max_queued_requests: RESOURCE_EXHAUSTED.  The stage processes killed
    mid-stream (the engine process lives on): the streams in flight end UNAVAILABLE, health turns
    NOT_SERVING, new requests are refused UNAVAILABLE, and the server still answers and exits 0 on
    SIGTERM, its engine process gone with it."""
    server = ServerProcess(tmp_path, [
        f"model.model={tiny_llama_dir}", "model.dtype=float32", "parallel=pp2_mp", "parallel.stage_timeout_s=10",
        "scheduler.max_num_seqs=2", "serve.max_queued_requests=0",
    ])  # fmt: skip
    try:
        (engine,) = _processes(server, "pprun.engine.engine_process")
        stages = _processes(server, "pprun.executor.stage_main")
        assert len(stages) == 2 and all(p.ppid() == engine.pid for p in stages)

        def kill_stages() -> None:
            for p in stages:
                p.kill()

        _streams_end_unavailable_after(server, kill_stages, pp_size=2, queue_bound=True)
        assert not engine.is_running() or engine.status() == psutil.STATUS_ZOMBIE
    finally:
        server.kill()


def test_engine_process_death(tiny_llama_dir, tmp_path):
    """The engine process killed mid-stream: the server sees its socket close and ends the streams
    UNAVAILABLE, turns health NOT_SERVING, refuses new requests, and exits 0 on SIGTERM."""
    server = ServerProcess(tmp_path, [f"model.model={tiny_llama_dir}", "model.dtype=float32", "parallel=single"])
    try:
        (engine,) = _processes(server, "pprun.engine.engine_process")
        _streams_end_unavailable_after(server, engine.kill, pp_size=1)
        assert "the engine process exited" in server.log()
    finally:
        server.kill()


# --- the demo model at pp=2 on Ray actors --------------------------------------------------------------

DEMO_PROMPTS = ["The capital of France is", "Pipeline parallelism splits a model"]
DEMO_CHAT = [{"role": "user", "content": "Write a haiku about a graphics card."}]
DEMO_MAX_TOKENS = 8


@pytest.fixture(scope="module")
def demo_reference(demo_model_dir):
    """Offline greedy outputs (one in-process stage: V1/V2 and any pp give the same tokens)."""
    params = SamplingParams(temperature=0.0, max_tokens=DEMO_MAX_TOKENS)
    with LLM(str(demo_model_dir), executor="uni") as llm:
        outs = llm.generate(DEMO_PROMPTS, params) + llm.chat(DEMO_CHAT, params)
    return [o.outputs[0] for o in outs]


@pytest.fixture(scope="module")
def demo_server(demo_model_dir, ray_cluster, tmp_path_factory):
    address = ray_cluster.get_runtime_context().gcs_address
    server = ServerProcess(tmp_path_factory.mktemp("demo_server"), [
        f"model.model={demo_model_dir}", "parallel=pp2_ray", f"parallel.ray_address={address}",
        "serve.model_name=demo",
    ])  # fmt: skip
    yield server
    assert server.terminate() == 0
    server.kill()


def test_generate_streams_equal_offline(demo_server, demo_reference):
    with demo_server.channel() as ch:
        stub = pb_grpc.PprunStub(ch)
        info = model_info(stub)
        assert (info.model, info.pipeline_parallel_size, info.has_chat_template) == ("demo", 2, True)
        assert info.executor.startswith("ray")
        sampling = pb.SamplingParams(temperature=0.0, max_tokens=DEMO_MAX_TOKENS)
        requests = [pb.GenerateRequest(text=p, sampling=sampling, model="demo") for p in DEMO_PROMPTS]
        requests.append(pb.GenerateRequest(sampling=sampling, chat=pb.Chat(
            messages=[pb.ChatMessage(**m) for m in DEMO_CHAT])))
        calls = [stub.Generate(r, timeout=120) for r in requests]  # all in flight at once
        for call, ref in zip(calls, demo_reference):
            responses = list(call)
            assert len(responses) > 1
            assert "".join(r.text for r in responses) == ref.text
            assert [t for r in responses for t in r.token_ids] == ref.token_ids
            final = responses[-1].final
            assert final.finish_reason == ref.finish_reason
            assert final.usage.completion_tokens == len(ref.token_ids)
            assert 0 < final.timings.time_to_first_token_s <= final.timings.e2e_s


def test_abort_mid_stream_frees_blocks(demo_server):
    with demo_server.channel() as ch:
        stub = pb_grpc.PprunStub(ch)
        free_at_start = model_info(stub).kv_blocks_free
        call = stub.Generate(pb.GenerateRequest(request_id="to-abort", text="Once upon a time",
                                                sampling=greedy_proto(500)), timeout=120)
        next(call), next(call)
        assert model_info(stub).kv_blocks_free < free_at_start
        stub.Abort(pb.AbortRequest(request_id="to-abort"), timeout=30)
        rest = list(call)
        assert rest[-1].final.finish_reason == "abort"
        assert rest[-1].final.usage.completion_tokens < 500
        info = wait_idle(stub, free_at_start)
        assert info.kv_blocks_free == free_at_start and info.num_unfinished_requests == 0


def test_tritonclient_against_demo(demo_server, demo_reference):
    import tritonclient.grpc as tc

    client = tc.InferenceServerClient(url=demo_server.address)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("demo")
    assert client.get_server_metadata().name == "pprun"
    meta = client.get_model_metadata("demo")
    assert [(t.name, t.datatype) for t in meta.inputs] == [
        ("text_input", "BYTES"), ("stream", "BOOL"), ("sampling_parameters", "BYTES"), ("exclude_input_in_output", "BOOL")]
    assert [(t.name, t.datatype) for t in meta.outputs] == [("text_output", "BYTES")]

    def inputs(prompt: str, stream: bool | None = None, exclude: bool | None = None):
        values = [("text_input", "BYTES", [prompt.encode()]),
                  # Triton's vLLM clients send numbers as strings; both forms are taken.
                  ("sampling_parameters", "BYTES", [json.dumps({"temperature": "0", "max_tokens": DEMO_MAX_TOKENS}).encode()])]
        if stream is not None:
            values.append(("stream", "BOOL", [stream]))
        if exclude is not None:
            values.append(("exclude_input_in_output", "BOOL", [exclude]))
        out = []
        for name, dtype, value in values:
            t = tc.InferInput(name, [1], dtype)
            t.set_data_from_numpy(np.array(value, dtype=np.object_ if dtype == "BYTES" else bool))
            out.append(t)
        return out

    prompt, ref = DEMO_PROMPTS[0], demo_reference[0].text
    result = client.infer("demo", inputs(prompt), outputs=[tc.InferRequestedOutput("text_output")])
    assert result.as_numpy("text_output")[0].decode() == prompt + ref
    result = client.infer("demo", inputs(prompt, exclude=True))
    assert result.as_numpy("text_output")[0].decode() == ref

    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    for i, p in enumerate(DEMO_PROMPTS):
        client.async_stream_infer("demo", inputs(p, stream=True), request_id=f"s{i}")
    texts: dict[str, list[str]] = {"s0": [], "s1": []}
    done: set[str] = set()
    while len(done) < 2:
        result, error = results.get(timeout=120)
        assert error is None, error
        resp = result.get_response()
        texts[resp.id].append(result.as_numpy("text_output")[0].decode())
        if resp.parameters["triton_final_response"].bool_param:
            done.add(resp.id)
    client.stop_stream()
    for i, ref_out in enumerate(demo_reference[:2]):
        assert len(texts[f"s{i}"]) > 1 and "".join(texts[f"s{i}"]) == ref_out.text
    client.close()


STREAM_INFER_CLIENT = """
import sys, threading
import grpc
from serve_helpers import kserve_request, requests_then_hold
from tritonclient.grpc import service_pb2_grpc

hold = threading.Event()
stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(sys.argv[1]))
request = kserve_request("demo", "killed-stream", "Once upon a time", {"temperature": 0, "max_tokens": 4000, "ignore_eos": True})
first = next(stub.ModelStreamInfer(requests_then_hold([request], hold)))
assert not first.error_message, first.error_message
print("streaming", flush=True)
hold.wait(600)
"""


def test_stream_infer_client_that_leaves_is_aborted(demo_server):
    """ModelStreamInfer: a client process SIGKILLed mid-stream, and a client that closes its
    channel mid-stream; each request is aborted and every KV block comes back."""
    from tritonclient.grpc import service_pb2_grpc

    with demo_server.channel() as ch:
        stub = pb_grpc.PprunStub(ch)
        free_at_start = model_info(stub).kv_blocks_free
        client = ClientProcess(STREAM_INFER_CLIENT, demo_server.address)
        try:
            client.wait_for("streaming")
            assert model_info(stub).num_unfinished_requests == 1
        finally:
            client.kill()
        info = wait_idle(stub, free_at_start)
        assert info.num_unfinished_requests == 0 and info.kv_blocks_free == free_at_start
        assert "(KServe id 'killed-stream') aborted" in demo_server.log()

        hold = threading.Event()
        leaving = grpc.insecure_channel(demo_server.address)
        try:
            request = kserve_request("demo", "closed-channel", "Once upon a time",
                                     {"temperature": 0, "max_tokens": 4000, "ignore_eos": True})
            responses = service_pb2_grpc.GRPCInferenceServiceStub(leaving).ModelStreamInfer(
                requests_then_hold([request], hold))
            assert not next(responses).error_message
            assert model_info(stub).num_unfinished_requests == 1
            leaving.close()
            info = wait_idle(stub, free_at_start)
            assert info.num_unfinished_requests == 0 and info.kv_blocks_free == free_at_start
            assert "(KServe id 'closed-channel') aborted" in demo_server.log()
        finally:
            hold.set()
            leaving.close()


def test_stream_infer_answers_requests_before_malformed_bytes(demo_server, demo_reference):
    """A valid streaming request, then bytes that are no message, on one ModelStreamInfer call:
    the request streams to its end (the offline text), then the call ends INVALID_ARGUMENT."""
    from tritonclient.grpc import service_pb2

    request = kserve_request("demo", "before-garbage", DEMO_PROMPTS[0], {"temperature": 0, "max_tokens": DEMO_MAX_TOKENS})
    with demo_server.channel() as ch:
        stub = pb_grpc.PprunStub(ch)
        free_at_start = model_info(stub).kv_blocks_free
        call = ch.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")(
            iter([request.SerializeToString(), b"\xff\xff\xff"]), timeout=120)
        answered = []
        with pytest.raises(grpc.RpcError) as info:
            for raw in call:
                answered.append(service_pb2.ModelStreamInferResponse.FromString(raw))
        assert info.value.code() == Code.INVALID_ARGUMENT and "is not a valid message" in info.value.details()
        assert answered and not any(r.error_message for r in answered)
        texts = [r.infer_response.raw_output_contents[0][4:].decode() for r in answered]
        assert "".join(texts) == demo_reference[0].text
        assert answered[-1].infer_response.parameters["triton_final_response"].bool_param
        # The final response can reach the client while the request's last step is still in
        # flight (async pipeline steps): it is finished and its blocks freed within a step.
        info = wait_idle(stub, free_at_start)
        assert info.num_unfinished_requests == 0 and info.kv_blocks_free == free_at_start


def test_health_and_reflection(demo_server):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with demo_server.channel() as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "pprun.v1.Pprun", "inference.GRPCInferenceService"):
            assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == \
                health_pb2.HealthCheckResponse.SERVING
        services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
        assert {"pprun.v1.Pprun", "inference.GRPCInferenceService", "grpc.health.v1.Health"} <= services


_INTERCEPTOR_CHECK = """
import asyncio, grpc
from pprun.serve._proto.pprun.v1 import pprun_pb2 as pb
from pprun.serve.server import MalformedRequest, MalformedRequestInterceptor

async def generate(request, context):
    yield request

class Details(grpc.HandlerCallDetails):
    def __init__(self, method):
        self.method, self.invocation_metadata = method, ()

def handler():
    return grpc.unary_stream_rpc_method_handler(generate, pb.GenerateRequest.FromString,
                                                pb.GenerateResponse.SerializeToString)

first, second = handler(), handler()
interceptor = MalformedRequestInterceptor()

def intercept(h, method="/pprun.v1.Pprun/Generate"):
    async def continuation(_details):
        return h
    return asyncio.run(interceptor.intercept_service(continuation, Details(method)))

a, b, c = intercept(first), intercept(first), intercept(second)
assert a is b and a is not first and c is not a and intercept(second) is c
assert intercept(first, "/pprun.v1.Pprun/Other") is not a
assert isinstance(a.request_deserializer(b"\\xff\\xff"), MalformedRequest)
assert a.request_deserializer(pb.GenerateRequest(text="hi").SerializeToString()).text == "hi"
print("ok")
"""


def test_malformed_interceptor_wraps_each_method_once():
    """The interceptor builds a method's wrapped handler on its first call and returns that one
    on later calls (a burst of calls does not rebuild closures per call); a method whose handler
    changes is wrapped anew; malformed bytes still deserialize to a MalformedRequest.  In a
    process of its own: this one may hold tritonclient's copy of the KServe messages, which
    pprun.serve.server's own copy would clash with in protobuf's default pool."""
    import subprocess
    import sys
    from pathlib import Path

    out = subprocess.run([sys.executable, "-c", _INTERCEPTOR_CHECK], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent)  # this checkout's pprun
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_bench_compare_tokens():
    """bench_serve's comparison of served outputs with offline ones (where the first one differs)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "bench_serve.py"
    spec = importlib.util.spec_from_file_location("bench_serve", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    same = bench.compare_tokens([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]])
    assert same == {"equal_outputs": 2, "outputs": 2, "first_difference_min": None, "first_difference_p50": None}
    diff = bench.compare_tokens([[1, 2, 3], [4, 5, 6], [7, 8]], [[1, 9, 3], [4, 5, 6], [7, 8, 9]])
    assert diff == {"equal_outputs": 1, "outputs": 3, "first_difference_min": 1, "first_difference_p50": 1.5}
