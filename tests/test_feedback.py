"""The sampled-ids channel of async pipeline steps (``pprun.distributed.feedback``), its two ends
in two processes: the socket channel, the gloo one, and the errors of a channel that breaks."""

from __future__ import annotations

import traceback
from datetime import timedelta

import numpy as np
import pytest
from two_ranks import run_two_ranks

STEPS = [  # (requests that sample, their ids) per step, in step order
    (["a", "b", "c"], [11, 12, 13]),
    (["d"], [14]),
    (["a", "b", "c"], [21, 22, 23]),
    (["d"], [24]),
    (["a", "c"], [31, 33]),  # b finished
    (["d"], [34]),
]


def _end(rank: int, init_method: str, socket_on: bool, mode: str, spin_s: float, out) -> None:
    """One end of the channel (rank 0: the first stage, 1: the last); puts what it saw in ``out``.

    ``mode``: "ok" (the first stage reads each step's ids one step later), "lag" (it expects every
    step first and reads the last ``num_slots`` steps' ids at the end: slots come round with their
    messages unread), "closed" / "silent" (the last stage closes after one step / sends nothing),
    "mismatch" (the last stage sends two ids where the first expects three).  ``spin_s``: how
    long the first stage polls the socket before a blocking read."""
    try:
        import os

        # The switch as a stage process gets it: in its environment, read when the module is
        # imported (docs/switches.md).  Only the first stage's counts: the last stage gets the
        # opposite, which must change nothing.
        socket_here = socket_on if rank == 0 else not socket_on
        os.environ["PPRUN_DISABLE_FEEDBACK_SOCKET"] = "0" if socket_here else "1"
        import torch
        import torch.distributed as dist

        from pprun.distributed import feedback as fb

        assert fb.SOCKET_ENABLED == socket_here, "pprun.distributed.feedback was imported before the switch was set"
        if mode == "strangers":
            _strangers_first(fb, rank)
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2,
                                timeout=timedelta(seconds=60))  # fmt: skip
        timeout_s = 2.0 if mode not in ("ok", "strangers") else 60.0
        key = b"the last stage's key" if mode == "impostor" and rank == 1 else KEY
        end = fb.SampleFeedback(dist.group.WORLD, 1 - rank, rank == 0, max_num_reqs=4, num_slots=3,
                                host="127.0.0.1", timeout_s=timeout_s, spin_s=spin_s, authkey=key)  # fmt: skip
        try:
            end.warm_up()
        except RuntimeError as e:
            if mode != "impostor":
                raise
            out.put((rank, {"error": str(e)}))
            return
        seen: dict[str, object] = {"socket": end.sock is not None, "polls": end._spinner is not None}
        if rank == 1:
            if mode in ("ok", "lag", "strangers"):
                for _, ids in STEPS:
                    end.send(torch.tensor(ids, dtype=torch.int64))
            elif mode == "closed":
                end.send(torch.tensor(STEPS[0][1], dtype=torch.int64))
                end.close()
            elif mode == "mismatch":
                end.send(torch.tensor(STEPS[0][1][:2], dtype=torch.int64))
            dist.barrier()  # "silent": sends nothing, waits for the first stage to time out
        elif mode == "lag":
            flats = []
            for req_ids, _ in STEPS:
                end.expect(req_ids, torch.arange(len(req_ids)), len(req_ids))
                flats.append(_where(end, req_ids))  # where this step's land
            seen["got"] = [_read(end, flat) for flat in flats[-3:]]  # the newest step per slot (num_slots=3)
            dist.barrier()
        else:
            got = []
            for step, (req_ids, _) in enumerate(STEPS):
                end.expect(req_ids, torch.arange(len(req_ids)), len(req_ids))
                if step >= 1:  # the previous step's ids, as a step two behind would read them
                    try:
                        got.append(_read(end, _where(end, STEPS[step - 1][0])))
                    except RuntimeError as e:
                        seen["error"] = str(e)
                        break
            seen["got"] = got
            dist.barrier()
        end.close()
        out.put((rank, seen))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the test
        out.put((rank, {"exception": traceback.format_exc()}))


KEY = b"0123456789abcdef0123456789abcdef"
"""The run's key both ends share (an ``impostor`` last stage holds another)."""


