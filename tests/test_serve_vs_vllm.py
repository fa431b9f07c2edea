"""``scripts/serve_vs_vllm.py`` without vLLM or a GPU: its arguments and plan, the commands it
would run (pprun's overrides composed against pprun's own schema; vLLM's flags against those of
vLLM 0.26's ``vllm bench serve`` and ``vllm serve`` it relies on), the reading of vLLM's saved
result (``tests/data/vllm/bench_serve_result.json``: the keys, in their order, of a file vLLM
0.26's ``vllm bench serve`` saved with this script's arguments, ``--save-result`` without
``--save-detailed``; its values those of a 4-way run of 8 prompts of 512 tokens and 128 out), the
summary and table, and the whole loop of a server job
against a stand-in server (``http.server`` answering ``/v1/models``) and a stand-in ``vllm``
package whose CLI entry point writes result files."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import socket
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULT = REPO_ROOT / "tests" / "data" / "vllm" / "bench_serve_result.json"

BENCH_FLAGS = {
    "--backend": 1, "--base-url": 1, "--endpoint": 1, "--model": 1, "--tokenizer": 1, "--dataset-name": 1,
    "--random-input-len": 1, "--random-output-len": 1, "--ignore-eos": 0, "--num-prompts": 1, "--seed": 1,
    "--max-concurrency": 1, "--request-rate": 1, "--temperature": 1, "--percentile-metrics": 1,
    "--metric-percentiles": 1, "--disable-tqdm": 0, "--label": 1, "--metadata": "*", "--save-result": 0,
    "--result-dir": 1, "--result-filename": 1,
}
"""The ``vllm bench serve`` options the script passes, each as vLLM 0.26 declares it (values taken:
1, none, or any number), from ``add_cli_args`` in ``vllm/benchmarks/serve.py`` and
``add_dataset_parser`` in ``vllm/benchmarks/datasets``."""
SERVE_FLAGS = {"--host", "--port", "--served-model-name", "--dtype", "--max-num-seqs", "--max-model-len",
               "--disable-uvicorn-access-log"}
"""The ``vllm serve`` options the script passes (``vllm serve --help`` of 0.26)."""


def load_script():
    spec = importlib.util.spec_from_file_location("serve_vs_vllm", REPO_ROOT / "scripts" / "serve_vs_vllm.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["serve_vs_vllm"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


svv = load_script()


def bench_parser() -> argparse.ArgumentParser:
    """A strict parser of :data:`BENCH_FLAGS` (an option outside them is an error)."""
    ap = argparse.ArgumentParser(exit_on_error=False)
    for flag, nargs in BENCH_FLAGS.items():
        if nargs == 0:
            ap.add_argument(flag, action="store_true")
        else:
            ap.add_argument(flag, nargs=None if nargs == 1 else nargs)
    return ap


# --- arguments and plan -------------------------------------------------------------------------


def test_rows_parse_and_refuse():
    assert svv.parse_row("c64") == svv.Row("c64", 64, math.inf)
    assert svv.parse_row("r8") == svv.Row("r8", None, 8.0)
    assert svv.parse_row("r0.5").rate == 0.5 and svv.parse_row("r0.5").arrival_bound
    rinf = svv.parse_row("rinf")
    assert rinf.concurrency is None and math.isinf(rinf.rate) and not rinf.arrival_bound
    for bad in ("64", "c", "c0", "r0", "rfast", "c-1", "x8"):
        with pytest.raises(ValueError, match=rf"row '{re.escape(bad)}' is invalid: .*(cN|at least 1|positive)"):
            svv.parse_row(bad)


def test_prompts_per_row():
    bounds = dict(min_prompts=32, max_prompts=1024, rate_window_s=8.0, max_num_seqs=256)
    got = {name: svv.num_prompts(svv.parse_row(name), **bounds) for name in svv.DEFAULT_ROWS.split(",")}
    assert got == {"c1": 32, "c16": 64, "c64": 256, "c256": 1024, "r8": 64, "r32": 256, "rinf": 512}
    args = svv.parse_args(["--model", "m=/x"])
    defaults = dict(min_prompts=args.min_prompts, max_prompts=args.max_prompts, rate_window_s=args.rate_window_s,
                    max_num_seqs=args.max_num_seqs)
    assert [svv.num_prompts(svv.parse_row(r), **defaults) for r in ("r8", "r32", "rinf")] == [48, 192, 512]
    assert svv.num_prompts(svv.parse_row("c512"), **bounds) == 1024


def test_plan_cold_first_then_repeat_passes_with_distinct_seeds():
    rows = [svv.parse_row(r) for r in ("c1", "r8")]
    runs = svv.plan_runs(rows, svv.parse_row("c64"), 2, svv.Settings(seed=100), min_prompts=32,
                         max_prompts=1024, rate_window_s=8.0)
    assert [r.name for r in runs] == ["c64-cold", "c1-r1", "r8-r1", "c1-r2", "r8-r2"]
    assert [r.seed for r in runs] == [100, 101, 102, 103, 104]
    assert [r.num_prompts for r in runs] == [256, 32, 64, 32, 64]
    assert [r.name for r in svv.plan_runs(rows, None, 1, svv.Settings(), min_prompts=1, max_prompts=9,
                                          rate_window_s=1.0)] == ["c1-r1", "r8-r1"]


@pytest.mark.parametrize("argv, fragment", [
    ([], "--model is required"),
    (["--model", "x"], "give NAME=DIR, or one of"),
    (["--model", "a b=/tmp/x"], "NAME .*or NAME=DIR"),
    (["--model", "a=/x", "--model", "a=/y"], "names must differ"),
    (["--model", "a=/x", "--servers", "pprun,sglang"], "--servers='pprun,sglang' is invalid"),
    (["--model", "a=/x", "--servers", "vllm,vllm"], "distinct"),
    (["--model", "a=/x", "--rows", "c64,fast"], "row 'fast' is invalid"),
    (["--model", "a=/x", "--cold-row", "c0"], "row 'c0' is invalid"),
    (["--model", "a=/x", "--min-prompts", "64", "--max-prompts", "32"], "--min-prompts=64 is above"),
    (["--model", "a=/x", "--max-model-len", "600"], "exceeds --max-model-len=600"),
    (["--model", "a=/x", "--repeats", "-1"], "--repeats=-1 must be at least 0"),
    (["--model", "a=/x", "--repeats", "0", "--cold-row", "none"], "runs nothing"),
    (["--model", "a=/x", "--pprun-arg", "serve.api_servers"], "KEY=VALUE"),
])  # fmt: skip
def test_bad_arguments_are_errors_naming_them(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exit_info:
        svv.parse_args(argv)
    assert exit_info.value.code == 2
    assert re.search(fragment, capsys.readouterr().err)


def test_known_model_names_default_to_tmp():
    args = svv.parse_args(["--model", "qwen3-8b", "--model", "mine=/data/m"])
    assert args.models == [("qwen3-8b", "/tmp/qwen3-8b"), ("mine", "/data/m")]
    assert args.server_list == ["pprun", "vllm"] and [r.name for r in args.row_list] == svv.DEFAULT_ROWS.split(",")
    assert args.cold.name == "c64" and args.vllm_python == sys.executable


# --- the commands -------------------------------------------------------------------------------


def test_bench_arguments_are_vllm_0_26_flags(tmp_path):
    args = svv.parse_args(["--model", f"m={tmp_path}", "--temperature", "0.5", "--out", str(tmp_path / "out")])
    jobs = svv.make_jobs(args)
    assert [(j.model, j.server) for j in jobs] == [("m", "pprun"), ("m", "vllm")]
    parser = bench_parser()
    for job in jobs:
        assert job.port != 0
        for run in job.runs:
            a = parser.parse_args(job.bench[run.name])
            assert (a.backend, a.endpoint, a.dataset_name, a.model, a.tokenizer) == (
                "openai", "/v1/completions", "random", "m", str(tmp_path))
            assert a.base_url == f"http://127.0.0.1:{job.port}"
            assert (a.random_input_len, a.random_output_len, a.ignore_eos, a.save_result) == ("512", "128", True, True)
            assert (a.percentile_metrics, a.metric_percentiles, a.temperature) == ("ttft,tpot,itl", "50,99", "0.5")
            assert int(a.num_prompts) == run.num_prompts and int(a.seed) == run.seed
            assert (a.max_concurrency is None) == (run.row.concurrency is None)
            assert (a.request_rate is None) == (run.row.concurrency is not None)
            assert Path(a.result_dir) / a.result_filename == job.folder / f"{run.name}.json"
            assert svv.RUN_FILE.match(a.result_filename)
    rinf = next(r for r in jobs[0].runs if r.row.name == "rinf")
    assert parser.parse_args(jobs[0].bench[rinf.name]).request_rate == "inf"


def test_server_commands(tmp_path):
    """pprun's overrides compose against its own schema; vLLM's flags are ``vllm serve``'s."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from pprun.config.config import default_conf_dir, register_configs

    args = svv.parse_args(["--model", f"m={tmp_path}", "--pprun-arg", "serve.api_servers=2",
                           "--vllm-arg=--api-server-count=2", "--vllm-python", "/tmp/vpy"])
    pprun_job, vllm_job = svv.make_jobs(args)
    assert pprun_job.command[:4] == [sys.executable, "-m", "pprun", "serve"]
    register_configs()
    with initialize_config_dir(str(default_conf_dir()), version_base="1.3"):
        cfg = OmegaConf.to_object(compose("serve", overrides=pprun_job.command[4:]))
    assert (cfg.model.model, cfg.model.dtype, cfg.device, cfg.model.max_model_len) == (
        str(tmp_path), "bfloat16", "cuda", 1024)
    assert (cfg.scheduler.max_num_seqs, cfg.serve.http_port, cfg.serve.port) == (256, pprun_job.port, 0)
    assert (cfg.serve.model_name, cfg.serve.api_servers, cfg.parallel.pipeline_parallel_size) == ("m", 2, 1)

    cmd = vllm_job.command
    assert cmd[:5] == ["/tmp/vpy", "-m", "vllm.entrypoints.cli.main", "serve", str(tmp_path)]
    flags = [a.split("=")[0] for a in cmd[5:] if a.startswith("--")]
    assert set(flags) - {"--api-server-count"} <= SERVE_FLAGS
    opts = dict(zip(cmd[5::1], cmd[6::1]))
    assert (opts["--port"], opts["--served-model-name"], opts["--max-num-seqs"], opts["--max-model-len"]) == (
        str(vllm_job.port), "m", "256", "1024")
    assert cmd[-1] == "--api-server-count=2"


