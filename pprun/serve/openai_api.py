"""The OpenAI API's bodies: ``/v1/completions`` and ``/v1/chat/completions`` requests read into
token-id prompts and :class:`~pprun.sampling.params.SamplingParams`, and the engine's deltas
written as OpenAI's answers and streamed chunks.  No HTTP here: ``pprun.serve.http`` serves it.

A body is checked in this order, and the first failure is a 400 naming the field (``param``), its
value and what is allowed: unknown keys (with the closest known one); the declared schema
(``pprun.serve.protocol``: types, ranges); parameters pprun does not implement (penalties, logit
bias, tools) unless they hold their neutral value; the model; ``SamplingParams.validate`` and the
engine's own checks (``param`` is the OpenAI name the client used, ``max_completion_tokens``,
``top_logprobs``, with ``SamplingParams``' message); the server's per-request limits
(``pprun.serve.settings.RequestLimits``); the prompts, and each choice's ``max_tokens`` against
what the context leaves after its prompt.  Nothing is queued before every check has passed.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from pprun.checks import SEED_MAX, is_int
from pprun.engine.async_engine import EngineClient, EngineClosedError, QueueFullError
from pprun.engine.outputs import RequestDelta
from pprun.executor.base import StageFailedError
from pprun.sampling.params import SamplingParams
from pprun.serve import protocol
from pprun.serve.errors import NotFoundError
from pprun.serve.settings import RequestLimitError, RequestLimits


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``
    with an HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None) -> None:  # noqa: A002 (OpenAI's key)
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code

    def body(self) -> dict:
        """The JSON body OpenAI's clients read the error from."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_for(exc: BaseException, param: str | None = None) -> OpenAIError:
    """The OpenAI error an exception from the engine answers: bad input 400, unknown model 404,
    queue full 429, draining or a failed stage 503, anything else (a bug) 500."""
    if isinstance(exc, OpenAIError):
        return exc
    text = str(exc) or type(exc).__name__
    if isinstance(exc, NotFoundError):
        return OpenAIError(404, text, param=param, code="model_not_found")
    if isinstance(exc, QueueFullError):
        return OpenAIError(429, text, type="rate_limit_error", code="rate_limit_exceeded")
    if isinstance(exc, (EngineClosedError, StageFailedError)):
        return OpenAIError(503, text, type="server_error", code="service_unavailable")
    if isinstance(exc, RequestLimitError):
        return OpenAIError(400, text, param=exc.param or param)
    if isinstance(exc, (ValueError, TypeError)):
        return OpenAIError(400, text, param=param)
    return OpenAIError(500, f"internal error: {type(exc).__name__}: {text}", type="server_error", code="internal_error")


# --- requests --------------------------------------------------------------------------------------

_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "ignore_eos", "min_tokens",
             "stop_token_ids", "skip_special_tokens")  # fmt: skip
"""Request keys that are SamplingParams fields of the same name (top_k, min_p, ignore_eos,
min_tokens, stop_token_ids and skip_special_tokens are extensions, as vLLM takes them)."""

NEUTRAL: dict[str, tuple[tuple[object, ...], str]] = {
    "presence_penalty": ((0, 0.0), "pprun does not implement penalties; leave it unset or 0"),
    "frequency_penalty": ((0, 0.0), "pprun does not implement penalties; leave it unset or 0"),
    "repetition_penalty": ((1, 1.0), "pprun does not implement penalties; leave it unset or 1"),
    "logit_bias": (({},), "pprun does not implement logit bias; leave it unset or {}"),
    "best_of": ((1,), "pprun does not rank candidates; use n"),
    "echo": ((False,), "the prompt is not echoed; leave it unset or false"),
    "suffix": (("",), "pprun does not insert text; leave it unset"),
    "tools": (([],), "pprun does not call tools; leave it unset"),
    "tool_choice": (("none",), "pprun does not call tools; leave it unset or 'none'"),
    "functions": (([],), "pprun does not call functions; leave it unset"),
    "function_call": (("none",), "pprun does not call functions; leave it unset or 'none'"),
    "response_format": (({"type": "text"},), "only plain text is produced; leave it unset or {'type': 'text'}"),
}
"""Parameters taken only at their neutral value (or null): anything else is a 400 naming them."""

COMPLETION_KEYS = frozenset(protocol.CompletionRequest.model_fields)
"""Keys a ``/v1/completions`` body may have (``pprun.serve.protocol.CompletionRequest``)."""
CHAT_KEYS = frozenset(protocol.ChatCompletionRequest.model_fields)
"""Keys a ``/v1/chat/completions`` body may have (``pprun.serve.protocol.ChatCompletionRequest``)."""
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's ``max_tokens`` of a completion that gives none (cut to what the context leaves)."""

