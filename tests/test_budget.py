"""Bit budgets: `budget.allocate` against brute force, and a KV policy whose full-attention
layers each take their own quantiser."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

from oscar_jax import budget
from oscar_jax.config import CacheSpec, QuantConfig, bits_per_element
from oscar_jax.models import generate as gen, kv_policy
from oscar_jax.models.config import ModelConfig
from oscar_jax.models.decoder import Decoder, forward_logits


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.integers(1, 5), st.integers(1, 3), st.integers(0, 2**31 - 1), st.floats(0.0, 1.0))
def test_allocate_is_optimal_within_the_budget(layers, choices, seed, slack):
    """The chosen candidates keep the weighted bits within the target, and their summed error
    is the least of every combination that does (up to the bit grid: no combination with
    L grid units of room to spare does better)."""
    rng = np.random.default_rng(seed)
    errors = rng.uniform(0, 1, (layers, choices))
    bits = rng.uniform(2, 8, (layers, choices))
    weights = rng.uniform(0.1, 1, layers)
    share = weights / weights.sum()
    cheapest, dearest = (share * bits.min(1)).sum(), (share * bits.max(1)).sum()
    target = cheapest + slack * (dearest - cheapest)
    picked = budget.allocate(errors, bits, target, weights)
    rows = np.arange(layers)
    assert (share * bits[rows, picked]).sum() <= target + 1e-12
    combos = [np.array(c) for c in itertools.product(range(choices), repeat=layers)]
    spent = lambda c: (share * bits[rows, c]).sum()
    error = lambda c: errors[rows, c].sum()
    best = min(error(c) for c in combos if spent(c) <= target + 1e-12)
    best_with_room = min((error(c) for c in combos if spent(c) <= target - layers * budget.BIT_RESOLUTION),
                         default=np.inf)
    assert best - 1e-12 <= error(picked) <= best_with_room + 1e-12


def test_allocate_counts_each_layers_cheapest_exactly():
    """Bits off the grid (SmolLM2's 64 + 256 and 16 + 256 at 8192 tokens, 30 layers): the
    cheapest choice fits a target equal to its bits, and the bits one upgrade needs above it
    are all the room it takes (rounding every layer's whole cost up would lose ~0.02 bits)."""
    spec = lambda sink, window, quant: CacheSpec(1, 1, 1, 64, 8192, sink, window, quant)
    two, four = QuantConfig(2), QuantConfig(4)
    uniform = bits_per_element(spec(64, 256, two), 8192)
    assert budget.allocate(np.ones((30, 1)), np.full((30, 1), uniform), uniform).tolist() == [0] * 30
    bits = np.tile([bits_per_element(spec(16, 256, q), 8192) for q in (two, four)], (30, 1))
    errors = np.zeros((30, 2))
    errors[:, 0], errors[7, 0] = 1.0, 5.0  # the first candidate errs; layer 7 most
    picked = budget.allocate(errors, bits, uniform)
    assert bits[np.arange(30), picked].mean() <= uniform  # one 4-bit layer fits, two do not
    assert picked.tolist() == [int(i == 7) for i in range(30)]


def test_allocate_refuses_an_unreachable_target():
    with pytest.raises(ValueError, match="below the cheapest"):
        budget.allocate(np.ones((3, 2)), np.array([[2.5, 4.5]] * 3), 2.0)
    with pytest.raises(ValueError, match="expected equal"):
        budget.allocate(np.ones((3, 2)), np.ones((3, 3)), 4.0)


def test_policy_with_a_quantiser_per_layer():
    """Full-attention layers of 2-, 4- and 8-bit codes: each layer's cache carries its own
    quantiser, the state's bits per element are the layers' average at the held length, and
    prefill + decode stay close to the float32 forward (closer than all-2-bit)."""
    cfg = ModelConfig("llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=32, rms_eps=1e-5, rope_theta=1e4, layer_types=("full_attention",) * 3)
    model = Decoder(cfg, rngs=nnx.Rngs(5))
    quants = (QuantConfig(2), QuantConfig(4), QuantConfig(8))
    mixed = kv_policy.QuantPolicy("budget", QuantConfig(2), 4, 8, layer_quant=quants, implementation="xla")
    uniform = kv_policy.QuantPolicy("int2", QuantConfig(2), 4, 8, implementation="xla")
    tokens = np.random.default_rng(1).integers(0, 64, (2, 60)).astype(np.int32)
    want = np.asarray(jax.jit(forward_logits)(model, jnp.asarray(tokens)))
    diffs = {}
    for policy in (mixed, uniform):
        kv = gen.init_state(model, policy, 2, 64)
        logits, kv = gen.prefill(model, kv, tokens[:, :48], np.array([48, 48]))
        got = [np.asarray(logits)]
        for t in range(48, 59):
            _, logits, kv = gen.decode_step(model, kv, jnp.asarray(tokens[:, t]), jax.random.key(0))
            got.append(np.asarray(logits))
        diffs[policy.name] = np.abs(np.stack(got, 1) - want[:, 47:59]).max()
        if policy is mixed:
            assert [layer.cache.spec.quant for layer in kv.layers] == list(quants)
            held = 59
            formula = np.mean([bits_per_element(layer.cache.spec, held) for layer in kv.layers])
            assert kv_policy.bits_per_element(kv) == pytest.approx(formula)
    print(f"\nmax|logit diff| vs float32: {diffs}")
    assert diffs["budget"] < diffs["int2"]
    with pytest.raises(ValueError, match="one per full-attention layer"):
        gen.init_state(model, kv_policy.QuantPolicy("bad", QuantConfig(2), 4, 8, layer_quant=quants[:2]), 1, 64)


def test_candidates_and_their_bits():
    """'BITS[:G]' candidates parse to quantisers; their bits per element follow
    b + 2·16/G over the quantised history and 16 over sink + window."""
    cands = budget.parse_candidates("2:32, 2, 4:16", 64)
    assert cands == (QuantConfig(2, 32), QuantConfig(2), QuantConfig(4, 16))
    assert budget.parse_candidates("2:64", 64) == (QuantConfig(2),)
    got = budget.candidate_bits(cands, head_dim=64, sink=64, window=256, context=8192)
    hist = 8192 - 320
    want = [(hist * (b + 32 / g) + 320 * 16) / 8192 for b, g in ((2, 32), (2, 64), (4, 16))]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    for text, match in (("3:32", "bits=3"), ("2:128", "does not divide"), ("2:x", "BITS\\[:G\\]"),
                        ("2,2:64", "at most once")):
        with pytest.raises(ValueError, match=match):
            budget.parse_candidates(text, 64)


def test_select_takes_each_layer_from_its_candidate():
    """select: layer l's rotations, duals, eigenvalues and clips are those of the candidate
    calibration allocate picked for it, and layer_quant names that candidate's quantiser."""
    from oscar_jax import calibrate as cal

    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((3, 1, 32, h, 16)).astype(np.float32) * np.geomspace(3, 0.3, 16)
               for h in (4, 2, 2))
    st = cal.statistics(cal.accumulate(cal.Accumulator.init(3, 2, 16), q, k, v))
    quants = (QuantConfig(2, 8), QuantConfig(2, 16), QuantConfig(4, 16))
    cands = [cal.calibrate(st, (q, k, v), rotation_k="shaped/head", rotation_v="uhp", quant_cfg=c,
                           grid=(0.7, 0.85, 1.0)) for c in quants]
    picked = np.array([2, 0, 1])
    mixed = budget.select(cands, picked)
    assert mixed.layer_quant == tuple(quants[j] for j in picked)
    for i, j in enumerate(picked):
        for which in ("rot_k", "rot_v"):
            for field in ("rot", "dual", "eigenvalues"):
                np.testing.assert_array_equal(getattr(getattr(mixed, which), field)[i],
                                              getattr(getattr(cands[j], which), field)[i])
        assert (mixed.clip_k[i], mixed.clip_v[i]) == (cands[j].clip_k[i], cands[j].clip_v[i])
    with pytest.raises(ValueError, match="picked="):
        budget.select(cands, np.array([0, 3, 1]))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 3), st.integers(0, 2**31 - 1), st.floats(0.0, 1.0))
