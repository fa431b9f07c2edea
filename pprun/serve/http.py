"""The OpenAI-compatible HTTP server of ``pprun serve`` (``serve.http_port``): Starlette routes on
uvicorn, on the event loop and over the engine the gRPC server uses.

Routes: ``GET /v1/models`` (and ``/v1/models/{model}``), ``POST /v1/completions``, ``POST
/v1/chat/completions`` (answered whole, or streamed as server-sent events: ``data: {chunk}``
lines, then ``data: [DONE]``), ``GET /health`` (200 while the engine takes requests, 503 after a
stage failure and while draining), ``GET /metrics`` (Prometheus text, ``pprun.serve.metrics``) and
``GET /openapi.json`` (the routes and their schemas, ``pprun.serve.protocol``).
Every route needs ``Authorization: Bearer <token>`` when a token is configured, checked before
the body is read.  A client that disconnects aborts its requests (their KV blocks are back within
a step), whether its answer is streamed or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

import pprun
from pprun.config.config import ServeConfig
from pprun.engine.async_engine import EngineClient, RequestStream
from pprun.engine.outputs import RequestDelta
from pprun.serve import openai_api as oa
from pprun.serve.metrics import CONTENT_TYPE, ServerMetrics
from pprun.serve.protocol import openapi_document
from pprun.serve.settings import RequestLimits

logger = logging.getLogger(__name__)

_DONE = b"data: [DONE]\n\n"
_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def _sse(obj: Any) -> bytes:
    return b"data: " + _dumps(obj) + b"\n\n"


def json_response(obj: Any, status: int = 200) -> Response:
    """A JSON answer (compact, UTF-8)."""
    return Response(_dumps(obj), status_code=status, media_type="application/json")


def error_response(err: oa.OpenAIError) -> Response:
    """An error in OpenAI's shape with its status (401 also says which scheme it wants)."""
    headers = {"www-authenticate": "Bearer"} if err.status == 401 else None
    return Response(_dumps(err.body()), status_code=err.status, media_type="application/json", headers=headers)


class BearerTokenMiddleware:
    """ASGI middleware that answers 401 to every HTTP request without ``Authorization: Bearer
    <token>``, before the application reads anything of it (compared in constant time)."""

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        """Pass the request on, or refuse it."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = None
        for key, value in scope["headers"]:
            if key == b"authorization":
                given = value
        if given is not None and hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        message = ("this server needs 'Authorization: Bearer <token>' on every request" if given is None
                   else "the bearer token in 'Authorization' is wrong")
        await error_response(oa.OpenAIError(401, message, code="invalid_api_key"))(scope, receive, send)


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestDelta]]:
    """The deltas of several streams as they come, each with its stream's index."""
    if len(streams) == 1:
        async for delta in streams[0]:
            yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, RequestDelta]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        async for delta in stream:
            queue.put_nowait((i, delta))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    left = len(streams)
    try:
        while left:
            i, delta = await queue.get()
            left -= delta.finished
            yield i, delta
    finally:
        for task in tasks:
            task.cancel()


