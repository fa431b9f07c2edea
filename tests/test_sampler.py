"""Unit tests for the last-stage torch sampler (CPU, small vocabularies)."""

from __future__ import annotations

import pytest
import torch

from pprun.core.outputs import Logprobs
from pprun.sampling.params import SamplingParams
from pprun.sampling.sampler import (
    Sampler,
    SamplingTensors,
    apply_top_k_top_p,
    make_generator,
    to_logprobs,
)

VOCAB_SIZE = 32


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None] | None = None,
):
    """Build tensors for ``params`` and run one sampler step."""
    if generators is None:
        generators = [make_generator(p.seed, "cpu") for p in params]
    t = SamplingTensors.build(params, generators, "cpu", vocab_size=logits.shape[-1])
    return Sampler()(logits, t)


def draw_many(logits_row: torch.Tensor, params: SamplingParams, num_draws: int) -> torch.Tensor:
    """Sample ``num_draws`` tokens from one row in a single batched step (fixed global seed)."""
    torch.manual_seed(1234)
    logits = logits_row.unsqueeze(0).expand(num_draws, -1).contiguous()
    return sample(logits, [params] * num_draws).sampled_token_ids


@pytest.fixture
def logits() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(6, VOCAB_SIZE, generator=gen) * 3


def test_greedy_is_argmax(logits: torch.Tensor) -> None:
    out = sample(logits, [SamplingParams(temperature=0.0)] * logits.shape[0])
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.sampled_logprobs is None and out.topk_ids is None


def test_greedy_bf16_matches_float32_argmax(logits: torch.Tensor) -> None:
    bf16 = logits.to(torch.bfloat16)
    out = sample(bf16, [SamplingParams(temperature=0.0)] * logits.shape[0])
    assert torch.equal(out.sampled_token_ids, bf16.float().argmax(dim=-1))


def test_tiny_temperature_behaves_like_greedy(logits: torch.Tensor) -> None:
    torch.manual_seed(0)
    for temperature in (1e-3, 1e-9):
        out = sample(logits, [SamplingParams(temperature=temperature)] * logits.shape[0])
        assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


def test_top_k_one_is_greedy(logits: torch.Tensor) -> None:
    torch.manual_seed(0)
    out = sample(logits, [SamplingParams(temperature=2.0, top_k=1)] * logits.shape[0])
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


def test_top_k_restricts_support(logits: torch.Tensor) -> None:
    row = logits[0]
    top_k = 5
    allowed = set(row.topk(top_k).indices.tolist())
    # High temperature flattens the distribution so tokens outside top-k would show up.
    sampled = draw_many(row, SamplingParams(temperature=5.0, top_k=top_k), 2000)
    seen = set(sampled.tolist())
    assert seen <= allowed
    assert len(seen) == top_k


def test_top_k_with_top_p_combined_restricts_support(logits: torch.Tensor) -> None:
    row = logits[1]
    allowed = set(row.topk(3).indices.tolist())
    sampled = draw_many(row, SamplingParams(temperature=5.0, top_k=3, top_p=0.999), 2000)
    assert set(sampled.tolist()) <= allowed


def test_top_p_restricts_to_nucleus() -> None:
    probs = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04])
    row = probs.log()
    # Nucleus for 0.75: the smallest top set reaching 0.75 is {0, 1} (0.5 + 0.3 = 0.8).
    sampled = draw_many(row, SamplingParams(temperature=1.0, top_p=0.75), 2000)
    assert set(sampled.tolist()) == {0, 1}
    # A tiny top_p still keeps the top token.
    sampled = draw_many(row, SamplingParams(temperature=1.0, top_p=1e-6), 200)
    assert set(sampled.tolist()) == {0}


def test_apply_top_p_masks_tail_only() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]]).log()
    masked = apply_top_k_top_p(logits.clone(), None, torch.tensor([0.85]))
    assert torch.isinf(masked[0, 3:]).all()
    assert torch.isfinite(masked[0, :3]).all()
    assert torch.equal(masked[0, :3], logits[0, :3])


