"""PartitionSpecs for the KV state on a device mesh (docs/ARCHITECTURE.md §6).

Logical axes map to mesh axes through one rules table (`DEFAULT_RULES`): batch -> `data`,
KV heads (and the query heads and MLP columns of a decoder's weights) -> `model`, the
quantised history's tokens -> `seq`. A logical axis is replicated when its mesh axis is
absent or does not divide it (SmolLM2's 3 KV heads on a 4-way model axis). A `model` axis
larger than the KV heads is met by repeating each KV head on several devices instead
(`kv_head_copies`, `repeat_kv_heads`: what `oscar_jax.models.parallel` places on such a
mesh), after which the repeated heads divide it. The bf16 sink and recent ring are never
split along tokens: under `seq` every device holds them (`oscar_jax.parallel`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from oscar_jax.cache import LayerParams, OscarCache, RingCache
from oscar_jax.paged import PagedCache

# logical axis -> mesh axis. "heads" (query heads), "mlp" (MLP columns) and "vocab" (LM-head
# columns) name decoder weights (oscar_jax.models.parallel); the rest the KV state.
DEFAULT_RULES = {"batch": "data", "kv_heads": "model", "heads": "model", "mlp": "model", "vocab": "model",
                 "seq": "seq"}

# Logical axes of each per-layer leaf (the stacked form adds "layers" in front).
_KV = ("batch", "kv_heads", "seq", "head_dim")
_WINDOW = ("batch", "kv_heads", "window", "head_dim")  # the sink and the ring: never split along tokens
_CHANNEL_MAJOR = ("batch", "kv_heads", "head_dim", "seq")  # the packed V codes
_META = ("batch", "kv_heads", "groups", "slice", "seq")
_LOGICAL = {
    OscarCache: {
        "sink_k": _WINDOW, "sink_v": _WINDOW, "hist_codes_k": _KV, "hist_codes_v": _CHANNEL_MAJOR,
        "hist_lo_k": _META, "hist_scale_k": _META, "hist_lo_v": _META, "hist_scale_v": _META,
        "recent_k": _WINDOW, "recent_v": _WINDOW, "lengths": ("batch",), "overflow": ("batch",),
    },
    RingCache: {"k": _WINDOW, "v": _WINDOW, "lengths": ("batch",)},
    # The page pool's leading axis is its pages (replicated: every data shard's slots may own any
    # page); KV heads shard as in the contiguous cache.
    PagedCache: {
        "sink_k": _WINDOW, "sink_v": _WINDOW, "recent_k": _WINDOW, "recent_v": _WINDOW, "lengths": ("batch",),
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


def mesh_axis(logical: str | None, count: int, mesh: Mesh, rules: dict[str, str] | None = None) -> str | None:
    """The mesh axis that splits `count` items of logical axis `logical` (a size, or a head
    count for a flattened heads x head_dim axis), or None (replicated): the rule's axis must be
    in the mesh and divide `count`."""
    rules = DEFAULT_RULES if rules is None else rules
    m = rules.get(logical) if logical is not None else None
    return m if m is not None and m in mesh.shape and count % mesh.shape[m] == 0 else None


def kv_head_copies(kv_heads: int, query_heads: int, mesh: Mesh, rules: dict[str, str] | None = None) -> int:
    """On how many devices each of `kv_heads` KV heads (serving `query_heads` query heads) lies
    when the rules' mesh axis for "kv_heads", of size m, splits them: m / kv_heads where m is a
    larger multiple of kv_heads that divides query_heads (vLLM's layout: each KV head repeated on
    m / kv_heads consecutive devices, each device one KV head and query_heads / m of its query
    heads); else 1 (m divides kv_heads: whole KV heads per device; or the axis is absent, or
    splits neither way: replicated, `mesh_axis`)."""
    rules = DEFAULT_RULES if rules is None else rules
    m = mesh.shape.get(rules.get("kv_heads"), 1)
    if m > kv_heads and m % kv_heads == 0 and query_heads % m == 0:
        return m // kv_heads
    return 1


def repeat_kv_heads(tree, copies: int):
    """`tree` (a type of `partition_specs`, stacked or per layer) with each KV head repeated
    `copies` times consecutively along every array's "kv_heads" axis (and a cache's spec saying
    so): new head j is head j // copies. Attention is unchanged when query head h of G per KV
    head keeps KV head h // (G / copies) (`kv_head_copies`)."""
    logical = _LOGICAL.get(type(tree))
    if logical is None:
        raise TypeError(f"repeat_kv_heads: unsupported type {type(tree).__name__}")
    if copies == 1:
        return tree

    def repeat(name, x):
        axes = logical[name]
        if "kv_heads" not in axes:
            return x
        return jnp.repeat(x, copies, axis=x.ndim - len(axes) + axes.index("kv_heads"))

    fields = {f.name: getattr(tree, f.name) for f in dataclasses.fields(tree) if not f.metadata.get("static")}
    fields = {k: None if v is None else repeat(k, v) for k, v in fields.items()}
    if hasattr(tree, "spec"):
        fields["spec"] = dataclasses.replace(tree.spec, kv_heads=tree.spec.kv_heads * copies)
    return dataclasses.replace(tree, **fields)


def spec(*axes: str | None) -> P:
    """PartitionSpec of `axes` without its trailing Nones: the form a compiled program returns,
    so that a jitted step's outputs equal its inputs' shardings (one compilation)."""
    axes = list(axes)
    while axes and axes[-1] is None:
        axes.pop()
    return P(*axes)


def partition_specs(tree, mesh: Mesh, rules: dict[str, str] | None = None):
    """PartitionSpec pytree (same structure as `tree`: an OscarCache, RingCache, PagedCache or
    LayerParams, stacked or per-layer) for `mesh`."""
    logical = _LOGICAL.get(type(tree))
    if logical is None:
        raise TypeError(f"partition_specs: unsupported type {type(tree).__name__}")

    def spec_for(name, x):
        axes = logical[name]
        axes = ("layers",) * (x.ndim - len(axes)) + axes
        return spec(*(mesh_axis(axis, size, mesh, rules) for axis, size in zip(axes, x.shape)))

    fields = {f.name: getattr(tree, f.name) for f in dataclasses.fields(tree)
              if not f.metadata.get("static")}
    return dataclasses.replace(tree, **{k: None if v is None else spec_for(k, v)
                                        for k, v in fields.items()})


def shardings(tree, mesh: Mesh, rules: dict[str, str] | None = None):
    """NamedSharding pytree for `tree` on `mesh` (derived from `partition_specs`)."""
    return jax.tree.map(lambda p: NamedSharding(mesh, p), partition_specs(tree, mesh, rules),
                        is_leaf=lambda x: isinstance(x, P))
