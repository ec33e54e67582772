"""Mixed-cache attention on TPU (Pallas Mosaic): bf16 sink ++ packed INT-b history ++ bf16 ring.

One kernel instance per (batch row, KV head); the grid's last axis walks the
packed history in blocks of `AttentionConfig.hist_rows` byte rows (tpb tokens each).
The g*C query rows of a KV head (GQA heads x chunk) share every block read.
Online-softmax state (running max, denominator, output) lives in VMEM scratch:
step 0 initialises it and folds in the sink, every step folds in one history
block, the last step folds in the recent ring and writes (o, lse).

History scores use the integer trick (docs/method.md, "Kernel arithmetic"), per group of
G channels:
  q . x_hat = scale * (q . level[code]) + lo * sum(q)
so the MXU multiplies the queries by small integer levels and the per-token
scale/lo are applied to the [query rows, tokens] score tile; values likewise:
  sum_t p_t x_hat_t = (p * scale) @ level[codes] + sum_t p_t lo_t.
The V codes are channel-major ([D, rows] per block, `layout.py`), so the value
product contracts the lane (token) axis of both operands, like q @ k^T.
The packed codes and metadata are the only history bytes read from HBM; no
dequantised [T, D] tile is ever formed.

Verified in TPU interpret mode on CPU only (`pltpu.InterpretParams`); never
compiled for or run on TPU hardware here (see docs/tpu.md).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from oscar_jax.pallas_kernels import layout

NUM_LANES = 128
NUM_SUBLANES = 8
_HI = jax.lax.Precision.HIGHEST
_NT = (((1,), (1,)), ((), ()))  # contract the last dims: a [M, K] x b [N, K] -> [M, N]
_NN = (((1,), (0,)), ((), ()))


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Static kernel settings.

    hist_rows: packed byte rows of history per grid step (tpb tokens per row).

    A multiple of 128 (the metadata block puts these rows on lanes); a shorter
    history is one block, and a partial last block is masked. 2048 rows (8192
    tokens at 2 bits, ~0.6 MB of K+V codes and metadata at D = 128) keep the
    ~0.35 us per-step pipeline overhead below the DMA time on v5e/v6e while
    staying well inside the default scoped VMEM (docs/tpu.md; untuned).
    passes: bf16 MXU passes per matmul over the f32 queries / probabilities (the
    other operand, integer levels or the bf16 cache, is exact in bf16). Max error
    against the f32 reference on a test case with |o| <= 1.8, lse ~ 9: 3 passes
    2e-6 (like an f32 matmul), 2 passes 1e-5, 1 pass (queries rounded to bf16,
    as stock TPU attention kernels do) 4e-3.
    """

    hist_rows: int = 2048
    passes: int = 3

    def __post_init__(self):
        if self.passes not in (1, 2, 3):
            raise ValueError(f"AttentionConfig.passes={self.passes}: expected 1, 2 or 3")
        if self.hist_rows <= 0 or self.hist_rows % NUM_LANES:
            raise ValueError(f"AttentionConfig.hist_rows={self.hist_rows}: expected a positive "
                             f"multiple of {NUM_LANES}")


def interpret_params(interpret: bool | pltpu.InterpretParams) -> pltpu.InterpretParams | bool | None:
    """The adapter's `interpret=True` -> TPU interpret mode with out-of-bounds reads
    raising, race detection on, grid order along parallel axes randomised and 2 simulated
    cores (with one, programs run one after another and no race between them can show).
    Inside a program over several devices (`shard_map`, `oscar_jax.parallel`): Pallas's
    generic interpreter (True) instead, since the TPU one's per-device callbacks wait on
    each other there (with 2 cores they hang; with one, 8 devices take seconds a call)."""
    if isinstance(interpret, pltpu.InterpretParams):
        return interpret
    if interpret and jax.sharding.get_abstract_mesh().size > 1:
        return True
    if interpret:
        return pltpu.InterpretParams(detect_races=True, out_of_bounds_reads="raise", random_seed=0,
                                     num_cores_or_threads=2)
    return None


def _level_values(codes: jax.Array, levels: tuple[float, ...]) -> jax.Array:
    """int32 codes -> level[code]: bfloat16 (exact) for uniform levels 0..255, else float32."""
    if all(lv == i for i, lv in enumerate(levels)):
        return codes.astype(jnp.bfloat16)
    out = jnp.full(codes.shape, levels[0], jnp.float32)
    for i, lv in enumerate(levels[1:], start=1):
        out = jnp.where(codes == i, jnp.float32(lv), out)
    return out


