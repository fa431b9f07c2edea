"""Compile one of pprun's Triton kernels for sm_90 (H100/H200) ahead of time, without a GPU.

It runs in another process with the Triton interpreter off: a test session without CUDA runs
the kernels' other tests under the interpreter (``triton_env``), where ``triton.jit`` yields
functions that the compiler cannot take.  That process is started once (its imports of Triton
and torch cost seconds) and compiles kernel after kernel, as long as the test process's
environment stays the one it was started with (else a new one starts: the kernels' modules read
their switches at import).  Triton's bundled ptxas assembles the PTX, so inline PTX that does not
assemble fails here.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
from typing import IO

import pytest
from child_process import close_child

_SCRIPT = r"""
import importlib, json, os, sys, traceback
import triton
from triton.backends.compiler import GPUTarget

replies = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # what Triton prints goes where the errors go, not to the reply channel


def compile_one(spec):
    fn = getattr(importlib.import_module(spec["module"]), spec["kernel"])
    # A Triton dtype travels as its name: "tl.bfloat16".
    const = {k: getattr(triton.language, v[3:]) if isinstance(v, str) and v.startswith("tl.") else v
             for k, v in spec["constexprs"].items()}
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
        return {"skip": str(e)}
    return {"ptx": compiled.asm["ptx"], "cubin": bool(compiled.asm["cubin"])}


for line in sys.stdin:
    try:
        result = compile_one(json.loads(line))
    except BaseException:
        result = {"error": traceback.format_exc()}
    replies.write(json.dumps(result) + "\n")
    replies.flush()
"""

TIMEOUT_S = 600


class _Compiler:
    """The compiling process: started on first use, kept for the next kernels while the
    environment it was started with (less ``TRITON_INTERPRET``) is the caller's (pytest's
    ``PYTEST_CURRENT_TEST``, which names the running test, aside)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] | None = None
        self.log: IO[bytes] | None = None

    def compile(self, spec: dict) -> dict:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        if self.proc is not None and (_same(self.env) != _same(env) or self.proc.poll() is not None):
            self.close()
        if self.proc is None:
            self.log = tempfile.TemporaryFile()
            self.env = env
            self.proc = subprocess.Popen([sys.executable, "-c", _SCRIPT], env=env, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=self.log)
        self.proc.stdin.write((json.dumps(spec) + "\n").encode())
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            timed_out = not ready
            self.proc.kill()
            self.proc.wait()
            self.log.seek(0)
            err = self.log.read().decode(errors="replace")
            self.close()
            why = f"took more than {TIMEOUT_S} s" if timed_out else "ended the compiling process"
            raise AssertionError(f"compiling {spec['module']}.{spec['kernel']} for sm_90 {why}:\n{err[-3000:]}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc is not None:
            close_child(self.proc, timeout_s=30)
            self.proc.stdout.close()
            self.log.close()
        self.proc = self.env = self.log = None


def _same(env: dict[str, str] | None) -> dict[str, str] | None:
    """What of an environment a kernel compiled in it may depend on."""
    return None if env is None else {k: v for k, v in env.items() if k != "PYTEST_CURRENT_TEST"}


_compiler = _Compiler()
atexit.register(_compiler.close)


def compile_sm90(module: str, kernel: str, constexprs: dict, *, options: dict, pointers: dict | None = None,
                 default_pointer: str = "*fp32", float_args: tuple[str, ...] = (),
                 divisible: tuple[str, ...] = ()) -> str:
    """The PTX of ``module.kernel`` compiled for sm_90 with ``constexprs`` and launch ``options``;
    pointer arguments typed by ``pointers`` (else ``default_pointer``), the others int32 except
    ``float_args``; a Triton dtype among ``constexprs`` is given by name (``"tl.bfloat16"``).  Skips the test when Triton or its NVIDIA toolchain is missing."""
    pytest.importorskip("triton")
    spec = {"module": module, "kernel": kernel, "constexprs": constexprs, "options": options,
            "pointers": pointers or {}, "default_pointer": default_pointer, "float_args": list(float_args),
            "divisible": list(divisible)}
    result = _compiler.compile(spec)
    if "error" in result:
        raise AssertionError(f"compiling {module}.{kernel} for sm_90 failed:\n{result['error'][-3000:]}")
    if "skip" in result:
        pytest.skip(f"no ptxas: {result['skip']}")
    assert result["cubin"]
    return result["ptx"]