_FIELD_IN_MESSAGE = re.compile(r"SamplingParams\.(\w+)=")


@dataclass
class ParsedRequest:
    """A completions or chat request read into what the engine takes."""

    chat: bool
    prompts: list[dict]
    """Token-id prompts (``{"prompt_token_ids": [...]}``), one per prompt of the request."""
    params: list[SamplingParams]
    """``n`` per prompt, in choice order: choice ``p * n + i`` is prompt ``p``'s ``i``-th (a seeded
    request's choices get seeds ``seed``, ``seed + 1``, ...: equal seeds would give equal choices)."""
    n: int
    stream: bool
    include_usage: bool
    logprobs: bool
    """Whether each token's logprobs are returned."""
    return_token_ids: bool = False
    return_timings: bool = False

    def prompt_of(self, choice: int) -> int:
        """The prompt a choice answers."""
        return choice // self.n


def _check_keys(body: dict, allowed: frozenset[str], endpoint: str) -> None:
    for key in body:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), sorted(allowed), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise OpenAIError(400, f"unrecognized request argument {key!r} for {endpoint}{hint} "
                                   f"(allowed: {', '.join(sorted(allowed))})", param=str(key))


def _check_schema(body: dict, model: type[BaseModel]) -> None:
    """The body against its declared schema: a 400 naming the first field that breaks it."""
    try:
        model.model_validate(body)
    except ValidationError as e:
        message, param = protocol.explain(e, model, body)
        raise OpenAIError(400, message, param=param) from None


def _check_neutral(body: dict) -> None:
    for key, (neutral, why) in NEUTRAL.items():
        value = body.get(key)
        if value is not None and not any(value == v and type(value) is type(v) for v in neutral):
            raise OpenAIError(400, f"{key}={value!r} is not supported: {why}", param=key)


def _flag(body: dict, key: str, default: bool = False) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise OpenAIError(400, f"{key}={value!r} is invalid: must be true or false", param=key)
    return value


def _check_sampling(engine: EngineClient, params: SamplingParams, names: dict[str, str],
                    num_prompt_tokens: int | None = None) -> None:
    """SamplingParams' own validation and the engine's bounds (vocabulary, ``model.max_logprobs``;
    with ``num_prompt_tokens``, ``max_tokens`` against what the context leaves after the prompt);
    a failure is a 400 whose ``param`` is the request's name for the field."""
    try:
        if num_prompt_tokens is None:
            engine.inputs.check_params(params, "request")
        else:
            engine.inputs.check_output_room(num_prompt_tokens, params, "request")
    except ValueError as e:
        message = str(e).removeprefix("request: ")
        found = _FIELD_IN_MESSAGE.search(message)
        field_name = found.group(1) if found else None
        param = names.get(field_name, field_name) if field_name else None
        if param is not None and param != field_name:
            message = f"{param}: {message}"
        raise OpenAIError(400, message, param=param) from None


def _sampling(body: dict, engine: EngineClient, limits: RequestLimits, *,
              chat: bool) -> tuple[SamplingParams, int, dict[str, str], bool]:
    """The request's SamplingParams (checked), n, the request's names of the fields, and whether
    ``max_tokens`` is the completions default (cut to each prompt's room, not refused)."""
    names = {f: f for f in _SAMPLING}
    values: dict[str, Any] = {f: body[f] for f in _SAMPLING if body.get(f) is not None}
    max_tokens, max_completion = body.get("max_tokens"), body.get("max_completion_tokens")
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise OpenAIError(400, f"max_tokens={max_tokens!r} and max_completion_tokens={max_completion!r} differ: "
                               "give one", param="max_completion_tokens")
    if max_completion is not None:
        values["max_tokens"], names["max_tokens"] = max_completion, "max_completion_tokens"
    elif max_tokens is not None:
        values["max_tokens"], names["max_tokens"] = max_tokens, "max_tokens"
    else:
        # OpenAI's defaults: a completion stops after 16 tokens, a chat answer at the context's end.
        values["max_tokens"] = None if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
    if chat:
        logprobs, top = _flag(body, "logprobs"), body.get("top_logprobs")
        if top is not None and not logprobs:
            raise OpenAIError(400, f"top_logprobs={top!r} needs logprobs=true", param="top_logprobs")
        if logprobs:
            values["logprobs"], names["logprobs"] = (0 if top is None else top), "top_logprobs"
    elif body.get("logprobs") is not None:
        values["logprobs"], names["logprobs"] = body["logprobs"], "logprobs"
    n = body.get("n")
    n = 1 if n is None else n
    if not is_int(n) or n < 1:
        raise OpenAIError(400, f"n={n!r} is invalid: must be an integer >= 1", param="n")
    limits.check_choices(1, n)
    first = SamplingParams(**values)
    _check_sampling(engine, first, names)
    limits.check_stop(first.stop, "stop")
    defaulted = not chat and max_tokens is None and max_completion is None
    return first, n, names, defaulted


