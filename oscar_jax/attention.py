"""Public per-layer attention over the mixed cache, with backend dispatch (DESIGN §1.3).

`attend(q, layer_cache, layer_params, implementation=...)`:
  "xla"    the pure-jnp reference (`oscar_jax.reference`), any backend;
  "pallas" the GPU Pallas kernel (Triton lowering);
  "pallas_mosaic_gpu" the Hopper (sm_90) decode kernel (Pallas Mosaic GPU: TMA + wgmma);
  "pallas_tpu" the TPU Pallas kernel;
  "auto"   the best implementation for the default backend, the cache and the call
           (C queries, g query heads per KV head).
An explicit request that cannot run raises; only "auto" chooses.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from oscar_jax import reference
from oscar_jax.cache import LayerParams, OscarCache, RingCache
from oscar_jax.config import CacheSpec
from oscar_jax.pallas_kernels import layout

AttendFn = Callable[..., tuple[jax.Array, jax.Array]]
# (cache spec, C queries per call, g query heads per KV head) -> bool
SupportsFn = Callable[[CacheSpec, int, int], bool]


def _always(spec: CacheSpec, queries: int, group: int) -> bool:
    return True


# Kernel implementations register here: name -> (fn(q, cache, params, softmax_scale=...),
# supports: the calls it handles).
_IMPLEMENTATIONS: dict[str, tuple[AttendFn, SupportsFn]] = {"xla": (reference.attend, _always)}
_KNOWN = ("xla", "pallas", "pallas_mosaic_gpu", "pallas_tpu")
# What "auto" tries per backend, best first.
_AUTO_ORDER = {"gpu": ("pallas_mosaic_gpu", "pallas", "xla"), "tpu": ("pallas_tpu", "xla"), "cpu": ("xla",)}


def register(name: str, fn: AttendFn, supports: SupportsFn = _always) -> None:
    """Make a kernel implementation available under `name` (one of the known names).

    supports(spec, C, g): the calls it can run; "auto" takes the first of `_AUTO_ORDER` (the
    order of the measured speeds) that supports the call."""
    if name not in _KNOWN:
        raise ValueError(f"implementation name {name!r}: expected one of {_KNOWN}")
    _IMPLEMENTATIONS[name] = (fn, supports)


def available() -> tuple[str, ...]:
    return tuple(_IMPLEMENTATIONS)


def resolve(implementation: str, spec: CacheSpec, queries: int, group: int,
            backend: str | None = None) -> str:
    """The implementation `attend` runs for this request, cache spec, C = `queries` new
    queries, g = `group` query heads per KV head, and backend."""
    if implementation == "auto":
        backend = backend or jax.default_backend()
        for name in _AUTO_ORDER.get(backend, ("xla",)):
            if name in _IMPLEMENTATIONS and _IMPLEMENTATIONS[name][1](spec, queries, group):
                return name
    if implementation not in _KNOWN:
        raise ValueError(f"implementation={implementation!r}: expected 'auto' or one of {_KNOWN}")
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(
            f"implementation={implementation!r} is not available in this build "
            f"(available: {available()}); use implementation='auto' to let oscar-jax choose"
        )
    if not _IMPLEMENTATIONS[implementation][1](spec, queries, group):
        raise ValueError(
            f"implementation={implementation!r} does not support this call (cache {spec.quant}, "
            f"D={spec.head_dim}, C={queries} queries, g={group} query heads per KV head) on this "
            f"device; use implementation='xla' or 'auto'"
        )
    return implementation


def kernel_attend(kernel: Callable[..., tuple[jax.Array, jax.Array]], *,
                  rotates: bool = False) -> AttendFn:
    """Adapt a plain-array kernel to `attend`'s signature.

    The kernel sees rotated queries and returns outputs in the R_V basis:
      kernel(q_rot f32 [B, C, Hq, D], sink_k, sink_v bf16 [B, Hkv, S0, D],
             hist_codes_k u8 [B, Hkv, T_hist/tpb, D], hist_codes_v u8 [B, Hkv, D, T_hist/tpb]
             (channel-major, `layout.CHANNEL_MAJOR`),
             hist_lo_k, hist_scale_k, hist_lo_v, hist_scale_v [B, Hkv, D/G, tpb, T_hist/tpb],
             recent_k, recent_v bf16 [B, Hkv, W, D], lengths int32 [B], *,
             sink, window, bits, levels, softmax_scale, interpret)
        -> (o_rot f32 [B, C, Hq, D], lse f32 [B, C, Hq])
    `interpret` is True when running on CPU (tests); q rotation (by
    `params.query_rot`) and the back-rotation (by `params.output_rot`) happen
    here, in XLA. rotates: the kernel does both itself. It takes the model-basis q as it is,
    the rotations as `query_rot=` and `output_rot=`: their bf16 parts [Hkv, 2, D, D]
    (`LayerParams.query_rot_parts`; f32 [Hkv, D, D] where params carry none; output_rot None
    when params.v_folded), `query_rot_stats=` (`LayerParams.query_rot_stats` or None) and
    `out_dtype=` q.dtype, and returns o in the model basis (the R_V
    basis when v_folded) in that dtype (written by the kernel: no XLA convert after it).
    """

    def fn(q, cache: OscarCache, params: LayerParams, softmax_scale=None):
        spec = cache.spec
        hi = jax.lax.Precision.HIGHEST
        b, c, hq, d = q.shape
        heads = (b, c, spec.kv_heads, hq // spec.kv_heads, d)  # query head h * g + i of KV head h
        scale = spec.head_dim ** -0.5 if softmax_scale is None else softmax_scale
        if rotates:
            # the rotations' bf16 parts, split once by LayerParams.create
            query_rot = params.query_rot if params.query_rot_parts is None else params.query_rot_parts
            output_rot = params.output_rot if params.output_rot_parts is None else params.output_rot_parts
            q_in, extra = q, {"query_rot": query_rot, "query_rot_stats": params.query_rot_stats,
                              "out_dtype": q.dtype, "output_rot": None if params.v_folded else output_rot}
        else:
            q_in, extra = jnp.einsum("bckgd,kde->bckge", q.astype(jnp.float32).reshape(heads), params.query_rot,
                                     precision=hi).reshape(q.shape), {}
        arrays = layout.CacheArrays(*(getattr(cache, name) for name in layout.CacheArrays._fields))
        o, lse = kernel(
            q_in, arrays,
            sink=spec.sink, window=spec.window, bits=spec.quant.bits, levels=spec.quant.levels,
            softmax_scale=scale, interpret=jax.default_backend() == "cpu", **extra,
        )
        if not rotates and not params.v_folded:
            o = jnp.einsum("bckge,kde->bckgd", o.reshape(heads), params.output_rot,
                           precision=hi).reshape(q.shape)
        return o.astype(q.dtype), reference.shift_lse(lse, q, params, scale)

    return fn


def _check_q(q: jax.Array, kv_heads: int, head_dim: int, batch: int) -> None:
    if q.ndim != 4 or q.shape[0] != batch or q.shape[3] != head_dim or q.shape[2] % kv_heads:
        raise ValueError(
            f"q.shape={q.shape}: expected [B={batch}, C, Hq, D={head_dim}] with Hq a "
            f"multiple of Hkv={kv_heads}"
        )


def attend(q: jax.Array, layer_cache: OscarCache, layer_params: LayerParams, *,
           implementation: str = "auto", softmax_scale: float | None = None
           ) -> tuple[jax.Array, jax.Array]:
    """Attention of C new queries over one layer's mixed cache (tokens already appended).

    q: [B, C, Hq, D] post-RoPE, unrotated. Returns o [B, C, Hq, D] (model basis
    unless layer_params.v_folded) and lse float32 [B, C, Hq].
    """
    spec = layer_cache.spec
    if layer_cache.is_stacked:
        raise ValueError("attend takes a per-layer cache: use cache.layer(i) or lax.scan")
    _check_q(q, spec.kv_heads, spec.head_dim, spec.batch)
    if q.shape[1] > spec.window:
        raise ValueError(f"q has C={q.shape[1]} queries; at most window W={spec.window} per call")
    fn = _IMPLEMENTATIONS[resolve(implementation, spec, q.shape[1], q.shape[2] // spec.kv_heads)][0]
    return fn(q, layer_cache, layer_params, softmax_scale=softmax_scale)


def attend_window(q: jax.Array, ring: RingCache, *, softmax_scale: float | None = None
                  ) -> tuple[jax.Array, jax.Array]:
    """Sliding-window attention over a ring layer (XLA): q [B, C, Hq, D] -> (o, lse)."""
    spec = ring.spec
    _check_q(q, spec.kv_heads, spec.head_dim, spec.batch)
    return reference.attend_window(q, ring, softmax_scale)


from oscar_jax.pallas_kernels.tpu import mixed_attention as _tpu_attention  # noqa: E402

register("pallas_tpu", kernel_attend(_tpu_attention.mixed_attention))  # every CacheSpec

from oscar_jax.pallas_kernels.gpu import mixed_attention as _gpu_attention  # noqa: E402

register("pallas", kernel_attend(_gpu_attention.mixed_attention),
         supports=lambda spec, queries, group: _gpu_attention.supports(spec))

from oscar_jax.pallas_kernels.gpu import hopper as _hopper  # noqa: E402
from oscar_jax.pallas_kernels.gpu import mixed_attention_mgpu as _mgpu_attention  # noqa: E402

# GPU time on the H200: it beats the Triton kernel at every D it takes. D = 128 (B8 H32/8,
# bench/results/kernels_h200.json, session 10): 0.220 vs 0.785 ms at 128K, 0.072 vs 0.256 ms at
# 32K; D = 64 (SmolLM2 B8 8K): 0.021 vs 0.031 ms; D = 256 (Gemma-3 B8 32K; it lost through
# session 9, 0.096 vs 0.088): 0.082 vs 0.090 in session 10 and 0.082 vs 0.088 in session 11
# (bench/results/kernels_session10_h200.json run 3, kernels_session11_h200.json).
register("pallas_mosaic_gpu", kernel_attend(_mgpu_attention.mixed_attention, rotates=True),
         supports=lambda spec, queries, group: (_mgpu_attention.supports(spec, queries, group)
                                                and _hopper.device_supported()))
