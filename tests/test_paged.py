"""The paged cache (oscar_jax.paged) against the contiguous one: the same prompts and appends
through randomised block tables hold the same tokens and attend to the same outputs (XLA, and
the TPU kernel in interpret mode); the host free list conserves pages."""

from __future__ import annotations

import dataclasses

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from gpu_cases import lower_for_h200
from oscar_jax import paged, reference, rotation, sharding, updates
from oscar_jax import cache as oc
from oscar_jax.config import CacheSpec, QuantConfig
from oscar_jax.pallas_kernels import layout
from oscar_jax.pallas_kernels.gpu import mixed_attention as triton_attention
from oscar_jax.pallas_kernels.gpu import mixed_attention_mgpu

D, HKV, HQ, S0, W, PAGE = 32, 2, 4, 4, 8, 16


def _spec(batch: int, pages_per_seq: int, quant: QuantConfig = QuantConfig(bits=2), *, d: int = D,
          page: int = PAGE, sink: int = S0, window: int = W) -> CacheSpec:
    return CacheSpec(1, batch, HKV, d, sink + window + pages_per_seq * page, sink, window, quant)


def _params(d: int = D):
    rot = rotation.hadamard(d)
    return oc.LayerParams.create(rot, rot, 0.96, 0.92, num_layers=1, kv_heads=HKV,
                                 k_shift=np.linspace(-1, 1, d, dtype=np.float32)).layer(0)


def _kv(rng, b, t, d: int = D):
    return tuple(jnp.asarray(rng.normal(size=(b, t, HKV, d)), jnp.float32) for _ in range(2))


def _give_pages(cache: paged.PagedCache, free: list[int], final_lengths) -> paged.PagedCache:
    """Extend each slot's block table to the pages `final_lengths` need, taking ids off `free`."""
    table = np.asarray(cache.block_table).copy()
    for b, n in enumerate(final_lengths):
        have = int((table[b] >= 0).sum())
        need = int(paged.pages_for(int(n), cache.spec, cache.page_tokens))
        for j in range(have, need):
            table[b, j] = free.pop()
    return dataclasses.replace(cache, block_table=jnp.asarray(table))


def _assert_same_tokens(pc: paged.PagedCache, cc: oc.OscarCache):
    kp, vp, valid = oc.dense_view(paged.gather(pc))
    kc, vc, _ = oc.dense_view(cc)
    held = np.asarray(valid)[:, None, :, None]
    np.testing.assert_array_equal(np.where(held, kp, 0), np.where(held, kc, 0))
    np.testing.assert_array_equal(np.where(held, vp, 0), np.where(held, vc, 0))
    np.testing.assert_array_equal(pc.lengths, cc.lengths)
    np.testing.assert_array_equal(pc.overflow, cc.overflow)


@pytest.mark.parametrize("seed", range(3))
def test_paged_equals_contiguous(seed):
    """Prompts (bulk write), decode steps and an extend chunk through a random block table
    (page ids shuffled, slots interleaved) hold the contiguous cache's tokens; attention
    through the table gives the contiguous outputs: XLA exactly, the TPU kernel (interpret)
    within its bf16-pass error."""
    rng = np.random.default_rng(seed)
    batch, pages_per_seq = 3, 4
    spec = _spec(batch, pages_per_seq)
    params = _params()
    num_pages = batch * pages_per_seq + 2
    free = [int(i) for i in rng.permutation(num_pages)]
    t = int(rng.integers(S0 + W + PAGE, spec.max_len - 12))
    lengths = rng.integers(1, t + 1, size=batch).astype(np.int32)
    lengths[0] = t
    k, v = _kv(rng, batch, t)
    pc = _give_pages(paged.PagedCache.init(spec, PAGE, num_pages), free, lengths)
    pc = paged.write_prompt(pc, np.arange(batch), k, v, lengths, params)
    cc = updates.write_prompt(oc.OscarCache.init(spec, stacked=False), k, v, lengths, params)
    _assert_same_tokens(pc, cc)
    for c in (1, 1, 1, 5, 1):
        pc = _give_pages(pc, free, np.asarray(pc.lengths) + c)
        k, v = _kv(rng, batch, c)
        pc, cc = paged.append(pc, k, v, params), updates.append(cc, k, v, params)
    _assert_same_tokens(pc, cc)
    q = jnp.asarray(rng.normal(size=(batch, 1, HQ, D)), jnp.float32)
    o, lse = reference.attend(q, cc, params)
    o_xla, lse_xla = paged.attend(q, pc, params, implementation="xla")
    np.testing.assert_array_equal(o_xla, o)
    np.testing.assert_array_equal(lse_xla, lse)
    o_tpu, lse_tpu = paged.attend(q, pc, params, implementation="pallas_tpu", interpret=True)
    np.testing.assert_allclose(o_tpu, o, atol=5e-5, rtol=5e-5)
    np.testing.assert_allclose(lse_tpu, lse, atol=5e-5, rtol=5e-5)


