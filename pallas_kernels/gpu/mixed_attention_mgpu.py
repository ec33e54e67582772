"""Decode attention over the mixed OSCAR cache as a Mosaic GPU (Hopper) kernel, on int8 MMAs.

Both products run on the tensor cores' int8 path (wgmma s8·s8 -> s32), straight from the
2-bit codes (0..3 are exact int8), with tokens as the MMA's M dimension on the K side:
  scores^T [64, 8] = code_s [64, D] @ (256 q_hi + q_lo)^T    (one N = 16 s8 MMA: [q_hi | q_lo])
  scores = scale_s * (q_step * raw) + lo_s * Σq                        (per token, per query)
    (raw comes times _SLICE_SCALE[s], see below, and q_step is divided by it)
  online softmax over tokens, in base 2 (log2 e is folded into q)
  out^T [D, 8] += vcode_s^T [D, 64] @ (256 w_hi + w_lo)_s [64, 8]  (one N = 16 s8 MMA: [w_hi | w_lo])
where q ≈ q_step * (256 q_hi + q_lo) with int8 q_hi, q_lo (q_step from a bound on |q|, finer than bf16)
and w = p ∘ vscale_s ≈ (w_max / 127) * (w_hi + w_lo / 256) per step and query column, with
w_max the step's largest vscale (p <= 1 after the running max): it needs only the metadata,
so its cross-warp reduction shares the scores' barrier (a bound from the weights themselves
would put a second reduction after the softmax; ~15 bits of max w either way).
Σ p·lo is kept per token and reduced once at the end; the rounding error of w is charged
there to code - 1.5 rather than to code (uncentred, it cancelled badly against Σ p·lo).
W = 256 w_hi + w_lo = round(w / w_step) comes from one FFMA (`_ROUND`: the integer lands in
the float's low mantissa bits), w_lo its low byte and w_hi that of (W + 128) >> 8: no
float-to-int conversions.

Code tiles never pass through a float: token slice s of a packed 32-bit word is
`(word >> 2s) & 0x03030303`, four int8 codes, which is one A-operand register of the
WGMMA 8-bit layout as it stands. On the K side a word holds 4 channels x 4 tokens (the
cache's key layout), so a slice gives 4 channels of one token; on the V side the cache
stores codes channel-major ([D, T_hist/4]: a word holds 16 tokens of one channel), so a
slice gives 4 tokens of one channel, the K-major A operand of V^T·w (int8 wgmma takes
both operands K-major only, which is why the V codes are stored transposed). Slices are
taken scaled instead where that is exact to undo, `(word >> 4 (s // 2)) & (0x03030303 <<
2 (s % 2))` (codes times `_SLICE_SCALE` = 1, 4, 1, 4: one shift per word, shared by slices 2
and 3): on the K side every score tile's q_step divides the factor out per column block; on
the V side only where several slices share a tile (column block j holds slices j + P t,
all with the same factor), undone once on the accumulator at a piece's end. Each thread
loads only the metadata rows of its own column block.

The kernel runs without Pallas's automatic barriers (`unsafe_no_auto_barriers`), which put
one before each TMA copy (6 a step): shared-memory reuse is ordered by the step's own
reductions (`_max_rows`, one barrier a step, scratch alternating by step parity), the
barriers after `_dense`'s MMAs and commit_smem after every store; each step's copies are
issued by one warp (`one_warp`).

With g <= 4 (at D <= 128) several token slices share one [64, 8] score tile, each in its
own block of columns (`slices_per_tile`): q sits block-diagonally in the B operand, and
each column block is one more partial softmax for the merge, so padding columns do no work.

Work is split stream-K style (`WorkLine`): every (batch row, KV head) pair's sink and ring
and then its 256-token history tiles laid end to end and cut into programs of equal work
(`schedule`'s target: 3 x the SM count at 3 programs per SM), so a program takes pieces of
one or two pairs (each piece's history one partial, a sink and ring one more) and every SM
is busy to the end, whatever B x Hkv is. One warpgroup a program,
`warpgroups` of them per block (3 where there are enough programs: 3 per SM; `schedule`);
each step moves 64 packed rows (256 tokens) of K codes, the [D, 64] V-code tile and their
metadata into shared memory with TMA, `buffers` steps deep. Only a piece's last step masks
(tokens past the history). The V products' B operands are
zero outside their slice's column block once, before the loop, so each step stores only
the weights.

A pair's bf16 sink and recent ring are attended by the program that holds their units, on
bf16 MMAs in 64-token blocks (`_dense`), into one more partial (never cut: `WorkLine.cut`).

Three launches per call: `decode_start` (one Triton kernel: the query rotation, the
softmax scale and every query layout the MMAs need), this kernel, and `decode_finish` (one
Triton kernel: the merge of every partial and, at D <= 128, the back-rotation of the
output; XLA rotates back at D = 256).

Scope (`supports`): C = 1, D = G in {64, 128, 256}, uniform 2-bit codes, bf16 metadata,
g <= 8, packed history rows fewer than 64 (padded here) or a multiple of 64 (whole TMA
tiles; `CacheSpec` allocates a longer history in 256-token tiles).
In interpret mode (CPU) the A operands are staged in shared memory (the GPU interpreter
takes no register operands), and the unpacking, the metadata broadcast and the transposed
store use array ops; `pytest -m gpu` runs the compiled forms.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, memref, vector

from oscar_jax.pallas_kernels import layout

from . import decode_start as start
from .decode_finish import decode_finish
from .hopper import bf16_tiles as _bf16_tiles, int8_tiles as _int8_tiles, sm_count

_ROWS = start.TILE_ROWS  # packed rows per step: one m64 MMA tile per token slice
_N = start.N  # query columns (the smallest MMA N): g heads of one or more token slices
_TPB = 4  # tokens per packed byte (2-bit codes)
_COPIES = 6  # TMA copies per step: K codes, V codes, lo/scale of K and of V
_Q_LO = start.Q_LO  # q ≈ q_step * (256 q_hi + q_lo)
_W_MAX = 127.0  # w ≈ w_max / 127 * (w_hi + w_lo / 256), int8 w_hi and w_lo
_W_LO = 256  # W = round(256 * 127 w / w_max) = 256 w_hi + w_lo: w_lo is W's low byte
_ROUND = 1.5 * 2.0 ** 23  # x + this rounds x (|x| < 2^22) to an integer, held in the low mantissa bits
_ROUND_BITS = 0x4B400000  # the bits of _ROUND
_CODE_MID = 1.5  # mean code: the rounding of w is charged to code - 1.5
# Scaled A operands: slice s codes times this, `(byte >> 4 (s // 2)) & (3 << 2 (s % 2))`: one
# shift per word, shared by slices 2 and 3 (unscaled, slices 1-3 take one each).
_SLICE_SCALE = (1, 4, 1, 4)
_WARPGROUPS = 3  # programs per block (and per SM) where there are enough of them
_REDUCTION_SCRATCH = 512  # f32 per warpgroup: a cross-warp reduction of [R, 16] (4 warps x 32 lanes x 4)
_MAX_SCRATCH = 32  # f32: one [64, 8] array of a `_max_rows` (4 lane groups x 4 warps x 2 columns)
# The work line's costs, in units of a 256-token history step (~2.1 us, H200, B8 H32/8 D128
# 128K). A 64-token bf16 block of the sink or ring: the timelines of sessions 18 and 21 fit a
# sink and ring of 5 blocks at 10.6-12.5 us (bench/results/timeline_session18_h200.json).
_DENSE_TILE_COST = 1.2
# Units a program that reaches into a second pair gives up (`WorkLine.cut`): the second piece's
# start (its q, its first tiles, an empty pipeline) and the first one's store, which fits of
# those timelines put at 4-10 us besides its sink and ring; 5, with the costs beside it, timed
# best of the lines tried (the A/B below).
_SWITCH_COST = 5
# Units by which each warpgroup's programs are shorter: in each of the 8 calls of the session
# 17-18 timelines the median program of warpgroup 0 ended 0.3-1.1 us after warpgroup 1's and
# warpgroup 2's 0.8-1.8 us before (cause not known). These three against the earlier 0.8, 8 and
# none: the 128K call 0.1988 / 0.1987 ms against 0.1994 / 0.1992 (kernel 191.1-191.2 against
# 191.9 us; H200, jax 0.11.2, 2.28 bits/element, same run, two rounds:
# bench/results/kernels_session38_ab_h200.json). Only where programs hold at least
# _SHORTER_FROM units: the offsets were measured on programs of 85 and are ~0.5% of one.
_WARPGROUP_SHORTER = (1, 0, 0)
_SHORTER_FROM = 64


def _code_shift(s: int, scaled: bool) -> tuple[int, int]:
    """(right shift, mask) of token slice s in a packed byte. scaled: the codes times
    `_SLICE_SCALE[s]` (mask only for slices 0-1, a shift of 4 for slices 2-3, the same
    shifted word); else the codes themselves, `(byte >> 2s) & 3`."""
    if not scaled:
        return 2 * s, 3
    return 4 * (s // 2), 3 << (2 * (s % 2))


def _slice_codes(packed: jax.Array, s: int, *, scaled: bool = False, interpret: bool) -> jax.Array:
    """uint8 [R, C] packed tile (WGMMA 8-bit layout) -> int8 [R, C]: the 2-bit codes of token
    slice s (times `_SLICE_SCALE[s]` when scaled), computed on whole 32-bit registers (an
    and, and a shift for slices 1-3, or for slices 2-3 when scaled)."""
    shift, mask = _code_shift(s, scaled)
    if interpret:
        return ((packed >> shift) & jnp.uint8(mask)).astype(jnp.int8)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_8BIT,),
                       return_type=plgpu.ShapeDtypeStruct(packed.shape, jnp.int8,
                                                          layout=plgpu.Layout.WGMMA_8BIT))
    def convert(ctx, words):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        one_i32 = ir.VectorType.get((1,), i32)
        const = lambda v: arith.constant(i32, v)
        out = np.empty_like(words.registers)
        for idx, reg in np.ndenumerate(words.registers):
            w = llvm.extractelement(vector.bitcast(one_i32, reg), const(0))
            if shift:
                w = arith.shrui(w, const(shift))
            w = arith.andi(w, const(mask * 0x01010101))
            out[idx] = vector.bitcast(reg.type, vector.broadcast(one_i32, w))
        return mgpu.FragmentedArray(_registers=out, _layout=fa.WGMMA_LAYOUT_8BIT, _is_signed=True)

    return convert(packed)


def _store_weights(w_smem, tiles, *, cols: int, zero: bool = False, interpret: bool) -> None:
    """Store int32 [64, 8] weight tiles (WGMMA layout) as int8 (each element's low byte),
    transposed, into the K-major B operands of the V products, w_smem [4, 16, 64] int8
    (slice, 8 k + column with k = 0 for w_hi and 1 for w_lo, token; tiled (8, 64), 64-byte
    swizzle: each [8, 64] tile is 512 contiguous bytes): tiles[2 t + k] holds, in
    column block j (columns j * cols ... + cols - 1), slice t * P + j, which it fills there.
    Every other column of a slice's operand stays 0: `zero` writes that once, before the
    loop (tiles ignored), and no later store touches those bytes.

    Compiled, each element is one byte store at its swizzled address (Mosaic GPU has no
    transposed 8-bit store before Blackwell). In the [8, 64] tile, element (row r, column j)
    sits at byte 64 j + r, whose 16-byte chunk (bits 4-5) is XORed with bits 7-8. A thread's
    two columns of a WGMMA tile lie in one column block (cols is even or 8), so it stores
    each element once, into its block's slice.
    """
    packed = _N // cols
    if interpret:
        col_block = jnp.arange(_N)[None, :] // cols
        for s in range(_TPB):
            for k in range(2):
                x = jnp.zeros((_ROWS, _N), jnp.int32) if zero else \
                    jnp.where(col_block == s % packed, tiles[2 * (s // packed) + k], 0)
                w_smem.at[s, pl.ds(_N * k, _N)].T[...] = (((x & 0xFF) ^ 0x80) - 0x80).astype(jnp.int8)
        return

    @plgpu.inline_mgpu(arg_types=((plgpu.Layout.WGMMA,) * len(tiles), plgpu.RefType(_int8_tiles(_ROWS))))
    def store(ctx, arrays, ref):
        del ctx
        i8, i32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)
        const = lambda v: arith.constant(i32, v)
        base = mgpu.utils.memref_ptr(ref)
        frag_layout = arrays[0].layout
        tile_bytes = _N * _ROWS
        for reg_idx, (row, col) in zip(np.ndindex(arrays[0].registers.shape),
                                       frag_layout.thread_idxs(arrays[0].shape)):
            row, col = (arith.index_castui(i32, x) for x in (row, col))
            for e in range(frag_layout.vector_length):  # column col + e
                column = arith.addi(col, const(e))
                offset = arith.addi(arith.muli(column, const(_ROWS)), row)
                chunk = arith.andi(arith.shrui(offset, const(3)), const(0x30))
                offset = arith.xori(offset, chunk)
                if zero:  # this thread's bytes of every slice's hi and lo tiles
                    for t in range(2 * _TPB):
                        ptr = mgpu.utils.getelementptr(base, [arith.addi(offset, const(t * tile_bytes))], i8)
                        llvm.store(arith.constant(i8, 0), ptr)
                    continue
                # tile base of (slice t * P + column // cols, k): ((t P + block) * 2 + k) * 512
                block_base = arith.muli(arith.divui(column, const(cols)), const(2 * tile_bytes))
                offset = arith.addi(offset, block_base)
                for i, x in enumerate(arrays):
                    t, k = divmod(i, 2)
                    value = arith.trunci(i8, llvm.extractelement(x.registers[reg_idx], const(e)))
                    at = arith.addi(offset, const((2 * t * packed + k) * tile_bytes))
                    llvm.store(value, mgpu.utils.getelementptr(base, [at], i8))

    store(tuple(tiles), w_smem)


def _load_metadata(meta, t: int, packed: int) -> list:
    """One step's metadata, meta bf16 [4, 4, 64] (lo_k, scale_k, lo_v, scale_v; slice; packed
    row), for score tile t -> 4 f32 [64, 8] (WGMMA layout): element (row, column) is the
    value of that row for slice t * packed + column // (8 / packed), the slice whose scores
    the column holds. Each thread loads only its own column block's rows (its two columns
    lie in one block): 2 loads per array, no selects."""
    cols = _N // packed
    frag_layout, shape = fa.WGMMA_LAYOUT, (_ROWS, _N)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),),
                       return_type=[plgpu.ShapeDtypeStruct(shape, jnp.float32, layout=plgpu.Layout.WGMMA)] * 4)
    def load(ctx, ref):
        del ctx
        f32, index = ir.F32Type.get(), ir.IndexType.get()
        const = lambda v: arith.constant(index, v)
        vec = ir.VectorType.get((frag_layout.vector_length,), f32)
        regs = frag_layout.registers_shape(shape)
        out = [np.empty(regs, dtype=object) for _ in range(4)]
        for idx, (row, col) in zip(np.ndindex(regs), frag_layout.thread_idxs(shape)):
            slice_idx = arith.addi(arith.divui(col, const(cols)), const(t * packed))
            for k in range(4):
                value = arith.extf(f32, memref.load(ref, [const(k), slice_idx, row]))
                out[k][idx] = vector.broadcast(vec, value)
        return [mgpu.FragmentedArray(_registers=x, _layout=frag_layout, _is_signed=None) for x in out]

    return load(meta)


def _load_columns(ref, scales: tuple[int, ...], *, interpret: bool) -> jax.Array:
    """f32 [8] in shared memory -> [8] (one value per column of a WGMMA tile, 2 registers a
    thread), column block j (8 / len(scales) columns) divided by scales[j]. A [64, 8] tile
    whose rows all hold these values would keep 4 registers a thread for the whole loop."""
    cols = _N // len(scales)
    if interpret:
        block = lax.broadcasted_iota(jnp.int32, (_N,), 0) // cols
        factor = jnp.full((_N,), 1.0 / scales[0], jnp.float32)
        for j in range(1, len(scales)):
            factor = jnp.where(block == j, 1.0 / scales[j], factor)
        return ref[...] * factor
    column = plgpu.Layout.WGMMA.reduce(0)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),),
                       return_type=plgpu.ShapeDtypeStruct((_N,), jnp.float32, layout=column))
    def load(ctx, ref):
        del ctx
        i32, index, f32 = ir.IntegerType.get_signless(32), ir.IndexType.get(), ir.F32Type.get()
        const = lambda v: arith.constant(i32, v)
        col = arith.muli(arith.remui(mgpu.utils.thread_idx(), const(4)), const(2))  # this thread's 2 columns
        value = vector.load(ir.VectorType.get((2,), f32), ref, [arith.index_cast(index, col)])
        factor = arith.constant(f32, 1.0 / scales[0])
        block = arith.divui(col, const(cols))
        for j in range(1, len(scales)):
            factor = arith.select(arith.cmpi(arith.CmpIPredicate.eq, block, const(j)),
                                  arith.constant(f32, 1.0 / scales[j]), factor)
        value = arith.mulf(value, vector.broadcast(value.type, factor))
        layout = fa.WGMMA_LAYOUT.reduce((0,))
        return mgpu.FragmentedArray(_registers=np.asarray([value], dtype=object).reshape(
            layout.registers_shape((_N,))), _layout=layout, _is_signed=None)

    return load(ref)


def _zero_accumulator(shape: tuple[int, int]) -> jax.Array:
    """int32 zeros `shape` (WGMMA layout), each register set by a mov of its own (compiled
    only). ptxas issues an accumulator's first MMA as D = A B only where it sees each register
    set to 0; a scoped accumulator's registers are copies of one zero register, and for all but
    one of the step's accumulators it moved those zeros in every step (24 moves a step)."""
    layout = fa.WGMMA_LAYOUT

    @plgpu.inline_mgpu(return_type=plgpu.ShapeDtypeStruct(shape, jnp.int32, layout=plgpu.Layout.WGMMA))
    def zeros(ctx):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        vec = ir.VectorType.get((layout.vector_length,), i32)
        regs = np.empty(layout.registers_shape(shape), dtype=object)
        for idx in np.ndindex(regs.shape):
            v = llvm.mlir_undef(vec)
            for e in range(layout.vector_length):
                zero = mgpu.utils.inline_ptx("mov.b32 $0, 0;", result_types=i32, has_side_effects=True)
                v = llvm.insertelement(v, zero, arith.constant(i32, e))
            regs[idx] = v
        return mgpu.FragmentedArray(_registers=regs, _layout=layout, _is_signed=True)

    return zeros()


