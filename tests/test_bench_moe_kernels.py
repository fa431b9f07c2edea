"""``scripts/bench_moe_kernels.py``'s W8A8 mode (``--fp8 block --w8a8``) without a GPU: its flags,
the combinations it refuses, and its code paths at a tiny shape under Triton's interpreter with
the CUDA-graph timer replaced by one plain call (what is timed is the GPU's business; that each
setting launches, that the winners make a valid tuned entry under the W8A8 key that the library
then reads, and that the W8A8 rows run W8A8 is checked here)."""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from triton_env import triton_only  # noqa: E402  (sets TRITON_INTERPRET)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_moe_kernels.py"


def load_script():
    spec = importlib.util.spec_from_file_location("bench_moe_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_main(bench, monkeypatch, capsys, *args: str) -> tuple[object, str, str]:
    """``python bench_moe_kernels.py ARGS`` in this process, to its exit: (its exit code, stdout,
    stderr)."""
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *args])
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    out, err = capsys.readouterr()
    return exit_.value.code, out, err


def test_help_lists_w8a8_and_bad_combinations_are_refused(monkeypatch, capsys):
    """``--help`` lists ``--w8a8``; it takes ``--fp8 block`` (the error names the flag and what
    was given), and ``--fp8`` without it still refuses ``--tune``; all before any GPU is touched."""
    pytest.importorskip("triton")
    bench = load_script()
    code, out, _ = run_main(bench, monkeypatch, capsys, "--help")
    assert code == 0 and "--w8a8" in out and "float8_w8a8_block128" in out
    for args, message in ((["--w8a8"], "--w8a8 runs block-scaled float8 experts W8A8: it takes --fp8 block (got no --fp8)"),
                          (["--w8a8", "--fp8", "channel"], "it takes --fp8 block (got --fp8 channel)"),
                          (["--fp8", "block", "--tune"], "--fp8 block --w8a8 --tune tunes the W8A8 tiles"),
                          (["--write", "/tmp/x.json"], "--write writes what --tune found: it takes --tune")):
        code, _, _ = run_main(bench, monkeypatch, capsys, *args)
        assert isinstance(code, str) and message in code, (args, code)


def fake_timer(monkeypatch, bench, times=None) -> list[int]:
    """The script's timers run ``fn`` once and return the next of ``times`` (cycled; 1.0 if none);
    returns the live count of timed calls."""
    calls = [0]
    cycle = itertools.cycle(times or [1.0])

    def timed(fn, *args, **kwargs):
        fn()
        calls[0] += 1
        return next(cycle)

    monkeypatch.setattr(bench, "graph_us", timed)
    monkeypatch.setattr(bench, "eager_us", timed)
    return calls


@pytest.fixture
def tiny():
    """A tiny sparse layer's arguments and its 128x128 block-scaled float8 experts."""
    bench = load_script()
    args = Namespace(hidden=256, inter=128, experts=4, top_k=2)
    gen = torch.Generator().manual_seed(0)
    w13 = (torch.randn(4, 256, 256, generator=gen) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(4, 256, 128, generator=gen) * 0.05).to(torch.bfloat16)
    (q13, s13), (q2, s2) = bench.quantize_experts(w13, "block", 2), bench.quantize_experts(w2, "block", 1)
    fp8 = {"w13": q13, "w2": q2, "w13_scale": s13, "w2_scale": s2, "scale_block": 128}
    return bench, args, w13, w2, fp8, gen