async def _until_disconnect(receive: Any) -> None:
    """Return when the client has gone (the body has been read: what comes next is the end)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class OpenAIServer:
    """The routes over one engine, for the model clients call ``model_name``, within ``limits``."""

    def __init__(self, engine: EngineClient, model_name: str, limits: RequestLimits) -> None:
        self.engine = engine
        self.model_name = model_name
        self.limits = limits
        self.openapi = _dumps(openapi_document(version=pprun.__version__))
        self.max_body_bytes = 4 * 1024 * 1024
        self.created = int(time.time())
        self.text_of = oa.TokenText(engine.inputs.tokenizer)
        self.server_metrics = ServerMetrics(engine)

    def app(self, token: str | None, max_body_bytes: int) -> Any:
        """The ASGI application (behind the bearer-token check when ``token`` is set)."""
        self.max_body_bytes = max_body_bytes
        routes = [
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.get_model, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/openapi.json", self.openapi_json, methods=["GET"]),
        ]
        app = Starlette(routes=routes, exception_handlers={HTTPException: self._http_error, Exception: self._bug})
        return BearerTokenMiddleware(app, token) if token else app

    # --- small routes ---

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "pprun",
                "max_model_len": self.engine.inputs.max_model_len}

    async def list_models(self, request: Request) -> Response:
        """The one served model."""
        return json_response({"object": "list", "data": [self._model_card()]})

    async def get_model(self, request: Request) -> Response:
        """The served model by name; 404 for another."""
        try:
            oa.check_model({"model": request.path_params["model"]}, self.model_name)
        except oa.OpenAIError as e:
            return error_response(e)
        return json_response(self._model_card())

    async def health(self, request: Request) -> Response:
        """200 while the engine takes requests; 503 after a stage failure and while draining."""
        if self.engine.healthy:
            return Response(b"", status_code=200)
        why = self.engine.dead or "the server is draining"
        return error_response(oa.OpenAIError(503, why, type="server_error", code="service_unavailable"))

    async def metrics(self, request: Request) -> Response:
        """``pprun.serve.metrics`` in Prometheus' text format."""
        return Response(self.server_metrics.text(), headers={"content-type": CONTENT_TYPE})

    async def openapi_json(self, request: Request) -> Response:
        """The OpenAPI document: every route, its request and response schemas."""
        return Response(self.openapi, media_type="application/json")

    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 404:
            message = (f"{request.method} {request.url.path} is not served here: this server serves GET /v1/models, "
                       "POST /v1/completions, POST /v1/chat/completions, GET /health, GET /metrics and "
                       "GET /openapi.json")
        else:
            message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(oa.OpenAIError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None))

    async def _bug(self, request: Request, exc: Exception) -> Response:
        logger.exception("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(oa.error_for(exc))

    # --- generation ---

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``."""
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/chat/completions``."""
        return await self._generate(request, chat=True)

    async def _read_json(self, request: Request) -> Any:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise oa.OpenAIError(413, f"the request body has {length} bytes: at most serve.max_message_bytes="
                                      f"{self.max_body_bytes} are taken", code="request_too_large")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                raise oa.OpenAIError(413, f"the request body is over serve.max_message_bytes={self.max_body_bytes} "
                                          "bytes", code="request_too_large")
        try:
            return json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise oa.OpenAIError(400, f"the request body is not valid JSON: {e}") from None

    async def _generate(self, request: Request, chat: bool) -> Response:
        try:
            body = await self._read_json(request)
            parse = oa.parse_chat if chat else oa.parse_completion
            req = parse(body, self.engine, self.model_name, self.limits)
            streams = self._add(req)
        except ClientDisconnect:  # gone while its body was read: nothing queued, nobody to answer
            return Response(b"", status_code=499)
        except Exception as e:
            err = oa.error_for(e)
            if err.status == 500:
                logger.exception("%s %s failed", request.method, request.url.path)
            return error_response(err)
        request_id = ("chatcmpl-" if chat else "cmpl-") + streams[0].request_id
        head = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_name}
        if req.stream:
            # The response aborts what is unfinished when the client disconnects or the events stop.
            return _EventStream(self._events(req, streams, head), lambda: self._abort_unfinished(streams))
        collect = asyncio.ensure_future(self._answer(req, streams, head))
        gone = asyncio.ensure_future(_until_disconnect(request.receive))
        try:
            await asyncio.wait((collect, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():  # the client left before its answer: nobody to send it to
                collect.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await collect
            self._abort_unfinished(streams)
        if collect.cancelled():
            return Response(b"", status_code=499)
        try:
            return json_response(collect.result())
        except oa.OpenAIError as e:
            return error_response(e)

    def _add(self, req: oa.ParsedRequest) -> list[RequestStream]:
        """Every choice queued in the engine (all or none)."""
        loop = asyncio.get_running_loop()
        streams: list[RequestStream] = []
        try:
            for choice, params in enumerate(req.params):
                streams.append(self.engine.add_request(req.prompts[req.prompt_of(choice)], params, loop=loop,
                                                       where="request"))
        except BaseException:
            for stream in streams:
                self.engine.abort(stream.request_id)
            raise
        return streams

    def _abort_unfinished(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            if not stream.finished and self.engine.abort(stream.request_id):
                logger.info("request %s aborted: its HTTP client went away before the last answer", stream.request_id)

    async def _events(self, req: oa.ParsedRequest, streams: list[RequestStream], head: dict) -> AsyncIterator[bytes]:
        """The server-sent events of a streamed answer (the response, :class:`_EventStream`,
        aborts what is unfinished when the client leaves).

        The last choice's last chunk, the usage chunk and ``[DONE]`` are one item, which
        :class:`_EventStream` writes with the chunked body's end: one write per answer's end
        instead of three (a burst of answers ending together is written ahead of the requests
        their clients send next, on the same event loop)."""
        states = [oa.ChoiceState(i) for i in range(len(streams))]
        # Every chunk is `head` with one choice: its bytes around the choice are encoded once.
        before = b"data: " + _dumps(head)[:-1] + b',"choices":['
        after = b"]" + (b',"usage":null' if req.include_usage else b"") + b"}\n\n"
        left = len(streams)
        async for i, delta in _merged(streams):
            if delta.finish_reason == "error":
                err = oa.OpenAIError(503, delta.error or "the engine failed", type="server_error",
                                     code="service_unavailable")
                yield _sse(err.body()) + _DONE
                return
            choice = oa.choice_chunk(req, states[i], delta, self.text_of)
            chunk = b"" if choice is None else before + _dumps(choice) + after
            left -= delta.finished
            if not left:  # every choice has ended: the answer's end in one item
                if req.include_usage:
                    chunk += _sse({**head, "choices": [], "usage": oa.usage(req, states)})
                yield chunk + _DONE
                return
            if chunk:
                yield chunk
        if req.include_usage:
            yield _sse({**head, "choices": [], "usage": oa.usage(req, states)})
        yield _DONE

    async def _answer(self, req: oa.ParsedRequest, streams: list[RequestStream], head: dict) -> dict:
        """The whole answer of a request that is not streamed (what is unfinished when it stops is
        aborted by the handler)."""
        states = [oa.ChoiceState(i) for i in range(len(streams))]
        async for i, delta in _merged(streams):
            if delta.finish_reason == "error":
                raise oa.OpenAIError(503, delta.error or "the engine failed", type="server_error",
                                     code="service_unavailable")
            oa.add_to_answer(req, states[i], delta, self.text_of)
        return {**head, "object": "chat.completion" if req.chat else "text_completion",
                "choices": [oa.answer_choice(req, s) for s in states], "usage": oa.usage(req, states)}


class _EventStream(StreamingResponse):
    """Server-sent events, sent as they come; when the client disconnects, ``on_end`` runs at
    once (it aborts the requests, whose streams then end within a step; what is still sent goes
    nowhere), and at the end of the events otherwise (once in all).

    Starlette's StreamingResponse watches for the disconnect in an anyio task group of two tasks
    per response; a burst of requests is taken one after another on the event loop, so this one
    watches with one plain task and no cancellation."""

    def __init__(self, events: AsyncIterator[bytes], on_end: Any) -> None:
        super().__init__(events, media_type="text/event-stream", headers=_SSE_HEADERS)
        self._on_end = on_end
        self._ended = False

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            self._on_end()

    async def _watch(self, receive: Any) -> None:
        await _until_disconnect(receive)
        self._end()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        """Send the events; abort what is unfinished when they stop or the client leaves."""
        watcher = asyncio.ensure_future(self._watch(receive))
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            complete = False
            async for chunk in self.body_iterator:
                # The item that ends with [DONE] is the last: written with the body's end.
                complete = chunk.endswith(_DONE)
                await send({"type": "http.response.body", "body": chunk, "more_body": not complete})
            if not complete:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            self._end()


class _HeaderMiddleware:
    """ASGI middleware that adds one header to every HTTP answer (which front end served it)."""

    def __init__(self, app: Any, header: tuple[bytes, bytes]) -> None:
        self.app = app
        self.header = header

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        """Pass the request on; add the header to the answer's start."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), self.header]
            await send(message)

        await self.app(scope, receive, send_with_header)


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn on the event loop ``pprun serve`` runs, leaving SIGTERM/SIGINT to it (it drains
    both servers in order; uvicorn would otherwise take the signals for itself)."""

    @contextlib.contextmanager
    def capture_signals(self):  # noqa: D102 (uvicorn's hook)
        yield


def listening_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to ``host:port`` (an IPv6 literal with or without brackets), listening.

    Its protocol is IPPROTO_TCP, not 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on
    sockets whose protocol says TCP, and accepted sockets inherit the listener's.  With Nagle on,
    a stream's first event waits for the client's delayed ACK of the headers (about 40 ms).
    ``reuse_port``: SO_REUSEPORT, for front-end processes that share the port (the kernel spreads
    connections over their listeners).
    """
    host = host.strip("[]")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


class HttpServer:
    """The OpenAI HTTP server's life: bind, serve on the running event loop, stop."""

    def __init__(self, engine: EngineClient, model_name: str, sc: ServeConfig, token: str | None,
                 limits: RequestLimits, front_end: Any = None) -> None:
        self.sc = sc
        self.front_end = front_end
        """``pprun.serve.server.FrontEnd`` when one of several front-end processes serves this."""
        self.openai = OpenAIServer(engine, model_name, limits)
        self.app = self.openai.app(token, sc.max_message_bytes)
        if front_end is not None:
            self.app = _HeaderMiddleware(self.app, (b"pprun-api-server", str(front_end.index).encode()))
        self._server: _EmbeddedUvicorn | None = None
        self._task: asyncio.Task | None = None
        self.port: int | None = None

    async def start(self) -> int:
        """Bind ``serve.host``:``serve.http_port`` and start serving; returns the port."""
        sc, fe = self.sc, self.front_end
        port = sc.http_port if fe is None else fe.http_port
        try:
            sock = listening_socket(sc.host, port, reuse_port=fe is not None)
        except OSError as e:
            raise ValueError(f"serve.host={sc.host!r} serve.http_port={port}: cannot bind: {e}") from None
        config = uvicorn.Config(
            self.app, lifespan="off", log_config=None, access_log=False, server_header=False,
            ssl_certfile=sc.tls_cert_file, ssl_keyfile=sc.tls_key_file, timeout_graceful_shutdown=2,
        )  # fmt: skip
        self._server = _EmbeddedUvicorn(config)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # its error
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        self.port = sock.getsockname()[1]
        return self.port

    async def stop(self) -> None:
        """Stop taking connections, let answers in progress end (2 s at most), then return."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(self._task, timeout=10.0)
        except (TimeoutError, asyncio.CancelledError):
            pass
        except Exception:
            logger.exception("the HTTP server's shutdown failed")
