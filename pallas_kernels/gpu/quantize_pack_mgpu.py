"""Bulk rotate + quantise + pack as a Mosaic GPU (Hopper) kernel: `quantize_pack`'s
contract for one group per token (G = D in {64, 128}), uniform 2-bit codes and bf16
metadata, the cache's default.

A block of the grid is one (batch row, KV head) and a run of `Config.blocks_per_program`
64-token blocks, shared by `Config.warpgroups` warpgroups (block k of the run goes to
warpgroup k % wgs), so
the head's rotation is moved into shared memory once, by TMA, for all of them. Each
warpgroup streams its x tiles [64, D] (bf16, one TMA each, `Config.buffers` deep) and per
block:

  acc [64, D] = x @ R_hi + x @ R_lo           two bf16 wgmma into one f32 accumulator
                                              (R = R_hi + R_lo: ~16 bits, as the Triton kernel)
  xr = bf16(acc); per token: lo, scale from max / min and the clip (bf16, as stored)
  u = clip((xr - lo) / scale, 0, 3) + 1.5 * 2^23: the code, rounded half to even, in the
      low bits of u's word (exact for 0 <= u <= 3)
  byte row i, channel c = sum over s of code[4 i + s, c] << 2 s

The packing never leaves registers: in the WGMMA layout the four tokens of a byte row are
rows held by lanes l, l ^ 4, l ^ 8, l ^ 12 (the same register), so each thread ORs its
shifted codes, four to a 32-bit word, and two butterfly shuffles combine the lanes; one
more shuffle with a neighbour and a byte permute (prmt) make each lane's word four bytes in
a row of the layout, stored as one 32-bit word (`mgpu_helpers.store_codes`). The
16 packed rows [16, D] (K, token-major) or their transpose [D, 16] (V, channel-major) and
the block's lo / scale [4, 16] (token 4 i + s at [s, i]) go to shared memory and out by TMA.

Semantics are `quant.quantize` with the uniform codebook on the bf16 product of the split
rotation, as the Triton kernel, the NaN rules included: a token whose max, min, lo or scale
is not finite, or whose scale is 0, gets codes 0 (max and min propagate NaN), applied as a
per-token mask of the code bits (faster than a select per element). The quotient is a
division per element: a multiply by the token's reciprocal would be faster, but bf16 lo and
scale put many values exactly on a rounding boundary, where it changes the code. Tokens
past x's end are zeros (the blocks that
reach past it mask them); x's token count is padded to a multiple of 8 if it is not one (the
TMA window's tiling needs it; a copy of x). In interpret mode (CPU) the packing and the
metadata store are array ops and x is padded with NaN to its last block (the interpreter
clamps a window that runs past the end, where TMA fills zeros; the NaN shows a failed mask).
Interpreted, each warpgroup also loads its own copy of the rotation: the interpreter runs a
block's warpgroups as jitted programs on XLA:CPU's execution threads (as many as cores), and a
warpgroup blocked in a barrier wait holds its thread, so warpgroups that wait for warpgroup
0's copy could leave it no thread to run on.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from . import hopper
from .mgpu_helpers import store_codes, store_meta
from .quantize_pack import split_rotation

_TOKENS = 64  # tokens per block: one m64 MMA
_TPB = 4  # tokens per packed byte (2-bit codes)
_ROWS = _TOKENS // _TPB  # packed rows per block
_TOP = 3.0  # the largest uniform 2-bit level
_ROUND = 12582912.0  # 1.5 * 2^23: u + _ROUND holds round-half-even(u) in its low bits
_META = 2  # lo, scale


def _kernel(clip_ref, x_ref, rot_hi_ref, rot_lo_ref, codes_ref, lo_ref, scale_ref, *, rot_smem, x_smem,
            code_smem, meta_smem, rot_bar, x_bars, start: int, t_total: int, n_blocks: int, per_program: int,
            kv_heads: int, warpgroups: int, buffers: int, channel_major: bool, interpret: bool):
    pair, run = lax.axis_index("pair"), lax.axis_index("run")
    wg = lax.axis_index("wg") if warpgroups > 1 else 0
    b, h = pair // kv_heads, pair % kv_heads
    d = x_ref.shape[3]  # x_ref may be padded past its t_total tokens
    first = run * per_program + wg  # this warpgroup's blocks: first, first + wgs, ...
    steps = jnp.maximum(jnp.minimum(per_program, n_blocks - run * per_program) - wg + warpgroups - 1, 0) // warpgroups
    # Blocks wholly inside x come first; the rest mask the tokens past its end.
    whole = jnp.clip((t_total - start - _TOKENS * first - _TOKENS) // (_TOKENS * warpgroups) + 1, 0, steps)
    x_smem, code_smem, meta_smem = (ref.at[wg] for ref in (x_smem, code_smem, meta_smem))
    x_bar = lambda slot: x_bars.at[wg * buffers + slot]
    clip = clip_ref[0]

    def load_rotation():
        plgpu.copy_gmem_to_smem(rot_hi_ref.at[h], rot_smem.at[0], rot_bar)
        plgpu.copy_gmem_to_smem(rot_lo_ref.at[h], rot_smem.at[1], rot_bar)

    if interpret:  # each warpgroup its own copy: no warpgroup waits for another (module docstring)
        rot_smem, rot_bar = rot_smem.at[wg], rot_bar.at[wg]
        load_rotation()
    else:
        pl.when(wg == 0)(load_rotation)

    def issue(i, slot):
        t0 = start + _TOKENS * (first + warpgroups * i)
        plgpu.copy_gmem_to_smem(x_ref.at[b, pl.ds(t0, _TOKENS), h], x_smem.at[slot], x_bar(slot))

    for j in range(buffers - 1):
        pl.when(j < steps)(functools.partial(issue, j, j))
    plgpu.barrier_wait(rot_bar)
    layout = plgpu.Layout.WGMMA
    rows = plgpu.broadcasted_iota(jnp.int32, (_TOKENS, d), 0, layout=layout)
    by_row = lambda v: lax.broadcast_in_dim(v, (_TOKENS, d), [0])

    def step(i, carry, *, masked: bool):
        slot = lax.rem(i, buffers)
        ahead = i + buffers - 1  # into the buffer step i - 1 read (its MMAs are done)
        pl.when(ahead < steps)(lambda: issue(ahead, lax.rem(ahead, buffers)))
        plgpu.barrier_wait(x_bar(slot))

        def rotate(acc_ref):
            for k in range(2):  # R_hi, R_lo (stored transposed: [D out, D in])
                plgpu.wgmma(acc_ref, x_smem.at[slot], rot_smem.at[k].T)
            return acc_ref[...]

        xr = pl.run_scoped(rotate, plgpu.ACC((_TOKENS, d), jnp.float32))
        xr = xr.astype(jnp.bfloat16).astype(jnp.float32)  # as the cache stores it
        block = first + warpgroups * i
        if masked:
            xr = jnp.where(start + _TOKENS * block + rows < t_total, xr, 0.0)
        xmax, xmin = jnp.max(xr, axis=1), jnp.min(xr, axis=1)
        mid = 0.5 * (xmax + xmin)
        half = clip * 0.5 * (xmax - xmin)
        lo = (mid - half).astype(jnp.bfloat16)
        scale = (2.0 * half / _TOP).astype(jnp.bfloat16)
        lo32, scale32 = lo.astype(jnp.float32), scale.astype(jnp.float32)
        finite = lambda v: jnp.abs(v) < jnp.inf
        ok = (scale32 > 0) & finite(scale32) & finite(lo32) & finite(xmax) & finite(xmin)
        u = jnp.clip((xr - by_row(lo32)) / by_row(jnp.where(ok, scale32, 1.0)), 0.0, _TOP) + _ROUND
        mask = jnp.where(ok, 3, 0).astype(jnp.int32)
        out = lax.rem(i, 2)  # staging buffer: step i - 2's copies must have read it
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
        store_codes(u, mask, code_smem.at[out], channel_major=channel_major, interpret=interpret)
        store_meta(lo, scale, meta_smem.at[out], interpret=interpret)
        plgpu.commit_smem()
        r0 = _ROWS * block
        dst = codes_ref.at[b, h, :, pl.ds(r0, _ROWS)] if channel_major else codes_ref.at[b, h, pl.ds(r0, _ROWS)]
        plgpu.copy_smem_to_gmem(code_smem.at[out], dst, commit_group=False)
        plgpu.copy_smem_to_gmem(meta_smem.at[out, 0], lo_ref.at[b, h, 0, :, pl.ds(r0, _ROWS)], commit_group=False)
        plgpu.copy_smem_to_gmem(meta_smem.at[out, 1], scale_ref.at[b, h, 0, :, pl.ds(r0, _ROWS)])
        return carry

    lax.fori_loop(0, whole, functools.partial(step, masked=False), None)
    lax.fori_loop(whole, steps, functools.partial(step, masked=True), None)
    plgpu.wait_smem_to_gmem(0)


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings of the Mosaic GPU bulk write (`Config.default` picks them per device).

    blocks_per_program: the most 64-token blocks per grid block (one rotation load for them),
      fewer where that makes fewer than min_programs grid blocks;
    min_programs: the SM count (every SM busy); 1 in interpret mode, which runs grid blocks
      one after another;
    warpgroups: warpgroups per block; buffers: x tiles in flight per warpgroup.
    The defaults are the fastest settings measured for a [8, 32768, 8, 128] prompt.
    """

    blocks_per_program: int = 128
    min_programs: int = hopper.H200_SMS
    warpgroups: int = 3
    buffers: int = 3

    def __post_init__(self):
        if self.warpgroups < 1 or self.buffers < 2 or self.blocks_per_program < 1 or self.min_programs < 1:
            raise ValueError(f"Config(warpgroups={self.warpgroups}, buffers={self.buffers}, blocks_per_program="
                             f"{self.blocks_per_program}, min_programs={self.min_programs}): expected >= 1, >= 2, "
                             ">= 1 and >= 1")

    @classmethod
    def default(cls, *, interpret: bool = False) -> "Config":
        """The defaults with min_programs the device's SM count (1 in interpret mode)."""
        return cls(min_programs=1 if interpret else hopper.sm_count())


