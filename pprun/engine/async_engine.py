"""The async engine: many callers stream per-step deltas of requests that one engine loop steps.

Serving needs what offline generation does not: requests arriving from many clients while the
pipeline runs, tokens going back as they are sampled, and a client that leaves taking its request
(and its KV blocks) with it.  An :class:`EngineClient` is the caller's side of that:

* callers validate their request in their own thread (tokenizing is the expensive part, done by
  an :class:`~pprun.engine.inputs.InputProcessor`), then hand it to the engine loop
  (``pprun.engine.engine_loop``), which adds it before its next step, so new requests join the
  running batches (continuous batching across clients, and across the ``pp`` batches in flight,
  which the scheduler fills as usual);
* after each step the loop reports every updated request's new token ids; the client turns them
  into :class:`~pprun.engine.outputs.RequestDelta` s (incrementally detokenized, stop strings held
  back) and puts each on its request's :class:`RequestStream`; an asyncio caller's deltas of one
  step are delivered with a single ``call_soon_threadsafe``;
* an abort (client cancelled, disconnected, deadline passed) is applied before the loop's next
  step: the scheduler frees the request's blocks at once, so they are back within one step;
* a stage failure ends every stream with an error delta, and the client refuses new requests;
* :meth:`EngineClient.shutdown` drains: new requests are refused, running ones get up to a drain
  timeout to finish, the rest are aborted.

Two clients: :class:`AsyncEngine` runs the loop on a thread of this process;
``pprun.engine.engine_process.EngineProcess`` runs it in a process of its own, so that stepping
the model and serving (gRPC, tokenizing, detokenizing) do not share one interpreter lock.
"""

from __future__ import annotations

import abc
import asyncio
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pprun.config.config import PprunConfig
from pprun.config.validate import ResolvedConfig
from pprun.engine.detokenizer import IncrementalDetokenizer
from pprun.engine.engine_loop import (
    STOP,
    AbortCommand,
    AddCommand,
    Command,
    EngineLoop,
    FinishedUpdate,
    StepReport,
    serving_facts,
)
from pprun.engine.inputs import InputProcessor
from pprun.engine.llm_engine import LLMEngine
from pprun.engine.outputs import RequestDelta
from pprun.engine.request_latency import LatencyHistograms, RequestTimes
from pprun.engine.resolve import resolve_config
from pprun.sampling.params import SamplingParams

logger = logging.getLogger(__name__)


class EngineClosedError(RuntimeError):
    """The engine is draining or stopped (or a stage failed): it takes no new requests."""


class QueueFullError(RuntimeError):
    """Too many requests are queued; the caller should retry later."""


