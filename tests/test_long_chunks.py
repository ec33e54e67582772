"""Chunks of any length through the mixed cache (`attention.append_attend`, `paged.append_attend`):
a chunk's queries see the tokens before it as the cache holds them after the chunk's write and
its own tokens as written (bf16), causally; checked against a float64 oracle built from the
token model of `cache_oracle` for chunks shorter and longer than the window. A chunk's bulk
write leaves the cache bit for bit as its tokens appended one at a time; the paged cache
equals the contiguous one; bad chunks are refused by name."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from cache_oracle import SequenceOracle, random_kv, signed_permutation
from oscar_jax import attention, dispatch, paged, reference, updates
from oscar_jax import cache as oc
from oscar_jax.config import CacheSpec, QuantConfig
from test_paged import _assert_same_tokens, _give_pages

HKV, G, D, S0, W = 2, 2, 32, 4, 8
MAX_LEN = S0 + W + 64


def _setup(seed: int, quant: QuantConfig = QuantConfig(bits=2), batch: int = 3):
    rng = np.random.default_rng(seed)
    spec = CacheSpec(1, batch, HKV, D, MAX_LEN, S0, W, quant)
    rot_k, rot_v = signed_permutation(rng, HKV, D), signed_permutation(rng, HKV, D)
    shift = rng.uniform(-1, 1, (HKV, D)).astype(ml_dtypes.bfloat16).astype(np.float32)
    params = oc.LayerParams.create(rot_k, rot_v, 0.96, 0.92, num_layers=1, kv_heads=HKV, k_shift=shift).layer(0)
    return rng, spec, params


_write_prompt = jax.jit(lambda cache, k, v, n, params: updates.write_prompt(cache, k, v, n, params,
                                                                            implementation="xla"))
_append = jax.jit(lambda cache, k, v, params: updates.append(cache, k, v, params, implementation="xla"))
_append_attend = jax.jit(lambda q, k, v, cache, params: attention.append_attend(q, k, v, cache, params,
                                                                                implementation="xla"))


def _prompt(rng, spec: CacheSpec, params, lengths):
    """A cache holding prompts of `lengths` tokens, and their k, v [B, max_len, Hkv, D]."""
    k, v = (random_kv(rng, spec.batch, spec.max_len, HKV, D) for _ in range(2))
    cache = _write_prompt(oc.OscarCache.init(spec, stacked=False), k, v, np.asarray(lengths, np.int32), params)
    return cache, k, v


def _oracle_attention(spec: CacheSpec, params, keys, values, q, n0: int, scale: float):
    """float64 (o [C, Hq, D], lse [C, Hq]) of one row: keys/values [T, Hkv, D] every token the row
    holds (prompt then chunk, model basis), q [C, Hq, D] the chunk's queries. The tokens before
    the chunk hold what the token model stores after the chunk's write (quantised past the sink
    and the last W); the chunk's own tokens their bf16 rotation."""
    c = q.shape[0]
    shift = np.asarray(params.k_shift, np.float64)
    stored = []
    for x, rot, clip in ((keys - shift, params.rot_k, params.clip_k), (values, params.rot_v, params.clip_v)):
        model = SequenceOracle(dataclasses.replace(spec, batch=1), np.asarray(rot), float(clip))
        model.append(np.asarray(x, np.float32)[None])  # a one-row token model of the whole row
        held, n = model.expected(0)  # [H, n, D]
        own = np.einsum("thd,hde->hte", np.asarray(x[n0:], np.float32), np.asarray(rot))
        held[:, n0:] = own.astype(ml_dtypes.bfloat16).astype(np.float32)
        stored.append(held.astype(np.float64))
    ks, vs = stored
    g = q.shape[1] // HKV
    o = np.zeros(q.shape)
    lse = np.zeros(q.shape[:2])
    for i in range(c):
        for hq in range(q.shape[1]):
            h = hq // g
            qr = np.asarray(q[i, hq], np.float64) @ np.asarray(params.rot_k, np.float64)[h]
            s = ks[h, :n0 + i + 1] @ qr * scale
            top = s.max()
            p = np.exp(s - top)
            o[i, hq] = (p / p.sum()) @ vs[h, :n0 + i + 1] @ np.asarray(params.rot_v, np.float64)[h].T
            lse[i, hq] = top + np.log(p.sum()) + scale * float(np.asarray(q[i, hq], np.float64) @ shift[h])
    return o, lse


