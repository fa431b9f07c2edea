"""Scheduler and block-manager tests, driven by a fake model loop (pure Python, fast).

``FakeRunner`` keeps per-request state only from what ``SchedulerOutput`` tells it, the way a
real runner does, and checks the seam on every step: deltas line up, block tables never
overlap nor contain the null block, and its token view equals the scheduler's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import pytest

from pprun.core.block_manager import BlockManager, min_blocks_for_one_request
from pprun.core.outputs import ModelRunnerOutput, SchedulerOutput
from pprun.core.request import Request, RequestStatus
from pprun.core.scheduler import Scheduler
from pprun.sampling.params import SamplingParams

EOS = 2

TokenFn = Callable[[str, list[int]], int]


def position_token(req_id: str, token_ids: list[int]) -> int:
    """The 'model': the next token depends only on the position, so recompute after a
    preemption yields exactly the tokens an uninterrupted run would."""
    return 1000 + len(token_ids)


class FakeRunner:
    """Mirrors runner-side request state from SchedulerOutputs and samples with ``token_fn``."""

    def __init__(self, block_size: int, token_fn: TokenFn = position_token) -> None:
        self.block_size = block_size
        self.token_fn = token_fn
        self.token_ids: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        self.block_ids: dict[str, list[int]] = {}

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in out.finished_req_ids:
            # Tolerant: a request aborted while waiting was never held.
            self.token_ids.pop(req_id, None)
            self.num_computed.pop(req_id, None)
            self.block_ids.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.token_ids, f"{new.req_id} sent as new twice"
            self.token_ids[new.req_id] = list(new.prompt_token_ids)
            self.num_computed[new.req_id] = new.num_computed_tokens
            self.block_ids[new.req_id] = list(new.block_ids)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            assert self.num_computed[req_id] == cached.num_computed_tokens[i]
            self.token_ids[req_id].extend(cached.new_token_ids[i])
            self.block_ids[req_id].extend(cached.new_block_ids[i])
        held = [b for blocks in self.block_ids.values() for b in blocks]
        assert 0 not in held, "null block handed out"
        assert len(held) == len(set(held)), "a block is owned by two requests"

        req_ids, sampled = [], []
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            num_computed = self.num_computed[req_id] + num_tokens
            token_ids = self.token_ids[req_id]
            assert num_computed <= len(token_ids)
            assert len(self.block_ids[req_id]) * self.block_size >= num_computed
            self.num_computed[req_id] = num_computed
            req_ids.append(req_id)
            done = num_computed == len(token_ids)
            sampled.append([self.token_fn(req_id, token_ids)] if done else [])
        return ModelRunnerOutput(step_id=out.step_id, req_ids=req_ids, sampled_token_ids=sampled)


def make_req(req_id: str, num_prompt_tokens: int, **params) -> Request:
    """A request with prompt tokens 10, 11, ... and EOS = 2."""
    return Request(
        req_id=req_id,
        prompt_token_ids=list(range(10, 10 + num_prompt_tokens)),
        sampling_params=SamplingParams(**params),
        eos_token_ids={EOS},
    )


def drive(
    sched: Scheduler,
    runner: FakeRunner,
    max_in_flight: int = 1,
    before_step: Callable[[int], None] | None = None,
    max_iters: int = 1000,
) -> list[SchedulerOutput]:
    """Run until every request finished, keeping up to ``max_in_flight`` steps outstanding."""
    outstanding: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
    outputs = []
    for it in range(max_iters):
        if before_step is not None:
            before_step(it)
        if not sched.has_unfinished_requests() and not outstanding:
            break
        scheduled_something = False
        if len(outstanding) < max_in_flight and sched.has_schedulable_requests():
            out = sched.schedule()
            outputs.append(out)
            assert out.num_reqs <= sched.max_num_seqs
            assert sched.num_running <= sched.max_num_seqs
            assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
            for prev, _ in outstanding:
                overlap = set(prev.num_scheduled_tokens) & set(out.num_scheduled_tokens)
                assert not overlap, f"{overlap} scheduled in two steps in flight"
            runner_out = runner.execute(out)
            for req_id in out.num_scheduled_tokens:
                assert runner.token_ids[req_id] == sched.get_request(req_id).all_token_ids
            if not out.is_empty():
                outstanding.append((out, runner_out))
                scheduled_something = True
        if outstanding and (len(outstanding) >= max_in_flight or not scheduled_something):
            sched.update_from_output(*outstanding.popleft())
        elif not scheduled_something and sched.has_unfinished_requests():
            pytest.fail("scheduler made no progress with nothing in flight")
    else:
        pytest.fail("requests did not finish")
    # Deliver the last finished ids so the runner can drop everything.
    last = sched.schedule()
    runner.execute(last)
    assert last.is_empty()
    assert runner.token_ids == {}
    return outputs


def scheduled_tokens(outputs: list[SchedulerOutput], req_id: str) -> list[int]:
    return [o.num_scheduled_tokens[req_id] for o in outputs if req_id in o.num_scheduled_tokens]


def expected_outputs(num_prompt_tokens: int, num_output_tokens: int) -> list[int]:
    return [1000 + num_prompt_tokens + i for i in range(num_output_tokens)]


# ---------------------------------------------------------------------- block manager


def test_block_manager_never_hands_out_null_block_and_is_deterministic():
    def run() -> list[list[int] | None]:
        bm = BlockManager(num_blocks=6, block_size=4)
        a, b, c = make_req("a", 1), make_req("b", 1), make_req("c", 1)
        got = [bm.allocate(a, 8), bm.allocate(a, 9), bm.allocate(b, 4)]
        assert bm.num_free_blocks == 1
        assert bm.allocate(c, 12) is None and c.block_ids == []  # nothing changed
        assert bm.num_free_blocks == 1
        bm.free(a)
        assert a.block_ids == [] and bm.num_free_blocks == 4
        got.append(bm.allocate(c, 16))
        return got

    first = run()
    assert first == [[1, 2], [3], [4], [5, 1, 2, 3]]
    assert run() == first
    assert BlockManager(6, 4).blocks_needed(9, 2) == 1
    assert BlockManager(6, 4).blocks_needed(8, 2) == 0
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(1, 4)


def test_min_blocks_and_config_validation():
    assert min_blocks_for_one_request(16, 4) == 4
    assert min_blocks_for_one_request(17, 4) == 5
    with pytest.raises(ValueError, match="num_blocks=4 is too small.*>= 5"):
        Scheduler(4, 64, max_model_len=16, block_size=4, num_blocks=4)
    with pytest.raises(ValueError, match="max_num_batched_tokens=8.*enable_chunked_prefill"):
        Scheduler(
            4,
            8,
            max_model_len=16,
            block_size=4,
            num_blocks=5,
            enable_chunked_prefill=False,
        )
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        Scheduler(0, 8, max_model_len=16, block_size=4, num_blocks=5)
    sched = Scheduler(4, 8, max_model_len=16, block_size=4, num_blocks=5)
    assert sched.can_fit(16) and not sched.can_fit(17) and not sched.can_fit(0)
    with pytest.raises(ValueError, match="17 tokens.*max_model_len=16"):
        sched.add_request(make_req("long", 17))
    sched.add_request(make_req("a", 3))
    with pytest.raises(ValueError, match="req_id='a'"):
        sched.add_request(make_req("a", 3))


# ---------------------------------------------------------------------- batching


def test_chunked_prefill_splits_long_prompt_and_respects_max_num_seqs():
    sched = Scheduler(1, 8, max_model_len=64, block_size=4, num_blocks=33)
    sched.add_request(make_req("a", 20, max_tokens=3))
    sched.add_request(make_req("b", 5, max_tokens=2))
    outputs = drive(sched, FakeRunner(4))
    # a: chunks 8, 8, 4 (the last one samples), then 2 decodes; b only after a finished.
    assert [o.num_scheduled_tokens for o in outputs] == [
        {"a": 8},
        {"a": 8},
        {"a": 4},
        {"a": 1},
        {"a": 1},
        {"b": 5},
        {"b": 1},
    ]
    assert "a" in outputs[5].finished_req_ids
    # Chunks after the first go out as cached requests carrying no new tokens.
    assert outputs[1].scheduled_cached_reqs.new_token_ids == [[]]
    assert outputs[3].scheduled_cached_reqs.new_token_ids == [[1020]]


def test_chunked_prefill_shares_the_budget_between_decodes_and_prefill():
    sched = Scheduler(4, 8, max_model_len=64, block_size=4, num_blocks=33)
    sched.add_request(make_req("a", 3, max_tokens=4))
    sched.add_request(make_req("b", 12, max_tokens=1))
    outputs = drive(sched, FakeRunner(4))
    assert outputs[0].num_scheduled_tokens == {"a": 3, "b": 5}
    assert outputs[1].num_scheduled_tokens == {"a": 1, "b": 7}
    assert scheduled_tokens(outputs, "b") == [5, 7]


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_whole():
    sched = Scheduler(
        4,
        16,
        max_model_len=16,
        block_size=4,
        num_blocks=9,
        enable_chunked_prefill=False,
    )
    a, b = make_req("a", 10, max_tokens=3), make_req("b", 10, max_tokens=1)
    sched.add_request(a)
    sched.add_request(b)
    outputs = drive(sched, FakeRunner(4))
    assert outputs[0].num_scheduled_tokens == {"a": 10}
    assert outputs[1].num_scheduled_tokens == {"a": 1, "b": 10}
    assert a.output_token_ids == expected_outputs(10, 3)
    assert b.output_token_ids == expected_outputs(10, 1)


def test_requests_join_mid_run_and_leave_when_finished():
    sched = Scheduler(4, 32, max_model_len=64, block_size=4, num_blocks=33)
    a, b = make_req("a", 4, max_tokens=3), make_req("b", 6, max_tokens=4)
    sched.add_request(a)

    def join(it: int) -> None:
        if it == 2:
            sched.add_request(b)

    outputs = drive(sched, FakeRunner(4), before_step=join)
    assert [n.req_id for n in outputs[2].scheduled_new_reqs] == ["b"]
    assert outputs[2].scheduled_cached_reqs.req_ids == ["a"]
    assert "a" in outputs[3].finished_req_ids
    assert list(outputs[3].num_scheduled_tokens) == ["b"]
    assert a.output_token_ids == expected_outputs(4, 3)
    assert b.output_token_ids == expected_outputs(6, 4)
    assert a.finish_reason == b.finish_reason == "length"
    assert sched.block_manager.num_free_blocks == 32


def test_waiting_requests_are_admitted_first_come_first_served():
    sched = Scheduler(2, 64, max_model_len=64, block_size=4, num_blocks=33)
    lengths = {"a": 3, "b": 1, "c": 5, "d": 2}
    for i, (req_id, max_tokens) in enumerate(lengths.items()):
        sched.add_request(make_req(req_id, 4 + i, max_tokens=max_tokens))
    outputs = drive(sched, FakeRunner(4))
    admitted = [n.req_id for o in outputs for n in o.scheduled_new_reqs]
    assert admitted == ["a", "b", "c", "d"]
    # c takes b's seat once b finished (step 1), d takes a's (step 3).
    assert [n.req_id for n in outputs[1].scheduled_new_reqs] == ["c"]
    assert [n.req_id for n in outputs[3].scheduled_new_reqs] == ["d"]


# ---------------------------------------------------------------------- preemption


def run_preemption_case(
    num_blocks: int, max_in_flight: int = 1
) -> tuple[Scheduler, list[Request], list[SchedulerOutput]]:
    sched = Scheduler(
        4,
        16,
        max_model_len=16,
        block_size=4,
        num_blocks=num_blocks,
        max_in_flight=max_in_flight,
    )
    reqs = [make_req(f"r{i}", 5 + i, max_tokens=9 - i) for i in range(3)]
    for req in reqs:
        sched.add_request(req)
    outputs = drive(sched, FakeRunner(4), max_in_flight=max_in_flight)
    return sched, reqs, outputs


@pytest.mark.parametrize("max_in_flight", [1, 2])
def test_preemption_recomputes_and_every_request_finishes(max_in_flight):
    # 4 usable blocks: one request of max_model_len fits, three growing ones do not.
    sched, reqs, outputs = run_preemption_case(num_blocks=5, max_in_flight=max_in_flight)
    assert sum(r.num_preemptions for r in reqs) > 0
    for i, req in enumerate(reqs):
        assert req.status == RequestStatus.FINISHED_LENGTH
        assert req.output_token_ids == expected_outputs(5 + i, 9 - i)
    assert sched.block_manager.num_free_blocks == 4
    assert sched.num_running == sched.num_waiting == 0

    for step, out in enumerate(outputs):
        for new in out.scheduled_new_reqs:
            req = next(r for r in reqs if r.req_id == new.req_id)
            num_prompt_tokens = len(req.prompt_token_ids)
            if len(new.prompt_token_ids) > num_prompt_tokens:
                # Resumed: prompt + outputs so far, after being reported as finished.
                assert new.prompt_token_ids[:num_prompt_tokens] == req.prompt_token_ids
                assert (
                    new.prompt_token_ids[num_prompt_tokens:]
                    == req.output_token_ids[: len(new.prompt_token_ids) - num_prompt_tokens]
                )
                assert any(new.req_id in o.finished_req_ids for o in outputs[:step])


def test_request_that_cannot_grow_preempts_itself_and_resumes_with_its_outputs():
    sched = Scheduler(4, 16, max_model_len=16, block_size=4, num_blocks=5)
    runner = FakeRunner(4)
    a, b = make_req("a", 4, max_tokens=2), make_req("b", 8, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()  # a: 1 block, b: 2 blocks; then each decode needs one more
    sched.update_from_output(out, runner.execute(out))
    assert sched.block_manager.num_free_blocks == 1
    out = sched.schedule()  # a gets the last block; b needs one: b preempts itself
    assert list(out.num_scheduled_tokens) == ["a"]
    assert b.status == RequestStatus.PREEMPTED and b.block_ids == [] and b.num_preemptions == 1
    assert b.num_computed_tokens == 0
    assert out.finished_req_ids == {"b"}
    sched.update_from_output(out, runner.execute(out))  # a finishes, its blocks free up
    out = sched.schedule()
    assert out.finished_req_ids == {"a"}
    assert [n.req_id for n in out.scheduled_new_reqs] == ["b"]
    assert out.scheduled_new_reqs[0].prompt_token_ids == b.prompt_token_ids + [1008]


def test_preemption_picks_the_latest_arrival_that_is_not_in_flight():
    sched = Scheduler(4, 16, max_model_len=16, block_size=4, num_blocks=5)
    runner = FakeRunner(4)
    a, b, c = make_req("a", 4), make_req("b", 7), make_req("c", 3)
    for req in (a, b, c):
        sched.add_request(req)
    out = sched.schedule()  # 1 + 2 + 1 blocks: the cache is full
    sched.update_from_output(out, runner.execute(out))
    out = sched.schedule()  # a's decode needs a second block: c (latest) is preempted
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert out.finished_req_ids == {"c"}
    assert c.status == RequestStatus.PREEMPTED and c.block_ids == []
    assert a.num_preemptions == b.num_preemptions == 0
    assert out.scheduled_cached_reqs.new_block_ids == [[4], []]  # c's freed block


def test_preemption_never_picks_a_request_in_flight():
    sched = Scheduler(4, 16, max_model_len=16, block_size=4, num_blocks=5, max_in_flight=2)
    runner = FakeRunner(4)
    a, b, c = make_req("a", 4), make_req("b", 7), make_req("c", 4)
    sched.add_request(a)
    sched.add_request(b)
    step1 = sched.schedule()
    step1_out = runner.execute(step1)
    sched.add_request(c)
    step2 = sched.schedule()  # a, b in flight: only c; the cache is now full
    assert list(step2.num_scheduled_tokens) == ["c"]
    step2_out = runner.execute(step2)
    sched.update_from_output(step1, step1_out)
    step3 = sched.schedule()  # a needs a block; c arrived last but is in flight: b goes
    assert step3.num_scheduled_tokens == {"a": 1}
    assert step3.finished_req_ids == {"b"}
    assert b.status == RequestStatus.PREEMPTED and c.status == RequestStatus.RUNNING
    runner.execute(step3)
    sched.update_from_output(step2, step2_out)
    assert c.output_token_ids == [1004]


# ---------------------------------------------------------------------- pipeline in flight


def test_in_flight_requests_are_not_scheduled_again():
    sched = Scheduler(4, 64, max_model_len=64, block_size=4, num_blocks=33, max_in_flight=2)
    runner = FakeRunner(4)
    for req_id in ["a", "b", "c"]:
        sched.add_request(make_req(req_id, 4, max_tokens=4))
    first = sched.schedule()
    runner_first = runner.execute(first)
    assert sched.has_schedulable_requests() is False
    second = sched.schedule()  # everything is in flight
    assert second.is_empty()
    sched.update_from_output(first, runner_first)
    third = sched.schedule()
    assert list(third.num_scheduled_tokens) == ["a", "b", "c"]
    sched.add_request(make_req("d", 4, max_tokens=4))
    fourth = sched.schedule()
    assert list(fourth.num_scheduled_tokens) == ["d"]
    with pytest.raises(RuntimeError, match="max_in_flight=2"):
        sched.schedule()


def test_two_steps_in_flight_give_the_same_tokens_as_one():
    def run(max_in_flight: int) -> list[list[int]]:
        sched = Scheduler(
            3,
            10,
            max_model_len=64,
            block_size=4,
            num_blocks=33,
            max_in_flight=max_in_flight,
        )
        reqs = [make_req(f"r{i}", 3 + 4 * i, max_tokens=3 + i) for i in range(5)]
        for req in reqs:
            sched.add_request(req)
        drive(sched, FakeRunner(4), max_in_flight=max_in_flight)
        return [r.output_token_ids for r in reqs]

    assert run(2) == run(1)
    assert run(1)[4] == expected_outputs(19, 7)


# ---------------------------------------------------------------------- abort / failure


def test_abort_waiting_running_and_in_flight_requests():
    sched = Scheduler(2, 64, max_model_len=64, block_size=4, num_blocks=33, max_in_flight=2)
    runner = FakeRunner(4)
    a, b, c = make_req("a", 4), make_req("b", 4), make_req("c", 4)
    for req in (a, b, c):
        sched.add_request(req)
    out = sched.schedule()  # a, b running; c waiting
    sched.update_from_output(out, runner.execute(out))

    assert sched.abort_requests(["c", "unknown"]) == [c]  # waiting
    assert c.status == RequestStatus.FINISHED_ABORTED and c.finish_reason == "abort"
    assert sched.abort_requests("a") == [a]  # running, not in flight
    assert a.block_ids == []
    out = sched.schedule()
    assert out.finished_req_ids == {"a", "c"}
    assert list(out.num_scheduled_tokens) == ["b"]
    runner_out = runner.execute(out)

    sched.abort_requests(["b"])  # in flight
    assert b.block_ids == [] and not b.in_flight
    num_outputs_before = len(b.output_token_ids)
    assert sched.update_from_output(out, runner_out) == []  # its token is dropped
    assert len(b.output_token_ids) == num_outputs_before
    assert sched.schedule().finished_req_ids == {"b"}
    assert not sched.has_unfinished_requests()
    assert sched.block_manager.num_free_blocks == 32
    with pytest.raises(ValueError, match="finish_reason='bogus'"):
        sched.abort_requests(["a"], finish_reason="bogus")


def test_output_of_an_aborted_request_never_reaches_a_new_one_with_its_id():
    sched = Scheduler(4, 64, max_model_len=64, block_size=4, num_blocks=17, max_in_flight=2)
    runner = FakeRunner(4)
    sched.add_request(make_req("a", 4))
    old_step = sched.schedule()
    old_out = runner.execute(old_step)
    sched.abort_requests(["a"])
    new_a = make_req("a", 6)
    sched.add_request(new_a)
    new_step = sched.schedule()
    assert new_step.finished_req_ids == {"a"}
    new_out = runner.execute(new_step)
    assert sched.update_from_output(old_step, old_out) == []
    assert new_a.output_token_ids == [] and new_a.in_flight
    assert sched.update_from_output(new_step, new_out) == [new_a]
    assert new_a.output_token_ids == [1006]


def test_fail_all_ends_every_request_and_ignores_late_output():
    sched = Scheduler(1, 64, max_model_len=64, block_size=4, num_blocks=33)
    runner = FakeRunner(4)
    a, b = make_req("a", 4), make_req("b", 4)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    runner_out = runner.execute(out)
    assert sched.fail_all() == [a, b]
    assert a.status == b.status == RequestStatus.FINISHED_ERROR
    assert a.finish_reason == "error"
    assert sched.update_from_output(out, runner_out) == []
    assert a.output_token_ids == []
    assert sched.block_manager.num_free_blocks == 32
    assert sched.schedule().finished_req_ids == {"a", "b"}


def test_missing_sample_ends_request_with_error():
    sched = Scheduler(1, 64, max_model_len=64, block_size=4, num_blocks=33)
    a = make_req("a", 4)
    sched.add_request(a)
    out = sched.schedule()
    bad = ModelRunnerOutput(step_id=out.step_id, req_ids=["a"], sampled_token_ids=[[]])
    assert sched.update_from_output(out, bad) == [a]
    assert a.status == RequestStatus.FINISHED_ERROR


# ---------------------------------------------------------------------- stop conditions


def run_one(req: Request, token_fn: TokenFn = position_token, max_model_len: int = 64) -> Request:
    sched = Scheduler(4, 64, max_model_len=max_model_len, block_size=4, num_blocks=17)
    sched.add_request(req)
    drive(sched, FakeRunner(4, token_fn))
    assert sched.block_manager.num_free_blocks == 16
    return req


def always_eos(req_id: str, token_ids: list[int]) -> int:
    return EOS


def test_stop_token_ends_request_and_is_kept():
    req = run_one(make_req("a", 4, max_tokens=10, stop_token_ids=[1006]))
    assert req.output_token_ids == [1004, 1005, 1006]
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert (req.finish_reason, req.stop_reason) == ("stop", 1006)


def test_eos_ends_request():
    req = run_one(make_req("a", 4, max_tokens=10), token_fn=always_eos)
    assert req.output_token_ids == [EOS]
    assert (req.finish_reason, req.stop_reason) == ("stop", None)


def test_min_tokens_defers_stop_conditions():
    req = run_one(make_req("a", 4, max_tokens=10, min_tokens=3), token_fn=always_eos)
    assert req.output_token_ids == [EOS] * 3
    assert req.finish_reason == "stop"


def test_ignore_eos_runs_to_max_tokens_but_keeps_stop_tokens():
    req = run_one(make_req("a", 4, max_tokens=5, ignore_eos=True), token_fn=always_eos)
    assert req.output_token_ids == [EOS] * 5
    assert req.status == RequestStatus.FINISHED_LENGTH
    req = run_one(
        make_req("b", 4, max_tokens=5, ignore_eos=True, stop_token_ids=[EOS]),
        always_eos,
    )
    assert req.output_token_ids == [EOS]
    assert req.finish_reason == "stop"


def test_max_tokens_and_max_model_len():
    req = run_one(make_req("a", 4, max_tokens=6))
    assert req.output_token_ids == expected_outputs(4, 6)
    assert req.status == RequestStatus.FINISHED_LENGTH
    req = run_one(make_req("b", 10, max_tokens=None), max_model_len=16)
    assert req.num_tokens == 16 and req.finish_reason == "length"
    req = run_one(make_req("c", 16, max_tokens=None), max_model_len=16)
    assert req.output_token_ids == [1016] and req.finish_reason == "length"


# ---------------------------------------------------------------------- determinism


def test_two_schedulers_fed_the_same_inputs_agree():
    def run() -> list[SchedulerOutput]:
        sched = Scheduler(3, 12, max_model_len=16, block_size=4, num_blocks=6, max_in_flight=2)
        arrivals = {
            0: [("r0", 7, 9), ("r1", 3, 5)],
            3: [("r2", 9, 6)],
            5: [("r3", 2, 8)],
        }

        def join(it: int) -> None:
            for req_id, num_prompt_tokens, max_tokens in arrivals.get(it, []):
                sched.add_request(make_req(req_id, num_prompt_tokens, max_tokens=max_tokens))

        outputs = drive(sched, FakeRunner(4), max_in_flight=2, before_step=join)
        assert any(len(o.finished_req_ids) > 0 and o.scheduled_new_reqs for o in outputs)
        return outputs

    first, second = run(), run()
    assert len(first) > 10
    assert first == second


def test_spread_over_in_flight_gives_every_stage_a_batch():
    sched = Scheduler(8, 256, max_model_len=64, block_size=4, num_blocks=65, max_in_flight=2,
                      spread_over_in_flight=True)
    runner = FakeRunner(4)
    for i in range(5):
        sched.add_request(make_req(f"r{i}", 4, max_tokens=8))
    first = sched.schedule()
    out_first = runner.execute(first)
    second = sched.schedule()
    runner.execute(second)
    assert list(first.num_scheduled_tokens) == ["r0", "r1", "r2"]
    assert list(second.num_scheduled_tokens) == ["r3", "r4"]
    sched.update_from_output(first, out_first)
    third = sched.schedule()  # the first group comes back as soon as its output is in
    assert list(third.num_scheduled_tokens) == ["r0", "r1", "r2"]


def test_async_scheduling_joins_the_next_step_and_drops_overshoot():
    sched = Scheduler(4, 64, max_model_len=64, block_size=4, num_blocks=33, max_in_flight=2,
                      async_scheduling=True)
    eos = 2
    req = make_req("a", 4, max_tokens=10)
    req.eos_token_ids = {eos}
    sched.add_request(req)
    s1 = sched.schedule()  # prefill: samples token 5
    assert s1.num_scheduled_tokens == {"a": 4}
    s2 = sched.schedule()  # joins while s1 is in flight: computes the pending sample's KV
    assert s2.num_scheduled_tokens == {"a": 1}
    assert s2.scheduled_cached_reqs.new_token_ids == [[]]  # the token is still on the device
    assert req.num_computed_tokens == 5 and req.num_pending_samples == 2
    with pytest.raises(RuntimeError):
        sched.schedule()  # two steps in flight
    sched.update_from_output(s1, ModelRunnerOutput(s1.step_id, ["a"], [[7]]))
    s3 = sched.schedule()  # s1's token now known and sent; s2 still in flight
    assert s3.num_scheduled_tokens == {"a": 1}
    assert s3.scheduled_cached_reqs.new_token_ids == [[7]]
    sched.update_from_output(s2, ModelRunnerOutput(s2.step_id, ["a"], [[eos]]))  # stops here
    assert req.is_finished and req.output_token_ids == [7, eos]
    sched.update_from_output(s3, ModelRunnerOutput(s3.step_id, ["a"], [[9]]))  # overshoot: dropped
    assert req.output_token_ids == [7, eos]
    assert sched.block_manager.num_free_blocks == 32


def test_async_scheduling_stops_at_max_tokens_without_overshoot():
    sched = Scheduler(4, 64, max_model_len=64, block_size=4, num_blocks=33, max_in_flight=2,
                      async_scheduling=True)
    req = make_req("a", 4, max_tokens=1)
    sched.add_request(req)
    s1 = sched.schedule()
    assert sched.schedule().is_empty()  # the pending token is already the last one
    sched.update_from_output(s1, ModelRunnerOutput(s1.step_id, ["a"], [[7]]))
    assert req.is_finished and req.finish_reason == "length"


def test_async_scheduling_over_pipeline_batches_keeps_batch_order():
    """Pipeline with async steps: two batches, each with two steps in flight; a batch's next
    step goes behind the other batch's step (the first stage waits for no sample)."""
    sched = Scheduler(8, 256, max_model_len=64, block_size=4, num_blocks=65, max_in_flight=4,
                      spread_over_in_flight=True, async_scheduling=True)
    for i in range(4):
        sched.add_request(make_req(f"r{i}", 4, max_tokens=8))
    steps = [sched.schedule() for _ in range(4)]
    assert [list(s.num_scheduled_tokens) for s in steps] == [["r0", "r1"], ["r2", "r3"], ["r0", "r1"], ["r2", "r3"]]
    assert steps[2].num_scheduled_tokens == {"r0": 1, "r1": 1}  # on the pending samples
    assert steps[2].scheduled_cached_reqs.new_token_ids == [[], []]
    with pytest.raises(RuntimeError, match="max_in_flight=4"):
        sched.schedule()
    sched.update_from_output(steps[0], ModelRunnerOutput(steps[0].step_id, ["r0", "r1"], [[7], [8]]))
    fifth = sched.schedule()
    assert fifth.num_scheduled_tokens == {"r0": 1, "r1": 1}
    assert fifth.scheduled_cached_reqs.new_token_ids == [[7], [8]]


