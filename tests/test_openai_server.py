"""``pprun serve``'s OpenAI-compatible HTTP API with real clients: the official ``openai`` package,
unchanged, and ``curl`` for the raw server-sent events.

Servers: the tiny random Llama with the two-letter tokenizer (``tests/tiny_tokenizer.py``, whose
chat template makes chats work) in one stage with an engine process, a bearer token and a small
KV pool; and the same on a thread of the server process with TLS, for the certificate and for
draining.  Served texts are compared with offline ``LLM.generate`` / ``LLM.chat`` on the same
checkpoint (greedy, or seeded: a seeded request yields the same tokens in any batch).
"""

from __future__ import annotations

import json
import re
import shutil
import ssl
import subprocess
import threading
import time

import openai
import pytest
from serve_helpers import ServerProcess, make_self_signed_cert

from pprun import LLM
from pprun.sampling.params import SamplingParams

try:  # the HTTP client the openai package is built on (httpx2 in its recent releases)
    import httpx2 as httpx
except ImportError:
    import httpx

TOKEN = "http-s3cret"
KV_BLOCKS = 160
KV_BLOCK_BYTES = 2 * 4 * 16 * 2 * 16 * 4
"""Keys and values, 4 layers, 16 tokens, 2 KV heads of 16 dims, float32 (tests/tiny_models.py)."""
CHAT = [{"role": "system", "content": "abcd"}, {"role": "user", "content": "efghijkl"}]
PROMPT = "abcdefgh"
CURL = shutil.which("curl") or "/usr/bin/curl"


@pytest.fixture(scope="module")
def chat_llama_dir(tmp_path_factory):
    """The tiny Llama with a tokenizer and a chat template."""
    from tiny_models import make_tiny_llama
    from tiny_tokenizer import make_two_letter_tokenizer

    return make_two_letter_tokenizer(make_tiny_llama(tmp_path_factory.mktemp("openai_llama"), num_layers=4))


