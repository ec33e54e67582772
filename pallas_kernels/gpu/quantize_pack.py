"""Bulk rotate + quantise + pack of prompt keys or values into the history layout.

Pallas kernel with Triton lowering (GPU); `interpret=True` runs it on CPU.
It computes what `quant.pack(quant.quantize(bf16(x @ R), cfg, clip))` computes
(DESIGN §1.2, the layout of `layout.py`) in one pass over x: one program per
(batch row, KV head, block of packed rows) loads the tokens of each packed
slice s with one gather load (token tpb*i + s), rotates them on the matrix
units (R split into two bf16 halves, so the product carries ~16 mantissa
bits before its bf16 rounding), quantises each group of G channels and ORs
the codes of the tpb slices into one byte row, stored as a row of the
token-major K codes or, transposed in-kernel, a column of the channel-major
V codes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_MAX_CHUNK = 128


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """block_rows: packed rows (tokens_per_byte * block_rows tokens) per program."""

    block_rows: int = 32
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if self.block_rows < 16 or self.block_rows & (self.block_rows - 1):
            raise ValueError(f"BlockSizes.block_rows={self.block_rows}: expected a power of two >= 16")


def _kernel(clip_ref, x_ref, rot_hi_ref, rot_lo_ref, codes_ref, lo_ref, scale_ref, *, bits, levels,
            span, group_size, scale_dtype, start, rows_out, block_rows, channel_major, interpret):
    b, h, blk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    t_total, d = x_ref.shape[1], x_ref.shape[3]
    tpb = 8 // bits
    top = float(levels[-1])
    clip = clip_ref[0]
    r0 = blk * block_rows
    row_ids = r0 + jnp.arange(block_rows)
    row_ok = row_ids < rows_out
    if interpret:  # XLA:CPU may accumulate bf16 dots in bf16; the GPU MMA uses f32
        dot = lambda a, r: jnp.dot(a.astype(jnp.float32), r.astype(jnp.float32),
                                   precision=jax.lax.Precision.HIGHEST)
    else:
        dot = lambda a, r: jnp.dot(a, r, preferred_element_type=jnp.float32)
    # A group's rotated channels come in chunks of <= _MAX_CHUNK columns, so the rotation
    # tiles held for one dot stay within shared memory (D = G = 256 needs two).
    cw = min(group_size, _MAX_CHUNK)
    for gi in range(d // group_size):
        chunks = [pl.ds(gi * group_size + j * cw, cw) for j in range(group_size // cw)]

        def rot_tiles(cols):
            return rot_hi_ref[h, :, cols], rot_lo_ref[h, :, cols]  # [D, cw] bf16 each

        hoisted = [rot_tiles(cols) for cols in chunks] if len(chunks) == 1 else None
        packed = [None] * len(chunks)
        for s in range(tpb):
            tok = start + row_ids * tpb + s
            ok = tok < t_total
            x = plgpu.load(x_ref.at[b, jnp.where(ok, tok, 0)[:, None], h, jnp.arange(d)[None, :]],
                           mask=ok[:, None], other=0).astype(jnp.bfloat16)
            xr = []
            for j, cols in enumerate(chunks):
                hi, lo_part = hoisted[j] if hoisted else rot_tiles(cols)
                # [rows, cw], rounded to bf16 as the cache stores it
                xr.append((dot(x, hi) + dot(x, lo_part)).astype(jnp.bfloat16).astype(jnp.float32))
            if span is None:
                xmax = functools.reduce(jnp.maximum, [jnp.max(c, axis=1) for c in xr])
                xmin = functools.reduce(jnp.minimum, [jnp.min(c, axis=1) for c in xr])
                mid = 0.5 * (xmax + xmin)
                half = clip * 0.5 * (xmax - xmin)
            else:
                mid = sum(jnp.sum(c, axis=1) for c in xr) / group_size
                var = sum(jnp.sum((c - mid[:, None]) ** 2, axis=1) for c in xr) / group_size
                half = clip * span * jnp.sqrt(var)
            lo = (mid - half).astype(scale_dtype)
            scale = (2.0 * half / top).astype(scale_dtype)
            lo32, scale32 = lo.astype(jnp.float32)[:, None], scale.astype(jnp.float32)[:, None]
            pos = scale32 > 0
            for j, c in enumerate(xr):
                u = jnp.where(pos, (c - lo32) / jnp.where(pos, scale32, 1.0), 0.0)
                if span is None:
                    u = jnp.clip(u, 0.0, top)  # round half to even, as jnp.round:
                    code = jnp.floor(u)
                    frac = u - code  # exact for 0 <= u < 2**23
                    odd = code - 2.0 * jnp.floor(0.5 * code)
                    code = code + jnp.where((frac > 0.5) | ((frac == 0.5) & (odd == 1.0)), 1.0, 0.0)
                else:
                    code = jnp.zeros_like(u)
                    for k in range(1, len(levels)):
                        code = code + jnp.where(u >= 0.5 * (levels[k] + levels[k - 1]), 1.0, 0.0)
                code = jnp.where(jnp.abs(u) < jnp.inf, code, 0.0).astype(jnp.int32) << (bits * s)
                packed[j] = code if packed[j] is None else packed[j] | code
            idx = (b, h, jnp.int32(gi), jnp.int32(s), pl.ds(r0, block_rows))
            plgpu.store(lo_ref.at[idx], lo, mask=row_ok)
            plgpu.store(scale_ref.at[idx], scale, mask=row_ok)
        for cols, p in zip(chunks, packed):  # p: int32 [block_rows, cw]
            if channel_major:
                plgpu.store(codes_ref.at[b, h, cols, pl.ds(r0, block_rows)], p.T.astype(jnp.uint8),
                            mask=row_ok[None, :])
            else:
                plgpu.store(codes_ref.at[b, h, pl.ds(r0, block_rows), cols], p.astype(jnp.uint8),
                            mask=row_ok[:, None])


def quantize_pack(x, rot, clip, *, bits: int, levels: tuple[float, ...], group_size: int,
                  span: float | None, scale_dtype, start: int = 0, count: int | None = None,
                  channel_major: bool = False, interpret: bool = False,
                  block_sizes: BlockSizes | None = None):
    """Rotate, quantise and pack tokens [start, start + count) of x (zeros past T).

    x: bf16 [B, T, Hkv, D] (model layout); rot: f32 [Hkv, D, D]; clip: f32 [] ratio.
    span: None for the uniform min/max quantiser, else the Lloyd-Max spread factor.
    Returns codes uint8 [B, Hkv, count/tpb, D] (channel_major: [B, Hkv, D, count/tpb],
    the V history's layout), lo and scale (scale_dtype) [B, Hkv, D/G, tpb, count/tpb]:
    `layout.pack_codes` / `layout.pack_meta` order.
    """
    blocks = block_sizes or BlockSizes()
    b, t, hkv, d = x.shape
    tpb = 8 // bits
    count = t - start if count is None else count
    if bits not in (2, 4, 8) or count % tpb or count <= 0:
        raise ValueError(f"count={count}, bits={bits}: expected bits in (2, 4, 8) and count a "
                         f"positive multiple of tokens_per_byte={tpb}")
    if rot.shape != (hkv, d, d):
        raise ValueError(f"rot.shape={rot.shape}: expected [Hkv={hkv}, D={d}, D={d}]")
    if d % group_size or group_size < 16:
        raise ValueError(f"group_size={group_size}: must divide D={d} and be >= 16")
    rows = count // tpb
    rot = rot.astype(jnp.float32)
    rot_hi = rot.astype(jnp.bfloat16)
    rot_lo = (rot - rot_hi.astype(jnp.float32)).astype(jnp.bfloat16)
    clip = jnp.reshape(jnp.asarray(clip, jnp.float32), (1,))
    scale_dtype = jnp.dtype(scale_dtype)
    ng = d // group_size
    kernel = functools.partial(
        _kernel, bits=bits, levels=tuple(levels), span=span, group_size=group_size,
        scale_dtype=scale_dtype, start=start, rows_out=rows, block_rows=blocks.block_rows,
        channel_major=channel_major, interpret=interpret)
    full = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
    meta_shape = jax.ShapeDtypeStruct((b, hkv, ng, tpb, rows), scale_dtype)
    codes_shape = (b, hkv, d, rows) if channel_major else (b, hkv, rows, d)
    out_shape = [jax.ShapeDtypeStruct(codes_shape, jnp.uint8), meta_shape, meta_shape]
    codes, lo, scale = pl.pallas_call(
        kernel,
        grid=(b, hkv, -(-rows // blocks.block_rows)),
        in_specs=[full(clip), full(x), full(rot_hi), full(rot_lo)],
        out_specs=[pl.BlockSpec(o.shape, lambda *_, n=len(o.shape): (0,) * n) for o in out_shape],
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps,
                                             num_stages=blocks.num_stages),
        interpret=interpret,
        name="oscar_quantize_pack",
    )(clip, x.astype(jnp.bfloat16), rot_hi, rot_lo)
    return codes, lo, scale


def supports(spec) -> bool:
    """Cache configurations (a `CacheSpec`) the bulk write handles."""
    return spec.group_size >= 16 and spec.head_dim >= 16
