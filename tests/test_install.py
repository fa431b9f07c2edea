"""A non-editable install (what a wheel gives a user) finds its Hydra YAML and generates.

The YAML lives in the repository's top-level ``conf/``; ``setup.py`` ships it in the wheel as the
package data ``pprun/conf``. A checkout (or an editable install) reads ``conf/`` directly, so
nothing else in the suite would notice if the wheel lost it. This test copies the sources, builds
a wheel from the copy with this interpreter's pip (``pip wheel --no-deps --no-build-isolation``:
nothing is downloaded, so the running environment's setuptools builds it, which is why the
``test`` extra asks for one with ``bdist_wheel`` built in), installs that wheel into a fresh
virtual environment, and runs that environment's ``pprun`` from a directory outside any checkout.

The fresh environment sees the *running* interpreter's packages (pprun's dependencies, pip)
through a ``.pth`` file listing this interpreter's site-packages directories. That works the
same inside a virtual environment and outside one; ``venv --system-site-packages`` would not: from
inside a virtual environment it exposes the base interpreter's packages, not the active ones.
A ``.pth`` file adds plain directories without running the ``.pth`` files inside them, so an
editable pprun installed in the running environment stays invisible, and the wheel's copy,
installed in the fresh environment's own site-packages, is the only pprun there.
"""

from __future__ import annotations

import json
import os
import shutil
import site
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
    """A fresh venv (the running interpreter's packages visible) holding a wheel install of a copy of pprun."""
    root = tmp_path_factory.mktemp("install")
    src = root / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in SOURCES:
        path = REPO_ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    env = clean_env()
    dist = root / "dist"
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist), "."],
        src, env)  # fmt: skip
    (wheel,) = dist.glob("pprun-*.whl")
    # The source copy goes away: the installed package must not lean on it.
    shutil.rmtree(src)

    venv = root / "venv"
    # --without-pip: the running environment's pip (seen through the .pth file) installs into
    # whichever interpreter runs it.
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], root, env)
    python = venv / "bin" / "python"
    purelib = run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], root, env)
    (Path(purelib.stdout.strip()) / "_running_env.pth").write_text("\n".join(site_dirs()) + "\n")
    # --ignore-installed: an editable pprun of the running environment may be visible to pip's
    # metadata scan; the wheel goes into the fresh environment regardless.
    run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed", str(wheel)],
        root, env)  # fmt: skip
    return venv


def site_dirs() -> list[str]:
    """The running interpreter's site-packages directories (its user site too, when it uses one)."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE and site.getusersitepackages() in sys.path:
        dirs.append(site.getusersitepackages())
    return [d for d in dirs if os.path.isdir(d)]


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
