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
