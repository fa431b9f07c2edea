"""pprun's configuration: dataclasses (names follow vLLM's engine arguments), mirrored in Hydra.

One ``PprunConfig`` groups model, parallel, scheduler, cache and compilation settings. It is built
three ways: ``PprunConfig(...)`` directly, ``PprunConfig.from_kwargs(pipeline_parallel_size=2, ...)``
with vLLM-style flat keywords (what ``LLM(...)`` takes), or from Hydra YAML under the top-level ``conf/`` through
``register_configs()`` + ``PprunConfig.from_omegaconf``. Values are checked by
``pprun.config.validate.validate_config`` before any process starts; this module imports neither
torch nor Hydra at import time, so the scheduler can use it.
"""

from __future__ import annotations

import difflib
import logging
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_CUDAGRAPH_CAPTURE_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
"""Batch sizes (requests per decode step) captured as CUDA graphs when none are configured."""

DEFAULT_PIECEWISE_EXTRA_SIZES: tuple[int, ...] = (576, 640, 768, 1024)
"""Token counts past the largest decode size that also get piecewise graphs by default: a step
that joins one 512-token prompt to the requests decoding (512 + up to 256 tokens; 1,024 for two
such prompts) replays a graph instead of launching every kernel of every layer from the host.  An
eager step of that size launches some 13 kernels a layer, with the Python around each, which on a
36-layer model takes longer on the host than its kernels take on the GPU; a 512-token prefill of
the 22-layer 1.1B Llama takes 15.1 ms eager against 3.4-6.6 ms as one replay (docs/performance.md)."""

DEFAULT_MAX_MODEL_LEN_CAP = 8192
"""``max_model_len=None`` uses the model's ``max_position_embeddings``, but at most this many tokens."""


@dataclass
class ModelConfig:
    """Which model to run and in what precision."""

    model: str = "smollm2-135m-instruct"
    """Path to a Hugging Face model directory (config.json + safetensors), or a bundled alias."""
    tokenizer: str | None = None
    """Tokenizer directory; None uses the model directory."""
    dtype: str = "auto"
    """auto|float32|bfloat16|float16. auto: the checkpoint's dtype on GPU when it is half precision
    (else float32), always float32 on CPU."""
    max_model_len: int | None = None
    """Longest prompt + output per request, in tokens; None: the model's max_position_embeddings,
    capped at 8192 (so the default KV cache and buffers stay small)."""
    seed: int = 0
    """Seed for weight-independent randomness (unseeded sampling, dummy inputs)."""
    max_logprobs: int = 20
    """Most top alternatives a request may ask log-probabilities of (``SamplingParams.logprobs``,
    the OpenAI API's ``logprobs`` and ``top_logprobs``); more is refused naming this setting
    (vLLM's name and default)."""
    quantization: str | None = None
    """None|fp8 (vLLM's name). fp8: a floating-point checkpoint's decoder linears are quantized to
    float8 per output row at load (online FP8: half the weight memory, FP8 matmuls on Hopper;
    dequantized again where the run does not keep FP8). A checkpoint that is already FP8 runs as
    it is stored; another quantization method with it is an error."""


