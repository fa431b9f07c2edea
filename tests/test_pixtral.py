"""Pixtral-form Llava against transformers: the vision tower, the processor's placeholder
expansion and ``is_embed`` masks, and greedy tokens for prompts with 0, 1 and 2 images of
different sizes (so the patch grids differ), pp=1 and pp=2, V1 and V2, and with chunked prefill
cutting the image ranges."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import fork_mp_stages
from tiny_pixtral import load_pixtral_processor, make_tiny_pixtral

MAX_TOKENS = 16

PROMPTS = (
    ("USER : what is this ?", ()),
    ("USER : [IMG] what is this ?", (0,)),
    ("USER : [IMG] compare [IMG] them", (1, 0)),
)
"""(text, indices into :func:`images`) per prompt: 0, 1 and 2 images."""


@pytest.fixture(scope="module")
def pixtral_dir(tmp_path_factory):
    """The tiny Pixtral-form Llava (seed 2: its greedy choices win by a wide margin)."""
    return make_tiny_pixtral(tmp_path_factory.mktemp("tiny_pixtral"), seed=2)


@pytest.fixture(scope="module")
def images():
    """A 23x37 and a 60x18 image: 5x8 and 8x3 patches after processing."""
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((23, 37), (60, 18))]


@pytest.fixture(scope="module")
def hf_model(pixtral_dir):
    """transformers' model for the checkpoint (the parity reference)."""
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(pixtral_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_processor(pixtral_dir):
    """transformers' ``PixtralProcessor`` for the checkpoint."""
    return load_pixtral_processor(pixtral_dir)


def _hf_inputs(processor, text: str, imgs: list[np.ndarray]):
    from PIL import Image

    return processor(text=text, images=[Image.fromarray(i) for i in imgs] or None, return_tensors="pt")


@pytest.fixture(scope="module")
def hf_tokens(hf_model, hf_processor, images):
    """transformers' greedy tokens for each of :data:`PROMPTS` (one prompt per generate call)."""
    out = []
    for text, which in PROMPTS:
        inputs = _hf_inputs(hf_processor, text, [images[i] for i in which])
        with torch.no_grad():
            seq = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=3)
        out.append(seq[0, inputs["input_ids"].shape[1]:].tolist())
    return out


def _image_processor(pixtral_dir):
    from transformers import AutoTokenizer

    from pprun.models.hf_config import load_arch_config
    from pprun.multimodal.processing import ImageProcessor

    tokenizer = AutoTokenizer.from_pretrained(pixtral_dir)
    return ImageProcessor(pixtral_dir, load_arch_config(pixtral_dir).multimodal, tokenizer), tokenizer


# --- processing ------------------------------------------------------------------------------


def test_expansion_and_pixels_match_pixtral_processor(pixtral_dir, hf_processor, images):
    proc, tokenizer = _image_processor(pixtral_dir)
    for text, which in PROMPTS[1:]:
        imgs = [images[i] for i in which]
        ref = _hf_inputs(hf_processor, text, imgs)
        ids, items = proc.process(tokenizer.encode(text), imgs, "prompt")
        assert ids == ref["input_ids"][0].tolist()
        for item, size, pixels in zip(items, ref["image_sizes"], ref["pixel_values"], strict=True):
            h, w = size.tolist()
            assert item.data["image_sizes"].tolist() == [h, w]
            torch.testing.assert_close(item.data["pixel_values"], pixels[:, :h, :w], rtol=0, atol=0)


def test_placeholder_is_embed_false_exactly_at_break_and_end(pixtral_dir, hf_model, hf_processor, images):
    proc, tokenizer = _image_processor(pixtral_dir)
    img_id, break_id, end_id = tokenizer.convert_tokens_to_ids(["[IMG]", "[IMG_BREAK]", "[IMG_END]"])
    text, which = PROMPTS[2]
    imgs = [images[i] for i in which]
    ids, items = proc.process(tokenizer.encode(text), imgs, "prompt")
    ref = _hf_inputs(hf_processor, text, imgs)
    with torch.no_grad():
        tower_rows = [f.shape[0] for f in hf_model.model.get_image_features(
            ref["pixel_values"], image_sizes=ref["image_sizes"]).pooler_output]
    assert tower_rows == [8 * 3, 5 * 8]  # two different grids
    for item, rows in zip(items, tower_rows, strict=True):
        rng = item.placeholder
        span = ids[rng.offset:rng.end]
        assert span[-1] == end_id and set(span) == {img_id, break_id, end_id}
        assert list(rng.is_embed) == [t == img_id for t in span]  # False exactly at breaks and the end
        assert rng.num_embeds == sum(rng.is_embed) == rows
    # Outside the ranges no position is an image token.
    inside = {p for item in items for p in range(item.placeholder.offset, item.placeholder.end)}
    assert not {i for i, t in enumerate(ids) if t in (img_id, break_id, end_id)} - inside


