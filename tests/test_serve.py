"""``pprun serve`` end to end: real servers on loopback in their own processes, real clients.

Three servers: the tiny random Llama in process (bearer token, small message limit: load,
bad input, disconnects, token, bind address, SIGTERM), the tiny Llama at pp=2 on local
processes (queue bound, a stage killed), and the demo model at pp=2 on Ray actors (pprun.v1 and
tritonclient texts against offline ``LLM.generate``, abort, health, reflection).
"""

from __future__ import annotations

import asyncio
import json
import queue
import socket
import time

import grpc
import numpy as np
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serve_helpers import ServerProcess

from pprun import LLM
from pprun.sampling.params import SamplingParams
from pprun.serve._proto.pprun.v1 import pprun_pb2 as pb
from pprun.serve._proto.pprun.v1 import pprun_pb2_grpc as pb_grpc

TOKEN = "s3cret-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
LOAD_PROMPTS = [[(11 * i + j) % 250 + 1 for j in range(2 + i % 5)] for i in range(20)]
LOAD_MAX_TOKENS = 6
MESSAGE_LIMIT = 64 * 1024
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
    assert (cfg.serve.host, cfg.serve.port, cfg.serve.auth_token) == ("127.0.0.1", 0, None)
    assert cfg.pprun_config().scheduler.max_num_seqs == 8
    cfg.serve.validate()
    for kwargs, message in [
        ({"port": 70000}, r"serve.port=70000 is invalid"),
        ({"tls_cert_file": str(tmp_path)}, r"TLS needs both"),
        ({"auth_token": "a", "auth_token_file": "b"}, r"both set"),
        ({"auth_token_file": str(tmp_path / "missing")}, r"serve.auth_token_file=.* is not a file"),
        ({"max_queued_requests": -1}, r"serve.max_queued_requests=-1 is invalid"),
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


def test_load_200_concurrent_streams(tiny_server, tiny_reference):
    """200 streaming clients at once (ten channels, twenty calls each): none lost, each equal to
    the offline output; KV blocks back to the start and the server's memory steady."""
    n = 200

    async def one_round() -> list[list[int]]:
        channels = [grpc.aio.insecure_channel(tiny_server.address) for _ in range(10)]
        stubs = [pb_grpc.PprunStub(c) for c in channels]

        async def client(i: int) -> list[int]:
            call = stubs[i % 10].Generate(pb.GenerateRequest(
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

    with tiny_server.channel() as ch:
        stub = pb_grpc.PprunStub(ch)
        free_at_start = model_info(stub, AUTH).kv_blocks_free
        first = asyncio.run(one_round())  # also warms the server up (batch shapes, allocator)
        rss_after_first = tiny_server.rss_bytes()
        second = asyncio.run(one_round())
        for outs in (first, second):
            assert len(outs) == n
            assert all(out == tiny_reference[i % 20] for i, out in enumerate(outs))
        info = wait_idle(stub, free_at_start, AUTH)
        assert info.num_unfinished_requests == 0 and info.kv_blocks_free == free_at_start
        growth = tiny_server.rss_bytes() - rss_after_first
        assert growth < 64 * 2**20, f"server RSS grew by {growth / 2**20:.1f} MiB over a second round of {n}"


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


def test_sigterm_drains_and_exits_0(tiny_server, tiny_reference):
    """SIGTERM while a stream runs: the stream still completes, then the process exits 0."""
    with tiny_server.channel() as ch:
        stub = pb_grpc.PprunStub(ch)
        call = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=LOAD_PROMPTS[0]),
                                                sampling=greedy_proto(LOAD_MAX_TOKENS)), metadata=AUTH)
        first = next(call)
        tiny_server.proc.send_signal(15)
        rest = list(call)
        assert list(first.token_ids) + [t for r in rest for t in r.token_ids] == tiny_reference[0]
        assert rest[-1].final.finish_reason == "length"
    assert tiny_server.terminate() == 0, tiny_server.log()[-3000:]
    assert "draining" in tiny_server.log()


# --- the tiny model at pp=2 on local processes -------------------------------------------------------


def test_queue_bound_then_stage_failure(tiny_llama_dir, tmp_path):
    """Past max_num_seqs + max_queued_requests: RESOURCE_EXHAUSTED.  A stage killed mid-stream:
    the streams in flight end UNAVAILABLE, health turns NOT_SERVING, new requests are refused
    UNAVAILABLE, and the server still answers and exits 0 on SIGTERM."""
    server = ServerProcess(tmp_path, [
        f"model.model={tiny_llama_dir}", "model.dtype=float32", "parallel=pp2_mp", "parallel.stage_timeout_s=10",
        "scheduler.max_num_seqs=2", "serve.max_queued_requests=0",
    ])  # fmt: skip
    try:
        with server.channel() as ch:
            stub = pb_grpc.PprunStub(ch)
            health = health_pb2_grpc.HealthStub(ch)
            assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
            calls = [stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[i + 1, 2]), sampling=greedy_proto(1900)),
                                   timeout=120) for i in range(2)]
            for c in calls:
                next(c)
            _expect(Code.RESOURCE_EXHAUSTED, "2 requests are unfinished",
                    lambda: list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1])))))
            stages = [p for p in psutil.Process(server.proc.pid).children(recursive=True) if p.is_running()]
            assert stages, "no stage processes found"
            for p in stages:
                p.kill()
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
            assert model_info(stub).pipeline_parallel_size == 2
        assert server.terminate() == 0, server.log()[-3000:]
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


def test_health_and_reflection(demo_server):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with demo_server.channel() as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "pprun.v1.Pprun", "inference.GRPCInferenceService"):
            assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == \
                health_pb2.HealthCheckResponse.SERVING
        services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
        assert {"pprun.v1.Pprun", "inference.GRPCInferenceService", "grpc.health.v1.Health"} <= services
