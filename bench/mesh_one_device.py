"""The decode step on a one-device mesh against the same step without a mesh, in one run: the
OSCAR layers then append and attend inside `shard_map` (docs/serving.md §7), which should cost
nothing. Per KV scheme: ms/token (p50 over segments) both ways, their ratio, whether the compiled
mesh program still calls the Mosaic GPU kernel, and whether both decode the same tokens. The
plain step is timed before and after the meshes (A-B-A), and each ratio is against the mean of
the two, so a drift of the machine during the run shows as the spread of the two plain timings
instead of as a cost of the mesh.

    python bench/mesh_one_device.py --model llama3-8b --kv oscar,bf16 --context 32K --batch 8 \
        --mesh model=1 --mesh data=1,model=1,seq=1

Each `--mesh` is a one-device mesh (default `model=1`); with a `seq` axis the OSCAR layers run
the sequence-parallel step (`parallel.append_attend`: the kernel inside `shard_map`, then the
log-sum-exp merge).

Writes bench/results/<device>/mesh_one_device.json (`--out`).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from oscar_jax.models import bench, generate as gen, kv_policy, parallel, registry, results
from oscar_jax.models.decoder import fold_values


def decode_row(model, policy, mesh, context: int, batch: int, steps: int, segment: int) -> dict:
    """Time `steps` decode steps over a filled state (mesh None: one device, no shard_map)."""
    if mesh is not None:
        model = parallel.shard(model, mesh)
    new = 1 + segment + steps
    kv = bench.filled_state(model, policy, batch, context - new - 8, context, mesh=mesh)  # + 8 compared tokens
    jax.block_until_ready(kv)
    program = gen.compile_decode(model, kv, jax.random.key(1), max_new_tokens=new)
    mosaic = "mosaic_gpu" in program.as_text().lower()
    timed = bench.time_decode(model, kv, steps=steps, segment=segment)
    out, _, _ = gen.decode(model, timed.pop("kv"), jnp.ones((batch,), jnp.int32), jax.random.key(2),
                           max_new_tokens=8)
    return {"tpot_p50_ms": 1e3 * float(np.median(timed["per_token_s"])), "mosaic_gpu_kernel": mosaic,
            "tokens": np.asarray(out).tolist()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--kv", default="oscar,bf16")
    p.add_argument("--context", default="32K")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--segment", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--mesh", action="append", default=None, help="a one-device mesh, e.g. seq=1 (repeatable)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    context = bench._parse_count(a.context)
    meshes = {spec: parallel.parse_mesh(spec, jax.devices()[:1]) for spec in a.mesh or ["model=1"]}
    model, _ = registry.load(a.model, dtype=jnp.dtype(a.dtype), random_weights=True)
    rows = []
    for name in a.kv.split(","):
        serve_model, policy = fold_values(model, kv_policy.make_policy(name))
        measure = lambda mesh: decode_row(serve_model, policy, mesh, context, a.batch, a.steps, a.segment)
        before = measure(None)
        meshed = {spec: measure(mesh) for spec, mesh in meshes.items()}
        after = measure(None)
        plain_ms = (before["tpot_p50_ms"] + after["tpot_p50_ms"]) / 2
        for spec, m in meshed.items():
            row = {"kv": name, "mesh": spec, "context": context, "batch": a.batch, "model": a.model,
                   "tpot_p50_ms": plain_ms, "plain_before_ms": before["tpot_p50_ms"],
                   "plain_after_ms": after["tpot_p50_ms"], "mesh_tpot_p50_ms": m["tpot_p50_ms"],
                   "mesh_over_plain": m["tpot_p50_ms"] / plain_ms, "mosaic_gpu_kernel": before["mosaic_gpu_kernel"],
                   "mesh_mosaic_gpu_kernel": m["mosaic_gpu_kernel"], "same_tokens": before["tokens"] == m["tokens"]}
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
            rows.append(row)
    out = a.out or results.default_path("bench/results", "mesh_one_device")
    results.write(out, results.record(rows))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
