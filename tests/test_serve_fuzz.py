"""Schema-driven fuzzing of a live ``pprun serve`` (hypothesis): request bodies drawn from the
OpenAI API's declared schemas (``/openapi.json``, ``pprun.serve.protocol``), some of them broken
on purpose (a field's value swapped for any JSON value, an unknown key), and pprun.v1
``GenerateRequest`` messages drawn from their protobuf descriptors.

Every answer must be a 2xx that matches the declared response schema or a 4xx in OpenAI's error
shape (gRPC: OK or a status that names bad input); never a 5xx, and never past
``REQUEST_DEADLINE_S`` (a hang).  Afterwards the server still gives the reference tokens and
reports healthy.  One server serves every test of the module: the tiny Llama with a tokenizer
and chat template, a 128-token context and tight per-request limits so that no example runs long.
"""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest
from google.protobuf import message_factory
from serve_helpers import ServerProcess

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pprun.serve import protocol  # noqa: E402
from pprun.serve._proto.pprun.v1 import pprun_pb2 as pb  # noqa: E402
from pprun.serve._proto.pprun.v1 import pprun_pb2_grpc as pb_grpc  # noqa: E402
from pprun.serve.openai_api import NEUTRAL  # noqa: E402

try:  # the HTTP client the openai package is built on (httpx2 in its recent releases)
    import httpx2 as httpx
except ImportError:
    import httpx

MODEL = "fuzz"
MAX_MODEL_LEN = 128
REQUEST_DEADLINE_S = 30.0
"""Longest any one fuzzed request may take before it counts as a hang."""
EXAMPLES = 60
"""Examples per fuzz test (4 tests)."""
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])  # fmt: skip
REFERENCE = {"model": MODEL, "prompt": [1, 50, 34, 31], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
SEEN: dict[str, dict[int, int]] = {}
"""Statuses met, by test (printed at the end of the module)."""

ANY_JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=8,
)  # fmt: skip
"""Any JSON value (what a careless client puts in a field)."""


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory, request):
    from tiny_models import make_tiny_llama
    from tiny_tokenizer import make_two_letter_tokenizer

    model_dir = make_two_letter_tokenizer(make_tiny_llama(tmp_path_factory.mktemp("serve_fuzz_llama"), num_layers=2))
    proc = ServerProcess(tmp_path_factory.mktemp("serve_fuzz"), [
        f"model.model={model_dir}", "model.dtype=float32", f"model.max_model_len={MAX_MODEL_LEN}", "parallel=single",
        "scheduler.max_num_seqs=16", "serve.http_port=0", f"serve.model_name={MODEL}", "serve.max_choices=8",
        "serve.max_request_output_tokens=512",
    ])  # fmt: skip
    try:
        proc.base = f"http://{proc.info['http_address']}"
        proc.http = httpx.Client(base_url=proc.base, timeout=REQUEST_DEADLINE_S)
        proc.reference = _reference_tokens(proc)
        yield proc
        assert _reference_tokens(proc) == proc.reference  # still serves, the same tokens
        assert proc.http.get("/health").status_code == 200
        capture = request.config.pluginmanager.getplugin("capturemanager")
        with capture.global_and_fixture_disabled():
            print(f"\nserve fuzz statuses by test: {SEEN}", flush=True)
    finally:
        proc.kill()


def _reference_tokens(server) -> list[int]:
    body = {**REFERENCE, "return_token_ids": True}
    resp = server.http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


# --- strategies from a JSON schema -----------------------------------------------------------------


def _members(schema: dict, defs: dict) -> list[dict]:
    while "$ref" in schema:
        schema = defs[schema["$ref"].rsplit("/", 1)[-1]]
    if "anyOf" in schema:
        return [m for s in schema["anyOf"] for m in _members(s, defs)]
    return [schema]


def _integers(m: dict) -> st.SearchStrategy:
    low = m.get("minimum", m.get("exclusiveMinimum", -5))
    high = m.get("maximum", m.get("exclusiveMaximum", low + 300))
    return st.one_of(st.integers(low, min(high, low + 40)), st.sampled_from([low, high]))


