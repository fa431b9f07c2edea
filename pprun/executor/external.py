"""``external_launcher``: torchrun started the processes; this rank is one worker of one stage.

The world is ``tp x pp`` ranks: rank ``r`` is tp rank ``r % tp`` of stage ``r // tp``
(``pprun.distributed.layout``), so with ``--nproc-per-node tp`` each node holds one stage's tp
group.

Every rank runs the same engine (SPMD): the same prompts, the same scheduler, the same steps. For
their schedulers to reach the same decisions, every rank must see the same inputs:

* **KV blocks.** Each stage may fit a different number of blocks in its budget (its own layers,
  its own free memory). The ranks agree on the minimum with one ``all_reduce(MIN)`` on a CPU
  group of the whole world before the cache is allocated, so every scheduler manages the same pool.
* **Sampled tokens.** Only the last stage's tp rank 0 samples. With more than one rank it
  broadcasts each step's ``ModelRunnerOutput`` (a few ints per request, as JSON, never pickled,
  on that CPU group) to every rank, so ``get_output()`` returns the same object everywhere and
  the schedulers stay in lockstep.

A step runs synchronously inside ``submit`` (receive from the previous rank, compute, send to the
next, then the broadcast), so ``max_in_flight = 1``: the pipeline holds one batch at a time. That
is the price of SPMD without a driver; the ``mp`` and ``ray`` executors keep pp batches in flight.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

from pprun.config.validate import ResolvedConfig
from pprun.core.outputs import ModelRunnerOutput, SchedulerOutput
from pprun.distributed import groups
from pprun.distributed.layout import StageLayout
from pprun.distributed.transport import PipelineTransport, broadcast_plain
from pprun.executor.base import Executor, StageFailedError
from pprun.worker.faults import stage_faults
from pprun.worker.runner_base import resolve
from pprun.worker.worker import Worker, WorkerSpec

logger = logging.getLogger(__name__)

_groups_created = itertools.count()
"""Process groups this module created in this process (numbers their store prefixes)."""


class ExternalLauncherExecutor(Executor):
    """This torchrun rank's worker (stage ``RANK // tp``, tp rank ``RANK % tp``); every rank drives
    an identical engine."""

    name = "external_launcher"
    max_in_flight = 1

    def __init__(self, resolved: ResolvedConfig, runner: str) -> None:
        self.resolved = resolved
        self.pp_size = len(resolved.layer_partition)
        self.tp_size = resolved.cfg.parallel.tensor_parallel_size
        self.num_workers = self.pp_size * self.tp_size
        timeout_s = resolved.cfg.parallel.stage_timeout_s
        self.owns_process_group = not dist.is_initialized()
        self.failed = False
        """A step failed: peers may be gone, so shutdown skips the closing barrier."""
        if self.owns_process_group:
            _init_from_torchrun_env(resolved.device, timeout_s)
        self.rank = dist.get_rank()
        world_size = dist.get_world_size()
        if world_size != self.num_workers:
            # validate_config checks WORLD_SIZE, but a user may have initialised a larger group.
            self._destroy_own_group()
            raise ValueError(
                f"parallel.pipeline_parallel_size={self.pp_size} x parallel.tensor_parallel_size={self.tp_size} "
                f"= {self.num_workers} workers but the torch.distributed world has {world_size} ranks; with "
                "executor=external_launcher every rank is one worker, so they must be equal"
            )
        layout = StageLayout.of_global_rank(resolved.layer_partition, self.rank, self.tp_size)
        self.layout = layout
        self.pp_rank = layout.pp_rank
        device_index = int(os.environ.get("LOCAL_RANK", 0)) if resolved.device == "cuda" else None
        device = torch.device("cuda", device_index) if device_index is not None else torch.device("cpu")
        try:
            # Every rank makes the same groups in the same order (pprun.distributed.groups).
            self.transport = PipelineTransport.from_existing(layout, device, timeout_s)
            tp = groups.tensor_parallel_group(layout, device, timeout_s)
            self.cpu_group = groups.world_cpu_group(device, timeout_s)
            """Gloo over every rank: the agreed KV blocks and each step's output."""
            spec = WorkerSpec(
                resolved,
                layout,
                runner,
                device_index=device_index,
                faults=stage_faults(self.rank),
            )
            self.worker = Worker(spec, transport=self.transport, tp=tp)
            num_params = self.worker.load_model()
            self.stage_params = self._gather_stage_params(num_params)
            self.num_blocks = self._agree_on_min(self.worker.num_available_blocks())
            if self.worker.num_cross_slots is not None:
                self.num_cross_slots = self._agree_on_min(self.worker.num_cross_slots)
            # Every rank plans the same warm-up: the smallest and largest SM count of all ranks.
            sms = self.worker.num_sms
            self.stage_sms = tuple(sorted({self._agree_on_min(sms), -self._agree_on_min(-sms)} - {0}))
        except BaseException:
            self.worker = None
            self._destroy_own_group()
            raise
        self.outputs: deque[ModelRunnerOutput] = deque()
        logger.info(
            "external_launcher: rank %d of %d (%s) runs layers %d..%d; %d KV blocks agreed by every rank",
            self.rank,
            self.num_workers,
            layout.name,
            layout.start_layer,
            layout.end_layer - 1,
            self.num_blocks,
        )

    # --- start-up ------------------------------------------------------------------------------

    def _gather_stage_params(self, num_params: int) -> list[int]:
        """Parameter count of every stage (its tp ranks' together), the same list on every rank."""
        if self.num_workers == 1:
            return [num_params]
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(self.num_workers)]
        dist.all_gather(counts, torch.tensor([num_params], dtype=torch.int64), group=self.cpu_group)
        tp = self.tp_size
        return [sum(int(c) for c in counts[pp * tp : (pp + 1) * tp]) for pp in range(self.pp_size)]

    def _agree_on_min(self, num_available: int) -> int:
        """The smallest count over all ranks (KV blocks, cross-attention slots): every scheduler
        must manage the same pool."""
        if self.num_workers == 1:
            return num_available
        count = torch.tensor([num_available], dtype=torch.int64)
        dist.all_reduce(count, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(count.item())

    def init_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV blocks (the engine passes the same number on every rank)."""
        self.num_blocks = num_blocks
        self.worker.init_cache(num_blocks)

    # --- steps ---------------------------------------------------------------------------------

    def submit(self, so: SchedulerOutput) -> None:
        """Run this rank's part of the step now; with more than one rank the last stage's tp rank
        0 shares its output."""
        if self.worker is None:
            raise StageFailedError("the external_launcher executor is shut down")
        try:
            out = self.worker.execute_model(so)
        except Exception as e:
            self.failed = True
            # The other ranks then fail in recv/broadcast (peer closed, or the group's timeout):
            # bounded, never a hang. A rank whose neighbour died reports the transport error.
            raise StageFailedError(
                f"torchrun rank {self.rank} ({self.layout.name} of {self.pp_size}): step "
                f"{so.step_id} failed: {e!r}"
            ) from e
        if self.num_workers > 1:
            src = (self.pp_size - 1) * self.tp_size
            try:
                out = broadcast_plain(resolve(out) if out is not None else None, src, self.cpu_group)
            except Exception as e:
                self.failed = True
                raise StageFailedError(
                    f"rank {self.rank}: no output of step {so.step_id} from the last stage's tp rank 0 "
                    f"(rank {src}) within parallel.stage_timeout_s: {e!r}"
                ) from e
        else:
            out = resolve(out)
        if not isinstance(out, ModelRunnerOutput):
            raise StageFailedError(
                f"rank {self.pp_rank}: step {so.step_id} produced {type(out).__name__}, "
                "expected a ModelRunnerOutput from the last stage"
            )
        self.outputs.append(out)

    def get_output(self) -> ModelRunnerOutput:
        """The output of the step run by the last ``submit`` (identical on every rank)."""
        return self.outputs.popleft()

    # --- lifecycle -----------------------------------------------------------------------------

    def mark_ready(self) -> None:
        """This rank's worker's first-use record counts from now on (every rank runs the engine)."""
        self.worker.mark_ready()

    def first_use_snapshots(self) -> list[dict]:
        """This rank's worker's first-use counts (another rank's are its own engine's)."""
        return [self.worker.first_use_snapshot()]

    def shutdown(self) -> None:
        """Drop the stage; destroy the process group only if this executor created it."""
        self.worker = None
        self.outputs = deque()
        self._destroy_own_group()

    def _destroy_own_group(self) -> None:
        if self.owns_process_group and dist.is_initialized():
            if not self.failed:
                # Every rank must be done with the gloo pairs before any tears them down: a
                # rank destroying its group while a peer still drains a send aborts the process
                # ("terminate called without an active exception").
                try:
                    dist.barrier()
                except Exception:  # a peer is gone: nothing left to wait for
                    pass
            dist.destroy_process_group()
        self.owns_process_group = False

    def describe(self) -> str:
        """Executor and this process's place in the job."""
        return f"external_launcher (torchrun, rank {self.rank} of {self.num_workers})"


def _init_from_torchrun_env(device: str, timeout_s: float) -> None:
    """Join the job torchrun started (``env://``: MASTER_ADDR/PORT, RANK, WORLD_SIZE) as the default group."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ValueError(
            f"parallel.executor='external_launcher' needs a process started by torchrun (or an "
            f"initialised torch.distributed group), but {', '.join(missing)} is not set; run under "
            "`torchrun --nproc-per-node <tp x pp> ...` or choose executor mp or ray"
        )
    if device == "cuda":
        # Before NCCL initialises, so its communicator binds to this rank's GPU.
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    # destroy_process_group() resets torch's group counter, so a second group made on torchrun's
    # store (an LLM after an LLM in one job) would reuse the first one's keys and could connect
    # to its closed sockets. Every rank creates its groups in the same order (SPMD), so a
    # per-process count gives each group its own key space.
    store = dist.PrefixStore(f"pprun_external_launcher_{next(_groups_created)}/", store)
    dist.init_process_group(
        backend="nccl" if device == "cuda" else "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