def _bf16_pieces(a: jax.Array, passes: int) -> list[jax.Array]:
    """Split f32 a into `passes` bf16 terms summing to a within ~2**(-8 * passes) relative.

    Leading terms clear the low 16 bits with a mask (a convert round trip would be folded
    away by XLA's excess-precision rewrite in interpret mode); the last term is rounded.
    """
    pieces = []
    for _ in range(passes - 1):
        bits = jax.lax.bitcast_convert_type(a, jnp.uint32) & jnp.uint32(0xFFFF0000)
        head = jax.lax.bitcast_convert_type(bits, jnp.float32)
        pieces.append(head.astype(jnp.bfloat16))
        a = a - head
    return pieces + [a.astype(jnp.bfloat16)]


def _dot(a: jax.Array, b: jax.Array, dims, passes: int) -> jax.Array:
    """f32 a times b with f32 accumulation. A bf16 b holds exact values (integer levels,
    the bf16 cache), so the MXU runs `passes` bf16 passes over the pieces of a;
    a float32 b (Lloyd-Max levels) takes a HIGHEST-precision f32 matmul."""
    if b.dtype != jnp.bfloat16:
        return jax.lax.dot_general(a, b, dims, precision=_HI, preferred_element_type=jnp.float32)
    return sum(jax.lax.dot_general(x, b, dims, preferred_element_type=jnp.float32)
               for x in _bf16_pieces(a, passes))


