"""``pprun serve`` against ``vllm serve`` through vLLM's own serving client, ``vllm bench serve``:
one checkpoint at a time, one server at a time, on one GPU.  Prints one JSON object (and writes it
with a markdown table to ``--out``).

    python scripts/serve_vs_vllm.py --model llama1b=/tmp/llama1b --vllm-python /tmp/vpy --out /tmp/svv
    python scripts/serve_vs_vllm.py --model qwen3-8b --model qwen3-30b-a3b-24l --create-missing \\
        --vllm-python /tmp/vpy --out /tmp/svv --deadline-s 480
    python scripts/serve_vs_vllm.py --report /tmp/svv [more result folders]      # tables from saved results
    python scripts/serve_vs_vllm.py --model llama1b --dry-run                         # the commands, nothing run
    python scripts/serve_vs_vllm.py --model llama1b --vllm-python /tmp/vpy --preflight  # vLLM's flags, the tokenizer

For each ``--model NAME[=DIR]`` and each of ``--servers`` (pprun, then vLLM): start the server
(pprun: ``python -m pprun serve model=local model.model=DIR model.dtype=bfloat16 device=cuda
parallel=single scheduler.max_num_seqs=256 model.max_model_len=1024 serve.http_port=P ...``;
vLLM: ``--vllm-python -m vllm.entrypoints.cli.main serve DIR --dtype bfloat16 --max-num-seqs 256
--max-model-len 1024 --disable-uvicorn-access-log ...``, pprun's HTTP server keeping no access log
either), both under the served name NAME; wait until ``GET /v1/models`` answers 200 (ready); run
the benchmark plan with vLLM's client; stop the server with SIGTERM to its process group (SIGKILL
after ``--stop-timeout-s``).  ``--pprun-arg KEY=VALUE`` and ``--vllm-arg=--flag=value`` add to a
server's command line.

The plan, the same for both servers (same prompts: each run has its own ``--seed``, the same for
both, so no run reuses another's prompts from a prefix cache): first the ``--cold-row`` workload
once, the first request after ready (the "cold" run), then every row of ``--rows`` once, and again
for each of ``--repeats`` (the "steady" runs).  A row ``cN`` is ``--max-concurrency N`` (closed
loop) with ``4N`` prompts, at least ``--min-prompts``, at most ``--max-prompts``; ``rR`` is
``--request-rate R`` (Poisson arrivals) with ``R x --rate-window-s`` (6) prompts within the same
bounds; ``rinf`` sends ``2 x --max-num-seqs`` prompts at once.  Every run is ``--backend openai
--endpoint /v1/completions --dataset-name random --random-input-len 512 --random-output-len 128
--ignore-eos --percentile-metrics ttft,tpot,itl --metric-percentiles 50,99 --save-result``; the
tokenizer is the checkpoint's (``scripts/make_random_model.py`` writes a word tokenizer whose ids
round-trip through text, so a prompt is 511 words plus ``<s>``: 512 tokens on both servers, as
each server's ``usage.prompt_tokens`` tells and the summary checks).

vLLM's client runs in ``--vllm-python`` (its environment, ``PYTHONPATH`` of this process left
out: a wrapper script that sets its own is the usual ``--vllm-python``).  By default one client
process per server runs every bench of the plan (``--client in-process``: this script, run by
``--vllm-python``, calls vLLM's CLI entry point ``vllm.entrypoints.cli.main.main`` once per run
with that run's ``vllm bench serve`` arguments, so vLLM is imported once, while the server starts,
and not once per run); ``--client cli`` starts ``python -m vllm.entrypoints.cli.main bench serve``
per run instead (and is what in-process falls back to when the entry point does not import).

Results: ``--out/NAME/SERVER/ROW-cold.json`` and ``ROW-rK.json`` (vLLM's own result files, kept
as written), ``server.log``, ``client.log`` (vLLM's printed results), ``client.jsonl`` (each run's
exit and wall time), ``server.json`` (command, seconds to ready, problems, and what pprun logged
as a first use after ready: what made its cold run slower, if anything did); ``summary.json`` and
``summary.md`` over everything in ``--out``, written also when a SIGTERM ends the script (which
stops the server first).  Per row and server: the cold run, and the steady
runs' median with min-max of output tok/s, TTFT p50/p99, TPOT p50/p99, ITL p99 and the
streamed events per answer (:func:`events_per_answer`; fewer than the tokens where a server
merges what a client has not yet been sent, which lengthens its ITL, not its TPOT); pprun/vLLM
ratios of the steady medians; pprun's cold over its steady output rate; and the ``targets``
(steady output tok/s pprun/vLLM >= 1.2 and TTFT p99 pprun <= vLLM's, on the rows whose output rate
the arrivals do not fix, ``cN`` and ``rinf``; pprun cold >= 0.85 x its steady).  A run that
failed requests, fell short of its prompts or of 128 tokens each, or whose prompts the server
counted at another length than 512, is listed under ``problems``.

``--create-missing`` writes a checkpoint that is not there with ``scripts/make_random_model.py
--device cuda`` (``llama1b``, ``qwen3-8b``, ``qwen3-30b-a3b-24l``, ``qwen3-30b-a3b``: the
``MODELS`` below); a checkpoint without a tokenizer gets the word tokenizer written beside it
either way; ``--remove-created`` deletes what it wrote once that model's servers are done (the
three checkpoints take about 50 GB).  ``--deadline-s`` starts no run (nor checkpoint, nor server)
past that many seconds after the script started and kills what still runs 45 s later (its server
then gets 10 s to stop), so one invocation fits a time limit; what ran is kept.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SERVERS = ("pprun", "vllm")
DEFAULT_ROWS = "c1,c16,c64,c256,r8,r32,rinf"
MODELS: dict[str, list[str]] = {
    "llama1b": [],
    "qwen3-8b": ["--preset", "qwen3-8b"],
    "qwen3-30b-a3b-24l": ["--preset", "qwen3-30b-a3b", "--num-layers", "24"],
    "qwen3-30b-a3b": ["--preset", "qwen3-30b-a3b"],
}
"""``--model NAME`` without a folder: ``/tmp/NAME``, and the ``make_random_model.py`` options that
write it (``--create-missing``)."""

METRICS: dict[str, tuple[str, ...]] = {
    "output_tok_s": ("output_throughput",),
    "ttft_p50_ms": ("p50_ttft_ms", "median_ttft_ms"),
    "ttft_p99_ms": ("p99_ttft_ms",),
    "tpot_p50_ms": ("p50_tpot_ms", "median_tpot_ms"),
    "tpot_p99_ms": ("p99_tpot_ms",),
    "itl_p99_ms": ("p99_itl_ms",),
}
"""Reported metric -> the keys of vLLM's saved result that hold it (first present wins)."""

