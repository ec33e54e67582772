"""KV-cache policies: which cache each layer gets, and the per-layer write/append/attend
that the decoder calls.

A policy is a small frozen factory; what it builds is a `KVState` pytree holding one
cache per decoder layer, whose types carry all behaviour (dispatch is on the type), so
jitted code needs no policy object. Every layer owns its buffers: a decode step appends
into each layer's arrays in place (the state is donated) and the kernels read them where
they lie, with no slice of a stacked cache copied out and written back.

Layer kinds: "full_attention" layers get the policy's cache; "sliding_attention" layers
(Gemma 3 local) get a bf16 `RingCache` of their window under every quantised policy
(docs/method.md, "Attention over the mixed cache") and a dense cache under the dense
policies (so dense decoding equals a full forward exactly).

Policies and their stored formats (bits/element from the real format):
  bf16, fp32     `DenseCache`, 16 / 32 bits.
  fp8            `DenseCache` of float8_e4m3fn with a float32 scale per (sequence,
                 layer, KV head), vLLM's `kv_cache_dtype="fp8_e4m3"`: 8 bits + the scales.
  oscar          `OscarCache` INT2 + bf16 sink 64 / window 256, rotations and
                 clips from a calibration artifact (identity, 0.96/0.92 without one).
  quarot         `OscarCache` INT2, Hadamard rotations, clip 1, OSCAR's sink/window.
  int2/int4/int8 `OscarCache` per-token b-bit, identity rotation, no sink, the
                 bf16 window only as wide as one extend chunk.
  kivi           `KiviCache`: KIVI-2 (keys per-channel over 32-token groups,
                 values per-token over 32-channel groups, 128-token fp residual).
                 Its packed format is not served: values are stored simulated-quantised
                 (dequantised) and bits are counted from the KIVI format.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from oscar_jax import attention, cache as oc, dispatch, paged, parallel, rotation, sharding, updates
from oscar_jax.config import CacheSpec, QuantConfig, RingSpec
from oscar_jax.config import bits_per_element as bpe_formula
from oscar_jax.models import dense_cache
from oscar_jax.models.dense_cache import DenseCache, KiviCache, KiviConfig

FULL, SLIDING = "full_attention", "sliding_attention"
FP8 = dense_cache.FP8


def _static(default=dataclasses.MISSING):
    return dataclasses.field(default=default, metadata={"static": True})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OscarLayer:
    """One layer's `OscarCache` with its `LayerParams` (both per layer, no L axis) and the
    `attend` implementation to run ("auto", "xla", "pallas", ...); its appends run XLA's code
    when that is "xla", else `updates.append`'s "auto". mesh: the device mesh the cache is
    sharded on (`init_on_mesh`); then each device appends and attends its own shard
    (`oscar_jax.parallel`)."""

    cache: oc.OscarCache
    params: oc.LayerParams
    implementation: str = _static("auto")
    mesh: jax.sharding.Mesh | None = _static(None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedLayer:
    """One layer's paged cache (`oscar_jax.paged.PagedCache`: sequence slots over a page pool)
    with its `LayerParams` and `attend` implementation, what the serving engine's full-attention
    layers hold (`oscar_jax.models.serving`)."""

    cache: paged.PagedCache
    params: oc.LayerParams
    implementation: str = _static("auto")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVState:
    """The whole model's KV state. layers: one cache per decoder layer, in layer order
    (`OscarLayer`, `RingCache`, `DenseCache` or `KiviCache`); lengths int32 [B]: tokens held
    per sequence."""

    layers: tuple[Any, ...]
    lengths: jax.Array

    def of_kind(self, cfg, kind: str) -> list[Any]:
        """The caches of the layers of `kind` ("full_attention" or "sliding_attention")."""
        return [layer for layer, k in zip(self.layers, cfg.layer_types) if k == kind]


# ----------------------------------------------------------------------------
# Per-layer write / append / attend (dispatch on the cache type)


def write_prompt(layer, k: jax.Array, v: jax.Array, lengths: jax.Array):
    """Bulk write of whole prompts into one layer. k, v [B, T, Hkv, D] post-RoPE; lengths [B]."""
    if isinstance(layer, OscarLayer) and layer.mesh is not None:
        return dataclasses.replace(layer, cache=parallel.write_prompt(layer.cache, k, v, lengths, layer.params,
                                                                      mesh=layer.mesh))
    if isinstance(layer, OscarLayer):
        return dataclasses.replace(layer, cache=updates.write_prompt(layer.cache, k, v, lengths, layer.params))
    if isinstance(layer, oc.RingCache):
        return updates.ring_write_prompt(layer, k, v, lengths)
    return dense_cache.write_prompt(layer, k, v, lengths)


def values_in_output_basis(layer, v: jax.Array) -> jax.Array:
    """v [B, T, Hkv, D] (model basis) in the basis the layer's attention outputs take: rotated
    by R_V (ṽ = v R_V, as the cache stores it) where the layer's `LayerParams.v_folded` leaves
    o = Σ p ṽ in the R_V basis (`decoder.fold_values`), else v itself. Full-precision attention
    over the returned values (prefill) then gives outputs in the layer's output basis."""
    if not (isinstance(layer, OscarLayer) and layer.params.v_folded):
        return v
    return jnp.einsum("bthd,hde->bthe", v.astype(jnp.float32), layer.params.rot_v,
                      precision=jax.lax.Precision.HIGHEST).astype(v.dtype)


