"""The attention kernels on a history split along tokens (sequence parallelism).

Each implementation attends one slice of the history (`attention.attend(history_offset=...)`:
the slice's tokens, and the sink and ring only on the slice at offset 0); `merge_partials` of
the slices' (o, lse) must be the whole cache's attention. On CPU the kernels run in Pallas
interpret mode: the slices of one cache against `reference.attend`, and `parallel.append_attend`
on 8 simulated devices (seq 8; model 2 x seq 4) against one device running the same kernel.
Compiled on a Hopper GPU (`-m gpu_mgpu`, the Mosaic GPU kernel):

    pytest -p no:cacheprovider -n 0 -m gpu_mgpu tests/test_seq_kernels.py
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import Mesh

from cache_oracle import random_kv
from oscar_jax import attention, parallel, reference, sharding, updates
from oscar_jax import cache as cache_lib
from oscar_jax.config import CacheSpec, QuantConfig

INTERPRET = jax.default_backend() != "gpu"
ON_HOPPER = jax.default_backend() == "gpu" and jax.devices()[0].compute_capability == "9.0"
HIST_FIELDS = ("hist_codes_k", "hist_codes_v", "hist_lo_k", "hist_scale_k", "hist_lo_v", "hist_scale_v")


def _params(rng, h: int, d: int) -> cache_lib.LayerParams:
    rot = np.linalg.qr(rng.standard_normal((h, d, d)))[0].astype(np.float32)
    rot_v = np.linalg.qr(rng.standard_normal((h, d, d)))[0].astype(np.float32)
    return cache_lib.LayerParams.create(rot, rot_v, 0.95, 0.9, num_layers=1, kv_heads=h,
                                        k_shift=rng.standard_normal((h, d)).astype(np.float32)).layer(0)


@jax.jit
def _filled(cache, params, k, v, lengths):
    """write_prompt the first n - 1 tokens of k, v [B, T, H, D], then append token n - 1."""
    cache = updates.write_prompt(cache, k, v, lengths - 1, params, implementation="xla")
    last = lambda x: jnp.take_along_axis(x, (lengths - 1)[:, None, None, None], axis=1)
    return updates.append(cache, last(k), last(v), params)


def _history_slice(cache: cache_lib.OscarCache, i, parts: int) -> cache_lib.OscarCache:
    """Slice i (traced) of `parts` of the history's token axis (the K codes' rows, the last axis
    of the channel-major V codes and of the metadata); the sink, ring and lengths whole."""
    def cut(x, axis):
        n = x.shape[axis] // parts
        return jax.lax.dynamic_slice_in_dim(x, i * n, n, axis=axis)

    return dataclasses.replace(cache, **{name: cut(getattr(cache, name), -2 if name == "hist_codes_k" else -1)
                                         for name in HIST_FIELDS})


@functools.partial(jax.jit, static_argnames=("implementation", "parts"))
def _sliced_attend(q, cache, params, *, implementation: str, parts: int):
    """`parts` slices of the history attended one after another (lax.map: one instance of the
    kernel, the offset traced), merged."""
    tokens = cache.hist_codes_k.shape[-2] * cache.spec.quant.tokens_per_byte // parts
    o, lse = jax.lax.map(lambda i: attention.attend(q, _history_slice(cache, i, parts), params,
                                                    implementation=implementation, interpret=INTERPRET,
                                                    history_offset=i * tokens), jnp.arange(parts))
    assert o.dtype == jnp.float32
    return reference.merge_partials(list(o), list(lse))


def _check_slices(rng, spec: CacheSpec, g: int, lengths, implementation: str, parts: int):
    b, h, d = spec.batch, spec.kv_heads, spec.head_dim
    params = _params(rng, h, d)
    k, v = (jnp.asarray(random_kv(rng, b, spec.max_len, h, d)) for _ in range(2))
    cache = _filled(cache_lib.OscarCache.init(spec, stacked=False), params, k, v, jnp.asarray(lengths, jnp.int32))
    q = jnp.asarray(rng.standard_normal((b, 1, h * g, d)), jnp.float32)
    o, lse = _sliced_attend(q, cache, params, implementation=implementation, parts=parts)
    o_ref, lse_ref = jax.jit(reference.attend)(q, cache, params)
    assert bool(jnp.all(jnp.isfinite(o)))
    for row in range(b):
        rel = float(jnp.linalg.norm(o[row] - o_ref[row]) / jnp.linalg.norm(o_ref[row]))
        assert rel <= (1e-5 if implementation == "xla" else 1e-2), f"row {row} (length {lengths[row]}): {rel:.2e}"
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_ref), atol=2e-2, rtol=5e-3)


# sink 4, window 8, 64 history tokens: 8 slices of 8 tokens (2 packed rows).
SMALL = CacheSpec(1, 3, 2, 64, 4 + 64 + 8, sink=4, window=8)


@pytest.mark.parametrize("implementation,parts", [("xla", 8), ("pallas", 4), ("pallas_tpu", 2)])
@settings(max_examples=5, deadline=None)
@given(lengths=st.lists(st.integers(1, SMALL.max_len), min_size=SMALL.batch, max_size=SMALL.batch))
def test_history_slices_merge_to_the_whole_cache(implementation, parts, lengths):
    """Random ragged lengths (inside the sink, the ring, any history slice, full; traced: one
    compilation): the merged partials of `parts` slices are the reference over the whole cache."""
    _check_slices(np.random.default_rng(lengths), SMALL, 2, np.array(lengths), implementation, parts)


@functools.partial(jax.jit, static_argnames=("parts",))
def _emulated_seq_step(q, k, v, cache, params, *, parts: int):
    """One decode step of `parallel.append_attend`'s body for `parts` devices, emulated on one:
    each slice appends (the evicted token written where its position lies) and attends with the
    Mosaic GPU kernel (lax.map: one instance of it), then the partials merge. Returns (o, lse,
    the slices' history arrays put back together along tokens)."""
    tokens = cache.hist_codes_k.shape[-2] * cache.spec.quant.tokens_per_byte // parts

    def device(i):
        o, lse, c = attention.append_attend(q, k, v, _history_slice(cache, i, parts), params,
                                            implementation="pallas_mosaic_gpu", interpret=INTERPRET,
                                            history_offset=i * tokens)
        return o, lse, tuple(getattr(c, name) for name in HIST_FIELDS)

    o, lse, hist = jax.lax.map(device, jnp.arange(parts))
    whole = {name: jnp.concatenate(list(x), axis=-2 if name == "hist_codes_k" else -1)
             for name, x in zip(HIST_FIELDS, hist)}
    return *reference.merge_partials(list(o), list(lse)), whole


def _mgpu_seq_step(hist: int, parts: int, full: bool = True):
    """`_emulated_seq_step` (D = 128, g = 4, sink 8, window 64, a history of `hist` tokens) on rows
    without a history, with one whose evicted token lands 5 tokens into the second slice, and
    (full) a full one: the merged output is the reference's over the whole cache after the
    append, and the slices hold the history bytes one device's append writes."""
    lengths = [40, 72 + hist // parts + 5] + [8 + hist + 64] * full  # after the step's token
    spec = CacheSpec(1, len(lengths), 2, 128, 8 + hist + 64, sink=8, window=64,
                     quant=QuantConfig(2, scale_dtype="bfloat16"))
    rng = np.random.default_rng([hist, parts])
    b, h, d = spec.batch, spec.kv_heads, spec.head_dim
    params = _params(rng, h, d)
    prompt = jnp.asarray(random_kv(rng, b, spec.max_len, h, d))
    cache = jax.jit(updates.write_prompt)(cache_lib.OscarCache.init(spec, stacked=False), prompt, prompt,
                                          jnp.asarray(lengths) - 1, params)
    q = jnp.asarray(rng.standard_normal((b, 1, h * 4, d)), jnp.float32)
    k, v = (jnp.asarray(random_kv(rng, b, 1, h, d)) for _ in range(2))
    o, lse, hist_arrays = _emulated_seq_step(q, k, v, cache, params, parts=parts)
    appended = jax.jit(updates.append)(cache, k, v, params)  # the append "auto" runs (the Triton kernel on GPU)
    for name in HIST_FIELDS:
        np.testing.assert_array_equal(np.asarray(hist_arrays[name]), np.asarray(getattr(appended, name)), name)
    o_ref, lse_ref = jax.jit(reference.attend)(q, appended, params)
    for row in range(b):
        rel = float(jnp.linalg.norm(o[row] - o_ref[row]) / jnp.linalg.norm(o_ref[row]))
        assert rel <= 1e-2, f"row {row} (length {lengths[row]}): relative error {rel:.2e}"
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_ref), atol=2e-2, rtol=5e-3)


