"""Pipeline parallelism on CPU (gloo): parity across pp and executors, overlap, failures."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import pytest
import torch
from leftovers import Snapshot
from stage_zygote import Zygote, use_zygote

from pprun import LLM, SamplingParams
from pprun.executor.base import StageFailedError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
TOKEN_PROMPTS = [
    {"prompt_token_ids": [5, 17, 42, 9, 100, 3, 7]},
    {"prompt_token_ids": [11]},
    {"prompt_token_ids": list(range(30, 70))},
    {"prompt_token_ids": [200, 201, 202, 7, 7, 7]},
    {"prompt_token_ids": list(range(100, 119))},
]


STAGE_TIMEOUT_S = 120.0
"""``parallel.stage_timeout_s`` of this module's Ray pipelines and fault cells: no test here
waits for the timeout to fire, and on Ray the setting also bounds the actors' start (plus 60 s),
which the first pipeline of a fresh cluster can take two minutes for on a loaded 2-core machine."""


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def pids_gone(pids: list[int], within_s: float = 15.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                # A zombie child of ours counts as gone once reaped; check /proc state.
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().split(") ")[1].startswith("Z"):
                        continue
                alive.append(pid)
            except (ProcessLookupError, FileNotFoundError):
                pass
        if not alive:
            return True
        time.sleep(0.2)
    return False


@pytest.fixture(scope="module")
def zygote():
    """The warm template that the ``mp`` stages of some cells fork from (``tests/stage_zygote.py``)."""
    z = Zygote(dict(os.environ, OMP_NUM_THREADS="1"))
    yield z
    z.close()


def fork_stages(request, monkeypatch) -> None:
    """For the rest of the test, ``mp`` stages fork from the module's warm template
    (``tests/stage_zygote.py``) instead of starting as fresh interpreters (about 4.5 s of CPU
    each): for the cells whose checks are what the stages compute and send.  The fresh start is
    checked by the other ``mp`` cells here: the two-stage parity cells, the control-socket,
    step-trace and overlap cells, and every fault cell."""
    use_zygote(monkeypatch, request.getfixturevalue("zygote"))


@pytest.fixture(scope="module")
def tiny_reference(tiny_llama_dir):
    with LLM(str(tiny_llama_dir), dtype="float32", executor="uni", runner="v1") as llm:
        return tokens(llm.generate(TOKEN_PROMPTS, GREEDY))


@pytest.mark.parametrize(
    "executor, pp, partition",
    [
        ("mp", 2, None),
        ("mp", 3, [1, 1, 2]),
        ("mp", 4, None),
        ("ray", 2, [3, 1]),
        ("ray", 3, None),
        ("ray", 4, None),
    ],
)
def test_tiny_tokens_identical_across_pp(tiny_llama_dir, tiny_reference, executor, pp, partition, request,
                                        monkeypatch):  # fmt: skip
    """Tokens as in one process for every pp and executor.  The ``mp`` cells of three and four
    stages fork their stages from the warm template (:func:`fork_stages`): what they check is the
    pipeline's tokens."""
    if executor == "ray":
        request.getfixturevalue("ray_cluster")
    if executor == "mp" and pp > 2:
        fork_stages(request, monkeypatch)
    with LLM(str(tiny_llama_dir), dtype="float32", executor=executor, pipeline_parallel_size=pp,
             layer_partition=partition, runner="v1", stage_timeout_s=STAGE_TIMEOUT_S) as llm:
        assert tokens(llm.generate(TOKEN_PROMPTS, GREEDY)) == tiny_reference
        d = llm.describe()
        assert d["pipeline_parallel_size"] == pp and sum(d["layer_partition"]) == 4
        if partition:
            assert d["layer_partition"] == partition


def test_v2_three_batches_in_flight_through_two_stages(tiny_llama_dir, tiny_reference, request, monkeypatch):
    """parallel.microbatches=3 with two stages: three steps in flight, the last stage launching
    a step before the previous one's sampled ids are read; tokens as in one process."""
    fork_stages(request, monkeypatch)
    with LLM(str(tiny_llama_dir), dtype="float32", executor="mp", pipeline_parallel_size=2,
             microbatches=3, runner="v2", async_pipeline=False) as llm:
        assert llm.engine.executor.max_in_flight == 3
        for conn in llm.engine.executor.conns:  # no 40 ms delayed-ACK stalls (see set_nodelay)
            with socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM) as sock:
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        assert tokens(llm.generate(TOKEN_PROMPTS, GREEDY)) == tiny_reference
        assert llm.engine.num_steps > 0
        facts = llm.engine.executor.call_all("runner_facts")
        assert facts == [{"runner": "v2", "cudagraph_mode": "none", "hop_in_graph": False}] * 2


