"""Wall time of the calibration run against plain forwards over the same tokens.

Windows alternate between the two measurements (capture + accumulate, then a
plain forward of the same window), so a shared, noisy CPU affects both alike.
Both functions are compiled before timing. Prints a table and writes
bench/results/<device>/calibration_time_<model>.json (the schema of `oscar_jax.models.results`).

  .venv/bin/python bench/calibration_time.py --model smollm2 --tokens 32768
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from oscar_jax import calibrate as cal
from oscar_jax.models import capture as mc
from oscar_jax.models import registry, results

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--seq-len", type=int, default=1024)
    args = parser.parse_args()

    decoder, tokenizer = registry.load(args.model)
    text = mc.calibration_text("shakespeare")
    rows = mc.windows(np.asarray(tokenizer.encode(text)[: args.tokens], np.int32), args.seq_len)
    layers = mc.full_layers(decoder.cfg)
    cfg = decoder.cfg
    acc = cal.Accumulator.init(len(layers), cfg.num_kv_heads, cfg.head_dim,
                               cal.CalibConfig(softmax_scale=cfg.softmax_scale))
    first = jnp.asarray(rows[:1])
    jax.block_until_ready(mc.forward(decoder, first))
    cal.accumulate(acc, *mc.capture_qkv(decoder, first, layers))  # compile both
    calib_s = forward_s = 0.0
    for row in rows:
        tokens = jnp.asarray(row[None])
        t0 = time.perf_counter()
        acc = cal.accumulate(acc, *mc.capture_qkv(decoder, tokens, layers))
        t1 = time.perf_counter()
        jax.block_until_ready(mc.forward(decoder, tokens))
        t2 = time.perf_counter()
        calib_s += t1 - t0
        forward_s += t2 - t1
    t0 = time.perf_counter()
    cal.statistics(acc)
    finalize_s = time.perf_counter() - t0
    row = {
        "model": args.model, "tokens": int(rows.size), "seq_len": args.seq_len,
        "calibration_layers": len(layers), "calibration_forward_s": calib_s,
        "statistics_finalize_s": finalize_s, "plain_forward_s": forward_s,
        "ratio": (calib_s + finalize_s) / forward_s,
    }
    rec = results.record([row])
    out = results.write(results.default_path(RESULTS, f"calibration_time_{args.model}"), rec)
    print(f"{args.model}: {rows.size} tokens in windows of {args.seq_len} on {rec['device']} (jax {rec['jax']})")
    print(f"  capture + accumulate  {calib_s:8.1f} s  (+ finalize {finalize_s:.1f} s)")
    print(f"  plain forward         {forward_s:8.1f} s")
    print(f"  ratio                 {row['ratio']:8.2f}x   -> {out}")


if __name__ == "__main__":
    main()