@dataclass
class ParallelConfig:
    """How the model is split into pipeline stages and which processes run them."""

    pipeline_parallel_size: int = 1
    """Number of pipeline stages (each a group of ``tensor_parallel_size`` processes)."""
    tensor_parallel_size: int = 1
    """Processes (one device each) that split every layer of a stage between them (vLLM's name):
    column-parallel q/k/v and gate/up, row-parallel o and down, one all-reduce per block.  It must
    divide the model's attention heads.  A run has ``tensor_parallel_size x pipeline_parallel_size``
    workers; executor uni takes 1 only."""
    executor: str = "auto"
    """auto|uni|mp|ray|external_launcher. auto: external_launcher under torchrun, else uni for one
    stage and ray for several. ``LLM(distributed_executor_backend=...)`` is an alias."""
    layer_partition: list[int] | None = None
    """Decoder layers per stage, first to last (must sum to the layer count); None splits evenly."""
    ray_address: str | None = None
    """Ray cluster to attach to; None uses ``RAY_ADDRESS`` or starts a local cluster."""
    stage_timeout_s: float = 60.0
    """Longest wait, in seconds, between stages or for a step's result before the step fails."""
    ray_num_cpus_per_stage: float = 0.5
    """CPUs each Ray stage actor reserves (fractional so several stages fit on a small machine)."""
    placement_strategy: str = "PACK"
    """How Ray places the stage actors' placement group over nodes (executor ray): PACK (as few
    nodes as fit them), SPREAD (over as many nodes as can take them), STRICT_PACK (all on one
    node, else an error), STRICT_SPREAD (every stage on a node of its own, else an error)."""
    stage_resources: list[dict[str, float]] | None = None
    """Extra Ray resources each stage's actor reserves (executor ray), one mapping per stage from
    first to last, e.g. ``[{node_a: 1}, {node_b: 1}]`` to pin stages to nodes started with those
    custom resources; None: CPU (and one GPU on GPU) only."""
    microbatches: int | None = None
    """Batches in flight through the pipeline (executors mp and ray): steps submitted whose output
    has not come back.  None means one per stage.  One more than the stage count keeps every
    stage busy while the engine turns a batch's output into its next step (the round trip
    engine -> first stage ... last stage -> engine is longer than one stage's compute); the
    requests (at most ``scheduler.max_num_seqs``) are spread over the batches."""
    control_spin_us: int | None = None
    """Microseconds a control-socket reader (the driver, each stage, and an async pipeline's first
    stage waiting for sampled ids) polls before it blocks, 0 to 100000 (executors mp and ray).
    A blocked reader is woken by the kernel when the bytes land, which on hosts whose idle cores
    sleep deeply costs tens of microseconds per wake, twice per step; polling keeps the reader on
    its core but occupies it.  None (the default): 1000 with stages on GPUs when the host has at
    least two cores per pipeline process (driver and stages), else 0 (CPU stages need their
    cores).  The environment variable ``PPRUN_CONTROL_SPIN_US``, when set, overrides it."""
    async_pipeline: bool | None = None
    """Async pipeline steps (executors mp and ray, V2 runner, pp > 1): the engine submits each
    batch's next step while the current one is still in the pipeline, and the last stage sends
    its sampled ids straight to the first stage's host (``pprun.distributed.feedback``), so the
    engine is off the loop that feeds a batch's next step.  Twice ``microbatches`` steps in
    flight; a request that stops has computed one extra token, which is dropped.  None (the
    default): on wherever it applies on GPUs (V2, pp >= 2, mp or ray), off elsewhere (on CPU
    the stages compute on their own hosts and it gained nothing); True: required (an error
    where it cannot apply); False: off.  It pays where a batch's round trip through the engine
    is longer than the other batches in flight can cover (GPU stages, short decode steps);
    ``docs/performance.md`` has the figures."""


@dataclass
class SchedulerConfig:
    """Continuous-batching limits."""

    max_num_seqs: int = 128
    """Most requests in one scheduled batch."""
    max_num_batched_tokens: int | None = None
    """Most tokens (prefill + decode) in one scheduled batch.  None: 8192 on CUDA, 2048 on CPU
    (resolved by ``validate_config`` into ``ResolvedConfig.max_num_batched_tokens``; with chunked
    prefill off, at least ``max_model_len``); a value given here is used as is."""
    enable_chunked_prefill: bool = True
    """Split long prompts over several steps so decodes keep running; when off, a prompt must fit
    ``max_num_batched_tokens`` whole."""
    async_scheduling: bool = True
    """With one stage in process (executor uni) and the V2 runner, schedule step N+1 while step N
    still runs on the device; the runner feeds step N's sampled ids to step N+1 on the device, so
    the host's per-step work hides behind the device's.  A request that stops at step N has then
    computed one extra token, which is dropped."""
    max_num_encoder_tokens: int | None = None
    """Vision-language models: most encoder output rows (image embeddings) one step may compute;
    a prefill chunk is cut before an image that does not fit, and an image larger than this is
    refused.  None: ``max(max_num_batched_tokens, max_model_len)``, so every image of any prompt
    fits one step; an item read through cross-attention (a Whisper window), or an image larger
    than that, raises it to ``max_num_seqs`` such items, so a batch of clips is encoded in one
    step."""


@dataclass
class CacheConfig:
    """Paged KV-cache sizing."""

    block_size: int = 16
    """Tokens per KV-cache block (8, 16, 32, 64 or 128)."""
    kv_cache_memory_bytes: int | None = None
    """Exact KV-cache bytes per stage; overrides gpu_memory_utilization and cpu_kv_cache_bytes."""
    gpu_memory_utilization: float = 0.5
    """On GPU, the fraction of free device memory (after loading weights) given to the KV cache."""
    cpu_kv_cache_bytes: int = 1024 * 1024 * 1024
    """On CPU, KV-cache bytes per stage when kv_cache_memory_bytes is not set (1 GiB: the demo
    model needs ~380 MB for one 8192-token request across its 30 layers)."""
    enable_prefix_caching: bool = True
    """Keep full KV blocks after their request ends, named by a hash chain over their tokens (and
    multimodal items), and reuse them for any later request whose prompt starts with the same
    blocks; evicted least-recently-used when the pool needs blocks.  Encoder-decoder models
    (Whisper) run without it (logged once)."""