def test_mgpu_seq_step_interpreted():
    """The Mosaic GPU kernel in interpret mode, two slices of one 256-token tile each."""
    _mgpu_seq_step(512, 2, full=False)


@pytest.mark.gpu
@pytest.mark.gpu_mgpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("hist,parts", [(512, 2), (2048, 2), (2048, 4)])
def test_mgpu_seq_step_on_gpu(hist, parts):
    """The Mosaic GPU kernel and the Triton append compiled: two and four slices of whole
    256-token tiles (one and several tiles a slice)."""
    _mgpu_seq_step(hist, parts)


def _mesh(shape, axes) -> Mesh:
    return Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), axes)


MESHES = {"seq8": ((8,), ("seq",)), "model2-seq4": ((2, 4), ("model", "seq"))}
# Relative error of a row's output against one device. The Triton kernel rounds the softmax
# weights to bf16 against the running maximum of its own split of the history, which moves with
# the split; the TPU kernel's products are f32-like (3 bf16 passes).
TOLERANCE = {"pallas": 5e-3, "pallas_tpu": 1e-5}


STEPS, B, H, D, G = 6, 2, 2, 64, 2


@pytest.fixture(scope="module", params=["pallas", "pallas_tpu"])
def one_device(request):
    """(implementation, params, the cache after the prompts, each step's (q, k, v), the outputs
    and final cache of one device running the kernel): prompts of 40 and 9 tokens (sink 4,
    window 8: a history over 4 of 8 slices), then 6 decode steps (evictions into a fifth)."""
    implementation = request.param
    rng = np.random.default_rng(0)
    spec = CacheSpec(1, B, H, D, parallel.seq_max_len(CacheSpec(1, B, H, D, 4 + 8 + 48, sink=4, window=8), 8),
                     sink=4, window=8)
    params = _params(rng, H, D)
    prompt = jnp.asarray(random_kv(rng, B, 40, H, D))
    start = updates.write_prompt(cache_lib.OscarCache.init(spec, stacked=False), prompt, prompt,
                                 jnp.array([40, 9]), params)
    inputs = [(jnp.asarray(rng.standard_normal((B, 1, H * G, D)), jnp.float32),
               *(jnp.asarray(random_kv(rng, B, 1, H, D)) for _ in range(2))) for _ in range(STEPS)]

    @jax.jit
    def single(c, q, k, v):
        o, _, c = attention.append_attend(q, k, v, c, params, implementation=implementation, interpret=True)
        return o, c

    outs, cache = [], start
    for q, k, v in inputs:
        o, cache = single(cache, q, k, v)
        outs.append(o)
    return implementation, params, start, inputs, outs, cache


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_kernels_under_seq_give_one_devices_outputs(mesh_name, one_device):
    """parallel.append_attend with an explicit kernel (interpret mode) on a history split over
    `seq`: the decode steps give the outputs of one device running the same kernel and the same
    cache codes, all from one compiled program whose HLO holds one all-gather (the merge of the
    partials)."""
    assert jax.device_count() == 8, "tests/conftest.py sets 8 host devices"
    implementation, params, cache, inputs, want, want_cache = one_device
    mesh = _mesh(*MESHES[mesh_name])
    cache_shardings = sharding.shardings(cache, mesh)
    sharded = jax.device_put(cache, cache_shardings)
    sharded_params = jax.device_put(params, sharding.shardings(params, mesh))
    step = jax.jit(lambda c, p, q, k, v: parallel.append_attend(c, p, q, k, v, mesh=mesh, implementation=implementation,
                                                                 interpret=True),
                   out_shardings=(None, cache_shardings))
    compiled = step.lower(sharded, sharded_params, *inputs[0]).compile()  # every step runs this program
    assert sum(1 for line in compiled.as_text().splitlines() if re.search(r"= \S+ all-gather(-start)?\(", line)) == 1
    for i, (q, k, v) in enumerate(inputs):
        got, sharded = compiled(sharded, sharded_params, q, k, v)
        for row in range(B):
            rel = float(jnp.linalg.norm(got[row] - want[i][row]) / jnp.linalg.norm(want[i][row]))
            assert rel <= TOLERANCE[implementation], f"step {i}, row {row}: relative error {rel:.2e}"
    for name in ("hist_codes_k", "hist_codes_v", "lengths"):
        np.testing.assert_array_equal(np.asarray(getattr(sharded, name)), np.asarray(getattr(want_cache, name)), name)
    # The partitioned program rotates in another order: a bf16 value may move by one ulp.
    for name in ("hist_scale_k", "recent_v"):
        np.testing.assert_allclose(np.asarray(getattr(sharded, name), np.float32),
                                   np.asarray(getattr(want_cache, name), np.float32), rtol=8e-3, err_msg=name)


