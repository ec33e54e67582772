"""A tiny Llama GGUF with a byte-level tokenizer, written with `gguf.GGUFWriter`: a real
file for the loader, the dequantised-weight cache and the command line, in milliseconds."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from oscar_jax.models.config import ModelConfig
from oscar_jax.models.decoder import checkpoint_param_shapes
from oscar_jax.models.weights import checkpoint_name


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table (what byte-level BPE vocabularies hold)."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tiny_config(context_length: int = 512) -> ModelConfig:
    """2 layers, 4 query heads on 2 KV heads of dim 64 (the GPU kernels' smallest D);
    vocabulary: the 256 bytes, " t" (one merge), then BOS and EOS."""
    return ModelConfig(family="llama", vocab_size=259, hidden_size=128, intermediate_size=256, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=64, rms_eps=float(np.float32(1e-5)), rope_theta=10000.0,
                       layer_types=("full_attention",) * 2, tie_embeddings=True, bos_token_id=257,
                       eos_token_ids=(258,), max_position=context_length)


def write_tiny_gguf(path: str | Path, *, context_length: int = 512, seed: int = 0) -> Path:
    """Write a random-weight tiny Llama (`tiny_config`) with a byte-level BPE tokenizer (one
    token per byte but for " t") to `path`; float32 tensors."""
    import gguf

    cfg = tiny_config(context_length)
    rng = np.random.default_rng(seed)
    path = Path(path)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_layers)
    w.add_context_length(context_length)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(_byte_chars() + ["Ġt", "<s>", "</s>"])
    w.add_token_merges(["Ġ t"])
    w.add_token_types([1] * 257 + [3, 3])
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_ids[0])
    w.add_add_bos_token(True)
    w.add_tensor(checkpoint_name(cfg, "embed", "gguf"),
                 (0.5 * rng.standard_normal((cfg.vocab_size, cfg.hidden_size))).astype(np.float32))
    w.add_tensor(checkpoint_name(cfg, "final_norm", "gguf"), np.ones(cfg.hidden_size, np.float32))
    for param, shape in checkpoint_param_shapes(cfg).items():
        for i in range(cfg.num_layers):
            if param.endswith("norm"):
                x = np.ones(shape, np.float32)
            else:  # checkpoint layout [out, in]
                x = (rng.standard_normal(shape[::-1]) / np.sqrt(shape[0])).astype(np.float32)
            w.add_tensor(checkpoint_name(cfg, param, "gguf", i), x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