@dataclass
class CompilationConfig:
    """CUDA-graph capture (ignored on CPU)."""

    cudagraph_mode: str = "full_and_piecewise"
    """none|piecewise|full|full_and_piecewise (vLLM's names): run eagerly; capture piecewise graphs
    (cut at every attention call) for steps of up to the largest piecewise size; capture whole
    decode steps as full graphs (prefill and mixed steps eager); or both: full graphs for decode
    steps and piecewise graphs for prefill and mixed steps (``pprun.worker.v2.cuda_graphs``)."""
    cudagraph_capture_sizes: list[int] | None = None
    """Padded batch sizes of the full decode graphs; None: 1,2,4,8,16,24,32,48,64,96,128,192,256,384,512
    capped at max_num_seqs (plus max_num_seqs itself up to 512, so every decode batch up to 512 has a
    graph; a larger one runs eagerly)."""
    piecewise_capture_sizes: list[int] | None = None
    """Padded token counts of the piecewise graphs (modes piecewise and full_and_piecewise); None: the
    ``cudagraph_capture_sizes`` where those are given, else 1,2,4,...,384,512 and 576,640,768,1024
    (:data:`DEFAULT_PIECEWISE_EXTRA_SIZES`) capped at the step's token budget
    (``scheduler.max_num_batched_tokens``): a prompt of up to 512 tokens is one replay, and so is
    a step joining it to up to 512 tokens of other requests (a new prompt arriving while others
    decode); a step of more tokens runs eagerly (its kernels are then long enough that their
    launches hide behind them).  Sizes above the token budget are dropped: no step would replay
    them."""
    warmup: str = "auto"
    """auto|full|none: before the engine reports ready, run one step of every class a step can take
    (token and request counts, mixed steps, sampler variants, prefix hits, chunked prefill,
    encoders), so that nothing compiles, captures or loads for the first time under traffic
    (``pprun.engine.warmup``); auto: full on CUDA, none on CPU (nothing compiles there)."""

    def resolved_capture_sizes(self, max_num_seqs: int) -> list[int]:
        """The sorted capture sizes for a scheduler admitting at most ``max_num_seqs`` requests."""
        if self.cudagraph_capture_sizes is not None:
            return sorted({int(s) for s in self.cudagraph_capture_sizes if s <= max_num_seqs})
        sizes = [s for s in DEFAULT_CUDAGRAPH_CAPTURE_SIZES if s <= max_num_seqs]
        if max_num_seqs < DEFAULT_CUDAGRAPH_CAPTURE_SIZES[-1] and max_num_seqs not in sizes:
            sizes.append(max_num_seqs)
        return sizes

    def resolved_piecewise_sizes(self, max_num_batched_tokens: int) -> list[int]:
        """The sorted token counts of the piecewise graphs for a step budget of ``max_num_batched_tokens``."""
        if self.piecewise_capture_sizes is not None:
            return sorted({int(s) for s in self.piecewise_capture_sizes})
        if self.cudagraph_capture_sizes is not None:
            return sorted({int(s) for s in self.cudagraph_capture_sizes})
        return [s for s in DEFAULT_CUDAGRAPH_CAPTURE_SIZES + DEFAULT_PIECEWISE_EXTRA_SIZES
                if s <= max_num_batched_tokens]