def supports(spec) -> bool:
    """Cache configurations (a `CacheSpec`) this kernel writes: one group per token, D in
    {64, 128}, uniform 2-bit codes, bf16 metadata."""
    q = spec.quant
    return (spec.head_dim in (64, 128) and spec.group_size == spec.head_dim and q.bits == 2
            and tuple(q.levels) == (0.0, 1.0, 2.0, 3.0) and q.codebook == "uniform"
            and jnp.dtype(q.jnp_scale_dtype) == jnp.bfloat16)


def quantize_pack(x, rot, clip, *, bits: int, levels: tuple[float, ...], group_size: int,
                  span: float | None, scale_dtype, start: int = 0, count: int | None = None,
                  channel_major: bool = False, interpret: bool = False, config: Config | None = None):
    """`quantize_pack.quantize_pack`'s contract, restricted to `supports`: x bf16 [B, T,
    Hkv, D], rot f32 [Hkv, D, D], clip f32 [] -> codes uint8 [B, Hkv, count/4, D] (or [B,
    Hkv, D, count/4] when channel_major), lo and scale bf16 [B, Hkv, 1, 4, count/4]; count
    a multiple of 4 (a last partial block is computed whole and cut). config: `Config`, or
    None for `Config.default`."""
    b, t, hkv, d = x.shape
    count = t - start if count is None else count
    if (bits != 2 or tuple(levels) != (0.0, 1.0, 2.0, 3.0) or span is not None or group_size != d
            or d not in (64, 128) or jnp.dtype(scale_dtype) != jnp.bfloat16):
        raise ValueError(f"bits={bits}, levels={levels}, span={span}, group_size={group_size}, D={d}, "
                         f"scale_dtype={jnp.dtype(scale_dtype)}: this kernel needs uniform 2-bit codes, "
                         "G = D in (64, 128) and bf16 metadata")
    if count <= 0 or count % _TPB or start < 0:
        raise ValueError(f"start={start}, count={count}: expected start >= 0 and count a positive "
                         f"multiple of tokens_per_byte={_TPB}")
    if rot.shape != (hkv, d, d):
        raise ValueError(f"rot.shape={rot.shape}: expected [Hkv={hkv}, D={d}, D={d}]")
    config = config or Config.default(interpret=interpret)
    warpgroups, buffers = config.warpgroups, config.buffers
    n_blocks = -(-count // _TOKENS)  # the last block's rows past count/4 are cut off below
    runs = min(n_blocks, max(-(-n_blocks // config.blocks_per_program), -(-config.min_programs // (b * hkv))))
    per_program = -(-n_blocks // runs)
    runs = -(-n_blocks // per_program)
    x = x.astype(jnp.bfloat16)
    if interpret or t < _TOKENS or t % 8:  # see the module docstring; the kernel masks the pad
        t_pad = max(start + _TOKENS * n_blocks, _TOKENS) if interpret or t < _TOKENS else t
        x = jnp.pad(x, ((0, 0), (0, max(t_pad, t) + -max(t_pad, t) % 8 - t), (0, 0), (0, 0)),
                    constant_values=jnp.nan if interpret else 0)  # NaN: a mask that fails shows
    # [Hkv, D out, D in]: the B operand, K-major
    rot_hi, rot_lo = (jnp.swapaxes(r, 1, 2) for r in split_rotation(rot))
    rows = _ROWS * n_blocks
    codes_shape = (b, hkv, d, rows) if channel_major else (b, hkv, rows, d)
    staging = (warpgroups, 2, d, _ROWS) if channel_major else (warpgroups, 2, _ROWS, d)
    meta_shape = jax.ShapeDtypeStruct((b, hkv, 1, _TPB, rows), jnp.bfloat16)
    kernel = plgpu.kernel(
        functools.partial(_kernel, start=start, t_total=t, n_blocks=n_blocks, per_program=per_program, kv_heads=hkv,
                          warpgroups=warpgroups, buffers=buffers, channel_major=channel_major,
                          interpret=interpret),
        out_type=[jax.ShapeDtypeStruct(codes_shape, jnp.uint8), meta_shape, meta_shape],
        scratch_types=dict(
            rot_smem=plgpu.SMEM((warpgroups, 2, d, d) if interpret else (2, d, d), jnp.bfloat16,
                                transforms=hopper.bf16_tiles(d)),
            x_smem=plgpu.SMEM((warpgroups, buffers, _TOKENS, d), jnp.bfloat16, transforms=hopper.bf16_tiles(d)),
            code_smem=plgpu.SMEM(staging, jnp.uint8),
            meta_smem=plgpu.SMEM((warpgroups, 2, _META, _TPB, _ROWS), jnp.bfloat16),
            rot_bar=plgpu.Barrier(num_arrivals=2, num_barriers=warpgroups if interpret else 1),
            x_bars=plgpu.Barrier(num_arrivals=1, num_barriers=warpgroups * buffers)),
        grid=(b * hkv, runs),
        grid_names=("pair", "run"),
        **(dict(num_threads=warpgroups, thread_name="wg") if warpgroups > 1 else {}),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )
    clip = jnp.reshape(jnp.asarray(clip, jnp.float32), (1,))
    codes, lo, scale = kernel(clip, x, rot_hi, rot_lo)
    if rows != count // _TPB:
        keep = count // _TPB
        codes = codes[..., :keep] if channel_major else codes[:, :, :keep]
        lo, scale = lo[..., :keep], scale[..., :keep]
    return codes, lo, scale
