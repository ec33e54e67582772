"""`oscar bench`: decode throughput per KV scheme at one KV memory budget, set against the
step's memory roofline.

For each scheme and context length (the cache's capacity per sequence): the largest batch
whose KV cache fits the budget (or a fixed `--batch`), smaller where the compiled decode loop
(state plus XLA's temporaries, large where attention runs in XLA) would not fit the device
(one device; the row's `batch_limited_by` says so); the cache filled through
`write_prompt` with random post-RoPE K/V to `context - new tokens` (decode speed does not
depend on the values, and a real prefill of dozens of long prompts would take minutes);
then the compiled decode loop, timed per segment of steps: time per output token (p50/p99
over segments), decode tokens/s, KV bytes and bits/element, and the roofline of one step
(every weight and every held token's K/V read once, over the device-to-device copy
bandwidth measured in the same run). Then the time to first token of one prompt of that
length through the real prefill (compile excluded). The ceiling of a scheme's throughput
against bf16 at one budget is 16 / its bits per element.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import typer

from oscar_jax.models import generate as gen, kv_policy, results
from oscar_jax.models.cli import app, console
from oscar_jax.models.decoder import Decoder, fold_values

GIB = 2 ** 30
NOT_RUN = "not run: the run stopped before this cell"  # the error of the cells a cut-off run left


def copy_bandwidth(nbytes: int | None = None, reps: int = 20) -> float:
    """Bytes read plus written per second by device memory passes (read one buffer, write one):
    `reps` passes over 2 GiB on an accelerator (far past its caches; 64 MiB on a CPU),
    dispatched back to back so that the host's launch and wait do not count."""
    nbytes = nbytes or (2 ** 26 if jax.default_backend() == "cpu" else 2 * GIB)
    x = jax.random.normal(jax.random.key(0), (nbytes // 2,), jnp.bfloat16)
    step = jax.jit(lambda a: a * 0.5 + 1, donate_argnums=0)  # one read and one write per element
    x = step(x).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(reps):
        x = step(x)
    x.block_until_ready()
    return 2 * nbytes * reps / (time.perf_counter() - t0)


def weight_bytes(model: Decoder) -> int:
    """Bytes of the weights one decode step reads: every layer's, the final norm and the LM head
    (the embedding table when tied; an untied table is read only at the batch's rows)."""
    layers = sum(x.size * x.dtype.itemsize for block in model.layers for x in block.arrays().values())
    head = model.embed[...] if model.lm_head is None else model.lm_head[...]
    norm = model.final_norm[...]
    return int(layers + head.size * head.dtype.itemsize + norm.size * norm.dtype.itemsize)


def sequence_bytes(model: Decoder, policy, max_len: int) -> int:
    """Bytes of one sequence's K/V arrays and their scales at capacity `max_len` (each grows with
    the batch), the per-sequence counters (lengths, flags) left out."""
    state = jax.eval_shape(lambda: policy.init(model.cfg, 1, max_len))
    caches = [layer.cache if isinstance(layer, kv_policy.OscarLayer) else layer for layer in state.layers]
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(caches) if x.ndim >= 2)


def _first_row(layer):
    """An empty layer's first row: the same layer for one sequence (every cache array leads with
    the batch; an `OscarLayer` keeps its params, its spec says batch 1)."""
    if isinstance(layer, kv_policy.OscarLayer):
        cache = jax.tree.map(lambda x: x[:1], layer.cache)
        return dataclasses.replace(layer, cache=dataclasses.replace(cache, spec=dataclasses.replace(cache.spec,
                                                                                                   batch=1)))
    return jax.tree.map(lambda x: x[:1], layer)


@functools.partial(jax.jit, static_argnames=("context",), donate_argnames=("full",))
def _fill_layer(full, key, *, context: int):
    """Write random post-RoPE k, v of `context` tokens into one row of the empty layer `full`
    (donated) and copy it into every row: temporaries of one sequence of one layer only."""
    one = _first_row(full)
    shape = (1, context, *_heads(one))
    k, v = (jax.random.normal(part, shape, jnp.bfloat16) for part in jax.random.split(key))
    one = kv_policy.write_prompt(one, k, v, jnp.full((1,), context, jnp.int32))
    leaves, treedef = jax.tree.flatten(full)  # (its static batch differs from one's)
    # An update of `full` (not a new array), so that its donated buffers are reused.
    fill = lambda src, dst: jax.lax.dynamic_update_slice(dst, jnp.broadcast_to(src, dst.shape).astype(dst.dtype),
                                                         (0,) * dst.ndim)
    return treedef.unflatten([fill(src, dst) for src, dst in zip(jax.tree.leaves(one), leaves)])


def _heads(layer) -> tuple[int, int]:
    """(Hkv, D) of one layer's cache."""
    if isinstance(layer, kv_policy.OscarLayer):
        return layer.cache.spec.kv_heads, layer.cache.spec.head_dim
    spec = getattr(layer, "spec", None)
    return (spec.kv_heads, spec.head_dim) if spec is not None else tuple(layer.k.shape[-2:])


def filled_state(model: Decoder, policy, batch: int, context: int, max_len: int, seed: int = 0,
                 mesh: jax.sharding.Mesh | None = None, chunk: int = 1) -> kv_policy.KVState:
    """A KV state of `batch` sequences holding `context` random tokens each (capacity max_len,
    extend chunks of up to `chunk` tokens; with `mesh`, in its shards there)."""
    kv = gen.init_state(model, policy, batch, max_len, chunk, mesh=mesh)
    keys = jax.random.split(jax.random.key(seed), len(kv.layers))
    layers = tuple(_fill_layer(full, key, context=context) for full, key in zip(kv.layers, keys))
    kv = kv_policy.KVState(layers, jnp.full((batch,), context, jnp.int32))
    return kv if mesh is None else jax.device_put(kv, kv_policy.state_shardings(kv, mesh))


def fit_decode(model: Decoder, policy, batch: int, context: int, new_tokens: int, limit: float):
    """(batch, program): a batch <= `batch` whose compiled decode loop (`new_tokens` tokens over
    states of capacity `context`, one device) fits `limit` bytes: its arguments (weights and
    state; the output aliases the donated state) plus XLA's temporaries, which grow with the
    batch where attention runs in XLA. The batch shrinks by the measured excess until the
    program fits; (0, None) when one sequence does not."""
    fixed = weight_bytes(model)
    while batch >= 1:
        kv = jax.eval_shape(lambda: policy.init(model.cfg, batch, context))  # as `gen.init_state` makes it
        program = gen.compile_decode(model, kv, jax.random.key(1), max_new_tokens=new_tokens)
        use = program.memory_analysis()
        need = use.argument_size_in_bytes + use.temp_size_in_bytes
        if need <= limit:
            return batch, program
        batch = min(batch - 1, int(batch * max(limit - fixed, 0) / max(need - fixed, 1)))
    return 0, None


def time_decode(model: Decoder, kv: kv_policy.KVState, *, steps: int, segment: int, warmup: int = 1,
                program=None) -> dict:
    """Time the compiled decode loop: `warmup` segments, then `steps` tokens in segments of
    `segment` steps (program: `gen.compile_decode`'s for this state and 1 + segment * warmup +
    steps tokens; None: compiled here). Returns per-token times (s) of each timed segment, the
    compile seconds (0 when given the program) and the final state."""
    batch = kv.lengths.shape[0]
    key = jax.random.key(1)
    total = 1 + segment * warmup + steps
    t0 = time.perf_counter()
    program = program or gen.compile_decode(model, kv, key, max_new_tokens=total)
    compile_s = time.perf_counter() - t0
    marks = [time.perf_counter()]
    _, _, kv = gen.decode(model, kv, jnp.ones((batch,), jnp.int32), key, max_new_tokens=total, program=program,
                          segment=segment, on_segment=lambda i: marks.append(time.perf_counter()))
    per_token = np.diff(marks) / np.diff([1, *range(1 + segment, total, segment), total])
    return {"per_token_s": per_token[warmup:], "decode_compile_s": compile_s, "kv": kv}


def time_to_first_token(model: Decoder, policy, context: int, seed: int = 0,
                        mesh: jax.sharding.Mesh | None = None) -> dict:
    """Prefill one random prompt of `context` tokens and sample its first token: compile
    seconds, and the time of the second run (the first warms the device's autotuning)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, model.cfg.vocab_size, (1, context), dtype=np.int32)
    lengths = np.array([context], np.int32)
    kv = gen.init_state(model, policy, 1, context + 1, mesh=mesh)
    t0 = time.perf_counter()
    programs = gen.compile_prefill(model, kv, tokens, lengths)
    compile_s = time.perf_counter() - t0
    seconds = []
    for _ in range(2):
        t0 = time.perf_counter()
        logits, kv = gen.prefill(model, kv, tokens, lengths, programs=programs)
        jnp.argmax(logits, -1).block_until_ready()
        seconds.append(time.perf_counter() - t0)
    return {"ttft_s": seconds[-1], "ttft_first_run_s": seconds[0], "prefill_compile_s": compile_s}


def per_device_bytes(model: Decoder, kv_bytes: float, mesh: jax.sharding.Mesh | None) -> float:
    """Weight bytes over the `model` axis plus `kv_bytes` over every device: what one device of
    `mesh` holds and reads in a step when everything splits evenly (one device: the sum)."""
    if mesh is None:
        return weight_bytes(model) + kv_bytes
    return weight_bytes(model) / mesh.shape.get("model", 1) + kv_bytes / mesh.size


@dataclasses.dataclass(frozen=True)
class BenchSpec:
    """What one `oscar bench` run measures."""

    schemes: tuple[str, ...]
    contexts: tuple[int, ...]
    steps: int = 64
    segment: int = 8
    budget_gib: float = 48.0
    batches: tuple[int, ...] | None = None  # fixed batches instead of the largest that fits the budget
    ttft: tuple[str, ...] | None = None  # schemes whose time to first token is measured (None: every one)
    mesh: jax.sharding.Mesh | None = None  # the devices (models.parallel); None: one device
    device_bytes: int | None = None  # memory of one device (None: its allocator's limit, where known)


def budget_batch(per_seq: int, spec: "BenchSpec") -> int:
    """The most sequences of `per_seq` bytes whose K/V fit the budget (per device on a mesh, the
    batch a multiple of the `data` axis)."""
    if spec.mesh is None:
        return int(spec.budget_gib * GIB // per_seq)
    data = spec.mesh.shape.get("data", 1)
    return int(spec.budget_gib * GIB * spec.mesh.size // per_seq) // data * data


def bench_scheme(model: Decoder, name: str, policy, context: int, spec: BenchSpec, bandwidth: float,
                 batch: int | None = None) -> dict:
    """One row: `policy` (named `name`) at capacity `context` per sequence, `batch` sequences
    (None: the most that fit the budget)."""
    new_tokens = 1 + spec.segment + spec.steps
    per_seq = sequence_bytes(model, policy, context)
    row = {"kv": name, "context": context, "batch": batch or budget_batch(per_seq, spec),
           "kv_bytes_per_sequence": per_seq, "budget_gib": None if batch else spec.budget_gib}
    batch = row["batch"]
    if batch < 1:
        return {**row, "error": f"one sequence of {context} tokens needs {per_seq / GIB:.2f} GiB > the budget"}
    if context <= new_tokens:
        return {**row, "error": f"context {context} must exceed the {new_tokens} decoded tokens"}
    limit = spec.device_bytes or (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    need = per_device_bytes(model, batch * per_seq, spec.mesh)
    if limit and need > 0.95 * limit:
        return {**row, "error": f"needs {need / GIB:.1f} GiB of the device's {limit / GIB:.1f}"}
    serve_model, serve_policy = fold_values(model, policy)
    program, t0 = None, time.perf_counter()
    if limit and spec.mesh is None:  # the decode's temporaries fit beside the state, or the batch shrinks
        fit, program = fit_decode(serve_model, serve_policy, batch, context, new_tokens, 0.95 * limit)
        if fit < 1:
            return {**row, "error": f"the decode loop of one sequence needs more than {limit / GIB:.1f} GiB"}
        if fit < batch:
            row.update(batch=fit, batch_limited_by="the decode loop's temporaries")
            batch = fit
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    kv = filled_state(serve_model, serve_policy, batch, context - new_tokens, context, mesh=spec.mesh)
    jax.block_until_ready(kv)
    row["fill_s"] = time.perf_counter() - t0
    held = kv_policy.held_bytes(kv)
    row.update(bits_per_element=kv_policy.bits_per_element(kv), kv_bytes=kv_policy.nbytes(kv), kv_held_bytes=held)
    timed = time_decode(serve_model, kv, steps=spec.steps, segment=spec.segment, program=program)
    del kv, timed["kv"]
    per_token = timed["per_token_s"]
    p50 = float(np.median(per_token))
    roofline = per_device_bytes(serve_model, held, spec.mesh) / bandwidth
    row.update(tpot_p50_ms=1e3 * p50, tpot_p99_ms=1e3 * float(np.percentile(per_token, 99)),
               decode_tokens_per_s=batch / p50, roofline_ms=1e3 * roofline, step_over_roofline=p50 / roofline,
               ceiling_vs_bf16=16.0 / row["bits_per_element"], decode_compile_s=compile_s + timed["decode_compile_s"])
    if spec.ttft is None or name in spec.ttft:
        row.update(time_to_first_token(serve_model, serve_policy, context, mesh=spec.mesh))
    return row


def cells(spec: BenchSpec, schemes) -> list[tuple[int, str, int | None]]:
    """The (context, scheme, batch) cells of a run, in the order `run` measures them."""
    return [(context, name, batch) for context in spec.contexts for name in schemes
            for batch in spec.batches or (None,)]


def run(model: Decoder, policies: dict, spec: BenchSpec, progress=lambda row: None) -> list[dict]:
    """Every (scheme, context) row, with throughput relative to bf16 where bf16 ran."""
    bandwidth = copy_bandwidth()
    rows = []
    for context, name, batch in cells(spec, policies):
        try:
            row = bench_scheme(model, name, policies[name], context, spec, bandwidth, batch)
        except Exception as e:  # a cell that does not fit or compile is reported, the rest run
            row = {"kv": name, "context": context, "batch": batch, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        row["copy_GBps"] = bandwidth / 1e9
        rows.append(row)
        progress(row)
    for row in rows:
        base = next((r for r in rows if r["kv"] == "bf16" and r["context"] == row["context"]
                     and (spec.batches is None or r["batch"] == row["batch"]) and "decode_tokens_per_s" in r), None)
        if base is not None and "decode_tokens_per_s" in row:
            row["throughput_vs_bf16"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]
    return rows


def plot(rows: list[dict], path: str | Path, title: str) -> None:
    """Decode tokens/s against context, one line per scheme."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for name in dict.fromkeys(r["kv"] for r in rows):
        pts = [(r["context"], r["decode_tokens_per_s"]) for r in rows if r["kv"] == name and "decode_tokens_per_s" in r]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens per sequence)")
    ax.set_ylabel("decode tokens/s (whole batch)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _parse_count(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1024, "M": 1024 ** 2}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


@app.command()
def bench(
    model: str = typer.Option(..., help="smollm2 | gemma3 | llama3-8b | qwen3-8b | a .gguf file | an HF directory"),
    random_weights: bool = typer.Option(False, help="random weights of the model's architecture (speed runs)"),
    kv: str = typer.Option("bf16,fp8,int8,oscar", help="KV schemes, comma-separated (kv_policy.POLICIES)"),
    rotations: Path | None = typer.Option(None, help="calibration artifact directory for oscar"),
    contexts: str = typer.Option("8K,32K,128K", help="tokens per sequence (cache capacity), comma-separated"),
    steps: int = typer.Option(64, min=1, help="timed decode steps"),
    segment: int = typer.Option(8, min=1, help="decode steps per timed call"),
    kv_budget_gib: float = typer.Option(48.0, min=0.0, help="KV cache memory per scheme (per device with --mesh), GiB"),
    batch: str | None = typer.Option(None, help="fixed batches, comma-separated, instead of the largest that "
                                                "fits the budget"),
    ttft_kv: str | None = typer.Option(None, help="schemes whose time to first token (one prompt per context, "
                                                  "real prefill) is measured, comma-separated (default: all; "
                                                  "'none': no scheme)"),
    dtype: str = typer.Option("bfloat16", help="weights and activations: bfloat16 | float32"),
    implementation: str = typer.Option("auto", help="attend() implementation for OSCAR-cache layers"),
    mesh: str | None = typer.Option(None, help="device mesh, e.g. data=2,model=4 or model=2,seq=4 (axes data, "
                                               "model, seq; their product the device count); default one device"),
    out: Path | None = typer.Option(None, help="JSON path (default bench/results/<device>/serving_<model>.json)"),
    plot_path: Path | None = typer.Option(None, "--plot", help="PNG path (default: beside the JSON)"),
):
    """Decode throughput per KV scheme at one KV memory budget, beside its roofline. (Unless
    XLA_PYTHON_CLIENT_MEM_FRACTION is set, XLA may take 95% of the device's memory here.)"""
    import os

    from rich.table import Table

    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

    from oscar_jax.models import parallel
    from oscar_jax.models.cli import (check_implementation, check_writable, fail, load_calibration,
                                      load_model, model_config, schemes as scheme_names)

    if dtype not in ("float32", "bfloat16"):
        fail(f"--dtype {dtype!r}: expected bfloat16 or float32")
    check_implementation(implementation)
    schemes = tuple(scheme_names(kv, kv_policy.POLICIES))
    if rotations and "oscar" not in schemes:
        fail(f"--kv {kv} takes no --rotations; calibrated rotations are for --kv oscar")
    try:
        ctx = tuple(_parse_count(c) for c in contexts.split(",") if c.strip())
    except ValueError:
        fail(f"--contexts {contexts!r}: expected counts like 8K,32K,131072")
    if not ctx or min(ctx) < 1:
        fail(f"--contexts {contexts!r}: expected positive counts like 8K,32K,131072")
    try:
        batches = tuple(int(b) for b in batch.split(",")) if batch else None
    except ValueError:
        fail(f"--batch {batch!r}: expected positive ints like 1,8,32")
    if batches and min(batches) < 1:
        fail(f"--batch {batch!r}: expected positive ints like 1,8,32")
    if kv_budget_gib <= 0:
        fail(f"--kv-budget-gib {kv_budget_gib}: expected a budget > 0")
    ttft = None if ttft_kv is None else tuple(s.strip() for s in ttft_kv.split(",") if s.strip() not in ("", "none"))
    if ttft and not set(ttft) <= set(schemes):
        fail(f"--ttft-kv {ttft_kv!r}: expected names from --kv ({', '.join(schemes)}) or 'none'")
    label = Path(model).name if Path(model).exists() else model
    out = out or results.default_path("bench/results", f"serving_{label}")
    check_writable(out, "--out")
    check_writable(plot_path, "--plot")
    cfg = model_config(model, random_weights=random_weights)  # (a speed run may pass the model's context)
    device_mesh = None
    if mesh:
        try:
            device_mesh = parallel.parse_mesh(mesh)
            parallel.check_model(cfg, device_mesh)
        except ValueError as e:
            fail(f"--mesh {mesh}: {e}")
    policies = {}
    for name in schemes:
        try:
            policies[name] = (load_calibration(rotations, cfg, implementation) if name == "oscar" and rotations
                              else kv_policy.make_policy(name, implementation=implementation))
        except ValueError as e:
            fail(f"--rotations {rotations}: {e}" if name == "oscar" and rotations else f"--kv {name}: {e}")
    decoder, _ = load_model(model, dtype=jnp.dtype(dtype), random_weights=random_weights, sharding=device_mesh)
    spec = BenchSpec(schemes, ctx, steps, segment, kv_budget_gib, batches, ttft, device_mesh)
    done = []
    described = lambda r: {"model": label, "dtype": dtype, **({"mesh": mesh} if mesh else {}), **r}

    planned = cells(spec, policies)

    def progress(r):  # print the row, and keep the file current should the run be cut off
        console.print(f"{r['kv']:>6} ctx {r['context']:>7}: " + (r.get("error") or (
            f"B={r['batch']} {r['tpot_p50_ms']:.2f} ms/token ({r['step_over_roofline']:.2f}x roofline), "
            f"{r['decode_tokens_per_s']:.0f} tok/s" + (f", TTFT {r['ttft_s']:.2f} s" if "ttft_s" in r else ""))),
            markup=False, highlight=False)
        done.append(described(r))
        left = [described({"kv": name, "context": c, "batch": b, "error": NOT_RUN})
                for c, name, b in planned[len(done):]]
        results.write(out, results.record(done + left))

    rows = [described(r) for r in run(decoder, policies, spec, progress=progress)]
    result = results.record(rows)
    results.write(out, result)
    plot(rows, plot_path or out.with_suffix(".png"), f"{label}, {result['device']}, KV budget {kv_budget_gib:g} GiB")
    table = Table(title=f"oscar bench: {label} on {result['device']} (jax {result['jax']})")
    for col in ("kv", "context", "batch", "bits/el", "ms/token p50", "x roofline", "tok/s", "x bf16", "ceiling",
                "TTFT s"):
        table.add_column(col, justify="right")
    f = lambda r, k, fmt: fmt.format(r[k]) if r.get(k) is not None else "-"
    for r in rows:
        table.add_row(r["kv"], str(r["context"]), str(r.get("batch", "-")), f(r, "bits_per_element", "{:.2f}"),
                      f(r, "tpot_p50_ms", "{:.2f}"), f(r, "step_over_roofline", "{:.2f}"),
                      f(r, "decode_tokens_per_s", "{:.0f}"), f(r, "throughput_vs_bf16", "{:.2f}"),
                      f(r, "ceiling_vs_bf16", "{:.2f}"), f(r, "ttft_s", "{:.2f}"))
    console.print(table)
    console.print(f"wrote {out}")