def append_attend(layer, q: jax.Array, k: jax.Array, v: jax.Array, *, softmax_scale: float):
    """Append C new tokens to one layer, then attend their queries (docs/method.md,
    "Attention over the mixed cache"; OSCAR layers: `attention.append_attend`, any C, chunks
    longer than the window in XLA). q [B, C, Hq, D], k, v [B, C, Hkv, D] post-RoPE.
    Returns (o [B, C, Hq, D], layer)."""
    if isinstance(layer, OscarLayer) and layer.mesh is not None:
        o, cache = parallel.append_attend(layer.cache, layer.params, q, k, v, mesh=layer.mesh,
                                          implementation=layer.implementation, softmax_scale=softmax_scale)
        return o, dataclasses.replace(layer, cache=cache)
    if isinstance(layer, OscarLayer):
        o, _, cache = attention.append_attend(q, k, v, layer.cache, layer.params, implementation=layer.implementation,
                                              softmax_scale=softmax_scale)
        return o, dataclasses.replace(layer, cache=cache)
    if isinstance(layer, PagedLayer):
        o, _, cache = paged.append_attend(q, k, v, layer.cache, layer.params, implementation=layer.implementation,
                                          softmax_scale=softmax_scale)
        return o, dataclasses.replace(layer, cache=cache)
    if isinstance(layer, oc.RingCache):
        ring = updates.ring_append(layer, k, v)
        o, _ = attention.attend_window(q, ring, softmax_scale=softmax_scale)
        return o, ring
    return dense_cache.append_attend(layer, q, k, v, softmax_scale)


# ----------------------------------------------------------------------------
# Policies


def ring_layer(cfg, batch: int, chunk: int) -> oc.RingCache:
    """A sliding-window layer's ring for `batch` sequences and extend chunks of up to `chunk` tokens."""
    spec = RingSpec(1, batch, cfg.num_kv_heads, cfg.head_dim, cfg.sliding_window, cfg.sliding_window + chunk - 1)
    return oc.RingCache.init(spec, stacked=False)


