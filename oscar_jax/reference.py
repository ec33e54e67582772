"""Pure-jnp attention over the mixed cache: the oracle every kernel is tested against.

Contract (docs/method.md §4): the C new tokens have ALREADY been appended, so with
n = lengths, query c sits at position n - C + c and attends causally to the sink
(bf16) ++ dequantised history ++ recent ring (bf16). Each segment yields a
normalised partial output and its log-sum-exp; `merge_partials` combines them
exactly. Computed in float32 at HIGHEST precision.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from oscar_jax.cache import (LayerParams, OscarCache, RingCache, ring_positions,
                             ring_slot_positions)

_HI = jax.lax.Precision.HIGHEST


def merge_partials(outs: list[jax.Array], lses: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Merge normalised partial attentions: o_i [..., D], lse_i [...] -> (o, lse).

    A segment with no visible key has lse = -inf and contributes nothing.
    """
    lse = jnp.stack(lses)
    total = jax.nn.logsumexp(lse, axis=0)
    safe_total = jnp.where(jnp.isfinite(total), total, 0.0)
    w = jnp.exp(lse - safe_total)  # [S, ...]
    o = sum(w[i][..., None] * outs[i] for i in range(len(outs)))
    return o, total


def segment_attention(q, k, v, mask, softmax_scale):
    """One segment. q [B, H, g, C, D]; k, v [B, H, S, D]; mask bool [B, C, S].

    Returns o [B, H, g, C, D] (normalised within the segment) and lse [B, H, g, C].
    """
    s = jnp.einsum("bhgcd,bhsd->bhgcs", q, k, precision=_HI) * softmax_scale
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])
    o = jnp.einsum("bhgcs,bhsd->bhgcd", p, v, precision=_HI)
    return o, lse


def _split_heads(q: jax.Array, kv_heads: int) -> jax.Array:
    """q [B, C, Hq, D] -> [B, Hkv, g, C, D]; query head i uses KV head i // g."""
    b, c, hq, d = q.shape
    return jnp.moveaxis(q.reshape(b, c, kv_heads, hq // kv_heads, d), 1, 3)


def _merge_heads(o: jax.Array) -> jax.Array:
    """[B, Hkv, g, C, D] -> [B, C, Hq, D]."""
    b, h, g, c, d = o.shape
    return jnp.moveaxis(o, 3, 1).reshape(b, c, h * g, d)


def query_positions(lengths: jax.Array, c: int) -> jax.Array:
    """int32 [B, C]: position of each new query (the C newest tokens)."""
    return lengths[:, None] - c + jnp.arange(c)[None, :]


def shift_lse(lse: jax.Array, q: jax.Array, params: LayerParams, scale: float) -> jax.Array:
    """The log-sum-exp over the true keys from one over keys stored minus params.k_shift:
    lse f32 [B, C, Hq] + scale · q·k_shift (q [B, C, Hq, D], model basis)."""
    if params.k_shift is None:
        return lse
    shift = jnp.repeat(params.k_shift.astype(jnp.float32), q.shape[2] // params.k_shift.shape[0], axis=0)
    return lse + scale * jnp.einsum("bchd,hd->bch", q.astype(jnp.float32), shift, precision=_HI)


def attend(q: jax.Array, cache: OscarCache, params: LayerParams,
           softmax_scale: float | None = None, *, history_offset=0,
           gather_history: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]] | None = None,
           ) -> tuple[jax.Array, jax.Array]:
    """q: [B, C, Hq, D] post-RoPE, unrotated -> (o [B, C, Hq, D] in q.dtype, lse f32 [B, C, Hq]).

    o is in the model's basis unless params.v_folded (then in the R_V basis).
    Sequence parallelism (`oscar_jax.parallel`): the cache's history arrays may hold only
    history indices [history_offset, history_offset + T_local) of a longer history (int or
    traced int32), and gather_history(o, lse) returns the history partials of every slice
    stacked ([S, B, Hkv, g, C, D], [S, B, Hkv, g, C]), merged here with the sink and ring.
    """
    spec = cache.spec
    c, d = q.shape[1], q.shape[3]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    n = cache.lengths
    qp = query_positions(n, c)  # [B, C]
    qr = jnp.einsum("bhgcd,hde->bhgce", _split_heads(q.astype(jnp.float32), spec.kv_heads),
                    params.query_rot, precision=_HI)

    s0, w = spec.sink, spec.window
    f32 = lambda x: x.astype(jnp.float32)
    sink_pos = jnp.arange(s0)[None, None, :]
    o_s, lse_s = segment_attention(qr, f32(cache.sink_k), f32(cache.sink_v),
                                   (sink_pos < n[:, None, None]) & (sink_pos <= qp[..., None]), scale)
    outs, lses = [o_s], [lse_s]
    hist_k = cache.dequantized_hist("k")
    if hist_k.shape[-2]:
        hist_pos = s0 + history_offset + jnp.arange(hist_k.shape[-2])[None, None, :]
        visible = (hist_pos < (n - w)[:, None, None]) & (hist_pos <= qp[..., None])
        o_h, lse_h = segment_attention(qr, hist_k, cache.dequantized_hist("v"), visible, scale)
        o_h, lse_h = (o_h[None], lse_h[None]) if gather_history is None else gather_history(o_h, lse_h)
        outs += list(o_h)
        lses += list(lse_h)
    rpos = ring_positions(n, s0, w)[:, None, :]
    o_r, lse_r = segment_attention(qr, f32(cache.recent_k), f32(cache.recent_v),
                                   (rpos >= 0) & (rpos <= qp[..., None]), scale)
    outs.append(o_r)
    lses.append(lse_r)
    o, lse = merge_partials(outs, lses)
    if not params.v_folded:
        o = jnp.einsum("bhgce,hde->bhgcd", o, params.output_rot, precision=_HI)
    lse = jnp.moveaxis(lse, 3, 1).reshape(q.shape[:3])
    return _merge_heads(o).astype(q.dtype), shift_lse(lse, q, params, scale)


def attend_window(q: jax.Array, cache: RingCache,
                  softmax_scale: float | None = None) -> tuple[jax.Array, jax.Array]:
    """Sliding-window attention over a ring layer: query p sees positions (p - window, p].

    q: [B, C, Hq, D] -> (o [B, C, Hq, D], lse f32 [B, C, Hq]).
    """
    spec = cache.spec
    c, d = q.shape[1], q.shape[3]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    qp = query_positions(cache.lengths, c)[..., None]  # [B, C, 1]
    kp = ring_slot_positions(cache.lengths, spec.capacity)[:, None, :]  # [B, 1, cap]
    mask = (kp >= 0) & (kp <= qp) & (kp > qp - spec.window)
    o, lse = segment_attention(_split_heads(q.astype(jnp.float32), spec.kv_heads),
                               cache.k.astype(jnp.float32), cache.v.astype(jnp.float32), mask, scale)
    return _merge_heads(o).astype(q.dtype), jnp.moveaxis(lse, 3, 1).reshape(q.shape[:3])
