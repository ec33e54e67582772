"""Bulk write of a prompt's K or V into the packed history on TPU (Pallas Mosaic).

rotate -> round to the store dtype -> clip -> quantise -> pack, in one pass over
the prompt: each grid step reads a [tokens, Hkv*D] tile of the model-layout
activations, and writes packed codes [Hkv, tokens/tpb, D] (keys) or
[Hkv, D, tokens/tpb] (channel-major, values) and metadata
[Hkv, D/G, tpb, tokens/tpb] in the layout of `layout.pack_codes` /
`layout.pack_meta` (docs/ARCHITECTURE.md, "The cache format"). Token slice s of a byte row (tokens tpb*i + s)
is read with a strided sublane load, so packing is a shift-and-OR of tpb
quantised slices and never needs a cross-sublane shuffle.

The quantiser is the one of `oscar_jax.quant.quantize` (docs/method.md, "The quantiser"), written
with masked per-group lane reductions instead of a lane-splitting reshape;
verified against `quant.pack(quant.quantize(x @ R))` in TPU interpret mode.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from oscar_jax.pallas_kernels import layout
from oscar_jax.pallas_kernels.tpu.mixed_attention import NUM_LANES, interpret_params

_HI = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class WriteBlockSizes:
    """tokens: prompt tokens per grid step; a multiple of 128 * tpb (the metadata
    block puts tokens/tpb on lanes), or the whole prompt when it is shorter."""

    tokens: int = 2048

    def __post_init__(self):
        if self.tokens <= 0 or self.tokens % (4 * NUM_LANES):
            raise ValueError(f"WriteBlockSizes.tokens={self.tokens}: expected a positive multiple "
                             f"of {4 * NUM_LANES}")


def _quantize_slice(x, clip, *, n_groups, levels, codebook, span, scale_dtype):
    """x f32 [R, D] -> codes int32 [R, D], lo and scale (scale_dtype) [R, n_groups]."""
    rows, d = x.shape
    group = d // n_groups
    top = float(levels[-1])
    lane_group = jax.lax.broadcasted_iota(jnp.int32, (1, d), 1) // group
    los, scales = [], []
    lo_lanes = jnp.zeros_like(x)
    scale_lanes = jnp.zeros_like(x)
    for gi in range(n_groups):
        in_group = lane_group == gi
        if codebook == "uniform":
            xmax = jnp.max(jnp.where(in_group, x, -jnp.inf), axis=-1, keepdims=True)
            xmin = jnp.min(jnp.where(in_group, x, jnp.inf), axis=-1, keepdims=True)
            mid = 0.5 * (xmax + xmin)
            half = clip * 0.5 * (xmax - xmin)
        else:
            mid = jnp.sum(jnp.where(in_group, x, 0.0), axis=-1, keepdims=True) / group
            dev = jnp.where(in_group, x - mid, 0.0)
            half = clip * span * jnp.sqrt(jnp.sum(dev * dev, axis=-1, keepdims=True) / group)
        lo = (mid - half).astype(scale_dtype)
        scale = (2.0 * half / top).astype(scale_dtype)
        los.append(lo)
        scales.append(scale)
        lo_lanes = jnp.where(in_group, lo.astype(jnp.float32), lo_lanes)
        scale_lanes = jnp.where(in_group, scale.astype(jnp.float32), scale_lanes)
    positive = scale_lanes > 0
    u = jnp.where(positive, (x - lo_lanes) / jnp.where(positive, scale_lanes, 1.0), 0.0)
    if codebook == "uniform":
        code = jnp.clip(jnp.round(u), 0.0, top)
    else:  # nearest non-uniform level: count the midpoints at or below u
        code = sum((u >= 0.5 * (a + b)).astype(jnp.float32) for a, b in zip(levels, levels[1:]))
    code = jnp.where(jnp.isfinite(u), code, 0.0).astype(jnp.int32)
    return code, jnp.concatenate(los, axis=1), jnp.concatenate(scales, axis=1)


def _kernel(clip_ref, x_ref, rot_ref, codes_ref, lo_ref, scale_ref, *, bits, n_groups, levels,
            codebook, span, round_to, channel_major):
    """x_ref [tokens, Hkv*D]; rot_ref f32 [Hkv, D, D]; codes_ref u8 [Hkv, tokens/tpb, D]
    ([Hkv, D, tokens/tpb] when channel_major); lo_ref, scale_ref [Hkv, n_groups, tpb,
    tokens/tpb]; clip_ref f32 [1] in SMEM."""
    hkv, d = rot_ref.shape[:2]
    rows = lo_ref.shape[-1]
    tpb = 8 // bits
    clip = clip_ref[0]
    for h in range(hkv):
        packed = jnp.zeros((rows, d), jnp.int32)
        for s in range(tpb):
            x = x_ref[pl.ds(s, rows, stride=tpb), pl.ds(h * d, d)].astype(jnp.float32)
            x = jnp.dot(x, rot_ref[h], precision=_HI, preferred_element_type=jnp.float32)
            if round_to is not None:
                x = x.astype(round_to).astype(jnp.float32)
            code, lo, scale = _quantize_slice(x, clip, n_groups=n_groups, levels=levels,
                                              codebook=codebook, span=span,
                                              scale_dtype=lo_ref.dtype)
            packed = packed | (code << (bits * s))
            lo_ref[h, :, s, :] = lo.T
            scale_ref[h, :, s, :] = scale.T
        codes_ref[h] = (packed.T if channel_major else packed).astype(jnp.uint8)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "levels", "codebook",
                                             "lloyd_max_span", "scale_dtype", "round_to",
                                             "channel_major", "interpret", "block_sizes"))
def bulk_write(x, rot, clip, *, bits: int, group_size: int | None, levels: tuple[float, ...],
               codebook: str = "uniform", lloyd_max_span: float | None = None,
               scale_dtype: str = "bfloat16",
               round_to: str | None = "bfloat16", channel_major: bool = False,
               interpret: bool | pltpu.InterpretParams = False,
               block_sizes: WriteBlockSizes = WriteBlockSizes()):
    """Rotate, quantise and pack a prompt's keys or values for the history.

    x: [B, T, Hkv, D] float (model layout, unrotated), T a multiple of tpb = 8 // bits;
    rot: f32 [Hkv, D, D]; clip: f32 scalar in (0, 1]. bits, group_size, levels,
    codebook, lloyd_max_span (required for "lloyd_max") and scale_dtype are the
    fields of the cache's `QuantConfig`. round_to: dtype the rotated
    values are rounded to before quantising ("bfloat16" as `updates.write_prompt`
    does; None keeps float32). Returns (codes u8 [B, Hkv, T/tpb, D] or, channel_major
    (the V history), [B, Hkv, D, T/tpb]; lo, scale scale_dtype [B, Hkv, D/G, tpb, T/tpb])
    = `quant.pack(quant.quantize(rotated, cfg, clip), channel_major=channel_major)`.
    """
    if x.ndim != 4:
        raise ValueError(f"x.shape={x.shape}: expected [B, T, Hkv, D]")
    bsz, t, hkv, d = x.shape
    tpb = layout.tokens_per_byte(bits)
    if t % tpb:
        raise ValueError(f"x.shape={x.shape}: T={t} must be a multiple of tpb={tpb} for {bits=}")
    if rot.shape != (hkv, d, d):
        raise ValueError(f"rot.shape={rot.shape}: expected [Hkv={hkv}, D={d}, D={d}]")
    group = group_size or d
    if d % group:
        raise ValueError(f"group_size={group} must divide D={d}")
    if len(levels) != 1 << bits:
        raise ValueError(f"levels has {len(levels)} entries, expected 2**bits = {1 << bits}")
    if codebook not in ("uniform", "lloyd_max"):
        raise ValueError(f"codebook={codebook!r}: expected 'uniform' or 'lloyd_max'")
    if codebook == "lloyd_max" and not (lloyd_max_span and lloyd_max_span > 0):
        raise ValueError(f"{lloyd_max_span=}: codebook='lloyd_max' needs a positive span")
    n_groups = d // group
    tokens = t if t <= block_sizes.tokens else block_sizes.tokens
    rows = tokens // tpb
    meta_dtype = jnp.dtype(scale_dtype)
    sq = pl.squeezed
    kernel = functools.partial(_kernel, bits=bits, n_groups=n_groups, levels=tuple(levels),
                               codebook=codebook, span=lloyd_max_span,
                               round_to=None if round_to is None else jnp.dtype(round_to),
                               channel_major=channel_major)
    if channel_major:
        codes_spec = pl.BlockSpec((sq, hkv, d, rows), lambda b, i: (b, 0, 0, i))
        codes_shape = (bsz, hkv, d, t // tpb)
    else:
        codes_spec = pl.BlockSpec((sq, hkv, rows, d), lambda b, i: (b, 0, i, 0))
        codes_shape = (bsz, hkv, t // tpb, d)
    return pl.pallas_call(
        kernel,
        grid=(bsz, pl.cdiv(t, tokens)),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM),
                  pl.BlockSpec((sq, tokens, hkv * d), lambda b, i: (b, i, 0)),
                  pl.BlockSpec((hkv, d, d), lambda b, i: (0, 0, 0))],
        out_specs=[codes_spec,
                   pl.BlockSpec((sq, hkv, n_groups, tpb, rows), lambda b, i: (b, 0, 0, 0, i)),
                   pl.BlockSpec((sq, hkv, n_groups, tpb, rows), lambda b, i: (b, 0, 0, 0, i))],
        out_shape=[jax.ShapeDtypeStruct(codes_shape, jnp.uint8),
                   jax.ShapeDtypeStruct((bsz, hkv, n_groups, tpb, t // tpb), meta_dtype),
                   jax.ShapeDtypeStruct((bsz, hkv, n_groups, tpb, t // tpb), meta_dtype)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret_params(interpret),
        name="oscar_bulk_write_tpu",
    )(jnp.asarray(clip, jnp.float32).reshape(1), x.reshape(bsz, t, hkv * d),
      jnp.asarray(rot, jnp.float32))