@dataclasses.dataclass(frozen=True)
class DensePolicy:
    """A full cache of dtype "bfloat16", "float32" or "float8_e4m3fn" (with per-head
    scales, see `dense_cache.fp8_scale`) for every layer; no sink, no window."""

    dtype: str = "bfloat16"
    implementation: str = "auto"  # attention: "auto", "cudnn", "xla" or "pallas" (`dense_cache`)

    def __post_init__(self):
        if self.implementation not in dense_cache.IMPLEMENTATIONS:
            raise ValueError(f"DensePolicy.implementation={self.implementation!r}: expected one of "
                             f"{dense_cache.IMPLEMENTATIONS}")

    @property
    def name(self) -> str:
        return {"bfloat16": "bf16", "float32": "fp32", "float8_e4m3fn": "fp8"}[self.dtype]

    def init(self, cfg, batch: int, max_len: int, chunk: int = 1) -> KVState:
        window = lambda kind: cfg.sliding_window if kind == SLIDING else None
        layers = tuple(DenseCache.init(batch, cfg.num_kv_heads, cfg.head_dim, max_len, jnp.dtype(self.dtype),
                                       window(kind), self.implementation) for kind in cfg.layer_types)
        return KVState(layers, jnp.zeros((batch,), jnp.int32))


@dataclasses.dataclass(frozen=True)
class KiviPolicy:
    """KIVI-2 baseline (simulated storage, see the module docstring)."""

    cfg: KiviConfig = KiviConfig()
    name: str = "kivi"

    def init(self, model_cfg, batch: int, max_len: int, chunk: int = 1) -> KVState:
        if model_cfg.head_dim % self.cfg.group_channels:
            raise ValueError(f"KIVI group_channels={self.cfg.group_channels} must divide "
                             f"head_dim={model_cfg.head_dim}")
        make = lambda kind: (KiviCache.init(batch, model_cfg.num_kv_heads, model_cfg.head_dim, max_len, self.cfg)
                             if kind == FULL else ring_layer(model_cfg, batch, chunk))
        return KVState(tuple(make(kind) for kind in model_cfg.layer_types), jnp.zeros((batch,), jnp.int32))


