"""Whisper (``WhisperForConditionalGeneration``) as Hugging Face checkpoints describe it, built per stage.

One plain module tree, read top to bottom: ``EncoderAttention``, ``EncoderLayer``,
``SelfAttention``, ``CrossAttention``, ``DecoderLayer``, ``WhisperForConditionalGeneration``.

Stages: the first stage owns the audio encoder (two convolutions with GELU, learned positions,
pre-norm layers, final LayerNorm) and the decoder's token and position embeddings; decoder
layers are split over the stages like Llama's; the last stage owns the decoder's final
LayerNorm and the output projection, tied to the token embeddings (so the last stage reads
``model.decoder.embed_tokens.weight`` too).  Each stage allocates and reads only these.

The encoder runs once per request (:meth:`WhisperForConditionalGeneration.encode`, on the
first stage), and each stage that holds decoder layers turns the encoder output into its
layers' cross-attention K/V once (:meth:`write_cross_kv`), into the cross caches
(``pprun.attention.cross``).  A decoder step (``forward``) then reads them through
``attn_metadata.cross``; it never sees the encoder output.

Tensor parallelism (``tp``): the encoder runs replicated on every tp rank of the first stage
(it runs once per request, and each rank then needs the whole output for its own heads' cross
K/V, so replicating it costs no communication); the decoder is split as the Llama family is:
q/k/v, the cross-attention's q and k/v and fc1 column-parallel, both attentions' out_proj and
fc2 row-parallel (one all-reduce each), the token embedding and the tied output projection
vocabulary-parallel (``pprun.layers.parallel_linear``); each rank caches its own heads' self
and cross K/V.

Checkpoint quirks, handled in ``load_weights``: separate q/k/v land in one ``qkv_proj`` and the
cross-attention's k/v in one ``kv_proj``; Whisper's k projections have no bias, so the fused
bias keeps zeros in the k rows.  ``forward`` follows DESIGN contract 1 like the Llama model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from pprun.attention.cross import CrossAttentionMetadata, cross_attention, write_cross_kv
from pprun.attention.metadata import AttentionMetadata
from pprun.distributed.intermediate import IntermediateTensors
from pprun.distributed.layout import StageLayout
from pprun.distributed.tensor_parallel import TensorParallel
from pprun.layers.embedding import Embedding
from pprun.layers.parallel_linear import (
    Shard,
    linear_shards,
    lm_head,
    load_vocab_rows,
    split,
    vocab_embedding,
)
from pprun.models.base import PprunModel
from pprun.models.hf_config import AudioEncoderArch, ModelArchConfig
from pprun.models.quantization import LinearFactory

LAYER_NORM_EPS = 1e-5
"""nn.LayerNorm's default, which every Whisper checkpoint uses."""


def _qkv_bias_zero_k(proj: nn.Linear, q_rows: int, k_rows: int) -> None:
    """Zero the k rows of a fused projection's bias (the checkpoint has no k bias)."""
    if proj.bias is not None:
        proj.bias.data[q_rows : q_rows + k_rows].zero_()


class EncoderAttention(nn.Module):
    """Bidirectional self-attention over the encoder's frames (dense, no cache)."""

    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden // num_heads
        self.qkv_proj = nn.Linear(hidden, 3 * hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, S, hidden]`` -> ``[B, S, hidden]``."""
        batch, frames, hidden = x.shape
        qkv = self.qkv_proj(x).view(batch, frames, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, S, D]
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
        return self.out_proj(out.transpose(1, 2).reshape(batch, frames, hidden))


class EncoderLayer(nn.Module):
    """Pre-norm encoder block: self-attention, then a GELU feed-forward."""

    def __init__(self, hidden: int, num_heads: int, ffn_dim: int) -> None:
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(hidden, eps=LAYER_NORM_EPS)
        self.self_attn = EncoderAttention(hidden, num_heads)
        self.final_layer_norm = nn.LayerNorm(hidden, eps=LAYER_NORM_EPS)
        self.fc1 = nn.Linear(hidden, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """One block over ``h [B, S, hidden]``."""
        h = h + self.self_attn(self.self_attn_layer_norm(h))
        h = h + self.fc2(F.gelu(self.fc1(self.final_layer_norm(h))))
        if h.dtype == torch.float16:
            # As the reference does: fp16 activations can overflow in long audio.
            limit = torch.finfo(h.dtype).max - 1000
            h = h.clamp(min=-limit, max=limit)
        return h


class SelfAttention(nn.Module):
    """Causal decoder self-attention over the paged KV cache (no rotary: positions are learned)."""

    def __init__(self, hidden: int, num_heads: int, backend: Callable, make_linear: LinearFactory,
                 prefix: str) -> None:
        super().__init__()
        tp = make_linear.tp
        self.num_heads = tp.shard(num_heads, "num_attention_heads")
        """This tp rank's heads."""
        self.head_dim = hidden // num_heads
        self.scale = self.head_dim**-0.5
        rows = split(hidden, tp)
        self.qkv_proj = make_linear.column([f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"], hidden,
                                           [rows, rows, rows], True)
        self.out_proj = make_linear.row(f"{prefix}.out_proj", hidden, hidden, True)
        self.backend = backend
        self.kv_cache: torch.Tensor | None = None
        """[2, num_blocks, block_size, num_heads, head_dim], bound by the worker."""

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attend ``x [T, hidden]`` over each request's decoder context."""
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).view(num_tokens, 3, self.num_heads, self.head_dim).unbind(1)
        out = self.backend(q, k, v, self.kv_cache, meta, self.scale)
        return self.out_proj(out.reshape(num_tokens, -1))


