"""CUDA graphs for the V2 runner: whole-forward (``full``) and between-attention (``piecewise``).

``full``: one graph per capture size over the whole stage forward, for decode-only batches
(``num_tokens == num_reqs``) padded up to the next captured size.  Attention is inside the graph,
so every per-request buffer it reads is written for the padded count (padding inert).

``piecewise``: the forward is cut at every attention call.  Each attention layer's ``backend`` is
wrapped by :class:`PiecewiseBackend`; while a piecewise graph is being captured the wrapper ends
the current graph segment, hands back a fixed output buffer, and starts the next segment.  At
replay the runner replays segment 0, runs attention ``0`` eagerly (it depends on per-request
lengths, so any batch — prefill included — works) into that buffer, replays segment 1, and so
on.  The sizes are then token counts: any batch of at most the largest size is padded up.

All graphs share one memory pool; each size is warmed up eagerly first (Triton kernels compile
on their first call, which cannot happen under capture), once more with programmatic dependent
launch forced on (the captured launches' compiled variant, see ``pprun.kernels.triton_utils``).
Piecewise graphs keep rotary, cache write and attention as separate kernels (the attention
between segments runs eagerly over already-rotated q and k).  Capture reads only the runner's
persistent buffers, made inert beforehand (slot -1, sequence length 0), so it writes no KV cache
and touches no request state.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pprun.attention.metadata import AttentionMetadata
from pprun.utils.first_use import FirstUse

logger = logging.getLogger(__name__)

CUDAGRAPH_MODES = ("none", "piecewise", "full")
NUM_WARMUPS = 2
"""Eager runs per size before capture (compiles Triton kernels, sets up cuBLAS workspaces)."""


@dataclass
class AttentionCall:
    """One attention call cut out of a piecewise graph: its captured inputs and fixed output."""

    backend: Callable[..., torch.Tensor]
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv_cache: torch.Tensor
    scale: float
    out: torch.Tensor
    """Written by the eager attention at replay, read by the next graph segment."""


class _PiecewiseCapture:
    """The state of one piecewise capture: finished segments and the attention calls between them."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.segments: list[torch.cuda.CUDAGraph] = []
        self.calls: list[AttentionCall] = []
        self.graph: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.graph.capture_begin(pool=self.pool)

    def end(self) -> None:
        self.graph.capture_end()
        self.segments.append(self.graph)
        self.graph = None

    def split(
        self,
        backend: Callable[..., torch.Tensor],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        self.end()
        # Allocated between segments, i.e. outside every graph: a plain fixed buffer.  q/k/v stay
        # referenced by the recorded call, so the shared pool never hands their memory to a
        # later segment.
        out = torch.empty_like(q)
        self.calls.append(AttentionCall(backend, q, k, v, kv_cache, scale, out))
        self.begin()
        return out


class PiecewiseBackend:
    """An attention layer's backend, wrapped: a pass-through, except while a piecewise graph is
    captured, when the call becomes a cut between two graph segments."""

    rope_decode = None
    """None whatever the inner backend has: the cut is the backend call, so a piecewise layer
    never takes the one-kernel decode (whose launch would bypass it)."""

    def __init__(self, inner: Callable[..., torch.Tensor], manager: CudaGraphManager) -> None:
        self.inner = inner
        self.manager = manager

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        capture = self.manager.piecewise_capture
        if capture is None:
            return self.inner(q, k, v, kv_cache, meta, scale)
        return capture.split(self.inner, q, k, v, kv_cache, scale)


@dataclass
class _FullGraph:
    graph: torch.cuda.CUDAGraph
    output: Any


@dataclass
class _PiecewiseGraph:
    segments: list[torch.cuda.CUDAGraph]
    calls: list[AttentionCall]
    output: Any


@dataclass
class GraphPlan:
    """How one step runs: ``mode`` ``eager``, ``full`` or ``piecewise``, and its padded counts."""

    mode: str
    num_reqs_padded: int
    num_tokens_padded: int


class CudaGraphManager:
    """Captures and replays one stage's graphs for the configured sizes."""

    def __init__(
        self,
        mode: str,
        capture_sizes: list[int],
        device: torch.device,
        attention_layers: list[nn.Module],
        full_graph_unsupported_reason: str | None,
        first_use: FirstUse | None = None,
    ) -> None:
        """``first_use``: where each capture is recorded (``cuda graph: <mode> <size>``)."""
        self.first_use = first_use
        if mode not in CUDAGRAPH_MODES:
            raise ValueError(
                f"compilation.cudagraph_mode={mode!r} is not allowed; choose one of {CUDAGRAPH_MODES}"
            )
        self.sizes = sorted(set(capture_sizes))
        self.device = device
        self.mode = mode
        if device.type != "cuda" or not self.sizes:
            self.mode = "none"
        elif mode == "full" and full_graph_unsupported_reason is not None:
            logger.warning(
                "cudagraph_mode=full: running piecewise graphs instead, because %s",
                full_graph_unsupported_reason,
            )
            self.mode = "piecewise"
        if self.mode == "piecewise" and not attention_layers:
            logger.warning(
                "cudagraph_mode=piecewise: the model exposes no attention layers to cut at; running eagerly"
            )
            self.mode = "none"
        self.pool = torch.cuda.graph_pool_handle() if self.mode != "none" else None
        self.full: dict[int, _FullGraph] = {}
        self.piecewise: dict[int, _PiecewiseGraph] = {}
        self.piecewise_capture: _PiecewiseCapture | None = None
        if self.mode == "piecewise":
            for layer in attention_layers:
                if not isinstance(layer.backend, PiecewiseBackend):
                    layer.backend = PiecewiseBackend(layer.backend, self)

    @property
    def max_size(self) -> int:
        """Largest captured size (0 when graphs are off)."""
        return self.sizes[-1] if self.sizes and self.mode != "none" else 0

    def _padded(self, n: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    def plan(self, num_reqs: int, num_tokens: int, max_query_len: int) -> GraphPlan:
        """Pick graph or eager for a step and its padded counts (eager: padded == real)."""
        if (
            self.mode == "full"
            and max_query_len == 1
            and num_tokens == num_reqs
            and num_reqs <= self.max_size
        ):
            size = self._padded(num_reqs)
            if size in self.full:
                return GraphPlan("full", size, size)
        if self.mode == "piecewise" and num_tokens <= self.max_size:
            size = self._padded(num_tokens)
            if size in self.piecewise:
                # Attention runs eagerly over the real requests; only tokens are padded.
                return GraphPlan("piecewise", num_reqs, size)
        return GraphPlan("eager", num_reqs, num_tokens)

    # --- capture -----------------------------------------------------------------------------

    def capture(self, prepare: Callable[[int, int], None], forward: Callable[[int, int], Any]) -> None:
        """Warm up and capture every size, largest first (smaller graphs then reuse the pool).

        ``prepare(num_reqs_padded, num_tokens_padded)`` makes the runner's buffers inert for that
        size (host work and copies: it runs outside capture); ``forward(num_reqs_padded,
        num_tokens_padded)`` runs the stage forward over them and returns the model's output.
        Only ``forward`` is captured, so a replay reads whatever the buffers hold at that time.
        """
        if self.mode == "none":
            return
        from pprun.kernels.triton_utils import force_pdl

        for size in reversed(self.sizes):
            prepare(size, size)
            for _ in range(NUM_WARMUPS):
                forward(size, size)
            # Captured Triton kernels launch with PDL, a separate compiled variant: compile and
            # load it here, where nothing is being captured.
            with force_pdl():
                forward(size, size)
            torch.cuda.synchronize(self.device)
            if self.first_use is not None:
                self.first_use.record(f"cuda graph: {self.mode} {size}")
            if self.mode == "full":
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    output = forward(size, size)
                self.full[size] = _FullGraph(graph, output)
            else:
                self.piecewise[size] = self._capture_piecewise(forward, size)
        torch.cuda.synchronize(self.device)
        logger.info("captured %s CUDA graphs for sizes %s", self.mode, self.sizes)

    def _capture_piecewise(self, forward: Callable[[int, int], Any], size: int) -> _PiecewiseGraph:
        capture = _PiecewiseCapture(self.pool)
        torch.cuda.synchronize(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        self.piecewise_capture = capture
        try:
            with torch.cuda.stream(stream):
                capture.begin()
                output = forward(size, size)
                capture.end()
        finally:
            self.piecewise_capture = None
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return _PiecewiseGraph(capture.segments, capture.calls, output)

    # --- replay ------------------------------------------------------------------------------

    def replay(self, plan: GraphPlan, meta: AttentionMetadata) -> Any:
        """Replay the graph for ``plan`` over the (already written) persistent buffers; returns
        the captured output (padded rows included)."""
        if plan.mode == "full":
            entry = self.full[plan.num_tokens_padded]
            entry.graph.replay()
            return entry.output
        if plan.mode != "piecewise":
            raise ValueError(f"replay needs a graph plan, got mode {plan.mode!r}")
        pw = self.piecewise[plan.num_tokens_padded]
        for i, segment in enumerate(pw.segments):
            segment.replay()
            if i < len(pw.calls):
                c = pw.calls[i]
                c.out.copy_(c.backend(c.q, c.k, c.v, c.kv_cache, meta, c.scale))
        return pw.output
