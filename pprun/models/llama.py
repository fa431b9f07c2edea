"""The Llama family (Llama, Mistral, Qwen2, Qwen3; Qwen3-MoE and Mixtral with their experts) as Hugging
Face checkpoints describe it, built per stage.

One plain module tree, read top to bottom: rotary helpers, ``Attention``, ``MLP``,
``DecoderLayer``, ``LlamaForCausalLM`` (``RMSNorm`` comes from ``pprun.layers.norm``).  The model
says what it computes, in plain torch; that is the reference path (CPU, HF parity).  Where the
fused ops run (CUDA with Triton), each block's ``forward_fused`` runs the same modules with the
launches picked (see "Where the fused ops run" below).  A model is built for one pipeline
stage: the first stage owns the embedding, the last the final norm and LM head (a tied head
reads the embedding weights), and only the stage's own layers are ever allocated (a sparse
layer's experts included: a stage reads no other stage's experts).  Checkpoint quirks (separate
q/k/v and gate/up tensors fused into one matmul each, per-expert tensors stacked into two per
layer) are handled in ``load_weights``.

Forward follows docs/design.md contract 1: ``forward(input_ids, positions, inputs_embeds,
intermediate_tensors, attn_metadata)``; a non-last stage returns ``IntermediateTensors`` with
one tensor, ``hidden_states``: the residual stream after its last layer (that layer's output
added to its residual, which the layers otherwise carry apart to fold the add into the next
norm).  The next stage's first layer takes it as the first stage's first layer takes the
embeddings, so a hop carries half the bytes of the (output, residual) pair in one message, and
the tokens do not change: the add rounds as the next norm's fused add would have.

Tensor parallelism (``tp``, a ``TensorParallel``): each tp rank of a stage builds its shard of
every layer from ``pprun.layers.parallel_linear`` through the ``LinearFactory``: q/k/v (its query
heads, its KV heads or the one it shares where tp exceeds them) and gate/up column-parallel,
o_proj and down row-parallel, whose forward all-reduces, so every block's output, and the
residual stream a stage sends on, is whole on every rank; the embedding and LM head
vocabulary-parallel; a sparse layer's experts split along their width (``pprun.models.moe``).
:meth:`LlamaForCausalLM.checkpoint_shards` says which part of each tensor the rank reads.  At
tp 1 the layers are plain ``nn.Linear`` and ``nn.Embedding``.

Where the fused ops run (``pprun.layers.fused_ops_for``: CUDA with Triton, unless
``PPRUN_DISABLE_FUSED=1``), ``LlamaForCausalLM.forward`` calls each layer's
``DecoderLayer.forward_fused``: the same modules, in the same order, with the kernels picked by
the blocks themselves (``Attention.forward_fused``, ``MLP.forward_fused``,
``SparseMoeBlock.forward_fused``; each takes the norm before it):

- at one row the residual add + RMSNorm runs as the prologue of the matmul after it
  (``pprun.layers.norm_linear``: qkv, and gate_up with its SwiGLU);
- each decode matmul is told where it sits (``pprun.layers.linear``'s ``after`` / ``then``): qkv
  after a norm and before the attention, o_proj after the attention and before a norm, down
  before a norm unless it ends a stage that sends its output on; from that the dispatch decides
  whether the weights load ahead of the PDL wait, whether split-K partials are left to the next
  kernel (``SplitPartials``, merged by the norm or by the one-kernel decode attention) and
  whether the last weight tile is held across the wait;
- gate_up and its SwiGLU are one launch where the split-K kernels take the rows;
- a sparse layer's block (``pprun.models.moe``) runs the router and the grouped expert kernels,
  each token's expert outputs left to the next norm to sum.

Under tensor parallelism the same calls run on the rank's shards: a column shard takes the split-K
kernels and the norm fold as a whole layer does, while a row shard runs its own forward (the
matmul, then the all-reduce), so its output reaches the next norm whole, never as split partials,
and a sparse block sums its experts' partials before its all-reduce.

The tests that keep the two paths together: ``tests/test_norm_linear.py`` (a layer folded and
not), ``tests/test_launch_plan.py`` (the kernels a decode step launches),
``tests/test_fused_ops.py`` (whole models, fused against plain torch; on CUDA).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

import pprun.layers as layers
from pprun.attention.metadata import AttentionMetadata
from pprun.distributed.intermediate import IntermediateTensors
from pprun.distributed.layout import StageLayout
from pprun.distributed.tensor_parallel import TensorParallel
from pprun.kernels.partials import SplitPartials, merged
from pprun.layers import linear
from pprun.layers.attend import attend, attention_input
from pprun.layers.norm import RMSNorm
from pprun.layers.parallel_linear import (
    Shard,
    kv_head_shard,
    kv_heads_per_rank,
    linear_shards,
    lm_head,
    load_vocab_rows,
    split,
    vocab_embedding,
)
from pprun.models.base import PprunModel, allocate
from pprun.models.hf_config import ModelArchConfig
from pprun.models.moe import SparseMoeBlock
from pprun.models.quantization import LinearFactory


def rope_inv_freq(arch: ModelArchConfig) -> torch.Tensor:
    """Inverse frequencies, with the ``linear`` and ``llama3`` scaling variants applied."""
    dim = arch.head_dim
    inv_freq = 1.0 / (
        arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    scaling = arch.rope_scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of the last dim (the non-interleaved rotary layout of HF Llama)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding:
    """Precomputed cos/sin tables indexed by position (float32, cast to the activations' dtype).

    A plain object, not a module: the tables are derived state, so ``allocate``
    on the model must not touch them, and they are not weights.
    """

    def __init__(self, arch: ModelArchConfig, max_positions: int, device: torch.device) -> None:
        inv_freq = rope_inv_freq(arch)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)

    def __call__(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q [T, H, D]`` and ``k [T, KVH, D]`` by their token positions (new tensors;
        ``pprun.layers.attend`` rotates in place with one kernel where the fused ops run)."""
        cos = self.cos[positions].to(q.dtype).unsqueeze(1)
        sin = self.sin[positions].to(q.dtype).unsqueeze(1)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class Attention(nn.Module):
    """Grouped-query attention with one fused q/k/v projection over the paged KV cache."""

    def __init__(self, arch: ModelArchConfig, rotary: RotaryEmbedding, backend: Callable,
                 make_linear: LinearFactory, prefix: str) -> None:
        super().__init__()
        tp = make_linear.tp
        # This tp rank's heads: its share of the query heads, its KV heads (one, replicated, where
        # tp exceeds them); at tp 1 all of them.
        self.num_heads = tp.shard(arch.num_attention_heads, "num_attention_heads")
        self.num_kv_heads = kv_heads_per_rank(arch.num_key_value_heads, tp.size)
        self.head_dim = arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        kv_rows = kv_head_shard(arch.num_key_value_heads, self.head_dim, tp)
        self.qkv_proj = make_linear.column(
            [f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"], arch.hidden_size,
            [split(arch.num_attention_heads * self.head_dim, tp), kv_rows, kv_rows], arch.attention_bias)
        self.o_proj = make_linear.row(f"{prefix}.o_proj", arch.num_attention_heads * self.head_dim,
                                      arch.hidden_size, arch.o_proj_bias)
        # Qwen3: each head's q and k normalised over head_dim before RoPE.
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.rotary = rotary
        self.backend = backend
        self.kv_cache: torch.Tensor | None = None
        """[2, num_blocks, block_size, num_kv_heads, head_dim], bound by the worker."""

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attend ``x [T, hidden]`` (the input norm's output) over the request contexts described
        by ``meta``: ``o_proj`` of the attention over the rotated q/k, the new k/v cached."""
        qkv = self.norm_heads(self.qkv_proj(x))
        out = attend(self.backend, self.rotary, positions, qkv, self.kv_cache, meta, self.scale,
                     self.num_heads, self.num_kv_heads, self.head_dim)
        return self.o_proj(out)

    def forward_fused(
        self, positions: torch.Tensor, norm: RMSNorm, h: torch.Tensor | SplitPartials,
        residual: torch.Tensor | None, meta: AttentionMetadata,
    ) -> tuple[torch.Tensor | SplitPartials, torch.Tensor]:
        """``norm`` (the input norm, adding ``h`` to ``residual`` first) and then :meth:`forward`,
        with the launches picked where the fused ops run (module docstring); returns the output,
        possibly split partials for the next norm to merge, and the residual."""
        folded = layers.norm_linear(norm, self.qkv_proj, h, residual)
        if folded is not None:
            qkv, residual = folded
        else:
            x, residual = norm(h, residual)
            # Per-head q/k norms (Qwen3) read the projection merged; else the attention may merge it.
            then = attention_input(self.backend, meta, x) if self.q_norm is None else None
            qkv = layers.linear(self.qkv_proj, x, after="norm", then=then)
        qkv = self.norm_heads(qkv)
        out = attend(self.backend, self.rotary, positions, qkv, self.kv_cache, meta, self.scale,
                     self.num_heads, self.num_kv_heads, self.head_dim)
        return layers.linear(self.o_proj, out, after="attention", then="norm"), residual

    def norm_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """``qkv`` with each q and k head through ``q_norm`` / ``k_norm`` (a model with them),
        else ``qkv`` itself."""
        if self.q_norm is None:
            return qkv
        if layers.fused_ops_for(qkv) is not None:  # in place, one launch
            from pprun.layers.head_norm import head_rms_norm_

            return head_rms_norm_(qkv, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                  self.num_heads, self.num_kv_heads, self.head_dim)
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, _ = self.q_norm(q.reshape(-1, self.head_dim))
        k, _ = self.k_norm(k.reshape(-1, self.head_dim))
        return torch.cat([q.view(num_tokens, -1), k.view(num_tokens, -1), v], dim=-1)


class MLP(nn.Module):
    """SwiGLU feed-forward with gate and up fused into one matmul."""

    def __init__(self, arch: ModelArchConfig, make_linear: LinearFactory, prefix: str) -> None:
        super().__init__()
        tp = make_linear.tp
        rows = split(arch.intermediate_size, tp)
        self.intermediate_size = rows.size
        """This tp rank's share of the intermediate width (all of it at tp 1)."""
        self.gate_up_proj = make_linear.column([f"{prefix}.gate_proj", f"{prefix}.up_proj"], arch.hidden_size,
                                               [rows, rows], arch.mlp_bias)
        self.down_proj = make_linear.row(f"{prefix}.down_proj", arch.intermediate_size, arch.hidden_size,
                                         arch.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``down(silu(gate(x)) * up(x))``."""
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def forward_fused(
        self, norm: RMSNorm, h: torch.Tensor | SplitPartials, residual: torch.Tensor, then: str | None,
    ) -> tuple[torch.Tensor | SplitPartials, torch.Tensor]:
        """``norm`` (the post-attention norm) and then :meth:`forward`, with the launches picked
        where the fused ops run (module docstring); ``then="norm"``: a norm reads the output, so
        it may be split partials."""
        folded = layers.norm_linear(norm, self.gate_up_proj, h, residual, swiglu=True)
        if folded is not None:
            act, residual = folded
            return layers.linear(self.down_proj, act, then=then), residual
        x, residual = norm(h, residual)
        act = layers.linear_swiglu(self.gate_up_proj, x)
        if act is not None:
            return layers.linear(self.down_proj, act, then=then), residual
        # Rows the split-K kernels do not take (prefill, wide batches): cuBLAS, the fused activation.
        return self.down_proj(layers.fused_ops_for(x).silu_and_mul(self.gate_up_proj(x))), residual


class DecoderLayer(nn.Module):
    """Pre-norm transformer block; carries the residual stream separately."""

    def __init__(self, arch: ModelArchConfig, rotary: RotaryEmbedding, backend: Callable, layer: int = 0,
                 make_linear: LinearFactory | None = None) -> None:
        super().__init__()
        prefix = f"model.layers.{layer}"
        self.index = layer
        """The layer's global index (its checkpoint names')."""
        if make_linear is None:  # a layer on its own (tests): plain linears unless the arch is quantized
            make_linear = LinearFactory(arch, torch.device("cpu"), torch.float32)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, rotary, backend, make_linear, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        # A mixture-of-experts model's sparse layers (``layer``: the global index) hold experts.
        if arch.moe is not None and arch.moe.is_sparse(layer):
            experts = f"{prefix}.{arch.moe.checkpoint_prefix}"
            self.mlp: nn.Module = SparseMoeBlock(arch.moe, arch.hidden_size, make_linear.tp,
                                                 fp8=make_linear.fp8_experts(experts, arch.moe))
        else:
            self.mlp = MLP(arch, make_linear, f"{prefix}.mlp")

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the block's output and the updated residual, not yet added together: each
        norm adds its input to the residual first (with no residual, the input is it)."""
        h, residual = self.input_layernorm(hidden_states, residual)
        h = self.self_attn(positions, h, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    def forward_fused(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor | SplitPartials,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        feeds_norm: bool,
    ) -> tuple[torch.Tensor | SplitPartials, torch.Tensor]:
        """:meth:`forward` where the fused ops run, each block picking its launches (module
        docstring); ``feeds_norm``: a norm reads the output, so it may be split partials."""
        h, residual = self.self_attn.forward_fused(positions, self.input_layernorm, hidden_states, residual, meta)
        return self.mlp.forward_fused(self.post_attention_layernorm, h, residual, "norm" if feeds_norm else None)


class LlamaForCausalLM(PprunModel):
    """A Llama-family causal LM holding only the parts one pipeline stage owns (a text-only
    decoder: :class:`~pprun.models.base.PprunModel`'s declarations as they are)."""

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
        self.arch = arch
        self.layout = layout
        self.tp = tp if tp is not None else TensorParallel.single()
        self.dtype = dtype
        self.device = device
        rotary = RotaryEmbedding(arch, max_positions, device)
        # Each linear layer in its form: FP8 where an FP8 checkpoint's weights stay FP8 on this
        # run; this tp rank's shard of it under tensor parallelism.
        make_linear = LinearFactory(arch, device, dtype, self.tp)
        # Built on the meta device: nothing is allocated until ``allocate`` below, and then
        # only this stage's modules exist at all.
        with torch.device("meta"):
            self.embed_tokens = vocab_embedding(arch.vocab_size, arch.hidden_size, self.tp) if layout.is_first else None
            self.layers = nn.ModuleList(
                DecoderLayer(arch, rotary, attn_backend, i, make_linear) for i in layout.layer_range
            )
            if layout.is_last:
                self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
                self.lm_head = lm_head(arch.vocab_size, arch.hidden_size, self.tp)
            else:
                self.norm = None
                self.lm_head = None
        allocate(self, device, dtype)
        self.fp8_weight_names = frozenset(make_linear.fp8_weight_names)
        if layout.is_first and layout.is_last and arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    # --- forward -----------------------------------------------------------------------------

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings (first stage only)."""
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None,
        intermediate_tensors: IntermediateTensors | None,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor | IntermediateTensors:
        """Run this stage's layers over a flattened batch of tokens."""
        if self.layout.is_first:
            h = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        else:
            if intermediate_tensors is None:
                raise ValueError(
                    f"stage {self.layout.pp_rank} is not the first stage and needs "
                    "intermediate_tensors"
                )
            h = intermediate_tensors["hidden_states"]
        h, residual = self._run_layers(positions, h, attn_metadata)
        if not self.layout.is_last:
            # The residual stream itself (see the module docstring): one tensor on the wire.
            return IntermediateTensors({"hidden_states": h + residual})
        h, _ = self.norm(h, residual)
        return h

    def _run_layers(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor | SplitPartials, torch.Tensor]:
        """This stage's layers over ``hidden_states``, the residual stream (every stage's first
        layer starts from it alone): each layer's ``forward``, or where the fused ops run its
        ``forward_fused``.  Returns the last layer's output and residual, not yet added; the last
        stage's output goes into the final norm, which may merge split partials as it reads them,
        any other stage's is merged here (it is sent on)."""
        residual: torch.Tensor | None = None
        h: torch.Tensor | SplitPartials = hidden_states
        if layers.fused_ops_for(hidden_states) is None:
            for layer in self.layers:
                h, residual = layer(positions, h, residual, meta)
            return h, residual
        into_norm = self.layout.is_last
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            h, residual = layer.forward_fused(positions, h, residual, meta, feeds_norm=into_norm or i < last)
        return (h if into_norm else merged(h)), residual

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """LM-head logits for the given (last stage) hidden states."""
        return linear(self.lm_head, hidden_states)

    def make_empty_intermediate_tensors(
        self, num_tokens: int, dtype: torch.dtype, device: torch.device
    ) -> IntermediateTensors:
        """Receive buffers for what the previous stage sends (persistent in the runner): the
        residual stream, ``hidden_states``."""
        shape = (num_tokens, self.arch.hidden_size)
        return IntermediateTensors({"hidden_states": torch.zeros(shape, dtype=dtype, device=device)})

    # --- KV cache ----------------------------------------------------------------------------

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Give each owned layer its cache tensor, in layer order."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        for layer, cache in zip(self.layers, kv_caches):
            layer.self_attn.kv_cache = cache

    # --- weights -----------------------------------------------------------------------------

    def checkpoint_names(self) -> list[str]:
        """The checkpoint tensors this stage reads (and no others)."""
        from pprun.models.hf_config import expected_tensor_shapes

        names = list(
            expected_tensor_shapes(
                self.arch,
                self.layout.layer_range,
                first=self.layout.is_first,
                last=self.layout.is_last,
            )
        )
        return names

    def checkpoint_shards(self) -> dict[str, Shard]:
        """The part of each checkpoint tensor this tp rank reads, where it reads a part (see
        ``pprun.layers.parallel_linear``): empty at tp 1."""
        if self.tp.size == 1:
            return {}
        shards: dict[str, Shard] = {}
        if self.embed_tokens is not None:
            shards["model.embed_tokens.weight"] = self.embed_tokens.shard
        if self.lm_head is not None:
            shards["lm_head.weight" if not self.arch.tie_word_embeddings else "model.embed_tokens.weight"] = (
                self.lm_head.shard)
        for layer in self.layers:
            shards |= linear_shards(layer.self_attn.qkv_proj) | linear_shards(layer.self_attn.o_proj)
            if isinstance(layer.mlp, SparseMoeBlock):
                shards |= layer.mlp.expert_shards(f"model.layers.{layer.index}.{self.arch.moe.checkpoint_prefix}")
            else:
                shards |= linear_shards(layer.mlp.gate_up_proj) | linear_shards(layer.mlp.down_proj)
        return shards

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors (this tp rank's shards of them: :meth:`checkpoint_shards`) into
        this stage's parameters; returns the names loaded.

        q/k/v land in row blocks of ``qkv_proj``; gate/up in ``gate_up_proj``; a tied
        ``lm_head`` takes ``model.embed_tokens.weight`` on the last stage.
        """
        loaded: set[str] = set()
        start = self.layout.start_layer
        a = self.arch
        for name, tensor in weights:
            target: torch.Tensor | None = None
            if name == "model.embed_tokens.weight":
                if self.embed_tokens is not None:
                    load_vocab_rows(self.embed_tokens.weight, tensor)
                if self.lm_head is not None and a.tie_word_embeddings:
                    load_vocab_rows(self.lm_head.weight, tensor)
                loaded.add(name)
                continue
            if name == "model.norm.weight":
                target = self.norm.weight
            elif name == "lm_head.weight":
                load_vocab_rows(self.lm_head.weight, tensor)
                loaded.add(name)
                continue
            elif name.startswith("model.layers."):
                idx_str, rest = name[len("model.layers.") :].split(".", 1)
                layer = self.layers[int(idx_str) - start]
                part, param = rest.rsplit(".", 1)
                if part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                    attn = layer.self_attn  # this rank's q, k and v rows, in that order
                    q_size, kv_size = attn.q_size, attn.kv_size
                    row0, rows = {"q": (0, q_size), "k": (q_size, kv_size),
                                  "v": (q_size + kv_size, kv_size)}[part[len("self_attn.")]]
                    _copy_rows(layer.self_attn.qkv_proj, param, row0, rows, tensor)
                    loaded.add(name)
                    continue
                if isinstance(layer.mlp, SparseMoeBlock) and part.startswith(f"{a.moe.checkpoint_prefix}."):
                    # The sparse block (Mixtral's block_sparse_moe, Qwen3-MoE's mlp) is layer.mlp.
                    sub = part[len(a.moe.checkpoint_prefix) + 1 :]
                    if sub.startswith("experts.") and sub.count(".") == 2:
                        _, expert, proj = sub.split(".")
                        layer.mlp.load_expert(int(expert), proj, tensor, param)
                        loaded.add(name)
                        continue
                    if sub != "gate":
                        raise ValueError(f"checkpoint tensor {name!r} has no place in this model")
                    target = layer.mlp.gate.get_parameter(param)
                elif part in ("mlp.gate_proj", "mlp.up_proj"):
                    inter = layer.mlp.intermediate_size  # this rank's
                    _copy_rows(layer.mlp.gate_up_proj, param, 0 if part == "mlp.gate_proj" else inter, inter, tensor)
                    loaded.add(name)
                    continue
                if target is None and param in _SCALES:
                    module = layer.get_submodule(part)
                    _copy_rows(module, param, 0, module.out_features, tensor)
                    loaded.add(name)
                    continue
                if target is None:
                    target = layer.get_submodule(part).get_parameter(param)
            if target is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in this model")
            target.data.copy_(tensor)
            loaded.add(name)
        return loaded


_SCALES = ("weight_scale", "weight_scale_inv")
"""An FP8 checkpoint's weight scales (kept beside float8 weights by ``Fp8Linear``)."""


def _copy_rows(module: nn.Module, param: str, row0: int, rows: int, tensor: torch.Tensor) -> None:
    """A checkpoint tensor of a layer fused from several (its rows ``row0 : row0 + rows``) into
    place: a weight or bias as rows, an FP8 weight's scale through the layer's ``load_scale``."""
    if param in _SCALES:
        module.load_scale(row0, rows, tensor)
    else:
        getattr(module, param).data[row0 : row0 + rows].copy_(tensor)