@pytest.mark.gpu
@pytest.mark.gpu_mgpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
def test_mgpu_on_a_one_device_seq_mesh_on_gpu():
    """A one-device mesh with a `seq` axis (of size 1: no split): parallel.append_attend runs the
    Mosaic GPU kernel inside shard_map and gives attention.append_attend's outputs."""
    mesh = _mesh((1,), ("seq",))
    rng = np.random.default_rng(5)
    b, h, d, g = 2, 2, 128, 4
    spec = CacheSpec(1, b, h, d, 64 + 1024 + 256, sink=64, window=256, quant=QuantConfig(2, scale_dtype="bfloat16"))
    params = _params(rng, h, d)
    prompt = jnp.asarray(random_kv(rng, b, 1200, h, d))
    cache = updates.write_prompt(cache_lib.OscarCache.init(spec, stacked=False), prompt, prompt,
                                 jnp.array([1200, 300]), params)
    q = jnp.asarray(rng.standard_normal((b, 1, h * g, d)), jnp.float32)
    k, v = (jnp.asarray(random_kv(rng, b, 1, h, d)) for _ in range(2))
    got, _ = jax.jit(lambda c: parallel.append_attend(c, params, q, k, v, mesh=mesh,
                                                      implementation="pallas_mosaic_gpu"))(cache)
    want = jax.jit(lambda c: attention.append_attend(q, k, v, c, params, implementation="pallas_mosaic_gpu")[0])(cache)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
