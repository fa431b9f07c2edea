"""The engine: validation, scheduling, stepping the pipeline and turning tokens into outputs.

One loop (:meth:`LLMEngine.step`) keeps up to ``executor.max_in_flight`` (= pp) steps in
flight: it schedules and submits until that many are outstanding, then waits for the oldest.
The first stage learns what the last stage sampled through the next SchedulerOutput
(``CachedRequestData.new_token_ids``): the engine has those tokens anyway, the message goes
to every stage anyway, so the cost is a few bytes per request per step and no extra hop.
"""

from __future__ import annotations

import gc
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from pprun.config.config import PprunConfig
from pprun.config.validate import ResolvedConfig
from pprun.core.outputs import SchedulerOutput
from pprun.core.request import Request, RequestStatus
from pprun.core.scheduler import Scheduler, min_blocks_for_one_request
from pprun.engine.inputs import InputProcessor, load_tokenizer
from pprun.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, stopped_by_string
from pprun.engine.step_watchdog import StepWatchdog
from pprun.executor.base import StageFailedError
from pprun.sampling.params import SamplingParams
from pprun.utils.first_use import FirstUse
from pprun.utils.startup import freeze_startup_objects, in_background
from pprun.utils.step_trace import EngineStep, EngineTrace, trace_prefix

logger = logging.getLogger(__name__)


@dataclass
class _Tracked:
    """Engine-side bookkeeping of one request (text, logprobs, metrics)."""

    req: Request
    prompt: str | None
    metrics: RequestMetrics
    logprobs: list | None
    text: str = ""
    error: str | None = None


def executor_class(name: str) -> type:
    """The executor class of a resolved ``parallel.executor``."""
    if name == "uni":
        from pprun.executor.uni import UniExecutor

        return UniExecutor
    if name == "mp":
        from pprun.executor.mp import MpExecutor

        return MpExecutor
    if name == "ray":
        from pprun.executor.ray_executor import RayExecutor

        return RayExecutor
    if name == "external_launcher":
        from pprun.executor.external import ExternalLauncherExecutor

        return ExternalLauncherExecutor
    raise ValueError(f"parallel.executor={name!r} is unknown")


