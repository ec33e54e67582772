"""Frozen configuration for the quantiser and the mixed-precision KV cache.

Everything here is static (hashable) so it can live in a pytree's treedef and
in `jax.jit` static arguments. Invalid values fail at construction with a
message that names the field and the accepted range.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp

Codebook = Literal["uniform", "lloyd_max"]
ScaleDtype = Literal["bfloat16", "float32"]

# Gaussian Lloyd-Max levels for 4 levels, in units of `scale` from `lo`
# (docs/method.md §2.1): the span is mu +- LLOYD_MAX_SPAN * sigma (times the clip ratio).
LLOYD_MAX_LEVELS = (0.0, 1.05, 1.95, 3.0)
LLOYD_MAX_SPAN = 1.51
HIST_TILE = 256  # tokens: a history longer than this is allocated in whole tiles of it


def _is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """Per-token, per-group asymmetric quantiser (docs/method.md §2).

    bits: 2, 4 or 8 code bits per element.
    group_size: channels per (lo, scale) pair; None means one group per head
      (G = D). Must divide the head dim (checked by `CacheSpec`).
    codebook: "uniform" levels 0..L-1, or "lloyd_max" (2 bits only).
    scale_dtype: storage dtype of the per-group lo and scale.
    """

    bits: int = 2
    group_size: int | None = None
    codebook: Codebook = "uniform"
    scale_dtype: ScaleDtype = "bfloat16"

    def __post_init__(self):
        if self.bits not in (2, 4, 8):
            raise ValueError(f"QuantConfig.bits={self.bits!r}: expected 2, 4 or 8")
        if self.group_size is not None and not _is_power_of_two(self.group_size):
            raise ValueError(
                f"QuantConfig.group_size={self.group_size!r}: expected None or a power of two"
            )
        if self.codebook not in ("uniform", "lloyd_max"):
            raise ValueError(
                f"QuantConfig.codebook={self.codebook!r}: expected 'uniform' or 'lloyd_max'"
            )
        if self.codebook == "lloyd_max" and self.bits != 2:
            raise ValueError(
                f"QuantConfig.codebook='lloyd_max' needs bits=2, got bits={self.bits}"
            )
        if self.scale_dtype not in ("bfloat16", "float32"):
            raise ValueError(
                f"QuantConfig.scale_dtype={self.scale_dtype!r}: expected 'bfloat16' or 'float32'"
            )

    @property
    def num_levels(self) -> int:
        return 1 << self.bits

    @property
    def tokens_per_byte(self) -> int:
        """Codes are packed along tokens: 8 // bits tokens share one byte."""
        return 8 // self.bits

    @property
    def levels(self) -> tuple[float, ...]:
        """Reconstruction levels in units of scale: x_hat = lo + scale * level[code]."""
        if self.codebook == "lloyd_max":
            return LLOYD_MAX_LEVELS
        return tuple(float(i) for i in range(self.num_levels))

    @property
    def jnp_scale_dtype(self):
        return jnp.dtype(self.scale_dtype)

    def groups(self, head_dim: int) -> int:
        g = self.group_size or head_dim
        if head_dim % g:
            raise ValueError(f"group_size={g} must divide head_dim={head_dim}")
        return head_dim // g


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """Static shape of the mixed cache (docs/ARCHITECTURE.md §3): of `num_layers` layers
    stacked (`OscarCache.init(spec)`), or of one layer (`init(spec, stacked=False)`).

    Positions [0, sink) live in the bf16 sink, the last `window` positions in
    the bf16 recent ring, and everything between in the quantised history of
    `hist_capacity >= max_len - sink - window` tokens (whole `HIST_TILE`s when longer).
    """

    num_layers: int
    batch: int
    kv_heads: int
    head_dim: int
    max_len: int
    sink: int = 64
    window: int = 256
    quant: QuantConfig = QuantConfig()

    def __post_init__(self):
        for name in ("num_layers", "batch", "kv_heads", "head_dim", "max_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"CacheSpec.{name}={v!r}: expected a positive int")
        if not _is_power_of_two(self.head_dim):
            raise ValueError(f"CacheSpec.head_dim={self.head_dim}: expected a power of two")
        if self.sink < 0:
            raise ValueError(f"CacheSpec.sink={self.sink}: expected >= 0")
        if self.window < 1:
            raise ValueError(f"CacheSpec.window={self.window}: expected >= 1")
        self.quant.groups(self.head_dim)  # raises if G does not divide D
        if self.max_len < self.sink + self.window:
            raise ValueError(
                f"CacheSpec.max_len={self.max_len} must be >= sink + window = "
                f"{self.sink + self.window}"
            )

    @property
    def hist_capacity(self) -> int:
        """History tokens: max_len - sink - window, rounded up to whole tiles of HIST_TILE
        tokens when longer than one (64 packed rows of 2-bit codes, the unit the Mosaic GPU
        kernel moves with TMA; at most 255 tokens of slack per sequence), else to whole bytes
        of packed codes (the kernel pads such short histories itself)."""
        n = self.max_len - self.sink - self.window
        unit = HIST_TILE if n > HIST_TILE else self.quant.tokens_per_byte
        return -(-n // unit) * unit

    @property
    def num_groups(self) -> int:
        return self.quant.groups(self.head_dim)

    @property
    def group_size(self) -> int:
        return self.head_dim // self.num_groups


@dataclasses.dataclass(frozen=True)
class RingSpec:
    """Static shape of a sliding-window layer's cache (`num_layers` of them when stacked):
    a bf16 ring of `capacity` slots.

    Queries attend to the last `window` positions. With append-then-attend, an
    extend chunk of C tokens is exact while C <= capacity - window + 1, so
    `capacity` defaults to `window` (decode only) and may be raised for extend.
    """

    num_layers: int
    batch: int
    kv_heads: int
    head_dim: int
    window: int
    capacity: int | None = None

    def __post_init__(self):
        for name in ("num_layers", "batch", "kv_heads", "head_dim", "window"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"RingSpec.{name}={v!r}: expected a positive int")
        if self.capacity is None:
            object.__setattr__(self, "capacity", self.window)
        if self.capacity < self.window:
            raise ValueError(f"RingSpec.capacity={self.capacity} must be >= window={self.window}")

    @property
    def max_chunk(self) -> int:
        return self.capacity - self.window + 1


def bits_per_element(spec: CacheSpec, length: int) -> float:
    """Stored bits per K (or V) element for one sequence of `length` tokens.

    `bpe = (n_hist * (b + 2 * m / G) + n_bf16 * 16) / T` with n_hist the tokens in
    the quantised history, n_bf16 those in sink + recent, b the code bits, m the
    metadata bits (16 for bf16, 32 for f32) and G the group size. For D = G = 128,
    T = 131072, S0 = 64, W = 256, bf16 metadata this is 2.28.
    """
    if length <= 0:
        raise ValueError(f"length={length}: expected > 0")
    n_bf16 = min(length, spec.sink + spec.window)
    n_hist = length - n_bf16
    meta_bits = 16 if spec.quant.scale_dtype == "bfloat16" else 32
    per_hist = spec.quant.bits + 2 * meta_bits / spec.group_size
    return (n_hist * per_hist + n_bf16 * 16) / length