@dataclasses.dataclass(frozen=True)
class QuantPolicy:
    """A configuration of the OSCAR cache (`OscarCache`) for the full-attention layers.

    rotation: "identity", "hadamard" or "artifact" (then `layer_params` holds the
    calibrated rotations and clips, [L_full, ...]). sink/window: bf16 segments;
    window=None means "one extend chunk wide" (the ring holds the last chunk and nothing older).
    values_folded: the params say `v_folded` (attention returns outputs in the R_V basis),
    for a decoder whose output projections hold R_Vᵀ (`decoder.fold_values` makes the pair).
    layer_quant: one `QuantConfig` per full-attention layer (a bit budget spent unevenly,
    `oscar_jax.budget`), else `quant` for every layer.
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
    layer_quant: tuple[QuantConfig, ...] | None = None

    def __post_init__(self):
        if self.layer_quant is not None and not all(isinstance(q, QuantConfig) for q in self.layer_quant):
            raise ValueError("QuantPolicy.layer_quant: expected a tuple of QuantConfig, one per full-attention layer")
        if self.rotation not in ("identity", "hadamard", "artifact"):
            raise ValueError(f"QuantPolicy.rotation={self.rotation!r}: expected identity, hadamard or artifact")
        if (self.rotation == "artifact") != (self.layer_params is not None):
            raise ValueError("QuantPolicy: rotation='artifact' needs layer_params, and only it")

    def params(self, cfg) -> oc.LayerParams:
        """The full-attention layers' stacked `LayerParams` [L_full, ...]."""
        n, h, d = cfg.count(FULL), cfg.num_kv_heads, cfg.head_dim
        if self.layer_params is not None:
            if self.layer_params.rot_k.shape != (n, h, d, d):
                raise ValueError(f"layer_params.rot_k.shape={self.layer_params.rot_k.shape}: expected "
                                 f"[L_full={n}, Hkv={h}, D={d}, D={d}] for this model")
            return dataclasses.replace(self.layer_params, v_folded=self.values_folded)
        rot = rotation.identity(d) if self.rotation == "identity" else rotation.hadamard(d)
        return oc.LayerParams.create(rot, rot, self.clip_k, self.clip_v, num_layers=n, kv_heads=h,
                                     v_folded=self.values_folded)

    def layer_quants(self, cfg) -> tuple[QuantConfig, ...]:
        """The quantiser of each full-attention layer."""
        n = cfg.count(FULL)
        if self.layer_quant is None:
            return (self.quant,) * n
        if len(self.layer_quant) != n:
            raise ValueError(f"QuantPolicy.layer_quant has {len(self.layer_quant)} entries: expected one per "
                             f"full-attention layer ({n})")
        return self.layer_quant

    def cache_spec(self, cfg, batch: int, max_len: int, chunk: int = 1, full_index: int = 0) -> CacheSpec:
        """The `CacheSpec` of full-attention layer `full_index`'s cache."""
        window = self.window or chunk
        return CacheSpec(1, batch, cfg.num_kv_heads, cfg.head_dim, max(max_len, self.sink + window),
                         self.sink, window, self.layer_quants(cfg)[full_index])

    def init(self, cfg, batch: int, max_len: int, chunk: int = 1) -> KVState:
        if not cfg.count(FULL):
            return KVState(tuple(ring_layer(cfg, batch, chunk) for _ in cfg.layer_types),
                           jnp.zeros((batch,), jnp.int32))
        params = self.params(cfg)
        full_index = iter(range(cfg.count(FULL)))
        layers = []
        for kind in cfg.layer_types:
            if kind == FULL:
                j = next(full_index)
                spec = self.cache_spec(cfg, batch, max_len, chunk, j)
                # Per-layer copies: the state is donated by extend/decode, the policy's arrays must survive.
                layer_params = jax.tree.map(jnp.copy, params.layer(j))
                layers.append(OscarLayer(oc.OscarCache.init(spec, stacked=False), layer_params, self.implementation))
            else:
                layers.append(ring_layer(cfg, batch, chunk))
        return KVState(tuple(layers), jnp.zeros((batch,), jnp.int32))


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
    rotation, the reference clips): a calibrated one comes from `cli.load_calibration`.
    implementation: the attention of the policy's caches ("auto" or "xla" for every one;
    `attention.attend`'s kernels for OSCAR caches, "cudnn" for dense ones)."""
    dense = {"bf16": "bfloat16", "fp32": "float32", "fp8": "float8_e4m3fn"}
    if name in dense:
        return DensePolicy(dense[name], implementation)
    if name == "oscar":
        return oscar_policy(implementation=implementation)
    if name == "quarot":
        return QuantPolicy("quarot", QuantConfig(bits=2), 64, 256, "hadamard", implementation=implementation)
    if name == "kivi":
        return KiviPolicy()
    if name in ("int2", "int4", "int8"):
        return QuantPolicy(name, QuantConfig(bits=int(name[3:])), 0, None, implementation=implementation)
    raise ValueError(f"kv={name!r}: expected one of {POLICIES}")


def with_implementation(policy, name: str | None):
    """`policy` attending through implementation `name` (`make_policy`'s; None: unchanged);
    ValueError naming the choices (KIVI has none)."""
    if name is None:
        return policy
    if isinstance(policy, QuantPolicy):
        names = ("auto", *dispatch.NAMES)
    else:
        names = dense_cache.IMPLEMENTATIONS if isinstance(policy, DensePolicy) else ()
    if name not in names:
        raise ValueError(f"implementation={name!r}: policy {policy.name!r} takes "
                         + (", ".join(names) or "no implementation choice"))
    return dataclasses.replace(policy, implementation=name)


# ----------------------------------------------------------------------------
# Reporting


