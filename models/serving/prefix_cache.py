"""The prefix cache's host-side index (docs/paged.md §5): prompt prefixes whose KV state outlives
their request, so that a later prompt starting with the same tokens skips their prefill.

A prompt is cut at fixed boundaries m_1 < m_2 < ... (the engine's: with a paged pool
m_k = S0 + W + k * page_tokens, the length at which history page k - 1 is full). Entry k of a
prompt covers its tokens [0, m_k); its key chains the previous entry's key with tokens
[m_{k-1}, m_k) (`chain_keys`), starting from a salt that names everything else that decides
the cache's contents (`salt`: model config and weights, KV policy and calibration, the engine's
layout, the backend). An entry holds

- page: the pool page of history page k - 1 (paged policies), shared by reference count;
- snapshot: the one-row state's per-slot rows at m_k (bf16 sink and ring, lengths, sliding
  rings; dense policies: lengths and scales) as host arrays, what a hit restores beside the
  pages; None where no request snapshotted there (a hit can start only from a snapshot);
- rows: dense policies only: the K/V rows of tokens [m_{k-1}, m_k), host arrays.

refs counts the running sequences holding an entry (one whose prompt covers it). An entry
with refs 0 is cached: it keeps its page and host arrays but may be evicted, least recently
released first, a chain's deepest entry before its parents. `evict` frees cached pages when
the free list runs out (before any sequence is preempted) and host arrays past `host_bytes`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp

from oscar_jax import artifact, paged
from oscar_jax import cache as oc
from oscar_jax.models import kv_policy
from oscar_jax.paged import PageAllocator


@dataclasses.dataclass
class Entry:
    """One cached prefix boundary (module docstring)."""

    key: bytes
    parent: bytes | None
    depth: int  # k: the entry covers the prompt's tokens [0, m_k)
    page: int | None = None
    snapshot: Any = None
    rows: Any = None
    refs: int = 0

    @property
    def nbytes(self) -> int:
        """Host bytes of its snapshot and rows."""
        return sum(int(x.nbytes) for x in jax.tree.leaves((self.snapshot, self.rows)))


def chain_keys(salt: bytes, prompt: Sequence[int], bounds: Sequence[int]) -> list[bytes]:
    """The keys of `prompt`'s entries at `bounds` (increasing lengths m_1, m_2, ...): key k =
    sha256(key k-1 + int64 bytes of tokens [m_{k-1}, m_k)), key 0 = salt."""
    keys, prev, start = [], salt, 0
    tokens = np.asarray(prompt, np.int64)
    for end in bounds:
        prev = hashlib.sha256(prev + tokens[start:end].tobytes()).digest()
        keys.append(prev)
        start = end
    return keys


def weights_fingerprint(model) -> str:
    """SHA-256 over a sample of every weight array (its dtype, shape, first and last 64
    elements): tells two checkpoints of one architecture apart without reading all their bytes."""
    from flax import nnx

    h = hashlib.sha256()
    for x in jax.tree.leaves(nnx.state(model)):
        flat = x.reshape(-1)
        h.update(f"{x.dtype}{x.shape}".encode())
        h.update(np.asarray(jax.device_get(flat[:64])).tobytes() + np.asarray(jax.device_get(flat[-64:])).tobytes())
    return h.hexdigest()


def policy_fingerprint(policy, cfg) -> str:
    """SHA-256 of a KV policy's identity: its fields and, for OSCAR policies, every array of its
    `LayerParams` (rotations, clips: the calibration artifact's contents)."""
    fields = {f.name: repr(getattr(policy, f.name)) for f in dataclasses.fields(policy) if f.name != "layer_params"}
    h = hashlib.sha256(f"{type(policy).__name__}{sorted(fields.items())}".encode())
    if hasattr(policy, "params"):
        for x in jax.tree.leaves(policy.params(cfg)):
            h.update(np.asarray(jax.device_get(x)).tobytes())
    return h.hexdigest()


def salt(model, policy, layout: dict) -> bytes:
    """The first link of every key chain: model config and weights, the policy, the engine's
    `layout` (what else shapes the cached arrays: page size, chunk, capacity), jax and backend."""
    parts = {"config": artifact.fingerprint(model.cfg), "weights": weights_fingerprint(model),
             "policy": policy_fingerprint(policy, model.cfg), "layout": layout,
             "jax": jax.__version__, "backend": jax.default_backend()}
    return hashlib.sha256(artifact.fingerprint(parts).encode()).digest()


class PrefixCache:
    """Entries by key, reference counts and the LRU order of the unreferenced ones.

    salt: `salt(...)`; allocator: the pool's free list (None: dense policies, no pages);
    host_bytes: the host memory snapshots and rows may take before unreferenced entries go."""

    def __init__(self, salt: bytes, allocator: PageAllocator | None, host_bytes: int):
        if host_bytes < 0:
            raise ValueError(f"host_bytes={host_bytes}: expected >= 0")
        self.salt, self.allocator, self.host_bytes = salt, allocator, host_bytes
        self.entries: dict[bytes, Entry] = {}
        self._lru: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # refs 0, oldest first
        self.nbytes = 0

    def keys(self, prompt: Sequence[int], bounds: Sequence[int]) -> list[bytes]:
        return chain_keys(self.salt, prompt, bounds)

    def match(self, keys: Sequence[bytes]) -> tuple[int, int]:
        """(d, j): the entries of keys[:d] are all held and keys[d]'s is not; j <= d is the
        deepest of them with a snapshot (0: none), where a prefill can start."""
        d = j = 0
        for key in keys:
            entry = self.entries.get(key)
            if entry is None:
                break
            d += 1
            if entry.snapshot is not None:
                j = d
        return d, j

    @property
    def num_cached_pages(self) -> int:
        """Pages held by unreferenced entries only (evictable)."""
        return sum(self.entries[k].page is not None for k in self._lru)

    def cached_pages_among(self, keys: Sequence[bytes]) -> int:
        """Pages of keys' entries that are unreferenced now (acquiring them makes them unevictable)."""
        return sum(k in self._lru and self.entries[k].page is not None for k in keys)

    def acquire(self, key: bytes) -> Entry:
        entry = self.entries[key]
        entry.refs += 1
        self._lru.pop(key, None)
        return entry

    def release(self, keys: Sequence[bytes]) -> None:
        """One reference less on each of keys (a chain, shallowest first); those left without
        any become cached, the deepest the first to be evicted."""
        for key in reversed(keys):
            entry = self.entries[key]
            if entry.refs < 1:
                raise ValueError(f"release: entry at depth {entry.depth} holds no reference")
            entry.refs -= 1
            if entry.refs == 0:
                self._lru[key] = None

    def add(self, key: bytes, parent: bytes | None, depth: int, page: int | None, snapshot=None,
            rows=None, refs: int = 1) -> Entry:
        """A new entry with `refs` references (0: cached at once, the most recently used)."""
        if key in self.entries:
            raise ValueError(f"add: an entry at depth {depth} with this key exists")
        entry = self.entries[key] = Entry(key, parent, depth, page, snapshot, rows, refs)
        self.nbytes += entry.nbytes
        if refs == 0:
            self._lru[key] = None
        self.evict()
        return entry

    def attach(self, entry: Entry, snapshot) -> None:
        """Give `entry` (which has none) a snapshot."""
        entry.snapshot = snapshot
        self.nbytes += sum(int(x.nbytes) for x in jax.tree.leaves(snapshot))
        self.evict()

    def evict(self, pages: int = 0) -> None:
        """Drop unreferenced entries, least recently used first, until `pages` pages are freed to
        the allocator and the host arrays fit `host_bytes` (or none is left to drop)."""
        freed = 0
        while self._lru and (freed < pages or self.nbytes > self.host_bytes):
            key, _ = self._lru.popitem(last=False)
            entry = self.entries.pop(key)
            self.nbytes -= entry.nbytes
            if entry.page is not None:
                self.allocator.free([entry.page])
                freed += 1

    def chains(self) -> list[Entry]:
        """The entries reachable from the salt (their parents all held), in eviction order: the
        unreferenced least recently used first, then the referenced."""
        reachable: set[bytes] = set()
        for entry in sorted(self.entries.values(), key=lambda e: e.depth):
            if entry.parent is None or entry.parent in reachable:
                reachable.add(entry.key)
        order = list(self._lru) + [k for k in self.entries if k not in self._lru]
        return [self.entries[k] for k in order if k in reachable]


# ----------------------------------------------------------------------------
# The arrays: what a snapshot takes from a one-row state and puts back (device side)


def _snapshot(part: kv_policy.KVState) -> dict:
    """The arrays of a one-row state a snapshot keeps: every layer's but the OSCAR history and
    the dense K/V rows ({"l<i>": {name: array}, "lengths": array})."""
    out = {"lengths": part.lengths}
    for i, layer in enumerate(part.layers):
        if isinstance(layer, kv_policy.OscarLayer):
            out[f"l{i}"] = {f: getattr(layer.cache, f) for f in paged.ROW_FIELDS}
        elif isinstance(layer, oc.RingCache):
            out[f"l{i}"] = {"k": layer.k, "v": layer.v, "lengths": layer.lengths}
        else:
            out[f"l{i}"] = {f: getattr(layer, f) for f in ("lengths", "k_scale", "v_scale")
                            if getattr(layer, f) is not None}
    return out


take_snapshot = jax.jit(_snapshot)


@functools.partial(jax.jit, donate_argnames=("part",))
def with_snapshot(part: kv_policy.KVState, snapshot: dict) -> kv_policy.KVState:
    """`part` with `snapshot`'s arrays in place (`take_snapshot`'s inverse)."""
    layers = []
    for i, layer in enumerate(part.layers):
        arrays = snapshot[f"l{i}"]
        if isinstance(layer, kv_policy.OscarLayer):
            layers.append(dataclasses.replace(layer, cache=dataclasses.replace(layer.cache, **arrays)))
        else:
            layers.append(dataclasses.replace(layer, **arrays))
    return kv_policy.KVState(tuple(layers), snapshot["lengths"])


@jax.jit
def with_pages(state: kv_policy.KVState, part: kv_policy.KVState, ids: jax.Array) -> kv_policy.KVState:
    """`part` (one row) with the history of its OSCAR layers read from `state`'s pools: pages
    `ids` int32 [pages_per_seq] in order (NO_PAGE: none, zeros)."""
    layers = []
    for layer, row in zip(state.layers, part.layers):
        if isinstance(layer, kv_policy.PagedLayer):
            view = dataclasses.replace(layer.cache, block_table=ids[None], spec=row.cache.spec,
                                       **{f: getattr(row.cache, f) for f in paged.ROW_FIELDS})
            row = dataclasses.replace(row, cache=paged.gather(view))
        layers.append(row)
    return kv_policy.KVState(tuple(layers), part.lengths)


@functools.partial(jax.jit, static_argnames=("size",))
def take_rows(part: kv_policy.KVState, start: jax.Array, size: int) -> dict:
    """A dense one-row state's K/V rows [start, start + size) of every layer."""
    return {f"l{i}": {"k": jax.lax.dynamic_slice_in_dim(layer.k, start, size, axis=1),
                      "v": jax.lax.dynamic_slice_in_dim(layer.v, start, size, axis=1)}
            for i, layer in enumerate(part.layers)}


@functools.partial(jax.jit, donate_argnames=("part",))
def with_rows(part: kv_policy.KVState, rows: dict, start: jax.Array) -> kv_policy.KVState:
    """`take_rows`' inverse: `rows` written at row `start` of every layer."""
    layers = tuple(dataclasses.replace(
        layer, k=jax.lax.dynamic_update_slice_in_dim(layer.k, rows[f"l{i}"]["k"], start, axis=1),
        v=jax.lax.dynamic_update_slice_in_dim(layer.v, rows[f"l{i}"]["v"], start, axis=1))
        for i, layer in enumerate(part.layers))
    return kv_policy.KVState(layers, part.lengths)


@jax.jit
def read_pages(state: kv_policy.KVState, ids: jax.Array) -> dict:
    """Pages `ids` int32 [E] of every paged layer: {"l<i>": {history field: [E, ...]}}."""
    return {f"l{i}": {f: getattr(layer.cache, f)[ids] for f in paged.HIST_FIELDS}
            for i, layer in enumerate(state.layers) if isinstance(layer, kv_policy.PagedLayer)}


@functools.partial(jax.jit, donate_argnames=("state",))
def write_pages(state: kv_policy.KVState, ids: jax.Array, pages: dict) -> kv_policy.KVState:
    """`read_pages`' inverse: `pages` written into pool pages `ids`."""
    def put(i, layer):
        if not isinstance(layer, kv_policy.PagedLayer):
            return layer
        arrays = {f: getattr(layer.cache, f).at[ids].set(pages[f"l{i}"][f]) for f in paged.HIST_FIELDS}
        return dataclasses.replace(layer, cache=dataclasses.replace(layer.cache, **arrays))
    return kv_policy.KVState(tuple(put(i, layer) for i, layer in enumerate(state.layers)), state.lengths)


# ----------------------------------------------------------------------------
# On disk (orbax): the entries' keys, their pages' contents, snapshots and rows

FORMAT_VERSION = 1


def save(path: str | Path, salt: bytes, entries: list[Entry], pages: dict | None) -> None:
    """Write `entries` (`PrefixCache.chains`) under `salt` to the directory `path` (replaced if
    there); pages: `read_pages` of their pages in that order (None: dense policies)."""
    arrays: dict = {"pages": pages} if pages else {}
    for i, entry in enumerate(entries):
        if entry.snapshot is not None:
            arrays.setdefault("snapshots", {})[str(i)] = entry.snapshot
        if entry.rows is not None:
            arrays.setdefault("rows", {})[str(i)] = entry.rows
    meta = {"format_version": FORMAT_VERSION, "salt": salt.hex(),
            "entries": [{"key": e.key.hex(), "parent": e.parent.hex() if e.parent else None, "depth": e.depth,
                         "snapshot": e.snapshot is not None, "rows": e.rows is not None} for e in entries]}
    path = Path(path).absolute()
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    items = {"metadata": ocp.args.JsonSave(meta)}
    if arrays:
        items["arrays"] = ocp.args.StandardSave(arrays)
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckpt:
            ckpt.save(tmp, ocp.args.Composite(**items))
        if path.exists():
            shutil.rmtree(path)
        os.rename(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load(path: str | Path, salt: bytes) -> tuple[list[dict], dict]:
    """`save`'s (entries' metadata, arrays as numpy) from the directory `path`. ValueError when
    it is not a prefix cache or was saved under another salt (another model, weights, policy,
    calibration or engine layout: none of its entries could ever match)."""
    path = Path(path).absolute()
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckpt:
            meta = ckpt.restore(path, ocp.args.Composite(metadata=ocp.args.JsonRestore()))["metadata"]
    except Exception as e:
        raise ValueError(f"prefix cache {str(path)!r} cannot be read ({type(e).__name__}: {e})") from e
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"prefix cache {str(path)!r}: format_version {meta.get('format_version')!r}, "
                         f"expected {FORMAT_VERSION}")
    if meta["salt"] != salt.hex():
        raise ValueError(f"prefix cache {str(path)!r} was saved for another model, weights, KV policy, calibration "
                         "or engine layout (its key salt differs from this engine's): none of its entries can be used")
    if not meta["entries"]:
        return [], {}
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckpt:
        arrays = ckpt.restore(path, ocp.args.Composite(arrays=ocp.args.StandardRestore()))["arrays"]
    return meta["entries"], jax.tree.map(np.asarray, arrays)
