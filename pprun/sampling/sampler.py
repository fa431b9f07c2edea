"""The torch sampler run on the last pipeline stage: logits in, one token id per request out.

Per step the runner builds a :class:`SamplingTensors` from the scheduled requests'
:class:`~pprun.sampling.params.SamplingParams` and calls :class:`Sampler` on the
``[num_reqs, vocab_size]`` logits. Order of processing for a non-greedy row:
temperature, top-k, top-p, min-p, then one draw by the exponential race.

Logprobs are computed from the *raw* logits (``log_softmax`` of the model's output,
before temperature, top-k, top-p and min-p), which is what vLLM returns by default
(``logprobs_mode="raw_logprobs"``): they describe the model, not the sampling filter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pprun.sampling.logprobs import Logprobs
from pprun.sampling.params import SamplingParams
from pprun.utils.first_use import FirstUse

SAMPLING_EPS = 1e-5
"""Temperatures below this are treated as greedy: dividing by them would overflow float32
into ``inf`` and turn softmax into NaN, and the distribution is an argmax anyway (vLLM
uses the same threshold)."""


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """Return a generator seeded with ``seed`` on ``device``, or ``None`` for an unseeded request.

    The runner makes one when a seeded request arrives and keeps it for the request's whole
    life: the generator's state advancing step by step is what makes the token sequence
    reproducible regardless of batch composition.  A request preempted and resumed arrives
    again with its outputs in its prompt and gets a new generator: the runner keeps, with the
    request's row, how many draws those outputs took, and hands them to the sampler with the
    row's next sampling step (``SamplingTensors.skip_draws``), which skips them first, so the
    request continues its stream instead of restarting it.
    """
    if seed is None:
        return None
    generator = torch.Generator(device=torch.device(device))
    generator.manual_seed(seed)
    return generator


@dataclass
class SamplingTensors:
    """Per-row sampling parameters for one step, as device tensors plus batch-wide flags.

    Row ``i`` describes request ``i`` of the batch (real rows only, ``num_reqs`` of them).
    The flags let :class:`Sampler` skip work no row needs; they consider non-greedy rows
    only, since greedy rows ignore top-k/top-p/min-p.
    """

    temperature: torch.Tensor
    """``[num_reqs]`` float32; values below :data:`SAMPLING_EPS` mean greedy.  This and the next
    three may be empty when ``all_greedy`` (the V2 request table skips gathering them)."""
    top_k: torch.Tensor
    """``[num_reqs]`` int64; a disabled row holds ``vocab_size`` when it was given to
    :meth:`build`, else 0 (the sampler reads ``k <= 0`` or ``k > vocab`` as "keep all")."""
    top_p: torch.Tensor
    """``[num_reqs]`` float32; 1.0 keeps all."""
    min_p: torch.Tensor
    """``[num_reqs]`` float32; 0.0 keeps all."""
    generators: list[torch.Generator | None]
    """Per-row generator for seeded requests, ``None`` for rows drawing from the global RNG."""
    all_greedy: bool
    all_random: bool
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool
    max_num_logprobs: int | None
    """Largest ``logprobs`` asked by any row, ``None`` when no row asked."""
    is_greedy_host: list[bool] | None = None
    """Optional host copy of ``temperature < SAMPLING_EPS`` per row; when given, a batch mixing
    greedy and seeded rows does not read it back from the device (a sync)."""
    top_k_max_host: int | None = None
    """Optional host copy of the largest ``top_k`` over all rows, ``0`` when some row has top-k
    disabled (keeps the whole vocabulary); when given, top-k alone does not read the device's
    maximum back (a sync)."""
    skip_draws: list[int] | None = None
    """Optional, per row: draws the row's generator skips before this step's draw (a resumed
    seeded request's earlier outputs, see :func:`make_generator`); ``None``: none skips."""

    @property
    def num_reqs(self) -> int:
        """Number of rows (requests) these tensors describe."""
        return len(self.generators)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        device: torch.device | str,
        vocab_size: int | None = None,
    ) -> SamplingTensors:
        """Build the step's tensors: one small host-to-device copy per field.

        ``generators[i]`` is request ``i``'s generator from :func:`make_generator` (kept by
        the runner across steps). ``vocab_size``, when given, lets a ``top_k`` at or above
        the vocabulary count as disabled.
        """
        if len(generators) != len(params):
            raise ValueError(
                f"generators has {len(generators)} entries but params has {len(params)}: "
                "need exactly one generator (or None) per request row"
            )
        temperatures = [float(p.temperature) for p in params]
        is_greedy = [t < SAMPLING_EPS for t in temperatures]
        top_ks = [
            (vocab_size or 0) if p.top_k <= 0 or (vocab_size is not None and p.top_k > vocab_size)
            else p.top_k
            for p in params
        ]
        random_params = [p for p, g in zip(params, is_greedy) if not g]
        asked = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=torch.tensor(temperatures, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_ks, dtype=torch.int64, device=device),
            top_p=torch.tensor([float(p.top_p) for p in params], dtype=torch.float32, device=device),
            min_p=torch.tensor([float(p.min_p) for p in params], dtype=torch.float32, device=device),
            generators=list(generators),
            all_greedy=all(is_greedy),
            all_random=not any(is_greedy),
            no_top_k=all(
                p.top_k <= 0 or (vocab_size is not None and p.top_k >= vocab_size)
                for p in random_params
            ),
            no_top_p=all(p.top_p >= 1.0 for p in random_params),
            no_min_p=all(p.min_p <= 0.0 for p in random_params),
            max_num_logprobs=max(asked) if asked else None,
        )


