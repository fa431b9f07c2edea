"""Per-request state of the V2 runner, kept between steps in persistent tables (a row per request).

The scheduler sends only deltas (new requests, appended block ids, newly sampled tokens, finished
ids); this module applies them to fixed-size host tables so that each step's inputs can be built
by tensor indexing (see ``pprun.worker.v2.inputs``) instead of Python loops over tokens.
"""

from __future__ import annotations

import torch

from pprun.core.outputs import CachedRequestData
from pprun.sampling.params import SamplingParams
from pprun.sampling.sampler import SAMPLING_EPS, SamplingTensors, make_generator


class RequestTable:
    """Rows of per-request state: tokens, progress, blocks and sampling parameters.

    All tables live on the host (cheap to update with small deltas); the runner gathers a step's
    rows from them and copies the result into device buffers.  Row ``r`` is free or owned by
    exactly one request id.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_num_blocks_per_req: int,
        device: torch.device,
        make_generators: bool,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.device = device
        self.make_generators = make_generators
        """Only the last stage samples, so only it needs per-request generators."""
        self.row_of: dict[str, int] = {}
        # Lowest rows first: keeps the live rows dense, which reads better in a debugger.
        self.free_rows: list[int] = list(range(max_num_reqs - 1, -1, -1))

        self.token_ids = torch.zeros((max_num_reqs, max_model_len), dtype=torch.int64)
        """[max_num_reqs, max_model_len]: prompt and every output token the runner was told of."""
        self.num_tokens = torch.zeros(max_num_reqs, dtype=torch.int64)
        """Valid entries of each ``token_ids`` row."""
        self.num_computed_tokens = torch.zeros(max_num_reqs, dtype=torch.int64)
        """Tokens whose KV is in the cache before the current step."""
        self.block_table = torch.zeros((max_num_reqs, max_num_blocks_per_req), dtype=torch.int32)
        """KV blocks of each request, in order (unused entries 0, the null block)."""
        self.num_blocks = torch.zeros(max_num_reqs, dtype=torch.int64)

        self.temperature = torch.zeros(max_num_reqs, dtype=torch.float32)
        self.top_k = torch.zeros(max_num_reqs, dtype=torch.int64)
        """0 keeps all (``SamplingTensors.build`` without a vocab size does the same)."""
        self.top_p = torch.ones(max_num_reqs, dtype=torch.float32)
        self.min_p = torch.zeros(max_num_reqs, dtype=torch.float32)
        self.num_logprobs = torch.full((max_num_reqs,), -1, dtype=torch.int64)
        """-1: the request asked for no logprobs."""
        self.generators: list[torch.Generator | None] = [None] * max_num_reqs

    @property
    def num_live_reqs(self) -> int:
        """Requests currently holding a row."""
        return len(self.row_of)

    # --- deltas ------------------------------------------------------------------------------

    def update_cached(self, c: CachedRequestData, step_id: int) -> None:
        """Extend the requests this table already holds with their new blocks and tokens."""
        for i, req_id in enumerate(c.req_ids):
            row = self.row_of.get(req_id)
            if row is None:
                raise RuntimeError(
                    f"step {step_id}: cached request {req_id!r} is unknown to this runner "
                    "(it was never sent as a new request, or was dropped as finished)"
                )
            self._append_blocks(row, req_id, c.new_block_ids[i])
            self._append_tokens(row, req_id, c.new_token_ids[i])
            self.num_computed_tokens[row] = c.num_computed_tokens[i]

    def add(
        self,
        req_id: str,
        token_ids: list[int],
        block_ids: list[int],
        num_computed_tokens: int,
        params: SamplingParams,
    ) -> int:
        """Give ``req_id`` a row and write its prompt, blocks and sampling parameters.

        An id still held (resumed after preemption before its finished id arrived) keeps its
        row, whose contents are replaced.
        """
        row = self.row_of.get(req_id)
        if row is None:
            if not self.free_rows:
                raise RuntimeError(
                    f"request {req_id!r} needs a runner row but all max_num_seqs={self.max_num_reqs} "
                    "rows are held; the scheduler admitted more requests than max_num_seqs"
                )
            row = self.free_rows.pop()
            self.row_of[req_id] = row
        self.num_tokens[row] = 0
        self.num_blocks[row] = 0
        self.block_table[row].zero_()
        self._append_tokens(row, req_id, token_ids)
        self._append_blocks(row, req_id, block_ids)
        self.num_computed_tokens[row] = num_computed_tokens
        self.temperature[row] = float(params.temperature)
        self.top_k[row] = params.top_k if params.top_k > 0 else 0
        self.top_p[row] = float(params.top_p)
        self.min_p[row] = float(params.min_p)
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self.generators[row] = make_generator(params.seed, self.device) if self.make_generators else None
        return row

    def remove(self, req_id: str) -> int | None:
        """Free ``req_id``'s row; returns the row freed.

        A finished or preempted id this table never saw is ignored (returns ``None``).
        """
        row = self.row_of.pop(req_id, None)
        if row is None:
            return None
        self.generators[row] = None
        self.free_rows.append(row)
        return row

    def _append_tokens(self, row: int, req_id: str, token_ids: list[int]) -> None:
        if not token_ids:
            return
        start = int(self.num_tokens[row])
        end = start + len(token_ids)
        if end > self.max_model_len:
            raise RuntimeError(
                f"request {req_id!r} would hold {end} tokens, more than max_model_len={self.max_model_len}"
            )
        self.token_ids[row, start:end] = torch.tensor(token_ids, dtype=torch.int64)
        self.num_tokens[row] = end

    def _append_blocks(self, row: int, req_id: str, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.max_num_blocks_per_req:
            raise RuntimeError(
                f"request {req_id!r} would own {end} KV blocks, more than "
                f"ceil(max_model_len / block_size)={self.max_num_blocks_per_req}"
            )
        self.block_table[row, start:end] = torch.tensor(block_ids, dtype=torch.int32)
        self.num_blocks[row] = end

    # --- sampling ----------------------------------------------------------------------------

    def sampling_tensors(self, rows: torch.Tensor, device: torch.device) -> SamplingTensors:
        """The sampler's per-row tensors for ``rows`` (host int64), gathered from the tables.

        Same values and flags as ``SamplingTensors.build`` on the rows' ``SamplingParams``
        (so V1 and V2 draw identical tokens), without a Python loop over parameter objects.
        """
        temperature = self.temperature[rows]
        top_k = self.top_k[rows]
        top_p = self.top_p[rows]
        min_p = self.min_p[rows]
        num_logprobs = self.num_logprobs[rows]
        is_greedy = temperature < SAMPLING_EPS
        is_random = ~is_greedy
        asked = num_logprobs[num_logprobs >= 0]
        return SamplingTensors(
            temperature=temperature.to(device),
            top_k=top_k.to(device),
            top_p=top_p.to(device),
            min_p=min_p.to(device),
            generators=[self.generators[r] for r in rows.tolist()],
            all_greedy=bool(is_greedy.all()),
            all_random=not bool(is_greedy.any()),
            no_top_k=bool((top_k[is_random] <= 0).all()),
            no_top_p=bool((top_p[is_random] >= 1.0).all()),
            no_min_p=bool((min_p[is_random] <= 0.0).all()),
            max_num_logprobs=int(asked.max()) if asked.numel() else None,
        )

    def num_logprobs_list(self, rows: torch.Tensor) -> list[int | None]:
        """Each row's requested logprob count (``None`` where it asked for none)."""
        return [None if n < 0 else n for n in self.num_logprobs[rows].tolist()]
