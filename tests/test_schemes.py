"""Each `oscar eval` scheme's quantiser against an independent numpy computation.

Every scheme's policy comes from `scheme_policy`; K/V are written through its
cache (`kv_policy.write_prompt`, then one `append_attend` chunk) and read back
dequantised. The expectation per scheme (bits, codebook, sink/window, rotation,
clips) is spelled out here from the scheme table, and the quantisers are
re-derived in numpy (float32, bf16 metadata via ml_dtypes).

Test data sit on a dyadic grid (odd multiples of 1/32, |x| < 6), so rotations
by signed permutations or Sylvester Hadamard, means and variances are exact in
any summation order: library and oracle agree to the final multiply-add (rtol
1e-6), either way at exact rounding ties (`either`), and a wrong axis, group,
clip, codebook, rotation or sink/window shows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from oscar_jax import cache as oc
from oscar_jax.cache import LayerParams
from oscar_jax.models import evaluate as ev
from oscar_jax.models import generate as gen
from oscar_jax.models import kv_policy, registry
from oscar_jax.models.config import ModelConfig
from cache_oracle import signed_permutation

B, HKV, HQ, D, LAYERS = 2, 2, 4, 64, 2
LAYER = 1  # the layer read back (its calibrated clips differ from layer 0's)
CFG = ModelConfig("llama", vocab_size=32, hidden_size=64, intermediate_size=64, num_layers=LAYERS,
                  num_heads=HQ, num_kv_heads=HKV, head_dim=D, rms_eps=1e-5, rope_theta=1e4,
                  layer_types=("full_attention",) * LAYERS)
CALIB_CLIPS = ((0.9, 0.8), (0.85, 0.7))  # clip_k, clip_v per layer

# scheme -> (bits, codebook, sink, window (None: one extend chunk), rotation, clips)
PER_TOKEN = {
    "int8": (8, "uniform", 64, 256, "identity", "none"),
    "int4": (4, "uniform", 64, 256, "identity", "none"),
    "naive-int2": (2, "uniform", 0, None, "identity", "none"),
    "naive-int2-win": (2, "uniform", 64, 256, "identity", "none"),
    "quarot-int2": (2, "uniform", 64, 256, "hadamard", "none"),
    "oscar": (2, "uniform", 64, 256, "calibrated", "calibrated"),
    "oscar-lloyd": (2, "lloyd_max", 64, 256, "calibrated", "calibrated"),
    "oscar-fixedclip": (2, "uniform", 64, 256, "calibrated", "fixed"),
    "oscar-hadamard": (2, "uniform", 64, 256, "hadamard", "calibrated"),
    "oscar-norot": (2, "uniform", 64, 256, "identity", "calibrated"),
}


def bf16(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def e4m3(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)


def np_hadamard(d):
    h = np.array([[1.0]])
    while len(h) < d:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(d)


def np_quant_dequant(y, bits, clip=1.0, codebook="uniform", nudge=0.0):
    """Per-token asymmetric quantise-dequantise over the last axis of y float32 [..., G]:
    lo and scale rounded to bf16 first, then the nearest level on that grid, for the
    position (y - lo) / scale + nudge (see `either`)."""
    f32 = np.float32
    y = np.asarray(y, f32)
    if codebook == "uniform":
        levels = np.arange(2 ** bits, dtype=f32)
        mx, mn = y.max(-1, keepdims=True), y.min(-1, keepdims=True)
        mid, half = f32(0.5) * (mx + mn), f32(clip) * f32(0.5) * (mx - mn)
    else:  # Gaussian Lloyd-Max, mu -+ 1.51 sigma
        levels = np.array([0.0, 1.05, 1.95, 3.0], f32)
        mid = y.mean(-1, keepdims=True, dtype=f32)
        half = f32(clip) * f32(1.51) * np.sqrt(((y - mid) ** 2).mean(-1, keepdims=True, dtype=f32))
    lo, scale = bf16(mid - half), bf16(f32(2) * half / levels[-1])
    u = (y - lo) / scale + f32(nudge)
    if codebook == "uniform":
        code = np.clip(np.round(u), 0, levels[-1]).astype(int)
    else:
        code = np.searchsorted((levels[1:] + levels[:-1]) / f32(2), u, side="right")
    return lo + scale * levels[code]


def either(got, low, high):
    """Per element, whichever of the oracle's two readings is nearer to got. They differ only
    where the exact value sits on a rounding boundary (a tie: 2.5 levels, an e4m3 midpoint),
    which XLA may resolve either way (it divides by a broadcast as a reciprocal multiply)."""
    return np.where(np.abs(got - low) <= np.abs(got - high), low, high)


def np_quant_either(got, y, bits, clip=1.0, codebook="uniform"):
    return either(got, *(np_quant_dequant(y, bits, clip, codebook, nudge) for nudge in (-1e-5, 1e-5)))


def grid_kv(rng, b, t, h, d):
    """float32 [B, T, H, D], odd multiples of 1/32 (never zero), |x| < 6: per token an
    offset on the 1/16 grid plus deviations in ± pairs (so means and variances are exact)."""
    dev = np.clip(rng.standard_normal((b, t, h, d // 2)) * rng.uniform(0.3, 1.5, d // 2), -3.5, 3.5)
    dev = (2 * np.floor(dev * 16) + 1) / 32
    dev = np.concatenate([dev, -dev], axis=-1)
    dev = np.take_along_axis(dev, rng.permuted(np.tile(np.arange(d), (b, t, h, 1)), axis=-1), axis=-1)
    offset = np.round(rng.uniform(-2, 2, (b, t, h, 1)) * np.array([1.0, 0.5])[:h, None] * 16) / 16
    return (offset + dev).astype(np.float32)


def calibrated_params():
    """Stacked calibrated LayerParams: distinct signed permutations per layer, head, K and V."""
    rng = np.random.default_rng(11)
    rots = [np.stack([signed_permutation(rng, HKV, D) for _ in range(LAYERS)]) for _ in range(2)]
    clips = np.array(CALIB_CLIPS, np.float32)
    return LayerParams.create(rots[0], rots[1], clips[:, 0], clips[:, 1], num_layers=LAYERS, kv_heads=HKV)


_write = jax.jit(kv_policy.write_prompt)
_append = jax.jit(functools.partial(kv_policy.append_attend, softmax_scale=D ** -0.5))


def through_cache(name, k, v, lengths, extra, chunk, calibrated=None):
    """Prefill-style bulk write of k, v [B, T, Hkv, D] (rows `lengths` long), then one
    appended chunk `extra` = (k, v) [B, C, Hkv, D], into layer LAYER of the scheme's cache."""
    state = ev.scheme_policy(name, kv_policy.oscar_policy(calibrated)).init(CFG, B, 400, chunk)
    layer = state.layers[LAYER]
    layer = _write(layer, jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths, jnp.int32))
    q = np.random.default_rng(5).standard_normal((B, chunk, HQ, D)).astype(np.float32)
    _, layer = _append(layer, jnp.asarray(q), *(jnp.asarray(x) for x in extra))
    return layer


