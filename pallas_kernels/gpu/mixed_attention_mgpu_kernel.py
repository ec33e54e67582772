"""The Mosaic GPU (Hopper) decode kernel over the mixed OSCAR cache, on int8 MMAs: its body.

Both products run on the tensor cores' int8 path (wgmma s8·s8 -> s32), straight from the
2-bit codes (0..3 are exact int8), with tokens as the MMA's M dimension on the K side:
  scores^T [64, 8] = code_s [64, D] @ (256 q_hi + q_lo)^T    (one N = 16 s8 MMA: [q_hi | q_lo])
  scores = scale_s * (q_step * raw) + lo_s * Σq                        (per token, per query)
    (raw comes times SLICE_SCALE[s], see below, and q_step is divided by it)
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
2 (s % 2))` (codes times `SLICE_SCALE` = 1, 4, 1, 4: one shift per word, shared by slices 2
and 3): on the K side every score tile's q_step divides the factor out per column block; on
the V side only where several slices share a tile (column block j holds slices j + P t,
all with the same factor), undone once on the accumulator at a piece's end. Each thread
loads only the metadata rows of its own column block.

The kernel runs without Pallas's automatic barriers (`unsafe_no_auto_barriers`), which put
one before each TMA copy (6 a step): shared-memory reuse is ordered by the step's own
reductions (`mgpu_helpers.max_rows`, one barrier a step, scratch alternating by step parity), the
barriers after `_dense`'s MMAs and commit_smem after every store; each step's copies are
issued by one warp (`one_warp`).

With g <= 4 (at D <= 128) several token slices share one [64, 8] score tile, each in its
own block of columns (`slices_per_tile`): q sits block-diagonally in the B operand, and
each column block is one more partial softmax for the merge, so padding columns do no work.

Work comes as a `WorkLine` or a `LiveLine` (`mixed_attention_mgpu_schedule`): program k
takes units [bounds[k], bounds[k + 1]) of the (batch row, KV head) pairs' work laid end to
end, i.e. pieces of one or two pairs (a `LiveLine`'s: one). One warpgroup a program,
`warpgroups` of them per block; each step moves 64 packed rows (256 tokens) of K codes, the
[D, 64] V-code tile and their metadata into shared memory with TMA, `buffers` steps deep. Only a piece's last step masks
(tokens past the history). The V products' B operands are zero outside their slice's column
block once, before the loop, so each step stores only the weights.

A pair's bf16 sink and recent ring are attended by the program that holds their units, on
bf16 MMAs in 64-token blocks (`_dense`), into one more partial (never cut: `WorkLine.cut`).
Partials (o^T [D, 8] normalised, lse in base 2) go to global memory for `decode_finish`.

In interpret mode (CPU) the A operands are staged in shared memory (the GPU interpreter
takes no register operands), and the unpacking, the metadata broadcast and the transposed
store use array ops (`mgpu_helpers`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from oscar_jax.pallas_kernels import layout

from . import decode_start as start
from . import mgpu_helpers as helpers
from .hopper import bf16_tiles, int8_tiles
from .mgpu_helpers import SLICE_SCALE
from .mixed_attention_mgpu_schedule import LiveLine, WorkLine

ROWS = start.TILE_ROWS  # packed rows per step: one m64 MMA tile per token slice
N = start.N  # query columns (the smallest MMA N): g heads of one or more token slices
TPB = 4  # tokens per packed byte (2-bit codes)
_COPIES = 6  # TMA copies per step: K codes, V codes, lo/scale of K and of V
_Q_LO = start.Q_LO  # q ≈ q_step * (256 q_hi + q_lo)
_W_MAX = 127.0  # w ≈ w_max / 127 * (w_hi + w_lo / 256), int8 w_hi and w_lo
_W_LO = 256  # W = round(256 * 127 w / w_max) = 256 w_hi + w_lo: w_lo is W's low byte
_ROUND = 1.5 * 2.0 ** 23  # x + this rounds x (|x| < 2^22) to an integer, held in the low mantissa bits
_ROUND_BITS = 0x4B400000  # the bits of _ROUND
_CODE_MID = 1.5  # mean code: the rounding of w is charged to code - 1.5
_REDUCTION_SCRATCH = 512  # f32 per warpgroup: a cross-warp reduction of [R, 16] (4 warps x 32 lanes x 4)
_MAX_SCRATCH = 32  # f32: one [64, 8] array of a `max_rows` (4 lane groups x 4 warps x 2 columns)


def dense_blocks(sink: int, window: int) -> tuple[int, int]:
    """(sink blocks, all blocks) of 64 tokens of the bf16 sink and ring, each padded to whole
    blocks."""
    sink_blocks = -(-sink // ROWS)
    return sink_blocks, sink_blocks + -(-window // ROWS)


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
    sink_blocks, total = dense_blocks(sink, window)
    q_bar, k_bar, v_bar = bars

    def issue(i, which):
        """TMA of block i's K (which 0) or V (which 1) rows."""
        dst, bar = (k_smem, k_bar) if which == 0 else (v_smem, v_bar)
        seg_sink, seg_ring = (sk_ref, rk_ref) if which == 0 else (sv_ref, rv_ref)
        if sink_blocks:
            pl.when(i < sink_blocks)(lambda: plgpu.copy_gmem_to_smem(
                seg_sink.at[b, h, pl.ds(i * ROWS, ROWS)], dst, bar))
        pl.when(i >= sink_blocks)(lambda: plgpu.copy_gmem_to_smem(
            seg_ring.at[b, h, pl.ds((i - sink_blocks) * ROWS, ROWS)], dst, bar))

    plgpu.copy_gmem_to_smem(qd_ref.at[b, h], qd_smem, q_bar)  # [q_hi; q_lo]
    issue(0, 0)
    issue(0, 1)
    plgpu.barrier_wait(q_bar)
    wgmma_layout = plgpu.Layout.WGMMA
    tile = (ROWS, 2 * N)
    rows = plgpu.broadcasted_iota(jnp.int32, tile, 0, layout=wgmma_layout)
    columns = plgpu.broadcasted_iota(jnp.int32, tile, 1, layout=wgmma_layout)
    half, query = columns >= N, columns % N < g  # the right half; columns past g see nothing
    by_col = lambda v, shape=tile: lax.broadcast_in_dim(v, shape, [1])

    def block(i, carry):
        acc, m, l = carry
        plgpu.barrier_wait(k_bar)

        def qk(acc_ref):
            for k in range(2):  # q_hi, q_lo
                plgpu.wgmma(acc_ref, k_smem, qd_smem.at[pl.ds(k * 2 * N, 2 * N)].T)
            return acc_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC(tile, jnp.float32))
        barrier()
        pl.when(i + 1 < total)(lambda: issue(i + 1, 0))
        in_sink = i < sink_blocks
        j = jnp.where(in_sink, i, i - sink_blocks) * ROWS + rows  # slot in its segment
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

        pv_out = pl.run_scoped(pv, plgpu.ACC((d, 2 * N), jnp.float32))
        barrier()
        pl.when(i + 1 < total)(lambda: issue(i + 1, 1))
        return acc * by_col(alpha, (d, 2 * N)) + pv_out, m_new, l

    init = (plgpu.layout_cast(jnp.zeros((d, 2 * N), jnp.float32), wgmma_layout),
            plgpu.layout_cast(jnp.full((2 * N,), -jnp.inf, jnp.float32), wgmma_layout.reduce(0)),
            plgpu.layout_cast(jnp.zeros((2 * N,), jnp.float32), wgmma_layout.reduce(0)))
    acc, m, l = lax.fori_loop(0, total, block, init)
    seen = l > 0
    acc = acc / by_col(jnp.where(seen, l, 1.0), (d, 2 * N))  # both halves share l
    o_smem[...] = acc[:, :N] + acc[:, N:]
    lse16_smem[...] = jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), -jnp.inf)


