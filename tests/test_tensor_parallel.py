"""Tensor parallelism end to end: ``LLM(..., tensor_parallel_size=tp)`` on CPU (gloo), greedy
tokens equal to transformers' (fp32, same prompts) under every executor that runs it, and a
killed tp worker ends the run with an error naming it.

The matrix (each model at tp 2 under mp; tp 2 x pp 2 and tp 4 on a subset; ray and torchrun on
the smallest models), chosen to cover every model, every executor, both runners and the three
layouts of issue 53 within a few seconds per cell:

| model | executor | tp x pp | runner | what it adds |
| --- | --- | --- | --- | --- |
| Llama (4 heads, 2 KV) | mp | 2 x 1 | v2 | one stage split |
| Llama | mp | 2 x 2 | v1 | hops rank to rank between tp groups |
| Llama | mp | 4 x 1 | v2 | KV heads replicated (2 KV heads on 4 ranks) |
| Qwen3, one KV head | mp | 2 x 2 | v2 | the KV head replicated, tied embeddings |
| Qwen3-MoE | mp | 2 x 1 | v2 | experts split along their width |
| Mixtral | mp | 2 x 2 | v1 | every layer sparse |
| Llava (CLIP) | mp | 2 x 1 | v2 | images (tower replicated) |
| Whisper | mp | 2 x 2 | v2 | encoder output down each pipeline once per request |
| Llama | ray | 2 x 2 | v2 | a stage's actors in one bundle |
| Llama, Qwen3 one KV head | torchrun, 4 ranks | 2 x 2, 4 x 1 | v1, v2 | SPMD: every rank the same tokens |
| Llama | mp | 2 x 2 | v2 | tp rank 1 of stage 0 killed: StageFailedError |

The ``mp`` cells fork their workers from the warm template (``tests/stage_zygote.py``): what they
check is the split run's tokens and failure; a worker started as a fresh interpreter runs the same
``worker_main`` (``tests/test_pipeline.py`` checks that start), and the Ray and torchrun cells start
theirs fresh.  Bad layouts are refused at configuration time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from stage_zygote import Zygote, use_zygote
from tiny_models import (
    make_tiny_llama,
    make_tiny_llava,
    make_tiny_mixtral,
    make_tiny_qwen3,
    make_tiny_qwen3_moe,
)

from pprun import LLM, SamplingParams
from pprun.executor.base import StageFailedError

REPO_ROOT = Path(__file__).resolve().parent.parent
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = [[5, 17, 42, 9, 30, 3, 7], [11, 12], [20, 21, 22, 7, 7, 7, 7, 7, 13, 14, 40, 41]]
KV_BYTES = 1 << 22
STAGE_TIMEOUT_S = 60.0
TORCHRUN_TIMEOUT_S = 240

MAKERS = {
    "llama": lambda p: make_tiny_llama(p, num_layers=4),
    "qwen3-kv1": lambda p: make_tiny_qwen3(p, num_key_value_heads=1, tied=True),
    "qwen3-moe": lambda p: make_tiny_qwen3_moe(p),
    "mixtral": lambda p: make_tiny_mixtral(p),
}
"""The text models (their sizes divide by 2 and, for Llama and Qwen3, by 4)."""


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return {name: make(tmp_path_factory.mktemp(name)) for name, make in MAKERS.items()}


def hf_greedy_tokens(model_dir: Path, prompts=PROMPTS, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (EOS not special, as ``ignore_eos``):
    the full forward each step, the argmax at the last position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_tokens):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(prompt):])
    return out


@pytest.fixture(scope="module")
def references(model_dirs):
    return {name: hf_greedy_tokens(d) for name, d in model_dirs.items()}


@pytest.fixture(scope="module")
def zygote():
    """The warm template the ``mp`` cells fork their workers from (``tests/stage_zygote.py``)."""
    z = Zygote(dict(os.environ, OMP_NUM_THREADS="1"))
    yield z
    z.close()


def run(model_dir: Path, prompts, params=GREEDY, inspect=None, **kwargs) -> tuple[list, dict]:
    """Generate with a fresh ``LLM``; ``inspect(llm)`` runs while it is up."""
    kwargs.setdefault("kv_cache_memory_bytes", KV_BYTES)
    kwargs.setdefault("max_model_len", 256)
    with LLM(str(model_dir), dtype="float32", device="cpu", stage_timeout_s=STAGE_TIMEOUT_S, **kwargs) as llm:
        outs = llm.generate(prompts, params)
        if inspect is not None:
            inspect(llm)
        return outs, llm.describe()


def token_prompts(prompts=PROMPTS) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


TEXT_CASES = [
    # model, executor, tp, pp, runner
    ("llama", "mp", 2, 1, "v2"),
    ("llama", "mp", 2, 2, "v1"),
    ("llama", "mp", 4, 1, "v2"),
    ("qwen3-kv1", "mp", 2, 2, "v2"),
    ("qwen3-moe", "mp", 2, 1, "v2"),
    ("mixtral", "mp", 2, 2, "v1"),
    ("llama", "ray", 2, 2, "v2"),
]


@pytest.mark.parametrize("name, executor, tp, pp, runner", TEXT_CASES)
def test_text_models_match_transformers(model_dirs, references, name, executor, tp, pp, runner, request,
                                        monkeypatch):  # fmt: skip
    """Greedy tokens of the split run equal transformers' for each cell of the matrix."""
    extra, inspect = {}, None
    if executor == "ray":
        ray = request.getfixturevalue("ray_cluster")
        extra["ray_num_cpus_per_stage"] = 0.25  # 4 actors on the session cluster's 2 CPUs

        def inspect(llm):
            # One bundle per stage holding its tp workers' CPUs, shared by its tp actors.
            ex = llm.engine.executor
            bundles = ray.util.placement_group_table(ex.pg)["bundles"]
            assert [b["CPU"] for b in bundles.values()] == [0.25 * tp] * pp
            assert len(ex.actors) == tp * pp and len(ex.stage_node_ids) == pp
    else:
        use_zygote(monkeypatch, request.getfixturevalue("zygote"))
    outs, d = run(model_dirs[name], token_prompts(), inspect=inspect, executor=executor, tensor_parallel_size=tp,
                  pipeline_parallel_size=pp, runner=runner, **extra)
    assert [o.outputs[0].token_ids for o in outs] == references[name]
    assert (d["tensor_parallel_size"], d["pipeline_parallel_size"], d["runner"]) == (tp, pp, runner)
    assert f"tp {tp}" in d["executor"] and executor in d["executor"]


