"""The V2 model runner: persistent buffers, per-request state tables, CUDA graphs, async sampling.

Compared with V1 (``pprun.worker.v1.runner``):

- per-request state lives in fixed-size tables (:class:`RequestTable`), updated with the
  scheduler's deltas only;
- every input buffer is allocated once at its maximum size (:class:`InputBuffers`) and filled by
  tensor indexing (:func:`prepare_step`), so eager steps and graph replays read the same addresses;
- decode steps replay CUDA graphs (``full`` or ``piecewise``, see ``cuda_graphs``), padded up to a
  captured size with inert padding rows;
- sampled token ids reach the host through a pinned buffer and an event;
- whatever one model family needs (multimodal embeddings, encoder lengths) lives in its
  :class:`ModelState` plug-in, not here; the plug-in follows from the model's declarations
  through one registry (``pprun.worker.v2.plugins``).

It samples on the last stage only, so it does not serve SPMD torchrun ranks at pp > 1
(``unsupported_v2_features``).
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from pprun.config.validate import ResolvedConfig
from pprun.core.outputs import ModelRunnerOutput, SchedulerOutput
from pprun.distributed.feedback import SampleFeedback
from pprun.distributed.intermediate import IntermediateTensors
from pprun.distributed.layout import StageLayout
from pprun.distributed.pipeline import agree_on_graph_hops, open_sample_feedback
from pprun.distributed.transport import PipelineTransport
from pprun.layers import fused_ops_for
from pprun.models.base import PprunModel
from pprun.sampling.sampler import Sampler, SamplerOutput, SamplingTensors, mask_token_ids, to_logprobs
from pprun.switches import enabled_unless
from pprun.utils.first_use import FirstUse
from pprun.utils.step_trace import HostClock, trace_prefix
from pprun.worker.encoder_decoder import EncoderDecoderState
from pprun.worker.model_inputs import build_model_inputs
from pprun.worker.runner_base import ModelRunner, PendingOutput, StepResult
from pprun.worker.v2.cuda_graphs import CudaGraphManager, GraphPlan
from pprun.worker.v2.inputs import InputBuffers, StepBatch, prepare_step
from pprun.worker.v2.model_state import ModelState
from pprun.worker.v2.plugins import make_model_state
from pprun.worker.v2.request_state import RequestTable

logger = logging.getLogger(__name__)

GRAPH_LOGITS_ENABLED: bool = enabled_unless("PPRUN_DISABLE_GRAPH_LOGITS")
"""Whether the last stage's full decode graphs end with the LM head and a greedy argmax (an
all-greedy decode step then launches nothing but the graph and the ids' copy to the host).
``PPRUN_DISABLE_GRAPH_LOGITS=1`` computes the logits after the replay (the A/B switch)."""




def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A non-blocking copy of device tensor ``t`` into new pinned host memory (valid once the
    stream reaches the copy)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class _Suppression(enum.Enum):
    """How a step's sampling rows are kept from their suppressed ids (besides per-request id
    lists, when some request samples its first output and has ``begin_suppress_token_ids``)."""

    NONE = "none"
    """No sampling request suppresses anything."""
    TABLE_MASK = "table mask"
    """Only ``suppress_token_ids``: the request table's per-row device mask
    (:meth:`RequestTable.suppress_mask`), gathered by the step's sampling rows."""


class _AnySample(Mapping[str, int]):
    """Every request has a pending sample at row 0: what a stage after the first passes for the
    pending tokens of async pipeline steps (it reads no input ids, so their values never matter)."""

    def __getitem__(self, req_id: str) -> int:
        return 0

    def __contains__(self, req_id: object) -> bool:
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


ANY_SAMPLE = _AnySample()


class _SampleIndex(Mapping[str, int]):
    """Request id -> its row among a step's samples, built on first use: only async scheduling
    reads it (the next step's pending input tokens), and building it every step cost a dict of
    the whole batch."""

    def __init__(self, req_ids: list[str], sample_batch_idx: list[int]) -> None:
        self._req_ids = req_ids
        self._sample_batch_idx = sample_batch_idx
        self._index: dict[str, int] | None = None

    def _built(self) -> dict[str, int]:
        if self._index is None:
            self._index = {self._req_ids[i]: j for j, i in enumerate(self._sample_batch_idx)}
        return self._index

    def __getitem__(self, req_id: str) -> int:
        return self._built()[req_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._built())

    def __len__(self) -> int:
        return len(self._sample_batch_idx)