@dataclass
class PprunConfig:
    """Everything one engine needs to start; validated by ``validate_config`` before any process starts."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Model, tokenizer, dtype and context length."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Pipeline stages and executor."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Batching limits."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    """KV-cache sizing."""
    compilation: CompilationConfig = field(default_factory=CompilationConfig)
    """CUDA graphs."""
    runner: str = "auto"
    """auto|v1|v2: model runner; auto picks v2 unless a configured feature needs v1 (logged)."""
    device: str = "auto"
    """auto|cpu|cuda: auto uses CUDA when available."""
    log_level: str = "INFO"
    """Logging level of pprun's loggers (DEBUG, INFO, WARNING, ERROR)."""
    attention_backend: str = "auto"
    """auto|reference|triton: the attention kernels.  reference: plain torch on any device (the
    parity reference; it reads lengths on the host, so no full CUDA graphs); triton: the paged
    Triton kernels (CUDA only); auto: triton on CUDA where Triton imports, else reference.  The
    environment variable ``PPRUN_ATTN_BACKEND``, when set, overrides it."""

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> PprunConfig:
        """Build from flat vLLM-style keywords (``max_num_seqs=4``) or group dicts (``scheduler={...}``).

        ``distributed_executor_backend`` is accepted for ``executor``. Unknown keywords raise
        :class:`UnknownConfigKeyError` naming them and suggesting close names.
        """
        if "distributed_executor_backend" in kwargs:
            alias_value = kwargs.pop("distributed_executor_backend")
            if "executor" in kwargs and kwargs["executor"] != alias_value:
                raise ValueError(
                    f"executor={kwargs['executor']!r} and distributed_executor_backend={alias_value!r} "
                    "disagree; give only one (distributed_executor_backend is an alias of executor)"
                )
            kwargs["executor"] = alias_value

        group_values: dict[str, dict[str, Any]] = {name: {} for name in _GROUP_CLASSES}
        top_values: dict[str, Any] = {}
        # Group dicts/instances first, so a flat keyword given alongside one wins.
        for name in list(kwargs):
            value = kwargs[name]
            if name in _GROUP_CLASSES and (isinstance(value, dict) or is_dataclass(value)):
                group_values[name].update(_group_dict(name, kwargs.pop(name)))
            elif name in _GROUP_CLASSES and name not in _FLAT_KEY_TO_GROUP:
                raise ValueError(
                    f"{name}={value!r} has type {type(value).__name__}: the {name} group takes a dict of its "
                    f"fields or a {_GROUP_CLASSES[name].__name__}"
                )
        for name, value in kwargs.items():
            owner = _FLAT_KEY_TO_GROUP.get(name)
            if owner is None:
                raise UnknownConfigKeyError(_unknown_key_message(name, _KNOWN_FLAT_KEYS))
            if owner == _TOP_LEVEL:
                top_values[name] = value
            else:
                group_values[owner][name] = value
        groups = {name: _GROUP_CLASSES[name](**values) for name, values in group_values.items()}
        return cls(**groups, **top_values)

    @classmethod
    def from_omegaconf(cls, cfg: Any) -> PprunConfig:
        """Build from a Hydra/OmegaConf config (structured or plain) holding PprunConfig's keys.

        Extra top-level keys (an app's prompts, sampling, ...) are ignored; unknown keys inside a
        group raise like :meth:`from_kwargs`.
        """
        from omegaconf import DictConfig, OmegaConf

        obj = OmegaConf.to_object(cfg) if isinstance(cfg, DictConfig) else cfg
        if is_dataclass(obj):
            obj = {f.name: getattr(obj, f.name) for f in fields(obj)}
        if not isinstance(obj, dict):
            raise TypeError(
                f"from_omegaconf expects a DictConfig, dict or dataclass, got {type(obj).__name__}"
            )
        own = {f.name for f in fields(cls)}
        return cls.from_kwargs(**{k: v for k, v in obj.items() if k in own})


class UnknownConfigKeyError(TypeError, ValueError):
    """A configuration keyword that no config group has (a TypeError like a bad kwarg, and a ValueError)."""


_TOP_LEVEL = "<top>"

# Group name -> its dataclass, derived from PprunConfig's fields so it never drifts.
_GROUP_CLASSES: dict[str, type] = {
    f.name: f.default_factory  # type: ignore[misc]
    for f in fields(PprunConfig)
    if f.default_factory is not MISSING and is_dataclass(f.default_factory)
}


def _build_flat_key_table() -> dict[str, str]:
    """Flat keyword -> owning group (or top level); a name owned twice is a programming error."""
    table: dict[str, str] = {}
    owners = [(group, [f.name for f in fields(klass)]) for group, klass in _GROUP_CLASSES.items()]
    owners.append((_TOP_LEVEL, [f.name for f in fields(PprunConfig) if f.name not in _GROUP_CLASSES]))
    for owner, names in owners:
        for name in names:
            if name in table:
                raise RuntimeError(f"config field {name!r} is defined in both {table[name]!r} and {owner!r}")
            table[name] = owner
    return table


_FLAT_KEY_TO_GROUP: dict[str, str] = _build_flat_key_table()
_KNOWN_FLAT_KEYS: list[str] = sorted({*_FLAT_KEY_TO_GROUP, *_GROUP_CLASSES, "distributed_executor_backend"})


def _unknown_key_message(name: str, known: list[str], where: str = "") -> str:
    """An 'unknown key' message with difflib suggestions."""
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return f"unknown config key {name!r}{where}{hint} (known keys: {', '.join(sorted(set(known)))})"


def _group_dict(group: str, value: Any) -> dict[str, Any]:
    """A group's values (from a dict or an instance of its dataclass), unknown keys rejected."""
    klass = _GROUP_CLASSES[group]
    if is_dataclass(value):
        if not isinstance(value, klass):
            raise TypeError(f"{group}= expects a {klass.__name__} or a dict, got {type(value).__name__}")
        return {f.name: getattr(value, f.name) for f in fields(value)}
    known = [f.name for f in fields(klass)]
    for key in value:
        if key not in known:
            raise UnknownConfigKeyError(_unknown_key_message(str(key), known, where=f" in {group}"))
    return dict(value)


