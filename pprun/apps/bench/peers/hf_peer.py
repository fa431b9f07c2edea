"""``peer=hf``: Hugging Face transformers' ``generate()`` on the same workload, in this process
on pprun's device and dtype, after pprun's engine is shut down.

One peer for every workload: what differs by model family (the model class, the
preprocessing of images or audio, the inputs to ``generate``) is one small :class:`HFFamily`
each; loading, warm-up, batching, timing and metrics are shared.  Requests run in batches of
``max_num_seqs`` prompts of equal length and ``max_tokens`` (:func:`peer_batches`), so nothing is
padded and every row generates the same number of tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pprun.apps.bench.metrics import throughput_metrics, until_eos
from pprun.apps.bench.peers.base import PeerJob, PeerOutcome, PeerResult
from pprun.apps.bench.workloads import SAMPLE_RATE, BenchRequest, workload_rates
from pprun.config.config import BenchAppConfig

Generate = Callable[[list[BenchRequest], int], list[list[int]]]
"""``generate(batch, max_new_tokens)``: each row's new tokens (all of them with ``ignore_eos``,
else up to its EOS)."""


@dataclass(frozen=True)
class HFFamily:
    """How transformers runs one model family: its generate API's name in the result, and
    ``load(model_dir, device, torch_dtype, eos_token_ids, ignore_eos)`` returning the batch
    :data:`Generate` function (model loaded onto the device)."""

    name: str
    load: Callable[[str, str, Any, set[int], bool], Generate]


def peer_batches(workload: list[BenchRequest], batch_size: int) -> list[list[BenchRequest]]:
    """Requests grouped by (prompt length, max_tokens), in chunks of at most ``batch_size``, so each
    batch runs unpadded and every row generates the same number of tokens."""
    groups: dict[tuple[int, int], list[BenchRequest]] = {}
    for r in workload:
        groups.setdefault((len(r.model_token_ids), r.max_tokens), []).append(r)
    return [g[i : i + batch_size] for g in groups.values() for i in range(0, len(g), batch_size)]


def generation_kwargs(max_new_tokens: int, ignore_eos: bool) -> dict[str, Any]:
    """Greedy ``generate`` arguments for ``max_new_tokens`` new tokens."""
    # min_new_tokens == max_new_tokens suppresses EOS: every row runs the full length, as
    # pprun's ignore_eos does.
    kwargs: dict[str, Any] = {"do_sample": False, "max_new_tokens": max_new_tokens}
    if ignore_eos:
        kwargs["min_new_tokens"] = max_new_tokens
    return kwargs


def _rows(new_tokens: Any, eos_token_ids: set[int], ignore_eos: bool) -> list[list[int]]:
    """Each row of a batch's new tokens as the tokens it generated: all of them with
    ``ignore_eos``, else up to its EOS (the rest is padding after a row finished)."""
    rows = [row.tolist() for row in new_tokens]
    return rows if ignore_eos else [until_eos(row, eos_token_ids) for row in rows]


def _pad_id(config: Any, eos_token_ids: set[int]) -> int:
    pad = getattr(config, "pad_token_id", None)  # an optional field of HF configs
    if pad is None:
        pad = min(eos_token_ids)
    return pad[0] if isinstance(pad, list) else int(pad)


def _load_causal_lm(model_dir: str, device: str, torch_dtype: Any, eos_token_ids: set[int], ignore_eos: bool) -> Generate:
    """Text, chat and shared-prefix workloads: ``AutoModelForCausalLM.generate`` on token ids."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(device).eval()
    eos = model.config.eos_token_id
    eos_ids = set(eos_token_ids or ([eos] if isinstance(eos, int) else eos or []))
    pad = _pad_id(model.config, eos_ids)

    def generate(batch: list[BenchRequest], max_new_tokens: int) -> list[list[int]]:
        ids = torch.tensor([r.prompt_token_ids for r in batch], device=device)
        gen_cfg = GenerationConfig(
            **generation_kwargs(max_new_tokens, ignore_eos), pad_token_id=pad, eos_token_id=sorted(eos_ids) or eos
        )
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen_cfg)
        return _rows(out[:, ids.shape[1] :], eos_ids, ignore_eos)

    return generate


def _load_llava(model_dir: str, device: str, torch_dtype: Any, eos_token_ids: set[int], ignore_eos: bool) -> Generate:
    """Image workload: ``LlavaForConditionalGeneration.generate``, the checkpoint's image
    processor (timed) on the same images, the prompt expanded as pprun runs it (transformers
    checks it holds one image token per embedding row)."""
    import torch
    from transformers import AutoImageProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch_dtype).to(device).eval()
    processor = AutoImageProcessor.from_pretrained(model_dir)
    pad = _pad_id(model.config.text_config, eos_token_ids)

    def generate(batch: list[BenchRequest], max_new_tokens: int) -> list[list[int]]:
        images = [img for r in batch for img in r.multi_modal_data["image"]]
        pixels = processor(images, return_tensors="pt")["pixel_values"].to(device, torch_dtype)
        ids = torch.tensor([r.expanded_token_ids for r in batch], device=device)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels,
                pad_token_id=pad, eos_token_id=sorted(eos_token_ids), **generation_kwargs(max_new_tokens, ignore_eos),
            )  # fmt: skip
        return _rows(out[:, ids.shape[1] :], eos_token_ids, ignore_eos)

    return generate


