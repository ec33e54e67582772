"""Sharded attend on 8 fake CPU devices equals the one-device result; one compilation; KV heads
repeated over a `model` axis larger than them attend as the one-device cache does."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import oscar_jax as oj
from oscar_jax import sharding
from oscar_jax.config import CacheSpec
from cache_oracle import random_kv


def _step(cache, params, k, v, q):
    """One decode step over every layer: append then attend (lax.scan over layers)."""

    def layer(carry, xs):
        layer_cache, layer_params = xs
        layer_cache = oj.append(layer_cache, k, v, layer_params)
        o, _ = oj.attend(q, layer_cache, layer_params, implementation="xla")
        return carry + o.astype(jnp.float32), layer_cache

    out, cache = jax.lax.scan(layer, jnp.zeros(q.shape, jnp.float32), (cache, params))
    return out, cache


@pytest.mark.parametrize("kv_heads", [8, 3])
def test_sharded_equals_single_device_and_compiles_once(kv_heads):
    assert jax.device_count() == 8, "tests/conftest.py sets 8 host devices"
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    rng = np.random.default_rng(kv_heads)
    b, d, g, layers = 4, 16, 2, 2
    spec = CacheSpec(num_layers=layers, batch=b, kv_heads=kv_heads, head_dim=d, max_len=64,
                     sink=4, window=8)
    rot = np.linalg.qr(rng.standard_normal((layers, kv_heads, d, d)))[0].astype(np.float32)
    params = oj.LayerParams.create(rot, rot[::-1], 0.95, 0.9, num_layers=layers, kv_heads=kv_heads)
    prompt = random_kv(rng, b, 20, kv_heads, d)
    lengths = jnp.array([20, 3, 12, 17])
    cache = oj.OscarCache.init(spec)
    cache = jax.vmap(oj.write_prompt, in_axes=(0, None, None, None, 0))(cache, prompt, prompt, lengths, params)

    specs = sharding.partition_specs(cache, mesh)
    if kv_heads == 8:
        assert specs.hist_codes_k == P(None, "data", "model")
    else:  # 3 KV heads do not divide the 4-way model axis: replicated
        assert specs.hist_codes_k == P(None, "data")
    sharded_cache = jax.device_put(cache, sharding.shardings(cache, mesh))
    sharded_params = jax.device_put(params, sharding.shardings(params, mesh))
    batch_sharding = NamedSharding(mesh, P("data"))

    # Pin the cache's output sharding so step i's output is step i+1's input layout.
    step = jax.jit(_step, donate_argnums=0,
                   out_shardings=(batch_sharding, sharding.shardings(cache, mesh)))
    single = jax.jit(_step)
    for i in range(20):
        k, v = (random_kv(rng, b, 1, kv_heads, d) for _ in range(2))
        q = rng.standard_normal((b, 1, kv_heads * g, d)).astype(np.float32)
        want, cache = single(cache, params, k, v, q)
        got, sharded_cache = step(sharded_cache, sharded_params,
                                  *(jax.device_put(x, batch_sharding) for x in (k, v, q)))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert sharded_cache.hist_codes_k.sharding.spec == specs.hist_codes_k
    np.testing.assert_array_equal(np.asarray(sharded_cache.hist_codes_v), np.asarray(cache.hist_codes_v))
    assert step._cache_size() == 1


def _sharded_and_single_steps(mesh, cache_shardings):
    """(`parallel.append_attend` on `mesh`, the cache donated, and the same append + attend on
    one device in XLA): the two decode steps the sharded tests compare."""
    from oscar_jax import parallel

    step = jax.jit(lambda c, p, q, k, v: parallel.append_attend(c, p, q, k, v, mesh=mesh), donate_argnums=0,
                   out_shardings=(None, cache_shardings))

    @jax.jit
    def single(c, p, q, k, v):
        c = oj.append(c, k, v, p)
        return oj.attend(q, c, p, implementation="xla")[0], c

    return step, single


def test_kv_heads_repeated_over_a_larger_model_axis():
    """2 KV heads of 8 query heads on data 2 x model 4 (`kv_head_copies`: 2): the cache and its
    params with each KV head repeated on 2 devices (`repeat_kv_heads`), one KV head and 2 query
    heads a device, give the one-device outputs over 12 steps (query head h keeps KV head h // 4),
    and their history holds each head twice; one compilation."""

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    assert sharding.kv_head_copies(2, 8, mesh) == 2
    assert [sharding.kv_head_copies(h, hq, mesh) for h, hq in ((4, 8), (8, 8), (2, 6), (3, 12))] == [1, 1, 1, 1]
    rng = np.random.default_rng(5)
    b, h, d = 2, 2, 16
    spec = CacheSpec(1, b, h, d, 4 + 8 + 32, sink=4, window=8)
    rot = np.linalg.qr(rng.standard_normal((2, h, d, d)))[0].astype(np.float32)
    params = oj.LayerParams.create(rot[0], rot[1], 0.95, 0.9, num_layers=1, kv_heads=h,
                                   k_shift=rng.standard_normal((h, d)).astype(np.float32)).layer(0)
    prompt = random_kv(rng, b, 20, h, d)
    cache = oj.write_prompt(oj.OscarCache.init(spec, stacked=False), prompt, prompt, jnp.array([20, 7]), params)
    wide, wide_params = sharding.repeat_kv_heads(cache, 2), sharding.repeat_kv_heads(params, 2)
    assert wide.spec.kv_heads == 4 and wide.sink_k.shape[1] == wide_params.rot_k.shape[0] == 4
    cache_shardings = sharding.shardings(wide, mesh)
    sharded = jax.device_put(wide, cache_shardings)
    assert {s.data.shape for s in sharded.hist_codes_k.addressable_shards} == {(1, 1, *wide.hist_codes_k.shape[2:])}
    step, single = _sharded_and_single_steps(mesh, cache_shardings)

    wide_params = jax.device_put(wide_params, sharding.shardings(wide_params, mesh))
    for _ in range(12):
        k, v = (random_kv(rng, b, 1, h, d) for _ in range(2))
        q = rng.standard_normal((b, 1, 8, d)).astype(np.float32)
        want, cache = single(cache, params, q, k, v)
        got, sharded = step(sharded, wide_params, q, *(np.repeat(x, 2, axis=2) for x in (k, v)))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(sharded.hist_codes_v), np.repeat(np.asarray(cache.hist_codes_v), 2, 1))
    assert step._cache_size() == 1


def test_sequence_axis_of_each_history_array():
    """A `seq` rule shards the token axis of every history array: the third of the
    (token-major) K codes, the last of the channel-major V codes and of the metadata."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    spec = CacheSpec(num_layers=1, batch=2, kv_heads=3, head_dim=16, max_len=4 + 64 + 8,
                     sink=4, window=8)  # 64 history tokens: 16 packed rows
    cache = oj.OscarCache.init(spec).layer(0)
    specs = sharding.partition_specs(cache, mesh, {"batch": "data", "seq": "model"})
    assert specs.hist_codes_k == P("data", None, "model")
    assert specs.hist_codes_v == P("data", None, None, "model")
    for name in ("hist_lo_k", "hist_scale_k", "hist_lo_v", "hist_scale_v"):
        assert getattr(specs, name) == P("data", None, None, None, "model"), name
    assert specs.sink_k == specs.recent_v == P("data")  # the sink and ring are never split along tokens