def _accumulate(body, shapes, outs=(), *, interpret: bool):
    """Fresh int32 [M, 16] accumulators of `shapes` (WGMMA layout), body(acc_refs) issuing the
    MMAs and returning arrays shaped like `outs` (computed while the MMAs run), one wait ->
    (the accumulators' values, body's arrays). Compiled, through `pl.run_state` from
    `_zero_accumulator`s (body's arrays written to refs that start as `outs`); interpreted,
    through `pl.run_scoped` (the GPU interpreter cannot lower run_state's accumulators)."""
    if interpret:
        def scoped(*acc_refs):
            values = body(acc_refs)
            return [ref[...] for ref in acc_refs], values
        return pl.run_scoped(scoped, *[plgpu.ACC(shape, jnp.int32) for shape in shapes])

    def state(refs):
        acc_refs, out_refs = refs
        for ref, value in zip(out_refs, body(acc_refs), strict=True):
            ref[...] = value

    return pl.run_state(state)(([plgpu.ACC.init(_zero_accumulator(shape)) for shape in shapes], list(outs)))


def _warpgroup_barrier(*, interpret: bool) -> None:
    """All 4 warps of this warpgroup meet (the kernel runs without Pallas's automatic
    barriers, `unsafe_no_auto_barriers`: see `_kernel`)."""
    if interpret:
        return

    @plgpu.inline_mgpu()
    def barrier(ctx):
        del ctx
        mgpu.utils.warpgroup_barrier()

    barrier()


