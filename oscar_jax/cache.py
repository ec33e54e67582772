"""The mixed-precision KV state (docs/ARCHITECTURE.md §3) and its pure update functions.

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
import functools

import jax
import jax.numpy as jnp
import numpy as np

from oscar_jax import dispatch, quant
from oscar_jax.config import LLOYD_MAX_SPAN, CacheSpec, RingSpec
from oscar_jax.config import bits_per_element as _bpe_formula
from oscar_jax.pallas_kernels import layout
from oscar_jax.pallas_kernels.gpu import quantize_pack, quantize_pack_mgpu
from oscar_jax.pallas_kernels.tpu import bulk_write

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


def _check_append(spec_max_len: int, lengths: jax.Array, c: int) -> jax.Array:
    """ok [B]: the append of c tokens fits; raise eagerly if lengths are concrete."""
    ok = lengths + c <= spec_max_len
    if not isinstance(lengths, jax.core.Tracer):
        bad = np.nonzero(~np.asarray(ok))[0]
        if bad.size:
            raise ValueError(
                f"append of C={c} tokens overflows max_len={spec_max_len} for batch rows "
                f"{bad.tolist()} (lengths={np.asarray(lengths)[bad].tolist()})"
            )
    return ok


def _rotate(x: jax.Array, rot: jax.Array) -> jax.Array:
    """x [B, T, Hkv, D] (model layout), rot [Hkv, D, D] -> rotated f32 [B, Hkv, T, D]."""
    return jnp.einsum("bthd,hde->bhte", x.astype(jnp.float32), rot,
                      precision=jax.lax.Precision.HIGHEST)


def shifted_keys(k: jax.Array, params: LayerParams) -> jax.Array:
    """k [B, T, Hkv, D] as the cache stores it: minus `params.k_shift` when set."""
    if params.k_shift is None:
        return k
    return k.astype(jnp.float32) - params.k_shift.astype(jnp.float32)


def _check_kv(name: str, x: jax.Array, b: int, h: int, d: int) -> None:
    if x.ndim != 4 or x.shape[0] != b or x.shape[2] != h or x.shape[3] != d:
        raise ValueError(f"{name}.shape={x.shape}: expected [B={b}, T, Hkv={h}, D={d}]")


# ----------------------------------------------------------------------------
# Writes into the quantised history


def _write_history(codes, lo, scale, new: quant.Quantized, start, count, bits: int,
                   channel_major: bool):
    """Write token i < count of `new` at history index start + i, where that is >= 0.

    One sequence: codes uint8 [H, R, D] (or [H, D, R] when channel_major); lo/scale
    [H, n_groups, tpb, R]; new is unpacked (codes [H, C, D], lo/scale [H, C, n_groups]);
    start (may be negative) and count are int32 scalars. Reads and rewrites a static
    window of byte rows (columns when channel_major), so tokens that share a byte with
    older ones are merged exactly.
    """
    tpb = 8 // bits
    row_axis = -1 if channel_major else -2
    rows = codes.shape[row_axis]
    c = new.codes.shape[-2]
    win = min(rows, c // tpb + 2)
    r0 = jnp.clip(jnp.maximum(start, 0) // tpb, 0, rows - win)
    old_codes = jax.lax.dynamic_slice_in_dim(codes, r0, win, axis=row_axis)
    old_lo = jax.lax.dynamic_slice_in_dim(lo, r0, win, axis=-1)
    old_scale = jax.lax.dynamic_slice_in_dim(scale, r0, win, axis=-1)
    t = r0 * tpb + jnp.arange(win * tpb)  # history index of each token in the window
    src = t - start
    take = (src >= 0) & (src < count)
    src = jnp.clip(src, 0, c - 1)

    def merge(old_tokens, new_tokens, axis):
        picked = jnp.take(new_tokens, src, axis=axis)
        shape = [1] * picked.ndim
        shape[axis] = -1
        return jnp.where(take.reshape(shape), picked, old_tokens)

    m_codes = merge(layout.unpack_codes(old_codes, bits, channel_major=channel_major), new.codes, -2)
    m_lo = merge(layout.unpack_meta(old_lo, bits), new.lo, -2)
    m_scale = merge(layout.unpack_meta(old_scale, bits), new.scale, -2)
    codes = jax.lax.dynamic_update_slice_in_dim(
        codes, layout.pack_codes(m_codes, bits, channel_major=channel_major), r0, axis=row_axis)
    lo = jax.lax.dynamic_update_slice_in_dim(lo, layout.pack_meta(m_lo, bits), r0, axis=-1)
    scale = jax.lax.dynamic_update_slice_in_dim(scale, layout.pack_meta(m_scale, bits), r0, axis=-1)
    return codes, lo, scale


def _write_history_token(codes, lo, scale, new: quant.Quantized, index, ok, bits: int, channel_major: bool):
    """Decode's history write: one token per sequence at history index `index` int32 [B] (skipped
    where negative or not `ok` [B]), as a read-modify-write of its byte row and one metadata
    element, so a step touches a handful of bytes and stays a few fused kernels.

    codes uint8 [B, H, R, D] ([B, H, D, R] when channel_major); lo/scale [B, H, G, tpb, R];
    new is unpacked: codes [B, H, 1, D], lo/scale [B, H, 1, G]."""
    tpb = 8 // bits
    rows = codes.shape[-1 if channel_major else -2]
    if rows == 0:  # a cache without history
        return codes, lo, scale
    bidx = jnp.arange(codes.shape[0])
    at = jnp.maximum(index, 0)
    row, slot = at // tpb, at % tpb
    row = jnp.where((index >= 0) & ok, row, rows)  # past the end: dropped
    shift = (bits * slot).astype(jnp.uint8)[:, None, None]
    mask = jnp.uint8((1 << bits) - 1)
    code = new.codes[:, :, 0, :].astype(jnp.uint8)  # [B, H, D]
    if channel_major:
        old = codes[bidx, :, :, jnp.minimum(row, rows - 1)]  # [B, H, D]
        merged = (old & ~(mask << shift)) | (code << shift)
        codes = codes.at[bidx, :, :, row].set(merged, mode="drop")
    else:
        old = codes[bidx, :, jnp.minimum(row, rows - 1)]  # [B, H, D]
        merged = (old & ~(mask << shift)) | (code << shift)
        codes = codes.at[bidx, :, row].set(merged, mode="drop")
    lo = lo.at[bidx, :, :, slot, row].set(new.lo[:, :, 0], mode="drop")
    scale = scale.at[bidx, :, :, slot, row].set(new.scale[:, :, 0], mode="drop")
    return codes, lo, scale


# ----------------------------------------------------------------------------
# Public updates (per-layer view)


def append(cache: OscarCache, k: jax.Array, v: jax.Array, params: LayerParams) -> OscarCache:
    """Append C new tokens to every sequence of one layer's cache.

    k, v: [B, C, Hkv, D] post-RoPE, unrotated, C <= W. The tokens are rotated on
    entry; the C oldest recent tokens that leave the ring are quantised into the
    history. A row whose lengths + C would pass max_len raises outside jit; inside
    jit it is left unchanged and its `overflow` flag is set.
    """
    spec = cache.spec
    if cache.is_stacked:
        raise ValueError("append takes a per-layer cache: use cache.layer(i) or lax.scan")
    b, h, d = spec.batch, spec.kv_heads, spec.head_dim
    _check_kv("k", k, b, h, d)
    _check_kv("v", v, b, h, d)
    check_params(spec, params, "append")
    c = k.shape[1]
    if v.shape != k.shape:
        raise ValueError(f"v.shape={v.shape} must equal k.shape={k.shape}")
    if c > spec.window:
        raise ValueError(f"chunk C={c} must be <= window W={spec.window}")
    k = shifted_keys(k, params)
    s0, w, bits = spec.sink, spec.window, spec.quant.bits
    n = cache.lengths
    ok = _check_append(spec.max_len, n, c)
    pos = n[:, None] + jnp.arange(c)[None, :]  # [B, C]

    def update(which, x, rot, clip):
        x_rot = _rotate(x, rot).astype(STORE_DTYPE)  # [B, H, C, D]
        sink = getattr(cache, f"sink_{which}")
        ring = getattr(cache, f"recent_{which}")
        bidx = jnp.arange(b)[:, None]
        # Tokens leaving the ring: slot of new position p held position p - W.
        slot = jnp.mod(pos - s0, w)
        evicted = ring[bidx, :, slot]  # [B, C, H, D]
        # The ring is read here and written in place below: tying the two makes the read come
        # first, so XLA updates the ring in place instead of copying it.
        ring, evicted = jax.lax.optimization_barrier((ring, evicted))
        evicted = jnp.moveaxis(evicted, 1, 2)  # [B, H, C, D]
        q = quant.quantize(evicted, spec.quant, clip)
        # New token i evicts history index n + i - W - S0 (kept where >= 0).
        start = n - w - s0
        hist = (getattr(cache, f"hist_codes_{which}"), getattr(cache, f"hist_lo_{which}"),
                getattr(cache, f"hist_scale_{which}"))
        if c == 1:
            codes, lo, scale = _write_history_token(*hist, q, start, ok, bits, layout.CHANNEL_MAJOR[which])
        else:
            write = functools.partial(_write_history, bits=bits, channel_major=layout.CHANNEL_MAJOR[which])
            codes, lo, scale = jax.vmap(write)(*hist, q, start, jnp.where(ok, c, 0))
        in_sink = (pos < s0) & ok[:, None]
        sink = sink.at[bidx, :, jnp.where(in_sink, pos, s0)].set(
            jnp.moveaxis(x_rot, 2, 1), mode="drop")
        in_ring = (pos >= s0) & ok[:, None]
        ring = ring.at[bidx, :, jnp.where(in_ring, slot, w)].set(
            jnp.moveaxis(x_rot, 2, 1), mode="drop")
        return {f"sink_{which}": sink, f"recent_{which}": ring, f"hist_codes_{which}": codes,
                f"hist_lo_{which}": lo, f"hist_scale_{which}": scale}

    updates = {**update("k", k, params.rot_k, params.clip_k),
               **update("v", v, params.rot_v, params.clip_v)}
    return dataclasses.replace(
        cache, **updates, lengths=jnp.where(ok, n + c, n), overflow=cache.overflow | ~ok)


def _gpu_bulk_write(kernel):
    """`write_prompt`'s write of a GPU bulk kernel module (`quantize_pack` or
    `quantize_pack_mgpu`): fn(x [B, T, H, D], rot, clip, spec, start, count, channel_major,
    interpret) -> the packed Quantized of tokens [start, start + count) (zeros past T;
    channel-major codes if asked)."""

    def write(x, rot, clip, spec: CacheSpec, start: int, count: int, channel_major: bool, interpret: bool):
        cfg = spec.quant
        span = LLOYD_MAX_SPAN if cfg.codebook == "lloyd_max" else None
        codes, lo, scale = kernel.quantize_pack(
            x.astype(STORE_DTYPE), rot, clip, bits=cfg.bits, levels=cfg.levels,
            group_size=spec.group_size, span=span, scale_dtype=cfg.jnp_scale_dtype,
            start=start, count=count, channel_major=channel_major, interpret=interpret)
        return quant.Quantized(codes=codes, lo=lo, scale=scale)

    return write


def _tpu_bulk_write(x, rot, clip, spec: CacheSpec, start: int, count: int, channel_major: bool,
                    interpret: bool) -> quant.Quantized:
    """`_gpu_bulk_write`'s contract with the TPU bulk kernel."""
    cfg = spec.quant
    xs = x[:, start:start + count]
    xs = jnp.pad(xs, ((0, 0), (0, count - xs.shape[1]), (0, 0), (0, 0)))
    codes, lo, scale = bulk_write.bulk_write(
        xs, rot, clip, bits=cfg.bits, group_size=cfg.group_size, levels=cfg.levels,
        codebook=cfg.codebook, lloyd_max_span=LLOYD_MAX_SPAN if cfg.codebook == "lloyd_max" else None,
        scale_dtype=cfg.scale_dtype, channel_major=channel_major, interpret=interpret)
    return quant.Quantized(codes=codes, lo=lo, scale=scale)