@pytest.fixture(scope="module")
def server(chat_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openai_server")
    (tmp / "token").write_text(TOKEN + "\n")
    proc = ServerProcess(tmp, [
        f"model.model={chat_llama_dir}", "model.dtype=float32", "parallel=single", "scheduler.max_num_seqs=16",
        "serve.http_port=0", f"serve.auth_token_file={tmp / 'token'}", "serve.model_name=tiny-chat",
        f"cache.kv_cache_memory_bytes={KV_BLOCKS * KV_BLOCK_BYTES}",
    ])  # fmt: skip
    yield proc
    proc.kill()


@pytest.fixture(scope="module")
def offline(chat_llama_dir):
    """The offline engine on the same checkpoint (the reference)."""
    with LLM(str(chat_llama_dir), dtype="float32") as llm:
        yield llm


def base_url(server: ServerProcess, scheme: str = "http") -> str:
    return f"{scheme}://{server.info['http_address']}/v1"


def client(server: ServerProcess, **kw) -> openai.OpenAI:
    kw.setdefault("api_key", TOKEN)
    kw.setdefault("timeout", 120)
    return openai.OpenAI(base_url=base_url(server), max_retries=0, **kw)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def metrics(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(f"http://{server.info['http_address']}/metrics", headers={"authorization": f"Bearer {TOKEN}"},
                     timeout=30).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(pprun_\w+) (\S+)$", text, re.M)}


def wait_idle(server: ServerProcess, free_at_start: float) -> dict[str, float]:
    """Poll /metrics until no request is unfinished and every KV block is back (30 s at most)."""
    deadline = time.monotonic() + 30
    while True:
        m = metrics(server)
        if (m["pprun_requests_unfinished"] == 0 and m["pprun_kv_blocks_free"] == free_at_start) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def test_serve_config_http_port_validates():
    from pprun.config.config import ServeConfig

    ServeConfig(http_port=8000).validate()
    for kwargs, message in [({"http_port": 70000}, r"serve.http_port=70000 is invalid"),
                            ({"http_port": True}, r"serve.http_port=True is invalid"),
                            ({"http_port": 50051}, r"serve.http_port=50051 is invalid: serve.port")]:
        with pytest.raises(ValueError, match=message):
            ServeConfig(**kwargs).validate()


def test_models_loopback_and_tokens(server):
    host = server.info["http_address"].rsplit(":", 1)[0]
    assert host == "127.0.0.1"
    assert [m.id for m in client(server).models.list()] == ["tiny-chat"]
    assert client(server).models.retrieve("tiny-chat").id == "tiny-chat"
    with pytest.raises(openai.NotFoundError):
        client(server).models.retrieve("other")
    with pytest.raises(openai.AuthenticationError) as info:
        client(server, api_key="wrong").models.list()
    assert info.value.status_code == 401 and "the bearer token in 'Authorization' is wrong" in str(info.value)
    with pytest.raises(openai.AuthenticationError):
        client(server, api_key="wrong").chat.completions.create(model="tiny-chat", messages=CHAT, max_tokens=2)
    bare = httpx.get(base_url(server) + "/models", timeout=30)  # no Authorization header at all
    assert bare.status_code == 401
    assert bare.json()["error"]["code"] == "invalid_api_key" and "needs 'Authorization: Bearer" in bare.json()["error"]["message"]


def test_completions_equal_offline(server, offline):
    c = client(server)
    ref = offline.generate([PROMPT, {"prompt_token_ids": [1, 5, 9, 13]}], greedy(8))
    whole = c.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert whole.choices[0].text == ref[0].outputs[0].text and whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ref[0].prompt_token_ids), 8)
    tokens = c.completions.create(model="tiny-chat", prompt=[1, 5, 9, 13], max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    assert tokens.choices[0].token_ids == ref[1].outputs[0].token_ids
    chunks = list(c.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref[0].outputs[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    # Two prompts at once: a choice per prompt, in order.
    both = c.completions.create(model="tiny-chat", prompt=[PROMPT, "ponm"], max_tokens=4, temperature=0,
                                extra_body={"ignore_eos": True})
    assert [ch.index for ch in both.choices] == [0, 1]
    assert [ch.text for ch in both.choices] == [o.outputs[0].text for o in offline.generate([PROMPT, "ponm"], greedy(4))]


def test_metrics_report_the_prefix_cache(server):
    """/metrics carries prefix caching's counters: a prompt sent twice is looked up twice and the
    second finds its full blocks cached."""
    c = client(server)
    prompt = [1 + (7 * i) % 40 for i in range(48)]  # three full blocks of 16 and more
    before = metrics(server)
    for _ in range(2):
        c.completions.create(model="tiny-chat", prompt=prompt, max_tokens=2, temperature=0)
    after = metrics(server)
    assert after["pprun_prefix_cache_enabled"] == 1
    assert after["pprun_prefix_cache_queries_total"] >= before["pprun_prefix_cache_queries_total"] + 2
    assert after["pprun_prefix_cache_hits_total"] >= before["pprun_prefix_cache_hits_total"] + 1
    assert after["pprun_prefix_cache_blocks"] >= 2 and 0 < after["pprun_prefix_cache_hit_rate"] <= 1


def test_chat_equal_offline_streamed_and_not(server, offline):
    c = client(server)
    ref = offline.chat(CHAT, greedy(10))[0].outputs[0]
    whole = c.chat.completions.create(model="tiny-chat", messages=CHAT, max_completion_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True})
    msg = whole.choices[0].message
    assert (msg.role, msg.content, whole.choices[0].finish_reason) == ("assistant", ref.text, "length")
    assert whole.usage.completion_tokens == 10 and whole.usage.total_tokens == whole.usage.prompt_tokens + 10
    stream = c.chat.completions.create(model="tiny-chat", messages=CHAT, max_tokens=10, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert deltas[0].role == "assistant" and "".join(d.content or "" for d in deltas) == ref.text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    assert all(ch.usage is None for ch in chunks[:-1])
    # logprobs: the sampled token's and the top 3, per token.
    lp = c.chat.completions.create(model="tiny-chat", messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                   top_logprobs=3, extra_body={"ignore_eos": True})
    content = lp.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert "".join(t.token for t in content) == offline.chat(CHAT, greedy(4))[0].outputs[0].text
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-4) for t in content)  # greedy: the top one


def test_n2_seeded_choices_equal_offline_seeds(server, offline):
    """n=2 with a seed: choice i is the request seeded seed + i (equal seeds would make equal
    choices), token for token as offline."""
    c = client(server)
    sampled = dict(temperature=1.0, top_k=20, max_tokens=8, ignore_eos=True)
    refs = [offline.chat(CHAT, SamplingParams(seed=41 + i, **sampled))[0].outputs[0].text for i in range(2)]
    assert refs[0] != refs[1]
    whole = c.chat.completions.create(model="tiny-chat", messages=CHAT, n=2, seed=41, temperature=1.0, max_tokens=8,
                                      extra_body={"top_k": 20, "ignore_eos": True})
    assert [ch.message.content for ch in sorted(whole.choices, key=lambda ch: ch.index)] == refs
    assert whole.usage.completion_tokens == 16
    texts = ["", ""]
    for ch in c.chat.completions.create(model="tiny-chat", messages=CHAT, n=2, seed=41, temperature=1.0, max_tokens=8,
                                        stream=True, extra_body={"top_k": 20, "ignore_eos": True}):
        for choice in ch.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == refs


def test_stop_strings(server, offline):
    """A stop string taken from the greedy output ends the answer before it, streamed or not; no
    part of it reaches the client."""
    full = offline.generate([PROMPT], greedy(24))[0].outputs[0].text
    stop = full[9:12]
    ref = offline.generate([PROMPT], greedy(24, stop=[stop, "zz"]))[0].outputs[0]
    assert ref.finish_reason == "stop" and stop not in ref.text
    c = client(server)
    whole = c.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "zz"],
                                 extra_body={"ignore_eos": True})
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (ref.text, "stop")
    pieces = [ch.choices[0].text for ch in c.completions.create(
        model="tiny-chat", prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True,
        extra_body={"ignore_eos": True})]  # fmt: skip
    assert "".join(pieces) == ref.text