def concat_rows(prompt, extra, lengths):
    """Per row b: prompt[b, :lengths[b]] ++ extra[b] -> list of [n_b, H, D]."""
    return [np.concatenate([prompt[b, :n], extra[b]]) for b, n in enumerate(lengths)]


@pytest.mark.parametrize("name", list(PER_TOKEN))
def test_per_token_scheme_matches_numpy(name):
    bits, codebook, sink, window, rot_kind, clip_kind = PER_TOKEN[name]
    chunk = 8
    window = window or chunk
    calibrated = calibrated_params() if name.startswith("oscar") else None
    clips = {"none": (1.0, 1.0), "fixed": (0.96, 0.92), "calibrated": CALIB_CLIPS[LAYER]}[clip_kind]

    def rotation(which):  # [Hkv, D, D], the cache holds x @ R
        if rot_kind == "calibrated":
            return np.asarray(getattr(calibrated, f"rot_{which}")[LAYER], np.float64)
        return np.broadcast_to(np_hadamard(D) if rot_kind == "hadamard" else np.eye(D), (HKV, D, D))

    rng = np.random.default_rng(sorted(PER_TOKEN).index(name))
    lengths = np.array([360, 341])
    rot_basis = {w: rotation(w) for w in "kv"}
    # Data on the grid IN THE ROTATED BASIS; x = y R^T is exact, so the cache sees x R = y.
    y = {w: grid_kv(rng, B, 360 + chunk, HKV, D) for w in "kv"}
    x = {w: np.einsum("bthe,hde->bthd", y[w].astype(np.float64), rot_basis[w]).astype(np.float32) for w in "kv"}
    prompt = {w: x[w][:, :360] for w in "kv"}
    extra = {w: x[w][:, 360:] for w in "kv"}
    layer = through_cache(name, prompt["k"], prompt["v"], lengths, (extra["k"], extra["v"]), chunk, calibrated)
    got_k, got_v, valid = (np.asarray(a) for a in jax.jit(oc.dense_view)(layer.cache))

    for which, got, clip in (("k", got_k, clips[0]), ("v", got_v, clips[1])):
        rows = concat_rows(prompt[which], extra[which], lengths)
        for b, xb in enumerate(rows):
            n = len(xb)
            assert valid[b].sum() == n
            rotated = bf16(np.einsum("thd,hde->hte", xb.astype(np.float64), rot_basis[which]))  # [H, n, D]
            hist = (np.arange(n) >= sink) & (np.arange(n) < n - window)
            assert hist.sum() > 8
            got_b = got[b, :, :n]
            # sink and recent window: bf16 of the rotated vectors, exactly
            np.testing.assert_array_equal(got_b[:, ~hist], rotated[:, ~hist])
            want = np_quant_either(got_b[:, hist], rotated[:, hist], bits, clip, codebook)
            np.testing.assert_allclose(got_b[:, hist], want, rtol=1e-6, atol=1e-6)
            assert np.abs(want - rotated[:, hist]).max() > 1e-3  # the history really is quantised
            # what attention sees, in the model's basis: R^T dequant(quant(R x))
            unrot = np.einsum("hte,hde->htd", got_b[:, hist].astype(np.float64), rot_basis[which])
            want_unrot = np.einsum("hte,hde->htd", want.astype(np.float64), rot_basis[which])
            np.testing.assert_allclose(unrot, want_unrot, rtol=1e-6, atol=1e-5)


