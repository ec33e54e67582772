#!/usr/bin/env bash
# The end-to-end serving results on one GPU (H100 or H200): Llama-3-8B and Qwen3-8B shapes with
# random bf16 weights, through `oscar bench`. Each job writes bench/results/<device>/<job>.json
# (+ .png). Usage: bench/serving_gpu.sh JOB [JOB ...] with JOB one of
#   budget-llama      bf16, oscar, fp8, int8 at a 48 GiB KV budget, 8K and 32K, TTFT of bf16 and oscar
#   budget-llama-128k bf16 and oscar at 128K (fp8 and int8 there need more than an H100 leaves)
#   roofline-llama    bf16 and oscar at batch 1, 8, 32 (every cell that fits), 8K and 32K
#   roofline-llama-128k the same at 128K, batch 1 and 8
#   budget-qwen       bf16, oscar, fp8, int8 for the Qwen3-8B shape, 8K and 32K
#   budget-qwen-128k  bf16 and oscar for the Qwen3-8B shape at 128K
#   workload-KV-P     the Poisson workload through the engine (bench/workload.py, 1 request/s), KV one of
#                     oscar, bf16, fp8, P the prefix cache: on or off
#   prefill-chunks    extend chunks of 256 tokens at depths 1K-31K of a 32K prompt, Triton against cuDNN
#                     (OSCAR) and bf16/fp8 (cuDNN), beside the one-pass prefill (bench/prefill_chunks.py)
#   engine-step       the engine's decode step with idle slots: one step a call and rounds of 8, greedy or top_p
#                     against the static decode loop of the running rows (bench/engine_step.py)
#   mesh-one-device   the decode step on one-device meshes (model=1; data=1,model=1,seq=1) against none, oscar and
#                     bf16 at 32K, batch 8 (bench/mesh_one_device.py)
#   load-KV           `oscar serve` under bench/load_test.py (prompts 1K-8K, 256 output tokens; prefill in chunks
#                     of 1024 tokens, two between decode steps), KV oscar or bf16
set -uo pipefail
cd "$(dirname "$0")/.."
dev=$(python3 -c "from oscar_jax.models import results as r; print(r.device_folder(r.device_kind()))")

# Start `oscar serve` for the 8B shape with cache $1 and $2 slots, load it, stop it with SIGTERM.
load() {
  oscar serve --model llama3-8b --random-weights --dtype bfloat16 --kv "$1" --slots "$2" --max-len 16384 \
      --prefill-chunk 1024 --chunks-per-step 2 --max-prefills 1 --port 8000 & local pid=$!
  until python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/health')" 2> /dev/null; do
    kill -0 $pid 2> /dev/null || { echo "oscar serve exited" >&2; return 1; }; sleep 2
  done
  python3 bench/load_test.py --model llama3-8b --vocab 128256 --prompt-tokens 1024,8192 --max-tokens 256 \
      --levels 4,16,64 --duration 60 --out "bench/results/$dev/load_llama3-8b_$1.json"
  kill -TERM $pid; wait $pid
}
for job in "$@"; do
  case "$job" in
    budget-llama) oscar bench --model llama3-8b --random-weights --kv bf16,oscar,fp8,int8 \
        --contexts 8K,32K --ttft-kv bf16,oscar --out "bench/results/$dev/serving_budget_llama3-8b.json" ;;
    budget-llama-128k) oscar bench --model llama3-8b --random-weights --kv bf16,oscar \
        --contexts 128K --ttft-kv bf16,oscar --out "bench/results/$dev/serving_budget_llama3-8b_128k.json" ;;
    roofline-llama) oscar bench --model llama3-8b --random-weights --kv bf16,oscar --contexts 8K,32K \
        --batch 1,8,32 --ttft-kv none --steps 32 --out "bench/results/$dev/decode_roofline_llama3-8b.json" ;;
    roofline-llama-128k) oscar bench --model llama3-8b --random-weights --kv oscar,bf16 --contexts 128K \
        --batch 1,8 --ttft-kv none --steps 16 --out "bench/results/$dev/decode_roofline_llama3-8b_128k.json" ;;
    budget-qwen) oscar bench --model qwen3-8b --random-weights --kv bf16,oscar,fp8,int8 \
        --contexts 8K,32K --ttft-kv bf16,oscar --out "bench/results/$dev/serving_budget_qwen3-8b.json" ;;
    budget-qwen-128k) oscar bench --model qwen3-8b --random-weights --kv bf16,oscar \
        --contexts 128K --ttft-kv bf16,oscar --out "bench/results/$dev/serving_budget_qwen3-8b_128k.json" ;;
    workload-oscar-o[nf]*|workload-bf16-o[nf]*|workload-fp8-o[nf]*) w=${job#workload-}
        python3 bench/workload.py --kv "${w%-*}" --prefix-cache "${w##*-}" --rate 1 \
        --out "bench/results/$dev/workload_llama3-8b_${w%-*}_prefix-${w##*-}.json" ;;
    prefill-chunks) python3 bench/prefill_chunks.py --model llama3-8b --context 32K \
        --cells oscar:pallas:256,oscar:cudnn:256,bf16:auto:256,fp8:auto:256 --out "bench/results/$dev/prefill_chunks_llama3-8b.json" ;;
    engine-step) python3 bench/engine_step.py --model llama3-8b --cells oscar:64:39,bf16:11:11 --context 20K --profile \
        --out "bench/results/$dev/engine_step_llama3-8b.json" ;;
    mesh-one-device) python3 bench/mesh_one_device.py --model llama3-8b --kv oscar,bf16 --context 32K --batch 8 \
        --mesh model=1 --mesh data=1,model=1,seq=1 --out "bench/results/$dev/mesh_one_device.json" ;;
    load-oscar) load oscar 64 ;;
    load-bf16) load bf16 24 ;;
    *) echo "unknown job $job" >&2; exit 2 ;;
  esac
done
