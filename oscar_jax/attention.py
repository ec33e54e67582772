"""Public per-layer attention over the mixed cache, with backend dispatch (docs/method.md §4,
"Attention over the mixed cache"; the kernel contract: docs/ARCHITECTURE.md §5, "The kernel
interface").

`attend(q, layer_cache, layer_params, implementation=..., interpret=...)` takes the
implementation names of `oscar_jax.dispatch` (shared with `write_prompt`):
  "xla"    the pure-jnp reference (`oscar_jax.reference`), any backend;
  "pallas" the GPU Pallas kernel (Triton lowering);
  "pallas_mosaic_gpu" the Hopper (sm_90) decode kernel (Pallas Mosaic GPU: TMA + wgmma);
  "pallas_tpu" the TPU Pallas kernel;
  "cudnn"  the cache dequantised to bf16 and attended by cuDNN's flash attention (`flash_attend`:
           prefill chunks of many queries on GPU);
  "auto"   the fastest implementation for the default backend, the cache and the call
           (C queries, g query heads per KV head).
An explicit request that cannot run raises; only "auto" chooses. interpret=True runs an
explicit kernel implementation in Pallas interpret mode (CPU tests).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from oscar_jax import dispatch, reference, updates
from oscar_jax.cache import LayerParams, OscarCache, RingCache, check_params, ring_positions
from oscar_jax.config import CacheSpec
from oscar_jax.pallas_kernels import layout
from oscar_jax.pallas_kernels.gpu import mixed_attention as _gpu_attention
from oscar_jax.pallas_kernels.gpu import mixed_attention_mgpu as _mgpu_attention
from oscar_jax.pallas_kernels.tpu import mixed_attention as _tpu_attention

# fn(q, layer_cache, layer_params, softmax_scale=None, interpret=False, history_offset=None) -> (o, lse)
AttendFn = Callable[..., tuple[jax.Array, jax.Array]]


def within_window(supports: dispatch.SupportsFn = dispatch._always) -> dispatch.SupportsFn:
    """`supports` limited to chunks of at most W queries: a kernel attends a chunk the cache
    holds in its sink and ring (a longer one, whose own first tokens the history holds, runs in
    XLA, `append_attend`)."""
    return lambda spec, queries, group: queries <= spec.window and supports(spec, queries, group)


def register(name: str, fn: AttendFn, supports: dispatch.SupportsFn = dispatch._always) -> None:
    """Make a kernel implementation available to `attend` under `name` (one of
    `dispatch.NAMES`). supports(spec, C, g): the calls it can run (limited here to C <= W,
    `within_window`); "auto" takes the first of `dispatch.AUTO_ORDER` (the order of the measured
    speeds) that runs here and supports the call."""
    dispatch.register("attend", name, fn, supports if name == "xla" else within_window(supports))


def available() -> tuple[str, ...]:
    return dispatch.available("attend")


def resolve(implementation: str, spec: CacheSpec, queries: int, group: int,
            backend: str | None = None, interpret: bool = False) -> str:
    """The implementation `attend` runs for this request, cache spec, C = `queries` new
    queries, g = `group` query heads per KV head, backend and `interpret`."""
    return dispatch.resolve("attend", implementation, spec, queries=queries, group=group, backend=backend,
                            interpret=interpret)


def _by_kv_head(x: jax.Array, kv_heads: int) -> jax.Array:
    """[B, C, Hq, D] -> f32 [B, C, Hkv, g, D]: query head h * g + i belongs to KV head h."""
    b, c, hq, d = x.shape
    return x.astype(jnp.float32).reshape(b, c, kv_heads, hq // kv_heads, d)


def rotate_queries(q: jax.Array, params: LayerParams) -> jax.Array:
    """q [B, C, Hq, D] (model basis) -> f32 q·R_K per KV head, the basis the cache holds keys in."""
    return jnp.einsum("bckgd,kde->bckge", _by_kv_head(q, params.query_rot.shape[0]), params.query_rot,
                      precision=jax.lax.Precision.HIGHEST).reshape(q.shape)


def rotate_back(o: jax.Array, params: LayerParams) -> jax.Array:
    """o [B, C, Hq, D] in the R_V basis -> f32 o·R_V^T per KV head (the model basis)."""
    return jnp.einsum("bckge,kde->bckgd", _by_kv_head(o, params.output_rot.shape[0]), params.output_rot,
                      precision=jax.lax.Precision.HIGHEST).reshape(o.shape)


def kernel_attend(kernel: Callable[..., tuple[jax.Array, jax.Array]], *,
                  rotates: bool = False, paged: bool = False) -> AttendFn:
    """Adapt a plain-array kernel to `attend`'s signature.

    The kernel sees rotated queries and returns outputs in the R_V basis:
      kernel(q_rot f32 [B, C, Hq, D], cache: `layout.CacheArrays`, *,
             sink, window, bits, levels, softmax_scale, interpret)
        -> (o_rot f32 [B, C, Hq, D], lse f32 [B, C, Hq])
    and, for a history slice (sequence parallelism, `attend(history_offset=...)`),
      `history_offset=` int32 [] (traced): the history arrays hold history indices
      [history_offset, history_offset + T_local) of a longer history; the kernel then attends
      those and the sink and ring only where history_offset == 0 (`reference.attend`'s rule).
    `interpret` is the adapted function's own (Pallas interpret mode); q rotation (by
    `params.query_rot`) and the back-rotation (by `params.output_rot`) happen
    here, in XLA. rotates: the kernel does both itself. It takes the model-basis q as it is,
    the rotations as `query_rot=` and `output_rot=`: their bf16 parts [Hkv, 2, D, D]
    (`LayerParams.query_rot_parts`; f32 [Hkv, D, D] where params carry none; output_rot None
    when params.v_folded), `query_rot_stats=` (`LayerParams.query_rot_stats` or None) and
    `out_dtype=` q.dtype, and returns o in the model basis (the R_V
    basis when v_folded) in that dtype (written by the kernel: no XLA convert after it).
    paged: the adapted function takes an `oscar_jax.paged.PagedCache`, whose history fields
    are a page pool, and passes the kernel its `block_table=`.
    """

    def fn(q, cache: OscarCache, params: LayerParams, softmax_scale=None, interpret: bool = False,
           history_offset=None):
        spec = cache.spec
        scale = spec.head_dim ** -0.5 if softmax_scale is None else softmax_scale
        out_dtype = q.dtype if history_offset is None else jnp.float32  # a slice's partial: merged in f32
        if rotates:
            # the rotations' bf16 parts, split once by LayerParams.create
            query_rot = params.query_rot if params.query_rot_parts is None else params.query_rot_parts
            output_rot = params.output_rot if params.output_rot_parts is None else params.output_rot_parts
            q_in, extra = q, {"query_rot": query_rot, "query_rot_stats": params.query_rot_stats,
                              "out_dtype": out_dtype, "output_rot": None if params.v_folded else output_rot}
        else:
            q_in, extra = rotate_queries(q, params), {}
        if paged:
            extra["block_table"] = cache.block_table
        if history_offset is not None:
            extra["history_offset"] = jnp.asarray(history_offset, jnp.int32)
        o, lse = kernel(
            q_in, layout.CacheArrays.of(cache),
            sink=spec.sink, window=spec.window, bits=spec.quant.bits, levels=spec.quant.levels,
            softmax_scale=scale, interpret=interpret, **extra,
        )
        if not rotates and not params.v_folded:
            o = rotate_back(o, params)
        return o.astype(out_dtype), reference.shift_lse(lse, q, params, scale)

    return fn


def _check_q(q: jax.Array, kv_heads: int, head_dim: int, batch: int) -> None:
    if q.ndim != 4 or q.shape[0] != batch or q.shape[3] != head_dim or q.shape[2] % kv_heads:
        raise ValueError(
            f"q.shape={q.shape}: expected [B={batch}, C, Hq, D={head_dim}] with Hq a "
            f"multiple of Hkv={kv_heads}"
        )


def attend(q: jax.Array, layer_cache: OscarCache, layer_params: LayerParams, *,
           implementation: str = "auto", softmax_scale: float | None = None, interpret: bool = False,
           history_offset=None) -> tuple[jax.Array, jax.Array]:
    """Attention of C new queries over one layer's mixed cache (tokens already appended).

    q: [B, C, Hq, D] post-RoPE, unrotated. Returns o [B, C, Hq, D] (model basis
    unless layer_params.v_folded) and lse float32 [B, C, Hq]. interpret: run an explicit
    kernel implementation in Pallas interpret mode (any backend; for tests).
    history_offset (int or traced int32 []; sequence parallelism, `oscar_jax.parallel`): the
    cache's history arrays hold history indices [history_offset, history_offset + T_local) of
    a longer history; returns this slice's partial, o in float32 (`reference.attend`'s rule:
    the slice's history, and the sink and ring only where history_offset == 0), which
    `reference.merge_partials` over every slice makes the whole cache's attention.
    """
    spec = layer_cache.spec
    if layer_cache.is_stacked:
        raise ValueError("attend takes a per-layer cache: use cache.layer(i) or lax.scan")
    _check_q(q, spec.kv_heads, spec.head_dim, spec.batch)
    check_params(spec, layer_params, "attend")
    if q.shape[1] > spec.window:
        raise ValueError(f"q has C={q.shape[1]} queries; at most window W={spec.window} per call (a longer chunk "
                         "attends through append_attend)")
    name = resolve(implementation, spec, q.shape[1], q.shape[2] // spec.kv_heads, interpret=interpret)
    return dispatch.get("attend", name)(q, layer_cache, layer_params, softmax_scale=softmax_scale,
                                        interpret=interpret, history_offset=history_offset)


def append_attend(q: jax.Array, k: jax.Array, v: jax.Array, layer_cache: OscarCache, layer_params: LayerParams, *,
                  implementation: str = "auto", softmax_scale: float | None = None, interpret: bool = False,
                  history_offset=None) -> tuple[jax.Array, jax.Array, OscarCache]:
    """Append a chunk of C new tokens (`updates.append`), then attend its C queries: any C the
    cache holds (docs/ARCHITECTURE.md §5). q [B, C, Hq, D], k, v [B, C, Hkv, D] post-RoPE,
    unrotated -> (o [B, C, Hq, D], lse f32 [B, C, Hq], the cache after the append).

    Query c (position n + c, n the tokens held before) sees the tokens before the chunk as the
    cache holds them after the append (sink and ring bf16, history quantised) and the chunk's
    own tokens 0..c as written (bf16), causally. C <= W: exactly `updates.append` then `attend`
    (the chunk lies in the ring). C > W: cuDNN for implementation "cudnn" (`flash_attend` with
    the chunk's own tokens), else XLA (`reference.attend(own=...)`), whatever "auto" names; an
    explicit Pallas kernel raises (they attend chunks of <= W).
    history_offset: the cache holds a history slice (`attend`'s); the append writes only the
    history tokens inside it and the result is the slice's partial.
    """
    spec = layer_cache.spec
    c = k.shape[1]
    _check_q(q, spec.kv_heads, spec.head_dim, spec.batch)
    if q.shape[1] != c:
        raise ValueError(f"q has C={q.shape[1]} queries and k C={c} tokens: expected one query per new token")
    # Before the append: an explicit kernel that cannot attend these queries raises before any
    # work is traced (C > W: "auto" gives "xla"; "cudnn" runs `flash_attend`, which takes any C,
    # so only its platform and head dim are checked).
    checked = min(c, spec.window) if implementation == "cudnn" else c
    resolve(implementation, spec, checked, q.shape[2] // spec.kv_heads, interpret=interpret)
    cache = updates.append(layer_cache, k, v, layer_params, implementation="xla" if implementation == "xla" else "auto",
                           interpret=interpret, history_offset=0 if history_offset is None else history_offset)
    if c <= spec.window:
        o, lse = attend(q, cache, layer_params, implementation=implementation, softmax_scale=softmax_scale,
                        interpret=interpret, history_offset=history_offset)
    elif implementation == "cudnn":
        _refuse_seq(history_offset)
        o, lse = flash_attend(q, cache, layer_params, softmax_scale, own=updates.stored_kv(k, v, layer_params))
    else:
        o, lse = reference.attend(q, cache, layer_params, softmax_scale, own=updates.stored_kv(k, v, layer_params),
                                  history_offset=history_offset)
    return o, lse, cache


def flash_attend(q: jax.Array, cache: OscarCache, params: LayerParams, softmax_scale: float | None = None, *,
                 own: tuple[jax.Array, jax.Array] | None = None,
                 implementation: str = "cudnn") -> tuple[jax.Array, jax.Array]:
    """`reference.attend` of a chunk the cache has taken, through a flash kernel: one bf16 key
    sequence [front, sink S0, history T (dequantised)], the held tokens a prefix of it (the
    kernel stops at them), the positions a query may not see masked, and
    `jax.nn.dot_product_attention` of `implementation` ("cudnn" on GPU; "xla" anywhere, for
    tests). The front is the ring W (C <= W queries) or, with `own` (C > W: the chunk's K/V as
    stored, `updates.stored_kv`, bf16 [B, Hkv, C, D] each), the chunk's own tokens, which then
    see the tokens before the chunk through the sink and history. No [C, T] f32 scores exist
    and the codes are read once per chunk.

    q [B, C, Hq, D] -> (o [B, C, Hq, D] in q.dtype, lse f32 [B, C, Hq]: cuDNN gives it in bf16,
    so it is exact to bf16 only; sequence parallelism, which merges partials by it, refuses
    this implementation).
    """
    spec = cache.spec
    b, c, _, d = q.shape
    s0, w = spec.sink, spec.window
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    n = cache.lengths
    hist_k = cache.dequantized_hist("k")
    t = hist_k.shape[-2]
    if own is None:  # the ring: the held history ends at position n - W, where the key lengths stop
        (front_k, front_v), front_pos = (cache.recent_k, cache.recent_v), ring_positions(n, s0, w)  # -1: empty
        held_keys = w + s0 + jnp.clip(n - w - s0, 0, t)
    else:  # the chunk's own tokens: the history before the chunk ends at position n - C
        (front_k, front_v), front_pos = own, (n - c)[:, None] + jnp.arange(c)
        held_keys = c + s0 + jnp.clip(n - c - s0, 0, t)
    keys = lambda front, sink, hist: jnp.swapaxes(
        jnp.concatenate([front, sink, hist.astype(jnp.bfloat16)], axis=2), 1, 2)  # [B, F + S0 + T, Hkv, D]
    k = keys(front_k, cache.sink_k, hist_k)
    v = keys(front_v, cache.sink_v, cache.dequantized_hist("v"))
    key_pos = jnp.concatenate([front_pos, jnp.broadcast_to(jnp.arange(s0 + t), (b, s0 + t))], axis=1)  # [B, S]
    # Sink positions past n and the chunk's later tokens fall to `<= qp`; with `own`, the chunk's
    # tokens the sink or history took are seen in the front only (the key lengths let the kernel
    # stop early; the mask decides).
    visible = (key_pos[:, None] >= 0) & (key_pos[:, None] <= reference.query_positions(n, c)[..., None])  # [B, C, S]
    if own is not None:
        visible &= (jnp.arange(key_pos.shape[1]) < c) | (key_pos < (n - c)[:, None])[:, None]
    o, lse = jax.nn.dot_product_attention(rotate_queries(q, params).astype(jnp.bfloat16), k, v,
                                          mask=visible[:, None], scale=scale,
                                          key_value_seq_lengths=held_keys.astype(jnp.int32),
                                          implementation=implementation, return_residual=True)
    if not params.v_folded:
        o = rotate_back(o, params)
    return o.astype(q.dtype), reference.shift_lse(lse.astype(jnp.float32), q, params, scale)


def _refuse_seq(history_offset) -> None:
    if history_offset is not None:
        raise ValueError("implementation='cudnn' gives a bf16 log-sum-exp, too coarse to merge sequence-parallel "
                         "partials; use 'auto' or a kernel implementation under a seq mesh axis")


def _cudnn_attend(q, cache: OscarCache, params: LayerParams, softmax_scale=None, interpret: bool = False,
                  history_offset=None):
    _refuse_seq(history_offset)
    return flash_attend(q, cache, params, softmax_scale)


def _cudnn_supports(spec: CacheSpec, queries: int, group: int) -> bool:
    """cuDNN's flash attention: head dim <= 256 and a multiple of 8."""
    return spec.head_dim <= 256 and spec.head_dim % 8 == 0


def attend_window(q: jax.Array, ring: RingCache, *, softmax_scale: float | None = None
                  ) -> tuple[jax.Array, jax.Array]:
    """Sliding-window attention over a ring layer (XLA): q [B, C, Hq, D] -> (o, lse)."""
    spec = ring.spec
    _check_q(q, spec.kv_heads, spec.head_dim, spec.batch)
    return reference.attend_window(q, ring, softmax_scale)


register("xla", lambda q, cache, params, softmax_scale=None, interpret=False, history_offset=None:
         reference.attend(q, cache, params, softmax_scale, history_offset=history_offset))
register("pallas_tpu", kernel_attend(_tpu_attention.mixed_attention))  # every CacheSpec
register("pallas", kernel_attend(_gpu_attention.mixed_attention),
         supports=lambda spec, queries, group: _gpu_attention.supports(spec))
# Faster than the Triton kernel at every shape it takes ("auto" puts it first on GPU).
register("pallas_mosaic_gpu", kernel_attend(_mgpu_attention.mixed_attention, rotates=True),
         supports=_mgpu_attention.supports)
register("cudnn", _cudnn_attend, supports=_cudnn_supports)
