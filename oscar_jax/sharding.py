"""PartitionSpecs for the KV state on a device mesh (docs/ARCHITECTURE.md §6).

Logical axes map to mesh axes through one rules table: batch -> `data`,
kv_heads -> `model`. A logical axis is replicated when its size is not a
multiple of the mesh axis (SmolLM2's 3 KV heads on a 4-way model axis).
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from oscar_jax.cache import LayerParams, OscarCache, RingCache
from oscar_jax.paged import PagedCache

DEFAULT_RULES = {"batch": "data", "kv_heads": "model"}

# Logical axes of each per-layer leaf (the stacked form adds "layers" in front).
_KV = ("batch", "kv_heads", "seq", "head_dim")
_CHANNEL_MAJOR = ("batch", "kv_heads", "head_dim", "seq")  # the packed V codes
_META = ("batch", "kv_heads", "groups", "slice", "seq")
_LOGICAL = {
    OscarCache: {
        "sink_k": _KV, "sink_v": _KV, "hist_codes_k": _KV, "hist_codes_v": _CHANNEL_MAJOR,
        "hist_lo_k": _META, "hist_scale_k": _META, "hist_lo_v": _META, "hist_scale_v": _META,
        "recent_k": _KV, "recent_v": _KV, "lengths": ("batch",), "overflow": ("batch",),
    },
    RingCache: {"k": _KV, "v": _KV, "lengths": ("batch",)},
    # The page pool's leading axis is its pages (replicated: every data shard's slots may own any
    # page); KV heads shard as in the contiguous cache.
    PagedCache: {
        "sink_k": _KV, "sink_v": _KV, "recent_k": _KV, "recent_v": _KV, "lengths": ("batch",),
        "overflow": ("batch",), "block_table": ("batch", "page_slots"),
        "hist_codes_k": ("pages",) + _KV[1:], "hist_codes_v": ("pages",) + _CHANNEL_MAJOR[1:],
        "hist_lo_k": ("pages",) + _META[1:], "hist_scale_k": ("pages",) + _META[1:],
        "hist_lo_v": ("pages",) + _META[1:], "hist_scale_v": ("pages",) + _META[1:],
    },
    LayerParams: {"rot_k": ("kv_heads", "head_dim", "head_dim"),
                  "rot_v": ("kv_heads", "head_dim", "head_dim"), "clip_k": (), "clip_v": (),
                  "dual_k": ("kv_heads", "head_dim", "head_dim"),
                  "dual_v": ("kv_heads", "head_dim", "head_dim"), "k_shift": ("kv_heads", "head_dim"),
                  "query_rot_parts": ("kv_heads", "parts", "head_dim", "head_dim"),
                  "output_rot_parts": ("kv_heads", "parts", "head_dim", "head_dim"),
                  "query_rot_stats": ("kv_heads", "stat", "head_dim")},
}


def partition_specs(tree, mesh: Mesh, rules: dict[str, str] | None = None):
    """PartitionSpec pytree (same structure as `tree`: an OscarCache, RingCache, PagedCache or
    LayerParams, stacked or per-layer) for `mesh`."""
    rules = DEFAULT_RULES if rules is None else rules
    logical = _LOGICAL.get(type(tree))
    if logical is None:
        raise TypeError(f"partition_specs: unsupported type {type(tree).__name__}")

    def spec_for(name, x):
        axes = logical[name]
        axes = ("layers",) * (x.ndim - len(axes)) + axes
        mesh_axes = []
        for axis, size in zip(axes, x.shape):
            m = rules.get(axis)
            ok = m is not None and m in mesh.shape and size % mesh.shape[m] == 0
            mesh_axes.append(m if ok else None)
        return P(*mesh_axes)

    fields = {f.name: getattr(tree, f.name) for f in dataclasses.fields(tree)
              if not f.metadata.get("static")}
    return dataclasses.replace(tree, **{k: None if v is None else spec_for(k, v)
                                        for k, v in fields.items()})


def shardings(tree, mesh: Mesh, rules: dict[str, str] | None = None):
    """NamedSharding pytree for `tree` on `mesh` (derived from `partition_specs`)."""
    return jax.tree.map(lambda p: NamedSharding(mesh, p), partition_specs(tree, mesh, rules),
                        is_leaf=lambda x: isinstance(x, P))