def _numbers(m: dict) -> st.SearchStrategy:
    low = m.get("minimum", -2.0)
    high = m.get("maximum", 3.0)
    return st.floats(low, high, exclude_min="exclusiveMinimum" in m, exclude_max="exclusiveMaximum" in m)


def from_schema(schema: dict, defs: dict) -> st.SearchStrategy:
    """Values the schema describes, its edges included (small: each runs)."""
    options = []
    for m in _members(schema, defs):
        kind = m.get("type")
        if "const" in m or "enum" in m:
            options.append(st.sampled_from([m["const"]] if "const" in m else m["enum"]))
        elif kind == "integer":
            options.append(_integers(m))
        elif kind == "number":
            options.append(_numbers(m))
        elif kind == "string":
            options.append(st.text(alphabet="abcdefghijklmnop .\n", max_size=12))
        elif kind == "boolean":
            options.append(st.booleans())
        elif kind == "null":
            options.append(st.none())
        elif kind == "array":
            items = from_schema(m.get("items", {}), defs) if m.get("items") else ANY_JSON
            options.append(st.lists(items, min_size=m.get("minItems", 0), max_size=4))
        elif kind == "object" and "properties" in m:
            options.append(objects(m, defs))
        else:
            options.append(ANY_JSON)
    return st.one_of(options)


def objects(schema: dict, defs: dict, fixed: dict[str, st.SearchStrategy] | None = None) -> st.SearchStrategy:
    """An object of the schema: its required keys, some of the others; ``fixed`` overrides."""
    props = {k: (fixed or {}).get(k, from_schema(v, defs)) for k, v in schema["properties"].items()}
    required = set(schema.get("required", ()))
    return st.fixed_dictionaries({k: v for k, v in props.items() if k in required},
                                 optional={k: v for k, v in props.items() if k not in required})


PAST_EDGES = st.sampled_from([-1, 0, 1.5, 10**9, -(10**9), 2**64, 1e300, "1", "", True])


def broken(bodies: st.SearchStrategy, keys: list[str]) -> st.SearchStrategy:
    """Bodies with one key's value swapped for a value just past the usual edges or any JSON
    value, or an unknown key added."""

    @st.composite
    def spoil(draw):
        body = dict(draw(bodies))
        how = draw(st.sampled_from(["edge", "any", "unknown"]))
        if how == "unknown":
            body[draw(st.sampled_from(["temprature", "prompts", "max_token", "x"]))] = draw(ANY_JSON)
        else:
            body[draw(st.sampled_from(keys))] = draw(PAST_EDGES if how == "edge" else ANY_JSON)
        return body

    return spoil()


def request_bodies(server, name: str) -> st.SearchStrategy:
    """Bodies of ``POST`` ``name``'s request schema as the server publishes it (``/openapi.json``):
    most follow it (small generation settings, so each runs), some are broken."""
    doc = server.http.get("/openapi.json").json()
    defs = doc["components"]["schemas"]
    ref = doc["paths"][name]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    schema = defs[ref.rsplit("/", 1)[-1]]
    # Parameters taken only at their neutral value are drawn from those (the server says which).
    fixed = {key: st.sampled_from([None, *values]) for key, (values, _) in NEUTRAL.items()}
    fixed.update({"model": st.sampled_from([MODEL, MODEL, None, "other"]), "stream": st.booleans(),
                  "n": st.sampled_from([None, 1, 2, 9]), "min_tokens": st.sampled_from([None, 0, 2]),
                  "max_tokens": st.one_of(st.integers(1, 24), st.sampled_from([None, MAX_MODEL_LEN, 10**9]))})
    if "max_completion_tokens" in schema["properties"]:
        fixed["max_completion_tokens"] = fixed.pop("max_tokens")
    defs = {**defs, "ChatMessage": {**defs["ChatMessage"], "properties": {
        **defs["ChatMessage"]["properties"], "role": {"enum": ["user", "system", "assistant", "robot"]}}}}
    valid = objects(schema, defs, fixed)
    spoiled = broken(valid, sorted(schema["properties"]))
    return st.integers(0, 3).flatmap(lambda i: spoiled if i == 3 else valid)  # a quarter broken


# --- the checks --------------------------------------------------------------------------------------


