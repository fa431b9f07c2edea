"""Images and audio on the command line: ``pprun generate`` with ``images=`` and the JSONL
``"images"`` key on a tiny Llava, each bad input's message (before the engine starts), ``pprun
bench`` with ``workload=image`` (tiny Llava) and ``workload=audio`` (tiny Whisper) against
transformers' ``generate``, and ``scripts/make_random_model.py --llava`` (which builds the tiny
Llava every test here uses: it must load in transformers and in pprun with the same tokens)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import make_tiny_llama, make_tiny_whisper

from pprun.apps.bench import (
    check_bench_config,
    check_model_for_workload,
    greedy_match_fraction,
    image_workload,
    speech_clips,
    synthetic_clips,
)
from pprun.config.config import BenchAppConfig, GenerateAppConfig

REPO_ROOT = Path(__file__).resolve().parent.parent

TINY_LLAVA_ARGS = [
    "--llava", "--dtype", "float32", "--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2",
    "--intermediate", "128", "--vocab", "320", "--max-pos", "512", "--vision-hidden", "32",
    "--vision-layers", "2", "--vision-heads", "2", "--vision-intermediate", "64", "--image-size", "28",
]
"""A Llava of a 2-layer Llama (vocab 384 with <image> = 320) and a 2-layer CLIP tower on 28-pixel
images (4 embedding rows per image)."""

IMAGE_TOKEN_ID = 320
IMAGE_ROWS = 4


def load_maker():
    """``scripts/make_random_model.py`` as a module."""
    spec = importlib.util.spec_from_file_location("make_random_model", REPO_ROOT / "scripts" / "make_random_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("llava") / "tiny-llava"
    info = load_maker().main([str(out), *TINY_LLAVA_ARGS])
    assert info["image_token_id"] == IMAGE_TOKEN_ID and info["image_embeds"] == IMAGE_ROWS
    return out


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory) -> Path:
    return make_tiny_whisper(tmp_path_factory.mktemp("whisper"))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("llama"), num_layers=2)


@pytest.fixture(scope="module")
def image_files(tmp_path_factory) -> Path:
    """A folder with a.png, b.jpg and sub/c.png (seeded noise of different sizes) and
    not_an_image.png (text)."""
    from PIL import Image

    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    (folder / "sub").mkdir()
    for name, size in (("a.png", (40, 50)), ("b.jpg", (28, 28)), ("sub/c.png", (60, 30))):
        Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(folder / name)
    (folder / "not_an_image.png").write_text("hello")
    return folder


def run_pprun(args: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python -m pprun <args>`` from ``cwd`` with this checkout importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run([sys.executable, "-m", "pprun", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def compose(app: str, overrides: list[str]):
    """The app's typed config from ``conf/<app>.yaml`` and command-line style overrides."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from pprun.config.config import default_conf_dir, register_configs

    register_configs()
    with initialize_config_dir(str(default_conf_dir()), version_base="1.3"):
        return OmegaConf.to_object(hydra_compose(app, overrides=overrides))


# --- the Llava maker ------------------------------------------------------------------------------


def test_llava_maker_default_shape_is_clip_vit_l14_336():
    """The default ``--llava`` shape (config only: no 1.4B weights built here)."""
    maker = load_maker()
    config = maker.llava_config(maker.parse_args(["/unused", "--llava"]))
    v, t = config.vision_config, config.text_config
    assert (v.hidden_size, v.num_hidden_layers, v.num_attention_heads, v.intermediate_size) == (1024, 24, 16, 4096)
    assert (v.patch_size, v.image_size, v.model_type) == (14, 336, "clip_vision_model")
    assert config.vision_feature_layer == -2 and config.vision_feature_select_strategy == "default"
    assert config.image_seq_length == 576
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads) == (2048, 16, 32, 8)
    assert t.intermediate_size == 8192 and t.vocab_size == 32064 and config.image_token_index == 32000


