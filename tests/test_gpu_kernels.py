"""GPU Pallas kernels other than the Mosaic GPU attention against the XLA oracles: the Triton
attention kernel (mixed_attention), the implementation names' dispatch, and the bulk writes
(Triton quantize_pack, Mosaic GPU quantize_pack_mgpu, write_prompt). The Mosaic GPU decode
kernel and its parts: tests/test_mgpu_kernels.py; the cases and checks both share:
tests/gpu_cases.py.

On CPU the kernels run in Pallas interpret mode (`interpret=True`; the interpreter fills
kernel outputs with NaN before the call, so an unwritten element fails the check). The
tests marked `gpu` run the same checks compiled on a real GPU, in groups that each run in
under 5 minutes on one H100 (markers registered in tests/conftest.py, which also keeps the
compilations in build/jax_cache across runs):

    pytest -p no:cacheprovider -n 0 -m gpu_triton tests/test_gpu_kernels.py  # Triton attention (14)
    pytest -p no:cacheprovider -n 0 -m gpu_write tests/test_gpu_kernels.py   # bulk writes, write_prompt (19)

(`-m gpu` over this file and tests/test_mgpu_kernels.py runs all five groups; it also selects
tests/test_serving_path.py's `gpu_serving` and tests/test_append_kernel.py's cases of `gpu_write`.)
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

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cache_oracle import random_kv, signed_permutation
from gpu_cases import (INTERPRET, SINK, WINDOW, cache_spec, check_attention, lower_for_h200, on_gpu,
                       ragged_lengths, random_case, reference)
from oscar_jax import attention, dispatch, quant
from oscar_jax import cache as cache_lib
from oscar_jax import updates
from oscar_jax.config import CacheSpec, QuantConfig
from oscar_jax.pallas_kernels import layout
from oscar_jax.pallas_kernels.gpu import mixed_attention, quantize_pack, quantize_pack_mgpu

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


def _write_kernel(spec: CacheSpec) -> str:
    """The bulk write that "auto" runs for `spec` on a Hopper GPU: Mosaic GPU where it applies,
    else Triton."""
    return "pallas_mosaic_gpu" if quantize_pack_mgpu.supports(spec) else "pallas"


@pytest.mark.parametrize("pattern", range(N_PATTERNS))
@pytest.mark.parametrize("config", ATTN_CONFIGS, ids=lambda c: "d{}-g{}-c{}-G{}-{}-{}".format(*c))
def test_attention_matches_reference(config, pattern):
    d, g, c, g_size, codebook, scale_dtype = config
    spec = cache_spec(d, g_size, codebook, scale_dtype)
    rng = np.random.default_rng([d, g, c, g_size, pattern])
    check_attention(rng, spec, g, c, ragged_lengths(rng, pattern, c, spec))


def test_attention_splits_and_query_blocks():
    """Small blocks: 3 history splits of up to 3 steps of 16 rows (the longest row: 3, 3 and 2;
    shorter rows stop inside a split or before one), several query blocks; keys stored minus a
    key shift (the lse is corrected outside the kernel)."""
    spec = cache_spec(64, 16, "uniform", "bfloat16", hist=512)
    rng = np.random.default_rng(7)
    g, c = 4, 7
    q, cache, params = random_case(rng, spec, g, c, np.array([20, 150, 400, 584], np.int32), k_shift=True)
    blocks = mixed_attention.BlockSizes(block_rows=16, block_dense=16, block_q=16, num_splits=3)
    fn = attention.kernel_attend(functools.partial(mixed_attention.mixed_attention, block_sizes=blocks))
    o, lse = jax.jit(functools.partial(fn, interpret=INTERPRET))(q, cache, params)
    o_ref, lse_ref = reference(q, cache, params)
    assert float(jnp.linalg.norm(o - o_ref) / jnp.linalg.norm(o_ref)) <= 1e-2
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_ref), atol=2e-2, rtol=5e-3)


def test_dispatch_refuses_unsupported_specs():
    spec4 = CacheSpec(1, 1, 1, 64, 128, 8, 16, QuantConfig(4))
    spec_g8 = CacheSpec(1, 1, 1, 64, 128, 8, 16, QuantConfig(2, 8))
    assert mixed_attention.supports(cache_spec(128, 128, "uniform", "bfloat16"))
    assert not mixed_attention.supports(spec4) and not mixed_attention.supports(spec_g8)
    with pytest.raises(ValueError, match="does not support"):
        attention.resolve("pallas", spec4, 1, 4)
    assert attention.resolve("auto", spec4, 1, 4, backend="gpu") == "xla"
    g_below_d = cache_spec(64, 32, "uniform", "bfloat16")
    assert attention.resolve("auto", g_below_d, 1, 4, backend="gpu") == "pallas"
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
    spec = cache_spec(128, 128, "uniform", "bfloat16")
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
    assert dispatch.resolve("write", "auto", cache_spec(128, 32, "uniform", "bfloat16"), backend="gpu") == "pallas"
    for op in ("attend", "write"):
        with pytest.raises(ValueError, match="expected 'auto' or one of"):
            dispatch.resolve(op, "triton", spec)
    if jax.default_backend() == "cpu":
        rng = np.random.default_rng(2)
        q, cache, params = random_case(rng, spec, 4, 1, np.array([10, 20, 30, 40], np.int32))
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
        lower_for_h200(fn, (sds((2, 1000, 2, d), jnp.bfloat16), sds((2, d, d), jnp.float32)))


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
        lower_for_h200(fn, fn_args)


# ---------------------------------------------------------------------------------------
# The same checks compiled for a real GPU (Triton lowering rules apply), in the groups of the
# module docstring: each test carries the marker `gpu` and its group's.


@on_gpu("gpu_triton")
@pytest.mark.parametrize("pattern", range(1))
@pytest.mark.parametrize("config", ATTN_CONFIGS, ids=lambda c: "d{}-g{}-c{}-G{}-{}-{}".format(*c))
def test_attention_on_gpu(config, pattern):
    test_attention_matches_reference(config, pattern)


@on_gpu("gpu_triton")
@pytest.mark.parametrize("d,g,c", [(128, 4, 1), (128, 8, 64)])
def test_attention_on_gpu_real_windows(d, g, c):
    """Production sink/window (64/256), a few thousand history tokens, ragged batch."""
    spec = cache_spec(d, d, "uniform", "bfloat16", sink=64, window=256, hist=3000)
    rng = np.random.default_rng([d, g, c])
    check_attention(rng, spec, g, c, np.array([c, 64 + 256 + 1, 1700, spec.max_len], np.int32))


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
