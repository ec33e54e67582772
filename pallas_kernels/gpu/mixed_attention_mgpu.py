"""Decode attention over the mixed OSCAR cache on Hopper (Mosaic GPU, int8 MMAs): the entry point.

Three launches per call:
  `decode_start` (one Triton kernel: the query rotation, the softmax scale and every query
    layout the MMAs need);
  the Mosaic GPU kernel (`mixed_attention_mgpu_kernel`, its arithmetic there), which attends
    over the packed history and the bf16 sink and ring along a stream-K work line
    (`mixed_attention_mgpu_schedule`: `Config`, `WorkLine`, `schedule`; paged: `LiveLine`) into partials;
  `decode_finish` (one Triton kernel: the merge of every partial and, at D <= 128, the
    back-rotation of the output; XLA rotates back at D = 256, where a fused rotation would
    make each of decode_finish's channel blocks merge all 256 channels of every partial).

Scope (`supports`): C = 1, D = G in {64, 128, 256}, uniform 2-bit codes, bf16 metadata,
g <= 8, packed history rows fewer than 64 (padded here) or a multiple of 64 (whole TMA
tiles; `CacheSpec` allocates a longer history in 256-token tiles). `interpret=True` runs
all three in Pallas interpret mode (CPU); `pytest -m gpu_mgpu` runs them compiled.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from oscar_jax.pallas_kernels import layout

from . import decode_start as start
from . import mixed_attention_mgpu_kernel as kernel_lib
from .decode_finish import decode_finish
from .hopper import sm_count
from .mixed_attention_mgpu_kernel import ROWS, TPB, N
from .mixed_attention_mgpu_schedule import Config, LiveLine, WorkLine, schedule, slices_per_tile

__all__ = ["Config", "LiveLine", "WorkLine", "mixed_attention", "schedule", "slices_per_tile", "supports"]


def supports(spec, c: int, g: int) -> bool:
    """What this kernel handles (a `CacheSpec`, C queries, g query heads per KV head): decode,
    D = G in {64, 128, 256}, uniform 2-bit codes, bf16 metadata, g <= 8, packed rows a
    multiple of 64 when at least 64."""
    q = spec.quant
    rows = spec.hist_capacity // TPB
    return (c == 1 and g <= N and spec.head_dim in (64, 128, 256) and spec.group_size == spec.head_dim
            and q.bits == 2
            and tuple(q.levels) == (0.0, 1.0, 2.0, 3.0) and jnp.dtype(q.jnp_scale_dtype) == jnp.bfloat16
            and (rows < ROWS or rows % ROWS == 0))


def mixed_attention(q, cache: layout.CacheArrays, *, sink: int, window: int,
                    bits: int, levels: tuple[float, ...], softmax_scale: float,
                    interpret: bool = False, config: Config | None = None,
                    query_rot: jax.Array | None = None, output_rot: jax.Array | None = None,
                    query_rot_stats: jax.Array | None = None, out_dtype=jnp.float32, block_table=None,
                    history_offset=None, live: bool | None = None):
    """Same contract as `mixed_attention.mixed_attention` (Triton), restricted to `supports`,
    except that both rotations may be left to this kernel.

    q: [B, 1, Hq, D], rotated, or in the model basis when query_rot is given: f32 [Hkv, D, D],
    or its bf16 parts [Hkv, 2, D, D] (`layout.split_bf16`, which `LayerParams` holds: then no
    kernel splits it per call); query_rot_stats: f32 [Hkv, 2, D] =
    `layout.rotation_stats(query_rot)` (which `LayerParams` holds) or None (then computed per
    call); cache: `layout.CacheArrays` (G = D: metadata [B, Hkv, 1, 4, T_hist/4]); output_rot
    f32 [Hkv, D, D], its bf16 parts [Hkv, 2, D, D] or None (the output is rotated back,
    o = o_rot · output_rot[h]^T, by `decode_finish` at D <= 128 and by XLA at D = 256).
    config: `Config`, or None for `schedule`'s choice for this shape and the device's SMs.
    Returns (o out_dtype [B, 1, Hq, D]: o_rot, or rotated back when output_rot is given; lse
    f32 [B, 1, Hq]).
    block_table: int32 [B, n] for a paged history (`oscar_jax.paged`): the code and metadata
    arrays are then pools of P pages of R packed rows ([P, Hkv, R, D] etc.; R a multiple of the
    64-row TMA tile: pages of whole HIST_TILEs), and history tile t of row b is read from page
    block_table[b, t * 64 // R] where its TMA copy is issued (the schedule is the contiguous
    one's for n * R rows, cut at call time from the lengths: `LiveLine`).
    live: cut the work at call time from the lengths (`LiveLine`) instead of at trace time for
    every row at full capacity (`WorkLine`); None: where paged. Not with a history_offset.
    history_offset: int32 [] (may be traced) for a history slice (sequence parallelism): the
    history arrays hold history indices [history_offset, history_offset + T_hist) of a longer
    history; the result is then the slice's partial, the sink and ring attended only where
    history_offset == 0. The kernel sees lengths - history_offset (its history pieces stop at
    the slice's own tokens); `decode_finish` merges each pair's sink and ring partial (its
    last, computed from those lengths) only at offset 0, where the lengths are the true ones.
    """
    (sink_k, sink_v, hist_codes_k, hist_codes_v, hist_lo_k, hist_scale_k, hist_lo_v, hist_scale_v,
     recent_k, recent_v, lengths) = cache
    b, c, hq, d = q.shape
    hkv = sink_k.shape[1]
    g = hq // hkv
    paged = block_table is not None
    lead = hist_codes_k.shape[0] if paged else b  # pages or batch rows
    page_rows = hist_codes_k.shape[2]
    rows = block_table.shape[1] * page_rows if paged else page_rows  # the history's rows per sequence
    if paged and (block_table.ndim != 2 or block_table.shape[0] != b or page_rows % ROWS):
        raise ValueError(f"block_table.shape={block_table.shape}, pages of {page_rows} rows: expected [B={b}, n] "
                         f"and pages of whole {ROWS}-row tiles")
    if c != 1 or g > N or d not in (64, 128, 256) or hist_lo_k.shape[2] != 1 or bits != 2 or \
            tuple(levels) != (0.0, 1.0, 2.0, 3.0) or hist_lo_k.dtype != jnp.bfloat16:
        raise ValueError(f"q.shape={q.shape}, groups={hist_lo_k.shape[2]}, bits={bits}, "
                         f"metadata {hist_lo_k.dtype}: this kernel needs C=1, g<=8, D in (64, 128, 256), G=D, "
                         "uniform 2-bit codes and bf16 metadata")
    if hist_codes_v.shape != (lead, hkv, d, page_rows):
        raise ValueError(f"hist_codes_v.shape={hist_codes_v.shape}: expected channel-major "
                         f"[{lead}, Hkv={hkv}, D={d}, {page_rows}]")
    live = paged if live is None else live
    if history_offset is not None and (paged or live):
        raise ValueError("history_offset with a block_table or live=True: a paged history, and a live line, "
                         "are attended whole")
    if rows >= ROWS and rows % ROWS:
        raise ValueError(f"hist_codes_k.shape={hist_codes_k.shape}: T_hist/4 must be a multiple of {ROWS} "
                         "(whole TMA tiles; CacheSpec allocates a longer history in 256-token tiles)")
    packed = slices_per_tile(g, d)
    cols = N // packed  # query columns per slice: g padded
    q_blocks, qcol, q_dense = start.decode_start(q[:, 0], query_rot, kv_heads=hkv, softmax_scale=softmax_scale,
                                                 packed=packed, query_rot_stats=query_rot_stats,
                                                 interpret=interpret)
    # The bf16 segments in whole blocks of 64 rows (a copy only where S0 or W is not a multiple
    # of 64; the defaults, 64 and 256, are); no sink: the ring stands in (unread).
    whole = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, -x.shape[2] % ROWS), (0, 0))) if x.shape[2] % ROWS else x
    segments = [whole(x) for x in ((sink_k, sink_v) if sink else (recent_k, recent_v)) + (recent_k, recent_v)]

    codes_k, codes_v = hist_codes_k, hist_codes_v
    meta = [x.reshape(lead, hkv, TPB, page_rows) for x in (hist_lo_k, hist_scale_k, hist_lo_v, hist_scale_v)]
    if rows < ROWS:  # tiny caches only: every tile must fit inside the arrays
        codes_k = jnp.pad(codes_k, ((0, 0), (0, 0), (0, ROWS - rows), (0, 0)))
        codes_v = jnp.pad(codes_v, ((0, 0), (0, 0), (0, 0), (0, ROWS - rows)))
        meta = [jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, ROWS - rows))) for x in meta]
    tiles = -(-max(rows, ROWS) // ROWS)
    config, line = schedule(b * hkv, tiles, d, sms=sm_count(), config=config,
                            dense_blocks=kernel_lib.dense_blocks(sink, window)[1])
    if live:  # slots of ragged lengths: cut the work from them at call time
        line = LiveLine.like(line, config, hkv)
    kernel = kernel_lib.history_kernel(
        line, batch=b, kv_heads=hkv, head_dim=d, g=g, packed=packed, hist_rows=rows,
        warpgroups=config.warpgroups, buffers=config.buffers, sink=sink, window=window, interpret=interpret,
        pages=(line.table_size, block_table.shape[1], page_rows) if paged else None)
    table = line.table(lengths, sink=sink, window=window) if live else jnp.asarray(line.table())
    if paged:  # the block table rides behind the schedule's tables (decode_finish reads those only)
        table = jnp.concatenate([table, block_table.reshape(-1).astype(table.dtype)])
    lengths = lengths.astype(jnp.int32)
    counts, counts_at = table, line.table_offsets[1]
    if history_offset is not None:  # a slice away from offset 0: each pair's last partial (sink, ring) left out
        lengths = jnp.maximum(lengths - history_offset, 0)
        counts, counts_at = jnp.asarray(line.tables()[2]) - (history_offset != 0).astype(jnp.int32), 0
    o_t, lse2 = kernel(lengths, table,
                       q_blocks, qcol, q_dense.reshape(b, hkv, 4 * N, d), codes_k,
                       codes_v, *meta, *segments)
    fused_rot = output_rot if d <= 128 else None
    xla_rot = output_rot is not None and fused_rot is None
    o, lse = decode_finish(o_t, lse2, counts, counts_at=counts_at, g=g, cols=cols,
                           output_rot=fused_rot, out_dtype=jnp.float32 if xla_rot else out_dtype,
                           interpret=interpret)
    if xla_rot:
        rot = output_rot if output_rot.ndim == 3 else output_rot.astype(jnp.float32).sum(axis=1)  # hi + lo
        o = jnp.einsum("bhge,hde->bhgd", o, rot, precision=lax.Precision.HIGHEST).astype(out_dtype)
    return o.reshape(b, 1, hq, d), lse.reshape(b, 1, hq)