@dataclass
class SamplingAppConfig:
    """Sampling options of the ``pprun generate`` app (turned into a SamplingParams per prompt)."""

    temperature: float = 0.0
    """Softmax temperature; 0 is greedy (the CLI default, so runs are reproducible)."""
    top_p: float = 1.0
    """Nucleus sampling threshold, in (0, 1]."""
    top_k: int = -1
    """Keep the top_k most likely tokens; -1 keeps all."""
    min_p: float = 0.0
    """Drop tokens below min_p times the top token's probability."""
    max_tokens: int = 64
    """Most tokens generated per prompt."""
    seed: int | None = None
    """Per-request seed (same output alone or batched)."""
    stop: list[str] = field(default_factory=list)
    """Strings that end generation."""
    ignore_eos: bool = False
    """Keep generating past end-of-sequence."""
    logprobs: int | None = None
    """Return this many top alternatives' log-probabilities per token."""

    def to_sampling_params(self) -> Any:
        """The equivalent :class:`pprun.sampling.params.SamplingParams`."""
        from pprun.sampling.params import SamplingParams

        return SamplingParams(**{f.name: getattr(self, f.name) for f in fields(self)})


@dataclass
class GenerateAppConfig(PprunConfig):
    """The ``pprun generate`` app: PprunConfig's keys at top level, plus prompts and sampling."""

    prompt: str | None = None
    """One prompt to complete (placed before ``prompts``)."""
    images: list[str] = field(default_factory=list)
    """Image files for ``prompt`` (a vision-language model such as Llava), in order, e.g.
    ``images=[a.png,b.jpg]``: one per image token (``<image>``) of the prompt; a prompt with none
    gets them at its start, one ``<image>\\n`` each (with ``chat``: image parts before the text).
    Relative paths are read from the directory pprun was started in."""
    prompts: list[str] = field(default_factory=list)
    """Prompts to complete (in addition to input_file's)."""
    input_file: str | None = None
    """JSONL file, one request per line: {"prompt": str} or {"prompt_token_ids": [int]} or
    {"messages": [chat turns]}, each optionally with "images": [file paths] (as ``images`` for
    ``prompt``; token ids hold the image token id once per image, a chat gets the images before
    the text of its first user turn), "sampling": {field: value} overriding ``sampling`` for that
    line, and "id" (echoed in the output).  Any other key is an error naming the line.  Relative
    paths (the file's own and its images') are read from the directory pprun was started in."""
    output_file: str | None = None
    """Write results as JSON lines here; None prints them."""
    chat: bool = False
    """Wrap each prompt with the tokenizer's chat template."""
    progress: bool = True
    """Show a progress bar (when there are more than 8 prompts or stderr is a terminal)."""
    sampling: SamplingAppConfig = field(default_factory=SamplingAppConfig)
    """Sampling options applied to every prompt."""

    def pprun_config(self) -> PprunConfig:
        """Just the engine's configuration."""
        return PprunConfig.from_omegaconf(self)


@dataclass
class TranscribeAppConfig(PprunConfig):
    """The ``pprun transcribe`` app: PprunConfig's keys at top level, plus the audio files."""

    files: list[str] = field(default_factory=list)
    """Audio files to transcribe (WAV, FLAC, OGG...; any rate and channel count)."""
    output_file: str | None = None
    """Write results as JSON lines here ({"file", "text", "audio_seconds", "windows"}); None prints them."""
    progress: bool = True
    """Show a progress bar over the windows being transcribed."""
    max_tokens: int | None = None
    """Most tokens per 30 s window (None: up to the model's max_target_positions)."""

    def pprun_config(self) -> PprunConfig:
        """Just the engine's configuration."""
        return PprunConfig.from_omegaconf(self)


