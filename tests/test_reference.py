"""Reference attention against an independent dense float64 computation."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import logsumexp

import oscar_jax as oj
from oscar_jax import reference
from oscar_jax.config import CacheSpec, QuantConfig
from cache_oracle import SequenceOracle, random_kv, signed_permutation


def _dense_attention(q, keys, values, n, scale):
    """q [C, Hq, D] (rotated), keys/values [Hkv, n, D] -> o_rot [C, Hq, D], lse [C, Hq]; float64."""
    c, hq, _ = q.shape
    g = hq // keys.shape[0]
    o = np.zeros(q.shape)
    lse = np.zeros((c, hq))
    for i in range(c):
        visible = n - c + i + 1  # causal: keys at positions <= the query's
        for h in range(hq):
            s = keys[h // g, :visible].astype(np.float64) @ q[i, h].astype(np.float64) * scale
            lse[i, h] = logsumexp(s)
            o[i, h] = np.exp(s - lse[i, h]) @ values[h // g, :visible]
    return o, lse


@pytest.mark.parametrize("g", [1, 3])
@pytest.mark.parametrize("quant_cfg", [QuantConfig(bits=2), QuantConfig(bits=2, group_size=8),
                                       QuantConfig(bits=2, codebook="lloyd_max")], ids=str)
@pytest.mark.parametrize("v_folded,shift", [(False, False), (True, False), (False, True)])
def test_reference_matches_dense_masked_attention(g, quant_cfg, v_folded, shift):
    """shift: the cache stores k - k_shift; attention must still equal dense attention
    over the true keys (output and log-sum-exp). Fresh random data per case."""
    rng = np.random.default_rng([g, v_folded, shift, zlib.crc32(repr(quant_cfg).encode())])
    b, h, d = 3, 2, 16
    spec = CacheSpec(num_layers=1, batch=b, kv_heads=h, head_dim=d, max_len=64, sink=4, window=8,
                     quant=quant_cfg)
    rk, rv = signed_permutation(rng, h, d), signed_permutation(rng, h, d)
    mu = (rng.standard_normal((h, d)) * 3).astype(np.float32) if shift else np.zeros((h, d), np.float32)
    params = oj.LayerParams.create(rk, rv, 0.95, 0.9, num_layers=1, kv_heads=h, v_folded=v_folded,
                                   k_shift=mu if shift else None).layer(0)
    ok, ov = SequenceOracle(spec, rk, 0.95), SequenceOracle(spec, rv, 0.9)
    t = 40
    lengths = np.array([rng.integers(1, 5), rng.integers(5, 13), rng.integers(20, t + 1)])
    k, v = random_kv(rng, b, t, h, d) + mu, random_kv(rng, b, t, h, d)
    cache = oj.write_prompt(oj.OscarCache.init(spec).layer(0), k, v, jnp.asarray(lengths), params)
    ok.write_prompt(k - mu, lengths), ov.write_prompt(v, lengths)
    c = int(rng.choice([1, 5, 8]))
    k, v = random_kv(rng, b, c, h, d) + mu, random_kv(rng, b, c, h, d)
    cache = oj.append(cache, k, v, params)
    ok.append(k - mu), ov.append(v)

    q = rng.standard_normal((b, c, h * g, d)).astype(np.float32)
    o, lse = jax.jit(reference.attend)(jnp.asarray(q), cache, params)
    scale = d ** -0.5
    for row in range(b):
        keys, n = ok.expected(row)  # k - mu as stored (rotated); the true keys add mu back
        keys = keys + np.einsum("hd,hde->he", mu, rk)[:, None, :]
        vals, _ = ov.expected(row)
        q_rot = np.einsum("chd,hde->che", q[row], np.repeat(rk, g, axis=0))
        want_o, want_lse = _dense_attention(q_rot, keys, vals, n, scale)
        if not v_folded:
            want_o = np.einsum("che,hde->chd", want_o, np.repeat(rv, g, axis=0))
        np.testing.assert_allclose(np.asarray(o[row]), want_o, rtol=2e-4, atol=2e-5)
        np.testing.assert_allclose(np.asarray(lse[row]), want_lse, rtol=1e-5, atol=1e-5)


def test_rotations_cancel_in_attention():
    """With a general orthogonal R_K and R_V and every token in bf16 segments, the output
    equals plain attention on the unrotated keys/values (up to bf16 storage)."""
    rng = np.random.default_rng(11)
    b, h, d, g, t = 2, 2, 32, 2, 20
    spec = CacheSpec(num_layers=1, batch=b, kv_heads=h, head_dim=d, max_len=64, sink=8, window=16)
    rk = np.linalg.qr(rng.standard_normal((h, d, d)))[0].astype(np.float32)
    rv = np.linalg.qr(rng.standard_normal((h, d, d)))[0].astype(np.float32)
    params = oj.LayerParams.create(rk, rv, 1.0, 1.0, num_layers=1, kv_heads=h).layer(0)
    k, v = random_kv(rng, b, t, h, d), random_kv(rng, b, t, h, d)
    lengths = np.array([t, 13])
    cache = oj.write_prompt(oj.OscarCache.init(spec).layer(0), k, v, jnp.asarray(lengths), params)
    q = rng.standard_normal((b, 1, h * g, d)).astype(np.float32)
    o, _ = reference.attend(jnp.asarray(q), cache, params)
    for row in range(b):
        n = lengths[row]
        want, _ = _dense_attention(q[row], np.moveaxis(k[row, :n], 0, 1), np.moveaxis(v[row, :n], 0, 1),
                                   n, d ** -0.5)
        np.testing.assert_allclose(np.asarray(o[row]), want, rtol=3e-2, atol=3e-2)


def test_merge_partials_equals_one_softmax():
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((1, 1, 2, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 1, 30, 8)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((1, 1, 30, 8)), jnp.float32)
    full_mask = jnp.asarray(rng.random((1, 4, 30)) < 0.7).at[:, :, 0].set(True)
    o_full, lse_full = reference.segment_attention(q, k, v, full_mask, 0.3)
    parts = [reference.segment_attention(q, k[:, :, s], v[:, :, s], full_mask[:, :, s], 0.3)
             for s in (slice(0, 7), slice(7, 8), slice(8, 30))]
    o, lse = reference.merge_partials([p[0] for p in parts], [p[1] for p in parts])
    np.testing.assert_allclose(o, o_full, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, lse_full, rtol=1e-6)


def test_window_attention_sees_only_last_window():
    rng = np.random.default_rng(5)
    spec = oj.RingSpec(num_layers=1, batch=2, kv_heads=1, head_dim=8, window=4, capacity=7)
    k, v = random_kv(rng, 2, 12, 1, 8), random_kv(rng, 2, 12, 1, 8)
    ring = oj.ring_write_prompt(oj.RingCache.init(spec).layer(0), k[:, :8], v[:, :8], jnp.array([5, 8]))
    ring = oj.ring_append(ring, k[:, 8:12], v[:, 8:12])  # chunk of 4 = capacity - window + 1
    q = rng.standard_normal((2, 4, 2, 8)).astype(np.float32)
    o, lse = oj.attend_window(jnp.asarray(q), ring)
    seqs = [np.concatenate([k[0, :5], k[0, 8:12]]), k[1, :12]], [np.concatenate([v[0, :5], v[0, 8:12]]), v[1, :12]]
    for row in range(2):
        kk, vv = seqs[0][row][:, 0], seqs[1][row][:, 0]  # [n, D]
        n = kk.shape[0]
        for c in range(4):
            p = n - 4 + c
            lo = max(0, p - spec.window + 1)
            s = kk[lo:p + 1] @ q[row, c].T * 8 ** -0.5  # [keys, Hq]
            w = np.exp(s - logsumexp(s, axis=0))
            np.testing.assert_allclose(np.asarray(o[row, c]), (w.T @ vv[lo:p + 1]), rtol=1e-4, atol=1e-5)
