"""Learned rotations (oscar_jax.learn): the orthogonal parametrisation, the straight-through
quantiser, the served attention-output error against a float64 loop, training that lowers
the held-aside error, the artifact and `oscar calibrate --rotation-k learned` end to end."""

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from typer.testing import CliRunner

from oscar_jax import artifact, learn, quant
from oscar_jax import calibrate as cal
from oscar_jax import clips
from oscar_jax.cache import LayerParams
from oscar_jax.config import QuantConfig
from test_calibrate import HKV, HQ, D, L, planted, stream

TINY = Path(__file__).parent / "fixtures" / "hf_tiny" / "llama3"


@pytest.mark.parametrize("magnitude", [0.0, 0.1, 3.0, 100.0])
def test_cayley_is_orthogonal_for_any_parameter(magnitude):
    w = magnitude * jax.random.normal(jax.random.key(0), (3, 64, 64))
    r = np.asarray(learn.cayley(w), np.float64)
    assert np.abs(np.einsum("hki,hkj->hij", r, r) - np.eye(64)).max() < 2e-5
    if magnitude == 0.0:
        np.testing.assert_array_equal(r, np.broadcast_to(np.eye(64), r.shape))


def test_learned_rotations_orthogonal_to_float32_precision():
    """After steps that move W far from 0, the returned rotations are orthogonal to float32
    rounding, accepted by LayerParams without duals, and differ from their start."""
    rng = np.random.default_rng(0)
    q, k, v, *_ = planted(rng, b=1, t=40)
    st = cal.statistics(stream(q, k, v))
    init = cal.rotation_for(st, "k", "uhp/head"), cal.rotation_for(st, "v", "uhp/head")
    learner = learn.RotationLearner(*init, ("k", "v"), per_head=True, clip_k=0.9, clip_v=0.9, quant_cfg=QuantConfig(),
                                    sink=2, window=4, config=learn.LearnConfig(learning_rate=0.1, steps_per_batch=5))
    learner.step(q, k, v)
    rot_k, rot_v = learner.rotations()
    assert (rot_k.spec.name, rot_v.spec.name) == ("learned/head", "learned/head")
    for r, r0 in ((rot_k, init[0]), (rot_v, init[1])):
        x = r.rot.astype(np.float64)
        assert np.abs(np.einsum("lhki,lhkj->lhij", x, x) - np.eye(D)).max() < 1e-6
        assert np.abs(r.rot - r0.rot).max() > 0.05
    params = LayerParams.create(rot_k.rot, rot_v.rot, 1.0, 1.0, num_layers=L, kv_heads=HKV)
    assert params.dual_k is None and params.dual_v is None


def test_ste_forward_is_the_cache_quantiser_and_gradient_is_lsq():
    """Forward: clips.reconstruct's values bit for bit. Gradient of Σ c·x̂ (uniform, G = 8):
    c everywhere, plus ±(clip/3)·Σ_group c·r at each group's max/min (r the rounding
    residual in steps), against a numpy oracle."""
    rng = np.random.default_rng(1)
    cfg, clip = QuantConfig(group_size=8), 0.9
    x = jnp.asarray(rng.standard_normal((5, HKV, 16)), jnp.float32)
    rot = jnp.asarray(np.stack([np.linalg.qr(rng.standard_normal((16, 16)))[0] for _ in range(HKV)]), jnp.float32)
    served = learn._served_values(x[None], rot, rot, jnp.zeros((HKV, 16)), cfg, clip)[0]
    np.testing.assert_array_equal(np.asarray(served), np.asarray(clips.reconstruct(x, rot, rot, cfg, clip)))

    xr = jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)
    c = rng.standard_normal((4, 16))
    grad = np.asarray(jax.grad(lambda y: jnp.sum(jnp.asarray(c, jnp.float32) * learn.quantize_ste(y, cfg, clip)))(xr))
    exact = np.asarray(quant.dequantize(quant.quantize(xr.astype(jnp.bfloat16), cfg, clip), cfg), np.float64)
    x64 = np.asarray(xr, np.float64)
    want = c.copy()
    for t in range(4):
        for g in range(2):
            sl = slice(8 * g, 8 * g + 8)
            step = clip * (x64[t, sl].max() - x64[t, sl].min()) / 3
            pull = clip / 3 * np.sum(c[t, sl] * (exact[t, sl] - x64[t, sl]) / step)
            want[t, 8 * g + np.argmax(x64[t, sl])] += pull
            want[t, 8 * g + np.argmin(x64[t, sl])] -= pull
    np.testing.assert_allclose(grad, want, rtol=1e-4, atol=1e-5)


