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
from oscar_jax.config import QuantConfig, bits_per_element
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
    target = cheapest + slack * (dearest - cheapest) + layers * budget.BIT_RESOLUTION
    picked = budget.allocate(errors, bits, target, weights)
    rows = np.arange(layers)
    assert (share * bits[rows, picked]).sum() <= target + 1e-12
    combos = [np.array(c) for c in itertools.product(range(choices), repeat=layers)]
    spent = lambda c: (share * bits[rows, c]).sum()
    error = lambda c: errors[rows, c].sum()
    best = min(error(c) for c in combos if spent(c) <= target)
    best_with_room = min(error(c) for c in combos if spent(c) <= target - layers * budget.BIT_RESOLUTION)
    assert best - 1e-12 <= error(picked) <= best_with_room + 1e-12


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
