"""The start of a Mosaic GPU split decode: every query layout the kernel's MMAs need, in one kernel.

Pallas kernel with Triton lowering (GPU); `interpret=True` runs it on CPU.

One program per (batch row, KV head, block of `Config.channels` rotated channels) rotates its
block of the g queries, folds in the softmax scale and log2 e (every score of the decode is in
base 2), and lays it out for `mixed_attention_mgpu`: the int8 q_hi / q_lo blocks and q_step / Σq tiles of
the history's int8 MMAs, and the bf16 hi + lo parts of the queries for the bf16 MMAs over the
sink and ring. The two per-query numbers that span every channel come from the model-basis
query and the rotation's statistics (`layout.rotation_stats`), so no program needs another's
channels: Σq = q · (M 1), and the int8 split's range is the bound |(q M)_j| <= ‖q‖ max_j ‖M_:j‖
(Cauchy-Schwarz; ‖q‖ for an orthogonal M) instead of the largest rotated element.

Precision: the rotation is bf16 MMAs of the hi + lo parts (`bf16_product`) of the rotation
and of q (q's lo is 0 when q is bf16: two products), ~16 bits, compiled and interpreted alike.
The int8 split's error is about q_step / 2 = ‖q‖ max ‖M_:j‖ / (2 · 127 · 256) per element (up to
one q_step where q_lo clips): against a split over the largest rotated element, coarser by
‖q‖ max ‖M_:j‖ / max_j |(q M)_j|, at most sqrt(D) for an orthogonal M (a query spread evenly
over the channels: ~1.7e-4 of the largest element at D = 128, a tenth of its bf16 rounding),
more for a dual M by its column norms' spread. Given the rotation's parts ready
(`layout.split_bf16`, as `LayerParams` holds them) the kernel splits nothing of it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from oscar_jax.pallas_kernels import layout

N = 8  # query columns of the history kernel's MMAs (and of every partial)
TILE_ROWS = 64  # rows of the history kernel's [64, 8] score tiles (qcol repeats over them)
Q_LO = 256.0  # q ≈ q_step * (256 q_hi + q_lo)
_Q_PEAK = 127.0  # q / unit in [-127, 127]
LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings of `decode_start`: rotated channels per program (at most D), Triton's warps."""

    channels: int = 32
    num_warps: int = 4


def bf16_parts(x: jax.Array) -> tuple[jax.Array, ...]:
    """x (a kernel's tile) -> its bf16 parts: (x,) when x is bf16, else (hi, lo) with
    x ≈ hi + lo (~16 bits)."""
    return (x,) if x.dtype == jnp.bfloat16 else layout.bf16_hi_lo(x)


def rotation_input(rot, kv_heads: int, d: int, name: str) -> tuple[jax.Array | None, bool]:
    """rot: f32 [Hkv, D, D], its bf16 parts [Hkv, 2, D, D] (`layout.split_bf16`) or None ->
    (what the kernel loads: f32, the bf16 parts, or None; whether it is the parts)."""
    if rot is None:
        return None, False
    split = rot.ndim == 4
    if rot.shape != ((kv_heads, 2, d, d) if split else (kv_heads, d, d)):
        raise ValueError(f"{name}.shape={rot.shape}: expected f32 [Hkv={kv_heads}, D={d}, D={d}] "
                         "or its bf16 parts [Hkv, 2, D, D] (layout.split_bf16)")
    return rot.astype(jnp.bfloat16 if split else jnp.float32), split


def bf16_product(a: tuple[jax.Array, ...], b: tuple[jax.Array, ...]) -> jax.Array:
    """f32 a @ b from the bf16 parts of each (`bf16_parts`; [M, K] and [K, N]): the products
    of the parts but lo · lo, in f32 (~16 bits, as fine as the q_hi / q_lo split; TF32 is too
    coarse, and six products for ~f32 would double the kernel's time)."""
    dot = lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32)
    out = dot(a[0], b[0])
    if len(b) > 1:
        out += dot(a[0], b[1])
    if len(a) > 1:
        out += dot(a[1], b[0])
    return out


