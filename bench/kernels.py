"""Time the GPU Pallas kernels against bf16 attention baselines, all in one run.

Decode attention (C = 1 query per sequence, full-length rows) over the OSCAR
cache (2-bit uniform codes, G = D, bf16 metadata, S0 = 64, W = 256) for the
shapes of issue 5, beside: JAX cuDNN bf16 (`jax.nn.dot_product_attention(...,
implementation="cudnn")`), torch SDPA bf16 with the flash backend
(`enable_gqa=True`), XLA bf16 (`implementation="xla"`) and the XLA reference
over the OSCAR cache (dequantise in XLA, then attend). Both decode kernels are
timed: the Triton one (`mixed_attention`) and, where it applies, the Mosaic GPU one
(`mixed_attention_mgpu`; a failure to compile is recorded in the row, not raised);
the ratios are those of the one `attend(implementation="auto")` runs. Also the bulk
rotate-quantise-pack kernels (Mosaic GPU and Triton, both code layouts), and
`write_prompt` of a layer through XLA and through the bulk kernel. Timing: GPU time from a
profiler trace (`device_time`: first kernel start to last kernel end of a timed group,
inter-kernel gaps included, host dispatch not), median
of >= 50 repetitions after warm-up; torch is timed with CUDA events, which likewise leave
the host out. Each timed group runs the op over enough distinct input copies (>= 3 x L2
in total) that no copy is served from L2, and the group time is divided by the number
of copies. The wall-clock time of each JAX op (host dispatch included) is recorded beside
it (`*_wall_ms`), and of each OSCAR call the time of each of its kernels (`*_kernels_us`:
`decode_start`, the attention kernel, `decode_finish`). GB/s counts the bytes each op must read.

Run on a GPU:  python bench/kernels.py --tune --shapes 2,0,1,3,4,5,6 --out bench/results/kernels_h200.json
(--tune first sweeps BlockSizes on the first shape and uses the fastest for all.) The JSON is
saved after every op timed, so a run cut off by a time limit keeps what it measured; then
`python bench/kernels.py --markdown --out FILE.json` (no GPU) writes its table.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import platform
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from oscar_jax import attention  # noqa: E402
from oscar_jax import cache as cache_lib  # noqa: E402
from oscar_jax.config import CacheSpec, QuantConfig, bits_per_element  # noqa: E402
from oscar_jax.pallas_kernels.gpu import (  # noqa: E402
    mixed_attention, mixed_attention_mgpu, quantize_pack, quantize_pack_mgpu)

L2_BYTES = 60 * 2**20  # H200


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    seq: int


SHAPES = [
    Shape("B8 H32/8 D128 S8K", 8, 32, 8, 128, 8192),
    Shape("B8 H32/8 D128 S32K", 8, 32, 8, 128, 32768),
    Shape("B8 H32/8 D128 S128K", 8, 32, 8, 128, 131072),
    Shape("B1 H32/8 D128 S128K", 1, 32, 8, 128, 131072),
    Shape("B32 H32/8 D128 S32K", 32, 32, 8, 128, 32768),
    Shape("SmolLM2 B8 H9/3 D64 S8K", 8, 9, 3, 64, 8192),
    Shape("Gemma3 B8 H4/1 D256 S32K", 8, 4, 1, 256, 32768),
]


def time_group(fn, copies, reps: int, warmup: int = 3) -> float:
    """GPU seconds per call of fn over `copies` (a list of argument tuples): `device_time`'s span."""
    return device_time(fn, copies, reps, warmup)["span_ms"] / 1e3


