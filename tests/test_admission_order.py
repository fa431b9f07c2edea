"""The scheduler's waiting queue is first-come first-served: "no request waits while later ones are
admitted; long prompts do not starve short ones" (``pprun.core.scheduler``).

At every ``schedule()``, the requests it admits (new, or resumed after a preemption) are the head
of the waiting queue in arrival order, whatever the prompts' lengths, the token budget, chunked
prefill, prefix caching, a tight KV pool (preemptions) or the steps in flight.  A long prompt at
the head is admitted in chunks within the budget, so the short ones behind it wait a bounded
number of steps, and never start before it; one that cannot start (chunked prefill off) holds
them back until it fits, so it is never passed over for ever.
"""

from __future__ import annotations

import random
from collections import deque

import pytest

from pprun.core.outputs import ModelRunnerOutput, SchedulerOutput
from pprun.core.request import Request
from pprun.core.scheduler import Scheduler
from pprun.sampling.params import SamplingParams

BLOCK_SIZE = 4


class Runner:
    """Runner-side token state from the SchedulerOutputs; samples ``1000 + position`` once a
    request's tokens are all computed."""

    def __init__(self) -> None:
        self.token_ids: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in so.finished_req_ids:
            self.token_ids.pop(req_id, None)
            self.num_computed.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.token_ids[new.req_id] = list(new.prompt_token_ids)
            self.num_computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for req_id, new_ids in zip(cached.req_ids, cached.new_token_ids):
            self.token_ids[req_id].extend(new_ids)
        req_ids, sampled = [], []
        for req_id, num_tokens in so.num_scheduled_tokens.items():
            self.num_computed[req_id] += num_tokens
            tokens = self.token_ids[req_id]
            req_ids.append(req_id)
            sampled.append([1000 + len(tokens)] if self.num_computed[req_id] == len(tokens) else [])
        return ModelRunnerOutput(step_id=so.step_id, req_ids=req_ids, sampled_token_ids=sampled)


def make_req(req_id: str, prompt: list[int], max_tokens: int) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(req_id=req_id, prompt_token_ids=prompt, sampling_params=params, eos_token_ids={2})


def run_checking_fcfs(
    sched: Scheduler, arrivals: dict[int, list[Request]], max_in_flight: int
) -> dict[str, tuple[int, int]]:
    """Step ``sched`` as the engine does (submit while there is room, then apply the oldest
    output), adding ``arrivals[i]`` before round ``i``; at every ``schedule()`` the admitted
    requests must be the head of the waiting queue.  Returns each request's (round of arrival,
    round of its first admission)."""
    runner = Runner()
    outstanding: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
    rounds: dict[str, tuple[int, int]] = {}
    last_arrival = max(arrivals)
    for it in range(10_000):
        for req in arrivals.get(it, []):
            sched.add_request(req)
            rounds[req.req_id] = (it, -1)
        if it > last_arrival and not sched.has_unfinished_requests() and not outstanding:
            return rounds
        while len(outstanding) < max_in_flight and sched.can_schedule():
            waiting = [r.req_id for r in sched._waiting]
            assert [r.arrival_index for r in sched._waiting] == sorted(
                r.arrival_index for r in sched._waiting
            )
            so = sched.schedule()
            admitted = [n.req_id for n in so.scheduled_new_reqs]
            assert admitted == waiting[: len(admitted)], (
                f"round {it}: admitted {admitted} with {waiting} waiting"
            )
            for req_id in admitted:
                if rounds[req_id][1] < 0:
                    rounds[req_id] = (rounds[req_id][0], it)
            out = runner.execute(so)
            if so.is_empty():
                break
            outstanding.append((so, out))
        if outstanding:
            sched.update_from_output(*outstanding.popleft())
    raise AssertionError("requests did not finish")


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("num_blocks, max_in_flight", [(18, 1), (64, 1), (24, 2)])
def test_admission_is_first_come_first_served(chunked, prefix_caching, num_blocks, max_in_flight):
    """Random arrivals of short and long prompts (sharing prefixes), a token budget a long prompt
    exceeds with chunked prefill, a KV pool that forces preemptions at 18 blocks."""
    max_model_len = 64
    rng = random.Random(f"{chunked}{prefix_caching}{num_blocks}{max_in_flight}")
    sched = Scheduler(
        max_num_seqs=4, max_num_batched_tokens=24 if chunked else max_model_len, max_model_len=max_model_len,
        block_size=BLOCK_SIZE, num_blocks=num_blocks, enable_chunked_prefill=chunked, max_in_flight=max_in_flight,
        spread_over_in_flight=max_in_flight > 1, enable_prefix_caching=prefix_caching,
    )  # fmt: skip
    prefixes = [[10 + i for i in range(16)], [50 + i for i in range(8)]]
    arrivals: dict[int, list[Request]] = {}
    for i in range(40):
        num_prompt = rng.choice([rng.randint(1, 8), rng.randint(30, 48)])
        prompt = (rng.choice(prefixes) + [rng.randrange(100, 200) for _ in range(num_prompt)])[:num_prompt]
        max_tokens = rng.randint(1, min(12, max_model_len - num_prompt))
        arrivals.setdefault(rng.randint(0, 30), []).append(make_req(f"r{i}", prompt, max_tokens))
    rounds = run_checking_fcfs(sched, arrivals, max_in_flight)
    assert all(admitted >= 0 for _, admitted in rounds.values())
    by_arrival = sorted(rounds, key=lambda r: (rounds[r][0], int(r[1:])))
    firsts = [rounds[r][1] for r in by_arrival]
    assert firsts == sorted(firsts)  # first admissions in arrival order


def test_a_long_prompt_is_chunked_and_the_short_ones_behind_it_wait_a_bounded_time():
    sched = Scheduler(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=128, block_size=BLOCK_SIZE,
                      num_blocks=80)  # fmt: skip
    short_before = make_req("short0", [5, 6, 7], 4)
    long = make_req("long", list(range(10, 110)), 2)
    shorts = [make_req(f"short{i}", [5, 6, 7 + i], 4) for i in range(1, 4)]
    rounds = run_checking_fcfs(sched, {0: [short_before, long, *shorts]}, max_in_flight=1)
    assert rounds["short0"][1] == rounds["long"][1] == 0  # ahead of it: not held up by it
    # The long prompt's 100 tokens take ceil((100 + 3) / 16) = 7 steps of 16 tokens (the first
    # shared with short0); the ones behind it start once its last chunk leaves them room.
    admitted = [rounds[f"short{i}"][1] for i in range(1, 4)]
    assert admitted == sorted(admitted) and 0 < admitted[0] <= 7 and admitted[-1] <= 8


def test_without_chunked_prefill_a_long_prompt_that_does_not_fit_holds_back_later_ones_until_it_does():
    sched = Scheduler(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, block_size=BLOCK_SIZE,
                      num_blocks=80, enable_chunked_prefill=False)  # fmt: skip
    first = make_req("first", list(range(10, 50)), 3)  # 40 tokens
    long = make_req("long", list(range(10, 50)), 3)  # 40 more: not in the same step (64)
    short = make_req("short", [5, 6, 7], 3)  # would fit beside the first: FCFS says wait
    rounds = run_checking_fcfs(sched, {0: [first, long, short]}, max_in_flight=1)
    assert rounds["first"][1] == 0
    assert rounds["long"][1] == rounds["short"][1] == 1
