"""The gRPC server of ``pprun serve``: services, authentication, TLS, limits, health, draining;
and, with ``serve.http_port``, the OpenAI-compatible HTTP server (``pprun.serve.http``) beside it.

One asyncio event loop runs the gRPC server (``grpc.aio``); the engine steps the model in a
process of its own (``serve.engine_process``, ``pprun.engine.engine_process``) or on a thread of
this one (``pprun.engine.async_engine.AsyncEngine``).  Served: ``pprun.v1.Pprun``,
``inference.GRPCInferenceService`` (KServe v2 / Triton), ``grpc.health.v1.Health`` (SERVING while
the engine takes requests; NOT_SERVING after a stage failure and while draining) and server
reflection.  With a bearer token configured every call,
health and reflection included, must carry ``authorization: Bearer <token>`` (so must every HTTP
request).  Both servers bind ``serve.host``.  Every setting is checked once, before either
starts, into the :class:`~pprun.serve.settings.ServeSettings` this module takes as it is
(``pprun.serve.settings``).
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import json
import logging
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pprun.config.config import ServeAppConfig
from pprun.config.validate import ResolvedConfig
from pprun.engine.async_engine import AsyncEngine, EngineClient
from pprun.serve._proto.inference import grpc_service_pb2, grpc_service_pb2_grpc
from pprun.serve._proto.pprun.v1 import pprun_pb2, pprun_pb2_grpc
from pprun.serve.kserve import KServeService
from pprun.serve.pprun_api import PprunService
from pprun.serve.settings import ServeSettings, resolve_serve_settings

logger = logging.getLogger(__name__)

SERVICE_NAMES = (
    pprun_pb2.DESCRIPTOR.services_by_name["Pprun"].full_name,
    grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name,
)
"""The services pprun implements (health and reflection come on top)."""


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED, every call without ``authorization: Bearer <token>``."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        """Let the call through to its handler, or swap in one that refuses it."""
        given = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
        handler = await continuation(handler_call_details)
        if handler is None or (given is not None and hmac.compare_digest(given, self._expected)):
            return handler
        message = (
            "this server needs 'authorization: Bearer <token>' metadata on every call"
            if given is None
            else "the bearer token in 'authorization' is wrong"
        )

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        make = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(handler.request_streaming, handler.response_streaming)]
        return make(refuse, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


class MalformedRequest:
    """What a request that does not parse as its method's message deserializes to."""

    def __init__(self, error: Exception) -> None:
        self.error = error


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Answers INVALID_ARGUMENT to a request whose bytes are not its method's message (gRPC
    itself would answer UNKNOWN to a unary call and end a streaming one as if the client had
    finished: bad input must read as bad input).

    On a request stream (KServe ``ModelStreamInfer``) nothing after a malformed message is read:
    the requests already taken from the stream finish and send their responses, then the call
    ends with INVALID_ARGUMENT naming the method.
    """

    def __init__(self, trailing_metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self._trailing = trailing_metadata
        """Set on every call's trailers (the front end's index, with ``serve.api_servers`` > 1)."""
        self._wrapped: dict[str, tuple[object, object]] = {}
        """Method -> (its handler, the wrapped one): built once per method, not once per call
        (a burst of calls is taken one after another on the event loop)."""

    async def intercept_service(self, continuation, handler_call_details):
        """Wrap the handler's deserializer and behaviour (async handlers)."""
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(handler, method)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _wrap(self, handler, method: str):
        """``handler`` with a deserializer that turns bad bytes into a MalformedRequest and a
        behaviour that refuses one."""
        parse = handler.request_deserializer

        def deserialize(data: bytes):
            try:
                return parse(data)
            except Exception as e:  # DecodeError and friends
                return MalformedRequest(e)

        def refusal(request: MalformedRequest) -> str:
            return f"the request to {method} is not a valid message: {request.error}"

        serializer = handler.response_serializer
        trailing = self._trailing
        if handler.request_streaming:
            return self._wrap_request_stream(handler, deserialize, refusal, trailing)
        if handler.response_streaming:
            behavior = handler.unary_stream
            if not inspect.isasyncgenfunction(behavior):
                return handler

            async def stream(request, context):
                if trailing:
                    context.set_trailing_metadata(trailing)
                if isinstance(request, MalformedRequest):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal(request))
                async for item in behavior(request, context):
                    yield item

            return grpc.unary_stream_rpc_method_handler(stream, deserialize, serializer)
        behavior = handler.unary_unary

        async def unary(request, context):
            if trailing:
                context.set_trailing_metadata(trailing)
            if isinstance(request, MalformedRequest):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal(request))
            return await behavior(request, context)

        return grpc.unary_unary_rpc_method_handler(unary, deserialize, serializer)

    @staticmethod
    def _wrap_request_stream(handler, deserialize, refusal, trailing):
        """A request-streaming handler whose request iterator stops at the first malformed
        message; the call then ends INVALID_ARGUMENT once the handler has finished."""
        streaming_out = handler.response_streaming
        behavior = handler.stream_stream if streaming_out else handler.stream_unary
        if not (inspect.isasyncgenfunction(behavior) if streaming_out else inspect.iscoroutinefunction(behavior)):
            return handler  # a sync handler reads its requests another way: left as gRPC runs it

        def until_malformed(request_iterator, bad: list[MalformedRequest]):
            async def requests():
                async for request in request_iterator:
                    if isinstance(request, MalformedRequest):
                        bad.append(request)
                        return
                    yield request

            return requests()

        if streaming_out:
            async def bidi(request_iterator, context):
                if trailing:
                    context.set_trailing_metadata(trailing)
                bad: list[MalformedRequest] = []
                async for item in behavior(until_malformed(request_iterator, bad), context):
                    yield item
                if bad:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal(bad[0]))

            return grpc.stream_stream_rpc_method_handler(bidi, deserialize, handler.response_serializer)

        async def client_stream(request_iterator, context):
            if trailing:
                context.set_trailing_metadata(trailing)
            bad: list[MalformedRequest] = []
            response = await behavior(until_malformed(request_iterator, bad), context)
            if bad:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal(bad[0]))
            return response

        return grpc.stream_unary_rpc_method_handler(client_stream, deserialize, handler.response_serializer)


