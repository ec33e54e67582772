"""Register-level Mosaic GPU helpers of the Hopper kernels: every use of Mosaic GPU's private
API (fragmented arrays, MLIR dialects, inline PTX) by `mixed_attention_mgpu_kernel` and
`quantize_pack_mgpu` is here.

Each helper takes `interpret`: compiled, it is an `inline_mgpu` body that works on a WGMMA
fragment's registers (bit operations on whole 32-bit words, lane shuffles, byte stores at
swizzled shared-memory addresses); interpreted (Mosaic GPU interpret mode on CPU, which runs
no inline Mosaic GPU code), the same result from array ops. Shapes are the callers' tiles:
the decode kernel's [64, 8] score tiles (64 packed rows, 8 query columns) and 2-bit codes
(4 tokens a byte), the bulk write's [64, D] blocks of 64 tokens.
"""

from __future__ import annotations

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

from .hopper import int8_tiles

_TPB = 4  # tokens per packed byte (2-bit codes)
# Scaled A operands: slice s codes times this, `(byte >> 4 (s // 2)) & (3 << 2 (s % 2))`: one
# shift per word, shared by slices 2 and 3 (unscaled, slices 1-3 take one each).
SLICE_SCALE = (1, 4, 1, 4)


def _code_shift(s: int, scaled: bool) -> tuple[int, int]:
    """(right shift, mask) of token slice s in a packed byte. scaled: the codes times
    `SLICE_SCALE[s]` (mask only for slices 0-1, a shift of 4 for slices 2-3, the same
    shifted word); else the codes themselves, `(byte >> 2s) & 3`."""
    if not scaled:
        return 2 * s, 3
    return 4 * (s // 2), 3 << (2 * (s % 2))


def slice_codes(packed: jax.Array, s: int, *, scaled: bool = False, interpret: bool) -> jax.Array:
    """uint8 [R, C] packed tile (WGMMA 8-bit layout) -> int8 [R, C]: the 2-bit codes of token
    slice s (times `SLICE_SCALE[s]` when scaled), computed on whole 32-bit registers (an
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


def store_weights(w_smem, tiles, *, cols: int, zero: bool = False, interpret: bool) -> None:
    """Store int32 [R, N] weight tiles (WGMMA layout; the decode's R = 64 tokens, N = 8 query
    columns) as int8 (each element's low byte), transposed, into the K-major B operands of
    the V products, w_smem [4, 2 N, R] int8 (slice, N k + column with k = 0 for w_hi and 1 for
    w_lo, token; tiled (8, R), R-byte swizzle: each [8, R] tile is 8 R contiguous bytes):
    tiles[2 t + k] holds, in column block j (columns j * cols ... + cols - 1), slice t * P + j
    (P = N / cols), which it fills there. Every other column of a slice's operand stays 0:
    `zero` writes that once, before the loop (tiles ignored), and no later store touches
    those bytes.

    Compiled, each element is one byte store at its swizzled address (Mosaic GPU has no
    transposed 8-bit store before Blackwell). In the [8, 64] tile, element (row r, column j)
    sits at byte 64 j + r, whose 16-byte chunk (bits 4-5) is XORed with bits 7-8. A thread's
    two columns of a WGMMA tile lie in one column block (cols is even or 8), so it stores
    each element once, into its block's slice.
    """
    tpb, n, rows = w_smem.shape[0], w_smem.shape[1] // 2, w_smem.shape[2]
    packed = n // cols
    if interpret:
        col_block = jnp.arange(n)[None, :] // cols
        for s in range(tpb):
            for k in range(2):
                x = jnp.zeros((rows, n), jnp.int32) if zero else \
                    jnp.where(col_block == s % packed, tiles[2 * (s // packed) + k], 0)
                w_smem.at[s, pl.ds(n * k, n)].T[...] = (((x & 0xFF) ^ 0x80) - 0x80).astype(jnp.int8)
        return

    @plgpu.inline_mgpu(arg_types=((plgpu.Layout.WGMMA,) * len(tiles), plgpu.RefType(int8_tiles(rows))))
    def store(ctx, arrays, ref):
        del ctx
        i8, i32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)
        const = lambda v: arith.constant(i32, v)
        base = mgpu.utils.memref_ptr(ref)
        frag_layout = arrays[0].layout
        tile_bytes = n * rows
        for reg_idx, (row, col) in zip(np.ndindex(arrays[0].registers.shape),
                                       frag_layout.thread_idxs(arrays[0].shape)):
            row, col = (arith.index_castui(i32, x) for x in (row, col))
            for e in range(frag_layout.vector_length):  # column col + e
                column = arith.addi(col, const(e))
                offset = arith.addi(arith.muli(column, const(rows)), row)
                chunk = arith.andi(arith.shrui(offset, const(3)), const(0x30))
                offset = arith.xori(offset, chunk)
                if zero:  # this thread's bytes of every slice's hi and lo tiles
                    for t in range(2 * tpb):
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


def load_metadata(meta, t: int, packed: int, tile: tuple[int, int]) -> list:
    """One step's metadata, meta bf16 [4, 4, R] (lo_k, scale_k, lo_v, scale_v; slice; packed
    row), for score tile t -> 4 f32 `tile` [R, N] arrays (WGMMA layout; compiled only):
    element (row, column) is the value of that row for slice t * packed + column // (N /
    packed), the slice whose scores the column holds. Each thread loads only its own column
    block's rows (its two columns lie in one block): 2 loads per array, no selects."""
    cols = tile[1] // packed
    frag_layout, shape = fa.WGMMA_LAYOUT, tile

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