class V2ModelRunner(ModelRunner):
    """Runner for one pipeline stage (built by the worker once the KV cache is bound)."""

    name = "v2"

    def __init__(
        self,
        model: PprunModel,
        layout: StageLayout,
        device: torch.device,
        resolved: ResolvedConfig,
        num_blocks: int,
        transport: PipelineTransport | None = None,
        sample_feedback_slots: int = 0,
        feedback_spin_s: float = 0.0,
        encoder_decoder: EncoderDecoderState | None = None,
        first_use: FirstUse | None = None,
    ) -> None:
        """``transport``: the stage's channel when the pipeline has more than one stage (its
        decode graphs may then carry the hop, see ``pprun.distributed.pipeline``);
        ``sample_feedback_slots``: async pipeline steps, the last stage sending its sampled ids to
        the first into a ring of that many steps (``pprun.distributed.feedback``; the first and
        last stage must agree); 0: off; ``feedback_spin_s``: how long the first stage polls for
        those ids before a blocking read (``SampleFeedback``'s ``spin_s``); ``encoder_decoder``:
        an encoder-decoder stage's ``pprun.worker.encoder_decoder.EncoderDecoderState``, handed to
        the model's plug-in; ``first_use``: where the stage records what it captures and which
        sampler and suppression branches it runs for the first time (``pprun.utils.first_use``)."""
        cfg = resolved.cfg
        self.first_use = first_use
        self.model = model
        self.layout = layout
        self.transport = transport
        self.hop_in_graph = False
        """True when this stage's full graphs send to / receive from its neighbours themselves."""
        self.device = device
        self.dtype = resolved.dtype
        self.num_blocks = num_blocks
        self.block_size = cfg.cache.block_size
        self.max_num_reqs = cfg.scheduler.max_num_seqs
        self.max_model_len = resolved.max_model_len
        self.max_num_blocks_per_req = math.ceil(self.max_model_len / self.block_size)
        capture_sizes = [s for s in resolved.cudagraph_capture_sizes if s <= self.max_num_reqs]
        # A full decode graph of N requests holds N tokens, which may exceed the token budget
        # (piecewise sizes never do: validation keeps those within it).
        self.max_num_tokens = max([resolved.max_num_batched_tokens, *capture_sizes])

        self.table = RequestTable(
            self.max_num_reqs,
            self.max_model_len,
            self.max_num_blocks_per_req,
            device,
            make_generators=layout.is_last,
        )
        self.bufs = InputBuffers(
            self.max_num_tokens, self.max_num_reqs, self.max_num_blocks_per_req, self.block_size, device
        )
        self.model_state: ModelState = make_model_state(
            model, layout, device, self.dtype, self.max_num_reqs, self.max_num_tokens, encoder_decoder
        )
        self.sampler = Sampler(first_use)
        self.sampled_ring = torch.zeros((3, self.max_num_reqs), dtype=torch.int64, pin_memory=device.type == "cuda")
        """Pinned landing rows of the sampled ids, one per step in turn (a ring: with async
        scheduling, or a pipeline's last stage launching ahead, two steps' ids are outstanding at
        once; a third would need a longer ring).  A full decode graph's argmax writes its row
        itself (see :meth:`_logits_in_graph`); other steps copy into it."""
        self._host_slot = 0
        """The current step's row of :attr:`sampled_ring` (also in ``bufs.host_slot`` on the device)."""
        self._graph_ids_to_host = False
        """Whether the full decode graphs write the greedy ids to the ring themselves."""
        self._host_events = [torch.cuda.Event() for _ in self.sampled_ring] if device.type == "cuda" else []
        self.prev_sampled: torch.Tensor | None = None
        """The last step's sampled ids, on the device (async scheduling reads them)."""
        self.prev_sample_index: Mapping[str, int] = {}
        """Request id -> its row in :attr:`prev_sampled`."""
        self.feedback: SampleFeedback | None = open_sample_feedback(
            transport, layout, self.max_num_reqs, sample_feedback_slots, feedback_spin_s
        )
        """First and last stage of an async pipeline: the sampled ids' channel between them."""
        self._ids_from_last = self.feedback if layout.is_first else None
        """The first stage's end of :attr:`feedback` (input ids of pending tokens come from it)."""
        self.host_times: dict[str, float] | None = {} if trace_prefix() else None
        """With ``PPRUN_STEP_TRACE``: the last step's host time by phase, in us (the worker puts
        them in the step trace).  Two are waits: ``wait_reads_us`` for the previous step's reads of
        the pinned input buffers, and on an async pipeline's first stage ``wait_ids_us`` for the
        last stage's sampled ids.  The others are work (:data:`HOST_PHASES`).  None when tracing is
        off: nothing is timed."""
        self._plan_of: tuple[SchedulerOutput, GraphPlan] | None = None
        """The newest :meth:`plan` and its step (held, so compared by identity): the last stage's
        worker asks for it before launching the step, the step itself again."""
        # Graph replays read received hidden states from fixed addresses (contract 2).
        self.graph_intermediate: IntermediateTensors | None = None
        if not layout.is_first:
            self.graph_intermediate = model.make_empty_intermediate_tensors(
                self.max_num_tokens, self.dtype, device
            )
        self.graph_logits: torch.Tensor | None = None
        """Last stage with full graphs: ``[largest graph, vocab]`` logits written by every decode
        graph (the LM head runs inside it), one buffer shared by all sizes."""
        self.graph_greedy: torch.Tensor | None = None
        """Beside it, each row's argmax: an all-greedy decode step samples nothing outside the graph."""
        self.graphs = CudaGraphManager(
            cfg.compilation.cudagraph_mode if device.type == "cuda" else "none",
            capture_sizes,
            device,
            self.model_state.attention_layers(),
            self.model_state.full_graph_unsupported_reason(),
            first_use,
            resolved.piecewise_capture_sizes,
        )
        self.capture_model()

    # --- state -------------------------------------------------------------------------------

    def update_states(self, so: SchedulerOutput) -> None:
        """Apply the step's deltas to the request table and the model-state plug-in."""
        feedback = self._ids_from_last
        for req_id in so.finished_req_ids:
            row = self.table.remove(req_id)
            if row is not None:
                self.model_state.remove_request(row)
            if feedback is not None:
                feedback.forget(req_id)
        for new in so.scheduled_new_reqs:
            row = self.table.add(
                new.req_id, new.prompt_token_ids, new.block_ids, new.num_computed_tokens, new.sampling_params,
                new.num_prompt_tokens,
            )
            self.model_state.add_request(row, new)
        self.table.update_cached(so.scheduled_cached_reqs, so.step_id)
        self.model_state.begin_step(so)

    # --- graphs ------------------------------------------------------------------------------

    @torch.inference_mode()
    def capture_model(self) -> None:
        """Warm up and capture the configured graphs (no-op on CPU or with cudagraph_mode=none)."""
        self._capture_extra: tuple[torch.Tensor | None, dict[str, Any]] = (None, {})
        self.hop_in_graph = agree_on_graph_hops(
            self.transport, self.layout, self.device, self.graphs.mode, self.graphs.full_sizes,
            lambda: self.model.make_empty_intermediate_tensors(1, self.dtype, self.device),
            self.graph_intermediate,
        )
        if self.feedback is not None:
            self.feedback.warm_up()
        self.graphs.capture(self._prepare_dummy, self._dummy_forward)

    def _prepare_dummy(self, num_reqs_padded: int, num_tokens_padded: int) -> None:
        """Make every row of the buffers inert for one capture size: nothing is read from or
        written to the KV cache, and no request row is touched.  Runs outside capture (host
        writes, copies and event waits are not capturable, and must not replay).  A piecewise
        size past the request rows is prepared with all of them (its replays pad tokens only)."""
        num_reqs_padded = min(num_reqs_padded, self.max_num_reqs)
        # What the model-state plug-in prepares its capture inputs for (Whisper's cross-attention
        # reads one query per row in a full decode graph only).
        self.model_state.capture_kind = self.graphs.capturing or "none"
        self.bufs.wait_for_previous_reads()
        self.bufs.make_inert(0, 0, num_reqs_padded, num_tokens_padded)
        self.bufs.to_device(num_reqs_padded, num_tokens_padded, 0)
        self.bufs.wait_for_previous_reads()
        if self.graph_intermediate is not None:
            for t in self.graph_intermediate.values():
                t[:num_tokens_padded].zero_()
        self._capture_extra = self.model_state.capture_inputs(num_reqs_padded, num_tokens_padded)

    def _dummy_forward(self, num_reqs_padded: int, num_tokens_padded: int) -> Any:
        """The stage forward over the buffers :meth:`_prepare_dummy` made inert (captured)."""
        num_reqs_padded = min(num_reqs_padded, self.max_num_reqs)
        full = self.graphs.capturing == "full"
        meta = self.bufs.attn_metadata(0, num_reqs_padded, 0, num_tokens_padded, max_query_len=1)
        inputs_embeds, extra = self._capture_extra
        # Warm-ups run eagerly without the hop; the capture records it (``agree_on_graph_hops``).
        hop = self.hop_in_graph and full and torch.cuda.is_current_stream_capturing()
        received = self._graph_intermediate(num_tokens_padded)
        if hop and received is not None:
            self.transport.recv_in_graph(received)
        out = self._forward(meta, num_tokens_padded, received, inputs_embeds, extra)
        if hop and not self.layout.is_last:
            self.transport.send_in_graph(out)
        if self.layout.is_last and full and GRAPH_LOGITS_ENABLED:
            self._logits_in_graph(out, num_tokens_padded)
        return out

    def _logits_in_graph(self, hidden: torch.Tensor, num_tokens_padded: int) -> None:
        """The LM head and greedy argmax of a full decode graph, into buffers shared by every
        size (allocated by the first, eager, warm-up of the largest size).

        The model's own ``compute_logits`` runs (whatever it does beyond the head stays its
        business), then one copy into the shared buffer: the logits cost twice
        ``[largest size, vocab]`` of device memory, the buffer and a temporary in the graphs'
        pool (reused by every graph), and each replay copies its rows once.
        """
        logits = self.model.compute_logits(hidden)
        if self.model_state.masks_suppressed_in_graph:
            # Row i is masked by the i-th sampling request's table row: token i's request when
            # every token of the step samples, the only case in which :meth:`sample` takes these
            # logits (a 1-token prefill chunk short of its prompt's end samples nothing, and
            # shifts the rows after it).  Rows of requests that suppress nothing are all False;
            # padding rows read whatever rows their stale sample_rows name (discarded).
            mask = self.table.suppress_mask(logits.shape[-1], logits.device)
            logits = logits.masked_fill(mask[self.bufs.sample_rows.device[:num_tokens_padded]], float("-inf"))
        if self.graph_logits is None:
            self.graph_logits = torch.empty(
                (self.graphs.max_size, logits.shape[-1]), dtype=logits.dtype, device=self.device
            )
            self.graph_greedy = torch.empty(self.graphs.max_size, dtype=torch.int64, device=self.device)
        if fused_ops_for(logits) is not None and logits.stride(-1) == 1:
            # One Triton launch copies the logits, takes the argmax and stores the ids in the
            # pinned ring row the step names (``bufs.host_slot``): an all-greedy decode step then
            # launches no device-to-host copy after its graph, so with the staging kernel
            # nothing of it runs on a copy engine (a launch and a copy-engine round trip less).
            from pprun.sampling.greedy_kernel import copy_and_argmax

            copy_and_argmax(
                logits, self.graph_logits[:num_tokens_padded], self.graph_greedy[:num_tokens_padded],
                host_out=self.sampled_ring, host_slot=self.bufs.host_slot.device,
            )
            self._graph_ids_to_host = True
        else:
            self._graph_ids_to_host = False
            self.graph_logits[:num_tokens_padded].copy_(logits)
            torch.argmax(logits, dim=-1, out=self.graph_greedy[:num_tokens_padded])

    def _graph_intermediate(self, num_tokens_padded: int) -> IntermediateTensors | None:
        if self.graph_intermediate is None:
            return None
        return self.graph_intermediate[:num_tokens_padded]  # type: ignore[return-value]

    def _forward(
        self,
        meta: Any,
        num_tokens_padded: int,
        intermediate_tensors: IntermediateTensors | None,
        inputs_embeds: torch.Tensor | None,
        extra: dict[str, Any],
    ) -> Any:
        inputs = build_model_inputs(
            self.model,
            is_first_stage=self.layout.is_first,
            input_ids=self.bufs.input_ids.device[:num_tokens_padded],
            positions=self.bufs.positions.device[:num_tokens_padded],
            intermediate_tensors=intermediate_tensors,
            attn_metadata=meta,
            inputs_embeds=inputs_embeds,
        )
        inputs.update(extra)
        return self.model(**inputs)

    # --- one step ----------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(
        self,
        so: SchedulerOutput,
        intermediate_tensors: IntermediateTensors | None = None,
        receive: Callable[[IntermediateTensors | None, bool], IntermediateTensors] | None = None,
    ) -> StepResult:
        """Run one step and wait for its result (see :meth:`execute_model_async`)."""
        return self.execute_model_async(so, intermediate_tensors, receive).finished()

    @torch.inference_mode()
    def execute_model_async(
        self,
        so: SchedulerOutput,
        intermediate_tensors: IntermediateTensors | None = None,
        receive: Callable[[IntermediateTensors | None, bool], IntermediateTensors] | None = None,
    ) -> StepResult:
        """Run one step; non-last stages return what to send, the last its sampled tokens (a
        :class:`PendingOutput`).

        Host work never waits on the device here except for the previous step's input copies
        (they precede its forward) and, on the last stage, the sampled ids.  ``receive``
        (non-first stages, instead of ``intermediate_tensors``) is called once this step's
        inputs are copied, so that in stream order the copies do not wait for the previous
        stage's tensors; it is handed the buffers to land in (the graph's inputs on a graph
        step, else None: the worker's own) and whether the graph receives by itself.  A non-last
        stage's result says ``sent_in_graph`` when its graph sent the tensors itself.
        """
        # The deltas rewrite pinned staging memory (sampling parameters) that the previous
        # step's non-blocking copies may still be reading.
        clock = HostClock(self.host_times)
        self.bufs.wait_for_previous_reads()
        clock.lap("wait_reads_us")
        self.update_states(so)
        clock.lap("update_us")
        if so.is_empty():
            return StepResult(ModelRunnerOutput(so.step_id, [], [])) if self.layout.samples else StepResult()
        num_tokens = so.total_num_scheduled_tokens
        plan = self.plan(so)
        if self.layout.pp_size == 1:
            pending_from = self.prev_sample_index
        elif not self.layout.is_first:
            pending_from = ANY_SAMPLE  # later stages read no input ids
        elif self._ids_from_last is not None:
            pending_from = self._ids_from_last.index
        else:
            pending_from = {}  # synchronous pipeline steps: every input id is known
        batch = prepare_step(self.table, so, self.bufs, plan.num_reqs_padded, plan.num_tokens_padded, pending_from)
        if self.layout.is_last:
            self.table.flush_sampling_params()
        clock.lap("prepare_us")
        num_pending_on_device = batch.num_pending if self.layout.pp_size == 1 else 0
        if batch.num_pending and self._ids_from_last is not None:
            # Async pipeline steps: the ids the last stage sent (waits for them on the host).
            n = batch.num_pending
            self._ids_from_last.fill(self.bufs.input_ids.np, self.bufs.pending_token_idx.np[:n], self.bufs.pending_sample_idx.np[:n])
            clock.lap("wait_ids_us")
        self._host_slot = (self._host_slot + 1) % len(self.sampled_ring)
        self.bufs.host_slot.np[0] = self._host_slot
        # Async scheduling at pp = 1: the pending inputs are what the previous step sampled, still
        # on the device (stream order makes their read wait for that step, not the host).
        self.bufs.to_device(
            plan.num_reqs_padded, plan.num_tokens_padded, batch.num_sampled, num_pending_on_device,
            self.prev_sampled if num_pending_on_device else None,
        )
        meta = None
        if plan.mode != "full":  # a full graph reads its metadata from the buffers it was captured over
            meta = self.bufs.attn_metadata(
                batch.num_reqs, plan.num_reqs_padded, num_tokens, plan.num_tokens_padded, batch.max_query_len,
                batch.num_leading_decodes,
            )
        clock.lap("to_device_us")
        hop_in_graph = self.hop_in_graph and plan.mode == "full"
        in_graph_buffers = False
        if receive is not None:
            # A graph step's hidden states land straight in the graph's input buffers (or the
            # graph receives them itself).
            in_graph_buffers = plan.mode != "eager"
            into = self.graph_intermediate if in_graph_buffers else None
            intermediate_tensors = receive(into, hop_in_graph)
        if plan.mode == "full" and self.model_state.masks_suppressed_in_graph and self.graph_logits is not None:
            # The graph reads the suppression mask: its rows for requests that joined or left
            # are rewritten first, in stream order before the replay.
            self.table.suppress_mask(self.graph_logits.shape[1], self.graph_logits.device)
        out = self._run_model(plan, batch, meta, intermediate_tensors, in_graph_buffers, hop_in_graph)
        clock.lap("launch_us")
        if self._ids_from_last is not None and batch.num_sampled:
            self._ids_from_last.expect(batch.req_ids, batch.sample_batch_idx, batch.num_sampled)
            clock.lap("expect_us")
        if not self.layout.is_last:
            return StepResult(sent_in_graph=True) if hop_in_graph else StepResult(to_send=out[:num_tokens])
        pending = self.sample(so, batch, out, plan.mode == "full")
        clock.lap("sample_us")
        return StepResult(pending)

    def plan(self, so: SchedulerOutput) -> GraphPlan:
        """How ``so`` runs: a full or piecewise graph (with its padded counts) or eagerly."""
        if self._plan_of is None or self._plan_of[0] is not so:
            num_scheduled = so.num_scheduled_tokens
            plan = self.graphs.plan(so.num_reqs, so.total_num_scheduled_tokens, max(num_scheduled.values(), default=0))
            self._plan_of = (so, plan)
        return self._plan_of[1]

    @property
    def cudagraph_mode(self) -> str:
        """The CUDA-graph mode captured (``none`` on CPU)."""
        return self.graphs.mode

    def launches_quickly(self, so: SchedulerOutput) -> bool:
        """True when ``so`` replays one full CUDA graph (eager and piecewise steps launch kernel
        by kernel)."""
        return bool(so.num_scheduled_tokens) and self.plan(so).mode == "full"

    def close(self) -> None:
        """Close the sampled-ids channel (before the process groups go away under an
        outstanding send or receive)."""
        if self.feedback is not None:
            self.feedback.close()

    def _run_model(
        self,
        plan: GraphPlan,
        batch: StepBatch,
        meta: Any,
        intermediate_tensors: IntermediateTensors | None,
        in_graph_buffers: bool = False,
        hop_in_graph: bool = False,
    ) -> Any:
        """The stage forward, eager or replayed; ``in_graph_buffers``: the intermediate tensors
        were received into the graph's input buffers already; ``hop_in_graph``: the graph
        receives them itself."""
        if not self.layout.is_first and intermediate_tensors is None:
            raise ValueError(
                f"stage {self.layout.pp_rank} is not the first stage and needs intermediate_tensors"
            )
        inputs_embeds = None
        if self.layout.is_first:
            inputs_embeds = self.model_state.prepare_inputs_embeds(
                batch, self.bufs.input_ids.device[: plan.num_tokens_padded]
            )
        extra = self.model_state.extra_model_kwargs(batch)
        if plan.mode == "eager":
            return self._forward(meta, plan.num_tokens_padded, intermediate_tensors, inputs_embeds, extra)
        if self.graph_intermediate is not None:
            if not in_graph_buffers:
                self.graph_intermediate.copy_from(intermediate_tensors, batch.num_tokens)
            if plan.num_tokens_padded > batch.num_tokens and not hop_in_graph:
                # Stale rows from an earlier step would be finite, but zeros keep replays reproducible.
                for t in self.graph_intermediate.values():
                    t[batch.num_tokens : plan.num_tokens_padded].zero_()
        return self.graphs.replay(plan, meta)

    def sampling_tensors(self, batch: StepBatch) -> SamplingTensors:
        """The sampler's tensors for the batch's sampling requests: their parameters gathered on
        the device by the rows copied with the step's inputs (no copy, no sync)."""
        num_sampled = batch.num_sampled
        rows = batch.rows if num_sampled == batch.num_reqs else batch.rows[batch.sample_batch_idx]
        return self.table.sampling_tensors(rows, self.bufs.sample_rows.device[:num_sampled])

    def _suppressed_ids(self, batch: StepBatch) -> list[Any] | _Suppression:
        """What the step's sampling requests may not sample: :class:`_Suppression` (nothing, or
        only their ``suppress_token_ids`` through the table's device mask), or per request the ids
        (some request samples its first output and has begin ids)."""
        table = self.table
        if not table.num_suppressing:
            return _Suppression.NONE
        idx = batch.sample_batch_idx.numpy()
        rows = batch.rows.numpy()[idx]
        seq_lens = batch.num_computed_tokens[idx] + batch.num_scheduled_tokens.numpy()[idx]
        if table.begin_suppression_due(rows, seq_lens):
            ids = table.suppressed_ids(rows, seq_lens)
            return _Suppression.NONE if ids is None else ids
        return _Suppression.TABLE_MASK if table.suppresses_np[rows].any() else _Suppression.NONE

    def sample(
        self, so: SchedulerOutput, batch: StepBatch, hidden: torch.Tensor, full_graph: bool = False
    ) -> PendingOutput | None:
        """Sample for each request whose scheduled tokens reach the end of what it knows.

        With tensor parallelism every tp rank of the last stage computes the logits (the LM
        head's gather is a collective of the group; a full graph computed them already) and only
        tp rank 0 samples and answers (None elsewhere).

        Returns at once: the sampled ids are copied to pinned host memory behind an event, and
        the output is built when :meth:`PendingOutput.result` is called.  After a full decode
        graph (``full_graph``) the logits are already computed, and an all-greedy step without
        logprobs or suppressed ids takes the graph's argmax as it is.  Suppressed ids
        (``SamplingParams.suppress_token_ids``, ``begin_suppress_token_ids``) go to -inf in a copy
        of the logits before the sampler, as in V1, so such a step samples outside the graph: from
        the table's per-row device mask when no request samples its first output (a decode step:
        no host work per request), else through ``mask_token_ids`` with each request's ids.
        """
        num_sampled = batch.num_sampled
        if not num_sampled and not self.layout.samples:
            return None
        if not num_sampled:
            self.prev_sample_index = {}
            empty = ModelRunnerOutput(so.step_id, batch.req_ids, [[] for _ in batch.req_ids], [None] * batch.num_reqs)
            return PendingOutput.of(empty)  # nothing to wait for: the stage answers at once
        tensors = self.sampling_tensors(batch)
        in_graph = full_graph and self.graph_logits is not None  # the graph computed logits and argmax
        if in_graph and self.model_state.masks_suppressed_in_graph and num_sampled != batch.num_tokens:
            # The graph masked its rows by the sampling requests in order, right only when every
            # token samples: the logits are computed again from the graph's hidden states.
            in_graph = False
        sources = (self.graph_logits, self.graph_greedy) if in_graph else (hidden,)
        if num_sampled == batch.num_tokens:
            # Every token samples (a decode step): the rows are 0..n-1, views, no gather.
            picked = [t[:num_sampled] for t in sources]
        else:  # prefill chunks, some of which do not reach their prompt's end: gather
            rows = self.bufs.logits_indices.device[:num_sampled]
            picked = [t[rows] for t in sources]
        if not self.layout.samples:
            if not in_graph:
                self.model.compute_logits(picked[0])
            return None
        suppressed = self._suppressed_ids(batch)
        if suppressed is _Suppression.TABLE_MASK and in_graph and self.model_state.masks_suppressed_in_graph:
            suppressed = _Suppression.NONE  # the graph masked its logits before its argmax
        if suppressed is not _Suppression.NONE and self.first_use is not None:
            self.first_use.record(
                "sampler: suppression, table mask" if suppressed is _Suppression.TABLE_MASK else "sampler: suppression, ids"
            )
        on_host = False  # the graph's argmax wrote the ids to this step's ring row already
        if in_graph and suppressed is _Suppression.NONE and tensors.all_greedy and tensors.max_num_logprobs is None:
            res = SamplerOutput(picked[1])
            on_host = self._graph_ids_to_host and num_sampled == batch.num_tokens
        else:
            logits = picked[0] if in_graph else self.model.compute_logits(picked[0])
            if suppressed is _Suppression.TABLE_MASK:  # a decode step: one gather of the rows' device mask
                logits = self.table.mask_suppressed(logits, self.bufs.sample_rows.device[:num_sampled])
            elif suppressed is not _Suppression.NONE:
                logits = mask_token_ids(logits, suppressed)
            res = self.sampler(logits, tensors)
        self.prev_sampled = res.sampled_token_ids
        sample_idx_list = batch.sample_batch_idx.tolist()
        self.prev_sample_index = _SampleIndex(batch.req_ids, sample_idx_list)
        # Read the table now: by the time the output is built, a finished request's row may
        # already belong to a request admitted in a later step.
        num_logprobs = None
        if tensors.max_num_logprobs is not None:
            num_logprobs = self.table.num_logprobs_list(batch.rows[batch.sample_batch_idx])
            if self.device.type == "cuda":
                # Non-blocking copies behind the same event as the ids: a blocking read later
                # would queue behind any step launched after this one.
                res = SamplerOutput(
                    res.sampled_token_ids,
                    *(_pinned_copy(t) for t in (res.sampled_logprobs, res.topk_ids, res.topk_logprobs)),
                )
        host_ids, done = self._copy_to_host(res.sampled_token_ids, on_host)
        feedback = self.feedback

        def build() -> ModelRunnerOutput:
            if done is not None:
                done.synchronize()
            if feedback is not None:  # async pipeline steps: the first stage waits for these
                feedback.send(host_ids)
            token_ids = host_ids.tolist()
            logprobs: list[Any] = [None] * batch.num_reqs
            if num_sampled == batch.num_reqs:
                # Every request samples (decode): batch order is sampling order.
                sampled = [[tok] for tok in token_ids]
            else:
                sampled = [[] for _ in batch.req_ids]
                for i, tok in zip(sample_idx_list, token_ids):
                    sampled[i] = [tok]
            # Logprobs cost extra device-to-host copies: only when some request asked.
            if num_logprobs is not None:
                for i, lp in zip(sample_idx_list, to_logprobs(res, num_logprobs)):
                    logprobs[i] = lp
            return ModelRunnerOutput(
                step_id=so.step_id, req_ids=batch.req_ids, sampled_token_ids=sampled, logprobs=logprobs
            )

        return PendingOutput(build, done)

    def _copy_to_host(
        self, token_ids: torch.Tensor, on_host: bool = False
    ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start the sampled ids' copy to this step's pinned ring row (none when ``on_host``: the
        graph wrote them there); returns the host view and the event to wait on.  The rows
        rotate step by step, so two steps in flight never share one."""
        if self.device.type != "cuda":
            return token_ids, None
        n = token_ids.shape[0]
        host = self.sampled_ring[self._host_slot, :n]
        if not on_host:
            host.copy_(token_ids, non_blocking=True)
        done = self._host_events[self._host_slot]  # rotates with its row: no allocation per step
        done.record(self.bufs.stream)
        return host, done