def test_control_sockets_polled_before_blocking(tiny_llama_dir, tiny_reference, monkeypatch):
    """PPRUN_CONTROL_SPIN_US: driver and stages poll their sockets before blocking (by default
    with GPU stages on hosts with cores to spare); same tokens, and a stage killed meanwhile is
    still seen."""
    from pprun.executor.remote import control_spin_s

    monkeypatch.setenv("PPRUN_CONTROL_SPIN_US", "300")  # the stage processes inherit it
    with LLM(str(tiny_llama_dir), dtype="float32", executor="mp", pipeline_parallel_size=2, runner="v2") as llm:
        assert llm.engine.executor.spin_s == pytest.approx(3e-4)
        assert llm.engine.executor._spinner is not None
        assert tokens(llm.generate(TOKEN_PROMPTS, GREEDY)) == tiny_reference
        pids = list(llm.engine.executor.stage_pids)
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(StageFailedError, match="stage 1"):
            llm.generate(TOKEN_PROMPTS, GREEDY)
    assert pids_gone(pids)
    monkeypatch.setenv("PPRUN_CONTROL_SPIN_US", "0")
    assert control_spin_s(3, "cuda") == 0.0
    monkeypatch.delenv("PPRUN_CONTROL_SPIN_US")
    assert control_spin_s(3, "cpu") == 0.0  # CPU stages need the cores
    for bad in ("-5", "1.5", "fast", "100001"):
        monkeypatch.setenv("PPRUN_CONTROL_SPIN_US", bad)
        with pytest.raises(ValueError, match=f"PPRUN_CONTROL_SPIN_US='{bad}' is invalid.*microseconds from 0 to 100000"):
            LLM(str(tiny_llama_dir), dtype="float32", executor="mp", pipeline_parallel_size=2)


def test_async_pipeline_steps_give_the_outputs_of_one_process(demo_model_dir, request, monkeypatch):
    """pp=2 with async steps (``async_pipeline``): each batch's next step is submitted while its
    current one is in the pipeline and computes on the ids the last stage sent the first; stops
    (EOS, stop strings, max_tokens 1, min_tokens) and seeded sampling come out as in one process
    with synchronous steps, the overshoot tokens dropped."""
    from test_engine import DEMO_PROMPTS, STOP_MIX, outcomes

    fork_stages(request, monkeypatch)

    def run(**kw) -> tuple[tuple, list[tuple]]:
        with LLM("smollm2-135m-instruct", dtype="float32", max_model_len=512, **kw) as llm:
            outs = llm.generate(DEMO_PROMPTS[:6], STOP_MIX)
            ex = llm.engine.executor
            facts = (llm.engine.async_scheduling, getattr(ex, "async_steps", False), ex.max_in_flight)
        return facts, outcomes(outs)

    facts_one, want = run(async_scheduling=False)
    assert facts_one == (False, False, 1)
    facts, got = run(executor="mp", pipeline_parallel_size=2, microbatches=3, runner="v2", async_pipeline=True)
    assert facts == (True, True, 6)  # three batches, two steps each
    assert got == want


def test_async_pipeline_steps_default_on_gpu_only():
    """``parallel.async_pipeline`` unset: async pipeline steps on CUDA stages with the V2 runner,
    off on CPU (the stages compute on their hosts), with V1 and with tensor parallelism; True asks
    for them on CPU."""
    from types import SimpleNamespace

    from pprun.executor.remote import RemoteStagesExecutor

    def executor(device: str, wanted, runner: str = "v2", tp: int = 1) -> RemoteStagesExecutor:
        parallel = SimpleNamespace(microbatches=None, async_pipeline=wanted, control_spin_us=None,
                                   tensor_parallel_size=tp)
        resolved = SimpleNamespace(layer_partition=[2, 2], device=device, cfg=SimpleNamespace(parallel=parallel))
        return RemoteStagesExecutor(resolved, timeout_s=5.0, runner=runner)

    cpu, cuda = executor("cpu", None), executor("cuda", None)
    assert (cpu.async_steps, cpu.max_in_flight) == (False, 2)
    assert (cuda.async_steps, cuda.max_in_flight) == (True, 4)
    assert executor("cpu", True).async_steps and not executor("cuda", False).async_steps
    assert not executor("cuda", None, runner="v1").async_steps
    assert not executor("cuda", None, tp=2).async_steps


