"""``LLM``: offline batch generation, the public entry point (``from pprun import LLM``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pprun.config.config import PprunConfig
from pprun.config.validate import ResolvedConfig
from pprun.engine.llm_engine import LLMEngine
from pprun.engine.outputs import RequestOutput
from pprun.engine.resolve import resolve_config
from pprun.engine.speech import TranscriptionOutput
from pprun.executor.base import StageFailedError
from pprun.sampling.params import SamplingParams

logger = logging.getLogger(__name__)


class GenerationFailedError(StageFailedError):
    """A stage failed during ``generate``; ``outputs`` holds every request's final state
    (finished ones intact, the rest with finish_reason "error")."""

    def __init__(self, message: str, outputs: list[RequestOutput]) -> None:
        super().__init__(message)
        self.outputs = outputs


class LLM:
    """A model split into pipeline stages, ready to generate.

    ``LLM(model, **config)`` takes the flat vLLM-style names (``pipeline_parallel_size=2``,
    ``executor="ray"``, ``dtype="float32"``, ``max_num_seqs=...``) or group dicts; see
    ``pprun.config``, or ``config=``: a :class:`PprunConfig`, or a
    :class:`~pprun.config.validate.ResolvedConfig` an app resolved already.  The model is resolved
    (a known alias converted once) and the configuration validated once, before any process
    starts (``pprun.engine.resolve.resolve_config``); the resolved config is what the engine and
    every stage receive.  Use as a context manager, or call :meth:`shutdown`.

    Bad input to :meth:`generate` (a bad prompt or sampling parameter) fails the whole call
    with a ``ValueError`` naming the entry, field and value before any request is queued, so
    nothing already accepted — earlier calls' results, the engine itself — is lost.
    """

    def __init__(
        self, model: str | None = None, *, config: PprunConfig | ResolvedConfig | None = None, **kwargs
    ) -> None:
        if config is None:
            if model is not None:
                kwargs["model"] = str(model)
            config = PprunConfig.from_kwargs(**kwargs)
        elif model is not None or kwargs:
            raise ValueError("pass either config=PprunConfig(...) or keyword arguments, not both")
        self.resolved = resolve_config(config)
        """The run's resolved configuration (the one validation of this LLM)."""
        self.config = self.resolved.cfg
        self.engine = LLMEngine(self.resolved)

    # --- generation ------------------------------------------------------------------------------

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        A prompt is a string, or a dict with ``prompt`` (text) or ``prompt_token_ids`` and
        optionally ``multi_modal_data`` (``{"image": [...]}``: PIL images, NumPy arrays or file
        paths, one per image token of the prompt); ``sampling_params`` is one
        ``SamplingParams`` for all or a list with one per prompt.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, Sequence):
            raise ValueError(f"prompts has type {type(prompts).__name__}: must be a str, a dict or a list of them")
        prompts = list(prompts)
        params_list = self._params_for(prompts, sampling_params)
        checked = []
        for i, (p, sp) in enumerate(zip(prompts, params_list)):
            self.engine.inputs.check_params(sp, f"sampling_params[{i}]")
            checked.append(self.engine.inputs.process_prompt(p, f"prompts[{i}]"))
            params_list[i] = self.engine.inputs.check_request(checked[-1], sp, f"prompts[{i}]")
        ids = [
            self.engine.add_request(c.token_ids, sp, prompt=c.text, mm_items=c.mm_items)
            for c, sp in zip(checked, params_list)
        ]
        return self._run(ids, use_tqdm)

    def transcribe(
        self,
        audio: object,
        sampling_params: SamplingParams | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[TranscriptionOutput]:
        """Transcribe audio files or ``(samples, sample_rate)`` arrays with a speech model (Whisper).

        ``audio`` is one path or pair, or a list of them.  Each clip is resampled to 16 kHz mono
        and cut into consecutive 30 s windows, one request each (all queued together); a clip's
        text is its windows' texts joined in order (``pprun.audio``).  Decoding is greedy up to the
        model's ``max_target_positions`` unless ``sampling_params`` says otherwise; the checkpoint's
        suppress lists apply either way.  Every clip is read and checked before any is queued.
        """
        speech = self.engine.inputs.speech
        if speech is None:
            raise ValueError(
                f"LLM.transcribe needs a speech model; model {self.config.model.model!r} is text-only"
            )
        single = isinstance(audio, (str, bytes)) or hasattr(audio, "__fspath__") or (
            isinstance(audio, tuple) and len(audio) == 2 and not isinstance(audio[0], (str, tuple))
        )
        clips_in = [audio] if single else list(audio)
        if not clips_in:
            raise ValueError("audio is empty: pass a path, a (samples, sample_rate) pair, or a list of them")
        params = speech.default_params() if sampling_params is None else sampling_params
        self.engine.inputs.check_params(params, "sampling_params")
        params = speech.with_suppression(params)
        speech.check_length(len(speech.decoder_prompt), params, "sampling_params")
        clips = [speech.prepare_clip(a, f"audio[{i}]") for i, a in enumerate(clips_in)]
        prompts = []
        for clip in clips:
            for samples in speech.windows(clip):
                prompts.append(speech.audio_item(samples, clip.source, len(speech.decoder_prompt)))
        ids = [
            self.engine.add_request(list(speech.decoder_prompt), params, mm_items=[item]) for item in prompts
        ]
        outputs = iter(self._run(ids, use_tqdm))
        results = []
        for clip in clips:
            windows = [next(outputs) for _ in speech.windows(clip)]
            results.append(TranscriptionOutput(clip.source, speech.join(windows), clip.seconds, windows))
        return results

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list) and generate."""
        prompts = self.chat_prompts(messages, add_generation_prompt=add_generation_prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def chat_prompts(self, messages: list[dict] | list[list[dict]], *, add_generation_prompt: bool = True) -> list[dict]:
        """One conversation (a list of ``{role, content}`` dicts) or a list of them, rendered with
        the model's chat template into prompts for :meth:`generate` (``prompt_token_ids`` and the
        rendered ``prompt``).  Raises ValueError naming the conversation that cannot be rendered."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError(f"messages={messages!r} must be a non-empty list of {{role, content}} dicts, or a list "
                             "of such conversations")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [
            self.engine.inputs.render_chat(conv, f"messages[{i}]", add_generation_prompt=add_generation_prompt)
            for i, conv in enumerate(conversations)
        ]
        return prompts

    def _params_for(self, prompts: list, sampling_params) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * len(prompts)
        params = list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(
                f"sampling_params has {len(params)} entries for {len(prompts)} prompts: pass one "
                "SamplingParams or one per prompt"
            )
        return params  # each checked by the engine (check_params)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(ids)
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="requests", unit="req", dynamic_ncols=True)
        try:
            while len(results) < len(ids):
                try:
                    finished = self.engine.step()
                except StageFailedError as e:
                    for out in self.engine.drain_failed():
                        results.setdefault(out.request_id, out)
                    raise GenerationFailedError(
                        str(e), [results[i] for i in ids if i in results]
                    ) from e
                except BaseException:
                    # Interrupted (Ctrl-C): end this call's requests so a later call does not
                    # compute them for nobody.
                    if not self.engine.dead:
                        for i in ids:
                            if i not in results:
                                self.engine.abort_request(i)
                    raise
                for out in finished:
                    if out.request_id in wanted:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]

    # --- lifecycle -------------------------------------------------------------------------------

    def describe(self) -> dict:
        """Runner, executor and stage partition in use."""
        return self.engine.describe()

    def cache_stats(self) -> dict:
        """Prefix-cache hit rate, queries, hits and block counts (:meth:`LLMEngine.cache_stats`)."""
        return self.engine.cache_stats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block and zero the counters (:meth:`LLMEngine.reset_prefix_cache`)."""
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop every stage process and free their memory; idempotent."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass
