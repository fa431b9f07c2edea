"""The OpenAI API's bodies without a server (``pprun.serve.openai_api``): parameters into
SamplingParams (with SamplingParams' own validation), choices and seeds, errors and their
statuses, the shapes of streamed chunks."""

from __future__ import annotations

import pytest

from pprun.checks import SEED_MAX
from pprun.core.outputs import Logprobs
from pprun.engine.async_engine import EngineClosedError, QueueFullError
from pprun.engine.inputs import InputProcessor
from pprun.engine.outputs import RequestDelta
from pprun.executor.base import StageFailedError
from pprun.serve import openai_api as oa
from pprun.serve.errors import NotFoundError


class FakeInputs:
    """The real parameter checks (InputProcessor.check_params) for a 256-token vocabulary;
    prompts tokenized one id per character."""

    vocab_size = 256
    check_params = InputProcessor.check_params

    def check_prompt(self, prompt, where):
        if isinstance(prompt, str):
            return prompt, [ord(c) % 256 for c in prompt]
        ids = prompt["prompt_token_ids"]
        if not ids:
            raise ValueError(f"{where}: prompt has 0 tokens; it must have at least 1")
        return None, list(ids)


class FakeEngine:
    """What the parsers ask of an EngineClient: checks, chats."""

    inputs = FakeInputs()
    max_unfinished = 8

    def chat_prompt(self, messages, where, *, add_generation_prompt=True):
        return {"prompt_token_ids": [len(m["content"] or "") + 1 for m in messages]}


def completion(**body):
    return oa.parse_completion({"prompt": "abc", **body}, FakeEngine(), "m")


def chat(**body):
    return oa.parse_chat({"messages": [{"role": "user", "content": "hi"}], **body}, FakeEngine(), "m")


def expect_400(call, param: str, fragment: str) -> None:
    with pytest.raises(oa.OpenAIError) as info:
        call()
    err = info.value
    assert (err.status, err.param) == (400, param), (err.status, err.param, err.message)
    assert fragment in err.message, err.message


def test_defaults_and_names():
    assert completion().params[0].max_tokens == 16  # OpenAI's completions default
    assert chat().params[0].max_tokens is None  # a chat answer runs to the context's end
    assert chat(max_completion_tokens=5).params[0].max_tokens == 5
    assert chat(max_tokens=5, max_completion_tokens=5).params[0].max_tokens == 5
    p = chat(temperature=0.5, top_p=0.9, top_k=3, min_p=0.1, seed=4, stop="x", ignore_eos=True, logprobs=True,
             top_logprobs=2).params[0]
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.stop, p.ignore_eos, p.logprobs) == (
        0.5, 0.9, 3, 0.1, 4, ["x"], True, 2)
    assert chat(logprobs=True).params[0].logprobs == 0  # the sampled token's logprob only
    assert completion(logprobs=3).params[0].logprobs == 3
    # Null is unset, neutral values of unimplemented parameters are taken.
    assert completion(temperature=None, presence_penalty=0, frequency_penalty=0.0, repetition_penalty=1,
                      logit_bias={}, echo=False, best_of=1, user="u").params[0].temperature == 1.0
    chat(tools=[], tool_choice="none", response_format={"type": "text"}, parallel_tool_calls=True)


def test_n_and_seeds():
    req = completion(n=3, seed=7, temperature=1.0)
    assert [p.seed for p in req.params] == [7, 8, 9] and req.n == 3
    assert [p.seed for p in completion(n=2, seed=SEED_MAX).params] == [SEED_MAX, 0]  # stays 64-bit
    assert [p.seed for p in completion(n=2).params] == [None, None]
    two = completion(prompt=[[1, 2], [3]], n=2)
    assert [p["prompt_token_ids"] for p in two.prompts] == [[1, 2], [3]]
    assert len(two.params) == 4 and [two.prompt_of(c) for c in range(4)] == [0, 0, 1, 1]
    assert [p["prompt_token_ids"] for p in completion(prompt=[5, 6]).prompts] == [[5, 6]]
    assert len(completion(prompt=["ab", "cd"]).prompts) == 2
    expect_400(lambda: completion(n=0), "n", "n=0 is invalid: must be an integer in [1, 8]")
    expect_400(lambda: completion(n=9), "n", "n=9 is invalid")


