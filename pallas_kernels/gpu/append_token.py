"""Decode's append of one token per sequence into one layer's mixed cache: one kernel for K
or V of a layer.

Pallas kernel with Triton lowering (GPU); `interpret=True` runs it on CPU. It does what
`updates.append` does for C = 1 (docs/ARCHITECTURE.md §4) in one launch instead of a dozen
XLA fusions: one program per (batch row, KV head) reads the ring slot the new token takes,
writes the token there (or into the sink while the row holds fewer than S0 tokens),
quantises the token it pushed out (`quantize_pack.quantize_group`, the quantiser of the bulk
write) and merges its codes into their byte row and its lo/scale into their metadata slot.
Every cache array is updated in place (aliased input and output); a row that is not `ok`
(its append would overflow) is left untouched.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from oscar_jax.pallas_kernels.gpu.quantize_pack import quantize_group


def _kernel(lengths_ref, index_ref, ok_ref, clip_ref, x_ref, *refs, sink_len, window, bits, levels, group_size,
            span, scale_dtype, channel_major):
    sink_ref, ring_ref, codes_ref, lo_ref, scale_ref = refs[5:]  # the outputs, aliased to refs[:5]
    b, h = pl.program_id(0), pl.program_id(1)
    d = x_ref.shape[2]
    tpb = 8 // bits
    n = lengths_ref[b]
    ok = ok_ref[b] != 0
    full = lambda flag, shape: jnp.full(shape, flag)
    x = x_ref[b, h, pl.ds(0, d)]  # [D] bf16, rotated
    if sink_len:
        plgpu.store(sink_ref.at[b, h, jnp.minimum(n, sink_len - 1), pl.ds(0, d)], x,
                    mask=full(ok & (n < sink_len), (d,)))
    in_ring = ok & (n >= sink_len)
    slot = lax.rem(jnp.maximum(n - sink_len, 0), window)
    hist = index_ref[b]  # where the token leaving the ring goes in these history arrays
    rows = codes_ref.shape[3 if channel_major else 2]
    if rows:
        write = in_ring & (hist >= 0) & (hist < rows * tpb)
        at = jnp.maximum(hist, 0)
        row, sub = jnp.minimum(at // tpb, rows - 1), at % tpb
        shift = bits * sub
        keep = ~(((1 << bits) - 1) << shift)
        for gi in range(d // group_size):
            cols = pl.ds(gi * group_size, group_size)
            # the leaving token's group, read before the new token takes its slot: [1, G]
            old = ring_ref[b, h, pl.ds(slot, 1), cols].astype(jnp.float32)
            lo, scale, (code,) = quantize_group([old], clip_ref[0], span=span, levels=levels,
                                                scale_dtype=scale_dtype)
            if channel_major:
                idx, code = (b, h, cols, pl.ds(row, 1)), code.T  # [G, 1]
            else:
                idx = (b, h, pl.ds(row, 1), cols)
            byte = codes_ref[idx].astype(jnp.int32)
            plgpu.store(codes_ref.at[idx], ((byte & keep) | (code << shift)).astype(jnp.uint8),
                        mask=full(write, code.shape))
            meta = (b, h, jnp.int32(gi), sub, pl.ds(row, 1))
            plgpu.store(lo_ref.at[meta], lo, mask=full(write, (1,)))
            plgpu.store(scale_ref.at[meta], scale, mask=full(write, (1,)))
    plgpu.store(ring_ref.at[b, h, slot, pl.ds(0, d)], x, mask=full(in_ring, (d,)))


def append_token(x, lengths, index, ok, clip, sink, ring, codes, lo, scale, *, window: int, bits: int,
                 levels: tuple[float, ...], group_size: int, span: float | None, channel_major: bool,
                 interpret: bool = False):
    """Append one rotated token per row to K's or V's arrays of one layer, in place.

    x: bf16 [B, Hkv, D] (rotated, as the cache stores it); lengths int32 [B] (tokens held
    before the append); index int32 [B]: the index in these history arrays of the token the
    new one pushes out of the ring (lengths - W - S0 for a whole history; not written where
    outside [0, R*tpb)); ok bool [B] (rows to update); clip f32 []; sink bf16 [B, Hkv, S0, D];
    ring bf16 [B, Hkv, W, D]; codes uint8 [B, Hkv, R, D] ([B, Hkv, D, R] when channel_major);
    lo, scale [B, Hkv, D/G, tpb, R]. span: None for the uniform quantiser, else the Lloyd-Max
    spread factor. Returns the updated (sink, ring, codes, lo, scale).
    """
    b, hkv, d = x.shape
    if ring.shape != (b, hkv, window, d) or sink.shape[:2] + sink.shape[3:] != (b, hkv, d):
        raise ValueError(f"x.shape={x.shape}, sink.shape={sink.shape}, ring.shape={ring.shape}: "
                         f"expected [B, Hkv, D], [B, Hkv, S0, D] and [B, Hkv, W={window}, D]")
    kernel = functools.partial(
        _kernel, sink_len=sink.shape[2], window=window, bits=bits, levels=tuple(levels),
        group_size=group_size, span=span, scale_dtype=lo.dtype, channel_major=channel_major)
    arrays = (sink, ring, codes, lo, scale)
    whole = lambda a: pl.BlockSpec(a.shape, lambda *_, n=a.ndim: (0,) * n)
    inputs = (lengths.astype(jnp.int32), index.astype(jnp.int32), ok.astype(jnp.int32),
              jnp.reshape(jnp.asarray(clip, jnp.float32), (1,)), x.astype(jnp.bfloat16), *arrays)
    return pl.pallas_call(
        kernel,
        grid=(b, hkv),
        in_specs=[whole(a) for a in inputs],
        out_specs=[whole(a) for a in arrays],
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays],
        input_output_aliases={5 + i: i for i in range(len(arrays))},
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="oscar_append_token",
    )(*inputs)


def supports(spec) -> bool:
    """Cache configurations (a `CacheSpec`) the kernel handles: Triton tensors need power-of-two
    head and group sizes."""
    pow2 = lambda n: n >= 16 and n & (n - 1) == 0
    return pow2(spec.head_dim) and pow2(spec.group_size)
