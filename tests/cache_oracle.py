"""Independent model of what the mixed cache should hold, for the tests.

Tracks every appended token per sequence in numpy and answers, per position,
the value the cache must reproduce: bf16(k @ R) for sink and recent positions,
quantise-dequantise of that bf16 value for history positions.
"""

import dataclasses
import functools

import jax

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from oscar_jax import quant
from oscar_jax.config import CacheSpec


def signed_permutation(rng, heads, d):
    """Orthogonal [H, D, D] matrices whose products are exact in any precision."""
    out = np.zeros((heads, d, d), np.float32)
    for h in range(heads):
        out[h, np.arange(d), rng.permutation(d)] = rng.choice([-1.0, 1.0], d)
    return out


def random_kv(rng, b, t, h, d):
    """bf16-representable random [B, T, H, D] float32 data (never zeros)."""
    x = rng.standard_normal((b, t, h, d)) * rng.uniform(0.5, 3.0) + rng.uniform(-1, 1, (1, 1, h, d))
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


@dataclasses.dataclass
class SequenceOracle:
    spec: CacheSpec
    rot: np.ndarray  # [H, D, D]
    clip: float
    tokens: list = dataclasses.field(default_factory=list)  # per row: list of [H, D]

    def __post_init__(self):
        self.tokens = [[] for _ in range(self.spec.batch)]

    def write_prompt(self, x, lengths):  # x [B, T, H, D]
        self.tokens = [[x[b, t] for t in range(n)] for b, n in enumerate(lengths)]

    def append(self, x):  # x [B, C, H, D]
        for b in range(self.spec.batch):
            self.tokens[b].extend(x[b, t] for t in range(x.shape[1]))

    def expected(self, b):
        """float32 [H, n, D] the cache must hold for row b (rotated basis), and n."""
        s = self.spec
        n = len(self.tokens[b])
        if n == 0:
            return np.zeros((s.kv_heads, 0, s.head_dim), np.float32), 0
        x = np.stack(self.tokens[b], axis=1)  # [H, n, D]
        rot = np.einsum("hnd,hde->hne", x, self.rot).astype(ml_dtypes.bfloat16).astype(np.float32)
        hist = (np.arange(n) >= s.sink) & (np.arange(n) < n - s.window)
        if hist.any():  # quantise a fixed-size padded block: one compilation per spec
            padded = np.zeros((s.kv_heads, s.max_len, s.head_dim), np.float32)
            padded[:, :n] = rot
            deq = np.asarray(_quant_dequant(jnp.asarray(padded, jnp.bfloat16), s.quant, self.clip))
            rot[:, hist] = deq[:, :n][:, hist]
        return rot, n


@functools.partial(jax.jit, static_argnums=1)
def _quant_dequant(x, cfg, clip):
    return quant.dequantize(quant.quantize(x, cfg, clip), cfg)
