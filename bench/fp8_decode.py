"""One decode step's attention over one layer's dense cache at serving shapes: float8 through the
Triton kernel (`dense_cache` "auto" on a GPU) and through XLA ("xla"), bf16 through cuDNN, each
timed as `dense_cache.append_attend` (append the token in place, attend) in one jitted call that
takes the layer donated, as the decoder's step does.

    python bench/fp8_decode.py --shapes 22x20480,11x20480 --capacity 34816 --out bench/results/<device>/fp8_decode.json

Rows: kv, implementation, batch, held tokens a row, capacity, ms (median), and GB/s of the K/V
bytes the held tokens occupy (8 bits/element + scales for fp8, 16 for bf16).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import typer

from oscar_jax.models import dense_cache, results


def _layer(key, dtype, batch, held, capacity, hkv, d):
    k, v = ((20 * jax.random.normal(part, (batch, capacity, hkv, d), jnp.bfloat16)).astype(dtype)
            for part in jax.random.split(key))
    scale = (lambda: jnp.full((batch, hkv), 0.05, jnp.float32)) if dtype == dense_cache.FP8 else (lambda: None)
    return dense_cache.DenseCache(k, v, jnp.full((batch,), held, jnp.int32), scale(), scale())


def _ms(fn, layer, reps):
    """Median ms of `fn(layer) -> (o, layer)` with the layer donated and fed back (its rows grow
    by one token a call)."""
    o, layer = jax.block_until_ready(fn(layer))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        o, layer = jax.block_until_ready(fn(layer))
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def main(shapes: str = typer.Option("22x20480,11x20480", help="BATCHxHELD, comma-separated"),
         capacity: int = typer.Option(34816, help="tokens a row holds at most"),
         kv_heads: int = 8, q_heads: int = 32, head_dim: int = 128, reps: int = 30,
         out: str | None = typer.Option(None, help="record path (JSON)")):
    rng = np.random.default_rng(0)
    rows = []
    for shape in shapes.split(","):
        batch, held = map(int, shape.split("x"))
        q = jnp.asarray(rng.standard_normal((batch, 1, q_heads, head_dim)), jnp.bfloat16)
        new = [jnp.asarray(rng.standard_normal((batch, 1, kv_heads, head_dim)), jnp.bfloat16) for _ in "kv"]
        step = jax.jit(lambda layer: dense_cache.append_attend(layer, q, *new, head_dim ** -0.5), donate_argnums=0)
        for kv, dtype, impls in (("fp8", dense_cache.FP8, ("auto", "xla")), ("bf16", jnp.bfloat16, ("auto",))):
            for impl in impls:
                layer = _layer(jax.random.key(batch), dtype, batch, held, capacity, kv_heads, head_dim)
                layer = dataclasses.replace(layer, implementation=impl)
                ms = _ms(step, layer, reps)
                kernel = "kernel" if dense_cache.fp8_kernel_applies(layer, q_heads, 1) else "xla"
                name = {"fp8": kernel, "bf16": "cudnn" if dense_cache.cudnn_supported(layer, 1) else "xla"}[kv]
                held_bytes = 2 * batch * (held + 1) * kv_heads * head_dim * jnp.dtype(dtype).itemsize
                rows.append({"kv": kv, "implementation": name, "batch": batch, "held": held, "capacity": capacity,
                             "kv_heads": kv_heads, "q_heads": q_heads, "head_dim": head_dim,
                             "bits_per_element": 8 * jnp.dtype(dtype).itemsize, "ms": ms,
                             "GBps": held_bytes / ms / 1e6})
                print(rows[-1])
    if out:
        results.write(out, results.record(rows))


if __name__ == "__main__":
    typer.run(main)
