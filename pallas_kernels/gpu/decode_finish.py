"""The end of a Mosaic GPU decode: the merge of its partials and the back-rotation.

Pallas kernel with Triton lowering (GPU); `interpret=True` runs it on CPU.

Per (batch row, KV head) the Mosaic GPU kernel (`mixed_attention_mgpu`) leaves up to S
partials (its history pieces, and one more for the bf16 sink and ring; `counts` says how
many each has): o^T [D, 8] normalised and
its log-sum-exp in base 2, column c for query c % cols (column blocks of packed token
slices; -inf where a partial saw nothing). One program per (batch row, KV head, block of 64
output channels, 32 without the rotation) merges the partials elementwise in f32 (pass 1: each query's largest lse;
pass 2: the weighted sum of the [D, 8] partials, whole 32-byte rows, several per step; an
FMA dot over all 16 query rows would be half of the kernel's instructions) and,
given the output rotation, rotates its block of the result back (rows of the rotation times
o_rot; it then merges all D). The returned lse is in the natural base.

Precision: the merge is exact f32; the rotation is bf16 MMAs of the hi + lo parts of the
rotation and of the merged output (`decode_start.bf16_product`, ~16 bits), compiled and
interpreted alike; given the rotation's parts ready (`layout.split_bf16`) the kernel splits
only the output.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .decode_start import bf16_parts, bf16_product, rotation_input

_LN2 = math.log(2.0)
_Q = 16  # query columns of every tile: the partials' 8, padded to the least dot N


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings of `decode_finish`.

    channels: output channels per program with the back-rotation (each program then merges
      all D); merge_channels: without it (the fastest of 32, 64 and 128 at D = 128);
    chunk_elements: f32 elements of partials merged per step ([chunk, D_merged, 8]);
    num_warps, num_stages: Triton's.
    """

    channels: int = 64
    merge_channels: int = 32
    chunk_elements: int = 8192
    num_warps: int = 4
    num_stages: int = 2

    def channel_block(self, d: int, rotate: bool) -> int:
        """Output channels per program."""
        return min(d, self.channels if rotate else self.merge_channels)