def test_dry_run_prints_every_command(tmp_path, capsys):
    assert svv.main(["--model", f"m={tmp_path}", "--rows", "c1,rinf", "--repeats", "3", "--dry-run",
                     "--vllm-python", "/tmp/vpy", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    benches = [line for line in out.splitlines() if " bench serve " in line]
    assert len(benches) == 2 * (1 + 2 * 3)
    assert sum(" -m pprun serve " in line for line in out.splitlines()) == 1
    assert sum(" -m vllm.entrypoints.cli.main serve " in line for line in out.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_server_env_is_offline_and_keeps_pythonpath_for_pprun_only(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/tmp/site")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert svv.server_env("pprun")["PYTHONPATH"] == "/tmp/site"
    assert "PYTHONPATH" not in svv.server_env("vllm") and "PYTHONPATH" not in svv.server_env("client")
    assert svv.server_env("vllm")["HF_HUB_OFFLINE"] == "1"
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert svv.server_env("pprun")["HF_HUB_OFFLINE"] == "0"


# --- results ------------------------------------------------------------------------------------


def test_reads_vllm_result():
    data = json.loads(RESULT.read_text())
    got = svv.read_result(data)
    assert got["output_tok_s"] == pytest.approx(data["total_output_tokens"] / data["duration"])
    assert (got["ttft_p50_ms"], got["ttft_p99_ms"]) == (data["p50_ttft_ms"], data["p99_ttft_ms"])
    assert (got["tpot_p50_ms"], got["tpot_p99_ms"], got["itl_p99_ms"]) == (
        data["p50_tpot_ms"], data["p99_tpot_ms"], data["p99_itl_ms"])
    assert got["mean_input_tokens"] == data["total_input_tokens"] / data["completed"] == 512
    assert (got["num_prompts"], got["max_concurrency"], got["request_rate"]) == (data["num_prompts"], 4, "inf")
    assert svv.run_problems("x", got, 128, 512) == []
    short = svv.read_result({**data, "total_input_tokens": data["total_input_tokens"] - 8 * 3})
    assert svv.run_problems("x", short, 128, 512) == ["x: prompts of 509.0 tokens on average, not 512"]
    without_p50 = {k: v for k, v in data.items() if not k.startswith("p50_")}
    assert svv.read_result(without_p50)["ttft_p50_ms"] == data["median_ttft_ms"]


def test_events_per_answer_from_the_means():
    """Two answers of 5 tokens: one sent token by token (4 gaps of 10 ms), one in two events (one
    gap of 40 ms): TPOT 10 ms for both, mean ITL 40 ms / 5 gaps = 16 ms -> 1 + 10 x 4 / 16 = 3.5,
    the mean of 5 and 2 events."""
    data = {"completed": 2, "total_output_tokens": 10, "mean_tpot_ms": 10.0, "mean_itl_ms": 16.0}
    assert svv.events_per_answer(data) == pytest.approx(3.5)
    assert svv.events_per_answer({**data, "mean_itl_ms": 10.0}) == pytest.approx(5.0)  # one per token
    assert svv.events_per_answer({**data, "total_output_tokens": 9}) is None  # answers not all equal
    assert svv.events_per_answer({**data, "mean_itl_ms": None}) is None
    got = svv.read_result(json.loads(RESULT.read_text()))
    assert got["events_per_answer"] is not None and 1 <= got["events_per_answer"] <= 128


def test_run_problems_name_the_run():
    data = json.loads(RESULT.read_text())
    bad = svv.read_result({**data, "failed": 2, "completed": data["num_prompts"] - 2, "p99_itl_ms": None})
    problems = svv.run_problems("m/pprun/c4-r1", bad, 128)
    assert any("2 failed requests" in p for p in problems)
    assert any(f"{data['num_prompts'] - 2} of {data['num_prompts']} prompts" in p for p in problems)
    assert any("output tokens, not" in p for p in problems) and any("no itl_p99_ms" in p for p in problems)
    assert all(p.startswith("m/pprun/c4-r1: ") for p in problems)


def write_result(folder: Path, run: str, *, scale: float, ttft_scale: float = 1.0, **changes) -> dict:
    """The fixture with its output rate times ``scale`` and its TTFTs times ``ttft_scale``."""
    data = json.loads(RESULT.read_text())
    data["output_throughput"] *= scale
    for key in ("median_ttft_ms", "p50_ttft_ms", "p99_ttft_ms"):
        data[key] *= ttft_scale
    data.update(changes)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{run}.json").write_text(json.dumps(data))
    return data


def test_summary_ratios_cold_rows_and_targets(tmp_path):
    base = json.loads(RESULT.read_text())["output_throughput"]
    model = tmp_path / "m"
    scales = {"pprun": {"c4-cold": 1.0, "c4-r1": 1.5, "c4-r2": 1.3, "c4-r3": 1.4, "r8-r1": 1.0},
              "vllm": {"c4-cold": 0.9, "c4-r1": 1.0, "c4-r2": 1.1, "c4-r3": 0.95, "r8-r1": 1.0}}
    for server, runs in scales.items():
        for run, scale in runs.items():
            write_result(model / server, run, scale=scale, ttft_scale=0.8 if server == "pprun" else 1.0,
                         request_rate=8.0 if run.startswith("r8") else "inf")
    (model / "pprun" / "server.json").write_text(json.dumps({"ready_s": 41.5, "wall_s": 90.0, "command": ["x"]}))
    (model / "pprun" / "notes.json").write_text("{}")  # not a run: ignored
    summary = svv.summarize(svv.collect([tmp_path]))
    row = summary["models"]["m"]["rows"]["c4"]
    steady = row["pprun"]["steady"]["output_tok_s"]
    assert (steady["median"], steady["min"], steady["max"], steady["n"]) == pytest.approx((1.4 * base, 1.3 * base,
                                                                                           1.5 * base, 3))
    assert row["ratio"]["output_tok_s"] == pytest.approx(1.4 / 1.0)
    assert row["ratio"]["ttft_p99_ms"] == pytest.approx(0.8)
    assert row["pprun"]["cold"]["output_tok_s"] == pytest.approx(base)
    assert row["pprun"]["cold_over_steady"] == pytest.approx(1.0 / 1.4)
    assert summary["models"]["m"]["servers"]["pprun"]["ready_s"] == 41.5
    assert list(summary["models"]["m"]["rows"]) == ["c4", "r8"]

    targets = {(t["row"], t["check"].split(" ")[0] + " " + t["check"].split(" ")[1]): t for t in summary["targets"]}
    assert targets[("c4", "steady output")]["pass"] and targets[("c4", "steady TTFT")]["pass"]
    assert not targets[("c4", "pprun cold")]["pass"]  # 1/1.4 = 0.71 < 0.85
    assert not any(t["row"] == "r8" and "output tok/s pprun/vLLM" in t["check"] for t in summary["targets"])
    assert summary["problems"] == []

    table = svv.markdown(summary)
    lines = table.splitlines()
    steady_line = next(line for line in lines if line.startswith("| c4 | 8 | steady x3 |"))
    assert "**1.40**" in steady_line
    cold_line = next(line for line in lines if line.startswith("| c4 | 8 | cold |"))
    assert f"**{1.0 / 0.9:.2f}**" in cold_line
    assert lines.index(steady_line) < lines.index(cold_line)
    assert "pprun ready in 41.5 s" in table


def test_summary_with_one_server_has_no_ratio(tmp_path):
    write_result(tmp_path / "m" / "vllm", "c4-r1", scale=1.0, failed=1)
    summary = svv.summarize(svv.collect([tmp_path]))
    assert "ratio" not in summary["models"]["m"]["rows"]["c4"] and summary["targets"] == []
    assert summary["problems"] == ["m/vllm/c4-r1: 1 failed requests"]
    assert "| c4 | 8 | steady x1 | - |" in svv.markdown(summary)


def test_report_writes_summary_files(tmp_path, capsys):
    write_result(tmp_path / "res" / "m" / "pprun", "c4-r1", scale=1.2)
    write_result(tmp_path / "res" / "m" / "vllm", "c4-r1", scale=1.0)
    assert svv.main(["--report", str(tmp_path / "res")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["models"]["m"]["rows"]["c4"]["ratio"]["output_tok_s"] == pytest.approx(1.2)
    svv.report([tmp_path / "res"], tmp_path / "written")
    assert json.loads((tmp_path / "written" / "summary.json").read_text()) == printed
    assert "### m" in (tmp_path / "written" / "summary.md").read_text()


# --- a server job end to end, with stand-ins --------------------------------------------------------

FAKE_CLI = '''
import argparse, json, os, sys

def main():
    if sys.argv[1] == "serve" and not sys.argv[2].startswith("--help") and os.environ.get("FAKE_SERVE_PID"):
        with open(os.environ["FAKE_SERVE_PID"], "w") as f:
            f.write(str(os.getpid()))
        import time
        time.sleep(600)
    if "--help=all" in sys.argv:  # vLLM 0.26 lists a command's flags under --help=all only
        shown = FLAGS if sys.argv[1] == "bench" else SERVE_FLAGS
        print("usage: ...")
        for f in shown:
            if f != os.environ.get("FAKE_DROP_FLAG"):
                print(f"  {f} VALUE")
        raise SystemExit(0)
    assert sys.argv[1:3] == ["bench", "serve"], sys.argv
    ap = argparse.ArgumentParser()
    for flag, nargs in FLAGS.items():
        if nargs == 0:
            ap.add_argument(flag, action="store_true")
        else:
            ap.add_argument(flag, nargs=None if nargs == 1 else nargs)
    a = ap.parse_args(sys.argv[3:])
    data = json.load(open(os.environ["FAKE_RESULT"]))
    n = int(a.num_prompts)
    data.update(num_prompts=n, completed=n, total_output_tokens=n * int(a.random_output_len),
                total_input_tokens=n * int(a.random_input_len),
                max_concurrency=None if a.max_concurrency is None else int(a.max_concurrency),
                request_rate=a.request_rate or "inf", label=a.label)
    with open(os.path.join(a.result_dir, a.result_filename), "w") as f:
        json.dump(data, f)
    print("fake bench", a.result_filename, "pid", os.getpid())

if __name__ == "__main__":
    main()
'''


FAKE_TOKENIZERS = """
def get_tokenizer(name, **kwargs):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(name, local_files_only=True)
"""

FAKE_DATASETS = """
from dataclasses import dataclass


@dataclass
class SampleRequest:
    prompt: str
    prompt_len: int
    expected_output_len: int


class RandomDataset:
    # vLLM 0.26's RandomDataset, its offsets fixed: ids (offset + i + k) % allowed, decoded, re-encoded.
    def __init__(self, random_seed=0):
        self.seed = random_seed

    def sample(self, tokenizer, num_requests, input_len, output_len, **kwargs):
        special = set(tokenizer.all_special_ids)
        allowed = [i for i in range(tokenizer.vocab_size) if i not in special]
        real_len = input_len - tokenizer.num_special_tokens_to_add()
        out = []
        for i in range(num_requests):
            ids = [allowed[(7 * i + i + k) % len(allowed)] for k in range(real_len)]
            ids = tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False)[:real_len]
            out.append(SampleRequest(tokenizer.decode(ids), len(ids), output_len))
        return out
"""


@pytest.fixture
def stand_ins(tmp_path):
    """A ``--vllm-python`` wrapper whose ``vllm`` is a stand-in, and a folder to serve as the API."""
    pkg = tmp_path / "fake" / "vllm" / "entrypoints" / "cli"
    pkg.mkdir(parents=True)
    for folder in (pkg.parent.parent, pkg.parent, pkg):
        (folder / "__init__.py").write_text("")
    (pkg / "main.py").write_text(f"FLAGS = {BENCH_FLAGS!r}\nSERVE_FLAGS = {sorted(SERVE_FLAGS)!r}\n" + FAKE_CLI)
    vllm = pkg.parent.parent
    (vllm / "__init__.py").write_text('__version__ = "0.26.0+stand-in"\n')
    (vllm / "tokenizers.py").write_text(FAKE_TOKENIZERS)
    (vllm / "benchmarks").mkdir()
    (vllm / "benchmarks" / "__init__.py").write_text("")
    (vllm / "benchmarks" / "datasets.py").write_text(FAKE_DATASETS)
    vpy = tmp_path / "vpy"
    vpy.write_text(f'#!/bin/sh\nPYTHONPATH={tmp_path / "fake"} exec {sys.executable} "$@"\n')
    vpy.chmod(0o755)
    api = tmp_path / "api"
    (api / "v1").mkdir(parents=True)
    (api / "v1" / "models").write_text('{"data": [{"id": "m"}]}')
    return vpy, api


def job_for(tmp_path, vpy, api, *extra) -> tuple:
    args = svv.parse_args(["--model", f"m={tmp_path}", "--servers", "vllm", "--rows", "c2,r4", "--repeats", "2",
                           "--min-prompts", "2", "--max-prompts", "6", "--vllm-python", str(vpy),
                           "--out", str(tmp_path / "out"), "--ready-timeout-s", "60", *extra])
    (job,) = svv.make_jobs(args)
    job.command = [sys.executable, "-m", "http.server", str(job.port), "--bind", "127.0.0.1", "--directory", str(api)]
    return job, args


def port_closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.parametrize("client", ["in-process", "cli"])
def test_server_job_runs_the_plan_and_stops_the_server(tmp_path, stand_ins, monkeypatch, client):
    vpy, api = stand_ins
    monkeypatch.setenv("FAKE_RESULT", str(RESULT))
    job, args = job_for(tmp_path, vpy, api, "--client", client)
    info = svv.run_job(job, args, deadline=None)
    assert info["problems"] == [] and info["ready_s"] is not None
    assert [r["name"] for r in info["runs"]] == ["c64-cold", "c2-r1", "r4-r1", "c2-r2", "r4-r2"]
    assert all(r["event"] == "run" and r["error"] is None for r in info["runs"])
    assert port_closed(job.port)
    pids = {line.split()[-1] for line in (job.folder / "client.log").read_text().splitlines()
            if line.startswith("fake bench")}
    assert len(pids) == (1 if client == "in-process" else 5)
    summary = svv.summarize(svv.collect([args.out]))
    assert summary["problems"] == []
    rows = summary["models"]["m"]["rows"]
    assert set(rows) == {"c2", "c64", "r4"}
    assert rows["c2"]["vllm"]["steady"]["output_tok_s"]["n"] == 2 and rows["c64"]["vllm"]["cold"] is not None
    assert rows["c2"]["workload"]["num_prompts"] == 6 and rows["r4"]["workload"]["request_rate"] == "4.0"
    assert json.loads((job.folder / "server.json").read_text())["runs"] == info["runs"]


def test_server_job_past_deadline_skips_runs(tmp_path, stand_ins, monkeypatch):
    vpy, api = stand_ins
    monkeypatch.setenv("FAKE_RESULT", str(RESULT))
    job, args = job_for(tmp_path, vpy, api)
    info = svv.run_job(job, args, deadline=time.time() - 1)
    assert [r["event"] for r in info["runs"]] == ["skipped"] * 5
    assert not list(job.folder.glob("*-r1.json")) and port_closed(job.port)
    problems = svv.summarize(svv.collect([args.out]))["problems"]
    assert "m/vllm/c2-r1: skipped (past --deadline-s)" in problems and len(problems) == 5


def test_checkpoint_gets_a_tokenizer_and_a_missing_one_is_named(tmp_path):
    from transformers import AutoTokenizer

    spec = importlib.util.spec_from_file_location("make_random_model", REPO_ROOT / "scripts" / "make_random_model.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    maker.main([str(tmp_path / "bare"), "--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
                "--intermediate", "32", "--vocab", "100", "--dtype", "float32", "--no-tokenizer"])
    assert svv.ensure_checkpoint("bare", str(tmp_path / "bare"), create=False) == ["tokenizer written"]
    assert len(AutoTokenizer.from_pretrained(tmp_path / "bare", local_files_only=True)) == 100
    assert svv.ensure_checkpoint("bare", str(tmp_path / "bare"), create=False) == []
    with pytest.raises(SystemExit, match="--model llama1b=.*no config.json there; pass --create-missing"):
        svv.ensure_checkpoint("llama1b", str(tmp_path / "none"), create=False)
    with pytest.raises(SystemExit, match="write it with scripts/make_random_model.py"):
        svv.ensure_checkpoint("mine", str(tmp_path / "none"), create=True)


def test_server_that_exits_is_a_problem(tmp_path, stand_ins):
    vpy, api = stand_ins
    job, args = job_for(tmp_path, vpy, api)
    job.command = [sys.executable, "-c", "import sys; print('no GPU here'); "
                   "print('WARNING engine: first use after ready: prefill 7 tokens'); sys.exit(3)"]
    start = time.monotonic()
    info = svv.run_job(job, args, deadline=None)
    assert info["problems"] == ["the server exited with 3 (server.log)"] and info["ready_s"] is None
    assert info["first_uses_after_ready"] == ["prefill 7 tokens"]
    assert time.monotonic() - start < 30
    assert "no GPU here" in (job.folder / "server.log").read_text()
    plan = str(job.folder / "plan.json").encode()
    waiting = [p for p in Path("/proc").glob("[0-9]*/cmdline") if plan in _read(p)]
    assert waiting == []  # the client, still waiting for ready, was stopped with its process group


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def test_preflight_checks_flags_and_tokenizers(tmp_path, stand_ins, monkeypatch, capsys):
    vpy, _ = stand_ins
    spec = importlib.util.spec_from_file_location("make_random_model", REPO_ROOT / "scripts" / "make_random_model.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    maker.main([str(tmp_path / "tiny"), "--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
                "--intermediate", "32", "--vocab", "200", "--dtype", "float32"])
    capsys.readouterr()
    argv = ["--model", f"tiny={tmp_path / 'tiny'}", "--model", f"gone={tmp_path / 'gone'}", "--vllm-python", str(vpy),
            "--preflight"]
    assert svv.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["problems"] == [] and result["vllm_version"] == "0.26.0+stand-in"
    lens = result["tokenizers"][str(tmp_path / "tiny")]
    assert lens["served_prompt_lens"] == [512] * 8 and lens["client_prompt_lens"] == [511] * 8
    assert result["models_not_found"] == [str(tmp_path / "gone")]

    monkeypatch.setenv("FAKE_DROP_FLAG", "--metric-percentiles")
    assert svv.main(argv) == 1
    assert json.loads(capsys.readouterr().out)["problems"] == [
        "vllm bench serve --help=all lists none of ['--metric-percentiles']"]
    monkeypatch.setenv("FAKE_DROP_FLAG", "--max-num-seqs")
    assert svv.main(argv) == 0
    assert "--max-num-seqs" in json.loads(capsys.readouterr().out)["warnings"][0]


def test_sigterm_stops_the_server(tmp_path, stand_ins):
    """A time limit's SIGTERM to the script stops the server it started (its process group)."""
    import signal
    import subprocess

    vpy, _ = stand_ins
    spec = importlib.util.spec_from_file_location("make_random_model", REPO_ROOT / "scripts" / "make_random_model.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    maker.main([str(tmp_path / "tiny"), "--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
                "--intermediate", "32", "--vocab", "100", "--dtype", "float32"])
    pid_file = tmp_path / "serve.pid"
    script = subprocess.Popen(
        [sys.executable, str(REPO_ROOT / "scripts" / "serve_vs_vllm.py"), "--model", f"m={tmp_path / 'tiny'}",
         "--servers", "vllm", "--vllm-python", str(vpy), "--out", str(tmp_path / "out")],
        env={**os.environ, "FAKE_SERVE_PID": str(pid_file)}, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.2)
        server_pid = int(pid_file.read_text())
        script.send_signal(signal.SIGTERM)
        assert script.wait(timeout=60) == 143
    finally:
        script.kill()
    with pytest.raises(ProcessLookupError):
        os.kill(server_pid, 0)
    info = json.loads((tmp_path / "out" / "m" / "vllm" / "server.json").read_text())
    assert info["ready_s"] is None and info["problems"] == ["interrupted (SystemExit)"]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["problems"] == ["m/vllm: interrupted (SystemExit)"]
