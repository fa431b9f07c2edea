"""Tensor parallelism, model side: stage models split over tp ranks against transformers (fp32).

Each case forks ``tp`` ranks (one gloo group, world = tp) that build every stage of the model
(pp pieces chained by hand on each rank, as in ``test_model_parity``) with their
``TensorParallel``, read only their shards of a tiny random checkpoint, prefill three prompts
and decode one more token each; every rank's logits must equal transformers' (to fp32
rounding) and pick its tokens.  The matrix, run in two rank groups (tp 2: every model at pp 1,
and at pp 2 those whose later stages hold something of their own: a tied head reading the
embedding's shard, Llava's language model without its tower, Whisper's cross caches; tp 4: the
models whose sizes tp 4 divides):

- Llama (4 heads, 2 KV heads; at tp 4 each KV head replicated on two ranks), untied;
- Qwen3 with one KV head (replicated on every rank), tied embeddings;
- Qwen3-MoE (experts split along their intermediate width, a dense layer among them);
- Mixtral (every layer sparse);
- Llava (CLIP tower replicated, language model split; a 53-token vocabulary: padded shards);
- Whisper (encoder replicated, decoder split; a 101-token vocabulary).

Without processes: each rank's shards of every tensor tile the checkpoint tensor exactly, the KV
cache holds a rank's heads, and ``check_tensor_parallel`` refuses what it must.
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest
import torch
from tiny_models import (
    make_tiny_llama,
    make_tiny_llava,
    make_tiny_mixtral,
    make_tiny_qwen3,
    make_tiny_qwen3_moe,
    make_tiny_whisper,
)
from two_ranks import PRELOAD, _with_env

from pprun.attention.backend import reference_backend
from pprun.attention.cross import CrossAttentionMetadata
from pprun.attention.metadata import AttentionMetadata
from pprun.config.validate import even_partition
from pprun.distributed.intermediate import IntermediateTensors
from pprun.distributed.layout import StageLayout
from pprun.distributed.tensor_parallel import TensorParallel
from pprun.models.checkpoint import CheckpointIndex
from pprun.models.hf_config import load_arch_config
from pprun.models.parallelism import check_tensor_parallel

BLOCK = 4
BLOCKS_PER_REQ = 10
CPU = torch.device("cpu")
PROMPTS = [[5, 17, 42, 9, 30, 3, 7], [11, 12], [20, 21, 22, 7, 7, 7, 7, 7, 13, 14]]
NEXT = [8, 9, 10]
"""The token each prompt decodes next (any token: the logits are compared, not sampled)."""
WHISPER_PROMPTS = [[98, 100, 7], [98, 100], [98, 100, 11, 12, 13]]

MAKERS = {
    "llama": lambda p: make_tiny_llama(p, num_layers=4),
    "qwen3-kv1": lambda p: make_tiny_qwen3(p, num_key_value_heads=1, tied=True),
    "qwen3-moe": lambda p: make_tiny_qwen3_moe(p),
    "mixtral": lambda p: make_tiny_mixtral(p),
    "llava": lambda p: make_tiny_llava(p, text_heads=4),
    "whisper": lambda p: make_tiny_whisper(p, d_model=48, heads=4),
}
PP2 = ("llama", "qwen3-kv1", "llava", "whisper")
"""The models run at tp 2 x pp 2 too."""
TP4 = ("llama", "qwen3-kv1")
"""The models run at tp 4 too (4 heads; 2 and 1 KV heads: replicated on 2 and on 4 ranks)."""


# --- the harness -------------------------------------------------------------------------------


def run_ranks(target, world_size: int, *args, timeout_s: float = 300.0) -> dict[int, object]:
    """Run ``target(rank, world_size, init_method, *args, out)`` in ``world_size`` processes
    forked from a template that imported torch (``two_ranks``); each puts ``(rank, result)`` on
    ``out``, or ``(rank, traceback text)`` when it fails.  Returns ``{rank: result}`` once every
    process has exited with code 0; a failed rank fails the test at once (the others, waiting
    in a collective, are killed)."""
    import queue
    import time

    from pprun.executor.mp import free_port

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    out = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    env = dict(os.environ)
    procs = [ctx.Process(target=_with_env, args=(env, target, rank, world_size, init_method, *args, out))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size:
            try:
                rank, result = out.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                assert not dead, f"tp ranks {dead} died without a result"
                assert time.monotonic() < deadline, f"tp ranks gave no result within {timeout_s} s"
                continue
            assert not isinstance(result, str), f"tp rank {rank} failed:\n{result}"
            results[rank] = result
    finally:
        for p in procs:
            p.join(timeout=10 if len(results) < world_size else 60)
            if p.is_alive():
                p.kill()
                p.join()
    for rank, p in enumerate(procs):
        assert p.exitcode == 0, f"tp rank {rank} exited with {p.exitcode}"
    return results


def step_meta(windows: list[tuple[int, int]], cross: bool = False, device: torch.device = CPU) -> AttentionMetadata:
    """Metadata for request ``i`` computing positions ``[start, end)`` of ``windows[i]``, its
    cache in blocks ``1 + i * BLOCKS_PER_REQ ...`` (Whisper's: its cross slot ``i + 1``)."""
    tables = [[1 + i * BLOCKS_PER_REQ + b for b in range(BLOCKS_PER_REQ)] for i in range(len(windows))]
    starts, slots, seq_lens = [0], [], []
    for (start, end), table in zip(windows, tables, strict=True):
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)]
        starts.append(starts[-1] + end - start)
        seq_lens.append(end)
    return AttentionMetadata(
        num_reqs=len(windows), num_reqs_padded=len(windows), num_tokens=starts[-1], num_tokens_padded=starts[-1],
        max_query_len=max(e - s for s, e in windows),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=torch.tensor(tables, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        cross=CrossAttentionMetadata(
            encoder_seq_lens=torch.tensor([15] * len(windows), dtype=torch.int32, device=device),
            cross_slots=torch.arange(1, len(windows) + 1, dtype=torch.int32, device=device),
        ) if cross else None,
    )


def build_stages(model_dir: Path, pp: int, tp: TensorParallel, device: torch.device = CPU,
                 dtype: torch.dtype = torch.float32) -> list:
    """This tp rank's model of every stage of a ``pp``-stage pipeline, caches bound (on a GPU:
    the Triton attention, so the fused decoder path runs)."""
    from pprun.attention.backend import get_backend
    from pprun.worker.kv_cache import allocate_cross_caches, allocate_kv_caches
    from pprun.worker.model_loader import load_stage_model

    arch = load_arch_config(model_dir)
    partition = even_partition(arch.num_hidden_layers, pp)
    num_blocks = 1 + len(PROMPTS) * BLOCKS_PER_REQ
    stages = []
    for pp_rank in range(pp):
        layout = StageLayout.from_partition(partition, pp_rank)
        model = load_stage_model(model_dir, arch, layout, device=device, dtype=dtype, max_positions=64,
                                 attn_backend=get_backend("auto", device), tp=tp)
        model.bind_kv_caches(allocate_kv_caches(arch, layout.num_layers, num_blocks, BLOCK, dtype, device,
                                                tp_size=tp.size))
        if model.is_encoder_decoder:
            model.bind_cross_caches(allocate_cross_caches(model, len(PROMPTS) + 1, dtype, device))
        stages.append(model)
    return stages


def run_step(stages: list, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
             inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
    """One step through the stages chained by hand; the logits of every token."""
    it = None
    for model in stages:
        first = model.layout.is_first
        out = model(input_ids=ids if first and inputs_embeds is None else None, positions=positions,
                    inputs_embeds=inputs_embeds if first else None, intermediate_tensors=it, attn_metadata=meta)
        if model.layout.is_last:
            return model.compute_logits(out)
        it = IntermediateTensors({k: v.clone() for k, v in out.items()})
    raise AssertionError("unreachable")


def llava_inputs(model_dir: Path) -> list[dict]:
    """Each prompt with one image, as transformers' processor makes it (ids with the image
    placeholder expanded, pixel values)."""
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir, backend="pil")
    out = []
    for i, words in enumerate(["what is this", "describe the image", "the cat"]):
        gen = torch.Generator().manual_seed(i)
        pixels = (torch.rand(30, 30, 3, generator=gen) * 255).to(torch.uint8).numpy()
        out.append(dict(processor(text=f"USER: <image> {words} ?", images=[Image.fromarray(pixels)],
                                  return_tensors="pt")))
    return out


def whisper_features() -> torch.Tensor:
    return torch.randn(len(WHISPER_PROMPTS), 7, 30, generator=torch.Generator().manual_seed(1))


@torch.inference_mode()
def model_logits(name: str, model_dir: Path, pp: int, tp: TensorParallel, device: torch.device = CPU,
                 dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Per prompt: the logits (float32, on the CPU) at its last prompt token and at its decoded token."""
    stages = build_stages(model_dir, pp, tp, device, dtype)
    first = stages[0]
    if name == "whisper":
        prompts = WHISPER_PROMPTS
        enc = first.encode(whisper_features().to(device))
        for model in stages:
            model.write_cross_kv(enc, torch.arange(1, len(prompts) + 1, device=device))
    elif name == "llava":
        prompts = [x["input_ids"][0].tolist() for x in llava_inputs(model_dir)]
    else:
        prompts = PROMPTS
    ids = torch.tensor([t for p in prompts for t in p], device=device)
    positions = torch.tensor([i for p in prompts for i in range(len(p))], device=device)
    embeds = None
    if name == "llava":
        from pprun.multimodal.items import MultiModalItem, PlaceholderRange

        embeds = first.embed_input_ids(ids)
        items = [MultiModalItem("image", str(i), PlaceholderRange(0, 1), {"pixel_values": x["pixel_values"][0]})
                 for i, x in enumerate(llava_inputs(model_dir))]
        embeds[ids == first.image_token_index] = torch.cat(first.encode_items(items))
    cross = name == "whisper"
    logits = run_step(stages, ids, positions, step_meta([(0, len(p)) for p in prompts], cross, device), embeds)
    last = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    decode = run_step(stages, torch.tensor(NEXT, device=device), torch.tensor([len(p) for p in prompts], device=device),
                      step_meta([(len(p), len(p) + 1) for p in prompts], cross, device))
    return [torch.stack([logits[last[i]], decode[i]]).float().cpu() for i in range(len(prompts))]


def _rank(rank: int, world_size: int, init_method: str, cases: list[tuple[str, str, int]], device_type: str,
          dtype_name: str, out) -> None:
    """One tp rank: gloo on the CPU; on GPUs NCCL, rank ``r`` on GPU ``r`` (and rank 0 also runs
    each case at tp 1 on its GPU, under ``(name, pp, "tp1")``)."""
    import torch.distributed as dist

    backend = "nccl" if device_type == "cuda" else "gloo"
    device = torch.device(device_type, rank) if device_type == "cuda" else CPU
    if device_type == "cuda":
        torch.cuda.set_device(device)
    dtype = getattr(torch, dtype_name)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    try:
        tp = TensorParallel(rank, world_size, dist.new_group(list(range(world_size)), backend=backend))
        try:
            summed = tp.all_reduce(torch.full((2,), float(rank + 1), device=device))
            gathered = tp.all_gather(torch.tensor([[rank, 10 + rank]], device=device), dim=-1)
            sent = tp.broadcast(torch.tensor([rank], device=device), src=world_size - 1)
            collectives = (summed.tolist(), gathered.tolist(), sent.tolist())
            # numpy arrays: pickled whole (torch would pass a tensor's storage by a file descriptor,
            # which dies with this process).
            result = {(name, pp): [t.numpy() for t in model_logits(name, Path(path), pp, tp, device, dtype)]
                      for name, path, pp in cases}
            if device_type == "cuda" and rank == 0:
                result |= {(name, pp, "tp1"): [t.numpy() for t in model_logits(
                    name, Path(path), pp, TensorParallel.single(), device, dtype)] for name, path, pp in cases}
            result["collectives"] = collectives
        except Exception:
            import traceback

            out.put((rank, traceback.format_exc()))
            os._exit(1)  # the other ranks may wait in a collective: no orderly teardown
        out.put((rank, result))
    finally:
        dist.destroy_process_group()


def hf_logits(name: str, model_dir: Path) -> list[torch.Tensor]:
    """transformers' logits at each prompt's last token and at its decoded token (``NEXT``)."""
    with torch.no_grad():
        if name == "whisper":
            from transformers import WhisperForConditionalGeneration

            model = WhisperForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
            feats = whisper_features()
            return [model(input_features=feats[i : i + 1], decoder_input_ids=torch.tensor([p + [NEXT[i]]]))
                    .logits[0, -2:] for i, p in enumerate(WHISPER_PROMPTS)]
        if name == "llava":
            from transformers import LlavaForConditionalGeneration

            model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
            rows = []
            for i, x in enumerate(llava_inputs(model_dir)):
                ids = torch.cat([x["input_ids"], torch.tensor([[NEXT[i]]])], dim=1)
                rows.append(model(input_ids=ids, pixel_values=x["pixel_values"]).logits[0, -2:])
            return rows
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        return [model(torch.tensor([p + [NEXT[i]]])).logits[0, -2:] for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp_models")
    return {name: make(root / name) for name, make in MAKERS.items()}


@pytest.fixture(scope="module")
def references(model_dirs) -> dict[str, list[torch.Tensor]]:
    return {name: hf_logits(name, path) for name, path in model_dirs.items()}


def assert_matches(ours: dict, references: dict, tol: float = 1e-4) -> None:
    for (name, pp), rows in ours.items():
        for i, (got, ref) in enumerate(zip(rows, references[name], strict=True)):
            got = torch.from_numpy(got)
            where = f"{name} pp={pp} prompt {i}"
            torch.testing.assert_close(got, ref, atol=tol, rtol=tol, msg=lambda m, w=where: f"{w}: {m}")
            assert got.argmax(-1).tolist() == ref.argmax(-1).tolist(), where


def test_tp2_every_model_matches_transformers(model_dirs, references):
    """tp 2 x pp 1 for every model, tp 2 x pp 2 for :data:`PP2`: every rank's logits are
    transformers'."""
    cases = [(name, str(path), pp) for name, path in model_dirs.items() for pp in ((1, 2) if name in PP2 else (1,))]
    results = run_ranks(_rank, 2, cases, "cpu", "float32")
    for rank in (0, 1):
        assert_matches({k: v for k, v in results[rank].items() if k != "collectives"}, references)


@pytest.fixture(scope="module")
def tp4_results(model_dirs) -> dict[int, dict]:
    """Each of 4 tp ranks' results: :data:`TP4` at pp 1, and its collectives' (``"collectives"``)."""
    return run_ranks(_rank, 4, [(name, str(model_dirs[name]), 1) for name in TP4], "cpu", "float32")


def test_tp4_replicated_kv_heads_match_transformers(tp4_results, references):
    """tp 4 over 2 and over 1 KV heads (each KV head replicated on 2 and on 4 ranks)."""
    for rank in range(4):
        assert_matches({k: v for k, v in tp4_results[rank].items() if k != "collectives"}, references)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_fused_split_forward_matches_one_gpu(model_dirs, references):
    """tp 2 on two GPUs (NCCL), bf16, where the fused decoder path runs: column shards through the
    split-K kernels and the norm fold, the row shards' all-reduce before the next norm, the
    experts' partial sums merged before theirs.  Each rank's logits match the same model's at tp 1
    on one GPU (to bf16 rounding: the sums run in another order), and fp32 matches transformers."""
    text = ("llama", "qwen3-kv1", "qwen3-moe", "mixtral")
    results = run_ranks(_rank, 2, [(name, str(model_dirs[name]), pp) for name in text for pp in (1, 2)],
                        "cuda", "bfloat16")
    for rank in (0, 1):
        for (name, pp), rows in ((k, v) for k, v in results[rank].items() if isinstance(k, tuple) and len(k) == 2):
            for got, want in zip(rows, results[0][(name, pp, "tp1")], strict=True):
                torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(want), atol=3e-2, rtol=3e-2)
    fp32 = run_ranks(_rank, 2, [(name, str(model_dirs[name]), 1) for name in text], "cuda", "float32")
    # fp32 on the GPU: Triton attention and fused norms round apart from the CPU's torch.
    assert_matches({k: v for k, v in fp32[1].items() if k != "collectives"}, references, tol=1e-3)


def test_tensor_parallel_collectives(tp4_results):
    """``TensorParallel`` over 4 gloo ranks (the tp 4 ranks' first work): the all-reduce sums, the
    all-gather concatenates in rank order along the given dim, the broadcast copies the source
    rank's tensor; a size 1 group touches nothing, and a place outside the group or a group
    missing is refused."""
    for rank in range(4):
        assert tp4_results[rank]["collectives"] == ([10.0, 10.0], [[0, 10, 1, 11, 2, 12, 3, 13]], [3])
    single = TensorParallel.single()
    x = torch.ones(2)
    assert single.all_reduce(x) is x and single.all_gather(x) is x and single.broadcast(x) is x
    with pytest.raises(ValueError, match="tp rank 2 outside 0..1"):
        TensorParallel(2, 2, group=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs a process group"):
        TensorParallel(0, 2, None)


# --- without processes ---------------------------------------------------------------------------


def _ranks(size: int) -> list[TensorParallel]:
    """Every rank's place in a group of ``size``, for building models (no collective runs)."""
    return [TensorParallel(rank, size, group=object()) for rank in range(size)]  # type: ignore[arg-type]


@pytest.mark.parametrize(("name", "size"), [("llama", 2), ("llama", 4), ("qwen3-kv1", 2), ("qwen3-moe", 2),
                                             ("mixtral", 2), ("llava", 2), ("whisper", 2)])
def test_each_rank_reads_its_shard_and_the_shards_tile_each_tensor(model_dirs, name, size):
    """What each rank reads of a split tensor is its shard, no more; the ranks' shards of a tensor
    put together are the tensor (KV heads replicated past their count: each head once per
    ``size / kv_heads`` ranks); every tensor a rank claims reaches a parameter."""
    from pprun.worker.model_loader import load_stage_model

    path = model_dirs[name]
    arch = load_arch_config(path)
    index = CheckpointIndex.open(path, arch)
    layout = StageLayout.single(arch.num_hidden_layers)
    read: dict[str, list[torch.Tensor]] = {}
    for tp in _ranks(size):
        model = load_stage_model(path, arch, layout, device=CPU, dtype=torch.float32, max_positions=64,
                                 attn_backend=reference_backend, tp=tp)
        shards = model.checkpoint_shards()
        assert shards, "a tp rank reads parts of tensors"
        for tensor_name, tensor in index.iter_tensors(model.checkpoint_names(), shards=shards):
            if tensor_name in shards:
                shard = shards[tensor_name]
                assert tensor.shape[shard.dim] == shard.size <= index.shape(tensor_name)[shard.dim], tensor_name
                read.setdefault(tensor_name, []).append((shard, tensor))
    whole = index.load(list(read))
    kv_copies = max(1, size // arch.num_key_value_heads)
    for tensor_name, parts in read.items():
        dim = parts[0][0].dim
        unique = {(s.start, s.size): t for s, t in parts}
        copies = len(parts) // len(unique)
        if ".k_proj." in tensor_name or ".v_proj." in tensor_name:
            assert copies == (kv_copies if name != "whisper" else 1), tensor_name
        else:
            assert copies == 1, tensor_name
        joined = torch.cat([unique[k] for k in sorted(unique)], dim=dim)
        assert torch.equal(joined, whole[tensor_name]), tensor_name


def test_kv_cache_holds_a_ranks_heads(model_dirs):
    """A rank's cache block holds its KV heads: half at tp 2 of 2 heads, one head (replicated)
    at tp 4 of 2 and at tp 2 of 1."""
    from pprun.worker.kv_cache import allocate_kv_caches, bytes_per_block

    llama, qwen3 = load_arch_config(model_dirs["llama"]), load_arch_config(model_dirs["qwen3-kv1"])
    one = bytes_per_block(llama, 2, BLOCK, torch.float32)
    assert bytes_per_block(llama, 2, BLOCK, torch.float32, tp_size=2) * 2 == one
    assert bytes_per_block(llama, 2, BLOCK, torch.float32, tp_size=4) * 2 == one
    assert bytes_per_block(qwen3, 2, BLOCK, torch.float32, tp_size=2) == bytes_per_block(qwen3, 2, BLOCK, torch.float32)
    (cache,) = allocate_kv_caches(llama, 1, 3, BLOCK, torch.float32, CPU, tp_size=2)
    assert cache.shape == (2, 3, BLOCK, 1, llama.head_dim)


def test_check_tensor_parallel_refuses_what_cannot_split(model_dirs):
    """A tp that does not divide the attention heads, that neither divides nor is a multiple of
    the KV heads, or that does not divide an intermediate width is refused, naming
    ``tensor_parallel_size``, the value and the counts."""
    from dataclasses import replace

    llama = load_arch_config(model_dirs["llama"])  # 4 heads, 2 KV heads, intermediate 128
    for ok in (1, 2, 4):
        check_tensor_parallel(llama, ok)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 .*num_attention_heads=4, num_key_value_heads=2"):
        check_tensor_parallel(llama, 3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=8 .*num_attention_heads=4"):
        check_tensor_parallel(llama, 8)
    six = replace(llama, num_attention_heads=12, num_key_value_heads=4)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=6 neither divides nor is a multiple of the KV heads"):
        check_tensor_parallel(six, 6)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide .*intermediate_size=130"):
        check_tensor_parallel(replace(llama, intermediate_size=130), 4)
    moe = load_arch_config(model_dirs["qwen3-moe"])  # moe_intermediate_size 40
    with pytest.raises(ValueError, match=r"moe_intermediate_size=40"):
        check_tensor_parallel(replace(moe, num_attention_heads=16, num_key_value_heads=16, intermediate_size=64), 16)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=0 must be a positive integer"):
        check_tensor_parallel(llama, 0)
