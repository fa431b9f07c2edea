"""The fault matrix (docs/failures.md, "Failure behaviour"): each fault on each executor that can
have it, on CPU over gloo.  Per cell: the caller gets ``StageFailedError`` (or, at start-up, a
``ValueError``) naming the fault, never a hang (a stopped stage is detected by
``parallel.stage_timeout_s``; every other fault without it; pytest-timeout reports a hang);
every request in flight ends with ``finish_reason="error"``; no process, socket, rendezvous directory or shared-memory segment
of the run is left (``tests/leftovers.py``); a new ``LLM`` starts and serves in the same process
(for torchrun, where a failed rank ends its job: in the KV cell, the one that keeps its ranks).
Each cell's own pipeline starts its stages fresh; the new ``LLM``'s ``mp`` stages fork from the
session's warm template (``conftest.fork_mp_stages``), as what it checks is that the driver serves
again.

Faults come from ``PPRUN_TEST_FAULTS`` (``pprun/worker/faults.py``, the ``inject_faults``
fixture) or from the test itself (``ray.kill``, SIGKILL of the driver).  The exception-in-forward
and killed-stage cells of mp and ray are in tests/test_pipeline.py; the rows here are the rest.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import fork_mp_stages
from leftovers import Snapshot

from pprun import LLM, SamplingParams
from pprun.executor.base import StageFailedError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The checkout under test: subprocesses (a driver, torchrun's ranks) import pprun from it."""
STOP_TIMEOUT_S = {"mp": 6.0, "ray": 6.0, "external_launcher": 6.0}
"""How long the cells with a stopped (SIGSTOPped) stage wait for it, the one fault only the
timeout detects: short, since that stage is silent for good.  On ``mp`` (and torchrun) it is
``parallel.stage_timeout_s``.  On Ray that setting also bounds the group's rendezvous and, plus
60 s, the actors' start (fresh interpreters, two minutes on a loaded 2-core machine), so the
pipeline starts with the default, 60 s, and only the driver's wait for a stage's answer
(``executor.timeout_s``, set from the same setting) is shortened once every stage is up."""
TIMEOUT_S = 120.0
"""``parallel.stage_timeout_s`` of every other cell: an exception, a death, a lost actor or a
closed socket is detected without the timeout, which must then never fire, however loaded the
machine (a step slowed past a short timeout would end the run with the wrong error)."""
LEFTOVER_WAIT_S = 31.0
"""How long a killed driver's stages, and the CPUs of its placement group, may take to go before
what is left counts as left behind (a bounded wait: a loaded 2-core machine stopping the
stages)."""
PROMPTS = [{"prompt_token_ids": [5, 17, 42, 9, 100]}, {"prompt_token_ids": [11]}, {"prompt_token_ids": [7, 7, 8]}]
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _llm(model_dir, executor: str, **kwargs) -> LLM:
    kwargs.setdefault("runner", "v1")
    kwargs.setdefault("stage_timeout_s", TIMEOUT_S)
    return LLM(str(model_dir), dtype="float32", executor=executor, pipeline_parallel_size=2, **kwargs)


def _again(model_dir, executor: str, request) -> LLM:
    """The new LLM a cell starts once its pipeline has failed (``mp``: stages forked from the
    session's warm template)."""
    if executor == "mp":
        fork_mp_stages(request)
    return _llm(model_dir, executor)


def _fails_cleanly(model_dir, executor: str, llm: LLM, before: Snapshot, match: str, request,
                   act=None) -> StageFailedError:  # fmt: skip
    """Generate until the fault fires; check the error, the requests, the leftovers, and that a
    new LLM serves afterwards (:func:`_again`).  ``act(llm)``: what the test does to the
    pipeline once the generation runs (in a thread)."""
    import threading

    ex = llm.engine.executor
    pids, rendezvous = list(ex.stage_pids), getattr(ex, "rendezvous_dir", None)
    if act is not None:
        threading.Timer(1.0, act, args=(llm,)).start()
    with pytest.raises(StageFailedError, match=match) as info:
        llm.generate(PROMPTS, LONG)
    outs = info.value.outputs
    assert len(outs) == len(PROMPTS) and all(o.outputs[0].finish_reason == "error" for o in outs)
    llm.shutdown()
    assert before.left_behind(pids, [rendezvous]) == []
    with _again(model_dir, executor, request) as again:
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
        llm = _llm(tiny_llama_dir, executor, stage_timeout_s=STOP_TIMEOUT_S[executor] if executor == "mp" else 60.0)
    if executor == "ray":
        # Started with 60 s (see STOP_TIMEOUT_S); the stopped stage is then met by the driver.
        llm.engine.executor.timeout_s = STOP_TIMEOUT_S[executor]
    _fails_cleanly(tiny_llama_dir, executor, llm, before, r"stage 1 sent nothing for|stage 0 raised:(.|\n)*Timed out",
                   request)  # fmt: skip


