"""The packed layout of the quantised KV history (docs/ARCHITECTURE.md, "The cache format"),
in plain jnp, and the cache arrays every attention kernel takes (`CacheArrays`).

Codes are packed along TOKENS: with `tpb = 8 // bits` tokens per byte, a byte
holds one channel c of tokens tpb*i .. tpb*i + tpb - 1, token tpb*i + s in
bits [bits*s, bits*(s+1)). Unpacking therefore yields `tpb` token slices
(slice s = tokens tpb*i + s), each a plain shift-and-mask of the packed tile.

Keys are token-major, [..., T/tpb, D]: byte (i, c), channels on the last
(lane) axis. Values are CHANNEL-MAJOR, [..., D, T/tpb]: byte (c, i), exactly
the swapaxes of the key layout (`CHANNEL_MAJOR`). Int8 wgmma takes both
operands K-major only, and for V^T·P the reduction axis is tokens, so a
32-bit word must hold 16 tokens of ONE channel: `(w >> 2s) & 0x03030303` then
yields 4 int8 codes of one channel, one A-operand register.

Per-token, per-group metadata (lo, scale) is stored as [..., n_groups, tpb, R]
so that index [g, s, i] is token tpb*i + s: each unpacked slice reads its
metadata contiguously.

This module is the single definition of the layout: `oscar_jax.quant` and
every kernel import it, and kernels import nothing else of ours. It also holds
the two scalar rules kernels share: `round_to_int` (the codes' and the int8
query split's rounding) and `ring_position` (which position a ring slot holds).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

_VALID_BITS = (2, 4, 8)

# Whether the packed codes of the K / V history are channel-major ([..., D, T/tpb]).
CHANNEL_MAJOR = {"k": False, "v": True}


class CacheArrays(NamedTuple):
    """One layer's cache arrays, the attention kernels' cache argument (the fields of
    `oscar_jax.OscarCache` of the same names; tpb = 8 // bits, G the group size):

    sink_k, sink_v: bf16 [B, Hkv, S0, D] (positions [0, S0), rotated);
    hist_codes_k: uint8 [B, Hkv, T_hist/tpb, D] (`pack_codes`);
    hist_codes_v: uint8 [B, Hkv, D, T_hist/tpb] (channel-major, `CHANNEL_MAJOR`);
    hist_lo_k, hist_scale_k, hist_lo_v, hist_scale_v: bf16 or f32 [B, Hkv, D/G, tpb,
      T_hist/tpb] (`pack_meta`);
    recent_k, recent_v: bf16 [B, Hkv, W, D] (the ring: position p in slot (p - S0) % W);
    lengths: int32 [B] (tokens held per sequence).
    """

    sink_k: jax.Array
    sink_v: jax.Array
    hist_codes_k: jax.Array
    hist_codes_v: jax.Array
    hist_lo_k: jax.Array
    hist_scale_k: jax.Array
    hist_lo_v: jax.Array
    hist_scale_v: jax.Array
    recent_k: jax.Array
    recent_v: jax.Array
    lengths: jax.Array

    @classmethod
    def of(cls, cache) -> "CacheArrays":
        """The fields of the same names of `cache` (a per-layer `oscar_jax.OscarCache`)."""
        return cls(*(getattr(cache, name) for name in cls._fields))


def tokens_per_byte(bits: int) -> int:
    if bits not in _VALID_BITS:
        raise ValueError(f"bits={bits!r}: expected one of {_VALID_BITS}")
    return 8 // bits


def pack_codes(codes: jnp.ndarray, bits: int, *, channel_major: bool = False) -> jnp.ndarray:
    """codes: uint8 [..., T, D] with values < 2**bits -> packed uint8 [..., T/tpb, D],
    or [..., D, T/tpb] when channel_major."""
    tpb = tokens_per_byte(bits)
    *lead, t, d = codes.shape
    if t % tpb:
        raise ValueError(f"token axis T={t} must be a multiple of {tpb=} for {bits=}")
    slices = codes.astype(jnp.uint8).reshape(*lead, t // tpb, tpb, d)
    packed = jnp.zeros((*lead, t // tpb, d), jnp.uint8)
    for s in range(tpb):
        packed = packed | (slices[..., s, :] << (bits * s)).astype(jnp.uint8)
    return jnp.swapaxes(packed, -1, -2) if channel_major else packed


def unpack_slices(packed: jnp.ndarray, bits: int) -> jnp.ndarray:
    """packed uint8 [..., R, D] (or [..., D, R]) -> codes uint8 [tpb, ...] of the same
    trailing shape; slice s = tokens tpb*i+s."""
    tpb = tokens_per_byte(bits)
    mask = jnp.uint8((1 << bits) - 1)
    return jnp.stack([(packed >> (bits * s)) & mask for s in range(tpb)])


def unpack_codes(packed: jnp.ndarray, bits: int, *, channel_major: bool = False) -> jnp.ndarray:
    """packed uint8 [..., R, D] (or [..., D, R] when channel_major) -> codes uint8
    [..., R*tpb, D] in token order."""
    tpb = tokens_per_byte(bits)
    if channel_major:
        packed = jnp.swapaxes(packed, -1, -2)
    *lead, r, d = packed.shape
    slices = unpack_slices(packed, bits)  # [tpb, ..., R, D]
    return jnp.moveaxis(slices, 0, -2).reshape(*lead, r * tpb, d)


def pack_meta(meta: jnp.ndarray, bits: int) -> jnp.ndarray:
    """meta [..., T, n_groups] -> [..., n_groups, tpb, T/tpb] (index [g, s, i] = token tpb*i+s)."""
    tpb = tokens_per_byte(bits)
    *lead, t, g = meta.shape
    if t % tpb:
        raise ValueError(f"token axis T={t} must be a multiple of {tpb=} for {bits=}")
    x = meta.reshape(*lead, t // tpb, tpb, g)
    return jnp.moveaxis(x, (-3, -2, -1), (-1, -2, -3))


def unpack_meta(packed: jnp.ndarray, bits: int) -> jnp.ndarray:
    """[..., n_groups, tpb, R] -> meta [..., R*tpb, n_groups] in token order."""
    tokens_per_byte(bits)
    *lead, g, tpb, r = packed.shape
    x = jnp.moveaxis(packed, (-1, -2, -3), (-3, -2, -1))  # [..., R, tpb, g]
    return x.reshape(*lead, r * tpb, g)


def round_to_int(x):
    """f32 x with |x| < 2^22 -> int32, rounded half to even, as jnp.round (which Triton does
    not lower): x + 1.5 * 2^23 has a unit ulp, and a bitcast reads the integer off it (the
    compiler cannot fold it away, as XLA:CPU did an add-then-subtract)."""
    return lax.bitcast_convert_type(x + 12582912.0, jnp.int32) - 0x4B400000


def ring_position(n, j, sink: int, window: int):
    """Position held by recent-ring slot(s) j of a row holding n tokens, -1 where empty: the
    newest p < n with (p - S0) % W == j and p >= max(S0, n - W) (`cache.ring_positions`,
    restated for kernels with lax.rem on a non-negative argument, which Triton lowers)."""
    wrap = window * (-(-(sink + window) // window) + 1)
    p = n - 1 - lax.rem(n - 1 - sink - j + wrap, window)
    return jnp.where((p >= sink) & (p >= n - window), p, -1)


def bf16_hi_lo(x):
    """x -> (hi, lo) bf16: hi = x rounded to bf16, lo = x - hi rounded, so that x ≈ hi + lo
    to ~16 bits (plain jnp, also inside kernels: the operands of the GPU kernels' bf16 MMAs)."""
    x = x.astype(jnp.float32)
    hi = x.astype(jnp.bfloat16)
    return hi, (x - hi.astype(jnp.float32)).astype(jnp.bfloat16)


def rotation_stats(rot) -> jnp.ndarray:
    """rot f32 [..., D, D] or its bf16 parts [..., 2, D, D] (`split_bf16`; M, applied to
    queries as rows: q M) -> f32 [..., 2, D]: M's row sums (M 1, so that Σ_j (q M)_j = q · M 1)
    and its column norms (|(q M)_j| <= ‖q‖ ‖M_:j‖), what `decode_start` takes for the two
    per-query numbers that span every rotated channel."""
    m = rot.astype(jnp.float32).sum(axis=-3) if rot.dtype == jnp.bfloat16 else rot.astype(jnp.float32)
    return jnp.stack([m.sum(axis=-1), jnp.sqrt(jnp.sum(m * m, axis=-2))], axis=-2)


def split_bf16(x, axis: int = -3):
    """f32 x -> bf16 with a new axis of 2 at `axis`: [hi, lo] (`bf16_hi_lo`), what the GPU
    decode kernels take for the rotations (`LayerParams` splits them once, not per call)."""
    return jnp.stack(bf16_hi_lo(jnp.asarray(x, jnp.float32)), axis=axis)
