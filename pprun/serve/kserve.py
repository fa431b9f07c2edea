"""The KServe v2 / Open Inference Protocol service (``inference.GRPCInferenceService``) as
Triton serves a text-generation model, with the tensor names of Triton's vLLM backend.

Inputs: ``text_input`` (BYTES, one element), optional ``stream`` (BOOL), ``sampling_parameters``
(BYTES: a JSON object of SamplingParams fields; numbers may be given as strings, as Triton's
vLLM clients do) and ``exclude_input_in_output`` (BOOL).  Output: ``text_output`` (BYTES).
``ModelInfer`` answers once with the whole text (the prompt first unless
``exclude_input_in_output``); ``ModelStreamInfer`` is decoupled: with ``stream`` true one response
per engine step that added text, the last one carrying the parameter ``triton_final_response``
true, as Triton does; with ``stream`` false one response with the whole text.  A request's error
on the stream is a response with ``error_message`` (the stream itself goes on), as in Triton.
"""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import json
import logging
import struct
from collections.abc import AsyncIterator

import grpc

import pprun
from pprun.engine.async_engine import EngineClient
from pprun.sampling.params import SamplingParams
from pprun.serve._proto.inference import grpc_service_pb2 as pb
from pprun.serve._proto.inference import grpc_service_pb2_grpc as pb_grpc
from pprun.serve.errors import NotFoundError, message_for, status_for
from pprun.serve.settings import RequestLimits

logger = logging.getLogger(__name__)

MODEL_VERSION = "1"
INPUTS = {"text_input": "BYTES", "stream": "BOOL", "sampling_parameters": "BYTES", "exclude_input_in_output": "BOOL"}
"""Input tensor name -> datatype (Triton's vLLM backend)."""
OUTPUT = "text_output"
_SAMPLING_FIELDS = {f.name: f for f in dataclasses.fields(SamplingParams) if f.name != "n"}
_FINAL = "triton_final_response"


def _decode_bytes_tensor(raw: bytes, where: str) -> list[bytes]:
    """Triton's raw BYTES layout: each element a 4-byte little-endian length, then its bytes."""
    items, pos = [], 0
    while pos < len(raw):
        if pos + 4 > len(raw):
            raise ValueError(f"{where}: raw BYTES contents are truncated (a length prefix is cut)")
        (n,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        if pos + n > len(raw):
            raise ValueError(f"{where}: raw BYTES contents are truncated (an element of {n} bytes is cut)")
        items.append(raw[pos : pos + n])
        pos += n
    return items


def _encode_bytes_tensor(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(b)) + b for b in items)


_NUMBER_FIELDS = {"top_k": int, "seed": int, "max_tokens": int, "min_tokens": int, "logprobs": int,
                  "temperature": float, "top_p": float, "min_p": float}
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens")


def _coerce(name: str, value: object) -> object:
    """A sampling value given as a string (Triton's vLLM clients send them so) in the field's type;
    a string that does not parse is left as is, for validation to name."""
    if not isinstance(value, str):
        return value
    if name in _BOOL_FIELDS and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if name in _NUMBER_FIELDS:
        try:
            return _NUMBER_FIELDS[name](value)
        except ValueError:
            return value
    return value


