"""Which model-state plug-in the V2 runner gives a model: one registry, read in order.

A model declares what it is (:class:`pprun.models.base.PprunModel`: ``is_encoder_decoder``,
``supports_multimodal``, ``requires_raw_input_tokens``); it never names a plug-in.  Each entry of
:data:`MODEL_STATES` is a predicate over those declarations and the plug-in for the models it
holds for; the first entry that holds wins, and a model no entry holds for (a text-only decoder)
gets :class:`~pprun.worker.v2.model_state.ModelState`, which adds nothing.  A new family whose
needs differ adds its declaration to ``PprunModel`` and one line here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pprun.distributed.layout import StageLayout
from pprun.models.base import PprunModel
from pprun.worker.encoder_decoder import EncoderDecoderState
from pprun.worker.v2.encoder_decoder_state import EncoderDecoderModelState
from pprun.worker.v2.model_state import ModelState
from pprun.worker.v2.multimodal_state import MultiModalModelState

Declares = Callable[[type[PprunModel]], bool]
"""A predicate over a model class's declarations."""

MODEL_STATES: list[tuple[Declares, type[ModelState]]] = [
    (lambda model: model.is_encoder_decoder, EncoderDecoderModelState),
    (lambda model: model.supports_multimodal, MultiModalModelState),
]
"""(predicate over a model class's declarations, its plug-in), first match wins."""


def model_state_class(model_cls: type[PprunModel]) -> type[ModelState]:
    """The plug-in :data:`MODEL_STATES` gives ``model_cls`` (``ModelState`` when none holds)."""
    for declares, plugin in MODEL_STATES:
        if declares(model_cls):
            return plugin
    return ModelState


def make_model_state(
    model: PprunModel,
    layout: StageLayout,
    device: torch.device,
    dtype: torch.dtype,
    max_num_reqs: int,
    max_num_tokens: int,
    encoder_decoder: EncoderDecoderState | None = None,
) -> ModelState:
    """The stage's plug-in for ``model``, built (see :func:`model_state_class`)."""
    cls = model_state_class(type(model))
    if encoder_decoder is not None:
        # An encoder-decoder stage's cross caches, slots and encoder step, built by the worker
        # (``pprun.worker.encoder_decoder.EncoderDecoderState``): its plug-in takes them.
        return cls(model, layout, device, dtype, max_num_reqs, max_num_tokens, encoder_decoder=encoder_decoder)
    return cls(model, layout, device, dtype, max_num_reqs, max_num_tokens)
