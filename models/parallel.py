"""The decoder on a device mesh (docs/serving.md §7): `--mesh data=D,model=M,seq=S` parsed into a
`jax.sharding.Mesh`, and each weight's `NamedSharding` through `oscar_jax.sharding`'s one rules
table (the KV state's shardings: `kv_policy.state_shardings`).

Tensor parallel in the Megatron layout over `model`: column-parallel (output features split)
w_qkv and b_qkv in whole KV-head groups (each device's query heads with their KV head,
`decoder.fuse`), and w_gate_up in whole (gate, up) column pairs; row-parallel (input features
split) wo and w_down. The residual stream stays whole on every `model` device (and split by
batch over `data`), so each layer costs two all-reduces of its [B, C, H] activations: one after
wo, one after w_down. Norms and the embedding table are replicated (one row gathered per
token); the LM head is split over vocabulary columns.

How the Hkv KV heads meet M = model devices (`kv_groups`):
- M divides Hkv: each device holds Hkv / M whole groups (its KV heads, their query heads).
- M a multiple of Hkv that divides the query heads (vLLM's layout, e.g. a 70B shape's 8 KV
  heads on model=16 or 32): each KV head is repeated on r = M / Hkv consecutive devices, each
  device holding one KV head and Hq / M of its query heads. The model is laid out with M
  KV-head groups: w_qkv's [..., Hkv, G + 2, D] becomes [..., M, G / r + 2, D] (group j: query
  heads j G / r .. (j + 1) G / r - 1 and the k, v columns of KV head j // r; `qkv_layout`),
  b_qkv alike, and the KV state is made with M heads, the OSCAR parameters of KV head j // r
  on head j (`kv_policy.init_on_mesh`). Query head h keeps KV head h // G, so attention is
  unchanged; each device's cache holds one KV head. The model's config, its KV policy and its
  calibration artifacts stay per original KV head: the expansion happens when the model and
  the state are placed on the mesh, and `qkv_layout` lays a model out for any other mesh.
- Otherwise (M neither divides Hkv nor is such a multiple, e.g. SmolLM2's 3 KV heads on
  model=4): w_qkv (query heads included) and the cache are replicated on every `model`
  device, as `oscar_jax.sharding` replicates any axis its mesh axis does not divide, so
  attention is not tensor parallel there.

Weights go straight into their shards: a checkpoint tensor is read on the host (where a
repeated layout is made) and each device receives only its slice (`place`,
`jax.make_array_from_callback`); random weights are created by a program whose outputs are
already sharded (`init_decoder`).
"""

from __future__ import annotations

import functools
import math
import re
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from oscar_jax import sharding
from oscar_jax.models.config import ModelConfig
from oscar_jax.models.decoder import Decoder, abstract_decoder, fuse, qkv_groups, unfuse

AXES = ("data", "model", "seq")  # the mesh axes the rules table knows


