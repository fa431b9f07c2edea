"""The OpenAI HTTP API's request and response schemas, declared once as pydantic models (as
vLLM's ``entrypoints/openai/protocol.py``): the server validates every body against them, serves
them as ``/openapi.json`` and names what they allow when a body breaks them; tests check the
server's answers against the response models.

Requests are strict (no coercion: ``"5"`` is not an integer, ``1`` is not ``true``) and refuse
unknown keys.  What depends on the model or the server's settings (vocabulary, context length,
``model.max_logprobs``, ``serve.max_*``) is checked after the schema, by the engine and
``pprun.serve.settings.RequestLimits``; parameters pprun takes only at their neutral value
(penalties, logit bias, tools) are declared with their types and checked by
``pprun.serve.openai_api``.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.json_schema import models_json_schema

from pprun.checks import SEED_MAX, SEED_MIN

_REF = "#/components/schemas/{model}"


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


PositiveInt = Annotated[int, Field(ge=1)]
TokenId = Annotated[int, Field(ge=0)]


class StreamOptions(_Request):
    """Options of a streamed answer."""

    include_usage: bool | None = Field(None, description="A last chunk with the request's token usage.")


class TextPart(_Request):
    """A text part of a chat message's content (the only kind this server takes)."""

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat turn; keys beyond ``role`` and ``content`` go to the chat template as given."""

    model_config = ConfigDict(strict=True, extra="allow")

    role: str = Field(description="system, user, assistant, ... (as the model's chat template takes them).")
    content: str | list[TextPart] | None = None


class _SamplingRequest(_Request):
    """What completions and chat requests share."""

    model: str | None = Field(None, description="The served model's name (GET /v1/models); unset: that one.")
    n: PositiveInt | None = Field(None, description="Choices per prompt (at most serve.max_choices over the request).")
    stream: bool | None = Field(None, description="Answer with server-sent events, one chunk per engine step.")
    stream_options: StreamOptions | None = None
    max_tokens: PositiveInt | None = Field(
        None, description="Most tokens per choice; more than max_model_len minus the prompt's tokens is refused.")
    temperature: Annotated[float, Field(ge=0)] | None = Field(None, description="0 is greedy.")
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = Field(None, description="-1 or 0 keeps every token (extension).")
    min_p: Annotated[float, Field(ge=0, le=1)] | None = Field(None, description="Extension, as vLLM takes it.")
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = Field(
        None, description="Choice i of a seeded request is seeded seed + i.")
    stop: str | list[str] | None = Field(
        None, description="Strings that end a choice (at most serve.max_stop_strings, each at most "
                          "serve.max_stop_string_chars characters).")
    ignore_eos: bool | None = Field(None, description="Extension: generate past the end-of-sequence token.")
    min_tokens: Annotated[int, Field(ge=0)] | None = Field(None, description="Extension.")
    stop_token_ids: list[TokenId] | None = Field(None, description="Extension: token ids that end a choice.")
    skip_special_tokens: bool | None = Field(None, description="Extension.")
    presence_penalty: float | None = Field(None, description="Not implemented: only 0 is taken.")
    frequency_penalty: float | None = Field(None, description="Not implemented: only 0 is taken.")
    repetition_penalty: float | None = Field(None, description="Not implemented: only 1 is taken.")
    logit_bias: dict[str, float] | None = Field(None, description="Not implemented: only {} is taken.")
    user: str | None = Field(None, description="Taken and ignored.")
    return_token_ids: bool | None = Field(None, description="Extension: each choice's token ids.")
    return_timings: bool | None = Field(None, description="Extension: the engine's timings in each choice's end.")


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]] = Field(
        description="A string, a list of token ids, or a list of either (a choice set per prompt).")
    logprobs: Annotated[int, Field(ge=0)] | None = Field(
        None, description="The sampled token's logprob and the top ones (at most model.max_logprobs).")
    best_of: int | None = Field(None, description="Not implemented: only 1 is taken.")
    echo: bool | None = Field(None, description="Not implemented: only false is taken.")
    suffix: str | None = Field(None, description="Not implemented: only '' is taken.")


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(
        min_length=1, description="The conversation (at most serve.max_chat_messages messages, "
                                  "serve.max_content_parts content parts).")
    max_completion_tokens: PositiveInt | None = Field(None, description="max_tokens' newer name.")
    logprobs: bool | None = Field(None, description="Return each token's logprob.")
    top_logprobs: Annotated[int, Field(ge=0)] | None = Field(
        None, description="And the top ones' (at most model.max_logprobs; needs logprobs=true).")
    add_generation_prompt: bool | None = Field(None, description="Extension: end with the assistant's header.")
    tools: list[Any] | None = Field(None, description="Not implemented: only [] is taken.")
    tool_choice: Any = Field(None, description="Not implemented: only 'none' is taken.")
    functions: list[Any] | None = Field(None, description="Not implemented: only [] is taken.")
    function_call: Any = Field(None, description="Not implemented: only 'none' is taken.")
    response_format: dict[str, Any] | None = Field(None, description="Only {'type': 'text'} is taken.")
    parallel_tool_calls: bool | None = Field(None, description="Taken and ignored.")


# --- responses -------------------------------------------------------------------------------------

FinishReason = Literal["stop", "length", "abort", "error"]


class ErrorBody(_Response):
    """What went wrong: ``param`` names the request field, ``message`` its value and what is allowed."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Response):
    """Every error, in OpenAI's shape."""

    error: ErrorBody