def test_llava_images_match_transformers(tmp_path_factory, zygote, monkeypatch):
    """Llava at tp 2 (the CLIP tower and projector replicated, the language model split): a
    batch with 0, 1 and 3 images gives transformers' tokens."""
    from test_llava import GREEDY as LLAVA_GREEDY
    from test_llava import hf_tokens, pprun_prompts

    model_dir = make_tiny_llava(tmp_path_factory.mktemp("llava-tp"), "clip", text_heads=4)
    use_zygote(monkeypatch, zygote)
    outs, _ = run(model_dir, pprun_prompts(), LLAVA_GREEDY, executor="mp", tensor_parallel_size=2, runner="v2")
    assert [o.outputs[0].token_ids for o in outs] == hf_tokens(model_dir)


def test_whisper_matches_transformers(tmp_path_factory, zygote, monkeypatch):
    """Whisper at tp 2 x pp 2: every tp rank of the first stage encodes, each sends the encoder
    output down its own pipeline once per request; transformers' tokens for every clip."""
    from whisper_helpers import GREEDY as WHISPER_GREEDY
    from whisper_helpers import make_audio_dependent_whisper, ours, prompts, transformers_tokens

    model_dir = make_audio_dependent_whisper(tmp_path_factory.mktemp("whisper-tp"), d_model=48, heads=4)
    expected = transformers_tokens(model_dir)
    assert len({tuple(t) for t in expected}) > 1  # the tokens depend on the audio
    use_zygote(monkeypatch, zygote)
    outs, _ = run(model_dir, prompts(), WHISPER_GREEDY, executor="mp", tensor_parallel_size=2,
                  pipeline_parallel_size=2, runner="v2", max_model_len=None)
    assert [ours(o) for o in outs] == expected


def test_killed_tp_worker_fails_the_run(model_dirs, zygote, monkeypatch, inject_faults):
    """tp rank 1 of stage 0 (global rank 1) killed at its third step: the generate call raises
    StageFailedError naming that worker, and every worker process is gone afterwards."""
    use_zygote(monkeypatch, zygote)
    with inject_faults({1: {"kill_at_step": 3}}):
        llm = LLM(str(model_dirs["llama"]), dtype="float32", device="cpu", executor="mp", tensor_parallel_size=2,
                  pipeline_parallel_size=2, kv_cache_memory_bytes=KV_BYTES, max_model_len=256,
                  stage_timeout_s=STAGE_TIMEOUT_S)
    ex = llm.engine.executor
    procs = list(ex.procs)
    with pytest.raises(StageFailedError, match="stage 0 tp rank 1"):
        llm.generate(token_prompts(), GREEDY)
    llm.shutdown()
    assert all(p.poll() is not None for p in procs)


