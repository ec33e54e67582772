"""One layer's append + attend and prompt write on a device mesh, inside `jax.shard_map`
(docs/ARCHITECTURE.md §6, docs/serving.md §7).

The cache and its params lie as `oscar_jax.sharding` places them: batch over `data`, KV heads
(with their query heads) over `model`, and the quantised history's tokens over `seq`. Each
device runs the one-device code on its own shard, so the attention kernels (Mosaic GPU,
Triton, TPU) run per device on plain local arrays:

- `data` and `model` only: `updates.append` then `attention.attend` (any implementation) on
  the local cache; no collective.
- with `seq` (sequence parallel): the sink and the ring are replicated, every device
  appends the new tokens to them (the same few bytes everywhere), and the token they push
  out of the ring is quantised into the history on the one device whose slice holds its
  position (`updates.append(history_offset=...)`). Each device attends its history slice
  with the implementation one device would use (`attention.attend(history_offset=...)`:
  any kernel, or XLA), the device holding the first slice the sink and ring too, which
  gives a partial output (float32, the model's basis) and its log-sum-exp; one
  `all_gather` over `seq` brings every device's partial to every device, and each merges
  them (`reference.merge_partials`): one collective per layer.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from oscar_jax import attention, reference, sharding, updates
from oscar_jax.cache import LayerParams, OscarCache
from oscar_jax.config import HIST_TILE, CacheSpec


def local_spec(spec: CacheSpec, mesh: Mesh, rules: dict[str, str] | None = None) -> CacheSpec:
    """`spec` as one device of `mesh` sees its shard: batch and KV heads divided by the mesh
    axes that split them (max_len, and with it the overflow check, stays the global one)."""
    div = lambda logical, n: n // mesh.shape[a] if (a := sharding.mesh_axis(logical, n, mesh, rules)) else n
    return dataclasses.replace(spec, batch=div("batch", spec.batch), kv_heads=div("kv_heads", spec.kv_heads))


def seq_axis(cache: OscarCache, mesh: Mesh, rules: dict[str, str] | None = None) -> str | None:
    """The mesh axis that splits `cache`'s history along tokens (None: not split).
    ValueError when the mesh has the rules' `seq` axis (size > 1) but the history does not
    split into equal slices of whole packed rows, whole `HIST_TILE`s each once the history is
    longer than one tile (the layout every attention kernel takes of a whole history;
    `seq_max_len` gives a max_len whose history splits so)."""
    rules = sharding.DEFAULT_RULES if rules is None else rules
    axis = rules.get("seq")
    if axis is None or mesh.shape.get(axis, 1) == 1:
        return None
    rows, tpb = cache.hist_codes_k.shape[-2], cache.spec.quant.tokens_per_byte
    if (rows * tpb) % _slice_unit(rows * tpb, tpb, mesh.shape[axis]):
        raise ValueError(f"the history's {rows} packed rows do not split over {axis}={mesh.shape[axis]} (whole "
                         f"{HIST_TILE}-token tiles a slice where longer than one tile): allocate max_len with "
                         f"parallel.seq_max_len (max_len={cache.spec.max_len})")
    return axis


def _slice_unit(tokens: int, tokens_per_byte: int, parts: int) -> int:
    """History tokens that a history of `tokens` must be a multiple of to split into `parts`
    slices: whole packed rows each, whole `HIST_TILE`s once longer than one tile."""
    return (HIST_TILE if tokens > HIST_TILE else tokens_per_byte) * parts


def seq_max_len(spec: CacheSpec, parts: int) -> int:
    """The smallest max_len >= spec.max_len whose history splits into `parts` equal slices of
    whole packed rows (whole `HIST_TILE`s per slice once the history is longer than one tile)."""
    max_len = spec.max_len
    while True:
        s = dataclasses.replace(spec, max_len=max_len)
        unit = _slice_unit(s.hist_capacity, s.quant.tokens_per_byte, parts)
        if s.hist_capacity % unit == 0:
            return max_len
        max_len += unit - s.hist_capacity % unit


def _query_spec(cache_specs: OscarCache) -> P:
    """q, k, v, o [B, C, H, D]: batch and heads as the cache splits them (query head h * g + i
    belongs to KV head h, so contiguous blocks of query heads go with their KV heads)."""
    batch, heads = (*cache_specs.recent_k, None, None)[:2]
    return sharding.spec(batch, None, heads)


def _on_shards(fn, cache: OscarCache, params: LayerParams, args: tuple, arg_specs: tuple, out_spec, mesh: Mesh,
               rules: dict[str, str] | None):
    """fn(local cache, local params, *local args) -> (out, local cache), run on every device's shard
    by shard_map; returns (out, cache). The local cache carries `local_spec`. Zero-size arrays (a
    cache without history) stay outside shard_map (XLA:CPU cannot compile them there): each device
    makes its own empty one."""
    cache_specs = sharding.partition_specs(cache, mesh, rules)
    param_specs = sharding.partition_specs(params, mesh, rules)
    spec, local = cache.spec, local_spec(cache.spec, mesh, rules)
    empty = {f.name: getattr(cache, f.name) for f in dataclasses.fields(cache)
             if not f.metadata.get("static") and getattr(cache, f.name).size == 0}
    local_shape = lambda x, p: tuple(n // mesh.shape[a] if a else n for n, a in zip(x.shape, (*p, *[None] * x.ndim)))
    local_empty = {name: jax.ShapeDtypeStruct(local_shape(x, getattr(cache_specs, name)), x.dtype)
                   for name, x in empty.items()}
    cache, cache_specs = (dataclasses.replace(t, **dict.fromkeys(empty)) for t in (cache, cache_specs))

    def body(cache, params, *args):
        zeros = {n: jnp.zeros(x.shape, x.dtype) for n, x in local_empty.items()}
        out, cache = fn(dataclasses.replace(cache, spec=local, **zeros), params, *args)
        return out, dataclasses.replace(cache, spec=spec, **dict.fromkeys(empty))

    out, cache = jax.shard_map(body, mesh=mesh, in_specs=(cache_specs, param_specs, *arg_specs),
                               out_specs=(out_spec, cache_specs), check_vma=False)(cache, params, *args)
    return out, dataclasses.replace(cache, **empty)


def append_attend(cache: OscarCache, params: LayerParams, q: jax.Array, k: jax.Array, v: jax.Array, *,
                  mesh: Mesh, implementation: str = "auto", softmax_scale: float | None = None,
                  interpret: bool = False, rules: dict[str, str] | None = None) -> tuple[jax.Array, OscarCache]:
    """`attention.append_attend` of a chunk (k, v appended, then q attends; any C) over one
    layer's cache sharded on `mesh` (`sharding.shardings(cache, mesh, rules)`), each device on
    its shard with `implementation` (as on one device: "auto" picks what the dispatcher picks
    for the whole cache, an explicit kernel raises where it cannot run the call; interpret:
    Pallas interpret mode). q [B, C, Hq, D], k, v [B, C, Hkv, D] post-RoPE (global shapes).
    Returns (o [B, C, Hq, D], cache)."""
    qkv = _query_spec(sharding.partition_specs(cache, mesh, rules))
    seq = seq_axis(cache, mesh, rules)

    def body(cache, params, q, k, v):
        run = lambda offset: attention.append_attend(q, k, v, cache, params, implementation=implementation,
                                                     softmax_scale=softmax_scale, interpret=interpret,
                                                     history_offset=offset)
        if seq is None:
            o, _, cache = run(None)
            return o, cache
        slice_tokens = cache.hist_codes_k.shape[-2] * cache.spec.quant.tokens_per_byte
        o, lse, cache = run(jax.lax.axis_index(seq) * slice_tokens)
        parts = jax.lax.all_gather(jnp.concatenate([o, lse[..., None]], axis=-1), seq)  # [S, B, C, Hq, D + 1]
        o, _ = reference.merge_partials(list(parts[..., :-1]), list(parts[..., -1]))
        return o.astype(q.dtype), cache

    return _on_shards(body, cache, params, (q, k, v), (qkv,) * 3, qkv, mesh, rules)


def write_prompt(cache: OscarCache, k: jax.Array, v: jax.Array, prompt_lengths: jax.Array, params: LayerParams, *,
                 mesh: Mesh, implementation: str = "auto", rules: dict[str, str] | None = None) -> OscarCache:
    """`updates.write_prompt` of whole prompts (k, v [B, T, Hkv, D], prompt_lengths [B]) into one
    layer's cache sharded on `mesh`: over `data` and `model` each device writes its own rows and
    heads through `write_prompt`'s implementation (the bulk write kernels run per device); a
    history split over `seq` is written by the partitioner (XLA's quantiser on each slice; a kernel
    implementation runs once over the whole layer, then is sliced)."""
    if seq_axis(cache, mesh, rules) is not None:
        return updates.write_prompt(cache, k, v, prompt_lengths, params, implementation=implementation)
    cache_specs = sharding.partition_specs(cache, mesh, rules)
    kv = _query_spec(cache_specs)

    def body(cache, params, k, v, n):
        return None, updates.write_prompt(cache, k, v, n, params, implementation=implementation)

    return _on_shards(body, cache, params, (k, v, prompt_lengths), (kv, kv, cache_specs.lengths), None, mesh,
                      rules)[1]
