"""The Triton decode kernel over a float8 dense cache (`pallas_kernels.gpu.dense_decode`) against
numpy softmax attention over stored · scale, in interpret mode on the CPU; its Triton lowering
for sm_90 without a GPU; where the dense cache's "auto" and "pallas" take it; and, marked `gpu_triton`,
compiled on a GPU through `dense_cache.append_attend` against the cache's XLA path:

    pytest -p no:cacheprovider -n 0 -m gpu_triton tests/test_fp8_decode.py

Tolerance: relative Frobenius error <= 5e-3 (the softmax weights enter the V MMA in bf16; q is
rounded to bf16 in the oracle as in the kernel).
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh

from gpu_cases import lower_for_h200, on_gpu
from oscar_jax.models import dense_cache, kv_policy
from oscar_jax.models.config import ModelConfig
from oscar_jax.pallas_kernels.gpu import dense_decode

FP8 = ml_dtypes.float8_e4m3fn


def _case(rng, b, t, hkv, d, g):
    """Random float8 K/V (never all zeros, saturated at ±448), per-head scales, f32 queries."""
    kv = [np.clip(rng.standard_normal((b, t, hkv, d)) * rng.uniform(5, 150), -448, 448).astype(FP8)
          for _ in range(2)]
    scales = [rng.uniform(1e-3, 3e-2, (b, hkv)).astype(np.float32) for _ in range(2)]
    q = rng.standard_normal((b, hkv * g, d)).astype(np.float32)
    return q, *kv, *scales


def _oracle(q, k, v, k_scale, v_scale, lengths, softmax_scale):
    """float64 softmax(q_bf16 · (k · k_scale)ᵀ · softmax_scale) · (v · v_scale) over each row's
    first lengths[b] tokens; zeros for an empty row."""
    b, hq, d = q.shape
    g = hq // k.shape[2]
    qb = np.asarray(jnp.asarray(q).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    o = np.zeros((b, hq, d))
    for r in range(b):
        n = lengths[r]
        for hi in range(hq if n else 0):
            h = hi // g
            s = k[r, :n, h].astype(np.float64) * k_scale[r, h] @ qb[r, hi] * softmax_scale
            p = np.exp(s - s.max())
            o[r, hi] = (p / p.sum()) @ (v[r, :n, h].astype(np.float64) * v_scale[r, h])
    return o


@pytest.mark.parametrize("b,t,hkv,d,g,block_t,target,seed", [
    (3, 300, 2, 64, 4, 32, 24, 0),    # several splits, a partial last tile
    (2, 96, 1, 128, 8, 16, 1, 1),     # one split a row
    (4, 130, 2, 64, 1, 64, 512, 2),   # g = 1, splits of one tile
    (2, 200, 1, 256, 16, 32, 8, 4),   # D = 256, g = 16 (a query block without padding)
])
def test_fp8_decode_matches_numpy_softmax_over_stored_times_scale(b, t, hkv, d, g, block_t, target, seed):
    """Ragged lengths (0, 1, T and random) across splits and partial tiles."""
    rng = np.random.default_rng(seed)
    q, k, v, k_scale, v_scale = _case(rng, b, t, hkv, d, g)
    lengths = np.array([0, 1, t, *rng.integers(2, t, b)][:b], np.int32)
    rng.shuffle(lengths)
    got = dense_decode.fp8_decode(*map(jnp.asarray, (q, k, v, k_scale, v_scale, lengths)), softmax_scale=d ** -0.5,
                                  interpret=True, block_sizes=dense_decode.BlockSizes(block_t, target))
    want = _oracle(q, k, v, k_scale, v_scale, lengths, d ** -0.5)
    got = np.asarray(got)
    assert np.linalg.norm(got - want) <= 5e-3 * np.linalg.norm(want)
    np.testing.assert_array_equal(got[lengths == 0], 0.0)


def test_append_attend_through_the_kernel_equals_the_xla_path(monkeypatch):
    """`append_attend` with the kernel taken (interpret mode) against the cache's XLA path: the
    token appended first, each row's length + 1 attended, a row at capacity (its append dropped)
    attending its T tokens."""
    rng = np.random.default_rng(7)
    b, t, hkv, d, g = 3, 64, 2, 64, 4
    _, k, v, k_scale, v_scale = _case(rng, b, t, hkv, d, g)
    lengths = np.array([0, 37, t], np.int32)
    layer = dense_cache.DenseCache(*map(jnp.asarray, (k, v, lengths, k_scale, v_scale)))
    q = jnp.asarray(rng.standard_normal((b, 1, hkv * g, d)), jnp.bfloat16)
    new = [jnp.asarray(rng.standard_normal((b, 1, hkv, d)), jnp.float32) for _ in range(2)]
    want, want_layer = dense_cache.append_attend(dataclasses.replace(layer, implementation="xla"), q, *new, 0.125)
    kernel = dense_decode.fp8_decode
    monkeypatch.setattr(dense_cache, "fp8_kernel_applies", lambda *a: True)
    monkeypatch.setattr(dense_decode, "fp8_decode", lambda *a, **kw: kernel(*a, **kw, interpret=True))
    got, got_layer = dense_cache.append_attend(layer, q, *new, 0.125)
    assert got.dtype == q.dtype and got.shape == q.shape
    for name in ("k", "v", "lengths"):
        np.testing.assert_array_equal(np.asarray(getattr(got_layer, name)).view(np.uint8),
                                      np.asarray(getattr(want_layer, name)).view(np.uint8))
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want)


def test_fp8_decode_refuses_what_it_cannot_take():
    rng = np.random.default_rng(3)
    q, k, v, k_scale, v_scale = map(jnp.asarray, _case(rng, 2, 32, 2, 64, 4))
    lengths = jnp.array([3, 32], jnp.int32)
    call = lambda *a: dense_decode.fp8_decode(*a, softmax_scale=0.125, interpret=True)
    with pytest.raises(ValueError, match="expected float8_e4m3fn"):
        call(q, k.astype(jnp.bfloat16), v, k_scale, v_scale, lengths)
    with pytest.raises(ValueError, match="Hq / Hkv a whole number <= 16"):
        call(q[:, :7], k, v, k_scale, v_scale, lengths)
    with pytest.raises(ValueError, match=r"expected \[B=2, Hkv=2\] and \[B\]"):
        call(q, k, v, k_scale[:, :1], v_scale, lengths)
    with pytest.raises(ValueError, match="block_t=48"):
        dense_decode.BlockSizes(block_t=48)


def test_fp8_decode_lowers_for_cuda():
    """Pallas's Triton lowering (jax side, no GPU) accepts the kernel, float8 loads and their
    conversion to bf16 included, for an H200."""
    sds = jax.ShapeDtypeStruct
    b, t, hkv, d, g = 3, 1000, 8, 128, 4
    args = (sds((b, hkv * g, d), jnp.bfloat16), sds((b, t, hkv, d), jnp.float8_e4m3fn),
            sds((b, t, hkv, d), jnp.float8_e4m3fn), sds((b, hkv), jnp.float32), sds((b, hkv), jnp.float32),
            sds((b,), jnp.int32))
    lower_for_h200(lambda *a: dense_decode.fp8_decode(*a, softmax_scale=d ** -0.5), args)


def test_auto_and_pallas_take_the_kernel_for_float8_decode_on_a_gpu_only():
    layer = dense_cache.DenseCache.init(2, 2, 64, 32, dense_cache.FP8, implementation="pallas")
    assert dense_cache.fp8_kernel_applies(layer, 8, 1, "gpu")
    assert dense_cache.fp8_kernel_applies(dataclasses.replace(layer, implementation="auto"), 8, 1, "gpu")
    for other, q_heads, queries, backend in (
            (layer, 8, 1, "cpu"), (layer, 8, 1, "tpu"), (layer, 8, 4, "gpu"), (layer, 64, 1, "gpu"),
            *((dataclasses.replace(layer, implementation=name), 8, 1, "gpu") for name in ("xla", "cudnn")),
            (dataclasses.replace(layer, window=16), 8, 1, "gpu"),
            (dense_cache.DenseCache.init(2, 2, 64, 32, jnp.bfloat16, implementation="pallas"), 8, 1, "gpu"),
            (dense_cache.DenseCache.init(2, 2, 48, 32, dense_cache.FP8, implementation="pallas"), 8, 1, "gpu")):
        assert not dense_cache.fp8_kernel_applies(other, q_heads, queries, backend)


def test_float8_state_on_a_mesh_of_several_devices_decodes_in_xla():
    """The kernel has no SPMD partitioning rule (GSPMD would gather a sharded cache onto every
    device): a float8 state made on a mesh of several devices keeps "auto" out of it ("xla");
    on a one-device mesh, an explicit "pallas" and bf16 keep their implementation."""
    cfg = ModelConfig(family="llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=32, rms_eps=1e-6, rope_theta=1e4,
                      layer_types=("full_attention",) * 2)
    two, one = (Mesh(np.array(jax.devices()[:n]), ("data",)) for n in (2, 1))
    impls = lambda name, mesh, **kw: {layer.implementation for layer in kv_policy.init_on_mesh(
        kv_policy.make_policy(name, **kw), cfg, 2, 32, 8, mesh).layers}
    assert impls("fp8", two) == {"xla"}
    assert impls("fp8", one) == {"auto"}
    assert impls("fp8", two, implementation="pallas") == {"pallas"}
    assert impls("bf16", two) == {"auto"}


@on_gpu("gpu_triton")
@pytest.mark.parametrize("b,t,g", [(5, 4096, 4), (2, 20000, 8)])
def test_fp8_decode_on_gpu_equals_the_xla_path(b, t, g):
    """Compiled on a GPU: a decode step over a float8 cache through `append_attend` with "pallas"
    (the kernel) against "xla", at ragged lengths, D = 128."""
    rng = np.random.default_rng(b)
    hkv, d = 8, 128
    q, k, v, k_scale, v_scale = _case(rng, b, t, hkv, d, g)
    lengths = rng.integers(1, t - 1, b).astype(np.int32)
    layer = dense_cache.DenseCache(*map(jnp.asarray, (k, v, lengths, k_scale, v_scale)), implementation="pallas")
    new = [jnp.asarray(rng.standard_normal((b, 1, hkv, d)), jnp.bfloat16) for _ in range(2)]
    q = jnp.asarray(q[:, None], jnp.bfloat16)
    step = jax.jit(lambda layer: dense_cache.append_attend(layer, q, *new, d ** -0.5))
    assert dense_cache.fp8_kernel_applies(layer, hkv * g, 1)
    (got, got_layer), (want, _) = step(layer), step(dataclasses.replace(layer, implementation="xla"))
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want)
    np.testing.assert_array_equal(np.asarray(got_layer.lengths), lengths + 1)