def test_llava_maker_loads_in_transformers_and_pprun(llava_dir: Path, image_files: Path):
    """transformers' own processor and model, and pprun, on the maker's output (in the published
    checkpoints' layout, which vLLM reads too): the same greedy tokens for a prompt with two
    images (transformers expands <image> itself)."""
    from PIL import Image
    from safetensors import safe_open
    from transformers import AutoProcessor, AutoTokenizer, LlavaForConditionalGeneration

    from pprun import LLM, SamplingParams

    with safe_open(str(llava_dir / "model.safetensors"), "pt") as f:  # the published checkpoints' names
        assert {k.split(".")[0] + "." + k.split(".")[1] for k in f.keys()} == {
            "language_model.model", "language_model.lm_head", "vision_tower.vision_model",
            "multi_modal_projector.linear_1", "multi_modal_projector.linear_2"}
    tok = AutoTokenizer.from_pretrained(llava_dir)
    assert tok.convert_tokens_to_ids("<image>") == IMAGE_TOKEN_ID and len(tok) == 384
    assert tok.decode(tok("a cat, 12 dogs").input_ids, skip_special_tokens=True) == "a cat, 12 dogs"
    assert json.loads((llava_dir / "preprocessor_config.json").read_text())["image_processor_type"] == "CLIPImageProcessor"
    prompt = "USER: <image> and <image>\nWhat differs? ASSISTANT:"
    images = [Image.open(image_files / "a.png"), Image.open(image_files / "sub" / "c.png")]
    processor = AutoProcessor.from_pretrained(llava_dir)
    inputs = processor(images=images, text=prompt, return_tensors="pt")
    assert int((inputs["input_ids"] == IMAGE_TOKEN_ID).sum()) == 2 * IMAGE_ROWS
    model = LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    hf_tokens = out[0, inputs["input_ids"].shape[1]:].tolist()
    with LLM(str(llava_dir), dtype="float32", max_num_seqs=2) as llm:
        ours = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}},
                            SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    assert ours.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert list(ours.outputs[0].token_ids) == hf_tokens


# --- pprun generate with images -------------------------------------------------------------------


def test_generate_images_on_the_command_line_and_in_the_input_file(llava_dir: Path, image_files: Path):
    """One run from the images' folder: ``prompt`` + ``images=`` (no image token: prepended),
    and JSONL lines with an explicit image token, two images, token ids, a chat, another image
    and no image."""
    from transformers import AutoTokenizer

    question = "What is it?"
    lines = [
        {"prompt": f"<image>\n{question}", "images": ["a.png"], "id": "explicit"},
        {"prompt": "USER: <image> vs <image>\nSame?", "images": ["sub/c.png", "b.jpg"]},
        {"prompt_token_ids": [1, IMAGE_TOKEN_ID, 40, 41], "images": [str(image_files / "b.jpg")]},
        {"messages": [{"role": "user", "content": question}], "images": ["a.png"]},
        {"prompt": f"<image>\n{question}", "images": ["b.jpg"]},
        {"prompt": question},
    ]
    (image_files / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    result = run_pprun(
        ["generate", "model=local", f"model.model={llava_dir}", "parallel=single", "model.dtype=float32",
         f'prompt="{question}"', "images=[a.png]", "input_file=in.jsonl", "output_file=out.jsonl",
         "sampling.max_tokens=4", "sampling.ignore_eos=true", "scheduler.max_num_seqs=4"],
        image_files,
    )
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (image_files / "out.jsonl").read_text().splitlines()]
    assert [r.get("images") for r in records] == [["a.png"], ["a.png"], ["sub/c.png", "b.jpg"],
                                                 [str(image_files / "b.jpg")], ["a.png"], ["b.jpg"], None]
    assert all(len(r["token_ids"]) == 4 for r in records)
    # A prompt without an image token gets one at its start: the same request as the explicit one.
    assert records[0]["prompt"] == records[1]["prompt"] == f"<image>\n{question}"
    assert records[0]["token_ids"] == records[1]["token_ids"] and records[1]["id"] == "explicit"
    assert records[5]["token_ids"] != records[1]["token_ids"]  # another image, another answer
    # Each image is IMAGE_ROWS tokens of the prompt.
    tok = AutoTokenizer.from_pretrained(llava_dir)
    assert records[0]["metrics"]["num_prompt_tokens"] == len(tok(records[0]["prompt"]).input_ids) - 1 + IMAGE_ROWS
    assert records[2]["metrics"]["num_prompt_tokens"] == len(tok(lines[1]["prompt"]).input_ids) - 2 + 2 * IMAGE_ROWS
    assert records[3]["metrics"]["num_prompt_tokens"] == 3 + IMAGE_ROWS
    assert records[6]["metrics"]["num_prompt_tokens"] == len(tok(question).input_ids)
    # The chat: the image part went before the text, and the template rendered it as <image>.
    assert records[4]["messages"][0]["content"][0]["type"] == "image_url"
    assert records[4]["prompt"] == "<s>USER: <image>What is it?\nASSISTANT:"
    # Hydra wrote nothing into the working directory.
    assert sorted(p.name for p in image_files.iterdir()) == ["a.png", "b.jpg", "in.jsonl", "not_an_image.png",
                                                              "out.jsonl", "sub"]