def _strangers_first(fb, rank: int) -> None:
    """Before the last stage connects, three strangers connect to the first stage's sampled-ids
    listener: one sends a pickle whose loading would create a file, one sends 64 bytes of junk,
    one says nothing (the first stage's handshake timeout cut to 1 s)."""
    import socket

    if rank == 0:
        fb.auth.HANDSHAKE_TIMEOUT_S = 1.0
        return
    real = socket.create_connection

    def create_connection(address, *args, **kwargs):
        import os
        import pickle

        class Bomb:
            def __reduce__(self):
                return (os.mkdir, (os.environ["PPRUN_TEST_BOMB"],))

        strangers = [real(address) for _ in range(3)]
        strangers[0].sendall(pickle.dumps(Bomb()).ljust(64, b"."))
        strangers[1].sendall(b"x" * 64)
        sock = real(address, *args, **kwargs)
        for s in strangers[:2]:
            s.close()
        fb._silent_stranger = strangers[2]  # kept open until the end
        return sock

    fb.socket.create_connection = create_connection


def _where(end, req_ids: list[str]) -> np.ndarray:
    """Where the first stage's index says the newest expected ids of ``req_ids`` land."""
    return np.array([end.index[r] for r in req_ids])


def _read(end, flat: np.ndarray) -> list[int]:
    """The first stage's ``fill`` of the ids at ``flat`` (as a step's pending input ids)."""
    row = np.zeros(len(flat), dtype=np.int64)
    end.fill(row, np.arange(len(flat)), flat)
    return row.tolist()


def _run(socket_on: bool, mode: str = "ok", spin_s: float = 0.0) -> dict[int, dict]:
    results = run_two_ranks(_end, socket_on, mode, spin_s)
    for rank, seen in results.items():
        assert "exception" not in seen, f"rank {rank}:\n{seen['exception']}"
    return results


@pytest.mark.parametrize(("socket_on", "spin_s"), [(True, 0.0), (True, 0.002), (False, 0.002)])
@pytest.mark.parametrize("mode", ["ok", "lag"])
def test_ids_arrive_in_step_order_on_either_channel(socket_on, spin_s, mode):
    """Each step's ids land where the first stage's index says when a later step fills them in,
    also when ring slots come round with their messages unread, with the first stage polling
    the socket before it blocks or not.  The first stage's switch decides for both ends (the
    last stage's is set the other way)."""
    results = _run(socket_on, mode, spin_s)
    assert results[0]["socket"] is socket_on and results[1]["socket"] is socket_on
    # Only the first stage's end of a socket polls.
    assert results[0]["polls"] is (socket_on and spin_s > 0) and results[1]["polls"] is False
    want = [ids for _, ids in STEPS[:-1]] if mode == "ok" else [ids for _, ids in STEPS[-3:]]
    assert results[0]["got"] == want


def test_socket_channel_refuses_strangers_and_serves_the_last_stage(tmp_path, monkeypatch):
    """Strangers connecting to the first stage's sampled-ids listener before the last stage (a
    pickle that would make a directory if loaded, junk, silence) are refused unread, and the
    last stage's ids still arrive in order."""
    bomb = tmp_path / "unpickled"
    monkeypatch.setenv("PPRUN_TEST_BOMB", str(bomb))
    results = _run(True, "strangers")
    assert results[0]["socket"] and results[0]["got"] == [ids for _, ids in STEPS[:-1]]
    assert not bomb.exists()


def test_socket_channel_refuses_a_last_stage_with_another_key():
    """Two ends with different keys: the first stage refuses the connection and times out
    waiting for one that authenticates, the last stage's handshake fails; both raise an error
    naming the socket, and no id is read."""
    results = run_two_ranks(_end, True, "impostor", 0.0)
    assert "opening the sampled-ids socket failed accepting the last stage" in results[0]["error"]
    assert "opening the sampled-ids socket failed connecting" in results[1]["error"]
    assert "handshake" in results[1]["error"] or "key" in results[1]["error"]


def test_socket_channel_reports_a_closed_silent_or_out_of_step_last_stage():
    """A last stage that closes the channel, sends nothing within the timeout, or sends another
    count of ids than the first stage expects: the first stage's fill raises an error saying
    which, instead of waiting for good or reading shifted ids."""
    closed = _run(True, "closed", spin_s=0.002)[0]  # a closed socket ends the polling too
    assert closed["got"] == [STEPS[0][1]] and "closed the sampled-ids socket" in closed["error"]
    silent = _run(True, "silent", spin_s=0.002)[0]
    assert silent["got"] == [] and "no sampled ids from the last stage" in silent["error"]
    mismatch = _run(True, "mismatch")[0]
    assert mismatch["got"] == [] and "out of step" in mismatch["error"]