def _reduce_rows(x: jax.Array, kind: str, scratch, *, interpret: bool) -> jax.Array:
    """f32 [R, N] (WGMMA layout, N = 8 or 16) -> [N]: max or sum over rows, i.e. across this
    warpgroup's warps, through its own shared-memory scratch f32 [512] (Pallas's reduction
    scratch is one buffer for the whole block: warpgroups reducing at once would race on it)."""
    if interpret:
        return x.max(axis=0) if kind == "max" else x.sum(axis=0)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()),
                       return_type=plgpu.ShapeDtypeStruct((x.shape[1],), jnp.float32,
                                                          layout=plgpu.Layout.WGMMA.reduce(0)))
    def reduce(ctx, array, ref):
        del ctx
        return array.reduce("max" if kind == "max" else "add", 0, scratch=ref)

    return reduce(x, scratch)


def _max_rows(xs, scratches, *, interpret: bool) -> list:
    """f32 [64, 8] arrays (WGMMA layout) -> [8] each: the max over rows, all behind one barrier:
    the max in each thread and warp (butterfly shuffles), each warp's into the array's scratch
    f32 [_MAX_SCRATCH], a barrier, the max of the 4 warps' (two 16-byte loads). Mosaic GPU's
    `reduce` also puts a barrier after the loads, for the scratch's next use; here the caller
    instead gives each call scratch that nothing writes again before every warp has passed a
    later barrier."""
    if interpret:
        return [x.max(axis=0) for x in xs]
    out_layout = plgpu.Layout.WGMMA.reduce(0)

    @plgpu.inline_mgpu(arg_types=((plgpu.Layout.WGMMA,) * len(xs), (plgpu.RefType(),) * len(xs)),
                       return_type=[plgpu.ShapeDtypeStruct((_N,), jnp.float32, layout=out_layout)] * len(xs))
    def reduce(ctx, arrays, refs):
        del ctx
        i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
        const = lambda v: arith.constant(i32, v)
        thread = mgpu.utils.thread_idx()
        lane = arith.remui(thread, const(32))
        warp = arith.divui(arith.remui(thread, const(128)), const(32))
        group = arith.muli(arith.remui(lane, const(4)), const(4))  # this lane's columns' 4 slots
        at = lambda x: arith.index_cast(index, arith.muli(x, const(2)))
        for array, ref in zip(arrays, refs):
            regs = array.registers.reshape(2)  # rows r and r + 8 of this thread's 2 columns
            v = arith.maximumf(regs[0], regs[1])
            for distance in (4, 8, 16):  # the lanes of these 2 columns
                v = arith.maximumf(v, mgpu.utils.shfl_bfly(v, distance))
            vector.store(v, ref, [at(arith.addi(group, warp))])
        mgpu.utils.warpgroup_barrier()
        layout = fa.WGMMA_LAYOUT.reduce((0,))
        out = []
        for ref in refs:
            parts = vector.load(ir.VectorType.get((8,), ir.F32Type.get()), ref, [at(group)])
            parts = [mgpu.utils.vector_slice(parts, slice(2 * w, 2 * w + 2)) for w in range(4)]
            v = arith.maximumf(arith.maximumf(parts[0], parts[1]), arith.maximumf(parts[2], parts[3]))
            out.append(mgpu.FragmentedArray(_registers=np.asarray([v], dtype=object).reshape(
                layout.registers_shape((_N,))), _layout=layout, _is_signed=None))
        return out

    return reduce(tuple(xs), tuple(scratches))


