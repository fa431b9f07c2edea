"""Parity of pprun's Whisper with transformers (fp32, tiny random config of odd sizes), per stage."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_whisper

from pprun.attention.backend import reference_backend
from pprun.attention.cross import CrossAttentionMetadata, request_of_token
from pprun.attention.metadata import AttentionMetadata
from pprun.config.validate import even_partition
from pprun.distributed.intermediate import IntermediateTensors
from pprun.distributed.layout import StageLayout
from pprun.models.hf_config import load_arch_config
from pprun.worker.kv_cache import allocate_cross_caches, allocate_kv_caches
from pprun.worker.model_loader import load_stage_model

BLOCK = 4
NUM_BLOCKS = 64
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory):
    return make_tiny_whisper(tmp_path_factory.mktemp("whisper"))


@pytest.fixture(scope="module")
def hf_model(whisper_dir):
    from transformers import WhisperForConditionalGeneration

    return WhisperForConditionalGeneration.from_pretrained(whisper_dir, dtype=torch.float32).eval()


def features(batch: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 7, 30, generator=gen)


def step_meta(windows: list[tuple[int, int]], blocks: list[list[int]], slots: list[int],
              num_reqs_padded: int | None = None) -> AttentionMetadata:
    """Metadata for requests computing positions [start, end) each (``windows``)."""
    num_reqs = len(windows)
    num_reqs_padded = num_reqs_padded or num_reqs
    starts, slot_map, seq_lens = [0], [], []
    for (start, end), table in zip(windows, blocks, strict=True):
        slot_map += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)]
        starts.append(starts[-1] + end - start)
        seq_lens.append(end)
    pad = num_reqs_padded - num_reqs
    width = max(len(t) for t in blocks)
    return AttentionMetadata(
        num_reqs=num_reqs, num_reqs_padded=num_reqs_padded, num_tokens=starts[-1],
        num_tokens_padded=starts[-1], max_query_len=max(e - s for s, e in windows),
        query_start_loc=torch.tensor(starts + [starts[-1]] * pad, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens + [0] * pad, dtype=torch.int32),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in blocks] + [[0] * width] * pad,
                                 dtype=torch.int32),
        slot_mapping=torch.tensor(slot_map, dtype=torch.int64),
        cross=CrossAttentionMetadata(
            encoder_seq_lens=torch.tensor([15] * num_reqs + [0] * pad, dtype=torch.int32),
            cross_slots=torch.tensor(slots + [0] * pad, dtype=torch.int32),
        ),
    )


def build_stages(model_dir, pp: int):
    arch = load_arch_config(model_dir)
    partition = even_partition(arch.num_hidden_layers, pp)
    stages = []
    for rank in range(pp):
        layout = StageLayout.from_partition(partition, rank)
        model = load_stage_model(model_dir, arch, layout, device=CPU, dtype=torch.float32,
                                 max_positions=40, attn_backend=reference_backend)
        model.bind_kv_caches(allocate_kv_caches(arch, layout.num_layers, NUM_BLOCKS, BLOCK,
                                                torch.float32, CPU))
        model.bind_cross_caches(allocate_cross_caches(model, 8, torch.float32, CPU))
        stages.append(model)
    return stages


@torch.inference_mode()
def run_step(stages, ids: list[int], positions: list[int], meta: AttentionMetadata) -> torch.Tensor:
    it = None
    for model in stages:
        out = model(input_ids=torch.tensor(ids) if model.layout.is_first else None,
                    positions=torch.tensor(positions), inputs_embeds=None,
                    intermediate_tensors=it, attn_metadata=meta)
        if model.layout.is_last:
            return model.compute_logits(out)
        it = IntermediateTensors({k: v.clone() for k, v in out.items()})
    raise AssertionError("unreachable")


def test_encoder_matches_transformers(whisper_dir, hf_model):
    (model,) = build_stages(whisper_dir, 1)
    feats = features(3)
    with torch.inference_mode():
        ours = model.encode(feats)
        ref = hf_model.model.encoder(feats).last_hidden_state
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pp", [1, 2, 3])
def test_decoder_logits_match_transformers(whisper_dir, hf_model, pp):
    """Prefill of three prompts of different lengths, then two decode steps, against the full
    sequences through transformers; stages chained by hand (each builds and reads its own part)."""
    stages = build_stages(whisper_dir, pp)
    feats = features(3, seed=1)
    prompts = [[98, 100, 7], [98, 100], [98, 100, 11, 12, 13]]
    slots = [3, 1, 5]  # any free slots; slot 0 stays reserved
    with torch.inference_mode():
        enc = stages[0].encode(feats)
        for model in stages:  # the encoder output reaches each stage once
            model.write_cross_kv(enc, torch.tensor(slots))
    blocks = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    windows = [(0, len(p)) for p in prompts]
    ids = [t for p in prompts for t in p]
    positions = [i for p in prompts for i in range(len(p))]
    logits = [run_step(stages, ids, positions, step_meta(windows, blocks, slots))]
    seqs = [list(p) for p in prompts]
    for step in range(2):
        new = [20 + step + i for i in range(3)]
        windows = [(len(s), len(s) + 1) for s in seqs]
        for s, t in zip(seqs, new, strict=True):
            s.append(t)
        logits.append(run_step(stages, new, [w[0] for w in windows],
                               step_meta(windows, blocks, slots, num_reqs_padded=4)))
    with torch.no_grad():
        for i, seq in enumerate(seqs):
            ref = hf_model(input_features=feats[i : i + 1],
                           decoder_input_ids=torch.tensor([seq])).logits[0]
            start = sum(len(p) for p in prompts[:i])
            torch.testing.assert_close(logits[0][start : start + len(prompts[i])],
                                       ref[: len(prompts[i])], atol=1e-4, rtol=1e-4)
            for step in range(2):
                torch.testing.assert_close(logits[1 + step][i], ref[len(prompts[i]) + step],
                                           atol=1e-4, rtol=1e-4)


def test_stage_reads_only_its_tensors(whisper_dir):
    stages = build_stages(whisper_dir, 3)
    names = [set(m.checkpoint_names()) for m in stages]
    assert any(n.startswith("model.encoder.") for n in names[0])
    assert not any(n.startswith("model.encoder.") for n in names[1] | names[2])
    for rank, model in enumerate(stages):
        owned = {f"model.decoder.layers.{i}." for i in model.layout.layer_range}
        layer_names = {n for n in names[rank] if n.startswith("model.decoder.layers.")}
        assert all(any(n.startswith(o) for o in owned) for n in layer_names)
    # The tied projection reads the embeddings on the last stage; nothing else is shared.
    assert names[0] & names[2] == {"model.decoder.embed_tokens.weight"}
    assert not names[0] & names[1] and not names[1] & names[2]


def test_cross_attention_padding_rows_are_zero():
    q = torch.randn(5, 2, 4)
    cache = torch.randn(2, 3, 6, 2, 4)  # [2, slots, source_len, heads, head_dim]
    meta = CrossAttentionMetadata(encoder_seq_lens=torch.tensor([6, 3, 0], dtype=torch.int32),
                                  cross_slots=torch.tensor([2, 1, 0], dtype=torch.int32))
    qsl = torch.tensor([0, 2, 5, 5], dtype=torch.int32)
    from pprun.attention.cross import cross_attention

    out = cross_attention(q, cache, meta, qsl, 0.5)
    assert request_of_token(qsl, 5).tolist() == [0, 0, 1, 1, 1]
    # Request 1 sees only its first 3 encoder positions of slot 1.
    k, v = cache[0, 1, :3].transpose(0, 1), cache[1, 1, :3].transpose(0, 1)  # [heads, 3, head_dim]
    ref = torch.softmax(torch.einsum("hd,hsd->hs", q[2], k) * 0.5, -1)
    torch.testing.assert_close(out[2], torch.einsum("hs,hsd->hd", ref, v))
    # A padding request (length 0) gives zeros, not NaN.
    out = cross_attention(q, cache, CrossAttentionMetadata(
        encoder_seq_lens=torch.tensor([0, 0, 0], dtype=torch.int32),
        cross_slots=torch.zeros(3, dtype=torch.int32)), qsl, 0.5)
    assert torch.equal(out, torch.zeros_like(out))


def test_cross_kv_one_projection_equals_each_layer(whisper_dir):
    """``write_cross_kv`` projects every layer's K/V of every new request at once (the layers'
    kv_proj stacked, cut in groups of layers when the output would be large): each slot then holds
    what that layer's own ``kv_proj`` gives for that request, and other slots are untouched."""
    (model,) = build_stages(whisper_dir, 1)
    with torch.inference_mode():
        enc = model.encode(features(3, seed=2))
        for chunk in (None, 1):  # all layers in one product; one layer per product
            for layer in model.layers:
                layer.encoder_attn.cross_cache.zero_()
            if chunk is not None:
                model.CROSS_KV_CHUNK_BYTES = chunk  # an instance attribute: this model only
            model.write_cross_kv(enc, torch.tensor([5, 2, 7]))
            for layer in model.layers:
                k, v = layer.encoder_attn.project_kv(enc)
                cache = layer.encoder_attn.cross_cache
                torch.testing.assert_close(cache[0, [5, 2, 7]], k, rtol=1e-6, atol=1e-6)
                torch.testing.assert_close(cache[1, [5, 2, 7]], v, rtol=1e-6, atol=1e-6)
                assert not cache[:, [0, 1, 3, 4, 6]].any()