class CrossAttention(nn.Module):
    """Decoder attention over the request's encoder output, through its cross-cache slot."""

    def __init__(self, hidden: int, num_heads: int, make_linear: LinearFactory, prefix: str) -> None:
        super().__init__()
        tp = make_linear.tp
        self.num_heads = tp.shard(num_heads, "num_attention_heads")
        """This tp rank's heads."""
        self.head_dim = hidden // num_heads
        self.scale = self.head_dim**-0.5
        rows = split(hidden, tp)
        self.q_proj = make_linear.column([f"{prefix}.q_proj"], hidden, [rows], True)
        self.kv_proj = make_linear.column([f"{prefix}.k_proj", f"{prefix}.v_proj"], hidden, [rows, rows], True)
        self.out_proj = make_linear.row(f"{prefix}.out_proj", hidden, hidden, True)
        self.cross_cache: torch.Tensor | None = None
        """[2, num_cross_slots, max_source_positions, num_heads, head_dim], bound by the worker."""

    def project_kv(self, encoder_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[B, S, H, D]`` of encoder outputs ``[B, S, hidden]`` (the cache's layout)."""
        batch, frames, _ = encoder_out.shape
        kv = self.kv_proj(encoder_out).view(batch, frames, 2, self.num_heads, self.head_dim)
        return kv[:, :, 0], kv[:, :, 1]

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attend ``x [T, hidden]`` over each token's request's encoder K/V."""
        if meta.cross is None:
            raise ValueError("a Whisper decoder step needs attn_metadata.cross (encoder lengths)")
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        out = cross_attention(q, self.cross_cache, meta.cross, meta.query_start_loc, self.scale)
        return self.out_proj(out.reshape(num_tokens, -1))


class DecoderLayer(nn.Module):
    """Pre-norm decoder block: self-attention, cross-attention, GELU feed-forward."""

    def __init__(self, hidden: int, num_heads: int, ffn_dim: int, backend: Callable, make_linear: LinearFactory,
                 prefix: str) -> None:
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(hidden, eps=LAYER_NORM_EPS)
        self.self_attn = SelfAttention(hidden, num_heads, backend, make_linear, f"{prefix}.self_attn")
        self.encoder_attn_layer_norm = nn.LayerNorm(hidden, eps=LAYER_NORM_EPS)
        self.encoder_attn = CrossAttention(hidden, num_heads, make_linear, f"{prefix}.encoder_attn")
        self.final_layer_norm = nn.LayerNorm(hidden, eps=LAYER_NORM_EPS)
        self.fc1 = make_linear.column([f"{prefix}.fc1"], hidden, [split(ffn_dim, make_linear.tp)], True)
        self.fc2 = make_linear.row(f"{prefix}.fc2", ffn_dim, hidden, True)

    def forward(self, h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One block over the step's tokens ``h [T, hidden]``."""
        h = h + self.self_attn(self.self_attn_layer_norm(h), meta)
        h = h + self.encoder_attn(self.encoder_attn_layer_norm(h), meta)
        return h + self.fc2(F.gelu(self.fc1(self.final_layer_norm(h))))


class WhisperForConditionalGeneration(PprunModel):
    """Whisper holding only the parts one pipeline stage owns (see the module docstring)."""

    requires_raw_input_tokens = False
    is_encoder_decoder = True
    """The engine gives its requests an encoder input and a cross-cache slot."""

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
        if arch.audio_encoder is None:
            raise ValueError(f"{arch.architecture}: config has no audio encoder fields")
        self.arch = arch
        self.encoder_arch: AudioEncoderArch = arch.audio_encoder
        self.layout = layout
        self.tp = tp if tp is not None else TensorParallel.single()
        self.dtype = dtype
        self.device = device
        enc = self.encoder_arch
        hidden, heads = arch.hidden_size, arch.num_attention_heads
        make_linear = LinearFactory(arch, device, dtype, self.tp)
        with torch.device("meta"):
            if layout.is_first:
                self.conv1 = nn.Conv1d(enc.num_mel_bins, hidden, kernel_size=3, padding=1)
                self.conv2 = nn.Conv1d(hidden, hidden, kernel_size=3, stride=2, padding=1)
                self.encoder_positions = Embedding(enc.max_source_positions, hidden)
                self.encoder_layers = nn.ModuleList(
                    EncoderLayer(hidden, enc.num_attention_heads, enc.ffn_dim)
                    for _ in range(enc.num_layers)
                )
                self.encoder_layer_norm = nn.LayerNorm(hidden, eps=LAYER_NORM_EPS)
                self.embed_tokens = vocab_embedding(arch.vocab_size, hidden, self.tp)
                self.embed_positions = Embedding(arch.max_position_embeddings, hidden)
            self.layers = nn.ModuleList(
                DecoderLayer(hidden, heads, arch.intermediate_size, attn_backend, make_linear,
                             f"model.decoder.layers.{i}")
                for i in layout.layer_range
            )
            if layout.is_last:
                self.layer_norm = nn.LayerNorm(hidden, eps=LAYER_NORM_EPS)
                self.proj_out = lm_head(arch.vocab_size, hidden, self.tp)
        self.to_empty(device=device)
        self.to(dtype)
        # The k rows of fused biases stay zero: the checkpoint has no k bias to fill them.
        local = hidden // self.tp.size  # this tp rank's q, k and v rows each
        for layer in self.layers:
            _qkv_bias_zero_k(layer.self_attn.qkv_proj, local, local)
            _qkv_bias_zero_k(layer.encoder_attn.kv_proj, 0, local)
        for layer in getattr(self, "encoder_layers", []):
            _qkv_bias_zero_k(layer.self_attn.qkv_proj, hidden, hidden)

    # --- encoder (first stage) -----------------------------------------------------------

    @property
    def encoder_input_frames(self) -> int:
        """Mel frames the encoder takes (30 s of audio): twice its output positions."""
        return 2 * self.encoder_arch.max_source_positions

    def encode(self, input_features: torch.Tensor) -> torch.Tensor:
        """Encoder output ``[B, max_source_positions, hidden]`` of log-mel features
        ``[B, num_mel_bins, 2 * max_source_positions]`` (first stage only)."""
        if not self.layout.is_first:
            raise ValueError(f"stage {self.layout.pp_rank} has no encoder (it lives on the first stage)")
        expected = (self.encoder_arch.num_mel_bins, self.encoder_input_frames)
        if input_features.dim() != 3 or tuple(input_features.shape[1:]) != expected:
            raise ValueError(
                f"input_features must have shape [batch, {expected[0]}, {expected[1]}], "
                f"got {tuple(input_features.shape)}"
            )
        x = input_features.to(self.dtype)
        x = F.gelu(self.conv1(x))
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        h = x + self.encoder_positions.weight
        for layer in self.encoder_layers:
            h = layer(h)
        return self.encoder_layer_norm(h)

    CROSS_KV_CHUNK_BYTES = 1 << 30
    """Most bytes of projected cross K/V :meth:`write_cross_kv` holds at once (whole layers)."""

    def write_cross_kv(self, encoder_out: torch.Tensor, slots: torch.Tensor) -> None:
        """Compute this stage's decoder layers' cross K/V of ``encoder_out [B, S, hidden]``
        and store them in the requests' cross-cache ``slots [B]`` (once per request).

        Every layer's ``kv_proj`` runs in one matrix product over all the requests (their weights
        stacked), in groups of layers whose output stays under :attr:`CROSS_KV_CHUNK_BYTES`."""
        if not self.layers:
            return
        x = encoder_out.to(self.dtype)
        batch, frames, hidden = x.shape
        heads = self.arch.num_attention_heads // self.tp.size  # this tp rank's
        head_dim = hidden // self.arch.num_attention_heads
        per_layer = batch * frames * 2 * heads * head_dim * x.element_size()
        group = max(1, self.CROSS_KV_CHUNK_BYTES // max(per_layer, 1))
        for start in range(0, len(self.layers), group):
            layers = self.layers[start : start + group]
            projs = [layer.encoder_attn.kv_proj for layer in layers]
            weight = projs[0].weight if len(projs) == 1 else torch.cat([p.weight for p in projs])
            bias = None
            if projs[0].bias is not None:
                bias = projs[0].bias if len(projs) == 1 else torch.cat([p.bias for p in projs])
            kv = F.linear(x, weight, bias).view(batch, frames, len(layers), 2, heads, head_dim)
            for i, layer in enumerate(layers):  # K and V [B, S, H, D]: the cache's layout
                write_cross_kv(layer.encoder_attn.cross_cache, slots, kv[:, :, i, 0], kv[:, :, i, 1])

    # --- decoder -------------------------------------------------------------------------

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings (first stage only); positions are added in ``forward``."""
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None,
        intermediate_tensors: IntermediateTensors | None,
        attn_metadata: AttentionMetadata,
        cross_metadata: CrossAttentionMetadata | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """Run this stage's decoder layers over a flattened batch of decoder tokens.

        The cross-attention lengths and slots come as ``cross_metadata`` (the V2 plug-in's
        persistent buffers, also under CUDA graphs) or on ``attn_metadata.cross`` (V1)."""
        if cross_metadata is not None:
            attn_metadata = replace(attn_metadata, cross=cross_metadata)
        if self.layout.is_first:
            h = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            h = h + self.embed_positions(positions)
        else:
            if intermediate_tensors is None:
                raise ValueError(
                    f"stage {self.layout.pp_rank} is not the first stage and needs "
                    "intermediate_tensors"
                )
            h = intermediate_tensors["hidden_states"]
        for layer in self.layers:
            h = layer(h, attn_metadata)
        if not self.layout.is_last:
            return IntermediateTensors({"hidden_states": h})
        return self.layer_norm(h)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Output-projection logits for the given (last stage) hidden states."""
        return self.proj_out(hidden_states)

    def make_empty_intermediate_tensors(
        self, num_tokens: int, dtype: torch.dtype, device: torch.device
    ) -> IntermediateTensors:
        """Receive buffers for what the previous stage sends: the decoder's ``hidden_states``."""
        shape = (num_tokens, self.arch.hidden_size)
        return IntermediateTensors({"hidden_states": torch.zeros(shape, dtype=dtype, device=device)})

    # --- caches --------------------------------------------------------------------------

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Give each owned decoder layer its self-attention cache, in layer order."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            layer.self_attn.kv_cache = cache

    def cross_cache_shape(self, num_cross_slots: int) -> tuple[int, ...]:
        """Shape of one decoder layer's cross cache with ``num_cross_slots`` slots (slot 0
        reserved for padding rows)."""
        heads = self.arch.num_attention_heads
        return (2, num_cross_slots, self.encoder_arch.max_source_positions, heads // self.tp.size,
                self.arch.hidden_size // heads)

    def bind_cross_caches(self, cross_caches: list[torch.Tensor]) -> None:
        """Give each owned decoder layer its cross-attention cache, in layer order."""
        if len(cross_caches) != len(self.layers):
            raise ValueError(f"got {len(cross_caches)} cross caches for {len(self.layers)} layers")
        for layer, cache in zip(self.layers, cross_caches, strict=True):
            layer.encoder_attn.cross_cache = cache

    # --- weights -------------------------------------------------------------------------

    def checkpoint_names(self) -> list[str]:
        """The checkpoint tensors this stage reads (and no others)."""
        from pprun.models.hf_config import expected_tensor_shapes

        layout = self.layout
        return list(expected_tensor_shapes(self.arch, layout.layer_range, layout.is_first, layout.is_last))

    def _encoder_params(self) -> list[tuple[str, str]]:
        """(checkpoint name under ``model.encoder.``, module path here) for the encoder."""
        pairs = [
            ("conv1.weight", "conv1.weight"), ("conv1.bias", "conv1.bias"),
            ("conv2.weight", "conv2.weight"), ("conv2.bias", "conv2.bias"),
            ("embed_positions.weight", "encoder_positions.weight"),
            ("layer_norm.weight", "encoder_layer_norm.weight"),
            ("layer_norm.bias", "encoder_layer_norm.bias"),
        ]
        for i in range(self.encoder_arch.num_layers):
            # q/k/v map to "": row blocks of the fused qkv_proj, placed in load_weights.
            for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
                for param in ("weight", "bias") if proj != "k_proj" else ("weight",):
                    path = f"encoder_layers.{i}.self_attn.{proj}.{param}" if proj == "out_proj" else ""
                    pairs.append((f"layers.{i}.self_attn.{proj}.{param}", path))
            for part in ("self_attn_layer_norm", "final_layer_norm", "fc1", "fc2"):
                for param in ("weight", "bias"):
                    name = f"layers.{i}.{part}.{param}"
                    pairs.append((name, f"encoder_layers.{i}.{part}.{param}"))
        return pairs

    def checkpoint_shards(self) -> dict[str, Shard]:
        """The part of each decoder tensor this tp rank reads (the encoder's are read whole: it
        runs replicated); empty at tp 1."""
        if self.tp.size == 1:
            return {}
        shards: dict[str, Shard] = {}
        if self.layout.is_first:
            shards["model.decoder.embed_tokens.weight"] = self.embed_tokens.shard
        if self.layout.is_last:
            head = "model.decoder.embed_tokens.weight" if self.arch.tie_word_embeddings else "proj_out.weight"
            shards[head] = self.proj_out.shard
        for layer in self.layers:
            for proj in (layer.self_attn.qkv_proj, layer.self_attn.out_proj, layer.encoder_attn.q_proj,
                         layer.encoder_attn.kv_proj, layer.encoder_attn.out_proj, layer.fc1, layer.fc2):
                shards |= linear_shards(proj)
        return shards

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors (this tp rank's shards of the decoder's: :meth:`checkpoint_shards`)
        into this stage's parameters; returns the names loaded."""
        loaded: set[str] = set()
        hidden = self.arch.hidden_size
        local = hidden // self.tp.size  # a decoder q, k or v projection's rows on this tp rank
        encoder_paths = dict(self._encoder_params())
        start = self.layout.start_layer
        for name, tensor in weights:
            if name == "model.decoder.embed_tokens.weight":
                if self.layout.is_first:
                    load_vocab_rows(self.embed_tokens.weight, tensor)
                if self.layout.is_last and self.arch.tie_word_embeddings:
                    load_vocab_rows(self.proj_out.weight, tensor)
                loaded.add(name)
                continue
            target: torch.Tensor | None = None
            if name == "model.decoder.embed_positions.weight":
                target = self.embed_positions.weight
            elif name == "model.decoder.layer_norm.weight":
                target = self.layer_norm.weight
            elif name == "model.decoder.layer_norm.bias":
                target = self.layer_norm.bias
            elif name == "proj_out.weight":
                load_vocab_rows(self.proj_out.weight, tensor)
                loaded.add(name)
                continue
            elif name.startswith("model.encoder."):
                rest = name[len("model.encoder."):]
                path = encoder_paths.get(rest)
                if path is None:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in this model")
                if path:
                    target = self.get_parameter(path)
                else:  # a q/k/v projection: a row block of the fused qkv_proj
                    idx, _, proj, param = rest.split(".")[1:]
                    layer = self.encoder_layers[int(idx)]
                    row0 = "qkv".index(proj[0]) * hidden
                    getattr(layer.self_attn.qkv_proj, param).data[row0 : row0 + hidden].copy_(tensor)
                    loaded.add(name)
                    continue
            elif name.startswith("model.decoder.layers."):
                idx, rest = name[len("model.decoder.layers."):].split(".", 1)
                layer = self.layers[int(idx) - start]
                part, param = rest.rsplit(".", 1)
                attn, _, proj = part.partition(".")
                if attn == "self_attn" and proj in ("q_proj", "k_proj", "v_proj"):
                    row0 = "qkv".index(proj[0]) * local
                    getattr(layer.self_attn.qkv_proj, param).data[row0 : row0 + local].copy_(tensor)
                    loaded.add(name)
                    continue
                if attn == "encoder_attn" and proj in ("k_proj", "v_proj"):
                    row0 = 0 if proj == "k_proj" else local
                    getattr(layer.encoder_attn.kv_proj, param).data[row0 : row0 + local].copy_(tensor)
                    loaded.add(name)
                    continue
                target = layer.get_submodule(part).get_parameter(param)
            if target is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in this model")
            target.data.copy_(tensor)
            loaded.add(name)
        return loaded
