"""The async engine: per-step deltas from an engine thread, many callers, abort, failure, drain;
the engine process (``EngineProcess``): the same deltas, and its death ends every stream."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from leftovers import Snapshot

from pprun import LLM
from pprun.config.config import PprunConfig
from pprun.engine.async_engine import AsyncEngine, EngineClosedError, QueueFullError
from pprun.engine.engine_loop import StepReport
from pprun.engine.engine_process import EngineProcess
from pprun.sampling.params import SamplingParams

TOKEN_PROMPTS = [{"prompt_token_ids": [(7 * i + j) % 250 + 1 for j in range(3 + i)]} for i in range(6)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def tiny_config(model_dir, **kwargs) -> PprunConfig:
    return PprunConfig.from_kwargs(model=str(model_dir), dtype="float32", max_num_seqs=4, **kwargs)


@pytest.fixture(scope="module")
def tiny_offline(tiny_llama_dir):
    """Offline greedy token ids of TOKEN_PROMPTS (the reference every stream must equal)."""
    with LLM(str(tiny_llama_dir), dtype="float32") as llm:
        return [o.outputs[0].token_ids for o in llm.generate(TOKEN_PROMPTS, GREEDY)]


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_threads_stream_deltas_equal_to_offline(tiny_llama_dir, tiny_offline, runner):
    """Six callers in six threads (more than max_num_seqs=4: some queue, then join the running
    batch); every stream's deltas joined are the offline output, one or more deltas each."""
    engine = AsyncEngine(tiny_config(tiny_llama_dir, runner=runner))
    free_at_start = engine.num_free_blocks()
    results: dict[int, list] = {}

    def client(i: int) -> None:
        results[i] = list(engine.add_request(TOKEN_PROMPTS[i], GREEDY, request_id=f"r{i}"))

    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(TOKEN_PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        for i, deltas in results.items():
            assert [t for d in deltas for t in d.token_ids] == tiny_offline[i]
            assert len(deltas) >= 2 and not any(d.finished for d in deltas[:-1])
            last = deltas[-1]
            assert last.finished and last.finish_reason == "length" and last.metrics is not None
            assert last.num_output_tokens == len(tiny_offline[i])
            assert last.num_prompt_tokens == len(TOKEN_PROMPTS[i]["prompt_token_ids"])
        assert len(results) == len(TOKEN_PROMPTS)
        assert engine.num_free_blocks() == free_at_start and engine.num_unfinished == 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize("client", [AsyncEngine, EngineProcess])
def test_text_deltas_join_to_offline_text(demo_model_dir, client):
    """Incremental detokenization: text deltas joined equal the offline text, a stop string
    included (never streamed, even in part), whether the engine steps on a thread of this process
    or in an engine process (which sends token ids only: the text is made here)."""
    prompts = ["The capital of France is", "Write a haiku about a graphics card."]
    params = [SamplingParams(temperature=0.0, max_tokens=12), SamplingParams(temperature=0.0, max_tokens=12)]
    with LLM(demo_model_dir, executor="uni") as llm:
        offline = llm.generate(prompts, params)
        # A stop string taken from the middle of the first output: the request must stop there.
        full = offline[0].outputs[0].text
        stop = full[len(full) // 2 : len(full) // 2 + 3]
        params.append(SamplingParams(temperature=0.0, max_tokens=12, stop=[stop]))
        prompts.append(prompts[0])
        offline.append(llm.generate(prompts[0], params[2])[0])
    assert offline[2].outputs[0].finish_reason == "stop"
    engine = client(PprunConfig.from_kwargs(model=str(demo_model_dir), executor="uni"))
    try:
        streams = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        for stream, ref in zip(streams, offline):
            deltas = list(stream)
            assert "".join(d.text for d in deltas) == ref.outputs[0].text
            assert [t for d in deltas for t in d.token_ids] == ref.outputs[0].token_ids
            assert deltas[-1].finish_reason == ref.outputs[0].finish_reason
            if ref.outputs[0].finish_reason == "stop":
                assert all(stop not in "".join(d.text for d in deltas[: k + 1]) for k in range(len(deltas)))
    finally:
        engine.shutdown()


def test_asyncio_callers_and_cancel_frees_blocks(tiny_llama_dir, tiny_offline):
    """Callers on an event loop: one cancelled mid-stream is aborted (its blocks come back),
    the others finish with the offline output."""
    engine = AsyncEngine(tiny_config(tiny_llama_dir))
    free_at_start = engine.num_free_blocks()
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def collect(i: int) -> list[int]:
        return [t async for d in engine.generate(TOKEN_PROMPTS[i], GREEDY) for t in d.token_ids]

    async def cancelled() -> int:
        seen = 0
        async for _ in engine.generate(TOKEN_PROMPTS[0], long, request_id="long"):
            seen += 1
            if seen == 3:
                break  # leaving the generator aborts the request
        return seen

    async def main():
        return await asyncio.gather(cancelled(), *(collect(i) for i in range(3)))

    try:
        seen, *outs = asyncio.run(main())
        assert seen == 3 and outs == tiny_offline[:3]
        # The abort is applied before the engine's next step; wait for the stream to be dropped.
        for _ in range(200):
            if engine.num_unfinished == 0:
                break
            threading.Event().wait(0.01)
        assert engine.num_unfinished == 0 and engine.num_free_blocks() == free_at_start
    finally:
        engine.shutdown()


def test_abort_ends_stream_and_frees_blocks(tiny_llama_dir):
    engine = AsyncEngine(tiny_config(tiny_llama_dir))
    free_at_start = engine.num_free_blocks()
    try:
        stream = engine.add_request(TOKEN_PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
        it = iter(stream)
        first = next(it)
        assert not first.finished and engine.num_free_blocks() < free_at_start
        assert engine.abort(stream.request_id)
        rest = list(it)
        assert rest[-1].finished and rest[-1].finish_reason == "abort"
        assert first.num_output_tokens + sum(len(d.token_ids) for d in rest) < 400
        assert engine.num_free_blocks() == free_at_start
        assert not engine.abort(stream.request_id)  # gone: nothing to abort
    finally:
        engine.shutdown()


def test_abort_frees_blocks_within_one_step(tiny_llama_dir):
    """Counted in engine steps (``AsyncEngine.num_steps``): after ``abort()`` returns, at most
    the one step the engine thread may already have been submitting runs before the blocks are
    freed; the step that reports the abort schedules nothing.  A request whose abort waited for
    its own turn would keep stepping (one token per step, 400 allowed)."""
    engine = AsyncEngine(tiny_config(tiny_llama_dir))
    free_at_start = engine.num_free_blocks()
    try:
        stream = engine.add_request(TOKEN_PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
        it = iter(stream)
        for _ in range(3):
            assert not next(it).finished
        assert engine.abort(stream.request_id)
        steps_at_abort = engine.num_steps
        rest = list(it)
        assert rest[-1].finish_reason == "abort"
        assert engine.num_free_blocks() == free_at_start
        assert engine.num_steps - steps_at_abort <= 1, (steps_at_abort, engine.num_steps)
        assert sum(len(d.token_ids) for d in rest) <= 1
    finally:
        engine.shutdown()


def test_bad_requests_are_refused_before_queueing(tiny_llama_dir):
    engine = AsyncEngine(tiny_config(tiny_llama_dir), max_queued_requests=0)
    try:
        with pytest.raises(ValueError, match=r"request\.sampling_params: SamplingParams\.top_p=2\.0"):
            engine.add_request(TOKEN_PROMPTS[0], SamplingParams(top_p=2.0))
        with pytest.raises(ValueError, match=r"request\.prompt\.prompt_token_ids\[0\]=999 is outside the vocabulary"):
            engine.add_request({"prompt_token_ids": [999]}, GREEDY)
        with pytest.raises(ValueError, match="needs a tokenizer"):
            engine.add_request("text", GREEDY)
        long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        streams = [engine.add_request(TOKEN_PROMPTS[0], long, request_id=f"q{i}") for i in range(4)]
        with pytest.raises(ValueError, match="request_id='q0' is invalid"):
            engine.add_request(TOKEN_PROMPTS[0], long, request_id="q0")
        with pytest.raises(QueueFullError, match="4 requests are unfinished"):
            engine.add_request(TOKEN_PROMPTS[0], long)
        for s in streams:
            engine.abort(s.request_id)
        assert all(list(s)[-1].finish_reason == "abort" for s in streams)
        assert engine.num_unfinished == 0
    finally:
        engine.shutdown()


def test_token_id_prompts_fast_path_checks_as_the_engine_does(tiny_llama_dir, tiny_offline):
    """Token-id prompts are checked by type set and min/max when valid
    (``InputProcessor.process_prompt``); whatever fails that gets the element-by-element checks,
    so what is accepted and refused, and the message that says why, do not depend on the path."""
    import numpy as np

    engine = AsyncEngine(tiny_config(tiny_llama_dir))
    eng = engine.engine
    vocab, max_len = eng.vocab_size, eng.max_model_len
    try:
        ids = TOKEN_PROMPTS[1]["prompt_token_ids"]
        for prompt in ({"prompt_token_ids": ids}, {"prompt_token_ids": tuple(ids)}):
            text, got = engine.check_request(prompt, GREEDY)
            assert text is None and got == ids and type(got) is list and got is not ids
        bad = [
            ([np.int64(t) for t in ids], "must be a list of ints"),
            ([], "prompt has 0 tokens"),
            ([1, True, 2], r"prompt_token_ids=\[1, True, 2\] is invalid: must be a list of ints"),
            ([1, 2.0], "must be a list of ints"),
            ([1, -1], r"prompt_token_ids\[1\]=-1 is outside the vocabulary"),
            ([3, vocab], rf"prompt_token_ids\[1\]={vocab} is outside the vocabulary"),
            ([1] * max_len, f"prompt has {max_len} tokens"),
        ]
        for value, message in bad:
            with pytest.raises(ValueError, match=message):
                engine.add_request({"prompt_token_ids": value}, GREEDY)
        with pytest.raises(ValueError, match="unknown key"):
            engine.add_request({"prompt_token_ids": ids, "extra": 1}, GREEDY)
        # The request's output is the offline one.
        stream = engine.add_request({"prompt_token_ids": tuple(ids)}, GREEDY)
        assert [t for d in stream for t in d.token_ids] == tiny_offline[1]
        assert engine.num_unfinished == 0
    finally:
        engine.shutdown()


def long_streams(engine, num: int, max_tokens: int) -> list:
    """``num`` greedy requests of the token prompts that run ``max_tokens`` steps (no EOS)."""
    return [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
            for p in TOKEN_PROMPTS[:num]]


def last_deltas_are_errors(streams, *fragments: str) -> list:
    """Read each stream to its end; its last delta is an error naming every fragment."""
    lasts = [list(s)[-1] for s in streams]
    for last in lasts:
        assert last.finish_reason == "error" and all(f in last.error for f in fragments), last
    return lasts


def test_stage_failure_ends_every_stream_with_an_error(tiny_llama_dir, inject_faults):
    with inject_faults({0: {"raise_at_step": 4}}):
        engine = AsyncEngine(tiny_config(tiny_llama_dir))
    health: list[bool] = []
    engine.add_health_listener(health.append)
    try:
        last_deltas_are_errors(long_streams(engine, 3, 100), "injected failure")
        assert not engine.healthy and health == [False]
        with pytest.raises(EngineClosedError, match="the engine has failed"):
            engine.add_request(TOKEN_PROMPTS[0], GREEDY)
    finally:
        engine.shutdown()


def test_shutdown_drains_then_aborts(tiny_llama_dir, tiny_offline):
    """Shutdown lets a short request finish within the drain timeout, aborts one that cannot,
    and refuses new requests from the moment it starts."""
    engine = AsyncEngine(tiny_config(tiny_llama_dir, stage_timeout_s=30.0))
    short = engine.add_request(TOKEN_PROMPTS[2], GREEDY)
    endless = engine.add_request(TOKEN_PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=1900, ignore_eos=True))
    results = {}
    readers = [threading.Thread(target=lambda s=s: results.setdefault(s.request_id, list(s))) for s in (short, endless)]
    for t in readers:
        t.start()
    engine.shutdown(drain_timeout_s=1.0)
    for t in readers:
        t.join(timeout=30)
    assert [t for d in results[short.request_id] for t in d.token_ids] == tiny_offline[2]
    assert results[endless.request_id][-1].finish_reason == "abort"
    with pytest.raises(EngineClosedError, match="shutting down"):
        engine.add_request(TOKEN_PROMPTS[0], GREEDY)


def test_engine_process_streams_offline_output_and_frees_blocks(tiny_llama_dir, tiny_offline):
    """The engine in its own process: streams from many threads equal the offline output, logprobs
    come with their tokens; an aborted request's blocks come back (the counts the process reports
    with every step)."""
    engine = EngineProcess(tiny_config(tiny_llama_dir))
    free_at_start = engine.num_free_blocks()
    results: dict[int, list[int]] = {}
    try:
        long = engine.add_request(TOKEN_PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True,
                                                                   logprobs=2))
        it = iter(long)
        first = next(it)
        assert not first.finished and engine.num_free_blocks() < free_at_start
        assert len(first.logprobs) == len(first.token_ids) and len(first.logprobs[0].top_token_ids) == 2
        threads = [threading.Thread(target=lambda i=i: results.setdefault(
            i, [t for d in engine.add_request(TOKEN_PROMPTS[i], GREEDY) for t in d.token_ids]))
            for i in range(1, len(TOKEN_PROMPTS))]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert results == {i: tiny_offline[i] for i in range(1, len(TOKEN_PROMPTS))}
        assert engine.abort(long.request_id)
        assert list(it)[-1].finish_reason == "abort"
        assert engine.num_free_blocks() == free_at_start and engine.num_unfinished == 0
        assert engine.describe()["kv_blocks_per_stage"] == free_at_start + 1  # the null block
    finally:
        engine.shutdown()


def test_engine_process_death_ends_every_stream(tiny_llama_dir):
    """The engine process killed mid-stream: the server side sees its socket's EOF, every stream
    ends with an error, health turns false (listeners told), new requests are refused, shutdown
    returns, and nothing is left behind."""
    before = Snapshot()
    engine = EngineProcess(tiny_config(tiny_llama_dir))
    health: list[bool] = []
    engine.add_health_listener(health.append)
    try:
        streams = long_streams(engine, 2, 1900)
        for s in streams:
            next(iter(s))
        os.kill(engine.pid, signal.SIGKILL)
        last_deltas_are_errors(streams, "the engine process exited")
        assert not engine.healthy and health == [False]
        with pytest.raises(EngineClosedError, match="the engine has failed"):
            engine.add_request(TOKEN_PROMPTS[0], GREEDY)
    finally:
        engine.shutdown(drain_timeout_s=0.0)
    assert before.left_behind() == []


def test_engine_process_report_not_delivered_ends_every_stream(tiny_llama_dir, monkeypatch):
    """A step's report that the server side fails to turn into deltas (a bug there) fails the
    engine: every stream ends with an error that says so, instead of waiting for deltas that will
    never come; health turns false and shutdown leaves nothing behind."""
    before = Snapshot()
    engine = EngineProcess(tiny_config(tiny_llama_dir))
    original = engine._on_report

    def broken(report):
        if report.update_ids:
            raise RuntimeError("a bug in delivery")
        original(report)

    monkeypatch.setattr(engine, "_on_report", broken)
    try:
        last_deltas_are_errors(long_streams(engine, 2, 50), "could not be delivered", "a bug in delivery")
        assert not engine.healthy
    finally:
        engine.shutdown(drain_timeout_s=0.0)
    assert before.left_behind() == []


_SERVER_THAT_DIES = """
import sys
from pprun.config.config import PprunConfig
from pprun.engine.engine_loop import StepReport
from pprun.engine.engine_process import EngineProcess
from pprun.sampling.params import SamplingParams
engine = EngineProcess(PprunConfig.from_kwargs(model=sys.argv[1], dtype="float32", max_num_seqs=4))
stream = engine.add_request({"prompt_token_ids": [1, 2, 3]},
                            SamplingParams(temperature=0.0, max_tokens=1900, ignore_eos=True))
next(iter(stream))
print(engine.pid, flush=True)
sys.stdin.read()
"""


def test_engine_process_exits_with_its_server(tiny_llama_dir):
    """A server process SIGKILLed while its engine process steps a request: the engine process
    sees its socket's EOF and exits (its stages with it) instead of stepping for nobody."""
    server = subprocess.Popen([sys.executable, "-c", _SERVER_THAT_DIES, str(tiny_llama_dir)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent)
    try:
        engine_pid = int(server.stdout.readline())
    finally:
        server.kill()
        server.wait(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if psutil.Process(engine_pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.1)
    else:
        psutil.Process(engine_pid).kill()
        pytest.fail(f"engine process {engine_pid} outlived its server by 30 s")


def test_step_report_columns_from_the_loop_to_each_front_end():
    """A step's report as the engine process builds it (``EngineLoop._token_updates``: ids and
    their new tokens as columns, counts only where a request got more than one token, logprobs
    only for those that asked) yields each request's tokens and logprobs, survives pickling, and
    split over two front ends gives each its own requests under their own ids, with the
    counters."""
    import pickle
    import types
    from multiprocessing.connection import Connection

    from pprun.core.outputs import Logprobs
    from pprun.core.request import Request, RequestStatus
    from pprun.engine.engine_loop import EngineLoop, FinishedUpdate
    from pprun.engine.engine_process import _FrontEnds, _socket_pair

    plain = SamplingParams(temperature=0.0, max_tokens=20)
    with_lp = SamplingParams(temperature=0.0, max_tokens=20, logprobs=1)
    reqs = [Request(f"{i % 2}/r{i}", [1, 2], with_lp if i == 2 else plain) for i in range(4)]
    lp = [Logprobs(-0.5, [11], [-0.5]), Logprobs(-0.25, [12], [-0.25]), Logprobs(-0.125, [13], [-0.125])]
    engine = types.SimpleNamespace(tracked={"0/r2": types.SimpleNamespace(logprobs=lp)})
    loop = EngineLoop(engine, lambda wait_s: [], lambda report: None)
    for req, (sent, out) in zip(reqs, [(0, [5]), (1, [6, 7, 8]), (1, [9, 10]), (0, [4])]):
        req.status, req.output_token_ids = RequestStatus.RUNNING, out
        loop._num_reported[req.req_id] = sent
    reqs[3].status = RequestStatus.FINISHED_LENGTH  # its tokens go with its FinishedUpdate
    report = loop._token_updates(reqs)
    expected = [("0/r0", [5], None), ("1/r1", [7, 8], None), ("0/r2", [10], lp[1:2])]
    assert list(report.updates()) == expected
    assert report.update_counts == [1, 2, 1] and list(report.update_logprobs) == [2]
    assert list(pickle.loads(pickle.dumps(report)).updates()) == expected
    assert loop._num_reported == {"0/r0": 1, "1/r1": 3, "0/r2": 2, "1/r3": 0}
    decode = loop._token_updates(reqs[:2])  # nothing new: no update
    assert decode.update_ids == [] and decode.update_counts is None and decode.update_logprobs is None

    pairs = [_socket_pair() for _ in range(3)]
    ours = [Connection(pair[0].detach()) for pair in pairs]
    theirs = [Connection(pair[1].detach()) for pair in pairs]
    try:
        channels = _FrontEnds(theirs[0], theirs[1:])
        channels.owner.update({req.req_id: (i % 2, f"r{i}") for i, req in enumerate(reqs)})
        report.finished = [FinishedUpdate("1/r3", [4], None, "length", num_output_tokens=1)]
        report.num_steps, report.num_free_blocks, report.time = 7, 99, 123.0
        channels.report(report)
        got = [ours[1].recv(), ours[2].recv()]
        assert [list(r.updates()) for r in got] == [[("r0", [5], None), ("r2", [10], lp[1:2])],
                                                    [("r1", [7, 8], None)]]
        assert got[0].finished == [] and [f.request_id for f in got[1].finished] == ["r3"]
        assert [(r.num_steps, r.num_free_blocks, r.time) for r in got] == [(7, 99, 123.0)] * 2
        # A decode step (one token each, no logprobs) takes the split's fast path.
        channels.report(StepReport(["0/r0", "1/r1", "0/r2"], [21, 22, 23]))
        got = [ours[1].recv(), ours[2].recv()]
        assert [list(r.updates()) for r in got] == [[("r0", [21], None), ("r2", [23], None)], [("r1", [22], None)]]
    finally:
        for conn in ours + theirs:
            conn.close()
