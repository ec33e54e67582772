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
    q, k, v = _activations()
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
    meta = artifact.save(tmp_path / "a", calibrations["uhp"], corpus_hash=artifact.fingerprint("c"),
                         layers=(0, 2, 4), sink=16, window=112, **MODEL)
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


@pytest.mark.parametrize("edit, match", [
    ({"window": 0}, r"window=0: expected an int >= 1"),
    ({"sink": -1}, r"sink=-1: expected an int >= 0"),
    ({"layers": [0, 2]}, "layers="),
    ({"layers": [4, 2, 0]}, "layers="),
    ({"quant": {"bits": 3, "group_size": 8, "codebook": "uniform", "scale_dtype": "bfloat16"}}, "quant="),
    ({"quant": {"bits": 2, "group_size": 32, "codebook": "uniform", "scale_dtype": "bfloat16"}}, "head_dim=16"),
    ({"rotation_k": "bogus"}, "rotation_k="),
    ({"clip_mode": "guess"}, "clip_mode="),
    ({"center_keys": "yes"}, "center_keys="),
    ({"tokens": 1.5}, "tokens="),
    ({"created": "yesterday"}, "created="),
    ({"corpus_hash": "abc"}, "corpus_hash="),
    ({"extra": 1}, r"unknown: \['extra'\]"),
    ({"window": None}, "window="),
])
def test_invalid_metadata_field_refused(tmp_path, calibrations, edit, match):
    """Every metadata field is validated on read: a hand-edited window=0 (or any other
    out-of-range, mistyped, unknown field) is refused, by read_metadata and load alike."""
    path, _ = _save(tmp_path, calibrations["uhp"])
    meta_file = path / "metadata" / "metadata"
    raw = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps(raw | edit))
    for read in (lambda: artifact.read_metadata(path), lambda: artifact.load(path, head_dim=D, **MODEL)):
        with pytest.raises(ValueError, match=match):
            read()


@pytest.mark.parametrize("edit", [{"model_name": "other"}, {"rotation_k": "shaped"}, {"tokens": 4096},
                                  {"sink": 16}, {"window": 112}, {"layers": [1, 2, 3]},
                                  {"corpus_hash": artifact.fingerprint("other text")},
                                  {"created": "2020-01-01T00:00:00+00:00"}])
def test_checksum_covers_every_metadata_field(tmp_path, calibrations, edit):
    """A valid but hand-edited descriptive or serving field fails the checksum."""
    path, _ = _save(tmp_path, calibrations["uhp"])
    meta_file = path / "metadata" / "metadata"
    meta_file.write_text(json.dumps(json.loads(meta_file.read_text()) | edit))
    assert artifact.read_metadata(path)  # each field alone is valid
    with pytest.raises(ValueError, match="do not match the checksum"):
        artifact.load(path, head_dim=D, model_name=None, config_hash=MODEL["config_hash"])


_WRITER = """
import pickle, sys, time
from pathlib import Path
from oscar_jax import artifact
calib, target, go, kwargs = pickle.loads(Path(sys.argv[1]).read_bytes())
while not Path(go).exists():
    time.sleep(0.001)
try:
    meta = artifact.save(target, calib, **kwargs)
    print("WON", meta.checksum)
except ValueError as e:
    print("REFUSED", e)
"""