@pytest.mark.parametrize("executor", ["mp", "ray"])
def test_peer_gone_in_the_middle_of_a_hop(tiny_llama_dir, inject_faults, request, executor):
    """Stage 0 SIGKILLs itself at the start of its third step, while stage 1 waits in its
    receive of that step's hidden states: the driver names the dead stage."""
    _executor(request, executor)
    before = Snapshot()
    with inject_faults({0: {"kill_at_step": 3}}):
        llm = _llm(tiny_llama_dir, executor)
    _fails_cleanly(tiny_llama_dir, executor, llm, before, r"stage 0 (died|actor died)", request)


def test_lost_ray_actor(tiny_llama_dir, inject_faults, ray_cluster, request):
    """``ray.kill`` of the last stage's actor in the middle of a generation."""
    before = Snapshot()
    with inject_faults({0: {"delay_s": 0.05}}):
        llm = _llm(tiny_llama_dir, "ray")
    _fails_cleanly(tiny_llama_dir, "ray", llm, before, r"stage 1", request,
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
    with _again(tiny_llama_dir, executor, request) as again:
        assert len(again.generate(PROMPTS[:1], SHORT)[0].outputs[0].token_ids) == 4


DRIVER = r"""
import json, os, sys
from pprun import LLM, SamplingParams
os.environ["PPRUN_TEST_FAULTS"] = json.dumps({"0": {"delay_s": 0.05}})
llm = LLM(sys.argv[1], dtype="float32", executor=sys.argv[2], pipeline_parallel_size=2, runner="v1",
          stage_timeout_s=float(sys.argv[3]))
print(json.dumps([llm.engine.executor.stage_pids, llm.engine.executor.rendezvous_dir]), flush=True)
engine = llm.engine
engine.add_request([1, 2, 3], SamplingParams(max_tokens=5000, ignore_eos=True))
while not engine.last_updated:  # until a step has come back through both stages
    engine.step()
print("generating", flush=True)
while True:
    engine.step()
"""


def _kill_driver_mid_generation(model_dir, tmp_path, executor: str, env: dict | None = None) -> list[int]:
    """Start ``DRIVER`` in a subprocess, SIGKILL it once its generation runs (it says so after a
    step has come back), and check that its stages, their sockets and shared memory and its
    rendezvous directory are gone (waiting at most ``LEFTOVER_WAIT_S``: the stages see their
    control socket close, no timeout is involved).  Returns the stage pids."""
    import json

    import psutil
    from leftovers import job_left_behind

    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = dict(env or os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    driver = subprocess.Popen([sys.executable, str(script), str(model_dir), executor, str(TIMEOUT_S)],
                              stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        pids, rendezvous = json.loads(driver.stdout.readline())
        assert driver.stdout.readline() == "generating\n"  # in the middle of the generation
        ports = sorted({c.laddr.port for pid in [driver.pid, *pids] for c in psutil.Process(pid).net_connections("tcp")})
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
        left = job_left_behind([driver.pid, *pids], ports, within_s=LEFTOVER_WAIT_S)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert left == [], f"left behind by the killed driver: {left}"
    # The driver could not remove its rendezvous directory: its stages did on their way out.
    assert not (rendezvous and os.path.exists(rendezvous)), f"rendezvous directory {rendezvous} outlived its driver"
    return pids


def test_killed_driver_takes_its_stages_down(tiny_llama_dir, tmp_path):
    """SIGKILL of the driver mid-generation (mp): its stages see the control socket close (or
    their neighbour go) and exit (a bounded wait: ``LEFTOVER_WAIT_S``), leaving no socket,
    shared memory or rendezvous directory."""
    _kill_driver_mid_generation(tiny_llama_dir, tmp_path, "mp")


def test_killed_ray_driver_takes_its_actors_down(tiny_llama_dir, tmp_path, ray_cluster):
    """SIGKILL of a driver attached to the session's Ray cluster (``RAY_ADDRESS``) mid-generation:
    its stage actors' processes exit (a bounded wait; the stages see their control socket close;
    Ray ends a dead job's actors), nothing of theirs is left, the cluster gets its CPUs back (the
    driver's placement group goes with it) and serves a new pipeline."""
    cpus_before = ray_cluster.available_resources().get("CPU", 0.0)
    env = dict(os.environ, RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address)
    _kill_driver_mid_generation(tiny_llama_dir, tmp_path, "ray", env=env)
    deadline = time.monotonic() + LEFTOVER_WAIT_S
    while ray_cluster.available_resources().get("CPU", 0.0) < cpus_before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray_cluster.available_resources().get("CPU", 0.0) == cpus_before
    with _llm(tiny_llama_dir, "ray") as again:  # the cluster serves a new pipeline
        assert len(again.generate(PROMPTS[:1], SHORT)[0].outputs[0].token_ids) == 4


TORCHRUN_RANK = r"""
import json, os, sys, time

import psutil

from pprun import LLM, SamplingParams
from pprun.executor.base import StageFailedError

model_dir, out_dir, case, faults, timeout_s = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5])
rank = int(os.environ["RANK"])


def write(name, data):
    with open(os.path.join(out_dir, name + ".tmp"), "w") as f:
        json.dump(data, f)
    os.replace(os.path.join(out_dir, name + ".tmp"), os.path.join(out_dir, name))


def ports():
    return sorted({c.laddr.port for c in psutil.Process().net_connections("tcp") if c.laddr})


write(f"start{rank}.json", {"pid": os.getpid(), "ports": [int(os.environ["MASTER_PORT"])]})
common = dict(model=model_dir, dtype="float32", device="cpu", pipeline_parallel_size=2, max_model_len=128,
              stage_timeout_s=timeout_s)
prompts = [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5]}, {"prompt_token_ids": [6, 7, 8, 9]}]
result = {}
if case == "kv":
    try:
        LLM(**common, kv_cache_memory_bytes=4096)
        result["error"] = None
    except ValueError as e:
        result["error"] = str(e)
    with LLM(**common, cpu_kv_cache_bytes=1 << 20) as llm:  # a new LLM in the same process
        result["ports"] = ports()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    result["lengths"] = [len(o.outputs[0].token_ids) for o in outs]
    write(f"rank{rank}.json", result)
    sys.exit(0)
os.environ["PPRUN_TEST_FAULTS"] = faults
llm = LLM(**common, cpu_kv_cache_bytes=1 << 20)
result["ports"] = ports()
write(f"start{rank}.json", {"pid": os.getpid(), "ports": [int(os.environ["MASTER_PORT"])] + result["ports"]})
try:
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=120, ignore_eos=True))  # max_model_len=128
    result["error"] = None
except StageFailedError as e:
    result["error"] = str(e)
    result["finish_reasons"] = [o.outputs[0].finish_reason for o in getattr(e, "outputs", [])]
write(f"rank{rank}.json", result)
os._exit(1)  # as a failed job's rank would; interpreter teardown with a peer gone may abort in gloo
"""


def _sigterm_pending(pid: int) -> bool:
    """Whether a SIGTERM waits to be delivered to process ``pid`` (as it does to a stopped one)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            masks = [int(line.split()[1], 16) for line in f if line.startswith(("SigPnd:", "ShdPnd:"))]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return any(mask & (1 << (signal.SIGTERM - 1)) for mask in masks)


def _continue_once_terminated(start_file, done) -> None:
    """Send SIGCONT to the stopped rank that wrote ``start_file`` once torchrun's SIGTERM is
    pending on it, so the SIGTERM ends it at once.  torchrun 2.13 ends a failed job's other ranks
    with a 30 s grace before SIGKILL whatever ``--shutdown-timeout`` says (its ``_stop_workers``
    passes no timeout), and a stopped rank acts on no signal but SIGKILL: the grace would be
    waited out whole.  The rank is still ended by torchrun's own signal."""
    import json

    pid = None
    while not done.is_set():
        if pid is None and start_file.exists():
            pid = json.loads(start_file.read_text())["pid"]
        if pid is not None and _sigterm_pending(pid):
            os.kill(pid, signal.SIGCONT)
            return
        time.sleep(0.05)


def _torchrun_job(model_dir, tmp_path, case: str, faults: dict, timeout_s: float = TIMEOUT_S,
                  stopped_rank: int | None = None) -> tuple[subprocess.CompletedProcess, dict, list]:  # fmt: skip
    """Run ``TORCHRUN_RANK`` as a two-rank torchrun job (its temporary files in a directory of
    its own) with ``parallel.stage_timeout_s=timeout_s``; returns torchrun's result, each rank's result (absent: it died) and what the job
    left behind once torchrun exited (``leftovers.job_left_behind``).  ``stopped_rank``: the rank
    that SIGSTOPs itself, continued once torchrun has signalled it to end
    (:func:`_continue_once_terminated`)."""
    import json
    import shutil
    import threading

    from leftovers import job_left_behind

    script = tmp_path / "rank.py"
    script.write_text(TORCHRUN_RANK)
    job_tmp = tmp_path / "tmp"
    job_tmp.mkdir()
    torchrun = shutil.which("torchrun")
    cmd = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "PPRUN_TEST_FAULTS")}  # fmt: skip
    # TORCH_ELASTIC_SHUTDOWN_TIMEOUT (torchrun's --shutdown-timeout): the grace torchrun gives a
    # rank between SIGTERM and SIGKILL when it ends the job; 5 s instead of its default 30 s.
    env.update(TMPDIR=str(job_tmp), OMP_NUM_THREADS="1", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="5",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")])))  # fmt: skip
    # --monitor-interval: how often torchrun polls its ranks; once it sees one dead it SIGTERMs the
    # rest.  At its default 0.1 s it can end the survivor before the survivor has reported the
    # peer's death itself (what these cells check), a race a loaded 2-core machine loses at times.
    done = threading.Event()
    watcher = None
    if stopped_rank is not None:
        watcher = threading.Thread(target=_continue_once_terminated, args=(tmp_path / f"start{stopped_rank}.json", done))
        watcher.start()
    try:
        proc = subprocess.run([*cmd, "--standalone", "--nproc-per-node", "2", "--monitor-interval", "2",
                               "--log-dir", str(tmp_path / "logs"),
                               str(script), str(model_dir), str(tmp_path), case, json.dumps(faults), str(timeout_s)],
                              env=env, capture_output=True, text=True, timeout=240)  # fmt: skip
    finally:
        done.set()
        if watcher is not None:
            watcher.join()
    ranks = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)
             if (tmp_path / f"rank{r}.json").exists()}  # fmt: skip
    started = [json.loads((tmp_path / f"start{r}.json").read_text()) for r in (0, 1)]
    pids = [s["pid"] for s in started]
    ports = sorted({p for s in [*started, *ranks.values()] for p in s.get("ports", [])})
    return proc, ranks, job_left_behind(pids, ports, str(job_tmp))


