"""Random faults into running pp=2 generations (tiny model, CPU): each fault of a random kind, at a
random step of a random stage, on a random executor, seeded and reproducible from its seed.

Per fault: the generation either finishes (the fault's step never came) or fails with
``StageFailedError`` naming what the fault did (never a hang: a stopped stage is detected by
``parallel.stage_timeout_s``, every other fault without it; pytest-timeout reports a hang), with
every request in flight ended as ``"error"`` (one that had finished before stays intact); no
process, socket, shared-memory segment or rendezvous directory of the run is left behind; the
next pipeline starts and serves in the same process.

Kinds: an exception in a stage's forward (``raise_at_step``), a stage SIGKILLed at the start of a
step (``kill_at_step``: its neighbour may be waiting in a hop from or to it), a stage that stops
answering (``stop_at_step``: SIGSTOP), and on Ray ``ray.kill`` of a stage's actor at a random
moment.  Some faults add a small per-step delay to a stage, which moves the fault against the
other stage's work.  The executor and kind are stratified by seed (:data:`PLAN`): every 40
consecutive seeds hold each Ray kind once (stages as actors of the session cluster) and each
``mp`` kind 12 times, so any 40 faults cover every executor and kind; ``mp`` stages fork from a
warm template (``tests/stage_zygote.py``: a fresh interpreter per stage costs 4.5 s of CPU, more
than the rest of a fault).  The stage, step, prompts, runner and delay are random.

``PPRUN_RANDOM_FAULTS`` faults (default 40, what CI runs: every executor and kind, in chunks of
:data:`FAULTS_PER_CHUNK`, one test each); ``PPRUN_RANDOM_FAULTS_SEED`` the first seed (default
0): fault ``i`` draws everything from ``Random(seed + i)``.  A failing fault prints its seed, and
``PPRUN_RANDOM_FAULTS_SEED=<seed> PPRUN_RANDOM_FAULTS=1`` replays it alone.
"""

from __future__ import annotations

import math
import os
import random
import threading
import time

import pytest
from leftovers import Snapshot
from stage_zygote import Zygote, use_zygote

from pprun import LLM, SamplingParams
from pprun.executor.base import StageFailedError

NUM_FAULTS = int(os.environ.get("PPRUN_RANDOM_FAULTS", "40"))
BASE_SEED = int(os.environ.get("PPRUN_RANDOM_FAULTS_SEED", "0"))
FAULTS_PER_CHUNK = 10
"""Faults per test: a chunk stays well inside the per-test timeout."""
KINDS = {"mp": ("raise_at_step", "kill_at_step", "stop_at_step"),
         "ray": ("raise_at_step", "kill_at_step", "stop_at_step", "ray_kill")}  # fmt: skip
