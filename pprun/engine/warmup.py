"""Ready means warm: before the engine reports ready, one step of every class a step can take.

The plan (:func:`plan_warmup`) follows from the configuration alone (:class:`WarmupLimits`: the
request and token limits of a step, the context length, the KV cache, prefix caching, chunked
prefill, the model's inputs) and is a list of :class:`Wave`: requests queued at once, run
through the engine's own scheduler, executor and runners until they finish, so that every
executor and pipeline depth warms the paths its traffic takes.  Its parts:

* ``prefill``: one wave per class of token count (``pprun.utils.first_use.count_class``: every
  count up to 32, then per power of two a multiple of 16 and another count), its requests as
  many as the matching class of request counts; each request samples twice, so the wave's
  decode step of as many requests runs too (every decode size class, hence every CUDA graph
  size's replay, eager decodes beyond the largest graph included);
* ``mixed``: the same classes with requests decoding while one more computes its prompt (one
  request decoding while prompts of every token class join it in turn; then every request
  class).  Every request has a prompt of its own (:func:`prompt_pattern`): requests of one step
  that shared a prefix would hit each other's cached blocks and compute fewer tokens than their
  class (so the budget's own classes, split over several requests, were missed);
* ``eager decode`` (where the Triton decode kernel runs): per variant of the eager decode launch
  (:func:`eager_decode_rows`: its split count and second-tile preload, from the row count, the
  KV heads per rank, the block table's width and the SM count), a mixed step with that many
  decode rows and a decode step of that many requests;
* ``sampler``: each sampler variant alone and all of them in one batch (greedy, temperature,
  top-k, top-p, both, min-p, seeds, logprobs, suppressed ids, min-tokens);
* ``prefix cache`` (when on): a prompt run twice, the second time from its cached blocks;
* ``chunked prefill`` (when a prompt may exceed the token budget): a prompt cut into chunks;
* ``encoder``: images (Llava: one and two in a request); a speech model's requests each carry a
  clip, so its every wave runs the encoder.

Preemption is not forced: a resumed request runs as a prefill from the start of its prompt or
from its cached blocks, both warmed.  What the warm-up met is the engine's and stages'
first-use record (``pprun.utils.first_use``); once it is over they are marked ready, and any
key met later is counted and logged.  Each part's steps, seconds and new keys are logged.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pprun.sampling.params import SamplingParams
from pprun.utils.first_use import FirstUse, count_class_representatives

if TYPE_CHECKING:
    from pprun.config.validate import ResolvedConfig
    from pprun.engine.inputs import InputProcessor


class LLMEngine(Protocol):
    """What the warm-up reads of the engine and drives it by: ``pprun.engine.llm_engine.LLMEngine``
    (named here, not imported: the engine imports this module)."""

    resolved: ResolvedConfig
    inputs: InputProcessor
    num_blocks: int
    first_use: FirstUse
    executor: Any
    tracked: dict[str, Any]

    @property
    def prefix_caching(self) -> bool: ...

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
                    request_id: str | None = None, mm_items: list | None = None) -> str: ...

    def abort_request(self, request_id: str) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[Any]: ...

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarmupRequest:
    """One request of a wave: its prompt length, sampling and inputs."""

    num_prompt_tokens: int
    params: SamplingParams
    prompt_key: int = 0
    """Which prompt: two requests of the same key and length have the same tokens (a prefix hit)."""
    num_images: int = 0


@dataclass(frozen=True)
class Wave:
    """Requests queued at once (``first``); ``joiners``, groups of requests, are queued one group
    at a time once every request of ``first`` has sampled its first token, each after the
    previous one finished, so that each group's prompts share a step with the decodes of
    ``first`` alone; ``first`` is
    aborted after the last joiner (it samples enough to decode until then)."""

    part: str
    first: tuple[WarmupRequest, ...]
    joiners: tuple[tuple[WarmupRequest, ...], ...] = ()
    """Groups of requests, each group queued at once."""

    @property
    def requests(self) -> tuple[WarmupRequest, ...]:
        """Every request of the wave."""
        return self.first + tuple(r for group in self.joiners for r in group)


@dataclass(frozen=True)
class WarmupLimits:
    """What the plan follows from (the engine's configuration)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_blocks: int
    prefix_caching: bool
    chunked_prefill: bool
    max_logprobs: int
    image_tokens: int = 0
    """Prompt tokens of one image after expansion (0: a text-only model)."""
    fixed_prompt_len: int | None = None
    """A speech model's decoder prompt length (every request is that long and carries a clip)."""
    decode_rows: tuple[int, ...] = ()
    """Decode-row counts, one per variant the eager decode launch can take (:func:`eager_decode_rows`;
    empty where no Triton decode kernel runs)."""


def eager_decode_rows(
    max_rows: int, num_kv_heads: int, max_context_len: int, stage_sms: tuple[int, ...]
) -> tuple[int, ...]:
    """The fewest decode rows that give each ``(num_splits, preload_second)`` the Triton decode
    kernel specialises on (``pprun.attention.triton_ops``), over ``1..max_rows`` rows, on devices
    of each of ``stage_sms`` SMs, ascending.

    An eager launch (a mixed step's decode rows; a decode step beyond the largest full graph, or
    any decode step without full graphs) runs one program per (row, KV head) and splits the
    context by the row count and the block table's width, ``max_context_len`` tokens: the same
    every step (V2's persistent table, V1's padded to it), so the variants are a function of the
    row count alone and few (at most 16 split counts; 10 on 132 SMs with 8 KV heads)."""
    from pprun.attention.triton_ops import decode_splits_for, preload_second

    first: dict[tuple[int, int, bool], int] = {}
    for sms in stage_sms:
        for n in range(1, max_rows + 1):
            splits = decode_splits_for(n, num_kv_heads, max_context_len, sms)
            first.setdefault((sms, splits, preload_second(splits)), n)
    return tuple(sorted(set(first.values())))


def _greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra)


