"""Load test of a running `oscar serve`: rising concurrency levels of streaming completions.

    oscar serve --model smollm2 --port 8000 &
    python bench/load_test.py --base http://127.0.0.1:8000 --model smollm2 --prompt-tokens 64,256 \\
        --max-tokens 64 --levels 1,2,4,8,16 --duration 60

After one warm-up request per prompt-length bucket (so no level times a compilation), each
level runs `concurrency` clients (the `openai` async client, streaming, `include_usage`)
for `duration` seconds; each client sends completions back to back, a prompt of random token
ids of a length uniform in the --prompt-tokens range and --max-tokens output tokens (greedy,
no stop). A level records requests, errors (any non-200 or broken stream, by status), output
tokens/s over the level's wall time, and TTFT / TPOT p50 and p99. Levels rise until TTFT p99
passes --ttft-limit seconds. Writes the results record (device and jax as the server's
/health reports them) and a PNG beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the client never needs the accelerator

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import openai  # noqa: E402

from oscar_jax.models import results  # noqa: E402


async def _one(client, model: str, prompt: list[int], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first = last = None
    try:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        tokens = 0
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                first = first or now
                last = now
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return {"ok": True, "ttft": (first or time.perf_counter()) - t0, "tokens": tokens,
                "tpot": (last - first) / (tokens - 1) if first and tokens > 1 else None}
    except openai.APIStatusError as e:
        return {"ok": False, "error": str(e.status_code)}
    except (openai.APIError, httpx.HTTPError) as e:
        return {"ok": False, "error": type(e).__name__}


async def level(base: str, model: str, concurrency: int, duration: float, prompt_tokens: tuple[int, int],
                max_tokens: int, vocab: int, seed: int) -> dict:
    """One concurrency level -> its row."""
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=600)
    rng = np.random.default_rng(seed)
    done: list[dict] = []
    t0 = time.perf_counter()

    async def worker():
        while time.perf_counter() - t0 < duration:
            n = int(rng.integers(prompt_tokens[0], prompt_tokens[1] + 1))
            done.append(await _one(client, model, rng.integers(0, vocab, n).tolist(), max_tokens))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    await client.close()
    ok = [r for r in done if r["ok"]]
    ttft = [r["ttft"] for r in ok]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else None
    errors: dict[str, int] = {}
    for r in done:
        if not r["ok"]:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    return {"concurrency": concurrency, "duration_s": duration, "wall_s": wall, "requests": len(done),
            "errors": sum(errors.values()), "errors_by_kind": errors, "output_tokens": sum(r["tokens"] for r in ok),
            "output_tokens_per_s": sum(r["tokens"] for r in ok) / wall, "requests_per_s": len(ok) / wall,
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "tpot_p50_s": pct(tpot, 50),
            "tpot_p99_s": pct(tpot, 99), "prompt_tokens": list(prompt_tokens), "max_tokens": max_tokens}


async def warm_up(base: str, model: str, lo: int, hi: int, vocab: int) -> None:
    """One short request at lo, hi and every power of two between: the server compiles its
    prefill buckets before any level is timed."""
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=900)
    lengths = sorted({lo, hi, *(1 << i for i in range(lo.bit_length(), hi.bit_length()))})
    for n in lengths:
        await _one(client, model, [1] * n, 2)
    await client.close()


def plot(rows: list[dict], title: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = [r["concurrency"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(c, [r["output_tokens_per_s"] for r in rows], "o-")
    a.set(xlabel="concurrent clients", ylabel="output tokens/s", xscale="log", title="throughput")
    b.plot(c, [r["ttft_p99_s"] or np.nan for r in rows], "o-", label="TTFT p99")
    b.plot(c, [r["ttft_p50_s"] or np.nan for r in rows], "o--", label="TTFT p50")
    b.set(xlabel="concurrent clients", ylabel="seconds", xscale="log", title="time to first token")
    b.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the model id the server serves")
    p.add_argument("--levels", default="1,2,4,8,16", help="at most 5 concurrency levels, rising")
    p.add_argument("--duration", type=float, default=60.0, help="seconds a level sends new requests")
    p.add_argument("--prompt-tokens", default="1024,8192", help="LO,HI: prompt lengths uniform in [LO, HI]")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32000, help="prompt ids are drawn from [0, VOCAB)")
    p.add_argument("--ttft-limit", type=float, default=5.0, help="stop after the first level whose TTFT p99 passes it")
    p.add_argument("--out", type=Path, required=True, help="JSON path (a .png is written beside it)")
    args = p.parse_args(argv)
    levels = sorted(int(x) for x in args.levels.split(","))
    lo, hi = (int(x) for x in args.prompt_tokens.split(","))
    if not 1 <= len(levels) <= 5 or levels[0] < 1 or not 1 <= lo <= hi:
        sys.exit(f"--levels {args.levels!r}: expected 1-5 positive counts; --prompt-tokens {args.prompt_tokens!r}: "
                 "expected LO,HI with 1 <= LO <= HI")
    health = httpx.get(f"{args.base}/health", timeout=10).json()
    asyncio.run(warm_up(args.base, args.model, lo, hi, args.vocab))
    rows = []
    for i, c in enumerate(levels):
        row = asyncio.run(level(args.base, args.model, c, args.duration, (lo, hi), args.max_tokens, args.vocab, i))
        rows.append(row)
        print(f"{c:4d} clients: {row['requests']:5d} requests, {row['errors']} errors, "
              f"{row['output_tokens_per_s']:8.1f} tokens/s, TTFT p50/p99 {row['ttft_p50_s']}/{row['ttft_p99_s']} s, "
              f"TPOT p50/p99 {row['tpot_p50_s']}/{row['tpot_p99_s']} s", flush=True)
        if row["ttft_p99_s"] is None or row["ttft_p99_s"] > args.ttft_limit:
            break
    rec = {**results.record(rows, " ".join(["python", "bench/load_test.py", *(argv or sys.argv[1:])])),
           "device": health["device"], "jax": health["jax"]}
    results.write(args.out, rec)
    plot(rows, f"oscar serve {args.model} on {health['device']} (jax {health['jax']})", args.out.with_suffix(".png"))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
