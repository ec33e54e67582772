"""The serving engine under a Poisson workload: requests/s, output tokens/s, TTFT/TPOT, pages.

    python bench/workload.py --kv oscar --prefix-cache on --rate 1 \\
        --out bench/results/h100/workload_llama3-8b_oscar.json      # Llama-3-8B shape, one GPU
    python bench/workload.py --model tiny --scale 0.002 --requests 16 --out /tmp/w.json   # CPU

`--requests` requests arrive as a Poisson process of `--rate` requests/s (exponential gaps,
seeded). Prompt lengths are uniform in `--prompt-tokens`; a `--shared-fraction` of the
requests start with one common `--shared-prefix`-token prefix (their lengths uniform from
just past the prefix to the top of the range), the rest are random ids throughout. Output
lengths are uniform in `--output-tokens`, greedy, no stop ids. Every length is multiplied
by `--scale` (a tiny model on the CPU runs the same workload shape in seconds).

Each (KV scheme, prefix cache on/off) runs through one `Engine` in this process, with random
weights: the decode batch and pool follow a `--kv-gib` KV budget (dense caches: as many
slots of the full context as fit; OSCAR: `--oscar-slots` slots, whose bf16 sink and ring come
out of the budget, and pages of the rest).
Both modes prefill in chunks of a page, `--chunks-per-step` prefill pieces per decode step,
`--max-prefills` prompts at once (a call runs up to `--decode-steps` decode steps, one per
`--chunks-per-step` pieces where its round prefilled), so on and off differ by the cache only
(`--whole-prompts`: runs without the prefix cache prefill each prompt in one pass, padded to
a power of two).
`Engine.warm_up` runs first, so no timed step compiles (the record counts any that do).
SIGTERM stops the run in progress and writes what finished, marked incomplete. Recorded per
run: requests/s and output tokens/s end to end (first arrival to last finish), decode-phase
output tokens/s (tokens of the decode steps over their wall time, prefill excluded) and the
tokens an average decode step kept (its rows decoding, less any past a stop id), TTFT and
TPOT p50/p99 (TTFT from the arrival), the seconds between two deliveries of a request's
tokens p50/p99 (a round's tokens arrive together, after its prefill chunks), prefill tokens
computed and restored from the prefix cache, the share of the shared-prefix tokens the cache
restored, preemptions, pages in use over time, and the warm-up's compilations and seconds.
JSON and a PNG of pages in use beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # 8B weights + a 48 GiB pool pass XLA's 75%

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from oscar_jax import paged  # noqa: E402
from oscar_jax.models import kv_policy, registry, results  # noqa: E402
from oscar_jax.models.cli import unwritable  # noqa: E402
from oscar_jax.models.config import ModelConfig  # noqa: E402
from oscar_jax.models.decoder import Decoder  # noqa: E402
from oscar_jax.models.serving import Engine, Request  # noqa: E402

STOP = threading.Event()  # SIGTERM sets it: the run in progress stops and is recorded as incomplete
TINY = ModelConfig(family="llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=32, rms_eps=1e-6, rope_theta=1e4, layer_types=("full_attention",) * 2)
# The tiny model's OSCAR cache and pages, scaled down with it: sink 4, window 8, pages of 16 tokens.
TINY_OSCAR = kv_policy.QuantPolicy("oscar", kv_policy.QuantConfig(bits=2), 4, 8, clip_k=0.96, clip_v=0.92)


def workload(args, rng: np.random.Generator, vocab: int) -> tuple[list[tuple[float, Request]], int]:
    """(arrival seconds, request) pairs in arrival order, and how many start with the shared prefix."""
    scaled = lambda lo_hi: tuple(max(1, round(x * args.scale)) for x in lo_hi)
    (lo, hi), (out_lo, out_hi) = scaled(args.prompt_tokens), scaled(args.output_tokens)
    shared_len = max(1, round(args.shared_prefix * args.scale))
    shared = rng.integers(0, vocab, shared_len).tolist()
    arrivals = np.cumsum(rng.exponential(1 / args.rate, args.requests))
    out, sharing = [], 0
    for t in arrivals:
        if rng.random() < args.shared_fraction:
            n = int(rng.integers(max(lo, shared_len + 1), max(hi, shared_len + 1) + 1))
            prompt = shared + rng.integers(0, vocab, n - shared_len).tolist()
            sharing += 1
        else:
            prompt = rng.integers(0, vocab, int(rng.integers(lo, hi + 1))).tolist()
        out.append((float(t), Request(tuple(prompt), int(rng.integers(out_lo, out_hi + 1)))))
    return out, sharing


def paged_bytes(policy, cfg, max_len: int, chunk: int, page: int) -> tuple[int, int]:
    """(bytes of one pool page over every full-attention layer: codes and metadata, bytes of one
    slot's own state over every layer: the bf16 sink and ring, sliding-window rings, per-slot
    metadata) of an OSCAR policy's paged engine."""
    nbytes = lambda x: math.prod(x.shape) * x.dtype.itemsize
    page_total = slot_total = j = 0
    for kind in cfg.layer_types:
        if kind == kv_policy.FULL:
            spec = policy.cache_spec(cfg, 1, max_len, chunk, j)
            most = max(1, int(paged.pages_for(spec.max_len, spec, page)))  # a slot's block table, as the engine's
            spec = dataclasses.replace(spec, max_len=spec.sink + spec.window + most * page)
            shapes = jax.eval_shape(lambda spec=spec: paged.PagedCache.init(spec, page, 1))
            fields = {f.name: nbytes(getattr(shapes, f.name)) for f in dataclasses.fields(shapes)
                      if isinstance(getattr(shapes, f.name), jax.ShapeDtypeStruct)}
            page_total += sum(fields[f] for f in paged.HIST_FIELDS)
            slot_total += sum(v for f, v in fields.items() if f not in paged.HIST_FIELDS)
            j += 1
        else:
            slot_total += sum(map(nbytes, jax.tree.leaves(jax.eval_shape(lambda: kv_policy.ring_layer(cfg, 1, chunk)))))
    return page_total, slot_total


