"""The end of a split decode: bf16 sink + recent attention and the log-sum-exp merge, in one kernel.

Pallas kernel with Triton lowering (GPU); `interpret=True` runs it on CPU.

The Mosaic GPU decode kernel (`mixed_attention_mgpu`) leaves, per (batch row, KV head),
S history partials of 8 columns each: column c of a partial belongs to query c % cols
(column blocks of packed token slices). One program per (batch row, KV head, block of 64
output channels) attends the g queries to the bf16 sink and recent ring (scores over all D,
V and output over its block) and merges that partial with the history ones (its block of
them): one launch where XLA took about 20 small ops (concatenations, transposes,
reductions), with B x Hkv x D/64 programs rather than B x Hkv.

Precision: q and p enter the MMAs as two bf16 parts each (hi + lo, ~16 bits); the merge is
in f32.
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

from .mixed_attention import f32_dot

_LN2 = math.log(2.0)
_D_BLOCK = 64  # output channels per program (scores still take all D)
_CHUNK_ELEMENTS = 8192  # f32 elements of history partials merged per step ([8192 / 64, 64])


def _dense_block(d: int) -> int:
    """bf16 tokens per step of the sink / ring attention: 128 at D <= 128 (the ring of 256 in
    2 steps: 14.5 against 15.5 us per call at B8 H32/8 on the H200, 4 or 8 warps alike;
    `bench/results/kernels_mgpu_session5_h200.json`), 64 at D = 256 (shared memory)."""
    return 128 if d <= 128 else 64


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (max(n, 1) - 1).bit_length())


def _split_bf16(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    hi = x.astype(jnp.bfloat16)
    return hi, (x - hi.astype(jnp.float32)).astype(jnp.bfloat16)


def _kernel(n_ref, q_ref, ot_ref, lse_ref, sk_ref, sv_ref, rk_ref, rv_ref, o_ref, lse_out_ref, *,
            g: int, cols: int, splits: int, sink: int, window: int, d: int, interpret: bool):
    b, h = pl.program_id(0), pl.program_id(1)
    gq, db = _pow2(g), min(d, _D_BLOCK)  # this program's output channels: block program_id(2) of db
    n = n_ref[b]
    qrow = jnp.arange(gq)
    dcol = jnp.arange(d)  # scores take every channel
    vcol = pl.program_id(2) * db + jnp.arange(db)

    # bf16 segments: sink (positions 0..S0-1) and the recent ring (slot j holds the newest
    # position p < n with (p - S0) % W == j: layout.ring_position), natural base.
    # Rows past g (padding up to a power of two) repeat query g - 1, so that the stores of
    # the outputs go unmasked (the copies write the same values).
    qidx = jnp.minimum(qrow, g - 1)
    q = plgpu.load(q_ref.at[b, h, qidx[:, None], dcol[None, :]])
    q_hi, q_lo = _split_bf16(q)
    def segment(k_ref, v_ref, size, positions, carry):
        """Online softmax over one bf16 segment in blocks of `_dense_block(d)` tokens."""
        block = _dense_block(d)
        def step(i, carry):
            m, l, acc = carry
            j = i * block + jnp.arange(block)
            ok = j < size
            pos = positions(j)
            visible = ok & (pos >= 0) & (pos < n)
            rows = jnp.minimum(j, size - 1)[:, None]
            k = plgpu.load(k_ref.at[b, h, rows, dcol[None, :]], mask=ok[:, None], other=0.0)
            s = f32_dot(q_hi, k, 1, interpret) + f32_dot(q_lo, k, 1, interpret)  # [GQ, block]
            s = jnp.where(visible[None, :], s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp(m - m_use)
            p = jnp.exp(s - m_use[:, None])
            p_hi, p_lo = _split_bf16(p)
            v = plgpu.load(v_ref.at[b, h, rows, vcol[None, :]], mask=ok[:, None], other=0.0)
            pv = f32_dot(p_hi, v, 0, interpret) + f32_dot(p_lo, v, 0, interpret)
            return m_new, l * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv

        return lax.fori_loop(0, -(-size // block), step, carry)

    dense = (jnp.full((gq,), -jnp.inf, jnp.float32), jnp.zeros((gq,), jnp.float32), jnp.zeros((gq, db), jnp.float32))
    if sink:
        dense = segment(sk_ref, sv_ref, sink, lambda j: j, dense)
    m_d, l_d, o_d = segment(rk_ref, rv_ref, window, lambda j: layout.ring_position(n, j, sink, window), dense)
    m_du = jnp.where(m_d == -jnp.inf, 0.0, m_d)

    # History partials, base 2: rows r = 8 s + c of a chunk of splits, merged online as one
    # [GQ, R] weight matrix (query i takes the columns c with c % cols == i) times [R, DB].
    chunk = max(1, _CHUNK_ELEMENTS // (8 * db))  # splits per step
    r = jnp.arange(8 * chunk)
    col = r % 8
    mine = (col % cols)[None, :] == qidx[:, None]  # [GQ, R]

    def merge(i, carry):
        m, l, acc = carry
        s_idx = i * chunk + r // 8
        ok = s_idx < splits
        s_safe = jnp.minimum(s_idx, splits - 1)
        lse = plgpu.load(lse_ref.at[b, h, s_safe, col], mask=ok, other=-jnp.inf)  # [R]
        o = plgpu.load(ot_ref.at[b, h, s_safe[:, None], vcol[None, :], col[:, None]],
                       mask=ok[:, None], other=0.0)  # [R, DB]
        lse_q = jnp.where(mine, lse[None, :], -jnp.inf)  # [GQ, R]
        m_new = jnp.maximum(m, jnp.max(lse_q, axis=1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - m_use)
        w = jnp.exp2(lse_q - m_use[:, None])  # 0 off a query's columns
        pw = lax.dot_general(w, o, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST)  # f32 FMAs
        return m_new, l * alpha + jnp.sum(w, axis=1), acc * alpha[:, None] + pw

    init = (jnp.full((gq,), -jnp.inf, jnp.float32), jnp.zeros((gq,), jnp.float32),
            jnp.zeros((gq, db), jnp.float32))
    m_h, l_h, acc_h = lax.fori_loop(0, -(-splits // chunk), merge, init)

    # Merge the two: history (base 2, sums of normalised partials) and bf16 (natural base).
    lse_h = jnp.where(l_h > 0, (m_h + jnp.log2(jnp.where(l_h > 0, l_h, 1.0))) * _LN2, -jnp.inf)
    lse_d = jnp.where(l_d > 0, m_du + jnp.log(jnp.where(l_d > 0, l_d, 1.0)), -jnp.inf)
    lse = jnp.maximum(lse_h, lse_d)
    top = jnp.where(lse == -jnp.inf, 0.0, lse)
    w_h = jnp.where(l_h > 0, jnp.exp(lse_h - top) / jnp.where(l_h > 0, l_h, 1.0), 0.0)
    w_d = jnp.where(l_d > 0, jnp.exp(lse_d - top) / jnp.where(l_d > 0, l_d, 1.0), 0.0)
    total = jnp.where(l_h > 0, jnp.exp(lse_h - top), 0.0) + jnp.where(l_d > 0, jnp.exp(lse_d - top), 0.0)
    safe = jnp.where(total > 0, total, 1.0)
    plgpu.store(o_ref.at[b, h, qidx[:, None], vcol[None, :]],
                (acc_h * w_h[:, None] + o_d * w_d[:, None]) / safe[:, None])
    plgpu.store(lse_out_ref.at[b, h, qidx], jnp.where(total > 0, top + jnp.log(safe), -jnp.inf))  # same per block


def decode_finish(q, o_t, lse2, sink_k, sink_v, recent_k, recent_v, lengths, *, cols: int,
                  sink: int, window: int, g: int, interpret: bool = False):
    """Attend the bf16 segments and merge them with the history partials.

    q: f32 [B, Hkv, R, D] (softmax scale folded in, natural base), of which rows 0..g-1 are
    the g queries (rows past g are ignored); o_t: f32 [B, Hkv, S, D, 8]
    normalised history partials, column c for query c % cols; lse2: f32 [B, Hkv, S, 8] their
    log-sum-exp in base 2 (-inf: nothing seen); sink_k/v bf16 [B, Hkv, S0, D]; recent_k/v
    bf16 [B, Hkv, W, D]; lengths int32 [B]. Returns (o f32 [B, Hkv, g, D], lse f32 [B, Hkv, g],
    natural base).
    """
    b, hkv, rows, d = q.shape
    splits = o_t.shape[2]
    if o_t.shape != (b, hkv, splits, d, 8) or lse2.shape != (b, hkv, splits, 8) or not 1 <= g <= min(cols, rows) <= 8:
        raise ValueError(f"o_t.shape={o_t.shape}, lse2.shape={lse2.shape}, g={g}, cols={cols}: expected "
                         f"[B={b}, Hkv={hkv}, S, D={d}, 8], [B, Hkv, S, 8] and g <= cols <= 8, g <= q.shape[2]")
    full = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)
    out_shape = [jax.ShapeDtypeStruct((b, hkv, g, d), jnp.float32), jax.ShapeDtypeStruct((b, hkv, g), jnp.float32)]
    arrays = (lengths.astype(jnp.int32), q, o_t, lse2, sink_k, sink_v, recent_k, recent_v)
    o, lse = pl.pallas_call(
        functools.partial(_kernel, g=g, cols=cols, splits=splits, sink=sink, window=window, d=d,
                          interpret=interpret),
        grid=(b, hkv, d // min(d, _D_BLOCK)),
        in_specs=[full(x) for x in arrays],
        out_specs=[full(o) for o in out_shape],
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="oscar_decode_finish",
    )(*arrays)
    return o, lse
