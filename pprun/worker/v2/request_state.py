"""Per-request state of the V2 runner, kept between steps in persistent tables (a row per request).

The scheduler sends only deltas (new requests, appended block ids, newly sampled tokens, finished
ids); this module applies them to fixed-size host tables so that each step's inputs can be built
by tensor indexing (see ``pprun.worker.v2.inputs``) instead of Python loops over tokens.

Host-cost notes (this runs between GPU steps, while the device may idle):

- the token/block tables are CPU tensors with NumPy views; a step's deltas for all cached
  requests land in one fancy-indexed assignment each, not one torch call per request (a torch
  call costs microseconds of dispatch, a NumPy one a fraction of that);
- sampling parameters live per row on the device (written once per request, one small copy);
  a step gathers its rows there with an index tensor that arrives in the step's input copy, and
  the batch-wide flags come from per-row host bit masks, so building the sampler's tensors
  neither copies nor waits.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from pprun.core.outputs import CachedRequestData
from pprun.sampling.params import SamplingParams
from pprun.sampling.sampler import SAMPLING_EPS, SamplingTensors, make_generator

# Per-row sampling flags (host); a row's top-k/top-p/min-p bits are set only for non-greedy rows,
# since greedy rows ignore those filters (the sampler's flags consider non-greedy rows only).
_GREEDY = 1
_TOP_K = 2
_TOP_P = 4
_MIN_P = 8

# Rows of the packed per-row sampling-parameter table (float32; top-k is exact below 2**24, and
# any larger value exceeds every vocabulary, i.e. keeps all either way).
_TEMPERATURE, _TOP_P_ROW, _MIN_P_ROW, _TOP_K_ROW = range(4)
_NO_IDS = np.zeros(0, dtype=np.int64)


class RequestTable:
    """Rows of per-request state: tokens, progress, blocks and sampling parameters.

    Token/progress/block tables live on the host (cheap to update with small deltas); the runner
    gathers a step's rows from them into its pinned input buffers.  Sampling parameters live on
    ``device`` (plus host flags).  Row ``r`` is free or owned by exactly one request id.
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
        # NumPy views of the same memory: the per-step host paths index through these.
        self.token_ids_np = self.token_ids.numpy()
        self.num_tokens_np = self.num_tokens.numpy()
        self.num_computed_tokens_np = self.num_computed_tokens.numpy()
        self.block_table_np = self.block_table.numpy()
        self.num_blocks_np = self.num_blocks.numpy()

        pin = device.type == "cuda"
        self.sampling_params_host = torch.zeros((4, max_num_reqs), dtype=torch.float32, pin_memory=pin)
        """[4, max_num_reqs] temperature, top_p, min_p, top_k (float32) per row; staged here
        (pinned) and copied to :attr:`sampling_params_device` once per step that added requests."""
        self.sampling_params_host[_TOP_P_ROW] = 1.0
        self.sampling_params_device = (
            self.sampling_params_host if not pin else self.sampling_params_host.to(device)
        )
        self._sampling_params_np = self.sampling_params_host.numpy()
        self._sampling_params_dirty = False
        self._greedy_params = _per_row(self.sampling_params_device[:, :0])
        """The per-row tensors an all-greedy batch hands the sampler (empty: it reads none)."""
        self.sampling_flags_np = np.zeros(max_num_reqs, dtype=np.int64)
        """Per-row ``_GREEDY | _TOP_K | _TOP_P | _MIN_P`` bits (host)."""
        self.num_logprobs_np = np.full(max_num_reqs, -1, dtype=np.int64)
        """-1: the request asked for no logprobs."""
        self.generators: list[torch.Generator | None] = [None] * max_num_reqs
        self.draws_to_skip: list[int] = [0] * max_num_reqs
        """Per row: draws a resumed seeded request's new generator skips at its next sampling
        step (its earlier outputs; ``SamplingTensors.skip_draws``)."""
        self.num_skipping = 0
        """Live rows whose ``draws_to_skip`` is not 0 (0: a step builds no skip list)."""
        self.num_seeded = 0
        """Live rows holding a generator (0: skip building the per-row generator list)."""
        self.num_prompt_tokens_np = np.zeros(max_num_reqs, dtype=np.int64)
        """Tokens of each row's original prompt: the sample that ends a window of that length is
        the request's first output (a resumed request's row holds its outputs too)."""
        self.suppress_ids: list[np.ndarray | None] = [None] * max_num_reqs
        """Per row, ``SamplingParams.suppress_token_ids`` (never sampled), None when empty."""
        self.begin_suppress_ids: list[np.ndarray | None] = [None] * max_num_reqs
        """Per row, ``SamplingParams.begin_suppress_token_ids`` (not sampled as the first output)."""
        self.num_suppressing = 0
        """Live rows that suppress some id (0: a step checks nothing more)."""
        self.suppresses_np = np.zeros(max_num_reqs, dtype=bool)
        """Per row: it has ``suppress_token_ids``."""
        self.begin_suppresses_np = np.zeros(max_num_reqs, dtype=bool)
        """Per row: it has ``begin_suppress_token_ids``."""
        self._suppress_mask: torch.Tensor | None = None
        """``[max_num_reqs, vocab]`` bool on the device: row ``r`` True at ``suppress_ids[r]``
        (made on first use, rows rewritten only when a request takes or leaves them)."""
        self._suppress_mask_stale: set[int] = set()
        """Rows whose suppression changed since :attr:`_suppress_mask` was last written."""

    @property
    def num_live_reqs(self) -> int:
        """Requests currently holding a row."""
        return len(self.row_of)

    # Column views, for callers that read one parameter (host copies on CUDA).
    @property
    def temperature(self) -> torch.Tensor:
        """[max_num_reqs] float32 temperatures (host)."""
        return self.sampling_params_host[_TEMPERATURE]

    @property
    def top_k(self) -> torch.Tensor:
        """[max_num_reqs] int64 top-k, 0 where disabled (host)."""
        return self.sampling_params_host[_TOP_K_ROW].to(torch.int64)

    # --- deltas ------------------------------------------------------------------------------

    def update_cached(self, c: CachedRequestData, step_id: int) -> None:
        """Extend the requests this table already holds with their new blocks and tokens.

        All requests at once: one indexed write for the tokens, one for the blocks.
        """
        if not c.req_ids:
            return
        row_of = self.row_of
        try:
            rows_list = [row_of[r] for r in c.req_ids]
        except KeyError as e:
            raise RuntimeError(
                f"step {step_id}: cached request {e.args[0]!r} is unknown to this runner "
                "(it was never sent as a new request, or was dropped as finished)"
            ) from None
        rows = np.array(rows_list, dtype=np.int64)
        self._append(
            rows,
            c.req_ids,
            c.new_block_ids,
            self.block_table_np,
            self.num_blocks_np,
            self.max_num_blocks_per_req,
            "would own {end} KV blocks, more than "
            f"ceil(max_model_len / block_size)={self.max_num_blocks_per_req}",
        )
        self._append(
            rows,
            c.req_ids,
            c.new_token_ids,
            self.token_ids_np,
            self.num_tokens_np,
            self.max_model_len,
            f"would hold {{end}} tokens, more than max_model_len={self.max_model_len}",
        )
        self.num_computed_tokens_np[rows] = c.num_computed_tokens

    @staticmethod
    def _append(
        rows: np.ndarray,
        req_ids: list[str],
        values: list[list[int]],
        table: np.ndarray,
        counts: np.ndarray,
        capacity: int,
        too_many: str,
    ) -> None:
        """Append ``values[i]`` to row ``rows[i]`` of ``table`` (after its ``counts`` entries)."""
        lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
        total = int(lengths.sum())
        if total == 0:
            return
        starts = counts[rows]
        ends = starts + lengths
        over = ends > capacity
        if over.any():
            i = int(np.flatnonzero(over)[0])
            raise RuntimeError(f"request {req_ids[i]!r} " + too_many.format(end=int(ends[i])))
        flat = np.fromiter(itertools.chain.from_iterable(values), dtype=table.dtype, count=total)
        if total == len(values) and int(lengths.min()) == 1:
            # The decode step: exactly one new entry per request.
            table[rows, starts] = flat
        else:
            # Entry j of the flat list goes to column start[i] + (j - first_j[i]) of row rows[i].
            first = np.cumsum(lengths) - lengths
            cols = np.arange(total) + np.repeat(starts - first, lengths)
            table[np.repeat(rows, lengths), cols] = flat
        counts[rows] = ends

    def add(
        self,
        req_id: str,
        token_ids: list[int],
        block_ids: list[int],
        num_computed_tokens: int,
        params: SamplingParams,
        num_prompt_tokens: int | None = None,
    ) -> int:
        """Give ``req_id`` a row and write its prompt, blocks and sampling parameters.

        ``num_prompt_tokens``: the original prompt's length when ``token_ids`` also hold outputs
        (a request resumed after preemption); None: all of ``token_ids``.  An id still held
        (resumed after preemption before its finished id arrived) keeps its row, whose contents
        are replaced.  The parameters reach the device with the next
        :meth:`flush_sampling_params`.
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
        if len(token_ids) > self.max_model_len:
            raise RuntimeError(
                f"request {req_id!r} would hold {len(token_ids)} tokens, more than "
                f"max_model_len={self.max_model_len}"
            )
        if len(block_ids) > self.max_num_blocks_per_req:
            raise RuntimeError(
                f"request {req_id!r} would own {len(block_ids)} KV blocks, more than "
                f"ceil(max_model_len / block_size)={self.max_num_blocks_per_req}"
            )
        self.token_ids_np[row, : len(token_ids)] = token_ids
        self.num_tokens_np[row] = len(token_ids)
        self.block_table_np[row] = 0
        self.block_table_np[row, : len(block_ids)] = block_ids
        self.num_blocks_np[row] = len(block_ids)
        self.num_computed_tokens_np[row] = num_computed_tokens
        self.num_prompt_tokens_np[row] = len(token_ids) if num_prompt_tokens is None else num_prompt_tokens
        self._set_sampling_params(row, params, len(token_ids) - int(self.num_prompt_tokens_np[row]))
        return row

    def _set_sampling_params(self, row: int, params: SamplingParams, num_output_tokens: int = 0) -> None:
        temperature = float(params.temperature)
        top_k = params.top_k if params.top_k > 0 else 0
        p = self._sampling_params_np
        p[_TEMPERATURE, row] = temperature
        p[_TOP_P_ROW, row] = float(params.top_p)
        p[_MIN_P_ROW, row] = float(params.min_p)
        p[_TOP_K_ROW, row] = top_k
        self._sampling_params_dirty = True
        if temperature < SAMPLING_EPS:
            flags = _GREEDY
        else:
            flags = (
                (_TOP_K if top_k > 0 else 0)
                | (_TOP_P if params.top_p < 1.0 else 0)
                | (_MIN_P if params.min_p > 0.0 else 0)
            )
        self.sampling_flags_np[row] = flags
        self.num_logprobs_np[row] = -1 if params.logprobs is None else params.logprobs
        generator = make_generator(params.seed, self.device) if self.make_generators else None
        self._set_generator(row, generator)
        # A resumed request's outputs so far (in its token ids): its stream goes on after them.
        self._set_draws_to_skip(row, num_output_tokens if generator is not None else 0)
        self._set_suppression(row, params.suppress_token_ids, params.begin_suppress_token_ids)

    def _set_suppression(self, row: int, always: list[int] | None, first: list[int] | None) -> None:
        was = self.suppress_ids[row] is not None or self.begin_suppress_ids[row] is not None
        self.suppress_ids[row] = np.asarray(always, dtype=np.int64) if always else None
        self.begin_suppress_ids[row] = np.asarray(first, dtype=np.int64) if first else None
        self.num_suppressing += bool(always or first) - was
        self.suppresses_np[row] = bool(always)
        self.begin_suppresses_np[row] = bool(first)
        self._suppress_mask_stale.add(row)

    def _set_generator(self, row: int, generator: torch.Generator | None) -> None:
        self.num_seeded += (generator is not None) - (self.generators[row] is not None)
        self.generators[row] = generator

    def _set_draws_to_skip(self, row: int, n: int) -> None:
        self.num_skipping += bool(n) - bool(self.draws_to_skip[row])
        self.draws_to_skip[row] = n

    def remove(self, req_id: str) -> int | None:
        """Free ``req_id``'s row; returns the row freed.

        A finished or preempted id this table never saw is ignored (returns ``None``).
        """
        row = self.row_of.pop(req_id, None)
        if row is None:
            return None
        self._set_generator(row, None)
        self._set_draws_to_skip(row, 0)
        self._set_suppression(row, None, None)
        self.free_rows.append(row)
        return row

    # --- sampling ----------------------------------------------------------------------------

    def flush_sampling_params(self) -> bool:
        """Copy the per-row sampling parameters to the device if a request was added since the
        last flush (one small non-blocking copy from pinned memory); returns whether it copied.

        The caller must not rewrite the host table (:meth:`add`) before this copy has finished
        reading it: the V2 runner waits on its input-copy event before applying a step's deltas.
        """
        if not self._sampling_params_dirty:
            return False
        self._sampling_params_dirty = False
        if self.sampling_params_device is not self.sampling_params_host:
            self.sampling_params_device.copy_(self.sampling_params_host, non_blocking=True)
        return True

    def sampling_tensors(self, rows: torch.Tensor, device_rows: torch.Tensor | None = None) -> SamplingTensors:
        """The sampler's per-row tensors for ``rows``, gathered from the device table.

        When every row is greedy the four per-row tensors are empty: the sampler's greedy path
        reads none of them (it takes the argmax), and gathering them cost two device ops a step.

        ``rows``: host int64 rows (the flags and generators come from host state);
        ``device_rows``: the same rows already on the device (the runner passes its copy from
        the step's input buffers); ``None`` copies ``rows`` (tests, CPU).  Same values and flags
        as ``SamplingTensors.build`` on the rows' ``SamplingParams`` (so V1 and V2 draw
        identical tokens).  Needs :meth:`flush_sampling_params` after the last :meth:`add`.
        """
        rows_np = rows.numpy()
        flags = self.sampling_flags_np[rows_np]
        # Over no rows these are 0 and -1 (all bits): the same flags ``build`` gives for [].
        any_flags = int(np.bitwise_or.reduce(flags))
        all_flags = int(np.bitwise_and.reduce(flags))
        if all_flags & _GREEDY and rows_np.size:
            # Greedy rows read none of the per-row tensors: skip the gathers (two device ops
            # per step) and hand the sampler empty ones, made once.
            temperature, top_k, top_p, min_p = self._greedy_params
        else:
            if device_rows is None:
                self.flush_sampling_params()
                device_rows = rows.to(self.sampling_params_device.device)
            temperature, top_k, top_p, min_p = _per_row(self.sampling_params_device[:, device_rows])
        max_num_logprobs = int(self.num_logprobs_np[rows_np].max()) if rows_np.size else -1
        skip_draws = None
        if self.num_seeded:
            row_list = rows_np.tolist()
            generators = [self.generators[r] for r in row_list]
            if self.num_skipping:
                skip_draws = [self.draws_to_skip[r] for r in row_list]
                for r in row_list:  # skipped with this step's draws
                    self._set_draws_to_skip(r, 0)
        else:
            generators = [None] * len(rows_np)
        all_greedy = bool(all_flags & _GREEDY)
        all_random = not any_flags & _GREEDY
        no_top_k = not any_flags & _TOP_K
        # Host copies that spare the sampler a device read-back, computed only where it reads them.
        is_greedy_host = None
        if self.num_seeded and not all_greedy and not all_random:
            is_greedy_host = ((flags & _GREEDY) != 0).tolist()
        top_k_max_host = None
        if not all_greedy and not no_top_k:
            top_k_np = self._sampling_params_np[_TOP_K_ROW, rows_np]
            top_k_max_host = int(top_k_np.max()) if top_k_np.min() > 0 else 0
        return SamplingTensors(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            generators=generators,
            all_greedy=all_greedy,
            all_random=all_random,
            no_top_k=no_top_k,
            no_top_p=not any_flags & _TOP_P,
            no_min_p=not any_flags & _MIN_P,
            max_num_logprobs=max_num_logprobs if max_num_logprobs >= 0 else None,
            skip_draws=skip_draws,
            is_greedy_host=is_greedy_host,
            top_k_max_host=top_k_max_host,
        )

    def suppressed_ids(self, rows: np.ndarray, seq_lens: np.ndarray) -> list[np.ndarray] | None:
        """The token ids each of ``rows`` may not sample this step, or None when no row
        suppresses anything (the common case: one check).

        ``seq_lens[i]``: the tokens row ``rows[i]`` holds once the step is computed; the sample
        at the original prompt's length is the request's first output, which also drops its
        ``begin_suppress_token_ids`` (V1 decides the same way: ``pprun.sampling.sampler.suppress_tokens``).
        """
        if not self.num_suppressing:
            return None
        out: list[np.ndarray] = []
        found = False
        for row, seq_len in zip(rows.tolist(), seq_lens.tolist()):
            ids = self.suppress_ids[row]
            first = self.begin_suppress_ids[row]
            if first is not None and seq_len == self.num_prompt_tokens_np[row]:
                ids = first if ids is None else np.concatenate([ids, first])
            if ids is None:
                out.append(_NO_IDS)
            else:
                out.append(ids)
                found = True
        return out if found else None

    def begin_suppression_due(self, rows: np.ndarray, seq_lens: np.ndarray) -> bool:
        """Whether some of ``rows`` samples its first output this step and has
        ``begin_suppress_token_ids`` (then :meth:`suppressed_ids` gives each row's ids)."""
        due = self.begin_suppresses_np[rows]
        return bool(due.any() and (due & (seq_lens == self.num_prompt_tokens_np[rows])).any())

    def suppress_mask(self, vocab: int, device: torch.device) -> torch.Tensor:
        """The per-row mask ``[max_num_reqs, vocab]`` (True: the row's request may not sample that
        id), brought up to date: the host rewrites only the rows whose request changed since the
        last call (a row taken or left), with device writes queued on the current stream.  The
        tensor keeps its address while ``vocab`` and ``device`` stay, so a CUDA graph may read it
        (callers pass a tensor's device, which names its index: ``cuda`` and ``cuda:0`` differ).
        Ids past ``vocab`` are dropped, as ``mask_token_ids`` drops them."""
        mask = self._suppress_mask
        if mask is None or mask.shape[1] != vocab or mask.device != device:
            mask = torch.zeros((self.max_num_reqs, vocab), dtype=torch.bool, device=device)
            self._suppress_mask = mask
            self._suppress_mask_stale = set(np.flatnonzero(self.suppresses_np).tolist())
        if self._suppress_mask_stale:
            stale = np.fromiter(self._suppress_mask_stale, dtype=np.int64, count=len(self._suppress_mask_stale))
            self._suppress_mask_stale = set()
            mask[torch.from_numpy(stale).to(mask.device)] = False
            ids = [self.suppress_ids[r] if self.suppresses_np[r] else _NO_IDS for r in stale.tolist()]
            lengths = [len(i) for i in ids]
            if any(lengths):
                cols = np.concatenate(ids)
                rows = np.repeat(stale, lengths)
                keep = cols < vocab
                index = torch.from_numpy(np.stack([rows[keep], cols[keep]])).to(mask.device)
                mask[index[0], index[1]] = True
        return mask

    def mask_suppressed(self, logits: torch.Tensor, device_rows: torch.Tensor) -> torch.Tensor:
        """``logits [n, vocab]`` (a new tensor) with each row's ``suppress_token_ids`` at -inf,
        read from the per-row device mask (:meth:`suppress_mask`) gathered by ``device_rows [n]``
        (the rows, on the device): a step costs one gather and one fill, whatever its size."""
        mask = self.suppress_mask(logits.shape[-1], logits.device)
        return logits.masked_fill(mask[device_rows], float("-inf"))

    def num_logprobs_list(self, rows: torch.Tensor) -> list[int | None]:
        """Each row's requested logprob count (``None`` where it asked for none)."""
        return [None if n < 0 else n for n in self.num_logprobs_np[rows.numpy()].tolist()]


def _per_row(params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Temperature, top-k (int64), top-p and min-p of the gathered ``[4, rows]`` parameters."""
    return params[_TEMPERATURE], params[_TOP_K_ROW].to(torch.int64), params[_TOP_P_ROW], params[_MIN_P_ROW]
