"""``is_mm_embed`` on its own (pure logic): OR over interleaved/overlapping item ranges."""

import numpy as np

from pprun.multimodal.items import PlaceholderRange
from pprun.multimodal.mask import StepWindow, build_scatter_plan


def _plan(ranges_in_order):
    return build_scatter_plan(10, [StepWindow(0, 0, 10)], [ranges_in_order])


def test_overlapping_ranges_or_their_masks_in_either_order():
    outer = PlaceholderRange(0, 8, (True, True, False, False, False, True, True, True))
    inner = PlaceholderRange(2, 3)  # sits inside outer's False entries (audio inside a video)
    want = np.array([1, 1, 1, 1, 1, 1, 1, 1, 0, 0], dtype=bool)
    for order in ([outer, inner], [inner, outer]):
        plan = _plan(order)
        assert (plan.is_mm_embed == want).all()  # fails if OR is replaced by plain assignment
        assert plan.num_rows == int(plan.is_mm_embed.sum()) == outer.num_embeds + inner.num_embeds


def test_window_cut_scatters_only_its_part():
    rng = PlaceholderRange(3, 6, (True, False, True, True, False, True))
    plan = build_scatter_plan(4, [StepWindow(0, 4, 4)], [[rng]])  # positions 4..7
    assert plan.is_mm_embed.tolist() == [False, True, True, False]
    assert plan.row_embed.tolist() == [1, 2]


def test_alternating_ranges_keep_each_others_rows():
    """Two ranges that interleave position by position: each one's False entries sit under the
    other's True entries, so plain assignment (instead of OR) would erase half of the mask."""
    a = PlaceholderRange(0, 8, (True, False) * 4)  # positions 0, 2, 4, 6
    b = PlaceholderRange(1, 8, (True, False) * 4)  # positions 1, 3, 5, 7
    for order in ([a, b], [b, a]):
        plan = _plan(order)
        assert plan.is_mm_embed.tolist() == [True] * 8 + [False, False]
        assert plan.num_rows == 8
        # Row by row: which item (by index in this order) and which of its encoder rows.
        a_key = [i for i, (_, item) in enumerate(plan.items) if order[item] is a][0]
        assert [plan.row_item[i] == a_key for i in range(8)] == [True, False] * 4
        assert plan.row_embed.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def test_batch_of_requests_with_query_starts_scatters_each_window():
    """Three requests in one step at batch rows 0, 5 and 11; the second is cut mid-range by
    chunked prefill, the third carries two alternating ranges.  The scattered rows are exactly
    each item's encoder rows for its window, at the window's batch rows."""
    import torch

    from pprun.multimodal.items import MultiModalItem
    from pprun.worker.multimodal import MultiModalRunnerState

    windows = [StepWindow(0, 0, 5), StepWindow(5, 3, 6), StepWindow(11, 0, 6)]
    ranges = [
        [],
        [PlaceholderRange(2, 5)],  # positions 2..6; the window covers 3..8: rows 1..4 of it
        [PlaceholderRange(1, 4, (True, False, True, False)), PlaceholderRange(2, 4, (True, False, True, False))],
    ]
    plan = build_scatter_plan(17, windows, ranges)
    want = np.zeros(17, dtype=bool)
    want[5:9] = True  # request 1: positions 3..6 at rows 5..8
    want[12:16] = True  # request 2: positions 1, 3 (first item) and 2, 4 (second) at rows 12..15
    assert plan.is_mm_embed.tolist() == want.tolist()
    assert plan.num_rows == int(want.sum()) == 8

    state = MultiModalRunnerState(model=None)
    hidden = 3
    outputs = {}
    for req, req_ranges in enumerate(ranges):
        items = []
        for k, rng in enumerate(req_ranges):
            h = f"r{req}i{k}"
            outputs[h] = torch.arange(rng.num_embeds * hidden, dtype=torch.float32).view(-1, hidden) + 100 * (req * 10 + k + 1)
            state.encoder_cache[h] = outputs[h]
            items.append(MultiModalItem("image", h, rng))
        state.add_request(f"r{req}", items)
    embeds = torch.full((17, hidden), -1.0)
    state.scatter(embeds, ["r0", "r1", "r2"], windows)
    expected = torch.full((17, hidden), -1.0)
    expected[5:9] = outputs["r1i0"][1:5]
    expected[12] = outputs["r2i0"][0]
    expected[13] = outputs["r2i1"][0]
    expected[14] = outputs["r2i0"][1]
    expected[15] = outputs["r2i1"][1]
    assert torch.equal(embeds, expected)


def test_two_items_embedding_one_position_is_an_error():
    import pytest

    with pytest.raises(ValueError, match=r"request 0: item 1's range \(offset=3, length=2\) claims a position"):
        _plan([PlaceholderRange(0, 4), PlaceholderRange(3, 2)])
