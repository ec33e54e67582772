"""Q/K/V activation batches as calibration reads them: the shape check, the GQA query
grouping and the two value weightings (docs/method.md §1.1).

Post-RoPE (and post qk-norm) activations with a leading layer axis L:
  q: [L, B, T, Hq, D], k, v: [L, B, T, Hkv, D]; query head i belongs to KV head i // g.
Shared by the statistics (`calibrate`), the held-aside errors (`clips`), `learn` and `budget`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_HI = jax.lax.Precision.HIGHEST


def check_activations(q: jax.Array, k: jax.Array, v: jax.Array,
                      shape: tuple[int, int, int] | None = None) -> None:
    """Raise unless q [L, B, T, Hq, D], k and v [L, B, T, Hkv, D] with Hkv | Hq (and
    (L, Hkv, D) == shape when given)."""
    if q.ndim != 5 or k.ndim != 5 or v.shape != k.shape:
        raise ValueError(f"q.shape={q.shape}, k.shape={k.shape}, v.shape={v.shape}: expected "
                         f"q [L, B, T, Hq, D] and k, v [L, B, T, Hkv, D]")
    if q.shape[:3] != k.shape[:3] or q.shape[4] != k.shape[4] or q.shape[3] % k.shape[3]:
        raise ValueError(f"q.shape={q.shape} and k.shape={k.shape} disagree: expected equal "
                         f"[L, B, T] and D, and Hq a multiple of Hkv")
    if shape is not None and (k.shape[0], k.shape[3], k.shape[4]) != tuple(shape):
        raise ValueError(f"k.shape={k.shape}: expected (L, Hkv, D) = {tuple(shape)} "
                         f"as the accumulator was created")


def group_queries(q: jax.Array, kv_heads: int) -> jax.Array:
    """[..., Hq, D] -> [..., Hkv, g, D]."""
    *lead, hq, d = q.shape
    return q.reshape(*lead, kv_heads, hq // kv_heads, d)


def attention_mass(q: jax.Array, k: jax.Array, softmax_scale: float | None = None) -> jax.Array:
    """Σ over the causal queries of one chunk (and the g heads of the group) of p_qt².

    q: [B, T, Hq, D], k: [B, T, Hkv, D] (one layer) -> float32 [B, T, Hkv].
    """
    d = q.shape[-1]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    qg = group_queries(q.astype(jnp.float32), k.shape[2])
    s = jnp.einsum("bqhgd,bthd->bhgqt", qg, k.astype(jnp.float32), precision=_HI) * scale
    t = q.shape[1]
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    p = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)
    return jnp.moveaxis(jnp.sum(p * p, axis=(2, 3)), 1, 2)


def published_weights(k: np.ndarray, query_cov: np.ndarray) -> np.ndarray:
    """w_h[t] = k_tᵀ C_h k_t. k: [L, N, Hkv, D], query_cov: [L, Hkv, D, D] -> [L, N, Hkv]."""
    k = np.asarray(k, np.float64)
    return np.einsum("lnhd,lhde,lnhe->lnh", k, query_cov, k)
