"""Cases and checks shared by the GPU kernel tests (tests/test_gpu_kernels.py: Triton attention,
dispatch, bulk writes; tests/test_mgpu_kernels.py: the Mosaic GPU decode kernel).

A case is a one-layer OSCAR cache of `cache_spec`'s shape, filled by the XLA write and append
from random keys and values, with a ragged batch of lengths (`ragged_lengths`) and random
rotations; `check_attention` runs a kernel over it against the XLA reference. Off a GPU the
kernels run in Pallas interpret mode (`INTERPRET`); `on_gpu` marks the compiled-GPU twins.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cache_oracle import random_kv
from oscar_jax import attention
from oscar_jax import cache as cache_lib
from oscar_jax import reference as reference_lib
from oscar_jax import updates
from oscar_jax.config import CacheSpec, QuantConfig

HKV, BATCH, SINK, WINDOW, HIST = 2, 4, 8, 64, 120


def cache_spec(d, g_size, codebook, scale_dtype, *, batch=BATCH, sink=SINK, window=WINDOW, hist=HIST,
               kv_heads=HKV):
    """A one-layer 2-bit CacheSpec: head dim `d`, metadata groups of `g_size` (= d: one a token),
    max_len = sink + hist + window."""
    return CacheSpec(1, batch, kv_heads, d, sink + hist + window, sink, window,
                     QuantConfig(2, None if g_size == d else g_size, codebook, scale_dtype))


def ragged_lengths(rng, pattern: int, c: int, spec: CacheSpec) -> np.ndarray:
    """A ragged batch [B] int32: boundary lengths (inside the sink, on S0, inside S0 + W, on S0 + W,
    just past it, full) and one random length; all >= C so the C queries are appended.
    Batch `pattern` takes boundaries 3p, 3p + 1, ... of the list (cyclically), so
    consecutive patterns walk every boundary."""
    s0, w, top = spec.sink, spec.window, spec.max_len
    marks = [1, s0 - 1, s0, s0 + 1, s0 + w // 2, s0 + w - 1, s0 + w, s0 + w + 1, s0 + w + 3,
             top - 1, top]
    pool = [n for n in marks if c <= n <= top]
    picked = [pool[(3 * pattern + i) % len(pool)] for i in range(spec.batch - 1)]
    return np.array(picked + [int(rng.integers(c, top + 1))], np.int32)


@functools.partial(jax.jit, static_argnames=("c",))
def build_cache(cache, params, k, v, lengths, *, c):
    """write_prompt the first n - C tokens of k, v [B, T, H, D], then append the last C
    (lengths [B])."""
    cache = updates.write_prompt(cache, k, v, lengths - c, params, implementation="xla")
    idx = (lengths - c)[:, None] + jnp.arange(c)[None, :]
    take = lambda x: jnp.take_along_axis(x, idx[:, :, None, None], axis=1)
    return updates.append(cache, take(k), take(v), params)


# reference(q, cache, params) and attend(q, cache, params, implementation=, interpret=), jitted:
# q [B, C, Hkv·g, D] -> o [B, C, Hkv·g, D], lse [B, C, Hkv·g].
reference = jax.jit(reference_lib.attend)
attend = jax.jit(attention.attend, static_argnames=("implementation", "interpret"))
# Off a GPU the kernels run in Pallas interpret mode (an explicit opt-in of attend / write_prompt).
INTERPRET = jax.default_backend() != "gpu"


def random_case(rng, spec: CacheSpec, g: int, c: int, lengths: np.ndarray, k_shift: bool = False):
    """(q [B, C, Hkv·g, D] f32, the filled cache layer, its LayerParams): random orthogonal
    rotations and clips, optionally a key shift [Hkv, D]; the cache holds lengths [B] tokens."""
    b, h, d = spec.batch, spec.kv_heads, spec.head_dim
    rot = np.linalg.qr(rng.standard_normal((h, d, d)))[0].astype(np.float32)
    rot_v = np.linalg.qr(rng.standard_normal((h, d, d)))[0].astype(np.float32)
    shift = rng.standard_normal((h, d)).astype(np.float32) if k_shift else None
    params = cache_lib.LayerParams.create(rot, rot_v, rng.uniform(0.85, 1.0), rng.uniform(0.85, 1.0),
                                          num_layers=1, kv_heads=h, k_shift=shift).layer(0)
    t = spec.max_len
    k = jnp.asarray(random_kv(rng, b, t, h, d), jnp.bfloat16)
    v = jnp.asarray(random_kv(rng, b, t, h, d), jnp.bfloat16)
    cache = build_cache(cache_lib.OscarCache.init(spec).layer(0), params, k, v, jnp.asarray(lengths), c=c)
    q = jnp.asarray(rng.standard_normal((b, c, h * g, d)) * rng.uniform(0.5, 2.0), jnp.float32)
    return q, cache, params


def check_attention(rng, spec, g, c, lengths, kernel=None, k_shift=False, implementation="pallas",
                    rotates=False):
    """A random case (`random_case`) attended by a kernel against the reference: per row, relative
    Frobenius error <= 1e-2; lse within 2e-2 + 5e-3·|lse|. kernel: a `mixed_attention`-like
    function (rotates: it rotates q and o itself); None runs `attend(implementation=...)`."""
    q, cache, params = random_case(rng, spec, g, c, lengths, k_shift=k_shift)
    if kernel is None:
        o, lse = attend(q, cache, params, implementation=implementation, interpret=INTERPRET)
    else:
        o, lse = _kernel_attend(kernel, rotates)(q, cache, params)
    o_ref, lse_ref = reference(q, cache, params)
    assert o.shape == o_ref.shape and lse.shape == lse_ref.shape
    assert bool(jnp.all(jnp.isfinite(o))) and bool(jnp.all(jnp.isfinite(lse)))
    for row in range(spec.batch):  # per row, so a wrong short row is not hidden by long ones
        rel = float(jnp.linalg.norm(o[row] - o_ref[row]) / jnp.linalg.norm(o_ref[row]))
        assert rel <= 1e-2, f"row {row} (length {lengths[row]}): relative error {rel:.3e}"
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_ref), atol=2e-2, rtol=5e-3)


@functools.cache
def _kernel_attend(kernel, rotates: bool):
    """`attention.kernel_attend(kernel)` jitted, one per kernel object: the cases that pass the
    same kernel at the same shapes share one compilation."""
    return jax.jit(functools.partial(attention.kernel_attend(kernel, rotates=rotates), interpret=INTERPRET))


def lower_for_h200(fn, args):
    """Lower fn(*args) (ShapeDtypeStructs) for an H200 without a GPU: Pallas' Triton and Mosaic
    GPU lowering rules run (layouts, shapes, wgmma and TMA checks), nothing is compiled."""
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=1, platform="cuda")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def on_gpu(group: str):
    """Mark a test as compiled-GPU only: markers `gpu` and `group` (conftest.GPU_GROUPS),
    skipped off a GPU."""
    def mark(fn):
        for m in (pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU"),
                  getattr(pytest.mark, group), pytest.mark.gpu):
            fn = m(fn)
        return fn
    return mark
