"""Time the GPU decode-attention and bulk-write kernels against bf16 attention, in one run.

Decode attention (C = 1 query per sequence, full-length rows) over the OSCAR cache (2-bit
uniform codes, G = D, bf16 metadata, S0 = 64, W = 256; `v_folded` params, as `oscar generate`
serves them) for named shapes, beside: JAX cuDNN bf16 (`jax.nn.dot_product_attention(...,
implementation="cudnn")`), torch SDPA bf16 with the flash backend (`enable_gqa=True`), XLA bf16
(`implementation="xla"`) and the XLA reference over the OSCAR cache (dequantise, then attend).
Both GPU implementations of `attend` are timed, the Triton kernel (`"pallas"`) and, where it
applies, the Mosaic GPU one (`"pallas_mosaic_gpu"`; a failure to compile is recorded in the row);
`auto_*` is the one `attend(implementation="auto")` runs. Also the bulk rotate-quantise-pack
kernels (Mosaic GPU and Triton, both code layouts) and `write_prompt` of a layer through XLA and
through the bulk kernel.

Timing: GPU time from a profiler trace (`device_time`: first kernel start to last kernel end of
a timed group, inter-kernel gaps included, host dispatch not), median of --reps repetitions
after warm-up; torch is timed with CUDA events, which likewise leave the host out. Each timed
group runs the op over enough distinct input copies (>= 3 x the device's L2, read from the
device) that no copy is served from L2, and the group time is divided by the number of copies.
Every baseline is measured in the same run. The wall-clock time of each JAX op (host dispatch
included) is recorded beside it (`*_wall_ms`), and for each OSCAR call the time of each of its
kernels (`*_kernels_us`). GB/s counts the bytes each op must read; `read_ceiling_GBps` is an XLA
sum over 4 GiB, `copy_GBps` a device-to-device copy (read + write), both in the same run.

    python bench/kernels.py                                    # every shape and the bulk write
    python bench/kernels.py --shapes b8-128k,b8-32k --no-write
    python bench/kernels.py --markdown bench/results/h200/decode_attention.json  # a table, no GPU

Writes bench/results/<device>/decode_attention.json (--name) and bulk_write.json (the schema of
`oscar_jax.models.results`; set OSCAR_COMMIT where the tree has no .git), each saved after
every op timed, so a run cut off by a time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from oscar_jax import attention  # noqa: E402
from oscar_jax import cache as cache_lib  # noqa: E402
from oscar_jax import updates  # noqa: E402
from oscar_jax.config import CacheSpec, QuantConfig, bits_per_element  # noqa: E402
from oscar_jax.models import results  # noqa: E402
from oscar_jax.pallas_kernels.gpu import mixed_attention_mgpu, quantize_pack, quantize_pack_mgpu  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SINK, WINDOW = 64, 256


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    seq: int


SHAPES = {
    "b8-8k": Shape(8, 32, 8, 128, 8192),
    "b8-32k": Shape(8, 32, 8, 128, 32768),
    "b8-128k": Shape(8, 32, 8, 128, 131072),
    "b1-128k": Shape(1, 32, 8, 128, 131072),
    "b32-32k": Shape(32, 32, 8, 128, 32768),
    "smollm2-b8-8k": Shape(8, 9, 3, 64, 8192),  # SmolLM2-135M's attention
    "gemma3-b8-32k": Shape(8, 4, 1, 256, 32768),  # Gemma-3-270m's global layers
}


@dataclasses.dataclass(frozen=True)
class Device:
    """What the bench needs to know about the GPU, read from it (torch's device properties)."""
    name: str
    l2_bytes: int
    sm_count: int
    memory_bytes: int

    @classmethod
    def read(cls) -> "Device":
        try:
            import torch
        except ImportError:
            sys.exit("bench/kernels.py reads the GPU's L2 size through torch.cuda.get_device_properties "
                     "(and times torch flash attention): install torch")
        p = torch.cuda.get_device_properties(0)
        return cls(p.name, p.L2_cache_size, p.multi_processor_count, p.total_memory)


def time_group(fn, copies, reps: int, warmup: int = 3) -> float:
    """GPU seconds per call of fn over `copies` (a list of argument tuples): `device_time`'s span."""
    return device_time(fn, copies, reps, warmup)["span_ms"] / 1e3


def wall_time(fn, copies, reps: int, warmup: int = 3) -> float:
    """Median wall-clock seconds per call of fn over `copies`, device-synchronised (host dispatch
    included, which a decode loop amortises)."""
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
    spec = CacheSpec(1, batch, kv_heads, d, seq + 1, SINK, WINDOW, QuantConfig(2))
    rot = jnp.asarray(np.linalg.qr(np.random.default_rng(0).standard_normal((d, d)))[0], jnp.float32)
    params = cache_lib.LayerParams.create(rot, rot, 0.96, 0.92, num_layers=1, kv_heads=kv_heads,
                                          v_folded=True).layer(0)
    return cache_lib.OscarCache.init(spec).layer(0), params


def build_oscar(shape: Shape, key):
    """A full OSCAR cache layer of `shape` (written through XLA; the bulk write is timed apart),
    its params and the bf16 K and V [B, T, Hkv, D] it holds."""
    empty, params = empty_layer(shape.batch, shape.seq, shape.kv_heads, shape.head_dim)
    kk, kv = jax.random.split(key)
    x_shape = (shape.batch, shape.seq, shape.kv_heads, shape.head_dim)
    k = jax.random.normal(kk, x_shape, jnp.bfloat16)
    v = jax.random.normal(kv, x_shape, jnp.bfloat16)
    write = jax.jit(functools.partial(updates.write_prompt, implementation="xla"))
    cache = write(empty, k, v, jnp.full((shape.batch,), shape.seq, jnp.int32), params)
    return cache, params, k, v


def oscar_bytes(shape: Shape) -> int:
    """Bytes the kernel must read per call: codes + metadata of the history, bf16 sink + ring."""
    n_hist = shape.seq - SINK - WINDOW
    per_head = n_hist * shape.head_dim // 4 + 2 * n_hist * 2 + (SINK + WINDOW) * shape.head_dim * 2
    return 2 * shape.batch * shape.kv_heads * per_head


def bandwidth(reps: int) -> dict:
    """Read bandwidth of an XLA sum over 4 GiB of bf16 and of a device-to-device copy (r + w)."""
    x = jax.random.normal(jax.random.key(1), (2**31 // 2, 2), jnp.bfloat16)
    nbytes = x.size * 2
    t_sum = time_group(unrolled(lambda a: jnp.sum(a, dtype=jnp.float32)), [(x,)], reps)
    t_copy = time_group(unrolled(lambda a: a + 1), [(x,)], reps)
    del x
    return {"read_ceiling_GBps": nbytes / t_sum / 1e9, "copy_GBps": 2 * nbytes / t_copy / 1e9}


def n_copies(nbytes: int, device: Device) -> int:
    """Distinct input copies a timed group walks: >= 3 x L2 in total, 2 to 16."""
    return max(2, min(16, math.ceil(3 * device.l2_bytes / nbytes)))


def bench_shape(name: str, reps: int, device: Device, row: dict, saved=lambda: None) -> dict:
    """Time one shape's row into `row` (returned), calling saved() after every op timed, so
    that a run cut off by a time limit keeps the columns it measured."""
    shape = SHAPES[name]
    g = shape.q_heads // shape.kv_heads
    cache, params, k, v = build_oscar(shape, jax.random.key(sorted(SHAPES).index(name)))
    q = jax.random.normal(jax.random.key(2), (shape.batch, 1, shape.q_heads, shape.head_dim), jnp.bfloat16)
    nbytes = oscar_bytes(shape)
    bf16_nbytes = 2 * k.size * 2
    oscar_copies = [(q, cache)] + [(q, jax.tree.map(jnp.copy, cache)) for _ in range(n_copies(nbytes, device) - 1)]
    row.update({"shape": name, **dataclasses.asdict(shape),
                "bits_per_element": bits_per_element(cache.spec, shape.seq),
                "oscar_bytes": nbytes, "bf16_bytes": bf16_nbytes, "v_folded": params.v_folded,
                "auto": attention.resolve("auto", cache.spec, 1, g, backend="gpu")})

    def time_oscar(prefix: str, implementation: str) -> None:
        """attend(implementation) over the copies: its GPU time -> row[prefix + "_ms"], its
        kernels' own time -> row[prefix + "_kernels_us"], its wall-clock time and GB/s."""
        run = unrolled(lambda qq, c: attention.attend(qq, c, params, implementation=implementation))
        timed = device_time(run, oscar_copies, reps)
        row[f"{prefix}_ms"] = timed["span_ms"]
        row[f"{prefix}_kernels_us"] = {kernel: ms * 1e3 for kernel, ms in timed["kernels"].items()}
        row[f"{prefix}_wall_ms"] = wall_time(run, oscar_copies, reps) * 1e3
        row[f"{prefix}_GBps"] = nbytes / timed["span_ms"] * 1e-6
        saved()

    time_oscar("triton", "pallas")
    if mixed_attention_mgpu.supports(cache.spec, 1, g):
        try:
            time_oscar("mgpu", "pallas_mosaic_gpu")
        except Exception as e:  # noqa: BLE001 - record a compile failure, time the rest
            row["mgpu_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            for key in ("mgpu_ms", "mgpu_kernels_us"):  # no time of a call that failed
                row.pop(key, None)
    auto = "mgpu" if row["auto"] == "pallas_mosaic_gpu" else "triton"
    if f"{auto}_ms" in row:
        row["auto_ms"], row["auto_GBps"] = row[f"{auto}_ms"], row[f"{auto}_GBps"]
    row["xla_dequant_ms"] = time_group(
        unrolled(lambda qq, c: attention.attend(qq, c, params, implementation="xla")),
        oscar_copies[:2], max(5, reps // 10)) * 1e3
    saved()
    oscar_copies.clear()  # free the OSCAR caches before the bf16 copies
    del cache
    bf16_copies = [(q, k, v)] + [(q, jnp.copy(k), jnp.copy(v)) for _ in range(n_copies(bf16_nbytes, device) - 1)]
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
        row["torch"] = torch.__version__
        row["torch_flash_ms"] = t * 1e3
        row["torch_flash_GBps"] = bf16_nbytes / t / 1e9
        del t_copies
    except Exception as e:  # noqa: BLE001
        row["torch_flash_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    for base in ("jax_cudnn", "torch_flash", "jax_xla", "xla_dequant"):
        for prefix in ("triton", "mgpu", "auto"):
            if f"{base}_ms" in row and f"{prefix}_ms" in row:
                row[f"{prefix}_speedup_vs_{base}"] = row[f"{base}_ms"] / row[f"{prefix}_ms"]
    return row


def bench_write(reps: int, batch=8, seq=32768, kv_heads=8, d=128) -> dict:
    """The bulk kernels on [B, T, Hkv, D] bf16, K (token-major) and V (channel-major) code
    layouts: the Mosaic GPU one (what `write_prompt` runs for this cache on Hopper) and the
    Triton one. bytes = x read + codes and metadata written."""
    x = [jax.random.normal(jax.random.key(i), (batch, seq, kv_heads, d), jnp.bfloat16) for i in range(2)]
    rot = jnp.asarray(np.linalg.qr(np.random.default_rng(0).standard_normal((kv_heads, d, d)))[0], jnp.float32)
    nbytes = x[0].size * 2 + x[0].size // 4 + 2 * 2 * batch * seq * kv_heads
    row = {"op": "quantize_pack", "shape": [batch, seq, kv_heads, d], "bits": 2, "group_size": d, "bytes": nbytes}
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
    row = {"op": "write_prompt", "shape": list(x_shape), "bits": 2, "group_size": d, "bytes": nbytes}
    for impl in ("xla", "pallas"):
        write = functools.partial(updates.write_prompt, implementation=impl)
        t = time_group(unrolled(write), copies, reps)
        row[f"{impl}_ms"], row[f"{impl}_GBps"] = t * 1e3, nbytes / t / 1e9
    return row


def _cell(row: dict, key: str, fmt: str = "{:.3f}") -> str:
    return fmt.format(row[key]) if key in row else "n/a"


def attention_table(rec: dict) -> str:
    """Markdown table of a decode_attention record; ratios come from the times, so a row cut
    off after some baselines still shows those."""
    lines = [f"Decode attention, C = 1, {rec['device']}, jax {rec['jax']}, commit {rec['commit']}, "
             f"{rec['date']}; `{rec['command']}`", "",
             "| shape | bpe | auto | ms | GB/s | % read ceiling | x cuDNN | x torch flash | cuDNN ms | "
             "torch flash ms | XLA bf16 ms | XLA dequant ms | Triton ms | Mosaic GPU ms |",
             "|" + "---|" * 14]
    ratio = lambda r, base: f"{r[base] / r['auto_ms']:.2f}" if base in r and "auto_ms" in r else "n/a"
    for r in rec["rows"]:
        if "shape" not in r:  # cut off while its cache was built
            continue
        ceiling = (f"{100 * r['auto_GBps'] / r['read_ceiling_GBps']:.1f}"
                   if "auto_GBps" in r and "read_ceiling_GBps" in r else "n/a")
        lines.append(" | ".join([
            f"| {r['shape']}", f"{r['bits_per_element']:.2f}", r.get("auto", "n/a"), _cell(r, "auto_ms"),
            _cell(r, "auto_GBps", "{:.0f}"), ceiling, ratio(r, "jax_cudnn_ms"), ratio(r, "torch_flash_ms"),
            _cell(r, "jax_cudnn_ms"), _cell(r, "torch_flash_ms"), _cell(r, "jax_xla_ms"), _cell(r, "xla_dequant_ms"),
            _cell(r, "triton_ms"), "failed" if "mgpu_error" in r else _cell(r, "mgpu_ms")]) + " |")
    return "\n".join(lines)


def write_table(rec: dict) -> str:
    """Markdown table of a bulk_write record (% of the same run's copy bandwidth)."""
    lines = [f"Bulk write, {rec['device']}, jax {rec['jax']}, commit {rec['commit']}, {rec['date']}; "
             f"`{rec['command']}`", "", "| op | shape | implementation | ms | GB/s | % of copy |",
             "|---|---|---|---|---|---|"]
    for r in rec["rows"]:
        for impl in ("mgpu_k", "mgpu_v", "triton_k", "triton_v", "xla", "pallas"):
            if f"{impl}_ms" in r:
                copy = (f"{100 * r[impl + '_GBps'] / r['copy_GBps']:.1f}" if "copy_GBps" in r else "n/a")
                lines.append(f"| {r['op']} | {r['shape']} | {impl} | {r[impl + '_ms']:.3f} | "
                             f"{r[impl + '_GBps']:.0f} | {copy} |")
            elif f"{impl}_error" in r:
                lines.append(f"| {r['op']} | {r['shape']} | {impl} | failed | | |")
    return "\n".join(lines)


def markdown(rec: dict) -> str:
    """The table of a decode_attention or bulk_write record."""
    return write_table(rec) if any("op" in r for r in rec["rows"]) else attention_table(rec)


def parse_shapes(text: str) -> list[str]:
    names = list(SHAPES) if text == "all" else [s.strip() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in SHAPES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"--shapes {text!r}: expected 'all' or names from {', '.join(SHAPES)}")
    return names


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", type=parse_shapes, default="all",
                   help=f"comma-separated shape names ({', '.join(SHAPES)}) or 'all'")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--no-write", action="store_true", help="time the attention rows only, not the bulk write")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="folder of the records (default: bench/results/<device>)")
    p.add_argument("--name", default="decode_attention",
                   help="file name (without .json) of the decode-attention record; the bulk write's is bulk_write")
    p.add_argument("--markdown", type=Path, metavar="FILE", help="print the table of a saved record; no GPU")
    args = p.parse_args(argv)
    if args.markdown:
        print(markdown(results.read(args.markdown)))
        return
    if jax.default_backend() != "gpu":
        sys.exit("bench/kernels.py needs a GPU")
    device = Device.read()
    out_dir = args.out_dir or RESULTS / results.device_folder(results.device_kind())
    facts = {"reps": args.reps, "l2_bytes": device.l2_bytes, "sm_count": device.sm_count,
             "memory_bytes": device.memory_bytes, **bandwidth(args.reps)}
    command = " ".join(["python", "bench/kernels.py", *(sys.argv[1:] if argv is None else argv)])

    if not args.no_write:
        write_rec = results.record([], command)
        for fn in (bench_write, bench_write_prompt):
            try:
                row = {**fn(args.reps), **facts}
            except Exception as e:  # noqa: BLE001 - record a compile failure, time the attention
                row = {"op": fn.__name__.removeprefix("bench_"), "error": f"{type(e).__name__}: {str(e)[:300]}"}
            write_rec["rows"].append(row)
            results.write(out_dir / "bulk_write.json", write_rec)
            print(json.dumps(row), flush=True)
        print(markdown(write_rec))
    rec = results.record([], command)
    path = out_dir / f"{args.name}.json"
    for name in args.shapes:
        rec["rows"].append({})
        row = bench_shape(name, args.reps, device, rec["rows"][-1], saved=lambda: results.write(path, rec))
        row.update(facts)
        results.write(path, rec)
        print(json.dumps(row), flush=True)
    print(markdown(rec))


if __name__ == "__main__":
    main()