def test_layout_ranks():
    """Worker (pp_rank, tp_rank) has global rank pp_rank * tp + tp_rank; its pipeline is tp rank
    tp_rank of every stage, its tp group its stage's consecutive ranks; only the last stage's
    tp rank 0 samples."""
    from pprun.distributed.layout import StageLayout

    layouts = [StageLayout.of_global_rank([3, 1], rank, 2) for rank in range(4)]
    assert [(w.pp_rank, w.tp_rank, w.global_rank) for w in layouts] == [(0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)]
    assert [w.layer_range for w in layouts] == [range(0, 3), range(0, 3), range(3, 4), range(3, 4)]
    assert layouts[1].pipeline_ranks == [1, 3] and layouts[2].pipeline_ranks == [0, 2]
    assert layouts[3].tp_group_ranks == [2, 3] and layouts[0].world_size == 4
    assert [w.samples for w in layouts] == [False, False, True, False]
    assert layouts[3].name == "stage 1 tp rank 1" and StageLayout.single(4).name == "stage 0"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tensor_parallel_size": 3}, r"parallel\.tensor_parallel_size=3 does not divide the attention heads.*num_attention_heads=4"),
        ({"tensor_parallel_size": 2, "executor": "uni"}, r"parallel\.executor='uni'.*tensor_parallel_size=2"),
        ({"tensor_parallel_size": 0}, r"parallel\.tensor_parallel_size=0"),
        ({"tensor_parallel_size": 2, "executor": "mp", "async_pipeline": True, "pipeline_parallel_size": 2},
         r"async_pipeline=True.*tensor_parallel_size=2"),
    ],
)
def test_bad_layouts_refused_at_config_time(model_dirs, kwargs, message):
    """A tp the model cannot be split by, or an executor that cannot run it, is a ValueError
    naming the setting, before any process starts."""
    from pprun.config.config import PprunConfig
    from pprun.config.validate import validate_config

    cfg = PprunConfig.from_kwargs(model=str(model_dirs["llama"]), device="cpu", **kwargs)
    with pytest.raises(ValueError, match=message):
        validate_config(cfg)


TORCHRUN_SCRIPT = r"""
import json, os, sys

from pprun import LLM, SamplingParams

cases, out_dir, prompts, max_tokens = json.loads(sys.argv[1])
params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
result = {}
for name, model_dir, tp, pp in cases:
    with LLM(model_dir, dtype="float32", device="cpu", tensor_parallel_size=tp, pipeline_parallel_size=pp,
             kv_cache_memory_bytes=1 << 22, max_model_len=256) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        d = llm.describe()
        result[name] = {"tokens": [o.outputs[0].token_ids for o in outs], "runner": d["runner"],
                        "executor": d["executor"]}
with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(result, f)
"""


@pytest.mark.skipif(shutil.which("torchrun") is None and not (Path(sys.executable).parent / "torchrun").exists(),
                    reason="torchrun not installed")
def test_torchrun_ranks_match_transformers(model_dirs, references, tmp_path):
    """One torchrun job of 4 ranks runs Llama at tp 2 x pp 2 (V1: contract 5) then Qwen3 with
    one KV head at tp 4 (V2); every rank returns transformers' tokens."""
    script = tmp_path / "tp_job.py"
    script.write_text(TORCHRUN_SCRIPT)
    cases = [["llama", str(model_dirs["llama"]), 2, 2], ["qwen3-kv1", str(model_dirs["qwen3-kv1"]), 4, 1]]
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "4", str(script),
         json.dumps([cases, str(tmp_path), PROMPTS, MAX_TOKENS])],
        env=env, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in range(4):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["llama"]["tokens"] == references["llama"], rank
        assert result["qwen3-kv1"]["tokens"] == references["qwen3-kv1"], rank
        assert (result["llama"]["runner"], result["qwen3-kv1"]["runner"]) == ("v1", "v2")
        assert f"rank {rank} of 4" in result["llama"]["executor"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("cudagraph_mode", ["full", "piecewise"])
def test_two_gpus_nccl_graphs_match_eager(model_dirs, cudagraph_mode):
    """tp 2 on two GPUs (NCCL; the all-reduces captured inside the decode graphs): the same greedy
    tokens as the eager run and as transformers (fp32)."""
    kwargs = dict(dtype="float32", executor="mp", tensor_parallel_size=2, max_model_len=256,
                  kv_cache_memory_bytes=KV_BYTES)
    with LLM(str(model_dirs["llama"]), cudagraph_mode=cudagraph_mode, **kwargs) as llm:
        assert llm.engine.executor.call_all("runner_facts")[0]["cudagraph_mode"] == cudagraph_mode
        graphs = [o.outputs[0].token_ids for o in llm.generate(token_prompts(), GREEDY)]
    with LLM(str(model_dirs["llama"]), cudagraph_mode="none", **kwargs) as llm:
        eager = [o.outputs[0].token_ids for o in llm.generate(token_prompts(), GREEDY)]
    assert graphs == eager == hf_greedy_tokens(model_dirs["llama"])
