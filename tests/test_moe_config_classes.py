"""The MoE layer picks its tiles and its sort from the class of a step's token count, so the
warm-up's one count per class meets every variant traffic can take (ready means warm)."""

from __future__ import annotations

import json

import pytest
import torch

from pprun.utils.first_use import count_class, count_class_representatives, count_class_top
from tests.triton_env import triton_only

LIMIT = 8192  # the default scheduler.max_num_batched_tokens


def _representative_of(limit: int) -> dict[str, int]:
    return {count_class(n): n for n in count_class_representatives(limit)}


def test_count_class_top_is_one_value_per_class():
    tops: dict[str, set[int]] = {}
    for n in range(1, LIMIT + 1):
        tops.setdefault(count_class(n), set()).add(count_class_top(n))
        assert count_class_top(n) >= n
    assert all(len(values) == 1 for values in tops.values()), tops
    assert count_class_top(32) == 32 and count_class_top(33) == 64 and count_class_top(600) == 1024


@triton_only
@pytest.mark.parametrize("shape", ["E=128,N=768,H=2048,K=8,bfloat16"])
def test_tuned_configs_are_the_same_across_a_class(shape):
    """With the shipped H200 table (entries at 256 and 2,048 tokens switch at 724), every count
    of a class gets the tiles of the count the warm-up runs for that class."""
    from pprun.layers import moe_triton

    data = json.loads((moe_triton.TUNED_DIR / "NVIDIA_H200.json").read_text())
    table = moe_triton.parse_tuned(data["shapes"][shape], "NVIDIA_H200.json")
    reps = _representative_of(LIMIT)
    for n in range(1, LIMIT + 1):
        rep = reps[count_class(n)]
        got = moe_triton.config_for(n, table, 128, 8, torch.bfloat16)
        assert got == moe_triton.config_for(rep, table, 128, 8, torch.bfloat16), (n, rep)
    # The case met in traffic: 600 tokens take the 1,024-token class's 64-row blocks, not 32.
    assert moe_triton.config_for(600, table, 128, 8, torch.bfloat16).gate_up.block_m == 64


@triton_only
@pytest.mark.parametrize("num_experts, top_k", [(128, 8), (8, 2), (60, 4), (64, 6)])
def test_default_configs_and_sort_path_are_the_same_across_a_class(num_experts, top_k):
    """Without a tuned table (thresholds on assignments per expert) and for the choice between
    the one-program and the chunked sort (a threshold on assignments): per class, never per
    count, whatever the expert count and top-k put the thresholds at."""
    from pprun.layers import moe_triton

    reps = _representative_of(LIMIT)
    for n in range(1, LIMIT + 1):
        rep = reps[count_class(n)]
        assert (moe_triton.config_for(n, {}, num_experts, top_k, torch.bfloat16)
                == moe_triton.config_for(rep, {}, num_experts, top_k, torch.bfloat16)), (n, rep)
        assert moe_triton.sorts_in_chunks(n, top_k) == moe_triton.sorts_in_chunks(rep, top_k), (n, rep)


@triton_only
def test_w8a8_tiles_and_mode_are_the_same_across_a_class():
    """Block-scaled float8 experts: whether a step runs W8A8 (``FP8_W8A8_MIN_TOKENS``) and its
    W8A8 tiles, from the shipped H200 table and from the rule, are per class, never per count."""
    from pprun.layers import moe_triton

    key = moe_triton.w8a8_shape_key(128, 768, 2048, 8, 128)
    data = json.loads((moe_triton.TUNED_DIR / "NVIDIA_H200.json").read_text())
    table = moe_triton.parse_tuned(data["shapes"][key], "NVIDIA_H200.json", 128)
    assert moe_triton.FP8_W8A8_MIN_TOKENS is not None  # the mode is on by default: what is checked
    reps = _representative_of(LIMIT)
    for n in range(1, LIMIT + 1):
        rep = reps[count_class(n)]
        assert moe_triton.uses_w8a8(n, 2048, 768, 128) == moe_triton.uses_w8a8(rep, 2048, 768, 128), (n, rep)
        for tiles in (table, {}):
            assert (moe_triton.w8a8_config(n, 128, 8, 128, tiles)
                    == moe_triton.w8a8_config(rep, 128, 8, 128, tiles)), (n, rep, bool(tiles))
