"""GPU Pallas kernels (Triton and Mosaic GPU) against the XLA oracles.

On CPU the kernels run in Pallas interpret mode (`interpret=True`; the interpreter fills
kernel outputs with NaN before the call, so an unwritten element fails the check). The
tests marked `gpu` run the same checks compiled on a real GPU, in groups that each run in
under 5 minutes on one H100 (markers registered in tests/conftest.py, which also keeps the
compilations in build/jax_cache across runs):

    pytest -p no:cacheprovider -n 0 -m gpu_triton tests/test_gpu_kernels.py        # Triton attention (14)
    pytest -p no:cacheprovider -n 0 -m gpu_mgpu tests/test_gpu_kernels.py          # Mosaic GPU decode, D = 128 (7)
    pytest -p no:cacheprovider -n 0 -m gpu_decode tests/test_gpu_kernels.py        # Mosaic GPU decode, D = 64 and 256,
                                                                                   #   production windows, "auto" (8)
    pytest -p no:cacheprovider -n 0 -m gpu_decode_parts tests/test_gpu_kernels.py  # decode_start, decode_finish (8)
    pytest -p no:cacheprovider -n 0 -m gpu_write tests/test_gpu_kernels.py         # bulk writes, write_prompt (19)

(`-m gpu` runs all five groups, tests/test_serving_path.py's `gpu_serving` and
tests/test_append_kernel.py's cases of `gpu_write`.)
Tolerances: attention output relative Frobenius error
<= 1e-2 (bf16 MMA operands against the f32 HIGHEST-precision reference),
lse within 2e-2 + 5e-3·|lse| (q enters the MMA in bf16); the bulk write is
(Triton, and the Mosaic GPU write for G = D in {64, 128}, uniform 2-bit, bf16 metadata)
bit-exact in interpret mode when the rotation is a signed permutation (f32 Lloyd-Max metadata: 1e-5
relative, summation order differs); with a dense rotation a rotated value may
land on the neighbouring bf16, so codes may move by one level (<= 1% of them) and
metadata by 8e-3 relative + 2^-6 of the largest.

Each attention case is one shape configuration x one ragged batch of
lengths; the lengths are traced, so the cases of a configuration share one
compilation.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from cache_oracle import random_kv, signed_permutation
from oscar_jax import attention, dispatch, quant, reference
from oscar_jax import cache as cache_lib
from oscar_jax import updates
from oscar_jax.config import CacheSpec, QuantConfig
from oscar_jax.pallas_kernels import layout
from oscar_jax.pallas_kernels.gpu import (decode_finish, decode_start, hopper, mixed_attention,
                                         mixed_attention_mgpu, quantize_pack, quantize_pack_mgpu)
from oscar_jax.pallas_kernels.gpu.mixed_attention_mgpu import Config as MgpuConfig

HKV, BATCH, SINK, WINDOW, HIST = 2, 4, 8, 64, 120

# (D, g, C, G, codebook, scale dtype): every D in {64, 128, 256}, g in {1, 3, 4, 8},
# C in {1, 7, 64}, G = D and G < D, both codebooks, both metadata dtypes.
ATTN_CONFIGS = [
    (64, 1, 1, 64, "uniform", "bfloat16"),
    (64, 4, 7, 16, "uniform", "bfloat16"),
    (64, 3, 1, 32, "lloyd_max", "float32"),
    (64, 8, 64, 64, "uniform", "bfloat16"),
    (128, 4, 1, 128, "uniform", "bfloat16"),
    (128, 3, 7, 32, "uniform", "float32"),
    (128, 8, 1, 128, "lloyd_max", "bfloat16"),
    (128, 1, 64, 64, "uniform", "bfloat16"),
    (128, 8, 7, 16, "uniform", "bfloat16"),
    (256, 4, 1, 256, "uniform", "bfloat16"),
    (256, 1, 7, 256, "lloyd_max", "float32"),
    (256, 3, 64, 128, "uniform", "bfloat16"),
]
N_PATTERNS = 4  # batches of 3 boundary lengths each: every boundary >= C appears (all 11 at C = 1)


def _spec(d, g_size, codebook, scale_dtype, *, batch=BATCH, sink=SINK, window=WINDOW, hist=HIST,
          kv_heads=HKV):
    return CacheSpec(1, batch, kv_heads, d, sink + hist + window, sink, window,
                     QuantConfig(2, None if g_size == d else g_size, codebook, scale_dtype))


def _lengths(rng, pattern: int, c: int, spec: CacheSpec) -> np.ndarray:
    """A ragged batch: boundary lengths (inside the sink, on S0, inside S0 + W, on S0 + W,
    just past it, full) and one random length; all >= C so the C queries are appended.
    Batch `pattern` takes boundaries 3p, 3p + 1, ... of the list (cyclically), so
    consecutive patterns walk every boundary."""
    s0, w, top = spec.sink, spec.window, spec.max_len
    marks = [1, s0 - 1, s0, s0 + 1, s0 + w // 2, s0 + w - 1, s0 + w, s0 + w + 1, s0 + w + 3,
             top - 1, top]
    pool = [n for n in marks if c <= n <= top]
    picked = [pool[(3 * pattern + i) % len(pool)] for i in range(spec.batch - 1)]
    return np.array(picked + [int(rng.integers(c, top + 1))], np.int32)


@functools.partial(jax.jit, static_argnames=("c",))
def _build(cache, params, k, v, lengths, *, c):
    """write_prompt the first n - C tokens of k, v [B, T, H, D], then append the last C."""
    cache = updates.write_prompt(cache, k, v, lengths - c, params, implementation="xla")
    idx = (lengths - c)[:, None] + jnp.arange(c)[None, :]
    take = lambda x: jnp.take_along_axis(x, idx[:, :, None, None], axis=1)
    return updates.append(cache, take(k), take(v), params)


_reference = jax.jit(reference.attend)
_attend = jax.jit(attention.attend, static_argnames=("implementation", "interpret"))
# Off a GPU the kernels run in Pallas interpret mode (an explicit opt-in of attend / write_prompt).
INTERPRET = jax.default_backend() != "gpu"


def _write_kernel(spec: CacheSpec) -> str:
    """The bulk write that "auto" runs for `spec` on a Hopper GPU: Mosaic GPU where it applies,
    else Triton."""
    return "pallas_mosaic_gpu" if quantize_pack_mgpu.supports(spec) else "pallas"


def _random_case(rng, spec: CacheSpec, g: int, c: int, lengths: np.ndarray, k_shift: bool = False):
    b, h, d = spec.batch, spec.kv_heads, spec.head_dim
    rot = np.linalg.qr(rng.standard_normal((h, d, d)))[0].astype(np.float32)
    rot_v = np.linalg.qr(rng.standard_normal((h, d, d)))[0].astype(np.float32)
    shift = rng.standard_normal((h, d)).astype(np.float32) if k_shift else None
    params = cache_lib.LayerParams.create(rot, rot_v, rng.uniform(0.85, 1.0), rng.uniform(0.85, 1.0),
                                          num_layers=1, kv_heads=h, k_shift=shift).layer(0)
    t = spec.max_len
    k = jnp.asarray(random_kv(rng, b, t, h, d), jnp.bfloat16)
    v = jnp.asarray(random_kv(rng, b, t, h, d), jnp.bfloat16)
    cache = _build(cache_lib.OscarCache.init(spec).layer(0), params, k, v, jnp.asarray(lengths), c=c)
    q = jnp.asarray(rng.standard_normal((b, c, h * g, d)) * rng.uniform(0.5, 2.0), jnp.float32)
    return q, cache, params


def _check_attention(rng, spec, g, c, lengths, kernel=None, k_shift=False, implementation="pallas",
                     rotates=False):
    """kernel: a `mixed_attention`-like function (rotates: it rotates q and o itself); None
    runs `attend(implementation=...)`."""
    q, cache, params = _random_case(rng, spec, g, c, lengths, k_shift=k_shift)
    if kernel is None:
        o, lse = _attend(q, cache, params, implementation=implementation, interpret=INTERPRET)
    else:
        o, lse = jax.jit(functools.partial(attention.kernel_attend(kernel, rotates=rotates),
                                           interpret=INTERPRET))(q, cache, params)
    o_ref, lse_ref = _reference(q, cache, params)
    assert o.shape == o_ref.shape and lse.shape == lse_ref.shape
    assert bool(jnp.all(jnp.isfinite(o))) and bool(jnp.all(jnp.isfinite(lse)))
    for row in range(spec.batch):  # per row, so a wrong short row is not hidden by long ones
        rel = float(jnp.linalg.norm(o[row] - o_ref[row]) / jnp.linalg.norm(o_ref[row]))
        assert rel <= 1e-2, f"row {row} (length {lengths[row]}): relative error {rel:.3e}"
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_ref), atol=2e-2, rtol=5e-3)


@pytest.mark.parametrize("pattern", range(N_PATTERNS))
@pytest.mark.parametrize("config", ATTN_CONFIGS, ids=lambda c: "d{}-g{}-c{}-G{}-{}-{}".format(*c))
def test_attention_matches_reference(config, pattern):
    d, g, c, g_size, codebook, scale_dtype = config
    spec = _spec(d, g_size, codebook, scale_dtype)
    rng = np.random.default_rng([d, g, c, g_size, pattern])
    _check_attention(rng, spec, g, c, _lengths(rng, pattern, c, spec))


def test_attention_splits_and_query_blocks():
    """Small blocks: 3 history splits of up to 3 steps of 16 rows (the longest row: 3, 3 and 2;
    shorter rows stop inside a split or before one), several query blocks; keys stored minus a
    key shift (the lse is corrected outside the kernel)."""
    spec = _spec(64, 16, "uniform", "bfloat16", hist=512)
    rng = np.random.default_rng(7)
    g, c = 4, 7
    q, cache, params = _random_case(rng, spec, g, c, np.array([20, 150, 400, 584], np.int32), k_shift=True)
    blocks = mixed_attention.BlockSizes(block_rows=16, block_dense=16, block_q=16, num_splits=3)
    fn = attention.kernel_attend(functools.partial(mixed_attention.mixed_attention, block_sizes=blocks))
    o, lse = jax.jit(functools.partial(fn, interpret=INTERPRET))(q, cache, params)
    o_ref, lse_ref = _reference(q, cache, params)
    assert float(jnp.linalg.norm(o - o_ref) / jnp.linalg.norm(o_ref)) <= 1e-2
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_ref), atol=2e-2, rtol=5e-3)


def test_dispatch_refuses_unsupported_specs():
    spec4 = CacheSpec(1, 1, 1, 64, 128, 8, 16, QuantConfig(4))
    spec_g8 = CacheSpec(1, 1, 1, 64, 128, 8, 16, QuantConfig(2, 8))
    assert mixed_attention.supports(_spec(128, 128, "uniform", "bfloat16"))
    assert not mixed_attention.supports(spec4) and not mixed_attention.supports(spec_g8)
    with pytest.raises(ValueError, match="does not support"):
        attention.resolve("pallas", spec4, 1, 4)
    assert attention.resolve("auto", spec4, 1, 4, backend="gpu") == "xla"
    assert attention.resolve("auto", _spec(64, 32, "uniform", "bfloat16"), 1, 4, backend="gpu") == "pallas"  # G < D
    with pytest.raises(ValueError, match="group size"):
        updates.write_prompt(cache_lib.OscarCache.init(spec_g8).layer(0),
                               jnp.ones((1, 4, 1, 64), jnp.bfloat16), jnp.ones((1, 4, 1, 64), jnp.bfloat16),
                               jnp.array([4]), cache_lib.LayerParams.create(
                                   np.eye(64), np.eye(64), 1.0, 1.0, num_layers=1, kv_heads=1).layer(0),
                               implementation="pallas")


def test_kernels_run_off_their_backend_only_when_interpreted():
    """attend and write_prompt share one registry: on a backend that is not a kernel's own, an
    explicit kernel implementation raises unless interpret=True (Pallas interpret mode); "auto"
    there is "xla"; through the public entry points the refusal comes before anything runs."""
    spec = _spec(128, 128, "uniform", "bfloat16")
    for name in ("pallas", "pallas_mosaic_gpu", "pallas_tpu"):
        other = "gpu" if name == "pallas_tpu" else "tpu"
        for backend in ("cpu", other):
            with pytest.raises(ValueError, match="interpret=True"):
                attention.resolve(name, spec, 1, 4, backend=backend)
            with pytest.raises(ValueError, match="interpret=True"):
                dispatch.resolve("write", name, spec, backend=backend)
            assert attention.resolve(name, spec, 1, 4, backend=backend, interpret=True) == name
            assert dispatch.resolve("write", name, spec, backend=backend, interpret=True) == name
    assert attention.resolve("auto", spec, 1, 4, backend="cpu", interpret=True) == "xla"
    with pytest.raises(ValueError, match="compiles for the 'gpu' backend"):  # cuDNN has no interpret mode
        attention.resolve("cudnn", spec, 64, 4, backend="cpu", interpret=True)
    assert dispatch.resolve("write", "auto", spec, backend="cpu") == "xla"
    assert dispatch.resolve("write", "auto", spec, backend="gpu") == "pallas_mosaic_gpu"
    assert dispatch.resolve("write", "auto", _spec(128, 32, "uniform", "bfloat16"), backend="gpu") == "pallas"
    for op in ("attend", "write"):
        with pytest.raises(ValueError, match="expected 'auto' or one of"):
            dispatch.resolve(op, "triton", spec)
    if jax.default_backend() == "cpu":
        rng = np.random.default_rng(2)
        q, cache, params = _random_case(rng, spec, 4, 1, np.array([10, 20, 30, 40], np.int32))
        with pytest.raises(ValueError, match="interpret=True"):
            attention.attend(q, cache, params, implementation="pallas")
        x = jnp.zeros((spec.batch, 8, spec.kv_heads, spec.head_dim), jnp.bfloat16)
        with pytest.raises(ValueError, match="interpret=True"):
            updates.write_prompt(cache, x, x, jnp.full((spec.batch,), 8), params, implementation="pallas_mosaic_gpu")


_ONE_THREAD_WRITE = """
import jax, jax.numpy as jnp, numpy as np
from oscar_jax import cache as cache_lib, updates
from oscar_jax.config import CacheSpec, QuantConfig
spec = CacheSpec(1, 1, 2, 128, 512, 16, 32, QuantConfig(2))
rng = np.random.default_rng(0)
perm = np.stack([np.eye(128)[rng.permutation(128)] * rng.choice([-1.0, 1.0], 128) for _ in range(2)])
params = cache_lib.LayerParams.create(perm, perm, 0.9, 0.9, num_layers=1, kv_heads=2).layer(0)
k, v = (jnp.asarray(rng.standard_normal((1, 200, 2, 128)), jnp.bfloat16) for _ in "kv")
empty = cache_lib.OscarCache.init(spec).layer(0)
got = updates.write_prompt(empty, k, v, jnp.array([200]), params, implementation="pallas_mosaic_gpu",
                             interpret=True)
