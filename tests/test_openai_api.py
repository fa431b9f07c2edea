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
from pprun.serve.settings import RequestLimits


class FakeInputs:
    """The real parameter checks (InputProcessor's) for a 256-token vocabulary, a 64-token context
    and ``max_logprobs=20``; prompts tokenized one id per character."""

    vocab_size = 256
    max_model_len = 64
    max_logprobs = 20
    check_params = InputProcessor.check_params
    output_room = InputProcessor.output_room
    check_output_room = InputProcessor.check_output_room

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


LIMITS = RequestLimits(max_model_len=64, max_unfinished=8, max_choices=6, max_request_output_tokens=200,
                       max_stop_strings=3, max_stop_string_chars=5, max_chat_messages=4, max_content_parts=3)


def completion(**body):
    return oa.parse_completion({"prompt": "abc", **body}, FakeEngine(), "m", LIMITS)


def chat(**body):
    return oa.parse_chat({"messages": [{"role": "user", "content": "hi"}], **body}, FakeEngine(), "m", LIMITS)


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
    expect_400(lambda: completion(n=0), "n", "n=0 is invalid: must be an integer >= 1, or null")
    expect_400(lambda: completion(n=7), "n", "n=7 is too many: a request may have at most 6 choices "
                                            "(serve.max_choices=6)")
    expect_400(lambda: completion(prompt=["ab", "cd"], n=4), "n", "2 prompts x n=4 = 8 choices is too many")


def test_bad_parameters_name_themselves():
    expect_400(lambda: chat(top_p=0), "top_p", "top_p=0 is invalid: must be a number in (0, 1], or null")
    expect_400(lambda: chat(max_completion_tokens=0), "max_completion_tokens",
               "max_completion_tokens=0 is invalid: must be an integer >= 1, or null")
    # SamplingParams' own checks, under the request's name for the field.
    expect_400(lambda: chat(min_tokens=5, max_completion_tokens=4), "min_tokens",
               "SamplingParams.min_tokens=5 is invalid: must be at most max_tokens=4")
    expect_400(lambda: completion(max_tokens="x"), "max_tokens", "max_tokens='x' is invalid: must be an integer >= 1")
    expect_400(lambda: chat(logprobs=True, top_logprobs=300), "top_logprobs", "at most the vocabulary size 256")
    expect_400(lambda: chat(logprobs=True, top_logprobs=21), "top_logprobs",
               "SamplingParams.logprobs=21 is invalid: must be at most model.max_logprobs=20")
    expect_400(lambda: completion(logprobs=21), "logprobs", "must be at most model.max_logprobs=20")
    expect_400(lambda: completion(logprobs=-1), "logprobs", "logprobs=-1 is invalid: must be an integer >= 0")
    expect_400(lambda: chat(top_logprobs=2), "top_logprobs", "top_logprobs=2 needs logprobs=true")
    expect_400(lambda: chat(max_tokens=3, max_completion_tokens=4), "max_completion_tokens", "differ")
    expect_400(lambda: chat(seed=2**70), "seed", "seed=1180591620717411303424 is invalid: must be an integer in [")
    expect_400(lambda: chat(stop=5), "stop", "stop=5 is invalid: must be a string, a list (each item a string), "
                                             "or null")
    expect_400(lambda: chat(stream_options={"include_usage": True}), "stream_options", "only taken with stream=true")
    expect_400(lambda: chat(stream=True, stream_options={"x": 1}), "stream_options.x",
               "stream_options.x is unknown: stream_options takes the keys ['include_usage']")
    expect_400(lambda: chat(stream="yes"), "stream", "stream='yes' is invalid: must be true or false")
    expect_400(lambda: chat(presence_penalty=0.1), "presence_penalty", "not supported")
    expect_400(lambda: chat(tools=[{"type": "function"}]), "tools", "not supported")
    expect_400(lambda: completion(echo=True), "echo", "not supported")
    expect_400(lambda: chat(echo=True), "echo", "unrecognized request argument 'echo'")
    expect_400(lambda: completion(max_token=3), "max_token", "did you mean 'max_tokens'")
    expect_400(lambda: completion(prompt=[]), "prompt", "prompt=[] is invalid")
    expect_400(lambda: completion(prompt=[[1], []]), "prompt", "prompt[1]: prompt has 0 tokens")
    expect_400(lambda: chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
               "messages[0].content[0].type", "messages[0].content[0].type='image_url' is invalid: must be 'text'")
    expect_400(lambda: chat(messages=[{"content": "x"}]), "messages[0].role", "messages[0].role is required")
    with pytest.raises(oa.OpenAIError) as info:
        chat(model="other")
    assert (info.value.status, info.value.code) == (404, "model_not_found")


def test_max_tokens_against_the_context():
    """``max_tokens`` past what the 64-token context leaves after the prompt is a 400 naming both
    numbers; the completions default (16) is cut to the room instead; a chat without one runs to
    the context's end."""
    expect_400(lambda: completion(prompt=[1] * 10, max_tokens=55), "max_tokens",
               "SamplingParams.max_tokens=55 is invalid: the prompt has 10 tokens and max_model_len=64 leaves "
               "room for 54 output tokens")
    assert completion(prompt=[1] * 10, max_tokens=54).params[0].max_tokens == 54
    expect_400(lambda: chat(max_completion_tokens=10**9), "max_completion_tokens", "max_tokens=1000000000 is invalid")
    # Per prompt: the second prompt leaves less room.
    expect_400(lambda: completion(prompt=[[1], [1] * 60], max_tokens=5), "max_tokens", "the prompt has 60 tokens")
    cut = completion(prompt=[[1], [1] * 60], n=2)
    assert [p.max_tokens for p in cut.params] == [16, 16, 4, 4]
    assert chat().params[0].max_tokens is None


def test_request_limits():
    """The server's per-request limits: each a 400 naming the setting."""
    expect_400(lambda: completion(stop=["a", "b", "c", "d"]), "stop", "4 stop strings: at most serve.max_stop_strings=3")
    expect_400(lambda: chat(stop="abcdef"), "stop", "stop[0] has 6 characters: a stop string may have at most "
                                                    "serve.max_stop_string_chars=5")
    expect_400(lambda: chat(messages=[{"role": "user", "content": "a"}] * 5), "messages",
               "messages has 5 messages: at most serve.max_chat_messages=4")
    parts = [{"type": "text", "text": "a"}] * 2
    expect_400(lambda: chat(messages=[{"role": "user", "content": parts}] * 2), "messages",
               "messages has 4 content parts: at most serve.max_content_parts=3")
    # Output tokens over all choices: 4 choices x 60 > 200; a chat without max_tokens counts its room.
    expect_400(lambda: completion(n=4, max_tokens=60), "max_tokens",
               "up to 240 output tokens over its 4 choices")
    expect_400(lambda: chat(n=4), "max_tokens", "at most serve.max_request_output_tokens=200")
    assert len(completion(n=3, max_tokens=60).params) == 3


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