@dataclass
class BenchAppConfig(PprunConfig):
    """The ``pprun bench`` app: PprunConfig's keys at top level, plus the synthetic workload."""

    workload: str = "text"
    """text|image|audio|chat|shared_prefix.  text: random token ids (or ``input_file``).  image: a
    vision-language model (Llava); each request is ``num_images`` random images then ``input_len``
    random text tokens, the transformers peer ``LlavaForConditionalGeneration.generate``.  audio: a
    speech model (Whisper); each request is one clip of ``audio_seconds``, the transformers peer
    ``WhisperForConditionalGeneration.generate``; both report audio seconds per second too.  chat:
    one user message of ``input_len`` random common words per request, rendered through the
    model's chat template.  shared_prefix: every request starts with the same ``prefix_len``
    random tokens (a shared system prompt), then its own ``input_len``."""
    num_prompts: int = 64
    """Number of requests submitted at once."""
    batch_sizes: list[int] | None = None
    """Several batch sizes timed on one engine each (pprun's, then the peer's), e.g.
    ``batch_sizes=[1,32,64,256]``: for each B in order, B requests submitted at once (its own
    warm-up, then timed); ``scheduler.max_num_seqs`` is set to the largest B for every row, for
    pprun and the peer alike, and ``num_prompts`` is unused.  The JSON then holds ``rows`` (one
    object each, with the keys of a single run) and a ``summary`` table.  None: one run of
    ``num_prompts``.  (A Hydra sweep, ``-m num_prompts=1,32``, starts both engines afresh per job.)"""
    peer_batch_sizes: list[int] | None = None
    """With ``batch_sizes``: the batch sizes the peer runs too (each one of ``batch_sizes``); the
    other rows say the peer was not asked.  None: every batch size."""
    input_len: int = 128
    """Prompt length in tokens (random token ids; with workload=image the text after the images;
    with workload=chat words in the user message; with workload=shared_prefix each request's own
    tokens after the shared prefix; unused by workload=audio, whose prompt is the checkpoint's
    decoder prompt)."""
    prefix_len: int = 1024
    """workload=shared_prefix: tokens of the prefix every request shares (at least 1)."""
    output_len: int = 128
    """Tokens generated per request (EOS ignored, so every request runs to this length)."""
    num_images: int = 1
    """workload=image: images per request (1 to 64), each one image token in the prompt."""
    image_size: int = 336
    """workload=image: side in pixels (1 to 4096) of the random square RGB images (seeded by
    ``workload_seed``); the model's image processor resizes them as it would any image."""
    audio_seconds: float = 30.0
    """workload=audio: length of each clip in seconds, above 0 and at most one window of the
    model (30 s for Whisper)."""
    audio_source: str = "speech"
    """workload=audio: speech|synthetic.  speech: the recordings in ``tests/data/speech`` of a
    pprun checkout laid end to end (0.5 s of silence between them), each clip starting at its own
    seeded offset; synthetic: seeded tones and noise."""
    input_file: str | None = None
    """JSONL workload instead of random prompts (workload=text only): {"prompt": str} or
    {"prompt_token_ids": [int]} per line, optionally with "max_tokens" (else output_len)."""
    ignore_eos: bool = True
    """Generate every request's full length even past end-of-sequence (comparable runs); the
    peer then has EOS suppressed (transformers' ``min_new_tokens``).  False: both stop at EOS."""
    num_warmup_prompts: int | None = None
    """Requests run once (at most 16 tokens each) before timing, by pprun and by the peer alike.
    None: one full batch, ``min(num_prompts, scheduler.max_num_seqs)``, so that the timed run
    meets no batch shape for the first time: a shape first met inside the timed run costs it
    allocations and caches warmed (the kernels are compiled either way), which a smaller warm-up
    leaves in the measurement."""
    workload_seed: int = 0
    """Seed for the random prompts, images and audio offsets or synthetic audio."""
    peer: str = "hf"
    """hf|vllm|none: also time another engine on the same workload after pprun's engine is shut
    down.  hf: Hugging Face transformers' generate(), same process and device.  vllm: vLLM's
    offline engine in its own process (``vllm_python``), same checkpoint, dtype, token ids,
    ``max_num_seqs`` and ``max_model_len``."""
    vllm_python: str | None = None
    """peer=vllm: the Python interpreter of an environment with vLLM installed (vLLM pins its own
    torch, so it usually lives in its own environment); None: this interpreter."""
    vllm_args: dict[str, Any] = field(default_factory=dict)
    """peer=vllm: extra keyword arguments for ``vllm.LLM`` (e.g. ``+vllm_args.gpu_memory_utilization=0.8``),
    applied over the settings taken from pprun's configuration; they are reported in the JSON."""
    repeats: int | None = None
    """Timed passes per row and engine, after its one warm-up (each from an empty prefix cache):
    the JSON and tables report the median of every figure and its min-max; the ratio is median
    over median; a row whose output rate spreads by more than 15% of its median is timed again
    once, then flagged ``unstable``.  None: 3 when a peer runs, else 1."""
    peer_dtype: str | None = None
    """The peer's dtype (e.g. ``float32``, to settle a token disagreement where half-precision
    ties no longer decide); None: pprun's."""
    output_json: str | None = None
    """Write the result JSON here as well as printing it."""

    def pprun_config(self) -> PprunConfig:
        """Just the engine's configuration."""
        return PprunConfig.from_omegaconf(self)