def _layer_bits(layer, n: np.ndarray) -> tuple[float, float]:
    """(stored bits, held elements) per K (or V) channel of one layer at lengths n [B]."""
    if isinstance(layer, OscarLayer):
        bits = sum(float(bpe_formula(layer.cache.spec, int(x))) * x for x in n if x > 0)
        return bits, float(n.sum())
    if isinstance(layer, oc.RingCache):
        held = np.minimum(n, layer.spec.window).astype(np.float64)
        return 16 * held.sum(), held.sum()
    if isinstance(layer, KiviCache):
        cfg = layer.cfg
        q = np.maximum(n - cfg.residual, 0) // cfg.group_tokens * cfg.group_tokens
        # Per quantised element: b code bits + (scale, zero) in 16 bits each per group.
        k_bits = cfg.bits + 32 / cfg.group_tokens
        v_bits = cfg.bits + 32 / cfg.group_channels
        return float((q * (k_bits + v_bits) / 2 + (n - q) * 16).sum()), float(n.sum())
    held = (n if layer.window is None else np.minimum(n, layer.window)).astype(np.float64)
    bits = 8 * layer.k.dtype.itemsize * held.sum()
    if layer.k_scale is not None:  # one float32 scale per sequence and head, over its D channels
        bits += layer.k_scale.dtype.itemsize * 8 / layer.k.shape[-1] * np.count_nonzero(n)
    return bits, held.sum()


def bits_per_element(state: KVState) -> float:
    """Stored bits per K/V element over all layers at the current lengths, metadata
    and full-precision segments included (sliding layers count the window they hold)."""
    n = np.asarray(state.lengths)
    if not n.any():
        raise ValueError("bits_per_element: the KV state holds no tokens")
    totals = [_layer_bits(layer, n) for layer in state.layers]
    return sum(b for b, _ in totals) / sum(e for _, e in totals)


def held_bytes(state: KVState) -> float:
    """Bytes that the held tokens' K and V occupy over all layers and sequences (metadata and
    full-precision segments included): what one decode step must read."""
    n = np.asarray(state.lengths)

    def channels(layer) -> int:  # Hkv * D
        spec = layer.cache.spec if isinstance(layer, OscarLayer) else getattr(layer, "spec", None)
        return spec.kv_heads * spec.head_dim if spec is not None else layer.k.shape[-2] * layer.k.shape[-1]

    return float(sum(_layer_bits(layer, n)[0] * 2 * channels(layer) / 8 for layer in state.layers))


def capacity(state: KVState) -> int | None:
    """The most tokens a sequence of this state can hold (None: unbounded, rings only)."""
    caps = [layer.cache.spec.max_len if isinstance(layer, (OscarLayer, PagedLayer)) else layer.k.shape[1]
            for layer in state.layers if not isinstance(layer, oc.RingCache)]
    return min(caps) if caps else None


def check_fits(state: KVState, new_lengths: np.ndarray) -> None:
    """Raise if any sequence would hold more than `capacity(state)` tokens."""
    cap = capacity(state)
    new_lengths = np.asarray(new_lengths)
    if cap is not None and new_lengths.max() > cap:
        raise ValueError(f"sequences would reach {new_lengths.tolist()} tokens; this KV state holds at "
                         f"most {cap} (raise max_len in init_state)")


def state_shardings(state: KVState, mesh: jax.sharding.Mesh, rules: dict[str, str] | None = None) -> KVState:
    """NamedSharding pytree for a KV state on `mesh` through `oscar_jax.sharding`'s rules: batch
    -> "data", KV heads -> "model" (replicated where they do not divide; `init_on_mesh` makes a
    state whose repeated KV heads divide where it can), the OSCAR history's tokens -> "seq";
    dense/KIVI caches [B, T, Hkv, D] (and fp8 scales [B, Hkv]) split by batch and KV heads only."""
    axis = lambda name, size: sharding.mesh_axis(name, size, mesh, rules)

    def named(spec):
        return jax.sharding.NamedSharding(mesh, spec)

    def layer_shardings(layer):
        if isinstance(layer, (OscarLayer, PagedLayer)):
            return dataclasses.replace(layer, cache=sharding.shardings(layer.cache, mesh, rules),
                                       params=sharding.shardings(layer.params, mesh, rules))
        if isinstance(layer, oc.RingCache):
            return sharding.shardings(layer, mesh, rules)
        b, _, h, _ = layer.k.shape
        kv = named(sharding.spec(axis("batch", b), None, axis("kv_heads", h), None))
        scale = named(sharding.spec(axis("batch", b), axis("kv_heads", h)))
        scales = {"k_scale": scale, "v_scale": scale} if dense_cache._scales(layer)[0] is not None else {}
        return dataclasses.replace(layer, k=kv, v=kv, lengths=named(sharding.spec(axis("batch", b))), **scales)

    b = state.lengths.shape[0]
    return KVState(tuple(layer_shardings(layer) for layer in state.layers), named(sharding.spec(axis("batch", b))))


