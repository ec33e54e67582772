"""Decode attention over the mixed OSCAR cache as a Mosaic GPU (Hopper) kernel.

Status: compiled and correct on the H200 (`pytest -m gpu -k mgpu`) and in Mosaic GPU
interpret mode on CPU. `attention.attend` ("auto") runs it for decode at D = 128 on
sm_90, where the H200 measured it faster than the Triton kernel (B8 H32/8: 0.583 vs
0.703 ms at 128K, 0.259 vs 0.277 ms at 32K); at D = 256 it is slower (0.237 vs 0.139 ms),
see bench/results/kernels_mgpu_ab_h200.json.

Tokens are the MMA's M dimension ("swap AB"): with g <= 8 query heads per KV
head, the query side is the N = 8 operand, so a decode step wastes at most
8 / g of the matrix work (the Triton kernel pads g to 16 rows or expands slices).
One program per (batch row, KV head, history split); each step moves 64 packed
rows (256 tokens) of K and V codes and their metadata into shared memory with
TMA, and for each token slice s (token 4r + s is bits 2s..2s+1 of byte r):
  scores^T [64, 8] = bf16(128 + code_s) [64, D] @ q^T           (wgmma)
  scores = scale_s * (scores - 128 Σq) + lo_s * Σq                (per token; Σq of bf16 q)
  online softmax over tokens (axis 0), per query column
  out^T [D, 8] += bf16(128 + vcode_s)^T [D, 64] @ (p ∘ vscale_s) [64, 8]
and Σ p·lo - 128 Σ(p ∘ vscale) is kept per column. The D channels of both
products are in `channel_order(D)` (the order the packed-word unpack produces):
q is permuted to it before the call and the output back after. The bf16 sink and recent
ring (S0 + W tokens) are attended in XLA and merged with the history splits
by log-sum-exp, like the Triton kernel's partials.

Scope: C = 1, D in {64, 128, 256}, G = D, uniform 2-bit codes, bf16 metadata,
g <= 8, packed history rows a multiple of 8 (TMA needs 16-byte metadata rows).
One warpgroup per program; the TMA of step i + buffers - 1 is issued before
step i is computed. Compiled, the K tile is the MMA's A operand straight from
registers; the V tile (A = V^T) is staged in shared memory (Mosaic GPU cannot
load a transposed uint8 tile into the WGMMA layout). The GPU interpreter takes
A operands only from shared memory, so in interpret mode the K tile is staged too.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, vector

from .mixed_attention import merge_splits

_ROWS = 64  # packed rows per step: one m64 MMA tile per token slice
_N = 8  # query columns: g heads padded to the smallest MMA N
_TPB = 4  # tokens per packed byte (2-bit codes)
_OFFSET = 128.0  # 0x4300 | code is the bf16 number 128 + code
_COPIES = 6  # TMA copies per step: K codes, V codes, lo/scale of K and of V


def channel_order(d: int) -> np.ndarray:
    """[d] int: A-operand column a holds channel order[a] (see `_slice_tile`). Within each
    16-channel block, a = 8k + 2t + e holds channel 4t + 2e + k."""
    a = np.arange(d)
    return 16 * (a // 16) + 4 * ((a % 8) // 2) + 2 * (a % 2) + (a % 16 >= 8)


def _slice_tile(packed: jax.Array, s: int, *, interpret: bool) -> jax.Array:
    """uint8 [R, D] packed bytes -> bf16 [R, D]: column a = 128 + code of token slice s of
    channel channel_order(D)[a].

    Compiled, each thread's 32-bit register of 4 packed channels (WGMMA_8BIT layout) gives
    two bf16 pairs of the WGMMA layout with one shift and one and-or each
    (`(w >> 2s + 8k) & 0x00030003 | 0x43004300`: bytes k and k + 2), which fixes the channel
    order. The interpreter cannot run `inline_mgpu` with results, so there the same tile is
    built with array ops.
    """
    r, d = packed.shape
    if interpret:
        x = packed.astype(jnp.uint16)
        codes = lax.bitcast_convert_type(((x >> (2 * s)) & jnp.uint16(3)) | jnp.uint16(0x4300), jnp.bfloat16)
        return codes.reshape(r, d // 16, 4, 2, 2).transpose(0, 1, 4, 2, 3).reshape(r, d)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_8BIT,),
                       return_type=plgpu.ShapeDtypeStruct((r, d), jnp.bfloat16, layout=plgpu.Layout.WGMMA))
    def convert(ctx, words):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        one_i32, two_bf16 = ir.VectorType.get((1,), i32), ir.VectorType.get((2,), ir.BF16Type.get())
        const = lambda v: arith.constant(i32, v)
        out = np.empty(fa.WGMMA_LAYOUT.registers_shape((r, d)), dtype=object)
        for idx, reg in np.ndenumerate(words.registers):  # idx[1]: 16-channel block
            w = llvm.extractelement(vector.bitcast(one_i32, reg), const(0))
            for k in range(2):  # bytes k and k + 2 -> the pair in 8-column block 2 idx[1] + k
                shift = 2 * s + 8 * k
                t = arith.shrui(w, const(shift)) if shift else w
                t = arith.ori(arith.andi(t, const(0x00030003)), const(0x43004300))
                at = list(idx)
                at[1] = 2 * idx[1] + k
                out[tuple(at)] = vector.bitcast(two_bf16, vector.broadcast(one_i32, t))
        return mgpu.FragmentedArray(_registers=out, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

    return convert(packed)


def _kernel(n_ref, q_ref, ck_ref, cv_ref, lok_ref, sck_ref, lov_ref, scv_ref,
            o_ref, lse_ref,
            q_smem, ck_smem, cv_smem, meta_smem, a_smem, p_smem, o_smem, lse_smem, q_bar, tile_bars,
            *, split_rows: int, hist_rows: int, head_dim: int, buffers: int, interpret: bool):
    b, h, sp = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("split")
    n_hist = n_ref[b]
    valid_rows = (n_hist + _TPB - 1) // _TPB
    r_begin = sp * split_rows
    r_end = jnp.minimum(r_begin + split_rows, valid_rows)
    steps = (jnp.maximum(r_end - r_begin, 0) + _ROWS - 1) // _ROWS

    plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem, q_bar.at[0])
    plgpu.barrier_wait(q_bar.at[0])
    col = plgpu.Layout.WGMMA.reduce(0)  # one value per query column
    row = plgpu.Layout.WGMMA.reduce(1)  # one value per token
    tile = (_ROWS, _N)

    def column_sums(acc_ref):
        """Σ_d q[c, d] of the bf16 MMA operand, as a [64, 8] tile (the same in every row): an MMA
        of a ones tile with q. (An 8-vector loaded with the column layout gave every score a
        per-column offset on the H200, so the sums are made in the scores' own tile layout.)"""
        a_smem.at[0][...] = plgpu.layout_cast(jnp.full((_ROWS, head_dim), 1.0, jnp.bfloat16),
                                              plgpu.Layout.WGMMA)
        plgpu.commit_smem()
        plgpu.wgmma(acc_ref, a_smem.at[0], q_smem.T)
        return acc_ref[...]

    q_sum = pl.run_scoped(column_sums, plgpu.ACC(tile, jnp.float32))
    q_offset = _OFFSET * q_sum  # what the 128 in bf16(128 + code) adds to every score
    by_col = lambda v, shape=tile: lax.broadcast_in_dim(v, shape, [1])
    by_row = lambda v: lax.broadcast_in_dim(v, tile, [0])
    row_ids = plgpu.broadcasted_iota(jnp.int32, tile, 0, layout=plgpu.Layout.WGMMA)

    def tile_start(i):
        """First packed row of step i; the last tile is moved back to end at the array's end.
        Both are multiples of 8 (split_rows % 64 == 0, hist_rows % 8 == 0), which the TMA into
        the 8-row-tiled code buffers needs."""
        r_nominal = r_begin + i * _ROWS
        return r_nominal, jnp.minimum(r_nominal, hist_rows - _ROWS)

    def issue(i, slot):
        """TMA of step i's K/V code tiles and 4 metadata tiles into buffer `slot`."""
        r0 = tile_start(i)[1]
        sources = [ck_ref.at[b, h, pl.ds(r0, _ROWS)], cv_ref.at[b, h, pl.ds(r0, _ROWS)]]
        sources += [ref.at[b, h, :, pl.ds(r0, _ROWS)] for ref in (lok_ref, sck_ref, lov_ref, scv_ref)]
        targets = [ck_smem.at[slot], cv_smem.at[slot]] + [meta_smem.at[slot, j] for j in range(4)]
        for j, (src, dst) in enumerate(zip(sources, targets)):
            plgpu.copy_gmem_to_smem(src, dst, tile_bars.at[slot])  # one arrival per copy

    for j in range(buffers - 1):  # the first buffers - 1 steps are in flight before step 0
        pl.when(j < steps)(functools.partial(issue, j, j))

    def step(i, carry):
        acc, m, l_part, lo_part = carry
        slot = lax.rem(i, buffers)
        ahead = i + buffers - 1  # into the buffer step i - 1 read (its data is in registers)
        pl.when(ahead < steps)(lambda: issue(ahead, lax.rem(ahead, buffers)))

        plgpu.barrier_wait(tile_bars.at[slot])
        r_nominal, r0 = tile_start(i)
        fresh = r0 + row_ids >= r_nominal  # rows an earlier step has not seen
        codes_layout = None if interpret else plgpu.Layout.WGMMA_8BIT
        packed_k, packed_v = [plgpu.load(ref.at[slot], layout=codes_layout)  # read once per step
                              for ref in (ck_smem, cv_smem)]
        meta = [[plgpu.load(meta_smem.at[slot, j, s], layout=row).astype(jnp.float32) for j in range(4)]
                for s in range(_TPB)]  # per slice: lo_k, scale_k, lo_v, scale_v [64]

        def qk(*acc_refs):
            """The 4 slices' K products, issued back to back, waited on once."""
            for s, acc_ref in enumerate(acc_refs):
                a_k = _slice_tile(packed_k, s, interpret=interpret)
                if interpret:  # interpreter only (A from shared memory; its MMAs are synchronous)
                    a_smem.at[0][...] = a_k
                    plgpu.commit_smem()
                    a_k = a_smem.at[0]
                plgpu.wgmma(acc_ref, a_k, q_smem.T)
            return [acc_ref[...] for acc_ref in acc_refs]

        scores = []
        for s, raw in enumerate(pl.run_scoped(qk, *[plgpu.ACC(tile, jnp.float32)] * _TPB)):
            lo_k, scale_k = meta[s][0], meta[s][1]
            sc = by_row(scale_k) * (raw - q_offset) + by_row(lo_k) * q_sum
            scores.append(jnp.where(fresh & (_TPB * (r0 + row_ids) + s < n_hist), sc, -jnp.inf))
        # One cross-warp reduction per step: the running max over the 4 slices' tokens.
        m_new = jnp.maximum(m, functools.reduce(jnp.maximum, scores).max(axis=0))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m - m_use)
        l_part, lo_part = l_part * by_col(alpha), lo_part * by_col(alpha)
        acc = acc * by_col(alpha, (head_dim, _N))

        def pv_mma(acc_ref):
            """Σ_s (V_s)^T (p_s ∘ scale_v): two staging buffers, one MMA left in flight while
            the next slice is unpacked and stored."""
            sums = []
            for s in range(_TPB):
                lo_v, scale_v = meta[s][2], meta[s][3]
                p = jnp.exp(scores[s] - by_col(m_use))
                pv = (p * by_row(scale_v)).astype(jnp.bfloat16)
                sums.append((p, p * by_row(lo_v) - _OFFSET * pv.astype(jnp.float32)))
                buf = s % 2  # read by the MMA of slice s - 2, finished by the wait below
                a_smem.at[buf][...] = _slice_tile(packed_v, s, interpret=interpret)
                p_smem.at[buf].T[...] = pv
                plgpu.commit_smem()
                plgpu.wgmma(acc_ref, a_smem.at[buf].T, p_smem.at[buf].T)
                plgpu.wgmma_wait(1)
            return acc_ref[...], sums

        # A fresh accumulator per step (the GPU interpreter has no rule for run_state).
        pv_sum, sums = pl.run_scoped(pv_mma, plgpu.ACC((head_dim, _N), jnp.float32))
        acc = acc + pv_sum
        for p, lo_term in sums:  # per-token partial sums, reduced over tokens once at the end
            l_part, lo_part = l_part + p, lo_part + lo_term
        return acc, m_new, l_part, lo_part

    wgmma_tile = lambda shape: plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)
    init = (wgmma_tile((head_dim, _N)), plgpu.layout_cast(jnp.full((_N,), -jnp.inf, jnp.float32), col),
            wgmma_tile(tile), wgmma_tile(tile))
    acc, m, l_part, lo_part = lax.fori_loop(0, steps, step, init)
    l, lo_acc = l_part.sum(axis=0), lo_part.sum(axis=0)
    safe_l = jnp.where(l > 0, l, 1.0)
    o_smem[...] = (acc + by_col(lo_acc, (head_dim, _N))) / by_col(safe_l, (head_dim, _N))
    lse_smem[...] = jnp.where(l > 0, m + jnp.log(safe_l), -jnp.inf)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, h, sp])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, sp])
    plgpu.wait_smem_to_gmem(0)


