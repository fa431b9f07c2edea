"""The step watchdog (``pprun.engine.step_watchdog``): classes, the median rule, the minimum of
samples, the rate limit and first uses, on injected clocks and durations (no timing is asserted);
and the engine times every step through it."""

from __future__ import annotations

import logging

import pytest

from pprun.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from pprun.engine.step_watchdog import StepClass, StepWatchdog, request_features, step_class
from pprun.sampling.params import SamplingParams


class FakeClock:
    """Seconds that move only when told."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def new_req(req_id: str, num_tokens: int, **params) -> NewRequestData:
    return NewRequestData(req_id, list(range(num_tokens)), SamplingParams(**params), [1], 0)


def decode_step(step_id: int, num_reqs: int) -> SchedulerOutput:
    ids = [f"r{i}" for i in range(num_reqs)]
    cached = CachedRequestData(ids, [[] for _ in ids], [10] * num_reqs, [[5] for _ in ids])
    return SchedulerOutput(step_id, [], cached, dict.fromkeys(ids, 1), num_reqs)


def prefill_step(step_id: int, news: list[NewRequestData]) -> SchedulerOutput:
    tokens = {n.req_id: len(n.prompt_token_ids) for n in news}
    return SchedulerOutput(step_id, news, CachedRequestData(), tokens, sum(tokens.values()))


def run(dog: StepWatchdog, clock: FakeClock, so: SchedulerOutput, duration_s: float):
    dog.submitted(so)
    clock.now += duration_s
    return dog.answered(so)


def test_classes_bucket_kind_tokens_and_requests():
    assert step_class(decode_step(0, 5)) == StepClass("decode", 8, 8)
    assert step_class(decode_step(0, 8)) == StepClass("decode", 8, 8)
    assert step_class(prefill_step(0, [new_req("a", 100), new_req("b", 3)])) == StepClass("prefill", 128, 2)
    # One new request of one token is not a decode: its step starts a request.
    assert step_class(prefill_step(0, [new_req("a", 1)])).kind == "prefill"


def test_a_step_three_times_its_class_median_is_logged_with_sizes_and_firsts(caplog):
    clock = FakeClock()
    dog = StepWatchdog(clock=clock, min_samples=4, warn_interval_s=10.0)
    for i in range(4):
        assert run(dog, clock, decode_step(i, 5), 0.010) is None
    assert run(dog, clock, decode_step(4, 5), 0.029) is None  # under 3x the median
    # A prefill class of its own: its long steps do not count against the decode median.
    for i in range(5, 9):
        assert run(dog, clock, prefill_step(i, [new_req(f"p{i}", 100)]), 0.5) is None
    # The first top-k request's step starts a request: a prefill class, with no samples yet.
    so = prefill_step(9, [new_req("k", 1, temperature=0.7, top_k=5)])
    so = SchedulerOutput(9, so.scheduled_new_reqs, decode_step(9, 3).scheduled_cached_reqs,
                         {**decode_step(9, 3).num_scheduled_tokens, "k": 1}, 4)  # fmt: skip
    assert step_class(so) == StepClass("prefill", 4, 4)  # it starts a request: prefill
    with caplog.at_level(logging.WARNING, logger="pprun.engine.step_watchdog"):
        assert run(dog, clock, so, 1.0) is None  # its class has no samples yet: not judged
        slow = run(dog, clock, decode_step(10, 7), 0.050)
    assert slow is not None and slow.cls == StepClass("decode", 8, 8)
    assert slow.median_s == pytest.approx(0.010) and slow.num_samples == 5
    assert slow.num_tokens == slow.num_reqs == 7
    assert slow.firsts == ("step: decode 7 requests",)  # the first decode of 7 requests
    assert dog.num_slow == 1 and dog.num_observed == 11
    (record,) = caplog.records
    assert "slow engine step: 50.0 ms, 5.0x the median 10.0 ms" in record.getMessage()
    assert "decode, <=8 tokens, <=8 requests" in record.getMessage()
    assert "first use: step: decode 7 requests" in record.getMessage()


def test_no_judgement_before_the_minimum_of_samples():
    clock = FakeClock()
    dog = StepWatchdog(clock=clock, min_samples=8)
    for i in range(7):
        assert run(dog, clock, decode_step(i, 2), 0.01) is None
    assert run(dog, clock, decode_step(7, 2), 10.0) is None  # the 8th sample: 7 before it
    assert run(dog, clock, decode_step(8, 2), 10.0) is not None
    assert dog.num_slow == 1


def test_the_window_is_bounded_and_follows_the_latest_steps():
    clock = FakeClock()
    dog = StepWatchdog(clock=clock, window=8, min_samples=4, warn_interval_s=0.0)
    for i in range(8):
        run(dog, clock, decode_step(i, 1), 0.01)
    for i in range(8, 16):  # a lasting change: the first ones warn, then it is the class's time
        run(dog, clock, decode_step(i, 1), 0.1)
    assert len(dog.times[StepClass("decode", 1, 1)]) == 8
    assert 1 <= dog.num_slow <= 5
    assert run(dog, clock, decode_step(16, 1), 0.1) is None


def test_a_step_submitted_behind_another_is_timed_from_the_output_ahead_of_it():
    """Async scheduling submits a decode step while a prefill runs: the decode step's time starts
    when the prefill's output came back, so it is not charged the prefill."""
    clock = FakeClock()
    dog = StepWatchdog(clock=clock, min_samples=4, warn_interval_s=0.0)
    for i in range(8):
        run(dog, clock, decode_step(i, 1), 0.001)
    prefill, decode = prefill_step(8, [new_req("p", 512)]), decode_step(9, 1)
    dog.submitted(prefill)
    dog.submitted(decode)  # in flight behind the prefill
    clock.now += 0.020
    assert dog.answered(prefill) is None
    clock.now += 0.0012
    assert dog.answered(decode) is None  # 1.2 ms of its own, not 21.2 ms
    assert dog.times[StepClass("decode", 1, 1)][-1] == pytest.approx(0.0012)
    # A step submitted after the last output (the pipeline ran dry) starts at its submission.
    clock.now += 5.0
    slow = run(dog, clock, decode_step(10, 1), 0.004)
    assert slow is not None and slow.duration_s == pytest.approx(0.004)
    assert dog.num_slow == 1