def _kernel(lengths_ref, *refs, paged, split, sink, window, bits, levels, chunk, hist_rows, hist_tokens,
            n_groups, has_sink, has_hist, passes):
    """Refs per grid point (b, h, k): with `split` (a history slice) first_ref int32 [1] (SMEM:
    1 where this slice attends the sink and ring); the block table (SMEM, when paged: read by
    the index maps only, so block k is history block k of row b whichever page holds it);
    q_ref f32 [M, D] (scaled, rotated; row r is query c = r % chunk);
    sink_k/v bf16 [S0, D]; codes_k u8 [hist_rows, D]; codes_v u8 [D, hist_rows];
    lo_k, scale_k, lo_v, scale_v [n_groups, tpb, hist_rows]; recent_k/v bf16 [W, D];
    outputs o f32 [M, D], lse f32 [M, 128]; scratch m, l f32 [M, 128], acc f32 [M, D].
    """
    refs = list(refs)
    dense = refs.pop(0)[0] == 1 if split else True  # whether the sink and ring count here
    if paged:
        refs.pop(0)
    q_ref = refs.pop(0)
    sink_k_ref, sink_v_ref = (refs.pop(0), refs.pop(0)) if has_sink else (None, None)
    hist = [refs.pop(0) for _ in range(6)] if has_hist else None
    recent_k_ref, recent_v_ref, o_ref, lse_ref, m_ref, l_ref, acc_ref = refs

    b, k = pl.program_id(0), pl.program_id(2)
    n = lengths_ref[b]
    m_rows, d = q_ref.shape
    q = q_ref[...]
    row = jax.lax.broadcasted_iota(jnp.int32, (m_rows, 1), 0)
    q_pos = n - chunk + row % chunk  # [M, 1]

    def fold(s, pv):
        """Online-softmax update with scores s [M, N] (-inf = masked) and pv(p) -> [M, D]."""
        m_prev, l_prev = m_ref[:, :1], l_ref[:, :1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_safe)
        alpha = jnp.exp(m_prev - m_safe)
        l_ref[...] = jnp.broadcast_to(alpha * l_prev + jnp.sum(p, axis=-1, keepdims=True),
                                      l_ref.shape)
        m_ref[...] = jnp.broadcast_to(m_new, m_ref.shape)
        acc_ref[...] = alpha * acc_ref[...] + pv(p)

    def dense_segment(k_ref, v_ref, visible):
        s = jnp.where(visible, _dot(q, k_ref[...], _NT, passes), -jnp.inf)
        v = v_ref[...]
        fold(s, lambda p: _dot(p, v, _NN, passes))

    @pl.when(k == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        if has_sink:
            pos = jax.lax.broadcasted_iota(jnp.int32, (1, sink), 1)
            dense_segment(sink_k_ref, sink_v_ref, (pos < n) & (pos <= q_pos) & dense)

    if has_hist:
        codes_k_ref, codes_v_ref, lo_k_ref, scale_k_ref, lo_v_ref, scale_v_ref = hist
        tpb = 8 // bits
        n_hist = _history_tokens(n, sink, window, hist_tokens)

        @pl.when(k * hist_rows * tpb < n_hist)
        def _history():
            group = d // n_groups
            lane_group = jax.lax.broadcasted_iota(jnp.int32, (1, d), 1) // group
            group_mask = jnp.concatenate(
                [(lane_group == gi) for gi in range(n_groups)], axis=0)[:, None, :]  # [ng, 1, D]
            q_groups = jnp.where(group_mask, q[None], 0.0)  # [ng, M, D]
            q_sums = jnp.sum(q_groups, axis=-1)[:, :, None]  # [ng, M, 1]
            q_flat = q_groups.reshape(n_groups * m_rows, d)
            packed_k = codes_k_ref[...].astype(jnp.int32)
            packed_v = codes_v_ref[...].astype(jnp.int32)  # [D, rows]
            row_ids = k * hist_rows + jax.lax.broadcasted_iota(jnp.int32, (1, hist_rows), 1)
            mask = (1 << bits) - 1
            for s in range(tpb):
                valid = tpb * row_ids + s < n_hist  # [1, rows]; also masks a partial last block
                meta = lambda ref: jnp.where(valid, ref[:, s, :].astype(jnp.float32), 0.0)
                lo_k, scale_k, lo_v, scale_v = (meta(r) for r in
                                                (lo_k_ref, scale_k_ref, lo_v_ref, scale_v_ref))
                lvl_k = _level_values((packed_k >> (bits * s)) & mask, levels)  # [rows, D]
                raw = _dot(q_flat, lvl_k, _NT, passes).reshape(n_groups, m_rows, hist_rows)
                scores = jnp.sum(scale_k[:, None, :] * raw + lo_k[:, None, :] * q_sums, axis=0)
                scores = jnp.where(valid, scores, -jnp.inf)
                lvl_v = _level_values((packed_v >> (bits * s)) & mask, levels)  # [D, rows]
                lvl_v = jnp.where(valid, lvl_v, jnp.zeros((), lvl_v.dtype))

                def pv(p, lvl_v=lvl_v, lo_v=lo_v, scale_v=scale_v):
                    weighted = (p[None] * scale_v[:, None, :]).reshape(n_groups * m_rows, hist_rows)
                    out = _dot(weighted, lvl_v, _NT, passes).reshape(n_groups, m_rows, d)
                    lo_term = jnp.sum(p[None] * lo_v[:, None, :], axis=-1)[:, :, None]
                    return jnp.sum(jnp.where(group_mask, out + lo_term, 0.0), axis=0)

                fold(scores, pv)

    @pl.when(k == pl.num_programs(2) - 1)
    def _finish():
        slot = jax.lax.broadcasted_iota(jnp.int32, (1, window), 1)
        pos = n - 1 - jnp.remainder(n - 1 - sink - slot, window)  # position held by each slot
        held = (pos >= sink) & (pos >= n - window)
        dense_segment(recent_k_ref, recent_v_ref, held & (pos <= q_pos) & dense)
        l = l_ref[:, :1]
        o_ref[...] = acc_ref[...] / jnp.where(l > 0, l, 1.0)
        lse = jnp.where(l > 0, m_ref[:, :1] + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
        lse_ref[...] = jnp.broadcast_to(lse, lse_ref.shape)


def _history_tokens(n, sink: int, window: int, hist_tokens: int):
    """History tokens a row of n tokens holds in arrays of `hist_tokens` (a slice's lengths
    run past them)."""
    return jnp.clip(n - window - sink, 0, hist_tokens)


def _check(name, x, shape, dtype=None):
    if x.shape != tuple(shape) or (dtype is not None and x.dtype != dtype):
        want = f"{tuple(shape)}" + (f" {jnp.dtype(dtype).name}" if dtype is not None else "")
        raise ValueError(f"{name}: got {x.shape} {x.dtype.name}, expected {want}")


@functools.partial(jax.jit, static_argnames=("sink", "window", "bits", "levels", "softmax_scale",
                                             "interpret", "config"))
def mixed_attention(q_rot, cache: layout.CacheArrays, *, sink: int,
                    window: int, bits: int, levels: tuple[float, ...], softmax_scale: float,
                    interpret: bool | pltpu.InterpretParams = False,
                    config: AttentionConfig = AttentionConfig(), block_table=None, history_offset=None):
    """Attention of C appended queries over one layer's mixed cache (docs/method.md,
    "Attention over the mixed cache").

    q_rot f32 [B, C, Hq, D] (rotated by R_K); cache: `layout.CacheArrays` (R = T_hist / tpb
    packed rows; lengths count the C queries). Query head i uses KV head i // (Hq/Hkv).
    Returns o f32 [B, C, Hq, D] in the R_V basis and lse f32 [B, C, Hq].
    `interpret`: False on TPU; True or an `InterpretParams` for TPU interpret mode.
    block_table: int32 [B, n] for a paged history (`oscar_jax.paged`): the cache's history
    arrays are then a pool of pages, [P, Hkv, R, D] etc. with R the rows of one page, and
    history block k of row b is page block_table[b, k] (one page per grid step; the table is
    a second scalar prefetch, read only by the index maps).
    history_offset: int32 [] (may be traced) for a history slice (sequence parallelism): the
    history arrays hold history indices [history_offset, history_offset + T_hist) of a longer
    history; the result is then the slice's partial, the sink and ring attended only where
    history_offset == 0 (a scalar prefetch says so; the kernel sees lengths - history_offset,
    the true lengths where it attends them).
    """
    (sink_k, sink_v, hist_codes_k, hist_codes_v, hist_lo_k, hist_scale_k, hist_lo_v, hist_scale_v,
     recent_k, recent_v, lengths) = cache
    bsz, chunk, hq, d = q_rot.shape
    paged = block_table is not None
    hist_lead = hist_codes_k.shape[0] if paged else bsz  # pages or batch rows
    hkv = recent_k.shape[1]
    tpb = layout.tokens_per_byte(bits)
    if len(levels) != 1 << bits:
        raise ValueError(f"levels has {len(levels)} entries, expected 2**bits = {1 << bits}")
    if hq % hkv:
        raise ValueError(f"q_rot.shape={q_rot.shape}: Hq={hq} must be a multiple of Hkv={hkv}")
    if not 1 <= chunk <= window:
        raise ValueError(f"q_rot.shape={q_rot.shape}: chunk C={chunk} must lie in [1, W={window}]")
    rows = hist_codes_k.shape[2]
    n_groups = hist_lo_k.shape[2]
    if n_groups < 1 or d % n_groups:
        raise ValueError(f"hist_lo_k.shape={hist_lo_k.shape}: D/G={n_groups} must divide D={d}")
    _check("sink_k", sink_k, (bsz, hkv, sink, d), jnp.bfloat16)
    _check("sink_v", sink_v, (bsz, hkv, sink, d), jnp.bfloat16)
    _check("recent_k", recent_k, (bsz, hkv, window, d), jnp.bfloat16)
    _check("recent_v", recent_v, (bsz, hkv, window, d), jnp.bfloat16)
    _check("hist_codes_k", hist_codes_k, (hist_lead, hkv, rows, d), jnp.uint8)
    _check("hist_codes_v", hist_codes_v, (hist_lead, hkv, d, rows), jnp.uint8)
    for name, x in (("hist_lo_k", hist_lo_k), ("hist_scale_k", hist_scale_k),
                    ("hist_lo_v", hist_lo_v), ("hist_scale_v", hist_scale_v)):
        _check(name, x, (hist_lead, hkv, n_groups, tpb, rows))
    _check("lengths", lengths, (bsz,), jnp.int32)
    if paged and history_offset is not None:
        raise ValueError("history_offset with a block_table: a paged history is attended whole")
    if paged and (block_table.ndim != 2 or block_table.shape[0] != bsz or block_table.dtype != jnp.int32):
        raise ValueError(f"block_table: got {block_table.shape} {block_table.dtype}, expected [B={bsz}, n] int32")

    # [B, C, Hq, D] -> [B, Hkv, g*C (padded to 8 sublanes), D]; row r = (head r // C, query r % C).
    g = hq // hkv
    m_real = g * chunk
    m_rows = -(-m_real // NUM_SUBLANES) * NUM_SUBLANES
    q = q_rot.astype(jnp.float32) * softmax_scale
    q = jnp.moveaxis(q.reshape(bsz, chunk, hkv, g, d), 1, 3).reshape(bsz, hkv, m_real, d)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, m_rows - m_real), (0, 0)))

    has_sink, has_hist = sink > 0, rows > 0
    split = history_offset is not None
    if paged:  # one page per grid step
        hist_rows, n_blocks = rows, block_table.shape[1]
        prefetch = (lengths, block_table.reshape(-1))
    else:
        hist_rows = rows if rows <= config.hist_rows else config.hist_rows
        n_blocks = pl.cdiv(rows, hist_rows) if has_hist else 1
        prefetch = (lengths,)
    if split:
        offset = jnp.asarray(history_offset, jnp.int32)
        prefetch = (jnp.maximum(lengths - offset, 0), (offset == 0).astype(jnp.int32)[None])
    hist_tokens = (block_table.shape[1] if paged else 1) * rows * tpb
    sq = pl.squeezed

    def fixed(b, h, k, *prefetch_refs):
        return b, h, 0, 0

    def hist_block(b, h, k, lengths_ref, *rest):
        """(row or page, h, block): k clamped to the last block holding tokens, so later steps
        re-use it (no DMA); through the block table (the last prefetch) when paged."""
        n_hist = _history_tokens(lengths_ref[b], sink, window, hist_tokens)
        last = jnp.maximum(pl.cdiv(n_hist, hist_rows * tpb) - 1, 0)
        k = jnp.minimum(k, last)
        if paged:
            return jnp.maximum(rest[-1][b * n_blocks + k], 0), h, 0
        return b, h, k

    in_specs = [pl.BlockSpec((sq, sq, m_rows, d), fixed)]
    args = [q]
    if has_sink:
        in_specs += [pl.BlockSpec((sq, sq, sink, d), fixed)] * 2
        args += [sink_k, sink_v]
    if has_hist:
        codes_k_spec = pl.BlockSpec((sq, sq, hist_rows, d), lambda *a: (*hist_block(*a), 0))
        codes_v_spec = pl.BlockSpec((sq, sq, d, hist_rows),
                                    lambda *a: (*hist_block(*a)[:2], 0, hist_block(*a)[2]))
        meta_spec = pl.BlockSpec((sq, sq, n_groups, tpb, hist_rows),
                                 lambda *a: (*hist_block(*a)[:2], 0, 0, hist_block(*a)[2]))
        in_specs += [codes_k_spec, codes_v_spec] + [meta_spec] * 4
        args += [hist_codes_k, hist_codes_v, hist_lo_k, hist_scale_k, hist_lo_v, hist_scale_v]
    in_specs += [pl.BlockSpec((sq, sq, window, d), fixed)] * 2
    args += [recent_k, recent_v]

    kernel = functools.partial(
        _kernel, paged=paged, split=split, sink=sink, window=window, bits=bits, levels=tuple(levels), chunk=chunk,
        hist_rows=hist_rows, hist_tokens=hist_tokens, n_groups=n_groups, has_sink=has_sink, has_hist=has_hist,
        passes=config.passes)
    o, lse = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(bsz, hkv, n_blocks),
            in_specs=in_specs,
            out_specs=[pl.BlockSpec((sq, sq, m_rows, d), fixed),
                       pl.BlockSpec((sq, sq, m_rows, NUM_LANES), fixed)],
            scratch_shapes=[pltpu.VMEM((m_rows, NUM_LANES), jnp.float32),
                            pltpu.VMEM((m_rows, NUM_LANES), jnp.float32),
                            pltpu.VMEM((m_rows, d), jnp.float32)],
        ),
        out_shape=[jax.ShapeDtypeStruct((bsz, hkv, m_rows, d), jnp.float32),
                   jax.ShapeDtypeStruct((bsz, hkv, m_rows, NUM_LANES), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret_params(interpret),
        name="oscar_mixed_attention_tpu",
    )(*prefetch, *args)
    o = jnp.moveaxis(o[:, :, :m_real].reshape(bsz, hkv, g, chunk, d), 3, 1)
    lse = jnp.moveaxis(lse[:, :, :m_real, 0].reshape(bsz, hkv, g, chunk), 3, 1)
    return o.reshape(bsz, chunk, hq, d), lse.reshape(bsz, chunk, hq)
