"""One generation request as the scheduler tracks it (plain Python, no torch)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pprun.multimodal.items import MultiModalItem
from pprun.sampling.params import SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is in its life cycle."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        """True for every ``FINISHED_*`` status."""
        return self in _FINISHED_STATUSES


_FINISHED_STATUSES = (
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
)

FINISH_REASON_TO_STATUS: dict[str, RequestStatus] = {
    "stop": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH,
    "abort": RequestStatus.FINISHED_ABORTED,
    "error": RequestStatus.FINISHED_ERROR,
}
"""The user-visible ``finish_reason`` strings and the status each one means."""


@dataclass(eq=False)
class Request:
    """A prompt, its sampling parameters and everything generated for it so far.

    The scheduler owns the mutable fields; the engine reads them to build outputs.  Compared
    by identity (``eq=False``): two requests are never the same because their fields match.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.time)
    """Wall-clock time the request arrived (for metrics only: scheduling order is the order
    of ``Scheduler.add_request`` calls, which is identical on every SPMD rank)."""
    eos_token_ids: set[int] = field(default_factory=set)
    """End-of-sequence token ids of the model; ignored when ``sampling_params.ignore_eos``."""
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    """Tokens whose KV is in the cache (advanced when a step is scheduled, not when it ends)."""
    block_ids: list[int] = field(default_factory=list)
    """KV-cache blocks this request owns, in token order (with prefix caching, its cached prefix
    blocks are shared with other requests)."""
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    """``"stop"``, ``"length"``, ``"abort"`` or ``"error"`` once finished."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the request; ``None`` for EOS, length,
    abort and error (as in vLLM)."""
    num_steps_in_flight: int = 0
    """Steps this request is scheduled in whose output has not come back yet (at most 2, and
    2 only with async scheduling)."""
    num_pending_samples: int = 0
    """In-flight steps that will sample a token for this request: with async scheduling the
    next step may already compute that token's KV before the host knows the token."""
    last_step_pos: int = -1
    """The newest step this request was scheduled in, counted in non-empty steps (async pipeline
    steps keep a batch's next step a whole round behind it: ``Scheduler.schedule``)."""
    num_preemptions: int = 0
    num_output_tokens_sent: int = 0
    """Output tokens the runners already hold (sent in a prompt on resume or as new tokens)."""
    arrival_index: int = -1
    """Position in the scheduler's arrival order (set by ``Scheduler.add_request``)."""
    mm_items: list[MultiModalItem] = field(default_factory=list)
    """Multimodal items (images, audio) whose placeholder ranges sit in the prompt, in prompt order."""
    block_hashes: list[bytes] = field(default_factory=list)
    """Prefix caching: the hash chain of this request's full blocks of known tokens, first block
    first (``pprun.core.block_manager``); grown as tokens become known, kept over preemption."""
    num_registered_blocks: int = 0
    """Prefix caching: leading blocks of ``block_ids`` already offered to the cache (registered
    under their hash, or found there)."""
    num_cached_tokens: int = -1
    """Prompt tokens found in the prefix cache when the request was first admitted (-1: not
    admitted yet)."""

    @property
    def in_flight(self) -> bool:
        """Scheduled in a step whose output has not come back yet."""
        return self.num_steps_in_flight > 0

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by every output token (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """Prompt tokens plus output tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        """True once the request has a ``FINISHED_*`` status."""
        return self.status.is_finished
