"""Writes into the mixed cache (docs/ARCHITECTURE.md §4), one layer at a time: `append`
(decode and extend: new tokens enter the sink or ring, the tokens they push out of the ring
are quantised into the history), `write_prompt` (a prompt's bulk write, through the
rotate-quantise-pack kernels that `oscar_jax.dispatch` names), and the sliding-window ring's
`ring_append` and `ring_write_prompt`. Pure functions: each returns the updated cache.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from oscar_jax import dispatch, quant
from oscar_jax.cache import (STORE_DTYPE, LayerParams, OscarCache, RingCache, check_params,
                             ring_positions, ring_slot_positions)
from oscar_jax.config import LLOYD_MAX_SPAN, CacheSpec
from oscar_jax.pallas_kernels import layout
from oscar_jax.pallas_kernels.gpu import append_token, quantize_pack, quantize_pack_mgpu
from oscar_jax.pallas_kernels.tpu import bulk_write


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


def _check_inputs(caller: str, cache: OscarCache, k: jax.Array, v: jax.Array, params: LayerParams) -> None:
    """ValueError naming `caller` unless cache is one layer's and k, v [B, T, Hkv, D] and params fit it."""
    spec = cache.spec
    if cache.is_stacked:
        raise ValueError(f"{caller} takes a per-layer cache: use cache.layer(i) or lax.scan")
    for name, x in (("k", k), ("v", v)):
        _check_kv(name, x, spec.batch, spec.kv_heads, spec.head_dim)
    check_params(spec, params, caller)
    if v.shape != k.shape:
        raise ValueError(f"v.shape={v.shape} must equal k.shape={k.shape}")


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


def _write_history_token(codes, lo, scale, new: quant.Quantized, index, ok, bits: int, channel_major: bool,
                         seq: jax.Array | None = None):
    """Decode's history write: one token per sequence at history index `index` int32 [B] (skipped
    where negative or not `ok` [B]), as a read-modify-write of its byte row and one metadata
    element, so a step touches a handful of bytes and stays a few fused kernels.

    codes uint8 [N, H, R, D] ([N, H, D, R] when channel_major); lo/scale [N, H, G, tpb, R];
    new is unpacked: codes [B, H, 1, D], lo/scale [B, H, 1, G]; seq int32 [B]: the index on
    the first axis that row b writes (default b, N = B; a page pool's page, `oscar_jax.paged`)."""
    tpb = 8 // bits
    rows = codes.shape[-1 if channel_major else -2]
    if rows == 0:  # a cache without history
        return codes, lo, scale
    bidx = jnp.arange(new.codes.shape[0]) if seq is None else seq
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


def append(cache: OscarCache, k: jax.Array, v: jax.Array, params: LayerParams, *,
           implementation: str = "auto", interpret: bool = False, history_offset=0) -> OscarCache:
    """Append C new tokens to every sequence of one layer's cache.

    k, v: [B, C, Hkv, D] post-RoPE, unrotated, any C <= max_len. The tokens are rotated on
    entry; the C tokens that leave the ring (the oldest recent ones, and past C = W the
    chunk's own first C - W) are quantised into the history: the cache afterwards is bit
    for bit what C one-token appends leave. A row whose lengths + C would pass max_len raises
    outside jit; inside jit it is left unchanged and its `overflow` flag is set.
    implementation: `oscar_jax.dispatch`'s names: "xla", or "pallas" (the Triton
    one-token kernel `append_token`, C = 1); "auto" takes the kernel on GPU where it
    applies. interpret: run a kernel implementation in Pallas interpret mode (tests).
    history_offset (int or traced int32; sequence parallelism, `oscar_jax.parallel`): the
    history arrays hold history indices [history_offset, history_offset + T_local) of a longer
    history; a token evicted outside them is not written here.
    """
    _check_inputs("append", cache, k, v, params)
    c = k.shape[1]
    if dispatch.resolve("append", implementation, cache.spec, queries=c, interpret=interpret) == "pallas":
        return _append_token(cache, k, v, params, interpret, history_offset)
    bits = cache.spec.quant.bits

    def write_history(which, q, start, ok):
        hist = (getattr(cache, f"hist_codes_{which}"), getattr(cache, f"hist_lo_{which}"),
                getattr(cache, f"hist_scale_{which}"))
        start = start - history_offset
        if c == 1:
            codes, lo, scale = _write_history_token(*hist, q, start, ok, bits, layout.CHANNEL_MAJOR[which])
        else:
            write = functools.partial(_write_history, bits=bits, channel_major=layout.CHANNEL_MAJOR[which])
            codes, lo, scale = jax.vmap(write)(*hist, q, start, jnp.where(ok, c, 0))
        return {f"hist_codes_{which}": codes, f"hist_lo_{which}": lo, f"hist_scale_{which}": scale}

    return append_with(cache, k, v, params, write_history)


def stored_kv(k: jax.Array, v: jax.Array, params: LayerParams) -> tuple[jax.Array, jax.Array]:
    """k, v [B, C, Hkv, D] (post-RoPE, model basis) as the cache's bf16 segments store them:
    keys shifted by `params.k_shift`, both rotated -> (k_rot, v_rot) bf16 [B, Hkv, C, D]."""
    return (_rotate(shifted_keys(k, params), params.rot_k).astype(STORE_DTYPE),
            _rotate(v, params.rot_v).astype(STORE_DTYPE))


