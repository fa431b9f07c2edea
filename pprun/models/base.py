"""The interface between a pprun model and the runners that drive it (the worker <-> model seam).

Every model class the loader builds (``pprun.worker.model_loader.MODEL_CLASSES``) is a
:class:`PprunModel`: an ``nn.Module`` holding what one pipeline stage owns.  It has two halves:

- its declarations: class attributes saying what the model is (multimodal, encoder-decoder,
  needs raw tokens), each with a text-only decoder's default, so a model states only where it
  differs.  The runners map them to their own plug-ins (the V2 runner through one registry,
  ``pprun.worker.v2.plugins``); a model never names a runner or a plug-in, nor imports one
  (``tests/test_imports.py`` fails if a module of ``pprun/models/`` does);
- the methods the runners and the worker call, abstract here: a model class lacking one cannot
  be built.

A model with an encoder also has the methods of :class:`EncoderDecoderModel` (its decoder
layers cross-attend to the encoder output) or of :class:`MultiModalModel` (the encoder output is
merged into the token embeddings), which the runners' plug-ins for those declarations call.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from collections.abc import Iterable
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from pprun.attention.metadata import AttentionMetadata
from pprun.distributed.intermediate import IntermediateTensors
from pprun.distributed.layout import StageLayout
from pprun.layers.parallel_linear import Shard
from pprun.models.hf_config import AudioEncoderArch, ModelArchConfig
from pprun.multimodal.items import MultiModalItem


class PprunModel(nn.Module, metaclass=ABCMeta):
    """Base class of pprun's models: their declarations to the runners and the methods the
    runners call (see the module docstring)."""

    supports_multimodal: ClassVar[bool] = False
    """The first stage computes ``inputs_embeds`` itself (token embeddings with multimodal items
    merged in, :class:`MultiModalModel`) and passes those to ``forward``; the runner then leaves
    ``input_ids`` out (contract 1) unless :attr:`requires_raw_input_tokens` is set."""

    requires_raw_input_tokens: ClassVar[bool] = False
    """``forward`` needs ``input_ids`` even when the first stage passes ``inputs_embeds``
    (contract 1: the model then gets both)."""

    is_encoder_decoder: ClassVar[bool] = False
    """The model has an encoder whose output its decoder layers cross-attend to (Whisper,
    :class:`EncoderDecoderModel`): the worker gives each request an encoder step and a
    cross-cache slot (``pprun.worker.encoder_decoder``)."""

    fp8_weight_names: frozenset[str] = frozenset()
    """Checkpoint weights the model holds in float8 (an FP8 checkpoint's, where the run
    multiplies in FP8): the loader hands these over as stored, each with its scale."""

    arch: ModelArchConfig
    """The checkpoint's architecture (``config.json``), as the model was built from it."""
    layout: StageLayout
    """The stage the model was built for (which layers, first and last)."""
    layers: nn.ModuleList
    """The stage's decoder layers, one KV cache each (what :meth:`bind_kv_caches` binds)."""

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None,
        intermediate_tensors: IntermediateTensors | None,
        attn_metadata: AttentionMetadata,
        **extra: Any,
    ) -> torch.Tensor | IntermediateTensors:
        """The stage's layers over a step's flattened tokens, with the inputs of docs/design.md
        contracts 1 and 2 and any keyword arguments of the family's runner plug-in (``extra``);
        a non-last stage returns what it sends on, the last stage its final hidden states."""

    @abstractmethod
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits ``[rows, vocab]`` of the last stage's hidden states."""

    @abstractmethod
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[num_tokens, hidden]`` (first stage)."""

    @abstractmethod
    def make_empty_intermediate_tensors(
        self, num_tokens: int, dtype: torch.dtype, device: torch.device
    ) -> IntermediateTensors:
        """Buffers for ``num_tokens`` rows of what the previous stage sends (a non-first
        stage's receive buffers, at fixed addresses: contract 2)."""

    @abstractmethod
    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Give each of :attr:`layers` its KV cache, in layer order."""

    def attention_layers(self) -> list[nn.Module]:
        """The modules that call an attention backend, in layer order: each has a ``backend``
        (the callable it attends through, which the V2 runner may wrap to cut piecewise CUDA
        graphs around attention) and a ``kv_cache``.  This default finds them by those two
        attributes; a model whose attention modules are built otherwise overrides it."""
        return [m for m in self.modules() if hasattr(m, "backend") and hasattr(m, "kv_cache")]

    @abstractmethod
    def checkpoint_names(self) -> list[str]:
        """The checkpoint tensors this stage reads, and no other."""

    def checkpoint_shards(self) -> dict[str, Shard]:
        """``checkpoint name -> Shard``: the row or column range of a tensor this tensor-parallel
        rank reads (``pprun.layers.parallel_linear``); tensors not named are read whole.  A model
        built at tp 1 reads everything whole (this default)."""
        return {}

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy ``(checkpoint name, tensor)`` pairs into the stage's parameters (each format's
        quirks handled here); returns the names loaded."""


class EncoderDecoderModel(Protocol):
    """What an encoder-decoder model (``is_encoder_decoder``) adds for the worker's
    ``EncoderDecoderState``: its encoder on the first stage and its cross caches on every stage."""

    arch: ModelArchConfig
    encoder_arch: AudioEncoderArch
    """The encoder's inputs: ``num_mel_bins`` log-mel bins over ``2 * max_source_positions``
    frames per request, ``max_source_positions`` encoder positions out."""
    layers: nn.ModuleList

    def encode(self, input_features: torch.Tensor) -> torch.Tensor:
        """Encoder output ``[B, max_source_positions, hidden]`` of log-mel features (first stage)."""
        ...

    def cross_cache_shape(self, num_cross_slots: int) -> tuple[int, ...]:
        """Shape of one decoder layer's cross cache for ``num_cross_slots`` requests."""
        ...

    def bind_cross_caches(self, cross_caches: list[torch.Tensor]) -> None:
        """Give each decoder layer its cross cache, in layer order."""
        ...

    def write_cross_kv(self, encoder_out: torch.Tensor, slots: torch.Tensor) -> None:
        """The stage's layers' cross K/V of ``encoder_out`` into the requests' ``slots``."""
        ...


class MultiModalModel(Protocol):
    """What a model that merges encoder output into its token embeddings (``supports_multimodal``)
    adds for the first stage's multimodal state (``pprun.worker.multimodal``)."""

    arch: ModelArchConfig
    """``arch.hidden_size``: the width of the token embeddings and of each encoder output row."""

    def encode_items(self, items: list[MultiModalItem]) -> list[torch.Tensor]:
        """Each item's encoder output ``[num_embeds, hidden]`` (first stage)."""
        ...

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[num_tokens, hidden]`` (first stage)."""
        ...


def allocate(module: nn.Module, device: torch.device | str, dtype: torch.dtype | None = None) -> nn.Module:
    """Give every parameter and buffer of ``module`` (built on the meta device) uninitialised
    storage on ``device``, floating ones in ``dtype`` (but those a module names in its
    ``keep_dtypes``): ``module.to_empty(device=device).to(dtype)`` in one pass, keeping tensors
    shared between submodules shared.

    ``to_empty`` makes each tensor with ``empty_like`` of a meta tensor, which runs torch's Python
    reference kernel, whose first use imports ``sympy`` (about a second of a stage's start-up on
    CPU); ``torch.empty`` does not."""
    made: dict[int, torch.Tensor] = {}

    def empty(t: torch.Tensor, keep: bool = False) -> torch.Tensor:
        cast = dtype is not None and not keep and (t.is_floating_point() or t.is_complex())
        return torch.empty(t.shape, dtype=dtype if cast else t.dtype, device=device)

    for sub in module.modules():
        # A quantized layer's float8 weights and float32 scales keep their dtypes.
        keep = getattr(sub, "keep_dtypes", ())
        for name, param in sub._parameters.items():
            if param is not None:
                if id(param) not in made:
                    made[id(param)] = nn.Parameter(empty(param, name in keep), requires_grad=param.requires_grad)
                sub._parameters[name] = made[id(param)]
        for name, buf in sub._buffers.items():
            if buf is not None:
                if id(buf) not in made:
                    made[id(buf)] = empty(buf)
                sub._buffers[name] = made[id(buf)]
    return module
