"""The GGUF loader on a tiny real file: its context length, damaged files named, and the
dequantised-weight cache (hashed: a damaged cache file is rebuilt, never served)."""

import dataclasses
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from oscar_jax import artifact
from oscar_jax.models import gguf_loader, registry
from oscar_jax.models.config import ModelConfig
from tiny_gguf import tiny_config, write_tiny_gguf

HF_LLAMA3 = Path(__file__).parent / "fixtures" / "hf_tiny" / "llama3"


@pytest.fixture
def gguf_file(tmp_path, monkeypatch):
    monkeypatch.setenv("OSCAR_CACHE_DIR", str(tmp_path / "cache"))
    return write_tiny_gguf(tmp_path / "tiny.gguf", context_length=512)


def test_context_length_is_read_from_gguf_and_hf():
    hf = json.loads((HF_LLAMA3 / "config.json").read_text())
    cfg = ModelConfig.from_hf(hf)
    assert cfg.max_position == hf["max_position_embeddings"] == 64
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert ModelConfig.from_hf({k: v for k, v in hf.items() if k != "max_position_embeddings"}).max_position is None
    # the context length does not change what the model computes: calibrations stay valid
    assert artifact.fingerprint(cfg) == artifact.fingerprint(dataclasses.replace(cfg, max_position=None))
    assert artifact.fingerprint(cfg) != artifact.fingerprint(dataclasses.replace(cfg, rms_eps=1e-6))
    with pytest.raises(ValueError, match="max_position=0"):
        dataclasses.replace(cfg, max_position=0)


def test_check_context_names_what_set_the_length():
    cfg = tiny_config(context_length=512)
    cfg.check_context(512)
    with pytest.raises(ValueError, match=r"--max-new-tokens 600 \+ prompt = 605 tokens exceeds the model's "
                                         r"context length of 512 positions"):
        cfg.check_context(605, "--max-new-tokens 600 + prompt")
    dataclasses.replace(cfg, max_position=None).check_context(10**9)


def test_tiny_gguf_loads(gguf_file):
    model, tok = registry.load(gguf_file)
    assert model.cfg == tiny_config(context_length=512)
    assert tok.decode(tok.encode("to be or not")) == "to be or not"


@pytest.mark.parametrize("keep", [0.5, 0.999, 100])
def test_truncated_gguf_is_named(gguf_file, keep):
    data = gguf_file.read_bytes()
    gguf_file.write_bytes(data[: int(len(data) * keep) if keep < 1 else keep])
    with pytest.raises(ValueError, match=rf"GGUF file {gguf_file} is truncated or corrupt"):
        registry.load(gguf_file)


def _cache_file(gguf_file):
    return gguf_loader.cached_file(gguf_file, ".f32.safetensors")


@pytest.mark.parametrize("damage", ["nan", "flip_byte", "truncate", "no_hash"])
def test_damaged_weight_cache_is_rebuilt(gguf_file, damage):
    """The cache file holds a hash of its tensors: one NaN written into it, a flipped byte or
    a truncated file is rebuilt from the GGUF with a warning naming it, a file without the
    hash (an older format) quietly; the weights served are the GGUF's."""
    want = gguf_loader.dequantised_tensors(gguf_file)
    cached = _cache_file(gguf_file)
    with safe_open(str(cached), "numpy") as f:
        assert len(f.metadata()["sha256"]) == 64
    if damage in ("nan", "no_hash"):
        tensors = {k: v.copy() for k, v in want.items()}
        meta = {"sha256": gguf_loader.tensors_digest(want)} if damage == "nan" else None
        if damage == "nan":
            tensors["blk.0.attn_q.weight"][3, 5] = np.nan
        save_file(tensors, str(cached), metadata=meta)
    else:
        data = bytearray(cached.read_bytes())
        if damage == "flip_byte":
            data[len(data) // 2] ^= 0x40
        else:
            data = data[: len(data) // 2]
        cached.write_bytes(bytes(data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = gguf_loader.dequantised_tensors(gguf_file)
    messages = [str(w.message) for w in caught]
    if damage == "no_hash":
        assert not messages
    else:
        assert any(m.startswith(f"dequantised-weight cache {cached} is damaged") for m in messages), messages
    with safe_open(str(cached), "numpy") as f:  # rewritten with its hash
        assert f.metadata()["sha256"] == gguf_loader.tensors_digest(want)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
    again = gguf_loader.dequantised_tensors(gguf_file)  # the rebuilt cache file reads back
    np.testing.assert_array_equal(again["blk.0.attn_q.weight"], want["blk.0.attn_q.weight"])


def test_non_finite_gguf_weights_are_refused(gguf_file, monkeypatch):
    """A GGUF whose dequantised weights hold NaN is refused, naming the file and the tensor."""
    import gguf

    real = gguf.quants.dequantize

    def poisoned(data, kind):
        x = np.array(real(data, kind), np.float32)
        if x.shape == (256, 128):  # attn_q, ffn_gate and ffn_up; the first by name: blk.0.attn_q
            x[0, 0] = np.nan
        return x

    monkeypatch.setattr(gguf.quants, "dequantize", poisoned)
    with pytest.raises(ValueError, match=r"GGUF file .*tiny.gguf: tensor 'blk.0.attn_q.weight' holds non-finite"):
        gguf_loader.dequantised_tensors(gguf_file)
    assert not _cache_file(gguf_file).exists()
