#!/usr/bin/env bash
# The end-to-end serving results on one GPU (H100 or H200): Llama-3-8B and Qwen3-8B shapes with
# random bf16 weights, through `oscar bench`. Each job writes bench/results/<device>/<job>.json
# (+ .png). Usage: bench/serving_gpu.sh JOB [JOB ...] with JOB one of
#   budget-llama      bf16, oscar, fp8, int8 at a 48 GiB KV budget, 8K and 32K, TTFT of bf16 and oscar
#   budget-llama-128k bf16 and oscar at 128K (fp8 and int8 there need more than an H100 leaves)
#   roofline-llama    bf16 and oscar at batch 1, 8, 32 (every cell that fits), 8K/32K/128K
#   budget-qwen       bf16, oscar, fp8, int8 for the Qwen3-8B shape, 8K and 32K
set -uo pipefail
cd "$(dirname "$0")/.."
dev=$(python3 -c "from oscar_jax.models import results as r; print(r.device_folder(r.device_kind()))")
for job in "$@"; do
  case "$job" in
    budget-llama) oscar bench --model llama3-8b --random-weights --kv bf16,oscar,fp8,int8 \
        --contexts 8K,32K --ttft-kv bf16,oscar --out "bench/results/$dev/serving_budget_llama3-8b.json" ;;
    budget-llama-128k) oscar bench --model llama3-8b --random-weights --kv bf16,oscar \
        --contexts 128K --ttft-kv bf16,oscar --out "bench/results/$dev/serving_budget_llama3-8b_128k.json" ;;
    roofline-llama) oscar bench --model llama3-8b --random-weights --kv bf16,oscar --contexts 8K,32K,128K \
        --batch 1,8,32 --ttft-kv none --out "bench/results/$dev/decode_roofline_llama3-8b.json" ;;
    budget-qwen) oscar bench --model qwen3-8b --random-weights --kv bf16,oscar,fp8,int8 \
        --contexts 8K,32K --ttft-kv bf16,oscar --out "bench/results/$dev/serving_budget_qwen3-8b.json" ;;
    *) echo "unknown job $job" >&2; exit 2 ;;
  esac
done
