"""Markdown tables from `oscar eval` / `oscar needle` JSON records.

    python bench/accuracy_table.py bench/results/accuracy_smollm2_ctx8192.json [...]

Rows of every eval file, or of every run in a validation file (ΔPPL against the
bf16 row of the same run, else --bf16-ppl); needle files give accuracy per
scheme and length, averaged over depths.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path


def eval_table(records: dict, bf16_ppl: float | None = None) -> str:
    rows = records["results"]
    base = next((r["ppl"] for r in rows if r["kv"] == "bf16"), bf16_ppl)
    out = ["| kv | bits/elem | PPL | ΔPPL | KL vs fp32 | top-1 |", "|---|---|---|---|---|---|"]
    for r in rows:
        dppl = "" if base is None else f"{r['ppl'] - base:+.3f}"
        out.append(f"| {r['kv']} | {r['bpe']:.2f} | {r['ppl']:.3f} | {dppl} | {r['kl']:.4f} | {r['top1']:.3f} |")
    return "\n".join(out)


def needle_table(records: dict) -> str:
    acc = collections.defaultdict(list)
    for r in records["results"]:
        acc[(r["kv"], r["length"])].append((r["accuracy"], r["trials"]))
    lengths = sorted({n for _, n in acc})
    out = ["| kv | " + " | ".join(str(n) for n in lengths) + " |", "|---" * (len(lengths) + 1) + "|"]
    for kv in dict.fromkeys(k for k, _ in acc):
        cells = []
        for n in lengths:
            got = acc.get((kv, n))
            cells.append("" if not got else f"{sum(a * t for a, t in got) / sum(t for _, t in got):.2f}")
        out.append(f"| {kv} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(paths: list[str]) -> None:
    bf16 = None
    for p in paths:
        if p.startswith("--bf16-ppl="):
            bf16 = float(p.split("=", 1)[1])
            continue
        data = json.loads(Path(p).read_text())
        for records in data.get("runs", [data]):  # validation files hold several runs
            meta = records["meta"]
            print(f"\n{p}: {meta.get('device')}, jax {meta.get('jax')}\n`{meta.get('command')}`\n")
            is_needle = "accuracy" in records["results"][0]
            print(needle_table(records) if is_needle else eval_table(records, bf16))


if __name__ == "__main__":
    main(sys.argv[1:])
