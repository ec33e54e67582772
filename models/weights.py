"""Checkpoint names <-> `Decoder` parameters: one explicit table for both formats.

Checkpoint tensors use PyTorch's Linear layout [out, in]; the decoder stores [in, out],
with the q/k/v and gate/up tensors of a layer joined (`decoder.FUSED`). Norms: the decoder
stores the effective multiplier, which is the GGUF value for every family and HF's `1 + w`
for Gemma 3. llama.cpp stores the Q/K rows of Llama-family models in an interleaved RoPE
order, undone here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from oscar_jax.models import parallel
from oscar_jax.models.config import ModelConfig
from oscar_jax.models.decoder import FUSED, Decoder, abstract_decoder, checkpoint_param_shapes, fuse, unfuse

# decoder parameter -> (HF name, GGUF name); layer names take the layer index i.
GLOBAL_NAMES = {
    "embed": ("model.embed_tokens.weight", "token_embd.weight"),
    "final_norm": ("model.norm.weight", "output_norm.weight"),
    "lm_head": ("lm_head.weight", "output.weight"),
}
LAYER_NAMES = {
    "attn_norm": ("model.layers.{i}.input_layernorm.weight", "blk.{i}.attn_norm.weight"),
    "wq": ("model.layers.{i}.self_attn.q_proj.weight", "blk.{i}.attn_q.weight"),
    "wk": ("model.layers.{i}.self_attn.k_proj.weight", "blk.{i}.attn_k.weight"),
    "wv": ("model.layers.{i}.self_attn.v_proj.weight", "blk.{i}.attn_v.weight"),
    "wo": ("model.layers.{i}.self_attn.o_proj.weight", "blk.{i}.attn_output.weight"),
    "bq": ("model.layers.{i}.self_attn.q_proj.bias", "blk.{i}.attn_q.bias"),
    "bk": ("model.layers.{i}.self_attn.k_proj.bias", "blk.{i}.attn_k.bias"),
    "bv": ("model.layers.{i}.self_attn.v_proj.bias", "blk.{i}.attn_v.bias"),
    "bo": ("model.layers.{i}.self_attn.o_proj.bias", "blk.{i}.attn_output.bias"),
    "q_norm": ("model.layers.{i}.self_attn.q_norm.weight", "blk.{i}.attn_q_norm.weight"),
    "k_norm": ("model.layers.{i}.self_attn.k_norm.weight", "blk.{i}.attn_k_norm.weight"),
    "mlp_norm": ("model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.ffn_norm.weight"),
    "post_attn_norm": ("model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.post_attention_norm.weight"),
    "post_mlp_norm": ("model.layers.{i}.post_feedforward_layernorm.weight", "blk.{i}.post_ffw_norm.weight"),
    "w_gate": ("model.layers.{i}.mlp.gate_proj.weight", "blk.{i}.ffn_gate.weight"),
    "w_up": ("model.layers.{i}.mlp.up_proj.weight", "blk.{i}.ffn_up.weight"),
    "w_down": ("model.layers.{i}.mlp.down_proj.weight", "blk.{i}.ffn_down.weight"),
}
# Gemma 3 has a norm before the MLP besides the one after attention.
GEMMA3_HF_MLP_NORM = "model.layers.{i}.pre_feedforward_layernorm.weight"


def checkpoint_name(cfg: ModelConfig, param: str, fmt: str, i: int | None = None) -> str:
    """The checkpoint tensor name of decoder parameter `param` (layer i) in fmt "hf" or "gguf"."""
    col = {"hf": 0, "gguf": 1}[fmt]
    if i is None:
        return GLOBAL_NAMES[param][col]
    if fmt == "hf" and cfg.family == "gemma3" and param == "mlp_norm":
        return GEMMA3_HF_MLP_NORM.format(i=i)
    return LAYER_NAMES[param][col].format(i=i)


def unpermute_llama_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row interleave: w [n_heads*D, ...] -> HF's rotate-half order."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _to_decoder(cfg: ModelConfig, param: str, fmt: str, x: np.ndarray) -> np.ndarray:
    """One checkpoint tensor -> the decoder's layout for `param`."""
    x = np.asarray(x, np.float32)
    if fmt == "gguf" and cfg.family == "llama" and param in ("wq", "wk", "bq", "bk"):
        x = unpermute_llama_rows(x, cfg.num_heads if param in ("wq", "bq") else cfg.num_kv_heads)
    if param.endswith("norm") and fmt == "hf" and cfg.family == "gemma3":
        x = x + np.float32(1.0)
    if param.startswith("w") or param == "lm_head":
        x = x.T
    return x


