#!/usr/bin/env bash
# The GPU checks and the figures of docs/performance.md's tables, in one go: the Triton kernel
# tests and every GPU-marked test; then on the 1.1B random model `pprun bench` against
# transformers (batch 1 and 32), the V1 runner, scripts/gpu_speed.py (decode step, prefill,
# memory); with two GPUs pp=1 at batch 64 against pp=2 with 4 batches of 64, and the hop and
# control path (scripts/bench_pipeline.py).  Results land in $OUT (or ./gpu_out).
#   bash scripts/gpu_bench.sh [tests|bench|all]
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
what=${1:-all}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout 300 python3 -m pytest -q -m "not gpu" tests/test_skinny.py tests/test_fused_ops.py tests/test_triton_ops.py \
    tests/test_norm_linear.py -p no:cacheprovider 2>&1 | tail -20 | tee "$OUT/kernel_tests.log"
  timeout 600 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 | tail -40 | tee "$OUT/gpu_tests.log"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  [ -d /tmp/llama1b ] || python3 scripts/make_random_model.py /tmp/llama1b --device cuda
  common="model.model=/tmp/llama1b input_len=512 output_len=128 hydra.run.dir=/tmp/hy"
  for B in 1 32; do
    timeout 200 python3 -m pprun bench $common num_prompts=$B scheduler.max_num_seqs=$B runner=v2 \
      compilation.cudagraph_mode=full peer=hf output_json="$OUT/v2_full_b$B.json" 2>"$OUT/v2_full_b$B.err" | tail -c 2000
    timeout 200 python3 -m pprun bench $common num_prompts=$B scheduler.max_num_seqs=$B runner=v1 \
      compilation.cudagraph_mode=none peer=none output_json="$OUT/v1_b$B.json" 2>"$OUT/v1_b$B.err" | tail -c 1500
  done
  timeout 400 python3 scripts/gpu_speed.py /tmp/llama1b --memory-steps 1000 --out "$OUT/gpu_speed.json" \
    >"$OUT/gpu_speed.log" 2>&1; tail -c 1500 "$OUT/gpu_speed.json"
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    # pp=1 at batch 64 against pp=2 (mp) with 4 batches of 64 in flight, same machine.
    b64="python3 -m pprun bench model.model=/tmp/llama1b model.dtype=bfloat16 device=cuda peer=none input_len=512
      output_len=512 hydra.run.dir=/tmp/hy"
    timeout 300 $b64 parallel=single num_prompts=64 scheduler.max_num_seqs=64 \
      output_json="$OUT/pp1_b64.json" >/dev/null 2>"$OUT/pp1_b64.err"; echo "pp1 b64 rc=$?"
    timeout 300 $b64 parallel=pp2_mp parallel.microbatches=4 num_prompts=256 scheduler.max_num_seqs=256 \
      output_json="$OUT/pp2_b256_mb4.json" >/dev/null 2>"$OUT/pp2_b256_mb4.err"; echo "pp2 4x64 rc=$?"
    timeout 600 python3 scripts/bench_pipeline.py --device cuda --parts control,hop --control-steps 300 \
      --hop-iters 300 --hidden 2048 --out "$OUT/bench_pipeline_cuda.json" 2>"$OUT/bench_pipeline_cuda.err" | tail -c 3000
  fi
fi