def _record(test: str, status: int) -> None:
    counts = SEEN.setdefault(test, {})
    counts[status] = counts.get(status, 0) + 1


def check_http_answer(resp: Any, body: dict, whole: type, chunk: type) -> None:
    """A 2xx matching the declared response schema, or a 4xx in OpenAI's error shape."""
    assert resp.status_code < 500, (body, resp.status_code, resp.text[:500])
    if resp.status_code >= 400:
        err = protocol.ErrorResponse.model_validate(resp.json()).error
        assert err.message, body
        return
    if body.get("stream") is True:
        events = [e for e in resp.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]", (body, resp.text[-300:])
        for event in events[:-1]:
            assert event.startswith("data: "), event
            chunk.model_validate(json.loads(event.removeprefix("data: ")))
    else:
        whole.model_validate(resp.json())


def _post(server, path: str, body: dict) -> Any:
    try:
        return server.http.post(path, json=body)
    except httpx.TimeoutException:
        pytest.fail(f"no answer within {REQUEST_DEADLINE_S} s (a hang): {body}")


@pytest.fixture(scope="module")
def completion_bodies(fuzz_server):
    return request_bodies(fuzz_server, "/v1/completions")


@pytest.fixture(scope="module")
def chat_bodies(fuzz_server):
    return request_bodies(fuzz_server, "/v1/chat/completions")


def test_fuzzed_completions(fuzz_server, completion_bodies):
    @FUZZ
    @given(body=completion_bodies)
    def run(body):
        resp = _post(fuzz_server, "/v1/completions", body)
        _record("completions", resp.status_code)
        check_http_answer(resp, body, protocol.CompletionResponse, protocol.CompletionResponse)

    run()
    assert SEEN["completions"].get(200) and SEEN["completions"].get(400)  # both kinds were tried


def test_fuzzed_chats(fuzz_server, chat_bodies):
    @FUZZ
    @given(body=chat_bodies)
    def run(body):
        resp = _post(fuzz_server, "/v1/chat/completions", body)
        _record("chat", resp.status_code)
        check_http_answer(resp, body, protocol.ChatCompletionResponse, protocol.ChatCompletionChunk)

    run()
    assert SEEN["chat"].get(200) and SEEN["chat"].get(400)


@FUZZ
@given(raw=st.one_of(st.binary(max_size=64), ANY_JSON.map(lambda v: json.dumps(v).encode())),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))  # fmt: skip
def test_fuzzed_raw_bodies(fuzz_server, raw, path):
    """Bytes and JSON of any shape: a 4xx, never a 5xx."""
    try:
        resp = fuzz_server.http.post(path, content=raw, headers={"content-type": "application/json"})
    except httpx.TimeoutException:
        pytest.fail(f"no answer within {REQUEST_DEADLINE_S} s (a hang): {raw!r}")
    _record("raw", resp.status_code)
    assert 400 <= resp.status_code < 500, (raw, resp.status_code, resp.text[:300])
    protocol.ErrorResponse.model_validate(resp.json())


# --- gRPC: messages from their descriptors -----------------------------------------------------------

_INT_RANGES = {"TYPE_INT32": (-(2**31), 2**31 - 1), "TYPE_INT64": (-(2**63), 2**63 - 1)}


