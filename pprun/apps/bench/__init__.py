"""``pprun bench``: offline throughput and latency of pprun, and of a peer on the same workload.

The text workload is ``num_prompts`` random prompts of ``input_len`` token ids (seeded) generating
``output_len`` tokens each, greedy and past EOS, or a JSONL file; ``workload=chat`` renders
random user messages through the model's chat template, ``workload=shared_prefix`` gives every
request the same ``prefix_len`` tokens before its own ``input_len``.  pprun warms up on requests
of the same shape (``num_warmup_prompts``: one full batch by default, 16 tokens each), then runs
the workload timed; its engine is then shut down and the peer warms up on the same requests and
runs the same token ids: Hugging Face transformers' ``generate()`` (``peer=hf``) in this process
on the same device and dtype, in batches of ``max_num_seqs`` prompts of equal length (so nothing
is padded), or vLLM's offline engine (``peer=vllm``) in its own process with the same checkpoint,
dtype, ``max_num_seqs`` and ``max_model_len``.  One JSON object is printed: pprun's tokens/s,
request throughput, TTFT and TPOT percentiles, its steady decode rate (``decode_tokens_per_s``:
the steps after the last prefill while the batch is full, so prefill and the tail do not dilute
it), its prefill phase (``prefill_tokens_per_s``, ``prefill_ms_per_step``, ``prefill_steps``: the
steps that computed prompt tokens, from the run's start to the last of them), the configuration
facts, the peer's figures and the ratio pprun/peer of output tokens/s.

``workload=image`` (a Llava-form model) gives every request ``num_images`` seeded random images of
``image_size`` pixels square, then ``input_len`` random text tokens; the transformers peer is
``LlavaForConditionalGeneration.generate`` on the same images (through the checkpoint's image
processor) and the same expanded prompt.  ``workload=audio`` (Whisper) gives every request one
clip of ``audio_seconds`` (``audio_source``: the committed speech recordings, or synthetic); the
transformers peer is ``WhisperForConditionalGeneration.generate`` on the same clips, and both
sides report audio seconds per second.  Image and audio preprocessing (pixels, log-mel features)
is timed on both sides.  The JSON has the same shape for every workload; ``greedy_match_fraction``
compares each request's tokens up to its first EOS.

The package: :mod:`~pprun.apps.bench.workloads` (the requests), :mod:`~pprun.apps.bench.checks`
(settings checked before any engine starts), :mod:`~pprun.apps.bench.pprun_engine` (pprun timed),
:mod:`~pprun.apps.bench.peers` (the peers behind one interface), :mod:`~pprun.apps.bench.metrics`
(figures computed the same way for every engine), :mod:`~pprun.apps.bench.results` (the JSON and
the sweep report), :mod:`~pprun.apps.bench.app` (the run and the Hydra entry point).
"""

from pprun.apps.bench.app import free_device_memory, main, run
from pprun.apps.bench.checks import check_bench_config, check_model_for_workload
from pprun.apps.bench.metrics import (
    PREFILL_KEYS,
    STEADY_DECODE_KEYS,
    greedy_match_fraction,
    percentile,
    pprun_over_peer,
    until_eos,
)
from pprun.apps.bench.peers import PEERS, Peer, PeerFailed, PeerJob, PeerResult, PeerSkipped
from pprun.apps.bench.peers.hf_peer import peer_batches
from pprun.apps.bench.pprun_engine import ReportsCacheStats, run_pprun
from pprun.apps.bench.results import SweepReport, job_overrides
from pprun.apps.bench.workloads import (
    AUDIO_SOURCES,
    SAMPLE_RATE,
    SPEECH_DIR,
    WARMUP_MAX_TOKENS,
    WORKLOADS,
    BenchRequest,
    Workload,
    audio_workload,
    build_workload,
    chat_messages,
    chat_workload,
    check_workload_fits,
    file_workload,
    image_workload,
    random_workload,
    read_workload_file,
    shared_prefix_workload,
    speech_clips,
    synthetic_clips,
    total_audio_seconds,
    warmup_prompts,
    workload_facts,
)

__all__ = [
    "AUDIO_SOURCES", "PEERS", "PREFILL_KEYS", "SAMPLE_RATE", "SPEECH_DIR", "STEADY_DECODE_KEYS", "WARMUP_MAX_TOKENS",
    "WORKLOADS",
    "BenchRequest", "Peer", "PeerFailed", "PeerJob", "PeerResult", "PeerSkipped", "ReportsCacheStats", "SweepReport",
    "Workload", "audio_workload", "build_workload", "chat_messages", "chat_workload", "check_bench_config",
    "check_model_for_workload", "check_workload_fits", "file_workload", "free_device_memory", "greedy_match_fraction",
    "image_workload", "job_overrides", "main", "peer_batches", "percentile", "pprun_over_peer", "random_workload",
    "read_workload_file", "run", "run_pprun", "shared_prefix_workload", "speech_clips", "synthetic_clips",
    "total_audio_seconds", "until_eos", "warmup_prompts", "workload_facts",
]
