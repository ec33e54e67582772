"""Decode attention (one query a row) over a float8_e4m3fn dense cache (`models.dense_cache`).

Pallas kernel with Triton lowering (GPU); `interpret=True` runs it on CPU.

Grid (B, Hkv, splits). Split s of (row b, KV head h) walks the row's tokens
[s * T_s, (s + 1) * T_s), stopping at its length, in tiles of `block_t` tokens: each K and V
tile is read once as float8 and converted to bf16 in registers for two bf16 MMAs (f32
accumulation), the g query heads of KV head h being the rows of one query block (zero rows pad
it to 16, the MMA's smallest M). The per-head scales go on the scores (k_scale, with the
softmax scale) and on the output (v_scale), as in the cache's XLA path. Every program writes a
normalised partial and its log-sum-exp; `mixed_attention.merge_splits` combines them.

Triton, not Mosaic GPU: Hopper's float8 wgmma takes float8 for both operands, which would round
the bf16 query to e4m3; converting each tile to bf16 on its way to the MMA is what Triton's
`fp_to_fp` does in registers.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from oscar_jax.pallas_kernels.gpu.mixed_attention import f32_dot, merge_splits, online_update

FP8 = jnp.dtype(jnp.float8_e4m3fn)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """block_t: tokens per tile (a power of two >= 16); target_programs: splits are chosen so the
    grid has about this many programs (each split at least one tile)."""

    block_t: int = 128
    target_programs: int = 1024
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        if self.block_t < 16 or self.block_t & (self.block_t - 1):
            raise ValueError(f"BlockSizes.block_t={self.block_t}: expected a power of two >= 16")


def supports(head_dim: int, q_heads: int, kv_heads: int) -> bool:
    """Shapes the kernel takes: D in {64, 128, 256}, g = Hq / Hkv a whole number <= 16."""
    return head_dim in (64, 128, 256) and q_heads % kv_heads == 0 and q_heads // kv_heads <= 16


def device_supported() -> bool:
    """Whether the default device, where it is a GPU, converts float8 in Triton: sm_89 or newer.
    Off a GPU (interpret mode, lowering for CUDA) True."""
    device = jax.devices()[0]
    cc = getattr(device, "compute_capability", None)
    return device.platform != "gpu" or (cc is not None and tuple(map(int, cc.split("."))) >= (8, 9))


def _pad_pow2(x: jax.Array) -> jax.Array:
    """A 1-D array padded to a power of two (the lengths of Triton's blocks)."""
    return jnp.pad(x, (0, (1 << (x.size - 1).bit_length()) - x.size))


def _kernel(lengths_ref, qk_scale_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, hkv, split_tokens,
            block_t, interpret):
    b, h, s = (pl.program_id(i) for i in range(3))
    bm, d = q_ref.shape
    n = lengths_ref[b]
    qk_scale = qk_scale_ref[b * hkv + h]
    t_begin = s * split_tokens
    t_end = jnp.minimum(t_begin + split_tokens, jnp.minimum(n, k_ref.shape[1]))
    steps = jnp.maximum(t_end - t_begin + block_t - 1, 0) // block_t
    q = q_ref[...]

    def tile(ref, t0, ok):  # float8 [BT, D] of tokens t0.. -> bf16, zero past the split's end
        x = plgpu.load(ref.at[b, pl.ds(t0, block_t), h, :], mask=ok[:, None])
        return jnp.where(ok[:, None], x.astype(jnp.bfloat16), jnp.zeros((), jnp.bfloat16))

    def step(i, state):
        t0 = t_begin + i * block_t
        ok = t0 + jnp.arange(block_t) < t_end
        scores = jnp.where(ok[None, :], f32_dot(q, tile(k_ref, t0, ok), 1, interpret) * qk_scale, -jnp.inf)
        values = lambda p: [f32_dot(p.astype(jnp.bfloat16), tile(v_ref, t0, ok), 0, interpret)]
        return online_update(state, scores, values)

    init = (jnp.full((bm,), -jnp.inf, jnp.float32), jnp.zeros((bm,), jnp.float32),
            (jnp.zeros((bm, d), jnp.float32),))
    m, l, (acc,) = lax.fori_loop(0, steps, step, init)
    safe_l = jnp.where(l > 0, l, 1.0)
    o_ref[...] = acc / safe_l[:, None]
    lse_ref[...] = jnp.where(l > 0, m + jnp.log(safe_l), -jnp.inf)


def fp8_decode(q: jax.Array, k: jax.Array, v: jax.Array, k_scale: jax.Array, v_scale: jax.Array,
               lengths: jax.Array, *, softmax_scale: float, interpret: bool = False,
               block_sizes: BlockSizes | None = None) -> jax.Array:
    """Attention of one query a row over the first lengths[b] tokens of a float8 cache.

    q [B, Hq, D] (bf16 or f32; enters the MMA in bf16); k, v float8_e4m3fn [B, T, Hkv, D];
    k_scale, v_scale f32 [B, Hkv] (the cache holds x / scale); lengths int32 [B] (<= T; 0 gives
    zeros; lengths past T count as T). Returns o f32 [B, Hq, D] = softmax(q·(k·k_scale)ᵀ·softmax_scale)·(v·v_scale).
    """
    b, hq, d = q.shape
    _, t, hkv, _ = k.shape
    if k.dtype != FP8 or v.dtype != FP8 or v.shape != k.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k {k.dtype}{list(k.shape)}, v {v.dtype}{list(v.shape)}: expected float8_e4m3fn "
                         f"[B={b}, T, Hkv, D={d}] both")
    if not supports(d, hq, hkv):
        raise ValueError(f"q.shape={q.shape}, Hkv={hkv}: expected D in (64, 128, 256) and Hq / Hkv a whole "
                         "number <= 16")
    if k_scale.shape != (b, hkv) or v_scale.shape != (b, hkv) or lengths.shape != (b,):
        raise ValueError(f"k_scale {k_scale.shape}, v_scale {v_scale.shape}, lengths {lengths.shape}: expected "
                         f"[B={b}, Hkv={hkv}] and [B]")
    blocks = block_sizes or BlockSizes()
    g = hq // hkv
    bm = max(16, 1 << (g - 1).bit_length())
    tiles = -(-t // blocks.block_t)
    splits = max(1, min(tiles, -(-blocks.target_programs // (b * hkv))))
    split_tokens = -(-tiles // splits) * blocks.block_t
    splits = -(-t // split_tokens)

    qg = jnp.pad(q.reshape(b, hkv, g, d).astype(jnp.bfloat16), ((0, 0), (0, 0), (0, bm - g), (0, 0)))
    qk_scale = _pad_pow2((k_scale.astype(jnp.float32) * softmax_scale).reshape(-1))
    kernel = functools.partial(_kernel, hkv=hkv, split_tokens=split_tokens, block_t=blocks.block_t,
                               interpret=interpret)
    full = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)
    lengths = _pad_pow2(lengths.astype(jnp.int32))
    o_part, lse_part = pl.pallas_call(
        kernel,
        grid=(b, hkv, splits),
        in_specs=[full(lengths), full(qk_scale), pl.BlockSpec((None, None, bm, d), lambda i, j, s: (i, j, 0, 0)),
                  full(k), full(v)],
        out_specs=[pl.BlockSpec((None, None, None, bm, d), lambda i, j, s: (i, j, s, 0, 0)),
                   pl.BlockSpec((None, None, None, bm), lambda i, j, s: (i, j, s, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, hkv, splits, bm, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, splits, bm), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name="fp8_decode",
    )(lengths, qk_scale, qg, k, v)
    o, _ = merge_splits(o_part[..., :g, :], lse_part[..., :g])  # [B, Hkv, g, D]
    return (o * v_scale.astype(jnp.float32)[:, :, None, None]).reshape(b, hq, d)