@pytest.mark.parametrize("kwargs, param, fragment", [
    ({"top_p": 3}, "top_p", "top_p=3 is invalid: must be a number in (0, 1], or null"),
    ({"temperature": -1}, "temperature", "temperature=-1 is invalid: must be a number >= 0"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens=0 is invalid"),
    ({"max_completion_tokens": 10**9}, "max_completion_tokens",
     "SamplingParams.max_tokens=1000000000 is invalid: the prompt has"),
    ({"logprobs": True, "top_logprobs": -2}, "top_logprobs", "top_logprobs=-2 is invalid"),
    ({"logprobs": True, "top_logprobs": 99}, "top_logprobs", "must be at most model.max_logprobs=20"),
    ({"stop": ["a"] * 17}, "stop", "17 stop strings: at most serve.max_stop_strings=16"),
    ({"stop": [""]}, "stop", "SamplingParams.stop=[''] is invalid"),
    ({"n": 0}, "n", "n=0 is invalid"),
    ({"presence_penalty": 0.5}, "presence_penalty", "presence_penalty=0.5 is not supported"),
    ({"frequency_penalty": 1.0}, "frequency_penalty", "frequency_penalty=1.0 is not supported"),
    ({"extra_body": {"repetition_penalty": 1.2}}, "repetition_penalty", "repetition_penalty=1.2 is not supported"),
    ({"extra_body": {"temprature": 0}}, "temprature", "did you mean 'temperature'"),
    ({"messages": []}, "messages", "messages=[] is invalid"),
    ({"messages": [{"role": "robot", "content": "ab"}]}, "messages", "unknown role robot"),
])  # fmt: skip
def test_bad_parameters_are_400_naming_them(server, kwargs, param, fragment):
    call = {"model": "tiny-chat", "messages": CHAT, **kwargs}
    call.setdefault("max_completion_tokens", 2)
    with pytest.raises(openai.BadRequestError) as info:
        client(server).chat.completions.create(**call)
    err = info.value.body
    assert info.value.status_code == 400 and err["param"] == param and err["type"] == "invalid_request_error"
    assert fragment in err["message"], err["message"]


def test_completions_limits(server):
    """The issue's cases on /v1/completions: max_tokens past the context and logprobs past
    model.max_logprobs are 400s naming the numbers; the server still serves."""
    c = client(server)
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model="tiny-chat", prompt=[1, 5, 9], max_tokens=10**9)
    assert info.value.body["param"] == "max_tokens"
    assert ("max_tokens=1000000000 is invalid: the prompt has 3 tokens and max_model_len=2048 leaves room for 2045"
            in info.value.body["message"])
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=2, logprobs=100)
    assert info.value.body["param"] == "logprobs" and "model.max_logprobs=20" in info.value.body["message"]
    # The completions default (16 tokens) is cut to what a long prompt leaves.
    long = c.completions.create(model="tiny-chat", prompt=[1] * 2040, temperature=0, extra_body={"ignore_eos": True})
    assert long.usage.completion_tokens == 8 and long.choices[0].finish_reason == "length"
    assert metrics(server)["pprun_healthy"] == 1


