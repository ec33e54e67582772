"""The evaluation harness: metrics against numpy, schemes end to end, the CLI's JSON."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import log_softmax

from oscar_jax import rotation
from oscar_jax.cache import LayerParams
from oscar_jax.config import QuantConfig
from oscar_jax.models import evaluate as ev
from oscar_jax.models import kv_policy, registry, results

TINY = "tests/fixtures/hf_tiny/llama3"


@pytest.fixture(scope="module")
def tiny():
    """The tiny Llama 3 checkpoint (random weights), its 64-position context lifted: windows of
    hundreds of tokens exercise the cache; the context limit is not under test here."""
    decoder, _ = registry.load(TINY)
    decoder.cfg = dataclasses.replace(decoder.cfg, max_position=None)
    return decoder


@pytest.fixture(scope="module")
def smollm2():
    return registry.load("smollm2")


def test_chunk_sums_match_numpy():
    rng = np.random.default_rng(0)
    ref, logits = (rng.standard_normal((2, 5, 50)) * 3 for _ in range(2))
    logits[0, 1] = ref[0, 1] + 0.01  # same argmax there
    targets = rng.integers(0, 50, (2, 5))
    mask = np.ones((2, 5), bool)
    mask[1, 4] = False
    got = [float(x) for x in ev.chunk_sums(jnp.asarray(ref, jnp.float32), jnp.asarray(logits, jnp.float32),
                                           jnp.asarray(targets), jnp.asarray(mask))]
    lr, lp = log_softmax(ref, axis=-1), log_softmax(logits, axis=-1)
    nll = -np.take_along_axis(lp, targets[..., None], -1)[..., 0]
    kl = np.sum(np.exp(lr) * (lr - lp), axis=-1)
    agree = lr.argmax(-1) == lp.argmax(-1)
    np.testing.assert_allclose(got, [nll[mask].sum(), kl[mask].sum(), agree[mask].sum()], rtol=1e-5)


@pytest.mark.slow  # ~70 s on 2 cores with the model's load; the tiny model's checks below run in CI
def test_full_precision_cache_reproduces_forward_perplexity(smollm2):
    """SmolLM2 through the cache with prefill + extend chunks: fp32 equals the plain forward.
    (The bf16 cache's check against a forward with bf16 K/V is the tiny model's below: on
    this model bf16 rounding is chaotic, a 1e-7 relative nudge of q, k moves the bf16-K/V
    perplexity of a sample by std 1.5e-4.)"""
    decoder, tokenizer = smollm2
    from oscar_jax.models import corpus

    text, _ = corpus.shakespeare_text("evaluation")
    rows = ev.windows(np.asarray(tokenizer.encode(text[:6000]), np.int32), 256, 512)
    forward = ev.forward_perplexity(decoder, rows, chunk=32)
    (fp32,) = ev.evaluate(decoder, rows, {"fp32": kv_policy.DensePolicy("float32")}, chunk=32, batch=2)
    print(f"forward PPL {forward:.6f}; fp32 cache {fp32.ppl:.6f} (rel {abs(fp32.ppl / forward - 1):.2e})")
    assert fp32.tokens == 2 * (256 - 32)
    assert abs(fp32.ppl / forward - 1) < 1e-5 and fp32.kl < 1e-9 and fp32.top1 == 1.0


def test_bf16_cache_reproduces_forward_with_bf16_kv(tiny):
    """`evaluate`'s bf16 scheme equals the plain forward whose K/V are rounded to bf16 after
    the prefill chunk (its oracle) to 1e-5 relative perplexity; the unrounded forward is
    farther than 1e-4, so the check sees the rounding."""
    rows = np.random.default_rng(3).integers(0, tiny.cfg.vocab_size, (2, 256)).astype(np.int32)
    forward = ev.forward_perplexity(tiny, rows, chunk=32)
    forward_bf16 = ev.forward_perplexity(tiny, rows, chunk=32, kv_dtype="bfloat16")
    (bf16,) = ev.evaluate(tiny, rows, {"bf16": ev.scheme_policy("bf16")}, chunk=32, batch=2)
    rel = abs(bf16.ppl / forward_bf16 - 1)
    print(f"bf16 cache PPL {bf16.ppl:.6f}; forward with bf16 K/V {forward_bf16:.6f} (rel {rel:.1e}), "
          f"unrounded forward {forward:.6f} (rel {abs(bf16.ppl / forward - 1):.1e})")
    assert rel < 1e-5
    assert abs(bf16.ppl / forward - 1) > 1e-4


def test_every_scheme_runs_through_its_cache(tiny):
    rng = np.random.default_rng(1)
    rows = rng.integers(0, tiny.cfg.vocab_size, (2, 448)).astype(np.int32)
    d, h = tiny.cfg.head_dim, tiny.cfg.num_kv_heads
    rot = np.linalg.qr(rng.standard_normal((2, h, d, d)))[0]
    calibrated = LayerParams.create(rot, rot[:, ::-1], jnp.array([0.9, 0.8]), jnp.array([0.85, 0.95]),
                                    num_layers=2, kv_heads=h)
    policies = {name: ev.scheme_policy(name, kv_policy.oscar_policy(calibrated)) for name in ev.SCHEMES}
    results = {r.kv: r for r in ev.evaluate(tiny, rows, policies, chunk=64)}
    assert set(results) == set(ev.SCHEMES)
    assert results["bf16"].bpe == 16.0 and results["bf16"].top1 > 0.98
    for name, r in results.items():
        assert np.isfinite([r.ppl, r.kl]).all() and r.tokens == 2 * (448 - 64)
        if name != "bf16":  # 448 tokens: the 2-bit history holds 128 of them
            assert r.bpe < 16 and r.kl > results["bf16"].kl
    assert results["naive-int2"].kl > results["naive-int2-win"].kl  # no window at all is worse
    assert results["int8"].kl < results["int4"].kl < results["naive-int2-win"].kl
    fixed = ev.scheme_policy("oscar-fixedclip", kv_policy.oscar_policy(calibrated)).layer_params
    np.testing.assert_allclose(fixed.clip_k, 0.96)
    np.testing.assert_allclose(fixed.clip_v, 0.92)
    hadamard = ev.scheme_policy("oscar-hadamard", kv_policy.oscar_policy(calibrated)).layer_params
    np.testing.assert_allclose(hadamard.rot_k[1, 0], rotation.hadamard(d))
    np.testing.assert_allclose(hadamard.clip_v, calibrated.clip_v)
    shifted = dataclasses.replace(calibrated, k_shift=jnp.ones((2, h, d), jnp.float32))
    served = kv_policy.oscar_policy(shifted, quant=QuantConfig(group_size=16), sink=16, window=112)
    for name in ("oscar", "oscar-lloyd", "oscar-fixedclip", "oscar-hadamard", "oscar-norot"):
        p = ev.scheme_policy(name, served)  # the artifact's quantiser, bf16 segments and key shift are served
        assert (p.name, p.sink, p.window, p.quant.group_size) == (name, 16, 112, 16)
        np.testing.assert_array_equal(p.layer_params.k_shift, 1.0)
        assert p.quant.codebook == ("lloyd_max" if name == "oscar-lloyd" else "uniform")


def test_scheme_errors_are_clear():
    with pytest.raises(ValueError, match="needs calibrated rotations"):
        ev.scheme_policy("oscar")
    with pytest.raises(ValueError, match="expected one of"):
        ev.scheme_policy("int3")


class _Bytes:
    """UTF-8 bytes as token ids (the tiny checkpoint ships no tokenizer; vocab 320 > 256)."""

    def encode(self, text):
        return list(text.encode())


def _cli_text(tiny, tmp_path, monkeypatch, seed: int, words: int):
    """A random digit text FILE, with `registry.load` returning the tiny model and byte tokens."""
    text = tmp_path / "text.txt"
    text.write_text(" ".join(str(x) for x in np.random.default_rng(seed).integers(0, 10, words)))
    monkeypatch.setattr(registry, "load", lambda name, **kw: (tiny, _Bytes()))
    monkeypatch.setattr(registry, "load_config", lambda name: tiny.cfg)
    return text


def test_eval_cli_writes_records(tiny, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from oscar_jax.models.cli import app

    text = _cli_text(tiny, tmp_path, monkeypatch, 2, 600)
    out = tmp_path / "r.json"
    result = CliRunner().invoke(app, ["eval", "--model", TINY, "--text", str(text), "--kv", "bf16,fp8,quarot-int2",
                                      "--tokens", "400", "--context", "400", "--chunk", "50",
                                      "--json", str(out), "--plot", str(tmp_path / "p.png")])
    assert result.exit_code == 0, result.output
    records = results.read(out)["rows"]
    assert [r["kv"] for r in records] == ["bf16", "fp8", "quarot-int2"]
    assert 8 < records[1]["bpe"] < 8.01
    assert all({"kv", "ppl", "kl", "top1", "bpe"} <= set(r) for r in records)
    assert (tmp_path / "p.png").stat().st_size > 0


def test_calibrate_cli_serves_centered_keys_and_its_window(tiny, tmp_path, monkeypatch):
    """calibrate --center-keys --sink --window -> artifact -> the policy eval serves."""
    from typer.testing import CliRunner

    import oscar_jax.models.calibration  # noqa: F401  (registers `oscar calibrate`)
    from oscar_jax.models.cli import app, load_calibration

    text = _cli_text(tiny, tmp_path, monkeypatch, 4, 900)
    art = tmp_path / "art"
    result = CliRunner().invoke(app, ["calibrate", "--model", TINY, "--text", str(text), "--tokens", "512",
                                      "--heldout-tokens", "256", "--seq-len", "128", "--center-keys",
                                      "--sink", "8", "--window", "64", "--out", str(art)])
    assert result.exit_code == 0, result.output
    policy = load_calibration(art, tiny.cfg)
    assert (policy.sink, policy.window) == (8, 64) and policy.layer_params.k_shift is not None
    assert float(jnp.abs(policy.layer_params.k_shift).max()) > 0
    out = tmp_path / "r.json"
    result = CliRunner().invoke(app, ["eval", "--model", TINY, "--text", str(text), "--rotations", str(art),
                                      "--kv", "bf16,oscar", "--tokens", "400", "--context", "400",
                                      "--chunk", "50", "--json", str(out)])
    assert result.exit_code == 0, result.output
    bf16, oscar = results.read(out)["rows"]
    assert "sink 8, centered keys, window 64" in oscar["calibration"] and "calibration" not in bf16
    assert oscar["kv"] == "oscar" and np.isfinite(oscar["ppl"]) and oscar["kl"] > 0


def test_calibrate_cli_spends_a_bit_budget(tiny, tmp_path, monkeypatch):
    """calibrate --target-bpe: the (sink, window) and per-layer quantisers are the least-error
    choice within the target (brute force over the recorded held-aside errors), the artifact
    carries them, load_calibration serves each layer with its own, and eval counts bits within
    the target."""
    import itertools

    from typer.testing import CliRunner

    import oscar_jax.models.calibration  # noqa: F401  (registers `oscar calibrate`)
    from oscar_jax.models.cli import app, load_calibration

    text = _cli_text(tiny, tmp_path, monkeypatch, 5, 1700)
    art, report = tmp_path / "art", tmp_path / "cal.json"
    result = CliRunner().invoke(app, ["calibrate", "--model", TINY, "--text", str(text), "--tokens", "512",
                                      "--heldout-tokens", "256", "--seq-len", "128", "--sink", "8", "--window", "32",
                                      "--target-bpe", "5.3", "--budget-candidates", "2,2:8,4", "--budget-context",
                                      "400", "--budget-segments", "8+32,4+16", "--budget-chunk", "16",
                                      "--json", str(report), "--out", str(art)])
    assert result.exit_code == 0, result.output
    row = next(r for r in results.read(report)["rows"] if r.get("variant") == "budget")
    errors, bits = np.array(row["layer_errors"]), np.array(row["candidate_bpe"])
    assert errors.shape[:1] == bits.shape[:1] == (2,) and row["segments"] == [[8, 32], [4, 16]]
    rows = np.arange(errors.shape[1])
    combos = [(s, c) for s in range(2) for c in itertools.product(range(3), repeat=errors.shape[1])
              if bits[s, list(c)].mean() <= 5.3]
    total = lambda s, c: errors[s, rows, list(c)].sum()
    best = min(combos, key=lambda sc: total(*sc))
    chosen = [i for i, seg in enumerate(row["segments"]) if seg == [row["sink"], row["window"]]]
    assert len(chosen) == 1 and total(*best) == pytest.approx(total(chosen[0], row["picked"]), rel=1e-12)
    assert row["bpe"] == pytest.approx(bits[chosen[0], row["picked"]].mean())
    assert len(set(row["picked"])) > 1  # the target buys some layers more than the cheapest
    quants = (QuantConfig(2), QuantConfig(2, 8), QuantConfig(4))
    policy = load_calibration(art, tiny.cfg)
    assert policy.layer_quant == tuple(quants[j] for j in row["picked"])
    assert (policy.sink, policy.window) == (row["sink"], row["window"])
    out = tmp_path / "r.json"
    result = CliRunner().invoke(app, ["eval", "--model", TINY, "--text", str(text), "--rotations", str(art),
                                      "--kv", "oscar", "--tokens", "400", "--context", "400", "--chunk", "16",
                                      "--json", str(out)])
    assert result.exit_code == 0, result.output
    oscar = results.read(out)["rows"][0]
    assert oscar["bpe"] == pytest.approx(row["bpe"]) and oscar["bpe"] <= 5.3 and np.isfinite(oscar["ppl"])


def test_calibrate_cli_weighs_layers_by_output_kl_and_retargets(tiny, tmp_path, monkeypatch):
    """--budget-weights kl: the recorded weights are the layers' KL per unit of error, the
    choice is the least weighted error within the target (brute force); --budget-measured
    re-targets from that record without measuring again (the same choice as brute force at
    the new target) and refuses a record of other settings."""
    import itertools

    from typer.testing import CliRunner

    import oscar_jax.models.calibration  # noqa: F401  (registers `oscar calibrate`)
    from oscar_jax import budget
    from oscar_jax.models.cli import app

    text = _cli_text(tiny, tmp_path, monkeypatch, 6, 1800)
    common = ["calibrate", "--model", TINY, "--text", str(text), "--tokens", "512", "--heldout-tokens", "256",
              "--seq-len", "128", "--sink", "8", "--window", "32", "--budget-candidates", "2,2:8,4",
              "--budget-context", "400", "--budget-segments", "8+32,4+16", "--budget-chunk", "16",
              "--budget-weights", "kl", "--budget-kl-context", "120"]

    def run(target, name, *extra):
        report = tmp_path / f"{name}.json"
        result = CliRunner().invoke(app, [*common, "--target-bpe", target, *extra, "--json", str(report),
                                          "--out", str(tmp_path / name)])
        return result, report

    def check_optimal(row, target):
        errors, bits = np.array(row["layer_errors"]), np.array(row["candidate_bpe"])
        weights = np.array(row["layer_weights"])
        rows = np.arange(errors.shape[1])
        total = lambda s, c: (weights * errors[s, rows, list(c)]).sum()
        best = min(((s, c) for s in range(2) for c in itertools.product(range(3), repeat=errors.shape[1])
                    if bits[s, list(c)].mean() <= target), key=lambda sc: total(*sc))
        chosen = [i for i, seg in enumerate(row["segments"]) if seg == [row["sink"], row["window"]]]
        assert total(*best) == pytest.approx(total(chosen[0], row["picked"]), rel=1e-12)

    result, first = run("5.3", "a")
    assert result.exit_code == 0, result.output
    row = next(r for r in results.read(first)["rows"] if r.get("variant") == "budget")
    np.testing.assert_allclose(row["layer_weights"], budget.output_weights(row["layer_kl"], row["layer_kl_error"]))
    assert min(row["layer_kl"]) > 0 and row["weights"] == "kl" and row["measured_in"] is None
    check_optimal(row, 5.3)
    result, second = run("4.3", "b", "--budget-measured", str(first))
    assert result.exit_code == 0, result.output
    again = next(r for r in results.read(second)["rows"] if r.get("variant") == "budget")
    assert again["layer_errors"] == row["layer_errors"] and again["layer_weights"] == row["layer_weights"]
    assert again["measured_in"] == str(first) and again["bpe"] <= 4.3
    check_optimal(again, 4.3)
    result, _ = run("4.3", "c", "--budget-measured", str(first), "--budget-chunk", "8")
    assert result.exit_code != 0 and "--budget-measured" in result.output and "chunk" in result.output
