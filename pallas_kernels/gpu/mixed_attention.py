"""Fused attention of C new queries over the mixed OSCAR cache (docs/method.md, "Attention
over the mixed cache" and "Kernel arithmetic").

Pallas kernel with Triton lowering (GPU); `interpret=True` runs it on CPU.

One program per (batch row b, KV head h, query block, split). Splits
0..S-1 cover the packed history along the sequence (flash-decoding); split S
covers the bf16 sink and recent ring. Every program returns a normalised
partial output and its log-sum-exp; `merge_splits` combines them exactly in
XLA. All g query heads and C queries of a KV head are the rows of one query
block, so each packed code byte is read once per query block.

A packed byte holds tpb = 4 tokens (positions 4r .. 4r+3) of one channel (K codes
[rows, D], V codes channel-major [D, rows], `layout.py`), so
every query row is expanded into tpb rows: row s * (g * C) + i attends to the
tokens of slice s only (positions = s mod tpb, in the history and in the bf16
segments) and is one more partial softmax for the merge. A step's tpb MMAs
(one per slice) then fill one [rows, tokens] score tile in which every row is
a real query (decode, g = 4: 16 rows, no padding), instead of tpb tiles padded
from g to 16 rows; the elementwise softmax work per token drops by tpb.

History arithmetic never materialises dequantised keys or values:
  q·k̂ = scale·(q·level[code]) + lo·Σq          (per group of G channels)
  Σ p·v̂ = (p∘scale)·level[codes] + Σ p·lo
Codes become bf16 operands with one OR: the 16-bit pattern 0x4300 | code is
the bf16 number 128 + code, so the offset 128·Σq (and 128·Σ p∘scale) is
subtracted on the small score / row-sum tiles. Non-uniform codebooks
(Lloyd-Max) map codes to integer multiples of their levels instead (exact in
bf16), with the multiplier folded into scale. Programs stop at each row's own
history length, so short sequences of a ragged batch skip the blocks past it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from oscar_jax.pallas_kernels import layout

_BF16_128 = 0x4300  # bf16 bit pattern of 128.0; OR-ing a code < 128 into it gives 128 + code
_CODE_OFFSET = 128.0


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiling of the mixed-attention kernel.

    block_rows: packed history rows per inner step (tokens_per_byte * block_rows tokens).
    block_dense: bf16 sink / recent tokens per inner step.
    block_q: most expanded query rows (tpb * g * C, padded to a power of two >= 16) per program.
    num_splits: history splits per (row, KV head); None: enough splits that the
      grid has about `target_programs` programs.
    inline_asm: unpack 2-bit uniform codes with one PTX block per 4 bytes (compiled
      GPU runs only; interpret mode always uses the jnp bit operations).
    """

    block_rows: int = 64
    block_dense: int = 64
    block_q: int = 64
    num_splits: int | None = None
    target_programs: int = 8192
    num_warps: int = 4
    num_stages: int = 2
    inline_asm: bool = True

    @classmethod
    def default(cls, head_dim: int, query_rows: int) -> "BlockSizes":
        """Per-shape defaults. query_rows: tpb * g * C expanded rows of one KV head.

        Decode (<= 16 rows) reads 128 packed rows (512 tokens) per step with a 3-stage
        pipeline at D = 128, and 64 rows, 2 stages at D = 64 and 256 (the faster settings
        in same-run A/Bs on Hopper, docs/gpu_kernels.md); extend takes 32-row query
        blocks and 32 packed rows, which keeps Triton's shared memory under the limit.
        """
        if query_rows <= 16:
            if head_dim == 128:
                return cls(block_rows=128, block_q=16, num_stages=3)
            return cls(block_rows=64, block_q=16)
        return cls(block_rows=32, block_q=32)

    def __post_init__(self):
        for name in ("block_rows", "block_dense", "block_q"):
            v = getattr(self, name)
            if not _is_pow2(v) or v < 16:
                raise ValueError(f"BlockSizes.{name}={v}: expected a power of two >= 16")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"BlockSizes.num_splits={self.num_splits}: expected None or >= 1")