@pytest.mark.parametrize("c", [1, W, W + 5, 3 * W + 5])
def test_chunk_attention_equals_the_float64_oracle(c):
    """Chunks shorter and longer than the window, rows starting inside the sink, the ring and
    past it: one rule (tokens before the chunk as the cache holds them after its write, its own
    bf16), jitted with the chunk size static."""
    rng, spec, params = _setup(c)
    lengths = [0, 6, int(rng.integers(S0 + W + 1, MAX_LEN - c + 1))]
    cache, k0, v0 = _prompt(rng, spec, params, lengths)
    k, v = random_kv(rng, spec.batch, c, HKV, D), random_kv(rng, spec.batch, c, HKV, D)
    q = random_kv(rng, spec.batch, c, HKV * G, D)
    scale = D ** -0.5
    o, lse, after = _append_attend(q, k, v, cache, params)
    np.testing.assert_array_equal(after.lengths, np.asarray(lengths) + c)
    for b, n0 in enumerate(lengths):
        keys = np.concatenate([k0[b, :n0], k[b]])
        values = np.concatenate([v0[b, :n0], v[b]])
        o_ref, lse_ref = _oracle_attention(spec, params, keys, values, q[b], n0, scale)
        np.testing.assert_allclose(o[b], o_ref, atol=2e-5, rtol=2e-5, err_msg=f"row {b}")
        np.testing.assert_allclose(lse[b], lse_ref, atol=2e-5, rtol=2e-5, err_msg=f"row {b}")


@pytest.mark.parametrize("c", [W + 5, 3 * W + 5])
def test_flash_attention_of_long_chunks_equals_the_float64_oracle(c):
    """C > W through `flash_attend(own=...)`, the path of implementation "cudnn" (here jax's XLA
    attention, bf16 like cuDNN's): the float64 oracle's outputs within bf16 rounding (queries,
    keys, probabilities and output in bf16), rows starting at 0, inside the ring and past it."""
    rng, spec, params = _setup(100 + c)
    lengths = [0, 6, int(rng.integers(S0 + W + 1, MAX_LEN - c + 1))]
    cache, k0, v0 = _prompt(rng, spec, params, lengths)
    k, v = random_kv(rng, spec.batch, c, HKV, D), random_kv(rng, spec.batch, c, HKV, D)
    q = random_kv(rng, spec.batch, c, HKV * G, D)
    scale = D ** -0.5
    flash = jax.jit(lambda q, k, v, cache, params: attention.flash_attend(
        q, _append(cache, k, v, params), params, own=updates.stored_kv(k, v, params), implementation="xla"))
    o, lse = flash(q, k, v, cache, params)
    for b, n0 in enumerate(lengths):
        keys = np.concatenate([k0[b, :n0], k[b]])
        values = np.concatenate([v0[b, :n0], v[b]])
        o_ref, lse_ref = _oracle_attention(spec, params, keys, values, q[b], n0, scale)
        np.testing.assert_allclose(o[b], o_ref, atol=3e-2 * np.abs(o_ref).max(), rtol=0, err_msg=f"row {b}")
        np.testing.assert_allclose(lse[b], lse_ref, atol=2e-2, rtol=1e-2, err_msg=f"row {b}")


def test_chunks_within_the_window_are_append_then_attend():
    """C <= W: exactly `updates.append` then `attend`, the contract decode and the kernels follow."""
    rng, spec, params = _setup(7)
    cache, _, _ = _prompt(rng, spec, params, [3, 15, 40])
    k, v = random_kv(rng, spec.batch, W, HKV, D), random_kv(rng, spec.batch, W, HKV, D)
    q = random_kv(rng, spec.batch, W, HKV * G, D)
    o, lse, after = _append_attend(q, k, v, cache, params)
    appended = _append(cache, k, v, params)
    o_ref, lse_ref = jax.jit(lambda q, cache, params: attention.attend(q, cache, params, implementation="xla"))(
        q, appended, params)
    np.testing.assert_array_equal(o, o_ref)
    np.testing.assert_array_equal(lse, lse_ref)
    for x, y in zip(jax.tree.leaves(after), jax.tree.leaves(appended)):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("quant", [QuantConfig(bits=2), QuantConfig(bits=4, group_size=16, scale_dtype="float32")],
                         ids=["int2", "int4-g16-f32"])
def test_long_chunk_write_equals_one_token_appends(quant):
    """A chunk longer than the window (C = 3W + 5) writes the sink, ring and history codes and
    metadata that its tokens appended one at a time write, bit for bit (the uniform quantiser
    is per token, min and max exact), from rows starting empty, inside the ring and with a
    history."""
    rng, spec, params = _setup(11, quant)
    cache, _, _ = _prompt(rng, spec, params, [0, 9, 37])
    c = 3 * W + 5
    k, v = random_kv(rng, spec.batch, c, HKV, D), random_kv(rng, spec.batch, c, HKV, D)
    bulk = _append(cache, k, v, params)
    for i in range(c):
        cache = _append(cache, k[:, i:i + 1], v[:, i:i + 1], params)
    for name in ("sink_k", "sink_v", "recent_k", "recent_v", *(f"hist_{f}_{w}" for f in ("codes", "lo", "scale")
                                                                  for w in "kv"), "lengths", "overflow"):
        np.testing.assert_array_equal(getattr(bulk, name), getattr(cache, name), err_msg=name)


