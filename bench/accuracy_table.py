"""Markdown tables of `oscar eval` and `oscar needle` result files.

    python bench/accuracy_table.py bench/results/h200/accuracy_smollm2.json [...]

Eval rows give PPL, ΔPPL, KL and top-1 per scheme; a file that collects several calls
(each row naming its `command`, as the validation files do) gives one table per call.
ΔPPL is against the bf16 row of the same call, else against a bf16 row of the same file
over the same text and token count. Needle rows give accuracy per scheme and length,
averaged over depths.
"""

from __future__ import annotations

import collections
import sys

from oscar_jax.models import results


def _bf16_ppl(rows: list[dict], like: dict) -> float | None:
    """PPL of a bf16 row over the same text and tokens as `like`."""
    return next((r["ppl"] for r in rows if r["kv"] == "bf16" and r["tokens"] == like["tokens"]
                 and r.get("eval_text") == like.get("eval_text")), None)


def eval_table(rows: list[dict], same_file: list[dict] = ()) -> str:
    """ΔPPL against the bf16 row of `rows`, else of `same_file` (same text and tokens)."""
    base = next((r["ppl"] for r in rows if r["kv"] == "bf16"), None)
    if base is None:
        base = _bf16_ppl(list(same_file), rows[0])
    out = ["| kv | bits/elem | PPL | ΔPPL | KL vs fp32 | top-1 |", "|---|---|---|---|---|---|"]
    for r in rows:
        dppl = "" if base is None else f"{r['ppl'] - base:+.3f}"
        out.append(f"| {r['kv']} | {r['bpe']:.2f} | {r['ppl']:.3f} | {dppl} | {r['kl']:.4f} | {r['top1']:.3f} |")
    return "\n".join(out)


def needle_table(rows: list[dict]) -> str:
    acc = collections.defaultdict(list)
    for r in rows:
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


def tables(rec: dict) -> str:
    """The tables of one record: needle accuracy, or eval rows per call."""
    rows = rec["rows"]
    head = f"{rec['device']}, jax {rec['jax']}, commit {rec['commit']}, {rec['date']}"
    if "accuracy" in rows[0]:
        return f"{head}\n`{rec['command']}`\n\n{needle_table(rows)}"
    calls = collections.defaultdict(list)
    for r in rows:
        calls[r.get("command", rec["command"])].append(r)
    return "\n\n".join(f"{head}\n`{command}`\n\n{eval_table(call, rows)}" for command, call in calls.items())


def main(paths: list[str]) -> None:
    for p in paths:
        print(f"\n{p}: {tables(results.read(p))}")


if __name__ == "__main__":
    main(sys.argv[1:])
