"""The interface between a pprun model and the runners that drive it (the worker <-> model seam).

Every model class the loader builds (``pprun.worker.model_loader.MODEL_CLASSES``) is a
:class:`PprunModel`.  The class attributes below are the model's declarations to the runners;
each has the default of a text-only decoder, so a model states only where it differs.  The
runners read them as plain attributes.

The methods a model provides (not declared here, since each family's signature and state
differ; see ``docs/architecture.md``, "The model interface"):

- ``forward(input_ids, positions, inputs_embeds, intermediate_tensors, attn_metadata, **extra)``:
  docs/design.md contracts 1 and 2; a non-last stage returns ``IntermediateTensors``, the last
  stage hidden states;
- ``compute_logits(hidden_states)`` (last stage); ``embed_input_ids(input_ids)`` (first stage);
- ``make_empty_intermediate_tensors(num_tokens, dtype, device)``: the receive buffers of a
  non-first stage;
- ``layers`` (the stage's decoder layers, one KV cache each) and ``bind_kv_caches(caches)``;
- ``checkpoint_names()`` and ``load_weights(weights)``: the stage's checkpoint tensors.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn


class PprunModel(nn.Module):
    """Base class of pprun's models: the declarations the runners read (see the module docstring)."""

    supports_multimodal: ClassVar[bool] = False
    """The first stage computes ``inputs_embeds`` itself (token embeddings with multimodal items
    merged in) and passes those to ``forward``; the runner then leaves ``input_ids`` out
    (contract 1) unless :attr:`requires_raw_input_tokens` is set."""

    requires_raw_input_tokens: ClassVar[bool] = False
    """``forward`` needs ``input_ids`` even when the first stage passes ``inputs_embeds``
    (contract 1: the model then gets both)."""

    is_encoder_decoder: ClassVar[bool] = False
    """The model has an encoder whose output its decoder layers cross-attend to (Whisper): the
    worker gives each request an encoder step and a cross-cache slot
    (``pprun.worker.encoder_decoder``)."""

    model_state_cls: ClassVar[type | None] = None
    """The V2 runner's plug-in for this family (a subclass of
    ``pprun.worker.v2.model_state.ModelState``, which the models do not import: the worker
    depends on them, not the other way round); None gets ``ModelState`` itself, which adds
    nothing (a text-only decoder)."""


def allocate(module: nn.Module, device: torch.device | str, dtype: torch.dtype | None = None) -> nn.Module:
    """Give every parameter and buffer of ``module`` (built on the meta device) uninitialised
    storage on ``device``, floating ones in ``dtype``: ``module.to_empty(device=device).to(dtype)``
    in one pass, keeping tensors shared between submodules shared.

    ``to_empty`` makes each tensor with ``empty_like`` of a meta tensor, which runs torch's Python
    reference kernel, whose first use imports ``sympy`` (about a second of a stage's start-up on
    CPU); ``torch.empty`` does not."""
    made: dict[int, torch.Tensor] = {}

    def empty(t: torch.Tensor) -> torch.Tensor:
        new_dtype = dtype if dtype is not None and (t.is_floating_point() or t.is_complex()) else t.dtype
        return torch.empty(t.shape, dtype=new_dtype, device=device)

    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None:
                if id(param) not in made:
                    made[id(param)] = nn.Parameter(empty(param), requires_grad=param.requires_grad)
                sub._parameters[name] = made[id(param)]
        for name, buf in sub._buffers.items():
            if buf is not None:
                if id(buf) not in made:
                    made[id(buf)] = empty(buf)
                sub._buffers[name] = made[id(buf)]
    return module