@pytest.mark.parametrize("executor", ["mp", "ray"])
def test_async_pipeline_steps_survive_preemption(tiny_llama_dir, executor, request, monkeypatch):
    """A KV cache too small for every request: preemptions (only of requests out of flight)
    while batches have steps in flight computing on fed-back ids; tokens as requests alone."""
    from test_engine import _run_engine, token_prompts

    if executor == "ray":
        request.getfixturevalue("ray_cluster")
    else:
        fork_stages(request, monkeypatch)
    prompts = token_prompts(8, seed=1)
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * len(prompts)
    with LLM(str(tiny_llama_dir), dtype="float32") as llm:
        alone = [llm.generate([p], sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    per_block = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers per stage, block 16, 2 kv heads, dim 16, fp32
    with LLM(str(tiny_llama_dir), dtype="float32", executor=executor, pipeline_parallel_size=2, runner="v2",
             async_pipeline=True, max_model_len=96, kv_cache_memory_bytes=12 * per_block,
             max_num_batched_tokens=32, stage_timeout_s=STAGE_TIMEOUT_S) as llm:
        assert llm.engine.executor.async_steps
        tight = _run_engine(llm, prompts, params, arrivals=[0] * 8)
        preemptions = llm.engine.num_preemptions
    assert tight == alone
    assert preemptions > 0


def test_async_pipeline_steps_through_three_stages(tiny_llama_dir, tiny_reference, request, monkeypatch):
    """pp=3: the middle stage reads no input ids (pending tokens pass through it unread); the
    first and last stage exchange the ids; tokens as in one process."""
    fork_stages(request, monkeypatch)
    with LLM(str(tiny_llama_dir), dtype="float32", executor="mp", pipeline_parallel_size=3,
             layer_partition=[1, 2, 1], microbatches=4, runner="v2", async_pipeline=True) as llm:
        assert llm.engine.executor.max_in_flight == 8
        d = llm.describe()
        assert d["async_pipeline_steps"] is True and d["async_scheduling"] is False
        assert tokens(llm.generate(TOKEN_PROMPTS * 3, GREEDY)) == tiny_reference * 3


def test_async_pipeline_steps_abort_in_flight(tiny_llama_dir, tiny_reference, request, monkeypatch):
    """Requests aborted while their steps (two per batch) are in the pipeline: they end with
    "abort", the ids sent for their in-flight steps are dropped, the others' tokens are those
    of one process; new requests admitted afterwards are served too."""
    fork_stages(request, monkeypatch)
    with LLM(str(tiny_llama_dir), dtype="float32", executor="mp", pipeline_parallel_size=2, runner="v2",
             microbatches=2, async_pipeline=True) as llm:
        eng = llm.engine
        ids = [eng.add_request(p["prompt_token_ids"], GREEDY) for p in TOKEN_PROMPTS]
        results: dict[str, object] = {}
        for step in range(400):
            if step == 6:
                eng.abort_request(ids[1])
                eng.abort_request(ids[3])
                assert eng.num_steps > 4
                in_flight = {r for so in eng.in_flight for r in so.num_scheduled_tokens}
                assert ids[1] in in_flight and ids[3] in in_flight  # aborted while in the pipeline
            if step == 12:
                late = eng.add_request(TOKEN_PROMPTS[0]["prompt_token_ids"], GREEDY)
            for out in eng.step():
                results[out.request_id] = out
            if len(results) == len(ids) + 1:
                break
    assert [results[ids[i]].outputs[0].finish_reason for i in (1, 3)] == ["abort", "abort"]
    assert all(len(results[ids[i]].outputs[0].token_ids) < GREEDY.max_tokens for i in (1, 3))  # cut short
    for i in (0, 2, 4):
        assert results[ids[i]].outputs[0].token_ids == tiny_reference[i]
    assert results[late].outputs[0].token_ids == tiny_reference[0]


def test_pipeline_engine_submits_before_its_bookkeeping(request, monkeypatch):
    """A pipeline's engine submits the next step right after applying an output, before its
    per-request bookkeeping (the stages wait on that submission); with a stop string in play
    (checked by that bookkeeping) it submits only in the next call."""
    fork_stages(request, monkeypatch)
    with LLM("smollm2-135m-instruct", dtype="float32", max_model_len=256, executor="mp",
             pipeline_parallel_size=2, runner="v2") as llm:
        eng, ex = llm.engine, llm.engine.executor
        events: list[str] = []

        def recording(fn, mark: str):
            def wrapped(*a):
                out = fn(*a)
                events.append(mark)
                return out

            return wrapped

        for obj, name, mark in ((ex, "get_output", "g"), (ex, "submit", "s"), (eng, "step", "r")):
            setattr(obj, name, recording(getattr(obj, name), mark))

        def pattern(params: SamplingParams) -> str:
            events.clear()
            llm.generate(["1, 2, 3, 4,", "The capital of France is"], params)
            # Steady decode: the middle of the run, one output and one submission per call.
            return "".join(events)[len(events) // 3 : 2 * len(events) // 3]

        assert "gsr" in pattern(SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        late = pattern(SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=["@@@"]))
        assert "gsr" not in late and "grs" in late


def fail_submission(executor, n: int, message: str) -> None:
    """Make the ``n``-th ``executor.submit`` call from now on raise ``StageFailedError(message)``."""
    real_submit, calls = executor.submit, [0]

    def submit(so):
        calls[0] += 1
        if calls[0] == n:
            raise StageFailedError(message)
        real_submit(so)

    executor.submit = submit


def test_pipeline_submit_failing_after_an_output_fails_every_request(tiny_llama_dir, request, monkeypatch):
    """A submission that fails right after an output was applied (the early submission of a
    pipeline's engine): that call still returns what finished, the engine is dead, and the
    caller gets every unfinished request back as an error."""
    fork_stages(request, monkeypatch)
    with LLM(str(tiny_llama_dir), dtype="float32", executor="mp", pipeline_parallel_size=2, runner="v2") as llm:
        eng = llm.engine
        fail_submission(eng.executor, 8, "stage 0 died (injected at submission 8)")
        with pytest.raises(StageFailedError, match="injected at submission 8") as info:
            llm.generate(TOKEN_PROMPTS, GREEDY)
        assert eng.dead and "injected" in eng.dead
        outs = info.value.outputs
        assert len(outs) == len(TOKEN_PROMPTS)
        assert all(o.outputs[0].finish_reason == "error" for o in outs)
    # One prompt: the failing submission follows its own output; generate must still raise.
    with LLM(str(tiny_llama_dir), dtype="float32", executor="mp", pipeline_parallel_size=2, runner="v2") as llm:
        fail_submission(llm.engine.executor, 3, "stage 1 died (injected at submission 3)")
        with pytest.raises(StageFailedError, match="injected at submission 3") as info:
            llm.generate(TOKEN_PROMPTS[:1], GREEDY)
        assert [o.outputs[0].finish_reason for o in info.value.outputs] == ["error"]


@pytest.mark.parametrize("async_steps", [False, True])
def test_step_trace_written_by_every_stage_and_the_engine(tiny_llama_dir, tmp_path, monkeypatch, async_steps):
    """PPRUN_STEP_TRACE: each stage process and the engine write their per-step timings at
    shutdown; with async pipeline steps the first and last stage also their waits for and sends
    of sampled ids."""
    prefix = tmp_path / "trace"
    monkeypatch.setenv("PPRUN_STEP_TRACE", str(prefix))
    with LLM(str(tiny_llama_dir), dtype="float32", executor="mp", pipeline_parallel_size=2, runner="v2",
             async_pipeline=async_steps) as llm:
        llm.generate(TOKEN_PROMPTS, GREEDY)
        num_steps = llm.engine.num_steps
    feedback = sorted(p.name for p in tmp_path.glob("trace.feedback_*.json"))
    if not async_steps:
        assert feedback == []
    else:
        assert feedback == ["trace.feedback_first.json", "trace.feedback_last.json"]
        sends = json.loads((tmp_path / "trace.feedback_last.json").read_text())["calls"]
        fills = json.loads((tmp_path / "trace.feedback_first.json").read_text())["calls"]
        # A send per step that samples (every step here: short prompts), a fill per step that
        # reads pending ids (every decode step that a request joined while in flight).
        assert len(sends) == num_steps and 0 < len(fills) < num_steps
        assert all(t1 >= t0 for t0, t1 in sends + fills)
    engine = json.loads((tmp_path / "trace.engine.json").read_text())
    assert engine["num_steps"] == num_steps == len(engine["steps"])
    assert engine["summary"]["get_output_wait_us"]["n"] == num_steps
    for rank in (0, 1):
        stage = json.loads((tmp_path / f"trace.stage{rank}.json").read_text())
        assert stage["num_steps"] == num_steps  # every step reaches every stage
        assert sum(r["num_tokens"] for r in stage["steps"]) == sum(
            r["num_tokens"] for r in json.loads((tmp_path / "trace.stage0.json").read_text())["steps"]
        )
        assert all(r["host_us"] > 0 for r in stage["steps"])
        assert "compute_us" not in stage["steps"][0]  # CPU: no stream events
        # The V2 runner's host waits before each launch: the previous step's reads of the input
        # buffers (every step), the sampled ids (the first stage of an async pipeline, on the
        # steps that read pending ids: not every step).
        assert all(0 <= r["wait_reads_us"] <= r["host_us"] for r in stage["steps"] if r["num_tokens"] > 0)
        # Its host work by phase: every phase a stage runs, and together no more than its step.
        from pprun.utils.step_trace import HOST_PHASES

        busy = [r for r in stage["steps"] if r["num_tokens"] > 0]
        ran = {"update_us", "prepare_us", "to_device_us", "launch_us"}
        ran |= {"sample_us"} if rank == 1 else {"expect_us"} if async_steps else set()
        assert {k for r in busy for k in HOST_PHASES if k in r} == ran
        for r in busy:
            spent = sum(r.get(k, 0.0) for k in (*HOST_PHASES, "wait_reads_us", "wait_ids_us"))
            assert 0 < spent <= r["host_us"]
        with_ids = [r for r in stage["steps"] if "wait_ids_us" in r]
        if rank == 0 and async_steps:
            assert 0 < len(with_ids) < num_steps and all(0 <= r["wait_ids_us"] <= r["host_us"] for r in with_ids)
        else:
            assert with_ids == []
    # The summary of the run's steady decode (scripts/trace_summary.py): the engine's window,
    # and per stage the steps that started in it.
    from pprun.utils.step_trace import summarize_traces

    summary = summarize_traces(str(prefix))
    window = summary["steady_decode"]
    assert window is not None and window["decode_steps"] >= 2
    assert sorted(summary["stages"]) == ["stage0", "stage1"]
    assert ("wait_ids_us" in summary["stages"]["stage0"]) == async_steps
    for stage in summary["stages"].values():
        # Steps started between the window's first and last answer: all but those already in
        # flight when it opened (at most steps in flight - 1: 1, or 3 with async steps).
        assert stage["host_us"]["n"] >= window["decode_steps"] - 3 and stage["period_us"] > 0
    assert summary["engine"]["get_output_wait_us"]["n"] == window["decode_steps"]


def test_last_stage_launches_a_decode_step_before_answering_the_previous_one():
    """serve_steps: a pending output (GPU) is answered after the next step is launched when that
    launch is quick (a graph replay) and the device is still busy with it, before a slow launch or
    when the device is done, at once when nothing waits; answers keep step order."""
    import pickle

    from pprun.core.outputs import CachedRequestData, ModelRunnerOutput, SchedulerOutput
    from pprun.executor.remote import serve_steps

    log: list[str] = []

    def step(i: int, tokens: int) -> SchedulerOutput:
        return SchedulerOutput(i, [], CachedRequestData(), {"r": tokens}, tokens)

    from pprun.worker.runner_base import PendingOutput

    class DeviceEvent:  # stands in for the CUDA event recorded after the step's copies
        def __init__(self, i):
            self.i = i

        def query(self):
            return self.i == 4  # the device finished step 4 before step 5's message was read

    def Pending(i):  # noqa: N802  (stands in for a class)
        return PendingOutput(lambda: ModelRunnerOutput(i, ["r"], [[i]]), DeviceEvent(i))

    class FakeWorker:
        def execute_model(self, so, wait=True):
            log.append(f"launch {so.step_id}")
            return Pending(so.step_id) if so.step_id != 3 else ModelRunnerOutput(3, ["r"], [[3]])

        def launches_quickly(self, so):
            return so.total_num_scheduled_tokens == so.num_reqs  # stands in for "a full graph"

        def ping(self):
            return "pong"

    class FakeConn:
        def __init__(self, messages):
            self.messages = messages

        def poll(self):
            return bool(self.messages)

        def recv(self):
            return self.messages.pop(0)

        def send_bytes(self, data):
            log.append(f"answer {pickle.loads(data)[1].step_id}")

        def send(self, obj):
            log.append(f"result {obj[1]}")

    # 0, 1: decodes arriving together; 2: a prefill chunk; 3: a complete output; 4, 5: decodes,
    # 4 finished on the device by the time 5 arrives; then a call.
    msgs = [("step", step(0, 1)), ("step", step(1, 1)), ("step", step(2, 5)), ("step", step(3, 1)),
            ("step", step(4, 1)), ("step", step(5, 1)), ("call", "ping", {}), ("shutdown",)]  # fmt: skip
    serve_steps(FakeConn(msgs), FakeWorker())
    assert log == [
        "launch 0", "launch 1", "answer 0",  # decode 1 launched before 0's ids are awaited
        "answer 1", "launch 2",  # a prefill's launch is slow: answer first
        "launch 3", "answer 2", "answer 3",  # 3 is a decode again; complete, so answered at once
        "launch 4", "answer 4", "launch 5",  # 4 is done on the device: its answer goes first
        "answer 5", "result pong",
    ]  # fmt: skip


DEMO_TEXTS = ["The capital of France is", "def add(a, b):", "Hi", "Write a short poem about a cat who"]


@pytest.fixture(scope="module")
def demo_reference(demo_model_dir):
    with LLM("smollm2-135m-instruct", dtype="float32", max_model_len=512, runner="v1") as llm:
        return tokens(llm.generate(DEMO_TEXTS, GREEDY))


@pytest.mark.parametrize("executor, pp, partition", [("mp", 2, None), ("ray", 2, None), ("ray", 3, [12, 8, 10])])
def test_demo_tokens_identical_across_pp(demo_reference, executor, pp, partition, request):
    if executor == "ray":
        request.getfixturevalue("ray_cluster")
    with LLM("smollm2-135m-instruct", dtype="float32", max_model_len=512, executor=executor,
             pipeline_parallel_size=pp, layer_partition=partition, runner="v1",
             stage_timeout_s=STAGE_TIMEOUT_S) as llm:
        assert tokens(llm.generate(DEMO_TEXTS, GREEDY)) == demo_reference


def test_stage_parameters_add_up_to_the_model(tiny_llama_dir, ray_cluster):
    with LLM(str(tiny_llama_dir), dtype="float32", executor="uni", runner="v1") as llm:
        (full,) = llm.engine.executor.stage_params
    with LLM(str(tiny_llama_dir), dtype="float32", executor="ray", pipeline_parallel_size=2, runner="v1",
             stage_timeout_s=STAGE_TIMEOUT_S) as llm:
        split = llm.engine.executor.stage_params
    assert sum(split) == full  # untied: nothing is held twice
    assert all(0 < s < full for s in split)


def test_batches_overlap_across_stages(tiny_llama_dir, tmp_path, monkeypatch, inject_faults):
    """pp=2 with two batches in flight: stage 0 starts a step while stage 1 still runs the one
    before, read from what the stages record (their step traces: each step's start and host time,
    on the host's monotonic clock, shared by processes), not from the wall clock of the run.

    Each stage sleeps ``d`` per step (an injected delay, counted in its step), so a step spans at
    least ``d`` whatever the machine's load.  Steps run in turn (one batch in flight) would
    give stage 0's step k+1 a start after stage 1's step k ends, every time."""
    d = 0.1
    n_req, max_tokens = 8, 8
    prompts = [{"prompt_token_ids": [10 + i, 20 + i, 30]} for i in range(n_req)]
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prefix = tmp_path / "trace"
    monkeypatch.setenv("PPRUN_STEP_TRACE", str(prefix))
    with inject_faults({0: {"delay_s": d}, 1: {"delay_s": d}}):
        llm = LLM(str(tiny_llama_dir), dtype="float32", executor="mp", pipeline_parallel_size=2, runner="v1")
    with llm:
        assert llm.engine.executor.max_in_flight == 2
        outs = llm.generate(prompts, sp)
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    steps = []
    for rank in (0, 1):
        rows = json.loads((tmp_path / f"trace.stage{rank}.json").read_text())["steps"]
        steps.append([(r["t0"], r["t0"] + r["host_us"] * 1e-6) for r in rows if r["num_tokens"] > 0])
    first, last = steps
    assert len(first) == len(last) >= max_tokens  # both stages ran every step
    assert all(end - start >= d for start, end in first + last)
    # Stage 0 began step k+1 before stage 1 ended step k: the two stages worked at once.
    overlapped = sum(first[k + 1][0] < last[k][1] for k in range(len(first) - 1))
    assert overlapped >= (len(first) - 1) // 2, (overlapped, len(first))


FAULT_TIMEOUT_S = STAGE_TIMEOUT_S
"""``parallel.stage_timeout_s`` of the fault cells below: their faults (an exception, a death)
are detected without the timeout, which must then never fire, however loaded the machine."""


def pipeline_llm(model_dir, executor: str, request, **kwargs) -> LLM:
    """A two-stage pipeline of the tiny model, V1 unless ``runner`` says otherwise (the Ray
    cluster fixture joined when needed)."""
    if executor == "ray":
        request.getfixturevalue("ray_cluster")
    kwargs.setdefault("runner", "v1")
    kwargs.setdefault("stage_timeout_s", FAULT_TIMEOUT_S)
    return LLM(str(model_dir), dtype="float32", executor=executor, pipeline_parallel_size=2, **kwargs)


def assert_failed_cleanly(info, llm: LLM, run: tuple, before, model_dir, executor: str, request) -> None:
    """The fault cells' checks (docs/failures.md): every request ended with "error", nothing of the run is left (processes, sockets, shared memory,
    the rendezvous directory: ``tests/leftovers.py``), and a new LLM starts and serves in this
    process (its ``mp`` stages forked from the warm template, :func:`fork_stages`: the failed
    pipeline's started fresh).  ``run``: the stage pids and rendezvous directory, taken at start."""
    outs = info.value.outputs
    assert len(outs) == len(TOKEN_PROMPTS)
    assert all(o.outputs[0].finish_reason == "error" and o.error for o in outs)
    llm.shutdown()
    pids, rendezvous = run
    assert before.left_behind(pids, [rendezvous]) == []
    if executor == "mp":
        fork_stages(request, request.getfixturevalue("monkeypatch"))
    with pipeline_llm(model_dir, executor, request) as again:
        assert len(again.generate(TOKEN_PROMPTS[:1], GREEDY)[0].outputs[0].token_ids) == 12


def started(llm: LLM) -> tuple[list[int], str | None]:
    """The stage pids and the rendezvous directory of a started pipeline."""
    ex = llm.engine.executor
    return list(ex.stage_pids), ex.rendezvous_dir


@pytest.mark.parametrize("executor", ["mp", "ray"])
def test_stage_that_raises_becomes_an_error(tiny_llama_dir, executor, request, inject_faults):
    """Stage 1 raises in its third step: the error names it (not stage 0, which exits after it)
    and carries its traceback."""
    if executor == "ray":
        request.getfixturevalue("ray_cluster")
    before = Snapshot()
    with inject_faults({1: {"raise_at_step": 3}}):
        llm = pipeline_llm(tiny_llama_dir, executor, request)
    run = started(llm)
    with pytest.raises(StageFailedError, match=r"^(the engine has failed \()?stage 1 raised:(.|\n)*injected failure in stage 1") as info:
        llm.generate(TOKEN_PROMPTS, GREEDY)
    assert_failed_cleanly(info, llm, run, before, tiny_llama_dir, executor, request)


@pytest.mark.parametrize("executor", ["mp", "ray"])
def test_killed_stage_becomes_an_error(tiny_llama_dir, executor, request, inject_faults):
    """SIGKILL of the last stage's process in the middle of a generation."""
    if executor == "ray":
        request.getfixturevalue("ray_cluster")
    before = Snapshot()
    with inject_faults({0: {"delay_s": 0.05}}):
        llm = pipeline_llm(tiny_llama_dir, executor, request)
    run = started(llm)
    killer = threading.Timer(1.5, lambda: os.kill(run[0][1], signal.SIGKILL))
    killer.start()
    with pytest.raises(StageFailedError, match="stage 1") as info:
        llm.generate(TOKEN_PROMPTS, SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
    killer.join()
    assert_failed_cleanly(info, llm, run, before, tiny_llama_dir, executor, request)


@pytest.mark.parametrize("victim", [0, 1])
def test_killed_stage_with_async_pipeline_steps_becomes_an_error(tiny_llama_dir, victim, request, inject_faults):
    """Async pipeline steps: the first stage may be waiting for sampled ids the last stage will
    never send (or the last stage for a step that never comes); the driver still notices the
    dead stage, fails every request and stops the survivor."""
    before = Snapshot()
    with inject_faults({0: {"delay_s": 0.02}}):
        llm = pipeline_llm(tiny_llama_dir, "mp", request, runner="v2", async_pipeline=True)
    assert llm.engine.executor.async_steps
    run = started(llm)
    killer = threading.Timer(1.5, lambda: os.kill(run[0][victim], signal.SIGKILL))
    killer.start()
    with pytest.raises(StageFailedError, match=f"stage {victim}") as info:
        llm.generate(TOKEN_PROMPTS, SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
    killer.join()
    assert_failed_cleanly(info, llm, run, before, tiny_llama_dir, "mp", request)


def test_mismatched_intermediate_keys_are_a_clear_error(tiny_llama_dir, inject_faults):
    with inject_faults({0: {"rename_sent_keys": True}}):
        llm = LLM(str(tiny_llama_dir), dtype="float32", executor="mp", pipeline_parallel_size=2, runner="v1",
                  stage_timeout_s=FAULT_TIMEOUT_S)
    with pytest.raises(StageFailedError, match=r"keys differ.*hidden_states_renamed.*expects \['hidden_states'\]"):
        llm.generate(TOKEN_PROMPTS[:1], GREEDY)
    llm.shutdown()


def test_non_first_stage_gets_no_token_inputs():
    """Unit test of ``build_model_inputs`` alone (no runner, no pipeline): for a non-first stage
    it drops ``input_ids`` and ``inputs_embeds`` and passes the given intermediate tensors on as
    they are.  Contract 2 through the real V1 and V2 stage code (persistent receive buffers
    included) is tests/test_contracts.py::test_non_first_stage_forward_gets_received_tensors_in_persistent_buffers."""
    from pprun.worker.model_inputs import build_model_inputs

    its = {"hidden_states": torch.zeros(3, 4), "residual": torch.zeros(3, 4)}
    kw = build_model_inputs(torch.nn.Module(), is_first_stage=False, input_ids=torch.tensor([1, 2, 3]),
                            positions=torch.arange(3), intermediate_tensors=its, attn_metadata=None)
    assert kw["input_ids"] is None and kw["inputs_embeds"] is None and kw["intermediate_tensors"] is its


def test_transport_sends_metadata_once_and_rejects_later_changes(monkeypatch):
    """The metadata message travels with the first send only; a later send whose keys, widths or
    dtypes differ from what was announced fails on the sending side (the receiver would wait)."""
    import torch.distributed as dist

    from pprun.distributed.intermediate import IntermediateTensors
    from pprun.distributed.layout import StageLayout
    from pprun.distributed.transport import META_BYTES, PACK_MAX_BYTES, PipelineTransport

    wire: list[torch.Tensor] = []
    monkeypatch.setattr(dist, "send", lambda t, dst, group=None: wire.append(t.clone()))
    sender = PipelineTransport(StageLayout.from_partition([1, 1], 0), torch.device("cpu"), None, None, [0, 1])

    def its(n: int, width: int = 4, keys=("hidden_states", "residual"), dtype=torch.float32):
        return IntermediateTensors({k: torch.full((n, width), float(i), dtype=dtype) for i, k in enumerate(keys)})

    sender.send(its(3))
    assert [t.numel() for t in wire] == [META_BYTES, 24]  # metadata, then both tensors stacked
    wire.clear()
    sender.send(its(1))  # another step, another token count: tensors only
    assert [t.numel() for t in wire] == [8]
    wire.clear()
    mixed = PipelineTransport(StageLayout.from_partition([1, 1], 0), torch.device("cpu"), None, None, [0, 1])
    mixed.send(IntermediateTensors({"a": torch.zeros(2, 4), "b": torch.zeros(2, 3)}))
    assert [t.numel() for t in wire] == [META_BYTES, 8, 6]  # different widths: one message each
    wire.clear()
    big = 1 + PACK_MAX_BYTES // (2 * 4 * 4)  # rows of two [n, 4] fp32 tensors past the limit
    sender_big = PipelineTransport(StageLayout.from_partition([1, 1], 0), torch.device("cpu"), None, None, [0, 1])
    sender_big.send(its(big))
    assert [t.numel() for t in wire] == [META_BYTES, 4 * big, 4 * big]  # large hops: one message each
    for bad in (its(2, width=5), its(2, keys=("hidden_states", "other")), its(2, dtype=torch.float16)):
        with pytest.raises(ValueError, match="stage 0: intermediate tensors changed after the first send"):
            sender.send(bad)

    # The receiving side: the first recv reads and checks the metadata, later ones only tensors.
    receiver = PipelineTransport(StageLayout.from_partition([1, 1], 1), torch.device("cpu"), None, None, [0, 1])
    wire.clear()
    sender2 = PipelineTransport(StageLayout.from_partition([1, 1], 0), torch.device("cpu"), None, None, [0, 1])
    sender2.send(its(3))
    sender2.send(its(2))
    sender2.send(its(big))
    queue = list(wire)

    def fake_recv(t, src, group=None):
        t.copy_(queue.pop(0).view(t.dtype).reshape(t.shape))

    monkeypatch.setattr(dist, "recv", fake_recv)
    buffers = IntermediateTensors({k: torch.zeros(8, 4) for k in ("hidden_states", "residual")})
    got = receiver.recv(buffers, 3)
    assert got["residual"].eq(1.0).all() and got["hidden_states"].eq(0.0).all()
    assert got["hidden_states"].shape == (3, 4)
    assert got["residual"].data_ptr() == buffers["residual"].data_ptr()  # landed in the buffers
    got = receiver.recv(buffers, 2)
    assert got["residual"].shape == (2, 4)
    buffers = IntermediateTensors({k: torch.zeros(big, 4) for k in ("hidden_states", "residual")})
    got = receiver.recv(buffers, big)  # past PACK_MAX_BYTES: one message per tensor, as sent
    assert got["residual"].eq(1.0).all() and got["hidden_states"].eq(0.0).all() and not queue


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("graph_hop, async_steps", [(True, True), (False, True), (True, False)])
def test_two_gpu_stages_full_graphs_match_one_gpu(tiny_llama_dir, monkeypatch, graph_hop, async_steps):
    """pp=2 on two GPUs, V2 with full decode graphs, three batches in flight: the same tokens
    as one GPU, with the hop inside the decode graphs (send at the end of stage 0's graph,
    receive at the start of stage 1's) and, with ``PPRUN_DISABLE_GRAPH_HOP=1``, outside them;
    with async steps (the sampled ids sent host to host from the last stage to the first) and without."""
    prompts = TOKEN_PROMPTS * 3  # several decode batches of different sizes
    kw = dict(dtype="float32", device="cuda", runner="v2", cudagraph_mode="full", max_num_seqs=16)
    with LLM(str(tiny_llama_dir), executor="uni", **kw) as llm:
        want = tokens(llm.generate(prompts, GREEDY))
    if not graph_hop:
        monkeypatch.setenv("PPRUN_DISABLE_GRAPH_HOP", "1")
    with LLM(str(tiny_llama_dir), executor="mp", pipeline_parallel_size=2, microbatches=3,
             async_pipeline=async_steps, **kw) as llm:
        assert llm.engine.executor.async_steps is async_steps
        facts = llm.engine.executor.call_all("runner_facts")
        assert [f["cudagraph_mode"] for f in facts] == ["full", "full"]
        assert [f["hop_in_graph"] for f in facts] == [graph_hop, graph_hop]
        assert tokens(llm.generate(prompts, GREEDY)) == want


def _graph_hop_rank(rank: int, init_method: str, results) -> None:
    """One side of test_graph_hop_protocol_over_gloo (a spawned process)."""
    from pprun.distributed.intermediate import IntermediateTensors
    from pprun.distributed.layout import StageLayout
    from pprun.distributed.transport import PipelineTransport

    def its(n: int, keys=("hidden_states", "residual")) -> IntermediateTensors:
        return IntermediateTensors({k: torch.full((n, 4), float(i + 1)) for i, k in enumerate(keys)})

    t = PipelineTransport.init(StageLayout.from_partition([1, 1], rank), torch.device("cpu"), init_method, 60.0)
    try:
        out = {"same": t.agree(("full", (1, 2), True)), "differ": t.agree(("full", (1, 2), rank == 0))}
        if rank == 0:
            t.warm_up(its(3), None)
            # The order the receiver lands messages in is the announced one: a swapped order is
            # refused at capture time instead of landing hidden_states in residual.
            swapped = its(2, keys=("residual", "hidden_states"))
            try:
                t.send_in_graph(swapped)
            except ValueError as e:
                out["swapped_refused"] = "does not match what was announced" in str(e)
            t.send_in_graph(its(2))
        else:
            buffers = IntermediateTensors({k: torch.zeros(8, 4) for k in ("hidden_states", "residual")})
            t.warm_up(None, buffers)
            buffers["hidden_states"].zero_()
            buffers["residual"].zero_()
            t.recv_in_graph(buffers[:2])
            out["landed"] = [buffers["hidden_states"][:2].eq(1).all().item(), buffers["residual"][:2].eq(2).all().item()]
            out["rest_untouched"] = buffers["hidden_states"][2:].eq(0).all().item()
        results.put((rank, out))
    finally:
        t.close()


def test_graph_hop_protocol_over_gloo():
    """The calls that put a hop inside CUDA graphs, run eagerly over gloo between two processes:
    ``agree`` is True only when every stage passed the same value, ``warm_up`` announces and
    checks the metadata with one real hop, and ``send_in_graph`` / ``recv_in_graph`` move each
    tensor into the buffer of its key (a send in another order is refused)."""
    from two_ranks import run_two_ranks

    got = run_two_ranks(_graph_hop_rank)
    assert got[0] == {"same": True, "differ": False, "swapped_refused": True}
    assert got[1] == {"same": True, "differ": False, "landed": [True, True], "rest_untouched": True}