def _job_failed_cleanly(proc, ranks: dict, left: list, survivor: int, match: str) -> None:
    """The torchrun cells' checks: torchrun exited non-zero; the surviving rank raised the
    documented error with every request ended as "error"; the job left nothing behind."""
    assert proc.returncode != 0
    res = ranks.get(survivor)
    assert res is not None, f"rank {survivor} wrote no result:\n{proc.stderr[-6000:]}"
    assert res["error"] and re.search(match, res["error"]), res
    assert res["finish_reasons"] == ["error"] * 3, res
    assert left == [], left


def test_failing_torchrun_rank_ends_every_rank_with_an_error(tiny_llama_dir, tmp_path):
    """external_launcher: rank 1 raises in its third step; it reports its own error, and rank 0
    learns of it from the broken channel instead of waiting forever; both end every request
    with "error", and the job leaves nothing."""
    proc, ranks, left = _torchrun_job(tiny_llama_dir, tmp_path, "fault", {"1": {"raise_at_step": 3}})
    assert "injected failure in stage 1" in ranks[1]["error"] and ranks[1]["finish_reasons"] == ["error"] * 3, ranks
    _job_failed_cleanly(proc, ranks, left, survivor=0, match="torchrun rank 0")


def test_killed_torchrun_rank_ends_the_others_with_an_error(tiny_llama_dir, tmp_path):
    """external_launcher: rank 1 (the last stage) SIGKILLs itself at its third step; rank 0 does
    not wait in the collective for good: it reports a StageFailedError with every request
    failed, and torchrun exits non-zero, leaving nothing."""
    proc, ranks, left = _torchrun_job(tiny_llama_dir, tmp_path, "fault", {"1": {"kill_at_step": 3}})
    assert 1 not in ranks  # it died
    _job_failed_cleanly(proc, ranks, left, survivor=0, match="rank 0")


