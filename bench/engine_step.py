"""The serving engine's decode step alone: ms a token of the engine's own program
(`programs.decode`: the paged pool or dense slots, per-row sampling, one call from Python with
the engine's host work around it) with LIVE of its SLOTS slots running, against the static
decode loop of `oscar bench` over those rows alone (same model, cache scheme and lengths, in a
contiguous state just long enough: what the step could take).

    python bench/engine_step.py --model llama3-8b --cells oscar:64:39,bf16:11:11 --context 20K

A cell KV:SLOTS:LIVE fills every slot with `--context` random tokens (as if idle slots held
the sequences that finished there; the engine empties them before each step) and times, per
variant, greedy unless named:
  1 step a call    one decode step a call (`--decode-steps 1`, or a round of one prefill piece)
  K steps a call   a round of `--decode-steps` K steps a call (per token)
  top_p            K steps a call, every running row sampling at temperature 1, top_p 0.9
  capacity line    K steps a call with the Mosaic GPU kernel's work cut at trace time for every
                   slot at full capacity instead of from the live lengths (paged, on a GPU)
  static           `bench.time_decode` over LIVE rows of a contiguous state just long enough,
                   no engine (per token of 8-step segments)
With `--profile` the one-step call is traced once more and its GPU time grouped by kernel
(`decode_profile.summary`: the span from its first GPU event to its last, host gaps between
calls included; summed kernel and copy time; their count a step).
Writes bench/results/<device>/engine_step_<model>.json (`--out`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from oscar_jax import attention, dispatch, paged  # noqa: E402
from oscar_jax.models import bench, kv_policy, registry, results  # noqa: E402
from oscar_jax.models.cli import unwritable  # noqa: E402
from oscar_jax.models.serving import Engine, programs  # noqa: E402
from oscar_jax.pallas_kernels.gpu import mixed_attention_mgpu  # noqa: E402

import decode_profile  # noqa: E402  (bench/, beside this script)


def filled_engine(model, policy, slots: int, context: int, capacity: int, page: int, decode_steps: int) -> Engine:
    """An engine of `slots` slots, each holding the same `context` random tokens (every page a
    slot can take in its block-table row, so appends always find theirs)."""
    engine = Engine(model, policy, slots=slots, max_len=capacity, page_tokens=page, prefill_chunk=page,
                    decode_steps=decode_steps)
    part = bench.filled_state(model, engine._part_policy, 1, context, engine.capacity, chunk=engine._chunk)
    per_slot = engine.tables.shape[1] if engine.paged else 0
    for b in range(slots):
        engine.tables[b, :per_slot] = np.arange(b * per_slot, (b + 1) * per_slot)
        engine.state = programs.insert(engine.state, part, jnp.int32(b), jnp.asarray(engine.tables), jnp.int32(0))
    jax.block_until_ready(engine.state)
    return engine


def time_calls(engine: Engine, running: np.ndarray, calls: int, steps_a_call: int, temperature: float,
               top_p: float, trace_dir: str | None = None) -> list[float]:
    """Seconds a token of each of `calls` engine decode calls of `steps_a_call` steps (after one),
    the host's arrays included: rows `running` decode, the others are idle (block-table rows
    cleared, emptied before each step) as the engine leaves them. trace_dir: traced there."""
    b = engine.slots
    tables = np.where(running[:, None], engine.tables, paged.NO_PAGE)
    rows = lambda value, dtype: np.where(running, value, 0).astype(dtype)
    out = []
    for i in range(calls + 1):
        if i == 1 and trace_dir:
            jax.profiler.start_trace(trace_dir)
        t0 = time.perf_counter()
        sampling = (rows(temperature, np.float32), np.where(running, top_p, 1.0).astype(np.float32),
                    np.zeros(b, np.int32), rows(1 + i * steps_a_call, np.int32))
        args = (jnp.asarray(tables), jnp.ones(b, jnp.int32), jnp.asarray(running), *map(jnp.asarray, sampling))
        nxt, engine.state = programs.decode(engine.model, engine.state, *args, jnp.int32(steps_a_call),
                                            most=engine.decode_steps)
        np.asarray(nxt)
        out.append((time.perf_counter() - t0) / steps_a_call)
    if trace_dir:
        jax.profiler.stop_trace()
    return out[1:]


@contextlib.contextmanager
def capacity_line():
    """Within: the paged Mosaic GPU decode registered with its work cut at trace time for every
    slot at full capacity (`live=False`), the programs traced again."""
    key = ("paged_attend", "pallas_mosaic_gpu")
    live_line = dispatch._REGISTRY[key]
    kernel = attention.kernel_attend(functools.partial(mixed_attention_mgpu.mixed_attention, live=False),
                                     rotates=True, paged=True)
    dispatch.register(*key, kernel, supports=live_line[1])
    jax.clear_caches()
    try:
        yield
    finally:
        dispatch.register(*key, *live_line)
        jax.clear_caches()


def _ms(seconds) -> dict:
    return {"step_ms_p50": 1e3 * float(np.median(seconds)), "step_ms_p90": 1e3 * float(np.percentile(seconds, 90))}


def cell_rows(model, name: str, slots: int, live: int, context: int, capacity: int, page: int,
              steps: int, decode_steps: int, profile: bool = False) -> list[dict]:
    """The variants' rows of one cell (module docstring); `steps` tokens timed in each."""
    policy = kv_policy.make_policy(name)
    engine = filled_engine(model, policy, slots, context, capacity, page, decode_steps)
    running = np.arange(slots) < live
    k = decode_steps
    variants = {"1 step a call": (1, 0.0, 1.0), f"{k} steps a call": (k, 0.0, 1.0),
                f"top_p, {k} steps a call": (k, 1.0, 0.9)}
    rows = []
    base = {"kv": name, "slots": slots, "live": live, "context": context, "capacity": engine.capacity}
    for variant, (steps_a_call, temperature, top_p) in variants.items():
        seconds = time_calls(engine, running, -(-steps // steps_a_call), steps_a_call, temperature, top_p)
        rows.append({**base, "variant": variant, **_ms(seconds)})
        print(rows[-1], flush=True)
    if engine.paged and jax.default_backend() == "gpu":
        with capacity_line():
            seconds = time_calls(engine, running, -(-steps // k), k, 0.0, 1.0)
        rows.append({**base, "variant": f"{k} steps a call, capacity line", **_ms(seconds)})
        print(rows[-1], flush=True)
    if profile:  # the one-step call again, traced: where its time goes on the GPU
        trace_dir = tempfile.mkdtemp(prefix="oscar_engine_step_")
        time_calls(engine, running, steps, 1, 0.0, 1.0, trace_dir=trace_dir)
        rows.append({**base, "variant": "1 step a call, traced", **decode_profile.summary(trace_dir, steps)})
        print({k: v for k, v in rows[-1].items() if k != "groups"}, flush=True)
    del engine  # its pool, before the static state is allocated
    static_capacity = context + steps + 64  # the rows' own length
    state = bench.filled_state(model, policy, live, context, static_capacity)
    per_token = np.asarray(bench.time_decode(model, state, steps=steps, segment=8)["per_token_s"])
    rows.append({**base, "capacity": static_capacity, "variant": "static, per token of 8-step segments",
                 **_ms(per_token)})
    print(rows[-1], flush=True)
    return rows


def _check_args(p: argparse.ArgumentParser, a) -> tuple[list[tuple[str, int, int]], int, int]:
    """(cells, context, capacity), or `p.error` naming the option, before any model work."""
    cells = []
    for cell in a.cells.split(","):
        name, _, rest = cell.partition(":")
        slots, _, live = rest.partition(":")
        if name not in kv_policy.POLICIES or not (slots.isdigit() and live.isdigit()) or \
                not 1 <= int(live) <= int(slots):
            p.error(f"--cells {cell!r}: expected KV:SLOTS:LIVE, KV one of {', '.join(kv_policy.POLICIES)}, "
                    "1 <= LIVE <= SLOTS")
        cells.append((name, int(slots), int(live)))
    try:
        context, capacity = bench._parse_count(a.context), bench._parse_count(a.capacity)
    except ValueError:
        p.error(f"--context {a.context!r} / --capacity {a.capacity!r}: expected token counts such as 20K")
    if min(a.steps, a.page_tokens, a.decode_steps) < 1:
        p.error(f"--steps {a.steps} / --page-tokens {a.page_tokens} / --decode-steps {a.decode_steps}: "
                "expected ints >= 1")
    room = capacity - (4 + a.profile) * (a.steps + 2 * a.decode_steps)  # what the running rows grow by, at most
    if not 1 <= context <= room:
        p.error(f"--context {a.context}: expected 1 <= context <= capacity - runs (steps + 2 decode steps) = {room}")
    if a.profile and jax.default_backend() != "gpu":
        p.error(f"--profile: expected a GPU (traces GPU kernels), not {jax.default_backend()}")
    if a.dtype not in ("bfloat16", "float32"):
        p.error(f"--dtype {a.dtype!r}: expected bfloat16 or float32")
    problem = a.out and unwritable(Path(a.out), "--out")
    if problem:
        p.error(problem)
    return cells, context, capacity


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-8b", help="a config-only architecture (random weights)")
    p.add_argument("--cells", default="oscar:64:39,bf16:11:11", help="KV:SLOTS:LIVE, comma-separated")
    p.add_argument("--context", default="20K", help="tokens every slot holds")
    p.add_argument("--capacity", default="34816", help="tokens a slot holds at most")
    p.add_argument("--page-tokens", type=int, default=1024)
    p.add_argument("--steps", type=int, default=32, help="tokens timed in each variant")
    p.add_argument("--decode-steps", type=int, default=8, help="decode steps a call of the K-step variants")
    p.add_argument("--profile", action="store_true", help="also trace the engine's step (GPU) and group its kernels")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    cells, context, capacity = _check_args(p, a)
    model, _ = registry.load(a.model, dtype=jnp.dtype(a.dtype), random_weights=True)
    rows = [row for name, slots, live in cells
            for row in cell_rows(model, name, slots, live, context, capacity, a.page_tokens, a.steps, a.decode_steps,
                                 a.profile)]
    out = a.out or results.default_path("bench/results", f"engine_step_{a.model}")
    results.write(out, results.record(rows, " ".join(["python", "bench/engine_step.py", *(argv or sys.argv[1:])])))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