@dataclass
class ServeConfig:
    """The gRPC server of ``pprun serve`` and its OpenAI-compatible HTTP server (``docs/serving.md``)."""

    host: str = "127.0.0.1"
    """Address to bind: loopback by default; "0.0.0.0" or "[::]" only when asked, and an address
    beyond loopback only with a token or ``allow_unauthenticated`` (``pprun.config.exposure``)."""
    port: int = 50051
    """TCP port; 0 picks a free one (the address served is logged and printed)."""
    http_port: int | None = None
    """TCP port of the OpenAI-compatible HTTP API (``/v1/completions``, ``/v1/chat/completions``,
    ``/v1/models``) on ``host``, with the same token and TLS settings; None: no HTTP server; 0: a
    free port."""
    model_name: str | None = None
    """Name clients use for the model (KServe ``model_name``, pprun.v1 and the OpenAI API's
    ``model``); None: the last path component of ``model.model``."""
    auth_token: str | None = None
    """Bearer token every call must carry (``authorization: Bearer <token>`` metadata); None
    with no ``auth_token_file``: no token checked."""
    auth_token_file: str | None = None
    """File holding the bearer token (first line), so it stays off the command line."""
    tls_cert_file: str | None = None
    """PEM certificate chain: with ``tls_key_file``, serve TLS instead of plaintext."""
    tls_key_file: str | None = None
    """PEM private key of ``tls_cert_file``."""
    allow_unauthenticated: bool = False
    """Serve a non-loopback ``host`` without a bearer token (an explicit opt-out, logged at
    start); false: such a ``host`` without ``auth_token``/``auth_token_file`` is refused."""
    max_message_bytes: int = 4 * 1024 * 1024
    """Largest request or response message; a bigger one fails with RESOURCE_EXHAUSTED (over HTTP:
    the largest request body; a bigger one fails with 413)."""
    max_queued_requests: int = 1024
    """Requests accepted beyond ``scheduler.max_num_seqs`` (waiting for a slot); past that a new
    request fails with RESOURCE_EXHAUSTED."""
    drain_timeout_s: float = 30.0
    """On SIGTERM/SIGINT: how long running requests get to finish before they are aborted."""
    engine_process: bool = True
    """Step the engine in a process of its own (the server process keeps gRPC, tokenizing and
    detokenizing: no shared interpreter lock); false: on a thread of the server process."""
    api_servers: int = 1
    """Front-end processes (vLLM's ``--api-server-count``): each serves gRPC and HTTP on the same
    ports (SO_REUSEPORT) and does its requests' parsing, tokenizing, detokenizing and encoding,
    over one engine process that exchanges one message per step with each; 1: the server process
    is the one front end.  More than 1 needs ``engine_process``."""

    max_choices: int = 128
    """Most choices one OpenAI request may ask for: its prompts times ``n`` (OpenAI's cap on
    ``n``); each choice is a request in the engine's queue, so a request must also fit
    ``scheduler.max_num_seqs + max_queued_requests``."""
    max_request_output_tokens: int | None = None
    """Most output tokens one OpenAI request may ask for over all its choices (prompts times
    ``n`` times ``max_tokens``; a choice without ``max_tokens`` counts what its context leaves);
    None: ``max_choices`` times ``model.max_model_len`` (every choice a request may have may run
    to a full context)."""
    max_stop_strings: int = 16
    """Most stop strings one request may give (every front end)."""
    max_stop_string_chars: int = 256
    """Longest stop string, in characters (a stream holds back that many characters minus one)."""
    max_chat_messages: int = 1024
    """Most messages one chat request may hold (every front end)."""
    max_content_parts: int = 1024
    """Most content parts one OpenAI chat request may hold, over all its messages."""

    def validate(self) -> str | None:
        """Raise ValueError naming the first bad field, its value and what is allowed; return the
        warning the server logs about its address (``pprun.config.exposure``), or None."""
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"serve.host={self.host!r} is invalid: must be an address such as 127.0.0.1")
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"serve.port={self.port!r} is invalid: must be an integer in [0, 65535]")
        if self.http_port is not None and (
            not isinstance(self.http_port, int) or isinstance(self.http_port, bool) or not 0 <= self.http_port <= 65535
        ):
            raise ValueError(f"serve.http_port={self.http_port!r} is invalid: must be an integer in [0, 65535], "
                             "or null (no HTTP server)")
        if self.http_port is not None and self.http_port != 0 and self.http_port == self.port:
            raise ValueError(f"serve.http_port={self.http_port} is invalid: serve.port (gRPC) is the same port; "
                             "give the HTTP server another one")
        if not isinstance(self.max_message_bytes, int) or self.max_message_bytes < 1024:
            raise ValueError(f"serve.max_message_bytes={self.max_message_bytes!r} is invalid: must be an integer >= 1024")
        if not isinstance(self.max_queued_requests, int) or self.max_queued_requests < 0:
            raise ValueError(f"serve.max_queued_requests={self.max_queued_requests!r} is invalid: must be an integer >= 0")
        if not isinstance(self.drain_timeout_s, (int, float)) or not 0 <= self.drain_timeout_s < float("inf"):
            raise ValueError(f"serve.drain_timeout_s={self.drain_timeout_s!r} is invalid: must be a number >= 0")
        for name in ("max_choices", "max_stop_strings", "max_stop_string_chars", "max_chat_messages",
                     "max_content_parts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"serve.{name}={value!r} is invalid: must be an integer >= 1")
        limit = self.max_request_output_tokens
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise ValueError(f"serve.max_request_output_tokens={limit!r} is invalid: must be an integer >= 1, or "
                             "null (32 times model.max_model_len)")
        if not isinstance(self.engine_process, bool):
            raise ValueError(f"serve.engine_process={self.engine_process!r} is invalid: must be true or false")
        if not isinstance(self.api_servers, int) or isinstance(self.api_servers, bool) or self.api_servers < 1:
            raise ValueError(f"serve.api_servers={self.api_servers!r} is invalid: must be an integer >= 1 "
                             "(front-end processes over one engine)")
        if self.api_servers > 1 and not self.engine_process:
            raise ValueError(f"serve.api_servers={self.api_servers} needs serve.engine_process=true: front-end "
                             "processes share an engine that steps in a process of its own")
        if self.auth_token is not None and self.auth_token_file is not None:
            raise ValueError("serve.auth_token and serve.auth_token_file are both set: give one")
        if self.auth_token is not None and (not isinstance(self.auth_token, str) or not self.auth_token.strip()):
            raise ValueError("serve.auth_token is empty: give a token, or leave it unset")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError(
                f"serve.tls_cert_file={self.tls_cert_file!r} and serve.tls_key_file={self.tls_key_file!r}: "
                "TLS needs both (or neither, for plaintext)"
            )
        for name in ("auth_token_file", "tls_cert_file", "tls_key_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).expanduser().is_file():
                raise ValueError(f"serve.{name}={path!r} is not a file")
        if not isinstance(self.allow_unauthenticated, bool):
            raise ValueError(
                f"serve.allow_unauthenticated={self.allow_unauthenticated!r} is invalid: must be true or false"
            )
        from pprun.config.exposure import check_network_exposure

        # Raises for a non-loopback host without a token (docs/security.md); the warning is the
        # server's to log when it starts.
        return check_network_exposure(
            self.host,
            has_token=self.auth_token is not None or self.auth_token_file is not None,
            tls=self.tls_cert_file is not None,
            allow_unauthenticated=self.allow_unauthenticated,
        )


@dataclass
class ServeAppConfig(PprunConfig):
    """The ``pprun serve`` app: PprunConfig's keys at top level (as ``pprun generate``), plus the server."""

    serve: ServeConfig = field(default_factory=ServeConfig)
    """Address, authentication, TLS, limits and draining of the gRPC and HTTP servers."""

    def pprun_config(self) -> PprunConfig:
        """Just the engine's configuration."""
        return PprunConfig.from_omegaconf(self)


def default_conf_dir() -> Path:
    """The directory holding the Hydra YAML (``generate.yaml``, ``bench.yaml`` and groups).

    The YAML lives in the repository's top-level ``conf/``. A wheel ships that folder as the
    package data ``pprun/conf`` (``setup.py`` maps the package ``pprun.conf`` to ``conf/``), so an
    installed copy is looked for first, then the checkout's ``conf/`` beside the package (a
    source tree or an editable install, whichever way it was installed).
    """
    package_dir = Path(__file__).resolve().parent.parent
    candidates = (package_dir / "conf", package_dir.parent / "conf")
    for conf_dir in candidates:
        if (conf_dir / "generate.yaml").is_file():
            return conf_dir
    looked = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(f"no Hydra config generate.yaml in {looked}: is pprun installed completely?")


def register_configs() -> None:
    """Store the schemas in Hydra's ConfigStore, so YAML under ``conf/`` is type-checked against them.

    Names: ``pprun_schema`` (PprunConfig), ``generate_schema``, ``bench_schema`` and ``serve_schema`` (the apps).
    Calling it again is harmless.
    """
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name="pprun_schema", node=PprunConfig)
    store.store(name="generate_schema", node=GenerateAppConfig)
    store.store(name="bench_schema", node=BenchAppConfig)
    store.store(name="transcribe_schema", node=TranscribeAppConfig)
    store.store(name="serve_schema", node=ServeAppConfig)
