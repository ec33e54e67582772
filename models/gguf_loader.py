"""Load a decoder from a GGUF file (llama.cpp format) with the `gguf` package.

Every tensor is dequantised to float32 (the full-precision baseline of a 4-bit
GGUF). Dequantising Gemma 3's 262K-row embedding takes ~20 s on two CPU
cores, so the float32 tensors are cached as one safetensors file under
`cache_dir()` (keyed by the GGUF's name, size and mtime) with a SHA-256 of its
tensors in the file's metadata: a cache file that cannot be read or does not
match its hash is rebuilt from the GGUF. Non-finite weights are refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
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


def open_gguf(path: str | Path):
    """A `gguf.GGUFReader` of `path`; ValueError naming the file when it cannot be parsed
    (truncated, or not a GGUF file)."""
    gguf = import_gguf()
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError, IndexError, ... on a damaged file
        raise ValueError(f"GGUF file {path} is truncated or corrupt ({type(e).__name__}: {e})") from None


# The cached config's format: bumped when ModelConfig gains a field read from the GGUF.
_CONFIG_CACHE = ".config-v2.json"


def read_config(path: str | Path) -> ModelConfig:
    """The GGUF's `ModelConfig` (parsing GGUF metadata with its 262K-string vocab is
    slow, so the result is cached as JSON)."""
    cached = cached_file(path, _CONFIG_CACHE)
    if cached.exists():
        try:
            return ModelConfig.from_dict(json.loads(cached.read_text()))
        except (ValueError, TypeError, KeyError):  # a damaged cache file: parse the GGUF again
            pass
    cfg = ModelConfig.from_gguf(open_gguf(path))
    write_atomic(cached, lambda tmp: tmp.write_text(json.dumps(cfg.to_dict())))
    return cfg


def tensors_digest(tensors: dict[str, np.ndarray]) -> str:
    """SHA-256 hex of named arrays (names, dtypes, shapes and bytes, in name order)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()


_NO_HASH = "no content hash"


def _read_cache(cached: Path) -> tuple[dict[str, np.ndarray] | None, str]:
    """(the cached tensors, "") when `cached` reads back and matches its stored hash, else
    (None, why not)."""
    from safetensors import safe_open

    try:
        with safe_open(str(cached), "numpy") as f:
            digest = (f.metadata() or {}).get("sha256")
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # safetensors raises SafetensorError, OSError, ... on a damaged file
        return None, f"unreadable: {type(e).__name__}: {e}"
    if digest is None:
        return None, _NO_HASH
    if tensors_digest(tensors) != digest:
        return None, "its tensors do not match the content hash stored with them"
    return tensors, ""


def check_finite(tensors: dict[str, np.ndarray], source: str | Path) -> None:
    """ValueError naming `source` and the first tensor holding NaN or inf."""
    for name in sorted(tensors):
        if not np.isfinite(tensors[name]).all():
            raise ValueError(f"{source}: tensor {name!r} holds non-finite (NaN or inf) weights")


def dequantised_tensors(path: str | Path, *, use_cache: bool = True) -> dict[str, np.ndarray]:
    """All tensors of a GGUF as float32 numpy arrays in numpy order ([rows, cols] = [out, in]).

    With `use_cache`, read from (or written to) the hashed cache file beside the other
    derived files; a damaged cache file is rebuilt with a warning that names it, one without
    the hash (written by an older oscar-jax) quietly."""
    from safetensors.numpy import save_file

    cached = cached_file(path, ".f32.safetensors")
    if use_cache and cached.exists():
        tensors, why = _read_cache(cached)
        if tensors is not None:
            return tensors
        if why != _NO_HASH:  # an older cache file without the hash is rebuilt quietly
            warnings.warn(f"dequantised-weight cache {cached} is damaged ({why}); rebuilding it from {path}",
                          stacklevel=2)
    gguf = import_gguf()
    reader = open_gguf(path)
    try:
        tensors = {t.name: np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
                   for t in reader.tensors}
    except Exception as e:
        raise ValueError(f"GGUF file {path} is truncated or corrupt: its tensors cannot be read "
                         f"({type(e).__name__}: {e})") from None
    check_finite(tensors, f"GGUF file {path}")
    if use_cache:
        metadata = {"sha256": tensors_digest(tensors)}
        write_atomic(cached, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
    return tensors


def load_gguf(path: str | Path, *, dtype=jnp.float32, sharding: jax.sharding.Sharding | jax.sharding.Mesh | None = None,
              use_cache: bool = True) -> Decoder:
    """A `Decoder` with the GGUF's architecture (metadata) and dequantised weights."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    cfg = read_config(path)
    tensors = dequantised_tensors(path, use_cache=use_cache)
    return build_decoder(cfg, tensors.__getitem__, "gguf", dtype=dtype, sharding=sharding)