def _choices(req_params: SamplingParams, n: int, prompts: list[list[int]], names: dict[str, str],
             defaulted: bool, engine: EngineClient, limits: RequestLimits) -> list[SamplingParams]:
    """One SamplingParams per choice (``n`` per prompt, in order), each prompt's ``max_tokens``
    checked against what its context leaves (the completions default cut to it), and the
    request's choices and output tokens within the server's limits."""
    limits.check_choices(len(prompts), n)
    per_prompt = []
    for ids in prompts:
        room = engine.inputs.output_room(len(ids))
        params = req_params
        if defaulted and params.max_tokens > room:
            params = dataclasses.replace(params, max_tokens=room)
        _check_sampling(engine, params, names, len(ids))
        per_prompt.append(params)
    limits.check_output_tokens([room if p.max_tokens is None else p.max_tokens
                                for p, room in zip(per_prompt, (engine.inputs.output_room(len(i)) for i in prompts))
                                for _ in range(n)], names.get("max_tokens", "max_tokens"))
    params = []
    for first in per_prompt:
        params.append(first)
        for i in range(1, n):
            child = dataclasses.replace(first)
            if first.seed is not None:
                seed = first.seed + i
                child.seed = seed - 2**64 if seed > SEED_MAX else seed  # stays a 64-bit seed
            params.append(child)
    return params


def _stream_options(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise OpenAIError(400, "stream_options is only taken with stream=true", param="stream_options")
    if not isinstance(options, dict):
        raise OpenAIError(400, f"stream_options={options!r} is invalid: must be an object such as "
                               "{'include_usage': true}", param="stream_options")
    unknown = sorted(set(options) - {"include_usage"})
    if unknown:
        raise OpenAIError(400, f"stream_options has unknown key(s) {unknown}: only 'include_usage' is taken",
                          param="stream_options")
    value = options.get("include_usage")
    if value is not None and not isinstance(value, bool):
        raise OpenAIError(400, f"stream_options.include_usage={value!r} is invalid: must be true or false",
                          param="stream_options.include_usage")
    return bool(value)


def check_model(body: dict, served: str) -> None:
    """A 404 unless ``model`` is unset or the served model's name."""
    name = body.get("model")
    if name is not None and name != served:
        raise OpenAIError(404, f"model={name!r} is not served here: this server serves {served!r}",
                          param="model", code="model_not_found")


def _common(body: dict, served: str, model: type[BaseModel], endpoint: str) -> tuple[bool, bool]:
    if not isinstance(body, dict):
        raise OpenAIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    _check_keys(body, frozenset(model.model_fields), endpoint)
    _check_schema(body, model)
    _check_neutral(body)
    check_model(body, served)
    stream = _flag(body, "stream")
    return stream, _stream_options(body, stream)


def _limits_as_errors(parse: Any, body: Any, engine: EngineClient, served: str, limits: RequestLimits) -> ParsedRequest:
    """``parse(...)``, a request limit it meets raised as the :class:`OpenAIError` (a 400) it is."""
    try:
        return parse(body, engine, served, limits)
    except RequestLimitError as e:
        raise error_for(e) from None


def parse_completion(body: Any, engine: EngineClient, served: str, limits: RequestLimits) -> ParsedRequest:
    """A ``/v1/completions`` body: ``prompt`` is a string, a list of strings, a list of token
    ids or a list of such lists (one choice set per prompt).  Raises :class:`OpenAIError`."""
    return _limits_as_errors(_parse_completion, body, engine, served, limits)


def _parse_completion(body: Any, engine: EngineClient, served: str, limits: RequestLimits) -> ParsedRequest:
    stream, include_usage = _common(body, served, protocol.CompletionRequest, "/v1/completions")
    first, n, names, defaulted = _sampling(body, engine, limits, chat=False)
    raw = body.get("prompt")
    # A list of token ids is told from a list of prompts at C speed (the set of element types):
    # a burst of requests is read one after another on the event loop.
    if isinstance(raw, str) or (isinstance(raw, list) and raw and set(map(type, raw)) == {int}):
        raw = [raw]
    if not isinstance(raw, list) or not raw or not all(isinstance(p, (str, list)) for p in raw):
        raise OpenAIError(400, f"prompt={_short(raw)} is invalid: must be a non-empty string, a list of token "
                               "ids, or a non-empty list of either", param="prompt")
    prompts = []
    for i, prompt in enumerate(raw):
        where = "prompt" if len(raw) == 1 else f"prompt[{i}]"
        given = prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}
        try:  # the parameters are checked already (add_request checks everything again)
            _, ids = engine.inputs.check_prompt(given, f"{where}.prompt")
        except ValueError as e:
            raise OpenAIError(400, str(e).replace(f"{where}.prompt", where, 1), param="prompt") from None
        prompts.append({"prompt_token_ids": ids})
    params = _choices(first, n, [p["prompt_token_ids"] for p in prompts], names, defaulted, engine, limits)
    return ParsedRequest(False, prompts, params, n, stream, include_usage,
                         logprobs=first.logprobs is not None, return_token_ids=_flag(body, "return_token_ids"),
                         return_timings=_flag(body, "return_timings"))


