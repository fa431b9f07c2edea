"""LlavaForConditionalGeneration (CLIP and SigLIP towers) end to end: greedy tokens equal
transformers' ``generate`` on the checkpoint's own processor's inputs, for prompts with 0, 1 and 3
images in one batch, over pp = 1, 2, 3 (uni, mp, ray), both runners and chunked prefill; the
encoder runs once per distinct image and its cache entries go when their requests end; bad input
is refused before any work starts; ``LLM.chat`` takes OpenAI-style image parts."""

from __future__ import annotations

import base64
import io
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import fork_mp_stages
from PIL import Image
from tiny_models import make_tiny_llava

from pprun import LLM, SamplingParams
from pprun.multimodal import mask as mm_mask

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
SMALL_KV = 1 << 22
"""KV-cache bytes per stage: plenty for these prompts, and quick to allocate."""


def _image(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


IMAGES = [_image(37, 45, 0), _image(30, 30, 1), _image(51, 33, 2), _image(40, 40, 3)]
"""Odd sizes, so the processor resizes and crops differently each time."""

PROMPTS = [
    ("USER: describe a red cat ? ASSISTANT:", []),
    ("USER: <image>\nwhat is this ? ASSISTANT:", [0]),
    ("USER: <image> and <image> , then <image>\ncompare them . ASSISTANT:", [1, 2, 1]),
]
"""One batch: no image, one image, three images of which the first and last are the same."""


def pprun_prompts(prompts=PROMPTS) -> list:
    return [{"prompt": text, "multi_modal_data": {"image": [IMAGES[i] for i in imgs]}} if imgs else text
            for text, imgs in prompts]


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return make_tiny_llava(tmp_path_factory.mktemp("llava-clip"), "clip")


@pytest.fixture(scope="module")
def siglip_dir(tmp_path_factory):
    return make_tiny_llava(tmp_path_factory.mktemp("llava-siglip"), "siglip", num_layers=3)


_HF_CACHE: dict[tuple, list[list[int]]] = {}


def hf_tokens(model_dir, prompts=PROMPTS, max_new_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """transformers' greedy continuation of each prompt alone, inputs from the checkpoint's processor."""
    key = (str(model_dir), tuple((t, tuple(i)) for t, i in prompts), max_new_tokens)
    if key not in _HF_CACHE:
        from transformers import AutoProcessor, LlavaForConditionalGeneration

        # pprun processes images with transformers' PIL processors; so does the reference, also
        # where torchvision is installed (its resize differs in the last bits).
        processor = AutoProcessor.from_pretrained(model_dir, backend="pil")
        model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
        out = []
        for text, imgs in prompts:
            inputs = processor(text=text, images=[IMAGES[i] for i in imgs] or None, return_tensors="pt")
            with torch.no_grad():
                ids = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=3)
            out.append(ids[0, inputs["input_ids"].shape[1]:].tolist())
        _HF_CACHE[key] = out
    return _HF_CACHE[key]


def generate(model_dir, prompts=PROMPTS, **kwargs) -> list[list[int]]:
    kwargs.setdefault("kv_cache_memory_bytes", SMALL_KV)
    with LLM(str(model_dir), dtype="float32", max_model_len=256, **kwargs) as llm:
        if "runner" in kwargs:
            assert llm.describe()["runner"] == kwargs["runner"]
        outs = llm.generate(pprun_prompts(prompts), GREEDY)
    return [o.outputs[0].token_ids for o in outs]


def test_reference_depends_on_the_images(clip_dir, siglip_dir):
    """The parity below can fail: a different image changes transformers' tokens."""
    for model_dir in (clip_dir, siglip_dir):
        swapped = [(text, [3] * len(imgs)) for text, imgs in PROMPTS]
        want, other = hf_tokens(model_dir), hf_tokens(model_dir, swapped)
        assert want[0] == other[0]  # no image
        assert want[1] != other[1] and want[2] != other[2]


# (pp, executor, runner, max_num_batched_tokens): every (pp, executor, runner) for CLIP, a few
# for SigLIP; a 16-token budget cuts image ranges (25 and 49 positions) across steps.
CLIP_CASES = [
    (1, "uni", "v1", None), (1, "uni", "v2", 16),
    (2, "mp", "v1", 16), (2, "mp", "v2", None), (3, "mp", "v1", None), (3, "mp", "v2", 16),
    (2, "ray", "v1", None), (2, "ray", "v2", None), (3, "ray", "v1", 16), (3, "ray", "v2", None),
]
SIGLIP_CASES = [(1, "uni", "v2", None), (3, "mp", "v1", 16), (2, "ray", "v2", 16)]
FRESH_MP_CASE = (2, "mp", "v1", 16)
"""The one ``mp`` case whose stages start as fresh interpreters; the others fork theirs from the
warm template (``conftest.fork_mp_stages``): what they check is the stages' tokens."""


def _case_id(case) -> str:
    pp, executor, runner, budget = case
    return f"pp{pp}-{executor}-{runner}" + (f"-chunk{budget}" if budget else "")


def _run_case(model_dir, case, request) -> list[list[int]]:
    pp, executor, runner, budget = case
    if executor == "ray":
        request.getfixturevalue("ray_cluster")
    if executor == "mp" and case != FRESH_MP_CASE:
        fork_mp_stages(request)
    kwargs = {"max_num_batched_tokens": budget} if budget else {}
    return generate(model_dir, pipeline_parallel_size=pp, executor=executor, runner=runner, **kwargs)


@pytest.mark.parametrize("case", CLIP_CASES, ids=_case_id)
def test_clip_greedy_matches_transformers(clip_dir, case, request):
    assert _run_case(clip_dir, case, request) == hf_tokens(clip_dir)


@pytest.mark.parametrize("case", SIGLIP_CASES, ids=_case_id)
def test_siglip_greedy_matches_transformers(siglip_dir, case, request):
    assert _run_case(siglip_dir, case, request) == hf_tokens(siglip_dir)


# --- chunked prefill and the encoder budget, watched from inside the only stage ----------------


def _stage_mm(llm):
    """The only stage's :class:`MultiModalRunnerState` (V1: the runner's; V2: its plug-in's)."""
    runner = llm.engine.executor.worker.runner
    return runner.mm if runner.name == "v1" else runner.model_state.mm


def _count_encodes(mm) -> list[int]:
    """Record the rows each encoder call computes (the list is filled as the engine runs)."""
    calls: list[int] = []
    encode = mm.model.encode_items

    def counting(items):
        calls.append(sum(item.num_embeds for item in items))
        return encode(items)

    mm.model.encode_items = counting
    return calls


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_chunks_cut_image_ranges_and_the_encoder_budget_holds(clip_dir, runner, monkeypatch):
    """A 16-token step budget cuts every image's 25-position range over steps, and an encoder
    budget of 25 rows lets one image be encoded per step: the prompt with two distinct images is
    cut before the second until a later step.  Tokens stay transformers'."""
    plans = []
    build = mm_mask.build_scatter_plan

    def recording(num_tokens, windows, ranges):
        plan = build(num_tokens, windows, ranges)
        plans.append((plan, [list(r) for r in ranges]))
        return plan

    monkeypatch.setattr("pprun.worker.multimodal.build_scatter_plan", recording)
    with LLM(str(clip_dir), dtype="float32", max_model_len=256, runner=runner, executor="uni",
             max_num_batched_tokens=16, max_num_encoder_tokens=25, kv_cache_memory_bytes=SMALL_KV) as llm:
        calls = _count_encodes(_stage_mm(llm))
        outs = llm.generate(pprun_prompts(), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_tokens(clip_dir)
    assert calls == [25, 25, 25]  # three distinct images, one a step (the repeated one is cached)
    # Some step scattered only part of an item's rows (a window cut its range).
    partial = False
    for plan, ranges in plans:
        assert plan.num_rows == int(plan.is_mm_embed.sum())
        for key, (req, item) in enumerate(plan.items):
            rows = plan.row_embed[plan.row_item == key]
            partial |= 0 < len(rows) < ranges[req][item].num_embeds
    assert partial



@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_preempted_requests_keep_their_encoder_outputs(clip_dir, runner):
    """A KV cache of 19 blocks for ten image prompts preempts (recompute) again and again; a
    preempted request resumes from the cached encoder outputs: three distinct images, three
    encodings.  Tokens stay transformers'.  Prefix caching is off: the repeated prompts would
    share their blocks and need too few to preempt."""
    prompts = PROMPTS * 3 + [PROMPTS[1]]
    params = SamplingParams(temperature=0.0, max_tokens=10)
    with LLM(str(clip_dir), dtype="float32", max_model_len=256, runner=runner, executor="uni",
             max_num_batched_tokens=32, kv_cache_memory_bytes=19 * 8192, enable_prefix_caching=False) as llm:
        assert llm.engine.num_blocks == 19
        calls = _count_encodes(_stage_mm(llm))
        outs = llm.generate(pprun_prompts(prompts), params)
        assert llm.engine.num_preemptions > 0
    assert sum(calls) == 3 * 25
    assert [o.outputs[0].token_ids for o in outs] == hf_tokens(clip_dir, prompts, 10)


# --- the encoder cache -------------------------------------------------------------------------


def _queue(llm, prompt: dict, max_tokens: int) -> tuple[str, list[str]]:
    """Queue one request in the engine; returns its id and its items' content hashes."""
    engine = llm.engine
    checked = engine.inputs.process_prompt(prompt, "prompt")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    req_id = engine.add_request(checked.token_ids, params, prompt=checked.text, mm_items=checked.mm_items)
    return req_id, [item.content_hash for item in checked.mm_items]


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_encoder_runs_once_per_distinct_image_and_entries_go_with_their_requests(clip_dir, runner):
    twice = {"prompt": "USER: <image> and <image>\nsame ? ASSISTANT:", "multi_modal_data": {"image": [IMAGES[0]] * 2}}
    again = {"prompt": "USER: <image> , <image>\ncompare ASSISTANT:", "multi_modal_data": {"image": [IMAGES[1], IMAGES[0]]}}
    with LLM(str(clip_dir), dtype="float32", max_model_len=256, runner=runner, executor="uni",
             kv_cache_memory_bytes=SMALL_KV) as llm:
        engine, mm = llm.engine, _stage_mm(llm)
        calls = _count_encodes(mm)
        sched_cache = engine.scheduler.encoder_cache
        first, (hash0, _) = _queue(llm, twice, 12)
        while not engine.tracked[first].req.output_token_ids:
            engine.step()
        assert (mm.num_items_encoded, calls) == (1, [25])  # the same image twice: one encoding
        assert sched_cache.num_encoded == len(mm.encoder_cache) == 1
        # A later request while the first still runs: its image 0 is cached, image 1 is new.
        second, (hash1, also0) = _queue(llm, again, 3)
        assert also0 == hash0 != hash1
        finished = {}
        while first not in finished:
            finished.update((o.request_id, o) for o in engine.step())
            if second in finished and first not in finished:
                # The short request ended while the first runs: image 1's entry went on both sides
                # (the first stage drops it with the next step), image 0's stays.
                assert sched_cache.num_encoded == sched_cache.num_held == 1 and sched_cache.is_encoded(hash0)
        assert set(finished) == {first, second} and not engine.has_unfinished_requests()
        assert (mm.num_items_encoded, calls) == (2, [25, 25])
        assert set(mm.encoder_cache) == {hash0}
        # Both requests ended: the scheduler holds nothing; the first stage drops the request and
        # its entry with the next step it runs (finished ids and frees ride on a step).
        assert (sched_cache.num_encoded, sched_cache.num_held) == (0, 0)
        text_only = llm.generate(pprun_prompts(PROMPTS[:1]), GREEDY)
        assert mm.encoder_cache == {} and mm.items == {}
        assert text_only[0].outputs[0].token_ids == hf_tokens(clip_dir)[0]
        # Image 0 once more, after its entry was freed: encoded again.
        out = llm.generate(pprun_prompts(PROMPTS[1:2]), GREEDY)
        assert mm.num_items_encoded == 3
        assert out[0].outputs[0].token_ids == hf_tokens(clip_dir)[1]
    want_first, want_second = hf_tokens(clip_dir, [("USER: <image> and <image>\nsame ? ASSISTANT:", [0, 0]),
                                                   ("USER: <image> , <image>\ncompare ASSISTANT:", [1, 0])], 12)
    assert finished[first].outputs[0].token_ids == want_first
    assert finished[second].outputs[0].token_ids == want_second[:3]


# --- contracts 1 and 2 with a real vision-language model ---------------------------------------


SEEN: list[dict] = []


def _recording_llava():
    from pprun.models.llava import LlavaForConditionalGeneration

    class RecordingLlava(LlavaForConditionalGeneration):
        """Records what each stage's forward gets."""

        def forward(self, input_ids, positions, inputs_embeds, intermediate_tensors, attn_metadata):
            SEEN.append({
                "rank": self.layout.pp_rank, "input_ids": input_ids, "it": intermediate_tensors,
                "inputs_embeds": None if inputs_embeds is None else inputs_embeds.clone(),
            })
            return super().forward(input_ids, positions, inputs_embeds, intermediate_tensors, attn_metadata)

    return RecordingLlava


def _hf_inputs_embeds(model_dir, prompts) -> list[torch.Tensor]:
    """The ``inputs_embeds`` transformers' Llava hands its language model for each prompt (token
    embeddings with the image features scattered in)."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(model_dir, backend="pil")
    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    seen = []
    hook = model.model.language_model.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append(kwargs["inputs_embeds"][0].clone()), with_kwargs=True
    )
    try:
        for text, imgs in prompts:
            inputs = processor(text=text, images=[IMAGES[i] for i in imgs] or None, return_tensors="pt")
            with torch.no_grad():
                model(**inputs)
    finally:
        hook.remove()
    return seen


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_stage_inputs_of_a_real_llava(clip_dir, runner, monkeypatch):
    """Contracts 1 and 2 on a real tiny Llava split in two stages (both real ``Worker``s in this
    process, driven by the real scheduler; only the wire is fake): the first stage's forward gets
    ``input_ids=None`` and ``inputs_embeds`` equal to transformers' (token embeddings with every
    image's rows scattered in), the second ``input_ids=None``, ``inputs_embeds=None`` and the
    received tensors; the tokens are transformers'."""
    import torch.distributed as dist

    from pprun.config.config import PprunConfig
    from pprun.config.validate import validate_config
    from pprun.core.request import Request
    from pprun.core.scheduler import Scheduler
    from pprun.distributed.intermediate import IntermediateTensors
    from pprun.distributed.layout import StageLayout
    from pprun.distributed.transport import PipelineTransport
    from pprun.engine.llm_engine import load_tokenizer
    from pprun.multimodal.processing import ImageProcessor
    from pprun.worker import model_loader
    from pprun.worker.worker import Worker, WorkerSpec

    wire: list[torch.Tensor] = []
    monkeypatch.setattr(dist, "send", lambda t, dst, group=None: wire.append(t.clone()))
    monkeypatch.setattr(dist, "recv", lambda t, src, group=None: t.copy_(wire.pop(0).view(t.dtype).reshape(t.shape)))
    monkeypatch.setitem(model_loader.MODEL_CLASSES, "LlavaForConditionalGeneration", _recording_llava())
    rc = validate_config(PprunConfig.from_kwargs(
        model=str(clip_dir), device="cpu", dtype="float32", pipeline_parallel_size=2, executor="mp",
        max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256,
    ))
    workers = []
    for rank in range(2):
        layout = StageLayout.from_partition(rc.layer_partition, rank)
        worker = Worker(WorkerSpec(rc, layout, runner), transport=PipelineTransport(layout, torch.device("cpu"), None, None, [0, 1]))
        worker.load_model()
        worker.init_cache(64)
        workers.append(worker)
    assert workers[1].runner.model.vision_tower is None  # later stages never build the tower

    # Prompts processed as the engine does: its tokenizer, then the image processor.
    tokenizer = load_tokenizer(str(clip_dir))
    images = ImageProcessor(clip_dir, rc.arch.multimodal, tokenizer)
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256,
                          block_size=rc.cfg.cache.block_size, num_blocks=64)
    reqs = []
    for i, (text, imgs) in enumerate(PROMPTS):
        ids, items = images.process(tokenizer.encode(text), [IMAGES[k] for k in imgs], f"prompts[{i}]")
        reqs.append(Request(f"r{i}", ids, GREEDY, eos_token_ids={2}, mm_items=items))
        scheduler.add_request(reqs[-1])
    SEEN.clear()
    while scheduler.has_unfinished_requests():
        so = scheduler.schedule()
        assert workers[0].execute_model(so) is None  # sent down the pipeline
        out = workers[1].execute_model(so.without_payload())
        scheduler.update_from_output(so, out)
    assert not wire
    assert [r.output_token_ids for r in reqs] == hf_tokens(clip_dir)

    first = [s for s in SEEN if s["rank"] == 0]
    second = [s for s in SEEN if s["rank"] == 1]
    assert len(first) == len(second) == MAX_TOKENS
    for step, s in enumerate(first):
        assert s["input_ids"] is None and s["inputs_embeds"] is not None and s["it"] is None, step
    for step, s in enumerate(second):
        assert s["input_ids"] is None and s["inputs_embeds"] is None, step
        assert isinstance(s["it"], IntermediateTensors), step
    # The prefill step holds every prompt whole, in order: its rows are transformers' embeddings.
    want = _hf_inputs_embeds(clip_dir, PROMPTS)
    assert first[0]["inputs_embeds"].shape[0] == sum(w.shape[0] for w in want)
    for got, expected in zip(first[0]["inputs_embeds"].split([w.shape[0] for w in want]), want):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# --- bad input ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def clip_llm(clip_dir):
    """One engine (uni, V2) for the bad-input and chat tests."""
    with LLM(str(clip_dir), dtype="float32", max_model_len=256, executor="uni", kv_cache_memory_bytes=SMALL_KV) as llm:
        yield llm


@pytest.fixture(scope="module")
def text_llm(tiny_llama_dir):
    with LLM(str(tiny_llama_dir), dtype="float32", executor="uni", kv_cache_memory_bytes=SMALL_KV) as llm:
        yield llm


@pytest.fixture(scope="module")
def small_encoder_llm(clip_dir):
    """A CLIP image takes 25 encoder rows; this engine's steps compute at most 24."""
    with LLM(str(clip_dir), dtype="float32", max_model_len=256, executor="uni", max_num_encoder_tokens=24,
             kv_cache_memory_bytes=SMALL_KV) as llm:
        yield llm


ONE = "USER: <image>\nwhat is this ? ASSISTANT:"


def _files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bad-images")
    (folder / "notes.png").write_text("not an image at all")
    return folder


def _shown(path: Path) -> str:
    """A path as an error names it: whole up to 60 characters, else its first 57 and ``...``
    (a pytest-xdist worker's tmp folders are long enough for that)."""
    return str(path) if len(str(path)) <= 60 else str(path)[:57] + "..."


# (id, engine, bad prompt made in a folder of files, the error's pattern or one made from that folder)
BAD = [
    ("more-tokens", "clip_llm", lambda d: {"prompt": "USER: <image> <image> what", "multi_modal_data": {"image": [IMAGES[0]]}},
     r"prompts\[1\]\.multi_modal_data\['image'\] has 1 image\(s\) but the prompt has 2 image token\(s\) \(id 4\)"),
    ("more-images", "clip_llm", lambda d: {"prompt": ONE, "multi_modal_data": {"image": IMAGES[:3]}},
     r"prompts\[1\]\.multi_modal_data\['image'\] has 3 image\(s\) but the prompt has 1 image token\(s\)"),
    ("tokens-without-data", "clip_llm", lambda d: ONE,
     r"prompts\[1\]: the prompt has 1 image token\(s\) \(id 4\) but no multi_modal_data"),
    ("token-ids-without-data", "clip_llm", lambda d: {"prompt_token_ids": [1, 5, 4, 4, 6]},
     r"prompts\[1\]: the prompt has 2 image token\(s\) \(id 4\) but no multi_modal_data"),
    ("missing-file", "clip_llm", lambda d: {"prompt": ONE, "multi_modal_data": {"image": [str(d / "nope.png")]}},
     r"prompts\[1\]\.multi_modal_data\['image'\]\[0\]='.*nope\.png' is not a file"),
    ("not-an-image", "clip_llm", lambda d: {"prompt": ONE, "multi_modal_data": {"image": [d / "notes.png"]}},
     lambda d: rf"prompts\[1\]\.multi_modal_data\['image'\]\[0\]={re.escape(repr(_shown(d / 'notes.png')))} is not "
               r"a readable image: not an image format"),
    ("bad-data-url", "clip_llm", lambda d: {"prompt": ONE, "multi_modal_data": {"image": ["data:image/png;base64,AAAA"]}},
     r"prompts\[1\]\.multi_modal_data\['image'\]\[0\]='data:image/png;base64,AAAA' is not a readable image"),
    ("zero-size-array", "clip_llm", lambda d: {"prompt": ONE, "multi_modal_data": {"image": [np.zeros((0, 7, 3), np.uint8)]}},
     r"prompts\[1\]\.multi_modal_data\['image'\]\[0\] is an image of zero size \(shape \(0, 7, 3\)\)"),
    ("zero-size-pil", "clip_llm", lambda d: {"prompt": ONE, "multi_modal_data": {"image": [Image.new("RGB", (0, 5))]}},
     r"prompts\[1\]\.multi_modal_data\['image'\]\[0\] is an image of zero size \(0x5\)"),
    ("text-only-model", "text_llm", lambda d: {"prompt_token_ids": [5, 6], "multi_modal_data": {"image": [IMAGES[0]]}},
     r"prompts\[1\]\.multi_modal_data: model .* \(LlamaForCausalLM\) is text-only"),
    ("too-long-expanded", "clip_llm", lambda d: {"prompt": "USER:" + " <image>" * 11, "multi_modal_data": {"image": [IMAGES[0]] * 11}},
     r"prompts\[1\]: prompt has 278 tokens after its images were expanded.*max_model_len=256 a prompt may have at most 255"),
    ("unknown-modality", "clip_llm", lambda d: {"prompt": ONE, "multi_modal_data": {"image": [IMAGES[0]], "video": [IMAGES[1]]}},
     r"prompts\[1\]\.multi_modal_data has unknown modality key\(s\) \['video'\]: this model takes \['image'\]"),
    ("over-encoder-budget", "small_encoder_llm", lambda d: {"prompt": ONE, "multi_modal_data": {"image": [IMAGES[0]]}},
     r"prompts\[1\]\.multi_modal_data\['image'\]\[0\] takes 25 encoder output rows: must be at most "
     r"scheduler\.max_num_encoder_tokens=24"),
]


@pytest.mark.parametrize(("engine", "make", "message"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_refused_before_any_work(engine, make, message, request, tmp_path_factory):
    """Each bad prompt fails the whole call with a ValueError naming the entry and the field;
    nothing of the call is queued (the valid prompt before it neither), and the engine serves
    the valid prompt afterwards."""
    llm = request.getfixturevalue(engine)
    valid = {"clip_llm": pprun_prompts(PROMPTS[1:2])[0], "small_encoder_llm": PROMPTS[0][0],
             "text_llm": {"prompt_token_ids": [5, 6, 7]}}[engine]
    files = _files(tmp_path_factory)
    with pytest.raises(ValueError, match=message(files) if callable(message) else message):
        llm.generate([valid, make(files)], GREEDY)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([valid], GREEDY)[0]
    assert len(out.outputs[0].token_ids) == MAX_TOKENS
    if engine != "text_llm":
        want = hf_tokens(request.getfixturevalue("clip_dir"))
        assert out.outputs[0].token_ids == want[1 if engine == "clip_llm" else 0]


def test_encoder_budget_is_a_validated_config_field(clip_dir):
    for bad in (0, -3, 2.5, "many"):
        with pytest.raises(ValueError, match=rf"scheduler\.max_num_encoder_tokens={bad!r} is not allowed; it must be an integer >= 1"):
            LLM(str(clip_dir), dtype="float32", max_num_encoder_tokens=bad)
    from pprun.config.config import PprunConfig

    cfg = PprunConfig.from_kwargs(model=str(clip_dir), scheduler={"max_num_encoder_tokens": 64})
    assert cfg.scheduler.max_num_encoder_tokens == 64


# --- LLM.chat with OpenAI-style content parts ---------------------------------------------------


def test_chat_image_parts_equal_the_same_prompt_through_generate(clip_llm, clip_dir, tmp_path):
    buf = io.BytesIO()
    IMAGES[0].save(buf, format="PNG")  # lossless: the same pixels as the PIL image
    data_url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    path = tmp_path / "image0.png"
    IMAGES[0].save(path)

    def conversation(url):
        return [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "\nwhat is this ?"},
        ]}]

    text = "USER: <image>\nwhat is this ?\nASSISTANT:"  # what the chat template renders
    want = clip_llm.generate([{"prompt": text, "multi_modal_data": {"image": [IMAGES[0]]}}], GREEDY)
    outs = clip_llm.chat([conversation(data_url), conversation(str(path)), conversation(f"file://{path}")], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [want[0].outputs[0].token_ids] * 3
    assert want[0].outputs[0].token_ids == hf_tokens(clip_dir, [(text, [0])])[0]
    with pytest.raises(ValueError, match=r"messages\[0\]\[0\]\.content\[0\]\.image_url='http.*remote URLs are not fetched"):
        clip_llm.chat(conversation("http://example.com/cat.png"), GREEDY)


# --- CUDA graphs -------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(("mode", "budget"), [("none", None), ("piecewise", 16), ("full", None), ("full", 16)])
def test_image_steps_under_each_compilation_mode_gpu(clip_dir, mode, budget):
    """On CUDA (V2, fp32, Triton attention): image steps run eagerly (full: prefill is never a
    full graph) or as piecewise graphs over the persistent embeddings buffer; decode steps replay
    the full graphs captured over it.  Tokens equal transformers' (on CPU) in every mode, and
    which plans ran is checked."""
    kwargs = {"max_num_batched_tokens": budget} if budget else {}
    with LLM(str(clip_dir), dtype="float32", device="cuda", runner="v2", executor="uni", max_model_len=256,
             cudagraph_mode=mode, cudagraph_capture_sizes=[1, 2, 4, 8, 16], kv_cache_memory_bytes=SMALL_KV,
             **kwargs) as llm:
        runner = llm.engine.executor.worker.runner
        assert runner.cudagraph_mode == mode
        plans = []
        original = runner.graphs.plan

        def recording(num_reqs, num_tokens, max_query_len):
            plan = original(num_reqs, num_tokens, max_query_len)
            plans.append((plan.mode, max_query_len))
            return plan

        runner.graphs.plan = recording
        outs = llm.generate(pprun_prompts(), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_tokens(clip_dir)
    prefill = {m for m, q in plans if q > 1}
    decode = {m for m, q in plans if q == 1}
    assert prefill == ({"piecewise"} if mode == "piecewise" else {"eager"}), plans
    assert mode == "none" or mode in decode, plans
