"""Bulk rotate + quantise + pack of prompt keys or values into the history layout.

Pallas kernel with Triton lowering (GPU); `interpret=True` runs it on CPU.
It computes what `quant.pack(quant.quantize(bf16(x @ R), cfg, clip))` computes
(docs/method.md, "The quantiser"; the layout of `layout.py`) in one pass over x. One program per
(batch row, KV head, run of `loop` blocks) walks its blocks, holding the head's rotation
when it is one tile (D <= 128, one group); a block is `tpb * block_rows` consecutive
tokens, loaded as one tile and
rotated by one matrix product (R split into two bf16 halves, so the product carries
~16 mantissa bits before its bf16 rounding). Each group of G channels is quantised
per token, and the codes of tokens tpb*i + s are shifted by bits*s and summed over s
(a reshape of the tile) into byte row i, stored as a row of the token-major K codes
or, transposed in-kernel, a column of the channel-major V codes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from oscar_jax.pallas_kernels import layout

_MAX_CHUNK = 128


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """block_rows: packed rows per block (tokens_per_byte * block_rows tokens, the M of
    the rotation product); loop: blocks per program (the rotation is loaded once for them;
    > 1 at D > 128 exceeds Hopper's shared memory, Triton's pipelining buffers the
    per-group rotation tiles of every block)."""

    block_rows: int = 16
    loop: int = 16
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if self.block_rows < 16 or self.block_rows & (self.block_rows - 1):
            raise ValueError(f"BlockSizes.block_rows={self.block_rows}: expected a power of two >= 16")
        if self.loop < 1:
            raise ValueError(f"BlockSizes.loop={self.loop}: expected >= 1")

    @classmethod
    def default(cls, head_dim: int, group_size: int) -> "BlockSizes":
        """The fastest of a sweep on Hopper (GPU time, `bench/kernels.py`'s `tune_write`):
        one group per token at D <= 128 loops over blocks with the rotation held; several
        groups, or D = 256, take one block per program."""
        if group_size < head_dim or head_dim > 128:
            return cls(block_rows=32, loop=1, num_warps=8)
        return cls(block_rows=16, loop=4 if head_dim <= 64 else 16, num_warps=4)


def quantize_group(chunks, clip, *, span, levels, scale_dtype):
    """One group of channels of m tokens, quantised as `quant.quantize` does (docs/method.md,
    "The quantiser"): chunks f32 [m, cw] each (the group's channels, values exactly bf16),
    clip f32 [] -> lo, scale (scale_dtype) [m] and each chunk's codes int32 [m, cw]
    (non-finite positions code 0). span: None for the uniform min/max quantiser, else the
    Lloyd-Max spread factor."""
    top = float(levels[-1])
    size = sum(c.shape[1] for c in chunks)
    if span is None:
        xmax = functools.reduce(jnp.maximum, [jnp.max(c, axis=1) for c in chunks])
        xmin = functools.reduce(jnp.minimum, [jnp.min(c, axis=1) for c in chunks])
        mid = 0.5 * (xmax + xmin)
        half = clip * 0.5 * (xmax - xmin)
    else:
        mid = sum(jnp.sum(c, axis=1) for c in chunks) / size
        var = sum(jnp.sum((c - mid[:, None]) ** 2, axis=1) for c in chunks) / size
        half = clip * span * jnp.sqrt(var)
    lo = (mid - half).astype(scale_dtype)  # [m]
    scale = (2.0 * half / top).astype(scale_dtype)
    lo32, scale32 = lo.astype(jnp.float32)[:, None], scale.astype(jnp.float32)[:, None]
    pos = scale32 > 0
    codes = []
    for c in chunks:
        u = jnp.where(pos, (c - lo32) / jnp.where(pos, scale32, 1.0), 0.0)
        if span is None:  # round half to even, as jnp.round
            code = layout.round_to_int(jnp.clip(u, 0.0, top))
        else:
            code = jnp.zeros(u.shape, jnp.int32)
            for k in range(1, len(levels)):
                code = code + jnp.where(u >= 0.5 * (levels[k] + levels[k - 1]), 1, 0)
        codes.append(jnp.where(jnp.abs(u) < jnp.inf, code, 0))
    return lo, scale, codes


def _kernel(clip_ref, x_ref, rot_hi_ref, rot_lo_ref, codes_ref, lo_ref, scale_ref, *, bits, levels,
            span, group_size, scale_dtype, start, rows_out, block_rows, loop, channel_major, interpret):
    b, h, prog = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    t_total, d = x_ref.shape[1], x_ref.shape[3]
    tpb = 8 // bits
    m = tpb * block_rows  # tokens per block
    clip = clip_ref[0]
    if interpret:  # XLA:CPU may accumulate bf16 dots in bf16; the GPU MMA uses f32
        dot = lambda a, r: jnp.dot(a.astype(jnp.float32), r.astype(jnp.float32),
                                   precision=jax.lax.Precision.HIGHEST)
    else:
        dot = lambda a, r: jnp.dot(a, r, preferred_element_type=jnp.float32)
    # A group's rotated channels come in chunks of <= _MAX_CHUNK columns, so the rotation
    # tiles held for one product stay within shared memory (D = G = 256 needs two).
    cw = min(group_size, _MAX_CHUNK)
    groups = [[pl.ds(gi * group_size + j * cw, cw) for j in range(group_size // cw)]
              for gi in range(d // group_size)]
    rot_tiles = lambda cols: (rot_hi_ref[h, :, cols], rot_lo_ref[h, :, cols])  # [D, cw] bf16 each
    hoisted = rot_tiles(groups[0][0]) if d <= _MAX_CHUNK and len(groups) == 1 else None
    j = jnp.arange(m)
    slot = j % tpb  # token j of a block: slice j % tpb of packed row j // tpb
    shift = (bits * slot)[:, None]

    def block(i, carry):
        r0 = (prog * loop + i) * block_rows
        tok = start + tpb * r0 + j
        ok = tok < t_total
        x = plgpu.load(x_ref.at[b, jnp.where(ok, tok, 0)[:, None], h, jnp.arange(d)[None, :]],
                       mask=ok[:, None], other=0).astype(jnp.bfloat16)  # [m, D]
        row = r0 + j // tpb
        row_ok = row < rows_out
        for gi, chunks in enumerate(groups):
            xr = []
            for cols in chunks:
                hi, lo_part = hoisted if hoisted is not None else rot_tiles(cols)
                # [m, cw], rounded to bf16 as the cache stores it
                xr.append((dot(x, hi) + dot(x, lo_part)).astype(jnp.bfloat16).astype(jnp.float32))
            lo, scale, codes = quantize_group(xr, clip, span=span, levels=levels, scale_dtype=scale_dtype)
            for cols, code in zip(chunks, codes):
                code = code << shift
                packed = jnp.sum(code.reshape(block_rows, tpb, cw), axis=1)  # [block_rows, cw]
                rows = pl.ds(r0, block_rows)
                prow_ok = r0 + jnp.arange(block_rows) < rows_out
                if channel_major:
                    plgpu.store(codes_ref.at[b, h, cols, rows], packed.T.astype(jnp.uint8),
                                mask=prow_ok[None, :])
                else:
                    plgpu.store(codes_ref.at[b, h, rows, cols], packed.astype(jnp.uint8),
                                mask=prow_ok[:, None])
            idx = (b, h, jnp.int32(gi), slot, row)
            plgpu.store(lo_ref.at[idx], lo, mask=row_ok)
            plgpu.store(scale_ref.at[idx], scale, mask=row_ok)
        return carry

    if loop == 1:
        block(0, None)
    else:
        jax.lax.fori_loop(0, loop, block, None)


def split_rotation(rot: jax.Array) -> tuple[jax.Array, jax.Array]:
    """rot f32 [..., D, D] -> bf16 (R_hi, R_lo) with R_hi + R_lo = R to ~16 bits: the two
    halves the bulk kernels multiply by (f32 accumulation), one bf16 MMA each."""
    rot = rot.astype(jnp.float32)
    hi = rot.astype(jnp.bfloat16)
    return hi, (rot - hi.astype(jnp.float32)).astype(jnp.bfloat16)


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
    blocks = block_sizes or BlockSizes.default(x.shape[3], group_size)
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
    loop = min(blocks.loop, -(-rows // blocks.block_rows))  # no program walks past the last row
    rot_hi, rot_lo = split_rotation(rot)
    clip = jnp.reshape(jnp.asarray(clip, jnp.float32), (1,))
    scale_dtype = jnp.dtype(scale_dtype)
    ng = d // group_size
    kernel = functools.partial(
        _kernel, bits=bits, levels=tuple(levels), span=span, group_size=group_size,
        scale_dtype=scale_dtype, start=start, rows_out=rows, block_rows=blocks.block_rows,
        loop=loop, channel_major=channel_major, interpret=interpret)
    full = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
    meta_shape = jax.ShapeDtypeStruct((b, hkv, ng, tpb, rows), scale_dtype)
    codes_shape = (b, hkv, d, rows) if channel_major else (b, hkv, rows, d)
    out_shape = [jax.ShapeDtypeStruct(codes_shape, jnp.uint8), meta_shape, meta_shape]
    codes, lo, scale = pl.pallas_call(
        kernel,
        grid=(b, hkv, -(-rows // (blocks.block_rows * loop))),
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