def parse_chat(body: Any, engine: EngineClient, served: str, limits: RequestLimits) -> ParsedRequest:
    """A ``/v1/chat/completions`` body: ``messages`` rendered with the model's chat template.
    Content is a string or a list of text parts; image parts are refused (images are taken
    offline only).  Raises :class:`OpenAIError`."""
    return _limits_as_errors(_parse_chat, body, engine, served, limits)


def _parse_chat(body: Any, engine: EngineClient, served: str, limits: RequestLimits) -> ParsedRequest:
    stream, include_usage = _common(body, served, protocol.ChatCompletionRequest, "/v1/chat/completions")
    first, n, names, _ = _sampling(body, engine, limits, chat=True)
    messages = body.get("messages")
    limits.check_messages(messages, "messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise OpenAIError(400, f"messages={_short(messages)} is invalid: must be a non-empty list of "
                               "{role, content} objects", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message.get("role"), str):
            raise OpenAIError(400, f"messages[{i}].role={message.get('role')!r} is invalid: must be a string "
                                   "such as 'user'", param=f"messages[{i}].role")
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise OpenAIError(400, f"messages[{i}].content[{j}] has type {kind!r}: this server takes "
                                           "text parts only", param=f"messages[{i}].content[{j}]")
        elif content is not None and not isinstance(content, str):
            raise OpenAIError(400, f"messages[{i}].content={_short(content)} is invalid: must be a string or a "
                                   "list of text parts", param=f"messages[{i}].content")
    try:
        rendered = engine.chat_prompt(messages, "messages", add_generation_prompt=_flag(body, "add_generation_prompt", True))
        _, ids = engine.inputs.check_prompt({"prompt_token_ids": rendered["prompt_token_ids"]}, "messages.prompt")
    except ValueError as e:
        raise OpenAIError(400, str(e).replace("messages.prompt", "messages", 1), param="messages") from None
    params = _choices(first, n, [ids], names, False, engine, limits)
    return ParsedRequest(True, [{"prompt_token_ids": ids}], params, n, stream, include_usage,
                         logprobs=first.logprobs is not None, return_token_ids=_flag(body, "return_token_ids"),
                         return_timings=_flag(body, "return_timings"))


# --- answers ---------------------------------------------------------------------------------------

FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}


def _finite(value: float) -> float:
    """A logprob JSON can carry (-inf, a suppressed token's, as vLLM writes it)."""
    return value if math.isfinite(value) else -9999.0


class TokenText:
    """Token ids as the strings OpenAI's logprobs name them by (each token decoded alone;
    ``token_id:<id>`` for a model without a tokenizer)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, token_id: int) -> str:
        """The token's text."""
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])


@dataclass
class ChoiceState:
    """What one choice has sent so far (its logprobs offsets) and, at its end, its totals."""

    index: int
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    text_offset: int = 0
    """Characters of the choice's tokens so far (completions logprobs' ``text_offset``)."""
    role_sent: bool = False
    """A chat choice's role goes in its first chunk only."""
    finished: bool = False
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    last: RequestDelta | None = None


def chat_logprobs(delta: RequestDelta, text_of: TokenText) -> list[dict]:
    """The delta's tokens as chat ``logprobs.content`` entries."""
    out = []
    for token_id, lp in zip(delta.token_ids, delta.logprobs or ()):
        token = text_of(token_id)
        entry = {"token": token, "logprob": _finite(lp.sampled_logprob) if lp else -9999.0,
                 "bytes": list(token.encode()), "top_logprobs": []}
        if lp is not None:
            for top_id, top_lp in zip(lp.top_token_ids, lp.top_logprobs):
                top = text_of(top_id)
                entry["top_logprobs"].append({"token": top, "logprob": _finite(top_lp), "bytes": list(top.encode())})
        out.append(entry)
    return out


