"""Load a decoder from a Hugging Face checkpoint directory: `config.json` plus
`model.safetensors` or a sharded `model.safetensors.index.json`."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from oscar_jax.models.config import ModelConfig
from oscar_jax.models.decoder import Decoder
from oscar_jax.models.weights import build_decoder


def read_config(directory: str | Path) -> ModelConfig:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (an HF checkpoint directory needs config.json)")
    return ModelConfig.from_hf(json.loads(path.read_text()))


def tensor_files(directory: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (single file or sharded index)."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{directory} has neither model.safetensors nor model.safetensors.index.json")
    with safe_open(str(single), "numpy") as f:
        return {name: single for name in f.keys()}


def load_hf(directory: str | Path, *, dtype=jnp.float32,
            sharding: jax.sharding.Sharding | jax.sharding.Mesh | None = None) -> Decoder:
    """A `Decoder` from an HF safetensors checkpoint directory."""
    cfg = read_config(directory)
    files = tensor_files(directory)
    handles = {}

    def get(name: str) -> np.ndarray:
        file = files[name]  # KeyError names the missing tensor
        if file not in handles:
            handles[file] = safe_open(str(file), "numpy")
        return handles[file].get_tensor(name)

    return build_decoder(cfg, get, "hf", dtype=dtype, sharding=sharding)
