"""KV-cache policies: which cache each layer kind gets, and the per-layer
write/append/attend that the decoder calls.

A policy is a small frozen factory; what it builds is a `KVState` pytree whose
cache types carry all behaviour (dispatch is on the type), so jitted code
needs no policy object. Layer kinds: "full_attention" layers get the policy's
cache; "sliding_attention" layers (Gemma 3 local) get a bf16 `RingCache` of
their window under every quantised policy (DESIGN §1.3) and a dense cache
under the dense policies (so dense decoding equals a full forward exactly).

Policies and their stored formats (bits/element from the real format):
  bf16, fp32     `DenseCache`, 16 / 32 bits.
  fp8            `DenseCache` of float8_e4m3fn with a float32 scale per (sequence,
                 layer, KV head), vLLM's `kv_cache_dtype="fp8_e4m3"`: 8 bits + the scales.
  oscar          `OscarCache` INT2 + bf16 sink 64 / window 256, rotations and
                 clips from a calibration artifact (identity, 0.96/0.92 without one).
  quarot         `OscarCache` INT2, Hadamard rotations, clip 1, OSCAR's sink/window.
  int2/int4/int8 `OscarCache` per-token b-bit, identity rotation, no sink, the
                 bf16 window only as wide as one extend chunk (the append contract).
  kivi           `KiviCache`: KIVI-2 (keys per-channel over 32-token groups,
                 values per-token over 32-channel groups, 128-token fp residual).
                 We do not serve its packed format: values are stored
                 simulated-quantised (dequantised) and bits are counted from
                 the KIVI format.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from oscar_jax import attention, cache as oc, quant, rotation, sharding
from oscar_jax.config import CacheSpec, QuantConfig, RingSpec
from oscar_jax.config import bits_per_element as bpe_formula

FULL, SLIDING = "full_attention", "sliding_attention"
_HI = jax.lax.Precision.HIGHEST
FP8 = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# vLLM's `calculate_kv_scales` divisors (envs K_SCALE_CONSTANT, V_SCALE_CONSTANT): the
# prompt's amax lands at 200 (keys) / 100 (values) of 448, leaving headroom for later tokens.
FP8_AMAX_TO = {"k": 200.0, "v": 100.0}


def _static(default=dataclasses.MISSING):
    return dataclasses.field(default=default, metadata={"static": True})


# ----------------------------------------------------------------------------
# Cache types


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseCache:
    """Full-cache K/V: k, v [L, B, Hkv, T_max, D] (bf16, f32 or float8_e4m3fn), lengths int32 [L, B].

    float8 only: k_scale, v_scale float32 [L, B, Hkv]; the cache holds
    e4m3(clip(x / scale, ±448)) and attention reads stored * scale (`fp8_scale`
    says how the scale is set). `window` (sliding layers) limits what a query sees
    to its last `window` positions."""

    k: jax.Array
    v: jax.Array
    lengths: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    window: int | None = _static(None)

    @classmethod
    def init(cls, num_layers, batch, kv_heads, head_dim, max_len, dtype, window=None) -> "DenseCache":
        shape = (num_layers, batch, kv_heads, max_len, head_dim)
        scale = lambda: jnp.ones((num_layers, batch, kv_heads), jnp.float32) if dtype == FP8 else None
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((num_layers, batch), jnp.int32),
                   scale(), scale(), window)  # distinct buffers: the state is donated


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
    """KIVI-2, simulated: k, v f32 [L, B, Hkv, T_max, D] hold dequantised values for
    positions < quantised_length(n) and exact values after; lengths int32 [L, B]."""

    k: jax.Array
    v: jax.Array
    lengths: jax.Array
    cfg: KiviConfig = _static(KiviConfig())

    def quantised_length(self, n: jax.Array) -> jax.Array:
        """Positions [0, Q) are quantised: Q = floor((n - residual) / G_t) * G_t, >= 0."""
        g = self.cfg.group_tokens
        return jnp.maximum(n - self.cfg.residual, 0) // g * g


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OscarGroup:
    """An `OscarCache` with its `LayerParams` (both [L, ...] when stacked) and the
    `attend` implementation to run ("auto", "xla", "pallas", ...)."""

    cache: oc.OscarCache
    params: oc.LayerParams
    implementation: str = _static("auto")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVState:
    """The whole model's KV state. groups: {"full_attention": cache, "sliding_attention":
    cache} (absent kinds omitted), each layer-stacked over the layers of that kind in
    order; lengths int32 [B]: tokens held per sequence."""

    groups: dict[str, Any]
    lengths: jax.Array


# ----------------------------------------------------------------------------
# Per-layer views inside the decoder's scan


def layer_view(groups: dict[str, Any], kind: str, idx: jax.Array):
    """Layer `idx` (traced int) of the `kind` group."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, idx, keepdims=False), groups[kind])


