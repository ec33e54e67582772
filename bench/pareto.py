"""ΔPPL and KL against bits/element for every KV-cache scheme of one model, from the committed
`oscar eval` records (no recomputation), with oscar's Pareto front.

    python bench/pareto.py --model smollm2 --out bench/results/cpu/pareto_smollm2.png \
        bench/results/cpu/accuracy_smollm2_*.json

Rows are taken from the given records when they evaluate `--model` over the same text and
number of predicted tokens as the first bf16 row found (so every point is comparable);
ΔPPL is in percent of that bf16 PPL. An oscar row is named from its calibration: "oscar
budget" when its artifact spends a per-layer bit budget, else "oscar G=.." (a row's own
"scheme" name, when it has one, instead: e.g. how its budget weighed the layers). Writes the plot,
a record of the points beside it (same name, .json) and prints the markdown table.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import typer

from oscar_jax.models import results

SKIP = ("bf16", "fp32")  # the references, not points


def label(row: dict) -> str:
    """A scheme's name for the plot: the row's "scheme" when it names one, else kv, and for
    oscar rows what their calibration was (learned rotations, a per-layer budget or the group
    size G, and the bf16 sink + window)."""
    if row.get("scheme"):
        return row["scheme"]
    calibration = row.get("calibration", "")
    if not row["kv"].startswith("oscar") or not calibration:
        return row["kv"]
    group = re.search(r"G=(\d+)", calibration)
    rotations = re.search(r"corpus hash \w+, ([^,]+),", calibration)  # "K/V" as the artifact names them
    parts = [row["kv"], "learned" if rotations and "learned" in rotations.group(1) else "",
             "budget" if "per layer:" in calibration else (f"G={group.group(1)}" if group else "")]
    segment = re.search(r"sink (\d+),.*window (\d+)", calibration)
    if segment:
        parts.append(f"{segment.group(1)}+{segment.group(2)}")
    return " ".join(x for x in parts if x)


def _works(row: dict) -> str:
    """The evaluated works of a row's eval_text ('shakespeare evaluation: a, b' -> 'a, b')."""
    return row.get("eval_text", "").partition(":")[2].strip()


def collect(records: list[tuple[str, dict]], model: str) -> tuple[dict, list[dict]]:
    """(the bf16 row, the comparable scheme rows) of `model` in `records` ((path, record) each).
    Each point: label, kv, bpe, ppl, dppl_pct, kl, top1, source (the record's file name); one
    point per label and bits/element, the first record's (a configuration evaluated again later
    is not drawn twice)."""
    rows = [(path, r) for path, rec in records for r in rec["rows"] if r.get("model") == model and "ppl" in r]
    base = next((r for _, r in rows if r["kv"] == "bf16"), None)
    if base is None:
        raise ValueError(f"no bf16 row of model {model!r} in the records: ΔPPL needs one")
    same = lambda r: (r["tokens"], _works(r), r.get("context")) == (base["tokens"], _works(base), base.get("context"))
    points, seen = [], set()
    for path, r in rows:
        key = (label(r), round(r["bpe"], 4))
        if r["kv"] in SKIP or not same(r) or key in seen:
            continue
        seen.add(key)
        points.append({"label": label(r), "kv": r["kv"], "bpe": r["bpe"], "ppl": r["ppl"],
                       "dppl_pct": 100 * (r["ppl"] / base["ppl"] - 1), "kl": r["kl"], "top1": r["top1"],
                       "source": Path(path).name})
    return base, sorted(points, key=lambda p: (p["bpe"], p["label"]))


def front(points: list[dict], prefix: str = "oscar") -> list[dict]:
    """The points of `prefix` schemes no other such point beats in bits, ΔPPL and KL at once
    (no more of each, less of one), by bits."""
    mine = [p for p in points if p["kv"].startswith(prefix)]
    worse = lambda a, b: (b["bpe"] <= a["bpe"] and b["dppl_pct"] <= a["dppl_pct"] and b["kl"] <= a["kl"]
                          and (b["bpe"], b["dppl_pct"], b["kl"]) != (a["bpe"], a["dppl_pct"], a["kl"]))
    return [a for a in mine if not any(worse(a, b) for b in mine)]


def markdown(base: dict, points: list[dict]) -> str:
    on_front = {id(p) for p in front(points)}
    out = [f"| scheme | bits/element | PPL (bf16 {base['ppl']:.2f}) | ΔPPL | KL | top-1 |", "|---|---|---|---|---|---|"]
    for p in points:
        star = "**" if id(p) in on_front else ""
        out.append(f"| {star}{p['label']}{star} | {p['bpe']:.2f} | {p['ppl']:.2f} | {p['dppl_pct']:+.1f}% | "
                   f"{p['kl']:.3f} | {p['top1']:.3f} |")
    return "\n".join(out)


def plot(base: dict, points: list[dict], path: Path, title: str) -> None:
    """Two panels, ΔPPL (%) and KL against bits/element (log y), oscar's front joined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = front(points)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    for ax, key, name in ((axes[0], "dppl_pct", "ΔPPL vs bf16 (%)"), (axes[1], "kl", "KL from full precision")):
        for p in points:
            oscar = p["kv"].startswith("oscar")
            y = max(p[key], 1e-3)
            ax.scatter(p["bpe"], y, marker="o" if oscar else "s", color="tab:blue" if oscar else "tab:gray")
            ax.annotate(p["label"], (p["bpe"], y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.plot([p["bpe"] for p in best], [max(p[key], 1e-3) for p in best], color="tab:blue", alpha=0.6,
                drawstyle="steps-post", label="oscar's Pareto front")
        ax.set_xlabel("bits / element (K and V, metadata and bf16 segments included)")
        ax.set_ylabel(name)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(records: list[Path] = typer.Argument(..., help="oscar eval result files"),
         model: str = typer.Option(..., help="the model whose rows to take"),
         out: Path = typer.Option(..., help="the plot (.png); its record goes beside it (.json)")) -> None:
    if out.suffix != ".png":
        raise typer.BadParameter(f"{out}: expected a .png path", param_hint="--out")
    loaded = [(str(p), results.read(p)) for p in records]
    try:
        base, points = collect(loaded, model)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--model") from None
    windows = base.get("windows")
    plot(base, points, out, f"{model}: {base.get('eval_text', '')[:70]}, context {base.get('context')}, "
                            f"{windows} windows, {base['tokens']} predicted tokens")
    devices = sorted({rec["device"] for _, rec in loaded})
    rec = results.record([{"model": model, "bf16_ppl": base["ppl"], "tokens": base["tokens"], "windows": windows,
                           "context": base.get("context"), **p, "on_front": p in front(points)} for p in points],
                         "python bench/pareto.py " + " ".join(sys.argv[1:]))
    rec["device"] = ", ".join(devices)  # the records' device, not the one that drew the plot
    results.write(out.with_suffix(".json"), rec)
    print(markdown(base, points))


if __name__ == "__main__":
    typer.run(main)
