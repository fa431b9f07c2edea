"""Host cost of one V2 decode step, without a GPU: the runner's own work around the forward.

    python scripts/bench_v2_host.py [--batches 32 128] [--steps 300] [--gap-us 500 --wait block|spin] [--pin]

Drives :class:`V2ModelRunner` on CPU with a fake model (its forward and logits cost next to
nothing), so what is timed is the runner's host work: applying the scheduler's deltas
(``update_states``), building the step's inputs (``prepare_step`` + the buffer copies), gathering
the sampling tensors, and the whole ``execute_model``.  Prints one JSON line per batch size and
parameter mix, in microseconds per step (median over steps).

A pipeline stage does this work in bursts between waits (for the scheduler's message, the
previous stage, the sampled ids), not back to back.  ``--gap-us`` puts such a wait before every
step: ``--wait block`` blocks in ``select`` on a socket that stays silent (the thread sleeps, as in
a blocking receive), ``--wait spin`` polls the clock.  ``--pin`` keeps the process on one CPU.
Comparing them with back-to-back steps shows what running in bursts costs the same work.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import statistics
import time
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from pprun.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from pprun.distributed.layout import StageLayout
from pprun.sampling.params import SamplingParams
from pprun.worker.v2.runner import V2ModelRunner

BLOCK = 16
VOCAB = 64
HIDDEN = 8


class FakeModel(nn.Module):
    """Returns zeros of the right shape: a forward whose cost is negligible."""

    def forward(self, input_ids, positions, inputs_embeds, intermediate_tensors, attn_metadata):  # noqa: D102
        return torch.zeros(positions.shape[0], HIDDEN)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return torch.arange(hidden.shape[0] * VOCAB, dtype=torch.float32).reshape(-1, VOCAB) % 17


def make_runner(max_num_reqs: int, max_model_len: int) -> V2ModelRunner:
    cfg = SimpleNamespace(
        cache=SimpleNamespace(block_size=BLOCK),
        scheduler=SimpleNamespace(max_num_seqs=max_num_reqs, max_num_batched_tokens=2048),
        compilation=SimpleNamespace(cudagraph_mode="none"),
    )
    resolved = SimpleNamespace(
        cfg=cfg, dtype=torch.float32, max_model_len=max_model_len, cudagraph_capture_sizes=[]
    )
    return V2ModelRunner(FakeModel(), StageLayout.single(1), torch.device("cpu"), resolved, 10**6)


def params_for(i: int, mix: str) -> SamplingParams:
    if mix == "greedy":
        return SamplingParams(temperature=0.0, max_tokens=10**4, ignore_eos=True)
    return SamplingParams(
        temperature=[0.0, 0.7, 1.0][i % 3], top_k=[-1, 20, 40][i % 3], top_p=0.9, seed=i, max_tokens=10**4
    )


def make_gap(gap_us: float, wait: str):
    """A callable that waits ``gap_us`` microseconds the ``wait`` way (see the module docstring)."""
    gap_s = gap_us / 1e6
    if gap_s <= 0:
        return lambda: None
    if wait == "spin":
        def spin() -> None:
            end = time.perf_counter() + gap_s
            while time.perf_counter() < end:
                pass
        return spin
    quiet, _peer = socket.socketpair()

    def block() -> None:
        select.select([quiet], [], [], gap_s)
        _peer.fileno()  # keeps the peer open (a closed peer would make the socket readable)
    return block


def bench(
    batch: int, steps: int, mix: str, ctx: int = 512, max_model_len: int | None = None, gap=lambda: None
) -> dict[str, Any]:
    max_model_len = max_model_len or ctx + steps + 64
    runner = make_runner(batch, max_model_len)
    ids = [f"r{i}" for i in range(batch)]
    lengths = {r: ctx for r in ids}
    blocks = {r: -(-ctx // BLOCK) for r in ids}
    next_block = [1]

    def take(n: int) -> list[int]:
        out = list(range(next_block[0], next_block[0] + n))
        next_block[0] += n
        return out

    # Requests arrive already decoding (as if resumed): one scheduled token each from step 0.
    new = [
        NewRequestData(r, [(7 * i + j) % 50 + 3 for j in range(ctx)], params_for(i, mix), take(blocks[r]), ctx - 1)
        for i, r in enumerate(ids)
    ]
    runner.execute_model(SchedulerOutput(0, new, CachedRequestData(), {r: 1 for r in ids}, batch))

    phases: dict[str, list[float]] = {"update_states": [], "prepare_step": [], "sampling": [], "execute_model": []}
    gather = getattr(runner, "sampling_tensors", None)
    for step in range(1, steps + 1):
        cached = CachedRequestData()
        for r in ids:
            cached.req_ids.append(r)
            cached.num_computed_tokens.append(lengths[r])
            cached.new_token_ids.append([step % 50 + 3])
            lengths[r] += 1
            need = -(-lengths[r] // BLOCK) - blocks[r]
            blocks[r] += need
            cached.new_block_ids.append(take(need))
        so = SchedulerOutput(step, [], cached, {r: 1 for r in ids}, batch)
        gap()
        if step % 2:
            # Odd steps: the phases one by one (the runner's state advances exactly once).
            t0 = time.perf_counter()
            runner.update_states(so)
            t1 = time.perf_counter()
            plan = runner.graphs.plan(so.num_reqs, batch, 1)
            runner.bufs.wait_for_previous_reads()
            from pprun.worker.v2.inputs import prepare_step

            batch_ = prepare_step(runner.table, so, runner.bufs, plan.num_reqs_padded, plan.num_tokens_padded)
            runner.bufs.to_device(plan.num_reqs_padded, plan.num_tokens_padded, batch_.num_sampled)
            t2 = time.perf_counter()
            if gather is not None:
                gather(batch_)
            else:
                runner.table.sampling_tensors(batch_.rows[batch_.sample_batch_idx], runner.device)
            t3 = time.perf_counter()
            phases["update_states"].append(t1 - t0)
            phases["prepare_step"].append(t2 - t1)
            phases["sampling"].append(t3 - t2)
        else:
            t0 = time.perf_counter()
            runner.execute_model(so)
            phases["execute_model"].append(time.perf_counter() - t0)
    result = {"batch": batch, "mix": mix, "max_model_len": max_model_len}
    for name, ts in phases.items():
        result[f"{name}_us"] = round(statistics.median(ts) * 1e6, 1)
    return result


def main() -> None:
    """Print one JSON line per (batch, parameter mix)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--max-model-len", type=int, help="the runner's max_model_len (default: just enough)")
    ap.add_argument("--gap-us", type=float, default=0.0, help="a wait before every step (default none)")
    ap.add_argument("--wait", choices=("block", "spin"), default="block", help="how --gap-us waits")
    ap.add_argument("--pin", action="store_true", help="keep the process on one CPU (the first it may use)")
    ap.add_argument("--mixes", default="greedy,mixed", help="sampling-parameter mixes, comma-separated")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.pin:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    gap = make_gap(args.gap_us, args.wait)
    for batch in args.batches:
        for mix in args.mixes.split(","):
            result = bench(batch, args.steps, mix, max_model_len=args.max_model_len, gap=gap)
            if args.gap_us:
                result.update(gap_us=args.gap_us, wait=args.wait)
            result["pinned"] = args.pin
            print(json.dumps(result))


if __name__ == "__main__":
    main()
