"""Pure-jnp attention over the mixed cache: the oracle every kernel is tested against.

Contract (docs/method.md §4, docs/ARCHITECTURE.md §5): the C new tokens have ALREADY been
appended, so with n = lengths, query c sits at position n - C + c and attends causally to the
sink (bf16) ++ dequantised history ++ recent ring (bf16). A chunk longer than the window
(C > W) has written its own first C - W tokens into the history; its queries see the tokens
before it as the cache holds them and its own tokens as written (bf16, `own=`), causally. Each
segment yields a normalised partial output and its log-sum-exp; `merge_partials` combines them
exactly. Computed in float32 at HIGHEST precision.
"""

from __future__ import annotations

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
           softmax_scale: float | None = None, *, history_offset=None,
           own: tuple[jax.Array, jax.Array] | None = None) -> tuple[jax.Array, jax.Array]:
    """q: [B, C, Hq, D] post-RoPE, unrotated -> (o [B, C, Hq, D] in q.dtype, lse f32 [B, C, Hq]).

    o is in the model's basis unless params.v_folded (then in the R_V basis).
    own: the chunk's K/V as the cache stores them (`updates.stored_kv`: bf16 [B, Hkv, C, D]),
    needed when C > W: its queries then see the sink and history before the chunk (all of it)
    and the chunk's own tokens from `own`, causally, in blocks of W queries.
    history_offset (int or traced int32; sequence parallelism, `oscar_jax.parallel`): the
    cache's history arrays hold only history indices [history_offset, history_offset +
    T_local) of a longer history, and the call returns this slice's partial: its history
    tokens, and the sink and ring (for C > W: the sink and the chunk's own tokens) only where
    history_offset == 0, o in float32; `merge_partials` of every slice's (o, lse) is the whole
    cache's attention (each segment lies in exactly one slice's partial).
    """
    spec = cache.spec
    c, d = q.shape[1], q.shape[3]
    if c > spec.window and own is None:
        raise ValueError(f"q has C={c} queries, more than the window W={spec.window}: such a chunk attends to its "
                         "own tokens as written (pass own=updates.stored_kv(k, v, params); "
                         "attention.append_attend does)")
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    qr = jnp.einsum("bhgcd,hde->bhgce", _split_heads(q.astype(jnp.float32), spec.kv_heads),
                    params.query_rot, precision=_HI)
    common = dict(cache=cache, scale=scale, history_offset=0 if history_offset is None else history_offset,
                  first=True if history_offset is None else history_offset == 0)
    if own is None:
        o, lse = merge_partials(*_segments(qr, **common))
    else:
        block = lambda qb, start: merge_partials(*_chunk_segments(qb, own=own, start=start, **common))
        o, lse = _by_query_blocks(block, qr, spec.window)
    if not params.v_folded:
        o = jnp.einsum("bhgce,hde->bhgcd", o, params.output_rot, precision=_HI)
    lse = jnp.moveaxis(lse, 3, 1).reshape(q.shape[:3])
    o = _merge_heads(o)
    return o if history_offset is not None else o.astype(q.dtype), shift_lse(lse, q, params, scale)


def _history_segments(qr, cache: OscarCache, visible, scale, history_offset):
    """The history's partial: ([o [B, H, g, C, D]], [lse]), visible(hist_pos [1, 1, T]) -> mask
    [B, C, T]; none without a history."""
    hist_k = cache.dequantized_hist("k")
    if not hist_k.shape[-2]:
        return [], []
    hist_pos = cache.spec.sink + history_offset + jnp.arange(hist_k.shape[-2])[None, None, :]
    o_h, lse_h = segment_attention(qr, hist_k, cache.dequantized_hist("v"), visible(hist_pos), scale)
    return [o_h], [lse_h]


def _segments(qr, *, cache: OscarCache, scale, history_offset, first):
    """C <= W queries, the chunk appended: sink, history and ring partials (lists of o, lse);
    the sink and ring only where `first` (the slice at history index 0)."""
    spec = cache.spec
    c = qr.shape[3]
    n = cache.lengths
    qp = query_positions(n, c)  # [B, C]
    s0, w = spec.sink, spec.window
    f32 = lambda x: x.astype(jnp.float32)
    sink_pos = jnp.arange(s0)[None, None, :]
    o_s, lse_s = segment_attention(qr, f32(cache.sink_k), f32(cache.sink_v),
                                   (sink_pos < n[:, None, None]) & (sink_pos <= qp[..., None]) & first, scale)
    o_h, lse_h = _history_segments(
        qr, cache, lambda hist_pos: (hist_pos < (n - w)[:, None, None]) & (hist_pos <= qp[..., None]), scale,
        history_offset)
    rpos = ring_positions(n, s0, w)[:, None, :]
    o_r, lse_r = segment_attention(qr, f32(cache.recent_k), f32(cache.recent_v),
                                   (rpos >= 0) & (rpos <= qp[..., None]) & first, scale)
    return [o_s, *o_h, o_r], [lse_s, *lse_h, lse_r]


def _chunk_segments(qb, *, cache: OscarCache, scale, history_offset, first, own, start):
    """Queries start .. start + Cb - 1 (qb [B, H, g, Cb, D]) of a C-token chunk the cache has
    taken (C = own's length): sink and history before the chunk, and the chunk's own tokens
    (own: bf16 [B, H, C, D] each) causally; the sink and the chunk only where `first`. Lists
    of (o, lse) partials."""
    spec = cache.spec
    b, cb = qb.shape[0], qb.shape[3]
    own_k, own_v = (x.astype(jnp.float32) for x in own)
    c = own_k.shape[2]
    before = (cache.lengths - c)[:, None, None]  # [B, 1, 1]: tokens held before the chunk
    held = lambda pos: jnp.broadcast_to(pos < before, (b, cb, pos.shape[-1]))
    o_s, lse_s = segment_attention(qb, cache.sink_k.astype(jnp.float32), cache.sink_v.astype(jnp.float32),
                                   held(jnp.arange(spec.sink)[None, None, :]) & first, scale)
    o_h, lse_h = _history_segments(qb, cache, held, scale, history_offset)
    causal = jnp.arange(c)[None, :] <= (start + jnp.arange(cb))[:, None]  # [Cb, C]
    o_o, lse_o = segment_attention(qb, own_k, own_v, jnp.broadcast_to(causal, (b, cb, c)) & first, scale)
    return [o_s, *o_h, o_o], [lse_s, *lse_h, lse_o]


def _by_query_blocks(fn, qr: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """fn(q block [B, H, g, Cb, D], index of its first query) -> (o, lse) over qr [B, H, g, C, D]
    in blocks of at most `block` queries, one after another (memory of one block's scores)."""
    c = qr.shape[3]
    if c <= block:
        return fn(qr, 0)
    count = -(-c // block)
    qp = jnp.pad(qr, [(0, 0)] * 3 + [(0, count * block - c), (0, 0)])
    blocks = jnp.moveaxis(qp.reshape(qp.shape[:3] + (count, block, qp.shape[-1])), 3, 0)
    o, lse = jax.lax.map(lambda a: fn(*a), (blocks, jnp.arange(count) * block))
    o = jnp.moveaxis(o, 0, 3).reshape(qp.shape)[:, :, :, :c]
    lse = jnp.moveaxis(lse, 0, 3).reshape(qp.shape[:-1])[..., :c]
    return o, lse


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