def _dense_blocks(sink: int, window: int) -> tuple[int, int]:
    """(sink blocks, all blocks) of 64 tokens of the bf16 sink and ring, each padded to whole
    blocks."""
    sink_blocks = -(-sink // _ROWS)
    return sink_blocks, sink_blocks + -(-window // _ROWS)


def _dense(b, h, n, qd_ref, segments, o_smem, *, k_smem, v_smem, p_smem, qd_smem, lse16_smem,
           bars, reduce_rows, barrier, g: int, sink: int, window: int):
    """The bf16 sink and ring of one (batch row, KV head) in blocks of 64 tokens (both padded
    to whole blocks), on bf16 MMAs with tokens as M, in base 2 -> one more partial, o^T [D, 8]
    normalised into o_smem and its lse into lse16_smem[:8] (column c is query c; -inf past g):
      s^T [64, 16] = K [64, D] @ [q_hi | q_hi]^T + K @ [q_lo | q_lo]^T  (both halves: all of s)
      out^T [D, 16] += V^T [D, 64] @ [p_hi | p_lo] [64, 16]  (out = left + right half)
    q and p as bf16 hi + lo (~16 bits); K and V exact; f32 accumulators. Single-buffered: the
    next block's K (V) is in flight while this block's softmax (next QK) runs; each warp
    reads its own rows of a block's K (V) in the MMA, so `barrier` (all warps done) comes
    before the next block's copy into it.
    segments: (sink K, sink V, ring K, ring V) refs (the ring stands in for an empty sink)."""
    sk_ref, sv_ref, rk_ref, rv_ref = segments
    d = k_smem.shape[-1]
    sink_blocks, total = _dense_blocks(sink, window)
    q_bar, k_bar, v_bar = bars

    def issue(i, which):
        """TMA of block i's K (which 0) or V (which 1) rows."""
        dst, bar = (k_smem, k_bar) if which == 0 else (v_smem, v_bar)
        seg_sink, seg_ring = (sk_ref, rk_ref) if which == 0 else (sv_ref, rv_ref)
        if sink_blocks:
            pl.when(i < sink_blocks)(lambda: plgpu.copy_gmem_to_smem(
                seg_sink.at[b, h, pl.ds(i * _ROWS, _ROWS)], dst, bar))
        pl.when(i >= sink_blocks)(lambda: plgpu.copy_gmem_to_smem(
            seg_ring.at[b, h, pl.ds((i - sink_blocks) * _ROWS, _ROWS)], dst, bar))

    plgpu.copy_gmem_to_smem(qd_ref.at[b, h], qd_smem, q_bar)  # [q_hi; q_lo]
    issue(0, 0)
    issue(0, 1)
    plgpu.barrier_wait(q_bar)
    wgmma_layout = plgpu.Layout.WGMMA
    tile = (_ROWS, 2 * _N)
    rows = plgpu.broadcasted_iota(jnp.int32, tile, 0, layout=wgmma_layout)
    columns = plgpu.broadcasted_iota(jnp.int32, tile, 1, layout=wgmma_layout)
    half, query = columns >= _N, columns % _N < g  # the right half; columns past g see nothing
    by_col = lambda v, shape=tile: lax.broadcast_in_dim(v, shape, [1])

    def block(i, carry):
        acc, m, l = carry
        plgpu.barrier_wait(k_bar)

        def qk(acc_ref):
            for k in range(2):  # q_hi, q_lo
                plgpu.wgmma(acc_ref, k_smem, qd_smem.at[pl.ds(k * 2 * _N, 2 * _N)].T)
            return acc_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC(tile, jnp.float32))
        barrier()
        pl.when(i + 1 < total)(lambda: issue(i + 1, 0))
        in_sink = i < sink_blocks
        j = jnp.where(in_sink, i, i - sink_blocks) * _ROWS + rows  # slot in its segment
        pos = jnp.where(rows * 0 + i < sink_blocks, j, layout.ring_position(n, j, sink, window))
        visible = (j < jnp.where(in_sink, sink, window)) & (pos >= 0) & (pos < n) & query
        s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m, reduce_rows(s, "max"))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - m_use)
        p = jnp.exp2(s - by_col(m_use))
        l = l * alpha + reduce_rows(p, "sum")
        p_hi = p.astype(jnp.bfloat16).astype(jnp.float32)
        p_smem[...] = jnp.where(half, p - p_hi, p_hi).astype(jnp.bfloat16)
        plgpu.commit_smem()
        plgpu.barrier_wait(v_bar)

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, v_smem.T, p_smem)
            return acc_ref[...]

        pv_out = pl.run_scoped(pv, plgpu.ACC((d, 2 * _N), jnp.float32))
        barrier()
        pl.when(i + 1 < total)(lambda: issue(i + 1, 1))
        return acc * by_col(alpha, (d, 2 * _N)) + pv_out, m_new, l

    init = (plgpu.layout_cast(jnp.zeros((d, 2 * _N), jnp.float32), wgmma_layout),
            plgpu.layout_cast(jnp.full((2 * _N,), -jnp.inf, jnp.float32), wgmma_layout.reduce(0)),
            plgpu.layout_cast(jnp.zeros((2 * _N,), jnp.float32), wgmma_layout.reduce(0)))
    acc, m, l = lax.fori_loop(0, total, block, init)
    seen = l > 0
    acc = acc / by_col(jnp.where(seen, l, 1.0), (d, 2 * _N))  # both halves share l
    o_smem[...] = acc[:, :_N] + acc[:, _N:]
    lse16_smem[...] = jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), -jnp.inf)


