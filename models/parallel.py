"""The decoder on a device mesh (docs/serving.md §7): `--mesh data=D,model=M,seq=S` parsed into a
`jax.sharding.Mesh`, and each weight's `NamedSharding` through `oscar_jax.sharding`'s one rules
table (the KV state's shardings: `kv_policy.state_shardings`).

Tensor parallel in the Megatron layout over `model`: column-parallel (output features split)
w_qkv and b_qkv in whole KV-head groups (each device's query heads with their KV head,
`decoder.fuse`), and w_gate_up in whole (gate, up) column pairs; row-parallel (input features
split) wo and w_down. The residual stream stays whole on every `model` device (and split by
batch over `data`), so each layer costs two all-reduces of its [B, C, H] activations: one after
wo, one after w_down. Where the KV heads do not divide over `model`, w_qkv (query heads
included) and the cache are replicated, as `oscar_jax.sharding` replicates any axis its mesh
axis does not divide. Norms and the embedding table are replicated (one row gathered per
token); the LM head is split over vocabulary columns.

Weights go straight into their shards: a checkpoint tensor is read on the host and each
device receives only its slice (`place`, `jax.make_array_from_callback`); random weights are
created by a program whose outputs are already sharded (`init_decoder`).
"""

from __future__ import annotations

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
    whole MLP columns per device (KV heads that do not divide are replicated instead)."""
    m = mesh.shape.get("model", 1)
    for what, n in (("query heads (num_heads)", cfg.num_heads), ("MLP columns (intermediate_size)",
                                                                  cfg.intermediate_size)):
        if n % m:
            raise ValueError(f"mesh model={m}: the model's {n} {what} do not divide over it")


# Per parameter: the logical axis of each dimension and the count it must divide (heads for a
# flattened heads x head_dim axis, so a head is never cut).
def _weight_axes(cfg: ModelConfig) -> dict[str, tuple[tuple[str, int] | None, ...]]:
    heads, kv, mlp = ("heads", cfg.num_heads), ("kv_heads", cfg.num_kv_heads), ("mlp", cfg.intermediate_size)
    return {"w_qkv": (None, kv), "b_qkv": (kv,), "wo": (heads, None),
            "w_gate_up": (None, mlp), "w_down": (mlp, None),
            "lm_head": (None, ("vocab", cfg.vocab_size))}


def param_spec(cfg: ModelConfig, mesh: Mesh, name: str, ndim: int) -> P:
    """The PartitionSpec of decoder parameter `name` (a layer's "wq", ... or "embed", "lm_head",
    "final_norm") of `ndim` dimensions; replicated where the rules table names no split."""
    axes = _weight_axes(cfg).get(name, (None,) * ndim)
    return sharding.spec(*(None if a is None else sharding.mesh_axis(a[0], a[1], mesh) for a in axes))


def param_sharding(cfg: ModelConfig, mesh: Mesh, name: str, ndim: int) -> NamedSharding:
    return NamedSharding(mesh, param_spec(cfg, mesh, name, ndim))


def place(x: np.ndarray, cfg: ModelConfig, mesh: Mesh, name: str, dtype) -> jax.Array:
    """A host tensor of parameter `name` as a global array on `mesh`: each device receives
    its own slice only, cast to `dtype`."""
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
    """`model` (a `Decoder`) with every weight moved into its shards on `mesh`."""
    check_model(model.cfg, mesh)
    graphdef, state = nnx.split(model)
    pure = nnx.to_pure_dict(state)
    nnx.replace_by_pure_dict(state, jax.device_put(pure, _pure_shardings(model.cfg, mesh, pure)))
    return nnx.merge(graphdef, state)


def init_decoder(cfg: ModelConfig, mesh: Mesh, *, dtype=jnp.float32, seed: int = 0):
    """A `Decoder` with random weights (those of `Decoder(cfg, rngs=nnx.Rngs(seed))`) created in
    their shards on `mesh`: no device ever holds the whole model."""
    from oscar_jax.models.decoder import Decoder, abstract_decoder

    check_model(cfg, mesh)
    graphdef, state = nnx.split(abstract_decoder(cfg, dtype))
    pure = nnx.to_pure_dict(state)
    make = lambda: nnx.to_pure_dict(nnx.split(Decoder(cfg, rngs=nnx.Rngs(seed), dtype=dtype))[1])
    nnx.replace_by_pure_dict(state, jax.jit(make, out_shardings=_pure_shardings(cfg, mesh, pure))())
    return nnx.merge(graphdef, state)