@dataclass(frozen=True)
class FrontEnd:
    """Where one of ``serve.api_servers`` > 1 front-end processes serves (``pprun.serve.api_servers``):
    the ports its parent chose (shared with the other front ends through SO_REUSEPORT), its index
    (on every gRPC call's trailers and HTTP answer's headers as ``pprun-api-server``), and where its
    "serving" line goes instead of stdout."""

    index: int
    port: int
    http_port: int | None
    report_serving: Callable[[dict], None]


API_SERVER_KEY = "pprun-api-server"
"""The gRPC trailer and HTTP header naming the front end that served a call."""


def bind_address(host: str, port: int) -> str:
    """``host:port`` as gRPC takes it (an IPv6 literal in brackets)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


async def serve_engine(engine: EngineClient, settings: ServeSettings, stop: asyncio.Event | None = None,
                       front_end: FrontEnd | None = None) -> None:
    """Serve ``engine`` until SIGTERM/SIGINT (or ``stop`` is set), then drain and return;
    ``front_end``: as one of several front-end processes (None: the one server process)."""
    sc, token, name, limits = settings.serve, settings.token, settings.model_name, settings.limits
    loop = asyncio.get_running_loop()
    options = [
        ("grpc.max_receive_message_length", sc.max_message_bytes),
        ("grpc.max_send_message_length", sc.max_message_bytes),
        # One server: a second one on the same port must fail, not share it.  Front ends share
        # the port their parent holds (pprun.serve.api_servers).
        ("grpc.so_reuseport", int(front_end is not None)),
    ]
    tag = ((API_SERVER_KEY, str(front_end.index)),) if front_end is not None else ()
    interceptors = [BearerTokenInterceptor(token)] if token else []
    interceptors.append(MalformedRequestInterceptor(tag))
    server = grpc.aio.server(interceptors=interceptors, options=options)
    pprun_pb2_grpc.add_PprunServicer_to_server(PprunService(engine, name, limits), server)
    grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(KServeService(engine, name, limits), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*SERVICE_NAMES, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )

    async def set_health(serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", *SERVICE_NAMES):
            await health_servicer.set(service, status)

    await set_health(engine.healthy)
    engine.add_health_listener(
        lambda ok: loop.call_soon_threadsafe(lambda: asyncio.ensure_future(set_health(ok)))
    )

    # The one rule for every server's address (pprun.config.exposure), applied at validation:
    # what is left is the warning to log.
    if settings.exposure_warning:
        logger.warning("pprun serve: %s", settings.exposure_warning)
    address = bind_address(sc.host, sc.port if front_end is None else front_end.port)
    if sc.tls_cert_file is not None:
        creds = grpc.ssl_server_credentials(
            [(Path(sc.tls_key_file).expanduser().read_bytes(), Path(sc.tls_cert_file).expanduser().read_bytes())]
        )
        port = server.add_secure_port(address, creds)
    else:
        port = server.add_insecure_port(address)
    if not port:
        raise ValueError(f"serve.host={sc.host!r} serve.port={sc.port}: cannot bind {address}")
    await server.start()
    bound = bind_address(sc.host, port)
    logger.info("pprun serve: %s on %s (%s)%s", name, bound, "TLS" if sc.tls_cert_file else "plaintext",
                ", bearer token required" if token else "")
    serving = {"event": "serving", "address": bound, "model": name, "tls": sc.tls_cert_file is not None}
    http_server = None
    if sc.http_port is not None:
        # Imported here: a gRPC-only server needs neither Starlette nor uvicorn loaded.
        from pprun.serve.http import HttpServer

        http_server = HttpServer(engine, name, sc, token, limits, front_end)
        try:
            http_bound = bind_address(sc.host, await http_server.start())
        except BaseException:
            await server.stop(grace=None)
            raise
        serving["http_address"] = http_bound
        logger.info("pprun serve: OpenAI-compatible HTTP API on %s://%s/v1", "https" if sc.tls_cert_file else "http",
                    http_bound)
    if front_end is None:
        # One machine-readable line on stdout: scripts and tests wait for it (port 0 picks the port).
        print(json.dumps(serving), flush=True)
    else:
        front_end.report_serving(serving)

    stop = stop or asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests drive `stop`)
            pass
    await stop.wait()
    logger.info("pprun serve: draining (up to %.1f s), then stopping", sc.drain_timeout_s)
    # Refusing first, health second: a client that reads NOT_SERVING and then calls is refused.
    engine.stop_accepting()
    await set_health(False)
    # The engine refuses new requests, lets running ones finish (their streams still flow on
    # this loop), aborts what is left at the timeout and stops the stages.
    await loop.run_in_executor(None, engine.shutdown, sc.drain_timeout_s)
    await asyncio.gather(server.stop(grace=2.0), http_server.stop() if http_server else asyncio.sleep(0))
    logger.info("pprun serve: stopped")


def serve(settings: ServeSettings | ServeAppConfig, resolved: ResolvedConfig | None = None,
          stop: asyncio.Event | None = None) -> None:
    """Start the engine (the model's stages), then serve it until SIGTERM/SIGINT (or ``stop`` is
    set); returns after draining, so the process exits 0.  ``settings``: checked already
    (``pprun serve`` does it once, :func:`~pprun.serve.settings.resolve_serve_settings`), or an
    app configuration checked here (with ``resolved``, its engine's configuration resolved
    already).  One front end: this process (``serve.api_servers`` > 1 goes through
    :func:`pprun.serve.launch.serve`, which makes this process the front ends' parent)."""
    if not isinstance(settings, ServeSettings):
        settings = resolve_serve_settings(settings, resolved)
    sc = settings.serve
    if sc.api_servers > 1:
        raise ValueError(f"serve.api_servers={sc.api_servers}: several front-end processes are started by "
                         "pprun.serve.launch.serve (what `pprun serve` runs), not by this one-process server")
    if sc.engine_process:
        from pprun.engine.engine_process import EngineProcess

        engine = EngineProcess(settings.engine, max_queued_requests=sc.max_queued_requests)
    else:
        engine = AsyncEngine(settings.engine, max_queued_requests=sc.max_queued_requests)
    try:
        asyncio.run(serve_engine(engine, settings, stop))
    finally:
        engine.shutdown(drain_timeout_s=0.0)
        sys.stdout.flush()
