#!/usr/bin/env bash
# One GPU session: the Triton kernel tests and every GPU-marked test, then the 1.1B benchmarks
# (V2 full graphs, V1 eager, transformers' generate as the peer; the decode step, prefill and
# memory of scripts/gpu_speed.py; with two GPUs pp=1 vs pp=2, the hop, the control path, async
# pipeline steps on and off, and the NCCL ordering probe).  Results land in
# $OUT (or ./gpu_out).
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
  [ -d /tmp/llama1b ] || python3 scripts/make_random_llama.py /tmp/llama1b --device cuda
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
    timeout 900 python3 scripts/bench_pipeline.py --device cuda --model /tmp/llama1b --parts throughput,hop,control \
      --num-prompts 64 --input-len 512 --output-len 512 --microbatches 3,4 --pp2-executors mp \
      --out "$OUT/bench_pipeline_cuda.json" 2>"$OUT/bench_pipeline_cuda.err" | tail -c 3000
    # Async pipeline steps (parallel.async_pipeline, the default on GPUs) on and off, same machine;
    # then a 64 MiB NCCL message against a CUDA IPC peer copy.
    pp2="python3 -m pprun bench model.model=/tmp/llama1b model.dtype=bfloat16 device=cuda peer=none input_len=512
      output_len=512 parallel=pp2_mp hydra.run.dir=/tmp/hy"
    for mb in 2 3; do
      for ap in false true; do
        timeout 200 $pp2 parallel.microbatches=$mb num_prompts=$((64 * mb)) scheduler.max_num_seqs=$((64 * mb)) \
          parallel.async_pipeline=$ap output_json="$OUT/pp2_mb${mb}_async_$ap.json" >/dev/null 2>&1
        echo "pp2 microbatches=$mb async_pipeline=$ap rc=$?"
      done
    done
    timeout 60 python3 scripts/nccl_order_probe.py 2>&1 | grep '^{' | tee "$OUT/nccl_order_probe.log"
    timeout 60 python3 scripts/ipc_copy_probe.py 2>&1 | grep '^{' | tee "$OUT/ipc_copy_probe.log"
  fi
fi
