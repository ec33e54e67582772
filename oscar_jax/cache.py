"""The mixed-precision KV state (docs/ARCHITECTURE.md §3): its pytrees, their checks and
what can be read off them (positions, a dequantised view, bytes, bits per element); the
writes into them are `oscar_jax.updates`.

`OscarCache` holds one layer's mixed cache, what `append`, `write_prompt` and
`attend` take and what the models' KV state holds per layer (`init(spec,
stacked=False)`), or a layer-stacked one whose every array leaf carries a leading
`[L, ...]` (`init(spec)`, for layers run under `lax.scan`; `cache.layer(i)` or the
scan's slice is one layer's). Per sequence, positions [0, S0) are in the bf16 sink,
the last W positions in the bf16 recent ring (slot (p - S0) % W), and positions
[S0, n - W) in the quantised history (history index p - S0). All segments hold
ROTATED keys and values (k @ R_K, v @ R_V); rotation happens once, when a token enters.

`RingCache` is a sliding-window layer's cache (or a stack of them): a bf16 ring only.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from oscar_jax import quant
from oscar_jax.config import CacheSpec, RingSpec
from oscar_jax.config import bits_per_element as _bpe_formula
from oscar_jax.pallas_kernels import layout

STORE_DTYPE = jnp.bfloat16


def _static():
    return dataclasses.field(metadata={"static": True})


# Largest |dualᵀ·R - I| accepted, relative to |dual|ᵀ·|R| (dual = R for an orthogonal R):
# float32 rotations made in float64 (eigh + Hadamard) and rounded sit near 1e-7, float32 eigh
# near 1e-5; a scaled, random or zero matrix is off by O(1).
ORTHOGONALITY_TOLERANCE = 1e-3


def _concrete(*xs) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


def check_rotation(rot, dual, name: str = "rot", dual_name: str = "dual") -> None:
    """ValueError unless `rot` [.., D, D] is finite and, with `dual` None, orthogonal (RᵀR = I),
    or `dual` (same shape) is finite and R^{-T} (dualᵀ·R = I), within
    `ORTHOGONALITY_TOLERANCE` of |dual|ᵀ·|R| per entry. Skipped for traced arrays."""
    if not _concrete(rot, dual):
        return
    r = np.asarray(rot, np.float64)
    m = r if dual is None else np.asarray(dual, np.float64)
    for x, label in ((r, name), (m, dual_name)):
        if not np.isfinite(x).all():
            raise ValueError(f"{label} holds non-finite (NaN or inf) values")
    product = np.einsum("...ki,...kj->...ij", m, r)
    scale = np.einsum("...ki,...kj->...ij", np.abs(m), np.abs(r))
    err = np.abs(product - np.eye(r.shape[-1]))
    if np.all(err <= ORTHOGONALITY_TOLERANCE * scale + 1e-12):
        return
    worst = float(err.max())
    if dual is None:
        raise ValueError(f"{name} is not orthogonal (max |RᵀR - I| = {worst:.3g}) and comes without "
                         f"{dual_name}: a non-orthogonal rotation needs its dual R^-T")
    raise ValueError(f"{dual_name} is not the inverse transpose of {name} (max |{dual_name}ᵀ·{name} - I| = "
                     f"{worst:.3g})")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerParams:
    """Per-layer OSCAR parameters ([L, ...] when stacked).

    rot_k, rot_v: float32 [Hkv, D, D] (one rotation per KV head; a per-layer
      rotation is broadcast over heads). clip_k, clip_v: float32 [] ratios.
    v_folded: R_V^T is folded into the model's output projection, so attention
      returns outputs in the rotated basis.
    dual_k, dual_v: None for orthogonal rotations, else float32 [Hkv, D, D] =
      rot^{-T} (error-shaping calibrations): queries are rotated by the dual of
      R_K (q·R_K^{-T} · k·R_K = q·k) and outputs return by o = o_rot · dual_vᵀ.
    query_rot_parts, output_rot_parts: bf16 [Hkv, 2, D, D], `query_rot` and `output_rot`
      as hi + lo parts (`layout.split_bf16`), made once by `create` for the GPU decode
      kernels' bf16 MMAs (which would otherwise split them on every call).
    query_rot_stats: f32 [Hkv, 2, D], `query_rot`'s row sums and column norms
      (`layout.rotation_stats`), made once by `create` for the GPU decode's query layouts.
    """

    rot_k: jax.Array
    rot_v: jax.Array
    clip_k: jax.Array
    clip_v: jax.Array
    v_folded: bool = _static()
    dual_k: jax.Array | None = None
    dual_v: jax.Array | None = None
    k_shift: jax.Array | None = None
    query_rot_parts: jax.Array | None = None
    output_rot_parts: jax.Array | None = None
    query_rot_stats: jax.Array | None = None

    @property
    def query_rot(self) -> jax.Array:
        """[.., Hkv, D, D] applied to queries as rows: R_K, or R_K^{-T} when not orthogonal."""
        return self.rot_k if self.dual_k is None else self.dual_k

    @property
    def output_rot(self) -> jax.Array:
        """[.., Hkv, D, D] M with o = o_rot · Mᵀ: R_V, or R_V^{-T} when not orthogonal."""
        return self.rot_v if self.dual_v is None else self.dual_v

    @classmethod
    def create(cls, rot_k, rot_v, clip_k, clip_v, *, num_layers: int, kv_heads: int,
               v_folded: bool = False, dual_k=None, dual_v=None, k_shift=None) -> "LayerParams":
        """Broadcast rotations ([D, D], [Hkv, D, D] or [L, Hkv, D, D]), their optional
        duals (same shapes), clips and the optional key shift ([D], [Hkv, D] or
        [L, Hkv, D]) to a stack.

        Refuses (ValueError) non-finite values, clips outside (0, 1], a rotation without its
        dual that is not orthogonal, and a dual that is not its rotation's inverse transpose
        (`check_rotation`). Traced arguments (under jit) are checked for shape only."""

        def rot(r, name):
            r = jnp.asarray(r, jnp.float32)
            d = r.shape[-1]
            if r.ndim < 2 or r.shape[-2] != d or r.ndim > 4:
                raise ValueError(f"{name}.shape={r.shape}: expected [D, D], [Hkv, D, D] or [L, Hkv, D, D]")
            return jnp.broadcast_to(r, (num_layers, kv_heads, d, d))

        def clip(c, name):
            c = jnp.asarray(c, jnp.float32)
            if _concrete(c) and not np.all((np.asarray(c) > 0) & (np.asarray(c) <= 1)):
                raise ValueError(f"{name}={np.asarray(c).tolist()}: expected clip ratios in (0, 1]")
            return jnp.broadcast_to(c, (num_layers,))

        def shift(m):
            m = jnp.asarray(m, jnp.float32)
            d = jnp.shape(rot_k)[-1]
            if m.ndim < 1 or m.ndim > 3 or m.shape[-1] != d:
                raise ValueError(f"k_shift.shape={m.shape}: expected [D={d}], [Hkv, D] or [L, Hkv, D]")
            if _concrete(m) and not np.isfinite(np.asarray(m)).all():
                raise ValueError("k_shift holds non-finite (NaN or inf) values")
            return jnp.broadcast_to(m, (num_layers, kv_heads, d))

        rk, rv = rot(rot_k, "rot_k"), rot(rot_v, "rot_v")
        dk = None if dual_k is None else rot(dual_k, "dual_k")
        dv = None if dual_v is None else rot(dual_v, "dual_v")
        check_rotation(rk, dk, "rot_k", "dual_k")
        check_rotation(rv, dv, "rot_v", "dual_v")
        query_rot = rk if dk is None else dk
        return cls(rk, rv, clip(clip_k, "clip_k"), clip(clip_v, "clip_v"), v_folded, dk, dv,
                   None if k_shift is None else shift(k_shift),
                   layout.split_bf16(query_rot), layout.split_bf16(rv if dv is None else dv),
                   layout.rotation_stats(query_rot))

    def layer(self, i: int) -> "LayerParams":
        return jax.tree.map(lambda x: x[i], self)


def check_params(spec: CacheSpec, params: LayerParams, caller: str) -> None:
    """ValueError (naming `caller`) unless `params` is one layer's parameters for a cache of
    `spec`: rotations [Hkv, D, D], clips [], k_shift [Hkv, D]."""
    h, d = spec.kv_heads, spec.head_dim
    want = {"rot_k": (h, d, d), "rot_v": (h, d, d), "dual_k": (h, d, d), "dual_v": (h, d, d),
            "clip_k": (), "clip_v": (), "k_shift": (h, d)}
    for name, shape in want.items():
        x = getattr(params, name)
        if x is not None and tuple(x.shape) != shape:
            raise ValueError(f"{caller}: params.{name}.shape={tuple(x.shape)}: expected {list(shape)} for this "
                             f"cache (Hkv={h}, D={d}; stacked params: pass params.layer(i))")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OscarCache:
    """Layer-stacked mixed cache. Shapes for the stacked form (drop L per layer):

    sink_k, sink_v:          bf16  [L, B, Hkv, S0, D]
    hist_codes_k:            uint8 [L, B, Hkv, T_hist/tpb, D]   (layout.pack_codes)
    hist_codes_v:            uint8 [L, B, Hkv, D, T_hist/tpb]   (channel-major, layout.CHANNEL_MAJOR)
    hist_lo_k, hist_scale_k: meta  [L, B, Hkv, D/G, tpb, T_hist/tpb] (layout.pack_meta)
    recent_k, recent_v:      bf16  [L, B, Hkv, W, D]
    lengths:                 int32 [L, B]  tokens held per sequence (same in every layer)
    overflow:                bool  [L, B]  an append would have passed max_len (it was dropped), or
                                           write_prompt's prompt_lengths lay outside [0, min(T, max_len)]
                                           (the row was left empty)
    """

    sink_k: jax.Array
    sink_v: jax.Array
    hist_codes_k: jax.Array
    hist_codes_v: jax.Array
    hist_lo_k: jax.Array
    hist_scale_k: jax.Array
    hist_lo_v: jax.Array
    hist_scale_v: jax.Array
    recent_k: jax.Array
    recent_v: jax.Array
    lengths: jax.Array
    overflow: jax.Array
    spec: CacheSpec = _static()

    @classmethod
    def init(cls, spec: CacheSpec, *, stacked: bool = True) -> "OscarCache":
        """An empty cache (all lengths 0): layer-stacked, or one layer's (no L axis) when not
        `stacked` (then `spec.num_layers` is ignored)."""
        lb = ((spec.num_layers,) if stacked else ()) + (spec.batch, spec.kv_heads)
        tpb = spec.quant.tokens_per_byte
        rows = spec.hist_capacity // tpb
        bf = lambda n: jnp.zeros((*lb, n, spec.head_dim), STORE_DTYPE)
        meta = lambda: jnp.zeros((*lb, spec.num_groups, tpb, rows), spec.quant.jnp_scale_dtype)
        return cls(
            sink_k=bf(spec.sink), sink_v=bf(spec.sink),
            hist_codes_k=jnp.zeros((*lb, rows, spec.head_dim), jnp.uint8),
            hist_codes_v=jnp.zeros((*lb, spec.head_dim, rows), jnp.uint8),
            hist_lo_k=meta(), hist_scale_k=meta(), hist_lo_v=meta(), hist_scale_v=meta(),
            recent_k=bf(spec.window), recent_v=bf(spec.window),
            lengths=jnp.zeros(lb[:-1], jnp.int32), overflow=jnp.zeros(lb[:-1], bool),
            spec=spec,
        )

    @property
    def is_stacked(self) -> bool:
        return self.lengths.ndim == 2

    def layer(self, i: int) -> "OscarCache":
        return jax.tree.map(lambda x: x[i], self)

    def with_layer(self, i: int, layer_cache: "OscarCache") -> "OscarCache":
        return jax.tree.map(lambda s, x: s.at[i].set(x), self, layer_cache)

    def hist(self, which: str) -> quant.Quantized:
        """The packed history of 'k' or 'v' as a `Quantized` (packed layout; the V codes
        are channel-major, `layout.CHANNEL_MAJOR`)."""
        return quant.Quantized(
            codes=getattr(self, f"hist_codes_{which}"),
            lo=getattr(self, f"hist_lo_{which}"),
            scale=getattr(self, f"hist_scale_{which}"),
        )

    def dequantized_hist(self, which: str) -> jax.Array:
        """The history of 'k' or 'v' dequantised: float32 [.., B, Hkv, T_hist, D] (rotated basis)."""
        bits = self.spec.quant.bits
        unpacked = quant.unpack(self.hist(which), bits, channel_major=layout.CHANNEL_MAJOR[which])
        return quant.dequantize(unpacked, self.spec.quant)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RingCache:
    """Sliding-window layers' cache: k, v bf16 [L, B, Hkv, capacity, D] (no L for one
    layer's; position p in slot p % capacity, unrotated); lengths int32 [L, B]. Queries
    attend to the last `spec.window` positions; capacity - window + 1 bounds the extend
    chunk. A ring never overflows: positions are unbounded."""

    k: jax.Array
    v: jax.Array
    lengths: jax.Array
    spec: RingSpec = _static()

    @classmethod
    def init(cls, spec: RingSpec, *, stacked: bool = True) -> "RingCache":
        """An empty ring: layer-stacked, or one layer's (no L axis) when not `stacked`."""
        lb = ((spec.num_layers,) if stacked else ()) + (spec.batch,)
        shape = (*lb, spec.kv_heads, spec.capacity, spec.head_dim)
        return cls(jnp.zeros(shape, STORE_DTYPE), jnp.zeros(shape, STORE_DTYPE),
                   jnp.zeros(lb, jnp.int32), spec)

    def layer(self, i: int) -> "RingCache":
        return jax.tree.map(lambda x: x[i], self)


