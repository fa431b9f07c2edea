"""The fault matrix (docs/failures.md, "Failure behaviour"): each fault on each executor that can
have it, on CPU over gloo.  Per cell: the caller gets ``StageFailedError`` (or, at start-up, a
``ValueError``) within ``parallel.stage_timeout_s`` plus a margin; every request in flight ends
with ``finish_reason="error"``; no process, socket, rendezvous directory or shared-memory segment
of the run is left (``tests/leftovers.py``); a new ``LLM`` starts and serves in the same process.

Faults come from ``PPRUN_TEST_FAULTS`` (``pprun/worker/faults.py``, the ``inject_faults``
fixture) or from the test itself (``ray.kill``, SIGKILL of the driver).  The exception-in-forward
and killed-stage cells of mp and ray, and the failing torchrun rank, are in tests/test_pipeline.py
and tests/test_torchrun.py; the rows here are the rest of the matrix.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from leftovers import Snapshot

from pprun import LLM, SamplingParams
from pprun.executor.base import StageFailedError

TIMEOUT_S = 6.0
"""``parallel.stage_timeout_s`` of the cells (short: a silent stage must trip it)."""
MARGIN_S = 25.0
"""What the bound allows beyond the timeout: a loaded 2-core machine stopping the stages."""
PROMPTS = [{"prompt_token_ids": [5, 17, 42, 9, 100]}, {"prompt_token_ids": [11]}, {"prompt_token_ids": [7, 7, 8]}]
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _llm(model_dir, executor: str, **kwargs) -> LLM:
    kwargs.setdefault("runner", "v1")
    return LLM(str(model_dir), dtype="float32", executor=executor, pipeline_parallel_size=2,
               stage_timeout_s=TIMEOUT_S, **kwargs)  # fmt: skip


def _fails_cleanly(model_dir, executor: str, llm: LLM, before: Snapshot, match: str, act=None) -> StageFailedError:
    """Generate until the fault fires; check the error, its bound, the requests, the leftovers,
    and that a new LLM serves afterwards.  ``act(llm)``: what the test does to the pipeline
    once the generation runs (in a thread)."""
    import threading

    ex = llm.engine.executor
    pids, rendezvous = list(ex.stage_pids), getattr(ex, "rendezvous_dir", None)
    if act is not None:
        threading.Timer(1.0, act, args=(llm,)).start()
    t0 = time.monotonic()
    with pytest.raises(StageFailedError, match=match) as info:
        llm.generate(PROMPTS, LONG)
    assert time.monotonic() - t0 < TIMEOUT_S + MARGIN_S
    outs = info.value.outputs
    assert len(outs) == len(PROMPTS) and all(o.outputs[0].finish_reason == "error" for o in outs)
    llm.shutdown()
    assert before.left_behind(pids, [rendezvous]) == []
    with _llm(model_dir, executor) as again:
        assert all(len(o.outputs[0].token_ids) == 4 for o in again.generate(PROMPTS[:1], SHORT))
    return info.value


def _executor(request, executor: str) -> str:
    if executor == "ray":
        request.getfixturevalue("ray_cluster")
    return executor


@pytest.mark.parametrize("executor", ["mp", "ray"])
def test_stage_that_stops_answering(tiny_llama_dir, inject_faults, request, executor):
    """SIGSTOP of the last stage at its third step: nothing dies, nothing answers.  Whichever
    wait trips the stage timeout first reports it — the driver's ("stage 1 sent nothing") or
    stage 0's send of hidden states to the stopped stage ("Timed out ... send") — and the
    stopped process is killed with the rest."""
    _executor(request, executor)
    before = Snapshot()
    with inject_faults({1: {"stop_at_step": 3}}):
        llm = _llm(tiny_llama_dir, executor)
    _fails_cleanly(tiny_llama_dir, executor, llm, before, r"stage 1 sent nothing for|stage 0 raised:(.|\n)*Timed out")


@pytest.mark.parametrize("executor", ["mp", "ray"])
def test_peer_gone_in_the_middle_of_a_hop(tiny_llama_dir, inject_faults, request, executor):
    """Stage 0 SIGKILLs itself at the start of its third step, while stage 1 waits in its
    receive of that step's hidden states: the driver names the dead stage."""
    _executor(request, executor)
    before = Snapshot()
    with inject_faults({0: {"kill_at_step": 3}}):
        llm = _llm(tiny_llama_dir, executor)
    _fails_cleanly(tiny_llama_dir, executor, llm, before, r"stage 0 (died|actor died)")