def _async_pipeline_join_distances(
    batches: int, num_requests: int, max_num_seqs: int, max_tokens: int, max_num_batched_tokens: int
) -> list[int]:
    """Drive a scheduler with async pipeline steps as ``LLMEngine.step`` does (submit while
    there is room, an empty step is not submitted; then apply the oldest output) and return,
    for every request scheduled while a step of it was still in flight, the difference of the
    two steps' submission indices (1: straight behind)."""
    sched = Scheduler(max_num_seqs, max_num_batched_tokens, max_model_len=256, block_size=4, num_blocks=2000,
                      max_in_flight=2 * batches, spread_over_in_flight=True, async_scheduling=True)
    for i in range(num_requests):
        sched.add_request(make_req(f"r{i}", 12, max_tokens=max_tokens, ignore_eos=True))
    outstanding: deque[SchedulerOutput] = deque()
    position: dict[str, int] = {}
    distances: list[int] = []
    submitted = 0

    def submit() -> None:
        nonlocal submitted
        while sched.can_schedule():
            so = sched.schedule()
            if so.is_empty():
                break
            in_flight = {r for prev in outstanding for r in prev.num_scheduled_tokens}
            distances.extend(submitted - position[r] for r in so.num_scheduled_tokens if r in in_flight)
            position.update(dict.fromkeys(so.num_scheduled_tokens, submitted))
            submitted += 1
            outstanding.append(so)

    while sched.has_unfinished_requests() or outstanding:
        submit()
        so = outstanding.popleft()
        rids = list(so.num_scheduled_tokens)
        sampled = [[5] if sched.get_request(r).num_pending_samples else [] for r in rids]
        sched.update_from_output(so, ModelRunnerOutput(so.step_id, rids, sampled))
        submit()
    return distances