def seq_max_len(policy, cfg, batch: int, max_len: int, chunk: int, parts: int) -> int:
    """The smallest capacity >= max_len whose OSCAR histories (every full-attention layer's)
    split into `parts` equal slices along tokens (`parallel.seq_max_len`); max_len itself for
    other policies and parts == 1."""
    if parts == 1 or not isinstance(policy, QuantPolicy) or not cfg.count(FULL):
        return max_len
    while True:
        fitted = max(parallel.seq_max_len(policy.cache_spec(cfg, batch, max_len, chunk, j), parts)
                     for j in range(cfg.count(FULL)))
        if fitted == max_len:
            return max_len
        max_len = fitted


def on_mesh(policy, cfg, mesh: jax.sharding.Mesh):
    """(policy, cfg) as a KV state on `mesh` takes them: unchanged, or where the mesh repeats
    each KV head on r devices (`sharding.kv_head_copies`: a `model` axis M a multiple of Hkv
    dividing the query heads) cfg with M KV heads and an OSCAR policy's calibrated `LayerParams`
    with head j // r on head j (`sharding.repeat_kv_heads`), as `parallel.qkv_layout` lays out
    the model's q/k/v. Calibrations stay per original KV head; this happens on placement only."""
    copies = sharding.kv_head_copies(cfg.num_kv_heads, cfg.num_heads, mesh)
    if copies == 1:
        return policy, cfg
    if isinstance(policy, QuantPolicy) and policy.layer_params is not None:
        params = policy.params(cfg)  # checks the artifact's shapes against the model's KV heads
        policy = dataclasses.replace(policy, layer_params=sharding.repeat_kv_heads(params, copies))
    return policy, dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * copies)


def init_on_mesh(policy, cfg, batch: int, max_len: int, chunk: int, mesh: jax.sharding.Mesh) -> KVState:
    """`policy.init`'s state created in its shards on `mesh` (`state_shardings`; no device holds
    the whole state first), its OSCAR layers appending and attending per device. Where the mesh
    repeats each KV head on several devices the state holds the repeated heads (`on_mesh`), one
    a device. Under a `seq` axis the capacity is rounded up so that the histories split evenly
    (`seq_max_len`). On several devices a float8 dense cache's "auto" becomes "xla": the Triton
    float8 decode kernel has no partitioning rule, and GSPMD would gather its cache."""
    policy, cfg = on_mesh(policy, cfg, mesh)
    max_len = seq_max_len(policy, cfg, batch, max_len, chunk, mesh.shape.get(sharding.DEFAULT_RULES["seq"], 1))
    make = lambda: policy.init(cfg, batch, max_len, chunk)
    state = jax.jit(make, out_shardings=state_shardings(jax.eval_shape(make), mesh))()
    def placed(layer):
        if isinstance(layer, OscarLayer):
            return dataclasses.replace(layer, mesh=mesh)
        if isinstance(layer, DenseCache) and layer.k.dtype == dense_cache.FP8 and layer.implementation == "auto" \
                and mesh.size > 1:
            return dataclasses.replace(layer, implementation="xla")
        return layer
    return dataclasses.replace(state, layers=tuple(map(placed, state.layers)))


def nbytes(state: KVState) -> int:
    """Bytes allocated by the KV caches (all layers, full capacity; rotations excluded)."""
    def layer_bytes(layer):
        layer = layer.cache if isinstance(layer, (OscarLayer, PagedLayer)) else layer
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(layer))
    return sum(layer_bytes(layer) for layer in state.layers)