def test_chunk_cutting_a_range_scatters_only_its_image_rows(pixtral_dir, images):
    from pprun.multimodal.mask import StepWindow, build_scatter_plan

    proc, tokenizer = _image_processor(pixtral_dir)
    ids, items = proc.process(tokenizer.encode(PROMPTS[2][0]), [images[1], images[0]], "prompt")
    ranges = [item.placeholder for item in items]
    chunk = 16
    taken = [[] for _ in items]
    for start in range(0, len(ids), chunk):
        num = min(chunk, len(ids) - start)
        plan = build_scatter_plan(num, [StepWindow(0, start, num)], [ranges])
        for pos in range(start, start + num):
            embeds = any(r.offset <= pos < r.end and r.is_embed[pos - r.offset] for r in ranges)
            assert bool(plan.is_mm_embed[pos - start]) == embeds
        for (_, k), row in zip((plan.items[i] for i in plan.row_item), plan.row_embed):
            taken[k].append(int(row))
    # Every image row is scattered once, in order, though chunks cut each range.
    assert all(r.offset % chunk and r.end % chunk for r in ranges)
    assert taken == [list(range(item.num_embeds)) for item in items]


# --- the tower -------------------------------------------------------------------------------


def test_tower_matches_transformers_and_keeps_images_apart(hf_model):
    from pprun.models.pixtral import PixtralVisionModel

    vcfg = hf_model.config.vision_config
    tower = PixtralVisionModel(vcfg.to_dict(), vcfg.num_hidden_layers)
    tower.load_state_dict(hf_model.model.vision_tower.state_dict())
    gen = torch.Generator().manual_seed(0)
    imgs = [torch.randn(3, 25, 40, generator=gen), torch.randn(3, 40, 15, generator=gen)]
    padded = torch.zeros(2, 3, 40, 40)
    padded[0, :, :25, :40], padded[1, :, :40, :15] = imgs
    with torch.no_grad():
        ref = hf_model.model.vision_tower(padded, image_sizes=torch.tensor([[25, 40], [40, 15]]),
                                          output_hidden_states=True).hidden_states
        got = tower(imgs)
        alone = tower(imgs[1:])
    assert len(got) == len(ref) == vcfg.num_hidden_layers + 1
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r[0], rtol=1e-5, atol=1e-5)
    # Block-diagonal attention: the second image's states do not depend on the first image.
    torch.testing.assert_close(alone[-1], got[-1][5 * 8:], rtol=1e-5, atol=1e-5)


# --- generation ------------------------------------------------------------------------------


def _generate(pixtral_dir, images, **config):
    from pprun import LLM, SamplingParams

    prompts = [{"prompt": text, "multi_modal_data": {"image": [images[i] for i in which]}} if which else text
               for text, which in PROMPTS]
    with LLM(str(pixtral_dir), dtype="float32", **config) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("executor,pp", [("uni", 1), pytest.param("mp", 2, marks=pytest.mark.slow)])
def test_greedy_matches_transformers(pixtral_dir, images, hf_tokens, executor, pp, runner, request):
    if executor == "mp" and runner == "v2":  # the v1 case's stages start fresh; these fork theirs
        fork_mp_stages(request)
    got = _generate(pixtral_dir, images, executor=executor, pipeline_parallel_size=pp, runner=runner)
    assert got == hf_tokens


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_greedy_matches_transformers_with_chunks_cutting_image_ranges(pixtral_dir, images, hf_tokens, runner):
    # 16-token steps cut both image ranges of the two-image prompt (offsets 3 and 36, 32 and
    # 45 tokens long): each step scatters only the [IMG] rows inside its window.
    got = _generate(pixtral_dir, images, executor="uni", runner=runner, max_num_batched_tokens=16)
    assert got == hf_tokens


# --- bad input -------------------------------------------------------------------------------


def test_pixtral_config_with_default_strategy_is_refused(pixtral_dir, tmp_path):
    import json

    from pprun.models.hf_config import load_arch_config

    config = json.loads((pixtral_dir / "config.json").read_text())
    config["vision_feature_select_strategy"] = "default"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"vision_feature_select_strategy='default'.*must be 'full'"):
        load_arch_config(tmp_path)


def test_tower_refuses_bad_pixel_shapes(hf_model):
    from pprun.models.pixtral import PixtralVisionModel

    tower = PixtralVisionModel(hf_model.config.vision_config.to_dict(), 1)
    with pytest.raises(ValueError, match=r"shape \(40, 40\).*\[3, height, width\]"):
        tower.patch_grid(torch.zeros(40, 40))
    with pytest.raises(ValueError, match="smaller than one 5-pixel patch"):
        tower.patch_grid(torch.zeros(3, 4, 40))