def test_write_prompt_leaves_other_slots_and_pages():
    """A prompt written into one slot changes that slot and its pages only."""
    rng = np.random.default_rng(5)
    spec = _spec(3, 2)
    params = _params()
    pc = paged.PagedCache.init(spec, PAGE, 8)
    pc = dataclasses.replace(pc, block_table=jnp.asarray([[0, 1], [2, 3], [4, 5]], jnp.int32))
    k, v = _kv(rng, 3, spec.max_len)
    pc = paged.write_prompt(pc, np.arange(3), k, v, np.full(3, spec.max_len, np.int32), params)
    k1, v1 = _kv(rng, 1, 30)
    after = paged.write_prompt(pc, np.array([1]), k1, v1, np.array([30], np.int32), params)
    for name in paged.HIST_FIELDS:
        before_x, after_x = np.asarray(getattr(pc, name)), np.asarray(getattr(after, name))
        np.testing.assert_array_equal(np.delete(after_x, [2, 3], axis=0), np.delete(before_x, [2, 3], axis=0))
        assert not np.array_equal(after_x[2], before_x[2])
    for name in ("sink_k", "recent_v", "lengths"):
        np.testing.assert_array_equal(np.asarray(getattr(after, name))[[0, 2]], np.asarray(getattr(pc, name))[[0, 2]])
    assert int(after.lengths[1]) == 30


def test_insert_keeps_the_shared_pages():
    """insert(..., keep=[1]) writes a slot's rows and its second page, never its first (a shared
    prefix page holding those tokens already)."""
    rng = np.random.default_rng(6)
    spec = _spec(2, 2)
    params = _params()
    pc = dataclasses.replace(paged.PagedCache.init(spec, PAGE, 4), block_table=jnp.asarray([[0, 1], [2, 3]], jnp.int32))
    k, v = _kv(rng, 2, spec.max_len)
    pc = paged.write_prompt(pc, np.arange(2), k, v, np.full(2, spec.max_len, np.int32), params)
    k1, v1 = _kv(rng, 1, spec.max_len)
    part = updates.write_prompt(oc.OscarCache.init(dataclasses.replace(spec, batch=1), stacked=False), k1, v1,
                                np.array([spec.max_len], np.int32), params)
    after = paged.insert(pc, np.array([1]), part, keep=np.array([1]))
    for name in paged.HIST_FIELDS:
        before_x, after_x = np.asarray(getattr(pc, name)), np.asarray(getattr(after, name))
        np.testing.assert_array_equal(after_x[:3], before_x[:3])
        assert not np.array_equal(after_x[3], before_x[3])
    np.testing.assert_array_equal(after.sink_k[1], part.sink_k[0])


def test_missing_page_is_refused():
    rng = np.random.default_rng(1)
    spec = _spec(2, 2)
    params = _params()
    pc = dataclasses.replace(paged.PagedCache.init(spec, PAGE, 4),
                             block_table=jnp.asarray([[0, 1], [2, -1]], jnp.int32))
    k, v = _kv(rng, 2, spec.max_len)
    with pytest.raises(ValueError, match=r"slots \[1\] lack block-table pages"):
        paged.write_prompt(pc, np.arange(2), k, v, np.full(2, spec.max_len, np.int32), params)
    n = S0 + W + PAGE  # one full page of history: the next append needs page 2
    pc = paged.write_prompt(pc, np.arange(2), k, v, np.full(2, n, np.int32), params)
    k1, v1 = _kv(rng, 2, 1)
    with pytest.raises(ValueError, match=r"slots \[1\] lack the block-table page"):
        paged.append(pc, k1, v1, params)


@pytest.mark.parametrize("page_tokens", [0, 6, 48, 384])
def test_bad_page_tokens(page_tokens):
    with pytest.raises(ValueError, match="page_tokens"):
        paged.PagedCache.init(_spec(1, 1), page_tokens, 4)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=40))
def test_allocator_conserves_pages(ops):
    """allocated + free = total after every allocate / free; ids are never handed out twice."""
    alloc = paged.PageAllocator(12)
    owned: list[list[int]] = []
    for take, n in ops:
        if take:
            if n > alloc.num_free:
                with pytest.raises(paged.PagesExhausted):
                    alloc.allocate(n)
            else:
                owned.append(alloc.allocate(n))
        elif owned:
            alloc.free(owned.pop(n % len(owned)))
        held = [i for ids in owned for i in ids]
        assert len(held) == len(set(held)) == alloc.num_used
        assert alloc.num_used + alloc.num_free == 12
    if owned and owned[0]:
        alloc.free(owned[0])
        with pytest.raises(ValueError, match="not allocated"):
            alloc.free(owned[0][:1])


