"""Chunked prefill against one-pass prefill for one sequence: what the serving engine's extend
chunks cost at each depth of a long prompt, per attention implementation.

    python bench/prefill_chunks.py --model llama3-8b --context 32K \
        --cells oscar:pallas:256,oscar:cudnn:256,bf16:auto:256,fp8:auto:256 --out chunks.json

For each cell KV:IMPLEMENTATION:C it times `generate.extend` of C tokens on one row already
holding d tokens (d in --depths; random K/V, capacity --context + C), and the one-pass
`generate.prefill` of a --context-token prompt through the same cache. Rows give ms per chunk
and prompt tokens/s at each depth, the prefill's tokens/s, and the chunk's largest GPU kernel
groups at the deepest depth (profiler trace; GPU only). Results schema (device, jax, commit).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from decode_profile import group, kernel_events  # noqa: E402
from oscar_jax.models import bench, generate as gen, kv_policy, registry, results  # noqa: E402
from oscar_jax.models.decoder import fold_values  # noqa: E402


def _tokens(model, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, model.cfg.vocab_size, (1, n), dtype=np.int32)


def time_chunks(model, policy, depth: int, chunk: int, capacity: int, repeats: int) -> list[float]:
    """Seconds of each of `repeats` consecutive extend chunks (after one untimed) from `depth` held tokens."""
    state = bench.filled_state(model, policy, 1, depth, capacity, chunk=chunk)
    times = []
    for i in range(repeats + 1):
        tokens = _tokens(model, chunk, i)
        t0 = time.perf_counter()
        logits, state = gen.extend(model, state, tokens)
        jax.block_until_ready(logits)
        times.append(time.perf_counter() - t0)
    return times[1:]


def chunk_kernels(model, policy, depth: int, chunk: int, capacity: int, top: int) -> list[dict]:
    """The largest kernel groups of one extend chunk at `depth` (ms each), from a profiler trace."""
    state = bench.filled_state(model, policy, 1, depth, capacity, chunk=chunk)
    logits, state = gen.extend(model, state, _tokens(model, chunk, 0))  # compiled and warm
    jax.block_until_ready(logits)
    trace_dir = tempfile.mkdtemp(prefix="oscar_chunks_")
    jax.profiler.start_trace(trace_dir)
    logits, state = gen.extend(model, state, _tokens(model, chunk, 1))
    jax.block_until_ready(logits)
    jax.profiler.stop_trace()
    groups: dict[str, float] = {}
    for _, dur, name in kernel_events(trace_dir):
        groups[group(name)] = groups.get(group(name), 0.0) + dur / 1e6
    return [{"kernel": k, "ms": v} for k, v in sorted(groups.items(), key=lambda kv: -kv[1])[:top]]


def time_prefill(model, policy, context: int, capacity: int) -> float:
    """Seconds of the second one-pass prefill of a `context`-token prompt (the first compiles)."""
    tokens = _tokens(model, context, 0)
    seconds = []
    for _ in range(2):
        state = gen.init_state(model, policy, 1, capacity)
        t0 = time.perf_counter()
        logits, state = gen.prefill(model, state, tokens, np.array([context], np.int32))
        jax.block_until_ready(logits)
        seconds.append(time.perf_counter() - t0)
        del state
    return seconds[-1]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-8b", help="a config-only architecture or checkpoint (random weights)")
    p.add_argument("--context", default="32K", help="the prompt length (and the deepest depth's bound)")
    p.add_argument("--cells", default="oscar:pallas:256,oscar:cudnn:256,bf16:auto:256,fp8:auto:256",
                   help="KV:IMPLEMENTATION:C, comma-separated (IMPLEMENTATION: make_policy's)")
    p.add_argument("--depths", default="1K,8K,16K,31K", help="held tokens before the timed chunks")
    p.add_argument("--repeats", type=int, default=3, help="timed chunks per depth")
    p.add_argument("--top", type=int, default=12, help="kernel groups kept per cell (GPU)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    context = bench._parse_count(args.context)
    depths = [bench._parse_count(d) for d in args.depths.split(",")]
    model, _ = registry.load(args.model, dtype=jnp.bfloat16, random_weights=True)
    rows = []
    for cell in args.cells.split(","):
        kv, implementation, chunk = cell.split(":")
        chunk = int(chunk)
        served, policy = fold_values(model, kv_policy.make_policy(kv, implementation=implementation))
        capacity = context + chunk
        row = {"model": args.model, "kv": kv, "implementation": implementation, "chunk": chunk,
               "context": context, "bpe": None, "depths": []}
        for depth in depths:
            seconds = time_chunks(served, policy, depth, chunk, capacity, args.repeats)
            ms = 1e3 * float(np.median(seconds))
            row["depths"].append({"depth": depth, "ms_per_chunk": ms, "tokens_per_s": chunk / ms * 1e3})
            print(f"{cell} depth {depth}: {ms:.2f} ms per chunk, {chunk / ms * 1e3:.0f} tokens/s", flush=True)
        prefill_s = time_prefill(served, policy, context, capacity)
        row["prefill_s"], row["prefill_tokens_per_s"] = prefill_s, context / prefill_s
        row["bpe"] = kv_policy.bits_per_element(bench.filled_state(served, policy, 1, context, capacity))
        if jax.default_backend() == "gpu":
            row["kernels"] = chunk_kernels(served, policy, depths[-1], chunk, capacity, args.top)
        print(f"{cell}: one-pass prefill of {context} tokens {prefill_s:.2f} s "
              f"({context / prefill_s:.0f} tokens/s), {row['bpe']:.2f} bits/element", flush=True)
        rows.append(row)
        results.write(args.out, results.record(rows))


if __name__ == "__main__":
    main()