def test_openapi_describes_the_routes(server):
    doc = httpx.get(f"http://{server.info['http_address']}/openapi.json", headers={"authorization": f"Bearer {TOKEN}"},
                    timeout=30).json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"} <= set(doc["paths"])
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    request = doc["components"]["schemas"][body["$ref"].rsplit("/", 1)[-1]]
    assert {"prompt", "max_tokens", "logprobs", "stop"} <= set(request["properties"])
    assert request["required"] == ["prompt"] and request["additionalProperties"] is False


def test_other_errors(server):
    c = client(server)
    with pytest.raises(openai.NotFoundError) as info:
        c.completions.create(model="other", prompt=PROMPT, max_tokens=2)
    assert info.value.body["code"] == "model_not_found" and "serves 'tiny-chat'" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="prompt: a text prompt|prompt=.* is invalid"):
        c.completions.create(model="tiny-chat", prompt=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match=r"prompt_token_ids\[0\]=256 is outside the vocabulary"):
        c.completions.create(model="tiny-chat", prompt=[256], max_tokens=2)
    raw = httpx.post(base_url(server) + "/completions", content=b"{nope", timeout=30,
                     headers={"authorization": f"Bearer {TOKEN}"})
    assert raw.status_code == 400 and "not valid JSON" in raw.json()["error"]["message"]
    assert metrics(server)["pprun_healthy"] == 1  # still serving


def test_client_disconnect_aborts(server):
    """A client that leaves mid-stream, or before a whole answer, aborts its request: nothing
    stays unfinished and every KV block is back."""
    free_at_start = metrics(server)["pprun_kv_blocks_free"]
    aborted = "aborted: its HTTP client went away"
    num_aborted = server.log().count(aborted)
    c = client(server)
    stream = c.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=2000, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
    next(iter(stream))
    assert metrics(server)["pprun_requests_unfinished"] == 1
    stream.close()
    m = wait_idle(server, free_at_start)
    assert (m["pprun_requests_unfinished"], m["pprun_kv_blocks_free"]) == (0, free_at_start)
    assert server.log().count(aborted) == num_aborted + 1  # aborted, not run to its end
    # Not streamed: the client gives up (its read timeout) and closes the connection.
    with pytest.raises(openai.APITimeoutError):
        client(server, timeout=1.0).completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=2000,
                                                       temperature=0, extra_body={"ignore_eos": True})
    m = wait_idle(server, free_at_start)
    assert (m["pprun_requests_unfinished"], m["pprun_kv_blocks_free"]) == (0, free_at_start)
    assert server.log().count(aborted) == num_aborted + 2


