"""The plain-data seams between the scheduler and the model runners (no torch here).

The scheduler emits one :class:`SchedulerOutput` per step; every stage's runner receives
the same object; the last stage answers with a :class:`ModelRunnerOutput`.  Both are
picklable, printable and small: only what changed since the previous step crosses.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pprun.multimodal.items import MultiModalItem
from pprun.sampling.logprobs import Logprobs
from pprun.sampling.params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runners have not seen yet (or one resumed after preemption).

    The runner keeps per-request state from here on; later steps send only deltas.
    """

    req_id: str
    prompt_token_ids: list[int]
    """The prompt; for a request resumed after preemption, the prompt plus every token it
    had generated so far (recompute)."""
    sampling_params: SamplingParams
    block_ids: list[int]
    """KV-cache blocks owned by this request, in order (the same ids on every stage)."""
    num_computed_tokens: int
    """Tokens whose KV is already in the cache before this step: 0 for a fresh request, or the
    cached prefix (whole blocks, shared with earlier requests) with prefix caching."""
    mm_items: list[MultiModalItem] = field(default_factory=list)
    """The request's multimodal items; their tensors only in the first stage's copy of the step
    (:meth:`SchedulerOutput.without_payload`)."""
    num_prompt_tokens: int | None = None
    """Tokens of the original prompt (None: all of ``prompt_token_ids``); a resumed request's
    ``prompt_token_ids`` also hold its outputs, and the runner needs to know which was its
    first output (``SamplingParams.begin_suppress_token_ids``)."""


@dataclass
class CachedRequestData:
    """Requests the runners already hold, one entry per list index."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    """Blocks appended to each request's block list this step (often empty)."""
    num_computed_tokens: list[int] = field(default_factory=list)
    """Tokens whose KV is in the cache before this step."""
    new_token_ids: list[list[int]] = field(default_factory=list)
    """Tokens sampled since the runners last saw this request (how the first stage learns
    what the last stage sampled); usually one token, empty during chunked prefill."""

    @property
    def num_reqs(self) -> int:
        """Number of cached requests in this step."""
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    """Everything the runners need for one step."""

    step_id: int
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    """Tokens to compute this step, per request id (prefill chunk length or 1 for decode)."""
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)
    """Requests that finished, were aborted or preempted since the previous step: the runners
    drop their state (a preempted request comes back later as a new request)."""

    @property
    def num_reqs(self) -> int:
        """Number of requests scheduled this step (real, not padded)."""
        return len(self.num_scheduled_tokens)

    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    """Request id -> indices of its ``mm_items`` the first stage encodes this step (before the
    step's embeddings are built); items already in the encoder cache are not listed."""
    free_encoder_hashes: list[str] = field(default_factory=list)
    """Content hashes whose encoder outputs no request needs any more: the first stage drops them
    before this step's encoding."""

    def is_empty(self) -> bool:
        """True when the step computes nothing (it may still carry finished ids)."""
        return self.total_num_scheduled_tokens == 0

    def has_payload(self) -> bool:
        """True when some new request carries multimodal tensors (pixels, audio features)."""
        return any(item.data is not None for new in self.scheduled_new_reqs for item in new.mm_items)

    def without_payload(self) -> SchedulerOutput:
        """A copy for the stages after the first: multimodal items keep their ranges and hashes,
        not their tensors (only the first stage runs encoders)."""
        if not self.has_payload():
            return self
        new_reqs = [
            replace(new, mm_items=[item.without_payload() for item in new.mm_items]) if new.mm_items else new
            for new in self.scheduled_new_reqs
        ]
        return replace(self, scheduled_new_reqs=new_reqs)


@dataclass
class ModelRunnerOutput:
    """What the last stage returns for one step.

    ``sampled_token_ids[i]`` belongs to ``req_ids[i]``; it is empty for a request whose
    prefill chunk did not reach the end of its prompt (nothing to sample yet).
    """

    step_id: int
    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[Logprobs | None] | None = None
    stage_timings: dict[str, float] = field(default_factory=dict)
    """Optional per-stage timing, seconds (for benchmarks)."""
    first_use: tuple[str, ...] = ()
    """What the last stage compiled, captured or ran for the first time since its previous output
    (``pprun.utils.first_use`` keys; empty nearly always)."""
