"""A pipeline stage's worker: device set-up, model load, KV-cache allocation, one step.

The same class runs in process (``uni``), in a local process (``mp``), in a Ray actor
(``ray``) and on a torchrun rank (``external_launcher``); only how its steps arrive differs.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from pprun.config.validate import ResolvedConfig
from pprun.core.outputs import ModelRunnerOutput, SchedulerOutput
from pprun.distributed.intermediate import IntermediateTensors
from pprun.distributed.layout import StageLayout
from pprun.distributed.tensor_parallel import TensorParallel
from pprun.distributed.transport import PipelineTransport
from pprun.models.base import PprunModel
from pprun.utils.first_use import FirstUse, watch_triton
from pprun.utils.startup import freeze_startup_objects
from pprun.utils.step_trace import NullStageTrace, StageTrace, trace_prefix
from pprun.worker.runner_base import ModelRunner, PendingOutput

logger = logging.getLogger(__name__)


@dataclass
class WorkerSpec:
    """Everything a worker needs to build its stage; picklable, sent to remote processes."""

    resolved: ResolvedConfig
    """The run's configuration, validated once by the entry point (never validated again here)."""
    layout: StageLayout
    runner: str
    """"v1" or "v2" (already chosen by the engine)."""
    init_method: str | None = None
    """``torch.distributed`` rendezvous (``tcp://host:port``) for pp x tp > 1 with own executors."""
    device_index: int | None = None
    """CUDA device of this worker; ``None`` on CPU."""
    sample_feedback_slots: int = 0
    """Async pipeline steps: the last stage sends its sampled ids straight to the first
    (``pprun.distributed.feedback``) into a ring of this many steps (the executor's steps in
    flight plus spares); 0: off."""
    control_spin_s: float = 0.0
    """How long the stage polls its control socket, and the first stage its sampled-ids socket,
    before a blocking read (the driver's ``pprun.executor.remote.control_spin_s``)."""
    feedback_host: str | None = None
    """Where the first stage listens for the sampled-ids socket (None: the host of a ``tcp://``
    ``init_method``; a ``file://`` rendezvous and no host: the ids stay on gloo)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment set in the stage process before ``torch.distributed`` starts (gloo and NCCL on
    the loopback interface when every stage runs on the driver's host)."""
    authkey: bytes | None = field(default=None, repr=False)
    """The run's secret (set by the stage from its control connection, never sent in the spec):
    the sampled-ids socket authenticates its peer with it."""
    faults: dict | None = None
    """Tests only: the faults injected into this stage (``pprun.worker.faults``; None: none)."""