def test_the_launch_of_the_next_step_is_charged_to_that_step_not_to_the_one_in_flight():
    """With async scheduling the engine launches the next step before it waits for the one in
    flight; with the in-process executor that launch is the step's host work (an eager mixed step
    launches kernel by kernel for tens of ms).  It counts toward the step launched, not the
    decode step whose output it delayed."""
    clock = FakeClock()
    dog = StepWatchdog(clock=clock, min_samples=4, warn_interval_s=0.0)
    for i in range(8):
        run(dog, clock, decode_step(i, 1), 0.001)
    decode, mixed = decode_step(8, 1), prefill_step(9, [new_req("p", 512)])
    dog.submitted(decode)
    dog.submitting()
    clock.now += 0.050  # the mixed step's launch, while the decode step runs on the device
    dog.submitted(mixed)
    clock.now += 0.001
    assert dog.answered(decode) is None  # 1 ms of its own, not 51 ms
    assert dog.times[StepClass("decode", 1, 1)][-1] == pytest.approx(0.001)
    clock.now += 0.010
    assert dog.answered(mixed) is None  # too few of its class to judge
    assert dog.times[StepClass("prefill", 512, 1)][-1] == pytest.approx(0.060)  # its launch and the rest
    assert dog.num_slow == 0


def test_warnings_are_rate_limited_and_count_what_they_left_out(caplog):
    clock = FakeClock()
    dog = StepWatchdog(clock=clock, min_samples=4, warn_interval_s=10.0)
    for i in range(20):
        run(dog, clock, decode_step(i, 1), 0.01)
    with caplog.at_level(logging.WARNING, logger="pprun.engine.step_watchdog"):
        first = run(dog, clock, decode_step(20, 1), 1.0)
        assert first is not None and first.num_unlogged == 0
        for i in range(21, 24):  # within 10 s of the first: counted, not logged
            assert run(dog, clock, decode_step(i, 1), 1.0) is None
        clock.now += 10.0
        later = run(dog, clock, decode_step(24, 1), 1.0)
    assert later is not None and later.num_unlogged == 3
    assert dog.num_slow == 5
    assert len(caplog.records) == 2 and "3 more slow steps" in caplog.records[1].getMessage()


def test_first_uses_are_named_once_in_the_engine_record():
    clock = FakeClock()
    dog = StepWatchdog(clock=clock)
    reqs = [new_req("a", 4, temperature=0.0), new_req("b", 4, temperature=1.0, top_p=0.9, seed=3, logprobs=2)]
    dog.submitted(prefill_step(0, reqs))
    assert dog._pending[0].firsts == (
        "step: prefill 2 requests", "step: prefill 8 tokens", "request: greedy sampling",
        "request: random sampling", "request: top-p", "request: per-request seed", "request: logprobs",
    )  # fmt: skip
    assert set(dog._pending[0].firsts) == dog.first_use.seen  # the watchdog's firsts are the record's keys
    dog.submitted(
        prefill_step(1, [new_req("c", 3, temperature=0.5, top_p=0.5), new_req("d", 5, temperature=0.0)])
    )
    assert dog._pending[1].firsts == ()  # 8 tokens, 2 requests, known features: nothing new
    dog.submitted(decode_step(2, 3))
    dog.submitted(decode_step(3, 40))  # above 32: the class is the power-of-two bucket
    assert dog._pending[2].firsts == ("step: decode 3 requests",)
    assert dog._pending[3].firsts == ("step: decode <=64 requests",)
    # A step mixing decodes with a new request's prompt is a class of its own.
    mixed = SchedulerOutput(4, [new_req("m", 6)], decode_step(4, 2).scheduled_cached_reqs,
                            {**decode_step(4, 2).num_scheduled_tokens, "m": 6}, 8)  # fmt: skip
    dog.submitted(mixed)
    assert dog._pending[4].firsts == ("step: mixed 3 requests", "step: mixed 8 tokens")
    resumed = NewRequestData("r", [1, 2, 3, 4], SamplingParams(temperature=0.0), [1], 2, num_prompt_tokens=3)
    assert request_features(resumed) == ["greedy sampling", "prefix-cache hit", "recompute after preemption"]
    # A resumption is named in the step's firsts but is no key of the record.
    dog.submitted(prefill_step(5, [resumed]))
    assert "recompute after preemption" in dog._pending[5].firsts
    assert "request: recompute after preemption" not in dog.first_use.seen