def test_generate_image_paths_are_read_from_the_launch_directory(image_files: Path, tmp_path: Path):
    """With ``hydra.job.chdir=true`` the job runs elsewhere; a relative image is still looked for
    where pprun was started, and a missing one exits 2 before any engine starts."""
    result = run_pprun(["generate", "prompt=hi", "images=[a.png,missing.png]", "hydra.job.chdir=true",
                        f"hydra.run.dir={tmp_path / 'job'}"], image_files, timeout=300)
    assert result.returncode == 2, result.stderr
    assert (f"pprun generate: error: images[1]='missing.png' is not a file (looked for {image_files / 'missing.png'})"
            in result.stderr)


@pytest.mark.parametrize(
    ("settings", "lines", "message"),
    [
        ({"prompt": "hi", "images": ["missing.png"]}, None, "images[0]='missing.png' is not a file"),
        ({"prompt": "hi", "images": ["not_an_image.png"]}, None, "images[0]='not_an_image.png' is not a readable image"),
        ({"images": ["a.png"]}, None, "images=['a.png'] go with prompt=..., which is not set"),
        ({}, [{"prompt": "x"}, {"prompt": "y", "images": ["a.png", "gone.jpg"]}],
         "input_file line 2: images[1]='gone.jpg' is not a file"),
        ({}, [{"prompt": "x", "image": ["a.png"]}], "input_file line 1: unknown key 'image'; did you mean 'images'?"),
        ({}, [{"prompt": "x", "images": "a.png"}], "input_file line 1: images must be a list of image file paths"),
        ({"model": "llama", "prompt": "hi", "images": ["a.png"]}, None,
         "prompt: images given, but model {model!r} (LlamaForCausalLM) is text-only and takes no images"),
        ({}, [{"prompt": "<image> <image>", "images": ["a.png"]}],
         "input_file line 1: the prompt has 2 image token(s) '<image>' for 1 image(s) in images"),
        ({}, [{"prompt_token_ids": [1, 5], "images": ["a.png"]}],
         f"input_file line 1: prompt_token_ids hold 0 image token(s) (id {IMAGE_TOKEN_ID}) for 1 image(s)"),
        ({}, [{"messages": [{"role": "system", "content": "x"}], "images": ["a.png"]}],
         "input_file line 1: images need a user turn whose content is a string"),
    ],
)
def test_generate_bad_media_input_fails_before_the_engine(
    settings: dict, lines: list | None, message: str, llava_dir: Path, llama_dir: Path, image_files: Path,
    monkeypatch: pytest.MonkeyPatch,
):
    from pprun.apps import generate

    monkeypatch.chdir(image_files)

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine started")

    monkeypatch.setattr("pprun.engine.llm.LLM", no_engine)
    settings = dict(settings)
    model = str(llama_dir if settings.pop("model", None) == "llama" else llava_dir)
    cfg = GenerateAppConfig(**settings)
    cfg.model.model = model
    cfg.model.dtype = "float32"
    if lines is not None:
        (image_files / "bad.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        cfg.input_file = "bad.jsonl"
    with pytest.raises(ValueError) as info:
        generate.run(cfg)
    assert message.format(model=model) in str(info.value)


# --- pprun bench: image and audio workloads -------------------------------------------------------


def check_both_sides(data: dict, num_output_tokens: int) -> None:
    """pprun's and the peer's metrics are there and positive, they agree, and the ratio is theirs."""
    for side in ("pprun", "peer"):
        for key in ("output_tokens_per_s", "total_tokens_per_s", "requests_per_s", "elapsed_s"):
            assert data[side][key] > 0, (side, key)
        assert data[side]["num_output_tokens"] == num_output_tokens, side
    assert data["pprun"]["ttft_ms_p50"] > 0
    assert data["peer"]["greedy_match_fraction"] == 1.0  # greedy float32 on CPU: the same tokens
    assert data["ratio"] == pytest.approx(data["pprun"]["output_tokens_per_s"] / data["peer"]["output_tokens_per_s"],
                                          rel=0.01)


def test_bench_image_workload_with_hf_peer(llava_dir: Path, capsys: pytest.CaptureFixture):
    from pprun.apps import bench

    cfg = compose("bench", ["model=local", f"model.model={llava_dir}", "model.dtype=float32", "workload=image",
                            "num_images=2", "image_size=40", "num_prompts=3", "input_len=5", "output_len=4",
                            "num_warmup_prompts=1", "scheduler.max_num_seqs=2", "peer=hf"])
    data = bench.run(cfg)
    assert json.loads(capsys.readouterr().out) == data
    w = data["workload"]
    assert (w["type"], w["num_images"], w["image_size"], w["num_prompts"]) == ("image", 2, 40, 3)
    assert w["image_tokens_per_request"] == 2 * IMAGE_ROWS
    assert w["num_prompt_tokens"] == 3 * (5 + 2 * IMAGE_ROWS)
    check_both_sides(data, 3 * 4)
    assert data["peer"]["name"] == "transformers.LlavaForConditionalGeneration.generate"
    assert data["peer"]["num_batches"] == 2
    for side in ("pprun", "peer"):
        assert data[side]["images_per_s"] == pytest.approx(6 / data[side]["elapsed_s"], rel=0.01)


def test_bench_audio_workload_with_hf_peer(whisper_dir: Path, capsys: pytest.CaptureFixture):
    """Speech clips tiled to 2 s (the tiny Whisper's window is 3 s), stopping at EOS."""
    from pprun.apps import bench

    cfg = compose("bench", ["model=local", f"model.model={whisper_dir}", "model.dtype=float32", "workload=audio",
                            "audio_seconds=2", "num_prompts=3", "output_len=5", "ignore_eos=false",
                            "num_warmup_prompts=1", "scheduler.max_num_seqs=2", "peer=hf"])
    data = bench.run(cfg)
    assert json.loads(capsys.readouterr().out) == data
    w = data["workload"]
    assert (w["type"], w["audio_source"], w["audio_seconds"], w["total_audio_seconds"]) == ("audio", "speech", 2.0, 6.0)
    assert w["input_len"] is None and w["num_prompt_tokens"] == 3 * 2  # the decoder prompt
    num_tokens = data["pprun"]["num_output_tokens"]
    assert 3 <= num_tokens <= 15
    check_both_sides(data, num_tokens)
    assert data["peer"]["name"] == "transformers.WhisperForConditionalGeneration.generate"
    for side in ("pprun", "peer"):
        assert data[side]["audio_seconds_per_s"] == pytest.approx(6.0 / data[side]["elapsed_s"], rel=0.01)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"workload": "video"}, r"workload='video' is not allowed: choose one of text, image, audio"),
        ({"workload": "image", "num_images": 0}, r"num_images=0 must be an integer in \[1, 64\]"),
        ({"workload": "image", "image_size": 5000}, r"image_size=5000 must be an integer in \[1, 4096\]"),
        ({"workload": "image", "input_file": "w.jsonl"}, r"input_file='w.jsonl' is for workload=text"),
        ({"workload": "audio", "audio_seconds": 0}, r"audio_seconds=0 must be a number above 0 and at most 30"),
        ({"workload": "audio", "audio_seconds": 31.5}, r"audio_seconds=31\.5 must be a number above 0"),
        ({"workload": "audio", "audio_seconds": True}, r"audio_seconds=True must be a number"),
        ({"workload": "audio", "audio_source": "mic"}, r"audio_source='mic' is not allowed: choose one of speech, synthetic"),
    ],
)
def test_bench_rejects_bad_media_settings(change: dict, match: str):
    cfg = BenchAppConfig()
    for key, value in change.items():
        setattr(cfg, key, value)
    with pytest.raises(ValueError, match=match):
        check_bench_config(cfg)