def _oracle_attention_error(q, k, v, calib, cfg, sink, window, scale):
    """float64 loop over layers, sequences, query heads and queries >= sink + window."""
    out = []
    for i in range(q.shape[0]):
        shift = np.zeros((HKV, D)) if calib.k_shift is None else calib.k_shift[i]
        err = ref = 0.0
        for b in range(q.shape[1]):
            k_hat = np.asarray(clips.reconstruct(k[i, b] - shift, calib.rot_k.rot[i], calib.rot_k.dual[i], cfg,
                                                 float(calib.clip_k[i])), np.float64) + shift
            v_hat = np.asarray(clips.reconstruct(v[i, b], calib.rot_v.rot[i], calib.rot_v.dual[i], cfg,
                                                 float(calib.clip_v[i])), np.float64)
            for hq in range(HQ):
                h = hq // (HQ // HKV)
                for t in range(sink + window, q.shape[2]):
                    keys = np.arange(t + 1)
                    exact = (keys < sink) | (keys > t - window)
                    kk = np.where(exact[:, None], k[i, b, : t + 1, h], k_hat[: t + 1, h])
                    vv = np.where(exact[:, None], v[i, b, : t + 1, h], v_hat[: t + 1, h])
                    qq = np.asarray(q[i, b, t, hq], np.float64)
                    p, p_hat = (np.exp(s - s.max()) / np.exp(s - s.max()).sum()
                                for s in (scale * k[i, b, : t + 1, h] @ qq, scale * kk @ qq))
                    o, o_hat = p @ v[i, b, : t + 1, h], p_hat @ vv
                    err, ref = err + np.sum((o - o_hat) ** 2), ref + np.sum(o * o)
        out.append(err / ref)
    return np.array(out)


@pytest.mark.parametrize("rotation, center", [("uhp", True), ("shaped/head", False)])
def test_attention_error_matches_float64_loop(rotation, center):
    rng = np.random.default_rng(2)
    q, k, v, *_ = planted(rng, b=2, t=20)
    k = k + 2.0  # an offset for the centered case to remove
    st = cal.statistics(stream(q, k, v))
    cfg = QuantConfig(group_size=8)
    calib = cal.calibrate(st, (q, k, v), rotation_k=rotation, rotation_v="uhp", quant_cfg=cfg, grid=(0.8, 1.0),
                          center_keys=center)
    got = learn.attention_error(q, k, v, calib.rot_k, calib.rot_v, calib.clip_k, calib.clip_v, cfg, sink=3, window=5,
                                k_shift=calib.k_shift)
    np.testing.assert_allclose(got, _oracle_attention_error(q, k, v, calib, cfg, 3, 5, D ** -0.5), rtol=2e-4)
    assert np.all(got > 0)


def _outlier_draw(rng, b: int):
    """Planted q, k, v of b sequences of 64 tokens, with heavy-tailed outliers in key channels 0-1."""
    q, k, v, *_ = planted(rng, b=b, t=64)
    return q, (k + 3.0 * rng.standard_normal(k.shape) ** 3 * (np.arange(D) < 2)).astype(np.float32), v


