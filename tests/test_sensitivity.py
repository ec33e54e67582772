"""Output sensitivity of a layer's quantised cache: `budget.served_attention` against a
per-query oracle, `sensitivity.layer_kl` against an oracle forward, `budget.output_weights`
and the knapsack on weighted errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from oscar_jax import budget, learn
from oscar_jax import calibrate as cal
from oscar_jax.config import QuantConfig
from oscar_jax.models import sensitivity
from oscar_jax.models.capture import capture_qkv
from oscar_jax.models.config import ModelConfig
from oscar_jax.models.decoder import Decoder, _forward_layer, forward_logits, output_and_mlp


def _served_oracle(q, k, v, k_hat, v_hat, sink, window, chunk, scale):
    """Per query and head, float64: (o exact, ô with keys < sink and > the chunk's last
    position - window exact, the others from k_hat, v_hat) [T, Hq, D] each."""
    t, hq, d = q.shape
    g = hq // k.shape[1]
    o, o_hat = np.zeros((t, hq, d)), np.zeros((t, hq, d))
    soft = lambda s: np.exp(s - s.max()) / np.exp(s - s.max()).sum()
    for p in range(t):
        last = min((p // chunk + 1) * chunk - 1, t - 1)
        keys = np.arange(p + 1)
        exact = ((keys < sink) | (keys > last - window))[:, None]
        for h in range(hq):
            kk, vv = (np.asarray(x[: p + 1, h // g], np.float64) for x in (k, v))
            kh, vh = (np.asarray(x[: p + 1, h // g], np.float64) for x in (k_hat, v_hat))
            qv = np.asarray(q[p, h], np.float64)
            o[p, h] = soft(kk @ qv * scale) @ vv
            o_hat[p, h] = soft(np.where(exact, kk, kh) @ qv * scale) @ np.where(exact, vv, vh)
    return o, o_hat


@pytest.mark.parametrize("sink, window, chunk, block", [(3, 5, 1, 16), (0, 8, 4, 7), (2, 40, 2, 64)])
def test_served_attention_matches_a_per_query_oracle(sink, window, chunk, block):
    """Every query's exact and served output, blocks of queries padded past T; a window
    covering the sequence serves the exact output."""
    rng = np.random.default_rng(3)
    t, d = 37, 8
    q = rng.standard_normal((t, 4, d)).astype(np.float32)
    k, v = (rng.standard_normal((t, 2, d)).astype(np.float32) for _ in range(2))
    k_hat, v_hat = (x + 0.3 * rng.standard_normal(x.shape).astype(np.float32) for x in (k, v))
    o, o_hat = budget.served_attention(*map(jnp.asarray, (q, k, v, k_hat, v_hat)), sink=sink, window=window,
                                       chunk=chunk, scale=0.4, block=block)
    want_o, want_hat = _served_oracle(q, k, v, k_hat, v_hat, sink, window, chunk, 0.4)
    np.testing.assert_allclose(o, want_o, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(o_hat, want_hat, rtol=1e-4, atol=1e-5)
    if window >= t:
        np.testing.assert_allclose(o_hat, o, rtol=1e-5, atol=1e-6)
    else:
        assert np.abs(o_hat - o).max() > 1e-3


def _model():
    cfg = ModelConfig("llama", vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=16, rms_eps=1e-5, rope_theta=1e4,
                      layer_types=("full_attention", "sliding_attention", "full_attention"), sliding_window=8)
    return Decoder(cfg, rngs=nnx.Rngs(11))


def _calibrations(model, ids):
    layers = (0, 2)
    q, k, v = (np.asarray(x) for x in capture_qkv(model, jnp.asarray(ids), layers))
    stats = cal.statistics(cal.accumulate(cal.Accumulator.init(2, 2, 16), q, k, v))
    return (q, k, v), [cal.calibrate(stats, (q, k, v), rotation_k="uhp", rotation_v="uhp", quant_cfg=c,
                                     grid=(0.9, 1.0), center_keys=True, softmax_scale=model.cfg.softmax_scale)
                       for c in (QuantConfig(2), QuantConfig(8))]


def test_layer_kl_matches_an_oracle_forward():
    """The last full layer's KL: its K/V served by a float64 per-query oracle, the layer's
    output and the logits, KL against the full-precision forward; each layer's error equals
    `context_errors` over every query; a finer quantiser moves the output less."""
    model = _model()
    cfg = model.cfg
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, (2, 30)).astype(np.int32)
    held, (two, eight) = _calibrations(model, ids)
    sink, window, chunk = 2, 6, 3
    kl, err = sensitivity.layer_kl(model, ids, two, sink=sink, window=window, chunk=chunk, queries=10)
    want_err = budget.context_errors(held, [two], [(sink, window)], chunk=chunk, queries=30,
                                     softmax_scale=cfg.softmax_scale)[0, :, 0]
    np.testing.assert_allclose(err, want_err, rtol=2e-3)

    pos = budget.query_positions(30, 10)
    want_kl = 0.0
    for row in ids:
        tokens = jnp.asarray(row[None])
        positions = jnp.arange(30, dtype=jnp.int32)[None]
        x = model.embed_tokens(tokens)
        for i in range(2):
            x = _forward_layer(model.layers[i].arrays(), x, positions, jnp.array([30]), cfg=cfg,
                               kind=cfg.layer_types[i], capture=False, kv_dtype=None, exact_prefix=0)[0]
        q, k, v = (np.asarray(a[1, 0]) for a in capture_qkv(model, tokens, (0, 2)))
        k_hat, v_hat = (np.asarray(learn._served_values(jnp.asarray(a[None]), jnp.asarray(rot[1]), jnp.asarray(dual[1]),
                                                         jnp.asarray(shift), two.quant, float(clip[1]))[0])
                        for a, rot, dual, shift, clip in (
                            (k, two.rot_k.rot, two.rot_k.dual, two.k_shift[1], two.clip_k),
                            (v, two.rot_v.rot, two.rot_v.dual, np.zeros((2, 16), np.float32), two.clip_v)))
        _, o_hat = _served_oracle(q, k, v, k_hat, v_hat, sink, window, chunk, cfg.softmax_scale)
        x = output_and_mlp(cfg, model.layers[2].arrays(), x, jnp.asarray(o_hat[None], jnp.float32))
        lp = np.asarray(jax.nn.log_softmax(model.logits(x[0, pos]), axis=-1), np.float64)
        ref = np.asarray(jax.nn.log_softmax(forward_logits(model, tokens)[0, pos], axis=-1), np.float64)
        want_kl += (np.exp(ref) * (ref - lp)).sum(-1).mean() / len(ids)
    assert kl[1] == pytest.approx(want_kl, rel=2e-3, abs=1e-7)
    assert (kl > 0).all()
    kl8, err8 = sensitivity.layer_kl(model, ids, eight, sink=sink, window=window, chunk=chunk, queries=10)
    assert (kl8 < kl / 10).all() and (err8 < err / 10).all()
    with pytest.raises(ValueError, match="chunk="):
        sensitivity.layer_kl(model, ids, two, sink=2, window=4, chunk=5)
    with pytest.raises(ValueError, match="ids.shape"):
        sensitivity.layer_kl(model, ids[:, :8], two, sink=2, window=6)


def test_output_weights_and_the_weighted_knapsack():
    """KL / error per layer (0 for an exact layer); with weights the knapsack spends the
    bits on the layer whose error costs the output most, not the one with the most error."""
    w = budget.output_weights(np.array([0.2, 0.05, 0.0]), np.array([0.1, 0.5, 0.0]))
    np.testing.assert_allclose(w, [2.0, 0.1, 0.0])
    errors = np.array([[0.1, 0.01], [0.5, 0.05]])  # layer 1 has more error, layer 0 costs more per unit
    bits = np.array([[2.0, 4.0], [2.0, 4.0]])
    assert budget.allocate(errors, bits, 3.0).tolist() == [0, 1]
    assert budget.allocate(errors * w[:2, None], bits, 3.0).tolist() == [1, 0]
    with pytest.raises(ValueError, match="expected equal"):
        budget.output_weights(np.ones(3), np.ones(2))