def test_kivi2_groups_and_residual_match_numpy():
    """KIVI-2 through its policy: keys per channel over 32-token groups, values per token over
    32-channel groups, positions past floor((n - 128) / 32) * 32 exact; groups entering with
    an appended chunk are quantised then, from their exact values."""
    rng = np.random.default_rng(21)
    lengths = np.array([230, 200])  # 96 and 64 tokens quantised; the chunk adds a group to each
    k, v = grid_kv(rng, B, 270, HKV, D), grid_kv(rng, B, 270, HKV, D) * 0.5
    layer = through_cache("kivi2", k[:, :230], v[:, :230], lengths, (k[:, 230:], v[:, 230:]), 40)
    rows = zip(concat_rows(k[:, :230], k[:, 230:], lengths), concat_rows(v[:, :230], v[:, 230:], lengths))
    for b, (kb, vb) in enumerate(rows):
        n = len(kb)
        q_len = (n - 128) // 32 * 32
        assert q_len == (128 if b == 0 else 96)
        kb, vb = kb.transpose(1, 0, 2), vb.transpose(1, 0, 2)  # [H, n, D], exact
        groups = kb[:, :q_len].reshape(HKV, q_len // 32, 32, D).swapaxes(-1, -2)  # [H, g, D, 32 tokens]
        got_k, got_v = (np.asarray(x[b, :n]).transpose(1, 0, 2) for x in (layer.k, layer.v))  # [H, n, D]
        got_groups = got_k[:, :q_len].reshape(groups.shape[:2] + (32, D)).swapaxes(-1, -2)
        want_k = np_quant_either(got_groups, groups, 2).swapaxes(-1, -2).reshape(HKV, q_len, D)
        want_v = np_quant_either(got_v[:, :q_len].reshape(HKV, q_len, D // 32, 32),
                                 vb[:, :q_len].reshape(HKV, q_len, D // 32, 32), 2).reshape(HKV, q_len, D)
        np.testing.assert_allclose(got_k[:, :q_len], want_k, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got_v[:, :q_len], want_v, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(got_k[:, q_len:], kb[:, q_len:])
        np.testing.assert_array_equal(got_v[:, q_len:], vb[:, q_len:])


def test_fp8_stores_e4m3_with_per_head_scales_from_the_prompt():
    """fp8: keys and values stored as float8_e4m3fn = sat(x / scale) with scale = the prompt's
    amax per (row, KV head) / 200 (keys) or / 100 (values), padding ignored; an appended
    outlier saturates at ±448·scale; attention (a chunk, then a decode step) reads stored·scale."""
    rng = np.random.default_rng(31)
    t, c = 40, 3
    lengths = np.array([40, 29])
    k = grid_kv(rng, B, t + c, HKV, D)
    v = grid_kv(rng, B, t + c, HKV, D) * np.array([1.0, 0.125])[None, None, :, None]
    k[1, 29:t] *= 100  # right padding of row 1: must not set its scales
    v[1, 29:t] *= 100
    k[0, t + 1, 1, 5] = 60.0  # an appended outlier beyond 448 * scale
    layer = through_cache("fp8", k[:, :t], v[:, :t], lengths, (k[:, t:], v[:, t:]), c)
    assert layer.k.dtype == jnp.float8_e4m3fn and layer.v.dtype == jnp.float8_e4m3fn

    for which, x, amax_to in (("k", k, 200.0), ("v", v, 100.0)):
        stored = np.asarray(getattr(layer, which)).astype(np.float32).transpose(0, 2, 1, 3)  # [B, H, T, D]
        scale = np.asarray(getattr(layer, f"{which}_scale"))  # [B, H]
        rows = concat_rows(x[:, :t], x[:, t:], lengths)
        for b, xb in enumerate(rows):
            want_scale = np.abs(xb[: lengths[b]]).max(axis=(0, 2)).astype(np.float32) / np.float32(amax_to)
            np.testing.assert_allclose(scale[b], want_scale, rtol=1e-6)
            ratio = np.clip(xb.transpose(1, 0, 2) / want_scale[:, None, None], -448, 448)
            got = stored[b, :, : len(xb)]
            want = either(got, *(e4m3(ratio * (1 + nudge)) for nudge in (-1e-6, 1e-6)))
            np.testing.assert_array_equal(got, want)
    assert np.asarray(layer.k)[0, t + 1, 1, 5].astype(np.float32) == 448.0

    # a second chunk's queries, then one decode query (its own dot-product path), against numpy
    # softmax attention over stored * scale
    held = lengths + c
    for queries, seed in ((c, 5), (1, 6)):
        q = np.random.default_rng(seed).standard_normal((B, queries, HQ, D))
        new_k, new_v = (jnp.asarray(x[:, :queries] / 2) for x in (k, v))
        o, layer = _append(layer, jnp.asarray(q, jnp.float32), new_k, new_v)
        kd, vd = (np.asarray(getattr(layer, w)).astype(np.float64).transpose(0, 2, 1, 3)  # [B, H, T, D]
                  * np.asarray(getattr(layer, f"{w}_scale"))[:, :, None, None] for w in "kv")
        for b, n in enumerate(held):  # query ci sits at position n + ci
            for ci in range(queries):
                for hq in range(HQ):
                    h = hq // (HQ // HKV)
                    logits = kd[b, h, : n + ci + 1] @ q[b, ci, hq] * D ** -0.5
                    p = np.exp(logits - logits.max())
                    want = (p / p.sum()) @ vd[b, h, : n + ci + 1]
                    np.testing.assert_allclose(np.asarray(o[b, ci, hq]), want, rtol=1e-5, atol=1e-5)
        held = held + queries


def test_fp8_bits_per_element_is_8_plus_the_scales():
    """8 bits per element plus, per non-empty row and KV head, one float32 scale over its D
    channels, over the tokens held (not the capacity, 400)."""
    state = ev.scheme_policy("fp8").init(CFG, B, 400)
    held = jnp.array([250, 0], jnp.int32)
    state = kv_policy.KVState(state.layers, held)
    assert kv_policy.bits_per_element(state) == pytest.approx(8 + 32 / (D * 250))


def test_fp8_decode_loop_matches_stepwise_decode():
    """fp8 through prefill and the jitted while-loop decode equals token-by-token decode_step."""
    tiny, _ = registry.load("tests/fixtures/hf_tiny/llama3")
    prompts = [[5, 17, 33, 2, 91, 44, 12, 7, 60, 3], [8, 150, 77, 4, 19, 23, 301]]
    out = gen.generate(tiny, ev.scheme_policy("fp8"), prompts, max_new_tokens=6, eos_ids=())
    assert out.kv.layers[0].k.dtype == jnp.float8_e4m3fn
    tokens, lengths = gen.pad_prompts(prompts)
    kv = gen.init_state(tiny, ev.scheme_policy("fp8"), 2, 16)
    logits, kv = gen.prefill(tiny, kv, tokens, lengths)
    nxt = jnp.argmax(logits, -1).astype(jnp.int32)
    steps = [nxt]
    for _ in range(5):
        nxt, _, kv = gen.decode_step(tiny, kv, nxt, jax.random.key(0))
        steps.append(nxt)
    assert np.stack(steps, 1).tolist() == out.tokens
    assert np.all(np.asarray(out.kv.layers[0].k_scale) != 1.0)
