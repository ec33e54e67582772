"""Demo of the quantise -> cache -> attend path on random tensors (CPU).

Keys get a few large outlier channels, as real post-RoPE keys do. Each scheme
writes a T-token prompt into its cache, appends one token, and attends with
fresh queries; the output is compared with bf16 attention over the same keys.
Prints bits/element, KV bytes, and per scheme the relative error of the
attention logits (q·k) and of the attention output against bf16. On random
values the output is an average of noise, so its relative error is large for
every low-bit scheme; the logit error is the informative column here.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console
from rich.table import Table

import oscar_jax as oj
from oscar_jax import rotation
from oscar_jax.config import CacheSpec, QuantConfig

B, T, HQ, HKV, D = 2, 4096, 8, 2, 128


def synthetic_kv(rng):
    """k, v [B, T+1, Hkv, D] float32 with outlier key channels; q [B, 1, Hq, D]."""
    k = rng.standard_normal((B, T + 1, HKV, D))
    k[..., rng.choice(D, 6, replace=False)] *= 5.0  # outlier channels
    v = rng.standard_normal((B, T + 1, HKV, D))
    q = rng.standard_normal((B, 1, HQ, D))
    return (jnp.asarray(a, jnp.float32) for a in (k, v, q))


def bf16_attention(q, k, v):
    """Plain attention of q [B, 1, Hq, D] over all of k, v [B, T, Hkv, D] stored in bf16."""
    kb, vb = (jnp.repeat(x.astype(jnp.bfloat16).astype(jnp.float32), HQ // HKV, axis=2) for x in (k, v))
    s = jnp.einsum("bqhd,bthd->bhqt", q, kb) * D ** -0.5
    return jnp.einsum("bhqt,bthd->bqhd", jax.nn.softmax(s, axis=-1), vb)


def run_scheme(quant_cfg, rot, clips, k, v, q):
    spec = CacheSpec(num_layers=1, batch=B, kv_heads=HKV, head_dim=D, max_len=T + 64, quant=quant_cfg)
    params = oj.LayerParams.create(rot, rot, *clips, num_layers=1, kv_heads=HKV).layer(0)
    cache = oj.write_prompt(oj.OscarCache.init(spec).layer(0), k[:, :T], v[:, :T],
                            jnp.full((B,), T, jnp.int32), params)
    cache = oj.append(cache, k[:, T:], v[:, T:], params)
    o, _ = jax.jit(oj.attend)(q, cache, params)
    k_hat, _, valid = oj.dense_view(cache)  # [B, Hkv, P, D] rotated basis
    k_hat = jnp.einsum("bhpe,hde->bphd", k_hat[:, :, : T + 1], params.rot_k)  # back to model basis
    return o, k_hat, oj.bits_per_element(cache), oj.nbytes(cache)


def logits(q, k):
    """Attention logits [B, Hq, T] of q [B, 1, Hq, D] against k [B, T, Hkv, D]."""
    return jnp.einsum("bhd,bthd->bht", q[:, 0], jnp.repeat(k, HQ // HKV, axis=2)) * D ** -0.5


def main():
    rng = np.random.default_rng(0)
    k, v, q = synthetic_kv(rng)
    want = bf16_attention(q, k, v)
    no_clip, oscar_clip = (1.0, 1.0), (0.96, 0.92)  # the reference's INT2 clip ratios (K, V)
    schemes = {
        "int8 (no rotation)": (QuantConfig(bits=8), rotation.identity(D), no_clip),
        "int4 (no rotation)": (QuantConfig(bits=4), rotation.identity(D), no_clip),
        "int2 (no rotation)": (QuantConfig(bits=2), rotation.identity(D), oscar_clip),
        "int2 + Hadamard": (QuantConfig(bits=2), rotation.hadamard(D), oscar_clip),
        "int2 + Hadamard, Lloyd-Max": (QuantConfig(bits=2, codebook="lloyd_max"), rotation.hadamard(D),
                                       oscar_clip),
    }
    table = Table(title=f"attention over {T} random tokens (B={B}, Hq={HQ}, Hkv={HKV}, D={D}), "
                        f"sink 64 + window 256 in bf16, jax {jax.__version__} on {jax.default_backend()}")
    for col in ("scheme", "bits/element", "KV bytes", "logit rel. error", "output rel. error", "time s"):
        table.add_column(col)
    bf16_bytes = 2 * B * HKV * (T + 1) * D * 2
    want_logits = logits(q, k.astype(jnp.bfloat16).astype(jnp.float32))
    table.add_row("bf16 (dense)", "16.00", f"{bf16_bytes:,}", "0", "0", "-")
    rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
    for name, (cfg, rot, clips) in schemes.items():
        t0 = time.perf_counter()
        o, k_hat, bpe, nbytes = run_scheme(cfg, rot, clips, k, v, q)
        table.add_row(name, f"{bpe:.2f}", f"{nbytes:,}", f"{rel(logits(q, k_hat), want_logits):.4f}",
                      f"{rel(o, want):.4f}", f"{time.perf_counter() - t0:.1f}")
    Console().print(table)


if __name__ == "__main__":
    main()