def test_the_last_stage_keys_join_the_answered_steps_firsts_and_count_after_ready(caplog):
    """Keys arriving with a step's output are recorded in the engine's record and named in the
    slow step's warning; after ``mark_ready`` each new one is counted (the stage logged it)."""
    clock = FakeClock()
    dog = StepWatchdog(clock=clock, min_samples=4, warn_interval_s=0.0)
    for i in range(4):
        run(dog, clock, decode_step(i, 1), 0.01)
    dog.first_use.mark_ready()
    so = decode_step(4, 1)
    dog.submitted(so)
    clock.now += 1.0
    with caplog.at_level(logging.WARNING):
        slow = dog.answered(so, ("triton: kernel_x", "sampler: min-p"))
        dog.answered(decode_step(5, 1), ("triton: kernel_x",))  # known: not counted again
    assert slow is not None and slow.firsts == ("triton: kernel_x", "sampler: min-p")
    assert dog.first_use.after_ready == ["triton: kernel_x", "sampler: min-p"]
    messages = [r.getMessage() for r in caplog.records]
    # The stage logged its own keys after ready; the engine's record counts them without a second line.
    assert not any("first use after ready" in m for m in messages)
    assert any("first use: triton: kernel_x, sampler: min-p" in m for m in messages)


def test_the_engine_times_every_step_through_its_watchdog(tiny_llama_dir, caplog):
    """``LLMEngine`` hands each step to its watchdog at submission and at its output: with an
    injected clock that makes one decode step slow, that step is logged."""
    from pprun import LLM, SamplingParams

    with LLM(str(tiny_llama_dir), dtype="float32") as llm:
        engine = llm.engine
        dog = engine.watchdog
        clock = FakeClock()
        dog.clock = clock
        dog.min_samples = 4
        get_output = engine.executor.get_output
        num_outputs = 0

        def timed_get_output():
            # Every step's output takes 1 ms of the fake clock; the 15th (a decode) takes 5 s.
            nonlocal num_outputs
            num_outputs += 1
            clock.now += 5.0 if num_outputs == 15 else 0.001
            return get_output()

        engine.executor.get_output = timed_get_output
        with caplog.at_level(logging.WARNING, logger="pprun.engine.step_watchdog"):
            llm.generate(
                [{"prompt_token_ids": [5, 6, 7]}],
                SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            )
        assert dog.num_observed == engine.num_steps == num_outputs
        assert not dog._pending
        assert dog.num_slow >= 1  # with two steps in flight, the one behind it waited too
        # The rate limit keeps it to one warning.
        (record,) = [r for r in caplog.records if r.name == "pprun.engine.step_watchdog"]
        assert (
            "slow engine step" in record.getMessage()
            and "(decode, <=1 tokens, <=1 requests" in record.getMessage()
        )


def test_the_engine_charges_a_slow_launch_to_the_step_launched(tiny_llama_dir):
    """Through ``LLMEngine`` with async scheduling: a request joining a running one makes a mixed
    step whose launch takes 50 ms of the injected clock; the decode step in flight while it
    launches is not the one charged (it used to be logged as a slow decode step with nothing new)."""
    from pprun import LLM, SamplingParams

    with LLM(str(tiny_llama_dir), dtype="float32") as llm:
        engine = llm.engine
        assert engine.executor.max_in_flight == 2  # async scheduling: a step launches while one runs
        dog = engine.watchdog
        clock = FakeClock()
        dog.clock, dog.min_samples, dog.warn_interval_s = clock, 4, 0.0
        submit, get_output = engine.executor.submit, engine.executor.get_output
        mixed_steps = []

        def slow_mixed_submit(so):
            submit(so)
            if so.scheduled_new_reqs and so.num_reqs > len(so.scheduled_new_reqs):
                mixed_steps.append(so.step_id)
                clock.now += 0.050

        def timed_get_output():
            clock.now += 0.001
            return get_output()

        engine.executor.submit, engine.executor.get_output = slow_mixed_submit, timed_get_output
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        engine.add_request(list(range(5, 25)), params)
        num_steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            num_steps += 1
            if num_steps == 15:
                engine.add_request(list(range(30, 50)), params)
        assert len(mixed_steps) == 1
        assert dog.num_observed == engine.num_steps
        assert max(dog.times[StepClass("decode", 1, 1)]) < 0.010
        assert dog.num_slow == 0