def _load_whisper(model_dir: str, device: str, torch_dtype: Any, eos_token_ids: set[int], ignore_eos: bool) -> Generate:
    """Audio workload: ``WhisperForConditionalGeneration.generate`` (its generation config:
    decoder prompt, suppress lists), log-mel features included (timed)."""
    import torch
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

    model = WhisperForConditionalGeneration.from_pretrained(model_dir, dtype=torch_dtype).to(device).eval()
    features = WhisperFeatureExtractor.from_pretrained(model_dir)

    def generate(batch: list[BenchRequest], max_new_tokens: int) -> list[list[int]]:
        clips = [r.multi_modal_data["audio"][0] for r in batch]
        feats = features(clips, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features
        with torch.inference_mode():
            out = model.generate(feats.to(device, torch_dtype), **generation_kwargs(max_new_tokens, ignore_eos))
        rows = _rows(out, eos_token_ids, ignore_eos)
        if not ignore_eos and out.shape[1] < max_new_tokens:
            # Whisper's generate returns the new tokens only, and drops the EOS that ended the
            # longest row: every row that stopped short ended with one (pprun counts it).
            rows = [row if row and row[-1] in eos_token_ids else [*row, min(eos_token_ids)] for row in rows]
        return rows

    return generate


FAMILIES: dict[str, HFFamily] = {
    "text": HFFamily("transformers.generate", _load_causal_lm),
    "image": HFFamily("transformers.LlavaForConditionalGeneration.generate", _load_llava),
    "audio": HFFamily("transformers.WhisperForConditionalGeneration.generate", _load_whisper),
}
"""Model family (the workload's kind of model) -> how transformers runs it."""


def family_of(workload: str) -> HFFamily:
    """The family that runs ``workload`` (token workloads run on the causal LM)."""
    return FAMILIES[workload if workload in FAMILIES else "text"]


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def warm_up(warmup: list[BenchRequest], batch_size: int, device: str, generate: Generate) -> None:
    """Run ``generate`` once on the first batch of ``warmup`` (nothing without warm-up requests)."""
    if warmup:
        first = peer_batches(warmup, batch_size)[0]
        generate(first, first[0].max_tokens)
        _sync(device)


def time_batches(
    requests: list[BenchRequest], batch_size: int, device: str, generate: Generate
) -> tuple[float, list[list[int]], int]:
    """Time ``generate`` over ``requests``' :func:`peer_batches`; ``(elapsed_s, each request's
    tokens in request order, number of batches)``."""
    batches = peer_batches(requests, batch_size)
    start = time.perf_counter()
    batch_outputs = [generate(b, b[0].max_tokens) for b in batches]
    _sync(device)
    elapsed_s = time.perf_counter() - start
    tokens_by_request = {id(r): row for b, o in zip(batches, batch_outputs) for r, row in zip(b, o)}
    return elapsed_s, [tokens_by_request[id(r)] for r in requests], len(batches)


class TransformersPeer:
    """``peer=hf``: transformers' ``generate`` for the workload's model family."""

    name = "hf"

    def check(self, cfg: BenchAppConfig) -> None:
        """transformers is a dependency of pprun: nothing to check."""

    def run(self, job: PeerJob) -> PeerResult:
        """Load the checkpoint in transformers on pprun's device and dtype, warm up, time."""
        return self.timed(job, self.load(job))

    def run_all(self, jobs: list[PeerJob]) -> list[PeerOutcome]:
        """The checkpoint loaded once, then each job warmed up and timed in turn."""
        if not jobs:
            return []
        generate = self.load(jobs[0])
        return [self.timed(job, generate) for job in jobs]

    @staticmethod
    def load(job: PeerJob) -> Generate:
        """The job's model family's generate function, its checkpoint loaded on pprun's device."""
        import torch

        family = family_of(job.cfg.workload)
        return family.load(job.model_dir, job.device, getattr(torch, job.dtype), job.eos_token_ids, job.ignore_eos)

    @staticmethod
    def timed(job: PeerJob, generate: Generate) -> PeerResult:
        """Warm ``generate`` up on the job's warm-up requests, then time its requests
        ``job.repeats`` times (summarised as pprun's passes are)."""
        from pprun.apps.bench.pprun_engine import repeated

        warm_up(job.warmup, job.batch_size, job.device, generate)

        def one_pass() -> tuple[dict, list[list[int]]]:
            elapsed_s, tokens, num_batches = time_batches(job.requests, job.batch_size, job.device, generate)
            rates = throughput_metrics(elapsed_s, job.requests, tokens)
            name = family_of(job.cfg.workload).name
            metrics = {"name": name, "elapsed_s": rates.pop("elapsed_s"), "num_batches": num_batches, **rates}
            metrics.update(workload_rates(job.cfg, job.requests, elapsed_s))
            return metrics, tokens

        metrics, tokens = repeated(one_pass, job.repeats)
        return PeerResult(metrics, tokens)