@dataclass
class SamplerOutput:
    """What one sampler call returns, on the logits' device.

    The logprob fields are ``None`` unless some row asked for logprobs; then they cover
    every row, ``k = max_num_logprobs`` wide (rows asking fewer are cut on the host).
    """

    sampled_token_ids: torch.Tensor
    """``[num_reqs]`` int64."""
    sampled_logprobs: torch.Tensor | None = None
    """``[num_reqs]`` float32: raw log-probability of the sampled token."""
    topk_ids: torch.Tensor | None = None
    """``[num_reqs, k]`` int64, most likely first."""
    topk_logprobs: torch.Tensor | None = None
    """``[num_reqs, k]`` float32, descending."""


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    max_k: int | None = None,
) -> torch.Tensor:
    """Mask (to ``-inf``, in place) tokens outside each row's top-k, then outside its nucleus.

    ``top_k`` must already be in ``[1, vocab]``. Tokens tied with the k-th largest are kept.
    The nucleus is the smallest set of most-likely tokens (after top-k) whose probability
    reaches ``top_p``; the top token is always kept.  ``max_k``, when the caller knows it on
    the host, must equal ``top_k.max()`` (saves reading it from the device).
    """
    if top_p is None:
        if top_k is None:
            return logits
        # Top-k alone needs only the k-th largest value per row, not a full sort.
        if max_k is None:
            max_k = int(top_k.max())
        kth_largest = logits.topk(max_k, dim=-1).values.gather(1, (top_k - 1).unsqueeze(1))
        return logits.masked_fill_(logits < kth_largest, float("-inf"))

    logits_sorted, sort_idx = logits.sort(dim=-1, descending=False)
    vocab_size = logits.shape[-1]
    if top_k is not None:
        kth_largest = logits_sorted.gather(1, (vocab_size - top_k).unsqueeze(1))
        logits_sorted.masked_fill_(logits_sorted < kth_largest, float("-inf"))
    # Ascending order: drop the low tail whose cumulative mass stays within 1 - top_p.
    cum_probs = logits_sorted.softmax(dim=-1).cumsum_(dim=-1)
    outside_nucleus = cum_probs <= (1.0 - top_p).unsqueeze(1)
    outside_nucleus[:, -1] = False
    logits_sorted.masked_fill_(outside_nucleus, float("-inf"))
    return logits.scatter_(1, sort_idx, logits_sorted)