@pytest.mark.parametrize(
    "batches, num_requests, max_num_seqs, max_num_batched_tokens",
    [(2, 32, 32, 40), (3, 48, 48, 40), (2, 40, 8, 2048), (3, 36, 12, 2048)],
)
def test_async_pipeline_steps_join_a_whole_round_behind(batches, num_requests, max_num_seqs, max_num_batched_tokens):
    """Pipeline with async steps (prompts admitted in uneven chunks; more requests than
    ``max_num_seqs``, so some wait): a request joins a step while its previous one is still in
    flight only a whole round of batches later, counted in steps that run.  The first stage
    computes the joiner's next token from ids the last stage sends once that step left the
    pipeline; a join right behind it stalls every stage (0.42x on two H200s).  (Requests come in
    whole rounds of ``max_num_seqs`` here: with fewer left than fill every batch, the round is
    the batches still in use, down to the lone request below.)"""
    distances = _async_pipeline_join_distances(
        batches, num_requests, max_num_seqs, max_tokens=40, max_num_batched_tokens=max_num_batched_tokens
    )
    assert len(distances) > 10 * num_requests  # most decode tokens were computed by joiners
    assert min(distances) >= batches


@pytest.mark.parametrize("batches", [2, 3])
def test_async_pipeline_steps_keep_a_lone_request_joining(batches):
    """Fewer requests than batches: the lone request still joins the step right behind its own
    (it is all the pipeline has), rather than waiting for its output every token."""
    distances = _async_pipeline_join_distances(batches, 1, 8, max_tokens=30, max_num_batched_tokens=2048)
    assert len(distances) >= 25 and set(distances) == {1}


