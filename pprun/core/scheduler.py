"""Continuous-batching FCFS scheduler with chunked prefill and preemption by recompute.

Plain Python (no torch).  One ``schedule()`` call makes one :class:`SchedulerOutput`; the
step's :class:`ModelRunnerOutput` comes back through ``update_from_output``.  Up to
``max_in_flight`` steps may be outstanding (pipeline parallelism keeps ``pp`` batches in
flight); a request is in at most one of them, because a decode needs the token sampled by
the previous step.

Every decision depends only on the order of calls and the token ids, never on time or
process-dependent hashing (prefix-cache hashes are SHA-256), so SPMD ranks that each run their
own scheduler on the same inputs emit identical outputs.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from pprun.core.block_manager import BlockManager, min_blocks_for_one_request
from pprun.core.outputs import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pprun.core.request import FINISH_REASON_TO_STATUS, Request, RequestStatus
from pprun.multimodal.encoder_budget import (
    EncoderCacheManager,
    encoder_cost,
    plan_encoder_inputs,
    reads_cross_attention,
)

__all__ = ["Scheduler", "min_blocks_for_one_request"]


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} is invalid: must be an integer >= 1")


class _EncoderPlan(NamedTuple):
    """A request's window cut where the step's encoder budget ends, and what it encodes."""

    num_new_tokens: int
    to_encode: list[int]
    """Indices into the request's ``mm_items`` to encode this step."""
    cost: int
    """Encoder rows they take of the step's encoder budget."""


class _Admission(NamedTuple):
    """How a waiting request enters the step: its cached prefix and the window after it."""

    cached_block_ids: list[int]
    num_computed: int
    """Tokens of the cached prefix (whole blocks)."""
    num_new_tokens: int
    encoder: _EncoderPlan | None
    """None: the request has no multimodal items."""


class _RunningOrder(NamedTuple):
    """The running requests a step looks at before the waiting ones, and the async joiners it
    looks at after them."""

    candidates: list[Request]
    joiners: list[Request]


@dataclass
class _StepPlan:
    """The step being built: what the phases have put in it so far, and the budgets left."""

    step_cap: int
    """Most requests the step may take (:meth:`Scheduler._step_request_cap`)."""
    token_budget: int
    encoder_budget: int
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    scheduled: list[Request] = field(default_factory=list)
    encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    samples: list[str] = field(default_factory=list)
    """Ids of the requests the step samples for."""
    preempted: bool = False
    """Some running request was preempted for blocks: no waiting request is admitted."""