# ----------------------------------------------------------------------------
# Positions


def ring_positions(lengths: jax.Array, sink: int, window: int) -> jax.Array:
    """Position held by each recent-ring slot: int32 [B, W]; -1 where the slot is empty.

    Slot j holds the newest position p < n with (p - S0) % W == j and p >= max(S0, n - W).
    """
    n = lengths[:, None]
    j = jnp.arange(window)[None, :]
    p = n - 1 - jnp.mod(n - 1 - sink - j, window)
    return jnp.where((p >= sink) & (p >= n - window), p, -1)


def dense_view(cache: OscarCache) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Dequantised contents by position (rotated basis), for tests and the reference.

    Returns k, v: float32 [B, Hkv, P, D] with P = S0 + T_hist + W, and
    valid: bool [B, P] (position < length). Positions not held are arbitrary.
    """
    spec = cache.spec
    s0, w = spec.sink, spec.window

    def one(which):
        hist = cache.dequantized_hist(which)
        sink = getattr(cache, f"sink_{which}").astype(jnp.float32)
        dense = jnp.concatenate(
            [sink, hist, jnp.zeros(sink.shape[:2] + (w, spec.head_dim), jnp.float32)], axis=2)
        pos = ring_positions(cache.lengths, s0, w)  # [B, W]
        p_max = dense.shape[2]
        bidx = jnp.arange(spec.batch)[:, None]
        ring = jnp.moveaxis(getattr(cache, f"recent_{which}").astype(jnp.float32), 2, 1)
        return dense.at[bidx, :, jnp.where(pos >= 0, pos, p_max)].set(ring, mode="drop")

    p = s0 + spec.hist_capacity + w
    valid = jnp.arange(p)[None, :] < cache.lengths[:, None]
    return one("k"), one("v"), valid


def nbytes(cache) -> int:
    """Bytes allocated by the cache's arrays (all layers, full capacity)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))


def bits_per_element(cache: OscarCache) -> float:
    """Stored bits per K/V element at the current lengths (the formula of docs/method.md §3.3),
    averaged over the batch's held tokens; metadata and bf16 segments included."""
    lengths = np.asarray(cache.lengths).reshape(-1, cache.spec.batch)[0]
    held = [(int(n), _bpe_formula(cache.spec, int(n))) for n in lengths if n > 0]
    if not held:
        raise ValueError("bits_per_element: the cache holds no tokens")
    return sum(n * bpe for n, bpe in held) / sum(n for n, _ in held)


def ring_slot_positions(lengths: jax.Array, capacity: int) -> jax.Array:
    """Position held by each slot of a plain ring (slot p % capacity): int32 [B, capacity], -1 if empty."""
    n = lengths[:, None]
    j = jnp.arange(capacity)[None, :]
    p = n - 1 - jnp.mod(n - 1 - j, capacity)
    return jnp.where(p >= 0, p, -1)