def _pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def _kernel(ot_ref, lse_ref, counts_ref, *refs, g: int, cols: int, counts_at: int, rotate: bool, split: bool,
            config: Config):
    rot_ref, o_ref, lse_out_ref = refs if rotate else (None, *refs)
    b, h = pl.program_id(0), pl.program_id(1)
    splits, d = ot_ref.shape[2], ot_ref.shape[3]
    used = counts_ref[counts_at + b * pl.num_programs(1) + h]  # partials 0 .. used - 1 hold data
    db = config.channel_block(d, rotate)
    out_cols = pl.program_id(2) * db + jnp.arange(db)  # this program's output channels
    mcol = jnp.arange(d) if rotate else out_cols  # the channels it merges
    # Query column i holds query min(i, g - 1): columns past g repeat query g - 1, so that the
    # stores go unmasked (the copies write the same values).
    queries = jnp.minimum(jnp.arange(_Q), g - 1)
    finite = lambda x: jnp.where(x == -jnp.inf, 0.0, x)
    p8 = jnp.arange(8)
    owns = p8[:, None] % cols == queries[None, :]  # [8 partial columns, 16 query columns]
    same = p8[:, None] % cols == p8[None, :] % cols  # [8, 8]: the partial columns of one query

    def load(at, ok, other):
        """A load of partial slots, `other` where not ok (a slot past `counts`: any bits, NaN
        too). When the program only merges, unmasked with a select, so that no load waits for
        the count; with the rotation masked, which skips the unused slots (each the faster
        there)."""
        return plgpu.load(at, mask=ok, other=other) if rotate else jnp.where(ok, plgpu.load(at), other)

    # Pass 1: each query's largest log-sum-exp, per partial column.
    s_ids = jnp.arange(_pow2(splits))
    lses = load(lse_ref.at[b, h, jnp.minimum(s_ids, splits - 1)[:, None], p8[None, :]],
                (s_ids < used)[:, None], -jnp.inf)  # [S_pad, 8]
    col_top = jnp.max(lses, axis=0)
    top = finite(jnp.max(jnp.where(same, col_top[None, :], -jnp.inf), axis=1))  # per partial column
    top_q = finite(jnp.max(jnp.where(owns, col_top[:, None], -jnp.inf), axis=0))  # per query column

    # Pass 2: acc[:, p] = sum over partials of 2^(lse - top) o (elementwise, f32), `chunk`
    # partials ([chunk, D_merged, 8], whole 32-byte rows) per step.
    chunk = min(_pow2(splits), max(1, config.chunk_elements // (mcol.shape[0] * 8)))
    ks = jnp.arange(chunk)

    def merge(i, carry):
        acc, l = carry
        s_idx = i * chunk + ks
        ok = s_idx < used
        s_safe = jnp.minimum(s_idx, splits - 1)
        lse_k = load(lse_ref.at[b, h, s_safe[:, None], p8[None, :]], ok[:, None], -jnp.inf)
        w = jnp.exp2(lse_k - top[None, :])  # [chunk, 8]
        o = load(ot_ref.at[b, h, s_safe[:, None, None], mcol[None, :, None], p8[None, None, :]],
                 ok[:, None, None], 0.0)  # [chunk, D_merged, 8]
        return acc + jnp.sum(o * w[:, None, :], axis=0), l + jnp.sum(w, axis=0)

    acc, l_col = lax.fori_loop(0, -(-splits // chunk), merge, (jnp.zeros((mcol.shape[0], 8), jnp.float32),
                                                               jnp.zeros((8,), jnp.float32)))
    sel = owns.astype(jnp.float32)
    total = jnp.sum(l_col[:, None] * sel, axis=0)  # [16 query columns]: sum of 2^(lse - top_q)
    seen = total > 0
    o = jnp.sum(acc[:, :, None] * sel[None, :, :], axis=1) / jnp.where(seen, total, 1.0)[None, :]  # [D_merged, 16]
    if rotate:  # o_model = R o_rot: rows out_cols of R
        rows = lambda *k: plgpu.load(rot_ref.at[(h, *k, out_cols[:, None], mcol[None, :])])  # [DB, D]
        o = bf16_product((rows(0), rows(1)) if split else bf16_parts(rows()), bf16_parts(o))
    plgpu.store(o_ref.at[b, h, queries[None, :], out_cols[:, None]], o.astype(o_ref.dtype))
    lse = jnp.where(seen, (top_q + jnp.log2(jnp.where(seen, total, 1.0))) * _LN2, -jnp.inf)
    plgpu.store(lse_out_ref.at[b, h, queries], lse)  # the same in every channel block


def decode_finish(o_t, lse2, counts, *, cols: int, g: int, counts_at: int = 0, output_rot=None,
                  out_dtype=jnp.float32, interpret: bool = False, config: Config = Config()):
    """Merge the partials, rotate back.

    o_t: f32 [B, Hkv, S, D, 8] normalised partials, column c for query c % cols; lse2: f32
    [B, Hkv, S, 8] their log-sum-exp in base 2 (-inf: nothing seen); counts: int32, flat
    elements counts_at + b Hkv + h = the partials (row b, head h) has, its first ones (the
    rest any bits, NaN too, never used): a [B, Hkv] array, or a longer table that holds them
    (a constant with equal elements would be a broadcast kernel of its own in XLA);
    output_rot: f32 [Hkv, D, D], its bf16 parts [Hkv, 2, D, D] (`layout.split_bf16`) or None
    (o = o_rot · output_rot[h]^T when given; each channel block then merges all D, which the
    Mosaic GPU path does only at D <= 128). Returns (o out_dtype [B, Hkv, g, D]
    (written so by the kernel: no XLA convert after it), lse f32 [B, Hkv, g], natural base).
    config: `Config`.
    """
    b, hkv, splits, d = o_t.shape[:4]
    if o_t.shape != (b, hkv, splits, d, 8) or lse2.shape != (b, hkv, splits, 8) or not 1 <= g <= cols <= 8:
        raise ValueError(f"o_t.shape={o_t.shape}, lse2.shape={lse2.shape}, g={g}, cols={cols}: expected "
                         "[B, Hkv, S, D, 8], [B, Hkv, S, 8] and 1 <= g <= cols <= 8")
    rot, split = rotation_input(output_rot, hkv, d, "output_rot")
    rotate = rot is not None
    if counts.dtype != jnp.int32 or not 0 <= counts_at <= counts.size - b * hkv:
        raise ValueError(f"counts: {counts.dtype} {counts.shape}, counts_at={counts_at}: expected int32 "
                         f"holding B x Hkv = {b * hkv} counts from flat element counts_at on")
    counts = counts.reshape(-1)
    arrays = (o_t, lse2, counts, *((rot,) if rotate else ()))
    full = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)
    out_shape = [jax.ShapeDtypeStruct((b, hkv, g, d), out_dtype), jax.ShapeDtypeStruct((b, hkv, g), jnp.float32)]
    return pl.pallas_call(
        functools.partial(_kernel, g=g, cols=cols, counts_at=counts_at, rotate=rotate, split=split, config=config),
        grid=(b, hkv, d // config.channel_block(d, rotate)),
        in_specs=[full(x) for x in arrays],
        out_specs=[full(o) for o in out_shape],
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="oscar_decode_finish",
    )(*arrays)
