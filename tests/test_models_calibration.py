"""The model-side calibration run on a tiny random decoder with sliding and full layers."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from oscar_jax import artifact
from oscar_jax import calibrate as cal
from oscar_jax.config import QuantConfig
from oscar_jax.models import capture as mc
from oscar_jax.models.config import ModelConfig
from oscar_jax.models.decoder import Decoder

CFG = ModelConfig(
    family="gemma3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4,
    num_kv_heads=2, head_dim=16, rms_eps=1e-6, rope_theta=1e4, rope_local_theta=1e3,
    layer_types=("sliding_attention", "full_attention") * 2, sliding_window=8, qk_norm=True,
    activation="gelu_tanh", query_pre_attn_scalar=16.0, embed_scale=True, post_norms=True)


def test_collect_streams_the_full_attention_layers(tmp_path):
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, CFG.vocab_size, 3 * 16 + 2 * 16)
    run = mc.collect(model, ids[:50], ids[48:], seq_len=16,  # 50 -> 3 windows (tail dropped)
                     config=cal.CalibConfig("attention_mass", softmax_scale=CFG.softmax_scale))
    assert run.layers == (1, 3) and run.stats.tokens == 48
    # oracle: one capture of all three windows, full layers picked by hand
    rows = jnp.asarray(ids[:48].reshape(3, 16))
    positions = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (3, 16))
    _, _, cap = model(rows, positions, mode="forward", capture_qkv=True)
    q, k = (np.asarray(x, np.float64)[[1, 3]] for x in (cap.q, cap.k))
    qg = q.reshape(2, 48, 2, 2, 16)
    want = np.einsum("lnhgd,lnhge->lhde", qg, qg) / (48 * 2)
    np.testing.assert_allclose(run.stats.query_cov, want, rtol=1e-4, atol=1e-6)
    held_q, held_k, held_v = run.heldout
    assert held_q.shape == (2, 2, 16, 4, 16) and held_k.shape == held_v.shape == (2, 2, 16, 2, 16)
    np.testing.assert_allclose(held_k[:, 0], np.asarray(model(
        jnp.asarray(ids[48:64][None]), positions[:1], mode="forward", capture_qkv=True)[2].k)[[1, 3], 0],
        rtol=1e-5, atol=1e-5)  # float32 matmuls of a 1-row and a 2-row batch sum in other orders

    errors = mc.compare_variants(run, ("identity", "hadamard"), QuantConfig(), clips="fixed", sink=2, window=4)
    assert set(errors) == {"identity", "hadamard"}
    assert [e.shape for e in errors["identity"]] == [(2,)] * 3
    calib = cal.calibrate(run.stats, run.heldout, grid=(0.8, 1.0))
    path = tmp_path / "tiny"
    artifact.save(path, calib, model_name="tiny", config_hash=artifact.fingerprint(CFG),
                  corpus_hash=artifact.fingerprint(ids), layers=run.layers)
    assert artifact.load_layer_params(path, model_cfg=CFG).rot_k.shape == (2, 2, 16, 16)
    other = ModelConfig(**{**CFG.__dict__, "layer_types": ("full_attention",) * 4})
    with pytest.raises(ValueError, match="config_hash"):
        artifact.load_layer_params(path, model_cfg=other)


def test_windows_and_text_errors(tmp_path):
    np.testing.assert_array_equal(mc.windows(np.arange(10), 4), [[0, 1, 2, 3], [4, 5, 6, 7]])
    with pytest.raises(ValueError, match="seq_len=16"):
        mc.windows(np.arange(10), 16)
    with pytest.raises(FileNotFoundError, match="expected 'shakespeare' or a UTF-8 text file"):
        mc.calibration_text(str(tmp_path / "missing.txt"))
    (tmp_path / "a.txt").write_text("some calibration text")
    assert mc.calibration_text(str(tmp_path / "a.txt")) == "some calibration text"