def load_columns(ref, scales: tuple[int, ...], *, interpret: bool) -> jax.Array:
    """f32 [N] in shared memory -> [N] (one value per column of a WGMMA tile, 2 registers a
    thread), column block j (N / len(scales) columns) divided by scales[j]. A [64, N] tile
    whose rows all hold these values would keep 4 registers a thread for the whole loop."""
    n = ref.shape[-1]
    cols = n // len(scales)
    if interpret:
        block = lax.broadcasted_iota(jnp.int32, (n,), 0) // cols
        factor = jnp.full((n,), 1.0 / scales[0], jnp.float32)
        for j in range(1, len(scales)):
            factor = jnp.where(block == j, 1.0 / scales[j], factor)
        return ref[...] * factor
    column = plgpu.Layout.WGMMA.reduce(0)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),),
                       return_type=plgpu.ShapeDtypeStruct((n,), jnp.float32, layout=column))
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
            layout.registers_shape((n,))), _layout=layout, _is_signed=None)

    return load(ref)


def _zero_accumulator(shape: tuple[int, int]) -> jax.Array:
    """int32 zeros `shape` (WGMMA layout), each register set by a mov of its own (compiled
    only). ptxas issues an accumulator's first MMA as D = A B only where it sees each register
    set to 0; a scoped accumulator's registers are copies of one zero register, which it
    moves into all but one of a step's accumulators in every step."""
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


def accumulate(body, shapes, outs=(), *, interpret: bool):
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


def warpgroup_barrier(*, interpret: bool) -> None:
    """All 4 warps of this warpgroup meet (for kernels that run without Pallas's automatic
    barriers, `unsafe_no_auto_barriers`)."""
    if interpret:
        return

    @plgpu.inline_mgpu()
    def barrier(ctx):
        del ctx
        mgpu.utils.warpgroup_barrier()

    barrier()


def reduce_rows(x: jax.Array, kind: str, scratch, *, interpret: bool) -> jax.Array:
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