def test_async_scheduling_over_batches_needs_two_steps_per_batch():
    with pytest.raises(ValueError, match="even max_in_flight"):
        Scheduler(8, 256, max_model_len=64, block_size=4, num_blocks=65, max_in_flight=3,
                  spread_over_in_flight=True, async_scheduling=True)


# ---------------------------------------------------------------------- encoder budget


def test_encoder_inputs_go_only_to_requests_the_step_runs():
    """A running request whose next prefill chunk reaches an image and needs a block the pool
    lacks preempts itself: the step neither encodes its image nor counts it encoded (a runner
    drops a preempted request's items before it encodes), so the image is encoded in the step
    whose window first reaches it after the request resumes."""
    from pprun.multimodal.items import MultiModalItem, PlaceholderRange

    # 5 usable blocks of 4: "a" (11 tokens) takes 3, "b" (12, its image at 8..12) 2 for its first
    # chunk; b's second chunk needs a sixth block while a decodes, and b arrived last.
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=16, block_size=4, num_blocks=6)
    sched.add_request(make_req("a", 11, max_tokens=2))
    image = MultiModalItem("image", "img-b", PlaceholderRange(8, 4))
    sched.add_request(Request("b", list(range(10, 22)), SamplingParams(max_tokens=2), eos_token_ids={EOS},
                              mm_items=[image]))
    runner, encoded = FakeRunner(block_size=4), False
    outputs = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        outputs.append(out)
        assert set(out.scheduled_encoder_inputs) <= set(out.num_scheduled_tokens), out
        if "b" in out.scheduled_encoder_inputs:
            encoded = True
        elif "b" in out.num_scheduled_tokens and runner.num_computed.get("b", 0) < 12:
            if runner.num_computed.get("b", 0) + out.num_scheduled_tokens["b"] > 8:
                assert encoded, "b's window reaches its image, which was never encoded"
        sched.update_from_output(out, runner.execute(out))
        assert len(outputs) < 20
    assert any("b" in o.finished_req_ids for o in outputs[:3])  # b was preempted
    assert [o.scheduled_encoder_inputs for o in outputs if o.scheduled_encoder_inputs] == [{"b": [0]}]
