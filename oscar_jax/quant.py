"""Per-token, per-group asymmetric quantiser (docs/method.md §2).

For each token and each group of G channels:
  uniform:   mid = (max+min)/2, half = c*(max-min)/2, lo = mid - half,
             scale = 2*half/(L-1)
  lloyd_max: lo = mu - 1.51*sigma*c, scale = 2*1.51*sigma*c/3 (2 bits only)
lo and scale are rounded to their storage dtype FIRST, and the code is the
index of the level nearest to x on the stored grid `lo + scale*level[k]`, so
dequantisation reproduces the nearest representable value exactly.
A group containing NaN/Inf yields NaN metadata for that group only.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from oscar_jax.config import LLOYD_MAX_SPAN, QuantConfig
from oscar_jax.pallas_kernels import layout


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Quantized:
    """codes: uint8 [..., T, D]; lo, scale: scale_dtype [..., T, D/G] (unpacked),
    or the packed layout of `pallas_kernels.layout` after `pack` (codes [..., T/tpb, D],
    or [..., D, T/tpb] channel-major)."""

    codes: jax.Array
    lo: jax.Array
    scale: jax.Array


def _grouped(x: jax.Array, group_size: int) -> jax.Array:
    *lead, d = x.shape
    return x.reshape(*lead, d // group_size, group_size)


def _exactly(x32: jax.Array, dtype) -> jax.Array:
    """x32 (f32 values of a `dtype` array) pinned to `dtype`'s precision.

    XLA:GPU may drop a f32 -> bf16 -> f32 convert pair (excess precision), which
    made codes disagree with the bf16 data and metadata the cache stores;
    reduce_precision keeps the rounding.
    """
    fi = jnp.finfo(dtype)
    if fi.bits >= 32:
        return x32
    return lax.reduce_precision(x32, exponent_bits=fi.nexp, mantissa_bits=fi.nmant)


def quantize(x: jax.Array, cfg: QuantConfig, clip: float | jax.Array = 1.0) -> Quantized:
    """x: [..., T, D] float -> Quantized with codes [..., T, D], lo/scale [..., T, D/G].

    clip: range shrink ratio c in (0, 1], a Python float or a traced scalar.
    """
    d = x.shape[-1]
    g = cfg.group_size or d
    if d % g:
        raise ValueError(f"x.shape[-1]={d} is not a multiple of group_size={g}")
    xg = _grouped(_exactly(x.astype(jnp.float32), x.dtype), g)  # [..., T, n_groups, G]
    clip = jnp.asarray(clip, jnp.float32)
    levels = jnp.asarray(cfg.levels, jnp.float32)
    top = float(cfg.levels[-1])
    if cfg.codebook == "uniform":
        xmax = jnp.max(xg, axis=-1)
        xmin = jnp.min(xg, axis=-1)
        mid = 0.5 * (xmax + xmin)
        half = clip * 0.5 * (xmax - xmin)
    else:
        mid = jnp.mean(xg, axis=-1)
        half = clip * LLOYD_MAX_SPAN * jnp.sqrt(jnp.mean((xg - mid[..., None]) ** 2, axis=-1))
    lo = (mid - half).astype(cfg.jnp_scale_dtype)
    scale = (2.0 * half / top).astype(cfg.jnp_scale_dtype)
    lo32 = _exactly(lo.astype(jnp.float32), lo.dtype)[..., None]
    scale32 = _exactly(scale.astype(jnp.float32), scale.dtype)[..., None]
    safe = jnp.where(scale32 > 0, scale32, 1.0)
    u = jnp.where(scale32 > 0, (xg - lo32) / safe, 0.0)  # position in units of scale
    if cfg.codebook == "uniform":
        code = jnp.clip(jnp.round(u), 0, top)
    else:  # nearest of the non-uniform levels: count the midpoints below u
        mids = 0.5 * (levels[1:] + levels[:-1])
        code = jnp.sum(u[..., None] >= mids, axis=-1).astype(jnp.float32)
    code = jnp.where(jnp.isfinite(u), code, 0).astype(jnp.uint8)
    return Quantized(codes=code.reshape(x.shape), lo=lo, scale=scale)


def dequantize(q: Quantized, cfg: QuantConfig, dtype=jnp.float32) -> jax.Array:
    """Quantized (unpacked) -> x_hat [..., T, D] = lo + scale * level[code]."""
    d = q.codes.shape[-1]
    g = d // q.lo.shape[-1]
    levels = jnp.asarray(cfg.levels, jnp.float32)
    vals = _grouped(levels[q.codes.astype(jnp.int32)], g)
    out = q.lo.astype(jnp.float32)[..., None] + q.scale.astype(jnp.float32)[..., None] * vals
    return out.reshape(q.codes.shape).astype(dtype)


def pack(q: Quantized, bits: int, *, channel_major: bool = False) -> Quantized:
    """Unpacked [..., T, *] -> packed layout: codes [..., T/tpb, D] (or [..., D, T/tpb]
    when channel_major, as the V history), meta [..., n_groups, tpb, T/tpb]."""
    return Quantized(
        codes=layout.pack_codes(q.codes, bits, channel_major=channel_major),
        lo=layout.pack_meta(q.lo, bits),
        scale=layout.pack_meta(q.scale, bits),
    )


def unpack(q: Quantized, bits: int, *, channel_major: bool = False) -> Quantized:
    """Inverse of `pack`."""
    return Quantized(
        codes=layout.unpack_codes(q.codes, bits, channel_major=channel_major),
        lo=layout.unpack_meta(q.lo, bits),
        scale=layout.unpack_meta(q.scale, bits),
    )
