"""Where a decode step's GPU time goes: the kernels of the compiled decode loop of
`oscar bench` (same model, cache fill and loop), grouped by kernel name, from a profiler trace.

    python bench/decode_profile.py --model llama3-8b --cells oscar:8:8K,bf16:8:8K --out prof.json

Prints the step's span, its summed kernel time, the kernel count and the largest groups
(names with their numeric suffixes folded), and writes them as JSON (results schema).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from oscar_jax.models import bench, generate as gen, kv_policy, registry, results  # noqa: E402
from oscar_jax.models.decoder import fold_values  # noqa: E402


def kernel_events(trace_dir: str) -> list[tuple[int, int, str]]:
    """(start ns, duration ns, name) of every GPU kernel or copy in the trace, by start."""
    (path,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    events = []
    for plane in jax.profiler.ProfileData.from_file(path).planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                if line.name.startswith("Stream"):
                    events += [(e.start_ns, e.duration_ns, e.name) for e in line.events]
    return sorted(events)


def group(name: str) -> str:
    """A kernel name with numeric suffixes and template arguments folded."""
    return re.sub(r"[._]\d+", "", re.sub(r"<.*", "", name))[:80]


def profile(model, kv: str, context: int, batch: int, steps: int) -> dict:
    """Profile `steps` decode steps of `model` with a `kv` cache of `batch` sequences at `context`."""
    model, policy = fold_values(model, kv_policy.make_policy(kv))
    new_tokens = 1 + 2 * steps
    state = bench.filled_state(model, policy, batch, context - new_tokens, context)
    key = jax.random.key(0)
    program = gen.compile_decode(model, state, key, max_new_tokens=new_tokens)
    trace_dir = tempfile.mkdtemp(prefix="oscar_decode_")
    first = jnp.ones((batch,), jnp.int32)
    calls = []

    def on_segment(i):
        calls.append(i)
        if len(calls) == 1:  # the first segment warms up; trace the second
            jax.profiler.start_trace(trace_dir)

    t0 = time.perf_counter()
    gen.decode(model, state, first, key, max_new_tokens=new_tokens, program=program, segment=steps,
               on_segment=on_segment)
    jax.profiler.stop_trace()
    wall = time.perf_counter() - t0
    return {"kv": kv, "context": context, "batch": batch, "steps": steps, **summary(trace_dir, steps), "wall_s": wall}


def summary(trace_dir: str, steps: int) -> dict:
    """Per step of a trace of `steps` steps: the GPU span from the first kernel to the last, the
    summed kernel time, the kernel count, and the kernel groups by time."""
    events = kernel_events(trace_dir)
    span_ns = events[-1][0] + events[-1][1] - events[0][0]
    groups: dict[str, list[float]] = {}
    for _, dur, name in events:
        groups.setdefault(group(name), []).append(dur)
    rows = sorted(({"kernel": k, "ms_per_step": sum(v) / steps / 1e6, "count_per_step": len(v) / steps}
                   for k, v in groups.items()), key=lambda r: -r["ms_per_step"])
    return {"span_ms_per_step": span_ns / steps / 1e6, "busy_ms_per_step": sum(e[1] for e in events) / steps / 1e6,
            "kernels_per_step": len(events) / steps, "groups": rows}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-8b", help="a config-only architecture or checkpoint (random weights)")
    p.add_argument("--cells", default="oscar:8:8K", help="KV:BATCH:CONTEXT, comma-separated")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    model, _ = registry.load(args.model, dtype=jnp.bfloat16, random_weights=True)
    rows = []
    for cell in args.cells.split(","):
        kv, batch, context = cell.split(":")
        row = {"model": args.model, **profile(model, kv, bench._parse_count(context), int(batch), args.steps)}
        rows.append(row)
        results.write(args.out, results.record(rows))
        print(f"{row['kv']} B={row['batch']} ctx={row['context']}: span {row['span_ms_per_step']:.3f} ms/step, "
              f"kernels {row['busy_ms_per_step']:.3f} ms/step, {row['kernels_per_step']:.0f} kernels/step")
        for g in row["groups"][:args.top]:
            print(f"  {g['ms_per_step']:8.3f} ms  x{g['count_per_step']:6.1f}  {g['kernel']}")


if __name__ == "__main__":
    main()
