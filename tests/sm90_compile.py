"""Compile one of pprun's Triton kernels for sm_90 (H100/H200) ahead of time, without a GPU.

It runs in a fresh process with the Triton interpreter off: a test session without CUDA runs
the kernels' other tests under the interpreter (``triton_env``), where ``triton.jit`` yields
functions that the compiler cannot take.  Triton's bundled ptxas assembles the PTX, so inline
PTX that does not assemble fails here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_SCRIPT = r"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget

spec = json.loads(sys.argv[1])
fn = getattr(importlib.import_module(spec["module"]), spec["kernel"])
const = spec["constexprs"]
signature = {}
for name in fn.arg_names:
    if name in const:
        signature[name] = "constexpr"
    elif name.endswith("_ptr"):
        signature[name] = spec["pointers"].get(name, spec["default_pointer"])
    else:
        signature[name] = "fp32" if name in spec["float_args"] else "i32"
# As the runtime specializes a launch: pointers 16-byte aligned, strides and the named sizes
# multiples of 16 (without this Triton neither vectorizes loads nor pipelines loops).
attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
         if signature[name].startswith("*") or name.startswith("stride_") or name in spec["divisible"]}
try:
    compiled = triton.compile(triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=const, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=spec["options"])
except FileNotFoundError as e:  # a Triton build without the NVIDIA toolchain
    print(json.dumps({"skip": str(e)}))
    sys.exit(0)
print(json.dumps({"ptx": compiled.asm["ptx"], "cubin": bool(compiled.asm["cubin"])}))
"""


def compile_sm90(module: str, kernel: str, constexprs: dict, *, options: dict, pointers: dict | None = None,
                 default_pointer: str = "*fp32", float_args: tuple[str, ...] = (),
                 divisible: tuple[str, ...] = ()) -> str:
    """The PTX of ``module.kernel`` compiled for sm_90 with ``constexprs`` and launch ``options``;
    pointer arguments typed by ``pointers`` (else ``default_pointer``), the others int32 except
    ``float_args``.  Skips the test when Triton or its NVIDIA toolchain is missing."""
    pytest.importorskip("triton")
    spec = {"module": module, "kernel": kernel, "constexprs": constexprs, "options": options,
            "pointers": pointers or {}, "default_pointer": default_pointer, "float_args": list(float_args),
            "divisible": list(divisible)}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(spec)], env=env, capture_output=True,
                          text=True, timeout=600)
    if done.returncode != 0:
        raise AssertionError(f"compiling {module}.{kernel} for sm_90 failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(f"no ptxas: {result['skip']}")
    assert result["cubin"]
    return result["ptx"]
