"""Decoder configuration: one frozen dataclass for every supported family.

`ModelConfig.from_hf(config_dict)` reads a Hugging Face `config.json`
(llama, mistral, qwen2, qwen3, gemma3_text); `ModelConfig.from_gguf(reader)`
reads GGUF metadata (architectures `llama` and `gemma3`). Gemma 3 values
that GGUF does not record (local RoPE base, layer pattern, query scalar) take
the published Gemma 3 defaults, exactly as transformers' GGUF import does.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import numpy as np

Family = Literal["llama", "gemma3"]
LayerType = Literal["full_attention", "sliding_attention"]
Activation = Literal["silu", "gelu_tanh"]

HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")

# Gemma 3 defaults (transformers Gemma3TextConfig) for values GGUF does not store.
GEMMA3_ROPE_LOCAL_THETA = 10_000.0
GEMMA3_SLIDING_PATTERN = 6  # every 6th layer is global
GEMMA3_QUERY_PRE_ATTN_SCALAR = 256.0


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as in transformers: "linear" divides every inverse
    frequency by `factor`; "llama3" scales only long wavelengths (Llama 3.1)."""

    kind: Literal["linear", "llama3"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self):
        if self.kind not in ("linear", "llama3"):
            raise ValueError(f"RopeScaling.kind={self.kind!r}: expected 'linear' or 'llama3'")
        if not self.factor > 0:
            raise ValueError(f"RopeScaling.factor={self.factor!r}: expected > 0")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of one decoder.

    family: "llama" (Llama 2/3, SmolLM2, Mistral, Qwen2/3) or "gemma3".
    layer_types: per layer, "full_attention" or "sliding_attention" (the latter
      attends to the last `sliding_window` positions, itself included).
    rope_theta / rope_local_theta: RoPE bases of full / sliding layers.
    max_position: the context length the model was trained for (HF `max_position_embeddings`,
      GGUF `<arch>.context_length`; None: not recorded, no limit). It does not change what the
      model computes, so calibration fingerprints leave it out (`artifact.fingerprint`).
    norm weights are always stored as the effective multiplier (Gemma's 1 + w).
    """

    family: Family
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    layer_types: tuple[LayerType, ...]
    rope_local_theta: float | None = None
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None
    tie_embeddings: bool = True
    attention_bias: bool = False
    output_bias: bool = False
    qk_norm: bool = False
    activation: Activation = "silu"
    query_pre_attn_scalar: float | None = None
    embed_scale: bool = False
    post_norms: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hf_model_type: str = "llama"
    max_position: int | None = dataclasses.field(default=None, metadata={"fingerprint": False})

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"ModelConfig.{name}={v!r}: expected a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig.num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"ModelConfig.layer_types has {len(self.layer_types)} entries; "
                             f"expected num_layers={self.num_layers}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("ModelConfig.sliding_window must be set when a layer is sliding_attention")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim={self.head_dim}: RoPE needs an even head dim")
        if self.max_position is not None and (not isinstance(self.max_position, int) or self.max_position <= 0):
            raise ValueError(f"ModelConfig.max_position={self.max_position!r}: expected a positive int or None")

    def check_context(self, total: int, what: str = "prompt + new tokens") -> None:
        """Raise ValueError when `total` positions (prompt + new tokens) pass the model's
        context length `max_position` (None: no limit). what: the option(s) or arguments that
        set the total, named in the message."""
        if self.max_position is not None and total > self.max_position:
            raise ValueError(f"{what} = {total} tokens exceeds the model's context length of "
                             f"{self.max_position} positions")

    @property
    def softmax_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def layer_period(self) -> int:
        """Smallest p such that layer_types repeats with period p and p divides num_layers."""
        for p in range(1, self.num_layers + 1):
            if self.num_layers % p == 0 and self.layer_types == self.layer_types[:p] * (self.num_layers // p):
                return p
        return self.num_layers

    def count(self, kind: LayerType) -> int:
        return sum(t == kind for t in self.layer_types)

    def inv_freq(self, kind: LayerType) -> np.ndarray:
        """float64 [head_dim/2] RoPE inverse frequencies of a layer kind (scaling applied)."""
        theta = self.rope_local_theta if kind == "sliding_attention" and self.rope_local_theta else self.rope_theta
        inv = 1.0 / theta ** (np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim)
        s = self.rope_scaling
        if s is None or (kind == "sliding_attention" and self.family == "gemma3"):
            return inv
        if s.kind == "linear":
            return inv / s.factor
        low_wavelen = s.original_max_position / s.low_freq_factor
        high_wavelen = s.original_max_position / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled)

    # ------------------------------------------------------------------ readers

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Inverse of `to_dict` (e.g. after a JSON round trip)."""
        d = dict(d)
        d["layer_types"] = tuple(d["layer_types"])
        d["eos_token_ids"] = tuple(d["eos_token_ids"])
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        return cls(**d)

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> "ModelConfig":
        """From a Hugging Face config.json dict (a multimodal gemma3 uses its text_config)."""
        if c.get("model_type") == "gemma3" and "text_config" in c:
            c = {**c["text_config"], "model_type": "gemma3_text"}
        mt = c.get("model_type")
        if mt not in HF_MODEL_TYPES:
            raise ValueError(f"config.json model_type={mt!r}: expected one of {HF_MODEL_TYPES}")
        if c.get("mlp_bias"):
            raise ValueError("config.json mlp_bias=true is not supported")
        gemma = mt == "gemma3_text"
        n_layers = int(c["num_hidden_layers"])
        heads = int(c["num_attention_heads"])
        head_dim = int(c.get("head_dim") or c["hidden_size"] // heads)
        rope = _hf_rope(c)
        window = c.get("sliding_window")
        if gemma:
            pattern = int(c.get("sliding_window_pattern") or c.get("_sliding_window_pattern") or GEMMA3_SLIDING_PATTERN)
            layer_types = tuple(c.get("layer_types") or (
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers)))
        elif mt == "mistral" and window:
            layer_types = ("sliding_attention",) * n_layers
        elif c.get("use_sliding_window") and window:
            raise ValueError(f"config.json use_sliding_window=true ({mt}) is not supported")
        else:
            layer_types = ("full_attention",) * n_layers
        if "sliding_attention" not in layer_types:
            window = None
        eos = c.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            family="gemma3" if gemma else "llama",
            vocab_size=int(c["vocab_size"]),
            hidden_size=int(c["hidden_size"]),
            intermediate_size=int(c["intermediate_size"]),
            num_layers=n_layers,
            num_heads=heads,
            num_kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_eps=float(c.get("rms_norm_eps", 1e-6)),
            rope_theta=rope["theta"],
            rope_local_theta=rope["local_theta"],
            rope_scaling=rope["scaling"],
            layer_types=layer_types,
            sliding_window=int(window) if window else None,
            tie_embeddings=bool(c.get("tie_word_embeddings", gemma)),
            attention_bias=mt == "qwen2" or bool(c.get("attention_bias")),
            output_bias=mt != "qwen2" and bool(c.get("attention_bias")),
            qk_norm=mt in ("qwen3", "gemma3_text"),
            activation="gelu_tanh" if gemma else "silu",
            query_pre_attn_scalar=(float(c.get("query_pre_attn_scalar", GEMMA3_QUERY_PRE_ATTN_SCALAR))
                                   if gemma else None),
            embed_scale=gemma,
            post_norms=gemma,
            bos_token_id=c.get("bos_token_id"),
            eos_token_ids=eos,
            hf_model_type=mt,
            max_position=int(c["max_position_embeddings"]) if c.get("max_position_embeddings") else None,
        )

    @classmethod
    def from_gguf(cls, reader) -> "ModelConfig":
        """From a `gguf.GGUFReader`'s metadata (general.architecture llama or gemma3)."""
        meta = lambda key, default=None: (reader.fields[key].contents() if key in reader.fields else default)
        arch = meta("general.architecture")
        if arch not in ("llama", "gemma3"):
            raise ValueError(f"GGUF general.architecture={arch!r}: expected 'llama' or 'gemma3'")
        a = lambda key, default=None: meta(f"{arch}.{key}", default)
        n_layers = int(a("block_count"))
        heads = int(a("attention.head_count"))
        hidden = int(a("embedding_length"))
        head_dim = int(a("attention.key_length", hidden // heads))
        vocab = int(a("vocab_size", len(reader.fields["tokenizer.ggml.tokens"].data)))
        gemma = arch == "gemma3"
        window = a("attention.sliding_window")
        layer_types = tuple(
            "full_attention" if not gemma or (i + 1) % GEMMA3_SLIDING_PATTERN == 0 else "sliding_attention"
            for i in range(n_layers))
        scaling = None
        if a("rope.scaling.type") == "linear":
            scaling = RopeScaling("linear", float(a("rope.scaling.factor")))
        eos = meta("tokenizer.ggml.eos_token_id")
        return cls(
            family=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(a("feed_forward_length")),
            num_layers=n_layers,
            num_heads=heads,
            num_kv_heads=int(a("attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_eps=float(a("attention.layer_norm_rms_epsilon")),
            rope_theta=float(a("rope.freq_base", 10_000.0)),
            rope_local_theta=GEMMA3_ROPE_LOCAL_THETA if gemma else None,
            rope_scaling=scaling,
            layer_types=layer_types,
            sliding_window=int(window) if gemma and window else None,
            tie_embeddings="output.weight" not in {t.name for t in reader.tensors},
            attention_bias="blk.0.attn_q.bias" in {t.name for t in reader.tensors},
            qk_norm=gemma,
            activation="gelu_tanh" if gemma else "silu",
            query_pre_attn_scalar=GEMMA3_QUERY_PRE_ATTN_SCALAR if gemma else None,
            embed_scale=gemma,
            post_norms=gemma,
            bos_token_id=meta("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
            hf_model_type="gemma3_text" if gemma else "llama",
            max_position=int(a("context_length")) if a("context_length") else None,
        )

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict that `from_hf` (and transformers) read back to this config."""
        c: dict[str, Any] = {
            "architectures": ["Gemma3ForCausalLM" if self.family == "gemma3" else "LlamaForCausalLM"],
            "model_type": self.hf_model_type,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_eps, "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_embeddings, "attention_bias": self.attention_bias,
            "mlp_bias": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "torch_dtype": "float32",
        }
        if self.max_position is not None:
            c["max_position_embeddings"] = self.max_position
        if self.rope_scaling is not None:
            s = self.rope_scaling
            c["rope_scaling"] = {"rope_type": s.kind, "factor": s.factor}
            if s.kind == "llama3":
                c["rope_scaling"].update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                                         original_max_position_embeddings=s.original_max_position)
        if self.family == "gemma3":
            c.update(rope_local_base_freq=self.rope_local_theta, sliding_window=self.sliding_window,
                     layer_types=list(self.layer_types), query_pre_attn_scalar=self.query_pre_attn_scalar,
                     hidden_activation="gelu_pytorch_tanh")
        elif self.sliding_window:
            c["sliding_window"] = self.sliding_window
        return c


def _hf_rope(c: dict[str, Any]) -> dict[str, Any]:
    """RoPE bases and scaling from `rope_theta`/`rope_scaling` (transformers 4) or
    `rope_parameters` (transformers 5, per layer kind for Gemma 3)."""
    params = c.get("rope_parameters") or {}
    if "full_attention" in params:
        full, local = params["full_attention"], params.get("sliding_attention", {})
    else:
        full, local = params, {}
    theta = float(full.get("rope_theta", c.get("rope_theta", 10_000.0)))
    local_theta = local.get("rope_theta", c.get("rope_local_base_freq"))
    if c.get("model_type") == "gemma3_text" and local_theta is None:
        local_theta = GEMMA3_ROPE_LOCAL_THETA
    scaling_dict = c.get("rope_scaling") or (full if full.get("rope_type", "default") != "default" else None)
    scaling = None
    if scaling_dict:
        kind = scaling_dict.get("rope_type", scaling_dict.get("type"))
        if kind not in ("linear", "llama3", "default"):
            raise ValueError(f"config.json rope_scaling type {kind!r}: expected 'linear' or 'llama3'")
        if kind != "default":
            scaling = RopeScaling(
                kind, float(scaling_dict["factor"]),
                float(scaling_dict.get("low_freq_factor", 1.0)), float(scaling_dict.get("high_freq_factor", 4.0)),
                int(scaling_dict.get("original_max_position_embeddings", 8192)))
    return {"theta": theta, "local_theta": None if local_theta is None else float(local_theta), "scaling": scaling}