def test_training_lowers_the_held_aside_error_against_its_initial_rotation():
    """Planted activations (query energy where the keys are small, outlier key channels):
    after training from U·H·P on one draw, the served attention-output error on another
    draw is below U·H·P's at the same clips, in every layer."""
    rng = np.random.default_rng(0)

    train, held = _outlier_draw(rng, 8), _outlier_draw(rng, 4)
    st = cal.statistics(stream(*train))
    cfg, grid, sink, window = QuantConfig(), (0.8, 0.9, 1.0), 4, 8
    config = learn.LearnConfig(epochs=10, steps_per_batch=1, queries=32, learning_rate=1e-2)
    batches = lambda: [tuple(x[:, i: i + 2] for x in train) for i in range(0, 8, 2)]
    rot_k, rot_v = learn.learn_rotations(st, batches, rotation_k="learned", rotation_v="learned", quant_cfg=cfg,
                                         sink=sink, window=window, config=config, grid=grid)
    init_k, init_v = cal.rotation_for(st, "k", "uhp"), cal.rotation_for(st, "v", "uhp")
    fit = clips.fit_clips(st, *held, init_k, init_v, cfg, grid)
    error = lambda rk, rv: learn.attention_error(*held, rk, rv, fit.clip_k, fit.clip_v, cfg, sink=sink, window=window)
    before, after = error(init_k, init_v), error(rot_k, rot_v)
    assert np.all(after < 0.8 * before), (before, after)


def test_learning_from_the_error_shaped_rotation():
    """From "shaped" (not orthogonal): at W = 0 the rotations and duals are the init's bit
    for bit; after training each dual is its rotation's inverse transpose, the pair serves
    through LayerParams with its duals, and the held-aside error is below the init's at the
    same clips in every layer."""
    rng = np.random.default_rng(5)

    train, held = _outlier_draw(rng, 8), _outlier_draw(rng, 4)
    st = cal.statistics(stream(*train))
    cfg, sink, window = QuantConfig(group_size=8), 4, 8
    init = cal.rotation_for(st, "k", "shaped/head", 8), cal.rotation_for(st, "v", "shaped/head", 8)
    fit = clips.fit_clips(st, *held, *init, cfg, (0.8, 0.9, 1.0))
    config = learn.LearnConfig(init="shaped", epochs=10, steps_per_batch=1, queries=32, learning_rate=1e-2)
    learner = learn.RotationLearner(*init, ("k", "v"), per_head=True, clip_k=fit.clip_k, clip_v=fit.clip_v,
                                    quant_cfg=cfg, sink=sink, window=window, config=config)
    for r, r0 in zip(learner.rotations(), init):
        np.testing.assert_array_equal(r.rot, r0.rot)
        np.testing.assert_array_equal(r.dual, r0.dual)
    for _ in range(config.epochs):
        for i in range(0, 8, 2):
            learner.step(*(x[:, i: i + 2] for x in train))
    rot_k, rot_v = learner.rotations()
    for r, r0 in ((rot_k, init[0]), (rot_v, init[1])):
        gram = np.einsum("lhki,lhkj->lhij", r.dual.astype(np.float64), r.rot.astype(np.float64))
        assert np.abs(gram - np.eye(D)).max() < 1e-4 and np.abs(r.rot - r0.rot).max() > 1e-3
    calib = cal.calibrate(st, held, rotation_k=rot_k, rotation_v=rot_v, quant_cfg=cfg, grid=(0.8, 0.9, 1.0))
    params = calib.layer_params()
    np.testing.assert_array_equal(np.asarray(params.dual_k), rot_k.dual)
    error = lambda rk, rv: learn.attention_error(*held, rk, rv, fit.clip_k, fit.clip_v, cfg, sink=sink, window=window)
    before, after = error(*init), error(rot_k, rot_v)
    assert np.all(after < before), (before, after)


