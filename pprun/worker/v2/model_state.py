"""Model-state plug-ins: what one model family needs from the V2 runner, kept out of the runner.

The runner stays model-agnostic: it owns requests, token/position/slot buffers, attention
metadata, graphs and sampling.  A :class:`ModelState` adds what a family needs beyond that:

- per-request state of its own (a vision-language model keeps each request's multimodal items;
  an encoder-decoder keeps encoder lengths) in persistent per-row buffers, updated by
  :meth:`ModelState.add_request` / :meth:`ModelState.remove_request`;
- :meth:`ModelState.prepare_inputs_embeds`: first-stage input embeddings when the family merges
  something into the token embeddings (docs/design.md contract 3: ``is_mm_embed`` built by OR-ing every
  item's range, scattering only the scheduled window's part under chunked prefill), written into
  a persistent ``[max_num_tokens, hidden]`` buffer so graphs can read it;
- :meth:`ModelState.extra_model_kwargs`: more forward arguments, each a view of a persistent
  buffer written for the *padded* request count (contract 4: real rows first, padding rows
  zeroed, the same buffers eagerly and in graphs), e.g. ``encoder_seq_lens[:num_reqs_padded]``;
- :meth:`ModelState.capture_inputs`: the same, made inert, for CUDA-graph warm-up and capture;
- :meth:`ModelState.attention_layers`: the modules whose ``backend`` the runner may wrap for
  piecewise graphs.

Which plug-in a model gets follows from its declarations (:class:`pprun.models.base.PprunModel`:
``is_encoder_decoder``, ``supports_multimodal``, ...), through the one registry
``pprun.worker.v2.plugins.MODEL_STATES``; a text-only decoder (the Llama family) matches no entry
and gets :class:`ModelState` itself, whose defaults add nothing.  An encoder-decoder model's
plug-in (``pprun.worker.v2.encoder_decoder_state``) also takes the stage's
``EncoderDecoderState`` as ``encoder_decoder=`` (``pprun.worker.v2.plugins.make_model_state``
passes it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pprun.core.outputs import NewRequestData, SchedulerOutput
from pprun.distributed.layout import StageLayout
from pprun.models.base import PprunModel
from pprun.worker.v2.inputs import StepBatch


class ModelState:
    """The plug-in interface; the defaults are those of a text-only decoder (nothing extra)."""

    def __init__(
        self,
        model: PprunModel,
        layout: StageLayout,
        device: torch.device,
        dtype: torch.dtype,
        max_num_reqs: int,
        max_num_tokens: int,
    ) -> None:
        self.model = model
        self.layout = layout
        self.device = device
        self.dtype = dtype
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        self.capture_kind = "none"
        """The kind of CUDA graph the runner is about to capture (``full`` or ``piecewise``;
        ``none`` before the first), set before each capture: :meth:`capture_inputs` may depend
        on what that graph replays."""

    masks_suppressed_in_graph: bool = False
    """Whether the last stage's full decode graphs put each row's ``suppress_token_ids`` at -inf
    before their greedy argmax (the request table's per-row device mask, gathered by the step's
    sampling rows): for a family whose every request suppresses ids (Whisper's generation
    config), so that its greedy decode steps take their ids from the graph with no sampling
    outside it.  Off by default: a family whose requests rarely suppress would pay the gather and
    fill in every graph."""

    def add_request(self, row: int, new: NewRequestData) -> None:
        """A request took table row ``row`` (write its family-specific per-request state)."""

    def remove_request(self, row: int) -> None:
        """Row ``row`` was freed."""

    def begin_step(self, so: SchedulerOutput) -> None:
        """The step's deltas are applied (new and running requests in the table): act on what
        the step asks of the family, e.g. run encoders for ``so.scheduled_encoder_inputs`` and
        drop ``so.free_encoder_hashes`` from the encoder cache."""

    def prepare_inputs_embeds(self, batch: StepBatch, input_ids: torch.Tensor) -> torch.Tensor | None:
        """First stage only: ``[num_tokens_padded, hidden]`` embeddings, or ``None`` to let the
        model embed ``input_ids`` itself.  ``batch.num_computed_tokens`` and ``batch.query_start``
        give each request's scheduled window (prompt positions and batch rows).  Must return a view of a persistent buffer when the
        runner may replay a graph over it."""
        return None

    def extra_model_kwargs(self, batch: StepBatch) -> dict[str, Any]:
        """Extra forward kwargs for this step (views of persistent buffers, padded counts)."""
        return {}

    def capture_inputs(
        self, num_reqs_padded: int, num_tokens_padded: int
    ) -> tuple[torch.Tensor | None, dict[str, Any]]:
        """``(inputs_embeds, extra kwargs)`` for graph warm-up and capture: the step buffers of
        :meth:`prepare_inputs_embeds` / :meth:`extra_model_kwargs`, every row inert."""
        return None, {}

    def attention_layers(self) -> list[nn.Module]:
        """Modules that call an attention backend through a swappable ``backend`` attribute, as
        the model names them (``PprunModel.attention_layers``)."""
        return self.model.attention_layers()

    def full_graph_unsupported_reason(self) -> str | None:
        """Why a whole-forward graph cannot be captured for this model (``None``: it can)."""
        from pprun.attention.backend import reference_backend

        if any(m.backend is reference_backend for m in self.attention_layers()):
            return "the reference attention backend reads lengths on the host (not capture-safe)"
        return None