class Worker:
    """One worker of a stage (its tp rank): owns its model (or its shard of it), its KV cache, its
    runner, its pipeline channel and its place in the stage's tensor-parallel group."""

    def __init__(
        self, spec: WorkerSpec, transport: PipelineTransport | None = None, tp: TensorParallel | None = None
    ) -> None:
        """``transport`` and ``tp``: groups made by the caller in an existing world (torchrun);
        else the worker joins the run's world itself (``spec.init_method``) and makes them."""
        self.spec = spec
        self.layout = spec.layout
        rc = spec.resolved
        self.rc = rc
        if rc.device == "cuda":
            index = spec.device_index if spec.device_index is not None else 0
            torch.cuda.set_device(index)
            self.device = torch.device("cuda", index)
        else:
            self.device = torch.device("cpu")
        torch.manual_seed(rc.cfg.model.seed)
        world_size = self.layout.world_size
        if self.device.type == "cpu" and world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
            # Workers share the host's cores: one thread pool per core each would oversubscribe
            # them, and oversubscribed pools spin against each other.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        self.transport = transport
        self._world_store = None
        """The rendezvous store of a world joined without a transport (pp = 1, tp > 1)."""
        self._owns_world = transport is None and tp is None and world_size > 1
        """Whether this worker joined the world (and tears it down at shutdown)."""
        timeout_s = rc.cfg.parallel.stage_timeout_s
        if self._owns_world:
            # Every rank makes the same groups in the same order (pprun.distributed.groups).
            if self.layout.pp_size > 1:
                self.transport = PipelineTransport.init(
                    self.layout, self.device, spec.init_method, timeout_s,
                    feedback=spec.sample_feedback_slots > 0, feedback_host=spec.feedback_host, authkey=spec.authkey,
                )
            else:
                from pprun.distributed.groups import init_world

                self._world_store = init_world(self.layout, self.device, spec.init_method, timeout_s, spec.authkey)
        if tp is None:
            from pprun.distributed.groups import tensor_parallel_group

            tp = tensor_parallel_group(self.layout, self.device, timeout_s) if world_size > 1 else TensorParallel.single()
        self.tp = tp
        """This worker's place in its stage's tensor-parallel group."""
        self.model: PprunModel | None = None
        self.runner: ModelRunner | None = None
        self.encoder_decoder = None
        """An encoder-decoder stage's ``pprun.worker.encoder_decoder.EncoderDecoderState``."""
        self.num_cross_slots: int | None = None
        """An encoder-decoder stage's cross-attention slots (requests that may run at once), sized
        by :meth:`num_available_blocks` from the cache budget; None for a decoder-only model."""
        self.recv_buffers = None
        self.kv_cache_bytes = 0
        """Bytes of the KV cache allocated by :meth:`init_cache` (0 before)."""
        self.step_count = 0
        self.first_use = FirstUse(name=f"stage {self.layout.pp_rank}")
        """What this stage compiled, captured and ran for the first time (``pprun.utils.first_use``):
        Triton compiles, CUDA-graph captures, sampler branches; the last stage's new keys travel
        with each step's output (``ModelRunnerOutput.first_use``), another stage's are logged here."""
        if self.device.type == "cuda":
            watch_triton(self.first_use)
        prefix, name = trace_prefix(), f"stage{self.layout.pp_rank}"
        if self.layout.tp_size > 1:
            name += f"_tp{self.layout.tp_rank}"
        self.trace = StageTrace(self.device, name, f"{prefix}.{name}.json") if prefix else NullStageTrace()

    def load_model(self) -> int:
        """Build and load this stage's model; returns its parameter count."""
        from pprun.attention.backend import get_backend
        from pprun.worker.model_loader import load_stage_model

        rc = self.rc
        self.model = load_stage_model(
            rc.model_dir,
            rc.arch,
            self.layout,
            device=self.device,
            dtype=rc.dtype,
            max_positions=max(rc.max_model_len, 1),
            attn_backend=get_backend(rc.attention_backend, self.device),
            tp=self.tp,
        )
        return sum(p.numel() for p in self.model.parameters())

    @property
    def num_sms(self) -> int:
        """Streaming multiprocessors of this stage's device (0 off CUDA): the engine's warm-up
        plans the eager decode launch's split counts from it (``pprun.engine.warmup``)."""
        from pprun.kernels.grid import num_sms

        return num_sms(self.device) if self.device.type == "cuda" else 0

    def num_available_blocks(self) -> int:
        """KV blocks this stage can hold within its cache budget (own layers only)."""
        from pprun.worker.kv_cache import bytes_per_block

        rc = self.rc
        cache = rc.cfg.cache
        per_block = bytes_per_block(rc.arch, self.layout.num_layers, cache.block_size, rc.dtype, self.tp.size)
        if cache.kv_cache_memory_bytes is not None:
            budget = cache.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            torch.cuda.synchronize()
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * cache.gpu_memory_utilization)
        else:
            budget = cache.cpu_kv_cache_bytes
        from pprun.worker.encoder_decoder import is_encoder_decoder

        if is_encoder_decoder(self.model):
            # Cross-attention slots come out of the budget first, as many as it holds beside their
            # requests' self-attention (pprun.worker.encoder_decoder.cross_slots_for_budget); the
            # scheduler admits a request only while a slot is free.
            from pprun.core.block_manager import min_blocks_for_one_request
            from pprun.worker.encoder_decoder import cross_slots_for_budget
            from pprun.worker.kv_cache import bytes_per_cross_slot

            slot_bytes = bytes_per_cross_slot(self.model, rc.dtype)
            request_kv_bytes = min_blocks_for_one_request(rc.max_model_len, cache.block_size) * per_block
            max_num_seqs = rc.cfg.scheduler.max_num_seqs
            num_slots = cross_slots_for_budget(budget, slot_bytes, request_kv_bytes, per_block, max_num_seqs)
            if num_slots == 0:
                need = 2 * slot_bytes + request_kv_bytes + per_block
                raise ValueError(
                    f"stage {self.layout.pp_rank}: the KV-cache budget of {budget / 2**20:.1f} MiB holds no "
                    f"request of this encoder-decoder model: one needs {need / 2**20:.1f} MiB (its "
                    f"cross-attention slot of {slot_bytes / 2**20:.1f} MiB and the reserved one, and "
                    f"self-attention for model.max_model_len={rc.max_model_len} tokens); raise the cache "
                    "budget (cache.kv_cache_memory_bytes, cache.cpu_kv_cache_bytes or "
                    "cache.gpu_memory_utilization) or lower model.max_model_len"
                )
            if num_slots < max_num_seqs:
                logger.info(
                    "stage %d: cross-attention caches for %d requests at once (%.0f MiB each; "
                    "scheduler.max_num_seqs=%d do not fit the KV-cache budget of %.0f MiB beside their "
                    "self-attention); more requests wait for a slot",
                    self.layout.pp_rank, num_slots, slot_bytes / 2**20, max_num_seqs, budget / 2**20,
                )  # fmt: skip
            self.num_cross_slots = num_slots
            budget -= (num_slots + 1) * slot_bytes
        return budget // per_block

    def init_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV blocks for the owned layers and build the runner."""
        from pprun.worker.kv_cache import allocate_kv_caches

        rc = self.rc
        caches = allocate_kv_caches(
            rc.arch, self.layout.num_layers, num_blocks, rc.cfg.cache.block_size, rc.dtype, self.device,
            self.tp.size,
        )
        self.model.bind_kv_caches(caches)
        self.kv_cache_bytes = sum(t.numel() * t.element_size() for t in caches)
        from pprun.worker.encoder_decoder import EncoderDecoderState, is_encoder_decoder

        encoder_decoder = None
        if is_encoder_decoder(self.model):
            log_mel = None
            if self.layout.is_first:
                from pprun.audio import LogMelConfig, LogMelSpectrogram

                log_mel = LogMelSpectrogram(LogMelConfig.from_model_dir(rc.model_dir), self.device)
            encoder_decoder = EncoderDecoderState(
                self.model, self.layout, self.device, rc.dtype, self.num_cross_slots, self.transport,
                log_mel=log_mel,
            )
            self.kv_cache_bytes += encoder_decoder.cache_bytes
        self.encoder_decoder = encoder_decoder
        if self.spec.runner == "v2":
            from pprun.worker.v2.runner import V2ModelRunner

            self.runner = V2ModelRunner(
                self.model, self.layout, self.device, rc, num_blocks, self.transport,
                sample_feedback_slots=self.spec.sample_feedback_slots,
                feedback_spin_s=self.spec.control_spin_s,
                encoder_decoder=encoder_decoder,
                first_use=self.first_use,
            )
        else:
            from pprun.worker.v1.runner import V1ModelRunner

            self.runner = V1ModelRunner(
                self.model, self.layout, self.device, rc.cfg.cache.block_size, encoder_decoder=encoder_decoder,
                max_model_len=rc.max_model_len,
            )
            self.runner.sampler.first_use = self.first_use
        if not self.layout.is_first:
            max_tokens = rc.max_num_batched_tokens
            self.recv_buffers = self.model.make_empty_intermediate_tensors(
                max_tokens, rc.dtype, self.device
            )
        freeze_startup_objects()

    def execute_model(self, so: SchedulerOutput, wait: bool = True) -> ModelRunnerOutput | PendingOutput | None:
        """One step of this stage: receive, compute, send (or sample on the last stage).

        With ``wait=False`` the last stage may return a pending output (V2: ``PendingOutput``,
        whose ``result()`` waits for the sampled ids), so the caller can start the next step
        before this one's output is needed.
        """
        trace = self.trace
        num_tokens = so.total_num_scheduled_tokens
        trace.begin(num_tokens, so.num_reqs)
        self._begin_step()  # an injected delay is part of the step (a slow stage), traced as such
        receive = None
        if not self.layout.is_first and num_tokens > 0:

            def receive(into: IntermediateTensors | None = None, in_graph: bool = False) -> IntermediateTensors:
                # Called by the runner once the step's inputs are copied: in stream order the
                # copies then do not wait for the previous stage's tensors.  ``into``: buffers
                # the runner reads anyway (a graph's inputs), saving a copy; ``in_graph``: the
                # graph about to be replayed receives them itself (its wait counts as compute).
                if in_graph:
                    trace.mark()
                    return into[:num_tokens]
                received = self.transport.recv(into if into is not None else self.recv_buffers, num_tokens)
                trace.mark()
                return received

        else:
            trace.mark()
        # Only on a GPU does launching return before the work is done; on CPU a pending output
        # would only be sent later for nothing.
        run = self.runner.execute_model_async if not wait and self.device.type == "cuda" else self.runner.execute_model
        result = run(so, receive=receive)
        trace.mark()
        trace.note(self.runner.host_times)
        if not self.layout.is_last:
            to_send = result.to_send
            if to_send is None and not result.sent_in_graph and num_tokens > 0:
                raise RuntimeError(
                    f"stage {self.layout.pp_rank}: step {so.step_id} computed {num_tokens} tokens but the "
                    "runner returned nothing to send (the next stage would wait for them)"
                )
            if to_send is not None:
                if self.spec.faults and self.spec.faults.get("rename_sent_keys"):
                    to_send = IntermediateTensors({f"{k}_renamed": v for k, v in to_send.items()})
                self.transport.send(to_send)
        trace.end()
        return self._with_first_use(result.output)

    def _with_first_use(self, out: ModelRunnerOutput | PendingOutput | None) -> ModelRunnerOutput | PendingOutput | None:
        """The last stage's output carrying the keys this stage met since the previous step (a
        pending output hands them to the output it builds); another stage's keys were logged by
        its record and go no further."""
        if not self.first_use.has_new:
            return out
        keys = self.first_use.drain()
        if isinstance(out, PendingOutput) and out.ready:
            out.result().first_use = keys
        elif out is not None:
            out.first_use = keys
        return out

    def mark_ready(self) -> None:
        """The engine's warm-up is over: first uses from now on are counted and logged."""
        self.first_use.mark_ready()

    def first_use_snapshot(self) -> dict[str, object]:
        """This stage's first-use counts (``FirstUse.snapshot``)."""
        return self.first_use.snapshot()

    def runner_facts(self) -> dict[str, object]:
        """What this stage's runner does (diagnostics and tests): its name, its CUDA-graph mode
        and whether its decode graphs carry the pipeline hops; for an encoder-decoder model also
        how many requests' encoder outputs it encoded or received, sent on, and received."""
        facts: dict[str, object] = {
            "runner": self.runner.name,
            "cudagraph_mode": self.runner.cudagraph_mode,
            "hop_in_graph": self.runner.hop_in_graph,
        }
        ed = self.encoder_decoder
        if ed is not None:
            facts.update(num_encoded=ed.num_encoded, encoder_outputs_sent=ed.num_sent,
                         encoder_outputs_received=ed.num_received)
        return facts

    def launches_quickly(self, so: SchedulerOutput) -> bool:
        """True when launching ``so`` takes little host time: a V2 step replayed as one full
        CUDA graph (eager and piecewise steps launch kernel by kernel)."""
        # Also with async pipeline steps, although the previous step's ids then go to the first
        # stage with its answer, after this launch: the first stage reads them only a whole
        # round of batches later (``Scheduler.schedule``), and a full-graph launch blocks on
        # nothing from the first stage (the hop is a device-side receive), so it cannot wait on
        # them.
        return self.runner.launches_quickly(so)

    def execute_model_async(self, so: SchedulerOutput) -> ModelRunnerOutput | PendingOutput | None:
        """The only stage's step, returning before the device finishes when the runner can
        (V2: a ``PendingOutput``); used by the in-process executor for async scheduling."""
        if self.layout.pp_size != 1:
            raise ValueError("execute_model_async serves a single-stage pipeline only")
        self._begin_step()
        self.trace.begin(so.total_num_scheduled_tokens, so.num_reqs)
        self.trace.mark()
        result = self.runner.execute_model_async(so, None)
        self.trace.mark()
        self.trace.note(self.runner.host_times)
        self.trace.end()
        return self._with_first_use(result.output)

    def _begin_step(self) -> None:
        """Count the step; in tests, apply the injected delay or failure."""
        self.step_count += 1
        fi = self.spec.faults
        if not fi:
            return
        if fi.get("delay_s"):
            import time

            time.sleep(fi["delay_s"])
        if fi.get("raise_at_step") == self.step_count:
            raise RuntimeError(f"injected failure in {self.layout.name} at step {self.step_count}")
        for name, sig in (("kill_at_step", "SIGKILL"), ("stop_at_step", "SIGSTOP")):
            if fi.get(name) == self.step_count:
                import signal

                os.kill(os.getpid(), getattr(signal, sig))

    def memory_stats(self) -> dict[str, int]:
        """This stage process's memory: peak and current resident set, weight and KV-cache bytes.

        Read between steps (``executor.call_all("memory_stats")``); the RSS figures are the
        whole process's (interpreter, torch, gloo buffers included), from /proc/self/status
        where it exists, else ``getrusage`` (peak only).
        """
        import resource

        stats = {
            "pid": os.getpid(),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "rss_bytes": -1,
        }
        try:
            with open("/proc/self/status", encoding="ascii") as f:
                for line in f:
                    key, _, value = line.partition(":")
                    if key in ("VmHWM", "VmRSS"):
                        name = "peak_rss_bytes" if key == "VmHWM" else "rss_bytes"
                        stats[name] = int(value.split()[0]) * 1024
        except OSError:
            pass  # not Linux: keep getrusage's peak
        params = list(self.model.parameters()) if self.model is not None else []
        buffers = list(self.model.buffers()) if self.model is not None else []
        stats["param_bytes"] = sum(p.numel() * p.element_size() for p in params)
        stats["kv_cache_bytes"] = self.kv_cache_bytes
        stats["buffer_bytes"] = sum(b.numel() * b.element_size() for b in buffers)
        return stats

    def shutdown(self) -> None:
        """Write the step trace (``PPRUN_STEP_TRACE``) and release the pipeline channel."""
        self.trace.dump()
        self.trace = NullStageTrace()
        if self.runner is not None:
            self.runner.close()  # before the groups go away under an outstanding send or receive
        if self.transport is not None and self.spec.init_method is not None:
            self.transport.close()
        elif self._owns_world:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            if self._world_store is not None:
                self._world_store.close()
                self._world_store = None