def test_concurrent_writers_one_winner_never_partial(tmp_path, calibrations):
    """Writer processes racing for one path (each imports, then waits for one signal, 2
    rounds): exactly one succeeds, every other is refused with a ValueError, the artifact
    loads complete and is the winner's, and no temporary directory is left behind."""
    import pickle
    import subprocess
    import sys

    for round_ in range(2):
        path, go = tmp_path / f"a{round_}", tmp_path / f"go{round_}"
        procs = []
        for i, name in enumerate(("uhp", "shaped/head", "centered")):
            job = tmp_path / f"job{round_}{i}.pkl"
            job.write_bytes(pickle.dumps((calibrations[name], str(path), str(go), dict(
                corpus_hash=artifact.fingerprint(str(i)), layers=(0, 2, 4), **MODEL))))
            procs.append(subprocess.Popen([sys.executable, "-c", _WRITER, str(job)], stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        go.touch()
        outs = [p.communicate(timeout=300) for p in procs]
        assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
        lines = [out.strip().splitlines()[-1] for out, _ in outs]
        won = [line.split()[1] for line in lines if line.startswith("WON")]
        assert len(won) == 1, lines
        assert all("already exists" in line or "appeared while" in line
                   for line in lines if line.startswith("REFUSED")), lines
        _, loaded = artifact.load(path, head_dim=D, **MODEL)
        assert loaded.checksum == won[0]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["a0", "a1"]


FIXTURES = Path(__file__).parent / "fixtures"


def test_format_2_artifact_reads(tmp_path):
    """An artifact written by the format-2 code (tests/fixtures/artifact_v2, centered keys)
    loads with its arrays and no per-layer quantisers; a damaged copy is still refused."""
    params, meta = artifact.load(FIXTURES / "artifact_v2", head_dim=D, **MODEL)
    want = np.load(FIXTURES / "artifact_v2_expected.npz")
    assert meta.format_version == 2 and meta.layer_quant is None and meta.layer_quants() is None
    for field in ("rot_k", "rot_v", "clip_k", "clip_v", "k_shift"):
        np.testing.assert_array_equal(np.asarray(getattr(params, field)), want[field])
    copy = tmp_path / "v2"
    shutil.copytree(FIXTURES / "artifact_v2", copy)
    f = copy / "metadata" / "metadata"
    raw = json.loads(f.read_text())
    raw["layer_quant"] = [raw["quant"]] * L  # a field format 2 does not have
    f.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="unknown: \\['layer_quant'\\]"):
        artifact.load(copy, head_dim=D, **MODEL)


def test_layer_quant_round_trip(tmp_path):
    """A per-layer quantiser choice (`budget.select`) saves and loads: each layer's
    rotations and clips from its own candidate, `layer_quants()` the chosen quantisers; a
    tampered choice fails the checksum, a malformed one names the field."""
    from oscar_jax import budget

    acts = _activations()
    st = cal.statistics(cal.accumulate(cal.Accumulator.init(L, HKV, D), *acts))
    two, four = (cal.calibrate(st, acts, quant_cfg=q, grid=(0.7, 0.85, 1.0))
                 for q in (QuantConfig(group_size=8), QuantConfig(bits=4, group_size=16)))
    picked = np.array([1, 0, 1])
    mixed = budget.select([two, four], picked)
    path, meta = _save(tmp_path, mixed)
    params, loaded = artifact.load(path, head_dim=D, **MODEL)
    assert loaded == meta and meta.format_version == artifact.FORMAT_VERSION
    assert loaded.layer_quants() == (four.quant, two.quant, four.quant)
    for i, j in enumerate(picked):
        src = (two, four)[j]
        np.testing.assert_array_equal(np.asarray(params.rot_k[i]), src.rot_k.rot[i])
        np.testing.assert_array_equal(np.asarray(params.rot_v[i]), src.rot_v.rot[i])
        assert (float(params.clip_k[i]), float(params.clip_v[i])) == (src.clip_k[i], src.clip_v[i])
    f = path / "metadata" / "metadata"
    raw = json.loads(f.read_text())
    raw["layer_quant"][0]["bits"] = 2
    f.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="checksum"):
        artifact.load(path, head_dim=D, **MODEL)
    raw["layer_quant"] = raw["layer_quant"][:2]
    f.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="layer_quant=.*num_layers=3"):
        artifact.load(path, head_dim=D, **MODEL)


def _activations():
    rng = np.random.default_rng(0)
    return tuple(rng.standard_normal((L, 2, 24, h, D)).astype(np.float32) * np.geomspace(3, 0.3, D)
                 for h in (HQ, HKV, HKV))