def test_curl_sees_raw_server_sent_events(server, offline):
    ref = offline.chat(CHAT, greedy(6))[0].outputs[0].text
    body = json.dumps({"model": "tiny-chat", "messages": CHAT, "max_tokens": 6, "temperature": 0, "stream": True,
                       "ignore_eos": True})
    out = subprocess.run([CURL, "-sS", "-N", "-i", "-H", f"Authorization: Bearer {TOKEN}", "-H",
                          "Content-Type: application/json", "-d", body, base_url(server) + "/chat/completions"],
                         capture_output=True, text=True, timeout=120, check=True).stdout  # fmt: skip
    head, _, events = out.replace("\r\n", "\n").partition("\n\n")
    assert head.startswith("HTTP/1.1 200") and "content-type: text/event-stream" in head.lower()
    assert events.endswith("data: [DONE]\n\n")
    blocks = events.split("\n\n")[:-1]
    assert all(b.startswith("data: ") and "\n" not in b for b in blocks)
    chunks = [json.loads(b.removeprefix("data: ")) for b in blocks[:-1]]
    assert all(ch["object"] == "chat.completion.chunk" and ch["model"] == "tiny-chat" for ch in chunks)
    assert len({ch["id"] for ch in chunks}) == 1
    assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks) == ref
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


# --- TLS and draining ----------------------------------------------------------------------------


def test_tls_and_drain(chat_llama_dir, tmp_path, offline):
    """Over TLS a client that trusts the certificate is answered (plaintext is not); on SIGTERM
    new requests get 503 and /health 503 while a running stream goes on to its end; exit 0."""
    cert, key = make_self_signed_cert(tmp_path)
    proc = ServerProcess(tmp_path, [
        f"model.model={chat_llama_dir}", "model.dtype=float32", "parallel=single", "serve.engine_process=false",
        "serve.http_port=0", f"serve.tls_cert_file={cert}", f"serve.tls_key_file={key}", "serve.drain_timeout_s=60",
        f"cache.kv_cache_memory_bytes={KV_BLOCKS * KV_BLOCK_BYTES}",
    ])  # fmt: skip
    try:
        url = f"https://{proc.info['http_address']}/v1"
        trusting = ssl.create_default_context(cafile=str(cert))
        c = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120,
                          http_client=httpx.Client(verify=trusting))
        name = proc.info["model"]
        ref, ref_long = (o.outputs[0].text for o in offline.generate([PROMPT, PROMPT], [greedy(6), greedy(600)]))
        assert c.completions.create(model=name, prompt=PROMPT, max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True}).choices[0].text == ref
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://{proc.info['http_address']}/health", timeout=10)
        with pytest.raises(openai.APIConnectionError):
            openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30).models.list()

        pieces: list[str] = []
        first = threading.Event()

        def read_long_stream() -> None:
            for ch in c.completions.create(model=name, prompt=PROMPT, max_tokens=600, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}):
                pieces.append(ch.choices[0].text)
                first.set()

        reader = threading.Thread(target=read_long_stream)
        reader.start()
        assert first.wait(60)
        proc.proc.send_signal(15)
        deadline = time.monotonic() + 30
        while httpx.get(url.removesuffix("/v1") + "/health", verify=trusting, timeout=10).status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(openai.InternalServerError) as info:
            c.completions.create(model=name, prompt=PROMPT, max_tokens=2)
        assert info.value.status_code == 503 and "shutting down" in info.value.body["message"]
        reader.join(120)
        assert "".join(pieces) == ref_long
        assert proc.proc.wait(timeout=120) == 0
    finally:
        proc.kill()