def completion_logprobs(delta: RequestDelta, text_of: TokenText, state: ChoiceState) -> dict:
    """The delta's tokens as completions ``logprobs`` (tokens, their logprobs, the top ones and
    each token's offset in the choice's text)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for token_id, lp in zip(delta.token_ids, delta.logprobs or ()):
        token = text_of(token_id)
        tokens.append(token)
        token_lps.append(_finite(lp.sampled_logprob) if lp else -9999.0)
        tops.append({text_of(t): _finite(v) for t, v in zip(lp.top_token_ids, lp.top_logprobs)} if lp else None)
        offsets.append(state.text_offset)
        state.text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def timings(delta: RequestDelta) -> dict | None:
    """The engine's timings of a finished request (``return_timings``)."""
    m = delta.metrics
    if m is None:
        return None
    return {"arrival_time": m.arrival_time, "first_token_time": m.first_token_time,
            "finished_time": m.finished_time, "time_to_first_token_s": m.time_to_first_token,
            "time_per_output_token_s": m.time_per_output_token}


def usage(req: ParsedRequest, states: list[ChoiceState]) -> dict:
    """Tokens of the whole request: each prompt counted once, every choice's output."""
    prompt_tokens = sum(states[p * req.n].num_prompt_tokens for p in range(len(req.prompts)))
    completion_tokens = sum(s.num_output_tokens for s in states)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice_chunk(req: ParsedRequest, state: ChoiceState, delta: RequestDelta, text_of: TokenText) -> dict | None:
    """One delta of one choice as a streamed choice (None when it adds nothing a client sees:
    text held back, no logprobs asked)."""
    state.num_prompt_tokens, state.num_output_tokens = delta.num_prompt_tokens, delta.num_output_tokens
    if not delta.finished and not delta.text and not (delta.token_ids and (req.logprobs or req.return_token_ids)):
        return None
    choice: dict[str, Any] = {"index": state.index}
    if req.chat:
        content: dict[str, Any] = {"content": delta.text}
        if not state.role_sent:
            content, state.role_sent = {"role": "assistant", **content}, True
        choice["delta"] = content
        choice["logprobs"] = {"content": chat_logprobs(delta, text_of)} if req.logprobs else None
    else:
        choice["text"] = delta.text
        choice["logprobs"] = completion_logprobs(delta, text_of, state) if req.logprobs else None
    if req.return_token_ids:
        choice["token_ids"] = delta.token_ids
    choice["finish_reason"] = FINISH_REASONS.get(delta.finish_reason or "", None) if delta.finished else None
    if delta.finished:
        state.finished = True
        choice["stop_reason"] = delta.stop_reason
        if req.return_timings:
            choice["timings"] = timings(delta)
    return choice


def add_to_answer(req: ParsedRequest, state: ChoiceState, delta: RequestDelta, text_of: TokenText) -> None:
    """Collect one delta of one choice for the whole (non-streamed) answer."""
    state.texts.append(delta.text)
    state.token_ids += delta.token_ids
    if req.logprobs:
        if req.chat:
            state.logprobs += chat_logprobs(delta, text_of)
        else:
            state.logprobs.append(completion_logprobs(delta, text_of, state))
    state.num_prompt_tokens, state.num_output_tokens = delta.num_prompt_tokens, delta.num_output_tokens
    if delta.finished:
        state.finished, state.last = True, delta


def answer_choice(req: ParsedRequest, state: ChoiceState) -> dict:
    """One choice of the whole answer."""
    last = state.last
    text = "".join(state.texts)
    choice: dict[str, Any] = {"index": state.index}
    if req.chat:
        choice["message"] = {"role": "assistant", "content": text}
        choice["logprobs"] = {"content": state.logprobs} if req.logprobs else None
    else:
        choice["text"] = text
        if req.logprobs:
            parts = state.logprobs
            choice["logprobs"] = {k: [v for p in parts for v in p[k]] for k in ("tokens", "token_logprobs",
                                                                            "top_logprobs", "text_offset")}
        else:
            choice["logprobs"] = None
    if req.return_token_ids:
        choice["token_ids"] = state.token_ids
    choice["finish_reason"] = FINISH_REASONS.get(last.finish_reason or "", None) if last else None
    choice["stop_reason"] = last.stop_reason if last else None
    if req.return_timings and last is not None:
        choice["timings"] = timings(last)
    return choice


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