@pytest.mark.parametrize(("source_len", "heads", "dtype"), [(15, 3, torch.float32), (1500, 6, torch.float32),
                                                            (48, 2, torch.float16)])
def test_cross_decode_kernel_equals_gather_and_attend(source_len, heads, dtype):
    """The paged decode kernel over the cross caches in place (what a GPU decode step runs, on CPU
    through the Triton interpreter) gives what gathering each request's slot and attending gives:
    slots in any order, shorter encoder lengths, padding rows (slot 0, length 0) zero."""
    from triton_env import RUN_TRITON

    if not RUN_TRITON:
        pytest.skip("needs CUDA or the Triton interpreter")
    from pprun.attention.cross import cross_attention, cross_decode_attention, cross_page_size

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(source_len)
    head_dim, num_slots = 16, 6
    cache = torch.randn(2, num_slots, source_len, heads, head_dim, generator=gen).to(device, dtype)
    slots = [4, 1, 5, 0, 0]
    lens = [source_len, source_len, source_len - 3, 0, 0]  # two padding rows
    cross = CrossAttentionMetadata(
        encoder_seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        cross_slots=torch.tensor(slots, dtype=torch.int32, device=device),
        one_query_per_row=True,
    )
    q = torch.randn(len(slots), heads, head_dim, generator=gen).to(device, dtype)
    qsl = torch.arange(len(slots) + 1, dtype=torch.int32, device=device)
    got = cross_decode_attention(q, cache, cross, head_dim**-0.5)
    want = cross_attention(q.float(), cache.float(), cross, qsl, head_dim**-0.5)
    if device == "cuda":
        want_gpu = cross_attention(q, cache, cross, qsl, head_dim**-0.5)  # also the kernel
        torch.testing.assert_close(want_gpu, got)
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    assert not got[3:].any()
    assert source_len % cross_page_size(source_len) == 0
    assert cross_page_size(1500) == 4 and cross_page_size(15) == 1 and cross_page_size(4096) == 64
