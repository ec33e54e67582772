"""The implementations `attend`, `write_prompt` and `append` dispatch to: one registry, one set of names.

  "xla"                pure jnp (the reference attention, write_prompt's XLA quantiser), any backend;
  "pallas"             Pallas GPU kernels, Triton lowering;
  "pallas_mosaic_gpu"  Pallas Mosaic GPU kernels for Hopper (sm_90: TMA + wgmma);
  "pallas_tpu"         Pallas TPU (Mosaic) kernels;
  "cudnn"              cuDNN's flash attention over the cache dequantised to bf16 (attend only);
  "auto"               the first of `AUTO_ORDER[backend]` that runs on this device and supports
                       the call (on CPU: "xla").

A kernel implementation runs on its platform's backend ("gpu" or "tpu"; Mosaic GPU only on an
sm_90 device) or, with `interpret=True`, in Pallas interpret mode on any backend (tests on
CPU; "cudnn" is no Pallas kernel and runs on a GPU only). An explicit request that cannot run
raises a ValueError saying why; only "auto" chooses, and it never interprets.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from oscar_jax.config import CacheSpec
from oscar_jax.pallas_kernels.gpu import hopper

OPS = ("attend", "write", "append", "paged_attend")
NAMES = ("xla", "pallas", "pallas_mosaic_gpu", "pallas_tpu", "cudnn")
# The backend each implementation compiles for (None: any).
PLATFORMS = {"xla": None, "pallas": "gpu", "pallas_mosaic_gpu": "gpu", "pallas_tpu": "tpu", "cudnn": "gpu"}
# What "auto" tries per backend, fastest measured first.
AUTO_ORDER = {"gpu": ("pallas_mosaic_gpu", "pallas", "xla"), "tpu": ("pallas_tpu", "xla"), "cpu": ("xla",)}
# Devices of the platform an implementation needs: (check of the default device, what it needs).
_DEVICES = {"pallas_mosaic_gpu": (lambda: hopper.device_supported(), "an sm_90 (Hopper) GPU")}
_COMPILED_ONLY = ("cudnn",)  # not Pallas: no interpret mode

# (cache spec, C queries per call, g query heads per KV head) -> whether the kernel handles it;
# a write passes C = g = 1, an append C new tokens and g = 1.
SupportsFn = Callable[[CacheSpec, int, int], bool]
_REGISTRY: dict[tuple[str, str], tuple[Callable | None, SupportsFn]] = {}


def _always(spec: CacheSpec, queries: int, group: int) -> bool:
    return True


def register(op: str, name: str, fn: Callable | None, supports: SupportsFn = _always) -> None:
    """Make `fn` the `op` ("attend", "write", "append", or "paged_attend": attention through a
    block table, `oscar_jax.paged`) of implementation `name` (one of NAMES);
    supports(spec, C, g): the calls it can run. The op defines fn's signature (fn None: the
    op's own XLA code)."""
    if op not in OPS:
        raise ValueError(f"op={op!r}: expected one of {OPS}")
    if name not in NAMES:
        raise ValueError(f"implementation name {name!r}: expected one of {NAMES}")
    _REGISTRY[op, name] = (fn, supports)


def available(op: str) -> tuple[str, ...]:
    """The implementations registered for `op`."""
    return tuple(name for name in NAMES if (op, name) in _REGISTRY)


def get(op: str, name: str) -> Callable | None:
    """The registered `op` of implementation `name` (after `resolve`)."""
    return _REGISTRY[op, name][0]


def _runs_here(name: str, backend: str, interpret: bool = False) -> str | None:
    """Why implementation `name` cannot run on `backend` (None: it can); interpret: a Pallas
    kernel runs anywhere in interpret mode."""
    platform = PLATFORMS[name]
    if interpret and name not in _COMPILED_ONLY:
        return None
    if platform is not None and platform != backend:
        hint = "" if name in _COMPILED_ONLY else " (pass interpret=True to run it in Pallas interpret mode)"
        return f"it compiles for the {platform!r} backend and the default backend is {backend!r}{hint}"
    check, needs = _DEVICES.get(name, (lambda: True, ""))
    if not check():
        return f"it needs {needs} and the default device is a {jax.devices()[0].device_kind}"
    return None


def _describe(op: str, spec: CacheSpec, queries: int, group: int) -> str:
    q = spec.quant
    call = (f"this {op} (cache: {q.bits}-bit {q.codebook} codes, group size {spec.group_size}, D={spec.head_dim}, "
            f"{jnp.dtype(q.jnp_scale_dtype).name} metadata")
    return call + (f"; C={queries} queries, g={group} query heads per KV head)" if op == "attend" else ")")


def resolve(op: str, implementation: str, spec: CacheSpec, *, queries: int = 1, group: int = 1,
            backend: str | None = None, interpret: bool = False) -> str:
    """The implementation `op` runs for this request, cache spec, call (C = `queries` new
    queries, g = `group` query heads per KV head) and backend (default: JAX's); interpret:
    an explicit kernel implementation may run in Pallas interpret mode."""
    backend = backend or jax.default_backend()
    if implementation == "auto":
        for name in AUTO_ORDER.get(backend, ("xla",)):
            if (op, name) in _REGISTRY and _runs_here(name, backend) is None \
                    and _REGISTRY[op, name][1](spec, queries, group):
                return name
        return "xla"
    if implementation not in NAMES:
        raise ValueError(f"implementation={implementation!r}: expected 'auto' or one of {NAMES}")
    if (op, implementation) not in _REGISTRY:
        raise ValueError(f"implementation={implementation!r} has no {op} in this build (available: "
                         f"{available(op)}); use implementation='auto' to let oscar-jax choose")
    if not _REGISTRY[op, implementation][1](spec, queries, group):
        raise ValueError(f"implementation={implementation!r} does not support {_describe(op, spec, queries, group)}; "
                         "use implementation='xla' or 'auto'")
    why = _runs_here(implementation, backend, interpret)
    if why:
        raise ValueError(f"implementation={implementation!r} cannot run here: {why}; or use implementation='auto'")
    return implementation