class Sampler:
    """Pick one token per row of ``[num_reqs, vocab]`` logits according to :class:`SamplingTensors`.

    Greedy rows take the argmax of the raw logits. Other rows are scaled by temperature,
    filtered by top-k, top-p and min-p, and sampled by the exponential race
    ``argmax(probs / q)``, ``q ~ Exp(1)``, which equals a multinomial draw but needs no
    normalisation or CPU sync. A seeded row draws its ``q`` from its own generator, so its
    tokens do not depend on the batch it is in or its row position.

    ``first_use``: where each branch met for the first time is recorded (:func:`sampler_branches`).
    """

    def __init__(self, first_use: FirstUse | None = None) -> None:
        self.first_use = first_use
        self._branches_seen: set[tuple[bool, ...]] = set()

    def __call__(self, logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
        """Sample one token per row; add logprobs when ``t.max_num_logprobs`` is set."""
        if logits.dim() != 2 or logits.shape[0] != t.num_reqs:
            raise ValueError(
                f"logits has shape {tuple(logits.shape)}; expected [num_reqs={t.num_reqs}, vocab]"
            )
        if self.first_use is not None:
            flags = _branch_flags(t)
            if flags not in self._branches_seen:  # names made only for a new combination
                self._branches_seen.add(flags)
                for name in sampler_branches(flags):
                    self.first_use.record(name)
        out = SamplerOutput(sampled_token_ids=self._sample(logits, t))
        if t.max_num_logprobs is not None:
            self._add_logprobs(out, logits, t.max_num_logprobs)
        return out

    def _sample(self, logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        if t.all_greedy:
            # Upcasting bf16/fp16 to float32 is exact, so argmax needs no float32 copy.
            return logits.argmax(dim=-1)

        # Out of place on purpose: ``.float()`` returns the caller's tensor when it already is
        # float32, and the caller's logits must stay untouched (logprobs read them).
        logits32 = logits.float()
        is_greedy = t.temperature < SAMPLING_EPS
        if t.all_random:
            scaled = logits32 / t.temperature.unsqueeze(1)
        else:
            safe_temperature = torch.where(is_greedy, 1.0, t.temperature)
            scaled = logits32 / safe_temperature.unsqueeze(1)

        vocab_size = scaled.shape[-1]
        top_k = None
        if not t.no_top_k:
            # 0/-1 (disabled, when build() did not know the vocab) and oversize k keep all.
            top_k = torch.where((t.top_k <= 0) | (t.top_k > vocab_size), vocab_size, t.top_k)
        top_p = None if t.no_top_p else t.top_p
        max_k = None
        if top_k is not None and t.top_k_max_host is not None:
            # The same value as ``top_k.max()`` above: disabled or oversize k count as vocab.
            k = t.top_k_max_host
            max_k = vocab_size if k <= 0 or k > vocab_size else k
        scaled = apply_top_k_top_p(scaled, top_k, top_p, max_k)

        probs = scaled.softmax(dim=-1)
        if not t.no_min_p:
            max_prob = probs.max(dim=-1, keepdim=True).values
            probs.masked_fill_(probs < t.min_p.unsqueeze(1) * max_prob, 0.0)

        sampled = probs.div_(self._exponential_noise(probs, t, is_greedy)).argmax(dim=-1)
        if t.all_random:
            return sampled
        return torch.where(is_greedy, logits32.argmax(dim=-1), sampled)

    @staticmethod
    def _exponential_noise(
        probs: torch.Tensor, t: SamplingTensors, is_greedy: torch.Tensor
    ) -> torch.Tensor:
        # Unseeded rows share one global-RNG call; seeded rows are then overwritten with a draw
        # from their own generator. Greedy rows never advance their generator, so a seeded
        # request's stream depends only on its own steps.
        q = torch.empty_like(probs).exponential_()
        seeded_rows = [i for i, g in enumerate(t.generators) if g is not None]
        if seeded_rows:
            greedy_rows = None
            if not t.all_random:
                greedy_rows = t.is_greedy_host if t.is_greedy_host is not None else is_greedy.tolist()
            vocab_size = probs.shape[-1]
            for i in seeded_rows:
                if greedy_rows is not None and greedy_rows[i]:
                    continue
                for _ in range(t.skip_draws[i] if t.skip_draws is not None else 0):  # a resumed request's past draws
                    torch.empty(vocab_size, device=probs.device).exponential_(generator=t.generators[i])
                q[i] = torch.empty(vocab_size, device=probs.device).exponential_(
                    generator=t.generators[i]
                )
        return q

    @staticmethod
    def _add_logprobs(out: SamplerOutput, logits: torch.Tensor, num_logprobs: int) -> None:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        out.sampled_logprobs = logprobs.gather(1, out.sampled_token_ids.unsqueeze(1)).squeeze(1)
        topk = logprobs.topk(min(num_logprobs, logprobs.shape[-1]), dim=-1)
        out.topk_ids = topk.indices
        out.topk_logprobs = topk.values


def _branch_flags(t: SamplingTensors) -> tuple[bool, ...]:
    """Which of :class:`Sampler`'s branches a step takes (see :func:`sampler_branches`)."""
    random = not t.all_greedy
    return (
        t.all_greedy,
        random and t.all_random,
        random and not t.all_random,
        random and not t.no_top_k and t.no_top_p,
        random and not t.no_top_p,
        random and not t.no_min_p,
        random and any(g is not None for g in t.generators),
        t.max_num_logprobs is not None,
    )


_BRANCH_NAMES = (
    "sampler: greedy argmax",
    "sampler: temperature, every row random",
    "sampler: temperature, greedy rows mixed in",
    "sampler: top-k alone",
    "sampler: top-k/top-p sort",
    "sampler: min-p",
    "sampler: seeded draws",
    "sampler: logprobs",
)


def sampler_branches(flags: tuple[bool, ...]) -> list[str]:
    """The first-use keys of the branches in ``flags`` (from :func:`_branch_flags`): each is a
    different set of kernels (argmax, division, topk, sort and cumsum, per-row generators,
    log-softmax), loaded by the device on its first launch."""
    return [name for name, on in zip(_BRANCH_NAMES, flags) if on]


def to_logprobs(
    out: SamplerOutput, num_logprobs_per_row: list[int | None]
) -> list[Logprobs | None]:
    """Move the sampler's logprobs to the host as one :class:`Logprobs` per row (``None`` where
    the row asked for none), keeping each row's own ``n`` top entries."""
    if len(num_logprobs_per_row) != out.sampled_token_ids.shape[0]:
        raise ValueError(
            f"num_logprobs_per_row has {len(num_logprobs_per_row)} entries; "
            f"expected one per row ({out.sampled_token_ids.shape[0]})"
        )
    if all(n is None for n in num_logprobs_per_row):
        return [None] * len(num_logprobs_per_row)
    if out.sampled_logprobs is None or out.topk_ids is None or out.topk_logprobs is None:
        raise ValueError(
            "num_logprobs_per_row asks for logprobs but the SamplerOutput has none: "
            "build SamplingTensors from the same SamplingParams"
        )
    # One device-to-host copy per tensor, not per row.
    sampled = out.sampled_logprobs.tolist()
    top_ids = out.topk_ids.tolist()
    top_logprobs = out.topk_logprobs.tolist()
    result: list[Logprobs | None] = []
    for i, n in enumerate(num_logprobs_per_row):
        if n is None:
            result.append(None)
            continue
        if n > len(top_ids[i]):
            raise ValueError(
                f"num_logprobs_per_row[{i}]={n} exceeds the {len(top_ids[i])} top logprobs "
                "computed this step"
            )
        result.append(Logprobs(sampled[i], top_ids[i][:n], top_logprobs[i][:n]))
    return result


def suppress_tokens(
    logits: torch.Tensor, params: list[SamplingParams], is_first_output: list[bool]
) -> torch.Tensor:
    """``logits [num_reqs, vocab]`` with each row's suppressed ids at -inf (a new tensor when
    any row suppresses something, else ``logits`` itself).

    Row ``i`` suppresses ``params[i].suppress_token_ids`` always, and
    ``params[i].begin_suppress_token_ids`` when it samples its first output token
    (``is_first_output[i]``).  Ids past the vocabulary are ignored.
    """
    ids_per_row: list[list[int]] = []
    for p, first in zip(params, is_first_output, strict=True):
        ids = list(p.suppress_token_ids or ())
        if first:
            ids += list(p.begin_suppress_token_ids or ())
        ids_per_row.append(ids)
    return mask_token_ids(logits, ids_per_row)


def mask_token_ids(logits: torch.Tensor, ids_per_row: Sequence[Sequence[int] | np.ndarray]) -> torch.Tensor:
    """``logits [num_rows, vocab]`` with row ``i``'s ``ids_per_row[i]`` at -inf: a new tensor when
    some id falls in the vocabulary, else ``logits`` itself (a graph's logits buffer is never
    written).  Both runners suppress through this, so they drop the same entries.

    On CUDA the indices travel through pinned memory without blocking the host (the caching
    host allocator keeps that memory until the copy has read it).
    """
    if len(ids_per_row) != logits.shape[0]:
        raise ValueError(f"ids_per_row has {len(ids_per_row)} rows for logits of shape {tuple(logits.shape)}")
    lengths = [len(ids) for ids in ids_per_row]
    if not any(lengths):
        return logits
    cols = np.concatenate([np.asarray(ids, dtype=np.int64) for ids in ids_per_row])
    rows = np.repeat(np.arange(len(ids_per_row), dtype=np.int64), lengths)
    keep = cols < logits.shape[-1]
    if not keep.all():
        rows, cols = rows[keep], cols[keep]
    if not rows.size:
        return logits
    index = torch.from_numpy(np.stack([rows, cols]))
    if logits.is_cuda:
        index = index.pin_memory().to(logits.device, non_blocking=True)
    out = logits.clone()
    out[index[0], index[1]] = float("-inf")
    return out
