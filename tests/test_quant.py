"""Properties of the quantiser and the packed layout (docs/method.md §2, docs/ARCHITECTURE.md §3)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from oscar_jax import quant
from oscar_jax.config import QuantConfig
from oscar_jax.pallas_kernels import layout

CONFIGS = [
    QuantConfig(bits=2), QuantConfig(bits=4), QuantConfig(bits=8),
    QuantConfig(bits=2, codebook="lloyd_max"),
    QuantConfig(bits=2, scale_dtype="float32"), QuantConfig(bits=2, group_size=8),
    QuantConfig(bits=2, codebook="lloyd_max", group_size=8, scale_dtype="float32"),
]
settings.register_profile("oscar", max_examples=40, deadline=None)
settings.load_profile("oscar")


def _data(seed, tokens, d, spread, offset):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((3, tokens, d)) * spread + offset).astype(np.float32)


@st.composite
def cases(draw):
    cfg = draw(st.sampled_from(CONFIGS))
    d = draw(st.sampled_from([8, 16, 64]))
    x = _data(draw(st.integers(0, 2**31)), draw(st.integers(1, 5)) * cfg.tokens_per_byte, d,
              draw(st.floats(0.01, 100)), draw(st.floats(-50, 50)))
    clip = draw(st.floats(0.7, 1.0))
    return cfg, x, clip


# jitted: one compile per (config, shape) instead of one per eager op (the examples repeat shapes)
_quantize = jax.jit(quant.quantize, static_argnums=1)
_dequantize = jax.jit(quant.dequantize, static_argnums=1)
_pack, _unpack = (jax.jit(f, static_argnums=1, static_argnames="channel_major")
                  for f in (layout.pack_codes, layout.unpack_codes))
_pack_meta, _unpack_meta = (jax.jit(f, static_argnums=1) for f in (layout.pack_meta, layout.unpack_meta))


@given(cases())
def test_codes_in_range_and_nearest_representable(case):
    cfg, x, clip = case
    q = _quantize(jnp.asarray(x), cfg, clip)
    codes = np.asarray(q.codes)
    assert codes.dtype == np.uint8 and codes.max() < cfg.num_levels
    g = x.shape[-1] // q.lo.shape[-1]
    lo = np.asarray(q.lo.astype(jnp.float32))[..., None]  # stored (rounded) metadata
    scale = np.asarray(q.scale.astype(jnp.float32))[..., None]
    grid = lo[..., None] + scale[..., None] * np.asarray(cfg.levels)  # [..., ng, 1, L]
    xg = x.reshape(*x.shape[:-1], -1, g)
    xc = np.clip(xg, lo, lo + scale * cfg.levels[-1])
    best = np.min(np.abs(grid - xc[..., None]), axis=-1)
    xhat = np.asarray(_dequantize(q, cfg)).reshape(xg.shape)
    tol = 1e-5 * (np.abs(xc) + scale) + 1e-30
    np.testing.assert_array_less(np.abs(xhat - xc) - best, tol)


@given(cases(), st.booleans())
def test_pack_unpack_bijective(case, channel_major):
    cfg, x, _ = case
    rng = np.random.default_rng(x.size)
    codes = rng.integers(0, cfg.num_levels, x.shape, dtype=np.uint8)
    packed = _pack(jnp.asarray(codes), cfg.bits, channel_major=channel_major)
    rows, d = x.shape[-2] // cfg.tokens_per_byte, x.shape[-1]
    assert packed.shape == (*x.shape[:-2], *((d, rows) if channel_major else (rows, d)))
    np.testing.assert_array_equal(_unpack(packed, cfg.bits, channel_major=channel_major), codes)
    meta = jnp.asarray(x[..., :4])
    np.testing.assert_array_equal(_unpack_meta(_pack_meta(meta, cfg.bits), cfg.bits), meta)


def test_layout_bit_positions_by_hand():
    """Byte (i, c) holds token 4i+s of channel c in bits 2s..2s+1; meta [g, s, i] = token 4i+s."""
    codes = np.array([[1], [2], [3], [0], [3], [3], [0], [1]], np.uint8)  # [T=8, D=1]
    packed = np.asarray(layout.pack_codes(jnp.asarray(codes), 2))
    assert packed[:, 0].tolist() == [1 | 2 << 2 | 3 << 4 | 0 << 6, 3 | 3 << 2 | 0 << 4 | 1 << 6]
    slices = np.asarray(layout.unpack_slices(jnp.asarray(packed), 2))  # [4, R=2, 1]
    assert slices[1, :, 0].tolist() == [2, 3]  # tokens 1 and 5
    meta = jnp.arange(8.0).reshape(8, 1)  # token t has value t
    pm = np.asarray(layout.pack_meta(meta, 2))  # [1, 4, 2]
    assert pm[0, 1].tolist() == [1.0, 5.0] and pm[0, 3].tolist() == [3.0, 7.0]


def test_channel_major_layout_by_hand():
    """Channel-major (the V history): byte (c, i) holds token 4i+s of channel c in bits
    2s..2s+1, so one 32-bit word holds 16 tokens of one channel."""
    codes = np.array([[1, 0], [2, 1], [3, 2], [0, 3], [3, 3], [3, 2], [0, 1], [1, 0]], np.uint8)  # [T=8, D=2]
    packed = np.asarray(layout.pack_codes(jnp.asarray(codes), 2, channel_major=True))  # [D=2, R=2]
    assert packed.tolist() == [[1 | 2 << 2 | 3 << 4 | 0 << 6, 3 | 3 << 2 | 0 << 4 | 1 << 6],
                               [0 | 1 << 2 | 2 << 4 | 3 << 6, 3 | 2 << 2 | 1 << 4 | 0 << 6]]
    slices = np.asarray(layout.unpack_slices(jnp.asarray(packed), 2))  # [4, D=2, R=2]
    assert slices[1].tolist() == [[2, 3], [1, 2]]  # tokens 1 and 5 of each channel
    assert layout.CHANNEL_MAJOR == {"k": False, "v": True}


@pytest.mark.parametrize("cfg", CONFIGS)
def test_constant_group_reconstructs(cfg):
    rng = np.random.default_rng(0)
    x = np.repeat(rng.standard_normal((5, 1)).astype(np.float32) * 7, 64, axis=1)[None]  # [1, 5, 64]
    xhat = np.asarray(quant.dequantize(quant.quantize(jnp.asarray(x), cfg, 0.9), cfg))
    if cfg.scale_dtype == "float32":
        np.testing.assert_array_equal(xhat, x)
    else:  # within the bf16 rounding of lo
        np.testing.assert_allclose(xhat, x, rtol=2.0**-8, atol=0)


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_isolated_to_its_group(cfg, bad):
    x = _data(1, 4 * cfg.tokens_per_byte, 64, 3.0, 1.0)
    y = x.copy()
    y[1, 2, 5] = bad  # token 2 of row 1, channel 5 (group 0)
    qx, qy = (quant.quantize(jnp.asarray(a), cfg, 0.95) for a in (x, y))
    g = cfg.group_size or 64
    hx, hy = (np.asarray(quant.dequantize(q, cfg)) for q in (qx, qy))
    touched = np.zeros(x.shape, bool)
    touched[1, 2, :g] = True
    np.testing.assert_array_equal(hx[~touched], hy[~touched])
    assert not np.all(np.isfinite(hy[touched]))


def test_uniform_full_range_hits_extremes():
    """With c = 1 and f32 metadata the min and max of a group are representable."""
    cfg = QuantConfig(bits=2, scale_dtype="float32")
    x = _data(3, 8, 32, 2.0, 0.5)
    xhat = np.asarray(quant.dequantize(quant.quantize(jnp.asarray(x), cfg, 1.0), cfg))
    np.testing.assert_allclose(xhat.max(-1), x.max(-1), rtol=1e-6)
    np.testing.assert_allclose(xhat.min(-1), x.min(-1), rtol=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    (dict(bits=3), "bits"), (dict(group_size=12), "group_size"),
    (dict(codebook="lloyd_max", bits=4), "lloyd_max"), (dict(scale_dtype="float16"), "scale_dtype"),
])
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantConfig(**kwargs)


def test_quantize_traced_clip_under_jit():
    cfg = QuantConfig(bits=2)
    x = jnp.asarray(_data(4, 8, 16, 1.0, 0.0))
    f = jax.jit(lambda x, c: quant.dequantize(quant.quantize(x, cfg, c), cfg))
    np.testing.assert_array_equal(f(x, 0.9), quant.dequantize(quant.quantize(x, cfg, 0.9), cfg))
    assert not np.array_equal(f(x, 0.9), f(x, 1.0))  # the traced clip is applied, not a constant
