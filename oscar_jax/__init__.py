"""oscar-jax: a 2-bit KV cache (OSCAR) for JAX decoders, with Pallas kernels.

The library layer: configuration, quantiser, rotations, the KV-state pytree,
the reference attention and the dispatching `attend`. Models live in
`oscar_jax.models`, kernels in `oscar_jax.pallas_kernels`.
"""

from oscar_jax.attention import attend, attend_window
from oscar_jax.cache import LayerParams, OscarCache, RingCache, bits_per_element, dense_view, nbytes
from oscar_jax.config import CacheSpec, QuantConfig, RingSpec
from oscar_jax.quant import Quantized, dequantize, quantize
from oscar_jax.updates import append, ring_append, ring_write_prompt, write_prompt

__all__ = [
    "CacheSpec", "QuantConfig", "RingSpec", "Quantized", "quantize", "dequantize",
    "LayerParams", "OscarCache", "RingCache", "append", "write_prompt", "ring_append",
    "dense_view", "nbytes", "bits_per_element", "attend", "attend_window", "ring_write_prompt",
]
__version__ = "0.1.0"