def test_lost_ray_actor(tiny_llama_dir, inject_faults, ray_cluster):
    """``ray.kill`` of the last stage's actor in the middle of a generation."""
    before = Snapshot()
    with inject_faults({0: {"delay_s": 0.05}}):
        llm = _llm(tiny_llama_dir, "ray")
    _fails_cleanly(tiny_llama_dir, "ray", llm, before, r"stage 1",
                   act=lambda llm: ray_cluster.kill(llm.engine.executor.actors[1], no_restart=True))  # fmt: skip


@pytest.mark.parametrize("executor", ["mp", "ray"])
def test_kv_cache_that_cannot_fit(tiny_llama_dir, request, executor):
    """A KV cache too small for one request of max_model_len: a ValueError naming the setting
    before any request runs, the stages already started are stopped, and a new LLM starts."""
    _executor(request, executor)
    before = Snapshot()
    with pytest.raises(ValueError, match=r"KV cache is too small.*kv_cache_memory_bytes"):
        _llm(tiny_llama_dir, executor, kv_cache_memory_bytes=4096, max_model_len=256)
    assert before.left_behind() == []
    with _llm(tiny_llama_dir, executor) as again:
        assert len(again.generate(PROMPTS[:1], SHORT)[0].outputs[0].token_ids) == 4


DRIVER = r"""
import json, os, sys
from pprun import LLM, SamplingParams
os.environ["PPRUN_TEST_FAULTS"] = json.dumps({"0": {"delay_s": 0.05}})
llm = LLM(sys.argv[1], dtype="float32", executor="mp", pipeline_parallel_size=2, runner="v1", stage_timeout_s=6)
print(json.dumps([llm.engine.executor.stage_pids, llm.engine.executor.rendezvous_dir]), flush=True)
llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=5000, ignore_eos=True))
"""


def test_killed_driver_takes_its_stages_down(tiny_llama_dir, tmp_path):
    """SIGKILL of the driver mid-generation (mp): its stages see the control socket close (or
    their neighbour go) and exit within the stage timeout plus the margin."""
    import json

    import psutil

    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    driver = subprocess.Popen([sys.executable, str(script), str(tiny_llama_dir)], stdout=subprocess.PIPE, text=True)
    try:
        pids, rendezvous = json.loads(driver.stdout.readline())
        time.sleep(1.0)  # in the middle of the generation
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
        deadline = time.monotonic() + TIMEOUT_S + MARGIN_S
        alive = pids
        while alive and time.monotonic() < deadline:
            alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
            time.sleep(0.2)
        assert alive == [], f"stage processes {alive} outlived their driver"
    finally:
        if driver.poll() is None:
            driver.kill()
    # The driver could not remove its rendezvous directory: its stages did on their way out.
    assert not os.path.exists(rendezvous), f"rendezvous directory {rendezvous} outlived its driver"


TORCHRUN_KILLED = r"""
import json, os, sys
from pprun import LLM, SamplingParams
from pprun.executor.base import StageFailedError
model_dir, out_dir = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
os.environ["PPRUN_TEST_FAULTS"] = json.dumps({"1": {"kill_at_step": 3}})
llm = LLM(model_dir, dtype="float32", device="cpu", pipeline_parallel_size=2, cpu_kv_cache_bytes=1 << 20,
          max_model_len=128, stage_timeout_s=6)
try:
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=8, ignore_eos=True))
    result = {"error": None}
except StageFailedError as e:
    result = {"error": str(e), "finish_reasons": [o.outputs[0].finish_reason for o in getattr(e, "outputs", [])]}
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
os._exit(1)
"""


def test_killed_torchrun_rank_ends_the_others_with_an_error(tiny_llama_dir, tmp_path):
    """external_launcher: rank 1 SIGKILLs itself at its third step; rank 0 does not wait in the
    collective for good: it reports a StageFailedError with every request failed, within the
    bound, and torchrun exits non-zero."""
    import json
    import shutil

    script = tmp_path / "killed.py"
    script.write_text(TORCHRUN_KILLED)
    torchrun = shutil.which("torchrun")
    cmd = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "PPRUN_TEST_FAULTS")}  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run([*cmd, "--standalone", "--nproc-per-node", "2", str(script), str(tiny_llama_dir),
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=180)  # fmt: skip
    assert proc.returncode != 0
    assert not (tmp_path / "rank1.json").exists()  # it died
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    assert rank0["error"] and "torchrun rank 0" in rank0["error"], rank0
    assert rank0["finish_reasons"] == ["error"]
    assert time.monotonic() - t0 < 120  # start-up of two interpreters included
