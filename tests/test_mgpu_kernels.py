"""The Mosaic GPU decode kernel (mixed_attention_mgpu) and its parts against XLA oracles: the
attention over the cache (int8 MMAs, G = D, uniform codes, bf16 metadata) against the
reference, decode_start's query layouts, decode_finish's merge of the partials, the schedule
and its work line, what the kernel refuses, what "auto" picks, and the sm_90 lowering. The
Triton attention, the dispatch and the bulk writes: tests/test_gpu_kernels.py; the cases and
checks both share: tests/gpu_cases.py.

On CPU the kernel runs in Mosaic GPU interpret mode (register operands staged in shared
memory, the unpacking and the transposed weight store as array ops); `test_mgpu_lowers_for_cuda`
runs the Python side of its sm_90 compilation (layouts, wgmma and TMA checks) without a GPU.
The tests marked `gpu` run the same checks compiled on a real GPU, in groups that each run in
under 5 minutes on one H100 (markers registered in tests/conftest.py, which also keeps the
compilations in build/jax_cache across runs):

    pytest -p no:cacheprovider -n 0 -m gpu_mgpu tests/test_mgpu_kernels.py          # Mosaic GPU decode, D = 128 (7)
    pytest -p no:cacheprovider -n 0 -m gpu_decode tests/test_mgpu_kernels.py        # Mosaic GPU decode, D = 64 and 256,
                                                                                    #   production windows, "auto" (8)
    pytest -p no:cacheprovider -n 0 -m gpu_decode_parts tests/test_mgpu_kernels.py  # decode_start, decode_finish (8)

Tolerances: attention output relative Frobenius error <= 1e-2 (bf16 MMA operands against the
f32 HIGHEST-precision reference), lse within 2e-2 + 5e-3·|lse| (q enters the MMA in bf16).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from gpu_cases import cache_spec, check_attention, lower_for_h200, on_gpu, ragged_lengths, random_case
from oscar_jax import attention
from oscar_jax.pallas_kernels import layout
from oscar_jax.pallas_kernels.gpu import decode_finish, decode_start, hopper, mixed_attention_mgpu
from oscar_jax.pallas_kernels.gpu.mixed_attention_mgpu import Config as MgpuConfig

# (D, g, history tokens, target programs): 8-14 programs of 8 (row, head) pairs -> one program
# a pair (pieces of up to 4 steps at 1024 tokens); 32-1024 -> each pair in 2-4 pieces (3-5
# partials with its sink and ring); 4096 tokens at 12 -> 4 programs of two pairs, the second
# pair's sink and ring between their pieces, and pieces of up to 14 steps (a program reaches
# into a second pair only more than `Config.switch_cost` = 5 units into it: 16 tiles a pair here).
MGPU_CASES = [
    (128, 4, 1024, 12), (128, 1, 1024, 64), (128, 3, 100, 8), (128, 8, 480, 48), (128, 4, 992, 1024),
    (64, 3, 1024, 10), (256, 4, 1024, 14), (256, 1, 480, 8), (64, 3, 4096, 12), (128, 4, 4096, 12)]


# Boundary patterns 2 (lengths just past S0 + W: histories of 0, 1, 3 tokens) and 3 (full,
# full - 1, and length 1): both at every D (at D = 256 across two cases) and at
# slices_per_tile 2 (g = 3), one per case elsewhere (CI time: ~20 s a run on 2 cores).
# MGPU_CASES[0] and [9] run compiled only (-m gpu_mgpu); programs of two pairs: [8] (D = 64)
# here, [9] (D = 128) compiled.
MGPU_RUNS = [(MGPU_CASES[1], 3), (MGPU_CASES[2], 2), (MGPU_CASES[3], 3),
             (MGPU_CASES[4], 3), (MGPU_CASES[5], 2), (MGPU_CASES[5], 3), (MGPU_CASES[6], 2),
             (MGPU_CASES[7], 3), (MGPU_CASES[8], 3)]


@pytest.mark.parametrize("case,pattern", MGPU_RUNS,
                         ids=lambda c: "d{}-g{}-hist{}-p{}".format(*c) if isinstance(c, tuple) else f"pattern{c}")
def test_mgpu_attention_matches_reference(case, pattern):
    d, g, hist, target = case
    spec = cache_spec(d, d, "uniform", "bfloat16", hist=hist)
    rng = np.random.default_rng([d, g, hist, target, pattern])
    assert mixed_attention_mgpu.supports(spec, 1, g)
    config = MgpuConfig(3, 2, target) if d <= 128 else MgpuConfig(1, 3, target)  # 3 per block: large shapes'
    check_attention(rng, spec, g, 1, ragged_lengths(rng, pattern, 1, spec), kernel=_mgpu_kernel(config),
                    k_shift=True, rotates=True)


@functools.cache
def _mgpu_kernel(config: MgpuConfig):
    """The kernel at `config`, one object per config: the patterns of one case share its
    compilation (`check_attention` jits each kernel once)."""
    return functools.partial(mixed_attention_mgpu.mixed_attention, config=config)


@pytest.mark.parametrize("sink,window", [(64, 192), (0, 100)])
def test_mgpu_sink_and_ring_match_reference(sink, window):
    """A production-size sink and a ring of 192 (the kernel's bf16 blocks of 64: 1 + 3, taken
    by the program holding their units, here one of their own), and no sink with a ring of
    100 (padded to 2 blocks;
    the ring stands in for the sink's operands); lengths inside the sink, inside the ring, on
    S0 + W and full. (A sink of 8, padded to a block: the other cases.)"""
    spec = cache_spec(64, 64, "uniform", "bfloat16", sink=sink, window=window, hist=256)
    rng = np.random.default_rng([sink, 5])
    lengths = np.array([1, sink + 70, sink + window, spec.max_len], np.int32)
    check_attention(rng, spec, 3, 1, lengths, kernel=mixed_attention_mgpu.mixed_attention, rotates=True)


def test_mgpu_one_warpgroup_three_buffers_match_reference():
    """One program per block with 3 TMA buffers at D = 128 (`schedule`'s default where
    programs are few, and at D = 256): steps i + 1 and i + 2 in flight while step i is
    computed (4 steps: the buffers wrap); both rotations in XLA (decode_start's
    query_rot=None path and decode_finish's output_rot=None path)."""
    spec = cache_spec(128, 128, "uniform", "bfloat16", hist=1024)
    rng = np.random.default_rng(3)
    kernel = functools.partial(mixed_attention_mgpu.mixed_attention, config=MgpuConfig(1, 3, 8))
    check_attention(rng, spec, 4, 1, ragged_lengths(rng, 13, 1, spec), kernel=kernel, k_shift=True,
                    rotates=False)


def test_mgpu_schedule():
    """3 programs per block only where they outnumber one wave of 2 per SM (132 SMs off a
    GPU), and then 2 TMA buffers only; the work line cut into the fewest units per program
    that make at most the target."""
    def schedule(pairs, tiles, d, **kw):
        config, line = mixed_attention_mgpu.schedule(pairs, tiles, d, sms=132, **kw)
        return config.warpgroups, config.buffers, line

    loads = lambda line: np.diff(line.bounds)
    wg, buffers, line = schedule(64, 512, 128, dense_blocks=5)  # B8 H8 128K: 396 of 396 slots
    assert (wg, buffers, line.dense, line.programs, loads(line).max()) == (3, 2, 6, 396, 85)
    assert loads(line)[::3].max() == 84  # warpgroup 0's programs one unit shorter
    wg, buffers, line = schedule(8, 512, 128, dense_blocks=5)  # B1 128K
    assert (wg, line.programs, loads(line).max()) == (3, 384, 11)
    wg, buffers, line = schedule(64, 1, 128, dense_blocks=5)  # short histories: few programs, 1 a block
    assert (wg, buffers, line.programs) == (1, 3, 128)
    wg, buffers, line = schedule(8, 128, 256, dense_blocks=5)  # D = 256: one a block, at most 1024
    assert (wg, buffers, line.programs, loads(line).max()) == (1, 3, 520, 6)
    wg, buffers, line = schedule(64, 512, 128, config=MgpuConfig(1, 2, 128))
    assert (wg, buffers, line.programs, loads(line).max()) == (1, 2, 128, 256)
    # 3 units each would make 16 programs (the cuts moved out of the sinks and rings): 4
    wg, buffers, line = schedule(8, 1, 128, dense_blocks=2, config=MgpuConfig(1, 3, 12))
    assert (line.programs, loads(line).max()) == (8, 4)
    for bad in (0, 3):
        with pytest.raises(ValueError, match="warpgroups"):
            schedule(8, 4, 256 if bad else 128, config=MgpuConfig(bad, 2, 396))
    for bad in (1, 3):  # several warpgroups share the code buffers' union only at depth 2
        with pytest.raises(ValueError, match="buffers"):
            schedule(64, 512, 128, config=MgpuConfig(3, bad, 396))
    with pytest.raises(ValueError, match="per_program"):
        mixed_attention_mgpu.WorkLine.cut(4, 3, 2, 6)
    with pytest.raises(ValueError, match="switch"):
        mixed_attention_mgpu.WorkLine.cut(4, 3, 2, 2, -1)
    with pytest.raises(ValueError, match="shorter"):
        mixed_attention_mgpu.WorkLine.cut(4, 3, 2, 2, 0, (2, 0, 0))


@settings(max_examples=200, deadline=None)
@given(pairs=st.integers(1, 40), tiles=st.integers(1, 60), dense=st.integers(0, 6), data=st.data())
def test_work_line_covers_every_unit_once(pairs, tiles, dense, data):
    """WorkLine against a direct enumeration: every history tile of every pair is in exactly
    one program's piece and every sink and ring in exactly one program, never cut; programs
    touch at most two pairs and program k takes at most per_program - shorter[k % len(shorter)]
    units (more only for a sink and ring longer than that, fewer by up to `switch` where they
    reach into a second pair); a pair's pieces take partials 0, 1, ... in program order and its
    sink and ring the last of its `tables` count; `table` lays the three end to end at
    `table_offsets`."""
    unit = tiles + dense
    shorter = tuple(data.draw(st.lists(st.integers(0, 2), max_size=3)))
    per_program = data.draw(st.integers(min(unit, 1 + max(shorter, default=0)), unit))
    shorter = shorter if per_program > max(shorter, default=0) else ()
    switch = data.draw(st.integers(0, unit))
    line = mixed_attention_mgpu.WorkLine.cut(pairs, tiles, dense, per_program, switch, shorter)
    bounds, first, counts = line.tables()
    table, (first_at, counts_at) = line.table(), line.table_offsets  # the kernels' one constant
    assert table.dtype == np.int32 and len(table) == counts_at + pairs
    for part, want in ((table[:first_at], bounds), (table[first_at:counts_at], first), (table[counts_at:], counts)):
        np.testing.assert_array_equal(part, want)
    seen_tiles = np.zeros((pairs, tiles), int)
    dense_at = np.full(pairs, -1)
    parts = [[] for _ in range(pairs)]
    for k in range(line.programs):
        u0, u1 = int(bounds[k]), int(bounds[k + 1])
        most = per_program - (shorter[k % len(shorter)] if shorter else 0)
        assert u1 > u0 and (u1 - u0 <= most or u1 - u0 <= dense)
        n = int(line.pieces(np.int64(u0), np.int64(u1)))
        touched = {u // unit for u in range(u0, u1)}
        assert n == len(touched) <= 2
        for i in range(n):
            pair, owns, t_begin, t_end = (int(x) for x in line.piece(u0, u1, i))
            assert pair == min(touched) + i
            if owns:
                assert dense_at[pair] == -1 and pair * unit + dense <= u1
                dense_at[pair] = k
            if t_end > t_begin:
                seen_tiles[pair, t_begin:t_end] += 1
                parts[pair].append(k - first[pair])
    assert (seen_tiles == 1).all() and (dense_at >= 0).all()
    for pair in range(pairs):
        assert parts[pair] == list(range(counts[pair] - 1))


@settings(max_examples=150, deadline=None)
@given(rows=st.integers(1, 12), kv_heads=st.sampled_from([1, 2, 8]), tiles=st.integers(1, 40),
       dense_blocks=st.sampled_from([0, 2, 5]), sms=st.sampled_from([2, 132]), data=st.data())
def test_live_line_splits_the_live_tiles_of_ragged_rows(rows, kv_heads, tiles, dense_blocks, sms, data):
    """LiveLine.table against a direct enumeration, for ragged lengths (idle rows, rows past
    or short of the sink and window, full rows): each program takes one pair or nothing;
    every live history tile (a row's history tokens / 256, rounded up) is in exactly one
    piece of its pair, every sink and ring in exactly one program; a pair's pieces take
    partials 0, 1, ... and its sink and ring the last of its count, at most `max_partials`;
    no program takes more live units than the live work / target (or than a pair's live
    tiles / (max_partials - 1)) plus a sink and ring."""
    sink, window = 64, 256
    lengths = np.array(data.draw(st.lists(st.integers(0, sink + window + tiles * 256), min_size=rows,
                                          max_size=rows)), np.int32)
    pairs = rows * kv_heads
    config, line = mixed_attention_mgpu.schedule(pairs, tiles, 128, sms=sms, dense_blocks=dense_blocks)
    live_line = mixed_attention_mgpu.LiveLine.like(line, config, kv_heads)
    table = live_line.table(lengths, sink=sink, window=window, xp=np)  # the kernel's: xp=jnp (below)
    first_at, counts_at = live_line.table_offsets
    assert table.dtype == np.int32 and len(table) == live_line.table_size == counts_at + pairs
    bounds, first, counts = table[:first_at], table[first_at:counts_at], table[counts_at:]
    live = np.repeat(-(-np.clip(lengths - sink - window, 0, None) // 256), kv_heads)
    unit, dense = live_line.unit, live_line.dense
    per = max(-(-(live.sum() + pairs * dense) // config.target_programs),
              -(-live.max() // (live_line.max_partials - 1)), 1)
    seen_tiles = np.zeros((pairs, tiles), int)
    dense_at = np.full(pairs, -1)
    parts = [[] for _ in range(pairs)]
    for k in range(live_line.programs):
        u0, u1 = int(bounds[k]), int(bounds[k + 1])
        assert u0 <= u1
        if u0 == u1:
            continue
        assert int(live_line.pieces(np.int64(u0), np.int64(u1))) == 1
        pair, owns, t_begin, t_end = (int(x) for x in live_line.piece(u0, u1, 0))
        assert pair == u0 // unit == (u1 - 1) // unit
        if owns:
            assert dense_at[pair] == -1
            dense_at[pair] = k
        assert min(t_end, live[pair]) - t_begin <= per
        seen_tiles[pair, t_begin:min(t_end, live[pair])] += 1
        if t_end > t_begin:
            parts[pair].append(k - first[pair])
    assert (dense_at >= 0).all() and bounds[-1] == pairs * unit
    for pair in range(pairs):
        assert (seen_tiles[pair, :live[pair]] == 1).all() and (seen_tiles[pair, live[pair]:] == 0).all()
        assert parts[pair] == list(range(counts[pair] - 1)) and counts[pair] <= live_line.max_partials
    if rows == 3:  # the kernel's table, traced, agrees
        traced = jax.jit(functools.partial(live_line.table, sink=sink, window=window))(jnp.asarray(lengths))
        np.testing.assert_array_equal(np.asarray(traced), table)


# (D, g, cols as slices_per_tile gives, partials, rotation: None, "f32" or its bf16 "parts")
FINISH_CASES = [(128, 3, 4, 5, "parts"), (256, 4, 8, 40, None), (64, 2, 2, 6, "f32"), (128, 4, 4, 8, None),
                (64, 1, 2, 3, None)]


@pytest.mark.parametrize("d,g,cols,splits,rotate", FINISH_CASES)
def test_decode_finish_matches_a_direct_merge(d, g, cols, splits, rotate, interpret=True):
    """decode_finish against an XLA oracle: a log-sum-exp over every partial column c % cols
    == i, with empty (-inf) partials and a row with none seen at all, in base 2; then
    o_rot · R^T per KV head when the output rotation is given, f32 or as its bf16 parts (to
    1e-4: finer than a TF32 rotation's ~5e-4). The partials take two merge steps at D = 256, the second
    ragged (one masked step elsewhere). Query 0's lses lie 200 above the others, so a global
    rather than per-query max underflows. Each (row, head) uses its first `counts` partials
    (the work line's pieces); the rest hold NaN and must not reach the result. out_dtype bf16 (D = 128)
    gives the f32 result rounded once; at D = 256 the counts sit inside a longer table
    (`counts_at`)."""
    rng = np.random.default_rng([d, g, splits])
    b, hkv = 4, 2
    o_t = jnp.asarray(rng.standard_normal((b, hkv, splits, d, 8)), jnp.float32)
    lse2 = np.asarray(rng.standard_normal((b, hkv, splits, 8)) * 3, np.float32)
    lse2 += 200.0 * (np.arange(8) % cols == 0)  # query 0 far above the others (2^-200: 0 in f32)
    lse2[0] = -np.inf  # row 0: nothing seen at all
    lse2[:, :, 0, :4] = -np.inf  # some empty partials
    counts = rng.integers(1, splits + 1, (b, hkv)).astype(np.int32)
    counts[1, 0] = splits
    unused = np.arange(splits)[None, None, :] >= counts[:, :, None]  # [B, Hkv, S]
    poisoned = jnp.where(unused[..., None, None], jnp.nan, o_t)
    rot = jnp.asarray(np.linalg.qr(rng.standard_normal((hkv, d, d)))[0], jnp.float32)
    # D = 256: the counts inside a longer table, after 5 other entries (as the work line passes them)
    table, at = (counts, 0)
    if d == 256:
        table, at = np.concatenate([rng.integers(0, 99, 5), counts.ravel()]).astype(np.int32), 5
    finish = functools.partial(decode_finish.decode_finish, poisoned,
                               jnp.asarray(np.where(unused[..., None], np.nan, lse2)), jnp.asarray(table),
                               counts_at=at, cols=cols, g=g, interpret=interpret,
                               output_rot={None: None, "f32": rot, "parts": layout.split_bf16(rot)}[rotate])
    o, lse = finish()
    assert o.shape == (b, hkv, g, d) and lse.shape == (b, hkv, g) and o.dtype == jnp.float32
    if d == 128:  # out_dtype: one case (the cast is the store's, the same at every shape)
        o_bf16, _ = finish(out_dtype=jnp.bfloat16)
        assert o_bf16.dtype == jnp.bfloat16  # the f32 result, rounded once at the store
        np.testing.assert_array_equal(np.asarray(o_bf16, np.float32),
                                      np.asarray(o.astype(jnp.bfloat16), np.float32))

    hi = jax.lax.Precision.HIGHEST
    owner = np.arange(8) % cols  # the query of each partial column
    lse2 = np.where(unused[..., None], -np.inf, lse2)  # the oracle sees only the used partials
    for i in range(g):
        scores = jnp.asarray(lse2 * np.log(2.0))[..., owner == i].reshape(b, hkv, -1)  # natural base
        values = jnp.moveaxis(o_t[..., owner == i], -1, -2).reshape(b, hkv, -1, d)
        want_lse = jax.nn.logsumexp(scores, axis=-1)
        weights = jnp.exp(scores - jnp.where(jnp.isfinite(want_lse), want_lse, 0.0)[..., None])
        want_o = jnp.einsum("bht,bhtd->bhd", weights, values, precision=hi)
        if rotate:
            want_o = jnp.einsum("bhe,hde->bhd", want_o, rot, precision=hi)
        np.testing.assert_allclose(np.asarray(lse[:, :, i]), np.asarray(want_lse), rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(np.asarray(o[:, :, i]), np.asarray(want_o), rtol=1e-4, atol=1e-4)


# (D, g, rotation: None, "f32" or its bf16 "parts"); D = 256: on the GPU only
QUERY_LAYOUT_CASES = [(128, 4, "parts"), (64, 1, "f32"), (256, 3, None)]


@pytest.mark.parametrize("d,g,rotate", QUERY_LAYOUT_CASES[:2])
def test_mgpu_query_layout_is_finer_than_bf16(d, g, rotate, interpret=True):
    """decode_start's query layouts against an XLA oracle: column c of the N = 8 query
    columns is query c % (8 / P) of column block c // (8 / P) (zeros in the other blocks and
    in padding columns), q ≈ q_step (256 q_hi + q_lo) with int8 q_hi, q_lo, q_step = ‖q‖ max_j
    ‖M_:j‖ / (127 · 256) for a rotation M, orthogonal or not (the largest element's when q comes
    rotated), within about one q_step (its rounding or a clipped q_lo, + the rotation's), under
    a tenth of a bf16 rounding of q (a TF32 rotation fails); Σq per column; the bf16 hi + lo
    parts for the sink and ring (row r: column r % 8) within a bf16 rounding and, summed, as
    fine as the int8 split."""
    rng = np.random.default_rng([d, g])
    b, hkv, scale = 3, 2, d ** -0.5
    # bf16 q with the rotation's parts (the models' case: two products), f32 q otherwise
    q = jnp.asarray(rng.standard_normal((b, hkv * g, d)) * 3, jnp.bfloat16 if rotate == "parts" else jnp.float32)
    rot = np.linalg.qr(rng.standard_normal((hkv, d, d)))[0]
    if rotate == "f32":  # a dual (non-orthogonal) rotation: columns scaled by 0.5-2
        rot = rot * rng.uniform(0.5, 2.0, (hkv, 1, d))
    rot = jnp.asarray(rot, jnp.float32)
    packed = mixed_attention_mgpu.slices_per_tile(g, d)
    rot_in = {None: None, "f32": rot, "parts": layout.split_bf16(rot)}[rotate]
    blocks, qcol, q_dense = decode_start.decode_start(q, rot_in, kv_heads=hkv, softmax_scale=scale,
                                                     packed=packed, interpret=interpret)
    heads = q.astype(jnp.float32).reshape(b, hkv, g, d)
    want = jnp.einsum("bhgd,hde->bhge", heads, rot, precision=jax.lax.Precision.HIGHEST) if rotate else heads
    cols = 8 // packed
    owner = np.arange(8) % cols  # the query of each column; columns with owner >= g are padding
    want_cols = jnp.where(jnp.asarray(owner < g)[:, None], want[:, :, np.minimum(owner, g - 1)] * scale, 0.0)
    want2 = want_cols * np.log2(np.e)
    assert blocks.shape == (b, hkv, packed, 16, d)  # block j: [q_hi; q_lo] of column block j
    hi = sum(blocks[:, :, j, :8].astype(jnp.float32) for j in range(packed))  # one block per column
    lo = sum(blocks[:, :, j, 8:].astype(jnp.float32) for j in range(packed))
    for j in range(packed):  # outside its column block a block is 0
        outside = np.arange(8) // cols != j
        assert not np.any(np.asarray(blocks[:, :, j, :8])[:, :, outside])
        assert not np.any(np.asarray(blocks[:, :, j, 8:])[:, :, outside])
    step, q_sum = qcol[:, :, 0, 0], qcol[:, :, 1, 0]
    assert bool(jnp.all(qcol[:, :, :, 1:] == qcol[:, :, :, :1]))  # the same in every row
    approx = step[..., None] * (256.0 * hi + lo)
    peak = jnp.max(jnp.abs(want2), axis=-1, keepdims=True)
    real = owner < g
    if rotate:  # |(q M)_j| <= ‖q‖ max_j ‖M_:j‖ (‖q M‖ = ‖q‖ when M is orthogonal)
        col_norm = jnp.max(jnp.linalg.norm(rot, axis=-2), axis=-1)[None, :, None]
        q_cols = jnp.where(jnp.asarray(owner < g)[:, None], heads[:, :, np.minimum(owner, g - 1)], 0.0)
        bound = jnp.linalg.norm(q_cols, axis=-1) * col_norm * scale * np.log2(np.e)
    else:  # q comes rotated: its largest element
        bound = peak[..., 0]
    np.testing.assert_allclose(np.asarray(step)[:, :, real], np.asarray(bound / (127 * 256))[:, :, real], rtol=1e-5)
    in_steps = float(jnp.max((jnp.abs(approx - want2) / step[..., None])[:, :, real]))
    err = float(jnp.max((jnp.abs(approx - want2) / jnp.where(peak > 0, peak, 1.0))[:, :, real]))
    bf16_err = float(jnp.max((jnp.abs(want2.astype(jnp.bfloat16).astype(jnp.float32) - want2)
                              / jnp.where(peak > 0, peak, 1.0))[:, :, real]))
    assert in_steps <= 1.05 and err < bf16_err / 10  # a clipped q_lo: a step; the rotation's error
    assert not np.any(np.asarray(hi)[:, :, ~real]) and not np.any(np.asarray(lo)[:, :, ~real])
    np.testing.assert_allclose(np.asarray(q_sum), np.asarray(jnp.sum(want2, axis=-1)), rtol=1e-4, atol=1e-4)
    # The bf16 parts for the sink and ring: row r holds column r % 8, hi a bf16 rounding of
    # the query (to 2^-8) and hi + lo as fine as the int8 split.
    assert q_dense.shape == (b, hkv, 2, 16, d) and q_dense.dtype == jnp.bfloat16
    want16, peak16 = (jnp.concatenate([x, x], axis=2) for x in (want2, jnp.where(peak > 0, peak, 1.0)))
    rel = lambda x: float(jnp.max(jnp.abs(x.astype(jnp.float32) - want16) / peak16))
    assert rel(q_dense[:, :, 0]) <= 2.0 ** -8
    assert rel(q_dense[:, :, 0].astype(jnp.float32) + q_dense[:, :, 1].astype(jnp.float32)) <= 1.0 / (127 * 256)


def test_mgpu_refuses_what_it_does_not_handle():
    spec = cache_spec(128, 64, "uniform", "bfloat16", hist=1536)  # G < D
    rng = np.random.default_rng(0)
    q, cache, params = random_case(rng, spec, 4, 1, np.array([10, 20, 30, 40], np.int32))
    assert not mixed_attention_mgpu.supports(spec, 1, 4)
    assert not mixed_attention_mgpu.supports(cache_spec(128, 128, "uniform", "bfloat16", hist=1536), 7, 4)
    assert not mixed_attention_mgpu.supports(cache_spec(128, 128, "uniform", "float32", hist=1536), 1, 4)
    with pytest.raises(ValueError, match="G=D"):
        attention.kernel_attend(mixed_attention_mgpu.mixed_attention)(q, cache, params)
    spec = cache_spec(128, 128, "uniform", "bfloat16", hist=1536)
    q, cache, params = random_case(rng, spec, 4, 1, np.array([10, 20, 30, 40], np.int32))
    token_major = dataclasses.replace(cache, hist_codes_v=jnp.swapaxes(cache.hist_codes_v, -1, -2))
    with pytest.raises(ValueError, match="channel-major"):
        attention.kernel_attend(mixed_attention_mgpu.mixed_attention)(q, token_major, params)
    for name, call in (("query_rot", lambda r: decode_start.decode_start(q[:, 0], r, kv_heads=spec.kv_heads,
                                                                         softmax_scale=1.0, packed=2, interpret=True)),
                       ("output_rot", lambda r: decode_finish.decode_finish(
                           jnp.zeros((4, spec.kv_heads, 2, 128, 8)), jnp.zeros((4, spec.kv_heads, 2, 8)),
                           jnp.ones((4, spec.kv_heads), jnp.int32), cols=4, g=4, output_rot=r, interpret=True))):
        with pytest.raises(ValueError, match=f"{name}.shape"):  # parts of one head too few
            call(params.query_rot_parts[:1])


def test_auto_picks_mosaic_gpu_kernel_for_hopper_decode(monkeypatch):
    """"auto" on a GPU: the Mosaic GPU kernel for decode at D = 64, 128 and 256 (where it was
    measured faster), the Triton kernel for extend (C > 1), g > 8, or a GPU that is not sm_90."""
    spec = cache_spec(128, 128, "uniform", "bfloat16", hist=1536)
    assert attention.resolve("auto", spec, 1, 4, backend="gpu") == "pallas_mosaic_gpu"
    d256 = cache_spec(256, 256, "uniform", "bfloat16", hist=1536)
    assert attention.resolve("auto", d256, 1, 4, backend="gpu") == "pallas_mosaic_gpu"
    assert attention.resolve("auto", spec, 7, 4, backend="gpu") == "pallas"
    assert attention.resolve("auto", spec, 1, 16, backend="gpu") == "pallas"
    d64 = cache_spec(64, 64, "uniform", "bfloat16", hist=1536)
    assert attention.resolve("auto", d64, 1, 3, backend="gpu") == "pallas_mosaic_gpu"
    assert attention.resolve("pallas_mosaic_gpu", d64, 1, 3, backend="gpu") == "pallas_mosaic_gpu"
    with pytest.raises(ValueError, match="C=7 queries"):
        attention.resolve("pallas_mosaic_gpu", spec, 7, 4, backend="gpu")
    monkeypatch.setattr(hopper, "device_supported", lambda: False)
    assert attention.resolve("auto", spec, 1, 4, backend="gpu") == "pallas"
    with pytest.raises(ValueError, match="sm_90"):  # an explicit request on a GPU that is not Hopper
        attention.resolve("pallas_mosaic_gpu", spec, 1, 4, backend="gpu")


# CI time: 16-46 s a case on 2 cores; 1 warpgroup a block at D <= 128 and 4 slices a tile lower
# only on the GPU (`test_mgpu_one_warpgroup_on_gpu`, `test_mgpu_attention_on_gpu`).
@pytest.mark.parametrize("d,g,rotate", [(128, 4, True), (256, 8, True), (64, 3, False)])
def test_mgpu_lowers_for_cuda(d, g, rotate):
    """B8 Hkv 8 at 32K, slices_per_tile 2 (D = 128), 1 (D = 256) and 2 at D = 64's 64-byte
    swizzle, 3 programs per block at D <= 128 (1 at D = 256): Mosaic GPU's layout inference,
    wgmma and TMA checks for sm_90, and the Triton lowering of decode_start (without a
    rotation at D = 64, with an f32 one at D = 256 and, with a bf16 q, its bf16 parts at
    D = 128) and decode_finish (the bf16 parts at D = 128; none at D = 64 and 256, where XLA
    rotates back)."""
    b, hkv, rows, sink, window = 8, 8, 8192, 64, 256
    sds = jax.ShapeDtypeStruct
    bf, u8 = jnp.bfloat16, jnp.uint8
    args = (sds((b, 1, hkv * g, d), bf if d == 128 else jnp.float32), sds((b, hkv, sink, d), bf),
            sds((b, hkv, sink, d), bf),
            sds((b, hkv, rows, d), u8), sds((b, hkv, d, rows), u8),
            *[sds((b, hkv, 1, 4, rows), bf)] * 4,
            sds((b, hkv, window, d), bf), sds((b, hkv, window, d), bf), sds((b,), jnp.int32))
    fn = lambda q, *cache, **kw: mixed_attention_mgpu.mixed_attention(
        q, layout.CacheArrays(*cache), sink=sink, window=window, bits=2, levels=(0.0, 1.0, 2.0, 3.0),
        softmax_scale=d ** -0.5, **kw)
    if rotate:
        rot = sds((hkv, 2, d, d), bf) if d == 128 else sds((hkv, d, d), jnp.float32)
        lower_for_h200(lambda *a: fn(*a[:-2], query_rot=a[-2], output_rot=a[-1]), (*args, rot, rot))
    else:
        lower_for_h200(fn, args)


# ---------------------------------------------------------------------------------------
# The same checks compiled for a real GPU (Triton lowering rules apply), in the groups of the
# module docstring: each test carries the marker `gpu` and its group's.


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.gpu_mgpu if c[0] == 128 else pytest.mark.gpu_decode)
                                  for c in MGPU_CASES], ids=lambda c: "d{}-g{}-hist{}-p{}".format(*c))
def test_mgpu_attention_on_gpu(case):
    # pattern 3 at 4096 tokens (full rows): both pieces of the two-pair programs have steps
    test_mgpu_attention_matches_reference(case, 3 if case[2] == 4096 else 9)


@on_gpu("gpu_mgpu")
def test_mgpu_one_warpgroup_on_gpu():
    test_mgpu_one_warpgroup_three_buffers_match_reference()


@on_gpu("gpu_decode_parts")
@pytest.mark.parametrize("d,g,rotate", QUERY_LAYOUT_CASES)
def test_mgpu_query_layout_on_gpu(d, g, rotate):
    test_mgpu_query_layout_is_finer_than_bf16(d, g, rotate, interpret=False)


@on_gpu("gpu_decode_parts")
@pytest.mark.parametrize("d,g,cols,splits,rotate", FINISH_CASES)
def test_decode_finish_on_gpu(d, g, cols, splits, rotate):
    test_decode_finish_matches_a_direct_merge(d, g, cols, splits, rotate, interpret=False)


@on_gpu("gpu_decode")
@pytest.mark.parametrize("d,g", [(128, 4), (256, 4), (64, 3)])
def test_mgpu_attention_on_gpu_real_windows(d, g):
    """Production sink/window (64/256: the kernel's bf16 blocks unpadded), a ragged
    batch over a 2048-token history."""
    spec = cache_spec(d, d, "uniform", "bfloat16", sink=64, window=256, hist=2048)
    rng = np.random.default_rng([d, g])
    check_attention(rng, spec, g, 1, np.array([1, 64 + 256 + 1, 1700, spec.max_len], np.int32),
                    kernel=mixed_attention_mgpu.mixed_attention, rotates=True)


@on_gpu("gpu_decode")
def test_auto_attend_on_gpu_runs_the_preferred_kernel():
    """attend(implementation="auto") at D = 128 decode: the Mosaic GPU kernel on sm_90 (the
    Triton one elsewhere), through the same entry point the models use, against the reference."""
    spec = cache_spec(128, 128, "uniform", "bfloat16", sink=64, window=256, hist=3072)
    hopper = jax.devices()[0].compute_capability == "9.0"
    assert attention.resolve("auto", spec, 1, 4) == ("pallas_mosaic_gpu" if hopper else "pallas")
    check_attention(np.random.default_rng(11), spec, 4, 1,
                    np.array([1, 64 + 256 + 1, 1700, spec.max_len], np.int32), implementation="auto")