def sampling_from_json(raw: bytes) -> SamplingParams:
    """SamplingParams from the ``sampling_parameters`` JSON object; unknown keys are refused."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"sampling_parameters is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"sampling_parameters must be a JSON object, got {type(obj).__name__}")
    values = {}
    for key, value in obj.items():
        if key not in _SAMPLING_FIELDS:
            close = difflib.get_close_matches(str(key), list(_SAMPLING_FIELDS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"sampling_parameters key {key!r} is unknown{hint} (allowed: {', '.join(_SAMPLING_FIELDS)})"
            )
        values[key] = _coerce(key, value)
    return SamplingParams(**values)


@dataclasses.dataclass
class ParsedRequest:
    """A KServe request read into what the engine takes."""

    text: str
    stream: bool
    params: SamplingParams
    exclude_input: bool


def parse_infer_request(req: pb.ModelInferRequest, model_name: str) -> ParsedRequest:
    """Read and check a ModelInferRequest; raise ValueError/NotFoundError naming what is wrong."""
    if req.model_name != model_name:
        raise NotFoundError(f"model_name={req.model_name!r} is not served here: this server serves {model_name!r}")
    if req.model_version not in ("", MODEL_VERSION):
        raise NotFoundError(f"model_version={req.model_version!r} of {model_name!r} is unknown: only "
                            f"{MODEL_VERSION!r} is served")
    for out in req.outputs:
        if out.name != OUTPUT:
            raise ValueError(f"requested output {out.name!r} is unknown: the only output is {OUTPUT!r}")
    raw = list(req.raw_input_contents)
    if raw and len(raw) != len(req.inputs):
        raise ValueError(f"raw_input_contents has {len(raw)} entries for {len(req.inputs)} inputs: must be one per input")
    values: dict[str, object] = {}
    for i, tensor in enumerate(req.inputs):
        name = tensor.name
        where = f"input {name!r}"
        if name not in INPUTS:
            raise ValueError(f"input {name!r} is unknown (inputs: {', '.join(INPUTS)})")
        if name in values:
            raise ValueError(f"input {name!r} is given twice")
        if tensor.datatype != INPUTS[name]:
            raise ValueError(f"{where} has datatype {tensor.datatype!r}: must be {INPUTS[name]}")
        num_elements = 1
        for d in tensor.shape:
            num_elements *= d
        if any(d < 0 for d in tensor.shape) or num_elements != 1:
            raise ValueError(f"{where} has shape {list(tensor.shape)}: must hold exactly one element (e.g. [1])")
        if INPUTS[name] == "BYTES":
            items = _decode_bytes_tensor(raw[i], where) if raw else list(tensor.contents.bytes_contents)
        else:
            items = list(raw[i]) if raw else list(tensor.contents.bool_contents)
        if len(items) != 1:
            raise ValueError(f"{where} holds {len(items)} elements: must hold exactly one")
        values[name] = items[0]
    if "text_input" not in values:
        raise ValueError("input 'text_input' (BYTES) is missing: it holds the prompt")
    try:
        text = values["text_input"].decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("input 'text_input' is not valid UTF-8") from None
    params = sampling_from_json(values["sampling_parameters"]) if "sampling_parameters" in values else SamplingParams()
    return ParsedRequest(text, bool(values.get("stream", False)), params, bool(values.get("exclude_input_in_output", False)))


class KServeService(pb_grpc.GRPCInferenceServiceServicer):
    """The KServe v2 methods over the async engine, for one model named ``model_name``."""

    def __init__(self, engine: EngineClient, model_name: str, limits: RequestLimits) -> None:
        self.engine = engine
        self.model_name = model_name
        self.limits = limits

    async def ServerLive(self, request, context):  # noqa: N802 (gRPC method names)
        """The process answers: live."""
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):  # noqa: N802
        """Ready while the engine takes requests (no stage failure, not draining)."""
        return pb.ServerReadyResponse(ready=self.engine.healthy)

    async def ModelReady(self, request, context):  # noqa: N802
        """Ready as the server is, for the served model; NOT_FOUND for another."""
        try:
            self._check_model(request.name, request.version)
        except NotFoundError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        return pb.ModelReadyResponse(ready=self.engine.healthy)

    async def ServerMetadata(self, request, context):  # noqa: N802
        """Server name and version (no protocol extensions)."""
        return pb.ServerMetadataResponse(name="pprun", version=pprun.__version__, extensions=[])

    async def ModelMetadata(self, request, context):  # noqa: N802
        """The model's tensors, as Triton's vLLM backend declares them."""
        try:
            self._check_model(request.name, request.version)
        except NotFoundError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        tm = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=self.model_name, versions=[MODEL_VERSION], platform="pprun",
            inputs=[tm(name=n, datatype=d, shape=[1]) for n, d in INPUTS.items()],
            outputs=[tm(name=OUTPUT, datatype="BYTES", shape=[-1])],
        )  # fmt: skip

    def _check_model(self, name: str, version: str) -> None:
        if name != self.model_name:
            raise NotFoundError(f"model {name!r} is not served here: this server serves {self.model_name!r}")
        if version not in ("", MODEL_VERSION):
            raise NotFoundError(f"version {version!r} of {name!r} is unknown: only {MODEL_VERSION!r} is served")

    def _response(self, req: pb.ModelInferRequest, text: str, final: bool | None) -> pb.ModelInferResponse:
        resp = pb.ModelInferResponse(
            model_name=self.model_name, model_version=MODEL_VERSION, id=req.id,
            outputs=[pb.ModelInferResponse.InferOutputTensor(name=OUTPUT, datatype="BYTES", shape=[1])],
            raw_output_contents=[_encode_bytes_tensor([text.encode("utf-8")])],
        )  # fmt: skip
        if final is not None:
            resp.parameters[_FINAL].bool_param = final
        return resp

    async def _run(self, req: pb.ModelInferRequest, parsed: ParsedRequest, streaming: bool) -> AsyncIterator[pb.ModelInferResponse]:
        """The responses of one request: per delta (``streaming``) or one with the whole text.
        Raises on bad input or an engine failure."""
        self.limits.check_stop(parsed.params.stop, "sampling_parameters.stop")
        stream = self.engine.add_request(parsed.text, parsed.params, loop=asyncio.get_running_loop(),
                                         where="ModelInferRequest")
        pieces: list[str] = []
        try:
            async for delta in stream:
                if delta.finish_reason == "error":
                    raise _Unavailable(delta.error or "the engine failed")
                if streaming:
                    if delta.text or delta.finished:
                        yield self._response(req, delta.text, final=delta.finished)
                else:
                    pieces.append(delta.text)
        finally:
            if not stream.finished and self.engine.abort(stream.request_id):
                logger.info("request %s (KServe id %r) aborted: its call ended before the last response "
                            "(client gone, cancelled or past its deadline)", stream.request_id, req.id)
        if not streaming:
            text = "".join(pieces)
            if not parsed.exclude_input:
                text = parsed.text + text
            yield self._response(req, text, final=None)

    async def ModelInfer(self, request, context):  # noqa: N802
        """One request, one response with the whole text."""
        try:
            parsed = parse_infer_request(request, self.model_name)
            if parsed.stream:
                raise ValueError("input 'stream' is true: streaming needs ModelStreamInfer (decoupled)")
            async for resp in self._run(request, parsed, streaming=False):
                return resp
        except _Unavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except Exception as e:
            await context.abort(status_for(e), message_for(e))

    async def ModelStreamInfer(self, request_iterator, context):  # noqa: N802
        """Decoupled: requests run concurrently; their responses interleave on the one stream."""
        out: asyncio.Queue = asyncio.Queue()
        tasks: set[asyncio.Task] = set()

        async def serve_one(req: pb.ModelInferRequest) -> None:
            try:
                parsed = parse_infer_request(req, self.model_name)
                final = None if not parsed.stream else True
                async for resp in self._run(req, parsed, streaming=parsed.stream):
                    if final is None:  # stream false: one response, the final one
                        resp.parameters[_FINAL].bool_param = True
                    await out.put(pb.ModelStreamInferResponse(infer_response=resp))
            except Exception as e:
                await out.put(pb.ModelStreamInferResponse(error_message=message_for(e)))

        async def read_requests() -> None:
            try:
                async for req in request_iterator:
                    task = asyncio.create_task(serve_one(req))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            finally:
                if tasks:
                    await asyncio.gather(*list(tasks), return_exceptions=True)
                await out.put(None)

        reader = asyncio.create_task(read_requests())
        try:
            while (item := await out.get()) is not None:
                yield item
        finally:
            # The client left (or the call was cancelled): its requests are aborted by their
            # tasks' cleanup.
            reader.cancel()
            for task in list(tasks):
                task.cancel()


class _Unavailable(RuntimeError):
    """A request ended by a stage failure (UNAVAILABLE)."""