def test_bench_workload_needs_the_right_model(llava_dir: Path, whisper_dir: Path, llama_dir: Path):
    cases = [
        (llama_dir, "image", "workload=image needs a vision-language model (Llava); model.model="),
        (whisper_dir, "text", "is a speech model: use workload=audio"),
        (llava_dir, "audio", "(LlavaForConditionalGeneration) is a vision-language model: use workload=image"),
    ]
    for model_dir, workload, message in cases:
        cfg = BenchAppConfig(workload=workload)
        cfg.model.model = str(model_dir)
        with pytest.raises(ValueError) as info:
            check_model_for_workload(cfg)
        assert message in str(info.value)
    cfg = BenchAppConfig(workload="text")
    cfg.model.model = str(llava_dir)
    check_model_for_workload(cfg)  # a vision-language model runs text prompts too


def test_bench_media_workload_helpers():
    first = image_workload(3, 6, 2, num_images=2, image_size=9, vocab_size=12, image_token_id=5, seed=1)
    again = image_workload(3, 6, 2, num_images=2, image_size=9, vocab_size=12, image_token_id=5, seed=1)
    assert [r.prompt_token_ids for r in first] == [r.prompt_token_ids for r in again]
    assert all(np.array_equal(a, b) for r, s in zip(first, again)
               for a, b in zip(r.multi_modal_data["image"], s.multi_modal_data["image"]))
    for r in first:
        assert r.prompt_token_ids[:2] == [5, 5] and 5 not in r.prompt_token_ids[2:]
        assert all(0 <= t < 12 for t in r.prompt_token_ids) and len(r.prompt_token_ids) == 8
        assert [img.shape for img in r.multi_modal_data["image"]] == [(9, 9, 3)] * 2
    assert not np.array_equal(first[0].multi_modal_data["image"][0], first[1].multi_modal_data["image"][0])
    clips = speech_clips(4, 1.5, seed=0)
    assert [c.shape for c in clips] == [(24000,)] * 4 and clips[0].dtype == np.float32
    assert len({c.tobytes() for c in clips}) == 4  # each clip starts at its own offset
    assert all(np.array_equal(a, b) for a, b in zip(clips, speech_clips(4, 1.5, seed=0)))
    noise = synthetic_clips(2, 0.5, seed=3)
    assert [c.shape for c in noise] == [(8000,)] * 2 and np.abs(noise[0]).max() <= 1.0
    # Greedy agreement: up to the EOS (2) when both stop there; before pprun's EOS with ignore_eos.
    assert greedy_match_fraction([[4, 2, 9]], [[4, 7, 7]], {2}, ignore_eos=True) == 1.0
    assert greedy_match_fraction([[4, 2]], [[4, 2, 0]], {2}, ignore_eos=False) == 1.0
    assert greedy_match_fraction([[4, 2], [4, 5]], [[4, 3], [4, 6]], {2}, ignore_eos=False) == 0.0
    assert greedy_match_fraction([[4, 5], [4, 6]], [[4, 5], [4, 7]], {2}, ignore_eos=True) == 0.5