def _kernel(n_ref, table_ref, q_ref, qcol_ref, qd_ref, ck_ref, cv_ref, lok_ref, sck_ref, lov_ref, scv_ref,
            sk_ref, sv_ref, rk_ref, rv_ref, o_ref, lse_ref, *, codes, q_smem, qcol_smem, meta_smem, w_smem,
            o_smem, lse_smem, red_smem, q_bar, tile_bars, dense_bars, stage_k=None, stage_v=None,
            line: WorkLine | LiveLine, hist_tokens: int, head_dim: int, packed: int, buffers: int,
            sink: int, window: int, g: int, kv_heads: int, warpgroups: int, interpret: bool,
            pages: tuple[int, int, int] | None = None):
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
    n_tiles = TPB // packed  # score tiles per step; tile t holds slices t * packed + j
    tile = (ROWS, N)
    wgmma_layout = plgpu.Layout.WGMMA
    row = wgmma_layout.reduce(1)  # one value per token
    by_col = lambda v, shape=tile: lax.broadcast_in_dim(v, shape, [1])
    by_row = lambda v: lax.broadcast_in_dim(v, tile, [0])
    row_ids = plgpu.broadcasted_iota(jnp.int32, tile, 0, layout=wgmma_layout)
    col_block = plgpu.broadcasted_iota(jnp.int32, tile, 1, layout=wgmma_layout) // (N // packed)
    codes_layout = None if interpret else plgpu.Layout.WGMMA_8BIT
    reduce_rows = functools.partial(helpers.reduce_rows, scratch=red_smem.at[pl.ds(0, _REDUCTION_SCRATCH)],
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
        """Scratch of array k of step i's `max_rows` (0: the w bound, 1: the scores), by step
        parity: its next writer, step i + 2, runs after every warp passed step i + 1's barriers."""
        return red_smem.at[pl.ds(_REDUCTION_SCRATCH + (lax.rem(i, 2) * 2 + k) * _MAX_SCRATCH, _MAX_SCRATCH)]

    def unscale(shape, t):
        """f32 `shape` (WGMMA layout, 8 columns): column block j holds 1 / SLICE_SCALE of slice
        t * packed + j, the factor its scaled codes (`mgpu_helpers.slice_codes`) came times."""
        blocks = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=wgmma_layout) // (N // packed)
        factor = jnp.full(shape, 1.0 / SLICE_SCALE[t * packed], jnp.float32)
        for j in range(1, packed):
            factor = jnp.where(blocks == j, 1.0 / SLICE_SCALE[t * packed + j], factor)
        return factor

    wgmma_tile = lambda shape: plgpu.layout_cast(jnp.zeros(shape, jnp.float32), wgmma_layout)
    helpers.store_weights(w_smem, (wgmma_tile(tile).astype(jnp.int32),), cols=N // packed, zero=True,
                   interpret=interpret)  # the zero columns of every V-product B operand

    def history(b, h, t_begin, t_end, part):
        """History tiles [t_begin, t_end) of pair (b, h) -> partial `part`."""
        n_hist = jnp.clip(n_ref[b] - sink - window, 0, hist_tokens)  # history tokens of this row (n_ref: lengths)
        valid_rows = (n_hist + TPB - 1) // TPB
        r_begin = t_begin * ROWS
        r_end = jnp.minimum(t_end * ROWS, valid_rows)
        steps = (jnp.maximum(r_end - r_begin, 0) + ROWS - 1) // ROWS

        def by_block(vectors):
            """[64] per slice of a tile -> [64, 8]: column block j takes the vector of slice j."""
            out = by_row(vectors[0])
            for j in range(1, len(vectors)):
                out = jnp.where(col_block == j, by_row(vectors[j]), out)
            return out

        def issue(i, slot):
            """TMA of step i's K codes [64, D], V codes [D, 64] and 4 metadata tiles into `slot`
            (whole tiles: a piece is whole tiles of the [64 x tiles]-row arrays; paged, row r0
            of row b is row r0 % R of page block_table[b, r0 // R], R a multiple of 64)."""
            r0 = r_begin + i * ROWS
            at, rr = b, r0
            if pages is not None:
                block_at, per_seq, page_rows = pages
                j = r0 // page_rows
                at, rr = jnp.maximum(table_ref[block_at + b * per_seq + j], 0), r0 - j * page_rows
            sources = [ck_ref.at[at, h, pl.ds(rr, ROWS)], cv_ref.at[at, h, :, pl.ds(rr, ROWS)]]
            sources += [ref.at[at, h, :, pl.ds(rr, ROWS)] for ref in (lok_ref, sck_ref, lov_ref, scv_ref)]
            targets = [ck_smem.at[slot], cv_smem.at[slot]] + [meta_smem.at[slot, j] for j in range(4)]
            for src, dst in zip(sources, targets):
                plgpu.copy_gmem_to_smem(src, dst, tile_bar(slot))  # one arrival per copy

        for j in range(buffers - 1):  # the first buffers - 1 steps are in flight before step 0
            pl.when(j < steps)(functools.partial(issue, j, j))
        plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem, q_bar)  # q_hi, q_lo (with the first tiles)
        plgpu.copy_gmem_to_smem(qcol_ref.at[b, h], qcol_smem, q_bar)  # q_step, Σq tiles
        plgpu.barrier_wait(q_bar)
        # Per column ([8]: 2 registers a thread); q_step / SLICE_SCALE as the K codes come scaled.
        q_steps = [helpers.load_columns(qcol_smem.at[0, 0], SLICE_SCALE[t * packed:(t + 1) * packed],
                                 interpret=interpret) for t in range(n_tiles)]
        q_sum = helpers.load_columns(qcol_smem.at[1, 0], (1,), interpret=interpret)

        def a_operand(codes, s, stage, scaled=False):
            """Slice s of a packed code tile as an MMA A operand: registers when compiled; staged
            in shared memory when interpreted (the GPU interpreter takes no register operands)."""
            x = helpers.slice_codes(codes, s, scaled=scaled, interpret=interpret)
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
            r0 = r_begin + i * ROWS
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
                    meta = [helpers.load_metadata(meta_smem.at[slot], t, packed, tile) for t in range(n_tiles)]
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
                accs, _ = helpers.accumulate(qk, [(ROWS, 2 * N)] * n_tiles, interpret=interpret)
                packed_v, meta, w_max = load_rest()
            with jax.named_scope("softmax"):
                scores = []
                for t in range(n_tiles):
                    lo_k, scale_k = meta[t][0], meta[t][1]
                    raw = (accs[t][:, :N] * int(_Q_LO) + accs[t][:, N:]).astype(jnp.float32)
                    sc = scale_k * (by_col(q_steps[t]) * raw) + lo_k * by_col(q_sum)
                    if last:
                        token = TPB * (r0 + row_ids) + t * packed + col_block
                        sc = jnp.where(token < n_hist, sc, -jnp.inf)
                    scores.append(sc)
                # The scores' and the w bound's maxima over tokens behind one barrier.
                s_max, w_bound = helpers.max_rows((functools.reduce(jnp.maximum, scores), w_max),
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
                helpers.store_weights(w_smem, w_tiles, cols=N // packed, interpret=interpret)
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
                for s in range(TPB):
                    plgpu.wgmma(acc_refs[0], a_operand(packed_v, s, stage_v, scaled=packed > 1), w_smem.at[s].T)
                return partial_sums(l_part, lo_part)

            with jax.named_scope("pv"):
                (pv_acc,), sums = helpers.accumulate(pv, [(head_dim, 2 * N)], (l_part, lo_part), interpret=interpret)
            pv_raw = (pv_acc[:, :N] * int(_W_LO) + pv_acc[:, N:]).astype(jnp.float32)
            acc = acc * by_col(alpha, (head_dim, N)) + pv_raw * by_col(w_step, (head_dim, N))
            return (acc, m_new, *sums)

        init = (wgmma_tile((head_dim, N)),
                plgpu.layout_cast(jnp.full((N,), -jnp.inf, jnp.float32), wgmma_layout.reduce(0)),
                wgmma_tile(tile), wgmma_tile(tile))
        carry = lax.fori_loop(0, steps - 1, functools.partial(step, last=False), init)
        acc, m, l_part, lo_part = lax.fori_loop(jnp.maximum(steps - 1, 0), steps,
                                                functools.partial(step, last=True), carry)
        l, lo_acc = reduce_rows(l_part, "sum"), reduce_rows(lo_part, "sum")
        safe_l = jnp.where(l > 0, l, 1.0)
        if packed > 1:  # column block j's V codes came times SLICE_SCALE[j] (its slices j + P t)
            acc = acc * unscale((head_dim, N), 0)
        o_smem[...] = (acc + by_col(lo_acc, (head_dim, N))) / by_col(safe_l, (head_dim, N))
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
               reduce_rows=reduce_rows, barrier=functools.partial(helpers.warpgroup_barrier, interpret=interpret),
               g=g, sink=sink, window=window, **dense_smem)
        plgpu.commit_smem()

        @pl.when(writes)
        def _():
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, h, part])
            plgpu.copy_smem_to_gmem(dense_smem["lse16_smem"].at[pl.ds(0, N)], lse_ref.at[b, h, part])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # o_smem free for the next piece

    def piece(i):
        """This program's i-th pair: its sink and ring where their units are this program's,
        then its history tiles here (both none where the units lie elsewhere)."""
        pair, owns_dense, t_begin, t_end = line.piece(u0, u1, i, jnp)
        b, h = pair // kv_heads, pair % kv_heads
        pl.when(owns_dense)(lambda: dense(b, h, table_ref[counts_at + pair] - 1))
        pl.when(t_end > t_begin)(lambda: history(b, h, t_begin, t_end, program - table_ref[first_at + pair]))

    # Unrolled: a loop over the pieces would keep the pieces' state in a loop carry, slower
    # even where every program has one piece.
    piece(0)
    pl.when(line.pieces(u0, u1) > 1)(functools.partial(piece, 1))