def _from_decoder(cfg: ModelConfig, param: str, x: np.ndarray) -> np.ndarray:
    """Inverse of `_to_decoder` for fmt "hf"."""
    x = np.asarray(x, np.float32)
    if param.startswith("w") or param == "lm_head":
        x = x.T
    if param.endswith("norm") and cfg.family == "gemma3":
        x = x - np.float32(1.0)
    return np.ascontiguousarray(x)


def build_decoder(cfg: ModelConfig, get: Callable[[str], np.ndarray], fmt: str, *,
                  dtype=jnp.float32, sharding: jax.sharding.Sharding | jax.sharding.Mesh | None = None) -> Decoder:
    """Build a `Decoder` from checkpoint tensors: `get(name)` returns the tensor (KeyError if absent).

    The abstract model (`nnx.eval_shape`) gives every parameter's shape; each is
    filled from the table above, cast to `dtype` and placed with `sharding`: one Sharding for
    every array, or a Mesh (each tensor sent slice by slice into its tensor-parallel shards,
    `parallel.place`; no device holds the whole model).
    """
    if isinstance(sharding, jax.sharding.Mesh):
        parallel.check_model(cfg, sharding)
    graphdef, state = nnx.split(abstract_decoder(cfg, dtype))
    pure = nnx.to_pure_dict(state)

    def fetch(name: str, shape: tuple[int, ...], param: str) -> np.ndarray:
        try:
            raw = get(name)
        except KeyError:
            raise KeyError(f"checkpoint has no tensor {name!r} (needed for {param}, {cfg.hf_model_type})") from None
        x = _to_decoder(cfg, param, fmt, raw)
        if x.shape != shape:
            raise ValueError(f"checkpoint tensor {name!r} has shape {raw.shape}; expected {shape} "
                             f"after conversion (decoder parameter {param})")
        return x

    def place(x: np.ndarray, param: str) -> jax.Array:
        if isinstance(sharding, jax.sharding.Mesh):
            return parallel.place(x, cfg, sharding, param, dtype)
        x = jnp.asarray(x, dtype)
        return x if sharding is None else jax.device_put(x, sharding)

    for param in GLOBAL_NAMES:
        if param in pure and pure[param] is not None:
            pure[param] = place(fetch(checkpoint_name(cfg, param, fmt), pure[param].shape, param), param)
    shapes = checkpoint_param_shapes(cfg)
    for i in range(cfg.num_layers):
        tensors = {param: fetch(checkpoint_name(cfg, param, fmt, i), shape, param) for param, shape in shapes.items()}
        for name, parts in FUSED.items():
            if parts[0] in tensors:
                tensors[name] = fuse(cfg, name, [tensors.pop(p) for p in parts])
        for param, x in tensors.items():
            pure["layers"][i][param] = place(x, param)
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def hf_tensors(model: Decoder) -> dict[str, np.ndarray]:
    """The decoder's weights as HF-named float32 tensors ([out, in] layout; a model laid out for
    a mesh that repeats its KV heads is saved with each KV head once)."""
    cfg = model.cfg
    out = {checkpoint_name(cfg, "embed", "hf"): _from_decoder(cfg, "embed", model.embed[...])}
    out[checkpoint_name(cfg, "final_norm", "hf")] = _from_decoder(cfg, "final_norm", model.final_norm[...])
    if model.lm_head is not None:
        out[checkpoint_name(cfg, "lm_head", "hf")] = _from_decoder(cfg, "lm_head", model.lm_head[...])
    for i, block in enumerate(model.layers):
        for param, value in block.arrays().items():
            value = np.asarray(value)
            if param in parallel.QKV:
                value = parallel.qkv_layout(cfg, value, cfg.num_kv_heads)
            for part, x in zip(FUSED.get(param, (param,)), unfuse(cfg, param, value) if param in FUSED else (value,)):
                out[checkpoint_name(cfg, part, "hf", i)] = _from_decoder(cfg, part, x)
    return out


def save_hf(model: Decoder, directory: str | Path) -> Path:
    """Write `config.json` + `model.safetensors` (float32) that `load_hf` reads back."""
    from safetensors.numpy import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model.cfg.to_hf(), indent=2))
    save_file(hf_tensors(model), str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory
