"""The end of a Mosaic GPU split decode: the bf16 sink and ring, the partials' merge, the back-rotation.

Pallas kernel with Triton lowering (GPU); `interpret=True` runs it on CPU.

Per (batch row, KV head) the Mosaic GPU kernel (`mixed_attention_mgpu`) leaves S history
partials: o^T [D, 8] normalised and its log-sum-exp in base 2, column c for query c % cols
(column blocks of packed token slices; -inf where a partial saw nothing). One program per
(batch row, KV head, block of 64 output channels) attends the g queries to the bf16 sink and
recent ring (scores over all D, values over the channels it merges), merges the history
partials elementwise in f32 (pass 1: each query's largest lse; pass 2: the weighted sum of
the [D, 8] partials, whole 32-byte rows, several per step; an FMA dot over all 16 query rows
took half of the kernel's instructions on the H200), merges the two, and, given the output rotation,
rotates its block of the result back (rows of the rotation times o_rot; it then merges all
D). All scores are in base 2 (log2 e is folded into the queries); the returned lse is in the
natural base.

Precision: q and p enter the bf16 MMAs as two bf16 parts each (hi + lo, ~16 bits); the merge
is exact f32; the rotation is three bf16 MMAs on the GPU (~17 bits) and exact f32 in
interpret mode.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from oscar_jax.pallas_kernels import layout

from .decode_start import rotation_precision
from .mixed_attention import f32_dot

_LN2 = math.log(2.0)
_D_BLOCK = 64  # output channels per program (scores still take all D)
_Q = 16  # query columns of every tile: the partials' 8, padded to the least dot N
_CHUNK_ELEMENTS = 8192  # f32 elements of partials merged per step ([chunk, D_merged, 8])


def _dense_block(d: int) -> int:
    """bf16 tokens per step of the sink / ring attention: 128 at D <= 128 (the ring of 256 in
    2 steps: 14.5 against 15.5 us per call at B8 H32/8 on the H200, 4 or 8 warps alike;
    `bench/results/kernels_mgpu_session5_h200.json`), 64 at D = 256 (shared memory)."""
    return 128 if d <= 128 else 64


def _pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def _split_bf16(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    hi = x.astype(jnp.bfloat16)
    return hi, (x - hi.astype(jnp.float32)).astype(jnp.bfloat16)


def _kernel(n_ref, q_ref, ot_ref, lse_ref, sk_ref, sv_ref, rk_ref, rv_ref, *refs, g: int, cols: int,
            sink: int, window: int, rotate: bool, interpret: bool):
    rot_ref, o_ref, lse_out_ref = refs if rotate else (None, *refs)
    b, h = pl.program_id(0), pl.program_id(1)
    splits, d = ot_ref.shape[2], ot_ref.shape[3]
    db = min(d, _D_BLOCK)
    out_cols = pl.program_id(2) * db + jnp.arange(db)  # this program's output channels
    mcol = jnp.arange(d) if rotate else out_cols  # the channels it merges
    n = n_ref[b]
    # Query column i holds query min(i, g - 1): columns past g repeat query g - 1, so that the
    # stores go unmasked (the copies write the same values).
    c = jnp.arange(_Q)
    queries = jnp.minimum(c, g - 1)

    # bf16 segments: sink (positions 0..S0-1) and the recent ring (slot j holds the newest
    # position p < n with (p - S0) % W == j: layout.ring_position), as [tokens, 16] score tiles.
    q_hi, q_lo = _split_bf16(plgpu.load(q_ref.at[b, h, queries[:, None], jnp.arange(d)[None, :]]))

    def segment(k_ref, v_ref, size, positions, carry):
        """Online softmax over one bf16 segment in blocks of `_dense_block(d)` tokens (fewer
        for a shorter segment, but at least 16: the least M of a Triton dot)."""
        block = min(_dense_block(d), max(16, _pow2(size)))

        def step(i, carry):
            m, l, acc = carry
            j = i * block + jnp.arange(block)
            ok = j < size
            pos = positions(j)
            visible = ok & (pos >= 0) & (pos < n)
            rows = jnp.minimum(j, size - 1)[:, None]
            k = plgpu.load(k_ref.at[b, h, rows, jnp.arange(d)[None, :]], mask=ok[:, None], other=0.0)
            s = f32_dot(k, q_hi, 1, interpret) + f32_dot(k, q_lo, 1, interpret)  # [block, 16]
            s = jnp.where(visible[:, None], s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=0))
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp2(m - m_use)
            p = jnp.exp2(s - m_use[None, :])
            v = plgpu.load(v_ref.at[b, h, rows, mcol[None, :]], mask=ok[:, None], other=0.0)
            pv = sum(f32_dot(v, part, 0, interpret, contract_a=0) for part in _split_bf16(p))  # [D_merged, 16]
            return m_new, l * alpha + jnp.sum(p, axis=0), acc * alpha[None, :] + pv

        return lax.fori_loop(0, -(-size // block), step, carry)

    dense = (jnp.full((_Q,), -jnp.inf, jnp.float32), jnp.zeros((_Q,), jnp.float32),
             jnp.zeros((mcol.shape[0], _Q), jnp.float32))
    if sink:
        dense = segment(sk_ref, sv_ref, sink, lambda j: j, dense)
    m_d, l_d, acc_d = segment(rk_ref, rv_ref, window, lambda j: layout.ring_position(n, j, sink, window), dense)

    # History partials. Partial column p (0..7) belongs to query p % cols.
    finite = lambda x: jnp.where(x == -jnp.inf, 0.0, x)
    p8 = jnp.arange(8)
    owns = p8[:, None] % cols == queries[None, :]  # [8 partial columns, 16 query columns]
    same = p8[:, None] % cols == p8[None, :] % cols  # [8, 8]: the partial columns of one query
    # Pass 1: each query's largest log-sum-exp, per partial column and per query column.
    s_ids = jnp.arange(_pow2(splits))
    lses = plgpu.load(lse_ref.at[b, h, jnp.minimum(s_ids, splits - 1)[:, None], p8[None, :]],
                      mask=(s_ids < splits)[:, None], other=-jnp.inf)  # [S_pad, 8]
    col_top = jnp.max(lses, axis=0)
    top = finite(jnp.max(jnp.where(same, col_top[None, :], -jnp.inf), axis=1))  # per partial column
    top_q = finite(jnp.max(jnp.where(owns, col_top[:, None], -jnp.inf), axis=0))  # per query column

    # Pass 2: acc[:, p] = sum over partials of 2^(lse - top) o (elementwise, f32), `chunk`
    # partials ([chunk, D_merged, 8], whole 32-byte rows) per step.
    chunk = min(_pow2(splits), max(1, _CHUNK_ELEMENTS // (mcol.shape[0] * 8)))
    ks = jnp.arange(chunk)

    def merge(i, carry):
        acc, l = carry
        s_idx = i * chunk + ks
        ok = s_idx < splits
        s_safe = jnp.minimum(s_idx, splits - 1)
        lse_k = plgpu.load(lse_ref.at[b, h, s_safe[:, None], p8[None, :]], mask=ok[:, None], other=-jnp.inf)
        w = jnp.exp2(lse_k - top[None, :])  # [chunk, 8]
        o = plgpu.load(ot_ref.at[b, h, s_safe[:, None, None], mcol[None, :, None], p8[None, None, :]],
                       mask=ok[:, None, None], other=0.0)  # [chunk, D_merged, 8]
        return acc + jnp.sum(o * w[:, None, :], axis=0), l + jnp.sum(w, axis=0)

    acc_h, l_col = lax.fori_loop(0, -(-splits // chunk), merge, (jnp.zeros((mcol.shape[0], 8), jnp.float32),
                                                                 jnp.zeros((8,), jnp.float32)))
    sel = owns.astype(jnp.float32)
    o_h = jnp.sum(acc_h[:, :, None] * sel[None, :, :], axis=1)  # [D_merged, 16 query columns], no dot
    l_h = jnp.sum(l_col[:, None] * sel, axis=0)

    # The two merged: history (scale 2^top_q) and bf16 (scale 2^m_d), per query column.
    m_h = jnp.where(l_h > 0, top_q, -jnp.inf)
    m_dense = jnp.where(l_d > 0, finite(m_d), -jnp.inf)
    top_all = finite(jnp.maximum(m_h, m_dense))
    w_h = jnp.where(l_h > 0, jnp.exp2(m_h - top_all), 0.0)
    w_d = jnp.where(l_d > 0, jnp.exp2(m_dense - top_all), 0.0)
    total = w_h * l_h + w_d * l_d
    seen = total > 0
    o = (o_h * w_h[None, :] + acc_d * w_d[None, :]) / jnp.where(seen, total, 1.0)[None, :]  # [D_merged, 16]
    if rotate:  # o_model = R o_rot: rows out_cols of R
        r_rows = plgpu.load(rot_ref.at[h, out_cols[:, None], mcol[None, :]])  # [DB, D]
        o = lax.dot_general(r_rows, o, (((1,), (0,)), ((), ())), precision=rotation_precision(interpret),
                            preferred_element_type=jnp.float32)
    plgpu.store(o_ref.at[b, h, queries[None, :], out_cols[:, None]], o)
    lse = jnp.where(seen, (top_all + jnp.log2(jnp.where(seen, total, 1.0))) * _LN2, -jnp.inf)
    plgpu.store(lse_out_ref.at[b, h, queries], lse)  # the same in every channel block


def decode_finish(q, o_t, lse2, sink_k, sink_v, recent_k, recent_v, lengths, *, cols: int, sink: int,
                  window: int, g: int, output_rot=None, interpret: bool = False):
    """Attend the bf16 segments, merge them with the history partials, rotate back.

    q: f32 [B, Hkv, Q, D] (softmax scale and log2 e folded in: base 2), of which rows
    0..g-1 are the g queries (rows past g are ignored); o_t: f32 [B, Hkv, S, D, 8]
    normalised history partials, column c for query c % cols; lse2: f32 [B, Hkv, S, 8] their
    log-sum-exp in base 2 (-inf: nothing seen); sink_k/v bf16 [B, Hkv, S0, D]; recent_k/v
    bf16 [B, Hkv, W, D]; lengths int32 [B]; output_rot: f32 [Hkv, D, D] or None (o = o_rot ·
    output_rot[h]^T when given; each channel block then merges all D, which the Mosaic GPU
    path does only at D <= 128). Returns (o f32 [B, Hkv, g, D], lse f32 [B, Hkv, g], natural
    base).
    """
    b, hkv, q_rows, d = q.shape
    splits = o_t.shape[2]
    if o_t.shape != (b, hkv, splits, d, 8) or lse2.shape != (b, hkv, splits, 8) or not 1 <= g <= min(cols, q_rows) <= 8:
        raise ValueError(f"o_t.shape={o_t.shape}, lse2.shape={lse2.shape}, g={g}, cols={cols}: expected "
                         f"[B={b}, Hkv={hkv}, S, D={d}, 8], [B, Hkv, S, 8] and g <= cols <= 8, g <= q.shape[2]")
    if output_rot is not None and output_rot.shape != (hkv, d, d):
        raise ValueError(f"output_rot.shape={output_rot.shape}: expected [Hkv={hkv}, D={d}, D={d}]")
    rotate = output_rot is not None
    if not sink:  # no zero-sized operands: the ring stands in (unread)
        sink_k, sink_v = recent_k, recent_v
    arrays = (lengths.astype(jnp.int32), q, o_t, lse2, sink_k, sink_v, recent_k, recent_v,
              *((output_rot.astype(jnp.float32),) if rotate else ()))
    full = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)
    out_shape = [jax.ShapeDtypeStruct((b, hkv, g, d), jnp.float32), jax.ShapeDtypeStruct((b, hkv, g), jnp.float32)]
    return pl.pallas_call(
        functools.partial(_kernel, g=g, cols=cols, sink=sink, window=window, rotate=rotate, interpret=interpret),
        grid=(b, hkv, d // min(d, _D_BLOCK)),
        in_specs=[full(x) for x in arrays],
        out_specs=[full(o) for o in out_shape],
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="oscar_decode_finish",
    )(*arrays)
