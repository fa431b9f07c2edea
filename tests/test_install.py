"""A non-editable install (what a wheel gives a user) finds its Hydra YAML and generates.

The YAML lives in the repository's top-level ``conf/``; ``setup.py`` ships it in the wheel as the
package data ``pprun/conf``. A checkout (or an editable install) reads ``conf/`` directly, so
nothing else in the suite would notice if the wheel lost it. This test copies the sources,
installs the copy with ``pip install --no-deps --no-build-isolation .`` into a fresh virtual
environment that sees the system's packages (so nothing is downloaded), and runs that
environment's ``pprun`` from a directory outside any checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# A wheel build, a fresh environment and two CLI runs: ~20-40 s on a 2-core machine.
pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parent.parent

# What a wheel is built from: the package, the YAML, and the packaging files (pyproject names README.md).
SOURCES = ("pprun", "conf", "setup.py", "pyproject.toml", "README.md")


def run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``cmd`` and fail the test with its output if it exits non-zero."""
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{cmd} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def installed_venv(tmp_path_factory) -> Path:
    """A fresh venv (system site packages visible) holding a non-editable install of a copy of pprun."""
    root = tmp_path_factory.mktemp("install")
    src = root / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in SOURCES:
        path = REPO_ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    venv = root / "venv"
    # --without-pip: the venv would otherwise get the interpreter's bundled pip and setuptools, and
    # an old bundled setuptools shadows the system's (no bdist_wheel); the system's pip installs
    # into whichever interpreter runs it.
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True
    )
    python = venv / "bin" / "python"
    env = clean_env()
    run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "."], src, env)
    # The source copy goes away: the installed package must not lean on it.
    shutil.rmtree(src)
    return venv


def clean_env() -> dict[str, str]:
    """The environment without anything that would put this checkout on ``sys.path``."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


def test_wheel_ships_every_yaml_and_finds_it(installed_venv: Path, tmp_path: Path) -> None:
    """The installed package holds every YAML file of ``conf/``, and ``default_conf_dir`` points at it."""
    python = installed_venv / "bin" / "python"
    proc = run(
        [
            str(python),
            "-c",
            "import pprun; from pprun.config import default_conf_dir; "
            "print(pprun.__file__); print(default_conf_dir())",
        ],
        tmp_path,
        clean_env(),
    )
    package_file, conf_dir = (Path(line) for line in proc.stdout.split())
    assert package_file.is_relative_to(installed_venv), package_file
    assert conf_dir == package_file.parent / "conf"
    wanted = sorted(str(p.relative_to(REPO_ROOT / "conf")) for p in (REPO_ROOT / "conf").rglob("*.yaml"))
    shipped = sorted(str(p.relative_to(conf_dir)) for p in conf_dir.rglob("*.yaml"))
    assert shipped == wanted


def test_installed_pprun_composes_and_generates(installed_venv: Path, tmp_path: Path, hf_demo) -> None:
    """``pprun generate --cfg job`` composes the packaged YAML, and a short greedy run on the demo model
    gives transformers' tokens, run from a directory outside the checkout."""
    pprun = installed_venv / "bin" / "pprun"
    env = clean_env()
    job = run([str(pprun), "generate", "--cfg", "job", "parallel=single", "sampling.max_tokens=4"], tmp_path, env)
    assert "pipeline_parallel_size: 1" in job.stdout
    assert "max_tokens: 4" in job.stdout

    prompt = "The capital of France is"
    out = tmp_path / "out.jsonl"
    run(
        [
            str(pprun),
            "generate",
            "parallel=single",
            "sampling.max_tokens=4",
            f"prompt={prompt}",
            f"output_file={out}",
        ],
        tmp_path,
        env,
    )
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]

    model, tok = hf_demo
    import torch

    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=4, do_sample=False)[0, ids.shape[1] :].tolist()
    assert record["token_ids"] == ref
    # A plain run writes nothing into the working directory but the requested output.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]