def sampler_variants(max_logprobs: int) -> list[SamplingParams]:
    """One request's parameters per sampler variant (each samples three tokens)."""
    lp = {"logprobs": max(1, max_logprobs)} if max_logprobs > 0 else {}
    return [
        _greedy(3),
        SamplingParams(temperature=0.8, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=5, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.8, min_p=0.1, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=0, max_tokens=3, ignore_eos=True),
        _greedy(3, **lp),
        SamplingParams(temperature=0.8, max_tokens=3, ignore_eos=True, **lp),
        _greedy(3, suppress_token_ids=[1]),
        _greedy(3, begin_suppress_token_ids=[1]),
        _greedy(3, min_tokens=2),
    ]


def _split(total: int, parts: int) -> list[int]:
    """``total`` tokens over ``parts`` requests, as even as can be."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def plan_warmup(limits: WarmupLimits) -> list[Wave]:
    """The waves that meet every step class and variant ``limits`` allow (see the module doc)."""
    lim = limits
    max_prompt = lim.max_model_len - 2  # room for two samples
    waves: list[Wave] = []
    if lim.fixed_prompt_len is not None:  # a speech model: every request is a clip and its prompt
        p = lim.fixed_prompt_len
        for r in count_class_representatives(min(lim.max_num_seqs, lim.max_num_batched_tokens // p)):
            waves.append(Wave("prefill", tuple(WarmupRequest(p, _greedy(2)) for _ in range(r))))
        for r in count_class_representatives(min(lim.max_num_seqs, lim.max_num_batched_tokens // p))[1:]:
            waves.append(Wave("mixed", tuple(WarmupRequest(p, _greedy(lim.max_model_len - p - 1)) for _ in range(r - 1)),
                              ((WarmupRequest(p, _greedy(1)),),)))  # fmt: skip
        variants = sampler_variants(lim.max_logprobs)
        waves += [Wave("sampler", (WarmupRequest(p, v),)) for v in variants]
        waves.append(Wave("sampler", tuple(WarmupRequest(p, v) for v in variants[: lim.max_num_seqs])))
        return [w for w in waves if _fits(w, lim)]

    # Every request its own prompt (the prefix-cache wave's two aside): requests of one step that
    # shared a prefix would hit each other's blocks and compute fewer tokens than their class.
    keys = itertools.count(1)
    budget = lim.max_num_batched_tokens
    tokens = count_class_representatives(budget)
    reqs = count_class_representatives(min(lim.max_num_seqs, budget))
    for i, t in enumerate(tokens):
        r = max(reqs[i] if i < len(reqs) else 1, math.ceil(t / max_prompt))
        if r > lim.max_num_seqs:
            continue
        waves.append(Wave("prefill", tuple(WarmupRequest(n, _greedy(2), prompt_key=next(keys)) for n in _split(t, r))))
    # Mixed: one request decodes while a prompt of each token class joins in turn (groups short
    # enough for its context), then each request class with a one-token joiner.
    decode_room = lim.max_model_len - 2
    group = max(1, (decode_room - 4) // 3)
    joiners = [
        tuple(
            WarmupRequest(n, _greedy(1), prompt_key=next(keys))
            for n in _split(t - 1, math.ceil((t - 1) / max_prompt))
        )
        for t in tokens
        if t >= 2 and math.ceil((t - 1) / max_prompt) < lim.max_num_seqs
    ]
    for g in range(0, len(joiners), group):
        part = tuple(joiners[g : g + group])
        decoder = WarmupRequest(1, _greedy(min(decode_room, 3 * len(part) + 4)), prompt_key=next(keys))
        waves.append(Wave("mixed", (decoder,), part))
    for r in reqs[2:]:
        decoders = tuple(
            WarmupRequest(1, _greedy(min(decode_room, 8)), prompt_key=next(keys)) for _ in range(r - 1)
        )
        waves.append(Wave("mixed", decoders, ((WarmupRequest(1, _greedy(1), prompt_key=next(keys)),),)))
    # Eager decode launches: a mixed step of n decode rows (a two-token prompt joins n requests
    # decoding) and a decode step of n requests, for each variant's row count n.
    prefill_rows = {len(w.first) for w in waves if w.part == "prefill"}
    for n in lim.decode_rows:
        if n < lim.max_num_seqs:
            decoders = tuple(WarmupRequest(1, _greedy(min(decode_room, 6)), prompt_key=next(keys)) for _ in range(n))
            waves.append(Wave("eager decode", decoders, ((WarmupRequest(2, _greedy(1), prompt_key=next(keys)),),)))
        if n not in prefill_rows and n <= lim.max_num_seqs:
            waves.append(Wave("eager decode", tuple(WarmupRequest(1, _greedy(2), prompt_key=next(keys))
                                                    for _ in range(n))))  # fmt: skip
    variants = sampler_variants(lim.max_logprobs)
    waves += [Wave("sampler", (WarmupRequest(4, v, prompt_key=next(keys)),)) for v in variants]
    waves.append(Wave("sampler", tuple(WarmupRequest(4, v, prompt_key=next(keys))
                                       for v in variants[: lim.max_num_seqs])))  # fmt: skip
    # Two whole blocks and one token more (chunked where the budget is smaller).
    shared = min(2 * lim.block_size + 1, max_prompt, budget if not lim.chunked_prefill else max_prompt)
    if lim.prefix_caching and shared > lim.block_size:
        key = next(keys)
        for _ in range(2):
            waves.append(Wave("prefix cache", (WarmupRequest(shared, _greedy(2), prompt_key=key),)))
    if lim.chunked_prefill and max_prompt > budget:
        waves.append(
            Wave("chunked prefill", (WarmupRequest(min(max_prompt, budget + budget // 2 + 1), _greedy(2),
                                                     prompt_key=next(keys)),))
        )
    if lim.image_tokens:
        for n in (1, 2):
            if n * lim.image_tokens + 4 <= min(max_prompt, budget):
                waves.append(
                    Wave("encoder", (WarmupRequest(4, _greedy(2), prompt_key=next(keys), num_images=n),))
                )
    return [w for w in waves if _fits(w, lim)]


def _fits(wave: Wave, lim: WarmupLimits) -> bool:
    """Whether the requests of the wave that run at once (``first`` and one group of joiners)
    fit ``max_num_seqs`` and the KV cache (block 0 is reserved)."""

    def blocks(reqs: tuple[WarmupRequest, ...]) -> int:
        return sum(math.ceil((r.num_prompt_tokens + r.num_images * lim.image_tokens + r.params.max_tokens)
                             / lim.block_size) for r in reqs)  # fmt: skip

    group_reqs = max((len(g) for g in wave.joiners), default=0)
    group_blocks = max((blocks(g) for g in wave.joiners), default=0)
    return (
        len(wave.first) + group_reqs <= lim.max_num_seqs
        and blocks(wave.first) + group_blocks < lim.num_blocks
    )


def limits_for(engine: LLMEngine) -> WarmupLimits:
    """The engine's :class:`WarmupLimits`."""
    rc = engine.resolved
    cfg = rc.cfg
    speech = engine.inputs.speech
    image_tokens = 0
    if rc.arch.multimodal is not None:
        image_tokens = _image_tokens(engine)
    decode_rows: tuple[int, ...] = ()
    stage_sms = getattr(engine.executor, "stage_sms", ())
    if stage_sms and rc.attention_backend != "reference" and speech is None:
        from pprun.worker.kv_cache import kv_heads_per_rank

        bs = cfg.cache.block_size
        decode_rows = eager_decode_rows(
            cfg.scheduler.max_num_seqs,
            kv_heads_per_rank(rc.arch, cfg.parallel.tensor_parallel_size),
            -(-rc.max_model_len // bs) * bs,  # the block table's width (V2's persistent one; V1's padded)
            stage_sms,
        )
    return WarmupLimits(
        max_num_seqs=cfg.scheduler.max_num_seqs,
        max_num_batched_tokens=rc.max_num_batched_tokens,
        max_model_len=rc.max_model_len,
        block_size=cfg.cache.block_size,
        num_blocks=engine.num_blocks,
        prefix_caching=engine.prefix_caching,
        chunked_prefill=cfg.scheduler.enable_chunked_prefill,
        max_logprobs=cfg.model.max_logprobs,
        image_tokens=image_tokens,
        fixed_prompt_len=len(speech.decoder_prompt) if speech is not None else None,
        decode_rows=decode_rows,
    )


def _image() -> object:
    from PIL import Image

    return Image.new("RGB", (64, 64), (128, 96, 64))


def _image_tokens(engine: LLMEngine) -> int:
    """Placeholder tokens one warm-up image expands into."""
    image_token = engine.resolved.arch.multimodal["image_token_index"]
    ids, _ = engine.inputs.image_processor.process([image_token], [_image()], "warm-up")
    return len(ids)


@dataclass
class PartReport:
    """What one part of the warm-up did."""

    num_waves: int = 0
    num_steps: int = 0
    seconds: float = 0.0
    num_new_keys: int = 0
    """First-use keys (the engine's and the last stage's) met in this part."""


def _prompt_ids(engine: LLMEngine, req: WarmupRequest) -> tuple[list[int], list]:
    """Token ids (and multimodal items) of a warm-up request: a pattern by its ``prompt_key``,
    clear of special and image tokens (checked by the engine's own input processor)."""
    rc = engine.resolved
    speech = engine.inputs.speech
    if speech is not None:
        import numpy as np

        clip = speech.prepare_clip((np.zeros(16000, dtype=np.float32), 16000), "warm-up")
        (samples,) = speech.windows(clip)
        return list(speech.decoder_prompt), [
            speech.audio_item(samples, "warm-up", len(speech.decoder_prompt))
        ]
    skip = rc.arch.multimodal["image_token_index"] if rc.arch.multimodal is not None else -1
    ids = prompt_pattern(req.prompt_key, req.num_prompt_tokens, rc.arch.vocab_size, skip)
    if req.num_images:  # each image's token after a few prompt tokens
        ids += [rc.arch.multimodal["image_token_index"]] * req.num_images
    prompt: dict = {"prompt_token_ids": ids}
    if req.num_images:
        prompt["multi_modal_data"] = {"image": [_image() for _ in range(req.num_images)]}
    processed = engine.inputs.process_prompt(prompt, "warm-up")
    return processed.token_ids, processed.mm_items


def prompt_pattern(key: int, num_tokens: int, vocab_size: int, skip: int = -1) -> list[int]:
    """A warm-up prompt's token ids: from the upper three quarters of the vocabulary (special
    tokens sit at either end of most; ``skip``, the image token, is stepped over), the first three
    the digits of ``key`` (distinct keys below ``span ** 3`` start differently, so that no prompt
    hits another's cached blocks), then a pattern."""
    low = vocab_size // 4
    span = vocab_size - low - 1
    head = [low + (key // span**d) % span for d in range(3)]
    ids = (head + [low + (key * 7919 + j * 104729) % span for j in range(max(0, num_tokens - 3))])[:num_tokens]
    return [t + 1 if t == skip else t for t in ids]


def _params(engine: LLMEngine, req: WarmupRequest) -> SamplingParams:
    speech = engine.inputs.speech
    return speech.with_suppression(req.params) if speech is not None else req.params


def run_warmup(engine: LLMEngine, waves: list[Wave]) -> dict[str, PartReport]:
    """Run ``waves`` through ``engine`` (nothing else queued), each to its end; the report per part."""
    record = engine.first_use
    reports: dict[str, PartReport] = {}
    n = 0
    for wave in waves:
        report = reports.setdefault(wave.part, PartReport())
        num_keys = len(record.seen)
        t0 = time.perf_counter()
        steps = 0

        def add(reqs: tuple[WarmupRequest, ...]) -> list[str]:
            nonlocal n
            ids = []
            for req in reqs:
                prompt_ids, mm_items = _prompt_ids(engine, req)
                n += 1
                ids.append(engine.add_request(prompt_ids, _params(engine, req), request_id=f"warmup-{n}",
                                              mm_items=mm_items))  # fmt: skip
            return ids

        first = add(wave.first)
        if wave.joiners:
            while any(i in engine.tracked and not engine.tracked[i].req.output_token_ids for i in first):
                engine.step()
                steps += 1
            for group in wave.joiners:
                joined = add(group)
                while any(i in engine.tracked for i in joined):
                    engine.step()
                    steps += 1
            for req_id in first:  # decoding only to keep the joiners company
                if req_id in engine.tracked:
                    engine.abort_request(req_id)
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        if engine.tracked:  # the aborted ones' outputs
            engine.step()
        report.num_waves += 1
        report.num_steps += steps
        report.seconds += time.perf_counter() - t0
        report.num_new_keys += len(record.seen) - num_keys
    return reports
