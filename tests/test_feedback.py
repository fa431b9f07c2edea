"""The sampled-ids channel of async pipeline steps (``pprun.distributed.feedback``), its two ends
in two processes: the socket channel, the gloo fallback, and the errors of a channel that breaks."""

from __future__ import annotations

import multiprocessing as mp
import traceback
from datetime import timedelta

import numpy as np
import pytest

STEPS = [  # (requests that sample, their ids) per step, in step order
    (["a", "b", "c"], [11, 12, 13]),
    (["d"], [14]),
    (["a", "b", "c"], [21, 22, 23]),
    (["d"], [24]),
    (["a", "c"], [31, 33]),  # b finished
    (["d"], [34]),
]


def _end(rank: int, port: int, socket_on: bool, mode: str, out) -> None:
    """One end of the channel (rank 0: the first stage, 1: the last); puts what it saw in ``out``."""
    try:
        import torch
        import torch.distributed as dist

        from pprun.distributed import feedback as fb

        fb.SOCKET_ENABLED = socket_on
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=60))  # fmt: skip
        timeout_s = 2.0 if mode != "ok" else 60.0
        end = fb.SampleFeedback(dist.group.WORLD, 1 - rank, rank == 0, max_num_reqs=4, num_slots=3,
                                host="127.0.0.1", timeout_s=timeout_s)  # fmt: skip
        end.warm_up()
        seen: dict[str, object] = {"socket": end.sock is not None}
        if rank == 1:
            if mode == "ok":
                for _, ids in STEPS:
                    end.send(torch.tensor(ids, dtype=torch.int64))
            elif mode == "closed":
                end.send(torch.tensor(STEPS[0][1], dtype=torch.int64))
                end.close()
            dist.barrier()  # "silent": sends nothing, waits for the first stage to time out
        else:
            got = []
            for step, (req_ids, _) in enumerate(STEPS):
                end.expect(req_ids, torch.arange(len(req_ids)), len(req_ids))
                if step >= 1:  # the previous step's ids, as a step two behind would read them
                    prev_ids = STEPS[step - 1][0]
                    flat = np.array([end.index[r] for r in prev_ids])
                    row = np.zeros(len(prev_ids), dtype=np.int64)
                    try:
                        end.fill(row, np.arange(len(prev_ids)), flat)
                    except RuntimeError as e:
                        seen["error"] = str(e)
                        break
                    got.append(row.tolist())
            seen["got"] = got
            dist.barrier()
        end.close()
        out.put((rank, seen))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the test
        out.put((rank, {"exception": traceback.format_exc()}))


def _run(socket_on: bool, mode: str = "ok") -> dict[int, dict]:
    from pprun.executor.mp import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_end, args=(r, port, socket_on, mode, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    for rank, seen in results.items():
        assert "exception" not in seen, f"rank {rank}:\n{seen['exception']}"
    return results


@pytest.mark.parametrize("socket_on", [True, False])
def test_ids_arrive_in_step_order_on_either_channel(socket_on):
    """Each step's ids land where the first stage's index says, read only when a later step
    fills them in; with the socket switched off on the first stage both ends stay on gloo."""
    results = _run(socket_on)
    assert results[0]["socket"] is socket_on and results[1]["socket"] is socket_on  # the first decides
    assert results[0]["got"] == [ids for _, ids in STEPS[:-1]]


def test_socket_channel_reports_a_closed_or_silent_last_stage():
    """A last stage that closes the channel, or sends nothing within the timeout: the first stage's
    fill raises an error saying which, instead of waiting for good."""
    closed = _run(True, "closed")[0]
    assert closed["got"] == [STEPS[0][1]] and "closed the sampled-ids socket" in closed["error"]
    silent = _run(True, "silent")[0]
    assert silent["got"] == [] and "no sampled ids from the last stage" in silent["error"]