REPORTED = (*METRICS, "events_per_answer")
"""Every metric of a run: those of :data:`METRICS` and ``events_per_answer``, the mean number of
streamed events (SSE chunks holding text) per answer, derived in :func:`read_result`."""

DEADLINE_GRACE_S = 45
"""How long past ``--deadline-s`` a run may still go before it is killed (the server then gets
10 s to stop)."""
THROUGHPUT_TARGET = 1.2
COLD_TARGET = 0.85
FIRST_USE = re.compile(r"first use after ready: (.*)$")
"""What pprun logs when something compiles, captures or loads for the first time after ready
(``pprun.utils.first_use``): the cold run's suspects."""
RUN_FILE = re.compile(r"^(?P<row>c\d+|r(?:\d+(?:\.\d+)?|inf))-(?P<kind>cold|r\d+)\.json$")


# --- the plan ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One workload: closed loop at ``concurrency``, or arrivals at ``rate`` per second."""

    name: str
    concurrency: int | None
    rate: float

    @property
    def arrival_bound(self) -> bool:
        """Whether the arrivals, not the server, set the output rate (a finite ``rate``)."""
        return self.concurrency is None and math.isfinite(self.rate)


def parse_row(text: str) -> Row:
    """``cN`` (``--max-concurrency N``), ``rR`` (``--request-rate R``) or ``rinf``."""
    m = re.fullmatch(r"c(\d+)|r(inf|\d+(?:\.\d+)?)", text.strip())
    if m is None:
        raise ValueError(f"row {text!r} is invalid: rows are cN (max concurrency N, e.g. c64), "
                         "rR (Poisson request rate R per second, e.g. r8) or rinf (all at once)")
    if m.group(1) is not None:
        concurrency = int(m.group(1))
        if concurrency < 1:
            raise ValueError(f"row {text!r} is invalid: the concurrency must be at least 1")
        return Row(f"c{concurrency}", concurrency, math.inf)
    rate = math.inf if m.group(2) == "inf" else float(m.group(2))
    if rate <= 0:
        raise ValueError(f"row {text!r} is invalid: the request rate must be positive")
    return Row("rinf" if math.isinf(rate) else f"r{m.group(2)}", None, rate)


def num_prompts(row: Row, *, min_prompts: int, max_prompts: int, rate_window_s: float, max_num_seqs: int) -> int:
    """Prompts of one run of ``row`` (module docstring)."""
    if row.concurrency is not None:
        wanted = 4 * row.concurrency
    elif math.isinf(row.rate):
        wanted = 2 * max_num_seqs
    else:
        wanted = round(row.rate * rate_window_s)
    return max(min_prompts, min(max_prompts, wanted))


@dataclass
class Run:
    """One ``vllm bench serve`` of a plan."""

    name: str
    row: Row
    kind: str
    """``cold`` or ``rK`` (the K-th steady run)."""
    seed: int
    num_prompts: int


@dataclass
class Settings:
    """What every run and server of one invocation share."""

    input_len: int = 512
    output_len: int = 128
    max_num_seqs: int = 256
    max_model_len: int = 1024
    temperature: float | None = None
    seed: int = 0


def plan_runs(rows: list[Row], cold: Row | None, repeats: int, settings: Settings, **prompt_bounds) -> list[Run]:
    """The cold run (if any), then ``repeats`` passes over ``rows``; seeds ``settings.seed + i``."""
    runs: list[Run] = []

    def add(row: Row, kind: str) -> None:
        n = num_prompts(row, max_num_seqs=settings.max_num_seqs, **prompt_bounds)
        runs.append(Run(f"{row.name}-{kind}", row, kind, settings.seed + len(runs), n))

    if cold is not None:
        add(cold, "cold")
    for k in range(1, repeats + 1):
        for row in rows:
            add(row, f"r{k}")
    return runs


def bench_args(run: Run, *, base_url: str, model_name: str, tokenizer: str, result_dir: Path, label: str,
               settings: Settings) -> list[str]:
    """The arguments after ``vllm bench serve`` for ``run``."""
    args = ["--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", model_name, "--tokenizer", tokenizer, "--dataset-name", "random",
            "--random-input-len", str(settings.input_len), "--random-output-len", str(settings.output_len),
            "--ignore-eos", "--num-prompts", str(run.num_prompts), "--seed", str(run.seed)]
    if run.row.concurrency is not None:
        args += ["--max-concurrency", str(run.row.concurrency)]
    else:
        args += ["--request-rate", "inf" if math.isinf(run.row.rate) else repr(run.row.rate)]
    if settings.temperature is not None:
        args += ["--temperature", repr(settings.temperature)]
    args += ["--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99", "--disable-tqdm",
             "--label", label, "--metadata", f"server={label}", f"run={run.name}",
             "--save-result", "--result-dir", str(result_dir), "--result-filename", f"{run.name}.json"]
    return args


