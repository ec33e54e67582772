"""The one-token append kernel (`pallas_kernels/gpu/append_token.py`, dispatch name "pallas")
against `updates.append`'s XLA code: bit-equal caches after every step of a ragged batch
that crosses the sink, the ring's first wrap, every byte sub-slot of the history and an
overflowing row. On CPU the kernel runs in Pallas interpret mode; the `gpu_write` group runs
it compiled on a GPU (`pytest -p no:cacheprovider -n 0 -m gpu_write tests/test_append_kernel.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cache_oracle import random_kv
from oscar_jax import cache as cache_lib
from oscar_jax import dispatch, updates
from oscar_jax.config import CacheSpec, QuantConfig

SINK, WINDOW, HIST, STEPS = 8, 16, 40, 7
# (D, G, codebook, metadata dtype, bits)
CONFIGS = [
    (64, 64, "uniform", "bfloat16", 2),
    (128, 32, "uniform", "float32", 2),
    (128, 128, "lloyd_max", "bfloat16", 2),
    (256, 64, "uniform", "bfloat16", 2),
    (128, 64, "uniform", "bfloat16", 4),
]
ON_GPU = jax.default_backend() == "gpu"
_append = jax.jit(updates.append, static_argnames=("implementation", "interpret"))


def _case(config, seed):
    d, g_size, codebook, scale_dtype, bits = config
    spec = CacheSpec(1, 4, 2, d, SINK + HIST + WINDOW, SINK, WINDOW,
                     QuantConfig(bits, None if g_size == d else g_size, codebook, scale_dtype))
    rng = np.random.default_rng([d, g_size, bits, seed])
    h = spec.kv_heads
    rot_k, rot_v = (np.linalg.qr(rng.standard_normal((h, d, d)))[0].astype(np.float32) for _ in range(2))
    params = cache_lib.LayerParams.create(rot_k, rot_v, rng.uniform(0.85, 1.0), rng.uniform(0.85, 1.0),
                                          num_layers=1, kv_heads=h).layer(0)
    t = spec.max_len
    k, v = (jnp.asarray(random_kv(rng, spec.batch, t, h, d), jnp.bfloat16) for _ in range(2))
    # inside the sink; just before the ring's first wrap; in the history (random sub-slot);
    # two tokens short of max_len, so its last appends overflow and must leave it untouched
    lengths = jnp.asarray([SINK - 3, SINK + WINDOW - 2, SINK + WINDOW + int(rng.integers(1, HIST - STEPS)),
                           spec.max_len - 2], jnp.int32)
    cache = updates.write_prompt(cache_lib.OscarCache.init(spec).layer(0), k, v, lengths, params,
                                 implementation="xla")
    steps = [(jnp.asarray(random_kv(rng, spec.batch, 1, h, d), jnp.bfloat16),
              jnp.asarray(random_kv(rng, spec.batch, 1, h, d), jnp.bfloat16)) for _ in range(STEPS)]
    return cache, params, steps


@pytest.mark.parametrize("seed", [0])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "d{}-G{}-{}-{}-{}bit".format(*c))
def test_append_kernel_matches_xla(config, seed):
    cache, params, steps = _case(config, seed)
    got = want = cache
    for k, v in steps:
        got = _append(got, k, v, params, implementation="pallas", interpret=not ON_GPU)
        want = _append(want, k, v, params, implementation="xla")
        for name in ("lengths", "overflow", "sink_k", "sink_v", "recent_k", "recent_v", "hist_codes_k",
                     "hist_codes_v", "hist_lo_k", "hist_lo_v", "hist_scale_k", "hist_scale_v"):
            a, b = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
            if name.startswith(("hist_lo", "hist_scale")) and config[3] == "float32":  # f32 statistics
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=0, err_msg=name)
            else:
                np.testing.assert_array_equal(a, b, err_msg=name)
    assert np.asarray(got.overflow).tolist() == [False, False, False, True]


def test_append_dispatch():
    """"auto" takes the kernel only on a GPU and for one token; an explicit "pallas" off a GPU
    needs interpret=True, and a chunk of several tokens is refused by name."""
    spec = CacheSpec(1, 2, 2, 128, SINK + HIST + WINDOW, SINK, WINDOW, QuantConfig(2))
    assert dispatch.resolve("append", "auto", spec) == ("pallas" if ON_GPU else "xla")
    assert dispatch.resolve("append", "auto", spec, queries=3) == "xla"
    with pytest.raises(ValueError, match="does not support"):
        dispatch.resolve("append", "pallas", spec, queries=3, interpret=True)
    if not ON_GPU:
        with pytest.raises(ValueError, match="interpret=True"):
            dispatch.resolve("append", "pallas", spec)


@pytest.mark.gpu
@pytest.mark.gpu_write
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "d{}-G{}-{}-{}-{}bit".format(*c))
def test_append_kernel_on_gpu(config):
    test_append_kernel_matches_xla(config, 1)