want = updates.write_prompt(empty, k, v, jnp.array([200]), params, implementation="xla")
for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
print("equal")
"""


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="Mosaic GPU interpret mode on XLA:CPU")
def test_mgpu_write_interpreted_on_one_thread():
    """The Mosaic GPU bulk write interpreted with XLA:CPU given one execution thread
    (PJRT_NPROC=1), max_len 512, sink 16, window 32, T = 200: 3 blocks, one per warpgroup.
    Warpgroups that waited for another's copy of the rotation held the only thread and the
    write hung (with two cores, most shapes); it finishes and equals the XLA write exactly
    (signed-permutation rotation)."""
    import os
    import subprocess
    import sys
    result = subprocess.run([sys.executable, "-c", _ONE_THREAD_WRITE], env={**os.environ, "PJRT_NPROC": "1"},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "equal" in result.stdout, result.stderr[-3000:]


# Bulk write: (D, G, codebook, scale dtype, bits).
WRITE_CONFIGS = [
    (64, 64, "uniform", "bfloat16", 2),
    (64, 16, "lloyd_max", "float32", 2),
    (128, 32, "uniform", "float32", 2),
    (128, 128, "lloyd_max", "bfloat16", 2),
    (256, 64, "uniform", "bfloat16", 2),
    (128, 64, "uniform", "bfloat16", 4),
]
WRITE_CASES = [(cfg, rotation, seed) for cfg in WRITE_CONFIGS for rotation in ("permutation", "dense")
               for seed in range(2)]


@pytest.mark.parametrize("config,rotation,seed", WRITE_CASES,
                         ids=lambda x: "-".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_write_prompt_pallas_matches_xla(config, rotation, seed, exact=True):
    d, g_size, codebook, scale_dtype, bits = config
    spec = CacheSpec(1, 3, 2, d, SINK + 90 + WINDOW, SINK, WINDOW,
                     QuantConfig(bits, None if g_size == d else g_size, codebook, scale_dtype))
    rng = np.random.default_rng([d, g_size, bits, seed, rotation == "dense"])
    h = spec.kv_heads
    rot = (signed_permutation(rng, h, d) if rotation == "permutation"
           else np.linalg.qr(rng.standard_normal((h, d, d)))[0].astype(np.float32))
    params = cache_lib.LayerParams.create(rot, rot[::-1], rng.uniform(0.85, 1.0), rng.uniform(0.85, 1.0),
                                          num_layers=1, kv_heads=h).layer(0)
    t = spec.max_len - int(rng.integers(63, 90))  # T < S0 + history: the kernel zero-fills its slots past T
    k = jnp.asarray(random_kv(rng, 3, t, h, d), jnp.bfloat16)
    v = jnp.asarray(random_kv(rng, 3, t, h, d), jnp.bfloat16)
    lengths = jnp.asarray([t, int(rng.integers(SINK + WINDOW, t)), int(rng.integers(1, SINK + WINDOW))])
    empty = cache_lib.OscarCache.init(spec).layer(0)
    write = jax.jit(updates.write_prompt, static_argnames=("implementation", "interpret"))
    got = write(empty, k, v, lengths, params, implementation=_write_kernel(spec), interpret=INTERPRET)
    want = write(empty, k, v, lengths, params, implementation="xla")
    exact = exact and rotation == "permutation"
    for name in ("sink_k", "sink_v", "recent_k", "recent_v", "lengths"):
        a, b = np.asarray(getattr(got, name), np.float32), np.asarray(getattr(want, name), np.float32)
        if exact:
            np.testing.assert_array_equal(a, b, err_msg=name)
        else:  # XLA's f32 rotation rounds differently for a different token count: 1 bf16 ulp
            np.testing.assert_allclose(a, b, rtol=2**-7, atol=1e-6, err_msg=name)
    for which in ("k", "v"):
        codes = np.asarray(getattr(got, f"hist_codes_{which}"))
        codes_ref = np.asarray(getattr(want, f"hist_codes_{which}"))
        if exact:
            np.testing.assert_array_equal(codes, codes_ref, err_msg=f"codes_{which}")
        else:
            unpack = functools.partial(layout.unpack_codes, bits=bits,
                                       channel_major=layout.CHANNEL_MAJOR[which])
            a, b = (np.asarray(unpack(x), np.int32) for x in (codes, codes_ref))
            assert np.abs(a - b).max() <= 1, f"{which}: a code moved by more than one level"
            assert np.mean(a != b) <= 1e-2, f"{which}: {np.mean(a != b):.2e} of codes differ"
        for meta in ("lo", "scale"):
            a = np.asarray(getattr(got, f"hist_{meta}_{which}"), np.float32)
            b = np.asarray(getattr(want, f"hist_{meta}_{which}"), np.float32)
            assert np.all(np.isfinite(a)), f"{meta}_{which} has unwritten (NaN) entries"
            span = np.abs(b).max()
            if exact and scale_dtype == "bfloat16":
                np.testing.assert_array_equal(a, b, err_msg=f"{meta}_{which}")
            elif exact:  # f32 Lloyd-Max statistics: summation order
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * span, err_msg=f"{meta}_{which}")
            else:  # a rotated value may round to the neighbouring bf16: 2 ulps of the largest
                np.testing.assert_allclose(a, b, rtol=8e-3, atol=2**-6 * span, err_msg=f"{meta}_{which}")


@pytest.mark.parametrize("channel_major", [False, True])
def test_quantize_pack_programs_walk_their_own_blocks(channel_major):
    """Several programs, each looping over blocks (BlockSizes(loop=2)), the last one past the
    end: every packed row and its metadata equal the XLA quantiser on the rotated input,
    exactly (signed-permutation rotation)."""
    rng = np.random.default_rng([5, channel_major])
    x = np.asarray(random_kv(rng, 2, 400, 2, 64))  # 100 packed rows: 4 programs of 2 x 16
    rot = signed_permutation(rng, 2, 64)
    cfg = QuantConfig(2, scale_dtype="bfloat16")
    codes, lo, scale = quantize_pack.quantize_pack(
        jnp.asarray(x, jnp.bfloat16), jnp.asarray(rot), 0.9, bits=2, levels=cfg.levels, group_size=64,
        span=None, scale_dtype=jnp.bfloat16, channel_major=channel_major,
        block_sizes=quantize_pack.BlockSizes(block_rows=16, loop=2),
        interpret=jax.default_backend() == "cpu")
    x_rot = np.einsum("bthd,hde->bhte", x, rot)  # [B, Hkv, T, D]
    want = quant.pack(quant.quantize(jnp.asarray(x_rot, jnp.bfloat16), cfg, 0.9), 2, channel_major=channel_major)
    np.testing.assert_array_equal(np.asarray(codes), np.asarray(want.codes))
    np.testing.assert_array_equal(np.asarray(lo), np.asarray(want.lo))
    np.testing.assert_array_equal(np.asarray(scale), np.asarray(want.scale))


def test_quantize_pack_nan_stays_in_its_token():
    """A NaN input element (spread by the rotation over its token) gives NaN metadata and
    code 0 for that token only, exactly as the XLA quantiser on the rotated input."""
    rng = np.random.default_rng(3)
    x = np.asarray(random_kv(rng, 1, 64, 1, 64))
    x[0, 5, 0, 3] = np.nan
    rot = signed_permutation(rng, 1, 64)
    cfg = QuantConfig(2, 16, scale_dtype="float32")
    codes, lo, scale = quantize_pack.quantize_pack(
        jnp.asarray(x, jnp.bfloat16), jnp.asarray(rot), 1.0, bits=2, levels=cfg.levels,
        group_size=16, span=None, scale_dtype=jnp.float32, interpret=jax.default_backend() == "cpu")
    x_rot = np.einsum("td,de->te", x[0, :, 0], rot[0])[None, None]  # [1, 1, T, D]
    want = quant.pack(quant.quantize(jnp.asarray(x_rot, jnp.bfloat16), cfg), 2)
    np.testing.assert_array_equal(np.asarray(codes), np.asarray(want.codes))
    for got, ref in ((lo, want.lo), (scale, want.scale)):  # all-NaN max/min: NaN or -inf
        got, ref = np.asarray(got), np.asarray(ref)
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(ref))
        np.testing.assert_array_equal(got[np.isfinite(got)], ref[np.isfinite(ref)])
    bad = ~np.isfinite(np.asarray(lo)[0, 0])  # [G, tpb, rows]: token 5 is slice 1 of row 1
    assert bad[:, 1, 1].all() and bad.sum() == bad.shape[0]


# Mosaic GPU bulk write (quantize_pack_mgpu): G = D in {64, 128}, uniform 2-bit codes, bf16
# metadata. (B, T, Hkv, D, start, count, channel_major, rotation, warpgroups, blocks_per_program,
# NaN), one grid block at least (min_programs=1): T < start + count zero-fills (in interpret mode
# x is padded with NaN there, so only the kernel's mask makes the zeros); a count that is not a
# multiple of 64 cuts the last block.
MGPU_WRITE_CASES = [
    (1, 256, 2, 128, 0, 256, False, "dense", 3, 128, False),  # one run of 4 blocks a head
    (2, 200, 2, 64, 64, 320, True, "permutation", 2, 2, False),  # runs of 2 blocks, 2 past T
    (1, 300, 1, 128, 0, 300, False, "permutation", 3, 2, True),  # a NaN; 5 blocks, the last cut
    (2, 40, 2, 64, 8, 72, False, "permutation", 1, 1, False),  # T < 64
    (1, 1024, 1, 128, 64, 896, True, "dense", 2, 16, False),  # 7 steps a warpgroup: the rings turn
]


def _check_mgpu_write(case, *, interpret: bool):
    """quantize_pack_mgpu against the XLA quantiser on the rotated tokens [start, start + count)
    (zeros past T): exact for a signed-permutation rotation (the kernel's quotient is correctly
    rounded; a NaN token gets NaN or inf metadata and codes 0 there too), else codes within one
    level (<= 1% of them) and metadata within 8e-3 relative + 2^-6 of the largest (a rotated
    value may round to the neighbouring bf16, as in the Triton kernel's test)."""
    b, t, hkv, d, start, count, channel_major, rotation, wgs, per_program, nan = case
    rng = np.random.default_rng([b, t, d, start, count])
    x = np.asarray(random_kv(rng, b, t, hkv, d))
    if nan:
        x[0, start + 5, 0, 3] = np.nan
    rot = (signed_permutation(rng, hkv, d) if rotation == "permutation"
           else np.linalg.qr(rng.standard_normal((hkv, d, d)))[0].astype(np.float32))
    cfg = QuantConfig(2, scale_dtype="bfloat16")
    got = quantize_pack_mgpu.quantize_pack(
        jnp.asarray(x, jnp.bfloat16), jnp.asarray(rot), 0.9, bits=2, levels=cfg.levels, group_size=d, span=None,
        scale_dtype=jnp.bfloat16, start=start, count=count, channel_major=channel_major, interpret=interpret,
        config=quantize_pack_mgpu.Config(blocks_per_program=per_program, min_programs=1, warpgroups=wgs))
    x_rot = np.einsum("bthd,hde->bhte", x, rot.astype(np.float64)).astype(np.float32)
    x_rot = np.pad(x_rot, ((0, 0), (0, 0), (0, max(0, start + count - t)), (0, 0)))[:, :, start:start + count]
    want = quant.pack(quant.quantize(jnp.asarray(x_rot, jnp.bfloat16), cfg, 0.9), 2, channel_major=channel_major)
    codes, want_codes = np.asarray(got[0]), np.asarray(want.codes)
    assert codes.shape == want_codes.shape
    if rotation == "permutation":
        np.testing.assert_array_equal(codes, want_codes)
    else:
        unpack = functools.partial(layout.unpack_codes, bits=2, channel_major=channel_major)
        a, w = (np.asarray(unpack(c), np.int32) for c in (codes, want_codes))
        assert np.abs(a - w).max() <= 1 and np.mean(a != w) <= 1e-2, np.mean(a != w)
    for meta, ref in zip(got[1:], (want.lo, want.scale)):
        meta, ref = np.asarray(meta, np.float32), np.asarray(ref, np.float32)
        assert meta.shape == ref.shape
        np.testing.assert_array_equal(np.isfinite(meta), np.isfinite(ref))
        keep = np.isfinite(ref)
        if rotation == "permutation":
            np.testing.assert_array_equal(meta[keep], ref[keep])
        else:
            np.testing.assert_allclose(meta[keep], ref[keep], rtol=8e-3, atol=2**-6 * np.abs(ref[keep]).max())
    if nan:  # token start + 5 is slice 1 of packed row 1; nothing else is touched
        assert (~np.isfinite(np.asarray(got[1], np.float32))).sum() == 1


@pytest.mark.parametrize("case", MGPU_WRITE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_quantize_pack_mgpu_matches_xla(case):
    _check_mgpu_write(case, interpret=True)


@pytest.mark.parametrize("d", [64, 128])
def test_quantize_pack_mgpu_lowers_for_cuda(d):
    """Mosaic GPU's lowering for sm_90 (wgmma, TMA, the in-register packing) accepts the bulk
    write in both code layouts, at 1 and 3 warpgroups."""
    sds = jax.ShapeDtypeStruct
    for channel_major, wgs in ((False, 3), (True, 1)):
        fn = functools.partial(quantize_pack_mgpu.quantize_pack, clip=0.9, bits=2, levels=(0.0, 1.0, 2.0, 3.0),
                               group_size=d, span=None, scale_dtype=jnp.bfloat16, channel_major=channel_major,
                               config=quantize_pack_mgpu.Config(warpgroups=wgs))
        _lower_for_h200(fn, (sds((2, 1000, 2, d), jnp.bfloat16), sds((2, d, d), jnp.float32)))


@pytest.mark.parametrize("d,g,c", [(128, 4, 1), (64, 8, 7)])
def test_triton_kernels_lower_for_cuda(d, g, c):
    """Pallas's Triton lowering (jax side, no GPU) accepts the attention kernel over the
    channel-major V codes and the bulk write in both code layouts, for an H200."""
    b, hkv, rows, sink, window = 2, 2, 256, 64, 256
    sds = jax.ShapeDtypeStruct
    bf, u8 = jnp.bfloat16, jnp.uint8
    args = (sds((b, c, hkv * g, d), jnp.float32), sds((b, hkv, sink, d), bf), sds((b, hkv, sink, d), bf),
            sds((b, hkv, rows, d), u8), sds((b, hkv, d, rows), u8),
            *[sds((b, hkv, 1, 4, rows), bf)] * 4,
            sds((b, hkv, window, d), bf), sds((b, hkv, window, d), bf), sds((b,), jnp.int32))
    attend = lambda q, *cache: mixed_attention.mixed_attention(
        q, layout.CacheArrays(*cache), sink=sink, window=window, bits=2, levels=(0.0, 1.0, 2.0, 3.0),
        softmax_scale=d ** -0.5)
    write_args = (sds((b, 4 * rows, hkv, d), bf), sds((hkv, d, d), jnp.float32), sds((), jnp.float32))
    writes = [functools.partial(quantize_pack.quantize_pack, bits=2, levels=(0.0, 1.0, 2.0, 3.0),
                                group_size=d, span=None, scale_dtype=bf, channel_major=channel_major)
              for channel_major in (False, True)]
    for fn, fn_args in ((attend, args), *((w, write_args) for w in writes)):
        _lower_for_h200(fn, fn_args)


def _lower_for_h200(fn, args):
    """Lower fn(*args) (ShapeDtypeStructs) for an H200 without a GPU: Pallas' Triton and Mosaic
    GPU lowering rules run (layouts, shapes, wgmma and TMA checks), nothing is compiled."""
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=1, platform="cuda")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


# ---------------------------------------------------------------------------------------
# Mosaic GPU kernel (mixed_attention_mgpu): decode on int8 MMAs, G = D, uniform codes, bf16
# metadata. On CPU it runs in Mosaic GPU interpret mode (register operands staged in shared
# memory, the unpacking and the transposed weight store as array ops); `test_mgpu_lowers_for_cuda`
# runs the Python side of its sm_90 compilation (layouts, wgmma and TMA checks) without a GPU.

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
    spec = _spec(d, d, "uniform", "bfloat16", hist=hist)
    rng = np.random.default_rng([d, g, hist, target, pattern])
    assert mixed_attention_mgpu.supports(spec, 1, g)
    config = MgpuConfig(3, 2, target) if d <= 128 else MgpuConfig(1, 3, target)  # 3 per block: large shapes'
    kernel = functools.partial(mixed_attention_mgpu.mixed_attention, config=config)
    _check_attention(rng, spec, g, 1, _lengths(rng, pattern, 1, spec), kernel=kernel, k_shift=True,
                     rotates=True)


@pytest.mark.parametrize("sink,window", [(64, 192), (0, 100)])
def test_mgpu_sink_and_ring_match_reference(sink, window):
    """A production-size sink and a ring of 192 (the kernel's bf16 blocks of 64: 1 + 3, taken
    by the program holding their units, here one of their own), and no sink with a ring of
    100 (padded to 2 blocks;
    the ring stands in for the sink's operands); lengths inside the sink, inside the ring, on
    S0 + W and full. (A sink of 8, padded to a block: the other cases.)"""
    spec = _spec(64, 64, "uniform", "bfloat16", sink=sink, window=window, hist=256)
    rng = np.random.default_rng([sink, 5])
    lengths = np.array([1, sink + 70, sink + window, spec.max_len], np.int32)
    _check_attention(rng, spec, 3, 1, lengths, kernel=mixed_attention_mgpu.mixed_attention, rotates=True)


def test_mgpu_one_warpgroup_three_buffers_match_reference():
    """One program per block with 3 TMA buffers at D = 128 (`schedule`'s default where
    programs are few, and at D = 256): steps i + 1 and i + 2 in flight while step i is
    computed (4 steps: the buffers wrap); both rotations in XLA (decode_start's
    query_rot=None path and decode_finish's output_rot=None path)."""
    spec = _spec(128, 128, "uniform", "bfloat16", hist=1024)
    rng = np.random.default_rng(3)
    kernel = functools.partial(mixed_attention_mgpu.mixed_attention, config=MgpuConfig(1, 3, 8))
    _check_attention(rng, spec, 4, 1, _lengths(rng, 13, 1, spec), kernel=kernel, k_shift=True,
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
    spec = _spec(128, 64, "uniform", "bfloat16", hist=1536)  # G < D
    rng = np.random.default_rng(0)
    q, cache, params = _random_case(rng, spec, 4, 1, np.array([10, 20, 30, 40], np.int32))
    assert not mixed_attention_mgpu.supports(spec, 1, 4)
    assert not mixed_attention_mgpu.supports(_spec(128, 128, "uniform", "bfloat16", hist=1536), 7, 4)
    assert not mixed_attention_mgpu.supports(_spec(128, 128, "uniform", "float32", hist=1536), 1, 4)
    with pytest.raises(ValueError, match="G=D"):
        attention.kernel_attend(mixed_attention_mgpu.mixed_attention)(q, cache, params)
    spec = _spec(128, 128, "uniform", "bfloat16", hist=1536)
    q, cache, params = _random_case(rng, spec, 4, 1, np.array([10, 20, 30, 40], np.int32))
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
    spec = _spec(128, 128, "uniform", "bfloat16", hist=1536)
    assert attention.resolve("auto", spec, 1, 4, backend="gpu") == "pallas_mosaic_gpu"
    d256 = _spec(256, 256, "uniform", "bfloat16", hist=1536)
    assert attention.resolve("auto", d256, 1, 4, backend="gpu") == "pallas_mosaic_gpu"
    assert attention.resolve("auto", spec, 7, 4, backend="gpu") == "pallas"
    assert attention.resolve("auto", spec, 1, 16, backend="gpu") == "pallas"
    d64 = _spec(64, 64, "uniform", "bfloat16", hist=1536)
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
        _lower_for_h200(lambda *a: fn(*a[:-2], query_rot=a[-2], output_rot=a[-1]), (*args, rot, rot))
    else:
        _lower_for_h200(fn, args)


# ---------------------------------------------------------------------------------------
# The same checks compiled for a real GPU (Triton lowering rules apply), in the groups of the
# module docstring: each test carries the marker `gpu` and its group's.


def on_gpu(group: str):
    """Mark a test as compiled-GPU only: markers `gpu` and `group` (conftest.GPU_GROUPS),
    skipped off a GPU."""
    def mark(fn):
        for m in (pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU"),
                  getattr(pytest.mark, group), pytest.mark.gpu):
            fn = m(fn)
        return fn
    return mark


@on_gpu("gpu_triton")
@pytest.mark.parametrize("pattern", range(1))
@pytest.mark.parametrize("config", ATTN_CONFIGS, ids=lambda c: "d{}-g{}-c{}-G{}-{}-{}".format(*c))
def test_attention_on_gpu(config, pattern):
    test_attention_matches_reference(config, pattern)


@on_gpu("gpu_triton")
@pytest.mark.parametrize("d,g,c", [(128, 4, 1), (128, 8, 64)])
def test_attention_on_gpu_real_windows(d, g, c):
    """Production sink/window (64/256), a few thousand history tokens, ragged batch."""
    spec = _spec(d, d, "uniform", "bfloat16", sink=64, window=256, hist=3000)
    rng = np.random.default_rng([d, g, c])
    _check_attention(rng, spec, g, c, np.array([c, 64 + 256 + 1, 1700, spec.max_len], np.int32))


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
    spec = _spec(d, d, "uniform", "bfloat16", sink=64, window=256, hist=2048)
    rng = np.random.default_rng([d, g])
    _check_attention(rng, spec, g, 1, np.array([1, 64 + 256 + 1, 1700, spec.max_len], np.int32),
                     kernel=mixed_attention_mgpu.mixed_attention, rotates=True)


@on_gpu("gpu_decode")
def test_auto_attend_on_gpu_runs_the_preferred_kernel():
    """attend(implementation="auto") at D = 128 decode: the Mosaic GPU kernel on sm_90 (the
    Triton one elsewhere), through the same entry point the models use, against the reference."""
    spec = _spec(128, 128, "uniform", "bfloat16", sink=64, window=256, hist=3072)
    hopper = jax.devices()[0].compute_capability == "9.0"
    assert attention.resolve("auto", spec, 1, 4) == ("pallas_mosaic_gpu" if hopper else "pallas")
    _check_attention(np.random.default_rng(11), spec, 4, 1,
                     np.array([1, 64 + 256 + 1, 1700, spec.max_len], np.int32), implementation="auto")


def _decision_margin(x, rot, lengths, cache, spec):
    """|distance| of each history element's position u = (x·R - lo)/scale (float64, from
    `cache`'s metadata) to the nearest decision boundary of the codebook, in units of
    scale; NaN outside the written history. x [2 (k, v), B, T, H, D]; rot [H, D, D]."""
    bits, s0, w = spec.quant.bits, spec.sink, spec.window
    levels = np.asarray(spec.quant.levels)
    bounds = 0.5 * (levels[1:] + levels[:-1])
    xr = np.einsum("kbthd,hde->kbhte", np.asarray(x, np.float64), np.asarray(rot, np.float64))
    out = []
    for which, r in (("k", 0), ("v", 1)):
        lo = np.asarray(layout.unpack_meta(getattr(cache, f"hist_lo_{which}"), bits), np.float64)
        sc = np.asarray(layout.unpack_meta(getattr(cache, f"hist_scale_{which}"), bits), np.float64)
        n_hist = lo.shape[2]
        g = spec.head_dim // lo.shape[-1]
        u = (xr[r][:, :, s0: s0 + n_hist] - np.repeat(lo, g, -1)) / np.repeat(sc, g, -1)
        margin = np.min(np.abs(u[..., None] - bounds), axis=-1)
        slot = np.arange(n_hist)[None, None, :, None]
        held = slot < (np.asarray(lengths) - s0 - w)[:, None, None, None]
        out.append(np.where(held, margin, np.nan))
    return out


@on_gpu("gpu_write")
@pytest.mark.parametrize("case", MGPU_WRITE_CASES + [(2, 4096, 8, 128, 0, 4096, True, "permutation", 3, 128, True),
                                  (2, 4096, 8, 128, 256, 3840, False, "dense", 3, 128, False)],
                         ids=lambda c: "-".join(map(str, c)))
def test_quantize_pack_mgpu_on_gpu(case):
    _check_mgpu_write(case, interpret=False)


@on_gpu("gpu_write")
@pytest.mark.parametrize("config", WRITE_CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_write_prompt_on_gpu_ties_only(config):
    """With an exact (signed-permutation) rotation the compiled kernel and XLA agree on every
    sink/ring value and every metadata entry; a code may differ by one level only where
    u = (x - lo)/scale sits on a decision boundary (bf16 lo/scale put many elements
    exactly on k + 1/2, and Triton's division is not correctly rounded; the (64, 64, uniform,
    bf16) config runs the Mosaic GPU write, whose division is)."""
    d, g_size, codebook, scale_dtype, bits = config
    spec = CacheSpec(1, 3, 2, d, SINK + 90 + WINDOW, SINK, WINDOW,
                     QuantConfig(bits, None if g_size == d else g_size, codebook, scale_dtype))
    rng = np.random.default_rng([d, g_size, bits])
    rot = signed_permutation(rng, spec.kv_heads, d)
    params = cache_lib.LayerParams.create(rot, rot, 0.9, 0.9, num_layers=1, kv_heads=spec.kv_heads).layer(0)
    t = spec.max_len - 17
    k = jnp.asarray(random_kv(rng, 3, t, spec.kv_heads, d), jnp.bfloat16)
    v = jnp.asarray(random_kv(rng, 3, t, spec.kv_heads, d), jnp.bfloat16)
    lengths = jnp.asarray([t, t - 30, 40])
    write = jax.jit(updates.write_prompt, static_argnames=("implementation",))
    empty = cache_lib.OscarCache.init(spec).layer(0)
    got = write(empty, k, v, lengths, params, implementation=_write_kernel(spec))
    want = write(empty, k, v, lengths, params, implementation="xla")
    for name in ("sink_k", "sink_v", "recent_k", "recent_v", "lengths", "hist_lo_k", "hist_lo_v",
                 "hist_scale_k", "hist_scale_v"):
        np.testing.assert_allclose(np.asarray(getattr(got, name), np.float32),
                                   np.asarray(getattr(want, name), np.float32), rtol=1e-5, err_msg=name)
    margins = _decision_margin(np.stack([np.asarray(k, np.float32), np.asarray(v, np.float32)]), rot,
                               lengths, want, spec)
    for which, margin in zip("kv", margins):
        unpack = functools.partial(layout.unpack_codes, bits=bits,
                                   channel_major=layout.CHANNEL_MAJOR[which])
        a, b = (np.asarray(unpack(getattr(c, f"hist_codes_{which}")), np.int32) for c in (got, want))
        held = ~np.isnan(margin)
        differ = (a != b) & held
        assert np.abs(a - b)[held].max(initial=0) <= 1, which
        assert np.all(margin[differ] < 1e-4), (
            f"{which}: {differ.sum()} codes differ, {np.sum(margin[differ] >= 1e-4)} away from a boundary")


@on_gpu("gpu_write")
@pytest.mark.parametrize("config", WRITE_CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_write_prompt_on_gpu(config):
    # A dense rotation adds bf16 rounding of x·R (1 ulp moves lo/scale and the codes near
    # a boundary): measured on an H200, <= 0.34% of code elements, by one level.
    test_write_prompt_pallas_matches_xla(config, "dense", 0, exact=False)