def test_per_layer_quantisers_train_each_layer_group_as_alone():
    """layer_quant (a bit budget's): each group of layers sharing a quantiser comes out bit for
    bit as those layers learned alone with that quantiser (the group's statistics and
    activations only); `start` at the built Hadamard rotations equals learning from
    init="hadamard" (so `start` is used, not the default U·H·P), and an untrained partner in
    `start` comes back as given."""
    rng = np.random.default_rng(6)
    q, k, v = _outlier_draw(rng, 4)
    st = cal.statistics(stream(q, k, v))
    two, four = QuantConfig(bits=2, group_size=8), QuantConfig(bits=4, group_size=16)
    layer_quant = tuple(four if i % 2 else two for i in range(L))
    config = learn.LearnConfig(epochs=2, steps_per_batch=1, queries=16, learning_rate=1e-2)
    batches = lambda: [tuple(x[:, i: i + 2] for x in (q, k, v)) for i in range(0, 4, 2)]
    run = lambda st_, b, cfg, **kw: learn.learn_rotations(st_, b, rotation_k="learned/head", rotation_v="uhp/head",
                                                          quant_cfg=cfg, sink=2, window=8, config=config,
                                                          center_keys=True, grid=(0.8, 1.0), **kw)
    mixed = run(st, batches, two, layer_quant=layer_quant)
    for cfg in (two, four):
        idx = np.array([i for i in range(L) if layer_quant[i] == cfg])
        alone = run(learn._layers(st, idx), lambda: [tuple(x[idx] for x in b) for b in batches()], cfg)
        for got, want in zip(mixed, alone):
            np.testing.assert_array_equal(got.rot[idx], want.rot)
            np.testing.assert_array_equal(got.dual[idx], want.dual)
    built = cal.centered(st, None, True)[0]
    start = cal.rotation_for(built, "k", "hadamard/head"), cal.rotation_for(st, "v", "u/head")
    from_start = run(st, batches, two, start=start)
    hadamard = learn.learn_rotations(st, batches, rotation_k="learned/head", rotation_v="u/head", quant_cfg=two,
                                     sink=2, window=8, config=dataclasses.replace(config, init="hadamard"),
                                     center_keys=True, grid=(0.8, 1.0))
    np.testing.assert_array_equal(from_start[0].rot, hadamard[0].rot)
    np.testing.assert_array_equal(from_start[1].rot, start[1].rot)  # untrained: as given
    with pytest.raises(ValueError, match="one per layer"):
        run(st, batches, two, layer_quant=layer_quant[:-1])


def test_artifact_round_trips_the_learned_variant(tmp_path):
    rng = np.random.default_rng(3)
    q, k, v, *_ = planted(rng, b=1, t=40)
    st = cal.statistics(stream(q, k, v))
    rot_k, rot_v = learn.learn_rotations(st, lambda: [(q, k, v)], rotation_k="shaped/head",
                                         rotation_v="learned/head", quant_cfg=QuantConfig(), sink=2, window=4,
                                         center_keys=True, grid=(0.9, 1.0),
                                         config=learn.LearnConfig(learning_rate=0.05))
    assert (rot_k.spec.name, rot_v.spec.name) == ("shaped/head", "learned/head")
    calib = cal.calibrate(st, (q, k, v), rotation_k=rot_k, rotation_v=rot_v, grid=(0.9, 1.0), center_keys=True)
    meta = artifact.save(tmp_path / "a", calib, model_name="m", config_hash=artifact.fingerprint("m"),
                         corpus_hash=artifact.fingerprint("t"))
    params, loaded = artifact.load(tmp_path / "a", model_name="m", config_hash=artifact.fingerprint("m"), head_dim=D)
    assert loaded == meta and (meta.rotation_k, meta.rotation_v, meta.center_keys) == ("shaped/head", "learned/head",
                                                                                       True)
    np.testing.assert_array_equal(np.asarray(params.rot_v), rot_v.rot)
    np.testing.assert_array_equal(np.asarray(params.dual_k), rot_k.dual)
    np.testing.assert_array_equal(np.asarray(params.k_shift), calib.k_shift)
    assert params.dual_v is None