def append_with(cache, k: jax.Array, v: jax.Array, params: LayerParams, write_history):
    """`append`'s sink and ring update, the history write left to `write_history(which, q,
    start, ok) -> {field: array}` (which "k" or "v"; q the evicted tokens quantised, unpacked:
    codes [B, H, C, D], lo/scale [B, H, C, G]; evicted token i goes to history index
    start + i where that is >= 0, start int32 [B]; ok bool [B]: the row takes the append).
    `cache` is any per-layer cache with `OscarCache`'s spec, sink_*, recent_*, lengths and
    overflow fields (`oscar_jax.paged.PagedCache` writes its history through a block table).

    New token i (position n + i) pushes position n + i - W out of the ring: the ring's token
    for i < W, the chunk's own token i - W past it (C > W); only the chunk's last W tokens
    enter the ring."""
    spec = cache.spec
    b = spec.batch
    c = k.shape[1]
    if c > spec.max_len:
        raise ValueError(f"k has C={c} tokens: a chunk holds at most the cache's max_len={spec.max_len}")
    s0, w = spec.sink, spec.window
    n = cache.lengths
    ok = _check_append(spec.max_len, n, c)
    pos = n[:, None] + jnp.arange(c)[None, :]  # [B, C]

    def update(which, x_rot, clip):  # x_rot [B, H, C, D] bf16
        sink = getattr(cache, f"sink_{which}")
        ring = getattr(cache, f"recent_{which}")
        bidx = jnp.arange(b)[:, None]
        # Tokens leaving the ring: slot of new position p held position p - W.
        slot = jnp.mod(pos - s0, w)
        evicted = ring[bidx, :, slot[:, :min(c, w)]]  # [B, min(C, W), H, D]
        # The ring is read here and written in place below: tying the two makes the read come
        # first, so XLA updates the ring in place instead of copying it.
        ring, evicted = jax.lax.optimization_barrier((ring, evicted))
        evicted = jnp.moveaxis(evicted, 1, 2)  # [B, H, min(C, W), D]
        in_ring = (pos >= s0) & ok[:, None]
        if c > w:  # the chunk's first C - W tokens pass through the ring: evicted, never written there
            evicted = jnp.concatenate([evicted, x_rot[:, :, :c - w]], axis=2)
            in_ring &= jnp.arange(c)[None, :] >= c - w
        q = quant.quantize(evicted, spec.quant, clip)
        # New token i evicts history index n + i - W - S0 (kept where >= 0).
        hist = write_history(which, q, n - w - s0, ok)
        in_sink = (pos < s0) & ok[:, None]
        sink = sink.at[bidx, :, jnp.where(in_sink, pos, s0)].set(
            jnp.moveaxis(x_rot, 2, 1), mode="drop")
        ring = ring.at[bidx, :, jnp.where(in_ring, slot, w)].set(
            jnp.moveaxis(x_rot, 2, 1), mode="drop")
        return {f"sink_{which}": sink, f"recent_{which}": ring, **hist}

    k_rot, v_rot = stored_kv(k, v, params)
    updates = {**update("k", k_rot, params.clip_k), **update("v", v_rot, params.clip_v)}
    return dataclasses.replace(
        cache, **updates, lengths=jnp.where(ok, n + c, n), overflow=cache.overflow | ~ok)


def _append_token(cache: OscarCache, k: jax.Array, v: jax.Array, params: LayerParams, interpret: bool,
                  history_offset) -> OscarCache:
    """`append` of one token a row through the Triton kernel `append_token` (one launch for K,
    one for V, every array updated in place)."""
    spec, cfg = cache.spec, cache.spec.quant
    n = cache.lengths
    ok = _check_append(spec.max_len, n, 1)
    updates = {}
    for which, x, rot, clip in (("k", shifted_keys(k, params), params.rot_k, params.clip_k),
                                ("v", v, params.rot_v, params.clip_v)):
        names = (f"sink_{which}", f"recent_{which}", f"hist_codes_{which}", f"hist_lo_{which}",
                 f"hist_scale_{which}")
        x_rot = _rotate(x, rot).astype(STORE_DTYPE)[:, :, 0]  # [B, H, D]
        updates.update(zip(names, append_token.append_token(
            x_rot, n, n - spec.window - spec.sink - history_offset, ok, clip, *(getattr(cache, name) for name in names),
            window=spec.window, bits=cfg.bits,
            levels=cfg.levels, group_size=spec.group_size, span=LLOYD_MAX_SPAN if cfg.codebook == "lloyd_max" else None,
            channel_major=layout.CHANNEL_MAJOR[which], interpret=interpret)))
    return dataclasses.replace(cache, **updates, lengths=jnp.where(ok, n + 1, n), overflow=cache.overflow | ~ok)


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


# append's implementations: its XLA code, and on GPU the one-token kernel (one launch per K or V
# of a layer where the XLA code runs a dozen small fusions).
dispatch.register("append", "xla", None)
dispatch.register("append", "pallas", append_token.append_token,
                  lambda spec, queries, group: queries == 1 and append_token.supports(spec))
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
    _check_inputs("write_prompt", cache, k, v, params)
    b = spec.batch
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