class Scheduler:
    """Decides which requests run each step and how many tokens each computes.

    Policy: first the running requests in arrival order (one decode token each, or their next
    prefill chunk), then waiting ones (new or preempted) in arrival order while
    ``max_num_seqs``, the token budget ``max_num_batched_tokens`` and the free KV blocks
    allow.  Waiting requests are admitted strictly first-come first-served: the first one
    that does not fit blocks those behind it.  When a running request needs a KV block and
    none is free, the most recently arrived running request that is not in flight (possibly
    itself) is preempted: its blocks are freed and it is recomputed later from its prompt and
    outputs.  With prefix caching, a waiting request is admitted with its cached prefix (whole
    blocks, never its last token) already computed, and a preempted one's freed blocks stay
    cached for its resumption until the pool needs them.
    """

    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        block_size: int,
        num_blocks: int,
        enable_chunked_prefill: bool = True,
        max_in_flight: int = 1,
        spread_over_in_flight: bool = False,
        async_scheduling: bool = False,
        max_num_encoder_tokens: int | None = None,
        enable_prefix_caching: bool = False,
        num_cross_slots: int | None = None,
    ) -> None:
        _positive_int("max_num_seqs", max_num_seqs)
        if num_cross_slots is not None:
            _positive_int("num_cross_slots", num_cross_slots)
        _positive_int("max_num_batched_tokens", max_num_batched_tokens)
        _positive_int("max_model_len", max_model_len)
        _positive_int("block_size", block_size)
        _positive_int("max_in_flight", max_in_flight)
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            # Without chunking a whole prompt (or a resumed prompt+outputs) must fit in one
            # step, or it would wait forever.
            raise ValueError(
                f"max_num_batched_tokens={max_num_batched_tokens} is invalid with "
                f"enable_chunked_prefill=False: must be >= max_model_len={max_model_len}"
            )
        self._default_encoder_budget = max_num_encoder_tokens is None
        if max_num_encoder_tokens is None:
            # Every embedded item of any prompt fits in one step (its rows are at most the
            # prompt's length); a larger cross-attention item raises it (add_request).
            max_num_encoder_tokens = max(max_num_batched_tokens, max_model_len)
        _positive_int("max_num_encoder_tokens", max_num_encoder_tokens)
        self.max_num_encoder_tokens = max_num_encoder_tokens
        """Encoder output rows (image/audio embeddings, a Whisper window's encoder positions) a
        step may compute: the encoder budget."""
        self.encoder_cache = EncoderCacheManager()
        """Which multimodal items' encoder outputs the first stage holds, and who needs them."""
        self.enable_prefix_caching = enable_prefix_caching
        """Reuse cached full KV blocks a new request's tokens start with (``pprun.core.block_manager``):
        the request is admitted with ``num_computed_tokens`` at the cached prefix's end."""
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        min_blocks = min_blocks_for_one_request(max_model_len, block_size)
        if self.block_manager.num_usable_blocks < min_blocks:
            raise ValueError(
                f"num_blocks={num_blocks} is too small: one request of max_model_len="
                f"{max_model_len} tokens needs {min_blocks} blocks of block_size={block_size}, "
                f"plus the reserved null block, so num_blocks must be >= {min_blocks + 1}"
            )
        self.max_num_seqs = max_num_seqs
        self.num_cross_slots = num_cross_slots
        """An encoder-decoder model's cross-attention slots per stage (None: a decoder-only model).
        Every running request holds one, from its admission (new or resumed) until the step after
        it ends or is preempted, whose ``finished_req_ids`` free it before that step's new
        requests take theirs; a waiting request is admitted only while one is free."""
        self.max_num_running = min(max_num_seqs, num_cross_slots or max_num_seqs)
        """Requests that may run at once: ``max_num_seqs``, or fewer cross-attention slots."""
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.enable_chunked_prefill = enable_chunked_prefill
        self.max_in_flight = max_in_flight
        self.spread_over_in_flight = spread_over_in_flight
        """Cap each step at ceil(unfinished / batches) requests, so that with pipeline parallelism
        every stage gets a batch (the engine turns this on for pp > 1); batches are
        ``max_in_flight``, or half of it with async scheduling (each batch two steps in flight)."""
        self.async_scheduling = async_scheduling
        """Let a decoding request join the next step while its current step is still in flight
        (a runner that feeds the token sampled on the device into the next step's input: at
        pp = 1 the previous step's samples, in a pipeline the ids the last stage sends to the
        first): the host's scheduling and bookkeeping then overlap the device's compute.  The
        cost: a request that stops in step N has already computed one token in step N+1, whose
        output is dropped.  Each request is then in at most two steps: ``max_in_flight`` is 2,
        or with ``spread_over_in_flight`` twice the number of batches."""
        if async_scheduling and max_in_flight != 2 and not (spread_over_in_flight and max_in_flight % 2 == 0):
            raise ValueError(
                f"async_scheduling needs max_in_flight=2, or an even max_in_flight (two steps per "
                f"batch) with spread_over_in_flight, got max_in_flight={max_in_flight}"
            )

        # Unfinished requests by id (dicts keep insertion order: deterministic iteration).
        self._requests: dict[str, Request] = {}
        # Both queues are kept sorted by arrival_index.
        self._waiting: list[Request] = []
        self._running: list[Request] = []
        self._num_arrived = 0
        self._next_step_id = 0
        self._num_steps_built = 0
        """Non-empty steps built so far (ids also go to empty steps, which never run)."""
        self._num_batches = max_in_flight // 2 if async_scheduling else max_in_flight
        """Batches a pipeline's requests are spread over (``spread_over_in_flight``): with async
        scheduling each batch has two steps in flight."""
        # Ids the runners must drop, reported in the next SchedulerOutput.
        self._pending_finished_req_ids: dict[str, None] = {}
        # Non-empty steps whose output has not come back: step_id -> the requests scheduled.
        self._steps_in_flight: dict[int, list[Request]] = {}
        # Per in-flight step: ids of the requests it samples for.
        self._step_samples: dict[int, list[str]] = {}

    # ------------------------------------------------------------------ queries

    @property
    def num_waiting(self) -> int:
        """Requests waiting to be admitted (new or preempted)."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Requests holding KV blocks (in flight or not)."""
        return len(self._running)

    @property
    def num_steps_in_flight(self) -> int:
        """Scheduled non-empty steps whose output has not come back."""
        return len(self._steps_in_flight)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self._requests)

    def has_schedulable_requests(self) -> bool:
        """True when some unfinished request is not in flight (a step might schedule it)."""
        return any(not req.in_flight for req in self._requests.values())

    def can_schedule(self) -> bool:
        """True when fewer than ``max_in_flight`` steps are outstanding."""
        return len(self._steps_in_flight) < self.max_in_flight

    def can_fit(self, num_tokens: int) -> bool:
        """True when a prompt of ``num_tokens`` tokens is admissible at all.

        It must be non-empty, at most ``max_model_len`` long, and its KV must fit in the cache
        on its own.
        """
        return (
            1 <= num_tokens <= self.max_model_len
            and self.block_manager.blocks_needed(num_tokens, 0) <= self.block_manager.num_usable_blocks
        )

    def get_request(self, req_id: str) -> Request | None:
        """The unfinished request with this id, or ``None``."""
        return self._requests.get(req_id)

    # ------------------------------------------------------------------ lifecycle

    def add_request(self, req: Request) -> None:
        """Queue a new request; it is scheduled after every request added before it."""
        if req.req_id in self._requests:
            raise ValueError(f"req_id={req.req_id!r} is invalid: a request with this id is unfinished")
        num_prompt_tokens = len(req.prompt_token_ids)
        if not self.can_fit(num_prompt_tokens):
            raise ValueError(
                f"prompt_token_ids has {num_prompt_tokens} tokens for request {req.req_id!r}: "
                f"must be between 1 and max_model_len={self.max_model_len}"
            )
        if req.mm_items:
            biggest = max(encoder_cost(item) for item in req.mm_items)
            if self._default_encoder_budget:
                # The token-sized default fits every embedded item (its rows are prompt tokens,
                # which the token budget limits anyway).  An item read through cross-attention
                # (a Whisper window: encoder positions, no prompt rows) raises it to a full batch
                # of the largest such item, so max_num_seqs requests start and are encoded in
                # one step, as a batch of clips is transcribed; a budget that admits fewer
                # windows per step takes max_num_seqs / fewer steps to fill the batch, each an
                # eager step with its own encoder call.  An embedded item larger than the
                # default raises it the same way.
                reads_cross = any(reads_cross_attention(item) for item in req.mm_items)
                if reads_cross or biggest > self.max_num_encoder_tokens:
                    self.max_num_encoder_tokens = max(self.max_num_encoder_tokens, biggest * self.max_num_running)
            if biggest > self.max_num_encoder_tokens:
                raise ValueError(
                    f"request {req.req_id!r} has a multimodal item of {biggest} encoder rows: "
                    f"must be at most scheduler.max_num_encoder_tokens={self.max_num_encoder_tokens}"
                )
            self.encoder_cache.add_request(req.req_id, req.mm_items)
        req.status = RequestStatus.WAITING
        req.arrival_index = self._num_arrived
        self._num_arrived += 1
        self._requests[req.req_id] = req
        self._waiting.append(req)

    def abort_requests(self, req_ids: str | Iterable[str], finish_reason: str = "abort") -> list[Request]:
        """End the given requests wherever they are (waiting, running or in flight).

        Unknown or already finished ids are ignored.  ``finish_reason`` is ``"abort"`` or, when
        the engine ends a request itself (a stop string), ``"stop"``, ``"length"`` or
        ``"error"``.  Returns the requests ended.  An in-flight request's blocks are freed at
        once: every stage runs steps in order, so its pending KV writes land before those of
        any later step that reuses the blocks.
        """
        if finish_reason not in FINISH_REASON_TO_STATUS:
            raise ValueError(
                f"finish_reason={finish_reason!r} is invalid: must be one of "
                f"{sorted(FINISH_REASON_TO_STATUS)}"
            )
        if isinstance(req_ids, str):
            req_ids = [req_ids]
        status = FINISH_REASON_TO_STATUS[finish_reason]
        aborted = []
        for req_id in req_ids:
            req = self._requests.get(req_id)
            if req is None:
                continue
            self._finish(req, status, finish_reason)
            aborted.append(req)
        return aborted

    def fail_all(self, reason: str = "error") -> list[Request]:
        """End every unfinished request with ``FINISHED_ERROR`` (a stage died); returns them.

        Outputs of steps still in flight are ignored if they ever come back.
        """
        failed = sorted(self._requests.values(), key=lambda r: r.arrival_index)
        for req in failed:
            self._finish(req, RequestStatus.FINISHED_ERROR, reason)
        self._steps_in_flight.clear()
        self._step_samples.clear()
        return failed

    # ------------------------------------------------------------------ scheduling

    def schedule(self) -> SchedulerOutput:
        """Build the next step.  Raises ``RuntimeError`` if ``max_in_flight`` steps are out.

        Scheduled requests are marked in flight and their ``num_computed_tokens`` advanced.
        The step may be empty (nothing schedulable) yet still carry ``finished_req_ids``; the
        engine must pass it on to the runners all the same.
        """
        if not self.can_schedule():
            raise RuntimeError(
                f"schedule() called with {len(self._steps_in_flight)} steps in flight: "
                f"max_in_flight={self.max_in_flight}; call update_from_output first"
            )
        num_unfinished = min(len(self._requests), self.max_num_running)
        step = _StepPlan(
            step_cap=self._step_request_cap(num_unfinished),
            token_budget=self.max_num_batched_tokens,
            encoder_budget=self.max_num_encoder_tokens,
        )
        if self.enable_prefix_caching:
            self.block_manager.begin_step()
        order = self._plan_running_order(num_unfinished, step.step_cap)
        self._take_running(step, order.candidates)
        # Skipped after a preemption: the blocks just freed are for the running requests, and
        # re-admitting the victim now would only thrash.
        if not step.preempted:
            self._admit_waiting(step)
        if order.joiners:
            self._take_running(step, order.joiners)
        return self._close_step(step)

    def _plan_running_order(self, num_unfinished: int, step_cap: int) -> _RunningOrder:
        """The running requests this step looks at, earliest arrival first, and the async joiners
        it looks at after the waiting ones (none unless async steps spread over pipeline batches).

        Pipeline batches with async steps: requests out of flight (and the waiting ones) first,
        then those joining a step they are still in — only a step at least a round of batches
        back (counted in steps that run), oldest first.  The first stage computes a joiner's next
        token from the ids the last stage sends it once that step is through the whole pipeline:
        a join straight behind its own step (what taking joiners in arrival order drifts into)
        makes every step wait for the one before it, slower than the synchronous pipeline
        (docs/performance.md, "Pipeline settings").  The round is the batches the unfinished
        requests fill: a lone request joins right behind itself.
        """
        if not (self.async_scheduling and self.spread_over_in_flight):
            return _RunningOrder(self._running, [])
        batches_in_use = min(self._num_batches, -(-num_unfinished // step_cap))
        newest_allowed = self._num_steps_built - batches_in_use
        joiners = sorted(
            (r for r in self._running if r.num_steps_in_flight and r.last_step_pos <= newest_allowed),
            key=lambda r: r.last_step_pos,
        )
        return _RunningOrder([r for r in self._running if not r.num_steps_in_flight], joiners)

    def _take_running(self, step: _StepPlan, reqs: list[Request]) -> None:
        """Add running requests ``reqs``, in order, while the step has room: each its next decode
        token or prefill chunk.  One that needs a KV block when none is free preempts
        (:meth:`_allocate_or_preempt`).

        The common case (a decode token within the request's last block) allocates nothing and
        reads lengths directly: with a few hundred requests this loop is most of the engine's
        host time per step.
        """
        block_size, running, async_scheduling = self.block_size, RequestStatus.RUNNING, self.async_scheduling
        cached_reqs = step.cached_reqs
        for req in list(reqs):
            if step.token_budget == 0 or len(step.scheduled) >= step.step_cap:
                break
            if req.status is not running:
                continue  # preempted earlier in this loop
            if req.num_steps_in_flight and (not async_scheduling or not self._can_join_step(req)):
                continue  # in an outstanding step
            num_computed = req.num_computed_tokens
            num_new_tokens = min(
                len(req.prompt_token_ids) + len(req.output_token_ids) + req.num_pending_samples - num_computed,
                step.token_budget,
            )
            if num_new_tokens <= 0:
                continue
            encoder = None
            if req.mm_items:
                encoder = self._plan_encoder(req, num_computed, num_new_tokens, step.encoder_budget)
                num_new_tokens = encoder.num_new_tokens
                if num_new_tokens <= 0:
                    continue
            if num_computed + num_new_tokens <= len(req.block_ids) * block_size:
                new_block_ids = []  # the request's blocks already cover this step
            else:
                new_block_ids, preempted = self._allocate_or_preempt(req, num_computed + num_new_tokens)
                step.preempted = step.preempted or preempted
                if new_block_ids is None:
                    continue  # preempted itself: nothing of it (its encoding neither) is in the step
            if encoder is not None:
                self._commit_encoder(step, req, encoder)
            cached_reqs.req_ids.append(req.req_id)
            cached_reqs.new_block_ids.append(new_block_ids)
            cached_reqs.num_computed_tokens.append(num_computed)
            num_sent = req.num_output_tokens_sent
            outputs = req.output_token_ids
            cached_reqs.new_token_ids.append(outputs[num_sent:] if num_sent < len(outputs) else [])
            req.num_output_tokens_sent = len(outputs)
            self._mark_scheduled(step, req, num_new_tokens)
            if self.enable_prefix_caching and req.num_computed_tokens >= (req.num_registered_blocks + 1) * block_size:
                # Blocks this step fills, as far as their token ids are known (an async step
                # may compute a token the host learns later: named in a later step).  Checked
                # inline first: most decode steps fill no block.
                self.block_manager.register_full_blocks(req, min(req.num_computed_tokens, req.num_tokens))

    def _admit_waiting(self, step: _StepPlan) -> None:
        """Admit waiting requests (new or preempted) strictly first-come first-served while the
        step has room: the first one that does not fit blocks those behind it."""
        while (
            self._waiting
            and step.token_budget > 0
            and len(self._running) < self.max_num_running  # max_num_seqs, or a free cross slot
            and len(step.scheduled) < step.step_cap
        ):
            req = self._waiting[0]
            admission = self._plan_admission(req, step)
            if admission is None:
                break
            num_total_tokens = admission.num_computed + admission.num_new_tokens
            if self.block_manager.allocate(req, num_total_tokens, admission.cached_block_ids) is None:
                break
            self._admit(step, req, admission)

    def _plan_admission(self, req: Request, step: _StepPlan) -> _Admission | None:
        """How the waiting request ``req`` would enter the step: its cached prefix and the window
        after it, cut to the step's budgets; None when it must wait for a later step.

        A waiting request is never in flight (only requests out of flight are preempted), and
        its ``num_computed_tokens`` is 0.
        """
        block_manager = self.block_manager
        cached_block_ids = block_manager.find_cached_prefix(req) if self.enable_prefix_caching else []
        num_computed = len(cached_block_ids) * self.block_size
        num_new_tokens = self._fit_window(req.num_tokens - num_computed, step.token_budget)
        if num_new_tokens is None:
            return None
        if num_new_tokens == 1 and cached_block_ids:
            # A one-token step may run as a fused decode kernel that writes each token's KV and
            # attends in one launch: no block this very step writes may be read.
            num_kept = next(
                (i for i, b in enumerate(cached_block_ids) if block_manager.registered_this_step(b)),
                len(cached_block_ids),
            )
            if num_kept < len(cached_block_ids):
                cached_block_ids = cached_block_ids[:num_kept]
                num_computed = num_kept * self.block_size
                num_new_tokens = self._fit_window(req.num_tokens - num_computed, step.token_budget)
                if num_new_tokens is None:
                    return None  # a prompt is scheduled whole without chunking: next step
        encoder = None
        if req.mm_items:
            encoder = self._plan_encoder(req, num_computed, num_new_tokens, step.encoder_budget)
            if encoder.num_new_tokens == 0 or (
                encoder.num_new_tokens < num_new_tokens and not self.enable_chunked_prefill
            ):
                return None  # the step's encoder budget is spent: FCFS, so the rest wait too
            num_new_tokens = encoder.num_new_tokens
            if num_new_tokens == 1 and any(block_manager.registered_this_step(b) for b in cached_block_ids):
                return None  # cut to one token on a block this step writes (see above): next step
        return _Admission(cached_block_ids, num_computed, num_new_tokens, encoder)

    def _fit_window(self, num_tokens_left: int, token_budget: int) -> int | None:
        """A waiting request's window of ``num_tokens_left`` tokens cut to ``token_budget``; None
        when it does not fit and chunked prefill is off (a prompt is then scheduled whole)."""
        if num_tokens_left <= token_budget:
            return num_tokens_left
        return token_budget if self.enable_chunked_prefill else None

    def _admit(self, step: _StepPlan, req: Request, admission: _Admission) -> None:
        """Move ``req`` (its blocks allocated) from waiting to running as a new request of the step."""
        req.num_computed_tokens = admission.num_computed
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = admission.num_computed
            self.block_manager.record_admission(req, admission.num_computed)
        if admission.encoder is not None:
            self._commit_encoder(step, req, admission.encoder)
        self._waiting.pop(0)
        req.status = RequestStatus.RUNNING
        self._insert_by_arrival(self._running, req)
        step.new_reqs.append(
            NewRequestData(
                req_id=req.req_id,
                prompt_token_ids=req.all_token_ids,
                sampling_params=req.sampling_params,
                block_ids=list(req.block_ids),
                num_computed_tokens=req.num_computed_tokens,
                mm_items=req.mm_items,
                num_prompt_tokens=len(req.prompt_token_ids),
            )
        )
        req.num_output_tokens_sent = req.num_output_tokens
        self._mark_scheduled(step, req, admission.num_new_tokens)
        if self.enable_prefix_caching:
            self.block_manager.register_full_blocks(req, min(req.num_computed_tokens, req.num_tokens))

    def _plan_encoder(self, req: Request, start: int, num_new_tokens: int, encoder_budget: int) -> _EncoderPlan:
        """The encoder budget, planned for ``req``'s window ``[start, start + num_new_tokens)``:
        the window cut where the budget ends, and the items to encode (nothing is committed:
        :meth:`_commit_encoder` does that once the request is in the step)."""
        if start >= len(req.prompt_token_ids):
            return _EncoderPlan(num_new_tokens, [], 0)  # decoding: past every item's range
        num_new_tokens, to_encode, cost = plan_encoder_inputs(
            req.mm_items, start, num_new_tokens, encoder_budget, self.encoder_cache
        )
        return _EncoderPlan(num_new_tokens, to_encode, cost)

    def _commit_encoder(self, step: _StepPlan, req: Request, plan: _EncoderPlan) -> None:
        """``req`` is in the step: its items to encode are listed, charged to the encoder budget
        and counted encoded."""
        if not plan.to_encode:
            return
        step.encoder_inputs[req.req_id] = plan.to_encode
        step.encoder_budget -= plan.cost
        for i in plan.to_encode:
            self.encoder_cache.mark_encoded(req.mm_items[i].content_hash)

    def _close_step(self, step: _StepPlan) -> SchedulerOutput:
        """Give the step built its id, count it in flight when it runs anything, and hand it out
        with the ids and encoder outputs the runners must drop."""
        step_id = self._next_step_id
        self._next_step_id += 1
        if step.scheduled:
            self._num_steps_built += 1
            self._steps_in_flight[step_id] = step.scheduled
            self._step_samples[step_id] = step.samples
        finished_req_ids = set(self._pending_finished_req_ids)
        self._pending_finished_req_ids = {}
        # Frees ride on a step that runs (an empty one never reaches the runners).
        free_encoder_hashes = self.encoder_cache.take_freed() if step.scheduled else []
        return SchedulerOutput(
            step_id=step_id,
            scheduled_new_reqs=step.new_reqs,
            scheduled_cached_reqs=step.cached_reqs,
            num_scheduled_tokens=step.num_scheduled_tokens,
            total_num_scheduled_tokens=sum(step.num_scheduled_tokens.values()),
            finished_req_ids=finished_req_ids,
            scheduled_encoder_inputs=step.encoder_inputs,
            free_encoder_hashes=free_encoder_hashes,
        )

    def _step_request_cap(self, num_unfinished: int) -> int:
        """Most requests one step may take.

        With several steps in flight (pipeline parallelism), the unfinished requests
        (``num_unfinished``, at most ``max_num_seqs``) are spread evenly over the batches: one
        step taking them all would leave the other stages idle.
        """
        if self.max_in_flight == 1 or not self.spread_over_in_flight:
            return self.max_num_seqs
        return max(1, -(-num_unfinished // self._num_batches))

    def _allocate_or_preempt(self, req: Request, num_total_tokens: int) -> tuple[list[int] | None, bool]:
        """Grow ``req``'s blocks to ``num_total_tokens``, preempting the most recently arrived
        requests out of flight (possibly ``req`` itself) until they fit.

        Returns the new block ids (None when ``req`` cannot run this step: no victim left, or it
        was the victim) and whether anything was preempted.
        """
        preempted = False
        while True:
            new_block_ids = self.block_manager.allocate(req, num_total_tokens)
            if new_block_ids is not None:
                return new_block_ids, preempted
            victim = self._pick_preemption_victim()
            if victim is None:
                return None, preempted
            self._preempt(victim)
            preempted = True
            if victim is req:
                return None, preempted

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """Apply one step's sampled tokens; returns requests that got tokens or finished.

        Outputs for requests aborted, failed or finished meanwhile are ignored.  A request
        whose prefill was complete but that got no token is ended with an error rather than
        left waiting forever.
        """
        if runner_output.step_id != scheduler_output.step_id:
            raise ValueError(
                f"runner_output.step_id={runner_output.step_id} does not match "
                f"scheduler_output.step_id={scheduler_output.step_id}"
            )
        step_reqs = self._steps_in_flight.pop(scheduler_output.step_id, None)
        if step_reqs is None:
            return []  # an empty step, or one failed by fail_all
        samples = set(self._step_samples.pop(scheduler_output.step_id, ()))
        running = RequestStatus.RUNNING
        # Keyed by the objects scheduled, not by looking ids up: an aborted id may already be
        # reused by a new request.  Aborted or failed ones are no longer RUNNING (and a request
        # in flight is never preempted, so every other one is finished).
        live_reqs: dict[str, Request] = {}
        for req in step_reqs:
            if req.status is not running:
                continue  # finished: _finish already cleared its counters
            req.num_steps_in_flight -= 1
            if req.req_id in samples:
                req.num_pending_samples -= 1
            live_reqs[req.req_id] = req
        updated: list[Request] = []
        for req_id, token_ids in zip(runner_output.req_ids, runner_output.sampled_token_ids, strict=True):
            req = live_reqs.get(req_id)
            if req is None or not token_ids:
                continue
            for token_id in token_ids:
                req.output_token_ids.append(token_id)
                if self._check_stop(req, token_id):
                    break
            updated.append(req)
        for req in live_reqs.values():
            if (
                not req.num_steps_in_flight
                and req.status is running
                and req.num_computed_tokens >= len(req.prompt_token_ids) + len(req.output_token_ids)
            ):
                self._finish(req, RequestStatus.FINISHED_ERROR, "error")
                updated.append(req)
        return updated

    # ------------------------------------------------------------------ internals

    def _check_stop(self, req: Request, token_id: int) -> bool:
        """Finish ``req`` if ``token_id`` (just appended) ends it; True when it did."""
        params = req.sampling_params
        num_outputs = len(req.output_token_ids)
        if num_outputs >= params.min_tokens:
            if token_id in params.stop_token_ids:
                req.stop_reason = token_id
                self._finish(req, RequestStatus.FINISHED_STOPPED, "stop")
                return True
            if not params.ignore_eos and token_id in req.eos_token_ids:
                self._finish(req, RequestStatus.FINISHED_STOPPED, "stop")
                return True
        if (
            params.max_tokens is not None and num_outputs >= params.max_tokens
        ) or len(req.prompt_token_ids) + num_outputs >= self.max_model_len:
            self._finish(req, RequestStatus.FINISHED_LENGTH, "length")
            return True
        return False

    def _mark_scheduled(self, step: _StepPlan, req: Request, num_new_tokens: int) -> None:
        """Put ``req``'s window of ``num_new_tokens`` in the step: its tokens computed, the step's
        token budget charged, ``req`` in flight (sampling if the window ends its known tokens)."""
        step.num_scheduled_tokens[req.req_id] = num_new_tokens
        step.token_budget -= num_new_tokens
        req.num_computed_tokens += num_new_tokens
        req.last_step_pos = self._num_steps_built  # the step being built, counted in non-empty steps
        # Set now, so a later preemption in this same step cannot pick it.
        req.num_steps_in_flight += 1
        num_tokens = len(req.prompt_token_ids) + len(req.output_token_ids)
        if req.num_computed_tokens >= num_tokens + req.num_pending_samples:
            # This step ends at the last known (or pending) token: it samples the next one.
            req.num_pending_samples += 1
            step.samples.append(req.req_id)
        step.scheduled.append(req)

    def _can_join_step(self, req: Request) -> bool:
        """Not in flight; or, with async scheduling, in exactly one step that samples for it
        (its next token's KV can be computed from the device-side sample), with room left."""
        if not req.in_flight:
            return True
        if not self.async_scheduling or req.num_steps_in_flight > 1 or req.num_pending_samples != 1:
            return False
        params = req.sampling_params
        num_outputs_after = req.num_output_tokens + req.num_pending_samples + 1
        if params.max_tokens is not None and num_outputs_after > params.max_tokens:
            return False  # the pending token already is the last one
        return req.num_tokens + req.num_pending_samples < self.max_model_len

    def _pick_preemption_victim(self) -> Request | None:
        """The most recently arrived running request that is not in flight."""
        for req in reversed(self._running):
            if not req.in_flight:
                return req
        return None

    def _preempt(self, req: Request) -> None:
        self.block_manager.free(req)
        self._running.remove(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.num_output_tokens_sent = 0
        self._insert_by_arrival(self._waiting, req)
        self._pending_finished_req_ids[req.req_id] = None

    def _finish(self, req: Request, status: RequestStatus, finish_reason: str) -> None:
        self.block_manager.free(req)
        if req.mm_items:
            self.encoder_cache.release_request(req.req_id, req.mm_items)
        if req in self._running:
            self._running.remove(req)
        elif req in self._waiting:
            self._waiting.remove(req)
        del self._requests[req.req_id]
        req.status = status
        req.finish_reason = finish_reason
        req.num_steps_in_flight = 0
        req.num_pending_samples = 0
        # Runners must tolerate ids they never held (a request aborted while waiting).
        self._pending_finished_req_ids[req.req_id] = None

    @staticmethod
    def _insert_by_arrival(queue: list[Request], req: Request) -> None:
        bisect.insort(queue, req, key=lambda r: r.arrival_index)