@pytest.mark.parametrize("shape, axes", [((8,), ("seq",)), ((2, 4), ("model", "seq"))])
def test_sequence_parallel_append_attend_equals_single_device(shape, axes):
    """parallel.append_attend with the history split along tokens over `seq`: 40 decode steps
    (their evictions cross every slice boundary) give one device's outputs and the same cache
    bytes; the sink and ring are replicated; one compilation."""
    from oscar_jax import parallel

    mesh = Mesh(np.array(jax.devices()).reshape(shape), axes)
    rng = np.random.default_rng(len(axes))
    b, h, d, g = 2, 2, 16, 2
    spec = CacheSpec(1, b, h, d, 4 + 8 + 48, sink=4, window=8)
    spec = CacheSpec(1, b, h, d, parallel.seq_max_len(spec, 8), sink=4, window=8)
    assert spec.hist_capacity == 64  # 8 slices of 8 tokens
    rot = np.linalg.qr(rng.standard_normal((h, d, d)))[0].astype(np.float32)
    params = oj.LayerParams.create(rot, rot[::-1], 0.95, 0.9, num_layers=1, kv_heads=h).layer(0)
    prompt = random_kv(rng, b, 30, h, d)
    cache = oj.write_prompt(oj.OscarCache.init(spec, stacked=False), prompt, prompt, jnp.array([30, 5]), params)
    cache_shardings = sharding.shardings(cache, mesh)
    heads = "model" if "model" in axes else None
    assert cache_shardings.hist_codes_v.spec == P(None, heads, None, "seq")
    assert cache_shardings.sink_k.spec == cache_shardings.recent_v.spec == sharding.spec(None, heads)
    sharded = jax.device_put(cache, cache_shardings)
    sharded_params = jax.device_put(params, sharding.shardings(params, mesh))
    step, single = _sharded_and_single_steps(mesh, cache_shardings)

    for _ in range(40):
        k, v = (random_kv(rng, b, 1, h, d) for _ in range(2))
        q = rng.standard_normal((b, 1, h * g, d)).astype(np.float32)
        want, cache = single(cache, params, q, k, v)
        got, sharded = step(sharded, sharded_params, q, k, v)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    for name in ("hist_codes_k", "hist_codes_v", "hist_lo_k", "hist_scale_v", "sink_v", "recent_k", "lengths"):
        np.testing.assert_array_equal(np.asarray(getattr(sharded, name)), np.asarray(getattr(cache, name)), name)
    assert step._cache_size() == 1


def test_sequence_parallel_refuses_what_it_cannot_run():
    from oscar_jax import parallel

    mesh = Mesh(np.array(jax.devices()), ("seq",))
    spec = CacheSpec(1, 1, 2, 16, 4 + 8 + 20, sink=4, window=8)  # 20 history tokens: 5 packed rows
    cache = oj.OscarCache.init(spec, stacked=False)
    params = oj.LayerParams.create(np.eye(16), np.eye(16), 1.0, 1.0, num_layers=1, kv_heads=2).layer(0)
    q, k = jnp.ones((1, 1, 2, 16)), jnp.ones((1, 1, 2, 16))
    with pytest.raises(ValueError, match="5 packed rows do not split over seq=8"):
        parallel.append_attend(cache, params, q, k, k, mesh=mesh)
    cache = oj.OscarCache.init(dataclasses.replace(spec, max_len=parallel.seq_max_len(spec, 8)), stacked=False)
    with pytest.raises(ValueError, match="implementation='pallas' does not support"):  # D = 16
        parallel.append_attend(cache, params, q, k, k, mesh=mesh, implementation="pallas")
    chunk = jnp.ones((1, 10, 2, 16))  # C = 10 > W = 8: XLA only, on a mesh as on one device
    with pytest.raises(ValueError, match="implementation='pallas_tpu' does not support .*C=10"):
        parallel.append_attend(cache, params, chunk, chunk, chunk, mesh=mesh, implementation="pallas_tpu",
                               interpret=True)