PLAN = tuple(("ray", KINDS["ray"][i // 10]) if i % 10 == 9 else ("mp", KINDS["mp"][(i - i // 10) % 3]) for i in range(40))
"""(executor, kind) of seed ``s``: ``PLAN[s % 40]``; one fault in ten on Ray (a Ray fault starts
two fresh stage interpreters), each of its kinds once per 40 seeds, the ``mp`` kinds in turn."""
STOP_TIMEOUT_S = {"mp": 3.0, "ray": 3.0}
"""How long a ``stop_at_step`` fault's pipeline waits for the stopped stage, the one kind only the
timeout detects: short, since the stopped stage is silent for good.  On ``mp`` it is
``parallel.stage_timeout_s``.  On Ray that setting also bounds the group's rendezvous and, plus
60 s, the actors' start (fresh interpreters, not forked from the warm template, two minutes on a
loaded 2-core machine), so the pipeline starts with the default, 60 s, and only the driver's wait
for a stage's answer (``executor.timeout_s``) is shortened once every stage is up."""
TIMEOUT_S = 120.0
"""``parallel.stage_timeout_s`` of every other fault: an exception, a death or a lost actor is
detected without the timeout, which must then never fire, however loaded the machine (a step
slowed past a short timeout would end the run with the wrong error)."""
EXPECTED = {
    "raise_at_step": "^(the engine has failed \\()?stage {stage} raised:(.|\n)*injected failure in stage {stage}",
    "kill_at_step": "stage {stage} (died|actor died)",
    "stop_at_step": "sent nothing for|Timed out",
    "ray_kill": "stage {stage}",
}
"""What the error says for each kind: the raising stage named first (not its neighbour, which
exits after it), the dead stage, or whichever wait times out first around a stopped stage.  A
failure met while submitting right after a step's output is raised by the next step, as "the
engine has failed (<why>)"."""
TOTALS = {"injected": 0, "fired": 0, "not fired": 0}


def draw(seed: int) -> dict:
    """The fault and the generation of one seed."""
    rng = random.Random(seed)
    executor, kind = PLAN[seed % len(PLAN)]
    # The executor and the kind were drawn here before PLAN: drawn and dropped, so that a seed's
    # stage, step, prompts and timing stay what they were.
    rng.random()
    stage = rng.randint(0, 1)
    rng.choice(KINDS["mp"])
    fault = {
        "seed": seed,
        "executor": executor,
        "stage": stage,
        "kind": kind,
        "step": rng.randint(1, 10),
        "prompts": [{"prompt_token_ids": [rng.randrange(1, 250) for _ in range(rng.randint(1, 12))]}
                    for _ in range(rng.randint(1, 4))],  # fmt: skip
        "max_tokens": rng.randint(2, 12),
        "async": rng.random() < 0.5,
        "delay": (rng.randint(0, 1), round(rng.uniform(0.005, 0.03), 3)) if rng.random() < 0.3 else None,
        "kill_after_s": round(rng.uniform(0.05, 0.6), 2),
    }
    if fault["kind"] == "ray_kill":
        fault["delay"] = (0, 0.05)  # the generation outlasts the kill's moment, mostly
    return fault


def stage_timeout_s(fault: dict) -> float:
    """``parallel.stage_timeout_s`` of a fault's pipeline (a stopped Ray stage: see STOP_TIMEOUT_S)."""
    if fault["kind"] == "stop_at_step" and fault["executor"] == "mp":
        return STOP_TIMEOUT_S["mp"]
    return 60.0 if fault["kind"] == "stop_at_step" else TIMEOUT_S


def stage_faults(fault: dict) -> dict[int, dict]:
    """``PPRUN_TEST_FAULTS`` of a fault (``ray_kill`` is done by the test, not the stage)."""
    faults: dict[int, dict] = {}
    if fault["kind"] != "ray_kill":
        faults[fault["stage"]] = {fault["kind"]: fault["step"]}
    if fault["delay"] is not None:
        rank, delay = fault["delay"]
        faults.setdefault(rank, {})["delay_s"] = delay
    return faults


def run_one(model_dir, fault: dict, inject_faults, ray=None) -> str:
    """Run one fault; returns "fired" or "not fired", raises AssertionError naming the seed."""
    import re

    where = f"seed {fault['seed']}: {fault}"
    before = Snapshot()
    with inject_faults(stage_faults(fault)):
        llm = LLM(str(model_dir), dtype="float32", executor=fault["executor"], pipeline_parallel_size=2,
                  runner="v2" if fault["async"] else "v1", async_pipeline=fault["async"],
                  stage_timeout_s=stage_timeout_s(fault))  # fmt: skip
    ex = llm.engine.executor
    if fault["kind"] == "stop_at_step" and fault["executor"] == "ray":
        ex.timeout_s = STOP_TIMEOUT_S["ray"]  # started with 60 s (see STOP_TIMEOUT_S)
    pids, rendezvous = list(ex.stage_pids), ex.rendezvous_dir
    killer = None
    if fault["kind"] == "ray_kill":
        actor = ex.actors[fault["stage"]]
        killer = threading.Timer(fault["kill_after_s"], lambda: ray.kill(actor, no_restart=True))
    params = SamplingParams(temperature=0, max_tokens=fault["max_tokens"], ignore_eos=True)
    outcome = "not fired"
    try:
        if killer is not None:
            killer.start()
        outs = llm.generate(fault["prompts"], params)
        assert all(len(o.outputs[0].token_ids) == fault["max_tokens"] for o in outs), where
    except StageFailedError as e:
        outcome = "fired"
        expected = EXPECTED[fault["kind"]].format(stage=fault["stage"])
        assert re.search(expected, str(e)), f"{where}: the error does not match {expected!r}: {e}"
        assert len(e.outputs) == len(fault["prompts"]), where
        # Requests in flight end with "error"; one that finished before the fault is intact.
        reasons = [o.outputs[0].finish_reason for o in e.outputs]
        assert "error" in reasons, f"{where}: {reasons}"
        assert all(r == "error" or (r == "length" and len(o.outputs[0].token_ids) == fault["max_tokens"])
                   for r, o in zip(reasons, e.outputs)), f"{where}: {reasons}"  # fmt: skip
    finally:
        if killer is not None:
            killer.cancel()
            killer.join()
        llm.shutdown()
    left = before.left_behind(pids, [rendezvous])
    assert left == [], f"{where}: left {left}"
    return outcome


@pytest.fixture(scope="module")
def zygote():
    """The warm template the ``mp`` stages of this module fork from."""
    z = Zygote(dict(os.environ, OMP_NUM_THREADS="1"))
    yield z
    z.close()


@pytest.mark.slow
@pytest.mark.parametrize("chunk", range(math.ceil(NUM_FAULTS / FAULTS_PER_CHUNK)))
def test_random_faults_end_in_errors_and_leave_nothing(tiny_llama_dir, inject_faults, zygote, monkeypatch,
                                                       request, capsys, chunk):  # fmt: skip
    # One intra-op thread per stage: what pprun picks for two stages on two cores.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    use_zygote(monkeypatch, zygote)
    seeds = range(BASE_SEED + chunk * FAULTS_PER_CHUNK, BASE_SEED + min(NUM_FAULTS, (chunk + 1) * FAULTS_PER_CHUNK))
    faults = [draw(seed) for seed in seeds]
    ray = request.getfixturevalue("ray_cluster") if any(f["executor"] == "ray" for f in faults) else None
    counts = {"fired": 0, "not fired": 0}
    t0 = time.monotonic()
    for fault in faults:
        try:
            counts[run_one(tiny_llama_dir, fault, inject_faults, ray)] += 1
        except BaseException:
            with capsys.disabled():
                print(f"\nrandom fault failed: PPRUN_RANDOM_FAULTS_SEED={fault['seed']} PPRUN_RANDOM_FAULTS=1 ({fault})")
            raise
    # A new pipeline serves after the chunk's faults.
    with LLM(str(tiny_llama_dir), dtype="float32", executor="mp", pipeline_parallel_size=2, runner="v1") as llm:
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4))
        assert len(out[0].outputs[0].token_ids) == 4
    TOTALS["injected"] += len(faults)
    for k, v in counts.items():
        TOTALS[k] += v
    with capsys.disabled():
        print(f"\nrandom faults, seeds {seeds.start}..{seeds.stop - 1}: {len(faults)} injected "
              f"({sum(f['executor'] == 'ray' for f in faults)} on Ray), {counts['fired']} fired and ended in "
              f"errors, {counts['not fired']} after the generation finished, in {time.monotonic() - t0:.0f}s; "
              f"so far {TOTALS['injected']} injected, {TOTALS['fired']} fired, 0 hangs, 0 leftovers")  # fmt: skip
    # The draws are meant to fire mostly: a harness whose faults never fire tests nothing.
    assert counts["fired"] >= len(faults) // 2


def test_every_forty_seeds_cover_every_executor_and_kind():
    """The stratified plan: any 40 consecutive seeds (so CI's default draws, from any first seed)
    hold every kind on every executor that can have it."""
    pairs = {(executor, kind) for executor, kinds in KINDS.items() for kind in kinds}
    for first in (0, 7, 1234):
        assert {(f["executor"], f["kind"]) for f in map(draw, range(first, first + 40))} == pairs
