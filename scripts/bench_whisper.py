"""Whisper transcription throughput: pprun against transformers (and CTranslate2) in one run.

Workload: ``--num-clips`` clips of ``--seconds`` seconds each, built from the committed speech
clips (``tests/data/speech``) laid end to end with 0.5 s of silence between them and cut to length
(at most 30 s: one window each).  Every engine decodes greedily, without timestamps, with the
checkpoint's suppress lists, up to ``--max-tokens`` per clip; the figures are output tokens per
second and audio seconds per second, after one warm-up batch.

Peers, each in batches of ``--batch`` clips:
- transformers ``WhisperForConditionalGeneration.generate`` on the converted directory;
- CTranslate2 (the engine of faster-whisper) on the original ``model.bin`` (``--ct2``; needs
  ``pip install ctranslate2``, a benchmark peer only, not a dependency).

pprun runs every clip as one ``LLM.transcribe`` call (its own continuous batching, at most
``--batch`` requests at once: ``scheduler.max_num_seqs``).  Prints one JSON object.

    python scripts/bench_whisper.py --num-clips 16 --seconds 30 --batch 16 --ct2
    python scripts/bench_whisper.py --device cuda --dtype float16 --num-clips 64 --seconds 30 --batch 64
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

SPEECH = Path(__file__).resolve().parent.parent / "tests" / "data" / "speech"


def make_clips(num_clips: int, seconds: float) -> list[np.ndarray]:
    """``num_clips`` 16 kHz clips of ``seconds`` each, from the committed speech laid end to end."""
    from pprun.audio import prepare_audio

    pieces = [prepare_audio(p).samples for p in sorted(SPEECH.iterdir())]
    gap = np.zeros(8000, dtype=np.float32)
    length = int(seconds * 16000)
    clips = []
    for i in range(num_clips):
        parts, total, j = [], 0, i
        while total < length:
            parts += [pieces[j % len(pieces)], gap]
            total += pieces[j % len(pieces)].shape[0] + gap.shape[0]
            j += 1
        clips.append(np.concatenate(parts)[:length])
    return clips


def timed(fn, clips, batch):
    """Run ``fn`` over ``clips`` in batches (after warming up on the first); (seconds, tokens)."""
    fn(clips[:batch])
    start = time.perf_counter()
    tokens = 0
    for i in range(0, len(clips), batch):
        tokens += fn(clips[i : i + batch])
    return time.perf_counter() - start, tokens


def main() -> None:
    """Parse arguments, run each engine, print the JSON result."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-clips", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--runner", default="auto")
    ap.add_argument("--ct2", action="store_true", help="add CTranslate2 on the original model.bin")
    ap.add_argument("--skip-transformers", action="store_true")
    args = ap.parse_args()
    if not 0 < args.seconds <= 30:
        raise SystemExit(f"--seconds={args.seconds}: one clip is one 30 s window at most")

    import torch

    from pprun import LLM
    from pprun.models.demo import resolve_model
    from pprun.sampling.params import SamplingParams

    model_dir = resolve_model("whisper-tiny.en")
    clips = make_clips(args.num_clips, args.seconds)
    audio_s = args.num_clips * args.seconds
    result: dict[str, object] = {
        "model": "whisper-tiny.en", "num_clips": args.num_clips, "seconds": args.seconds,
        "batch": args.batch, "device": args.device, "dtype": args.dtype, "max_tokens": args.max_tokens,
        "threads": torch.get_num_threads(),
    }

    def report(name: str, elapsed: float, tokens: int) -> None:
        result[name] = {"elapsed_s": round(elapsed, 3), "output_tokens": tokens,
                        "tokens_per_s": round(tokens / elapsed, 1),
                        "audio_s_per_s": round(audio_s / elapsed, 2)}

    llm = LLM(str(model_dir), dtype=args.dtype, runner=args.runner, max_num_seqs=args.batch,
              max_num_batched_tokens=max(2048, 4 * args.batch))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

    def pprun_run(batch_clips) -> int:
        outs = llm.transcribe([(c, 16000) for c in batch_clips], params)
        return sum(len(w.outputs[0].token_ids) for o in outs for w in o.windows)

    report("pprun", *timed(pprun_run, clips, len(clips)))
    result["pprun_runner"] = llm.describe()["runner"]
    llm.shutdown()

    if not args.skip_transformers:
        from transformers import WhisperForConditionalGeneration, WhisperProcessor

        dtype = getattr(torch, args.dtype)
        hf = WhisperForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
        processor = WhisperProcessor.from_pretrained(model_dir)

        def hf_run(batch_clips) -> int:
            feats = processor(batch_clips, sampling_rate=16000, return_tensors="pt").input_features
            with torch.no_grad():
                out = hf.generate(feats.to(args.device, dtype), max_new_tokens=args.max_tokens, do_sample=False)
            return int((out != hf.generation_config.pad_token_id).sum()) + len(batch_clips)  # + each EOS

        report("transformers", *timed(hf_run, clips, args.batch))
        result["pprun_vs_transformers"] = round(result["transformers"]["elapsed_s"] / result["pprun"]["elapsed_s"], 2)

    if args.ct2:
        import ctranslate2
        from transformers import WhisperProcessor

        from pprun.models.whisper_ct2 import ct2_dir_for

        processor = WhisperProcessor.from_pretrained(model_dir)
        compute = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}[args.dtype]
        ct2 = ctranslate2.models.Whisper(str(ct2_dir_for("whisper-tiny.en")), device=args.device,
                                         compute_type=compute, intra_threads=torch.get_num_threads())

        def ct2_run(batch_clips) -> int:
            feats = processor(batch_clips, sampling_rate=16000, return_tensors="np").input_features
            res = ct2.generate(ctranslate2.StorageView.from_array(np.ascontiguousarray(feats)),
                               [[50257, 50362]] * len(batch_clips), beam_size=1,
                               max_length=args.max_tokens + 2)
            return sum(len(r.sequences_ids[0]) + 1 for r in res)  # + each EOS

        report("ctranslate2", *timed(ct2_run, clips, args.batch))
        result["pprun_vs_ctranslate2"] = round(result["ctranslate2"]["elapsed_s"] / result["pprun"]["elapsed_s"], 2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