def from_descriptor(descriptor, overrides: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """Messages of a protobuf descriptor: every field maybe set (one member of a oneof at most),
    numbers small or at their type's edges, strings short; ``overrides`` by field name."""
    fd = type(descriptor.fields[0])
    kinds = {v: k for k, v in vars(fd).items() if k.startswith("TYPE_")}
    fields = {}
    for f in descriptor.fields:
        kind = kinds[f.type]
        if f.name in overrides:  # the whole field's values, repeated or not
            fields[f.name] = overrides[f.name]
            continue
        if kind == "TYPE_MESSAGE":
            value = from_descriptor(f.message_type, overrides)
        elif kind in _INT_RANGES:
            low, high = _INT_RANGES[kind]
            value = st.one_of(st.integers(-3, 40), st.sampled_from([low, high, 10**6]))
        elif kind in ("TYPE_DOUBLE", "TYPE_FLOAT"):
            value = st.one_of(st.floats(-2, 3, width=32), st.sampled_from([float("nan"), float("inf"), -1e30]))
        elif kind == "TYPE_BOOL":
            value = st.booleans()
        else:
            value = st.text(alphabet="abcdefghijklmnop .", max_size=12)
        is_repeated = getattr(f, "is_repeated", None)
        if is_repeated if is_repeated is not None else f.label == f.LABEL_REPEATED:
            value = st.lists(value, max_size=4)
        fields[f.name] = value
    oneofs = [[f.name for f in o.fields] for o in descriptor.oneofs if not o.name.startswith("_")]
    message_class = message_factory.GetMessageClass(descriptor)

    def build(values: dict) -> Any:
        for members in oneofs:  # keep the first member set of each oneof
            for name in [m for m in members if m in values][1:]:
                del values[name]
        return message_class(**values)

    return st.fixed_dictionaries({}, optional=fields).map(build)


@FUZZ
@given(data=st.data())
def test_fuzzed_grpc_generate(fuzz_server, data):
    """pprun.v1 Generate with hypothesis-made requests: OK or a status that names bad input."""
    request = data.draw(from_descriptor(pb.GenerateRequest.DESCRIPTOR, {
        "model": st.sampled_from(["", MODEL, "other"]), "request_id": st.sampled_from(["", "fuzz-id"]),
        "max_tokens": st.one_of(st.integers(-1, 24), st.sampled_from([MAX_MODEL_LEN, 10**9])),
        "ids": st.lists(st.integers(-2, 300), max_size=6),
    }))  # fmt: skip
    stub = pb_grpc.PprunStub(fuzz_server.grpc_channel)
    try:
        responses = list(stub.Generate(request, timeout=REQUEST_DEADLINE_S))
    except grpc.RpcError as e:
        _record("grpc", e.code().value[0])
        assert e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), (request, e.code(), e.details())
        assert e.details(), request
    else:
        _record("grpc", 0)
        assert responses and responses[-1].HasField("final"), request


@pytest.fixture(scope="module", autouse=True)
def _grpc_channel(fuzz_server):
    fuzz_server.grpc_channel = fuzz_server.channel()
    yield
    fuzz_server.grpc_channel.close()


# --- the same limits on every front end --------------------------------------------------------------


def test_max_tokens_past_the_context_on_every_front_end(fuzz_server):
    """``max_tokens`` beyond what the 128-token context leaves after the prompt: a 400 (OpenAI) or
    INVALID_ARGUMENT (pprun.v1, KServe) naming both numbers; too many stop strings the same."""
    resp = fuzz_server.http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 126})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"
    assert "max_tokens=126 is invalid: the prompt has 3 tokens and max_model_len=128 leaves room for 125" in resp.text
    stub = pb_grpc.PprunStub(fuzz_server.grpc_channel)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), sampling=pb.SamplingParams(max_tokens=126))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request, timeout=REQUEST_DEADLINE_S))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens=126 is invalid: the prompt has 3 tokens and max_model_len=128 leaves room for 125" in (
        info.value.details())
    request = pb.GenerateRequest(text="abcd", sampling=pb.SamplingParams(max_tokens=2, stop=["a"] * 17))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request, timeout=REQUEST_DEADLINE_S))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "GenerateRequest.sampling.stop has 17 stop strings: at most serve.max_stop_strings=16" in info.value.details()
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="ab")] * 1025)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(pb.GenerateRequest(chat=chat, sampling=pb.SamplingParams(max_tokens=2)),
                           timeout=REQUEST_DEADLINE_S))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ("GenerateRequest.chat.messages has 1025 messages: at most serve.max_chat_messages=1024"
            in info.value.details())

    from serve_helpers import kserve_request
    from tritonclient.grpc import service_pb2_grpc

    kserve = service_pb2_grpc.GRPCInferenceServiceStub(fuzz_server.grpc_channel)
    with pytest.raises(grpc.RpcError) as info:
        kserve.ModelInfer(kserve_request(MODEL, "too-long", "abcd", {"max_tokens": 1000}, stream=False),
                          timeout=REQUEST_DEADLINE_S)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens=1000 is invalid: the prompt has" in info.value.details()
    assert "max_model_len=128" in info.value.details()