def layer_update(groups: dict[str, Any], kind: str, idx: jax.Array, layer) -> dict[str, Any]:
    """`groups` with layer `idx` of the `kind` group replaced by `layer`."""
    new = jax.tree.map(lambda s, x: jax.lax.dynamic_update_index_in_dim(s, x.astype(s.dtype), idx, 0),
                       groups[kind], layer)
    return {**groups, kind: new}


def _to_cache_layout(x: jax.Array, t_max: int) -> jax.Array:
    """[B, T, H, D] -> [B, H, t_max, D] (cut or zero-padded)."""
    x = jnp.moveaxis(x, 1, 2)[:, :, :t_max]
    return jnp.pad(x, ((0, 0), (0, 0), (0, t_max - x.shape[2]), (0, 0)))


def _kivi_quantise_keys(k: jax.Array, cfg: KiviConfig) -> jax.Array:
    """k [B, H, T, D] (T a multiple of group_tokens) -> dequantised, per channel over token groups."""
    b, h, t, d = k.shape
    g = k.reshape(b, h, t // cfg.group_tokens, cfg.group_tokens, d)
    g = jnp.swapaxes(g, -1, -2)  # quantise along the token axis, per channel
    deq = _uniform_fake_quant(g, cfg.bits)
    return jnp.swapaxes(deq, -1, -2).reshape(b, h, t, d)


def _kivi_quantise_values(v: jax.Array, cfg: KiviConfig) -> jax.Array:
    """v [B, H, T, D] -> dequantised, per token over channel groups."""
    b, h, t, d = v.shape
    g = v.reshape(b, h, t, d // cfg.group_channels, cfg.group_channels)
    return _uniform_fake_quant(g, cfg.bits).reshape(b, h, t, d)


def _uniform_fake_quant(x: jax.Array, bits: int) -> jax.Array:
    """Asymmetric min/max quantise-dequantise over the last axis (bf16 scale and zero)."""
    q = quant.quantize(x, QuantConfig(bits=bits))
    return quant.dequantize(q, QuantConfig(bits=bits))


def _kivi_refresh(c: KiviCache, old_q: jax.Array) -> KiviCache:
    """Quantise the token groups that entered [old_q, Q(n)) since the last update.

    Each group is quantised once from its exact values; old_q int32 [B]."""
    cfg, t_max = c.cfg, c.k.shape[2]
    new_q = c.quantised_length(c.lengths)
    pos = jnp.arange(t_max)[None, None, :, None]
    fresh = (pos >= old_q[:, None, None, None]) & (pos < new_q[:, None, None, None])
    usable = t_max // cfg.group_tokens * cfg.group_tokens
    if usable == 0:
        return c
    deq_k = _kivi_quantise_keys(c.k[:, :, :usable].astype(jnp.float32), cfg)
    deq_v = _kivi_quantise_values(c.v[:, :, :usable].astype(jnp.float32), cfg)
    pad = lambda a: jnp.pad(a, ((0, 0), (0, 0), (0, t_max - usable), (0, 0)))
    return dataclasses.replace(c, k=jnp.where(fresh, pad(deq_k), c.k), v=jnp.where(fresh, pad(deq_v), c.v))


def fp8_scale(x: jax.Array, held: jax.Array, which: str) -> jax.Array:
    """The static fp8 scale of one sequence and KV head, set once from its prompt:
    amax(|x|) over the held tokens / FP8_AMAX_TO[which] (vLLM's `calculate_kv_scales`
    rule, per KV head instead of per tensor); 1.0 (vLLM's uncalibrated default) when
    the prompt is all zeros. x [B, H, T, D], held bool [B, 1, T, 1] -> float32 [B, H].
    Later tokens never change it; beyond ±448 * scale they saturate."""
    amax = jnp.max(jnp.where(held, jnp.abs(x.astype(jnp.float32)), 0.0), axis=(2, 3))
    return jnp.where(amax > 0, amax / FP8_AMAX_TO[which], 1.0)


def _store(x: jax.Array, dtype, scale: jax.Array | None) -> jax.Array:
    """x -> the cache's storage dtype; float8 stores clip(x / scale, ±448) (vLLM's saturating
    cast). scale broadcasts against x (None unless float8)."""
    if scale is None:
        return x.astype(dtype)
    return jnp.clip(x.astype(jnp.float32) / scale, -FP8_MAX, FP8_MAX).astype(dtype)


def _load(stored: jax.Array, scale: jax.Array | None) -> jax.Array:
    """Stored [B, H, T, D] -> float32 (times scale [B, H] for float8)."""
    x = stored.astype(jnp.float32)
    return x if scale is None else x * scale[:, :, None, None]


def _scales(layer) -> tuple[jax.Array | None, jax.Array | None]:
    return (layer.k_scale, layer.v_scale) if isinstance(layer, DenseCache) else (None, None)


def write_prompt(layer, k: jax.Array, v: jax.Array, lengths: jax.Array):
    """Bulk write of whole prompts into one layer. k, v [B, T, Hkv, D] post-RoPE; lengths [B]."""
    if isinstance(layer, OscarGroup):
        return dataclasses.replace(layer, cache=oc.write_prompt(layer.cache, k, v, lengths, layer.params))
    if isinstance(layer, oc.RingCache):
        return oc.ring_write_prompt(layer, k, v, lengths)
    t_max = layer.k.shape[2]
    k, v = _to_cache_layout(k, t_max), _to_cache_layout(v, t_max)  # [B, H, T_max, D]
    if _scales(layer)[0] is None:
        new = dataclasses.replace(layer, k=k.astype(layer.k.dtype), v=v.astype(layer.v.dtype), lengths=lengths)
    else:
        held = (jnp.arange(t_max) < lengths[:, None])[:, None, :, None]
        k_scale, v_scale = fp8_scale(k, held, "k"), fp8_scale(v, held, "v")
        new = dataclasses.replace(layer, k=_store(k, FP8, k_scale[:, :, None, None]),
                                  v=_store(v, FP8, v_scale[:, :, None, None]),
                                  k_scale=k_scale, v_scale=v_scale, lengths=lengths)
    if isinstance(layer, KiviCache):
        new = _kivi_refresh(new, jnp.zeros_like(lengths))
    return new


def _dense_append_attend(layer, q, k, v, softmax_scale, window):
    """Append k, v [B, C, Hkv, D] at positions lengths + c, then attend q [B, C, Hq, D]."""
    b, c, hq, d = q.shape
    hkv, t_max = layer.k.shape[1], layer.k.shape[2]
    n = layer.lengths
    pos = n[:, None] + jnp.arange(c)[None, :]  # [B, C]
    bidx = jnp.arange(b)[:, None]
    k_scale, v_scale = _scales(layer)

    def put(cache, x, scale):  # the scatter's value is [B, C, Hkv, D]
        x = _store(x, cache.dtype, None if scale is None else scale[:, None, :, None])
        return cache.at[bidx, :, pos].set(x, mode="drop")

    layer = dataclasses.replace(layer, k=put(layer.k, k, k_scale), v=put(layer.v, v, v_scale), lengths=n + c)
    if isinstance(layer, KiviCache):
        layer = _kivi_refresh(layer, layer.quantised_length(n))
    kp = jnp.arange(t_max)[None, None, :]
    mask = kp <= pos[..., None]  # [B, C, T]
    if window is not None:
        mask &= kp > pos[..., None] - window
    qg = q.astype(jnp.float32).reshape(b, c, hkv, hq // hkv, d)
    s = jnp.einsum("bchgd,bhsd->bhgcs", qg, _load(layer.k, k_scale), precision=_HI) * softmax_scale
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhgcs,bhsd->bchgd", p, _load(layer.v, v_scale), precision=_HI)
    return o.reshape(b, c, hq, d).astype(q.dtype), layer


def values_in_output_basis(layer, v: jax.Array) -> jax.Array:
    """v [B, T, Hkv, D] (model basis) in the basis the layer's attention outputs take: rotated
    by R_V (ṽ = v R_V, as the cache stores it) where the layer's `LayerParams.v_folded` leaves
    o = Σ p ṽ in the R_V basis (`decoder.fold_values`), else v itself. Full-precision attention
    over the returned values (prefill) then gives outputs in the layer's output basis."""
    if not (isinstance(layer, OscarGroup) and layer.params.v_folded):
        return v
    return jnp.einsum("bthd,hde->bthe", v.astype(jnp.float32), layer.params.rot_v,
                      precision=jax.lax.Precision.HIGHEST).astype(v.dtype)


def append_attend(layer, q: jax.Array, k: jax.Array, v: jax.Array, *, softmax_scale: float):
    """Append C new tokens to one layer, then attend their queries (DESIGN §1.3).

    q [B, C, Hq, D], k, v [B, C, Hkv, D] post-RoPE. Returns (o [B, C, Hq, D], layer).
    """
    if isinstance(layer, OscarGroup):
        cache = oc.append(layer.cache, k, v, layer.params)
        o, _ = attention.attend(q, cache, layer.params, implementation=layer.implementation,
                                softmax_scale=softmax_scale)
        return o, dataclasses.replace(layer, cache=cache)
    if isinstance(layer, oc.RingCache):
        ring = oc.ring_append(layer, k, v)
        o, _ = attention.attend_window(q, ring, softmax_scale=softmax_scale)
        return o, ring
    return _dense_append_attend(layer, q, k, v, softmax_scale, getattr(layer, "window", None))


# ----------------------------------------------------------------------------
# Policies


@dataclasses.dataclass(frozen=True)
class DensePolicy:
    """A full cache of dtype "bfloat16", "float32" or "float8_e4m3fn" (with per-head
    scales, see `fp8_scale`) for every layer; no sink, no window."""

    dtype: str = "bfloat16"

    @property
    def name(self) -> str:
        return {"bfloat16": "bf16", "float32": "fp32", "float8_e4m3fn": "fp8"}[self.dtype]

    def init(self, cfg, batch: int, max_len: int, chunk: int = 1) -> KVState:
        groups = {}
        for kind in (FULL, SLIDING):
            if cfg.count(kind):
                groups[kind] = DenseCache.init(
                    cfg.count(kind), batch, cfg.num_kv_heads, cfg.head_dim, max_len, jnp.dtype(self.dtype),
                    cfg.sliding_window if kind == SLIDING else None)
        return KVState(groups, jnp.zeros((batch,), jnp.int32))


@dataclasses.dataclass(frozen=True)
class KiviPolicy:
    """KIVI-2 baseline (simulated storage, see module docstring)."""

    cfg: KiviConfig = KiviConfig()
    name: str = "kivi"

    def init(self, model_cfg, batch: int, max_len: int, chunk: int = 1) -> KVState:
        if model_cfg.head_dim % self.cfg.group_channels:
            raise ValueError(f"KIVI group_channels={self.cfg.group_channels} must divide "
                             f"head_dim={model_cfg.head_dim}")
        groups = {}
        shape = (model_cfg.count(FULL), batch, model_cfg.num_kv_heads, max_len, model_cfg.head_dim)
        if model_cfg.count(FULL):
            groups[FULL] = KiviCache(jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32),
                                     jnp.zeros(shape[:2], jnp.int32), self.cfg)
        if model_cfg.count(SLIDING):
            groups[SLIDING] = _ring(model_cfg, batch, chunk)
        return KVState(groups, jnp.zeros((batch,), jnp.int32))


def _ring(cfg, batch: int, chunk: int) -> oc.RingCache:
    return oc.RingCache.init(RingSpec(cfg.count(SLIDING), batch, cfg.num_kv_heads, cfg.head_dim,
                                      cfg.sliding_window, cfg.sliding_window + chunk - 1))


@dataclasses.dataclass(frozen=True)
class QuantPolicy:
    """A configuration of the OSCAR cache (`OscarCache`) for the full-attention layers.

    rotation: "identity", "hadamard" or "artifact" (then `layer_params` holds the
    calibrated rotations and clips, [L_full, ...]). sink/window: bf16 segments;
    window=None means "one extend chunk wide" (the smallest the append contract allows).
    values_folded: the params say `v_folded` (attention returns outputs in the R_V basis),
    for a decoder whose output projections hold R_Vᵀ (`decoder.fold_values` makes the pair).
    """

    name: str
    quant: QuantConfig
    sink: int
    window: int | None
    rotation: str = "identity"
    clip_k: float = 1.0
    clip_v: float = 1.0
    layer_params: oc.LayerParams | None = dataclasses.field(default=None, compare=False)
    implementation: str = "auto"
    values_folded: bool = False

    def __post_init__(self):
        if self.rotation not in ("identity", "hadamard", "artifact"):
            raise ValueError(f"QuantPolicy.rotation={self.rotation!r}: expected identity, hadamard or artifact")
        if (self.rotation == "artifact") != (self.layer_params is not None):
            raise ValueError("QuantPolicy: rotation='artifact' needs layer_params, and only it")

    def params(self, cfg) -> oc.LayerParams:
        n, h, d = cfg.count(FULL), cfg.num_kv_heads, cfg.head_dim
        if self.layer_params is not None:
            if self.layer_params.rot_k.shape != (n, h, d, d):
                raise ValueError(f"layer_params.rot_k.shape={self.layer_params.rot_k.shape}: expected "
                                 f"[L_full={n}, Hkv={h}, D={d}, D={d}] for this model")
            return dataclasses.replace(self.layer_params, v_folded=self.values_folded)
        rot = rotation.identity(d) if self.rotation == "identity" else rotation.hadamard(d)
        return oc.LayerParams.create(rot, rot, self.clip_k, self.clip_v, num_layers=n, kv_heads=h,
                                     v_folded=self.values_folded)

    def init(self, cfg, batch: int, max_len: int, chunk: int = 1) -> KVState:
        window = self.window or chunk
        if chunk > window:
            raise ValueError(f"chunk={chunk} must be <= the {self.name} policy's window={window}")
        groups = {}
        if cfg.count(FULL):
            spec = CacheSpec(cfg.count(FULL), batch, cfg.num_kv_heads, cfg.head_dim,
                             max(max_len, self.sink + window), self.sink, window, self.quant)
            # A fresh copy: the state is donated by extend/decode, the policy's arrays must survive.
            params = jax.tree.map(jnp.copy, self.params(cfg))
            groups[FULL] = OscarGroup(oc.OscarCache.init(spec), params, self.implementation)
        if cfg.count(SLIDING):
            groups[SLIDING] = _ring(cfg, batch, chunk)
        return KVState(groups, jnp.zeros((batch,), jnp.int32))


def oscar_policy(layer_params: oc.LayerParams | None = None, *, quant: QuantConfig | None = None,
                 sink: int = 64, window: int = 256, implementation: str = "auto") -> QuantPolicy:
    """OSCAR INT2: calibrated rotations/clips when given, else identity with the reference
    clips. quant, sink, window: the quantiser and bf16 segments the calibration serves
    (default 2-bit, G = D, sink 64, window 256; `cli.load_calibration` reads them from
    the artifact)."""
    return QuantPolicy("oscar", quant or QuantConfig(bits=2), sink, window,
                       "identity" if layer_params is None else "artifact", 0.96, 0.92, layer_params,
                       implementation)


POLICIES = ("bf16", "fp32", "fp8", "oscar", "quarot", "kivi", "int2", "int4", "int8")


def make_policy(name: str, *, implementation: str = "auto"):
    """A policy by name (one of POLICIES); "oscar" here is uncalibrated (identity
    rotation, the reference clips): a calibrated one comes from `cli.load_calibration`."""
    if name == "bf16":
        return DensePolicy("bfloat16")
    if name == "fp32":
        return DensePolicy("float32")
    if name == "fp8":
        return DensePolicy("float8_e4m3fn")
    if name == "oscar":
        return oscar_policy(implementation=implementation)
    if name == "quarot":
        return QuantPolicy("quarot", QuantConfig(bits=2), 64, 256, "hadamard", implementation=implementation)
    if name == "kivi":
        return KiviPolicy()
    if name in ("int2", "int4", "int8"):
        return QuantPolicy(name, QuantConfig(bits=int(name[3:])), 0, None, implementation=implementation)
    raise ValueError(f"kv={name!r}: expected one of {POLICIES}")


# ----------------------------------------------------------------------------
# Reporting


def _group_bits(group, n: np.ndarray) -> tuple[float, float]:
    """(stored bits, held elements) per K (or V) channel for one layer group at lengths n [B]."""
    layers = jax.tree.leaves(group)[0].shape[0]
    if isinstance(group, OscarGroup):
        spec = group.cache.spec
        held = n.astype(np.float64)
        bits = sum(float(bpe_formula(spec, int(x))) * x for x in n if x > 0)
        return layers * bits, layers * held.sum()
    if isinstance(group, oc.RingCache):
        held = np.minimum(n, group.spec.window).astype(np.float64)
        return layers * 16 * held.sum(), layers * held.sum()
    if isinstance(group, KiviCache):
        cfg = group.cfg
        q = np.maximum(n - cfg.residual, 0) // cfg.group_tokens * cfg.group_tokens
        # Per quantised element: b code bits + (scale, zero) in 16 bits each per group.
        k_bits = cfg.bits + 32 / cfg.group_tokens
        v_bits = cfg.bits + 32 / cfg.group_channels
        bits = (q * (k_bits + v_bits) / 2 + (n - q) * 16).sum()
        return layers * float(bits), layers * float(n.sum())
    held = n.astype(np.float64) if group.window is None else np.minimum(n, group.window).astype(np.float64)
    bits = 8 * group.k.dtype.itemsize * held.sum()
    if group.k_scale is not None:  # one float32 scale per sequence and head, over its D channels
        bits += group.k_scale.dtype.itemsize * 8 / group.k.shape[-1] * np.count_nonzero(n)
    return layers * bits, layers * held.sum()


def bits_per_element(state: KVState) -> float:
    """Stored bits per K/V element over all layers at the current lengths, metadata
    and full-precision segments included (sliding layers count the window they hold)."""
    n = np.asarray(state.lengths)
    if not n.any():
        raise ValueError("bits_per_element: the KV state holds no tokens")
    totals = [_group_bits(g, n) for g in state.groups.values()]
    return sum(b for b, _ in totals) / sum(e for _, e in totals)


def capacity(state: KVState) -> int | None:
    """The most tokens a sequence of this state can hold (None: unbounded, rings only)."""
    caps = []
    for g in state.groups.values():
        if isinstance(g, OscarGroup):
            caps.append(g.cache.spec.max_len)
        elif not isinstance(g, oc.RingCache):
            caps.append(g.k.shape[3])
    return min(caps) if caps else None


def check_fits(state: KVState, new_lengths: np.ndarray) -> None:
    """Raise if any sequence would hold more than `capacity(state)` tokens."""
    cap = capacity(state)
    new_lengths = np.asarray(new_lengths)
    if cap is not None and new_lengths.max() > cap:
        raise ValueError(f"sequences would reach {new_lengths.tolist()} tokens; this KV state holds at "
                         f"most {cap} (raise max_len in init_state)")


def state_shardings(state: KVState, mesh: jax.sharding.Mesh, rules: dict[str, str] | None = None) -> KVState:
    """NamedSharding pytree for a KV state on `mesh`: batch -> "data", KV heads ->
    "model" (replicated where they do not divide), via `oscar_jax.sharding`'s rules;
    dense/KIVI caches [L, B, Hkv, T, D] (and fp8 scales [L, B, Hkv]) follow the same rules."""
    rules = sharding.DEFAULT_RULES if rules is None else rules

    def axis(name: str, size: int):
        m = rules.get(name)
        return m if m is not None and m in mesh.shape and size % mesh.shape[m] == 0 else None

    def named(spec):
        return jax.sharding.NamedSharding(mesh, spec)

    def group(g):
        if isinstance(g, OscarGroup):
            return dataclasses.replace(g, cache=sharding.shardings(g.cache, mesh, rules),
                                       params=sharding.shardings(g.params, mesh, rules))
        if isinstance(g, oc.RingCache):
            return sharding.shardings(g, mesh, rules)
        _, b, h, _, _ = g.k.shape
        kv = named(P(None, axis("batch", b), axis("kv_heads", h), None, None))
        scale = named(P(None, axis("batch", b), axis("kv_heads", h)))
        scales = {"k_scale": scale, "v_scale": scale} if _scales(g)[0] is not None else {}
        return dataclasses.replace(g, k=kv, v=kv, lengths=named(P(None, axis("batch", b))), **scales)

    b = state.lengths.shape[0]
    return KVState({kind: group(g) for kind, g in state.groups.items()}, named(P(axis("batch", b))))


def nbytes(state: KVState) -> int:
    """Bytes allocated by the KV caches (all layers, full capacity; rotations excluded)."""
    def group_bytes(g):
        g = g.cache if isinstance(g, OscarGroup) else g
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(g))
    return sum(group_bytes(g) for g in state.groups.values())
