"""The ``pprun.v1.Pprun`` service: streamed ``Generate``, ``Abort``, ``GetModelInfo``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from pprun.engine.async_engine import EngineClient
from pprun.engine.outputs import RequestDelta
from pprun.sampling.params import SamplingParams
from pprun.serve._proto.pprun.v1 import pprun_pb2, pprun_pb2_grpc
from pprun.serve.errors import NotFoundError, message_for, status_for
from pprun.serve.settings import RequestLimits

logger = logging.getLogger(__name__)

_OPTIONAL_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens",
                      "ignore_eos", "logprobs", "skip_special_tokens")  # fmt: skip
"""``optional`` fields of pprun.v1.SamplingParams: unset keeps SamplingParams' default."""


def sampling_from_proto(msg: pprun_pb2.SamplingParams) -> SamplingParams:
    """The SamplingParams a request asks for (unset fields keep the defaults); validated by the
    engine when the request is added."""
    values = {name: getattr(msg, name) for name in _OPTIONAL_SAMPLING if msg.HasField(name)}
    if msg.stop:
        values["stop"] = list(msg.stop)
    if msg.stop_token_ids:
        values["stop_token_ids"] = list(msg.stop_token_ids)
    return SamplingParams(**values)


def prompt_from_proto(engine: EngineClient, request: pprun_pb2.GenerateRequest,
                      limits: RequestLimits) -> str | dict:
    """The request's prompt as the engine takes it (text, token ids, or a rendered chat of at
    most ``serve.max_chat_messages`` messages)."""
    kind = request.WhichOneof("input")
    if kind == "text":
        return request.text
    if kind == "token_ids":
        return {"prompt_token_ids": list(request.token_ids.ids)}
    if kind == "chat":
        chat = request.chat
        add = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
        messages = [{"role": m.role, "content": m.content} for m in chat.messages]
        limits.check_messages(messages, "GenerateRequest.chat.messages")
        return engine.chat_prompt(messages, "GenerateRequest.chat.messages", add_generation_prompt=add)
    raise ValueError("GenerateRequest.input is unset: give one of text, token_ids or chat")


def response_from_delta(delta: RequestDelta) -> pprun_pb2.GenerateResponse:
    """One delta as a GenerateResponse (``final`` filled on the last one)."""
    resp = pprun_pb2.GenerateResponse(request_id=delta.request_id, token_ids=delta.token_ids, text=delta.text)
    if delta.logprobs:
        for lp in delta.logprobs:
            if lp is None:
                resp.logprobs.add()
            else:
                resp.logprobs.add(sampled_logprob=lp.sampled_logprob, top_token_ids=lp.top_token_ids,
                                  top_logprobs=lp.top_logprobs)
    if delta.finished:
        final = resp.final
        final.finish_reason = delta.finish_reason or ""
        if isinstance(delta.stop_reason, str):
            final.stop_string = delta.stop_reason
        elif isinstance(delta.stop_reason, int):
            final.stop_token_id = delta.stop_reason
        final.usage.prompt_tokens = delta.num_prompt_tokens
        final.usage.completion_tokens = delta.num_output_tokens
        final.usage.total_tokens = delta.num_prompt_tokens + delta.num_output_tokens
        m = delta.metrics
        if m is not None:
            t = final.timings
            t.arrival_time = m.arrival_time
            t.first_token_time = m.first_token_time or 0.0
            t.finished_time = m.finished_time or 0.0
            t.time_to_first_token_s = m.time_to_first_token or 0.0
            t.time_per_output_token_s = m.time_per_output_token or 0.0
            t.e2e_s = (m.finished_time - m.arrival_time) if m.finished_time else 0.0
    return resp


class PprunService(pprun_pb2_grpc.PprunServicer):
    """pprun.v1 over the async engine; ``model_name`` is the name clients may ask for, ``limits``
    what one request may ask of the server."""

    def __init__(self, engine: EngineClient, model_name: str, limits: RequestLimits) -> None:
        self.engine = engine
        self.model_name = model_name
        self.limits = limits

    def check_model(self, name: str, field: str) -> None:
        """Raise NotFoundError unless ``name`` is empty or the served model's."""
        if name and name != self.model_name:
            raise NotFoundError(f"{field}={name!r} is not served here: this server serves {self.model_name!r}")

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: pprun_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pprun_pb2.GenerateResponse]:
        """Stream one request's deltas; a stage failure ends the call with UNAVAILABLE."""
        try:
            self.check_model(request.model, "GenerateRequest.model")
            prompt = prompt_from_proto(self.engine, request, self.limits)
            params = sampling_from_proto(request.sampling)
            self.limits.check_stop(params.stop, "GenerateRequest.sampling.stop")
            stream = self.engine.add_request(prompt, params, request.request_id or None,
                                             loop=asyncio.get_running_loop(), where="GenerateRequest")
        except Exception as e:
            await context.abort(status_for(e), message_for(e))
            return
        try:
            async for delta in stream:
                if delta.finish_reason == "error":
                    await context.abort(grpc.StatusCode.UNAVAILABLE, delta.error or "the engine failed")
                yield response_from_delta(delta)
        finally:
            # Cancelled (client gone, deadline passed) or failed mid-stream: free its blocks.
            if not stream.finished and self.engine.abort(stream.request_id):
                logger.info("request %s aborted: its Generate call ended before the last response "
                            "(client gone, cancelled or past its deadline)", stream.request_id)

    async def Abort(self, request: pprun_pb2.AbortRequest, context: grpc.aio.ServicerContext) -> pprun_pb2.AbortResponse:  # noqa: N802
        """Abort a running request by id; NOT_FOUND when none runs under that id."""
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "AbortRequest.request_id is empty")
        if not self.engine.abort(request.request_id):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"request_id={request.request_id!r} is not running")
        return pprun_pb2.AbortResponse()

    async def GetModelInfo(self, request: pprun_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pprun_pb2.ModelInfo:  # noqa: N802
        """The served model, its length limit, stage layout, runner and executor."""
        facts = self.engine.describe()
        tok = self.engine.inputs.tokenizer
        return pprun_pb2.ModelInfo(
            model=self.model_name,
            max_model_len=facts["max_model_len"],
            pipeline_parallel_size=facts["pipeline_parallel_size"],
            layer_partition=facts["layer_partition"],
            runner=facts["runner"],
            executor=facts["executor"],
            device=facts["device"],
            dtype=facts["dtype"],
            kv_blocks_per_stage=facts["kv_blocks_per_stage"],
            block_size=facts["block_size"],
            vocab_size=self.engine.inputs.vocab_size,
            has_tokenizer=tok is not None,
            has_chat_template=bool(tok is not None and getattr(tok, "chat_template", None)),
            kv_blocks_free=self.engine.num_free_blocks(),
            num_unfinished_requests=self.engine.num_unfinished,
        )