def test_killed_torchrun_rank_0(tiny_llama_dir, tmp_path):
    """external_launcher: rank 0 (the first stage) SIGKILLs itself at its third step, while
    rank 1 waits to receive that step's hidden states: rank 1 reports the broken hop."""
    proc, ranks, left = _torchrun_job(tiny_llama_dir, tmp_path, "fault", {"0": {"kill_at_step": 3}})
    assert 0 not in ranks
    _job_failed_cleanly(proc, ranks, left, survivor=1, match="torchrun rank 1")


def test_stopped_torchrun_rank(tiny_llama_dir, tmp_path):
    """external_launcher: rank 1 SIGSTOPs itself at its third step (alive, silent): rank 0's next
    wait on it (its send of hidden states, or the step's output from the last stage) times out
    after ``stage_timeout_s``; torchrun then ends the stopped rank (SIGTERM, SIGKILL after its
    grace; the test continues the stopped rank once the SIGTERM is pending, so it takes effect
    without waiting out that grace) and exits non-zero."""
    timeout_s = STOP_TIMEOUT_S["external_launcher"]
    proc, ranks, left = _torchrun_job(tiny_llama_dir, tmp_path, "fault", {"1": {"stop_at_step": 3}}, timeout_s,
                                      stopped_rank=1)  # fmt: skip
    assert 1 not in ranks
    _job_failed_cleanly(proc, ranks, left, survivor=0,
                        match=r"torchrun rank 0 .*Timed out|rank 0: no output of step \d+ from the last stage")


def test_torchrun_kv_cache_that_cannot_fit(tiny_llama_dir, tmp_path):
    """external_launcher: a KV cache too small for one request is a ValueError naming the
    setting on every rank before any request runs; the process group is torn down and a new LLM
    in the same processes serves; the job exits 0 and leaves nothing."""
    proc, ranks, left = _torchrun_job(tiny_llama_dir, tmp_path, "kv", {})
    assert proc.returncode == 0, proc.stderr[-6000:]
    for r in (0, 1):
        assert re.search(r"KV cache is too small.*kv_cache_memory_bytes", ranks[r]["error"]), ranks[r]
        assert ranks[r]["lengths"] == [4, 4, 4]
    assert left == [], left


def test_write_to_a_stage_that_raised_reports_its_error():
    """A stage that raised sends its traceback and exits, so the driver's next write to it can
    find the socket closed before the driver has read why: the error is still the stage's own
    ("stage 1 raised" with the traceback), not a death without a cause.  (The driver alone, on
    socket pairs standing for two stages.)"""
    import pickle
    from multiprocessing import Pipe
    from types import SimpleNamespace

    from pprun.core.outputs import CachedRequestData, SchedulerOutput
    from pprun.executor.remote import RemoteStagesExecutor

    parallel = SimpleNamespace(microbatches=None, async_pipeline=None, control_spin_us=None, tensor_parallel_size=1)
    ex = RemoteStagesExecutor(SimpleNamespace(layer_partition=[2, 2], device="cpu", cfg=SimpleNamespace(
        parallel=parallel)), timeout_s=5.0)  # fmt: skip
    (driver0, stage0), (driver1, stage1) = Pipe(), Pipe()
    ex.conns = [driver0, driver1]
    stage1.send_bytes(pickle.dumps(("error", 1, "Traceback ...\nRuntimeError: injected failure in stage 1")))
    stage1.close()
    with pytest.raises(StageFailedError, match=r"^stage 1 raised:\n(.|\n)*injected failure in stage 1"):
        ex.submit(SchedulerOutput(0, [], CachedRequestData(), {"r": 1}, 1))
    assert ex.dead
    stage0.close()
