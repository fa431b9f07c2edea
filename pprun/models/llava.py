"""``LlavaForConditionalGeneration`` as Hugging Face checkpoints describe it, built per stage.

A vision tower (CLIP, SigLIP or Pixtral) and a two-layer projector turn each image into rows of
the language model's embedding width; the language model is pprun's Llama family
(:class:`~pprun.models.llama.LlamaForCausalLM`, from the config's ``text_config``).  The tower
and projector live on the first stage only: later stages never build or read them.  Under
tensor parallelism the language model is split (``pprun.models.llama``) and the tower and
projector run replicated on every tp rank of the first stage: each image is encoded once per
request, small beside the decoder, and every rank then holds the rows it merges into its
embeddings without a collective.  The first
stage's runner scatters the image rows into the token embeddings where ``is_mm_embed`` is True
(``pprun.worker.multimodal``) and calls :meth:`LlavaForConditionalGeneration.forward` with
``input_ids=None`` and those ``inputs_embeds``.

Checkpoint names: :func:`canonical_name` is the one place that maps what a checkpoint stores
(the older ``language_model.model.*`` / ``vision_tower.vision_model.*`` layout, or
transformers 5's ``model.language_model.*`` / ``model.vision_tower.*``) onto this module's names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace

import torch
from torch import nn

from pprun.attention.metadata import AttentionMetadata
from pprun.distributed.intermediate import IntermediateTensors
from pprun.distributed.layout import StageLayout
from pprun.distributed.tensor_parallel import TensorParallel
from pprun.layers.parallel_linear import Shard
from pprun.models.base import PprunModel, allocate
from pprun.models.clip import VisionTransformer, activation
from pprun.models.hf_config import ModelArchConfig
from pprun.models.llama import LlamaForCausalLM
from pprun.models.tensor_rules import IgnoreRule
from pprun.multimodal.items import MultiModalItem

_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)


def canonical_name(stored: str) -> str:
    """A checkpoint tensor's name as this model knows it: the language model's in the Llama
    layout (``model.layers.N...``, ``lm_head.weight``), the tower's under ``vision_tower.``, the
    projector's under ``multi_modal_projector.``."""
    for prefix, canonical in _PREFIXES:
        if stored.startswith(prefix):
            return canonical + stored[len(prefix):]
    return stored


def ignored_tensor_rules(arch: ModelArchConfig) -> list[IgnoreRule]:
    """The tower's tensors this model never reads (by canonical name), each with why: blocks past
    the deepest feature layer (not built), the tower's own head and final norm, and position-id
    buffers older checkpoints store."""
    mm = arch.multimodal
    built = max(feature_layers(mm, int(mm["vision_config"]["num_hidden_layers"])))
    return [
        IgnoreRule(r"vision_tower\.(?:encoder|transformer)\.layers\.(\d+)\..*",
                   "vision tower blocks past the deepest vision_feature_layer: never run", min_index=built),
        IgnoreRule(r"vision_tower\.(?:post_layernorm|head)\..*",
                   "the vision tower's final norm and pooling head: the projector reads hidden states "
                   "before them"),
        IgnoreRule(r"vision_tower\.embeddings\.position_ids",
                   "position ids: a buffer of 0..n-1, not a weight"),
    ]


def feature_layers(mm: dict, num_tower_layers: int) -> list[int]:
    """The tower hidden-state indices the projector reads (``vision_feature_layer``, an int or a
    list), as non-negative indices into the ``num_tower_layers + 1`` hidden states."""
    wanted = mm["vision_feature_layer"]
    wanted = [wanted] if isinstance(wanted, int) else list(wanted)
    out = [i if i >= 0 else num_tower_layers + 1 + i for i in wanted]
    bad = [w for w, i in zip(wanted, out) if not 0 <= i <= num_tower_layers]
    if bad:
        raise ValueError(
            f"vision_feature_layer={mm['vision_feature_layer']!r} names hidden states outside the tower's "
            f"{num_tower_layers + 1}"
        )
    return out


