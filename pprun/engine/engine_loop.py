"""The serving engine's loop: take commands, step the :class:`LLMEngine`, report each step's tokens.

One loop owns an ``LLMEngine`` (which is not thread-safe, and whose ``step`` blocks until a batch
comes back) and does everything that touches it.  It runs on the async engine's thread
(``pprun.engine.async_engine``, in the server's process) or as the main loop of the engine process
(``pprun.engine.engine_process``); both hand it the same commands and get the same reports:

* :class:`AddCommand` / :class:`AbortCommand` are applied before the next step, so requests from
  every client join the running batches and an abort frees its blocks within a step;
* after each step one :class:`StepReport` carries every updated request's new token ids (and
  logprobs when asked), each finished request's :class:`FinishedUpdate` and the engine's counters.
  No text (but for an output a stop string cut, which the engine decoded to find it): detokenizing
  is the caller's (``async_engine.EngineClient``), so that in the engine process the loop steps
  and does little else.  The updates are columns (the ids, their tokens in one flat list), not an
  object per request: the engine process builds and pickles a report every step, and a decode
  step's is 64 ids and 64 ints, not 64 tuples of an id and a one-token list.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields

from pprun.core.outputs import Logprobs
from pprun.engine.llm_engine import LLMEngine
from pprun.engine.outputs import RequestMetrics, RequestOutput
from pprun.executor.base import StageFailedError
from pprun.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5
"""How long an idle loop waits for a command between checks of its stop flag (a command ends the
wait at once)."""
BLOCKED_WAIT_S = 0.001
"""How long the loop waits for a command when it has requests but could schedule none of them (a
command ends the wait at once)."""


@dataclass
class AddCommand:
    """Queue a validated request."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    """When the request was accepted (validated and queued): what its TTFT counts from."""


@dataclass
class AbortCommand:
    """Abort a request (its last report says finish_reason "abort")."""

    request_id: str


STOP = None
"""The command that ends the loop (after the commands taken with it)."""

Command = AddCommand | AbortCommand | None

TokenUpdate = tuple[str, list[int], "list[Logprobs | None] | None"]
"""``(request_id, new token ids, their logprobs or None)``: what one step added to a running
request, as :meth:`StepReport.updates` yields it."""


@dataclass
class FinishedUpdate:
    """The end of one request: its last new tokens and everything its final delta carries."""

    request_id: str
    new_token_ids: list[int]
    logprobs: list[Logprobs | None] | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    text: str | None = None
    """The whole output's text when the engine has it (always in process; where a stop string cut
    it in the engine process); None: the caller decodes the output itself."""
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    """Prompt tokens found in the prefix cache (``RequestOutput.num_cached_tokens``)."""


@dataclass
class StepReport:
    """What the loop says after a step (or after commands that ended requests without one).

    The running requests' new tokens are columns (:meth:`updates` yields them per request):
    ``update_ids`` in step order, ``update_tokens`` their new token ids concatenated, and only
    where needed ``update_counts`` and ``update_logprobs``.  The engine process pickles a report
    every step on the thread that steps the engine; a tuple and a list per request would be most
    of that work.  Pickled as a tuple of its fields (no field names).
    """

    update_ids: list[str] = field(default_factory=list)
    """Running requests the step gave tokens, in step order (the finished ones are in ``finished``)."""
    update_tokens: list[int] = field(default_factory=list)
    """Their new token ids, in the order of ``update_ids``."""
    update_counts: list[int] | None = None
    """New tokens per id of ``update_ids``; None: one each (every step but those after a burst of
    aborts or a failure gives each running request exactly one)."""
    update_logprobs: dict[int, list[Logprobs | None]] | None = None
    """Index in ``update_ids`` -> the logprobs of its new tokens, for the requests that asked."""
    finished: list[FinishedUpdate] = field(default_factory=list)
    failure: str | None = None
    """Set when the engine failed: ``finished`` are the requests it ended, every other request of
    the caller's ends too, and no more steps run."""
    num_steps: int = 0
    """``LLMEngine.num_steps`` after this report's step."""
    num_free_blocks: int = 0
    """KV blocks free after this report's step."""
    num_first_uses_after_ready: int = 0
    """Keys the engine's first-use record met after ready (``LLMEngine.first_use``; the last
    stage's arrive with its outputs), after this report's step."""
    cache_stats: dict | None = None
    """``LLMEngine.cache_stats()`` when a request was admitted or a block evicted since the last
    report that carried them (None otherwise: nothing to resend on every step)."""
    time: float = 0.0
    """When the report was made (``time.time``): when its tokens were known, which the serving
    client's latency histograms count to (``pprun.engine.request_latency``)."""

    def updates(self) -> Iterator[TokenUpdate]:
        """Each updated running request's ``(request_id, new token ids, logprobs or None)``."""
        tokens, counts, lps = self.update_tokens, self.update_counts, self.update_logprobs
        pos = 0
        for k, req_id in enumerate(self.update_ids):
            if counts is None:
                new_ids = [tokens[k]]
            else:
                n = counts[k]
                new_ids = tokens[pos : pos + n]
                pos += n
            yield req_id, new_ids, (lps.get(k) if lps else None)

    def add_update(self, req_id: str, new_ids: list[int], logprobs: list[Logprobs | None] | None) -> None:
        """Append one running request's new tokens (and logprobs) to the columns."""
        n = len(new_ids)
        if self.update_counts is None and n != 1:
            self.update_counts = [1] * len(self.update_ids)
        if logprobs is not None:
            if self.update_logprobs is None:
                self.update_logprobs = {}
            self.update_logprobs[len(self.update_ids)] = logprobs
        self.update_ids.append(req_id)
        self.update_tokens.extend(new_ids)
        if self.update_counts is not None:
            self.update_counts.append(n)

    def __reduce__(self) -> tuple:
        return StepReport, tuple(getattr(self, f.name) for f in fields(self))