def _kernel(n_ref, table_ref, q_ref, qcol_ref, qd_ref, ck_ref, cv_ref, lok_ref, sck_ref, lov_ref, scv_ref,
            sk_ref, sv_ref, rk_ref, rv_ref, o_ref, lse_ref, *, codes, q_smem, qcol_smem, meta_smem, w_smem,
            o_smem, lse_smem, red_smem, q_bar, tile_bars, dense_bars, stage_k=None, stage_v=None,
            line: WorkLine, hist_tokens: int, head_dim: int, packed: int, buffers: int,
            sink: int, window: int, g: int, kv_heads: int, warpgroups: int, interpret: bool):
    # Program k = warpgroup wg of block `block` takes units [bounds[k], bounds[k + 1]) of the
    # work line (`WorkLine`; its tables, end to end in table_ref: bounds, each pair's first
    # program and its partials): pieces of one or two (batch row, KV head) pairs. The last
    # block's spare warpgroups compute the last program again and write nothing.
    first_at, counts_at = line.table_offsets
    # (a traced 0 at one warpgroup: `pl.run_state` cannot close over refs indexed by a Python int)
    wg = lax.axis_index("wg") if warpgroups > 1 else lax.axis_index("block") * 0
    flat = lax.axis_index("block") * warpgroups + wg
    program = jnp.minimum(flat, line.programs - 1)
    writes = flat < line.programs
    u0, u1 = table_ref[program], table_ref[program + 1]
    (ck_smem, cv_smem), dense_smem = codes  # the history's code buffers, or the sink / ring's
    q_smem, qcol_smem, ck_smem, cv_smem, meta_smem, w_smem, o_smem, lse_smem, red_smem = (
        ref.at[wg] for ref in (q_smem, qcol_smem, ck_smem, cv_smem, meta_smem, w_smem, o_smem, lse_smem, red_smem))
    dense_smem = dict(zip(("k_smem", "v_smem", "p_smem", "qd_smem", "lse16_smem"),
                          (ref.at[wg] for ref in dense_smem)))
    if interpret:
        stage_k, stage_v = stage_k.at[wg], stage_v.at[wg]
    q_bar, all_tile_bars = q_bar.at[wg], tile_bars
    tile_bar = lambda slot: all_tile_bars.at[wg * buffers + slot]  # this warpgroup's TMA barriers
    n_tiles = _TPB // packed  # score tiles per step; tile t holds slices t * packed + j
    tile = (_ROWS, _N)
    wgmma_layout = plgpu.Layout.WGMMA
    row = wgmma_layout.reduce(1)  # one value per token
    by_col = lambda v, shape=tile: lax.broadcast_in_dim(v, shape, [1])
    by_row = lambda v: lax.broadcast_in_dim(v, tile, [0])
    row_ids = plgpu.broadcasted_iota(jnp.int32, tile, 0, layout=wgmma_layout)
    col_block = plgpu.broadcasted_iota(jnp.int32, tile, 1, layout=wgmma_layout) // (_N // packed)
    codes_layout = None if interpret else plgpu.Layout.WGMMA_8BIT
    reduce_rows = functools.partial(_reduce_rows, scratch=red_smem.at[pl.ds(0, _REDUCTION_SCRATCH)],
                                    interpret=interpret)

    def one_warp(fn):
        """Run fn (a step's TMA copies) on warp wg % 4 of this warpgroup only, so the warpgroups
        of a block issue from different schedulers; the other warps skip it (in Pallas's
        warpgroup semantics all 4 warps compute every copy's coordinates and arrive on its
        barrier, ~130 instructions a step)."""
        if interpret:
            return fn()
        plgpu.warp_map(lambda warp: pl.when(warp == wg % 4)(fn))

    def max_scratch(i, k):
        """Scratch of array k of step i's `_max_rows` (0: the w bound, 1: the scores), by step
        parity: its next writer, step i + 2, runs after every warp passed step i + 1's barriers."""
        return red_smem.at[pl.ds(_REDUCTION_SCRATCH + (lax.rem(i, 2) * 2 + k) * _MAX_SCRATCH, _MAX_SCRATCH)]

    def unscale(shape, t):
        """f32 `shape` (WGMMA layout, 8 columns): column block j holds 1 / _SLICE_SCALE of slice
        t * packed + j, the factor its scaled codes (`_slice_codes`) came times."""
        blocks = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=wgmma_layout) // (_N // packed)
        factor = jnp.full(shape, 1.0 / _SLICE_SCALE[t * packed], jnp.float32)
        for j in range(1, packed):
            factor = jnp.where(blocks == j, 1.0 / _SLICE_SCALE[t * packed + j], factor)
        return factor

    wgmma_tile = lambda shape: plgpu.layout_cast(jnp.zeros(shape, jnp.float32), wgmma_layout)
    _store_weights(w_smem, (wgmma_tile(tile).astype(jnp.int32),), cols=_N // packed, zero=True,
                   interpret=interpret)  # the zero columns of every V-product B operand

    def history(b, h, t_begin, t_end, part):
        """History tiles [t_begin, t_end) of pair (b, h) -> partial `part`."""
        n_hist = jnp.clip(n_ref[b] - sink - window, 0, hist_tokens)  # history tokens of this row (n_ref: lengths)
        valid_rows = (n_hist + _TPB - 1) // _TPB
        r_begin = t_begin * _ROWS
        r_end = jnp.minimum(t_end * _ROWS, valid_rows)
        steps = (jnp.maximum(r_end - r_begin, 0) + _ROWS - 1) // _ROWS

        def by_block(vectors):
            """[64] per slice of a tile -> [64, 8]: column block j takes the vector of slice j."""
            out = by_row(vectors[0])
            for j in range(1, len(vectors)):
                out = jnp.where(col_block == j, by_row(vectors[j]), out)
            return out

        def issue(i, slot):
            """TMA of step i's K codes [64, D], V codes [D, 64] and 4 metadata tiles into `slot`
            (whole tiles: a piece is whole tiles of the [64 x tiles]-row arrays)."""
            r0 = r_begin + i * _ROWS
            sources = [ck_ref.at[b, h, pl.ds(r0, _ROWS)], cv_ref.at[b, h, :, pl.ds(r0, _ROWS)]]
            sources += [ref.at[b, h, :, pl.ds(r0, _ROWS)] for ref in (lok_ref, sck_ref, lov_ref, scv_ref)]
            targets = [ck_smem.at[slot], cv_smem.at[slot]] + [meta_smem.at[slot, j] for j in range(4)]
            for src, dst in zip(sources, targets):
                plgpu.copy_gmem_to_smem(src, dst, tile_bar(slot))  # one arrival per copy

        for j in range(buffers - 1):  # the first buffers - 1 steps are in flight before step 0
            pl.when(j < steps)(functools.partial(issue, j, j))
        plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem, q_bar)  # q_hi, q_lo (with the first tiles)
        plgpu.copy_gmem_to_smem(qcol_ref.at[b, h], qcol_smem, q_bar)  # q_step, Σq tiles
        plgpu.barrier_wait(q_bar)
        # Per column ([8]: 2 registers a thread); q_step / _SLICE_SCALE as the K codes come scaled.
        q_steps = [_load_columns(qcol_smem.at[0, 0], _SLICE_SCALE[t * packed:(t + 1) * packed],
                                 interpret=interpret) for t in range(n_tiles)]
        q_sum = _load_columns(qcol_smem.at[1, 0], (1,), interpret=interpret)

        def a_operand(codes, s, stage, scaled=False):
            """Slice s of a packed code tile as an MMA A operand: registers when compiled; staged
            in shared memory when interpreted (the GPU interpreter takes no register operands)."""
            x = _slice_codes(codes, s, scaled=scaled, interpret=interpret)
            if not interpret:
                return x
            stage.at[s][...] = x
            plgpu.commit_smem()
            return stage.at[s]

        def step(i, carry, *, last: bool):
            """Step i; only the last step of a piece masks (tokens past n_hist)."""
            acc, m, l_part, lo_part = carry
            slot = lax.rem(i, buffers)
            ahead = i + buffers - 1  # into the buffer step i - 1 read (its data is in registers)
            one_warp(lambda: pl.when(ahead < steps)(lambda: issue(ahead, lax.rem(ahead, buffers))))

            with jax.named_scope("tma_wait"):  # phases name the regions of a Mosaic GPU profile
                plgpu.barrier_wait(tile_bar(slot))
            r0 = r_begin + i * _ROWS
            packed_k = plgpu.load(ck_smem.at[slot], layout=codes_layout)  # [64, D]

            def load_rest():
                """Metadata [64, 8] per tile (lo_k, scale_k, lo_v, scale_v; column block j: slice
                t * packed + j), w_max [64, 8]: per packed row and column, the largest scale_v over
                the score tiles (the bound of w = p * scale_v, p <= 1, once reduced over rows with
                the scores) and the V codes."""
                if interpret:
                    meta = [[by_block([plgpu.load(meta_smem.at[slot, k, t * packed + j], layout=row).astype(jnp.float32)
                                       for j in range(packed)]) for k in range(4)] for t in range(n_tiles)]
                else:
                    meta = [_load_metadata(meta_smem.at[slot], t, packed) for t in range(n_tiles)]
                w_max = functools.reduce(jnp.maximum, [mt[3] for mt in meta])
                return plgpu.load(cv_smem.at[slot], layout=codes_layout), meta, w_max  # V codes [D, 64]

            def qk(acc_refs):
                """Per tile: its slices' codes times [q_hi | q_lo] placed in the slice's column block
                (one N = 16 int8 MMA per slice into one [64, 16] accumulator per tile)."""
                for t in range(n_tiles):
                    for j in range(packed):
                        plgpu.wgmma(acc_refs[t], a_operand(packed_k, t * packed + j, stage_k, scaled=True),
                                    q_smem.at[j].T)
                return ()

            with jax.named_scope("qk"):  # the metadata and the V codes are loaded after the MMAs' wait
                accs, _ = _accumulate(qk, [(_ROWS, 2 * _N)] * n_tiles, interpret=interpret)
                packed_v, meta, w_max = load_rest()
            with jax.named_scope("softmax"):
                scores = []
                for t in range(n_tiles):
                    lo_k, scale_k = meta[t][0], meta[t][1]
                    raw = (accs[t][:, :_N] * int(_Q_LO) + accs[t][:, _N:]).astype(jnp.float32)
                    sc = scale_k * (by_col(q_steps[t]) * raw) + lo_k * by_col(q_sum)
                    if last:
                        token = _TPB * (r0 + row_ids) + t * packed + col_block
                        sc = jnp.where(token < n_hist, sc, -jnp.inf)
                    scores.append(sc)
                # The scores' and the w bound's maxima over tokens behind one barrier.
                s_max, w_bound = _max_rows((functools.reduce(jnp.maximum, scores), w_max),
                                           (max_scratch(i, 1), max_scratch(i, 0)), interpret=interpret)
                m_new = jnp.maximum(m, s_max)
                m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if last else m_new  # finite if unmasked
                alpha = jnp.exp2(m - m_use)
                probs = [jnp.exp2(sc - by_col(m_use)) for sc in scores]
                weights = [p * meta[t][3] for t, p in enumerate(probs)]
            with jax.named_scope("w_store"):
                w_step = w_bound * (1.0 / (_W_MAX * _W_LO))  # one unit of W = 256 w_hi + w_lo
                w_inv = jnp.where(w_bound > 0, 1.0 / jnp.where(w_bound > 0, w_step, 1.0), 0.0)
                w_tiles, w_errors = [], []
                for t, w in enumerate(weights):  # B operands of the V products, K-major [16, 64] int8
                    # W = round(w / w_step) in [0, 256 * 127], by one FFMA: bits = _ROUND_BITS + W (no
                    # float-to-int conversion and its clamps); the low bytes of bits and of
                    # (bits + 128) >> 8 are w_lo = W - 256 w_hi in [-128, 127] and w_hi.
                    bits = lax.bitcast_convert_type(w * by_col(w_inv) + _ROUND, jnp.int32)
                    w_tiles += [(bits + _W_LO // 2) >> 8, bits]
                    units = (bits - _ROUND_BITS).astype(jnp.float32)  # (not biased - _ROUND: XLA folds it)
                    w_errors.append(w - units * by_col(w_step))
                _store_weights(w_smem, w_tiles, cols=_N // packed, interpret=interpret)
                plgpu.commit_smem()

            def partial_sums(l_part, lo_part):
                """Per-token partial sums, reduced over tokens once at the end; the rounding of w
                is charged to code - 1.5."""
                l_part, lo_part = l_part * by_col(alpha), lo_part * by_col(alpha)
                for t, p in enumerate(probs):
                    l_part = l_part + p
                    lo_part = lo_part + p * meta[t][2] + _CODE_MID * w_errors[t]
                return l_part, lo_part

            def pv(acc_refs):
                """out^T [D, 16] = V codes^T times [w_hi | w_lo], one N = 16 MMA per slice; the
                partial sums while the MMAs run."""
                for s in range(_TPB):
                    plgpu.wgmma(acc_refs[0], a_operand(packed_v, s, stage_v, scaled=packed > 1), w_smem.at[s].T)
                return partial_sums(l_part, lo_part)

            with jax.named_scope("pv"):
                (pv_acc,), sums = _accumulate(pv, [(head_dim, 2 * _N)], (l_part, lo_part), interpret=interpret)
            pv_raw = (pv_acc[:, :_N] * int(_W_LO) + pv_acc[:, _N:]).astype(jnp.float32)
            acc = acc * by_col(alpha, (head_dim, _N)) + pv_raw * by_col(w_step, (head_dim, _N))
            return (acc, m_new, *sums)

        init = (wgmma_tile((head_dim, _N)),
                plgpu.layout_cast(jnp.full((_N,), -jnp.inf, jnp.float32), wgmma_layout.reduce(0)),
                wgmma_tile(tile), wgmma_tile(tile))
        carry = lax.fori_loop(0, steps - 1, functools.partial(step, last=False), init)
        acc, m, l_part, lo_part = lax.fori_loop(jnp.maximum(steps - 1, 0), steps,
                                                functools.partial(step, last=True), carry)
        l, lo_acc = reduce_rows(l_part, "sum"), reduce_rows(lo_part, "sum")
        safe_l = jnp.where(l > 0, l, 1.0)
        if packed > 1:  # column block j's V codes came times _SLICE_SCALE[j] (its slices j + P t)
            acc = acc * unscale((head_dim, _N), 0)
        o_smem[...] = (acc + by_col(lo_acc, (head_dim, _N))) / by_col(safe_l, (head_dim, _N))
        lse_smem[...] = jnp.where(l > 0, m + jnp.log2(safe_l), -jnp.inf)  # base 2
        plgpu.commit_smem()

        @pl.when(writes)
        def _():
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, h, part])
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, part])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # o_smem free for the next piece

    def dense(b, h, part):
        """The sink and ring of pair (b, h) -> partial `part`."""
        bars = (dense_bars.at[3 * wg], dense_bars.at[3 * wg + 1], dense_bars.at[3 * wg + 2])
        _dense(b, h, n_ref[b], qd_ref, (sk_ref, sv_ref, rk_ref, rv_ref), o_smem, bars=bars,
               reduce_rows=reduce_rows, barrier=functools.partial(_warpgroup_barrier, interpret=interpret),
               g=g, sink=sink, window=window, **dense_smem)
        plgpu.commit_smem()

        @pl.when(writes)
        def _():
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, h, part])
            plgpu.copy_smem_to_gmem(dense_smem["lse16_smem"].at[pl.ds(0, _N)], lse_ref.at[b, h, part])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # o_smem free for the next piece

    def piece(i):
        """This program's i-th pair: its sink and ring where their units are this program's,
        then its history tiles here (both none where the units lie elsewhere)."""
        pair, owns_dense, t_begin, t_end = line.piece(u0, u1, i, jnp)
        b, h = pair // kv_heads, pair % kv_heads
        pl.when(owns_dense)(lambda: dense(b, h, table_ref[counts_at + pair] - 1))
        pl.when(t_end > t_begin)(lambda: history(b, h, t_begin, t_end, program - table_ref[first_at + pair]))

    # Unrolled: inside a loop over the pieces the kernel took 80.9 against 58.9 us (H200, B8
    # 32K, where every program has one piece; bench/results/kernels_session11_h200.json run 2).
    piece(0)
    pl.when(line.pieces(u0, u1) > 1)(functools.partial(piece, 1))