def test_paged_long_chunk_equals_contiguous():
    """A chunk longer than the window through a shuffled block table: the same tokens as the
    contiguous cache and the same outputs, bit for bit."""
    rng, spec, params = _setup(3)
    page, pages_per_seq = 16, 4
    spec = CacheSpec(1, 3, HKV, D, S0 + W + pages_per_seq * page, S0, W, spec.quant)
    num_pages = 3 * pages_per_seq + 1
    free = [int(i) for i in rng.permutation(num_pages)]
    lengths = np.asarray([2, 20, 30], np.int32)
    k0, v0 = random_kv(rng, 3, 30, HKV, D), random_kv(rng, 3, 30, HKV, D)
    c = 2 * W + 3
    pc = _give_pages(paged.PagedCache.init(spec, page, num_pages), free, lengths + c)
    pc = jax.jit(lambda pc, k, v, n, params: paged.write_prompt(pc, jnp.arange(3), k, v, n, params,
                                                                implementation="xla"))(pc, k0, v0, lengths, params)
    cc = _write_prompt(oc.OscarCache.init(spec, stacked=False), k0, v0, lengths, params)
    k, v = random_kv(rng, 3, c, HKV, D), random_kv(rng, 3, c, HKV, D)
    q = random_kv(rng, 3, c, HKV * G, D)
    o_p, lse_p, pc = jax.jit(lambda q, k, v, pc, params: paged.append_attend(q, k, v, pc, params,
                                                                             implementation="xla"))(q, k, v, pc, params)
    o_c, lse_c, cc = _append_attend(q, k, v, cc, params)
    _assert_same_tokens(pc, cc)
    np.testing.assert_array_equal(o_p, o_c)
    np.testing.assert_array_equal(lse_p, lse_c)


def test_auto_attends_long_chunks_in_xla_on_gpu():
    """"auto" keeps the Triton kernel for chunks of W queries and takes XLA past them."""
    spec = CacheSpec(1, 1, HKV, 64, MAX_LEN, S0, W, QuantConfig(bits=2))  # a shape the Triton kernel takes
    for op in ("attend", "paged_attend"):
        assert dispatch.resolve(op, "auto", spec, queries=W, group=G, backend="gpu") == "pallas"
        assert dispatch.resolve(op, "auto", spec, queries=W + 1, group=G, backend="gpu") == "xla"


def test_bad_chunks_are_refused_by_name():
    rng, spec, params = _setup(5, batch=1)
    cache, _, _ = _prompt(rng, spec, params, [20])
    kv = lambda c: random_kv(rng, 1, c, HKV, D)
    with pytest.raises(ValueError, match=f"k has C={MAX_LEN + 1} tokens: a chunk holds at most the cache's "
                                         f"max_len={MAX_LEN}"):
        updates.append(cache, kv(MAX_LEN + 1), kv(MAX_LEN + 1), params)
    c = MAX_LEN - 19
    with pytest.raises(ValueError, match=f"append of C={c} tokens overflows max_len={MAX_LEN}"):
        attention.append_attend(random_kv(rng, 1, c, HKV * G, D), kv(c), kv(c), cache, params)
    with pytest.raises(ValueError, match="implementation='pallas' does not support .*C=13 queries"):
        attention.append_attend(random_kv(rng, 1, 13, HKV * G, D), kv(13), kv(13), cache, params,
                                implementation="pallas", interpret=True)
    # cuDNN takes chunks longer than the window (`flash_attend`): off a GPU only the platform refuses it.
    with pytest.raises(ValueError, match="implementation='cudnn' cannot run here: it compiles for the 'gpu'"):
        attention.append_attend(random_kv(rng, 1, 13, HKV * G, D), kv(13), kv(13), cache, params,
                                implementation="cudnn")
    with pytest.raises(ValueError, match="q has C=13 queries and k C=12 tokens"):
        attention.append_attend(random_kv(rng, 1, 13, HKV * G, D), kv(12), kv(12), cache, params)
    long_q = jnp.asarray(random_kv(rng, 1, 13, HKV * G, D))
    with pytest.raises(ValueError, match="at most window W=8 per call .*append_attend"):
        attention.attend(long_q, cache, params)
    with pytest.raises(ValueError, match="more than the window W=8: .*own="):
        reference.attend(long_q, cache, params)
