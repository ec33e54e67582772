"""Full-precision and simulated-quantised baseline caches, one decoder layer each.

`DenseCache` holds every position of a layer in bf16, f32 or float8_e4m3fn (vLLM's
`kv_cache_dtype="fp8_e4m3"`: a float32 scale per sequence and KV head); `KiviCache`
simulates KIVI-2 (values stored dequantised, bits counted from the KIVI format).
Both store k, v as [B, T_max, Hkv, D] (the layout of `jax.nn.dot_product_attention`
and cuDNN), so decode attention reads the cache where it lies. Appends scatter the
new tokens in place; the decoder donates the state, so nothing else is copied.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from oscar_jax import quant
from oscar_jax.config import QuantConfig
from oscar_jax.pallas_kernels.gpu import dense_decode

FP8 = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# vLLM's `calculate_kv_scales` divisors (envs K_SCALE_CONSTANT, V_SCALE_CONSTANT): the
# prompt's amax lands at 200 (keys) / 100 (values) of 448, leaving headroom for later tokens.
FP8_AMAX_TO = {"k": 200.0, "v": 100.0}
_HI = jax.lax.Precision.HIGHEST
IMPLEMENTATIONS = ("auto", "cudnn", "xla", "pallas")


def _static(default=dataclasses.MISSING):
    return dataclasses.field(default=default, metadata={"static": True})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseCache:
    """One layer's K/V: k, v [B, T_max, Hkv, D] (bf16, f32 or float8_e4m3fn), lengths int32 [B].

    float8 only: k_scale, v_scale float32 [B, Hkv]; the cache holds e4m3(clip(x / scale,
    ±448)) and attention reads stored * scale (`fp8_scale` says how the scale is set).
    `window` (sliding layers) limits what a query sees to its last `window` positions.
    `implementation` of attention: "cudnn" (flash attention), "xla", "auto" (cuDNN where
    `cudnn_supported`, else XLA; decode over float8 on the Triton kernel where
    `fp8_kernel_applies`) or "pallas" (as "auto")."""

    k: jax.Array
    v: jax.Array
    lengths: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    window: int | None = _static(None)
    implementation: str = _static("auto")

    @classmethod
    def init(cls, batch, kv_heads, head_dim, max_len, dtype, window=None, implementation="auto") -> "DenseCache":
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation={implementation!r}: expected one of {IMPLEMENTATIONS}")
        shape = (batch, max_len, kv_heads, head_dim)
        scale = lambda: jnp.ones((batch, kv_heads), jnp.float32) if dtype == FP8 else None
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32),
                   scale(), scale(), window, implementation)  # distinct buffers: the state is donated


@dataclasses.dataclass(frozen=True)
class KiviConfig:
    """KIVI-2: `bits`-bit keys per channel over `group_tokens` tokens, values per
    token over `group_channels` channels, the newest >= `residual` tokens in full precision."""

    bits: int = 2
    group_tokens: int = 32
    group_channels: int = 32
    residual: int = 128


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KiviCache:
    """KIVI-2, simulated: k, v f32 [B, T_max, Hkv, D] hold dequantised values for positions
    < quantised_length(n) and exact values after; lengths int32 [B]."""

    k: jax.Array
    v: jax.Array
    lengths: jax.Array
    cfg: KiviConfig = _static(KiviConfig())

    @classmethod
    def init(cls, batch, kv_heads, head_dim, max_len, cfg: KiviConfig) -> "KiviCache":
        shape = (batch, max_len, kv_heads, head_dim)
        return cls(jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32),
                   jnp.zeros((batch,), jnp.int32), cfg)

    def quantised_length(self, n: jax.Array) -> jax.Array:
        """Positions [0, Q) are quantised: Q = floor((n - residual) / G_t) * G_t, >= 0."""
        g = self.cfg.group_tokens
        return jnp.maximum(n - self.cfg.residual, 0) // g * g


def _uniform_fake_quant(x: jax.Array, bits: int) -> jax.Array:
    """Asymmetric min/max quantise-dequantise over the last axis (bf16 scale and zero)."""
    return quant.dequantize(quant.quantize(x, QuantConfig(bits=bits)), QuantConfig(bits=bits))


def _kivi_quantise(k: jax.Array, v: jax.Array, cfg: KiviConfig) -> tuple[jax.Array, jax.Array]:
    """k, v [B, T, H, D] (T a multiple of group_tokens) -> dequantised: keys per channel over
    token groups, values per token over channel groups."""
    b, t, h, d = k.shape
    kg = k.reshape(b, t // cfg.group_tokens, cfg.group_tokens, h, d)
    kg = jnp.moveaxis(kg, 2, -1)  # [B, T/G, H, D, G]: quantise along the tokens, per channel
    deq_k = jnp.moveaxis(_uniform_fake_quant(kg, cfg.bits), -1, 2).reshape(b, t, h, d)
    vg = v.reshape(b, t, h, d // cfg.group_channels, cfg.group_channels)
    return deq_k, _uniform_fake_quant(vg, cfg.bits).reshape(b, t, h, d)


def _kivi_refresh(c: KiviCache, old_q: jax.Array) -> KiviCache:
    """Quantise the token groups that entered [old_q, Q(n)) since the last update; each
    group is quantised once, from its exact values. old_q int32 [B]."""
    cfg, t_max = c.cfg, c.k.shape[1]
    usable = t_max // cfg.group_tokens * cfg.group_tokens
    if usable == 0:
        return c
    new_q = c.quantised_length(c.lengths)
    pos = jnp.arange(t_max)[None, :, None, None]
    fresh = (pos >= old_q[:, None, None, None]) & (pos < new_q[:, None, None, None])
    deq_k, deq_v = _kivi_quantise(c.k[:, :usable], c.v[:, :usable], cfg)
    pad = lambda a: jnp.pad(a, ((0, 0), (0, t_max - usable), (0, 0), (0, 0)))
    return dataclasses.replace(c, k=jnp.where(fresh, pad(deq_k), c.k), v=jnp.where(fresh, pad(deq_v), c.v))


def fp8_scale(x: jax.Array, held: jax.Array, which: str) -> jax.Array:
    """The static fp8 scale of one sequence and KV head, set once from its prompt:
    amax(|x|) over the held tokens / FP8_AMAX_TO[which] (vLLM's `calculate_kv_scales`
    rule, per KV head instead of per tensor); 1.0 (vLLM's uncalibrated default) when
    the prompt is all zeros. x [B, T, H, D], held bool [B, T, 1, 1] -> float32 [B, H].
    Later tokens never change it; beyond ±448 * scale they saturate."""
    amax = jnp.max(jnp.where(held, jnp.abs(x.astype(jnp.float32)), 0.0), axis=(1, 3))
    return jnp.where(amax > 0, amax / FP8_AMAX_TO[which], 1.0)


def _store(x: jax.Array, dtype, scale: jax.Array | None) -> jax.Array:
    """x -> the cache's storage dtype; float8 stores clip(x / scale, ±448) (vLLM's saturating
    cast). scale broadcasts against x (None unless float8)."""
    if scale is None:
        return x.astype(dtype)
    return jnp.clip(x.astype(jnp.float32) / scale, -FP8_MAX, FP8_MAX).astype(dtype)


def _scales(layer) -> tuple[jax.Array | None, jax.Array | None]:
    return (layer.k_scale, layer.v_scale) if isinstance(layer, DenseCache) else (None, None)


def write_prompt(layer: DenseCache | KiviCache, k: jax.Array, v: jax.Array, lengths: jax.Array):
    """Bulk write of whole prompts (replaces the contents). k, v [B, T, Hkv, D] post-RoPE,
    T <= T_max; lengths int32 [B]. Positions past a row's length hold padding, never read."""
    t_max = layer.k.shape[1]
    k, v = k[:, :t_max], v[:, :t_max]
    put = lambda cache, x: jax.lax.dynamic_update_slice(cache, x, (0, 0, 0, 0))
    if _scales(layer)[0] is None:
        new = dataclasses.replace(layer, k=put(layer.k, k.astype(layer.k.dtype)),
                                  v=put(layer.v, v.astype(layer.v.dtype)), lengths=lengths)
    else:
        held = (jnp.arange(k.shape[1]) < lengths[:, None])[:, :, None, None]
        k_scale, v_scale = fp8_scale(k, held, "k"), fp8_scale(v, held, "v")
        new = dataclasses.replace(layer, k=put(layer.k, _store(k, FP8, k_scale[:, None, :, None])),
                                  v=put(layer.v, _store(v, FP8, v_scale[:, None, :, None])),
                                  k_scale=k_scale, v_scale=v_scale, lengths=lengths)
    if isinstance(layer, KiviCache):
        new = _kivi_refresh(new, jnp.zeros_like(lengths))
    return new