def test_allocate_segments_is_optimal_over_segments_and_layers(segments, layers, choices, seed, slack):
    """allocate_segments: the segment and per-layer candidates it returns fit the target and
    have the least summed error of every (segment, combination) that does (up to the grid)."""
    rng = np.random.default_rng(seed)
    errors = rng.uniform(0, 1, (segments, layers, choices))
    bits = rng.uniform(2, 8, (segments, choices))
    lo, hi = bits.min(), bits.max()
    target = lo + slack * (hi - lo)
    chosen, picked = budget.allocate_segments(errors, bits, target)
    rows = np.arange(layers)
    assert bits[chosen, picked].mean() <= target + 1e-12
    combos = [(s, np.array(c)) for s in range(segments) for c in itertools.product(range(choices), repeat=layers)]
    total = lambda s, c: errors[s, rows, c].sum()
    best = min(total(s, c) for s, c in combos if bits[s, c].mean() <= target + 1e-12)
    best_with_room = min((total(s, c) for s, c in combos
                          if bits[s, c].mean() <= target - layers * budget.BIT_RESOLUTION), default=np.inf)
    assert best - 1e-12 <= total(chosen, picked) <= best_with_room + 1e-12
    with pytest.raises(ValueError, match="every segment"):
        budget.allocate_segments(errors, bits, lo - 0.1)