def slices_per_tile(g: int, head_dim: int) -> int:
    """Token slices whose scores share one [64, 8] tile: each takes a block of 8 / P columns,
    g padded to a power of two (g = 4: 2 slices, g <= 2: all 4, g > 4: 1). At D = 256 one
    slice per tile: packing was slower there on the H200 (more live A operands, spills;
    bench/results/kernels_mgpu_int8_h200.json)."""
    if head_dim > 128:
        return 1
    return min(_TPB, _N // (1 << (g - 1).bit_length()))


@dataclasses.dataclass(frozen=True)
class WorkLine:
    """The kernel's work decomposition (stream-K): each (batch row, KV head) pair's work laid
    end to end, `unit` units a pair (the sink and ring's `dense` units, then its `tiles`
    256-token history tiles), cut into programs: program k takes units [bounds[k],
    bounds[k + 1]), never cutting a sink and ring (`cut`) and at most one pair's units (so
    at most two pairs). Its history tiles of a pair are one piece, one partial; the pieces
    of a pair have partials 0, 1, ... in program order, its sink and ring the next one."""

    pairs: int
    tiles: int
    dense: int
    bounds: tuple[int, ...]

    @property
    def unit(self) -> int:
        return self.dense + self.tiles

    @property
    def programs(self) -> int:
        return len(self.bounds) - 1

    @classmethod
    def cut(cls, pairs: int, tiles: int, dense: int, per_program: int, switch: int = 0,
            shorter: tuple[int, ...] = ()) -> "WorkLine":
        """Programs of per_program units (the last one fewer), program k shorter by
        shorter[k % len(shorter)] where given (a block's warpgroups run at different paces),
        each cut that would fall inside a sink and ring moved to before it (or after it where
        the program would be empty); a program that reaches into a second pair is `switch`
        units shorter (its second piece's start and its first piece's end cost time of their
        own)."""
        unit, total = dense + tiles, pairs * (dense + tiles)
        most = max(shorter, default=0)
        if min(pairs, tiles) < 1 or dense < 0 or switch < 0 or min(shorter, default=0) < 0 or \
                not 1 + most <= per_program <= unit:
            raise ValueError(f"pairs={pairs}, tiles={tiles}, dense={dense}, per_program={per_program}, "
                             f"switch={switch}, shorter={shorter}: expected pairs, tiles >= 1, dense, switch, "
                             f"shorter >= 0 and {1 + most} <= per_program <= {unit}")
        bounds = [0]
        while bounds[-1] < total:
            k = len(bounds) - 1
            end = min(bounds[-1] + per_program - (shorter[k % len(shorter)] if shorter else 0), total)
            base = end // unit * unit
            if bounds[-1] < base < end:  # two pairs
                end = max(base, end - switch)
            if base < end < base + dense:
                end = base if base > bounds[-1] else base + dense
            bounds.append(end)
        return cls(pairs, tiles, dense, tuple(bounds))

    def piece(self, u0, u1, i, xp=np):
        """The i-th pair of a program of units [u0, u1) -> (pair, whether the program takes
        its sink and ring, its first and end history tile there)."""
        pair = u0 // self.unit + i
        base = pair * self.unit
        t_begin = xp.clip(u0 - base - self.dense, 0, self.tiles)
        t_end = xp.clip(u1 - base - self.dense, 0, self.tiles)
        return pair, (u0 <= base) & (base < u1), t_begin, t_end

    def pieces(self, u0, u1):
        """Pairs that a program of units [u0, u1) touches: 1 or 2."""
        return 1 + ((u0 // self.unit + 1) * self.unit < u1).astype(np.int32)

    def tables(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """int32 (bounds [programs + 1], each pair's first program with history tiles of it
        [pairs], each pair's partials [pairs]: its pieces and the sink and ring's)."""
        bounds = np.asarray(self.bounds, np.int32)
        base = np.arange(self.pairs) * self.unit
        program_of = lambda u: np.searchsorted(bounds, u, side="right") - 1
        first, last = program_of(base + self.dense), program_of(base + self.unit - 1)
        return bounds, first.astype(np.int32), (last - first + 2).astype(np.int32)

    @property
    def table_offsets(self) -> tuple[int, int]:
        """Where the first programs and the partials of `tables()` start in `table()`."""
        return self.programs + 1, self.programs + 1 + self.pairs

    def table(self) -> np.ndarray:
        """int32 [programs + 1 + 2 pairs]: `tables()` end to end, one constant for the kernels
        (XLA makes a constant whose elements are all equal, as first and partials often are,
        into a broadcast kernel of its own: ~0.4 us each, 128K on the H200)."""
        return np.concatenate(self.tables())


def schedule(rows_and_heads: int, tiles: int, head_dim: int, *, dense_blocks: int = 0,
             warpgroups: int | None = None, buffers: int | None = None,
             target_programs: int | None = None) -> tuple[int, int, WorkLine]:
    """(warpgroups per block, TMA buffers, work line) for B x Hkv = rows_and_heads pairs of
    `tiles` 256-token history tiles and `dense_blocks` 64-token blocks of sink and ring (each
    counted as `_DENSE_TILE_COST` tiles); None picks the default.

    warpgroups: 3 at D <= 128 when the work makes more programs than one wave of 2 per SM
    holds (target 3 x SMs), else 1 (target 2 x SMs at D <= 128, 1024 at D = 256: shared
    memory holds one D = 256 program of 118 KB). Programs: the fewest units each (at most a
    pair's) that `WorkLine.cut` makes into at most the target; at 3 per block and at least
    `_SHORTER_FROM` units a program, each warpgroup's programs `_WARPGROUP_SHORTER` units shorter.
    buffers: 2 at 3 per block (204.7 against 208.1 us with 3, 128K kernel; and the only
    depth there: see `mixed_attention`'s shared-memory union), else 3."""
    sms = sm_count()
    dense = math.ceil(_DENSE_TILE_COST * dense_blocks)
    unit, total = tiles + dense, rows_and_heads * (tiles + dense)

    def line_for(target: int, shorter: tuple[int, ...] = ()) -> WorkLine:
        per_program = min(unit, -(-total // target))
        shorter = shorter if per_program >= _SHORTER_FROM else ()
        line = WorkLine.cut(rows_and_heads, tiles, dense, per_program, _SWITCH_COST, shorter)
        while line.programs > target and per_program < unit:  # the moved cuts added some
            per_program += 1
            line = WorkLine.cut(rows_and_heads, tiles, dense, per_program, _SWITCH_COST, shorter)
        return line

    if warpgroups is None:
        many = line_for(target_programs or _WARPGROUPS * sms).programs > 2 * sms
        warpgroups = _WARPGROUPS if head_dim <= 128 and many else 1
    if warpgroups < 1 or (warpgroups > 1 and head_dim > 128):
        raise ValueError(f"warpgroups={warpgroups}: expected >= 1, and 1 at D = {head_dim} > 128 "
                         "(shared memory holds one such program per block)")
    if buffers is None:
        buffers = 2 if warpgroups > 1 else 3
    if buffers < 1 or (warpgroups > 1 and buffers != 2):
        raise ValueError(f"buffers={buffers} at warpgroups={warpgroups}: expected >= 1, and 2 with several "
                         "warpgroups (the sink and ring's buffers then overlay each warpgroup's own code buffers)")
    if target_programs is None:
        target_programs = warpgroups * sms if warpgroups > 1 else 2 * sms if head_dim <= 128 else 1024
    line = line_for(target_programs, _WARPGROUP_SHORTER if warpgroups == _WARPGROUPS else ())
    return warpgroups, buffers, line


def supports(spec, c: int, g: int) -> bool:
    """What this kernel handles (a `CacheSpec`, C queries, g query heads per KV head): decode,
    D = G in {64, 128, 256}, uniform 2-bit codes, bf16 metadata, g <= 8, packed rows a
    multiple of 64 when at least 64."""
    q = spec.quant
    rows = spec.hist_capacity // _TPB
    return (c == 1 and g <= _N and spec.head_dim in (64, 128, 256) and spec.group_size == spec.head_dim
            and q.bits == 2
            and tuple(q.levels) == (0.0, 1.0, 2.0, 3.0) and jnp.dtype(q.jnp_scale_dtype) == jnp.bfloat16
            and (rows < _ROWS or rows % _ROWS == 0))


def mixed_attention(q, sink_k, sink_v, hist_codes_k, hist_codes_v, hist_lo_k, hist_scale_k,
                    hist_lo_v, hist_scale_v, recent_k, recent_v, lengths, *, sink: int, window: int,
                    bits: int, levels: tuple[float, ...], softmax_scale: float,
                    interpret: bool = False, target_programs: int | None = None, buffers: int | None = None,
                    warpgroups: int | None = None,
                    query_rot: jax.Array | None = None, output_rot: jax.Array | None = None,
                    query_rot_stats: jax.Array | None = None, out_dtype=jnp.float32):
    """Same contract as `mixed_attention.mixed_attention` (Triton), restricted to `supports`,
    except that both rotations may be left to this kernel.

    q: [B, 1, Hq, D], rotated, or in the model basis when query_rot is given: f32 [Hkv, D, D],
    or its bf16 parts [Hkv, 2, D, D] (`layout.split_bf16`, which `LayerParams` holds: then no
    kernel splits it per call) (`decode_start` rotates q: one kernel for the rotation and
    every query layout the MMAs need, where XLA took about ten small ops); query_rot_stats: f32
    [Hkv, 2, D] = `layout.rotation_stats(query_rot)` (which `LayerParams` holds) or None (then
    computed per call); hist_codes_k uint8 [B, Hkv, T_hist/4, D];
    hist_codes_v uint8 [B, Hkv, D, T_hist/4] (channel-major); lo/scale bf16 [B, Hkv, 1, 4,
    T_hist/4]; sink/recent bf16 [B, Hkv, S0 or W, D]; lengths int32 [B]; output_rot f32
    [Hkv, D, D], its bf16 parts [Hkv, 2, D, D] or None (the output is rotated back, o = o_rot · output_rot[h]^T, by
    `decode_finish` at D <= 128 and by XLA at D = 256).
    Returns (o out_dtype [B, 1, Hq, D]: o_rot, or rotated back when output_rot is given; lse
    f32 [B, 1, Hq]).
    warpgroups: programs per block, each warpgroup one program with its own buffers and
    barriers. 3 puts 3 programs on an SM (ptxas then fits a thread into 168 registers, spilling
    56 bytes since session 27, where 1 program per block took 213 and 2 programs per SM): at B8 H32/8 on the
    H200 the kernel took 203.2 against 220.6 us at 128K and 57.2 against 58.6 us at 32K
    (bench/results/kernels_session9_h200.json run 2). target_programs: the work line is
    chosen for at most about this many programs. buffers: TMA pipeline depth. None: see
    `schedule`.
    """
    b, c, hq, d = q.shape
    hkv = sink_k.shape[1]
    g = hq // hkv
    rows = hist_codes_k.shape[2]
    if c != 1 or g > _N or d not in (64, 128, 256) or hist_lo_k.shape[2] != 1 or bits != 2 or \
            tuple(levels) != (0.0, 1.0, 2.0, 3.0) or hist_lo_k.dtype != jnp.bfloat16:
        raise ValueError(f"q.shape={q.shape}, groups={hist_lo_k.shape[2]}, bits={bits}, "
                         f"metadata {hist_lo_k.dtype}: this kernel needs C=1, g<=8, D in (64, 128, 256), G=D, "
                         "uniform 2-bit codes and bf16 metadata")
    if hist_codes_v.shape != (b, hkv, d, rows):
        raise ValueError(f"hist_codes_v.shape={hist_codes_v.shape}: expected channel-major "
                         f"[B={b}, Hkv={hkv}, D={d}, T_hist/4={rows}]")
    if rows >= _ROWS and rows % _ROWS:
        raise ValueError(f"hist_codes_k.shape={hist_codes_k.shape}: T_hist/4 must be a multiple of {_ROWS} "
                         "(whole TMA tiles; CacheSpec allocates a longer history in 256-token tiles)")
    packed = slices_per_tile(g, d)
    cols = _N // packed  # query columns per slice: g padded
    q_blocks, qcol, q_dense = start.decode_start(q[:, 0], query_rot, kv_heads=hkv, softmax_scale=softmax_scale,
                                                 packed=packed, query_rot_stats=query_rot_stats,
                                                 interpret=interpret)
    # The bf16 segments in whole blocks of 64 rows (a copy only where S0 or W is not a multiple
    # of 64; the defaults, 64 and 256, are); no sink: the ring stands in (unread).
    whole = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, -x.shape[2] % _ROWS), (0, 0))) if x.shape[2] % _ROWS else x
    segments = [whole(x) for x in ((sink_k, sink_v) if sink else (recent_k, recent_v)) + (recent_k, recent_v)]
    dense_blocks = _dense_blocks(sink, window)[1]

    codes_k, codes_v = hist_codes_k, hist_codes_v
    meta = [x.reshape(b, hkv, _TPB, rows) for x in (hist_lo_k, hist_scale_k, hist_lo_v, hist_scale_v)]
    if rows < _ROWS:  # tiny caches only: every tile must fit inside the arrays
        codes_k = jnp.pad(codes_k, ((0, 0), (0, 0), (0, _ROWS - rows), (0, 0)))
        codes_v = jnp.pad(codes_v, ((0, 0), (0, 0), (0, 0), (0, _ROWS - rows)))
        meta = [jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, _ROWS - rows))) for x in meta]
    hist_rows = max(rows, _ROWS)
    tiles = -(-hist_rows // _ROWS)
    warpgroups, buffers, line = schedule(b * hkv, tiles, d, dense_blocks=dense_blocks, warpgroups=warpgroups,
                                         buffers=buffers, target_programs=target_programs)
    partials = line.tables()[2]  # per pair

    wgs = warpgroups  # every buffer below is per warpgroup
    history_codes = (plgpu.SMEM((wgs, buffers, _ROWS, d), jnp.uint8, transforms=_int8_tiles(d)),
                     plgpu.SMEM((wgs, buffers, d, _ROWS), jnp.uint8, transforms=_int8_tiles(_ROWS)))
    dense_tiles = (plgpu.SMEM((wgs, _ROWS, d), jnp.bfloat16, transforms=_bf16_tiles(d)),  # K block
                   plgpu.SMEM((wgs, _ROWS, d), jnp.bfloat16, transforms=_bf16_tiles(2 * _N)),  # V block (p's swizzle)
                   plgpu.SMEM((wgs, _ROWS, 2 * _N), jnp.bfloat16, transforms=_bf16_tiles(2 * _N)),  # [p_hi | p_lo]
                   plgpu.SMEM((wgs, 4 * _N, d), jnp.bfloat16, transforms=_bf16_tiles(d)),  # [q_hi; q_lo]
                   plgpu.SMEM((wgs, 2 * _N), jnp.float32))  # lse
    scratch = dict(
        # The history's loop, then the sink and ring. The union overlays the two groups as
        # wholes; a warpgroup's dense K / V lie over its own code buffers only because both
        # strides are 128 D bytes (2 buffers: `schedule` holds several warpgroups to that).
        codes=plgpu.RefUnion(history_codes, dense_tiles),
        q_smem=plgpu.SMEM((wgs, packed, 2 * _N, d), jnp.int8, transforms=_int8_tiles(d)),  # blocks x [hi; lo]
        qcol_smem=plgpu.SMEM((wgs, 2, _ROWS, _N), jnp.float32),
        meta_smem=plgpu.SMEM((wgs, buffers, 4, _TPB, _ROWS), jnp.bfloat16),
        w_smem=plgpu.SMEM((wgs, _TPB, 2 * _N, _ROWS), jnp.int8, transforms=_int8_tiles(_ROWS)),
        o_smem=plgpu.SMEM((wgs, d, _N), jnp.float32),
        lse_smem=plgpu.SMEM((wgs, _N), jnp.float32),
        red_smem=plgpu.SMEM((wgs, _REDUCTION_SCRATCH + 4 * _MAX_SCRATCH), jnp.float32),
        q_bar=plgpu.Barrier(num_arrivals=2, num_barriers=wgs),
        tile_bars=plgpu.Barrier(num_arrivals=_COPIES, num_barriers=wgs * buffers),
        dense_bars=plgpu.Barrier(num_arrivals=1, num_barriers=3 * wgs))  # q; K; V
    if interpret:  # A operands staged in shared memory
        scratch["stage_k"] = plgpu.SMEM((wgs, _TPB, _ROWS, d), jnp.int8, transforms=_int8_tiles(d))
        scratch["stage_v"] = plgpu.SMEM((wgs, _TPB, d, _ROWS), jnp.int8, transforms=_int8_tiles(_ROWS))
    kernel = plgpu.kernel(
        functools.partial(_kernel, line=line, hist_tokens=rows * _TPB, head_dim=d,
                          packed=packed, buffers=buffers, sink=sink, window=window, g=g, kv_heads=hkv,
                          warpgroups=wgs, interpret=interpret),
        out_type=[jax.ShapeDtypeStruct((b, hkv, partials.max(), d, _N), jnp.float32),
                  jax.ShapeDtypeStruct((b, hkv, partials.max(), _N), jnp.float32)],
        scratch_types=scratch,
        grid=(-(-line.programs // wgs),),
        grid_names=("block",),
        **(dict(num_threads=wgs, thread_name="wg") if wgs > 1 else {}),
        # No automatic barriers (Pallas's own put one before every TMA copy: 6 a step): a
        # buffer is copied into only after every warp has passed a barrier that follows its
        # last read (a step's reductions, the end of a piece, `_dense`'s `barrier`), and
        # every store to shared memory is followed by commit_smem (a fence and a barrier).
        compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )
    table = jnp.asarray(line.table())
    o_t, lse2 = kernel(lengths.astype(jnp.int32), table,
                       q_blocks, qcol, q_dense.reshape(b, hkv, 4 * _N, d), codes_k,
                       codes_v, *meta, *segments)
    # The merge of every (history piece or sink / ring, column block) partial, and the back-rotation:
    # fused at D <= 128; at D = 256 a fused rotation makes each of decode_finish's channel
    # blocks merge all 256 channels of every partial, so XLA rotates there (Gemma-3 B8 32K on
    # the H200, session 8: 0.110 ms so, 0.162 fused; bench/results/kernels_session8_h200.json).
    fused_rot = output_rot if d <= 128 else None
    xla_rot = output_rot is not None and fused_rot is None
    o, lse = decode_finish(o_t, lse2, table, counts_at=line.table_offsets[1], g=g, cols=cols,
                           output_rot=fused_rot, out_dtype=jnp.float32 if xla_rot else out_dtype,
                           interpret=interpret)
    if xla_rot:
        rot = output_rot if output_rot.ndim == 3 else output_rot.astype(jnp.float32).sum(axis=1)  # hi + lo
        o = jnp.einsum("bhge,hde->bhgd", o, rot, precision=lax.Precision.HIGHEST).astype(out_dtype)
    return o.reshape(b, 1, hq, d), lse.reshape(b, 1, hq)