def pprun_command(python: str, model_dir: str, model_name: str, port: int, settings: Settings,
                  extra: list[str]) -> list[str]:
    """``pprun serve`` on one GPU, one stage, its OpenAI HTTP API on ``port``."""
    return [python, "-m", "pprun", "serve", "model=local", f"model.model={model_dir}", "model.dtype=bfloat16",
            "device=cuda", "parallel=single", f"scheduler.max_num_seqs={settings.max_num_seqs}",
            f"model.max_model_len={settings.max_model_len}", f"serve.http_port={port}", "serve.port=0",
            f"serve.model_name={model_name}", *extra]


def vllm_command(python: str, model_dir: str, model_name: str, port: int, settings: Settings,
                 extra: list[str]) -> list[str]:
    """``vllm serve`` with the same limits, without uvicorn's access log (pprun keeps none)."""
    return [python, "-m", "vllm.entrypoints.cli.main", "serve", model_dir, "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", model_name, "--dtype", "bfloat16",
            "--max-num-seqs", str(settings.max_num_seqs), "--max-model-len", str(settings.max_model_len),
            "--disable-uvicorn-access-log", *extra]


def parse_model(text: str) -> tuple[str, str]:
    """``NAME=DIR``, or ``NAME`` of :data:`MODELS` (folder ``/tmp/NAME``)."""
    name, sep, folder = text.partition("=")
    if not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        raise ValueError(f"--model {text!r} is invalid: NAME (letters, digits, '.', '_', '-') or NAME=DIR")
    if not sep:
        if name not in MODELS:
            raise ValueError(f"--model {text!r}: give NAME=DIR, or one of {sorted(MODELS)} (folder /tmp/NAME)")
        folder = f"/tmp/{name}"
    return name, folder


# --- the command line --------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring); errors name the option and what it takes."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", default=[], metavar="NAME[=DIR]",
                    help=f"a checkpoint (repeatable); NAME alone is one of {sorted(MODELS)} in /tmp/NAME")
    ap.add_argument("--servers", default="pprun,vllm", help="which servers, in this order (default pprun,vllm)")
    ap.add_argument("--rows", default=DEFAULT_ROWS, help=f"workloads (default {DEFAULT_ROWS})")
    ap.add_argument("--cold-row", default="c64", help="the cold run's workload (default c64); 'none': no cold run")
    ap.add_argument("--repeats", type=int, default=2, help="steady runs per row (default 2)")
    ap.add_argument("--min-prompts", type=int, default=32)
    ap.add_argument("--max-prompts", type=int, default=1024)
    ap.add_argument("--rate-window-s", type=float, default=6.0, help="a rate row's prompts: rate x this")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--temperature", type=float, default=None,
                    help="sent with every request (default: none, each server's default, 1.0 for both)")
    ap.add_argument("--seed", type=int, default=0, help="the first run's --seed; run i gets seed + i")
    ap.add_argument("--vllm-python", default=None,
                    help="the interpreter (or a wrapper script) with vLLM and aiohttp; default this one")
    ap.add_argument("--pprun-python", default=sys.executable)
    ap.add_argument("--pprun-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="an extra pprun serve override (repeatable)")
    ap.add_argument("--vllm-arg", action="append", default=[], metavar="FLAG",
                    help="an extra vllm serve argument (repeatable; --vllm-arg=--flag=value)")
    ap.add_argument("--client", choices=("in-process", "cli"), default="in-process")
    ap.add_argument("--out", type=Path, default=Path("/tmp/serve_vs_vllm"))
    ap.add_argument("--create-missing", action="store_true",
                    help="write a missing checkpoint with scripts/make_random_model.py --device cuda")
    ap.add_argument("--remove-created", action="store_true",
                    help="delete a checkpoint --create-missing wrote once its servers are done (disk space)")
    ap.add_argument("--ready-timeout-s", type=float, default=600.0)
    ap.add_argument("--stop-timeout-s", type=float, default=60.0)
    ap.add_argument("--run-timeout-s", type=float, default=600.0, help="longest one bench run may take")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="start no run this many seconds after the start; kill what runs 60 s later")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and commands; start nothing")
    ap.add_argument("--preflight", action="store_true",
                    help="check in --vllm-python, without servers, that vLLM takes every flag of the plan and "
                         "that each existing checkpoint's tokenizer gives --input-len token prompts")
    ap.add_argument("--report", nargs="+", type=Path, metavar="DIR",
                    help="only summarize saved results (folders written by --out)")
    args = ap.parse_args(argv)
    if args.report:
        return args
    try:
        args.models = [parse_model(m) for m in args.model]
        args.server_list = [s.strip() for s in args.servers.split(",") if s.strip()]
        args.row_list = [parse_row(r) for r in args.rows.split(",") if r.strip()]
        args.cold = None if args.cold_row == "none" else parse_row(args.cold_row)
    except ValueError as e:
        ap.error(str(e))
    if not args.models:
        ap.error("--model is required (NAME=DIR or one of " + ", ".join(sorted(MODELS)) + "), or --report DIR")
    if len({name for name, _ in args.models}) != len(args.models):
        ap.error(f"--model names must differ: {[name for name, _ in args.models]}")
    unknown = [s for s in args.server_list if s not in SERVERS]
    if unknown or not args.server_list or len(set(args.server_list)) != len(args.server_list):
        ap.error(f"--servers={args.servers!r} is invalid: a comma-separated list of distinct {'/'.join(SERVERS)}")
    if not args.row_list:
        ap.error("--rows is empty")
    for key in ("repeats", "min_prompts", "max_prompts", "input_len", "output_len", "max_num_seqs", "max_model_len"):
        minimum = 0 if key == "repeats" else 1
        if getattr(args, key) < minimum:
            ap.error(f"--{key.replace('_', '-')}={getattr(args, key)} must be at least {minimum}")
    if args.min_prompts > args.max_prompts:
        ap.error(f"--min-prompts={args.min_prompts} is above --max-prompts={args.max_prompts}")
    if args.input_len + args.output_len > args.max_model_len:
        ap.error(f"--input-len={args.input_len} + --output-len={args.output_len} exceeds "
                 f"--max-model-len={args.max_model_len}")
    if args.rate_window_s <= 0:
        ap.error(f"--rate-window-s={args.rate_window_s} must be positive")
    if args.repeats == 0 and args.cold is None:
        ap.error("--repeats=0 with --cold-row=none runs nothing")
    bad = [a for a in args.pprun_arg if "=" not in a]
    if bad:
        ap.error(f"--pprun-arg {bad[0]!r} is invalid: KEY=VALUE (a pprun serve override)")
    args.vllm_python = args.vllm_python or sys.executable
    args.settings = Settings(input_len=args.input_len, output_len=args.output_len, max_num_seqs=args.max_num_seqs,
                             max_model_len=args.max_model_len, temperature=args.temperature, seed=args.seed)
    return args