def test_min_p_drops_low_probability_tokens() -> None:
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    row = probs.log()
    # min_p=0.3 drops tokens below 0.3 * 0.4 = 0.12: tokens 3 and 4.
    sampled = draw_many(row, SamplingParams(temperature=1.0, min_p=0.3), 3000)
    assert set(sampled.tolist()) == {0, 1, 2}


def test_seeded_row_independent_of_batch(logits: torch.Tensor) -> None:
    num_steps = 4
    seeded = SamplingParams(temperature=1.0, seed=42, top_p=0.9)

    # Alone: one request, its generator kept across steps.
    gen_alone = make_generator(42, "cpu")
    alone = []
    for step in range(num_steps):
        step_logits = logits[step : step + 1]
        alone.append(sample(step_logits, [seeded], [gen_alone]).sampled_token_ids.item())

    # In a batch at row 2, next to unseeded, greedy and other seeded rows.
    others = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, seed=7, top_k=5),
        seeded,
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, min_p=0.1),
    ]
    gens = [make_generator(p.seed, "cpu") for p in others]
    torch.manual_seed(99)
    batched = []
    for step in range(num_steps):
        step_logits = torch.randn(len(others), VOCAB_SIZE) * 3
        step_logits[2] = logits[step]
        batched.append(sample(step_logits, others, gens).sampled_token_ids[2].item())

    assert batched == alone


def test_different_seeds_give_different_streams() -> None:
    flat = torch.zeros(1, VOCAB_SIZE)
    params = SamplingParams(temperature=1.0)
    g42, g43 = make_generator(42, "cpu"), make_generator(43, "cpu")
    seq42 = [sample(flat, [params], [g42]).sampled_token_ids.item() for _ in range(16)]
    seq43 = [sample(flat, [params], [g43]).sampled_token_ids.item() for _ in range(16)]
    # Sixteen uniform draws over 32 tokens coincide with probability 32**-16.
    assert seq42 != seq43


def test_seeded_row_ignores_global_rng() -> None:
    flat = torch.zeros(1, VOCAB_SIZE)
    params = [SamplingParams(temperature=1.0, seed=5)]
    streams = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        gen = make_generator(5, "cpu")
        streams.append([sample(flat, params, [gen]).sampled_token_ids.item() for _ in range(8)])
    assert streams[0] == streams[1]