def _dense_partial(q, sink_k, sink_v, recent_k, recent_v, lengths, sink: int, window: int):
    """Attention of the newest query over the bf16 sink and recent ring, in XLA.

    q: f32 [B, Hkv, g, D] (softmax scale folded in). Returns (o f32 [B, Hkv, 1, g, D],
    lse f32 [B, Hkv, 1, g]); lse = -inf where no bf16 token is visible.
    """
    n = lengths[:, None]
    # Ring slot j holds the newest position p < n with (p - S0) % W == j (cache.ring_positions;
    # pallas_kernels does not import oscar_jax, so the rule is restated here).
    ring_pos = n - 1 - jnp.mod(n - 1 - sink - jnp.arange(window)[None, :], window)
    ring_ok = (ring_pos >= sink) & (ring_pos >= n - window)
    sink_ok = jnp.arange(sink)[None, :] < jnp.minimum(n, sink)
    visible = jnp.concatenate([sink_ok, ring_ok], axis=1)[:, None, None, :]  # [B, 1, 1, S0 + W]
    k = jnp.concatenate([sink_k, recent_k], axis=2).astype(jnp.float32)
    v = jnp.concatenate([sink_v, recent_v], axis=2).astype(jnp.float32)
    s = jnp.where(visible, jnp.einsum("bhgd,bhtd->bhgt", q, k), -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])
    o = jnp.einsum("bhgt,bhtd->bhgd", p, v)
    return o[:, :, None], lse[:, :, None]