# --- running -----------------------------------------------------------------------------------


def log(message: str) -> None:
    print(f"[serve_vs_vllm {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
"""Set for the servers and the client unless set already: local checkpoints only, nothing sent out
(a machine without network would otherwise wait on connection attempts)."""


def server_env(server: str) -> dict[str, str]:
    """The environment of a server or the client: this one with :data:`OFFLINE_ENV`, less
    ``PYTHONPATH`` (pprun's) for vLLM's interpreter."""
    env = {**OFFLINE_ENV, **os.environ}
    if server != "pprun":
        env.pop("PYTHONPATH", None)
    return env


def ensure_checkpoint(name: str, folder: str, create: bool) -> list[str]:
    """The checkpoint in ``folder`` with a tokenizer: written if missing and ``create``; a tokenizer
    written beside weights that have none.  Returns what was done."""
    path = Path(folder)
    done: list[str] = []
    if not (path / "config.json").is_file():
        if not create or name not in MODELS:
            how = ("pass --create-missing" if name in MODELS else
                   f"write it with scripts/make_random_model.py {folder} --device cuda [--preset ...]")
            raise SystemExit(f"--model {name}={folder}: no config.json there; {how}")
        cmd = [sys.executable, str(REPO_ROOT / "scripts" / "make_random_model.py"), folder, "--device", "cuda",
               *MODELS[name]]
        log("writing " + shlex.join(cmd))
        subprocess.run(cmd, check=True)
        done.append("created: " + shlex.join(cmd))
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        import importlib.util

        spec = importlib.util.spec_from_file_location("make_random_model", REPO_ROOT / "scripts" / "make_random_model.py")
        maker = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(maker)
        config = json.loads((path / "config.json").read_text())
        config = config.get("text_config", config)
        maker.write_word_tokenizer(path, config["vocab_size"], config.get("max_position_embeddings", 4096))
        log(f"{folder}: no tokenizer; wrote the word tokenizer over its {config['vocab_size']} ids")
        done.append("tokenizer written")
    return done


def stop_group(proc: subprocess.Popen, timeout_s: float) -> int | None:
    """SIGTERM to ``proc``'s process group, SIGKILL to what is left after ``timeout_s``."""
    pgid = proc.pid  # started with start_new_session: the group is the leader's pid
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 30.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            proc.poll()
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return proc.returncode
            time.sleep(0.2)
    return proc.poll()


@dataclass
class ServerJob:
    """One server of one model, and its runs."""

    model: str
    model_dir: str
    server: str
    port: int
    command: list[str]
    runs: list[Run]
    folder: Path
    bench: dict[str, list[str]] = field(default_factory=dict)
    """Run name -> its ``vllm bench serve`` arguments."""


def make_jobs(args: argparse.Namespace) -> list[ServerJob]:
    """Every (model, server) of the invocation, in order, with its runs' bench arguments."""
    jobs = []
    runs = plan_runs(args.row_list, args.cold, args.repeats, args.settings, min_prompts=args.min_prompts,
                     max_prompts=args.max_prompts, rate_window_s=args.rate_window_s)
    for name, folder in args.models:
        for server in args.server_list:
            port = free_port()
            if server == "pprun":
                command = pprun_command(args.pprun_python, folder, name, port, args.settings, args.pprun_arg)
            else:
                command = vllm_command(args.vllm_python, folder, name, port, args.settings, args.vllm_arg)
            job = ServerJob(name, folder, server, port, command, runs, args.out / name / server)
            for run in runs:
                job.bench[run.name] = bench_args(run, base_url=f"http://127.0.0.1:{port}", model_name=name,
                                                 tokenizer=folder, result_dir=job.folder, label=server,
                                                 settings=args.settings)
            jobs.append(job)
    return jobs


def run_job(job: ServerJob, args: argparse.Namespace, deadline: float | None) -> dict:
    """Start the server, run the plan through vLLM's client, stop the server; ``server.json``."""
    job.folder.mkdir(parents=True, exist_ok=True)
    for old in job.folder.glob("*.json"):
        old.unlink()  # a rerun of this model and server replaces its results
    status_path = job.folder / "client.jsonl"
    status_path.unlink(missing_ok=True)
    plan = {"base_url": f"http://127.0.0.1:{job.port}", "ready_timeout_s": args.ready_timeout_s,
            "deadline": deadline, "client": args.client, "status": str(status_path),
            "runs": [{"name": run.name, "args": job.bench[run.name]} for run in job.runs]}
    plan_path = job.folder / "plan.json"
    plan_path.write_text(json.dumps(plan, indent=2))
    info: dict = {"model": job.model, "model_dir": job.model_dir, "server": job.server,
                  "command": job.command, "problems": []}
    log(f"{job.model}/{job.server}: " + shlex.join(job.command))
    t0 = time.time()
    stop_timeout_s = args.stop_timeout_s
    with open(job.folder / "server.log", "w") as server_log, open(job.folder / "client.log", "w") as client_log:
        server = subprocess.Popen(job.command, stdout=server_log, stderr=subprocess.STDOUT,
                                  env=server_env(job.server), start_new_session=True, cwd=REPO_ROOT)
        client = subprocess.Popen([args.vllm_python, str(Path(__file__).resolve()), "--driver", str(plan_path)],
                                  stdout=client_log, stderr=subprocess.STDOUT, env=server_env("client"),
                                  start_new_session=True)
        interrupted: BaseException | None = None
        try:
            while client.poll() is None:
                if server.poll() is not None:
                    info["problems"].append(f"the server exited with {server.returncode} (server.log)")
                    break
                if deadline is not None and time.time() > deadline + DEADLINE_GRACE_S:
                    info["problems"].append(f"killed {DEADLINE_GRACE_S} s past --deadline-s")
                    stop_timeout_s = min(stop_timeout_s, 10.0)
                    break
                # The driver writes an event when ready and after each run: a silence longer than
                # the ready timeout (before) or --run-timeout-s (after) is a hang.
                last = status_path.stat().st_mtime if status_path.exists() else None
                limit = t0 + args.ready_timeout_s + 30 if last is None else last + args.run_timeout_s
                if time.time() > limit:
                    info["problems"].append("killed: no progress for --run-timeout-s" if last else
                                            "killed: not ready within --ready-timeout-s")
                    break
                time.sleep(0.5)
        except (KeyboardInterrupt, SystemExit) as e:  # SIGINT, or SIGTERM through main's handler
            info["problems"].append(f"interrupted ({type(e).__name__})")
            interrupted = e
        finally:
            if client.poll() is None:
                stop_group(client, 5.0)
            info["server_exit"] = stop_group(server, stop_timeout_s)
    events = [json.loads(line) for line in status_path.read_text().splitlines()] if status_path.exists() else []
    ready = next((e for e in events if e["event"] == "ready"), None)
    info["ready_s"] = round(ready["time"] - t0, 1) if ready else None
    info["runs"] = [e for e in events if e["event"] in ("run", "skipped")]
    info["problems"] += [e["error"] for e in events if e.get("error")]
    info["wall_s"] = round(time.time() - t0, 1)
    log_text = (job.folder / "server.log").read_text(errors="replace")
    info["first_uses_after_ready"] = [m.group(1) for line in log_text.splitlines() if (m := FIRST_USE.search(line))]
    (job.folder / "server.json").write_text(json.dumps(info, indent=2))
    log(f"{job.model}/{job.server}: ready in {info['ready_s']} s, {sum(e['event'] == 'run' for e in events)} runs, "
        f"{info['wall_s']} s in all" + (f"; problems: {info['problems']}" if info["problems"] else ""))
    if interrupted is not None:
        raise interrupted
    return info


def drive(plan_path: str) -> int:
    """The client side, run by ``--vllm-python``: wait for ready, then each run's bench."""
    plan = json.loads(Path(plan_path).read_text())
    status = open(plan["status"], "a")

    def emit(**event) -> None:
        status.write(json.dumps(event) + "\n")
        status.flush()

    entry = None
    if plan["client"] == "in-process":
        try:
            from vllm.entrypoints.cli.main import main as entry
        except Exception as e:  # noqa: BLE001 - any import failure: fall back to one process per run
            emit(event="note", text=f"in-process client unavailable ({type(e).__name__}: {e}); one process per run")
    url = plan["base_url"] + "/v1/models"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy
    t0 = time.monotonic()
    while True:
        try:
            with opener.open(url, timeout=5) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() - t0 > plan["ready_timeout_s"]:
            emit(event="error", error=f"not ready after {plan['ready_timeout_s']} s")
            return 1
        time.sleep(0.5)
    emit(event="ready", time=time.time())
    for run in plan["runs"]:
        if plan["deadline"] is not None and time.time() > plan["deadline"]:
            emit(event="skipped", name=run["name"], reason="past --deadline-s")
            continue
        start = time.time()
        error = None
        print(f"=== {run['name']}: vllm bench serve {shlex.join(run['args'])}", flush=True)
        if entry is not None:
            sys.argv = ["vllm", "bench", "serve", *run["args"]]
            try:
                entry()
            except SystemExit as e:
                if e.code not in (None, 0):
                    error = f"{run['name']}: vllm bench serve exited with {e.code}"
            except Exception as e:  # noqa: BLE001 - one failed run must not end the plan
                error = f"{run['name']}: {type(e).__name__}: {e}"
        else:
            cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", *run["args"]]
            rc = subprocess.run(cmd, stdout=sys.stdout, stderr=subprocess.STDOUT).returncode
            if rc:
                error = f"{run['name']}: vllm bench serve exited with {rc}"
        sys.stdout.flush()
        emit(event="run", name=run["name"], wall_s=round(time.time() - start, 2), error=error)
    status.close()
    return 0


# --- results -----------------------------------------------------------------------------------


def read_result(data: dict) -> dict:
    """The reported metrics of one vLLM result (``None`` where it lacks one) and its workload."""
    out: dict = {}
    for name, keys in METRICS.items():
        out[name] = next((float(data[k]) for k in keys if data.get(k) is not None), None)
    completed = data.get("completed") or 0
    out["events_per_answer"] = events_per_answer(data)
    out.update(
        completed=completed, failed=data.get("failed"), num_prompts=data.get("num_prompts"),
        duration_s=data.get("duration"), total_output_tokens=data.get("total_output_tokens"),
        mean_input_tokens=(data["total_input_tokens"] / completed) if completed and data.get("total_input_tokens")
        else None,
        max_concurrency=data.get("max_concurrency"), request_rate=data.get("request_rate"))
    return out


def events_per_answer(data: dict) -> float | None:
    """The mean number of streamed events per answer, from a result's means: a request's ITLs
    (one per event after the first) sum to its latency less its TTFT, which is its TPOT x
    (output tokens - 1); with every answer equally long (``--ignore-eos``) that gives
    ``1 + mean_tpot x (tokens - 1) / mean_itl``.  A server that sends one event per token
    gives the token count; one that merges tokens a client has not yet been sent, fewer.
    None unless the result has both means and its output tokens divide evenly among its answers
    (with ``--ignore-eos``, every answer is ``--random-output-len`` long)."""
    completed, tokens = data.get("completed"), data.get("total_output_tokens")
    tpot, itl = data.get("mean_tpot_ms"), data.get("mean_itl_ms")
    if not completed or not tokens or tokens % completed or not tpot or not itl:
        return None
    per_answer = tokens // completed
    return 1 + tpot * (per_answer - 1) / itl if per_answer > 1 else 1.0


def run_problems(where: str, result: dict, output_len: int | None, input_len: int | None = None) -> list[str]:
    """What makes a run's figures doubtful: failures, fewer answers than prompts, short outputs,
    prompts of another length than ``input_len`` by the server's own count (vLLM 0.26's client
    takes each answer's ``usage.prompt_tokens``)."""
    problems = []
    if result.get("failed"):
        problems.append(f"{where}: {result['failed']} failed requests")
    if result.get("num_prompts") is not None and result["completed"] != result["num_prompts"]:
        problems.append(f"{where}: {result['completed']} of {result['num_prompts']} prompts completed")
    if output_len and result["completed"] and result.get("total_output_tokens") is not None \
            and result["total_output_tokens"] != result["completed"] * output_len:
        problems.append(f"{where}: {result['total_output_tokens']} output tokens, not "
                        f"{result['completed']} x {output_len}")
    mean_input = result.get("mean_input_tokens")
    if input_len and mean_input is not None and abs(mean_input - input_len) > 0.5:
        problems.append(f"{where}: prompts of {mean_input:.1f} tokens on average, not {input_len}")
    missing = [k for k in METRICS if result.get(k) is None]
    if missing:
        problems.append(f"{where}: no {', '.join(missing)} in the result")
    return problems


def collect(folders: list[Path]) -> dict:
    """``{model: {server: {"runs": {run name: result}, "server": server.json}}}`` of every result
    file under ``folders`` (``MODEL/SERVER/ROW-KIND.json``); a later folder's run of the same name
    replaces an earlier one."""
    found: dict = {}
    for top in folders:
        for path in sorted(top.glob("*/*/*.json")):
            model, server = path.parent.parent.name, path.parent.name
            if server not in SERVERS:
                continue
            entry = found.setdefault(model, {}).setdefault(server, {"runs": {}, "server": None})
            if path.name == "server.json":
                entry["server"] = json.loads(path.read_text())
            elif RUN_FILE.match(path.name):
                entry["runs"][path.stem] = read_result(json.loads(path.read_text()))
    return found


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize(found: dict, output_len: int | None = 128, input_len: int | None = 512) -> dict:
    """Per model and row: each server's cold run and steady median/min/max, the pprun/vLLM ratios,
    cold over steady, the targets and the problems (module docstring)."""
    summary: dict = {"models": {}, "targets": [], "problems": []}
    for model in sorted(found):
        servers = found[model]
        rows: dict = {}
        for server, entry in servers.items():
            job = entry["server"] or {}
            summary["problems"] += [f"{model}/{server}: {p}" for p in job.get("problems", [])]
            summary["problems"] += [f"{model}/{server}/{r['name']}: skipped ({r.get('reason')})"
                                    for r in job.get("runs", []) if r.get("event") == "skipped"]
            for run_name, result in entry["runs"].items():
                row_name, kind = run_name.rsplit("-", 1)
                summary["problems"] += run_problems(f"{model}/{server}/{run_name}", result, output_len, input_len)
                slot = rows.setdefault(row_name, {"workload": None}).setdefault(server, {"cold": None, "steady": []})
                rows[row_name]["workload"] = rows[row_name]["workload"] or {
                    k: result[k] for k in ("num_prompts", "max_concurrency", "request_rate")}
                if kind == "cold":
                    slot["cold"] = {k: result.get(k) for k in REPORTED}
                else:
                    slot["steady"].append(result)
        model_out: dict = {"servers": {s: {k: (e["server"] or {}).get(k) for k in
                                           ("ready_s", "wall_s", "command", "first_uses_after_ready")}
                                       for s, e in servers.items()}, "rows": {}}
        for row_name in sorted(rows, key=row_order):
            row = rows[row_name]
            out: dict = {"workload": row["workload"]}
            for server in SERVERS:
                if server not in row:
                    continue
                slot = row[server]
                steady = {k: spread([r[k] for r in slot["steady"] if r.get(k) is not None])
                          for k in REPORTED if any(r.get(k) is not None for r in slot["steady"])}
                out[server] = {"cold": slot["cold"], "steady": steady}
                cold_rate, steady_rate = (slot["cold"] or {}).get("output_tok_s"), steady.get("output_tok_s")
                if cold_rate and steady_rate:
                    out[server]["cold_over_steady"] = cold_rate / steady_rate["median"]
            both = all(s in out and out[s]["steady"] for s in SERVERS)
            if both:
                out["ratio"] = {k: out["pprun"]["steady"][k]["median"] / out["vllm"]["steady"][k]["median"]
                                for k in REPORTED if k in out["pprun"]["steady"] and k in out["vllm"]["steady"]
                                and out["vllm"]["steady"][k]["median"]}
            model_out["rows"][row_name] = out
            summary["targets"] += row_targets(model, row_name, out)
        summary["models"][model] = model_out
    return summary


def row_order(name: str) -> tuple[int, float]:
    """Concurrency rows first, by concurrency, then rate rows by rate."""
    row = parse_row(name)
    return (0, row.concurrency) if row.concurrency is not None else (1, row.rate)


def row_targets(model: str, row_name: str, out: dict) -> list[dict]:
    """The issue's targets on one row (throughput and TTFT only where the arrivals do not set the
    output rate; cold over steady where pprun has both)."""
    targets = []
    ratio = out.get("ratio", {})
    if not parse_row(row_name).arrival_bound:
        if "output_tok_s" in ratio:
            targets.append({"model": model, "row": row_name, "check": f"steady output tok/s pprun/vLLM >= {THROUGHPUT_TARGET}",
                            "value": ratio["output_tok_s"], "pass": ratio["output_tok_s"] >= THROUGHPUT_TARGET})
        if "ttft_p99_ms" in ratio:
            targets.append({"model": model, "row": row_name, "check": "steady TTFT p99 pprun <= vLLM (ratio <= 1)",
                            "value": ratio["ttft_p99_ms"], "pass": ratio["ttft_p99_ms"] <= 1.0})
    cold = out.get("pprun", {}).get("cold_over_steady")
    if cold is not None:
        targets.append({"model": model, "row": row_name, "check": f"pprun cold / steady output tok/s >= {COLD_TARGET}",
                        "value": cold, "pass": cold >= COLD_TARGET})
    return targets


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"


def _pair(out: dict, kind: str, metric: str) -> str:
    """``pprun / vLLM`` of one metric (steady medians, or the cold runs)."""
    parts = []
    for server in SERVERS:
        side = out.get(server)
        if side is None:
            parts.append("-")
        elif kind == "cold":
            parts.append(_num((side["cold"] or {}).get(metric)))
        else:
            parts.append(_num(side["steady"].get(metric, {}).get("median")))
    return " / ".join(parts)


def _rate(out: dict, server: str, kind: str) -> str:
    side = out.get(server)
    if side is None:
        return "-"
    if kind == "cold":
        return _num((side["cold"] or {}).get("output_tok_s"))
    s = side["steady"].get("output_tok_s")
    return "-" if s is None else f"{_num(s['median'])} ({_num(s['min'])}-{_num(s['max'])})"


def markdown(summary: dict) -> str:
    """One table per model: steady rows (medians, min-max of output tok/s) and cold rows apart."""
    lines = []
    for model, model_out in summary["models"].items():
        ready = ", ".join(f"{s} ready in {_num(v.get('ready_s'))} s" for s, v in model_out["servers"].items())
        lines += [f"### {model}", "", ready, "",
                  "| workload | prompts | run | pprun output tok/s | vLLM output tok/s | pprun / vLLM | "
                  "TTFT p50 ms pprun / vLLM | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | ITL p99 ms | events per answer |",
                  "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for kind in ("steady", "cold"):
            for row_name, out in model_out["rows"].items():
                has = any((out.get(s) or {}).get(kind) for s in SERVERS)
                if not has:
                    continue
                prompts = (out["workload"] or {}).get("num_prompts")
                if kind == "steady":
                    n = max(out[s]["steady"].get("output_tok_s", {}).get("n", 0) for s in SERVERS if s in out)
                    label, ratio = f"steady x{n}", out.get("ratio", {}).get("output_tok_s")
                else:
                    label = "cold"
                    rates = [(out.get(s) or {}).get("cold") or {} for s in SERVERS]
                    ratio = (rates[0]["output_tok_s"] / rates[1]["output_tok_s"]
                             if rates[0].get("output_tok_s") and rates[1].get("output_tok_s") else None)
                lines.append(f"| {row_name} | {prompts or '-'} | {label} | {_rate(out, 'pprun', kind)} | "
                             f"{_rate(out, 'vllm', kind)} | {'-' if ratio is None else f'**{ratio:.2f}**'} | "
                             + " | ".join(_pair(out, kind, m) for m in
                                          ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p99_ms",
                                           "events_per_answer"))
                             + " |")
        lines.append("")
    if summary["targets"]:
        lines += ["| model | row | target | value | met |", "| --- | --- | --- | ---: | --- |"]
        lines += [f"| {t['model']} | {t['row']} | {t['check']} | {t['value']:.2f} | {'yes' if t['pass'] else 'no'} |"
                  for t in summary["targets"]]
        lines.append("")
    if summary["problems"]:
        lines += ["Problems:", ""] + [f"- {p}" for p in summary["problems"]] + [""]
    return "\n".join(lines)


def report(folders: list[Path], write_to: Path | None, output_len: int | None = 128,
           input_len: int | None = 512) -> dict:
    """Summarize what ``folders`` hold; print the JSON, and write it with the table to ``write_to``."""
    summary = summarize(collect(folders), output_len, input_len)
    table = markdown(summary)
    if write_to is not None:
        write_to.mkdir(parents=True, exist_ok=True)
        (write_to / "summary.json").write_text(json.dumps(summary, indent=2))
        (write_to / "summary.md").write_text(table)
    print(json.dumps(summary, indent=2))
    print(table, file=sys.stderr)
    return summary


# --- preflight ---------------------------------------------------------------------------------


def preflight(jobs: list[ServerJob], args: argparse.Namespace) -> int:
    """Check, in ``--vllm-python`` and without a server or a GPU, what the runs will need of
    vLLM: every flag the plan passes to ``vllm bench serve`` and ``vllm serve`` is in their help,
    and each checkpoint's tokenizer gives vLLM's random dataset prompts that encode to
    ``--input-len`` tokens.  Prints a JSON object; exit status 1 if anything is missing."""
    bench = sorted({a for job in jobs for argv in job.bench.values() for a in argv if a.startswith("--")})
    serve = sorted({a.split("=")[0] for job in jobs if job.server == "vllm" for a in job.command if a.startswith("--")})
    folders = sorted({folder for _, folder in args.models if (Path(folder) / "config.json").is_file()})
    request = {"bench_flags": bench, "serve_flags": serve, "tokenizers": folders, "input_len": args.input_len,
               "output_len": args.output_len}
    proc = subprocess.run([args.vllm_python, str(Path(__file__).resolve()), "--preflight-driver", json.dumps(request)],
                          env=server_env("client"), capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        print(proc.stdout[-4000:] + proc.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"--preflight: {args.vllm_python} failed (exit {proc.returncode})")
    result = json.loads(lines[-1])
    result["models_not_found"] = [folder for _, folder in args.models if folder not in folders]
    print(json.dumps(result, indent=2))
    return 1 if result["problems"] else 0


def preflight_driver(request_json: str) -> int:
    """The vLLM side of :func:`preflight` (run by ``--vllm-python``)."""
    import contextlib
    import io

    request = json.loads(request_json)
    result: dict = {"problems": []}
    from vllm.entrypoints.cli.main import main as entry

    def help_text(argv: list[str]) -> str:
        sys.argv = ["vllm", *argv]
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                entry()
            except SystemExit:
                pass
        return out.getvalue()

    def missing(flags: list[str], text: str) -> list[str]:
        return [f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text)]

    try:
        import vllm

        result["vllm_version"] = getattr(vllm, "__version__", None)
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        result["problems"].append(f"import vllm: {type(e).__name__}: {e}")
    # vLLM's own parser (FlexibleArgumentParser, 0.26) lists a command's flags under --help=all; its
    # plain --help shows only their groups.
    gone = missing(request["bench_flags"], help_text(["bench", "serve", "--help=all"]))
    if gone:
        result["problems"].append(f"vllm bench serve --help=all lists none of {gone}")
    if request["serve_flags"]:
        # A serve flag not listed is a warning only: the run itself tells.
        gone = missing(request["serve_flags"], help_text(["serve", "--help=all"]))
        if gone:
            result["warnings"] = [f"vllm serve --help=all lists none of {gone}"]
    result["tokenizers"] = {}
    for folder in request["tokenizers"]:
        try:
            try:
                from vllm.tokenizers import get_tokenizer
            except ImportError:
                from vllm.transformers_utils.tokenizer import get_tokenizer
            from vllm.benchmarks.datasets import RandomDataset

            tok = get_tokenizer(folder)
            samples = RandomDataset(random_seed=0).sample(tokenizer=tok, num_requests=8,
                                                          input_len=request["input_len"],
                                                          output_len=request["output_len"])
            served = [len(tok.encode(r.prompt)) for r in samples]
            result["tokenizers"][folder] = {"vocab_size": tok.vocab_size, "ids": len(tok),
                                            "client_prompt_lens": [r.prompt_len for r in samples],
                                            "served_prompt_lens": served}
            if set(served) != {request["input_len"]}:
                result["problems"].append(f"{folder}: prompts of vLLM's random dataset encode to {served} "
                                          f"tokens, not {request['input_len']}")
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            result["problems"].append(f"{folder}: {type(e).__name__}: {e}")
    print(json.dumps(result))
    return 0


def dry_run(jobs: list[ServerJob], args: argparse.Namespace) -> None:
    """Print each server command and each run's ``vllm bench serve`` command; start nothing."""
    vllm = shlex.join([args.vllm_python, "-m", "vllm.entrypoints.cli.main", "bench", "serve"])
    for job in jobs:
        print(f"# {job.model} ({job.model_dir}) / {job.server}: {len(job.runs)} runs, "
              f"{sum(r.num_prompts for r in job.runs)} prompts")
        print(shlex.join(job.command))
        for run in job.runs:
            print(f"{vllm} {shlex.join(job.bench[run.name])}")
        print()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--driver"]:
        return drive(argv[1])
    if argv[:1] == ["--preflight-driver"]:
        return preflight_driver(argv[1])
    args = parse_args(argv)
    if args.report:
        report(args.report, None, args.output_len, args.input_len)
        return 0
    jobs = make_jobs(args)
    if args.dry_run:
        dry_run(jobs, args)
        return 0
    if args.preflight:
        return preflight(jobs, args)
    start = time.time()
    deadline = None if args.deadline_s is None else start + args.deadline_s
    # SIGTERM (a time limit's) ends the script through its finally blocks, which stop the servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        for name, folder in args.models:
            model_jobs = [job for job in jobs if job.model == name]
            if deadline is not None and time.time() > deadline:
                log(f"{name}: not started, past --deadline-s")
                continue
            prepared = ensure_checkpoint(name, folder, args.create_missing)
            for job in model_jobs:
                if deadline is not None and time.time() > deadline:
                    log(f"{job.model}/{job.server}: not started, past --deadline-s")
                    continue
                info = run_job(job, args, deadline)
                if prepared:
                    info["checkpoint"] = prepared
                    (job.folder / "server.json").write_text(json.dumps(info, indent=2))
            if args.remove_created and any(p.startswith("created") for p in prepared):
                log(f"{name}: removing {folder} (--remove-created)")
                shutil.rmtree(folder)
    finally:  # what ran is summarized, interrupted or not
        if args.out.is_dir():
            report([args.out], args.out, args.output_len, args.input_len)
    return 0


if __name__ == "__main__":
    sys.exit(main())