def level_encoding(levels: tuple[float, ...]) -> tuple[int, float] | None:
    """(multiplier m, offset) such that m * level[k] are small integers exact in bf16.

    Uniform levels 0..L-1 use m = 1 and the 0x4300 | code trick (offset 128);
    others need an integer multiple (Lloyd-Max [0, 1.05, 1.95, 3] -> m = 20, offset 0).
    None when no multiplier up to 64 makes every level an integer <= 256.
    """
    if levels == tuple(float(i) for i in range(len(levels))) and len(levels) <= 128:
        return 1, _CODE_OFFSET
    for m in range(1, 65):
        scaled = [lv * m for lv in levels]
        if all(abs(x - round(x)) < 1e-6 and 0 <= round(x) <= 256 for x in scaled):
            return m, 0.0
    return None


# One PTX instance turns 4 packed bytes (4 channels x 4 tokens) into the bf16
# operands 128 + code of one token slice: shift the slice's bits down, let prmt
# spread bytes 0,1 (and 2,3) into the two 16-bit halves of a word, then one lop3
# ((x & 0x00030003) | 0x43004300) per word gives two bf16 values.
_UNPACK2_ASM = """{{
.reg .b32 t, a, b, z;
mov.b32 z, 0;
shr.u32 t, $2, {shift};
prmt.b32 a, t, z, 0x4140;
prmt.b32 b, t, z, 0x4342;
lop3.b32 $0, a, 0x00030003, 0x43004300, 0xea;
lop3.b32 $1, b, 0x00030003, 0x43004300, 0xea;
}}"""


def _uniform2_slices(codes_u8: jax.Array) -> list[jax.Array]:
    """GPU fast path, 2-bit uniform codes: a uint8 tile -> 4 bf16 slices of 128 + code (same shape)."""
    out = jax.ShapeDtypeStruct(codes_u8.shape, jnp.bfloat16)
    return [plgpu.elementwise_inline_asm(_UNPACK2_ASM.format(shift=2 * s), args=[codes_u8],
                                         constraints="=r,=r,r", pack=4, result_shape_dtypes=[out])[0]
            for s in range(4)]


def _slices(codes_u8: jax.Array, bits: int, levels, mult: int, fast: bool) -> list[jax.Array]:
    """A uint8 tile of packed codes (K [R, G], V [G, R]) -> tpb bf16 slices of its shape
    holding offset + mult * level[code]."""
    if fast and bits == 2 and mult == 1:
        return _uniform2_slices(codes_u8)
    codes = codes_u8.astype(jnp.uint16)
    return [_level_values(codes, bits * s, bits, levels, mult) for s in range(8 // bits)]


def _level_values(codes: jax.Array, shift: int, bits: int, levels, mult: int) -> jax.Array:
    """codes uint16 (packed bytes) -> bf16 of the same shape: offset + mult * level of slice `shift`."""
    code = (codes >> shift) & ((1 << bits) - 1)
    if mult == 1 and levels == tuple(float(i) for i in range(len(levels))):
        return lax.bitcast_convert_type(code | _BF16_128, jnp.bfloat16)
    code = code.astype(jnp.int32)
    val = jnp.full(code.shape, round(levels[0] * mult), jnp.int32)
    for k in range(1, len(levels)):
        step = round(levels[k] * mult) - round(levels[k - 1] * mult)
        val = val + jnp.where(code >= k, step, 0)
    return val.astype(jnp.float32).astype(jnp.bfloat16)


def f32_dot(a, b, contract_b: int, exact_f32: bool):
    """a [M, K] bf16 times b ([N, K] if contract_b == 1 else
    [K, N]) bf16 -> f32 [M, N].

    exact_f32 widens the (bf16-valued) operands first: XLA:CPU, which runs the
    kernel in interpret mode, may accumulate large bf16 dots in bf16, which the
    128 + code offset cannot survive; the GPU MMA accumulates in f32.
    """
    if exact_f32:
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())), preferred_element_type=jnp.float32,
                           precision=lax.Precision.HIGHEST if exact_f32 else None)