def supports(spec, c: int, g: int) -> bool:
    """What this kernel handles (a `CacheSpec`, C queries, g query heads per KV head): decode,
    D = G in {64, 128, 256}, uniform 2-bit codes, bf16 metadata, g <= 8, packed rows a
    multiple of 8."""
    q = spec.quant
    rows = spec.hist_capacity // _TPB
    return (c == 1 and g <= _N and spec.head_dim in (64, 128, 256) and spec.group_size == spec.head_dim
            and q.bits == 2
            and tuple(q.levels) == (0.0, 1.0, 2.0, 3.0) and jnp.dtype(q.jnp_scale_dtype) == jnp.bfloat16
            and (rows < _ROWS or rows % 8 == 0))


def device_supported() -> bool:
    """Whether the default device runs this kernel: an sm_90 GPU (TMA + wgmma), or the CPU
    (Mosaic GPU interpret mode)."""
    device = jax.devices()[0]
    return device.platform == "cpu" or getattr(device, "compute_capability", None) == "9.0"


def mixed_attention(q_rot, sink_k, sink_v, hist_codes_k, hist_codes_v, hist_lo_k, hist_scale_k,
                    hist_lo_v, hist_scale_v, recent_k, recent_v, lengths, *, sink: int, window: int,
                    bits: int, levels: tuple[float, ...], softmax_scale: float,
                    interpret: bool = False, target_programs: int = 1024, buffers: int = 2):
    """Same contract as `mixed_attention.mixed_attention` (Triton), restricted to `supports`.

    q_rot: f32 [B, 1, Hq, D]; codes uint8 [B, Hkv, T_hist/4, D]; lo/scale bf16
    [B, Hkv, 1, 4, T_hist/4]; sink/recent bf16 [B, Hkv, S0 or W, D]; lengths int32 [B].
    Returns (o_rot f32 [B, 1, Hq, D], lse f32 [B, 1, Hq]). target_programs: history
    splits are chosen for about this many programs (2 fit per H200 SM by registers).
    buffers: TMA pipeline depth; on the H200 3 and 4 were slower than 2 (fewer programs
    fit per SM), see bench/results/kernels_mgpu_ab_h200.json.
    """
    b, c, hq, d = q_rot.shape
    hkv = sink_k.shape[1]
    g = hq // hkv
    rows = hist_codes_k.shape[2]
    if c != 1 or g > _N or d not in (64, 128, 256) or hist_lo_k.shape[2] != 1 or bits != 2 or \
            tuple(levels) != (0.0, 1.0, 2.0, 3.0) or hist_lo_k.dtype != jnp.bfloat16:
        raise ValueError(f"q_rot.shape={q_rot.shape}, groups={hist_lo_k.shape[2]}, bits={bits}, "
                         f"metadata {hist_lo_k.dtype}: this kernel needs C=1, g<=8, D in (64, 128, 256), G=D, "
                         "uniform 2-bit codes and bf16 metadata")
    q = (q_rot[:, 0].astype(jnp.float32) * softmax_scale).reshape(b, hkv, g, d)
    q8 = jnp.pad(q, ((0, 0), (0, 0), (0, _N - g), (0, 0)))
    order = channel_order(d)  # the MMA's channel order (`_slice_tile`)
    q_bf = q8[..., order].astype(jnp.bfloat16)
    n_hist = jnp.clip(lengths.astype(jnp.int32) - window - sink, 0, rows * _TPB)

    codes = [hist_codes_k, hist_codes_v]
    meta = [x.reshape(b, hkv, _TPB, rows) for x in (hist_lo_k, hist_scale_k, hist_lo_v, hist_scale_v)]
    if rows >= _ROWS and rows % 8:
        raise ValueError(f"hist_codes_k.shape={hist_codes_k.shape}: TMA needs 16-byte metadata rows, "
                         "i.e. T_hist/4 a multiple of 8 (choose max_len - sink - window a multiple of 32)")
    if rows < _ROWS:  # tiny caches only: every tile must fit inside the arrays
        codes = [jnp.pad(x, ((0, 0), (0, 0), (0, _ROWS - rows), (0, 0))) for x in codes]
        meta = [jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, _ROWS - rows))) for x in meta]
    hist_rows = max(rows, _ROWS)
    tiles = -(-hist_rows // _ROWS)
    split_rows = _ROWS * -(-tiles // max(1, min(tiles, -(-target_programs // (b * hkv)))))
    num_splits = -(-hist_rows // split_rows)

    swizzled = lambda minor_bytes: (plgpu.TilingTransform((8, minor_bytes)), plgpu.SwizzleTransform(128))
    codes_tiling = (plgpu.TilingTransform((8, min(d, 128))), plgpu.SwizzleTransform(min(d, 128)))
    kernel = plgpu.kernel(
        functools.partial(_kernel, split_rows=split_rows, hist_rows=hist_rows, head_dim=d,
                          buffers=buffers, interpret=interpret),
        out_type=[jax.ShapeDtypeStruct((b, hkv, num_splits, d, _N), jnp.float32),
                  jax.ShapeDtypeStruct((b, hkv, num_splits, _N), jnp.float32)],
        scratch_types=[plgpu.SMEM((_N, d), jnp.bfloat16, transforms=swizzled(64)),
                       plgpu.SMEM((buffers, _ROWS, d), jnp.uint8, transforms=codes_tiling),  # 8-row tiles:
                       plgpu.SMEM((buffers, _ROWS, d), jnp.uint8, transforms=codes_tiling),  # r0 % 8 == 0
                       plgpu.SMEM((buffers, 4, _TPB, _ROWS), jnp.bfloat16),
                       plgpu.SMEM((2, _ROWS, d), jnp.bfloat16, transforms=swizzled(64)),
                       plgpu.SMEM((2, _N, _ROWS), jnp.bfloat16, transforms=swizzled(64)),
                       plgpu.SMEM((d, _N), jnp.float32),
                       plgpu.SMEM((_N,), jnp.float32),
                       plgpu.Barrier(num_barriers=1),
                       plgpu.Barrier(num_arrivals=_COPIES, num_barriers=buffers)],
        grid=(b, hkv, num_splits),
        grid_names=("b", "h", "split"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )
    o_t, lse_h = kernel(n_hist, q_bf, *codes, *meta)
    o_h = jnp.swapaxes(o_t, -1, -2)[..., :g, np.argsort(order)]  # [B, Hkv, S, g, D]
    o_d, lse_d = _dense_partial(q, sink_k, sink_v, recent_k, recent_v, lengths, sink, window)
    o, lse = merge_splits(jnp.concatenate([o_h, o_d], axis=2),
                          jnp.concatenate([lse_h[..., :g], lse_d], axis=2))
    return o.reshape(b, 1, hq, d), lse.reshape(b, 1, hq)
