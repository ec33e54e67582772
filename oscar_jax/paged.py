"""The paged mixed cache (docs/paged.md): one layer's quantised history in a pool of fixed-size
pages shared by every sequence slot, read and written through per-slot block tables; each
slot keeps its own bf16 sink and recent ring.

`PagedCache` holds one layer's pool of pages in its history fields (page p's codes and
metadata are the history layout of `OscarCache`, docs/ARCHITECTURE.md §3, for `page_tokens`
consecutive history tokens, with the page on the leading axis in place of the batch), the
slots' sink, ring, lengths and overflow flags, and `block_table` int32 [B, pages_per_seq]:
history token i of slot b lies in page `block_table[b, i // page_tokens]` at index
`i % page_tokens` (-1: no page). Every layer of a model uses the same page ids (one table,
duplicated per layer).

Pure functions, jit-friendly: `write_prompt` (the bulk write, through `updates.write_prompt`'s
implementations, then each history page scattered to its pool page), `append` (decode and
extend: the evicted tokens written into their pages), `attend` (through the block table:
`"xla"` gathers the pages into the contiguous layout and runs the reference; the TPU, Triton
and Mosaic GPU kernels read the pages in place), `append_attend` (a chunk of any length,
`attention.append_attend`'s rule), `read_slot` / `write_slot` (a slot's rows and
pages, to swap to host memory and back). `PageAllocator` is the host-side free list an engine
allocates from. The design: docs/paged.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from oscar_jax import attention, dispatch, reference, updates
from oscar_jax.cache import STORE_DTYPE, LayerParams, OscarCache, check_params
from oscar_jax.config import HIST_TILE, CacheSpec
from oscar_jax.pallas_kernels import layout
from oscar_jax.pallas_kernels.gpu import mixed_attention as _gpu_attention
from oscar_jax.pallas_kernels.gpu import mixed_attention_mgpu as _mgpu_attention
from oscar_jax.pallas_kernels.tpu import mixed_attention as _tpu_attention

NO_PAGE = -1
# Which page sizes (packed rows a page) each attention implementation reads: the Triton
# kernel's steps are at least 16 rows, the Mosaic GPU kernel's TMA tiles 64 rows (HIST_TILE).
_PAGES_READ = {"xla": lambda rows: True, "pallas_tpu": lambda rows: True,
               "pallas": lambda rows: rows >= 16 and rows & (rows - 1) == 0,
               "pallas_mosaic_gpu": lambda rows: rows % 64 == 0}
_PAGES_READ_TEXT = {"pallas": "a power of two >= 16 packed rows", "pallas_mosaic_gpu": "whole 64-row tiles"}


def _static():
    return dataclasses.field(metadata={"static": True})


def check_page_tokens(spec: CacheSpec, page_tokens: int) -> None:
    """ValueError unless `page_tokens` is a positive multiple of HIST_TILE (what the GPU kernels
    take), or a divisor of it that holds whole packed bytes (small pages, for tests)."""
    tpb = spec.quant.tokens_per_byte
    if not isinstance(page_tokens, int) or page_tokens <= 0 or page_tokens % tpb or not (
            page_tokens % HIST_TILE == 0 or HIST_TILE % page_tokens == 0):
        raise ValueError(f"page_tokens={page_tokens!r}: expected a multiple of HIST_TILE={HIST_TILE} (what the GPU "
                         f"kernels take) or a divisor of it that is a multiple of {tpb} tokens per byte")


def pages_for(length, spec: CacheSpec, page_tokens: int):
    """Pages a sequence holding `length` tokens needs: its history tokens [S0, length - W) in
    whole pages (an int, numpy or jax array of lengths)."""
    hist = length - spec.sink - spec.window
    return -(-(hist * (hist > 0)) // page_tokens)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedCache:
    """One layer's paged cache (P pages of R = page_tokens / tpb packed rows, B slots):

    sink_k, sink_v, recent_k, recent_v, lengths, overflow: per slot, as in `OscarCache`;
    hist_codes_k uint8 [P, Hkv, R, D], hist_codes_v uint8 [P, Hkv, D, R] (channel-major),
    hist_lo_k, hist_scale_k, hist_lo_v, hist_scale_v [P, Hkv, D/G, tpb, R]: the page pool,
      each page the `OscarCache` history layout of `page_tokens` consecutive tokens;
    block_table int32 [B, pages_per_seq]: slot b's history token i is in page
      block_table[b, i // page_tokens] (NO_PAGE where none is allocated).
    spec: the per-slot view (batch B, max_len = S0 + W + pages_per_seq * page_tokens).
    `layout.CacheArrays.of` reads it as the kernels' cache argument, the history fields
    holding the pool.
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
    block_table: jax.Array
    spec: CacheSpec = _static()
    page_tokens: int = _static()

    is_stacked = False  # one layer's cache (what `updates` checks)

    @classmethod
    def init(cls, spec: CacheSpec, page_tokens: int, num_pages: int) -> "PagedCache":
        """Empty slots and a pool of `num_pages` pages; spec.max_len - S0 - W must be a whole
        number of pages (the most one slot can hold)."""
        check_page_tokens(spec, page_tokens)
        hist = spec.max_len - spec.sink - spec.window
        if hist % page_tokens:
            raise ValueError(f"spec.max_len={spec.max_len}: max_len - sink - window = {hist} must be a multiple "
                             f"of page_tokens={page_tokens}")
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages={num_pages!r}: expected a positive int")
        b, h, d = spec.batch, spec.kv_heads, spec.head_dim
        tpb = spec.quant.tokens_per_byte
        rows = page_tokens // tpb
        bf = lambda n: jnp.zeros((b, h, n, d), STORE_DTYPE)
        meta = lambda: jnp.zeros((num_pages, h, spec.num_groups, tpb, rows), spec.quant.jnp_scale_dtype)
        return cls(bf(spec.sink), bf(spec.sink),
                   jnp.zeros((num_pages, h, rows, d), jnp.uint8), jnp.zeros((num_pages, h, d, rows), jnp.uint8),
                   meta(), meta(), meta(), meta(), bf(spec.window), bf(spec.window),
                   jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool),
                   jnp.full((b, hist // page_tokens), NO_PAGE, jnp.int32), spec, page_tokens)

    @property
    def pages_per_seq(self) -> int:
        return self.block_table.shape[1]

    @property
    def num_pages(self) -> int:
        return self.hist_codes_k.shape[0]


HIST_FIELDS = ("hist_codes_k", "hist_codes_v", "hist_lo_k", "hist_scale_k", "hist_lo_v", "hist_scale_v")
SLOT_FIELDS = ("sink_k", "sink_v", "recent_k", "recent_v", "lengths", "overflow", "block_table")
ROW_FIELDS = SLOT_FIELDS[:-1]  # a slot's own arrays, beside its pages and table
# The token axis of each history field ([P, H, ...] per page, [B, H, ...] contiguous).
_TOKEN_AXIS = {"hist_codes_k": -2, "hist_codes_v": -1, "hist_lo_k": -1, "hist_scale_k": -1, "hist_lo_v": -1,
               "hist_scale_v": -1}


def _pages_of(x: jax.Array, token_axis: int, rows: int, n: int) -> jax.Array:
    """Contiguous history x [B, H, ...] (at least n * rows packed rows on token_axis) -> its
    first n pages [B * n, H, ...] of `rows` packed rows each, in (row, page) order."""
    b = x.shape[0]
    t = x.ndim + token_axis
    x = jax.lax.slice_in_dim(x, 0, n * rows, axis=t)
    x = x.reshape(x.shape[:t] + (n, rows) + x.shape[t + 1:])
    return jnp.moveaxis(x, t, 1).reshape((b * n,) + x.shape[1:t] + (rows,) + x.shape[t + 2:])


def gather(cache: PagedCache) -> OscarCache:
    """The contiguous `OscarCache` holding the same tokens (pages gathered through the block
    table, unallocated entries as zeros, padded to `spec.hist_capacity`): what the reference
    and the contiguous kernels read."""
    spec = cache.spec
    table = cache.block_table
    pad_rows = (spec.hist_capacity - cache.pages_per_seq * cache.page_tokens) // spec.quant.tokens_per_byte
    held = table >= 0

    def pages(x, token_axis):
        """x [P, H, *rest] -> [B, H, *rest] with each slot's pages joined on rest's token_axis (< 0)."""
        g = x[jnp.maximum(table, 0)]  # [B, n, H, *rest]
        g = jnp.where(held.reshape(held.shape + (1,) * (g.ndim - 2)), g, jnp.zeros((), g.dtype))
        t = g.ndim + token_axis  # the token axis of [B, n, H, *rest]
        g = jnp.moveaxis(g, 1, t - 1)  # the page axis just before the rows within a page
        g = g.reshape(g.shape[:t - 1] + (g.shape[t - 1] * g.shape[t],) + g.shape[t + 1:])
        widths = [(0, 0)] * g.ndim
        widths[t - 1] = (0, pad_rows)
        return jnp.pad(g, widths)

    hist = {name: pages(getattr(cache, name), axis) for name, axis in _TOKEN_AXIS.items()}
    return OscarCache(sink_k=cache.sink_k, sink_v=cache.sink_v, recent_k=cache.recent_k, recent_v=cache.recent_v,
                      lengths=cache.lengths, overflow=cache.overflow, spec=spec, **hist)


def _missing_pages(table: jax.Array, lengths: jax.Array, spec: CacheSpec, page_tokens: int) -> jax.Array:
    """bool [B]: a slot holding `lengths` tokens has history in a page its table lacks."""
    need = pages_for(lengths, spec, page_tokens)
    j = jnp.arange(table.shape[1])[None, :]
    return jnp.any((j < need[:, None]) & (table < 0), axis=1)


def _refuse(caller: str, bad: jax.Array, what: str) -> None:
    """Raise outside jit where any of `bad` [B] is set, naming the slots."""
    if not isinstance(bad, jax.core.Tracer):
        rows = np.nonzero(np.asarray(bad))[0]
        if rows.size:
            raise ValueError(f"{caller}: slots {rows.tolist()} {what}")


def write_prompt(cache: PagedCache, slots, k: jax.Array, v: jax.Array, prompt_lengths, params: LayerParams, *,
                 implementation: str = "auto", interpret: bool = False) -> PagedCache:
    """Bulk write of whole prompts into slots `slots` int32 [Bp] (replacing their contents).

    k, v [Bp, T, Hkv, D] post-RoPE, unrotated; prompt_lengths int32 [Bp] <= T. The prompts go
    through `updates.write_prompt` (its `implementation`s: the bulk rotate-quantise-pack
    kernels) into a contiguous cache of ceil(T's history / page_tokens) pages, which `insert`
    puts into the slots and their pages.
    """
    spec = cache.spec
    bp, t = k.shape[0], k.shape[1]
    n_pages = int(min(pages_for(t, spec, cache.page_tokens), cache.pages_per_seq))
    part = dataclasses.replace(spec, batch=bp, max_len=spec.sink + spec.window + n_pages * cache.page_tokens)
    part = updates.write_prompt(OscarCache.init(part, stacked=False), k, v, prompt_lengths, params,
                                implementation=implementation, interpret=interpret)
    return insert(cache, slots, part)


def insert(cache: PagedCache, slots, part: OscarCache, keep=None) -> PagedCache:
    """Put the rows of a contiguous one-layer cache `part` (batch Bp, the same sink, window,
    head shape and quantiser; a history of at most pages_per_seq pages) into slots `slots`
    int32 [Bp]: their sink, ring, lengths and overflow, and the history, page by page, into
    the pool at the slots' block-table entries. keep int32 [Bp] (default 0): row b's first
    keep[b] pages are left unwritten (shared pages that hold these tokens already). A slot
    whose table lacks a page its tokens need raises outside jit; inside jit it is flagged in
    `overflow`."""
    spec = cache.spec
    slots = jnp.asarray(slots, jnp.int32)
    bp = part.spec.batch
    if slots.shape != (bp,):
        raise ValueError(f"slots.shape={slots.shape}: expected [Bp={bp}] (one slot per row of part)")
    same = ("kv_heads", "head_dim", "sink", "window", "quant")
    if part.is_stacked or any(getattr(part.spec, f) != getattr(spec, f) for f in same):
        raise ValueError(f"insert: part's spec {part.spec} does not match this paged cache's {spec} "
                         f"(one layer's cache with the same {', '.join(same)})")
    rows = cache.page_tokens // spec.quant.tokens_per_byte
    n_pages = min(part.spec.hist_capacity // cache.page_tokens, cache.pages_per_seq)
    table = cache.block_table[slots]
    missing = _missing_pages(table[:, :n_pages], part.lengths, spec, cache.page_tokens) | (
        pages_for(part.lengths, spec, cache.page_tokens) > n_pages)
    _refuse("insert", missing, "lack block-table pages their tokens need")
    out = {name: getattr(cache, name).at[slots].set(getattr(part, name))
           for name in ("sink_k", "sink_v", "recent_k", "recent_v", "lengths")}
    out["overflow"] = cache.overflow.at[slots].set(part.overflow | missing)
    if n_pages:
        keep = jnp.zeros((bp,), jnp.int32) if keep is None else jnp.asarray(keep, jnp.int32)
        ids = table[:, :n_pages]
        ids = jnp.where((ids >= 0) & (jnp.arange(n_pages)[None, :] >= keep[:, None]), ids, cache.num_pages)
        ids = ids.reshape(-1)  # no page, or a kept one: dropped
        for name, axis in _TOKEN_AXIS.items():
            pages = _pages_of(getattr(part, name), axis, rows, n_pages)
            out[name] = getattr(cache, name).at[ids].set(pages, mode="drop")
    return dataclasses.replace(cache, **out)


def append(cache: PagedCache, k: jax.Array, v: jax.Array, params: LayerParams) -> PagedCache:
    """`updates.append` into a paged cache: k, v [B, C, Hkv, D] (any C <= max_len) enter the
    slots' sink or ring; the tokens they evict are written into their pages, one token at a time
    (decode's read-modify-write of one byte row per page). A slot whose table lacks the page
    an evicted token goes to raises outside jit; inside jit the token is dropped and the slot
    flagged in `overflow`."""
    updates._check_inputs("append", cache, k, v, params)
    spec = cache.spec
    c, bits, page = k.shape[1], spec.quant.bits, cache.page_tokens
    table = cache.block_table
    missing = _missing_pages(table, cache.lengths + c, spec, page) & (cache.lengths + c <= spec.max_len)
    _refuse("append", missing, f"lack the block-table page the append of C={c} tokens writes into")
    bidx = jnp.arange(spec.batch)

    def write_history(which, q, start, ok):
        cm = layout.CHANNEL_MAJOR[which]
        names = (f"hist_codes_{which}", f"hist_lo_{which}", f"hist_scale_{which}")

        def token(i, hist):
            index = start + i  # history index [B]
            phys = table[bidx, jnp.clip(index // page, 0, cache.pages_per_seq - 1)]
            index = jnp.where((index >= 0) & (phys >= 0), index % page, -1)
            new = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, i, 1, axis=2), q)
            return updates._write_history_token(*hist, new, index, ok, bits, cm, seq=phys)

        hist = tuple(getattr(cache, name) for name in names)
        hist = token(0, hist) if c == 1 else jax.lax.fori_loop(0, c, token, hist)
        return dict(zip(names, hist))

    out = updates.append_with(cache, k, v, params, write_history)
    return dataclasses.replace(out, overflow=out.overflow | missing)


def attend(q: jax.Array, cache: PagedCache, params: LayerParams, *, implementation: str = "auto",
           softmax_scale: float | None = None, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """`attention.attend` over a paged cache (tokens already appended): q [B, C, Hq, D] ->
    (o [B, C, Hq, D], lse f32 [B, C, Hq]). implementation: "xla" (pages gathered, then the
    reference), "pallas_tpu" / "pallas" / "pallas_mosaic_gpu" (the TPU / Triton / Mosaic GPU
    kernel reading pages through the block table; Triton: pages of a power of two >= 16 packed
    rows, Mosaic GPU: whole HIST_TILEs), "auto" (XLA where the page size suits no kernel);
    interpret: Pallas interpret mode."""
    spec = cache.spec
    attention_check(q, cache, params)
    if q.shape[1] > spec.window:
        raise ValueError(f"q has C={q.shape[1]} queries; at most window W={spec.window} per call (a longer chunk "
                         "attends through append_attend)")
    name = _resolve(q, cache, implementation, interpret)
    return dispatch.get("paged_attend", name)(q, cache, params, softmax_scale=softmax_scale, interpret=interpret)


def append_attend(q: jax.Array, k: jax.Array, v: jax.Array, cache: PagedCache, params: LayerParams, *,
                  implementation: str = "auto", softmax_scale: float | None = None, interpret: bool = False
                  ) -> tuple[jax.Array, jax.Array, PagedCache]:
    """`attention.append_attend` over a paged cache: `append` of k, v [B, C, Hkv, D], then the C
    queries q [B, C, Hq, D] attend -> (o, lse, cache). C <= W: `attend` (any implementation);
    C > W: the pages gathered, then `reference.attend(own=...)` (XLA; an explicit kernel raises)."""
    spec = cache.spec
    c = k.shape[1]
    attention_check(q, cache, params)
    if q.shape[1] != c:
        raise ValueError(f"q has C={q.shape[1]} queries and k C={c} tokens: expected one query per new token")
    if c > spec.window:
        _resolve(q, cache, implementation, interpret)
    cache = append(cache, k, v, params)
    if c <= spec.window:
        o, lse = attend(q, cache, params, implementation=implementation, softmax_scale=softmax_scale,
                        interpret=interpret)
    else:
        o, lse = reference.attend(q, gather(cache), params, softmax_scale, own=updates.stored_kv(k, v, params))
    return o, lse, cache


def _resolve(q: jax.Array, cache: PagedCache, implementation: str, interpret: bool) -> str:
    """The implementation `attend` runs: `dispatch`'s choice, XLA under "auto" where the page size
    suits no kernel (an explicit kernel that does not read these pages raises)."""
    spec = cache.spec
    name = dispatch.resolve("paged_attend", implementation, spec, queries=q.shape[1],
                            group=q.shape[2] // spec.kv_heads, interpret=interpret)
    if not _PAGES_READ[name](cache.page_tokens // spec.quant.tokens_per_byte):
        if implementation != "auto":
            raise ValueError(f"implementation={name!r} does not read pages of {cache.page_tokens} tokens "
                             f"({_PAGES_READ_TEXT[name]}); use 'xla' or 'auto'")
        name = "xla"
    return name


def attention_check(q: jax.Array, cache: PagedCache, params: LayerParams) -> None:
    spec = cache.spec
    b, h, d = spec.batch, spec.kv_heads, spec.head_dim
    if q.ndim != 4 or q.shape[0] != b or q.shape[3] != d or q.shape[2] % h:
        raise ValueError(f"q.shape={q.shape}: expected [B={b}, C, Hq, D={d}] with Hq a multiple of Hkv={h}")
    check_params(spec, params, "attend")


class PagesExhausted(RuntimeError):
    """`PageAllocator.allocate` asked for more pages than are free."""


class PageAllocator:
    """Host-side free list of page ids [0, num_pages): `allocate(n)` takes the n lowest free
    ids, `free(ids)` returns them; allocated + free = num_pages always."""

    def __init__(self, num_pages: int):
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages={num_pages!r}: expected a positive int")
        self.num_pages = num_pages
        self._free = set(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"allocate(n={n}): expected n >= 0")
        if n > len(self._free):
            raise PagesExhausted(f"allocate({n}): only {len(self._free)} of {self.num_pages} pages are free")
        ids = sorted(self._free)[:n]
        self._free.difference_update(ids)
        return ids

    def free(self, ids) -> None:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.num_pages or i in self._free]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"free({ids}): pages {bad or ids} are not allocated (double free or foreign id)")
        self._free.update(ids)


def _xla_attend(q, cache: PagedCache, params: LayerParams, softmax_scale=None, interpret: bool = False):
    return reference.attend(q, gather(cache), params, softmax_scale)


dispatch.register("paged_attend", "xla", _xla_attend)
dispatch.register("paged_attend", "pallas_tpu", attention.kernel_attend(_tpu_attention.mixed_attention, paged=True),
                  supports=attention.within_window())
dispatch.register("paged_attend", "pallas", attention.kernel_attend(_gpu_attention.mixed_attention, paged=True),
                  supports=attention.within_window(lambda spec, queries, group: _gpu_attention.supports(spec)))
dispatch.register("paged_attend", "pallas_mosaic_gpu",
                  attention.kernel_attend(_mgpu_attention.mixed_attention, rotates=True, paged=True),
                  supports=attention.within_window(_mgpu_attention.supports))


def read_slot(cache: PagedCache, slot, page_ids) -> dict[str, jax.Array]:
    """What slot `slot` holds, to swap it out: its sink, ring, lengths and overflow, and the pages
    `page_ids` int32 [n] (its table's entries, in order; padding ids read any page)."""
    ids = jnp.asarray(page_ids, jnp.int32)
    return {**{name: getattr(cache, name)[slot] for name in ROW_FIELDS},
            **{name: getattr(cache, name)[ids] for name in HIST_FIELDS}}


def write_slot(cache: PagedCache, slot, page_ids, saved: dict[str, jax.Array]) -> PagedCache:
    """Swap `saved` (`read_slot`'s) back into slot `slot` and pages `page_ids` int32 [n] (ids
    < 0 or >= num_pages are skipped: padding); the block table is the caller's."""
    ids = jnp.asarray(page_ids, jnp.int32)
    ids = jnp.where(ids >= 0, ids, cache.num_pages)
    out = {name: getattr(cache, name).at[slot].set(saved[name]) for name in ROW_FIELDS}
    out.update({name: getattr(cache, name).at[ids].set(saved[name], mode="drop") for name in HIST_FIELDS})
    return dataclasses.replace(cache, **out)