def parse_mesh(text: str, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """"data=2,model=4" (axes from `AXES`, each once, sizes >= 1, their product the number of
    `devices`, default all) -> Mesh with those axes in that order. ValueError naming what is wrong."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = {}
    for part in text.split(","):
        m = re.fullmatch(r"\s*([a-z]+)\s*=\s*(\d+)\s*", part)
        if m is None:
            raise ValueError(f"mesh {text!r}: expected axis=size pairs like data=2,model=4")
        axis, size = m.group(1), int(m.group(2))
        if axis not in AXES:
            raise ValueError(f"mesh {text!r}: unknown axis {axis!r}; expected some of {', '.join(AXES)}")
        if axis in sizes:
            raise ValueError(f"mesh {text!r}: axis {axis!r} given twice")
        if size < 1:
            raise ValueError(f"mesh {text!r}: {axis}={size}; expected a size >= 1")
        sizes[axis] = size
    if math.prod(sizes.values()) != len(devices):
        raise ValueError(f"mesh {text!r}: {' x '.join(map(str, sizes.values()))} = {math.prod(sizes.values())} "
                         f"devices; this process has {len(devices)}")
    return Mesh(np.array(devices).reshape(tuple(sizes.values())), tuple(sizes))


def check_model(cfg: ModelConfig, mesh: Mesh) -> None:
    """ValueError unless the model splits over the mesh's `model` axis: whole query heads and
    whole MLP columns per device (the KV heads split, repeat or replicate: `kv_groups`)."""
    m = mesh.shape.get("model", 1)
    for what, n in (("query heads (num_heads)", cfg.num_heads), ("MLP columns (intermediate_size)",
                                                                  cfg.intermediate_size)):
        if n % m:
            raise ValueError(f"mesh model={m}: the model's {n} {what} do not divide over it")


def kv_groups(cfg: ModelConfig, mesh: Mesh | None) -> int:
    """The KV-head groups the model and its KV state take on `mesh` (module docstring): Hkv,
    or M = model where each KV head is repeated on M / Hkv devices
    (`oscar_jax.sharding.kv_head_copies`)."""
    if mesh is None:
        return cfg.num_kv_heads
    return cfg.num_kv_heads * sharding.kv_head_copies(cfg.num_kv_heads, cfg.num_heads, mesh)


def qkv_layout(cfg: ModelConfig, x, groups: int):
    """A fused q/k/v (w_qkv [H, out] or b_qkv [out], numpy or jax, in any `decoder.qkv_groups`
    layout) with `groups` KV-head groups: Hkv (the checkpoint's `decoder.fuse` layout) or a
    multiple r Hkv dividing the query heads, each KV head's k, v columns then repeated r times
    consecutively, each group holding G / r query heads. The query columns keep their order."""
    hkv, d = cfg.num_kv_heads, cfg.head_dim
    if groups % hkv or cfg.num_heads % groups:
        raise ValueError(f"qkv_layout: groups={groups}; expected a multiple of num_kv_heads={hkv} that "
                         f"divides num_heads={cfg.num_heads}")
    held = qkv_groups(cfg, x.shape[-1])
    if held == groups:
        return x
    xp = np if isinstance(x, np.ndarray) else jnp
    q, k, v = unfuse(cfg, "w_qkv", x)

    def heads(a):  # [..., held * D] -> each of the Hkv KV heads once, then `groups // Hkv` times
        a = a.reshape(*a.shape[:-1], held, d)[..., ::held // hkv, :]
        return xp.repeat(a, groups // hkv, axis=-2).reshape(*a.shape[:-2], groups * d)

    return fuse(cfg, "w_qkv", (q, heads(k), heads(v)))


QKV = ("w_qkv", "b_qkv")  # the parameters laid out by KV-head groups (`qkv_layout`)


# Per parameter: the logical axis of each dimension and the count it must divide (heads for a
# flattened heads x head_dim axis, so a head is never cut).
def _weight_axes(cfg: ModelConfig, groups: int) -> dict[str, tuple[tuple[str, int] | None, ...]]:
    heads, kv, mlp = ("heads", cfg.num_heads), ("kv_heads", groups), ("mlp", cfg.intermediate_size)
    return {"w_qkv": (None, kv), "b_qkv": (kv,), "wo": (heads, None),
            "w_gate_up": (None, mlp), "w_down": (mlp, None),
            "lm_head": (None, ("vocab", cfg.vocab_size))}


def param_spec(cfg: ModelConfig, mesh: Mesh, name: str, ndim: int) -> P:
    """The PartitionSpec of decoder parameter `name` (a layer's "w_qkv", ... or "embed", "lm_head",
    "final_norm") of `ndim` dimensions, w_qkv and b_qkv in the mesh's `kv_groups` layout;
    replicated where the rules table names no split."""
    axes = _weight_axes(cfg, kv_groups(cfg, mesh)).get(name, (None,) * ndim)
    return sharding.spec(*(None if a is None else sharding.mesh_axis(a[0], a[1], mesh) for a in axes))


def param_sharding(cfg: ModelConfig, mesh: Mesh, name: str, ndim: int) -> NamedSharding:
    return NamedSharding(mesh, param_spec(cfg, mesh, name, ndim))


def place(x: np.ndarray, cfg: ModelConfig, mesh: Mesh, name: str, dtype) -> jax.Array:
    """A host tensor of parameter `name` (w_qkv, b_qkv: in any KV-head layout, the checkpoint's
    `decoder.fuse` one included) as a global array on `mesh`: w_qkv and b_qkv laid out for the
    mesh on the host (`qkv_layout`), then each device receives its own slice only, cast to `dtype`."""
    if name in QKV:
        x = qkv_layout(cfg, x, kv_groups(cfg, mesh))
    return jax.make_array_from_callback(x.shape, param_sharding(cfg, mesh, name, x.ndim),
                                        lambda index: np.asarray(x[index], dtype))


def _pure_shardings(cfg: ModelConfig, mesh: Mesh, pure: dict) -> dict:
    """NamedShardings in the structure of a decoder's `nnx.to_pure_dict` state."""
    out = {}
    for name, value in pure.items():
        if name == "layers":
            out[name] = {i: {p: param_sharding(cfg, mesh, p, x.ndim) for p, x in layer.items()}
                         for i, layer in value.items()}
        else:
            out[name] = None if value is None else param_sharding(cfg, mesh, name, value.ndim)
    return out


def shard(model, mesh: Mesh):
    """`model` (a `Decoder`) with every weight moved into its shards on `mesh`, w_qkv and b_qkv
    laid out for the mesh's `kv_groups` by a program whose outputs are already sharded (the
    other weights move as they are; those already in place stay)."""
    cfg = model.cfg
    check_model(cfg, mesh)
    graphdef, state = nnx.split(model)
    pure = nnx.to_pure_dict(state)
    shardings = _pure_shardings(cfg, mesh, pure)
    groups = kv_groups(cfg, mesh)
    relayout = {name: jax.jit(functools.partial(qkv_layout, cfg, groups=groups),  # one program per parameter
                              out_shardings=param_sharding(cfg, mesh, name, ndim)) for name, ndim in zip(QKV, (2, 1))}
    for layer in pure["layers"].values():
        for name in QKV:
            if name in layer and qkv_groups(cfg, layer[name].shape[-1]) != groups:
                layer[name] = relayout[name](layer[name])
    nnx.replace_by_pure_dict(state, jax.device_put(pure, shardings))
    return nnx.merge(graphdef, state)


def init_decoder(cfg: ModelConfig, mesh: Mesh, *, dtype=jnp.float32, seed: int = 0):
    """A `Decoder` with random weights (those of `Decoder(cfg, rngs=nnx.Rngs(seed))`, w_qkv and
    b_qkv laid out for the mesh's `kv_groups`) created in their shards on `mesh`: no device ever
    holds the whole model."""
    check_model(cfg, mesh)
    graphdef, state = nnx.split(abstract_decoder(cfg, dtype))
    pure = nnx.to_pure_dict(state)
    groups = kv_groups(cfg, mesh)

    def make():
        made = nnx.to_pure_dict(nnx.split(Decoder(cfg, rngs=nnx.Rngs(seed), dtype=dtype))[1])
        for layer in made["layers"].values():
            layer.update({name: qkv_layout(cfg, layer[name], groups) for name in QKV if name in layer})
        return made

    nnx.replace_by_pure_dict(state, jax.jit(make, out_shardings=_pure_shardings(cfg, mesh, pure))())
    return nnx.merge(graphdef, state)