def online_update(state, scores, values_fn):
    """One online-softmax step. scores: f32 [BM, N] (masked with -inf); values_fn(p)
    -> list (per group) of f32 [BM, G] to add to the accumulators."""
    m, l, acc = state
    m_new = jnp.maximum(m, jnp.max(scores, axis=1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m - m_use)
    p = jnp.exp(scores - m_use[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    acc = tuple(a * alpha[:, None] + x for a, x in zip(acc, values_fn(p)))
    return m_new, l, acc


def _kernel(lengths_ref, table_ref, q_ref, sink_k_ref, sink_v_ref, codes_k_ref, codes_v_ref,
            lo_k_ref, scale_k_ref, lo_v_ref, scale_v_ref, recent_k_ref, recent_v_ref,
            o_ref, lse_ref, *, g, c, sink, window, bits, levels, mult, offset, num_groups,
            hist_rows, split_rows, num_hist_splits, pages, blocks: BlockSizes, interpret: bool):
    b, h, mb, split = (pl.program_id(i) for i in range(4))

    def locate(r0):
        """(first index, row) of history row r0 of this program's sequence: (b, r0), or through
        the block table when paged (a step's rows never straddle a page)."""
        if pages is None:
            return b, r0
        per_seq, page_rows = pages
        j = r0 // page_rows
        return jnp.maximum(table_ref[b * per_seq + j], 0), r0 - j * page_rows

    bm, d = q_ref.shape
    gs = d // num_groups
    tpb = 8 // bits
    n = lengths_ref[b]
    rows = mb * bm + jnp.arange(bm)  # expanded row e = slice * (g * C) + query row
    row_slice = jnp.minimum(rows // (g * c), tpb - 1)
    q_pos = n - c + (rows % (g * c)) // g  # [BM] position of each row's query

    def init():
        return (jnp.full((bm,), -jnp.inf, jnp.float32), jnp.zeros((bm,), jnp.float32),
                tuple(jnp.zeros((bm, gs), jnp.float32) for _ in range(num_groups)))

    def finish(state):
        m, l, acc = state
        safe_l = jnp.where(l > 0, l, 1.0)
        for gi, a in enumerate(acc):
            o_ref[:, pl.ds(gi * gs, gs)] = a / safe_l[:, None]
        lse_ref[...] = jnp.where(l > 0, m + jnp.log(safe_l), -jnp.inf)

    @pl.when(split < num_hist_splits)
    def _history():
        n_hist = jnp.clip(n - window - sink, 0, hist_rows * tpb)
        valid_rows = (n_hist + tpb - 1) // tpb
        r_begin = split * split_rows
        r_end = jnp.minimum(r_begin + split_rows, valid_rows)
        steps = jnp.maximum(r_end - r_begin + blocks.block_rows - 1, 0) // blocks.block_rows
        br = blocks.block_rows
        # Per group: query slice (bf16 MMA operand), its exact sum and the sum of its bf16 copy.
        qg = [q_ref[:, pl.ds(gi * gs, gs)] for gi in range(num_groups)]
        qg_bf = [x.astype(jnp.bfloat16) for x in qg]
        q_sum = [jnp.sum(x, axis=1) for x in qg]
        q_bf_sum = [jnp.sum(x.astype(jnp.float32), axis=1) for x in qg_bf]
        slice_of = jnp.broadcast_to(row_slice[:, None], (bm, br))
        out_slice = jnp.broadcast_to(row_slice[:, None], (bm, gs))

        def load_codes(i):
            """Packed code tiles of step i, per group: K uint8 [BR, G], V uint8 [G, BR]."""
            r0 = r_begin + i * br
            ok = r0 + jnp.arange(br) < r_end
            at, rr = locate(r0)
            packed_k = tuple(plgpu.load(codes_k_ref.at[at, h, pl.ds(rr, br), pl.ds(gi * gs, gs)],
                                        mask=ok[:, None], other=0) for gi in range(num_groups))
            packed_v = tuple(plgpu.load(codes_v_ref.at[at, h, pl.ds(gi * gs, gs), pl.ds(rr, br)],
                                        mask=ok[None, :], other=0) for gi in range(num_groups))
            return packed_k, packed_v

        def step(i, state):
            packed_k, packed_v = load_codes(i)
            r0 = r_begin + i * br
            row_ids = r0 + jnp.arange(br)
            row_ok = row_ids < r_end
            cols = jnp.broadcast_to(row_ids[None, :], (bm, br))
            at, rr = locate(r0)

            def meta(ref, gi):
                """f32 [BM, BR]: the metadata of token tpb * r + (the row's slice), from one
                contiguous [BR] load per slice (faster than a [BM, BR] gather)."""
                tile = None
                for s in range(tpb):
                    v = plgpu.load(ref.at[at, h, jnp.int32(gi), jnp.int32(s), pl.ds(rr, br)],
                                   mask=row_ok, other=0).astype(jnp.float32)[None, :]
                    tile = jnp.broadcast_to(v, (bm, br)) if tile is None else jnp.where(slice_of == s, v, tile)
                return tile

            def codes(packed, gi):  # tpb bf16 slices of the tile's shape
                return _slices(packed[gi], bits, levels, mult, blocks.inline_asm and not interpret)

            scores = None
            for gi in range(num_groups):
                ck = codes(packed_k, gi)
                qk = None
                for s in range(tpb):  # each row keeps the product with its own slice's codes
                    d_s = f32_dot(qg_bf[gi], ck[s], 1, interpret)
                    qk = d_s if qk is None else jnp.where(slice_of == s, d_s, qk)
                raw = qk - offset * q_bf_sum[gi][:, None]
                part = meta(scale_k_ref, gi) * (1.0 / mult) * raw + meta(lo_k_ref, gi) * q_sum[gi][:, None]
                scores = part if scores is None else scores + part
            scores = jnp.where(cols * tpb + slice_of < n_hist, scores, -jnp.inf)

            def values(p):
                out = []
                for gi in range(num_groups):
                    cv = codes(packed_v, gi)
                    pv = (p * meta(scale_v_ref, gi) * (1.0 / mult)).astype(jnp.bfloat16)
                    acc = jnp.sum(p * meta(lo_v_ref, gi) - offset * pv.astype(jnp.float32), axis=1)[:, None]
                    for s in range(tpb):  # rows keep the product with their own slice's codes
                        acc = acc + jnp.where(out_slice == s, f32_dot(pv, cv[s], 1, interpret), 0.0)
                    out.append(acc)
                return out

            return online_update(state, scores, values)

        finish(lax.fori_loop(0, steps, step, init()))

    @pl.when(split == num_hist_splits)
    def _dense():
        bd = blocks.block_dense
        q_bf = q_ref[...].astype(jnp.bfloat16)

        def segment(k_ref, v_ref, size, count, positions, state):
            def step(i, state):
                j = i * bd + jnp.arange(bd)
                row_ok = j < size
                k = plgpu.load(k_ref.at[b, h, pl.ds(i * bd, bd), :], mask=row_ok[:, None], other=0)
                pos = positions(j)
                vis = row_ok & (pos >= 0) & (pos < n)
                vis = vis[None, :] & (pos[None, :] <= q_pos[:, None]) & (j[None, :] % tpb == row_slice[:, None])
                s = jnp.where(vis, f32_dot(q_bf, k, 1, interpret), -jnp.inf)

                def values(p):
                    p = p.astype(jnp.bfloat16)
                    return [f32_dot(p, plgpu.load(v_ref.at[b, h, pl.ds(i * bd, bd), pl.ds(gi * gs, gs)],
                                               mask=row_ok[:, None], other=0), 0, interpret)
                            for gi in range(num_groups)]

                return online_update(state, s, values)

            return lax.fori_loop(0, (count + bd - 1) // bd, step, state)

        state = init()
        if sink:
            state = segment(sink_k_ref, sink_v_ref, sink, jnp.minimum(n, sink), lambda j: j, state)
        state = segment(recent_k_ref, recent_v_ref, window, jnp.clip(n - sink, 0, window),
                        lambda j: layout.ring_position(n, j, sink, window), state)
        finish(state)


def merge_splits(o_part: jax.Array, lse_part: jax.Array) -> tuple[jax.Array, jax.Array]:
    """o_part f32 [..., S, M, D], lse_part f32 [..., S, M] -> (o [..., M, D], lse [..., M])."""
    lse = jax.nn.logsumexp(lse_part, axis=-2)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    w = jnp.exp(lse_part - safe[..., None, :])
    return jnp.sum(w[..., None] * o_part, axis=-3), lse


def _default_splits(programs: int, hist_rows: int, blocks: BlockSizes) -> int:
    most = max(1, -(-hist_rows // blocks.block_rows))
    return max(1, min(most, -(-blocks.target_programs // max(programs, 1))))


def mixed_attention(q_rot, cache: layout.CacheArrays, *, sink: int, window: int,
                    bits: int, levels: tuple[float, ...], softmax_scale: float,
                    interpret: bool = False, block_sizes: BlockSizes | None = None, block_table=None,
                    history_offset=None):
    """Attention of C new queries over one layer's mixed cache (plain arrays, rotated basis).

    q_rot: f32 [B, C, Hq, D] (already multiplied by R_K); cache: `layout.CacheArrays` (metadata
    bf16 or f32), lengths counting the C queries as the newest tokens. Returns (o_rot f32
    [B, C, Hq, D] in the R_V basis, lse f32 [B, C, Hq]).
    block_table: int32 [B, n] for a paged history (`oscar_jax.paged`): the history arrays are
    then a pool of P pages ([P, Hkv, R, D] etc., R rows a page, a multiple of the step's
    `block_rows`, which is lowered to R where larger) and history row r of sequence b lies in
    page block_table[b, r // R] (read where a tile is fetched; the loops are unchanged).
    history_offset: int32 [] (may be traced) for a history slice (sequence parallelism): the
    history arrays hold history indices [history_offset, history_offset + T_hist) of a longer
    history; the result is then the slice's partial, the sink and ring attended only where
    history_offset == 0. The history programs see lengths - history_offset (so they stop at
    the slice's own tokens); the sink and ring's program, whose partial counts only at offset 0
    (where the lengths are the true ones), is dropped from the merge elsewhere.
    """
    (sink_k, sink_v, hist_codes_k, hist_codes_v, hist_lo_k, hist_scale_k, hist_lo_v, hist_scale_v,
     recent_k, recent_v, lengths) = cache
    b, c, hq, d = q_rot.shape
    hkv = sink_k.shape[1]
    tpb = 8 // bits
    num_groups = hist_lo_k.shape[2]
    page_rows = None if block_table is None else hist_codes_k.shape[2]
    if page_rows is not None:
        if block_table.ndim != 2 or block_table.shape[0] != b or not _is_pow2(page_rows) or page_rows < 16:
            raise ValueError(f"block_table.shape={block_table.shape}, page rows {page_rows}: expected [B={b}, n] "
                             "and pages of a power of two >= 16 packed rows")
        hist_lead, hist_rows = hist_codes_k.shape[0], block_table.shape[1] * page_rows
    else:
        hist_lead, hist_rows = b, hist_codes_k.shape[2]
    hist_shape = hist_rows if page_rows is None else page_rows
    if hq % hkv:
        raise ValueError(f"q_rot.shape={q_rot.shape}: Hq={hq} must be a multiple of Hkv={hkv}")
    if sink_k.shape != (b, hkv, sink, d) or recent_k.shape != (b, hkv, window, d):
        raise ValueError(f"sink_k.shape={sink_k.shape}, recent_k.shape={recent_k.shape}: expected "
                         f"[B={b}, Hkv={hkv}, S0={sink}, D={d}] and [B, Hkv, W={window}, D]")
    if hist_codes_k.shape != (hist_lead, hkv, hist_shape, d) or \
            hist_lo_k.shape != (hist_lead, hkv, num_groups, tpb, hist_shape):
        raise ValueError(f"hist_codes_k.shape={hist_codes_k.shape}, hist_lo_k.shape={hist_lo_k.shape}: "
                         f"expected [B, Hkv, T_hist/{tpb}, D={d}] and [B, Hkv, D/G, {tpb}, T_hist/{tpb}]")
    if hist_codes_v.shape != (hist_lead, hkv, d, hist_shape):
        raise ValueError(f"hist_codes_v.shape={hist_codes_v.shape}: expected channel-major "
                         f"[B={b}, Hkv={hkv}, D={d}, T_hist/{tpb}={hist_rows}]")
    if lengths.shape != (b,):
        raise ValueError(f"lengths.shape={lengths.shape}: expected [B={b}]")
    if history_offset is not None and page_rows is not None:
        raise ValueError("history_offset with a block_table: a paged history is attended whole")
    enc = level_encoding(tuple(levels))
    if enc is None:
        raise ValueError(f"levels={levels}: no small integer multiple is exact in bf16")
    if d % num_groups or d // num_groups < 16:
        raise ValueError(f"group size D/G={d}/{num_groups}: the kernel needs groups of >= 16 channels")
    g = hq // hkv
    m = g * c
    me = tpb * m  # expanded rows: one per (token slice, query row)
    blocks = block_sizes or BlockSizes.default(d, me)
    if page_rows is not None and blocks.block_rows > page_rows:
        blocks = dataclasses.replace(blocks, block_rows=page_rows)
    mp = max(16, 1 << (me - 1).bit_length())
    bm = min(mp, blocks.block_q)
    mp = -(-mp // bm) * bm
    n_mblocks = mp // bm
    num_splits = blocks.num_splits or _default_splits(b * hkv * n_mblocks, hist_rows, blocks)
    split_rows = -(-max(hist_rows, 1) // num_splits)
    split_rows = -(-split_rows // blocks.block_rows) * blocks.block_rows
    num_hist_splits = -(-hist_rows // split_rows) if hist_rows else 0

    # Query rows of KV head h: row c * g + i is query c of head h * g + i; expanded row
    # s * m + row attends to the tokens of slice s (positions = s mod tpb).
    q = (q_rot.astype(jnp.float32) * softmax_scale).reshape(b, c, hkv, g, d)
    q = jnp.moveaxis(q, 1, 2).reshape(b, hkv, m, d)
    q = jnp.pad(jnp.concatenate([q] * tpb, axis=2), ((0, 0), (0, 0), (0, mp - me), (0, 0)))

    kernel = functools.partial(
        _kernel, g=g, c=c, sink=sink, window=window, bits=bits, levels=tuple(levels),
        mult=enc[0], offset=enc[1], num_groups=num_groups, hist_rows=hist_rows,
        split_rows=split_rows, num_hist_splits=num_hist_splits, blocks=blocks,
        pages=None if page_rows is None else (block_table.shape[1], page_rows),
        interpret=interpret)
    full = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)
    splits = num_hist_splits + 1
    # The block table flat, padded to a power of two (the lengths of Triton's blocks).
    table = jnp.zeros((1,), jnp.int32) if block_table is None else block_table.reshape(-1).astype(jnp.int32)
    table = jnp.pad(table, (0, (1 << (table.size - 1).bit_length()) - table.size))
    lengths = lengths.astype(jnp.int32)
    if history_offset is not None:
        lengths = jnp.maximum(lengths - history_offset, 0)
    arrays = (lengths, table, q, sink_k, sink_v, hist_codes_k, hist_codes_v,
              hist_lo_k, hist_scale_k, hist_lo_v, hist_scale_v, recent_k, recent_v)
    in_specs = [full(arrays[0]), full(table), pl.BlockSpec((None, None, bm, d), lambda i, j, k, s: (i, j, k, 0))]
    in_specs += [full(x) for x in arrays[3:]]
    o_part, lse_part = pl.pallas_call(
        kernel,
        grid=(b, hkv, n_mblocks, splits),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, None, bm, d), lambda i, j, k, s: (i, j, s, k, 0)),
                   pl.BlockSpec((None, None, None, bm), lambda i, j, k, s: (i, j, s, k))],
        out_shape=[jax.ShapeDtypeStruct((b, hkv, splits, mp, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, splits, mp), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps,
                                             num_stages=blocks.num_stages),
        interpret=interpret,
        name="oscar_mixed_attention",
    )(*arrays)
    if history_offset is not None:  # the sink and ring's partial (the last split) counts at offset 0 only
        lse_part = lse_part.at[:, :, -1].set(jnp.where(history_offset == 0, lse_part[:, :, -1], -jnp.inf))
    # Each (split, slice) pair is one partial softmax of query row `row`: merge them all.
    o, lse = merge_splits(o_part[..., :me, :].reshape(b, hkv, splits * tpb, m, d),
                          lse_part[..., :me].reshape(b, hkv, splits * tpb, m))
    o = jnp.moveaxis(o.reshape(b, hkv, c, g, d), 2, 1).reshape(b, c, hq, d)
    lse = jnp.moveaxis(lse.reshape(b, hkv, c, g), 2, 1).reshape(b, c, hq)
    return o, lse


def supports(spec) -> bool:
    """Cache configurations this kernel handles (a `CacheSpec`): 2-bit codes, G >= 16, D in
    {64, 128, 256}, a non-empty sink and history (its grid has no zero-size segments)."""
    d = spec.head_dim
    return (spec.quant.bits == 2 and 16 <= spec.group_size and d in (64, 128, 256)
            and spec.sink > 0 and spec.hist_capacity > 0
            and level_encoding(spec.quant.levels) is not None)
