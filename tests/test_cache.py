"""The KV-state pytree: writes and appends against an independent position model."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oscar_jax as oj
from oscar_jax import cache as cache_lib
from oscar_jax import updates
from oscar_jax import rotation
from oscar_jax.config import CacheSpec, QuantConfig, bits_per_element
from cache_oracle import SequenceOracle, random_kv, signed_permutation

QUANTS = [QuantConfig(bits=2), QuantConfig(bits=4), QuantConfig(bits=2, group_size=8),
          QuantConfig(bits=2, scale_dtype="float32"), QuantConfig(bits=8)]


def _setup(seed, quant_cfg, batch=3, heads=2, d=16, sink=4, window=8, max_len=64):
    rng = np.random.default_rng(seed)
    spec = CacheSpec(num_layers=1, batch=batch, kv_heads=heads, head_dim=d, max_len=max_len,
                     sink=sink, window=window, quant=quant_cfg)
    rk, rv = signed_permutation(rng, heads, d), signed_permutation(rng, heads, d)
    params = oj.LayerParams.create(rk, rv, 0.9, 0.8, num_layers=1, kv_heads=heads).layer(0)
    return rng, spec, params, SequenceOracle(spec, rk, 0.9), SequenceOracle(spec, rv, 0.8)


_dense_view = jax.jit(oj.dense_view)


def _check(cache, ok, ov):
    k, v, valid = (np.asarray(a) for a in _dense_view(cache))
    for b in range(cache.spec.batch):
        for dense, oracle in ((k, ok), (v, ov)):
            want, n = oracle.expected(b)
            assert int(cache.lengths[b]) == n and valid[b].sum() == n
            np.testing.assert_array_equal(dense[b, :, :n], want)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("quant_cfg", QUANTS, ids=str)
def test_random_writes_and_appends_match_position_model(seed, quant_cfg):
    rng, spec, params, ok, ov = _setup(seed, quant_cfg)
    append = jax.jit(oj.append)
    t = 20
    lengths = rng.integers(0, t + 1, spec.batch)
    lengths[rng.integers(spec.batch)] = rng.choice([spec.sink, spec.sink + spec.window, t])
    k, v = random_kv(rng, spec.batch, t, spec.kv_heads, spec.head_dim), random_kv(
        rng, spec.batch, t, spec.kv_heads, spec.head_dim)
    cache = oj.write_prompt(oj.OscarCache.init(spec).layer(0), k, v, jnp.asarray(lengths), params)
    ok.write_prompt(k, lengths), ov.write_prompt(v, lengths)
    _check(cache, ok, ov)
    while True:
        c = int(rng.choice([1, 3, spec.window]))
        if int(np.max(cache.lengths)) + c > spec.max_len:
            break
        k, v = (random_kv(rng, spec.batch, c, spec.kv_heads, spec.head_dim) for _ in range(2))
        cache = append(cache, k, v, params)
        ok.append(k), ov.append(v)
        _check(cache, ok, ov)
    assert not np.any(cache.overflow)


def test_append_past_capacity_raises_outside_jit():
    _, spec, params, *_ = _setup(0, QuantConfig())
    cache = oj.OscarCache.init(spec).layer(0)
    x = np.ones((spec.batch, 8, spec.kv_heads, spec.head_dim), np.float32)
    for _ in range(spec.max_len // 8):
        cache = oj.append(cache, x, x, params)
    with pytest.raises(ValueError, match="overflows max_len=64"):
        oj.append(cache, x[:, :1], x[:, :1], params)


def test_append_past_capacity_flags_inside_jit():
    rng, spec, params, *_ = _setup(1, QuantConfig())
    x = random_kv(rng, spec.batch, 61, spec.kv_heads, spec.head_dim)
    cache = oj.write_prompt(oj.OscarCache.init(spec).layer(0), x, x, jnp.array([60, 50, 61]), params)
    y = random_kv(rng, spec.batch, 5, spec.kv_heads, spec.head_dim)
    after = jax.jit(oj.append)(cache, y, y, params)
    assert after.overflow.tolist() == [True, False, True]
    assert after.lengths.tolist() == [60, 55, 61]
    for name in ("sink_k", "hist_codes_k", "hist_lo_v", "recent_v"):  # flagged rows untouched
        np.testing.assert_array_equal(getattr(after, name)[0], getattr(cache, name)[0])
        np.testing.assert_array_equal(getattr(after, name)[2], getattr(cache, name)[2])


@pytest.mark.parametrize("kw, match", [
    (dict(k_shape=(3, 2, 5, 16)), r"k.shape=\(3, 2, 5, 16\)"),
    (dict(k_shape=(3, 65, 2, 16)), "k has C=65 tokens: a chunk holds at most the cache's max_len=64"),
])
def test_append_rejects_bad_shapes(kw, match):
    _, spec, params, *_ = _setup(0, QuantConfig())
    x = np.ones(kw["k_shape"], np.float32)
    with pytest.raises(ValueError, match=match):
        oj.append(oj.OscarCache.init(spec).layer(0), x, x, params)


def test_bits_per_element_headline_figure():
    """D = G = 128, T = 131072, S0 = 64, W = 256, bf16 metadata: 2.28 bits/element,
    and the arrays really allocate that many bits for the capacity they hold (the history
    rounded up to whole 256-token tiles: 64 tokens more here)."""
    spec = CacheSpec(num_layers=1, batch=1, kv_heads=1, head_dim=128, max_len=131072)
    assert abs(bits_per_element(spec, 131072) - 2.28) < 0.01
    held = spec.sink + spec.hist_capacity + spec.window
    assert held - 131072 == 64
    cache = oj.OscarCache.init(spec)
    k_bytes = sum(getattr(cache, f).nbytes for f in
                  ("sink_k", "hist_codes_k", "hist_lo_k", "hist_scale_k", "recent_k"))
    assert abs(k_bytes * 8 / (held * 128) - bits_per_element(spec, held)) < 1e-6
    full = cache_lib.OscarCache(**{**{f: getattr(cache, f) for f in cache.__dataclass_fields__},
                                   "lengths": jnp.full((1, 1), 131072, jnp.int32)})
    assert abs(oj.bits_per_element(full) - 2.28) < 0.01
    smol = CacheSpec(num_layers=1, batch=1, kv_heads=1, head_dim=64, max_len=8192)
    assert abs(bits_per_element(smol, 8192) - 3.03) < 0.01


def test_ring_layer_keeps_last_capacity_positions():
    rng = np.random.default_rng(7)
    spec = oj.RingSpec(num_layers=1, batch=2, kv_heads=1, head_dim=8, window=4, capacity=6)
    x = random_kv(rng, 2, 9, 1, 8)
    ring = oj.ring_write_prompt(oj.RingCache.init(spec).layer(0), x, x, jnp.array([3, 9]))
    pos = np.asarray(cache_lib.ring_slot_positions(ring.lengths, spec.capacity))
    for b in range(2):
        for slot, p in enumerate(pos[b]):
            if p >= 0:
                np.testing.assert_array_equal(np.asarray(ring.k[b, :, slot], np.float32), x[b, p])
    assert sorted(p for p in pos[1] if p >= 0) == [3, 4, 5, 6, 7, 8]
    y = random_kv(rng, 2, 3, 1, 8)
    ring = oj.ring_append(ring, y, y)
    np.testing.assert_array_equal(np.asarray(ring.k[1, :, 9 % 6], np.float32), y[1, 0])
    with pytest.raises(ValueError, match="capacity - window"):
        oj.ring_append(ring, random_kv(rng, 2, 4, 1, 8), random_kv(rng, 2, 4, 1, 8))


def test_history_byte_layout_after_write_prompt_and_appends():
    """Pins the stored layout down: with identity rotations, clip 1, f32 metadata and
    every token holding the levels 0..3 (lo = 0, scale = 1), the history codes are
    the inputs themselves. Byte (i, c) of hist_codes_k and byte (c, i) of hist_codes_v
    hold channel c of history tokens 4i..4i+3, token 4i+s in bits 2s..2s+1, after a
    prompt write and after one-token and chunked demotions."""
    b, h, d, s0, w = 2, 2, 16, 4, 8
    spec = CacheSpec(num_layers=1, batch=b, kv_heads=h, head_dim=d, max_len=s0 + 32 + w,
                     sink=s0, window=w, quant=QuantConfig(bits=2, scale_dtype="float32"))
    eye = np.broadcast_to(np.eye(d, dtype=np.float32), (h, d, d))
    params = oj.LayerParams.create(eye, eye, 1.0, 1.0, num_layers=1, kv_heads=h).layer(0)
    rng = np.random.default_rng(0)
    t = spec.max_len
    codes = rng.integers(0, 4, (2, b, t, h, d))  # [k/v, B, T, H, D]
    codes[..., 0], codes[..., 1] = 0, 3  # every token spans the full range
    codes = codes[..., rng.permutation(d)]
    k, v = (jnp.asarray(x, jnp.float32) for x in codes)
    prompt = np.array([30, 13])
    cache = oj.write_prompt(oj.OscarCache.init(spec).layer(0), k, v, jnp.asarray(prompt), params)

    def check(cache):
        n_hist = np.asarray(cache.lengths) - s0 - w
        stored = {"k": np.asarray(cache.hist_codes_k), "v": np.asarray(cache.hist_codes_v)}
        rows = spec.hist_capacity // 4  # 32 history tokens: 8 packed rows
        assert stored["k"].shape == (b, h, rows, d) and stored["v"].shape == (b, h, d, rows)
        for row in range(b):
            for p in range(max(n_hist[row], 0)):  # history index p = position s0 + p
                i, s = divmod(p, 4)
                got_k = (stored["k"][row, :, i, :] >> 2 * s) & 3  # [H, D]
                got_v = (stored["v"][row, :, :, i] >> 2 * s) & 3
                np.testing.assert_array_equal(got_k, codes[0, row, s0 + p])
                np.testing.assert_array_equal(got_v, codes[1, row, s0 + p])

    check(cache)
    append = jax.jit(oj.append)
    n = prompt.copy()
    for c in [1, 1, 3, 1, 8]:
        idx = n[:, None] + np.arange(c)[None, :]
        take = lambda x: jnp.take_along_axis(x, jnp.asarray(idx)[:, :, None, None], axis=1)
        cache = append(cache, take(k), take(v), params)
        n += c
        check(cache)
    assert n.tolist() == [t, 27] and not np.any(cache.overflow)  # row 0: a full history


def test_layer_params_split_the_kernel_rotations_once():
    """LayerParams.create holds query_rot and output_rot (the duals where given) as bf16 hi +
    lo parts for the GPU decode kernels: hi is the bf16 rounding, hi + lo within 2^-16 of
    the largest entry, per layer and KV head, and layer(i) slices them with the rest; and the
    query rotation's row sums and column norms (the dual's where given)."""
    rng = np.random.default_rng(3)
    layers, heads, d = 2, 3, 16
    rot = lambda: np.linalg.qr(rng.standard_normal((layers, heads, d, d)))[0]
    inv_t = lambda m: np.linalg.inv(m).swapaxes(-1, -2)
    rk, rv = rot(), rot() @ (np.eye(d) + 0.2 * rng.standard_normal((layers, heads, d, d)))
    dual_v = inv_t(rv)
    params = oj.LayerParams.create(rk, rv, 0.9, 0.8, num_layers=layers, kv_heads=heads, dual_v=dual_v)
    dk = rng.standard_normal((layers, heads, d, d))
    stats = oj.LayerParams.create(inv_t(dk), rv, 0.9, 0.8, num_layers=layers, kv_heads=heads, dual_k=dk,
                                  dual_v=dual_v).query_rot_stats
    for got, want in ((params.query_rot_stats, rk), (stats, dk)):
        assert got.shape == (layers, heads, 2, d) and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got[:, :, 0]), want.sum(axis=-1), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(got[:, :, 1]), np.linalg.norm(want, axis=-2), rtol=1e-5)
    for parts, want in ((params.query_rot_parts, rk), (params.output_rot_parts, dual_v)):
        assert parts.shape == (layers, heads, 2, d, d) and parts.dtype == jnp.bfloat16
        hi, lo = (np.asarray(parts[:, :, k], np.float32) for k in range(2))
        np.testing.assert_array_equal(hi, np.asarray(jnp.asarray(want, jnp.float32).astype(jnp.bfloat16), np.float32))
        assert np.max(np.abs(hi + lo - want)) <= 2.0 ** -16 * np.max(np.abs(want))
        assert np.any(lo != 0)
    one = params.layer(1)
    for name in ("query_rot_parts", "output_rot_parts", "query_rot_stats"):
        np.testing.assert_array_equal(np.asarray(getattr(one, name)), np.asarray(getattr(params, name)[1]))


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("channel_major", [False, True])
def test_single_token_history_write_equals_the_window_write(bits, channel_major):
    """Decode's one-token history write (a byte row read-modified-written) gives exactly the
    bytes and metadata of the general windowed write, for random packed histories, every slot
    of a byte, a negative index (nothing written) and a row flagged not ok."""
    rng = np.random.default_rng(bits + 10 * channel_major)
    b, h, d, g, rows = 6, 2, 16, 2, 5
    tpb = 8 // bits
    shape = (b, h, d, rows) if channel_major else (b, h, rows, d)
    codes = jnp.asarray(rng.integers(0, 256, shape), jnp.uint8)
    lo, scale = (jnp.asarray(rng.standard_normal((b, h, g, tpb, rows)), jnp.bfloat16) for _ in range(2))
    new = cache_lib.quant.Quantized(
        codes=jnp.asarray(rng.integers(0, 2 ** bits, (b, h, 1, d)), jnp.uint8),
        lo=jnp.asarray(rng.standard_normal((b, h, 1, g)), jnp.bfloat16),
        scale=jnp.asarray(rng.standard_normal((b, h, 1, g)), jnp.bfloat16))
    index = jnp.asarray([0, tpb - 1, tpb * rows - 1, 2 * tpb + 1 if tpb > 1 else 2, -3, 3], jnp.int32)
    ok = jnp.asarray([True, True, True, True, True, False])
    got = updates._write_history_token(codes, lo, scale, new, index, ok, bits, channel_major)
    window = jax.vmap(functools.partial(updates._write_history, bits=bits, channel_major=channel_major))
    want = window(codes, lo, scale, new, index, jnp.where(ok, 1, 0))
    for got_x, want_x in zip(got, want):
        np.testing.assert_array_equal(np.asarray(got_x, np.float32), np.asarray(want_x, np.float32))
    assert not np.array_equal(np.asarray(got[0]), np.asarray(codes))  # something was written


def test_write_prompt_out_of_range_lengths_are_flagged_inside_jit():
    """Under jit, a row whose prompt_lengths pass T (or max_len, or are negative) is left
    empty and flagged in `overflow` (never filled from past the end of k, v): appending one
    token and attending then equals the same on a row written with length 0."""
    spec = CacheSpec(num_layers=1, batch=3, kv_heads=2, head_dim=64, max_len=64, sink=16, window=32)
    rng = np.random.default_rng(4)
    rk, rv = signed_permutation(rng, 2, 64), signed_permutation(rng, 2, 64)
    params = oj.LayerParams.create(rk, rv, 0.9, 0.8, num_layers=1, kv_heads=2).layer(0)
    k, v = (jnp.asarray(random_kv(rng, 3, 40, 2, 64)) for _ in range(2))
    empty = oj.OscarCache.init(spec).layer(0)
    flagged = jax.jit(oj.write_prompt)(empty, k, v, jnp.array([50, 30, -3]), params)
    assert flagged.overflow.tolist() == [True, False, True] and flagged.lengths.tolist() == [0, 30, 0]
    want = oj.write_prompt(empty, k, v, jnp.array([0, 30, 0]), params)
    x = jnp.asarray(random_kv(rng, 3, 1, 2, 64))
    q = jnp.asarray(rng.standard_normal((3, 1, 4, 64)), jnp.float32)
    o, lse = oj.attend(q, oj.append(flagged, x, x, params), params, implementation="xla")
    o_want, lse_want = oj.attend(q, oj.append(want, x, x, params), params, implementation="xla")
    assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(lse)).all()
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_want))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_want))


@pytest.mark.parametrize("t, lengths", [(40, [50]), (70, [70]), (40, [-1])])
def test_write_prompt_out_of_range_lengths_raise_eagerly(t, lengths):
    spec = CacheSpec(num_layers=1, batch=1, kv_heads=2, head_dim=64, max_len=64, sink=16, window=32)
    params = oj.LayerParams.create(np.eye(64), np.eye(64), 1.0, 1.0, num_layers=1, kv_heads=2).layer(0)
    k = jnp.ones((1, t, 2, 64))
    with pytest.raises(ValueError, match=r"write_prompt: prompt_lengths=\[-?\d+\] must lie in \[0, min\(T="):
        oj.write_prompt(oj.OscarCache.init(spec).layer(0), k, k, jnp.array(lengths), params)


_D = 16
_Q = np.linalg.qr(np.random.default_rng(0).standard_normal((_D, _D)))[0]


@pytest.mark.parametrize("kw, match", [
    (dict(rot_k=2 * np.eye(_D)), "rot_k is not orthogonal"),
    (dict(rot_v=np.random.default_rng(1).standard_normal((_D, _D))), "rot_v is not orthogonal"),
    (dict(rot_k=np.zeros((_D, _D))), "rot_k is not orthogonal"),
    (dict(rot_v=np.full((_D, _D), np.nan)), "rot_v holds non-finite"),
    (dict(rot_k=2 * np.eye(_D), dual_k=2 * np.eye(_D)), "dual_k is not the inverse transpose of rot_k"),
    (dict(dual_v=_Q.T), "dual_v is not the inverse transpose"),
    (dict(dual_k=np.full((_D, _D), np.inf)), "dual_k holds non-finite"),
    (dict(clip_k=np.nan), "clip_k"),
    (dict(clip_v=np.inf), "clip_v"),
    (dict(clip_k=[0.9, 0.0]), "clip_k"),
    (dict(k_shift=np.full(_D, np.nan)), "k_shift holds non-finite"),
])
def test_layer_params_refuse_invalid_rotations_and_clips(kw, match):
    """A non-orthogonal rotation needs its dual R^-T, and a dual must be that; NaN/inf values
    and clips outside (0, 1] are refused."""
    args = dict(rot_k=_Q, rot_v=_Q[::-1], clip_k=0.9, clip_v=0.8) | kw
    with pytest.raises(ValueError, match=match):
        oj.LayerParams.create(args.pop("rot_k"), args.pop("rot_v"), args.pop("clip_k"), args.pop("clip_v"),
                              num_layers=2, kv_heads=3, **args)


def test_layer_params_accept_rotations_near_orthogonal_and_with_their_duals():
    """Rotations as calibration makes them (float64 eigh + Hadamard, rounded to float32; or
    float32 eigh) pass; so does a scaled rotation with its exact dual."""
    rng = np.random.default_rng(2)
    for d in (64, 256):
        c = rng.standard_normal((d, 4 * d))
        lam, u = np.linalg.eigh(c @ c.T)
        r64 = np.asarray(rotation.compose(u.astype(np.float32), lam.astype(np.float32)))
        _, u32 = jnp.linalg.eigh(jnp.asarray(c @ c.T, jnp.float32))
        for r in (r64, np.asarray(u32) @ np.asarray(rotation.hadamard(d))):
            oj.LayerParams.create(r, r, 0.9, 0.8, num_layers=1, kv_heads=1)
    s = np.exp(rng.uniform(-3, 3, _D))  # conditioning e^6 ~ 400, as error-shaped rotations reach
    oj.LayerParams.create(_Q * s, _Q, 0.9, 0.8, num_layers=1, kv_heads=1, dual_k=(_Q / s).astype(np.float32))


@pytest.mark.parametrize("heads, d, stacked", [(1, 16, False), (2, 8, False), (2, 16, True)])
def test_params_for_another_cache_are_refused_by_name(heads, d, stacked):
    """Params for another head count or head dim (or the whole stack) fail with a message that
    names the parameter and the cache's shape, in append, write_prompt and attend."""
    spec = CacheSpec(num_layers=1, batch=1, kv_heads=2, head_dim=16, max_len=64, sink=4, window=8)
    params = oj.LayerParams.create(np.eye(d), np.eye(d), 0.9, 0.9, num_layers=2, kv_heads=heads)
    params = params if stacked else params.layer(0)
    cache = oj.OscarCache.init(spec).layer(0)
    x = jnp.ones((1, 4, 2, 16))
    match = r"params\.rot_k\.shape=.*expected \[2, 16, 16\] for this cache"
    with pytest.raises(ValueError, match="write_prompt: " + match):
        oj.write_prompt(cache, x, x, jnp.array([4]), params)
    with pytest.raises(ValueError, match="append: " + match):
        oj.append(cache, x[:, :1], x[:, :1], params)
    with pytest.raises(ValueError, match="attend: " + match):
        oj.attend(jnp.ones((1, 1, 4, 16)), cache, params, implementation="xla")