def engine_for(model, cfg, kv: str, prefix: bool, args, max_len: int, shortest: int) -> Engine:
    """The engine of one run: slots and pages from the KV budget (module docstring); shortest:
    the shortest prompt (whole-prompt prefills are bucketed from there)."""
    tiny = args.model == "tiny"
    policy = TINY_OSCAR if tiny and kv == "oscar" else kv_policy.make_policy(kv)
    if kv in args.decode_attention:
        policy = kv_policy.with_implementation(policy, args.decode_attention[kv])
    page = max(16, round(args.page_tokens * args.scale)) if tiny else args.page_tokens
    chunk = None if args.whole_prompts and not prefix else page
    budget = args.kv_gib * 2**30
    # Never more slots than requests, nor more pages than they could all hold at once with every
    # prompt's pages cached besides (a budget far past the workload would only allocate unused memory).
    if isinstance(policy, kv_policy.QuantPolicy):
        spec = policy.cache_spec(cfg, 1, max_len, chunk or 1)
        most = 2 * args.requests * max(1, int(paged.pages_for(spec.max_len, spec, page)))
        slots = min(args.oscar_slots, args.requests)
        page_b, slot_b = paged_bytes(policy, cfg, max_len, chunk or 1, page)
        if budget < slots * slot_b + page_b:
            raise SystemExit(f"--kv-gib {args.kv_gib}: {slots} slots' own state ({slots * slot_b / 2**30:.3g} GiB) "
                             f"and one page leave no room; expected more --kv-gib or fewer --oscar-slots")
        pages = min(most, int((budget - slots * slot_b) // page_b))
    else:
        token_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(policy.dtype).itemsize
        slots, pages = max(1, min(args.requests, int(budget // (token_bytes * max_len)))), None
    return Engine(model, policy, slots=slots, max_len=max_len, page_tokens=page, num_pages=pages,
                  min_bucket=1 << (shortest.bit_length() - 1), prefill_chunk=chunk,
                  chunks_per_step=args.chunks_per_step, max_prefills=args.max_prefills, prefix_cache=prefix,
                  decode_steps=args.decode_steps,
                  chunk_attention=args.chunk_attention)


def run(engine: Engine, requests: list[tuple[float, Request]], shared_len: int, shared: int) -> dict:
    """The timed run of `requests` (arrival seconds, request) -> its row."""
    base = {k: getattr(engine, k) for k in ("prompt_tokens", "prefix_hit_tokens", "prefill_seconds",
                                            "decode_seconds", "decode_tokens", "decode_step_count", "preemptions")}
    first_rid = len(engine.requests)
    arrival, first, finish, pages, running = {}, {}, {}, [], []
    delivered, gaps = {}, []  # rid -> (tokens, seconds) at its last delivery; seconds between deliveries
    pending = list(requests)
    start = time.perf_counter()
    while (pending or not engine.done()) and not STOP.is_set():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            t, req = pending.pop(0)
            arrival[engine.submit(req)] = t
        if engine.done():
            time.sleep(min(0.05, max(0.0, pending[0][0] - now)))
            continue
        engine.step()
        now = time.perf_counter() - start
        pages.append((now, engine.scheduler.pages_in_use()))
        running.append((now, len(engine.scheduler.running)))
        for rid in arrival:
            result = engine.results[rid]
            if result.tokens and rid not in first:
                first[rid] = now
            if len(result.tokens) > delivered.get(rid, (0, 0.0))[0]:
                if rid in delivered:
                    gaps.append(now - delivered[rid][1])
                delivered[rid] = (len(result.tokens), now)
            if result.finish is not None and rid not in finish:
                finish[rid] = now
    rids = [r for r in range(first_rid, len(engine.requests)) if r in finish]  # all of them unless stopped
    out_tokens = {rid: len(engine.results[rid].tokens) for rid in rids}
    ttft = [first[r] - arrival[r] for r in first]
    tpot = [(finish[r] - first[r]) / (out_tokens[r] - 1) for r in rids if out_tokens[r] > 1]
    span = max(finish.values(), default=time.perf_counter() - start) - min(arrival.values(), default=0.0)
    d = {k: getattr(engine, k) - v for k, v in base.items()}
    pct = lambda xs, q: float(np.percentile(xs, q))
    return {"kv": engine.policy.name, "prefix_cache": engine.prefix is not None, "slots": engine.slots,
            "complete": len(rids) == len(requests), "arrived": len(arrival),
            "num_pages": engine.num_pages, "page_tokens": engine.page_tokens, "requests": len(rids),
            "makespan_s": span, "requests_per_s": len(rids) / span, "output_tokens": sum(out_tokens.values()),
            "output_tokens_per_s": sum(out_tokens.values()) / span,
            "decode_output_tokens_per_s": d["decode_tokens"] / d["decode_seconds"] if d["decode_seconds"] else None,
            "prefill_seconds": d["prefill_seconds"], "decode_seconds": d["decode_seconds"],
            "decode_steps_run": d["decode_step_count"],
            "tokens_per_decode_step": d["decode_tokens"] / d["decode_step_count"] if d["decode_step_count"] else None,
            "ttft_p50_s": pct(ttft, 50) if ttft else None, "ttft_p99_s": pct(ttft, 99) if ttft else None,
            "tpot_p50_s": pct(tpot, 50) if tpot else None, "tpot_p99_s": pct(tpot, 99) if tpot else None,
            "delivery_gap_p50_s": pct(gaps, 50) if gaps else None,
            "delivery_gap_p99_s": pct(gaps, 99) if gaps else None,
            "prompt_tokens": d["prompt_tokens"], "prefix_hit_tokens": d["prefix_hit_tokens"],
            "prefill_tokens_computed": d["prompt_tokens"] - d["prefix_hit_tokens"],
            "shared_prefix_tokens": shared * shared_len,
            "shared_prefix_restored": d["prefix_hit_tokens"] / (shared * shared_len) if shared else None,
            "preemptions": d["preemptions"], "compiles_timed": None, "pages_in_use": pages,
            "sequences_running": running}


def plot(rows: list[dict], title: str, path: Path) -> None:
    """Pages in use (paged runs) and sequences holding a slot (runs that record them) against time;
    no file (a stale one removed) where the rows hold neither."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [("pages_in_use", "KV pages in use", lambda r: r["num_pages"]),
              ("sequences_running", "sequences holding a slot", lambda r: r.get("sequences_running"))]
    series = [(key, label, has) for key, label, has in series if any(has(r) for r in rows)]
    if not series:
        path.unlink(missing_ok=True)
        return
    fig, axes = plt.subplots(len(series), 1, figsize=(8, 3 * len(series) + 1), sharex=True, squeeze=False)
    for ax, (key, label, has) in zip(axes[:, 0], series):
        for r in rows:
            if has(r):
                t, y = zip(*r[key]) if r[key] else ((), ())
                ax.plot(t, y, label=f"{r['kv']}, prefix cache {'on' if r['prefix_cache'] else 'off'}")
        ax.set(ylabel=label)
        ax.legend()
    axes[0, 0].set(title=title)
    axes[-1, 0].set(xlabel="seconds since the first arrival")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _per_kv(text: str) -> dict[str, str]:
    """"KV=NAME,..." -> {KV: NAME}, else argparse's error naming the option."""
    pairs = [item.split("=") for item in text.split(",") if item]
    if any(len(pair) != 2 or not all(pair) for pair in pairs):
        raise argparse.ArgumentTypeError(f"{text!r}: expected KV=IMPLEMENTATION pairs, comma-separated")
    return dict(pairs)


def _range(text: str) -> tuple[int, int]:
    """"LO,HI" -> (LO, HI) with 1 <= LO <= HI, else argparse's error naming the option."""
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LO,HI ints") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r}: expected 1 <= LO <= HI")
    return lo, hi


def _check_args(p: argparse.ArgumentParser, args, modes: dict) -> None:
    """`p.error` (usage, the option named, exit 2) on a value no run can use, before any model work."""
    positive = {"--requests": args.requests, "--shared-prefix": args.shared_prefix,
                "--oscar-slots": args.oscar_slots, "--page-tokens": args.page_tokens,
                "--chunks-per-step": args.chunks_per_step, "--max-prefills": args.max_prefills,
                "--decode-steps": args.decode_steps}
    for option, value in positive.items():
        if value < 1:
            p.error(f"{option} {value}: expected an int >= 1")
    for option, value in {"--rate": args.rate, "--scale": args.scale, "--kv-gib": args.kv_gib}.items():
        if not (value > 0 and math.isfinite(value)):
            p.error(f"{option} {value}: expected a finite number > 0")
    if not 0 <= args.shared_fraction <= 1:
        p.error(f"--shared-fraction {args.shared_fraction}: expected a fraction in [0, 1]")
    if any(m not in modes for m in args.prefix_cache.split(",")):
        p.error(f"--prefix-cache {args.prefix_cache!r}: expected off, on or off,on")
    unknown = [k for k in args.kv.split(",") if k not in kv_policy.POLICIES]
    if unknown:
        p.error(f"--kv {args.kv!r}: expected comma-separated names from {', '.join(kv_policy.POLICIES)}")
    if args.dtype not in ("bfloat16", "float32"):
        p.error(f"--dtype {args.dtype!r}: expected bfloat16 or float32")
    for kv, name in args.decode_attention.items():
        try:
            kv_policy.with_implementation(kv_policy.make_policy(kv), name)
        except ValueError as e:
            p.error(f"--decode-attention {kv}={name}: {e}")
    problem = unwritable(args.out, "--out")
    if problem:
        p.error(problem)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama3-8b", help="a config-only architecture (random weights) or 'tiny'")
    p.add_argument("--kv", default="bf16,fp8,oscar", help="KV schemes, comma-separated")
    p.add_argument("--prefix-cache", default="off,on", help="off, on or off,on")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals, requests per second")
    p.add_argument("--prompt-tokens", type=_range, default="4096,32768",
                   help="LO,HI: prompt lengths uniform in [LO, HI]")
    p.add_argument("--shared-prefix", type=int, default=8192, help="tokens of the common prefix")
    p.add_argument("--shared-fraction", type=float, default=0.5, help="share of the requests that start with it")
    p.add_argument("--output-tokens", type=_range, default="512,2048", help="LO,HI: output lengths uniform in [LO, HI]")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies every length (prompts, prefix, outputs)")
    p.add_argument("--kv-gib", type=float, default=48.0, help="KV memory budget per run")
    p.add_argument("--oscar-slots", type=int, default=128, help="decode batch of the OSCAR runs")
    p.add_argument("--page-tokens", type=int, default=1024,
                   help="KV page and prefill chunk (1024: 2.2-2.5x the tokens/s of 256 at the 8B shape, docs/paged.md)")
    p.add_argument("--whole-prompts", action="store_true",
                   help="runs without the prefix cache prefill each prompt in one pass instead of page chunks")
    p.add_argument("--chunks-per-step", type=int, default=4,
                   help="prefill pieces (a whole prompt or a chunk) per decode step")
    p.add_argument("--max-prefills", type=int, default=1, help="prompts prefilling at once (admission waits)")
    p.add_argument("--decode-steps", type=int, default=8, help="most decode steps a call")
    p.add_argument("--chunk-attention", default=None,
                   help="attention implementation of the prefill chunks (default: cudnn for oscar on a GPU, "
                        "else the cache's, as decode)")
    p.add_argument("--decode-attention", type=_per_kv, default={},
                   help="KV=IMPLEMENTATION,...: a policy's attention other than 'auto' (e.g. fp8=xla: float8 "
                        "decode in XLA instead of the Triton kernel)")
    p.add_argument("--dtype", default="bfloat16", help="weights and activations: bfloat16 | float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warm-up-only", action="store_true",
                   help="build and warm up each run's engine, print its compilations, write nothing: with "
                        "JAX_COMPILATION_CACHE_DIR set, a later run loads those programs instead of compiling")
    p.add_argument("--out", type=Path, required=True, help="JSON path (a .png is written beside it)")
    args = p.parse_args(argv)
    modes = {"off": False, "on": True}
    _check_args(p, args, modes)
    signal.signal(signal.SIGTERM, lambda *_: STOP.set())
    if args.model == "tiny":
        cfg = TINY
        model = Decoder(cfg, rngs=nnx.Rngs(0), dtype=jnp.dtype(args.dtype))
    else:
        model, _ = registry.load(args.model, dtype=jnp.dtype(args.dtype), random_weights=True)
        cfg = model.cfg
    requests, shared = workload(args, np.random.default_rng(args.seed), cfg.vocab_size)
    hi = max(len(r.prompt) for _, r in requests)
    max_len = hi + max(r.max_tokens for _, r in requests)
    shared_len = max(1, round(args.shared_prefix * args.scale))
    rows = []
    for kv in args.kv.split(","):
        for mode in args.prefix_cache.split(","):
            engine = engine_for(model, cfg, kv, modes[mode], args, max_len, min(len(r.prompt) for _, r in requests))
            t0 = time.perf_counter()
            warm = engine.warm_up()
            warm_s, compiled = time.perf_counter() - t0, engine.compiles
            if args.warm_up_only:
                print(f"{kv:6s} prefix {mode:3s}: warm-up: {warm} programs in {warm_s:.1f} s", flush=True)
                del engine  # before the next run's pool is allocated
                continue
            row = run(engine, requests, shared_len, shared)
            row.update(warm_up_compiles=warm, warm_up_s=warm_s, compiles_timed=engine.compiles - compiled,
                       rate_per_s=args.rate, scale=args.scale, shared_prefix=shared_len, shared_requests=shared,
                       kv_gib=args.kv_gib, prefill_chunk=engine.chunk, chunks_per_step=args.chunks_per_step,
                       max_prefills=args.max_prefills, decode_steps=args.decode_steps,
                       chunk_attention=engine.chunk_attention or "policy",
                       decode_attention=args.decode_attention.get(kv, "auto"))
            rows.append(row)
            f = lambda x: "-" if x is None else f"{x:.2f}"
            print(f"{kv:6s} prefix {mode:3s}: {row['requests_per_s']:.3f} req/s, {row['output_tokens_per_s']:.1f} "
                  f"tok/s end to end, {f(row['decode_output_tokens_per_s'])} tok/s decode, TTFT p50/p99 "
                  f"{f(row['ttft_p50_s'])}/{f(row['ttft_p99_s'])} s, prefix restored {row['prefix_hit_tokens']} "
                  f"of {row['prompt_tokens']} prompt tokens, {row['compiles_timed']} compiles timed"
                  + ("" if row["complete"] else f", STOPPED with {row['requests']} of {args.requests} done"),
                  flush=True)
            del engine
            if STOP.is_set():
                break
        if STOP.is_set():
            break
    if args.warm_up_only:
        return
    rec = results.record(rows, " ".join(["python", "bench/workload.py", *(argv or sys.argv[1:])]))
    results.write(args.out, rec)
    plot(rows, f"{args.model}: {args.requests} requests at {args.rate}/s on {results.device_kind()}",
         args.out.with_suffix(".png"))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