def split_query(q: jax.Array, peak: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q f32 [..., D] (a row or a block of one) and peak f32 [...] (a bound on |q| over the
    whole row) -> (int8 q_hi, int8 q_lo [..., D], q_step f32 [...]) with q ≈ q_step * (256 q_hi
    + q_lo): |error| <= q_step / 2 = peak / (2 · 127 · 256) (+ a clipped q_lo)."""
    unit = jnp.where(peak > 0, peak / _Q_PEAK, 1.0)
    x = q / unit[..., None]
    hi = jnp.clip(layout.round_to_int(x), -_Q_PEAK, _Q_PEAK)  # a safeguard: |x| <= ~127.0003 from a bound
    lo = jnp.clip(layout.round_to_int((x - hi.astype(jnp.float32)) * Q_LO), -127, 127)
    return hi.astype(jnp.int8), lo.astype(jnp.int8), unit / Q_LO


def _kernel(q_ref, *refs, g: int, cols: int, scale: float, rotate: bool, split: bool):
    """One (batch row, KV head, channel block) of `decode_start`; split: the rotation comes as
    its bf16 parts."""
    rot_ref, stats_ref, qb_ref, qcol_ref, qd_ref = refs if rotate else (None, None, *refs)
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    d, packed, blocks = q_ref.shape[-1], N // cols, pl.num_programs(2)
    cw = d // blocks
    # Row r of a [16, .] tile (a dot's least M) is column c = r % 8 of the N = 8 query columns:
    # rows 8-15 repeat rows 0-7 (the two halves of the bf16 MMAs' B operand; the int8 stores
    # write the copies' same values).
    c = jnp.arange(2 * N) % N
    use = c % cols < g  # column c takes query c % cols of column block c // cols (c < g: query c)
    heads = (h * g + jnp.minimum(c % cols, g - 1))[:, None]
    ch = j * cw + jnp.arange(cw)  # this program's rotated channels
    row = plgpu.load(q_ref.at[b, heads, jnp.arange(d)[None, :]], mask=use[:, None], other=0.0)  # [16, D]
    q32 = row.astype(jnp.float32)
    if rotate:
        rot = (tuple(rot_ref[h, k, :, pl.ds(j * cw, cw)] for k in range(2)) if split else
               bf16_parts(rot_ref[h, :, pl.ds(j * cw, cw)]))
        x = bf16_product(bf16_parts(row), rot)  # [16, cw]
        sums, norms = stats_ref[h, 0, :], stats_ref[h, 1, :]
        q_sum = jnp.sum(q32 * sums[None, :], axis=1)
        peak = jnp.sqrt(jnp.sum(q32 * q32, axis=1)) * jnp.max(norms)
    else:  # q is rotated already: its own largest element and sum
        x = plgpu.load(q_ref.at[b, heads, ch[None, :]], mask=use[:, None], other=0.0).astype(jnp.float32)
        q_sum, peak = jnp.sum(q32, axis=1), jnp.max(jnp.abs(q32), axis=1)
    fold = scale * LOG2E
    x, q_sum, peak = x * fold, q_sum * fold, peak * fold
    tile_rows = c[:, None]
    q_hi, q_lo, q_step = split_query(x, peak)
    for k, part in enumerate((q_hi, q_lo)):
        for jb in range(packed):  # column block jb: zeros outside it
            plgpu.store(qb_ref.at[b, h, jb, k * N + tile_rows, ch[None, :]],
                        jnp.where((c // cols == jb)[:, None], part, jnp.int8(0)))
    for k, part in enumerate(layout.bf16_hi_lo(x)):
        plgpu.store(qd_ref.at[b, h, k, jnp.arange(2 * N)[:, None], ch[None, :]], part)
    rows = j * (TILE_ROWS // blocks) + jnp.arange(TILE_ROWS // blocks)[:, None]  # this program's share
    for k, vec in enumerate((q_step, q_sum)):  # the same in every row of the [64, 8] tile
        plgpu.store(qcol_ref.at[b, h, k, rows, tile_rows.T],
                    jnp.broadcast_to(vec[None, :], (TILE_ROWS // blocks, 2 * N)))


def decode_start(q, query_rot, *, kv_heads: int, softmax_scale: float, packed: int, query_rot_stats=None,
                 interpret: bool = False, config: Config = Config()):
    """q [B, Hq, D] (model basis, or rotated when query_rot is None); query_rot f32
    [Hkv, D, D], its bf16 parts [Hkv, 2, D, D] (`layout.split_bf16`: nothing to split in the
    kernel) or None; query_rot_stats: f32 [Hkv, 2, D] = `layout.rotation_stats(query_rot)` (which
    `LayerParams` holds; computed here when None); packed: the history kernel's token slices
    per score tile; config: `Config`.

    Returns, per (batch row, KV head), in one Triton kernel, all in base 2 (log2 e and the
    softmax scale folded into the rotated queries); column c of the N = 8 query columns is
    query c % (8 / P), so columns 0..g-1 are queries 0..g-1:
      q_blocks int8 [B, Hkv, P, 16, D]: block j holds q_hi in rows 0..7 and q_lo in rows
        8..15 for column block j (zeros elsewhere; padding columns are 0);
      qcol f32 [B, Hkv, 2, 64, 8]: q_step and Σq of each column, repeated over 64 rows;
      q_dense bf16 [B, Hkv, 2, 16, D]: the columns' queries as hi + lo parts (~16 bits), row
        r holding column r % 8 (for the bf16 MMAs over the sink and ring).
    """
    b, hq, d = q.shape
    g, cols = hq // kv_heads, N // packed
    rot, split = rotation_input(query_rot, kv_heads, d, "query_rot")
    rotate = rot is not None
    if rotate:
        stats = layout.rotation_stats(rot) if query_rot_stats is None else query_rot_stats
        if stats.shape != (kv_heads, 2, d) or stats.dtype != jnp.float32:
            raise ValueError(f"query_rot_stats: {stats.dtype} {stats.shape}: expected f32 [Hkv={kv_heads}, 2, "
                             f"D={d}] (layout.rotation_stats)")
        inputs = (q, rot, stats)
    else:
        inputs = (q,)
    full = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
    out_shape = [jax.ShapeDtypeStruct((b, kv_heads, packed, 2 * N, d), jnp.int8),
                 jax.ShapeDtypeStruct((b, kv_heads, 2, TILE_ROWS, N), jnp.float32),
                 jax.ShapeDtypeStruct((b, kv_heads, 2, 2 * N, d), jnp.bfloat16)]
    return pl.pallas_call(
        functools.partial(_kernel, g=g, cols=cols, scale=softmax_scale, rotate=rotate, split=split),
        grid=(b, kv_heads, d // min(d, config.channels)),
        in_specs=[full(x.shape) for x in inputs],
        out_specs=[full(o.shape) for o in out_shape],
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1),
        interpret=interpret,
        name="oscar_decode_start",
    )(*inputs)
