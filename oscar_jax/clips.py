"""Held-aside errors and clip ratios (docs/method.md §1.4; the errors of
`oscar calibrate --compare`, §1.6).

Given calibration `Statistics` and key/value `Rotation`s [L, Hkv, D, D], these measure
what the cache's quantised history loses on held-aside activations q [L, B, T, Hq, D],
k, v [L, B, T, Hkv, D]:
- `reconstruct`: one layer's vectors [N, Hkv, D] rotated, stored as bf16, quantised,
  dequantised and mapped back to the model basis;
- `fit_clips`: per layer and per K/V the clip ratio in a grid that minimises the
  attention-aware error (keys E[(k-k̂)ᵀ C_h (k-k̂)], values the score-weighted
  E[w |v-v̂|²], weights from `value_weights` [L, B·T, Hkv]) -> `ClipFit` (clips [L],
  error curves [L, n_grid]);
- `logit_error` / `output_error`: the relative attention-logit error (every key
  quantised) and attention-output error (every value quantised, keys exact) per layer [L].
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from oscar_jax import quant
from oscar_jax.activations import attention_mass, check_activations, group_queries, published_weights
from oscar_jax.cache import STORE_DTYPE
from oscar_jax.config import QuantConfig

if TYPE_CHECKING:  # annotations only: calibrate imports this module
    from oscar_jax.calibrate import Rotation, Statistics

CLIP_GRID = tuple(round(0.70 + 0.01 * i, 2) for i in range(31))  # 0.70 .. 1.00
_HI = jax.lax.Precision.HIGHEST


def reconstruct(x: jax.Array, rot: jax.Array, dual: jax.Array, cfg: QuantConfig,
                clip: float | jax.Array) -> jax.Array:
    """What the cache's history returns, back in the model basis (one layer).

    x: [N, Hkv, D]; rot, dual: [Hkv, D, D]; clip: scalar. x is rotated, stored as
    bf16 (as the cache does), quantised, dequantised and mapped back by dualᵀ.
    Returns float32 [N, Hkv, D].
    """
    x_rot = jnp.einsum("nhd,hde->hne", x.astype(jnp.float32), rot, precision=_HI)
    x_hat = quant.dequantize(quant.quantize(x_rot.astype(STORE_DTYPE), cfg, clip), cfg)
    return jnp.einsum("hne,hde->nhd", x_hat, dual, precision=_HI)


def value_weights(stats: Statistics, q: jax.Array, k: jax.Array,
                  softmax_scale: float | None = None) -> np.ndarray:
    """Value weights of held-aside tokens under `stats.value_weighting`, normalised
    to average 1 per layer and head. q [L, B, T, Hq, D], k [L, B, T, Hkv, D] ->
    float64 [L, B·T, Hkv]."""
    num_layers = k.shape[0]
    flat_k = np.asarray(k, np.float64).reshape(num_layers, -1, *k.shape[3:])
    if stats.value_weighting == "published":
        w = published_weights(flat_k, stats.query_cov)
    else:
        w = np.stack([np.asarray(attention_mass(q[i], k[i], softmax_scale), np.float64)
                      for i in range(num_layers)]).reshape(flat_k.shape[:3])
    return w / w.mean(axis=1, keepdims=True)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _clip_curves(k, v, w_v, query_cov, rot_k, dual_k, rot_v, dual_v, grid, cfg: QuantConfig):
    """Relative errors of one layer over the clip grid: keys Σ eᵀ C_h e / Σ kᵀ C_h k,
    values Σ w |e|² / Σ w |v|². k, v [N, Hkv, D]; w_v [N, Hkv]; -> two [n_grid]."""

    def errors(c):
        ek = k - reconstruct(k, rot_k, dual_k, cfg, c)
        ev = v - reconstruct(v, rot_v, dual_v, cfg, c)
        err_k = jnp.einsum("nhd,hde,nhe->", ek, query_cov, ek, precision=_HI)
        return err_k, jnp.einsum("nh,nhd->", w_v, ev * ev, precision=_HI)

    err_k, err_v = jax.lax.map(errors, grid)
    ref_k = jnp.einsum("nhd,hde,nhe->", k, query_cov, k, precision=_HI)
    return err_k / ref_k, err_v / jnp.einsum("nh,nhd->", w_v, v * v, precision=_HI)


@dataclasses.dataclass(frozen=True)
class ClipFit:
    """clip_k, clip_v: float32 [L]; grid: [n]; err_k, err_v: float64 [L, n] relative
    attention-aware errors on the held-aside tokens (NaN where not evaluated)."""

    clip_k: np.ndarray
    clip_v: np.ndarray
    grid: np.ndarray
    err_k: np.ndarray
    err_v: np.ndarray


def fit_clips(stats: Statistics, q: jax.Array, k: jax.Array, v: jax.Array, rot_k: Rotation,
              rot_v: Rotation, cfg: QuantConfig, grid=CLIP_GRID,
              softmax_scale: float | None = None) -> ClipFit:
    """Per layer and per K/V, the clip ratio in `grid` that minimises the held-aside
    attention-aware error (keys: E[(k-k̂)ᵀ C_h (k-k̂)]; values: score-weighted
    E[w |v-v̂|²]). q [L, B, T, Hq, D], k, v [L, B, T, Hkv, D]: held-aside tokens."""
    check_activations(q, k, v, stats.query_cov.shape[:3])
    grid = np.asarray(grid, np.float32)
    if grid.ndim != 1 or grid.size == 0 or np.any(grid <= 0) or np.any(grid > 1):
        raise ValueError(f"grid={grid}: expected a non-empty 1-D list of ratios in (0, 1]")
    w_v = value_weights(stats, q, k, softmax_scale)
    flat = lambda x: jnp.asarray(x, jnp.float32).reshape(x.shape[0], -1, *x.shape[3:])
    k, v = flat(k), flat(v)
    curves = [_clip_curves(k[i], v[i], jnp.asarray(w_v[i], jnp.float32),
                           jnp.asarray(stats.query_cov[i], jnp.float32), rot_k.rot[i],
                           rot_k.dual[i], rot_v.rot[i], rot_v.dual[i], grid, cfg)
              for i in range(k.shape[0])]
    err_k = np.array([np.asarray(c[0], np.float64) for c in curves])
    err_v = np.array([np.asarray(c[1], np.float64) for c in curves])
    return ClipFit(grid[np.argmin(err_k, axis=1)], grid[np.argmin(err_v, axis=1)], grid,
                   err_k, err_v)


def _causal(t: int) -> jax.Array:
    return jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]


@functools.partial(jax.jit, static_argnames=("cfg",))
def _logit_sums(q, k, rot, dual, clip, cfg: QuantConfig):
    """One layer: q [B, T, Hq, D], k [B, T, Hkv, D] -> (Σ (s - ŝ)², Σ s²) over causal pairs."""
    b, t, hkv, d = k.shape
    k_hat = reconstruct(k.reshape(-1, hkv, d), rot, dual, cfg, clip).reshape(k.shape)
    qg = group_queries(q.astype(jnp.float32), hkv)
    s = jnp.einsum("bqhgd,bthd->bhgqt", qg, k.astype(jnp.float32), precision=_HI)
    s_hat = jnp.einsum("bqhgd,bthd->bhgqt", qg, k_hat, precision=_HI)
    causal = _causal(t)
    return jnp.sum(jnp.where(causal, (s - s_hat) ** 2, 0.0)), jnp.sum(jnp.where(causal, s * s, 0.0))


@functools.partial(jax.jit, static_argnames=("cfg", "softmax_scale"))
def _output_sums(q, k, v, rot, dual, clip, cfg: QuantConfig, softmax_scale):
    """One layer: (Σ |o - ô|², Σ |o|²) with o = softmax(q·k) v, ô the same over v̂."""
    b, t, hkv, d = k.shape
    v_hat = reconstruct(v.reshape(-1, hkv, d), rot, dual, cfg, clip).reshape(v.shape)
    qg = group_queries(q.astype(jnp.float32), hkv)
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    s = jnp.einsum("bqhgd,bthd->bhgqt", qg, k.astype(jnp.float32), precision=_HI) * scale
    p = jax.nn.softmax(jnp.where(_causal(t), s, -jnp.inf), axis=-1)
    o = jnp.einsum("bhgqt,bthd->bhgqd", p, v.astype(jnp.float32), precision=_HI)
    o_hat = jnp.einsum("bhgqt,bthd->bhgqd", p, v_hat, precision=_HI)
    return jnp.sum((o - o_hat) ** 2), jnp.sum(o * o)


def logit_error(q: jax.Array, k: jax.Array, rot_k: Rotation, clip_k: np.ndarray,
                cfg: QuantConfig) -> np.ndarray:
    """Relative attention-logit error per layer on held-aside tokens, every key quantised:
    Σ (q·k - q·k̂)² / Σ (q·k)² over causal (query, key) pairs of each sequence and the
    g query heads of each KV head. q [L, B, T, Hq, D], k [L, B, T, Hkv, D]; clip_k [L]
    -> float64 [L]."""
    check_activations(q, k, k)
    sums = [_logit_sums(q[i], k[i], rot_k.rot[i], rot_k.dual[i], float(clip_k[i]), cfg)
            for i in range(k.shape[0])]
    return np.array([float(e) / float(r) for e, r in sums])


def output_error(q: jax.Array, k: jax.Array, v: jax.Array, rot_v: Rotation, clip_v: np.ndarray,
                 cfg: QuantConfig, softmax_scale: float | None = None) -> np.ndarray:
    """Relative attention-output error per layer on held-aside tokens, every value quantised
    (keys exact): Σ |o - ô|² / Σ |o|² over causal queries. q [L, B, T, Hq, D], k, v
    [L, B, T, Hkv, D]; clip_v [L] -> float64 [L]."""
    check_activations(q, k, v)
    sums = [_output_sums(q[i], k[i], v[i], rot_v.rot[i], rot_v.dual[i], float(clip_v[i]), cfg,
                         softmax_scale) for i in range(k.shape[0])]
    return np.array([float(e) / float(r) for e, r in sums])
