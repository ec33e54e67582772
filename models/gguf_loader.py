"""Load a decoder from a GGUF file (llama.cpp format) with the `gguf` package.

Every tensor is dequantised to float32 (the full-precision baseline of a 4-bit
GGUF). Dequantising Gemma 3's 262K-row embedding takes ~20 s on two CPU
cores, so the float32 tensors are cached as one safetensors file under
`cache_dir()` (keyed by the GGUF's name, size and mtime) and memory-mapped on
later loads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from oscar_jax.models.config import ModelConfig
from oscar_jax.models.decoder import Decoder
from oscar_jax.models.weights import build_decoder


def import_gguf():
    """The `gguf` package, imported on first use so that random-weight runs work on
    machines without it (the GPU image has no gguf)."""
    import gguf

    return gguf


def cache_dir() -> Path:
    """Where assembled/dequantised files live: $OSCAR_CACHE_DIR or ~/.cache/oscar-jax."""
    return Path(os.environ.get("OSCAR_CACHE_DIR") or Path.home() / ".cache" / "oscar-jax")


def cached_file(path: str | Path, suffix: str) -> Path:
    """A file derived from the GGUF at `path`, in `cache_dir()`, keyed by its name, size and mtime."""
    path = Path(path)
    st = path.stat()
    return cache_dir() / f"{path.stem}-{st.st_size}-{st.st_mtime_ns}{suffix}"


def write_atomic(target: Path, write) -> None:
    """write(tmp_path) then rename onto target, so concurrent readers never see a partial file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    write(tmp)
    tmp.replace(target)


def read_config(path: str | Path) -> ModelConfig:
    """The GGUF's `ModelConfig` (parsing GGUF metadata with its 262K-string vocab is
    slow, so the result is cached as JSON)."""
    cached = cached_file(path, ".config.json")
    if cached.exists():
        return ModelConfig.from_dict(json.loads(cached.read_text()))
    cfg = ModelConfig.from_gguf(import_gguf().GGUFReader(str(path)))
    write_atomic(cached, lambda tmp: tmp.write_text(json.dumps(cfg.to_dict())))
    return cfg


def dequantised_tensors(path: str | Path, *, use_cache: bool = True) -> dict[str, np.ndarray]:
    """All tensors of a GGUF as float32 numpy arrays in numpy order ([rows, cols] = [out, in])."""
    from safetensors.numpy import load_file, save_file

    cached = cached_file(path, ".f32.safetensors")
    if use_cache and cached.exists():
        return load_file(str(cached))
    gguf = import_gguf()
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
               for t in reader.tensors}
    if use_cache:
        write_atomic(cached, lambda tmp: save_file(tensors, str(tmp)))
    return tensors


def load_gguf(path: str | Path, *, dtype=jnp.float32, sharding: jax.sharding.Sharding | None = None,
              use_cache: bool = True) -> Decoder:
    """A `Decoder` with the GGUF's architecture (metadata) and dequantised weights."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    cfg = read_config(path)
    tensors = dequantised_tensors(path, use_cache=use_cache)
    return build_decoder(cfg, tensors.__getitem__, "gguf", dtype=dtype, sharding=sharding)