def test_bad_learning_settings_refused():
    with pytest.raises(ValueError, match="LearnConfig.init='learned'"):
        learn.LearnConfig(init="learned")
    with pytest.raises(ValueError, match="LearnConfig.epochs=0"):
        learn.LearnConfig(epochs=0)
    with pytest.raises(ValueError, match="learning_rate"):
        learn.LearnConfig(learning_rate=0.0)
    rng = np.random.default_rng(4)
    q, k, v, *_ = planted(rng, b=1, t=16)
    st = cal.statistics(stream(q, k, v))
    with pytest.raises(ValueError, match="trained on activations"):
        cal.rotation_for(st, "k", "learned")
    with pytest.raises(ValueError, match="neither is 'learned'"):
        learn.learn_rotations(st, lambda: [], rotation_k="uhp", rotation_v="uhp",
                              quant_cfg=QuantConfig(), sink=2, window=4)
    with pytest.raises(ValueError, match="both be per head or both per layer"):
        learn.learn_rotations(st, lambda: [], rotation_k="learned", rotation_v="learned/head",
                              quant_cfg=QuantConfig(), sink=2, window=4)
    with pytest.raises(ValueError, match="yielded no calibration batch"):
        learn.learn_rotations(st, lambda: [], rotation_k="learned", rotation_v="uhp", quant_cfg=QuantConfig(),
                              sink=2, window=4)
    with pytest.raises(ValueError, match="more than sink \\+ window = 16"):
        learn.attention_error(q, k, v, cal.rotation_for(st, "k", "uhp"), cal.rotation_for(st, "v", "uhp"),
                              np.ones(L), np.ones(L), QuantConfig(), sink=8, window=8)


