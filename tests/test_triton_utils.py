"""``pprun.kernels.triton_utils``: the interpreter's boolean splat mend.

Runs on CUDA, or on CPU under the Triton interpreter (the default without CUDA).
"""

from __future__ import annotations

import pytest
import torch
from triton_env import DEVICE, USE_INTERPRETER, triton_only  # noqa: E402  (sets TRITON_INTERPRET)


@pytest.mark.skipif(not USE_INTERPRETER, reason="the Triton interpreter only")
def test_interpreter_splat_of_a_scalar_comparison_holds_bool():
    """The interpreter types a scalar comparison's handle with its operands' dtype (here int32)
    while holding a numpy bool; broadcast into an int1 block it must stay bool (Triton 3.9's
    load, store and atomics reject any other mask dtype)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    import pprun.kernels.triton_utils  # noqa: F401  (mends the splat)

    scalar = interpreter.TensorHandle(np.array([True]), tl.int32)  # what ``pid < n`` gives
    out = interpreter.interpreter_builder.create_splat(tl.block_type(tl.int1, [4]), scalar)
    assert out.data.dtype == np.bool_ and out.dtype == tl.int1 and out.data.all()
    # Other element types are left as the interpreter makes them.
    ints = interpreter.interpreter_builder.create_splat(
        tl.block_type(tl.int32, [4]), interpreter.TensorHandle(np.array([7], dtype=np.int32), tl.int32)
    )
    assert ints.data.dtype == np.int32 and ints.dtype == tl.int32 and (ints.data == 7).all()


@triton_only
def test_block_mask_and_scalar_condition_mask_loads_and_stores():
    """A block mask ``&`` a scalar comparison (a splat of it) masks a load and a store."""
    import triton
    import triton.language as tl

    import pprun.kernels.triton_utils  # noqa: F401  (mends the interpreter's splat)

    @triton.jit
    def copy_where(x_ptr, out_ptr, n, rows_on, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = (offs < n) & (row < rows_on)
        x = tl.load(x_ptr + row * BLOCK + offs, mask=mask, other=-1.0)
        tl.store(out_ptr + row * BLOCK + offs, x, mask=mask)

    x = torch.arange(12, dtype=torch.float32, device=DEVICE).reshape(3, 4)
    out = torch.zeros_like(x)
    copy_where[(3,)](x, out, 3, 2, BLOCK=4)
    want = torch.zeros_like(x)
    want[:2, :3] = x[:2, :3]
    assert torch.equal(out, want)