class MultiModalProjector(nn.Module):
    """``linear_2(act(linear_1(features)))``: tower width (times feature layers) to the LM's."""

    def __init__(self, in_features: int, hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_features, hidden, bias=bias)
        self.act = activation(act)
        self.linear_2 = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Project image features into the language model's embedding space."""
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(PprunModel):
    """A Llava-form vision-language model holding only what one pipeline stage owns."""

    supports_multimodal = True
    """The first stage computes ``inputs_embeds`` (contract 1: the model then gets ``input_ids=None``)."""
    requires_raw_input_tokens = False

    def __init__(
        self,
        arch: ModelArchConfig,
        layout: StageLayout,
        *,
        device: torch.device,
        dtype: torch.dtype,
        max_positions: int,
        attn_backend: Callable,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        mm = arch.multimodal
        if mm is None:
            raise ValueError(f"{arch.architecture} needs a multimodal config (vision_config)")
        self.arch = arch
        self.layout = layout
        self.mm_config = mm
        self.hidden_size = arch.hidden_size
        self.image_token_index = int(mm["image_token_index"])
        text_arch = replace(arch, architecture=mm["text_architecture"], multimodal=None)
        self.language_model = LlamaForCausalLM(
            text_arch, layout, device=device, dtype=dtype, max_positions=max_positions, attn_backend=attn_backend,
            tp=tp,
        )
        self.fp8_weight_names = self.language_model.fp8_weight_names
        self.vision_tower: nn.Module | None = None
        self.multi_modal_projector: MultiModalProjector | None = None
        if layout.is_first:
            vcfg = mm["vision_config"]
            self.tower_type = vcfg["model_type"]
            self.feature_layers = feature_layers(mm, int(vcfg["num_hidden_layers"]))
            with torch.device("meta"):
                self.vision_tower = self._build_tower(vcfg, max(self.feature_layers))
                self.multi_modal_projector = MultiModalProjector(
                    vcfg["hidden_size"] * len(self.feature_layers), arch.hidden_size,
                    mm["projector_hidden_act"], mm["multimodal_projector_bias"],
                )
            allocate(self.vision_tower, device, dtype)
            allocate(self.multi_modal_projector, device, dtype)

    def _build_tower(self, vcfg: dict, num_layers: int) -> nn.Module:
        if self.tower_type == "pixtral":
            from pprun.models.pixtral import PixtralVisionModel

            return PixtralVisionModel(vcfg, num_layers)
        return VisionTransformer(vcfg, num_layers, clip=self.tower_type == "clip_vision_model")

    @property
    def layers(self) -> nn.ModuleList:
        """The language model's decoder layers on this stage (what the KV cache serves)."""
        return self.language_model.layers

    # --- encoder -----------------------------------------------------------------------------

    def encode_items(self, items: list[MultiModalItem]) -> list[torch.Tensor]:
        """Each image's rows in the language model's embedding space (``[num_embeds, hidden]``)."""
        if self.vision_tower is None:
            raise RuntimeError(f"stage {self.layout.pp_rank} has no vision tower (only the first stage encodes)")
        for item in items:
            if item.modality != "image":
                raise ValueError(f"{type(self).__name__} encodes images, not {item.modality!r} items")
        if self.tower_type == "pixtral":
            # Images of their own sizes, packed into one sequence (attention stays per image).
            images = [item.data["pixel_values"].to(self.language_model.device) for item in items]
            rows = self._project(self.vision_tower(images))
            return list(rows.split([r * c for r, c in map(self.vision_tower.patch_grid, images)]))
        # Same-size images (the processor resizes every one) run as one batch.
        pixels = torch.stack([item.data["pixel_values"] for item in items]).to(self.language_model.device)
        return list(self._project(self.vision_tower(pixels)).unbind(0))

    def _project(self, states: list[torch.Tensor]) -> torch.Tensor:
        selected = [states[i] for i in self.feature_layers]
        if self.mm_config["vision_feature_select_strategy"] == "default":
            selected = [s[:, 1:] for s in selected]  # drop the class token
        return self.multi_modal_projector(torch.cat(selected, dim=-1) if len(selected) > 1 else selected[0])

    # --- language model ----------------------------------------------------------------------

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings (first stage only)."""
        return self.language_model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None,
        intermediate_tensors: IntermediateTensors | None,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor | IntermediateTensors:
        """The language model's layers on this stage (image rows are already in ``inputs_embeds``)."""
        return self.language_model(input_ids, positions, inputs_embeds, intermediate_tensors, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """LM-head logits (last stage)."""
        return self.language_model.compute_logits(hidden_states)

    def make_empty_intermediate_tensors(
        self, num_tokens: int, dtype: torch.dtype, device: torch.device
    ) -> IntermediateTensors:
        """What the previous stage sends: the language model's residual stream."""
        return self.language_model.make_empty_intermediate_tensors(num_tokens, dtype, device)

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """The language model's layers take the KV caches."""
        self.language_model.bind_kv_caches(kv_caches)

    # --- weights -----------------------------------------------------------------------------

    def checkpoint_names(self) -> list[str]:
        """This stage's tensors, by :func:`canonical_name`: the language model's, and on the first
        stage the tower's (only the blocks built) and the projector's."""
        names = self.language_model.checkpoint_names()
        if self.vision_tower is not None:
            names += [f"vision_tower.{n}" for n, _ in self.vision_tower.named_parameters()]
            names += [f"multi_modal_projector.{n}" for n, _ in self.multi_modal_projector.named_parameters()]
        return names

    def checkpoint_shards(self) -> dict[str, Shard]:
        """The language model's shards on this tp rank; the tower and projector are read whole
        (they run replicated on every tp rank of the first stage)."""
        return self.language_model.checkpoint_shards()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy canonically named tensors into place; returns the names loaded."""
        loaded: set[str] = set()
        own = {"vision_tower": self.vision_tower, "multi_modal_projector": self.multi_modal_projector}

        def text_weights() -> Iterable[tuple[str, torch.Tensor]]:
            # Streamed: each tensor is copied before the next is read.
            for name, tensor in weights:
                head, _, rest = name.partition(".")
                module = own.get(head)
                if module is None:
                    yield name, tensor
                    continue
                param = module.get_parameter(rest)
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}; the model expects "
                        f"{tuple(param.shape)}"
                    )
                param.data.copy_(tensor)
                loaded.add(name)

        return self.language_model.load_weights(text_weights()) | loaded
