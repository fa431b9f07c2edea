"""Two processes that talk over ``torch.distributed`` (the tests of the pipeline's channels
between two stages), forked from a template that has imported torch already."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from typing import Any

PRELOAD = ["numpy", "torch", "torch.distributed"]
"""What the template imports once for the session (about 4.5 s of CPU a fresh interpreter would
spend per rank).  Never pprun: a rank sets the switches pprun reads at import (test_feedback)."""


def _with_env(env: dict[str, str], target: Callable[..., None], *args: Any) -> None:
    """Run ``target(*args)`` with the environment the caller had when it started the rank (the
    template's is the one of its own start), as a spawned process would."""
    os.environ.clear()
    os.environ.update(env)
    target(*args)


def run_two_ranks(target: Callable[..., None], *args: Any, timeout_s: float = 120.0) -> dict[int, Any]:
    """Run ``target(rank, init_method, *args, out)`` as ranks 0 and 1 of a fresh process group's
    address; each puts ``(rank, result)`` on ``out``.  Returns ``{rank: result}`` once both
    processes have exited with code 0."""
    from pprun.executor.mp import free_port

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    out = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    env = dict(os.environ)
    procs = [ctx.Process(target=_with_env, args=(env, target, rank, init_method, *args, out)) for rank in (0, 1)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=timeout_s) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0, f"rank {procs.index(p)} exited with {p.exitcode}"
    return results