def max_rows(xs, scratches, *, interpret: bool) -> list:
    """f32 [64, N] arrays (WGMMA layout) -> [N] each: the max over rows, all behind one barrier:
    the max in each thread and warp (butterfly shuffles), each warp's into the array's scratch
    f32 [32] (4 lane groups x 4 warps x 2 columns), a barrier, the max of the 4 warps' (two
    16-byte loads). Mosaic GPU's `reduce` also puts a barrier after the loads, for the
    scratch's next use; here the caller instead gives each call scratch that nothing writes
    again before every warp has passed a later barrier."""
    if interpret:
        return [x.max(axis=0) for x in xs]
    n = xs[0].shape[1]
    out_layout = plgpu.Layout.WGMMA.reduce(0)

    @plgpu.inline_mgpu(arg_types=((plgpu.Layout.WGMMA,) * len(xs), (plgpu.RefType(),) * len(xs)),
                       return_type=[plgpu.ShapeDtypeStruct((n,), jnp.float32, layout=out_layout)] * len(xs))
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
                layout.registers_shape((n,))), _layout=layout, _is_signed=None))
        return out

    return reduce(tuple(xs), tuple(scratches))


def store_codes(v: jax.Array, mask: jax.Array, ref, *, channel_major: bool, interpret: bool) -> None:
    """v f32 [64, D] (WGMMA layout): u + 1.5 * 2^23 per element (the code in the word's low
    bits), and mask int32 [64] (row layout): 3, or 0 for a token whose codes are all 0 -> the
    block's packed codes, code = (bits of v) & mask, in ref uint8 [16, D] (token-major) or
    [D, 16] (channel-major).

    Compiled, the packing never leaves registers: in the WGMMA layout the four tokens of a
    byte row are rows held by lanes l, l ^ 4, l ^ 8, l ^ 12 (the same register), so each
    thread ORs its shifted codes, four to a 32-bit word, and two butterfly shuffles combine
    the lanes; one more shuffle with a neighbour and a byte permute (prmt) make each lane's
    word four bytes in a row of the layout, stored as one 32-bit word."""
    tokens, d = v.shape
    rows = tokens // _TPB
    if interpret:
        code = lax.bitcast_convert_type(v, jnp.int32) & mask[:, None]
        shift = 2 * (jnp.arange(tokens, dtype=jnp.int32) % _TPB)[:, None]
        packed = jnp.sum((code << shift).reshape(rows, _TPB, d), axis=1).astype(jnp.uint8)
        ref[...] = packed.T if channel_major else packed
        return

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1), plgpu.RefType()))
    def store(ctx, array, mask, out):
        del ctx
        i8, i32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)
        const = lambda x: arith.constant(i32, x)
        base = mgpu.utils.memref_ptr(out)
        regs = array.registers  # [1, D/8, 1, 1, 2 row halves, 1, 1, 1, 1] of vector<2xf32>
        where = dict(zip(np.ndindex(regs.shape), array.layout.thread_idxs(array.shape)))
        # This lane's rows are 16 w + l // 4 (+ 8): token slot s = (l // 4) % 4 of byte rows
        # i0 = 4 w + l // 16 and i0 + 2; its columns 8 j + 2 (l % 4) + {0, 1}.
        row0, col0 = (arith.index_castui(i32, x) for x in where[(0, 0, 0, 0, 0, 0, 0, 0, 0)])
        slot = arith.andi(row0, const(_TPB - 1))
        shift = arith.muli(slot, const(2))
        i0 = arith.shrui(row0, const(2))
        masks = [llvm.extractelement(mask.registers[0, 0, half, 0, 0], const(0)) for half in range(2)]
        words = []
        for j in range(d // 8):
            word = None
            for half in range(2):
                reg = regs[0, j, 0, 0, half, 0, 0, 0, 0]
                for e in range(2):
                    bits = arith.bitcast(i32, llvm.extractelement(reg, const(e)))
                    byte = arith.shli(arith.andi(bits, masks[half]), shift)
                    byte = arith.shli(byte, const(8 * (2 * half + e)))
                    word = byte if word is None else arith.ori(word, byte)
            for distance in (4, 8):  # the other three token slots of these byte rows
                word = arith.ori(word, mgpu.utils.shfl_bfly(word, distance))
            words.append(word)
        # The four lanes of a byte row now hold the same words: lane slot s takes j = 4 k + s.
        # Its word's bytes are (row i0, column c), (i0, c + 1), (i0 + 2, c), (i0 + 2, c + 1);
        # one more shuffle with a neighbour and a byte permute (prmt, selectors with the
        # first operand's bytes 0-3 and the second's 4-7) make it 4 bytes in a row of the
        # layout, stored as one 32-bit word:
        #   V (channel-major): lanes l, l ^ 16 hold rows i0 = 4 w + {0, 1}; the first stores
        #   column c, rows 4 w .. 4 w + 3, the second column c + 1;
        #   K (token-major): lanes l, l ^ 1 hold columns c = 4 m + {0, 2}; the first stores
        #   row i0, columns 4 m .. 4 m + 3, the second row i0 + 2.
        if channel_major:
            partner_distance, second = 16, arith.andi(i0, const(1))
            selectors = (0x6240, 0x3715)
        else:
            partner_distance, second = 1, arith.andi(arith.shrui(col0, const(1)), const(1))
            selectors = (0x5410, 0x3276)
        is_second = arith.cmpi(arith.CmpIPredicate.ne, second, const(0))
        selector = arith.select(is_second, const(selectors[1]), const(selectors[0]))
        for k in range(len(words) // 4):
            word = words[4 * k]
            for s in range(1, 4):
                word = arith.select(arith.cmpi(arith.CmpIPredicate.eq, slot, const(s)), words[4 * k + s], word)
            value = mgpu.utils.prmt(word, mgpu.utils.shfl_bfly(word, partner_distance), selector)
            col = arith.addi(arith.addi(col0, const(32 * k)), arith.muli(slot, const(8)))
            if channel_major:  # byte (c, i) at c * 16 + i: column c + second, rows from 4 w
                at = arith.addi(arith.muli(arith.addi(col, second), const(rows)), arith.subi(i0, second))
            else:  # byte (i, c) at i * D + c: row i0 + 2 second, columns from 4 m
                at = arith.addi(arith.muli(arith.addi(i0, arith.muli(second, const(2))), const(d)),
                                arith.subi(col, arith.muli(second, const(2))))
            llvm.store(value, mgpu.utils.getelementptr(base, [at], i8))

    store(v, mask, ref)


def store_meta(lo: jax.Array, scale: jax.Array, ref, *, interpret: bool) -> None:
    """lo, scale bf16 [64] (one per token, WGMMA row layout) -> ref bf16 [2, 4, 16]: token
    4 i + s at [kind, s, i], the packed metadata layout."""
    rows = lo.shape[0] // _TPB
    if interpret:
        for kind, x in enumerate((lo, scale)):
            ref[kind] = x.reshape(rows, _TPB).T
        return

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(1), plgpu.RefType()))
    def store(ctx, lo_arr, scale_arr, out):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        bf16 = ir.BF16Type.get()
        const = lambda x: arith.constant(i32, x)
        base = mgpu.utils.memref_ptr(out)
        for kind, arr in enumerate((lo_arr, scale_arr)):
            for idx, (row,) in zip(np.ndindex(arr.registers.shape), arr.layout.thread_idxs(arr.shape)):
                row = arith.index_castui(i32, row)
                at = arith.addi(arith.muli(arith.andi(row, const(_TPB - 1)), const(rows)), arith.shrui(row, const(2)))
                at = arith.addi(at, const(kind * _TPB * rows))
                value = llvm.extractelement(arr.registers[idx], const(0))
                llvm.store(value, mgpu.utils.getelementptr(base, [at], bf16))  # the 4 replicas agree

    store(lo, scale, ref)
