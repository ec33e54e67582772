"""The orbax calibration artifact: round trip, and refusal of mismatched or damaged ones."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from oscar_jax import artifact
from oscar_jax import calibrate as cal
from oscar_jax.config import QuantConfig

L, HQ, HKV, D = 3, 4, 2, 16
MODEL = dict(model_name="test-model", config_hash=artifact.fingerprint({"layers": L, "d": D}))


@pytest.fixture(scope="module")
def calibrations():
    """Calibrations of random activations: orthogonal (uhp), error-shaped per head, and
    uhp with centered keys."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((L, 2, 24, h, D)).astype(np.float32) * np.geomspace(3, 0.3, D)
               for h in (HQ, HKV, HKV))
    st = cal.statistics(cal.accumulate(cal.Accumulator.init(L, HKV, D), q, k, v))
    cfg = QuantConfig(group_size=8)
    out = {name: cal.calibrate(st, (q, k, v), rotation_k=name, rotation_v=name, quant_cfg=cfg,
                               grid=(0.8, 0.9, 1.0))
           for name in ("uhp", "shaped/head")}
    out["centered"] = cal.calibrate(st, (q, k, v), quant_cfg=cfg, grid=(0.8, 0.9, 1.0), center_keys=True)
    return out


def _save(tmp_path, calib, name="a"):
    path = tmp_path / name
    meta = artifact.save(path, calib, corpus_hash=artifact.fingerprint("some text"),
                         layers=(0, 2, 4), **MODEL)
    return path, meta


@pytest.mark.parametrize("name", ["uhp", "shaped/head"])
def test_round_trip(tmp_path, calibrations, name):
    calib = calibrations[name]
    path, meta = _save(tmp_path, calib)
    params, loaded = artifact.load(path, head_dim=D, **MODEL)
    want = calib.layer_params()
    for field in ("rot_k", "rot_v", "clip_k", "clip_v", "dual_k", "dual_v"):
        a, b = getattr(params, field), getattr(want, field)
        assert (a is None) == (b is None) == (field.startswith("dual") and name == "uhp")
        if a is not None:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert loaded == meta
    assert (meta.rotation_k, meta.value_weighting, meta.clip_mode) == (name, "published", "fit")
    assert (meta.num_layers, meta.kv_heads, meta.head_dim, meta.group_size) == (L, HKV, D, 8)
    assert meta.layers == (0, 2, 4) and meta.tokens == 2 * 24
    assert meta.quant == {"bits": 2, "group_size": 8, "codebook": "uniform", "scale_dtype": "bfloat16"}
    assert artifact.load(path, head_dim=D, v_folded=True, **MODEL)[0].v_folded
    assert (meta.sink, meta.window) == (64, 256)


def test_centered_keys_round_trip(tmp_path, calibrations):
    calib = calibrations["centered"]
    path, meta = _save(tmp_path, calib)
    params, loaded = artifact.load(path, head_dim=D, **MODEL)
    assert meta.center_keys and loaded == meta
    np.testing.assert_array_equal(np.asarray(params.k_shift), calib.k_shift)
    assert artifact.load(_save(tmp_path, calibrations["uhp"], "b")[0], head_dim=D, **MODEL)[0].k_shift is None


def test_served_sink_and_window(tmp_path, calibrations):
    meta = artifact.save(tmp_path / "a", calibrations["uhp"], corpus_hash="c", layers=(0, 2, 4),
                         sink=16, window=112, **MODEL)
    assert (meta.sink, meta.window) == (16, 112)
    assert artifact.read_metadata(tmp_path / "a") == meta


@pytest.mark.parametrize("override, match", [
    ({"model_name": "other-model"}, "model_name='test-model'"),
    ({"config_hash": "0" * 64}, "config_hash="),
    ({"head_dim": 2 * D}, "head_dim=16"),
])
def test_mismatched_model_refused(tmp_path, calibrations, override, match):
    path, _ = _save(tmp_path, calibrations["uhp"])
    kwargs = {**MODEL, "head_dim": D, **override}
    with pytest.raises(ValueError, match=match):
        artifact.load(path, **kwargs)


def test_other_format_version_refused(tmp_path, calibrations):
    path, _ = _save(tmp_path, calibrations["uhp"])
    meta_file = path / "metadata" / "metadata"
    raw = json.loads(meta_file.read_text())
    raw["format_version"] = artifact.FORMAT_VERSION + 1
    meta_file.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="format_version="):
        artifact.load(path, head_dim=D, **MODEL)


def _largest_file(root: Path) -> Path:
    return max((p for p in (root / "arrays").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("damage", ["truncate_data", "flip_data_byte", "drop_arrays",
                                    "truncate_metadata", "tamper_checksum"])
def test_damaged_artifact_refused(tmp_path, calibrations, damage):
    path, _ = _save(tmp_path, calibrations["shaped/head"])
    if damage == "truncate_data":
        f = _largest_file(path)
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif damage == "flip_data_byte":
        f = _largest_file(path)
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    elif damage == "drop_arrays":
        shutil.rmtree(path / "arrays")
    elif damage == "truncate_metadata":
        f = path / "metadata" / "metadata"
        f.write_bytes(f.read_bytes()[:40])
    else:
        f = path / "metadata" / "metadata"
        raw = json.loads(f.read_text())
        raw["checksum"] = artifact.fingerprint("not these arrays")
        f.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="corrupted"):
        artifact.load(path, head_dim=D, **MODEL)


def test_missing_and_existing_paths(tmp_path, calibrations):
    with pytest.raises(ValueError, match="not a directory"):
        artifact.load(tmp_path / "nothing", head_dim=D, **MODEL)
    path, _ = _save(tmp_path, calibrations["uhp"])
    with pytest.raises(ValueError, match="already exists"):
        _save(tmp_path, calibrations["uhp"])
    with pytest.raises(ValueError, match="layers has 2 entries"):
        artifact.save(tmp_path / "b", calibrations["uhp"], corpus_hash="c", layers=(0, 1), **MODEL)


def test_fingerprint_is_canonical_and_discriminating():
    assert artifact.fingerprint({"a": 1, "b": 2}) == artifact.fingerprint({"b": 2, "a": 1})
    assert artifact.fingerprint({"a": 1}) != artifact.fingerprint({"a": 2})
    assert artifact.fingerprint(np.arange(5)) == artifact.fingerprint([0, 1, 2, 3, 4])
    assert artifact.fingerprint(np.arange(5)) != artifact.fingerprint(np.arange(1, 6))
    assert artifact.fingerprint(QuantConfig()) != artifact.fingerprint(QuantConfig(bits=4))