def history_kernel(line: WorkLine | LiveLine, *, batch: int, kv_heads: int, head_dim: int, g: int, packed: int,
                   hist_rows: int, warpgroups: int, buffers: int, sink: int, window: int, interpret: bool,
                   pages: tuple[int, int, int] | None = None):
    """The kernel for `line` -> fn(lengths int32 [B], table int32 (`line.table(...)`), q_blocks int8
    [B, Hkv, P, 16, D], qcol f32 [B, Hkv, 2, 64, 8], q_dense bf16 [B, Hkv, 32, D] (`decode_start`'s
    outputs), codes_k uint8 [B, Hkv, R, D], codes_v uint8 [B, Hkv, D, R] (R >= 64 rows, whole
    tiles), lo_k, scale_k, lo_v, scale_v bf16 [B, Hkv, 4, R], the bf16 segments (sink K, sink V,
    ring K, ring V: [B, Hkv, 64 k, D]; the ring stands in for an empty sink)) -> (o_t f32
    [B, Hkv, S, D, 8], lse2 f32 [B, Hkv, S, 8]): each pair's partials (its history pieces in
    order, then its sink and ring), o^T normalised and its lse in base 2. hist_rows: the
    packed rows the cache holds (the history's length in rows, before any padding). pages: a
    paged history (`oscar_jax.paged`): (block_at, pages_per_seq, R) with the block table
    flattened into `table` from block_at, the code and metadata arrays [P, Hkv, ...] pools of
    pages of R rows (a multiple of 64), hist_rows = pages_per_seq * R."""
    b, hkv, d, wgs = batch, kv_heads, head_dim, warpgroups  # every buffer below is per warpgroup
    history_codes = (plgpu.SMEM((wgs, buffers, ROWS, d), jnp.uint8, transforms=int8_tiles(d)),
                     plgpu.SMEM((wgs, buffers, d, ROWS), jnp.uint8, transforms=int8_tiles(ROWS)))
    dense_tiles = (plgpu.SMEM((wgs, ROWS, d), jnp.bfloat16, transforms=bf16_tiles(d)),  # K block
                   plgpu.SMEM((wgs, ROWS, d), jnp.bfloat16, transforms=bf16_tiles(2 * N)),  # V block (p's swizzle)
                   plgpu.SMEM((wgs, ROWS, 2 * N), jnp.bfloat16, transforms=bf16_tiles(2 * N)),  # [p_hi | p_lo]
                   plgpu.SMEM((wgs, 4 * N, d), jnp.bfloat16, transforms=bf16_tiles(d)),  # [q_hi; q_lo]
                   plgpu.SMEM((wgs, 2 * N), jnp.float32))  # lse
    scratch = dict(
        # The history's loop, then the sink and ring. The union overlays the two groups as
        # wholes; a warpgroup's dense K / V lie over its own code buffers only because both
        # strides are 128 D bytes (2 buffers: `schedule` holds several warpgroups to that).
        codes=plgpu.RefUnion(history_codes, dense_tiles),
        q_smem=plgpu.SMEM((wgs, packed, 2 * N, d), jnp.int8, transforms=int8_tiles(d)),  # blocks x [hi; lo]
        qcol_smem=plgpu.SMEM((wgs, 2, ROWS, N), jnp.float32),
        meta_smem=plgpu.SMEM((wgs, buffers, 4, TPB, ROWS), jnp.bfloat16),
        w_smem=plgpu.SMEM((wgs, TPB, 2 * N, ROWS), jnp.int8, transforms=int8_tiles(ROWS)),
        o_smem=plgpu.SMEM((wgs, d, N), jnp.float32),
        lse_smem=plgpu.SMEM((wgs, N), jnp.float32),
        red_smem=plgpu.SMEM((wgs, _REDUCTION_SCRATCH + 4 * _MAX_SCRATCH), jnp.float32),
        q_bar=plgpu.Barrier(num_arrivals=2, num_barriers=wgs),
        tile_bars=plgpu.Barrier(num_arrivals=_COPIES, num_barriers=wgs * buffers),
        dense_bars=plgpu.Barrier(num_arrivals=1, num_barriers=3 * wgs))  # q; K; V
    if interpret:  # A operands staged in shared memory
        scratch["stage_k"] = plgpu.SMEM((wgs, TPB, ROWS, d), jnp.int8, transforms=int8_tiles(d))
        scratch["stage_v"] = plgpu.SMEM((wgs, TPB, d, ROWS), jnp.int8, transforms=int8_tiles(ROWS))
    return plgpu.kernel(
        functools.partial(_kernel, line=line, hist_tokens=hist_rows * TPB, head_dim=d,
                          packed=packed, buffers=buffers, sink=sink, window=window, g=g, kv_heads=hkv,
                          warpgroups=wgs, interpret=interpret, pages=pages),
        out_type=[jax.ShapeDtypeStruct((b, hkv, line.max_partials, d, N), jnp.float32),
                  jax.ShapeDtypeStruct((b, hkv, line.max_partials, N), jnp.float32)],
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
