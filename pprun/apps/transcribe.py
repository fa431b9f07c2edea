"""``pprun transcribe``: audio files to text with a speech model (Whisper) and one engine.

Every file is read, resampled and checked before any is queued (a bad file is an error naming
it).  Results go to stdout (one line per file) or ``output_file`` (JSONL: ``file``, ``text``,
``audio_seconds``, ``windows``), and a summary closes the run with audio seconds transcribed per
second of wall time.
"""

from __future__ import annotations

import json
import sys
import time

from pprun.apps import job_output_path
from pprun.config.config import TranscribeAppConfig


def run(app: TranscribeAppConfig) -> None:
    """Transcribe ``app.files`` and print or write the results and a summary."""
    from pprun import LLM
    from pprun.sampling.params import SamplingParams

    if not app.files:
        raise ValueError("files=[] is empty: give one or more audio files, e.g. 'files=[talk.wav]'")
    llm = LLM(config=app.pprun_config())
    try:
        params = None
        if app.max_tokens is not None:
            params = SamplingParams(temperature=0.0, max_tokens=app.max_tokens)
        start = time.perf_counter()
        results = llm.transcribe(list(app.files), params, use_tqdm=app.progress)
        elapsed = time.perf_counter() - start
        describe = llm.describe()
    finally:
        llm.shutdown()
    out_path = job_output_path(app.output_file)
    lines = [
        {
            "file": r.source,
            "text": r.text,
            "audio_seconds": round(r.audio_seconds, 3),
            "windows": len(r.windows),
            "num_output_tokens": sum(len(w.outputs[0].token_ids) for w in r.windows),
        }
        for r in results
    ]
    if out_path is not None:
        with open(out_path, "w") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")
    else:
        for line in lines:
            print(f"{line['file']}: {line['text']}")
    audio = sum(r.audio_seconds for r in results)
    summary = {
        "files": len(results),
        "windows": sum(line["windows"] for line in lines),
        "audio_seconds": round(audio, 3),
        "elapsed_s": round(elapsed, 3),
        "audio_seconds_per_second": round(audio / elapsed, 2) if elapsed > 0 else None,
        "output_tokens": sum(line["num_output_tokens"] for line in lines),
        "runner": describe.get("runner"),
        "executor": describe.get("executor"),
        "output_file": str(out_path) if out_path is not None else None,
    }
    print(json.dumps(summary), file=sys.stderr)


def main() -> None:
    """Entry point of ``pprun transcribe``: ``sys.argv[1:]`` are Hydra overrides."""
    from pprun.apps import run_hydra_app

    run_hydra_app("transcribe", run)


if __name__ == "__main__":
    main()
