"""executor=external_launcher under a real torchrun (CPU, gloo): SPMD ranks agree with each other and with pp=1.

Each test starts ``torchrun --standalone --nproc-per-node 2`` on a script and reads what the ranks
wrote. A hang fails the test through the subprocess timeout instead of blocking CI.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import make_tiny_llama

REPO_ROOT = Path(__file__).resolve().parent.parent
TORCHRUN_TIMEOUT_S = 180

# Prompts of different lengths; with 2 sequences and 16 tokens per step the scheduler chunks the
# long prompts and queues requests, so every rank must make the same non-trivial decisions.
PROMPTS = [
    {"prompt_token_ids": [5, 17, 42]},
    {"prompt_token_ids": list(range(10, 31))},
    {"prompt_token_ids": [7] * 11},
    {"prompt_token_ids": [100, 3, 250, 64, 9]},
]
MAX_TOKENS = 8
KV_BYTES = 3 * 1024 * 1024
SCHEDULER = {"max_num_seqs": 2, "max_num_batched_tokens": 16, "max_model_len": 128}

WORKER_SCRIPT = r"""
import json, os, sys

import torch.distributed as dist

from pprun import LLM, SamplingParams

model_dir, out_dir = sys.argv[1], sys.argv[2]
prompts, scheduler, kv_bytes, max_tokens = json.loads(sys.argv[3])
rank = int(os.environ["RANK"])
common = dict(model=model_dir, dtype="float32", device="cpu", pipeline_parallel_size=2,
              cpu_kv_cache_bytes=kv_bytes, **scheduler)
params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
result = {}

# runner=v2 cannot run SPMD with pp > 1: a configuration error, before any process group exists.
try:
    LLM(**common, runner="v2")
    result["v2_error"] = None
except ValueError as e:
    result["v2_error"] = str(e)

# executor and runner auto: external_launcher (torchrun detected) and the V1 fallback. An uneven
# layer split gives the stages different block counts, so the agreed minimum is observable.
with LLM(**common, layer_partition=[1, 3]) as llm:
    outs = llm.generate(prompts, params)
    result["auto"] = {"describe": llm.describe(), "tokens": [o.outputs[0].token_ids for o in outs]}
result["group_alive_after_own_shutdown"] = dist.is_initialized()

# A group the user initialised is reused and left alive; executor given explicitly.
dist.init_process_group("gloo")
with LLM(**common, executor="external_launcher", runner="v1") as llm:
    outs = llm.generate(prompts, params)
    result["explicit"] = {"describe": llm.describe(), "tokens": [o.outputs[0].token_ids for o in outs]}
result["user_group_alive_after_shutdown"] = dist.is_initialized()
dist.destroy_process_group()

with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
"""


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"  # two ranks on a 2-core machine: no thread oversubscription
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    # The test process is not a torchrun rank; make sure nothing leaks in from an outer job.
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    return env


def _torchrun(args: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node 2 <args>``; fails the test on timeout, and on error if ``check``."""
    torchrun = shutil.which("torchrun")
    cmd = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    cmd += ["--standalone", "--nproc-per-node", "2", *args]
    try:
        proc = subprocess.run(
            cmd, cwd=cwd, env=_child_env(), capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun did not finish in {TORCHRUN_TIMEOUT_S}s:\n{e.stdout}\n{e.stderr}")
    if check and proc.returncode != 0:
        pytest.fail(f"torchrun exited with {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def reference_tokens(tiny_llama: Path) -> list[list[int]]:
    """Greedy tokens of pp=1 in this process (V1 runner: V1 and V2 agree by contract 5)."""
    from pprun import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(
        str(tiny_llama),
        dtype="float32",
        device="cpu",
        executor="uni",
        runner="v1",
        cpu_kv_cache_bytes=KV_BYTES,
        **SCHEDULER,
    ) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def test_spmd_ranks_match_each_other_and_pp1(tiny_llama: Path, reference_tokens, tmp_path: Path) -> None:
    import torch

    from pprun.models.hf_config import load_arch_config
    from pprun.worker.kv_cache import bytes_per_block

    script = tmp_path / "worker.py"
    script.write_text(WORKER_SCRIPT)
    payload = json.dumps([PROMPTS, SCHEDULER, KV_BYTES, MAX_TOKENS])
    _torchrun([str(script), str(tiny_llama), str(tmp_path), payload], cwd=tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]

    for r, res in enumerate(ranks):
        for case in ("auto", "explicit"):
            assert res[case]["tokens"] == reference_tokens, (r, case)
            assert res[case]["describe"]["executor"] == f"external_launcher (torchrun, rank {r} of 2)"
            assert res[case]["describe"]["runner"] == "v1"
        # auto fell back to V1 for the documented reason
        assert any("external_launcher" in why for why in res["auto"]["describe"]["runner_fallback_reasons"])
        # runner=v2 is a configuration error naming the reason
        assert res["v2_error"] is not None
        assert "runner='v2'" in res["v2_error"] and "external_launcher" in res["v2_error"]
        # the executor destroys only the group it created
        assert res["group_alive_after_own_shutdown"] is False
        assert res["user_group_alive_after_shutdown"] is True

    # Both ranks manage the same KV pool: the smaller one, of the stage with 3 of the 4 layers.
    arch = load_arch_config(tiny_llama)
    expected_blocks = KV_BYTES // bytes_per_block(arch, 3, 16, torch.float32)
    assert KV_BYTES // bytes_per_block(arch, 1, 16, torch.float32) > expected_blocks
    for res in ranks:
        assert res["auto"]["describe"]["kv_blocks_per_stage"] == expected_blocks


def test_torchrun_generate_launcher(tiny_llama: Path, reference_tokens, tmp_path: Path) -> None:
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    out_file = tmp_path / "out.jsonl"
    proc = _torchrun(
        [
            str(REPO_ROOT / "launchers" / "torchrun_generate.py"),
            f"model.model={tiny_llama}",
            "model.dtype=float32",
            f"model.max_model_len={SCHEDULER['max_model_len']}",
            "device=cpu",
            "parallel.pipeline_parallel_size=2",
            f"scheduler.max_num_seqs={SCHEDULER['max_num_seqs']}",
            f"scheduler.max_num_batched_tokens={SCHEDULER['max_num_batched_tokens']}",
            f"cache.cpu_kv_cache_bytes={KV_BYTES}",
            f"input_file={prompts_file}",
            f"output_file={out_file}",
            f"sampling.max_tokens={MAX_TOKENS}",
            "sampling.ignore_eos=true",
        ],
        cwd=tmp_path,
    )
    rows = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [row["token_ids"] for row in rows] == reference_tokens
    assert [row["prompt_token_ids"] for row in rows] == [p["prompt_token_ids"] for p in PROMPTS]
    # Only rank 0 writes; the launcher leaves no Hydra output directories behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "prompts.jsonl"]
    assert "external_launcher (torchrun, rank 0 of 2)" in proc.stdout + proc.stderr