def _paged_case(rng, *, d, page, pages_per_seq, sink, window, lengths, g=HQ // HKV):
    """A paged cache written with `lengths` through a shuffled table, and its gathered view."""
    batch = len(lengths)
    spec = _spec(batch, pages_per_seq, d=d, page=page, sink=sink, window=window)
    num_pages = batch * pages_per_seq + 3
    pc = _give_pages(paged.PagedCache.init(spec, page, num_pages), [int(i) for i in rng.permutation(num_pages)],
                     lengths)
    k, v = _kv(rng, batch, spec.max_len, d)
    pc = paged.write_prompt(pc, np.arange(batch), k, v, np.asarray(lengths, np.int32), _params(d))
    return pc, jnp.asarray(rng.normal(size=(batch, 1, g * HKV, d)), jnp.float32)


def _check_triton_paged(pc, q, interpret: bool):
    """The Triton kernel through the block table == the same kernel over the gathered cache
    (same block sizes: the same arithmetic in the same order)."""
    blocks = triton_attention.BlockSizes(block_rows=min(64, pc.page_tokens // 4), block_q=16)
    kw = dict(sink=pc.spec.sink, window=pc.spec.window, bits=2, levels=pc.spec.quant.levels,
              softmax_scale=pc.spec.head_dim ** -0.5, interpret=interpret, block_sizes=blocks)
    o, lse = triton_attention.mixed_attention(q, layout.CacheArrays.of(pc), block_table=pc.block_table, **kw)
    o_ref, lse_ref = triton_attention.mixed_attention(q, layout.CacheArrays.of(paged.gather(pc)), **kw)
    np.testing.assert_array_equal(o, o_ref)
    np.testing.assert_array_equal(lse, lse_ref)


def test_triton_paged_equals_contiguous_interpret():
    rng = np.random.default_rng(7)
    pc, q = _paged_case(rng, d=64, page=64, pages_per_seq=3, sink=4, window=8, lengths=[4 + 8 + 3 * 64, 100])
    _check_triton_paged(pc, q, interpret=True)


def test_triton_paged_lowers_for_cuda():
    """Pallas's Triton lowering (no GPU) accepts the block-table reads."""
    b, hkv, d, pages, rows, sink, window = 2, 2, 128, 9, 64, 64, 256
    sds = jax.ShapeDtypeStruct
    bf, u8 = jnp.bfloat16, jnp.uint8
    args = (sds((b, 1, hkv * 4, d), jnp.float32), sds((b, hkv, sink, d), bf), sds((b, hkv, sink, d), bf),
            sds((pages, hkv, rows, d), u8), sds((pages, hkv, d, rows), u8), *[sds((pages, hkv, 1, 4, rows), bf)] * 4,
            sds((b, hkv, window, d), bf), sds((b, hkv, window, d), bf), sds((b,), jnp.int32), sds((b, 4), jnp.int32))
    lower_for_h200(lambda q, *cache: triton_attention.mixed_attention(
        q, layout.CacheArrays(*cache[:-1]), block_table=cache[-1], sink=sink, window=window, bits=2,
        levels=(0.0, 1.0, 2.0, 3.0), softmax_scale=d ** -0.5), args)


@pytest.mark.gpu
@pytest.mark.gpu_triton
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_triton_paged_equals_contiguous_on_gpu():
    """Compiled: production sink/window, pages of 256 tokens, a ragged batch."""
    rng = np.random.default_rng(8)
    pc, q = _paged_case(rng, d=128, page=256, pages_per_seq=7, sink=64, window=256,
                        lengths=[64 + 256 + 7 * 256, 1000, 321])
    _check_triton_paged(pc, q, interpret=False)


def _check_mgpu_paged(pc, q, interpret: bool):
    """The Mosaic GPU kernel through the block table == the same kernel over the gathered cache
    with the same schedule (the work line cut from the lengths, `live=True`), and within the
    kernel's tolerances of it with the line cut for every row at full capacity."""
    kw = dict(sink=pc.spec.sink, window=pc.spec.window, bits=2, levels=pc.spec.quant.levels,
              softmax_scale=pc.spec.head_dim ** -0.5, interpret=interpret)
    o, lse = mixed_attention_mgpu.mixed_attention(q, layout.CacheArrays.of(pc), block_table=pc.block_table, **kw)
    gathered = layout.CacheArrays.of(paged.gather(pc))
    o_ref, lse_ref = mixed_attention_mgpu.mixed_attention(q, gathered, live=True, **kw)
    np.testing.assert_array_equal(o, o_ref)
    np.testing.assert_array_equal(lse, lse_ref)
    o_cap, lse_cap = mixed_attention_mgpu.mixed_attention(q, gathered, **kw)
    np.testing.assert_allclose(o, o_cap, atol=1e-5 * float(np.abs(o_cap).max()), rtol=0)
    np.testing.assert_allclose(lse, lse_cap, atol=1e-5, rtol=1e-6)


def test_mgpu_paged_equals_contiguous_interpret():
    """Pages of one 256-token tile (the TMA tile), shuffled; a full row, a ragged one and an
    idle one."""
    rng = np.random.default_rng(9)
    pc, q = _paged_case(rng, d=64, page=256, pages_per_seq=2, sink=64, window=64, lengths=[64 + 64 + 512, 300, 0],
                        g=4)
    _check_mgpu_paged(pc, q, interpret=True)


def test_mgpu_paged_lowers_for_cuda():
    """Mosaic GPU's sm_90 checks (layouts, wgmma, TMA) accept the block-table reads: B4 Hkv4 at
    8K in pages of 256 tokens."""
    b, hkv, d, g, per_seq, rows, sink, window = 4, 4, 128, 4, 32, 64, 64, 256
    pages = b * per_seq
    sds = jax.ShapeDtypeStruct
    bf, u8 = jnp.bfloat16, jnp.uint8
    args = (sds((b, 1, hkv * g, d), jnp.float32), sds((b, hkv, sink, d), bf), sds((b, hkv, sink, d), bf),
            sds((pages, hkv, rows, d), u8), sds((pages, hkv, d, rows), u8), *[sds((pages, hkv, 1, 4, rows), bf)] * 4,
            sds((b, hkv, window, d), bf), sds((b, hkv, window, d), bf), sds((b,), jnp.int32),
            sds((b, per_seq), jnp.int32))
    lower_for_h200(lambda q, *cache: mixed_attention_mgpu.mixed_attention(
        q, layout.CacheArrays(*cache[:-1]), block_table=cache[-1], sink=sink, window=window, bits=2,
        levels=(0.0, 1.0, 2.0, 3.0), softmax_scale=d ** -0.5), args)


@pytest.mark.gpu
@pytest.mark.gpu_mgpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_mgpu_paged_equals_contiguous_on_gpu():
    """Compiled on Hopper: production sink/window, 256-token pages shuffled, a ragged batch."""
    rng = np.random.default_rng(10)
    pc, q = _paged_case(rng, d=128, page=256, pages_per_seq=15, sink=64, window=256,
                        lengths=[64 + 256 + 15 * 256, 3000, 321], g=4)
    _check_mgpu_paged(pc, q, interpret=False)


def test_sharded_paged_step_equals_one_device():
    """A jitted append + attend over a paged cache sharded on 8 host devices (slots over
    `data`, KV heads over `model`, the pool's pages replicated) equals the one-device step."""
    assert jax.device_count() == 8, "tests/conftest.py sets 8 host devices"
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    rng = np.random.default_rng(11)
    hkv = 4
    spec = CacheSpec(1, 2, hkv, D, S0 + W + 2 * PAGE, S0, W)
    rot = rotation.hadamard(D)
    params = oc.LayerParams.create(rot, rot, 0.96, 0.92, num_layers=1, kv_heads=hkv).layer(0)
    pc = dataclasses.replace(paged.PagedCache.init(spec, PAGE, 5), block_table=jnp.asarray([[3, 0], [4, 1]], jnp.int32))
    kv = lambda t: tuple(jnp.asarray(rng.normal(size=(2, t, hkv, D)), jnp.float32) for _ in range(2))
    pc = paged.write_prompt(pc, np.arange(2), *kv(30), np.array([30, 21], np.int32), params)
    k, v = kv(1)
    q = jnp.asarray(rng.normal(size=(2, 1, 2 * hkv, D)), jnp.float32)

    def step(cache, k, v, q):
        cache = paged.append(cache, k, v, params)
        return paged.attend(q, cache, params, implementation="xla")[0], cache

    want, want_cache = jax.jit(step)(pc, k, v, q)
    placed = jax.device_put(pc, sharding.shardings(pc, mesh))
    assert placed.hist_codes_k.sharding.spec == jax.sharding.PartitionSpec(None, "model")  # pages replicated
    got, got_cache = jax.jit(step, out_shardings=(None, sharding.shardings(pc, mesh)))(placed, k, v, q)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    for name in paged.HIST_FIELDS:
        np.testing.assert_array_equal(getattr(got_cache, name), getattr(want_cache, name))
