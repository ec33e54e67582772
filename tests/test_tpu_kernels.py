"""TPU Pallas kernels in TPU interpret mode (CPU) against the XLA reference.

Interpret mode runs with out-of-bounds reads raising, race detection on and the
order of the parallel grid axes randomised (`mixed_attention.interpret_params`).
CI runs the structured cases below; the larger random sweep (>= 200 cases) is
marked slow:  .venv/bin/python -m pytest tests/test_tpu_kernels.py -m slow -n 2
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
import numpy as np
import pytest
# The race detector's result has no public accessor in jax 0.11.2.
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret

import oscar_jax as oj
from oscar_jax import attention, quant
from oscar_jax.config import LLOYD_MAX_SPAN, CacheSpec, QuantConfig, bits_per_element
from oscar_jax.pallas_kernels import layout
from oscar_jax.pallas_kernels.tpu import bulk_write as bw
from oscar_jax.pallas_kernels.tpu import cost_model as cm
from oscar_jax.pallas_kernels.tpu import mixed_attention as ma

ATOL = RTOL = 5e-5  # 3 bf16 passes (default) vs the f32 HIGHEST reference, same cache


@dataclasses.dataclass(frozen=True)
class Config:
    """The static shape of one kernel compilation (lengths and data vary per draw)."""

    d: int
    g: int  # GQA ratio Hq / Hkv
    c: int  # queries per call (1 = decode)
    batch: int = 2
    hkv: int = 2
    sink: int = 16
    window: int = 64
    hist: int = 256  # most history tokens a row holds (max_len - S0 - W; capacity: whole HIST_TILEs)
    quant: QuantConfig = QuantConfig()
    hist_rows: int | None = None  # None: through attend(implementation="pallas_tpu")

    def __str__(self):
        q = self.quant
        return (f"D{self.d}-g{self.g}-C{self.c}-B{self.batch}-H{self.hkv}-S{self.sink}"
                f"-W{self.window}-T{self.hist}-b{q.bits}-G{q.group_size or self.d}-{q.codebook}"
                f"-{q.scale_dtype}-rows{self.hist_rows}")

    @property
    def max_len(self):
        return self.sink + self.hist + self.window

    @property
    def spec(self):
        return CacheSpec(1, self.batch, self.hkv, self.d, self.max_len, self.sink, self.window,
                         self.quant)

    def boundaries(self):
        """Lengths at the segment and block edges (all >= C so every query has a position)."""
        s0, w, tpb, full = self.sink, self.window, self.quant.tokens_per_byte, self.max_len
        edges = {self.c, s0, s0 + 1, s0 + w, s0 + w + 1, s0 + w + self.c, s0 + w + tpb - 1,
                 full - 1, full}
        if self.hist_rows:  # every history block's end, and one token past it
            block = self.hist_rows * tpb
            edges |= {s0 + w + k * block + e for k in range(1, -(-self.hist // block)) for e in (0, 1)}
        return sorted(n for n in edges if self.c <= n <= full)


def _draws(config: Config, n: int, seed: int):
    """n (config, lengths, seed) cases: ragged rows, half of them on segment/block edges."""
    rng = np.random.default_rng(seed)
    edges = config.boundaries()
    out = []
    for i in range(n):
        lengths = tuple(int(rng.choice(edges)) if rng.random() < 0.5
                        else int(rng.integers(config.c, config.max_len + 1))
                        for _ in range(config.batch))
        out.append(pytest.param(config, lengths, seed * 100 + i,
                                id=f"{config}-n{'_'.join(map(str, lengths))}"))
    return out


def _ci_cases():
    """15 compilations x 4 draws = 60 cases over D 64/128/256, g 1/3/4/8, C 1/7/64, B 1-4,
    bits 2/4/8, G < D and G = D, both codebooks and metadata dtypes, no sink, no history,
    several history blocks with a partial last one; and one case whose last block holds one
    token."""
    q2, q2g, lm = QuantConfig(), QuantConfig(group_size=32), QuantConfig(codebook="lloyd_max")
    configs = [
        Config(64, 1, 1, hist=600, hist_rows=128),
        Config(64, 3, 7, quant=q2g),
        Config(64, 8, 64, window=64, quant=lm, hist=600, hist_rows=128),
        Config(64, 4, 1, batch=3, hkv=3, quant=QuantConfig(bits=4, group_size=16)),
        Config(128, 1, 7, quant=QuantConfig(bits=8), hist=300, hist_rows=128),
        Config(128, 3, 1, quant=q2g, hist=600, hist_rows=128),
        Config(128, 4, 7, batch=3, hkv=1, quant=QuantConfig(scale_dtype="float32")),
        Config(128, 8, 1, quant=lm, batch=1),
        Config(128, 4, 64, window=64, hist=1100, hist_rows=128),
        Config(128, 4, 7, sink=0, quant=q2g),
        Config(128, 3, 7, hist=0),
        Config(256, 1, 64, window=64, quant=QuantConfig(bits=4)),
        Config(256, 3, 7, quant=QuantConfig(group_size=64, codebook="lloyd_max",
                                            scale_dtype="float32"), hist=600, hist_rows=128),
        Config(256, 4, 1, hkv=1, batch=4, quant=QuantConfig(group_size=16)),
        Config(256, 8, 7, hkv=1, sink=64, window=32, quant=q2, hist=1024),
    ]
    first = configs[0]  # a row whose second history block holds one token, beside a short row
    n = first.sink + first.window + first.hist_rows * first.quant.tokens_per_byte + 1
    one_token_block = pytest.param(first, (n, first.sink + first.window + 1), 99, id=f"{first}-n{n}_one_past_block")
    return [case for i, cfg in enumerate(configs) for case in _draws(cfg, 4, i)] + [one_token_block]


def _slow_cases():
    """52 random compilations x 4 draws = 208 cases."""
    rng = np.random.default_rng(7)
    quants = [QuantConfig(), QuantConfig(group_size=16), QuantConfig(group_size=64),
              QuantConfig(codebook="lloyd_max"), QuantConfig(codebook="lloyd_max", group_size=32),
              QuantConfig(bits=4), QuantConfig(bits=8, group_size=32),
              QuantConfig(scale_dtype="float32")]
    cases = []
    for i in range(52):
        c = int(rng.choice([1, 7, 64]))
        q = quants[int(rng.integers(len(quants)))]
        cfg = Config(d=int(rng.choice([64, 128, 256])), g=int(rng.choice([1, 3, 4, 8])), c=c,
                     batch=int(rng.integers(1, 5)), hkv=int(rng.integers(1, 4)),
                     sink=int(rng.choice([0, 8, 16, 64])),
                     window=int(rng.choice([64, 128])) if c == 64 else int(rng.choice([16, 32, 64])),
                     hist=int(rng.integers(0, 1500)) // q.tokens_per_byte * q.tokens_per_byte,
                     quant=q, hist_rows=int(rng.choice([128, 256])) if rng.random() < 0.5 else None)
        cases += _draws(cfg, 4, 1000 + i)
    return cases


def _random_cache(config: Config, lengths, seed):
    """An arbitrary cache state (random packed bytes, metadata, bf16 segments, even past
    `lengths`), rotations and queries: q [B, C, Hq, D], cache, params."""
    rng = np.random.default_rng(seed)
    spec = config.spec
    b, h, d = config.batch, config.hkv, config.d
    tpb, rows, ng = spec.quant.tokens_per_byte, spec.hist_capacity // spec.quant.tokens_per_byte, spec.num_groups
    bf16 = lambda *shape: jnp.asarray(rng.standard_normal((b, h, *shape)) * 1.5 + 0.3, jnp.bfloat16)
    meta_dtype = spec.quant.jnp_scale_dtype
    lo = lambda: jnp.asarray(rng.standard_normal((b, h, ng, tpb, rows)) - 1.0, meta_dtype)
    top = spec.quant.levels[-1]  # spans of about 0.15 .. 3 like quantised unit-scale data
    scale = lambda: jnp.asarray(rng.uniform(0.05, 1.0, (b, h, ng, tpb, rows)) * 3 / top, meta_dtype)
    codes = lambda *shape: jnp.asarray(rng.integers(0, 256, (b, h, *shape)), jnp.uint8)
    cache = oj.OscarCache(
        sink_k=bf16(config.sink, d), sink_v=bf16(config.sink, d),
        hist_codes_k=codes(rows, d), hist_codes_v=codes(d, rows),
        hist_lo_k=lo(), hist_scale_k=scale(), hist_lo_v=lo(), hist_scale_v=scale(),
        recent_k=bf16(config.window, d), recent_v=bf16(config.window, d),
        lengths=jnp.asarray(lengths, jnp.int32), overflow=jnp.zeros((b,), bool), spec=spec)
    rot = lambda: np.linalg.qr(rng.standard_normal((h, d, d)))[0].astype(np.float32)
    params = oj.LayerParams.create(rot(), rot(), 0.96, 0.92, num_layers=1, kv_heads=h).layer(0)
    q = jnp.asarray(rng.standard_normal((b, config.c, h * config.g, d)), jnp.float32)
    return q, cache, params


@functools.cache
def _implementations(config: Config):
    """Jitted (reference, kernel) for one static configuration, cached across draws."""
    if config.hist_rows is None:
        kernel = functools.partial(attention.attend, implementation="pallas_tpu", interpret=True)
    else:
        kernel = functools.partial(attention.kernel_attend(functools.partial(
            ma.mixed_attention, config=ma.AttentionConfig(config.hist_rows))), interpret=True)
    return jax.jit(functools.partial(attention.attend, implementation="xla")), jax.jit(kernel)


def _check_attention(q, cache, params, reference, kernel):
    want_o, want_lse = reference(q, cache, params)
    got_o, got_lse = jax.block_until_ready(kernel(q, cache, params))
    assert not tpu_interpret.races.races_found, "TPU interpret mode detected a data race"
    assert got_o.shape == want_o.shape and got_lse.shape == want_lse.shape
    np.testing.assert_allclose(np.asarray(got_lse), np.asarray(want_lse), atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(np.asarray(got_o), np.asarray(want_o), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("config,lengths,seed", _ci_cases())
def test_attention_matches_reference(config, lengths, seed):
    _check_attention(*_random_cache(config, lengths, seed), *_implementations(config))


def test_fewer_bf16_passes_trade_precision():
    """1 and 2 bf16 MXU passes over the f32 operand: bounded error, growing as passes drop."""
    config = Config(128, 4, 7, hist=600, hist_rows=128)
    q, cache, params = _random_cache(config, (640, 200), 11)
    reference, three_passes = _implementations(config)
    want_o, want_lse = reference(q, cache, params)
    errors = [float(np.abs(np.asarray(three_passes(q, cache, params)[0] - want_o)).max())]
    for passes, tol in ((2, 2e-4), (1, 2e-2)):
        kernel = attention.kernel_attend(functools.partial(
            ma.mixed_attention, config=ma.AttentionConfig(128, passes=passes)))
        o, lse = jax.jit(functools.partial(kernel, interpret=True))(q, cache, params)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), atol=tol, rtol=tol)
        np.testing.assert_allclose(np.asarray(o), np.asarray(want_o), atol=tol, rtol=tol)
        errors.append(float(np.abs(np.asarray(o - want_o)).max()))
    assert errors[0] < errors[1] < errors[2], errors


@pytest.mark.slow
@pytest.mark.parametrize("config,lengths,seed", _slow_cases())
def test_attention_matches_reference_sweep(config, lengths, seed):
    _check_attention(*_random_cache(config, lengths, seed), *_implementations(config))


def _written_cache(config: Config, lengths, seed):
    """A cache filled the real way: prompt write, then one C-token append."""
    rng = np.random.default_rng(seed)
    b, h, d, c = config.batch, config.hkv, config.d, config.c
    rot = lambda: np.linalg.qr(rng.standard_normal((h, d, d)))[0].astype(np.float32)
    params = oj.LayerParams.create(rot(), rot(), 0.96, 0.92, num_layers=1, kv_heads=h).layer(0)
    prompt = np.asarray(lengths, np.int32) - c
    t = max(int(prompt.max()), 1)
    offset = rng.standard_normal((1, 1, h, d)) * 2
    kv = lambda n: jnp.asarray(rng.standard_normal((b, n, h, d)) * rng.uniform(0.2, 3, (1, 1, h, d))
                               + offset, jnp.float32)
    cache = jax.jit(oj.write_prompt)(oj.OscarCache.init(config.spec).layer(0), kv(t), kv(t),
                                     jnp.asarray(prompt), params)
    cache = jax.jit(oj.append)(cache, kv(c), kv(c), params)
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)
    q = jnp.asarray(rng.standard_normal((b, c, h * config.g, d)), jnp.float32)
    return q, cache, params


def test_attention_over_written_cache():
    """Same check on a cache built by write_prompt + append (real quantised data)."""
    config = Config(128, 4, 7, batch=3, hist=600, hist_rows=128, quant=QuantConfig(group_size=64))
    _check_attention(*_written_cache(config, (670, 300, 90), 3), *_implementations(config))


def test_auto_picks_tpu_kernel_on_tpu_backend():
    spec = CacheSpec(1, 1, 1, 64, 64 + 256 + 64)
    assert attention.resolve("auto", spec, 1, 4, backend="tpu") == "pallas_tpu"
    assert attention.resolve("pallas_tpu", spec, 1, 4, backend="cpu", interpret=True) == "pallas_tpu"
    with pytest.raises(ValueError, match="interpret=True"):  # off a TPU only as an explicit opt-in
        attention.resolve("pallas_tpu", spec, 1, 4, backend="cpu")


def _walk(jaxpr, origin):
    """Yield (pallas_call eqn, origins of its operands); origin maps var -> input name or None."""
    for eqn in jaxpr.eqns:
        names = [origin.get(v) if isinstance(v, jex_core.Var) else None for v in eqn.invars]
        if eqn.primitive.name == "pallas_call":
            yield eqn, names
        for sub in jex_core.jaxprs_in_params(eqn.params):
            if len(sub.invars) == len(names):
                yield from _walk(sub, dict(zip(sub.invars, names)))


def test_hbm_operands_are_the_packed_cache_arrays():
    """The kernel's only history operands are the cache's packed arrays, passed untouched;
    its only float operands are the queries and the bf16 sink and ring."""
    config = Config(128, 4, 7, hist=512)
    q, cache, params = _random_cache(config, (600, 300), 0)
    leaves, _ = jax.tree.flatten(cache)
    names = [f.name for f in dataclasses.fields(cache) if f.name != "spec"]
    fn = lambda q, *leaves: attention.attend(
        q, jax.tree.unflatten(jax.tree.structure(cache), leaves), params,
        implementation="pallas_tpu", interpret=True)
    closed = jax.make_jaxpr(fn)(q, *leaves)
    origin = dict(zip(closed.jaxpr.invars, ["q", *names]))
    (eqn, operand_origins), = list(_walk(closed.jaxpr, origin))
    packed = ["hist_codes_k", "hist_codes_v", "hist_lo_k", "hist_scale_k", "hist_lo_v",
              "hist_scale_v"]
    for name in packed + ["sink_k", "sink_v", "recent_k", "recent_v", "lengths"]:
        assert name in operand_origins, f"{name} does not reach the kernel untouched"
    b, h, d, t_hist = 2, 2, 128, config.hist
    for v, name in zip(eqn.invars, operand_origins):
        aval = v.aval
        if jnp.issubdtype(aval.dtype, jnp.floating) and name not in packed:
            assert name in ("sink_k", "sink_v", "recent_k", "recent_v") or (
                aval.shape == (b, h, 32, d)), f"unexpected float operand {aval} ({name})"
            assert max(aval.shape) < t_hist, f"float operand {aval} spans the history"
    assert not any(jnp.issubdtype(v.aval.dtype, jnp.floating) and v.aval.shape[-2:] == (t_hist, d)
                   for v in eqn.invars)


LOWERING = [Config(64, 3, 7, quant=QuantConfig(group_size=32)), Config(128, 4, 1),
            Config(256, 8, 64, quant=QuantConfig(codebook="lloyd_max")),
            Config(128, 1, 7, sink=0, quant=QuantConfig(bits=4, scale_dtype="float32")),
            Config(128, 4, 7, hist=0), Config(128, 4, 7, hist=1100, hist_rows=128,
                                              quant=QuantConfig(bits=8, group_size=64))]


@pytest.mark.parametrize("config,chip", [(c, ("TPU v5e", "TPU v6e")[i % 2])
                                         for i, c in enumerate(LOWERING)], ids=str)
def test_kernels_lower_to_mosaic(config, chip):
    """Pallas's Mosaic lowering (jax side, no TPU compiler) accepts both kernels for the
    chip (the bulk write in both code layouts); what the TPU compiler would say about
    vector layouts is not checked here."""
    q, cache, params = _random_cache(config, (config.max_len,) * config.batch, 0)
    spec = config.spec
    attend_kernel = functools.partial(
        ma.mixed_attention, sink=spec.sink, window=spec.window, bits=spec.quant.bits,
        levels=spec.quant.levels, softmax_scale=0.1, interpret=False,
        config=ma.AttentionConfig(config.hist_rows or 2048))
    args = (q, layout.CacheArrays.of(cache))
    x = jnp.zeros((config.batch, 1024, config.hkv, config.d), jnp.bfloat16)
    write = functools.partial(
        bw.bulk_write, bits=spec.quant.bits, group_size=spec.quant.group_size,
        levels=spec.quant.levels, codebook=spec.quant.codebook, lloyd_max_span=LLOYD_MAX_SPAN,
        scale_dtype=spec.quant.scale_dtype, block_sizes=bw.WriteBlockSizes(512))
    device = jax.sharding.AbstractDevice(device_kind=chip, num_cores=1, platform="tpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                  abstract_device=device)):
        for fn, fn_args in ((attend_kernel, args), (write, (x, params.rot_k, params.clip_k)),
                            (functools.partial(write, channel_major=True),
                             (x, params.rot_v, params.clip_v))):
            text = jax.jit(fn).trace(*fn_args).lower(lowering_platforms=("tpu",)).as_text()
            assert "tpu_custom_call" in text


def test_interpret_flag_maps_to_checked_interpret_mode():
    p = ma.interpret_params(True)
    assert isinstance(p, ma.pltpu.InterpretParams)
    assert p.detect_races and p.out_of_bounds_reads == "raise" and p.num_cores_or_threads == 2
    assert ma.interpret_params(False) is None


def test_bad_inputs_raise_named_errors():
    q, cache, params = _random_cache(Config(64, 1, 1, batch=1), (100,), 0)
    arrays = layout.CacheArrays.of(cache)
    kw = dict(sink=16, window=64, bits=2, levels=(0.0, 1.0, 2.0, 3.0), softmax_scale=0.125,
              interpret=True)
    with pytest.raises(ValueError, match="lengths"):
        ma.mixed_attention(q, arrays._replace(lengths=cache.lengths.astype(jnp.float32)), **kw)
    with pytest.raises(ValueError, match="hist_codes_v"):
        ma.mixed_attention(q, arrays._replace(hist_codes_v=cache.hist_codes_v[..., :32]), **kw)
    with pytest.raises(ValueError, match="levels"):
        ma.mixed_attention(q, arrays, **{**kw, "levels": (0.0, 1.0)})
    with pytest.raises(ValueError, match="hist_rows=100"):
        ma.AttentionConfig(100)
    with pytest.raises(ValueError, match="T=6"):
        bw.bulk_write(jnp.ones((1, 6, 1, 64)), jnp.ones((1, 64, 64)), 0.9, bits=2,
                      group_size=None, levels=(0.0, 1.0, 2.0, 3.0), interpret=True)
    with pytest.raises(ValueError, match="rot.shape"):
        bw.bulk_write(jnp.ones((1, 8, 1, 64)), jnp.ones((64, 64)), 0.9, bits=2,
                      group_size=None, levels=(0.0, 1.0, 2.0, 3.0), interpret=True)


# ---------------------------------------------------------------------------- bulk write

WRITE_CASES = [  # (quant, D, Hkv, prompt tokens T, token block)
    (QuantConfig(), 128, 2, 1088, 512),
    (QuantConfig(group_size=32, codebook="lloyd_max"), 64, 3, 256, 2048),
    (QuantConfig(bits=4, group_size=16, scale_dtype="float32"), 256, 1, 520, 512),
    (QuantConfig(bits=8), 64, 2, 130, 2048),
    (QuantConfig(group_size=64), 128, 1, 2048 + 512, 2048),
]


def _write(x, rot, clip, cfg, block, channel_major):
    return bw.bulk_write(x, rot, clip, bits=cfg.bits, group_size=cfg.group_size,
                         levels=cfg.levels, codebook=cfg.codebook, lloyd_max_span=LLOYD_MAX_SPAN,
                         scale_dtype=cfg.scale_dtype, channel_major=channel_major, interpret=True,
                         block_sizes=bw.WriteBlockSizes(block))


@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("rotation", ["signed_permutation", "orthogonal"])
@pytest.mark.parametrize("cfg,d,hkv,t,block", WRITE_CASES, ids=str)
def test_bulk_write_matches_quant_pack(cfg, d, hkv, t, block, rotation, which):
    """Keys token-major, values channel-major (`layout.CHANNEL_MAJOR`)."""
    channel_major = layout.CHANNEL_MAJOR[which]
    rng = np.random.default_rng(t + d)
    x = jnp.asarray((rng.standard_normal((2, t, hkv, d)) * rng.uniform(0.1, 4, (1, 1, hkv, d))
                     + rng.standard_normal((1, 1, hkv, d))).astype(np.float32))
    if rotation == "signed_permutation":  # exact in float32: isolates the quantiser
        rot = np.stack([np.eye(d)[rng.permutation(d)] * rng.choice([-1, 1], d) for _ in range(hkv)])
    else:
        rot = np.linalg.qr(rng.standard_normal((hkv, d, d)))[0]
    rot = jnp.asarray(rot, jnp.float32)
    codes, lo, scale = jax.block_until_ready(_write(x, rot, 0.93, cfg, block, channel_major))
    assert not tpu_interpret.races.races_found
    x_rot = jnp.einsum("bthd,hde->bhte", x, rot, precision="highest").astype(jnp.bfloat16)
    unpacked = quant.quantize(x_rot, cfg, 0.93)
    want = quant.pack(unpacked, cfg.bits, channel_major=channel_major)
    for got, ref in ((codes, want.codes), (lo, want.lo), (scale, want.scale)):
        assert got.shape == ref.shape and got.dtype == ref.dtype
    if rotation == "signed_permutation":
        np.testing.assert_array_equal(np.asarray(lo), np.asarray(want.lo))
        np.testing.assert_array_equal(np.asarray(scale), np.asarray(want.scale))
    else:  # the f32 rotation sums may round differently before the bf16 rounding
        tol = 2 ** -7  # one bf16 ulp of the rounded rotated values
        for got, ref in ((lo, want.lo), (scale, want.scale)):
            np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32),
                                       rtol=tol, atol=tol * 1e-2)
    # Codes: identical, except where a value sits on a rounding tie (either choice is nearest).
    got_codes = np.asarray(layout.unpack_codes(codes, cfg.bits, channel_major=channel_major)).astype(int)
    ref_codes = np.asarray(unpacked.codes).astype(int)
    differ = got_codes != ref_codes
    assert np.all(np.abs(got_codes - ref_codes) <= 1)
    assert differ.mean() < 2e-3, f"{differ.mean():.2%} of codes differ"
    if rotation == "signed_permutation" and cfg.codebook == "uniform":
        g = cfg.group_size or d
        lo32 = np.repeat(np.asarray(unpacked.lo, np.float32), g, axis=-1)
        sc32 = np.repeat(np.asarray(unpacked.scale, np.float32), g, axis=-1)
        u = (np.asarray(x_rot, np.float32) - lo32) / sc32
        assert np.all(np.abs(u[differ] - np.floor(u[differ]) - 0.5) < 1e-5), "non-tie mismatch"


def test_write_prompt_through_bulk_kernel_equals_xla_path():
    """`write_prompt(implementation="pallas_tpu")` (the bulk kernel) stores what the XLA
    path stores: sink and ring exactly, history up to rounding ties."""
    spec = CacheSpec(1, 2, 2, 64, 16 + 512 + 32, sink=16, window=32, quant=QuantConfig(group_size=32))
    rng = np.random.default_rng(5)
    rk, rv = (np.linalg.qr(rng.standard_normal((2, 64, 64)))[0].astype(np.float32) for _ in "kv")
    params = oj.LayerParams.create(rk, rv, 0.96, 0.92, num_layers=1, kv_heads=2).layer(0)
    t = spec.max_len
    k = jnp.asarray(rng.standard_normal((2, t, 2, 64)).astype(np.float32) * 2 + 0.5)
    v = jnp.asarray(rng.standard_normal((2, t, 2, 64)).astype(np.float32))
    write = lambda impl: oj.write_prompt(oj.OscarCache.init(spec).layer(0), k, v, jnp.asarray([t, t - 7]),
                                         params, implementation=impl, interpret=impl != "xla")
    ref, got_cache = write("xla"), write("pallas_tpu")
    for name in ("sink_k", "sink_v", "recent_k", "recent_v", "lengths"):
        np.testing.assert_array_equal(np.asarray(getattr(got_cache, name)), np.asarray(getattr(ref, name)))
    for which in "kv":
        want_h, got_h = ref.hist(which), got_cache.hist(which)
        unpack = functools.partial(layout.unpack_codes, bits=2, channel_major=layout.CHANNEL_MAJOR[which])
        got, want = (np.asarray(unpack(x.codes)).astype(int) for x in (got_h, want_h))
        assert np.abs(got - want).max() <= 1 and (got != want).mean() < 2e-3
        for field in ("lo", "scale"):
            np.testing.assert_allclose(np.asarray(getattr(got_h, field), np.float32),
                                       np.asarray(getattr(want_h, field), np.float32), rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("d,g,bits,meta,t", [
    (128, None, 2, "bfloat16", 131072), (64, None, 2, "bfloat16", 8192),
    (128, 32, 4, "float32", 5000), (256, 64, 8, "bfloat16", 2048)])
def test_cost_model_bits_match_the_cache_formula(d, g, bits, meta, t):
    """The bytes model's implied bits/element equals DESIGN §1.2's formula (no padding)."""
    shape = cm.DecodeShape("t", 2, 3, d, t, bits=bits, group_size=g,
                           meta_bytes=jnp.dtype(meta).itemsize)
    spec = CacheSpec(1, 1, 3, d, t, quant=QuantConfig(bits=bits, group_size=g, scale_dtype=meta))
    assert cm.bits_per_element(shape) == pytest.approx(bits_per_element(spec, t), rel=1e-12)
    padded = dataclasses.replace(shape, meta_padding=4)
    assert cm.bytes_per_step(padded) > cm.bytes_per_step(shape)