def cudnn_supported(layer, queries: int) -> bool:
    """Whether attention of `queries` queries over this cache can run on cuDNN's flash attention
    (GPU, head dim <= 256 and a multiple of 8, no sliding window; bf16 or fp16 storage, or
    float8 for a chunk of several queries, which reads the cache converted to bf16)."""
    d = layer.k.shape[-1]
    dtypes = (jnp.bfloat16, jnp.float16) + ((FP8,) if queries > 1 else ())
    return (jax.default_backend() == "gpu" and isinstance(layer, DenseCache) and layer.window is None
            and layer.k.dtype in dtypes and d <= 256 and d % 8 == 0)


def fp8_kernel_applies(layer, q_heads: int, queries: int, backend: str | None = None) -> bool:
    """Whether decode attention (one query) runs on the Triton float8 kernel
    (`pallas_kernels.gpu.dense_decode`): "auto" or "pallas" on an sm_89+ GPU, a float8 cache
    without a sliding window, shapes the kernel takes."""
    return ((backend or jax.default_backend()) == "gpu" and isinstance(layer, DenseCache) and queries == 1
            and layer.implementation in ("auto", "pallas") and layer.k.dtype == FP8 and layer.window is None
            and dense_decode.supports(layer.k.shape[-1], q_heads, layer.k.shape[2])
            and dense_decode.device_supported())