def test_parse_segments():
    assert budget.parse_segments("64+256, 16+112,0+64") == ((64, 256), (16, 112), (0, 64))
    for text, match in (("64", "SINK\\+WINDOW"), ("a+b", "SINK\\+WINDOW"), ("8+0", "WINDOW >= 1"),
                        ("-1+8", "SINK >= 0"), ("8+8,8+8", "at most once")):
        with pytest.raises(ValueError, match=match):
            budget.parse_segments(text)


def _served_error_oracle(q, k, v, calib, layer, sink, window, chunk, pos, scale):
    """Per query, in float64 numpy: keys and values the cache serves (bf16-stored rotated
    vectors through `quant`, dequantised and rotated back; exact in the sink and in the
    chunk's newest `window` positions), softmax attention, Σ |o - ô|² and Σ |o|²."""
    from oscar_jax import quant
    from oscar_jax.cache import STORE_DTYPE

    def served(x, rot, dual, shift, clip):
        x_rot = np.einsum("thd,hde->the", x.astype(np.float64) - shift, rot)
        deq = quant.dequantize(quant.quantize(jnp.asarray(x_rot, jnp.float32).astype(STORE_DTYPE), calib.quant,
                                              clip), calib.quant)
        return np.einsum("the,hde->thd", np.asarray(deq, np.float64), dual) + shift

    shift = np.zeros(k.shape[1:]) if calib.k_shift is None else np.asarray(calib.k_shift[layer], np.float64)
    k_hat = served(k, calib.rot_k.rot[layer], calib.rot_k.dual[layer], shift,
                   calib.clip_k[layer])
    v_hat = served(v, calib.rot_v.rot[layer], calib.rot_v.dual[layer], 0.0, calib.clip_v[layer])
    t, hkv, _ = k.shape
    g = q.shape[1] // hkv
    err = ref = 0.0
    for p in pos:
        last = min((p // chunk + 1) * chunk - 1, t - 1)
        keys = np.arange(p + 1)
        exact = (keys < sink) | (keys > last - window)
        for h in range(q.shape[1]):
            kv = h // g
            qv = q[p, h].astype(np.float64)
            kk, kh = k[: p + 1, kv].astype(np.float64), k_hat[: p + 1, kv]
            vv, vh = v[: p + 1, kv].astype(np.float64), v_hat[: p + 1, kv]
            soft = lambda s: np.exp(s - s.max()) / np.exp(s - s.max()).sum()
            o = soft(kk @ qv * scale) @ vv
            o_hat = soft(np.where(exact[:, None], kk, kh) @ qv * scale) @ np.where(exact[:, None], vv, vh)
            err += ((o - o_hat) ** 2).sum()
            ref += (o ** 2).sum()
    return err, ref


@pytest.mark.parametrize("chunk, center", [(1, False), (4, True)])
def test_context_errors_match_a_per_query_oracle(chunk, center):
    """context_errors against a per-query float64 oracle: every (segment, layer, candidate)
    error, with the chunk's effect on the bf16 window and with centered keys; a window
    covering the whole sequence gives 0."""
    from oscar_jax import calibrate as cal

    rng = np.random.default_rng(7)
    layers, t, d = 2, 40, 16
    q, k, v = (rng.standard_normal((layers, 2, t, h, d)).astype(np.float32) * np.geomspace(3, 0.3, d)
               for h in (4, 2, 2))
    k = k + 1.5  # an offset for the centered keys to remove
    stats = cal.statistics(cal.accumulate(cal.Accumulator.init(layers, 2, d), q, k, v))
    calibs = [cal.calibrate(stats, (q, k, v), rotation_k="uhp", rotation_v="uhp", quant_cfg=c, grid=(0.8, 1.0),
                            center_keys=center) for c in (QuantConfig(2), QuantConfig(4, 8))]
    segments = ((4, 8), (0, 4), (2, 40))
    got = budget.context_errors((q, k, v), calibs, segments, chunk=chunk, queries=12, softmax_scale=0.3)
    assert got.shape == (3, layers, 2)
    pos = budget.query_positions(t, 12)
    assert len(set(pos.tolist())) == 12 and pos.min() >= 0 and pos.max() < t
    for s, (sink, window) in enumerate(segments[:2]):
        for layer in range(layers):
            for c, calib in enumerate(calibs):
                sums = [_served_error_oracle(*(x[layer, row] for x in (q, k, v)), calib, layer, sink, window, chunk,
                                             pos, 0.3) for row in range(2)]
                want = sum(e for e, _ in sums) / sum(r for _, r in sums)
                assert got[s, layer, c] == pytest.approx(want, rel=2e-3, abs=1e-9)
    assert got[0].sum() > 0 and np.all(got[2] < 1e-12)
    assert np.all(got[:2, :, 1] < got[:2, :, 0])  # 4-bit G=8 serves closer than 2-bit G=16
    with pytest.raises(ValueError, match="chunk="):
        budget.context_errors((q, k, v), calibs, ((0, 2),), chunk=4)