class ModelCard(_Response):
    """The served model."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(_Response):
    """``GET /v1/models``."""

    object: Literal["list"]
    data: list[ModelCard]


class Usage(_Response):
    """Tokens of the whole request: each prompt once, every choice's output."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Timings(_Response):
    """The engine's timings of a choice (``return_timings``)."""

    arrival_time: float
    first_token_time: float | None
    finished_time: float | None
    time_to_first_token_s: float | None
    time_per_output_token_s: float | None


class CompletionLogprobs(_Response):
    """Completions' logprobs: per token its text, logprob, top alternatives and text offset."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Response):
    """One choice of a completion (whole, or a streamed chunk's piece)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None
    timings: Timings | None = None


class CompletionResponse(_Response):
    """``POST /v1/completions`` answered whole (``object`` text_completion); streamed, each
    chunk has this shape with the choices it updates, then one with ``usage`` when asked."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(_Response):
    """An alternative token's logprob."""

    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    """A sampled token's logprob and the top alternatives'."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    """Chat logprobs: one entry per token."""

    content: list[TokenLogprob]


class AssistantMessage(_Response):
    """The answer of a chat choice."""

    role: Literal["assistant"]
    content: str


class ChatChoice(_Response):
    """One choice of a whole chat answer."""

    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None
    timings: Timings | None = None


class ChatCompletionResponse(_Response):
    """``POST /v1/chat/completions`` answered whole."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(_Response):
    """What a chunk adds to a chat choice (the role in its first chunk only)."""

    role: Literal["assistant"] | None = None
    content: str


class ChatChunkChoice(_Response):
    """One choice's piece of a streamed chat chunk."""

    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None
    timings: Timings | None = None


class ChatCompletionChunk(_Response):
    """One server-sent event of a streamed chat answer (then ``data: [DONE]``)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# --- the OpenAPI document --------------------------------------------------------------------------

_SCHEMA_MODELS: tuple[type[BaseModel], ...] = (
    CompletionRequest, ChatCompletionRequest, CompletionResponse, ChatCompletionResponse, ChatCompletionChunk,
    ErrorResponse, ModelList, ModelCard,
)  # fmt: skip


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": _REF.format(model=model.__name__)}


def _errors(*statuses: int) -> dict:
    reasons = {400: "Bad input: names the field, its value and what is allowed", 401: "No or a wrong bearer token",
               404: "Unknown model or route", 405: "Method not allowed on this route",
               413: "Body over serve.max_message_bytes", 429: "The queue is full: retry later",
               503: "Draining, or a stage failed"}  # fmt: skip
    return {str(s): {"description": reasons[s], "content": {"application/json": {"schema": _ref(ErrorResponse)}}}
            for s in statuses}


def _generation(request: type[BaseModel], answer: type[BaseModel], chunk: type[BaseModel], summary: str) -> dict:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {
            "200": {"description": "The answer (whole), or server-sent events `data: <chunk>` then `data: [DONE]` "
                                   "(stream=true)",
                    "content": {"application/json": {"schema": _ref(answer)},
                                "text/event-stream": {"schema": _ref(chunk)}}},
            **_errors(400, 401, 404, 413, 429, 503),
        },
    }}  # fmt: skip


def openapi_document(title: str = "pprun OpenAI-compatible API", version: str = "0") -> dict:
    """The OpenAPI 3.1 document of the HTTP API, its schemas from the models above."""
    _, top = models_json_schema([(m, "validation") for m in _SCHEMA_MODELS], ref_template=_REF)
    text = {"description": "OK", "content": {"text/plain": {"schema": {"type": "string"}}}}
    paths = {
        "/v1/completions": _generation(CompletionRequest, CompletionResponse, CompletionResponse, "Complete prompts"),
        "/v1/chat/completions": _generation(ChatCompletionRequest, ChatCompletionResponse, ChatCompletionChunk,
                                            "Answer a chat"),
        "/v1/models": {"get": {"summary": "The served model", "responses": {
            "200": {"description": "OK", "content": {"application/json": {"schema": _ref(ModelList)}}},
            **_errors(401)}}},
        "/v1/models/{model}": {"get": {
            "summary": "The served model by name",
            "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": {"description": "OK", "content": {"application/json": {"schema": _ref(ModelCard)}}},
                          **_errors(401, 404)}}},
        "/health": {"get": {"summary": "200 while the engine takes requests",
                            "responses": {"200": {"description": "Serving"}, **_errors(401, 503)}}},
        "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": text, **_errors(401)}}},
        "/openapi.json": {"get": {"summary": "This document", "responses": {"200": {"description": "OK"}}}},
    }  # fmt: skip
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {
            "schemas": top.get("$defs", {}),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


# --- errors in words -------------------------------------------------------------------------------


def _resolve(schema: dict, defs: dict) -> dict:
    while "$ref" in schema:
        schema = defs[schema["$ref"].rsplit("/", 1)[-1]]
    return schema


def _members(schema: dict, defs: dict) -> list[dict]:
    schema = _resolve(schema, defs)
    if "anyOf" in schema or "oneOf" in schema:
        return [m for s in schema.get("anyOf", schema.get("oneOf")) for m in _members(s, defs)]
    return [schema]


def _schema_at(schema: dict, defs: dict, path: list[str | int]) -> dict | None:
    """The schema of the value at ``path`` (field names and list indices) in ``schema``."""
    for step in path:
        found = None
        for member in _members(schema, defs):
            if isinstance(step, int) and member.get("type") == "array" and "items" in member:
                found = member["items"]
            elif isinstance(step, str) and step in member.get("properties", {}):
                found = member["properties"][step]
            if found is not None:
                break
        if found is None:
            return None
        schema = found
    return schema


def _bounds(schema: dict) -> str:
    low = schema.get("minimum", schema.get("exclusiveMinimum"))
    high = schema.get("maximum", schema.get("exclusiveMaximum"))
    left = "(" if "exclusiveMinimum" in schema else "["
    right = ")" if "exclusiveMaximum" in schema else "]"
    if low is not None and high is not None:
        return f" in {left}{low}, {high}{right}"
    if low is not None:
        return f" {'>' if left == '(' else '>='} {low}"
    if high is not None:
        return f" {'<' if right == ')' else '<='} {high}"
    return ""


def describe(schema: dict, defs: dict) -> str:
    """What ``schema`` allows, in words ("an integer >= 1, or null")."""
    words = []
    for m in _members(schema, defs):
        kind = m.get("type")
        if "const" in m or "enum" in m:
            values = [m["const"]] if "const" in m else m["enum"]
            words.append(" or ".join(repr(v) for v in values))
        elif kind == "integer":
            words.append("an integer" + _bounds(m))
        elif kind == "number":
            words.append("a number" + _bounds(m))
        elif kind == "string":
            words.append("a string")
        elif kind == "boolean":
            words.append("true or false")
        elif kind == "null":
            words.append("null")
        elif kind == "array":
            item = describe(m.get("items", {}), defs) if m.get("items") else "anything"
            least = f" of at least {m['minItems']} item(s)" if m.get("minItems") else ""
            words.append(f"a list{least} (each item {item})")
        elif kind == "object":
            title = m.get("title")
            names = sorted(m.get("properties", {}))
            words.append(f"an object {title} with keys {names}" if names else "an object")
        else:
            words.append("anything")
    if len(words) <= 2:
        return ", or ".join(words) if len(words) == 2 and words[-1] == "null" else " or ".join(words)
    return ", ".join(words[:-1]) + ", or " + words[-1]


def _where(path: list[str | int]) -> str:
    out = ""
    for step in path:
        out += f"[{step}]" if isinstance(step, int) else (f".{step}" if out else step)
    return out


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_MISSING = object()


def _value_at(body: Any, path: list[str | int]) -> Any:
    for step in path:
        try:
            body = body[step]
        except (KeyError, IndexError, TypeError):
            return _MISSING
    return body


@functools.cache
def _validation_schema(model: type[BaseModel]) -> dict:
    return model.model_json_schema(ref_template="#/$defs/{model}")


def explain(error: ValidationError, model: type[BaseModel], body: Any) -> tuple[str, str | None]:
    """A validation error as ``(message, param)``: the most specific field that breaks the schema,
    its value and what the schema allows there."""
    schema = _validation_schema(model)
    defs = schema.get("$defs", {})
    found = []
    for err in error.errors(include_url=False):
        # Union members and validators add steps of their own (``str``, ``list[int]``): the path
        # keeps list indices and the field names the schema has there.
        path: list[str | int] = []
        for step in err["loc"]:
            candidate = [*path, step]
            if _schema_at(schema, defs, candidate) is not None:
                path = candidate
        found.append((len(path), err, path))
    _, err, path = max(found, key=lambda f: f[0])
    where = _where(path) or "the request body"
    if err["type"] == "missing":
        return f"{where} is required", _where(path)
    if err["type"] == "extra_forbidden":
        key = err["loc"][-1]
        keys = sorted(k for m in _members(_schema_at(schema, defs, path) or {}, defs) for k in m.get("properties", {}))
        return f"{_where([*path, key])} is unknown: {where} takes the keys {keys}", _where([*path, key])
    value = _value_at(body, path)
    field_schema = _schema_at(schema, defs, path) or {}
    allowed = describe(field_schema, defs)
    shown = _short(value) if value is not _MISSING else _short(err.get("input"))
    return f"{where}={shown} is invalid: must be {allowed}", (_where(path) or None)