def _tiny_with_tokenizer(root: Path) -> Path:
    """The tiny Llama 3 checkpoint with a byte-level tokenizer.json (ids 0..255 < its 320)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    model = root / "tiny"
    shutil.copytree(TINY, model)
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab, [], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(model / "tokenizer.json"))
    return model


def test_calibrate_cli_learns_rotations_end_to_end(tmp_path):
    """`oscar calibrate --rotation-k learned --rotation-v learned --compare ...` on the tiny HF
    checkpoint: the artifact is the learned variant, loads for the model and serves `oscar eval`."""
    from oscar_jax.models import cli, registry

    cli_app = cli.app
    for module in cli.COMMAND_MODULES:
        __import__(module)
    model = _tiny_with_tokenizer(tmp_path)
    text = tmp_path / "text.txt"
    text.write_text("Now is the winter of our discontent made glorious summer by this sun of York. " * 12)
    out = tmp_path / "art"
    args = ["calibrate", "--model", str(model), "--text", str(text), "--tokens", "256", "--heldout-tokens", "128",
            "--seq-len", "64", "--sink", "4", "--window", "8", "--rotation-k", "learned", "--rotation-v", "learned",
            "--learn-steps", "2", "--learn-rate", "0.01", "--compare", "hadamard,uhp,learned,uhp:learned",
            "--out", str(out), "--time-forward", "--json", str(tmp_path / "calibrate.json")]
    result = CliRunner().invoke(cli_app, args)
    assert result.exit_code == 0, result.output
    assert "learning K learned, V learned from uhp" in result.output
    assert "learning K uhp, V learned from uhp" in result.output  # the K:V pair trains its own
    assert all(name in result.output for name in ("hadamard", "uhp", "learned", "window 8"))
    timing, *compared = json.loads((tmp_path / "calibrate.json").read_text())["rows"]
    assert (timing["rotation_k"], timing["tokens"]) == ("learned", 256) and timing["learn_s"] > 0
    assert timing["ratio"] == pytest.approx((timing["calibration_forward_s"] + timing["learn_s"] + timing["fit_s"])
                                            / timing["plain_forward_s"])
    assert [r["variant"] for r in compared] == ["hadamard", "uhp", "learned", "uhp:learned"]
    assert all(0 < r["served_output_mse"] < 1 and r["heldout_tokens"] == 64 for r in compared)
    decoder, _ = registry.load(str(model))
    params, meta = artifact.load_for_model(out, model_cfg=decoder.cfg)
    assert (meta.rotation_k, meta.rotation_v, meta.sink, meta.window) == ("learned", "learned", 4, 8)
    rot = np.asarray(params.rot_k, np.float64)
    assert params.dual_k is None and np.abs(np.einsum("lhki,lhkj->lhij", rot, rot) - np.eye(32)).max() < 1e-6
    report = tmp_path / "eval.json"
    result = CliRunner().invoke(cli_app, ["eval", "--model", str(model), "--text", str(text), "--rotations", str(out),
                                          "--kv", "oscar", "--context", "64", "--chunk", "8", "--tokens", "64",
                                          "--json", str(report)])
    assert result.exit_code == 0, result.output
    row = json.loads(report.read_text())["rows"][0]
    assert row["kv"] == "oscar" and np.isfinite(row["ppl"]) and "learned/learned" in row["calibration"]


def test_calibrate_cli_relearns_for_the_budget(tmp_path):
    """--budget-relearn: the budget's choice (segment, per-layer quantisers) stays that of the
    run without it (same recorded errors), the rotations are trained again (orthogonal, not
    the first ones) and the artifact serves `oscar eval`."""
    from oscar_jax.models import cli, registry

    for module in cli.COMMAND_MODULES:
        __import__(module)
    model = _tiny_with_tokenizer(tmp_path)
    text = tmp_path / "text.txt"
    text.write_text("Now is the winter of our discontent made glorious summer by this sun of York. " * 24)
    common = ["calibrate", "--model", str(model), "--text", str(text), "--tokens", "256", "--heldout-tokens", "128",
              "--seq-len", "64", "--sink", "4", "--window", "8", "--rotation-k", "learned", "--rotation-v", "learned",
              "--learn-steps", "2", "--learn-rate", "0.01", "--target-bpe", "6.5", "--budget-candidates", "2,2:8,4",
              "--budget-context", "64", "--budget-segments", "4+8,2+16", "--budget-chunk", "4"]
    first, again = tmp_path / "a.json", tmp_path / "b.json"
    for extra, report in (([], first), (["--budget-relearn", "--budget-measured", str(first)], again)):
        result = CliRunner().invoke(cli.app, [*common, *extra, "--json", str(report),
                                              "--out", str(report.with_suffix(""))])
        assert result.exit_code == 0, result.output
    assert "from the budget" in " ".join(result.output.split())
    rows = [next(r for r in json.loads(p.read_text())["rows"] if r.get("variant") == "budget") for p in (first, again)]
    assert [r["relearned"] for r in rows] == [False, True]
    assert all(rows[0][key] == rows[1][key] for key in ("picked", "sink", "window", "layer_errors", "bpe"))
    decoder, _ = registry.load(str(model))
    (p0, m0), (p1, m1) = (artifact.load_for_model(p.with_suffix(""), model_cfg=decoder.cfg) for p in (first, again))
    assert (m1.sink, m1.window, m1.rotation_k) == (m0.sink, m0.window, "learned")
    quants = [cli.load_calibration(p.with_suffix(""), decoder.cfg).layer_quant for p in (first, again)]
    assert quants[0] == quants[1] and len(set(quants[0])) > 1
    rot = np.asarray(p1.rot_k, np.float64)
    assert np.abs(np.einsum("lhki,lhkj->lhij", rot, rot) - np.eye(32)).max() < 1e-6
    assert np.abs(rot - np.asarray(p0.rot_k, np.float64)).max() > 1e-4
    result = CliRunner().invoke(cli.app, ["eval", "--model", str(model), "--text", str(text), "--rotations",
                                          str(again.with_suffix("")), "--kv", "oscar", "--context", "64", "--chunk",
                                          "4", "--tokens", "128", "--json", str(tmp_path / "eval.json")])
    assert result.exit_code == 0, result.output
    no_budget = common[:common.index("--target-bpe")]
    not_learned = [("uhp" if a == "learned" else a) for a in common]
    for argv in ([*no_budget, "--budget-relearn"], [*not_learned, "--budget-relearn"]):
        result = CliRunner().invoke(cli.app, [*argv, "--out", str(tmp_path / "never")])
        assert result.exit_code == 2 and "--budget-relearn: expected --target-bpe and a learned" in result.output
