"""Two spawned processes that talk over ``torch.distributed`` (the tests of the pipeline's
channels between two stages)."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any


def run_two_ranks(target: Callable[..., None], *args: Any, timeout_s: float = 120.0) -> dict[int, Any]:
    """Run ``target(rank, init_method, *args, out)`` as ranks 0 and 1 of a fresh process group's
    address; each puts ``(rank, result)`` on ``out``.  Returns ``{rank: result}`` once both
    processes have exited with code 0."""
    from pprun.executor.mp import free_port

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=target, args=(rank, init_method, *args, out)) for rank in (0, 1)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=timeout_s) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0, f"rank {procs.index(p)} exited with {p.exitcode}"
    return results