def test_bad_parameters_name_themselves():
    expect_400(lambda: chat(top_p=0), "top_p", "SamplingParams.top_p=0 is invalid: must be a number in (0, 1]")
    expect_400(lambda: chat(max_completion_tokens=0), "max_completion_tokens",
               "max_completion_tokens: SamplingParams.max_tokens=0 is invalid")
    expect_400(lambda: completion(max_tokens="x"), "max_tokens", "SamplingParams.max_tokens='x' is invalid")
    expect_400(lambda: chat(logprobs=True, top_logprobs=300), "top_logprobs", "at most the vocabulary size 256")
    expect_400(lambda: completion(logprobs=-1), "logprobs", "SamplingParams.logprobs=-1 is invalid")
    expect_400(lambda: chat(top_logprobs=2), "top_logprobs", "top_logprobs=2 needs logprobs=true")
    expect_400(lambda: chat(max_tokens=3, max_completion_tokens=4), "max_completion_tokens", "differ")
    expect_400(lambda: chat(seed=2**70), "seed", "SamplingParams.seed=")
    expect_400(lambda: chat(stop=5), "stop", "SamplingParams.stop=5 is invalid")
    expect_400(lambda: chat(stream_options={"include_usage": True}), "stream_options", "only taken with stream=true")
    expect_400(lambda: chat(stream=True, stream_options={"x": 1}), "stream_options", "unknown key(s) ['x']")
    expect_400(lambda: chat(stream="yes"), "stream", "stream='yes' is invalid")
    expect_400(lambda: chat(presence_penalty=0.1), "presence_penalty", "not supported")
    expect_400(lambda: chat(tools=[{"type": "function"}]), "tools", "not supported")
    expect_400(lambda: completion(echo=True), "echo", "not supported")
    expect_400(lambda: chat(echo=True), "echo", "unrecognized request argument 'echo'")
    expect_400(lambda: completion(max_token=3), "max_token", "did you mean 'max_tokens'")
    expect_400(lambda: completion(prompt=[]), "prompt", "prompt=[] is invalid")
    expect_400(lambda: completion(prompt=[[1], []]), "prompt", "prompt[1]: prompt has 0 tokens")
    expect_400(lambda: chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
               "messages[0].content[0]", "text parts only")
    expect_400(lambda: chat(messages=[{"content": "x"}]), "messages[0].role", "role=None is invalid")
    with pytest.raises(oa.OpenAIError) as info:
        chat(model="other")
    assert (info.value.status, info.value.code) == (404, "model_not_found")


def test_errors_from_the_engine():
    cases = [(NotFoundError("x"), 404, "model_not_found"), (QueueFullError("x"), 429, "rate_limit_exceeded"),
             (EngineClosedError("x"), 503, "service_unavailable"), (StageFailedError("x"), 503, "service_unavailable"),
             (ValueError("x"), 400, None), (RuntimeError("x"), 500, "internal_error")]
    for exc, status, code in cases:
        err = oa.error_for(exc)
        assert (err.status, err.code) == (status, code)
        assert set(err.body()["error"]) == {"message", "type", "param", "code"}


def test_chunks():
    text_of = oa.TokenText(None)
    req = completion(logprobs=1, stream=True)
    state = oa.ChoiceState(0)
    lp = Logprobs(-0.5, [7], [-0.5])
    first = oa.choice_chunk(req, state, RequestDelta("r", [7, 8], "", [lp, lp], num_output_tokens=2), text_of)
    assert first["logprobs"]["tokens"] == ["token_id:7", "token_id:8"]
    assert first["logprobs"]["text_offset"] == [0, 10] and first["finish_reason"] is None
    last = oa.choice_chunk(req, state, RequestDelta("r", [9], "", [None], finished=True, finish_reason="length",
                                                    num_prompt_tokens=3, num_output_tokens=3), text_of)
    assert last["finish_reason"] == "length" and last["logprobs"]["token_logprobs"] == [-9999.0]
    assert oa.usage(req, [state]) == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    # Nothing a client sees (text held back, no logprobs or token ids asked): no chunk.
    plain = chat(stream=True)
    s = oa.ChoiceState(0)
    assert oa.choice_chunk(plain, s, RequestDelta("r", [1], ""), text_of) is None
    chunk = oa.choice_chunk(plain, s, RequestDelta("r", [2], "hi"), text_of)
    assert chunk["delta"] == {"role": "assistant", "content": "hi"}
    assert oa.choice_chunk(plain, s, RequestDelta("r", [3], "!"), text_of)["delta"] == {"content": "!"}


def test_http_connections_send_without_nagle():
    """The HTTP server's accepted connections have TCP_NODELAY: with Nagle's algorithm on, a
    stream's first event waits for the client's delayed ACK of the headers."""
    import asyncio
    import socket

    from pprun.serve.http import listening_socket

    async def accepted_nodelay() -> int:
        got: asyncio.Future = asyncio.get_running_loop().create_future()

        class Capture(asyncio.Protocol):
            def connection_made(self, transport):
                got.set_result(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        sock = listening_socket("127.0.0.1", 0)
        server = await asyncio.get_running_loop().create_server(Capture, sock=sock)
        _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        try:
            return await asyncio.wait_for(got, 10)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(accepted_nodelay()) != 0