def _use_cudnn(layer, queries: int) -> bool:
    """Whether this call runs on cuDNN: "auto" where supported; "cudnn" must be supported."""
    impl = getattr(layer, "implementation", "auto")
    if impl == "cudnn" and not cudnn_supported(layer, queries):
        raise ValueError(f"implementation='cudnn' cannot run this call ({jax.default_backend()} backend, "
                         f"{layer.k.dtype} cache, C={queries}); use 'auto' or 'xla'")
    return impl != "xla" and cudnn_supported(layer, queries)


def append_attend(layer: DenseCache | KiviCache, q: jax.Array, k: jax.Array, v: jax.Array,
                  softmax_scale: float) -> tuple[jax.Array, DenseCache | KiviCache]:
    """Append k, v [B, C, Hkv, D] at positions lengths + c (in place), then attend
    q [B, C, Hq, D] (query c sees positions <= lengths + c). Returns (o [B, C, Hq, D], layer).
    Positions past T_max are dropped (the caller checks capacity)."""
    b, c, hq, d = q.shape
    t_max, hkv = layer.k.shape[1], layer.k.shape[2]
    n = layer.lengths
    pos = n[:, None] + jnp.arange(c)[None, :]  # [B, C]
    bidx = jnp.arange(b)[:, None]
    k_scale, v_scale = _scales(layer)

    def put(cache, x, scale):  # x [B, C, Hkv, D] -> rows (b, pos[b, c])
        x = _store(x, cache.dtype, None if scale is None else scale[:, None, :, None])
        if cache.dtype != FP8:
            return cache.at[bidx, pos].set(x, mode="drop")
        # float8 scatters as its bits: backends without float8 scatters would convert the cache.
        bits = lambda a, dtype: jax.lax.bitcast_convert_type(a, dtype)
        return bits(bits(cache, jnp.uint8).at[bidx, pos].set(bits(x, jnp.uint8), mode="drop"), FP8)

    layer = dataclasses.replace(layer, k=put(layer.k, k, k_scale), v=put(layer.v, v, v_scale), lengths=n + c)
    if isinstance(layer, KiviCache):
        layer = _kivi_refresh(layer, layer.quantised_length(n))
    if fp8_kernel_applies(layer, q.shape[2], c):
        o = dense_decode.fp8_decode(q[:, 0], layer.k, layer.v, k_scale, v_scale, jnp.minimum(n + c, t_max),
                                    softmax_scale=softmax_scale)
        return o[:, None].astype(q.dtype), layer
    kp = jnp.arange(t_max)[None, None, :]
    mask = kp <= pos[..., None]  # [B, C, T]
    if _use_cudnn(layer, c):  # a chunk's queries see the cache bottom-right causally: masked
        read = lambda stored, scale: stored if scale is None else \
            (stored.astype(jnp.float32) * scale[:, None, :, None]).astype(jnp.bfloat16)
        k_read, v_read = read(layer.k, k_scale), read(layer.v, v_scale)
        o = jax.nn.dot_product_attention(q.astype(k_read.dtype), k_read, v_read, mask=None if c == 1 else mask[:, None],
                                         scale=softmax_scale, key_value_seq_lengths=jnp.minimum(n + c, t_max),
                                         implementation="cudnn")
        return o.astype(q.dtype), layer
    window = getattr(layer, "window", None)
    if window is not None:
        mask &= kp > pos[..., None] - window
    # XLA, in float32: float8 values are exact in it, and their scales go on the scores and
    # the output. One query (decode) over a bf16 or f32 cache multiplies and reduces in one
    # fused pass over the cache as it lies (no transposed or converted copy of it); an extend
    # chunk's C queries use dot products at full precision. One query over a float8 cache uses
    # dot products at default precision: on a GPU the fused pass reads a float8 cache several
    # times slower, and TF32 holds its e4m3 values and bf16 queries exactly (it rounds f32
    # queries and the softmax weights to 11 significant bits, a TPU's bf16 pass to 8; e4m3 keeps 4).
    load = lambda stored: stored.astype(jnp.float32)
    qg = q.astype(jnp.float32).reshape(b, c, hkv, hq // hkv, d)
    dots = c > 1 or layer.k.dtype == FP8
    precision = jax.lax.Precision.DEFAULT if c == 1 else _HI
    if dots:
        s = jnp.einsum("bchgd,bthd->bchgt", qg, load(layer.k), precision=precision)
    else:
        s = jnp.moveaxis(jnp.sum(qg * load(layer.k)[:, :, :, None], axis=-1), 1, -1)[:, None]  # [B, 1, Hkv, g, T]
    s = s * softmax_scale
    if k_scale is not None:
        s = s * k_scale[:, None, :, None, None]
    s = jnp.where(mask[:, :, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    if dots:
        o = jnp.einsum("bchgt,bthd->bchgd", p, load(layer.v), precision=precision)
    else:
        o = jnp.sum(jnp.moveaxis(p[:, 0], -1, 1)[..., None] * load(layer.v)[:, :, :, None], axis=1)[:, None]
    if v_scale is not None:
        o = o * v_scale[:, None, :, None, None]
    return o.reshape(b, c, hq, d).astype(q.dtype), layer