class RequestStream:
    """The deltas of one request, in order; the last one has ``finished=True``.

    Iterate with ``async for`` when the request was added with an event loop (the deltas are
    delivered on that loop), or with ``for`` (blocking) when it was added without one.  An
    ``async for`` reader that falls behind the engine gets the deltas that piled up merged into
    one (:func:`merge_deltas`): a slow client costs one wake-up and one message per read, not one
    per step, and what it receives joins to the same output.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop | None) -> None:
        self.request_id = request_id
        self.loop = loop
        self._pending: list[RequestDelta] = []
        """Delivered, not yet read (asyncio streams; touched on the loop's thread only)."""
        self._waiter: asyncio.Future | None = None
        self._queue: queue.SimpleQueue | None = queue.SimpleQueue() if loop is None else None
        self.finished = False

    def _put(self, delta: RequestDelta) -> None:
        """Deliver a delta (on the stream's loop for asyncio streams)."""
        if self._queue is not None:
            self._queue.put(delta)
            return
        self._pending.append(delta)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def __aiter__(self) -> AsyncIterator[RequestDelta]:
        if self.loop is None:
            raise TypeError("this stream was added without an event loop: iterate it with `for`")
        while not self.finished:
            if not self._pending:
                self._waiter = self.loop.create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
            pending, self._pending = self._pending, []
            delta = pending[0] if len(pending) == 1 else merge_deltas(pending)
            self.finished = delta.finished
            yield delta

    def __iter__(self) -> Iterator[RequestDelta]:
        if self._queue is None:
            raise TypeError("this stream delivers on an event loop: iterate it with `async for`")
        while not self.finished:
            delta = self._queue.get()
            self.finished = delta.finished
            yield delta


def merge_deltas(deltas: list[RequestDelta]) -> RequestDelta:
    """Consecutive deltas of one request as one: tokens, text and logprobs joined; the last
    one's state (finished, reasons, counts, timings)."""
    last = deltas[-1]
    logprobs = None
    if any(d.logprobs is not None for d in deltas):
        logprobs = [lp for d in deltas for lp in (d.logprobs or ())]
    return RequestDelta(
        last.request_id, [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas), logprobs,
        finished=last.finished, finish_reason=last.finish_reason, stop_reason=last.stop_reason, error=last.error,
        num_prompt_tokens=last.num_prompt_tokens, num_output_tokens=last.num_output_tokens, metrics=last.metrics,
    )  # fmt: skip


@dataclass
class _Active:
    """The client's state of one streaming request."""

    stream: RequestStream
    params: SamplingParams
    num_prompt_tokens: int
    detok: IncrementalDetokenizer
    hold_back: int
    """Characters kept back while they could begin a stop string (longest stop string - 1)."""
    times: RequestTimes
    num_sent_tokens: int = 0
    num_sent_chars: int = 0


def max_unfinished_requests(cfg: PprunConfig, max_queued_requests: int) -> int:
    """Requests a client accepts at once: what the scheduler runs (``scheduler.max_num_seqs``)
    plus ``max_queued_requests`` waiting; raises ValueError on a bad ``max_queued_requests``."""
    if not isinstance(max_queued_requests, int) or max_queued_requests < 0:
        raise ValueError(f"max_queued_requests={max_queued_requests!r} is invalid: must be an integer >= 0")
    return cfg.scheduler.max_num_seqs + max_queued_requests


class EngineClient(abc.ABC):
    """The callers' side of a serving engine: validation, request streams, detokenizing, health,
    draining.  Where the engine loop runs is the subclass's: it sends commands (:meth:`_send`),
    feeds each :class:`~pprun.engine.engine_loop.StepReport` to :meth:`_on_report`, stops the
    loop (:meth:`_stop_engine`) and says what the engine counts.

    Past ``max_unfinished`` unfinished requests :meth:`add_request` raises :class:`QueueFullError`.
    """

    def __init__(self, inputs: InputProcessor, max_unfinished: int) -> None:
        self.inputs = inputs
        self.max_unfinished = max_unfinished
        self._active: dict[str, _Active] = {}
        self._lock = threading.Condition()
        """Guards ``_active`` (added to by callers, removed from by whoever delivers reports)."""
        self._closing = False
        self._stopped = False
        self.dead: str | None = None
        """Why the engine failed (a stage died); None while healthy."""
        self._health_listeners: list[Callable[[bool], None]] = []
        self._id_prefix = uuid.uuid4().hex[:12]
        self._ids = itertools.count()
        """Request ids the client assigns: this client's random prefix and a count (``uuid4`` per
        request reads the OS's random source, a syscall on the event loop for every request)."""
        self.latency = LatencyHistograms()
        """Time to first token, per output token, between tokens and in the queue, observed as
        reports come (``pprun.engine.request_latency``; served on ``/metrics``)."""

    # --- what the subclass provides ---------------------------------------------------------------

    @abc.abstractmethod
    def _send(self, cmd: Command) -> None:
        """Hand a command to the engine loop (applied before its next step)."""
        raise NotImplementedError

    @abc.abstractmethod
    def _stop_engine(self) -> None:
        """Stop the engine loop and the stages (every request has ended)."""
        raise NotImplementedError

    @property
    @abc.abstractmethod
    def num_steps(self) -> int:
        """Steps the engine has submitted so far (``LLMEngine.num_steps``): what "within one
        step" is counted in."""
        raise NotImplementedError

    @abc.abstractmethod
    def num_free_blocks(self) -> int:
        """KV blocks free in the scheduler's block manager."""
        raise NotImplementedError

    @property
    @abc.abstractmethod
    def num_first_uses_after_ready(self) -> int:
        """What the engine compiled, captured or ran for the first time after it reported ready
        (keys of its first-use record, ``pprun.utils.first_use``; 0 when the warm-up covered all)."""
        raise NotImplementedError

    @abc.abstractmethod
    def describe(self) -> dict:
        """The engine's facts (model, runner, executor, stage layout) plus ``max_model_len`` and
        the block size."""
        raise NotImplementedError

    @abc.abstractmethod
    def cache_stats(self) -> dict:
        """Prefix-cache hit rate, queries, hits and block counts (``LLMEngine.cache_stats``)."""
        raise NotImplementedError

    # --- state ------------------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """True while the engine takes requests (no stage failure, not draining)."""
        return self.dead is None and not self._closing

    def add_health_listener(self, listener: Callable[[bool], None]) -> None:
        """Call ``listener(healthy)`` when a stage fails or shutdown starts (from whichever thread
        notices)."""
        self._health_listeners.append(listener)

    def _health_changed(self) -> None:
        for listener in list(self._health_listeners):
            try:
                listener(self.healthy)
            except Exception:  # a listener's bug must not stop the engine
                logger.exception("health listener failed")

    @property
    def num_unfinished(self) -> int:
        """Requests accepted whose last delta has not been delivered yet."""
        return len(self._active)

    # --- requests ---------------------------------------------------------------------------------

    def check_request(self, prompt: object, params: object, where: str = "request") -> tuple[str | None, list[int]]:
        """Validate a prompt (str or ``{"prompt_token_ids": [...]}``) and its sampling parameters
        in the caller's thread; returns ``(text, token_ids)`` or raises ValueError naming ``where``
        (the engine's own checks and messages, :class:`~pprun.engine.inputs.InputProcessor`),
        ``max_tokens`` against what the context leaves after the prompt included."""
        self.inputs.check_params(params, f"{where}.sampling_params")
        text, ids = self.inputs.check_prompt(prompt, f"{where}.prompt")
        self.inputs.check_output_room(len(ids), params, f"{where}.sampling_params")
        return text, ids

    def chat_prompt(self, messages: object, where: str = "messages", *, add_generation_prompt: bool = True) -> dict:
        """A chat conversation rendered with the model's template into a token-id prompt."""
        return self.inputs.render_chat(messages, where, add_generation_prompt=add_generation_prompt)

    def add_request(
        self,
        prompt: str | dict,
        params: SamplingParams,
        request_id: str | None = None,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        where: str = "request",
    ) -> RequestStream:
        """Validate and queue a request; returns its stream of deltas.

        With ``loop`` the deltas are delivered on that event loop (``async for``), without it
        into a blocking queue (``for``).  Raises ValueError (bad prompt, parameters or a
        ``request_id`` in use), :class:`EngineClosedError` (draining, stopped or failed) or
        :class:`QueueFullError`.  Error messages name ``where`` (``request.prompt: ...``).
        """
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise ValueError(f"request_id={request_id!r} is invalid: must be a non-empty string, or None")
        self._check_open()
        _, ids = self.check_request(prompt, params, where)
        req_id = request_id or f"{self._id_prefix}-{next(self._ids)}"
        stops = params.stop or []
        arrival_time = time.time()
        active = _Active(
            RequestStream(req_id, loop),
            params,
            len(ids),
            IncrementalDetokenizer(self.inputs.tokenizer, params.skip_special_tokens),
            hold_back=max((len(s) for s in stops), default=1) - 1,
            times=RequestTimes(arrival_time),
        )
        with self._lock:
            self._check_open()
            if req_id in self._active:
                raise ValueError(f"request_id={req_id!r} is invalid: a request with this id is running")
            if len(self._active) >= self.max_unfinished:
                raise QueueFullError(
                    f"{len(self._active)} requests are unfinished, the most this server queues "
                    f"(scheduler.max_num_seqs + serve.max_queued_requests = {self.max_unfinished}); retry later"
                )
            self._active[req_id] = active
            self.latency.unfinished.set(len(self._active))
        self._send(AddCommand(req_id, ids, params, arrival_time))
        return active.stream

    async def generate(self, prompt: str | dict, params: SamplingParams, request_id: str | None = None) -> AsyncIterator[RequestDelta]:
        """Add a request and yield its deltas on the running event loop; leaving the loop early
        (the caller was cancelled, or broke out) aborts the request."""
        stream = self.add_request(prompt, params, request_id, loop=asyncio.get_running_loop())
        try:
            async for delta in stream:
                yield delta
        finally:
            if not stream.finished:
                self.abort(stream.request_id)

    def abort(self, request_id: str) -> bool:
        """Abort a running request (its stream ends with finish_reason "abort"); returns False
        when no request with this id is running."""
        with self._lock:
            if request_id not in self._active:
                return False
        self._send(AbortCommand(request_id))
        return True

    def _check_open(self) -> None:
        if self.dead is not None:
            raise EngineClosedError(f"the engine has failed ({self.dead}); the server must be restarted")
        if self._closing:
            raise EngineClosedError("the engine is shutting down and takes no new requests")

    # --- lifecycle --------------------------------------------------------------------------------

    def stop_accepting(self) -> None:
        """Refuse new requests from now on (:class:`EngineClosedError`); running ones go on.
        The first step of :meth:`shutdown`, callable ahead of it."""
        was_healthy = self.healthy
        self._closing = True
        if was_healthy:
            self._health_changed()

    def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        """Refuse new requests, give running ones ``drain_timeout_s`` to finish, abort the rest,
        then stop the engine loop and the stages.  Idempotent."""
        if self._stopped:
            return
        self.stop_accepting()
        deadline = time.monotonic() + max(0.0, drain_timeout_s)
        with self._lock:
            self._lock.wait_for(lambda: not self._active, timeout=max(0.0, deadline - time.monotonic()))
            left = list(self._active)
        if left:
            logger.warning("drain timeout (%.1f s): aborting %d unfinished request(s)", drain_timeout_s, len(left))
            for req_id in left:
                self._send(AbortCommand(req_id))
            with self._lock:
                self._lock.wait_for(lambda: not self._active, timeout=10.0)
        self._stopped = True
        self._stop_engine()

    # --- reports into deltas ----------------------------------------------------------------------

    def _on_report(self, report: StepReport) -> None:
        """One step's deltas: new tokens (and text) of running requests, then the finished ones'
        last; delivered together."""
        if report.failure is not None:
            self._fail(report.failure, report.finished)
            return
        deliveries: list[tuple[_Active, RequestDelta]] = []
        timed: list[tuple[RequestTimes, int]] = []
        actives = self._active
        detokenize = self.inputs.tokenizer is not None
        for req_id, new_ids, logprobs in report.updates():
            active = actives.get(req_id)
            if active is None:
                continue
            timed.append((active.times, len(new_ids)))
            text = ""
            if detokenize:
                active.detok.add(new_ids)
                visible = len(active.detok.text) - active.hold_back
                if visible > active.num_sent_chars:
                    text = active.detok.text[active.num_sent_chars : visible]
            active.num_sent_tokens += len(new_ids)
            active.num_sent_chars += len(text)
            deliveries.append((active, RequestDelta(req_id, new_ids, text, logprobs,
                                                    num_prompt_tokens=active.num_prompt_tokens,
                                                    num_output_tokens=active.num_sent_tokens)))
        for fin in report.finished:
            active = actives.get(fin.request_id)
            if active is not None:
                timed.append((active.times, len(fin.new_token_ids)))
                deliveries.append((active, self._final_delta(active, fin)))
        if timed:
            self.latency.step_tokens(report.time, timed)
        for fin in report.finished:
            active = actives.get(fin.request_id)
            if active is not None:
                self.latency.finished(active.times, fin.metrics)
        self._deliver(deliveries)

    def _final_delta(self, active: _Active, fin: FinishedUpdate) -> RequestDelta:
        text = ""
        if self.inputs.tokenizer is not None:
            if fin.new_token_ids:
                active.detok.add(fin.new_token_ids)
            text = active.detok.finish(fin.text, active.num_sent_chars)
        return RequestDelta(
            fin.request_id, fin.new_token_ids, text, fin.logprobs, finished=True,
            finish_reason=fin.finish_reason, stop_reason=fin.stop_reason, error=fin.error,
            num_prompt_tokens=fin.num_prompt_tokens, num_output_tokens=fin.num_output_tokens, metrics=fin.metrics,
            num_cached_tokens=fin.num_cached_tokens,
        )  # fmt: skip

    def _error_delta(self, active: _Active, why: str) -> RequestDelta:
        return RequestDelta(active.stream.request_id, [], "", finished=True, finish_reason="error", error=why,
                            num_prompt_tokens=active.num_prompt_tokens, num_output_tokens=active.num_sent_tokens)

    def _deliver(self, deliveries: list[tuple[_Active, RequestDelta]]) -> None:
        """Put deltas on their streams (one hand-over per event loop) and forget finished ones."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestDelta]]] = {}
        ended = []
        for active, delta in deliveries:
            stream = active.stream
            if delta.finished:
                ended.append(stream.request_id)
            if stream.loop is None:
                stream._put(delta)
            else:
                by_loop.setdefault(stream.loop, []).append((stream, delta))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the caller's loop is closed: nobody is listening
                pass
        if ended:
            with self._lock:
                for req_id in ended:
                    self._active.pop(req_id, None)
                self.latency.unfinished.set(len(self._active))
                self._lock.notify_all()

    def _fail(self, why: str, finished: list[FinishedUpdate]) -> None:
        """The engine failed: every stream ends with an error delta (``finished``: what the
        engine had of some of them); new requests are refused."""
        with self._lock:
            # Under the lock add_request checks and adds under: a request is refused or ends here.
            self.dead = why
            active_now = list(self._active.items())
        self._health_changed()  # before the streams end: a client that sees its error then asks sees it too
        by_id = {fin.request_id: fin for fin in finished}
        deliveries = []
        for req_id, active in active_now:
            fin = by_id.get(req_id)
            delta = self._final_delta(active, fin) if fin is not None else self._error_delta(active, why)
            delta.finish_reason, delta.error = "error", why
            deliveries.append((active, delta))
        self._deliver(deliveries)


class AsyncEngine(EngineClient):
    """An :class:`LLMEngine` stepped by an engine loop on its own thread of this process, taking
    requests from any thread.

    ``config``: the run's :class:`~pprun.config.validate.ResolvedConfig`, or a :class:`PprunConfig`
    resolved here (``pprun.engine.resolve.resolve_config``).
    ``max_queued_requests`` bounds the requests accepted beyond what the scheduler runs at once
    (``scheduler.max_num_seqs``): past ``max_num_seqs + max_queued_requests`` unfinished requests,
    :meth:`add_request` raises :class:`QueueFullError`.
    """

    def __init__(self, config: PprunConfig | ResolvedConfig, *, max_queued_requests: int = 1024) -> None:
        resolved = resolve_config(config)  # the run's one validation (a ResolvedConfig as is)
        max_unfinished = max_unfinished_requests(resolved.cfg, max_queued_requests)
        self.engine = LLMEngine(resolved)
        self.cfg = resolved.cfg
        super().__init__(self.engine.inputs, max_unfinished)
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._loop = EngineLoop(self.engine, self._take_commands, self._on_report)
        self._thread = threading.Thread(target=self._loop.run, name="pprun-engine", daemon=True)
        self._thread.start()

    @property
    def num_steps(self) -> int:
        """Steps the engine has submitted so far (``LLMEngine.num_steps``)."""
        return self.engine.num_steps

    @property
    def num_first_uses_after_ready(self) -> int:
        """Keys the engine's first-use record met after ready."""
        return len(self.engine.first_use.after_ready)

    def num_free_blocks(self) -> int:
        """KV blocks free in the scheduler's block manager (a consistent snapshot of one int)."""
        return self.engine.scheduler.block_manager.num_free_blocks

    def describe(self) -> dict:
        """The engine's facts (model, runner, executor, stage layout) plus ``max_model_len`` and
        the block size."""
        return serving_facts(self.engine)

    def cache_stats(self) -> dict:
        """The engine's prefix-cache stats now (read from the engine thread's counters)."""
        return self.engine.cache_stats()

    def _send(self, cmd: Command) -> None:
        self._commands.put(cmd)

    def _stop_engine(self) -> None:
        self._commands.put(STOP)  # wakes an idle engine thread
        self._thread.join(timeout=max(10.0, self.cfg.parallel.stage_timeout_s + 5))
        self.engine.shutdown()

    def _take_commands(self, wait_s: float) -> list[Command]:
        """Every queued command; with ``wait_s`` > 0 and none queued, the first one to come within
        ``wait_s`` (the queue wakes this thread the moment a caller puts one: no poll tick)."""
        cmds = []
        try:
            cmds.append(self._commands.get(timeout=wait_s) if wait_s > 0 else self._commands.get_nowait())
        except queue.Empty:
            return cmds
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds


def _put_all(items: list[tuple[RequestStream, Any]]) -> None:
    for stream, delta in items:
        stream._put(delta)
