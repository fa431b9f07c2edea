"""``pprun generate``: complete prompts from arguments or a JSONL file with one engine.

Prompts come from ``prompt=...``, ``prompts=[...]`` and ``input_file=requests.jsonl`` (in that
order); with none of them a few built-in chat prompts are answered. A vision-language model
(Llava) takes images: ``images=[a.png,b.jpg]`` go with ``prompt``, and an input line's
``"images"`` key with that line. Results go to stdout (readable) or ``output_file`` (JSONL, one
object per prompt), and a summary closes the run.

Every request is checked before the engine starts: the lines' keys and types, each image file
(present and readable), and, when there are images, that the model takes them and that a prompt
has one image token per image (:func:`attach_images`).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from pprun.apps import iter_jsonl, job_output_path
from pprun.config.config import GenerateAppConfig
from pprun.config.validate import ResolvedConfig
from pprun.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

BUILTIN_CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [{"role": "user", "content": "Explain pipeline parallelism in two sentences."}],
    [{"role": "user", "content": "Write a haiku about a graphics card."}],
]
"""What ``pprun generate`` answers when given no prompts."""

PROGRESS_MIN_PROMPTS = 8
"""More prompts than this show a progress bar even when stderr is not a terminal."""

_LINE_KEYS = ("prompt", "prompt_token_ids", "messages", "images", "sampling", "id")
_SAMPLING_KEYS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.name not in ("n", "extra"))


@dataclass
class GenerateRequest:
    """One unit of work: a prompt (text or token ids) or a chat conversation, with its sampling."""

    where: str
    """Where it came from, for messages: ``prompts[1]``, ``input_file line 3``, ``builtin[0]``."""
    sampling: SamplingParams
    """Sampling for this request (the app's ``sampling`` plus any per-line overrides)."""
    prompt: str | dict | None = None
    """A text prompt or ``{"prompt_token_ids": [...], "prompt": text?}``; None for a chat."""
    messages: list[dict] | None = None
    """A chat conversation (the model's chat template is applied)."""
    request_id: Any = None
    """The input line's ``id``, echoed in the output."""
    images: list[str] = field(default_factory=list)
    """Image files as given (``images=`` or the line's ``"images"``), echoed in the output."""
    image_paths: list[Path] = field(default_factory=list)
    """The same files, resolved against the directory pprun was started in, checked readable."""


def sampling_params_for(base: dict[str, Any], overrides: dict[str, Any] | None, where: str) -> SamplingParams:
    """``SamplingParams`` from the app's sampling dict with ``overrides`` (one input line's) applied."""
    values = dict(base)
    if overrides is not None:
        if not isinstance(overrides, dict):
            raise ValueError(
                f"{where}: sampling={overrides!r} must be an object of SamplingParams fields, "
                f'e.g. {{"max_tokens": 16}}'
            )
        for key, value in overrides.items():
            if key not in _SAMPLING_KEYS:
                close = difflib.get_close_matches(str(key), _SAMPLING_KEYS, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(
                    f"{where}: sampling key {key!r} is unknown{hint} (allowed: {', '.join(_SAMPLING_KEYS)})"
                )
            values[key] = value
    params = SamplingParams(**values)
    try:
        params.validate()
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return params


def launch_dir() -> Path:
    """The directory pprun was started in: Hydra's original working directory (a job may run
    elsewhere with ``hydra.job.chdir=true``), else the current one."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.utils import get_original_cwd

        if HydraConfig.initialized():
            return Path(get_original_cwd())
    except ImportError:
        pass
    return Path.cwd()


def resolve_input_path(path: str) -> Path:
    """A user-named input file: ``~`` expanded, relative paths against :func:`launch_dir`."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else launch_dir() / p


def check_image_files(images: object, where: str) -> tuple[list[str], list[Path]]:
    """A request's ``images`` (a list of file paths) as given and resolved, each one a readable
    image; raises ValueError naming ``where``, the entry and the path."""
    if not isinstance(images, list) or not all(isinstance(i, str) and i for i in images):
        raise ValueError(
            f"{where} must be a list of image file paths, e.g. [\"cat.png\", \"dog.jpg\"]; got {images!r}"
        )
    from PIL import Image, UnidentifiedImageError

    paths = []
    for i, image in enumerate(images):
        path = resolve_input_path(image)
        if not path.is_file():
            raise ValueError(f"{where}[{i}]={image!r} is not a file (looked for {path})")
        try:
            with Image.open(path) as img:
                img.verify()  # reads the file through without decoding every pixel
        except (UnidentifiedImageError, OSError, SyntaxError) as e:
            raise ValueError(f"{where}[{i}]={image!r} is not a readable image: {e}") from None
        paths.append(path)
    return list(images), paths


def read_input_file(path: str, base_sampling: dict[str, Any]) -> list[GenerateRequest]:
    """Parse a JSONL request file (see ``GenerateAppConfig.input_file``); blank lines are skipped."""
    requests = []
    for where, obj in iter_jsonl(str(resolve_input_path(path))):
        unknown = [k for k in obj if k not in _LINE_KEYS]
        if unknown:
            close = difflib.get_close_matches(str(unknown[0]), _LINE_KEYS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{where}: unknown key {unknown[0]!r}{hint} (allowed: {', '.join(_LINE_KEYS)})")
        sampling = sampling_params_for(base_sampling, obj.get("sampling"), where)
        if "messages" in obj:
            if "prompt" in obj or "prompt_token_ids" in obj:
                raise ValueError(f"{where}: give either 'messages' or a prompt, not both")
            messages = obj["messages"]
            if (
                not isinstance(messages, list)
                or not messages
                or not all(isinstance(m, dict) for m in messages)
            ):
                raise ValueError(
                    f"{where}: messages must be a non-empty list of {{role, content}} objects"
                )
            request = GenerateRequest(where, sampling, messages=messages, request_id=obj.get("id"))
        elif "prompt_token_ids" in obj:
            prompt = {"prompt_token_ids": obj["prompt_token_ids"]}
            if "prompt" in obj:
                prompt["prompt"] = obj["prompt"]
            request = GenerateRequest(where, sampling, prompt=prompt, request_id=obj.get("id"))
        elif "prompt" in obj:
            if not isinstance(obj["prompt"], str):
                raise ValueError(f"{where}: prompt must be a string, got {type(obj['prompt']).__name__}")
            request = GenerateRequest(where, sampling, prompt=obj["prompt"], request_id=obj.get("id"))
        else:
            raise ValueError(f"{where}: needs one of 'prompt', 'prompt_token_ids' or 'messages'")
        if "images" in obj:
            request.images, request.image_paths = check_image_files(obj["images"], f"{where}: images")
        requests.append(request)
    if not requests:
        raise ValueError(f"input_file={path!r} holds no requests")
    return requests


def collect_requests(cfg: GenerateAppConfig) -> list[GenerateRequest]:
    """Every request of a run, in order: ``prompt``, ``prompts``, then ``input_file``'s lines;
    the built-in chats when there are none."""
    base = {f.name: getattr(cfg.sampling, f.name) for f in dataclasses.fields(cfg.sampling)}
    texts = ([("prompt", cfg.prompt)] if cfg.prompt is not None else []) + [
        (f"prompts[{i}]", p) for i, p in enumerate(cfg.prompts)
    ]
    requests = []
    for where, text in texts:
        sampling = sampling_params_for(base, None, where)
        if cfg.chat:
            requests.append(GenerateRequest(where, sampling, messages=[{"role": "user", "content": text}]))
        else:
            requests.append(GenerateRequest(where, sampling, prompt=text))
    if cfg.images:
        if cfg.prompt is None:
            raise ValueError(
                f"images={list(cfg.images)!r} go with prompt=..., which is not set: give prompt, or an "
                '"images" key on the lines of input_file'
            )
        requests[0].images, requests[0].image_paths = check_image_files(list(cfg.images), "images")
    if cfg.input_file is not None:
        requests.extend(read_input_file(cfg.input_file, base))
    if not requests:
        requests = [
            GenerateRequest(f"builtin[{i}]", sampling_params_for(base, None, f"builtin[{i}]"), messages=chat)
            for i, chat in enumerate(BUILTIN_CHATS)
        ]
    return requests


def attach_images(requests: list[GenerateRequest], arch: Any, tokenizer: Any, model: str) -> None:
    """Turn each request's images into the prompt's ``multi_modal_data``, checked against the
    model (``arch``: its :class:`~pprun.models.hf_config.ModelArchConfig`) before the engine
    starts; raises ValueError naming the request and ``images``.

    A text prompt takes one image token (``<image>``) per image; one without any gets them at
    its start, one ``<image>\\n`` each. Token ids must hold the image token id once per image.
    A chat gets image parts before the text of its first user turn (the chat template renders
    each as the image token).
    """
    with_images = [r for r in requests if r.images]
    if not with_images:
        return
    if arch.multimodal is None:
        raise ValueError(
            f"{with_images[0].where}: images given, but model {model!r} ({arch.architecture}) is text-only "
            "and takes no images"
        )
    from pprun.multimodal.processing import image_token_text

    token_id = int(arch.multimodal["image_token_index"])
    token_text = image_token_text(tokenizer, token_id)
    for r in with_images:
        paths = [str(p) for p in r.image_paths]
        count = len(paths)
        if r.messages is not None:
            turn = next((m for m in r.messages if m.get("role") == "user"), None)
            if turn is None or not isinstance(turn.get("content"), str):
                raise ValueError(
                    f"{r.where}: images need a user turn whose content is a string (the images go before it)"
                )
            parts = [{"type": "image_url", "image_url": {"url": p}} for p in paths]
            index = r.messages.index(turn)
            r.messages = [*r.messages[:index], {**turn, "content": [*parts, {"type": "text", "text": turn["content"]}]},
                          *r.messages[index + 1:]]
            continue
        prompt = dict(r.prompt) if isinstance(r.prompt, dict) else {"prompt": r.prompt}
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            found = sum(t == token_id for t in ids) if isinstance(ids, list) else 0
            if found != count:
                raise ValueError(
                    f"{r.where}: prompt_token_ids hold {found} image token(s) (id {token_id}) for {count} "
                    f"image(s) in images: give one image token per image"
                )
        else:
            if token_text is None:
                raise ValueError(f"{r.where}: images with a text prompt need the model's tokenizer to name the image "
                                 f"token (id {token_id}); model {model!r} has none: give prompt_token_ids")
            found = prompt["prompt"].count(token_text)
            if found == 0:
                prompt["prompt"] = f"{token_text}\n" * count + prompt["prompt"]
            elif found != count:
                raise ValueError(
                    f"{r.where}: the prompt has {found} image token(s) {token_text!r} for {count} image(s) in "
                    f"images: give one per image (or none: then they go at the start)"
                )
        prompt["multi_modal_data"] = {"image": paths}
        r.prompt = prompt


def check_requests_against_model(
    cfg: GenerateAppConfig, requests: list[GenerateRequest], resolved: ResolvedConfig
) -> None:
    """What needs the model's config and tokenizer but not its engine (only when there are
    images): :func:`attach_images`.  ``resolved``: the run's resolved configuration."""
    if not any(r.images for r in requests):
        return
    from pprun.engine.inputs import load_tokenizer

    tokenizer = load_tokenizer(str(resolved.tokenizer_dir)) if resolved.arch.multimodal is not None else None
    attach_images(requests, resolved.arch, tokenizer, cfg.model.model)


def run_requests(llm: Any, requests: list[GenerateRequest], use_tqdm: bool) -> list[Any]:
    """Generate every request in one ``LLM.generate`` call (chats rendered with the chat template
    first), so that every prompt is checked before any runs; outputs in request order."""
    prompts = []
    for r in requests:
        if r.messages is None:
            prompts.append(r.prompt)
            continue
        try:
            prompts.extend(llm.chat_prompts([r.messages]))
        except ValueError as e:
            raise ValueError(f"{r.where}: {e}") from None
    try:
        return llm.generate(prompts, [r.sampling for r in requests], use_tqdm=use_tqdm)
    except ValueError as e:
        # LLM.generate names the request by its index here; name where it came from too.
        m = re.match(r"(prompts|sampling_params)\[(\d+)\]", str(e))
        if m is None or requests[int(m.group(2))].where == m.group(0):
            raise
        raise ValueError(f"{requests[int(m.group(2))].where}: {e}") from None


def result_record(index: int, request: GenerateRequest, output: Any) -> dict[str, Any]:
    """One output line: the prompt, the completion and the request's metrics."""
    completion = output.outputs[0]
    m = output.metrics
    record: dict[str, Any] = {"index": index}
    if request.request_id is not None:
        record["id"] = request.request_id
    if request.messages is not None:
        record["messages"] = request.messages
    if request.images:
        record["images"] = request.images
    record.update(
        prompt=output.prompt,
        text=completion.text,
        token_ids=list(completion.token_ids),
        finish_reason=completion.finish_reason,
        metrics={
            "num_prompt_tokens": len(output.prompt_token_ids),
            "num_output_tokens": len(completion.token_ids),
            "time_to_first_token_s": m.time_to_first_token,
            "time_per_output_token_s": m.time_per_output_token,
            "latency_s": None if m.finished_time is None else m.finished_time - m.arrival_time,
        },
    )
    if output.error:
        record["error"] = output.error
    return record


def print_record(record: dict[str, Any], request: GenerateRequest, stream: TextIO) -> None:
    """A result as a few readable lines."""
    if request.messages is not None:
        shown = request.messages[-1].get("content", "")
        if isinstance(shown, list):  # content parts: show the text ones
            shown = " ".join(str(p.get("text", "")) for p in shown if isinstance(p, dict) and p.get("type") == "text")
    elif record["prompt"] is not None:
        shown = record["prompt"]
    else:
        shown = f"token ids {request.prompt['prompt_token_ids']}"
    if request.images:
        shown += f"  [images: {', '.join(request.images)}]"
    print(f"=== [{record['index']}] {shown}", file=stream)
    # A model without a tokenizer returns no text; show the ids instead.
    print(record["text"] if record["text"] else f"token ids {record['token_ids']}", file=stream)
    m = record["metrics"]
    print(
        f"--- {m['num_prompt_tokens']} prompt + {m['num_output_tokens']} output tokens, "
        f"finish_reason={record['finish_reason']}",
        file=stream,
    )


def summarize(outputs: list[Any], elapsed_s: float, facts: dict[str, Any]) -> dict[str, Any]:
    """The run's totals and the engine's configuration facts."""
    num_prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    num_output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "num_requests": len(outputs),
        "num_prompt_tokens": num_prompt_tokens,
        "num_output_tokens": num_output_tokens,
        "elapsed_s": elapsed_s,
        "output_tokens_per_s": num_output_tokens / elapsed_s if elapsed_s > 0 else None,
        "runner": facts.get("runner"),
        "executor": facts.get("executor"),
        "pipeline_parallel_size": facts.get("pipeline_parallel_size"),
        "layer_partition": facts.get("layer_partition"),
        "device": facts.get("device"),
        "dtype": facts.get("dtype"),
    }


def format_summary(summary: dict[str, Any]) -> str:
    """The closing summary as aligned ``key: value`` lines."""
    tps = summary["output_tokens_per_s"]
    rows = [
        ("requests", summary["num_requests"]),
        ("prompt tokens", summary["num_prompt_tokens"]),
        ("output tokens", summary["num_output_tokens"]),
        ("elapsed", f"{summary['elapsed_s']:.2f} s"),
        ("output tokens/s", "n/a" if tps is None else f"{tps:.1f}"),
        ("runner", summary["runner"]),
        ("executor", summary["executor"]),
        (
            "stages",
            f"{summary['pipeline_parallel_size']} (decoder layers per stage: {summary['layer_partition']})",
        ),
        ("device", f"{summary['device']} ({summary['dtype']})"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(["=== summary"] + [f"{k + ':':<{width + 1}} {v}" for k, v in rows])


def run(cfg: GenerateAppConfig, stream: TextIO | None = None) -> dict[str, Any]:
    """Generate for every request of ``cfg``, write or print the results and the summary; return
    the summary."""
    from pprun.engine.llm import LLM
    from pprun.engine.resolve import resolve_config

    stream = sys.stdout if stream is None else stream
    # Before the engine starts: bad input fails fast.
    requests = collect_requests(cfg)
    resolved = resolve_config(cfg.pprun_config())  # once: the checks below and the engine take it
    check_requests_against_model(cfg, requests, resolved)
    output_file = job_output_path(cfg.output_file)
    use_tqdm = cfg.progress and (len(requests) > PROGRESS_MIN_PROMPTS or sys.stderr.isatty())
    with LLM(config=resolved) as llm:
        start = time.perf_counter()
        outputs = run_requests(llm, requests, use_tqdm)
        elapsed_s = time.perf_counter() - start
        facts = llm.describe()
    records = [result_record(i, r, o) for i, (r, o) in enumerate(zip(requests, outputs))]
    if output_file is not None:
        output_file.parent.mkdir(parents=True, exist_ok=True)
        with open(output_file, "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        print(f"wrote {len(records)} results to {output_file}", file=stream)
    else:
        for record, request in zip(records, requests):
            print_record(record, request, stream)
    summary = summarize(outputs, elapsed_s, facts)
    print(format_summary(summary), file=stream, flush=True)
    return summary


def main() -> None:
    """Entry point of ``pprun generate``: ``sys.argv[1:]`` are Hydra overrides."""
    from pprun.apps import run_hydra_app

    run_hydra_app("generate", run)


if __name__ == "__main__":
    main()