def wall_time(fn, copies, reps: int, warmup: int = 3) -> float:
    """Median wall-clock seconds per call of fn over `copies`, device-synchronised (host dispatch
    included: ~0.1 ms per call on the H200 for these ops, which a decode loop amortises)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(copies))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(copies))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) / len(copies)


def device_time(fn, copies, reps: int, warmup: int = 3) -> dict:
    """GPU time per call of fn over `copies`, from a profiler trace (jax.profiler), so host
    dispatch and synchronisation are left out, as CUDA events leave them out for torch.

    Returns span_ms (first kernel start to last kernel end of a group, median over reps,
    per copy: inter-kernel gaps included; busy_ms where the groups cannot be told apart,
    span_measured False), busy_ms (summed kernel time per copy) and kernels (name -> ms
    per copy, largest first)."""
    import glob
    import tempfile

    for _ in range(warmup):
        jax.block_until_ready(fn(copies))
    trace_dir = tempfile.mkdtemp(prefix="oscar_trace_")
    with jax.profiler.trace(trace_dir):
        for _ in range(reps):
            jax.block_until_ready(fn(copies))
    (path,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    events = []
    for plane in jax.profiler.ProfileData.from_file(path).planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                if line.name.startswith("Stream"):  # kernels and copies, not the XLA op annotations
                    events += [(e.start_ns, e.duration_ns, e.name) for e in line.events]
    events.sort()
    if not events:
        raise RuntimeError("the profiler trace holds no GPU kernel events")
    n = len(copies)
    busy_ms = sum(e[1] for e in events) / (reps * n * 1e6)
    per_rep, rem = divmod(len(events), reps)
    if rem:  # groups of unequal event counts: no span, the summed kernel time stands in
        span_ms = busy_ms
    else:
        spans = [events[i + per_rep - 1][0] + events[i + per_rep - 1][1] - events[i][0]
                 for i in range(0, len(events), per_rep)]
        span_ms = float(np.median(spans)) / (n * 1e6)
    kernels: dict[str, float] = {}
    for _, dur, name in events:
        kernels[name] = kernels.get(name, 0.0) + dur / (reps * n * 1e6)
    return {"span_ms": span_ms, "busy_ms": busy_ms, "span_measured": not rem,
            "kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1]))}


def torch_time(fn, copies, reps: int, warmup: int = 3) -> float:
    import torch

    for _ in range(warmup):
        for c in copies:
            fn(*c)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for c in copies:
            fn(*c)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return float(np.median(times)) / len(copies)


def unrolled(op):
    """jit of: run op on every copy (a static unroll, so each copy is its own buffer)."""

    @jax.jit
    def run(copies):
        return [op(*c) for c in copies]

    return run


def empty_layer(batch: int, seq: int, kv_heads: int, d: int):
    """An empty OSCAR cache layer for `seq` tokens (S0 = 64, W = 256, 2-bit, G = D) and its
    LayerParams (one random rotation for K and V; v_folded, as `oscar generate` serves them:
    R_V in the output projection, so the call returns o_rot). Room for seq + 1 tokens
    (CacheSpec rounds the history up to whole 256-token tiles)."""
    spec = CacheSpec(1, batch, kv_heads, d, seq + 1, 64, 256, QuantConfig(2))
    rot = jnp.asarray(np.linalg.qr(np.random.default_rng(0).standard_normal((d, d)))[0], jnp.float32)
    params = cache_lib.LayerParams.create(rot, rot, 0.96, 0.92, num_layers=1, kv_heads=kv_heads,
                                          v_folded=True).layer(0)
    return cache_lib.OscarCache.init(spec).layer(0), params


def build_oscar(shape: Shape, key, blocks=None):
    empty, params = empty_layer(shape.batch, shape.seq, shape.kv_heads, shape.head_dim)
    d = shape.head_dim
    kk, kv = jax.random.split(key)
    x_shape = (shape.batch, shape.seq, shape.kv_heads, d)
    k = jax.random.normal(kk, x_shape, jnp.bfloat16)
    v = jax.random.normal(kv, x_shape, jnp.bfloat16)
    write = jax.jit(functools.partial(cache_lib.write_prompt, implementation="xla"))  # timed apart
    cache = write(empty, k, v,
                  jnp.full((shape.batch,), shape.seq, jnp.int32), params)
    return cache, params, k, v


def oscar_bytes(shape: Shape) -> int:
    """Bytes the kernel must read per call: codes + metadata of the history, bf16 sink + ring."""
    n_hist = shape.seq - 64 - 256
    per_head = n_hist * shape.head_dim // 4 + 2 * n_hist * 2 + (64 + 256) * shape.head_dim * 2
    return 2 * shape.batch * shape.kv_heads * per_head


def read_ceiling(reps: int) -> dict:
    """Read bandwidth of an XLA sum over 4 GiB of bf16 and a device-to-device copy (r + w)."""
    x = jax.random.normal(jax.random.key(1), (2**31 // 2, 2), jnp.bfloat16)
    nbytes = x.size * 2
    t_sum = time_group(unrolled(lambda a: jnp.sum(a, dtype=jnp.float32)), [(x,)], reps)
    t_copy = time_group(unrolled(lambda a: a + 1), [(x,)], reps)
    del x
    return {"xla_sum_read_GBps": nbytes / t_sum / 1e9, "copy_read_write_GBps": 2 * nbytes / t_copy / 1e9}


def bench_shape(shape: Shape, reps: int, blocks=None, baselines: bool = True, row: dict | None = None,
                saved=lambda: None) -> dict:
    """Time one shape's row (returned; filled into `row` when given), calling saved() after every
    op timed, so that a run cut off by a time limit keeps the columns it measured."""
    key = jax.random.key(hash(shape.name) % 2**31)
    cache, params, k, v = build_oscar(shape, key)
    q = jax.random.normal(jax.random.key(2), (shape.batch, 1, shape.q_heads, shape.head_dim), jnp.bfloat16)
    oscar_nbytes = oscar_bytes(shape)
    bf16_nbytes = 2 * k.size * 2
    n_copies = lambda nbytes: max(2, min(16, math.ceil(3 * L2_BYTES / nbytes)))
    fn = attention.kernel_attend(functools.partial(mixed_attention.mixed_attention, block_sizes=blocks))
    oscar_copies = [(q, cache) for cache in [cache] + [jax.tree.map(jnp.copy, cache)
                                                       for _ in range(n_copies(oscar_nbytes) - 1)]]
    used = blocks or mixed_attention.BlockSizes.default(shape.head_dim, 4 * (shape.q_heads // shape.kv_heads))
    row = {} if row is None else row
    # auto: what attend(..., implementation="auto") runs for this decode call on this GPU.
    row.update({"shape": dataclasses.asdict(shape), "bits_per_element": bits_per_element(cache.spec, shape.seq),
                "oscar_bytes": oscar_nbytes, "bf16_bytes": bf16_nbytes, "block_sizes": dataclasses.asdict(used),
                "v_folded": params.v_folded,
                "auto": attention.resolve("auto", cache.spec, 1, shape.q_heads // shape.kv_heads, backend="gpu")})

    def kernel_time(run, prefix):
        """Time run (a call per copy): its span -> row[prefix + "_ms"], its kernels' own time per
        call -> row[prefix + "_kernels_us"] (where a call's time goes); returns the span in s."""
        timed = device_time(run, oscar_copies, reps)
        row[f"{prefix}_ms"] = timed["span_ms"]
        row[f"{prefix}_kernels_us"] = {name: ms * 1e3 for name, ms in timed["kernels"].items()}
        return timed["span_ms"] / 1e3

    run = unrolled(lambda qq, c: fn(qq, c, params))
    t = kernel_time(run, "oscar")
    row["oscar_wall_ms"] = wall_time(run, oscar_copies, reps) * 1e3
    row["oscar_GBps"] = oscar_nbytes / t / 1e9
    saved()
    if mixed_attention_mgpu.supports(cache.spec, 1, shape.q_heads // shape.kv_heads):
        try:  # as registered: the kernel rotates the queries itself
            run = unrolled(lambda qq, c: attention.attend(qq, c, params, implementation="pallas_mosaic_gpu"))
            t = kernel_time(run, "oscar_mgpu")
            row["oscar_mgpu_wall_ms"] = wall_time(run, oscar_copies, reps) * 1e3
            row["oscar_mgpu_GBps"] = oscar_nbytes / t / 1e9
        except Exception as e:  # noqa: BLE001 - record a compile failure, time the rest
            row["oscar_mgpu_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            for key in ("oscar_mgpu_ms", "oscar_mgpu_kernels_us"):  # no time of a call that failed
                row.pop(key, None)
    auto_key = "oscar_mgpu_ms" if row["auto"] == "pallas_mosaic_gpu" else "oscar_ms"
    if auto_key in row:
        row["auto_ms"] = row[auto_key]
        row["auto_GBps"] = oscar_nbytes / row[auto_key] * 1e-6
    saved()
    if not baselines:
        return row
    row["xla_dequant_ms"] = time_group(
        unrolled(lambda qq, c: attention.attend(qq, c, params, implementation="xla")),
        oscar_copies[:2], max(5, reps // 10)) * 1e3
    saved()
    del oscar_copies, cache
    bf16_copies = [(q, k, v)] + [(q, jnp.copy(k), jnp.copy(v)) for _ in range(n_copies(bf16_nbytes) - 1)]
    for impl in ("cudnn", "xla"):
        try:
            run = unrolled(functools.partial(jax.nn.dot_product_attention, implementation=impl))
            t = time_group(run, bf16_copies, reps)
            row[f"jax_{impl}_wall_ms"] = wall_time(run, bf16_copies, reps) * 1e3
            row[f"jax_{impl}_ms"] = t * 1e3
            row[f"jax_{impl}_GBps"] = bf16_nbytes / t / 1e9
        except Exception as e:  # noqa: BLE001 - record why a baseline cannot run here
            row[f"jax_{impl}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        saved()
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        tq = lambda x: torch.from_dlpack(x).transpose(1, 2)  # [B, S, H, D] -> [B, H, S, D] view
        t_copies = [(tq(qq), tq(kk), tq(vv)) for qq, kk, vv in bf16_copies]

        def sdpa(a, b_, c):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(a, b_, c, enable_gqa=True)

        t = torch_time(sdpa, t_copies, reps)
        row["torch_flash_ms"] = t * 1e3
        row["torch_flash_GBps"] = bf16_nbytes / t / 1e9
        del t_copies
    except Exception as e:  # noqa: BLE001
        row["torch_flash_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    for base in ("jax_cudnn", "torch_flash", "jax_xla"):
        if f"{base}_ms" in row:
            row[f"speedup_vs_{base}"] = row[f"{base}_ms"] / row["oscar_ms"]
            for prefix, key in (("mgpu_", "oscar_mgpu_ms"), ("auto_", "auto_ms")):
                if key in row:
                    row[f"{prefix}speedup_vs_{base}"] = row[f"{base}_ms"] / row[key]
    row["speedup_vs_xla_dequant"] = row["xla_dequant_ms"] / row["oscar_ms"]
    return row


def bench_write(reps: int, batch=8, seq=32768, kv_heads=8, d=128) -> dict:
    """The bulk kernels on [B, T, Hkv, D] bf16, K (token-major) and V (channel-major) code
    layouts: the Mosaic GPU one (what `write_prompt` runs for this cache) and the Triton one.
    bytes = x read + codes and metadata written."""
    x = [jax.random.normal(jax.random.key(i), (batch, seq, kv_heads, d), jnp.bfloat16) for i in range(2)]
    rot = jnp.asarray(np.linalg.qr(np.random.default_rng(0).standard_normal((kv_heads, d, d)))[0], jnp.float32)
    nbytes = x[0].size * 2 + x[0].size // 4 + 2 * 2 * batch * seq * kv_heads
    row = {"shape": [batch, seq, kv_heads, d], "bytes": nbytes}
    for name, kernel in (("mgpu", quantize_pack_mgpu), ("triton", quantize_pack)):
        for layout_name, channel_major in (("k", False), ("v", True)):
            key = f"{name}_{layout_name}"
            op = functools.partial(kernel.quantize_pack, rot=rot, clip=0.96, bits=2, levels=(0.0, 1.0, 2.0, 3.0),
                                   group_size=d, span=None, scale_dtype=jnp.bfloat16, channel_major=channel_major)
            try:
                t = time_group(unrolled(lambda a, op=op: op(a)), [(a,) for a in x], reps)
                row[f"{key}_ms"], row[f"{key}_GBps"] = t * 1e3, nbytes / t / 1e9
            except Exception as e:  # noqa: BLE001 - e.g. the Mosaic GPU kernel off Hopper
                row[f"{key}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return row


def bench_write_prompt(reps: int, batch=8, seq=32768, kv_heads=8, d=128) -> dict:
    """`write_prompt` of one whole layer (K and V [B, T, Hkv, D] bf16, full-length rows)
    through XLA and through the bulk kernel: what `write_prompt`'s "auto" chooses between.
    bytes = K and V read + the cache's arrays written."""
    empty, params = empty_layer(batch, seq, kv_heads, d)
    lengths = jnp.full((batch,), seq, jnp.int32)
    x_shape = (batch, seq, kv_heads, d)
    copies = [(empty, jax.random.normal(jax.random.key(2 * i), x_shape, jnp.bfloat16),
               jax.random.normal(jax.random.key(2 * i + 1), x_shape, jnp.bfloat16), lengths, params)
              for i in range(2)]
    nbytes = 2 * batch * seq * kv_heads * d * 2 + cache_lib.nbytes(empty)
    row = {"shape": list(x_shape), "bytes": nbytes}
    for impl in ("xla", "pallas"):
        write = functools.partial(cache_lib.write_prompt, implementation=impl)
        t = time_group(unrolled(write), copies, reps)
        row[f"{impl}_ms"], row[f"{impl}_GBps"] = t * 1e3, nbytes / t / 1e9
    return row


def tune(shape: Shape, reps: int) -> list[dict]:
    """Kernel-only time of mixed_attention over a grid of BlockSizes for one shape, fastest first."""
    cache, params, _, _ = build_oscar(shape, jax.random.key(0))
    q = jax.random.normal(jax.random.key(2), (shape.batch, 1, shape.q_heads, shape.head_dim), jnp.bfloat16)
    copies = [(q, cache), (q, jax.tree.map(jnp.copy, cache))]
    grid = [dict(block_rows=r, target_programs=t, num_warps=w) for r in (32, 64, 128)
            for t in (4096, 8192, 16384) for w in (4, 8)]
    rows = []
    for kw in grid:
        bs = mixed_attention.BlockSizes(**kw)
        fn = attention.kernel_attend(functools.partial(mixed_attention.mixed_attention, block_sizes=bs))
        try:
            t = time_group(unrolled(lambda qq, c, fn=fn: fn(qq, c, params)), copies, reps)
            rows.append({**dataclasses.asdict(bs), "ms": t * 1e3, "GBps": oscar_bytes(shape) / t / 1e9})
        except Exception as e:  # noqa: BLE001 - a config Triton cannot compile
            rows.append({**dataclasses.asdict(bs), "error": f"{type(e).__name__}: {str(e)[:160]}"})
        print(json.dumps(rows[-1]), flush=True)
    return sorted(rows, key=lambda r: r.get("ms", math.inf))


def tune_write(reps: int, batch=8, seq=32768, kv_heads=8, d=128) -> list[dict]:
    """GPU time of the Triton bulk kernel (token-major K codes) over a grid of BlockSizes, fastest first."""
    x = [jax.random.normal(jax.random.key(i), (batch, seq, kv_heads, d), jnp.bfloat16) for i in range(2)]
    rot = jnp.asarray(np.linalg.qr(np.random.default_rng(0).standard_normal((kv_heads, d, d)))[0], jnp.float32)
    nbytes = x[0].size * 2 + x[0].size // 4 + 2 * 2 * batch * seq * kv_heads
    rows = []
    for kw in (dict(block_rows=r, num_warps=w, loop=n) for r in (16, 32) for w in (4, 8) for n in (1, 4, 8, 16)):
        bs = quantize_pack.BlockSizes(**kw)
        op = functools.partial(quantize_pack.quantize_pack, rot=rot, clip=0.96, bits=2,
                               levels=(0.0, 1.0, 2.0, 3.0), group_size=d, span=None,
                               scale_dtype=jnp.bfloat16, block_sizes=bs)
        try:
            t = time_group(unrolled(lambda a, op=op: op(a)), [(a,) for a in x], reps)
            rows.append({**dataclasses.asdict(bs), "ms": t * 1e3, "GBps": nbytes / t / 1e9})
        except Exception as e:  # noqa: BLE001 - a config Triton cannot compile
            rows.append({**dataclasses.asdict(bs), "error": f"{type(e).__name__}: {str(e)[:160]}"})
        print(json.dumps(rows[-1]), flush=True)
    return sorted(rows, key=lambda r: r.get("ms", math.inf))


def markdown(result: dict) -> str:
    lines = [f"Decode attention, C = 1, {result['device']}, jax {result['jax']}, "
             f"torch {result.get('torch', 'n/a')}; `{result['command']}`", "",
             "OSCAR = what `attend(implementation=\"auto\")` runs (kernel column); "
             "Triton and Mosaic GPU = each kernel's own time. Times are GPU time (profiler span of "
             "the op's kernels; torch: CUDA events); wall = wall-clock per call, host dispatch included.", "",
             "| shape | bpe | kernel | OSCAR ms | OSCAR GB/s | x cuDNN | x torch flash | "
             "cuDNN ms | torch flash ms | XLA bf16 ms | XLA dequant ms | Triton ms | Mosaic GPU ms | "
             "OSCAR wall ms | cuDNN wall ms |",
             "|" + "---|" * 15]
    f = lambda r, k: f"{r[k]:.3f}" if k in r else "n/a"
    # ratios from the times, so that a row cut off after some baselines still shows them
    x = lambda r, base: f"{r[base] / r['auto_ms']:.3f}" if base in r and "auto_ms" in r else "n/a"
    for r in (r for r in result["attention"] if r):  # {}: a row cut off while its cache was built
        lines.append(f"| {r['shape']['name']} | {r['bits_per_element']:.2f} | {r['auto']} | "
                     f"{f(r, 'auto_ms')} | {r.get('auto_GBps', float('nan')):.0f} | "
                     f"{x(r, 'jax_cudnn_ms')} | {x(r, 'torch_flash_ms')} | "
                     f"{f(r, 'jax_cudnn_ms')} | {f(r, 'torch_flash_ms')} | {f(r, 'jax_xla_ms')} | "
                     f"{f(r, 'xla_dequant_ms')} | {f(r, 'oscar_ms')} | "
                     f"{f(r, 'oscar_mgpu_ms') if 'oscar_mgpu_error' not in r else 'failed'} | "
                     f"{f(r, 'oscar_mgpu_wall_ms' if r['auto'] == 'pallas_mosaic_gpu' else 'oscar_wall_ms')} | "
                     f"{f(r, 'jax_cudnn_wall_ms')} |")
    c = result["ceiling"]
    w = result.get("write", {"error": "not run"})
    lines += ["", f"Read ceiling: XLA sum {c['xla_sum_read_GBps']:.0f} GB/s; copy (read + write) "
              f"{c['copy_read_write_GBps']:.0f} GB/s."]
    if "error" in w:
        lines.append(f"Bulk rotate-quantise-pack: {w['error']}")
    else:
        copy = c["copy_read_write_GBps"]
        part = lambda k: (f"{w[k + '_ms']:.3f} ms, {w[k + '_GBps']:.0f} GB/s ({100 * w[k + '_GBps'] / copy:.1f}%)"
                          if k + "_ms" in w else "failed")
        lines.append(f"Bulk rotate-quantise-pack {w['shape']} (2-bit, G = D, bf16 metadata; % of the copy "
                     f"bandwidth): Mosaic GPU K {part('mgpu_k')}, V {part('mgpu_v')}; Triton K "
                     f"{part('triton_k')}, V {part('triton_v')}.")
    if "xla_ms" in result.get("write_prompt", {}):
        wp = result["write_prompt"]
        lines.append(f"write_prompt of one layer {wp['shape']} (K and V): XLA {wp['xla_ms']:.3f} ms "
                     f"({wp['xla_GBps']:.0f} GB/s), bulk kernel {wp['pallas_ms']:.3f} ms "
                     f"({wp['pallas_GBps']:.0f} GB/s).")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON path; a .md table is written beside it")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--shapes", default="all", help="comma-separated indices into SHAPES, or 'all'")
    p.add_argument("--no-write", action="store_true", help="time the attention rows only")
    p.add_argument("--tune", action="store_true",
                   help="sweep BlockSizes on the first shape, then compare with the fastest")
    p.add_argument("--markdown", action="store_true",
                   help="only write the .md table of the JSON saved at --out (a cut-off run's too); no GPU")
    args = p.parse_args(argv)
    if args.markdown:
        with open(args.out) as f:
            write_markdown(json.load(f), args.out)
        return
    if jax.default_backend() != "gpu":
        sys.exit("bench/kernels.py needs a GPU")
    shapes = SHAPES if args.shapes == "all" else [SHAPES[int(i)] for i in args.shapes.split(",")]
    blocks, tuning = None, None
    if args.tune:  # sweep on the first shape, then compare every shape with the fastest setting
        tuning = {"shape": shapes[0].name, "attention": tune(shapes[0], args.reps),
                  "write": tune_write(args.reps)}
        best = {k: v for k, v in tuning["attention"][0].items() if k not in ("ms", "GBps")}
        blocks = mixed_attention.BlockSizes(**best)
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "python": platform.python_version(), "command": " ".join(["python"] + sys.argv),
              "reps": args.reps, "cache": "2-bit uniform, G=D, bf16 metadata, S0=64, W=256"}
    try:
        import torch
        result["torch"] = torch.__version__
    except ImportError:
        pass
    result["tuning"] = tuning
    result["block_sizes"] = dataclasses.asdict(blocks) if blocks else "per shape: BlockSizes.default"
    result["attention"] = []
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def save():  # after every op timed, so a cut-off run keeps what it measured (whole: a kill
        # mid-write leaves the last save)
        with open(args.out + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(args.out + ".tmp", args.out)

    result["ceiling"] = read_ceiling(args.reps)
    save()

    for name, fn in () if args.no_write else (("write", bench_write), ("write_prompt", bench_write_prompt)):
        try:
            result[name] = fn(args.reps)
        except Exception as e:  # noqa: BLE001 - record a compile failure, time the attention
            result[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(json.dumps(result[name]), flush=True)
        save()
    for shape in shapes:
        result["attention"].append({})
        bench_shape(shape, args.reps, blocks, row=result["attention"][-1], saved=save)
        print(json.dumps(result["attention"][-1]), flush=True)
        save()
    write_markdown(result, args.out)


def write_markdown(result: dict, out: str) -> None:
    """The table of `result` beside its JSON path `out` (.md), printed too."""
    table = markdown(result)
    with open(os.path.splitext(out)[0] + ".md", "w") as f:
        f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
