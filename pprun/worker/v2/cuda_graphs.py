"""CUDA graphs for the V2 runner: whole-forward (``full``) and between-attention (``piecewise``).

``full``: one graph per capture size over the whole stage forward, for decode-only batches
(``num_tokens == num_reqs``) padded up to the next captured size.  Attention is inside the graph,
so every per-request buffer it reads is written for the padded count (padding inert).

``full_and_piecewise`` (the default, vLLM's name): full graphs for decode-only steps and piecewise
graphs (below) for every other step of at most the largest piecewise size: a prompt's prefill of
up to 512 tokens is one replay of a few dozen segments instead of hundreds of launches, so its
time no longer depends on how fast the host launches kernels.

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

CUDAGRAPH_MODES = ("none", "piecewise", "full", "full_and_piecewise")
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

    def __init__(self, inner: Callable[..., torch.Tensor], manager: CudaGraphManager) -> None:
        self.inner = inner
        self.manager = manager

    @property
    def rope_decode(self) -> Any:
        """None while a piecewise graph is captured (the cut is the backend call, so the layer must
        not take the one-kernel decode, whose launch would bypass it); the inner backend's
        otherwise (eager steps and full decode graphs keep the one-kernel decode)."""
        if self.manager.piecewise_capture is not None:
            return None
        return getattr(self.inner, "rope_decode", None)

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
        piecewise_sizes: list[int] | None = None,
    ) -> None:
        """``capture_sizes``: the full decode graphs' request counts; ``piecewise_sizes``: the
        piecewise graphs' token counts (None: ``capture_sizes``); ``first_use``: where each capture
        is recorded (``cuda graph: <kind> <size>``)."""
        self.first_use = first_use
        if mode not in CUDAGRAPH_MODES:
            raise ValueError(
                f"compilation.cudagraph_mode={mode!r} is not allowed; choose one of {CUDAGRAPH_MODES}"
            )
        full_sizes = sorted(set(capture_sizes))
        pw_sizes = sorted(set(capture_sizes if piecewise_sizes is None else piecewise_sizes))
        self.device = device
        self.mode = mode
        if device.type != "cuda" or not (full_sizes or pw_sizes):
            self.mode = "none"
        elif self.mode in ("full", "full_and_piecewise") and full_graph_unsupported_reason is not None:
            logger.warning(
                "cudagraph_mode=%s: running piecewise graphs instead, because %s",
                self.mode, full_graph_unsupported_reason,
            )
            if self.mode == "full":
                pw_sizes = full_sizes
            self.mode = "piecewise"
        if self.mode in ("piecewise", "full_and_piecewise") and not (attention_layers and pw_sizes):
            fallback = "full" if self.mode == "full_and_piecewise" and full_sizes else "none"
            logger.warning(
                "cudagraph_mode=%s: %s; running %s", self.mode,
                "no piecewise sizes" if attention_layers else "the model exposes no attention layers to cut at",
                "full decode graphs only" if fallback == "full" else "eagerly",
            )
            self.mode = fallback
        self.full_sizes = full_sizes if self.mode in ("full", "full_and_piecewise") else []
        """Request counts of the full decode graphs (empty unless the mode has them)."""
        self.piecewise_sizes = pw_sizes if self.mode in ("piecewise", "full_and_piecewise") else []
        """Token counts of the piecewise graphs (empty unless the mode has them)."""
        self.pool = torch.cuda.graph_pool_handle() if self.mode != "none" else None
        self.full: dict[int, _FullGraph] = {}
        self.piecewise: dict[int, _PiecewiseGraph] = {}
        self.piecewise_capture: _PiecewiseCapture | None = None
        self.capturing: str | None = None
        """``full`` or ``piecewise`` while that kind is warmed up and captured (what the runner's
        capture forward and the model-state plug-in prepare for), else None."""
        if self.piecewise_sizes:
            for layer in attention_layers:
                if not isinstance(layer.backend, PiecewiseBackend):
                    layer.backend = PiecewiseBackend(layer.backend, self)

    @property
    def has_full(self) -> bool:
        """Whether decode steps replay full graphs."""
        return bool(self.full_sizes)

    @property
    def max_size(self) -> int:
        """Largest full decode graph (0 without full graphs)."""
        return self.full_sizes[-1] if self.full_sizes else 0

    @property
    def max_piecewise_size(self) -> int:
        """Largest piecewise graph (0 without piecewise graphs)."""
        return self.piecewise_sizes[-1] if self.piecewise_sizes else 0

    def plan(self, num_reqs: int, num_tokens: int, max_query_len: int) -> GraphPlan:
        """Pick graph or eager for a step and its padded counts (eager: padded == real)."""
        if self.full_sizes and max_query_len == 1 and num_tokens == num_reqs and num_reqs <= self.max_size:
            size = self.full_sizes[bisect.bisect_left(self.full_sizes, num_reqs)]
            if size in self.full:
                return GraphPlan("full", size, size)
        if self.piecewise_sizes and num_tokens <= self.max_piecewise_size:
            size = self.piecewise_sizes[bisect.bisect_left(self.piecewise_sizes, num_tokens)]
            if size in self.piecewise:
                # Attention runs eagerly over the real requests; only tokens are padded.
                return GraphPlan("piecewise", num_reqs, size)
        return GraphPlan("eager", num_reqs, num_tokens)

    # --- capture -----------------------------------------------------------------------------

    def capture(self, prepare: Callable[[int, int], None], forward: Callable[[int, int], Any]) -> None:
        """Warm up and capture every size, full graphs then piecewise, largest first within each
        kind (smaller graphs then reuse the pool).

        ``prepare(num_reqs_padded, num_tokens_padded)`` makes the runner's buffers inert for that
        size (host work and copies: it runs outside capture); ``forward(num_reqs_padded,
        num_tokens_padded)`` runs the stage forward over them and returns the model's output.
        Both read :attr:`capturing` for the kind.  Only ``forward`` is captured, so a replay reads
        whatever the buffers hold at that time.  A piecewise size is prepared with as many request
        rows as it has tokens (at most the runner's rows: the runner clamps).
        """
        if self.mode == "none":
            return
        from pprun.kernels.triton_utils import force_pdl

        try:
            for kind, sizes in (("full", self.full_sizes), ("piecewise", self.piecewise_sizes)):
                self.capturing = kind
                for size in reversed(sizes):
                    prepare(size, size)
                    for _ in range(NUM_WARMUPS):
                        forward(size, size)
                    # Captured Triton kernels launch with PDL, a separate compiled variant: compile and
                    # load it here, where nothing is being captured.
                    with force_pdl():
                        forward(size, size)
                    torch.cuda.synchronize(self.device)
                    if self.first_use is not None:
                        self.first_use.record(f"cuda graph: {kind} {size}")
                    if kind == "full":
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph, pool=self.pool):
                            output = forward(size, size)
                        self.full[size] = _FullGraph(graph, output)
                    else:
                        self.piecewise[size] = self._capture_piecewise(forward, size)
        finally:
            self.capturing = None
        torch.cuda.synchronize(self.device)
        logger.info("captured CUDA graphs (%s): full %s, piecewise %s", self.mode, self.full_sizes,
                    self.piecewise_sizes)

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