def serving_facts(engine: LLMEngine) -> dict:
    """:meth:`LLMEngine.describe` plus ``max_model_len`` and the block size: what a server
    reports of its engine (``GetModelInfo``)."""
    facts = engine.describe()
    facts["max_model_len"] = engine.max_model_len
    facts["block_size"] = engine.cfg.cache.block_size
    return facts


class EngineLoop:
    """Steps ``engine`` on the commands ``take`` returns; ``report`` gets one :class:`StepReport`
    per step.

    ``take(wait_s)`` returns every command queued now, or, with ``wait_s`` > 0 and none queued,
    those that arrive within ``wait_s`` (it must return the moment one does: no poll tick).
    """

    def __init__(
        self,
        engine: LLMEngine,
        take: Callable[[float], list[Command]],
        report: Callable[[StepReport], None],
    ) -> None:
        self.engine = engine
        self.take = take
        self.report = report
        self.stopped = False
        self.failure: str | None = None
        self._num_reported: dict[str, int] = {}
        """Request id -> output tokens reported so far, for every request in the engine."""
        self._ended: list[FinishedUpdate] = []
        """Requests ended while commands were applied (refused by the engine): reported next."""
        self._last_counters = (-1, -1)
        """``(num_steps, num_free_blocks)`` of the last report sent."""
        self._last_cache_counters = (0, 0)
        """``(num_queries, num_evicted_blocks)`` of the last report that carried cache stats."""

    def run(self) -> None:
        """Step until a :data:`STOP` command comes."""
        eng = self.engine
        wait_s = 0.0
        while not self.stopped:
            idle = self.failure is not None or not eng.has_unfinished_requests()
            cmds = self.take(IDLE_WAIT_S if idle else wait_s)
            wait_s = 0.0
            num_aborts = 0
            for cmd in cmds:
                if isinstance(cmd, AddCommand):
                    self._add(cmd)
                elif isinstance(cmd, AbortCommand):
                    num_aborts += self._abort(cmd.request_id)
                else:
                    self.stopped = True
            if self._ended:
                ended, self._ended = self._ended, []
                self._report(StepReport(finished=ended))
            if self.failure is not None or not (eng.has_unfinished_requests() or num_aborts):
                continue
            try:
                finished = eng.step()
            except StageFailedError as e:
                self._fail(str(e))
                continue
            except Exception as e:  # a bug must end the streams, not leave clients waiting forever
                logger.exception("engine step failed")
                self._fail(f"{type(e).__name__}: {e}")
                continue
            report = self._token_updates(eng.last_updated)
            if finished:
                report.finished = [self._finished(o) for o in finished]
            self._report(report)
            if eng.dead is not None:  # failed after the step's bookkeeping: the rest end now
                self._fail(eng.dead)
                continue
            if not finished and not eng.in_flight and not eng.last_updated:
                # Nothing could be scheduled this round: do not spin, but wait for a command
                # rather than sleep, so that a new request or an abort is taken at once.
                wait_s = BLOCKED_WAIT_S

    def _report(self, report: StepReport) -> None:
        report.num_steps = self.engine.num_steps
        report.num_free_blocks = self.engine.scheduler.block_manager.num_free_blocks
        report.num_first_uses_after_ready = len(self.engine.first_use.after_ready)
        counters = (report.num_steps, report.num_free_blocks)
        if not (report.updates or report.finished or report.failure) and counters == self._last_counters:
            return  # a round that scheduled nothing (waiting for blocks): nothing to wake the caller for
        self._last_counters = counters
        report.time = time.time()
        stats = self.engine.scheduler.block_manager.stats
        cache_counters = (stats.num_queries, stats.num_evicted_blocks)
        if cache_counters != self._last_cache_counters:
            self._last_cache_counters = cache_counters
            report.cache_stats = self.engine.cache_stats()
        self.report(report)

    def _add(self, cmd: AddCommand) -> None:
        if self.failure is not None:
            self._ended.append(FinishedUpdate(cmd.request_id, [], None, "error", error=self.failure,
                                              num_prompt_tokens=len(cmd.prompt_token_ids)))
            return
        eng = self.engine
        try:
            eng.add_request(cmd.prompt_token_ids, cmd.params, request_id=cmd.request_id)
        except Exception as e:  # validated already; anything here is the engine's own refusal
            self._ended.append(FinishedUpdate(cmd.request_id, [], None, "error", error=f"{type(e).__name__}: {e}",
                                              num_prompt_tokens=len(cmd.prompt_token_ids)))
            return
        # The request arrived when it was accepted, not when the loop got to it: a wait behind a
        # running step is the engine's scheduling (counted in its TTFT), as for offline requests
        # added while the engine steps.
        tracked = eng.tracked[cmd.request_id]
        tracked.req.arrival_time = tracked.metrics.arrival_time = cmd.arrival_time
        self._num_reported[cmd.request_id] = 0

    def _abort(self, request_id: str) -> int:
        """Abort a request in the engine; 0 when it is not there (finished, or refused at add:
        its end is reported already or with the next report)."""
        if request_id not in self._num_reported or request_id not in self.engine.tracked:
            return 0
        self.engine.abort_request(request_id)
        return 1

    def _token_updates(self, updated: list) -> StepReport:
        """A report of the new tokens of the step's running requests (the finished ones' are in
        their :class:`FinishedUpdate`): the columns filled here directly, one id and one token
        per request in a decode step."""
        ids: list[str] = []
        tokens: list[int] = []
        counts: list[int] | None = None
        logprobs: dict[int, list] | None = None
        num_reported = self._num_reported
        tracked = self.engine.tracked
        for req in updated:
            if req.status.is_finished:
                continue
            req_id = req.req_id
            num_sent = num_reported.get(req_id)
            if num_sent is None:
                continue
            output_ids = req.output_token_ids
            n = len(output_ids) - num_sent
            if n <= 0:
                continue
            num_reported[req_id] = num_sent + n
            if n == 1:
                tokens.append(output_ids[-1])
            else:
                tokens.extend(output_ids[num_sent:])
                if counts is None:
                    counts = [1] * len(ids)
            if counts is not None:
                counts.append(n)
            if req.sampling_params.logprobs is not None:
                tr = tracked.get(req_id)
                if tr is not None and tr.logprobs is not None:
                    if logprobs is None:
                        logprobs = {}
                    logprobs[len(ids)] = tr.logprobs[num_sent : num_sent + n]
            ids.append(req_id)
        return StepReport(ids, tokens, counts, logprobs)

    def _finished(self, out: RequestOutput) -> FinishedUpdate:
        num_sent = self._num_reported.pop(out.request_id, 0)
        comp = out.outputs[0]
        return FinishedUpdate(
            out.request_id, list(comp.token_ids[num_sent:]),
            comp.logprobs[num_sent:] if comp.logprobs is not None else None,
            comp.finish_reason, comp.stop_reason,
            text=comp.text if self.engine.decode_outputs or comp.cut_by_stop_string else None,
            error=out.error, num_prompt_tokens=len(out.prompt_token_ids), num_output_tokens=len(comp.token_ids),
            metrics=out.metrics, num_cached_tokens=out.num_cached_tokens,
        )  # fmt: skip

    def _fail(self, why: str) -> None:
        """The engine failed: every request ends with an error; commands are still taken (new
        requests end at once) until the loop is stopped."""
        logger.error("engine failed: %s", why)
        self.failure = why
        finished = [self._finished(out) for out in self.engine.drain_failed()]
        self._num_reported.clear()
        self._report(StepReport(finished=finished, failure=why))