def max_z(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The largest per-token z-score of observed ``counts`` against the distribution ``probs``:
    how many standard errors of a count the farthest frequency lies from its probability."""
    n = counts.sum()
    return float(((counts - n * probs).abs() / (n * probs * (1 - probs)).sqrt()).max())


Z_BOUND = 4.5
"""A frequency this many standard errors from its probability fails (a true sampler trips it with
probability well under 1e-4 per test, over its four tokens and two paths)."""


def test_empirical_distribution_matches_softmax() -> None:
    """Both sampling paths draw from softmax(logits / T) for T = 0.8, and the number of draws
    separates T = 0.8 from its neighbours 0.7 and 0.9 (and from 1.0, the temperature ignored):
    the same draws are checked to fail against those distributions."""
    logits = torch.tensor([1.0, 0.5, -0.5, 0.0])
    temperature = 0.8
    expected = torch.softmax(logits / temperature, dim=-1)
    others = {t: torch.softmax(logits / t, dim=-1) for t in (0.7, 0.9, 1.0)}
    num_draws = 20000
    # Seeded path: one generator drawn from step after step.
    gen = make_generator(123, "cpu")
    params = SamplingParams(temperature=temperature, seed=123)
    counts = torch.zeros(4, dtype=torch.float64)
    t = SamplingTensors.build([params], [gen], "cpu")
    sampler = Sampler()
    for _ in range(num_draws):
        counts[sampler(logits.unsqueeze(0), t).sampled_token_ids.item()] += 1
    # Global-RNG path: many unseeded rows in one step.
    sampled = draw_many(logits, SamplingParams(temperature=temperature), num_draws)
    batched = torch.bincount(sampled, minlength=4).double()
    for path, observed in (("seeded", counts), ("batched", batched)):
        assert max_z(observed, expected.double()) < Z_BOUND, (path, observed / num_draws, expected)
        for t_other, probs in others.items():
            z = max_z(observed, probs.double())
            assert z > Z_BOUND, f"{path}: {num_draws} draws at T=0.8 cannot be told from T={t_other} (z={z:.1f})"


def test_logprobs_match_log_softmax(logits: torch.Tensor) -> None:
    num_reqs = logits.shape[0]
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=1.0, logprobs=5),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5, logprobs=0),
        SamplingParams(temperature=0.0, logprobs=1),
        SamplingParams(temperature=2.0, top_k=4, logprobs=2),
    ]
    torch.manual_seed(0)
    out = sample(logits, params)
    reference = torch.log_softmax(logits.float(), dim=-1)
    assert out.topk_ids is not None and out.topk_logprobs is not None
    assert out.sampled_logprobs is not None
    assert out.topk_ids.shape == (num_reqs, 5) and out.topk_ids.dtype == torch.int64
    rows = torch.arange(num_reqs)
    torch.testing.assert_close(out.sampled_logprobs, reference[rows, out.sampled_token_ids])
    torch.testing.assert_close(out.topk_logprobs, reference.topk(5, dim=-1).values)
    torch.testing.assert_close(reference.gather(1, out.topk_ids), out.topk_logprobs)
    assert (out.topk_logprobs[:, :-1] >= out.topk_logprobs[:, 1:]).all()

    host = to_logprobs(out, [p.logprobs for p in params])
    assert host[2] is None
    for i, p in enumerate(params):
        if p.logprobs is None:
            continue
        entry = host[i]
        assert isinstance(entry, Logprobs)
        assert len(entry.top_token_ids) == p.logprobs == len(entry.top_logprobs)
        assert entry.top_token_ids == reference[i].topk(p.logprobs).indices.tolist()
        assert entry.top_logprobs == sorted(entry.top_logprobs, reverse=True)
        assert entry.sampled_logprob == pytest.approx(
            reference[i, out.sampled_token_ids[i]].item(), abs=1e-5
        )
    assert host[0].top_token_ids[0] == logits[0].argmax().item()


def test_logprobs_are_raw_not_temperature_scaled(logits: torch.Tensor) -> None:
    out = sample(logits[:1], [SamplingParams(temperature=0.3, logprobs=2)])
    torch.testing.assert_close(
        out.topk_logprobs, torch.log_softmax(logits[:1], dim=-1).topk(2).values
    )


def test_mixed_greedy_and_random_batch(logits: torch.Tensor) -> None:
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.5, seed=3),
        SamplingParams(temperature=0.0, top_k=2, top_p=0.5),
        SamplingParams(temperature=1.0, top_p=0.8),
    ]
    torch.manual_seed(0)
    t = SamplingTensors.build(params, [make_generator(p.seed, "cpu") for p in params], "cpu")
    assert not t.all_greedy and not t.all_random
    input_logits = logits.clone()
    out = Sampler()(logits, t)
    assert torch.equal(logits, input_logits), "sampler must not modify the caller's logits"
    greedy_rows = [0, 2, 4]
    assert torch.equal(out.sampled_token_ids[greedy_rows], logits[greedy_rows].argmax(dim=-1))
    assert out.sampled_token_ids[1].item() in logits[1].topk(3).indices.tolist()
    assert ((out.sampled_token_ids >= 0) & (out.sampled_token_ids < VOCAB_SIZE)).all()


def test_build_flags_and_disabled_top_k() -> None:
    params = [
        SamplingParams(temperature=0.0, top_k=2, top_p=0.5, min_p=0.2, logprobs=4),
        SamplingParams(temperature=1.0, top_k=0),
        SamplingParams(temperature=1.0, top_k=-1, logprobs=1),
    ]
    t = SamplingTensors.build(params, [None] * 3, "cpu", vocab_size=VOCAB_SIZE)
    assert t.top_k.tolist() == [2, VOCAB_SIZE, VOCAB_SIZE]
    assert t.top_k.dtype == torch.int64 and t.temperature.dtype == torch.float32
    # Greedy rows' filters do not turn on the filtering paths.
    assert (t.no_top_k, t.no_top_p, t.no_min_p) == (True, True, True)
    assert (t.all_greedy, t.all_random) == (False, False)
    assert t.max_num_logprobs == 4
    # Without a vocab size, disabled rows hold 0 and the sampler keeps every token.
    t_unknown = SamplingTensors.build(
        [SamplingParams(temperature=1.0, top_k=-1), SamplingParams(temperature=1.0, top_k=100)],
        [None, None],
        "cpu",
    )
    assert t_unknown.top_k.tolist() == [0, 100] and not t_unknown.no_top_k
    out = Sampler()(torch.zeros(2, 4), t_unknown)
    assert out.sampled_token_ids.shape == (2,)


def test_bad_inputs_raise_value_error(logits: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="generators"):
        SamplingTensors.build([SamplingParams()], [], "cpu")
    t = SamplingTensors.build([SamplingParams()], [None], "cpu")
    with pytest.raises(ValueError, match="num_reqs=1"):
        Sampler()(logits, t)
    out = sample(logits[:1], [SamplingParams(temperature=0.0)])
    with pytest.raises(ValueError, match="asks for logprobs"):
        to_logprobs(out, [2])


def test_suppressed_ids_never_sampled_and_begin_ids_only_first(logits: torch.Tensor) -> None:
    """Suppression puts a row's ids at -inf in a copy (the input stays), before greedy, seeded
    sampling and logprobs alike; begin ids only for a first output; ids past the vocabulary and
    empty lists change nothing."""
    from pprun.sampling.sampler import mask_token_ids, suppress_tokens

    top = logits.argmax(dim=-1).tolist()
    params = [
        SamplingParams(temperature=0.0, suppress_token_ids=[top[0], VOCAB_SIZE + 5]),
        SamplingParams(temperature=0.0, begin_suppress_token_ids=[top[1]]),
        SamplingParams(temperature=0.0, begin_suppress_token_ids=[top[2]]),
        SamplingParams(temperature=0.0, suppress_token_ids=[VOCAB_SIZE]),
        SamplingParams(temperature=1.0, seed=3, suppress_token_ids=list(range(VOCAB_SIZE - 1)), logprobs=2),
        SamplingParams(temperature=0.0),
    ]
    before = logits.clone()
    first = [False, True, False, True, False, False]
    masked = suppress_tokens(logits, params, first)
    assert torch.equal(logits, before)
    out = sample(masked, params)
    got = out.sampled_token_ids.tolist()
    assert got[0] != top[0] and got[0] == masked[0].argmax().item()
    assert got[1] != top[1]
    assert got[2] == top[2] and got[3] == top[3] and got[5] == top[5]  # not first / past vocab / none
    assert got[4] == VOCAB_SIZE - 1  # the only id left
    assert out.topk_ids[4, 0].item() == VOCAB_SIZE - 1 and out.topk_logprobs[4, 1].item() == float("-inf")
    assert masked[4, : VOCAB_SIZE - 1].eq(float("-inf")).all()
    # Nothing in the vocabulary to drop: the very same tensor, no copy.
    assert mask_token_ids(logits, [[VOCAB_SIZE + 1], [], [], [], [], []]) is logits
    assert suppress_tokens(logits, [SamplingParams(begin_suppress_token_ids=[1])] * 6, [False] * 6) is logits
    with pytest.raises(ValueError, match="ids_per_row has 2 rows"):
        mask_token_ids(logits, [[1], [2]])