# write_prompt's implementations ("xla": its own XLA quantiser); "auto" takes the Mosaic GPU
# bulk write on Hopper where it applies, else the Triton one, on GPU (both much faster than XLA).
dispatch.register("write", "xla", None)
dispatch.register("write", "pallas", _gpu_bulk_write(quantize_pack),
                  lambda spec, queries, group: quantize_pack.supports(spec))
dispatch.register("write", "pallas_mosaic_gpu", _gpu_bulk_write(quantize_pack_mgpu),
                  lambda spec, queries, group: quantize_pack_mgpu.supports(spec))
dispatch.register("write", "pallas_tpu", _tpu_bulk_write)


def write_prompt(cache: OscarCache, k: jax.Array, v: jax.Array, prompt_lengths: jax.Array,
                 params: LayerParams, *, implementation: str = "auto", interpret: bool = False) -> OscarCache:
    """Bulk write of whole prompts into one layer's cache (replaces its contents).

    k, v: [B, T, Hkv, D] post-RoPE, unrotated; prompt_lengths: int32 [B] <= T.
    Row b ends up holding positions [0, prompt_lengths[b]): the sink, the quantised
    history [S0, n - W) and the recent ring. Rows whose prompt_lengths lie outside
    [0, min(T, max_len)] raise outside jit; inside jit they are emptied and flagged in
    `overflow`.
    implementation: `oscar_jax.dispatch`'s names: "xla", "pallas" / "pallas_mosaic_gpu" /
    "pallas_tpu" (the Triton / Mosaic GPU / TPU bulk rotate-quantise-pack kernel; only the
    sink and ring tokens are rotated in XLA) or "auto"; interpret: run an explicit kernel
    implementation in Pallas interpret mode (any backend; for tests).
    """
    spec = cache.spec
    impl = dispatch.resolve("write", implementation, spec, interpret=interpret)
    if cache.is_stacked:
        raise ValueError("write_prompt takes a per-layer cache: use cache.layer(i) or lax.scan")
    b, h, d = spec.batch, spec.kv_heads, spec.head_dim
    _check_kv("k", k, b, h, d)
    _check_kv("v", v, b, h, d)
    check_params(spec, params, "write_prompt")
    if v.shape != k.shape:
        raise ValueError(f"v.shape={v.shape} must equal k.shape={k.shape}")
    k = shifted_keys(k, params)
    t = k.shape[1]
    n = jnp.asarray(prompt_lengths, jnp.int32)
    if n.shape != (b,):
        raise ValueError(f"prompt_lengths.shape={n.shape}: expected [B={b}]")
    ok = (n >= 0) & (n <= min(t, spec.max_len))
    if not isinstance(n, jax.core.Tracer):
        bad = np.nonzero(~np.asarray(ok))[0]
        if bad.size:
            raise ValueError(f"write_prompt: prompt_lengths={np.asarray(n).tolist()} must lie in "
                             f"[0, min(T={t}, max_len={spec.max_len})] (batch rows {bad.tolist()})")
    n = jnp.where(ok, n, 0)
    s0, w, bits, tpb = spec.sink, spec.window, spec.quant.bits, spec.quant.tokens_per_byte
    n_hist = min(max(t - s0, 0), spec.hist_capacity)
    n_hist = -(-n_hist // tpb) * tpb
    ring_pos = ring_positions(n, s0, w)  # [B, W]

    def fit(x, start, size):  # x [B, H, T, D] -> [B, H, size, D], zero-padded past T
        x = x[:, :, start:start + size]
        return jnp.pad(x, ((0, 0), (0, 0), (0, size - x.shape[2]), (0, 0)))

    def update(which, x, rot, clip):
        if impl != "xla":  # rotate only the sink and ring tokens here; the kernel does the rest
            sink = fit(_rotate(x[:, :s0], rot), 0, s0).astype(STORE_DTYPE)
            ring = _rotate(jnp.take_along_axis(x, jnp.maximum(ring_pos, 0)[:, :, None, None], axis=1),
                           rot)
        else:
            x_rot = _rotate(x, rot)  # [B, H, T, D] f32
            sink = fit(x_rot, 0, s0).astype(STORE_DTYPE)
            ring = jnp.take_along_axis(x_rot, jnp.maximum(ring_pos, 0)[:, None, :, None], axis=2)
        ring = jnp.where((ring_pos >= 0)[:, None, :, None], ring, 0).astype(STORE_DTYPE)
        hist = cache.hist(which)
        channel_major = layout.CHANNEL_MAJOR[which]
        if n_hist:
            if impl != "xla":
                q = dispatch.get("write", impl)(x, rot, clip, spec, s0, n_hist, channel_major, interpret)
            else:
                q = quant.pack(quant.quantize(fit(x_rot, s0, n_hist).astype(STORE_DTYPE),
                                              spec.quant, clip), bits, channel_major=channel_major)
            hist = quant.Quantized(
                codes=jax.lax.dynamic_update_slice_in_dim(hist.codes, q.codes, 0,
                                                          axis=-1 if channel_major else -2),
                lo=jax.lax.dynamic_update_slice_in_dim(hist.lo, q.lo, 0, axis=-1),
                scale=jax.lax.dynamic_update_slice_in_dim(hist.scale, q.scale, 0, axis=-1))
        return {f"sink_{which}": sink, f"recent_{which}": ring, f"hist_codes_{which}": hist.codes,
                f"hist_lo_{which}": hist.lo, f"hist_scale_{which}": hist.scale}

    updates = {**update("k", k, params.rot_k, params.clip_k),
               **update("v", v, params.rot_v, params.clip_v)}
    return dataclasses.replace(cache, **updates, lengths=n, overflow=~ok)


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


def ring_append(cache: RingCache, k: jax.Array, v: jax.Array) -> RingCache:
    """Append C tokens (k, v: [B, C, Hkv, D], unrotated) to one sliding-window layer."""
    spec = cache.spec
    b, h, d = spec.batch, spec.kv_heads, spec.head_dim
    _check_kv("k", k, b, h, d)
    _check_kv("v", v, b, h, d)
    c = k.shape[1]
    if c > spec.max_chunk:
        raise ValueError(
            f"chunk C={c} must be <= capacity - window + 1 = {spec.max_chunk} "
            f"(raise RingSpec.capacity for longer extend chunks)")
    n = cache.lengths
    pos = n[:, None] + jnp.arange(c)[None, :]
    bidx = jnp.arange(b)[:, None]
    slot = jnp.mod(pos, spec.capacity)
    put = lambda ring, x: ring.at[bidx, :, slot].set(x.astype(STORE_DTYPE))
    return dataclasses.replace(cache, k=put(cache.k, k), v=put(cache.v, v), lengths=n + c)


def ring_slot_positions(lengths: jax.Array, capacity: int) -> jax.Array:
    """Position held by each slot of a plain ring (slot p % capacity): int32 [B, capacity], -1 if empty."""
    n = lengths[:, None]
    j = jnp.arange(capacity)[None, :]
    p = n - 1 - jnp.mod(n - 1 - j, capacity)
    return jnp.where(p >= 0, p, -1)


def ring_write_prompt(cache: RingCache, k: jax.Array, v: jax.Array,
                      prompt_lengths: jax.Array) -> RingCache:
    """Bulk write of whole prompts into one sliding-window layer (replaces its contents).

    k, v: [B, T, Hkv, D]; prompt_lengths: int32 [B] <= T. Keeps the last
    `capacity` positions of each prompt.
    """
    spec = cache.spec
    _check_kv("k", k, spec.batch, spec.kv_heads, spec.head_dim)
    _check_kv("v", v, spec.batch, spec.kv_heads, spec.head_dim)
    n = jnp.asarray(prompt_lengths, jnp.int32)
    if n.shape != (spec.batch,):
        raise ValueError(f"prompt_lengths.shape={n.shape}: expected [B={spec.batch}]")
    pos = ring_slot_positions(n, spec.capacity)  # [B, capacity]

    def gather(x):  # [B, T, H, D] -> [B, H, capacity, D]
        g = jnp.take_along_axis(x, jnp.maximum(pos, 0)[:, :, None, None], axis=1)
        return jnp.moveaxis(jnp.where((pos >= 0)[:, :, None, None], g, 0), 1, 2).astype(STORE_DTYPE)

    return dataclasses.replace(cache, k=gather(k), v=gather(v), lengths=n)
