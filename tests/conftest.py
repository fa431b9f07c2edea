"""Shared fixtures: tiny random checkpoints, the demo model, one Ray cluster per session."""

from __future__ import annotations

import os

# Before torch loads OpenMP (it reads these once), here and in every stage process the tests
# start.  PASSIVE: an OpenMP thread that waits for work sleeps instead of spinning; the tests run
# a driver and several stages on two cores, where a spinning thread takes the core a stage
# needs (a multi-stage test file runs about a quarter faster).
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402
import triton_env  # noqa: E402, F401  (first: without CUDA it turns the Triton interpreter on)

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    """GPU tests are skipped where no CUDA device is present."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """How many pytest-xdist workers ``-n auto`` (pyproject's ``addopts``) starts: two on a
    machine without CUDA and with two cores or more, else none (a serial run).

    Two: much of a test's time is spent waiting (processes starting, Ray, torch imports, gloo
    rendezvous), where the other worker's test takes the idle core; a third worker finds no idle
    core left on two.  Each worker has its own session fixtures (its own Ray cluster, stage
    template, tmp dirs) and runs whole test files (``--dist loadfile``).  With CUDA, none: the GPU
    tests size their KV caches from the device's free memory, which a second worker's engine on
    the same device would take."""
    if torch.cuda.is_available():
        return 0
    return 2 if (os.cpu_count() or 1) >= 2 else 0


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A 4-layer random Llama (untied, fp32) without a tokenizer."""
    from tiny_models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), num_layers=4)


@pytest.fixture(scope="session")
def demo_model_dir():
    """The converted demo model (converted once into the user cache, reused after)."""
    from pprun.models.demo import resolve_model

    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def hf_demo(demo_model_dir):
    """transformers' model and tokenizer for the demo directory (the parity reference)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    model = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()
    return model, tok


@pytest.fixture(scope="session")
def stage_zygote():
    """One warm template for the session that ``mp`` stages may fork from instead of starting as
    fresh interpreters (``tests/stage_zygote.py``: each fresh one spends about 4.5 s of CPU
    importing torch).  A test opts in with :func:`fork_mp_stages` where what it checks is what the
    stages compute, not how they start; each module keeps an ``mp`` case that starts them fresh."""
    from stage_zygote import Zygote

    z = Zygote(dict(os.environ, OMP_NUM_THREADS="1"))
    yield z
    z.close()


def fork_mp_stages(request) -> None:
    """For the rest of the test, the ``mp`` executor forks its stages from the session's warm
    template (:func:`stage_zygote`)."""
    from stage_zygote import use_zygote

    use_zygote(request.getfixturevalue("monkeypatch"), request.getfixturevalue("stage_zygote"))


@pytest.fixture(scope="session")
def ray_cluster():
    """One light local Ray cluster for the whole session (2 cores: fractional CPUs), started as
    pprun starts one: no dashboard, no usage stats, an 80 MiB object store, a short private temp
    directory, loopback only, and Ray's token authentication with a token of its own."""
    ray = pytest.importorskip("ray")
    from pprun.executor.ray_executor import start_local_ray, stop_local_ray

    temp_dir = None
    if not ray.is_initialized():
        temp_dir = start_local_ray(num_cpus=2, log_to_driver=False)
    yield ray
    if temp_dir is not None:
        stop_local_ray(temp_dir=temp_dir)
    else:
        ray.shutdown()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation (stops at EOS like pprun does)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=model.generation_config.eos_token_id if model.generation_config.eos_token_id is not None else 0,
        )
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture
def inject_faults(monkeypatch):
    """Faults for the stages of the next engine built (``pprun.worker.faults``): a context
    manager that sets ``PPRUN_TEST_FAULTS`` for the block, e.g.
    ``with inject_faults({1: {"raise_at_step": 3}}): llm = LLM(...)``.  The driver reads it when
    it builds its executor, so an engine built after the block gets no faults."""
    import contextlib
    import json

    from pprun.worker.faults import ENV

    @contextlib.contextmanager
    def inject(faults: dict[int, dict]):
        monkeypatch.setenv(ENV, json.dumps({str(rank): f for rank, f in faults.items()}))
        try:
            yield
        finally:
            monkeypatch.delenv(ENV)

    return inject


@pytest.fixture
def switch(monkeypatch):
    """Flip a debugging switch for one test: ``switch("PPRUN_DISABLE_NORM_FOLD", enabled=False)``
    sets the bool the variable controls in this process (``pprun.switches.SWITCHES``), as the
    variable would at import; undone after the test.  Processes started later (mp stages) read the
    environment instead: set the variable with ``monkeypatch.setenv`` for those."""
    import importlib

    from pprun.switches import SWITCHES

    def flip(name: str, enabled: bool) -> None:
        module, _, attr = SWITCHES[name].rpartition(".")
        monkeypatch.setattr(importlib.import_module(module), attr, enabled)

    return flip
