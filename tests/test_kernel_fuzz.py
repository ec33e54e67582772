"""Randomised kernel-vs-reference fuzzing with hypothesis: one test per kernel family and
kernel (decode attention: Triton, Mosaic GPU and TPU; extend (C > 1): Triton, TPU and
`attention.flash_attend`; bulk write: Triton, Mosaic GPU and TPU), run in Pallas' GPU or TPU
interpret mode on the CPU (flash_attend through `jax.nn.dot_product_attention`'s XLA path on
the CPU, its cuDNN path where the backend is a GPU).

Each example draws one static configuration within what the kernel supports (its
`supports(...)`, or its argument checks): head dim, GQA ratio, batch, KV heads, sink,
window, history length, bits, group size, codebook, metadata dtype, and kernel settings
(TPU history block, Triton block sizes, Mosaic GPU warpgroups), compiles the kernel and the
reference once, then runs `DRAWS` cases on it: ragged lengths around the sink, window,
byte, tile and block edges (or start/count/T for the writes) and fresh random data. The
attention kernels see arbitrary cache contents (random codes and metadata, bf16 segments,
junk past each row's length) and are compared with `oscar_jax.reference.attend` (its o in
the R_V basis, as the kernels return it); the bulk writes with the XLA path of
`write_prompt` (rotate, round to bf16, `quant.quantize`, `quant.pack`).

CI runs `CI_EXAMPLES` examples per test (about 80 cases); `-m slow` runs `SLOW_EXAMPLES`
(>= 500 cases), before kernel results are published:
  .venv/bin/python -m pytest tests/test_kernel_fuzz.py -m slow -n 2
Examples are derandomized (the same in every run); a failure prints the drawn configuration,
lengths and data seed, and `@reproduce_failure` blob.

Tolerances are the kernels' own (tests/test_gpu_kernels.py, tests/test_mgpu_kernels.py,
tests/test_tpu_kernels.py): GPU attention (bf16 MMA operands) per-row relative Frobenius error
<= 1e-2, lse within 2e-2 + 5e-3 |lse| (flash_attend, whose probabilities and output are bf16
too: 3e-2, and 1e-2 |lse|, which cuDNN returns in bf16); TPU attention (3 bf16 passes) 5e-5;
writes with a signed-permutation rotation exact (the TPU write's codes may differ on rounding
ties only, < 0.2% of them), with a dense rotation codes within one level (a rotated value may
round to the neighbouring bf16: <= 1% of them and 4 more) and metadata within 8e-3 relative +
2^-6 of the largest.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st
# The race detector's result has no public accessor in jax 0.11.2.
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret

import oscar_jax as oj
from oscar_jax import attention, quant, reference
from oscar_jax.config import HIST_TILE, LLOYD_MAX_SPAN, CacheSpec, QuantConfig
from oscar_jax.pallas_kernels import layout
from oscar_jax.pallas_kernels.gpu import mixed_attention as triton_attention
from oscar_jax.pallas_kernels.gpu import mixed_attention_mgpu as mgpu_attention
from oscar_jax.pallas_kernels.gpu import quantize_pack as triton_write
from oscar_jax.pallas_kernels.gpu import quantize_pack_mgpu as mgpu_write
from oscar_jax.pallas_kernels.tpu import bulk_write as tpu_write
from oscar_jax.pallas_kernels.tpu import mixed_attention as tpu_attention

DRAWS = 4  # cases (lengths and data) per drawn configuration: one compilation
CI_EXAMPLES = {"triton": 3, "mosaic_gpu": 2, "tpu": 3, "flash": 3}
SLOW_EXAMPLES = {"triton": 30, "mosaic_gpu": 20, "tpu": 30, "flash": 30}


def _fuzz(case_fn, examples: int, slow: bool):
    """Run case_fn(data, slow) on `examples` derandomized hypothesis examples."""

    @settings(max_examples=examples, derandomize=True, deadline=None, database=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(st.data())
    def run(data):
        case_fn(data, slow)

    run()


def _random_rotation(rng, h: int, d: int, dense: bool) -> np.ndarray:
    """f32 [H, D, D]: a random orthogonal matrix, or a signed permutation (exact products)."""
    if dense:
        return np.linalg.qr(rng.standard_normal((h, d, d)))[0].astype(np.float32)
    out = np.zeros((h, d, d), np.float32)
    for i in range(h):
        out[i, np.arange(d), rng.permutation(d)] = rng.choice([-1.0, 1.0], d)
    return out


# ---------------------------------------------------------------------------- attention


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    """One static attention configuration (one compilation)."""

    kernel: str  # "triton" | "mosaic_gpu" | "tpu" | "flash" (`attention.flash_attend`)
    d: int
    g: int
    c: int
    batch: int
    hkv: int
    sink: int
    window: int
    hist: int
    quant: QuantConfig
    hist_rows: int | None = None  # TPU history block (packed rows); None: its default
    warpgroups: int | None = None  # Mosaic GPU programs per block; None: its default
    v_folded: bool = True  # params fold R_V into the output (False: attention rotates back)

    @property
    def spec(self) -> CacheSpec:
        return CacheSpec(1, self.batch, self.hkv, self.d, self.sink + self.hist + self.window, self.sink,
                         self.window, self.quant)

    def edges(self) -> list[int]:
        """Lengths on the sink, window, byte, tile and block edges (and one either side)."""
        s0, w, top, tpb = self.sink, self.window, self.spec.max_len, self.quant.tokens_per_byte
        base = {self.c, s0 - 1, s0, s0 + 1, s0 + w - 1, s0 + w, s0 + w + 1, s0 + w + tpb - 1,
                s0 + w + tpb, s0 + w + self.c, top - 1, top}
        for tile in {64, HIST_TILE, (self.hist_rows or 2048) * tpb}:
            base |= {s0 + w + k * tile + e for k in range(1, self.hist // tile + 1) for e in (-1, 0, 1)}
        return sorted(n for n in base if self.c <= n <= top)


def _supported(case: AttentionCase) -> bool:
    spec = case.spec
    if case.kernel == "triton":  # a zero-size sink or history fails in the kernel, which `supports` admits
        return triton_attention.supports(spec) and spec.sink > 0 and spec.hist_capacity > 0
    if case.kernel == "mosaic_gpu":
        return mgpu_attention.supports(spec, case.c, case.g)
    return True  # the TPU kernel and flash_attend take every CacheSpec


@st.composite
def attention_cases(draw, kernel: str, extend: bool, slow: bool) -> AttentionCase:
    """A configuration the kernel supports: every head dim the GPU kernels take, GQA ratios
    1-8, group sizes down to 16 (8 on TPU), both codebooks and metadata dtypes where allowed,
    2/4/8 bits on TPU, no sink to 64, windows 8-64, histories of 0 to several tiles."""
    d = draw(st.sampled_from([64, 128, 256] if slow else [64, 128]), label="D")
    c = draw(st.sampled_from([2, 3, 7, 8, 16]), label="C") if extend else 1
    window = draw(st.sampled_from([w for w in (8, 16, 32, 64) if w >= c]), label="W")
    g = draw(st.sampled_from([1, 2, 3, 4, 8]), label="g")
    if kernel == "mosaic_gpu":
        q = QuantConfig()
    else:
        bits = draw(st.sampled_from([2, 4, 8] if kernel in ("tpu", "flash") else [2]), label="bits")
        smallest = 8 if kernel in ("tpu", "flash") else 16
        group = draw(st.sampled_from([None] + [s for s in (8, 16, 32, 64, 128) if smallest <= s < d]),
                     label="group size")
        codebook = draw(st.sampled_from(["uniform", "lloyd_max"]), label="codebook") if bits == 2 else "uniform"
        q = QuantConfig(bits, group, codebook, draw(st.sampled_from(["bfloat16", "float32"]), label="metadata"))
    case = AttentionCase(
        kernel, d, g, c,
        batch=draw(st.integers(1, 4 if slow else 3), label="B"),
        hkv=draw(st.integers(1, 3 if slow else 2), label="Hkv"),
        sink=draw(st.sampled_from([0, 4, 16, 64]), label="S0"),
        window=window,
        hist=draw(st.integers(0, 1500 if slow else 700), label="history tokens") // q.tokens_per_byte
        * q.tokens_per_byte,
        quant=q,
        hist_rows=draw(st.sampled_from([None, 128, 256]), label="TPU hist_rows") if kernel == "tpu" else None,
        warpgroups=draw(st.sampled_from([None, 1]), label="warpgroups") if kernel == "mosaic_gpu" else None,
        v_folded=draw(st.booleans(), label="v_folded") if kernel == "flash" else True)
    if not _supported(case):
        assume(False)
    return case


@functools.cache
def _attention_fns(case: AttentionCase):
    """Jitted (kernel, reference) of one configuration, cached across its draws."""
    spec = case.spec
    static = dict(sink=spec.sink, window=spec.window, bits=spec.quant.bits, levels=spec.quant.levels,
                  softmax_scale=spec.head_dim ** -0.5, interpret=True)
    if case.kernel == "flash":  # q unrotated, the cache and params themselves
        implementation = "cudnn" if jax.default_backend() == "gpu" else "xla"
        kernel = functools.partial(attention.flash_attend, implementation=implementation)
    elif case.kernel == "triton":
        kernel = functools.partial(triton_attention.mixed_attention, **static)
    elif case.kernel == "mosaic_gpu":
        config = None if case.warpgroups is None else mgpu_attention.Config(case.warpgroups, 3, 8)
        kernel = functools.partial(mgpu_attention.mixed_attention, config=config, **static)
    else:
        config = tpu_attention.AttentionConfig(case.hist_rows or 2048)
        kernel = functools.partial(tpu_attention.mixed_attention, config=config, **static)
    return jax.jit(kernel), jax.jit(reference.attend)


def _random_cache(case: AttentionCase, lengths, rng):
    """Arbitrary cache contents (codes, metadata of quantised-data magnitude, bf16 segments,
    also past each row's length), a per-head rotation (params v_folded: the reference
    returns o in the R_V basis, as the kernels do) and queries q [B, C, Hq, D]."""
    spec = case.spec
    b, h, d = spec.batch, spec.kv_heads, spec.head_dim
    tpb, rows, ng = spec.quant.tokens_per_byte, spec.hist_capacity // spec.quant.tokens_per_byte, spec.num_groups
    meta = spec.quant.jnp_scale_dtype
    bf16 = lambda n: jnp.asarray(rng.standard_normal((b, h, n, d)) * 1.5 + 0.3, jnp.bfloat16)
    lo = lambda: jnp.asarray(rng.standard_normal((b, h, ng, tpb, rows)) - 1.0, meta)
    scale = lambda: jnp.asarray(rng.uniform(0.05, 1.0, (b, h, ng, tpb, rows)) * 3 / spec.quant.levels[-1], meta)
    codes = lambda *shape: jnp.asarray(rng.integers(0, 256, (b, h, *shape)), jnp.uint8)
    cache = oj.OscarCache(
        sink_k=bf16(spec.sink), sink_v=bf16(spec.sink), hist_codes_k=codes(rows, d), hist_codes_v=codes(d, rows),
        hist_lo_k=lo(), hist_scale_k=scale(), hist_lo_v=lo(), hist_scale_v=scale(),
        recent_k=bf16(spec.window), recent_v=bf16(spec.window), lengths=jnp.asarray(lengths, jnp.int32),
        overflow=jnp.zeros((b,), bool), spec=spec)
    params = oj.LayerParams.create(_random_rotation(rng, h, d, True), _random_rotation(rng, h, d, True),
                                   0.9, 0.9, num_layers=1, kv_heads=h, v_folded=case.v_folded).layer(0)
    q = jnp.asarray(rng.standard_normal((b, case.c, h * case.g, d)) * rng.uniform(0.5, 2.0), jnp.float32)
    return q, cache, params


def _attention_case(kernel: str, extend: bool, data, slow: bool):
    case = data.draw(attention_cases(kernel, extend, slow), label="configuration")
    run_kernel, run_reference = _attention_fns(case)
    edges = case.edges()
    for _ in range(DRAWS):
        lengths = data.draw(st.lists(st.one_of(st.sampled_from(edges), st.integers(case.c, case.spec.max_len)),
                                     min_size=case.batch, max_size=case.batch), label="lengths")
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="data seed"))
        q, cache, params = _random_cache(case, lengths, rng)
        b, c, hq, d = q.shape
        q_rot = jnp.einsum("bckgd,kde->bckge", q.reshape(b, c, case.hkv, case.g, d), params.query_rot,
                           precision=jax.lax.Precision.HIGHEST).reshape(q.shape)
        if kernel == "flash":
            o, lse = jax.block_until_ready(run_kernel(q, cache, params))
        else:
            o, lse = jax.block_until_ready(run_kernel(q_rot, layout.CacheArrays.of(cache)))
        o_ref, lse_ref = run_reference(q, cache, params)
        assert o.shape == o_ref.shape and lse.shape == lse_ref.shape
        o, lse, o_ref, lse_ref = (np.asarray(x, np.float32) for x in (o, lse, o_ref, lse_ref))
        assert np.isfinite(o).all() and np.isfinite(lse).all()
        if kernel == "tpu":
            assert not tpu_interpret.races.races_found, "TPU interpret mode detected a data race"
            np.testing.assert_allclose(lse, lse_ref, atol=5e-5, rtol=5e-5)
            np.testing.assert_allclose(o, o_ref, atol=5e-5, rtol=5e-5)
        else:
            bound = 3e-2 if kernel == "flash" else 1e-2
            for row in range(b):
                rel = np.linalg.norm(o[row] - o_ref[row]) / np.linalg.norm(o_ref[row])
                assert rel <= bound, f"row {row} (length {lengths[row]}): relative error {rel:.3e}"
            # flash_attend's lse comes from cuDNN in bf16 (8 significant bits)
            np.testing.assert_allclose(lse, lse_ref, atol=2e-2, rtol=1e-2 if kernel == "flash" else 5e-3)


@pytest.mark.parametrize("kernel", ["triton", "mosaic_gpu", "tpu"])
def test_decode_attention_fuzz(kernel):
    _fuzz(functools.partial(_attention_case, kernel, False), CI_EXAMPLES[kernel], slow=False)


@pytest.mark.parametrize("kernel", ["triton", "tpu", "flash"])
def test_extend_attention_fuzz(kernel):
    _fuzz(functools.partial(_attention_case, kernel, True), CI_EXAMPLES[kernel], slow=False)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["triton", "mosaic_gpu", "tpu"])
def test_decode_attention_fuzz_sweep(kernel):
    _fuzz(functools.partial(_attention_case, kernel, False), SLOW_EXAMPLES[kernel], slow=True)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["triton", "tpu", "flash"])
def test_extend_attention_fuzz_sweep(kernel):
    _fuzz(functools.partial(_attention_case, kernel, True), SLOW_EXAMPLES[kernel], slow=True)


# ---------------------------------------------------------------------------- bulk write


@dataclasses.dataclass(frozen=True)
class WriteCase:
    """One static bulk-write configuration: x [B, T, Hkv, D], tokens [start, start + count)
    written (zeros past T)."""

    kernel: str
    batch: int
    t: int
    hkv: int
    d: int
    quant: QuantConfig
    start: int
    count: int
    channel_major: bool
    dense: bool  # a dense rotation (else a signed permutation: exact)
    settings: tuple = ()  # kernel keyword arguments (block sizes, warpgroups)


@st.composite
def write_cases(draw, kernel: str, slow: bool) -> WriteCase:
    d = draw(st.sampled_from([64, 128] if kernel == "mosaic_gpu" else [32, 64, 128, 256] if slow else [32, 64, 128]),
             label="D")
    if kernel == "mosaic_gpu":
        q = QuantConfig()
    else:
        bits = draw(st.sampled_from([2, 4, 8]), label="bits")
        smallest = 8 if kernel == "tpu" else 16
        group = draw(st.sampled_from([None] + [s for s in (8, 16, 32, 64) if smallest <= s < d]), label="group size")
        codebook = draw(st.sampled_from(["uniform", "lloyd_max"]), label="codebook") if bits == 2 else "uniform"
        q = QuantConfig(bits, group, codebook, draw(st.sampled_from(["bfloat16", "float32"]), label="metadata"))
    tpb = q.tokens_per_byte
    count = draw(st.integers(1, (1200 if slow else 500) // tpb), label="count / tpb") * tpb
    start = 0 if kernel == "tpu" else draw(st.integers(0, 80), label="start")
    t = count if kernel == "tpu" else draw(st.integers(1, start + count + 40), label="T")
    if kernel == "triton":
        settings = (("block_sizes", triton_write.BlockSizes(
            block_rows=draw(st.sampled_from([16, 32]), label="block rows"),
            loop=draw(st.sampled_from([1, 2, 4]), label="loop"))),)
    elif kernel == "mosaic_gpu":
        settings = (("config", mgpu_write.Config(
            blocks_per_program=draw(st.sampled_from([1, 2, 128]), label="blocks per program"), min_programs=1,
            warpgroups=draw(st.sampled_from([1, 2, 3]), label="warpgroups"))),)
    else:
        settings = (("block_sizes", tpu_write.WriteBlockSizes(draw(st.sampled_from([512, 2048]), label="block"))),)
    return WriteCase(kernel, draw(st.integers(1, 3), label="B"), t, draw(st.integers(1, 3), label="Hkv"), d, q,
                     start, count, draw(st.booleans(), label="channel-major"),
                     draw(st.booleans(), label="dense rotation"), settings)


@functools.cache
def _write_fn(case: WriteCase):
    q, settings = case.quant, dict(case.settings)
    span = LLOYD_MAX_SPAN if q.codebook == "lloyd_max" else None
    if case.kernel == "tpu":
        fn = functools.partial(tpu_write.bulk_write, bits=q.bits, group_size=q.group_size, levels=q.levels,
                               codebook=q.codebook, lloyd_max_span=span, scale_dtype=q.scale_dtype,
                               channel_major=case.channel_major, interpret=True, **settings)
    else:
        module = triton_write if case.kernel == "triton" else mgpu_write
        fn = functools.partial(module.quantize_pack, bits=q.bits, levels=q.levels, group_size=q.group_size or case.d,
                               span=span, scale_dtype=q.jnp_scale_dtype, start=case.start, count=case.count,
                               channel_major=case.channel_major, interpret=True, **settings)
    return jax.jit(fn)


@functools.partial(jax.jit, static_argnames=("cfg", "start", "count", "channel_major"))
def _write_reference(x, rot, clip, *, cfg: QuantConfig, start: int, count: int, channel_major: bool):
    """The XLA path of `write_prompt`: rotate (f32, HIGHEST), tokens [start, start + count)
    zero-padded past T, round to bf16, quantise, pack -> (packed, unpacked, rotated bf16 x)."""
    x_rot = jnp.einsum("bthd,hde->bhte", x.astype(jnp.float32), rot, precision=jax.lax.Precision.HIGHEST)
    x_rot = x_rot[:, :, start:start + count]
    x_rot = jnp.pad(x_rot, ((0, 0), (0, 0), (0, count - x_rot.shape[2]), (0, 0))).astype(jnp.bfloat16)
    unpacked = quant.quantize(x_rot, cfg, clip)
    return quant.pack(unpacked, cfg.bits, channel_major=channel_major), unpacked, x_rot


def _on_rounding_tie(x_rot, unpacked: quant.Quantized, group: int) -> np.ndarray:
    """bool [B, H, T, D]: the uniform quantiser's (x - lo) / scale lies on a half level, where
    either neighbouring code is nearest."""
    lo = np.repeat(np.asarray(unpacked.lo, np.float64), group, axis=-1)
    scale = np.repeat(np.asarray(unpacked.scale, np.float64), group, axis=-1)
    u = (np.asarray(x_rot, np.float64) - lo) / scale
    return np.abs(u - np.floor(u) - 0.5) < 1e-4


def _write_case(kernel: str, data, slow: bool):
    case = data.draw(write_cases(kernel, slow), label="configuration")
    write = _write_fn(case)
    q = case.quant
    for _ in range(DRAWS):
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="data seed"))
        clip = np.float32(data.draw(st.sampled_from([0.8, 0.93, 1.0]), label="clip"))
        x = (rng.standard_normal((case.batch, case.t, case.hkv, case.d)) * rng.uniform(0.1, 4, (1, 1, case.hkv, case.d))
             + rng.standard_normal((1, 1, case.hkv, case.d)))
        x = jnp.asarray(x, jnp.bfloat16)
        rot = jnp.asarray(_random_rotation(rng, case.hkv, case.d, case.dense))
        codes, lo, scale = jax.block_until_ready(write(x, rot, clip))
        if kernel == "tpu":
            assert not tpu_interpret.races.races_found, "TPU interpret mode detected a data race"
        want, unpacked, x_rot = _write_reference(x, rot, clip, cfg=q, start=case.start, count=case.count,
                                                 channel_major=case.channel_major)
        for got, ref in ((codes, want.codes), (lo, want.lo), (scale, want.scale)):
            assert got.shape == ref.shape and got.dtype == ref.dtype, (got.shape, ref.shape)
        unpack = functools.partial(layout.unpack_codes, bits=q.bits, channel_major=case.channel_major)
        got_codes, ref_codes = np.asarray(unpack(codes), np.int32), np.asarray(unpacked.codes, np.int32)
        for name, got, ref in (("lo", lo, want.lo), ("scale", scale, want.scale)):
            got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
            assert np.isfinite(got).all(), f"{name}: unwritten (NaN) entries"
            if not case.dense and q.scale_dtype == "bfloat16":
                np.testing.assert_array_equal(got, ref, err_msg=name)
            elif not case.dense:  # f32 metadata: summation order (Lloyd-Max statistics)
                np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max(), err_msg=name)
            else:
                np.testing.assert_allclose(got, ref, rtol=8e-3, atol=2**-6 * np.abs(ref).max(), err_msg=name)
        differ = got_codes != ref_codes
        assert np.abs(got_codes - ref_codes).max() <= 1, "a code moved by more than one level"
        if case.dense:
            assert differ.sum() <= 0.01 * differ.size + 4, f"{differ.sum()} of {differ.size} codes differ"
        elif kernel == "tpu":  # its quotient may round the other way on a tie
            assert differ.mean() < 2e-3, f"{differ.sum()} of {differ.size} codes differ"
            if q.codebook == "uniform":
                assert _on_rounding_tie(x_rot, unpacked, q.group_size or case.d)[differ].all(), "non-tie mismatch"
        else:
            assert not differ.any(), f"{differ.sum()} of {differ.size} codes differ"


@pytest.mark.parametrize("kernel", ["triton", "mosaic_gpu", "tpu"])
def test_bulk_write_fuzz(kernel):
    _fuzz(functools.partial(_write_case, kernel), CI_EXAMPLES[kernel], slow=False)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["triton", "mosaic_gpu", "tpu"])
def test_bulk_write_fuzz_sweep(kernel):
    _fuzz(functools.partial(_write_case, kernel), SLOW_EXAMPLES[kernel], slow=True)