class LLMEngine:
    """Owns the scheduler, the tokenizer and the executor of one model, and the
    :class:`~pprun.engine.inputs.InputProcessor` that checks its inputs (:attr:`inputs`).

    ``config``: the run's :class:`~pprun.config.validate.ResolvedConfig`, used as is; a
    :class:`PprunConfig` is resolved here first (``pprun.engine.resolve.resolve_config``), once.
    ``decode_outputs=False``: finished outputs carry no text except where a stop string cut it
    (checking stop strings needs the text); the caller detokenizes — the engine process of
    ``pprun serve``, whose server process does it.
    """

    def __init__(self, config: PprunConfig | ResolvedConfig, *, decode_outputs: bool = True) -> None:
        from pprun.engine.resolve import resolve_config

        rc = resolve_config(config)
        cfg = rc.cfg
        t_start = time.perf_counter()
        self.resolved = rc
        """The run's resolved configuration (handed to the executor and every stage as is)."""
        self.cfg = cfg
        """The configuration as given (``resolved.cfg``)."""
        self.max_model_len = rc.max_model_len
        self.vocab_size = rc.arch.vocab_size
        self.decode_outputs = decode_outputs
        self.runner_name = rc.runner
        self.v2_fallback_reasons = list(rc.v2_fallback_reasons)
        # The executor's imports (Ray's for ray: Executor.prepare) come first; then the tokenizer
        # (transformers' import and its files) loads on a thread while the stages start. Started
        # before them, its imports would hold up the executor's (one interpreter lock) and so the
        # stages.
        executor_cls = executor_class(rc.executor)
        executor_cls.prepare(rc)
        tokenizer = in_background(load_tokenizer, str(rc.tokenizer_dir))
        # The tokenizer is set once its thread is done; the encoder budget is the scheduler's.
        self.inputs = InputProcessor(rc, tokenizer=None, encoder_budget=self._encoder_budget)
        """Prompt and sampling-parameter checks, tokenizing, chat templates, decoding."""
        logger.info(
            "pprun: model %s, %d layers in %d stage(s) %s, executor %s, runner %s, %s %s",
            cfg.model.model,
            rc.arch.num_hidden_layers,
            len(rc.layer_partition),
            rc.layer_partition,
            rc.executor,
            self.runner_name,
            rc.device,
            str(rc.dtype).removeprefix("torch."),
        )
        self.executor = executor_cls(rc, self.runner_name)
        t_loaded = time.perf_counter()
        try:
            self.inputs.tokenizer = tokenizer()
        except BaseException:
            self.executor.shutdown()
            raise
        self.eos_token_ids = set(rc.arch.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        prefix = trace_prefix()
        self.trace = EngineTrace(f"{prefix}.engine.json") if prefix else None
        """Per-step timings (``PPRUN_STEP_TRACE``; ``pprun bench`` sets one for its timed run)."""
        self.async_scheduling = self.executor.async_steps
        self._submit_early = self.executor.submits_async
        """Stages in other processes (mp, ray): a step's output is followed by the next
        submissions before the engine's own bookkeeping (in process and under torchrun, submit
        runs the step itself)."""
        try:
            self._init_cache()
        except BaseException:
            self.executor.shutdown()
            raise
        t_cache = time.perf_counter()
        try:
            self.scheduler = self._make_scheduler()
        except BaseException:
            self.executor.shutdown()
            raise
        self.tracked: dict[str, _Tracked] = {}
        self._aborted: list[str] = []
        """Ids aborted by the user since the last collection (their outputs are due)."""
        self.in_flight: deque[SchedulerOutput] = deque()
        self.last_updated: list[Request] = []
        """Requests whose tokens the last :meth:`step` applied (finished or not): streaming
        (``pprun.engine.async_engine``) reads each one's new tokens from them."""
        self.carry_finished: set[str] = set()
        self.dead: str | None = None
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_preemptions = 0
        """Preemptions (by recompute) of requests finished so far."""
        self.first_use = FirstUse("engine")
        """What steps used for the first time (``pprun.utils.first_use``): step classes and request
        features from each ``SchedulerOutput``, and what the last stage reported with its outputs
        (Triton compiles, CUDA-graph captures, sampler branches).  Ready once the warm-up is over."""
        self.watchdog = StepWatchdog(first_use=self.first_use)
        """Times every step; logs one much slower than its class (``pprun.engine.step_watchdog``)."""
        self.startup_s: dict[str, float] = {
            "load": t_loaded - t_start,
            "kv_cache_and_capture": t_cache - t_loaded,
        }
        """Start-up by part, seconds: stages started and weights loaded (``load``), KV cache
        allocated and CUDA graphs captured with their warm-up runs (``kv_cache_and_capture``), the
        engine's warm-up (``warmup``, :meth:`warm_up`)."""
        try:
            self.warm_up()
        except BaseException:
            self.executor.shutdown()
            raise
        freeze_startup_objects()  # the driver's start-up objects too (tokenizer, Hydra, Ray client)

    def warm_up(self) -> None:
        """Run the warm-up (``compilation.warmup``, ``pprun.engine.warmup``) and mark the engine
        and its stages ready: a first use from now on is counted and logged.  Logs start-up by part."""
        from pprun.engine.warmup import limits_for, plan_warmup, run_warmup

        t0 = time.perf_counter()
        num_steps = 0
        eager = ""
        if self.resolved.warmup:
            waves = plan_warmup(limits_for(self))
            self.watchdog.judging = False
            reports = run_warmup(self, waves)
            self.watchdog.judging = True
            for part, r in reports.items():
                logger.info(
                    "warm-up %s: %d waves, %d steps, %.2f s, %d first uses",
                    part, r.num_waves, r.num_steps, r.seconds, r.num_new_keys,
                )  # fmt: skip
            num_steps = sum(r.num_steps for r in reports.values())
            if "eager decode" in reports:
                r = reports["eager decode"]
                eager = f"; eager decode variants {r.seconds:.2f} s, {r.num_steps} steps"
            # The warm-up leaves nothing behind but what it compiled, captured and loaded.
            self.reset_prefix_cache()
            self.num_steps = self.num_preemptions = 0
            self.watchdog.times.clear()
        self.startup_s["warmup"] = time.perf_counter() - t0
        self.first_use.mark_ready()
        self.executor.mark_ready()
        logger.info(
            "start-up: load %.2f s, KV cache and graph capture %.2f s, warm-up %.2f s (%d steps, %d first uses%s)",
            self.startup_s["load"], self.startup_s["kv_cache_and_capture"], self.startup_s["warmup"], num_steps,
            len(self.first_use.seen), eager,
        )  # fmt: skip

    def first_use_stats(self) -> dict:
        """First uses seen (``FirstUse.snapshot``): the engine's record (step classes, request
        features, the last stage's reports) and each stage's (``stages``, between steps)."""
        stats = self.first_use.snapshot()
        stats["stages"] = self.executor.first_use_snapshots()
        return stats

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (None for a checkpoint without one): ``inputs.tokenizer``."""
        return self.inputs.tokenizer

    def _encoder_budget(self) -> int:
        return self.scheduler.max_num_encoder_tokens

    def _make_scheduler(self) -> Scheduler:
        """The scheduler for this engine's executor (steps in flight, async or spread)."""
        sc = self.cfg.scheduler
        return Scheduler(
            max_num_seqs=sc.max_num_seqs,
            max_num_batched_tokens=self.resolved.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            block_size=self.cfg.cache.block_size,
            num_blocks=self.num_blocks,
            enable_chunked_prefill=sc.enable_chunked_prefill,
            max_in_flight=self.executor.max_in_flight,
            # pp > 1: a batch per stage (with async steps two steps per batch, the next one
            # computing on the ids the last stage sends the first).  One stage with async steps:
            # every request in each step, on the device-side samples of the previous one.
            spread_over_in_flight=self.executor.pp_size > 1,
            async_scheduling=self.async_scheduling,
            max_num_encoder_tokens=sc.max_num_encoder_tokens,
            enable_prefix_caching=self.prefix_caching,
            num_cross_slots=self.executor.num_cross_slots,
        )

    @property
    def prefix_caching(self) -> bool:
        """Whether this engine reuses cached KV blocks: ``cache.enable_prefix_caching``, except
        for an encoder-decoder model (its decoder also reads a per-request cross-attention cache
        the blocks do not name)."""
        return self.cfg.cache.enable_prefix_caching and self.resolved.arch.audio_encoder is None

    def cache_stats(self) -> dict:
        """Prefix-cache counters and block counts (``PrefixCacheStats.as_dict``: ``enabled``,
        ``hit_rate``, ``num_queries``, ``num_hits``, ``num_query_tokens``, ``num_hit_tokens``,
        ``num_evicted_blocks``, ``num_cached_blocks``, ``num_evictable_blocks``,
        ``num_free_blocks``, ``num_usable_blocks``): what benchmarks and server metrics read."""
        return self.scheduler.block_manager.snapshot_stats().as_dict()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block and zero the prefix-cache counters, so that a timed run
        after a warm-up on the same prompts computes them again; False (nothing changed) while
        a request holds blocks."""
        if self.in_flight:
            return False
        return self.scheduler.block_manager.reset_prefix_cache()

    def _init_cache(self) -> None:
        cache = self.cfg.cache
        available = self.executor.num_blocks
        needed = min_blocks_for_one_request(self.max_model_len, cache.block_size) + 1
        if available < needed:
            raise ValueError(
                f"the KV cache is too small: it holds {available} blocks of {cache.block_size} "
                f"tokens per stage, but one request of max_model_len={self.max_model_len} needs "
                f"{needed} (including the reserved null block); raise cache.kv_cache_memory_bytes "
                "(or cache.gpu_memory_utilization / cache.cpu_kv_cache_bytes) or lower "
                "model.max_model_len"
            )
        self.num_blocks = available
        self.executor.init_cache(available)
        logger.info("KV cache: %d blocks of %d tokens per stage", available, cache.block_size)
        if cache.enable_prefix_caching and not self.prefix_caching:
            logger.info(
                "prefix caching is off: model %s is an encoder-decoder model, whose requests each "
                "read their own encoder output (cache.enable_prefix_caching applies to decoder-only models)",
                self.cfg.model.model,
            )
        slots = self.executor.num_cross_slots
        if slots is not None:
            logger.info(
                "cross-attention caches: %d slots per stage, so at most %d requests run at once "
                "(scheduler.max_num_seqs=%d)", slots, min(slots, self.cfg.scheduler.max_num_seqs),
                self.cfg.scheduler.max_num_seqs,
            )  # fmt: skip

    # --- requests ------------------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        request_id: str | None = None,
        mm_items: list | None = None,
    ) -> str:
        """Queue an already validated request (``mm_items`` from ``inputs.process_prompt``); returns its id."""
        if self.dead:
            raise StageFailedError(f"the engine has failed ({self.dead}); start a new LLM")
        req_id = request_id or str(next(self._ids))
        if req_id in self.tracked:
            raise ValueError(f"request_id={req_id!r} is invalid: a request with this id is not yet collected")
        req = Request(
            req_id,
            prompt_token_ids,
            params,
            eos_token_ids=set() if params.ignore_eos else set(self.eos_token_ids),
            mm_items=list(mm_items or ()),
        )
        self.scheduler.add_request(req)
        self.tracked[req_id] = _Tracked(
            req, prompt, RequestMetrics(req.arrival_time), [] if params.logprobs is not None else None
        )
        return req_id

    def abort_request(self, request_id: str) -> None:
        """End a request; its output reports finish_reason "abort"."""
        self.scheduler.abort_requests([request_id])
        self._aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        """True while any request waits, runs or has a step in flight."""
        return self.scheduler.has_unfinished_requests() or bool(self.in_flight)

    # --- stepping ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Fill the pipeline, then apply the oldest step's output; returns finished requests."""
        if self.dead:
            raise StageFailedError(f"the engine has failed ({self.dead}); start a new LLM")
        t_start = time.perf_counter()
        try:
            num_submitted = self._submit_while_room()
            if not self.in_flight:
                self.last_updated = []
                return self._collect_finished([])  # user aborts only
            t_wait = time.perf_counter()
            out = self.executor.get_output()
            self.watchdog.answered(self.in_flight[0], out.first_use)
            if self.trace is not None:
                answered = self.in_flight[0]
                self.trace.record(
                    EngineStep(t_start, t_wait, time.perf_counter(), num_submitted,
                               answered.total_num_scheduled_tokens, answered.num_reqs,
                               self.trace.prompt_tokens(answered))
                )  # fmt: skip
        except StageFailedError as e:
            self._fail(str(e))
            raise
        except BaseException as e:
            if self.executor.dead:
                # The executor gave up on its stages (interrupted mid-step): so does the engine.
                self._fail(f"interrupted: {type(e).__name__}")
            raise
        so = self.in_flight.popleft()
        updated = self.scheduler.update_from_output(so, out)
        self.last_updated = updated
        failure: StageFailedError | None = None
        if self._submit_early and not any(req.sampling_params.stop for req in updated):
            # A pipeline's stages wait for the next steps (the batch's round trip runs through
            # here), the bookkeeping below does not: submit first.  Only a stop string, checked
            # below, may still end a request the scheduler sees as running.
            try:
                self._submit_while_room()
            except StageFailedError as e:
                failure = e  # after the bookkeeping: what finished in this step is returned
            except BaseException as e:
                if self.executor.dead:
                    self._fail(f"interrupted: {type(e).__name__}")
                raise
        now = time.time()
        lp_by_req = None  # built on the first request that asked for logprobs
        tracked = self.tracked
        finished: list[str] = []
        for req in updated:
            tr = tracked.get(req.req_id)
            if tr is None:
                continue
            m = tr.metrics
            if m.first_token_time is None and req.output_token_ids:
                m.first_token_time = now
            m.num_output_tokens = len(req.output_token_ids)
            if tr.logprobs is not None:
                if lp_by_req is None:
                    lp_by_req = dict(zip(out.req_ids, out.logprobs or [None] * len(out.req_ids)))
                tr.logprobs.append(lp_by_req.get(req.req_id))
            if req.sampling_params.stop:
                self._check_stop_strings(tr)
            if req.is_finished:
                finished.append(req.req_id)
        collected = self._collect_finished(finished)
        if failure is not None:
            self._fail(str(failure))  # the rest fail; the next call raises
        return collected

    def _submit_while_room(self) -> int:
        """Schedule and submit steps while the pipeline has room; returns how many."""
        num_submitted = 0
        while len(self.in_flight) < self.executor.max_in_flight and self.scheduler.can_schedule():
            so = self.scheduler.schedule()
            if self.carry_finished:
                so.finished_req_ids = self.carry_finished | set(so.finished_req_ids)
                self.carry_finished = set()
            if so.is_empty():
                # Nothing to compute: hand the finished ids to the runners with the next step.
                self.carry_finished |= set(so.finished_req_ids)
                break
            if so.scheduled_new_reqs:
                self._note_scheduled(so)
            self.watchdog.submitting()
            self.executor.submit(so)
            self.watchdog.submitted(so)
            self.in_flight.append(so)
            self.num_steps += 1
            num_submitted += 1
        return num_submitted

    def _note_scheduled(self, so: SchedulerOutput) -> None:
        """Stamp the first scheduling of the step's new requests (the end of their queue time)."""
        now = time.time()
        tracked = self.tracked
        for new in so.scheduled_new_reqs:
            tr = tracked.get(new.req_id)
            if tr is not None and tr.metrics.first_scheduled_time is None:
                tr.metrics.first_scheduled_time = now

    def _check_stop_strings(self, tr: _Tracked) -> None:
        """End a request whose text contains a stop string (the text is cut before it).

        Also checked when the token that completed the string was the last one allowed
        (finish_reason "length"): the stop string wins, as in vLLM.
        """
        req = tr.req
        stops = req.sampling_params.stop
        if not stops or (req.is_finished and req.finish_reason != "length"):
            return
        if len(req.output_token_ids) < req.sampling_params.min_tokens:
            return
        # Earlier steps found no stop string, so a new one ends in the newest token and spans
        # at most 4 bytes (tokens) per character: decode that tail first, and the whole output
        # only on a hit (no quadratic re-decoding of long outputs).
        window = 4 * max(len(s) for s in stops) + 8
        if len(req.output_token_ids) > window:
            tail = self.inputs.decode(req.output_token_ids[-window:], req.sampling_params)
            if not any(s in tail for s in stops):
                return
        text = self.inputs.decode(req.output_token_ids, req.sampling_params)
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            pos, s = min(hits)
            tr.text = text[:pos]
            if req.is_finished:
                req.status = RequestStatus.FINISHED_STOPPED
                req.finish_reason = "stop"
            else:
                self.scheduler.abort_requests([req.req_id], finish_reason="stop")
            req.stop_reason = s

    def _collect_finished(self, req_ids: list[str]) -> list[RequestOutput]:
        """Outputs of the finished requests among ``req_ids`` (those of the step, or every one
        after a failure) and those aborted by the user.

        Only the step's candidates are looked at, not every tracked request: with thousands
        queued, a per-step scan of all of them would be the engine's hot loop.
        """
        candidates, self._aborted = req_ids + self._aborted, []
        done = []
        for req_id in candidates:
            tr = self.tracked.get(req_id)
            if tr is not None and tr.req.is_finished:
                done.append(self._make_output(tr))
                del self.tracked[req_id]
        return done

    def _make_output(self, tr: _Tracked) -> RequestOutput:
        req = tr.req
        tr.metrics.finished_time = time.time()
        self.num_preemptions += req.num_preemptions
        params = req.sampling_params
        if self.decode_outputs and not stopped_by_string(req.finish_reason, req.stop_reason):
            tr.text = self.inputs.decode(req.output_token_ids, params)
        lps = tr.logprobs[: len(req.output_token_ids)] if tr.logprobs is not None else None
        return RequestOutput(
            request_id=req.req_id,
            prompt=tr.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[
                CompletionOutput(0, tr.text, list(req.output_token_ids), req.finish_reason, req.stop_reason, lps)
            ],
            finished=True,
            metrics=tr.metrics,
            error=tr.error or (self.dead if req.finish_reason == "error" else None),
            num_cached_tokens=max(req.num_cached_tokens, 0),
        )

    def _fail(self, why: str) -> None:
        """A stage failed: every request ends with an error status; the engine is closed."""
        self.dead = why
        self.in_flight.clear()
        self.watchdog.forget_in_flight()
        for req in self.scheduler.fail_all("error"):
            tr = self.tracked.get(req.req_id)
            if tr is not None:
                tr.error = why
        try:
            self.executor.shutdown()
        except Exception:  # already dying; the original error is what matters
            logger.exception("error while stopping stages")

    def drain_failed(self) -> list[RequestOutput]:
        """Outputs (finish_reason "error") of every request ended by a failure."""
        return self._collect_finished(list(self.tracked))

    def shutdown(self) -> None:
        """Stop the stages (writing the engine's step trace when ``PPRUN_STEP_TRACE`` is set); idempotent."""
        if self.trace is not None:
            self.trace.dump()
            self.trace = None
        if self.executor is not None:
            try:
                self.executor.shutdown()
            finally:
                self.executor = None
                gc.unfreeze()  # the caller's objects frozen at start-up are collectable again

    def describe(self) -> dict:
        """Facts for summaries: runner, executor, stage partition."""
        rc = self.resolved
        async_steps = self.executor is not None and self.executor.async_steps
        return {
            "model": self.cfg.model.model,
            "runner": self.runner_name,
            "runner_fallback_reasons": self.v2_fallback_reasons,
            "executor": self.executor.describe() if self.executor else rc.executor,
            "pipeline_parallel_size": len(rc.layer_partition),
            "tensor_parallel_size": rc.cfg.parallel.tensor_parallel_size,
            "layer_partition": list(rc.layer_partition),
            "device": rc.device,
            "dtype": str(rc.dtype).removeprefix("torch."),
            "kv_blocks_per_stage": self.num_blocks,
            "prefix_caching": self.prefix_caching,
            "steps_in_flight": self.executor.max_in_flight if self.executor else 1,
            # Both keep two steps per batch in flight: async scheduling with one stage in process
            # (executor uni), async pipeline steps across stages (mp, ray).
            "async_scheduling": async_steps and rc.executor == "uni",
            "async_pipeline_steps": async_steps and rc.executor != "uni",
        }