def test_w8a8_search_space():
    """The W8A8 search: K tiles of one scale block, ``block_n`` 64/128 by 4/8 warps, then 2-5
    stages; ``block_m`` the suited values with the rule's among them."""
    pytest.importorskip("triton")
    from pprun.layers import moe_triton

    bench = load_script()
    firsts = bench.w8a8_firsts("gate_up", 64, 128)
    assert {(c.block_n, c.block_k, c.num_warps, c.num_stages) for c in firsts} == \
        {(64, 128, 4, 3), (64, 128, 8, 3), (128, 128, 4, 3), (128, 128, 8, 3)}
    assert [c.num_stages for c in bench.w8a8_around(firsts[0])] == [2, 3, 4, 5]
    for tokens in (1, 32, 256, 2048, 8192):
        bms = bench.w8a8_block_ms(tokens, 8, 128, 128)
        assert set(bms) <= {16, 32, 64, 128}
        assert moe_triton.w8a8_config(tokens, 128, 8, 128).gate_up.block_m in bms
    assert bench.w8a8_block_ms(256, 8, 128, 128) == (16, 32, 64)  # 16 rows per expert: the rule's 64 too
    assert bench.fits("gate_up", 128, 128, 128, 4, itemsize=1) and not bench.fits("gate_up", 128, 128, 128, 4)


@triton_only
def test_w8a8_tune_writes_an_entry_the_library_reads(tiny, monkeypatch, tmp_path):
    """``tune_w8a8_tokens`` times each setting (each launch runs), keeps the fastest per GEMM, and
    ``write_tuned`` under ``w8a8_shape_key`` makes a file ``w8a8_table`` reads back."""
    from pprun.layers import moe_triton as mt

    bench, args, _, _, fp8, gen = tiny
    # Decreasing times: each GEMM's last-timed setting wins.
    calls = fake_timer(monkeypatch, bench, [float(t) for t in range(1000, 0, -1)])
    entry = bench.tune_w8a8_tokens(3, args, fp8, gen, deadline=float("inf"))
    assert 8 <= calls[0] <= 2 * 10 * len(bench.w8a8_block_ms(3, 2, 4, 128))  # a few dozen settings at most
    assert entry["block_m"] in bench.w8a8_block_ms(3, 2, 4, 128)
    assert entry["gate_up"][1] == entry["down"][1] == 128 and entry["down_us"] < entry["gate_up_us"]
    key = mt.w8a8_shape_key(4, 128, 256, 2, 128)
    path = tmp_path / "tuned.json"
    bench.write_tuned(path, "GPU X", key, {3: entry})
    assert list(json.loads(path.read_text())["shapes"]) == [key]
    monkeypatch.setenv(mt.TUNED_ENV, str(path))
    mt.tuned_table.cache_clear()
    try:
        got = mt.w8a8_config(3, 4, 2, 128, mt.w8a8_table("GPU X", 4, 128, 256, 2, 128))
        assert got == mt.ExpertsConfig(mt.GemmConfig(entry["block_m"], *entry["gate_up"]),
                                       mt.GemmConfig(entry["block_m"], *entry["down"]))
    finally:
        mt.tuned_table.cache_clear()
    with pytest.raises(TimeoutError):  # past the budget: the caller keeps what it has
        bench.search("down", lambda c: None, 16, 0.0, bench.w8a8_firsts("down", 16, 128), bench.w8a8_around, 1)


@triton_only
def test_w8a8_rows_run_w8a8_beside_w8a16(tiny, monkeypatch):
    """With ``w8a8``, a token count's row also has the W8A8 timings and tiles; the W8A8 output
    differs from W8A16's (the activations' float8 rounding: the mode ran), the switch is back
    off after the row, and the module's own setting back after the mode."""
    from pprun.layers import moe_triton as mt

    bench, args, w13, w2, fp8, gen = tiny
    fake_timer(monkeypatch, bench)
    default = mt.FP8_W8A8_MIN_TOKENS
    with bench.w8a8_mode(False):
        row = bench.time_tokens(3, args, w13, w2, gen, fp8, w8a8=True)
        assert mt.FP8_W8A8_MIN_TOKENS is None
    assert mt.FP8_W8A8_MIN_TOKENS == default
    assert {"fused_us", "bf16_fused_us", "w8a8_us", "w8a8_rule_us", "w8a8_config"} <= set(row)
    rule = mt.w8a8_config(3, 4, 2, 128)
    assert row["w8a8_config"] == {"gate_up": rule.gate_up._asdict(), "down": rule.down._asdict()}  # CPU: no table
    assert 0 < row["max_abs_diff_w8a8_vs_w8a16"] < float("inf")
