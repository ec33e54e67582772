"""Memory per device and collective bytes per decode step of the sharded decoder, on paper
(docs/serving.md §7): `python bench/parallel_plan.py` prints the markdown table.

Layout as the code places it (oscar_jax.sharding's rules, models.parallel): weights split over
`model` (q heads, MLP columns, LM-head vocabulary columns; embedding and norms replicated); the
KV cache split by batch over `data`, by KV head over `model`, and along tokens over `seq`. A
`model` axis that divides Hkv gives each device Hkv/model KV heads; one that is a multiple of
Hkv dividing the query heads repeats each KV head on model/Hkv devices, one KV head (its wk, wv
columns and its cache) a device; any other replicates wk, wv and the cache on every device.

Per device, with B sequences of T tokens, L layers, Hkv KV heads of D, b bits per element:
  weights  = Σ_params bytes / (model where split, else 1); wk, wv: of Hkv / model_kv heads, at least one
  KV       = 2 · L · B · max(Hkv, model_kv) · D · T · b / 8 / (data_B · model_kv · seq)
             (data_B = data if it divides B; model_kv = model if it divides Hkv or is a multiple of
             Hkv dividing the query heads, else 1; max(Hkv, model_kv): the heads repeated)
Collective payload per decode step (bytes each device contributes; bf16 activations, f32 partials):
  tensor parallel: 2 all-reduces per layer of [B/data_B, 1, H] bf16  ->  2 · L · B/data_B · H · 2
     (a ring all-reduce moves 2 (M - 1) / M times the payload through each device's links)
  sequence parallel: 1 all_gather per layer of each device's (o, lse) of its Hq/model_kv query
     heads, f32  ->  L · B/data_B · Hq/model_kv · (D + 1) · 4, of which each device receives seq - 1
     times its own
The LM head's argmax over vocabulary shards (two [B, model] all-gathers) and the decode loop's
stop flag are a few bytes a step and left out.
"""

from __future__ import annotations

import dataclasses

GB = 1e9
OSCAR_BITS = 2.28  # per element at D = G = 128 and 128K+ tokens (docs/method.md §3.3)


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int = 128256


LLAMA3_8B = Shape("8B", 32, 4096, 32, 8, 128, 14336)
LLAMA3_70B = Shape("70B", 80, 8192, 64, 8, 128, 28672)


@dataclasses.dataclass(frozen=True)
class System:
    name: str
    devices: int
    hbm_gb: float  # per device


SYSTEMS = (System("8x H200", 8, 141.0), System("v5e-256", 256, 16.0), System("v5p-128", 128, 95.0))


def split(n: int, axis: int) -> int:
    """The factor an axis of size `axis` divides `n` by (1 when it does not divide: replicated)."""
    return axis if n % axis == 0 else 1


def model_kv(s: Shape, model: int) -> int:
    """The factor `model` devices split attention by: model where it divides the KV heads or is a
    multiple of them dividing the query heads (each KV head repeated on model / Hkv devices), else
    1 (KV heads and query heads replicated)."""
    repeated = model % s.kv_heads == 0 and s.heads % model == 0
    return model if s.kv_heads % model == 0 or repeated else 1


def weight_bytes(s: Shape, model: int, itemsize: int = 2) -> float:
    """bf16 weight bytes one device holds under tensor parallelism over `model` devices."""
    q = s.heads * s.head_dim
    kv_heads = max(s.kv_heads, model_kv(s, model)) / model_kv(s, model)  # a device's (repeated) KV heads
    per_layer = (2 * s.hidden * q / split(s.heads, model) + 2 * s.hidden * kv_heads * s.head_dim
                 + 3 * s.hidden * s.mlp / split(s.mlp, model) + 2 * s.hidden)  # wq + wo, wk + wv, gate/up/down, norms
    head = s.hidden * s.vocab / split(s.vocab, model)
    return itemsize * (s.layers * per_layer + s.vocab * s.hidden + head + s.hidden)


def kv_bytes(s: Shape, batch: int, tokens: int, bits: float, data: int, model: int, seq: int) -> float:
    """KV cache bytes one device holds."""
    heads = max(s.kv_heads, model_kv(s, model))
    total = 2 * s.layers * batch * heads * s.head_dim * tokens * bits / 8
    return total / (split(batch, data) * model_kv(s, model) * seq)


def collective_bytes(s: Shape, batch: int, data: int, model: int, seq: int) -> tuple[float, float]:
    """(tensor-parallel all-reduce payload, sequence-parallel all_gather payload) per device and step."""
    b = batch / split(batch, data)
    tp = 2 * s.layers * b * s.hidden * 2 if model > 1 else 0.0
    sp = s.layers * b * s.heads / model_kv(s, model) * (s.head_dim + 1) * 4 if seq > 1 else 0.0
    return tp, sp


def layout(s: Shape, system: System) -> tuple[int, int, int]:
    """(data, model, seq) for one sequence: tensor parallel over at least as many devices as there
    are KV heads (each device reads 1/model of the weights a step) and at most as many as divide
    the query heads and MLP columns (`parallel.check_model`), the remaining devices splitting the
    history over `seq`; of those, the one holding the least per device with a 1M-token OSCAR
    history. (Past Hkv each device holds one repeated KV head, so a larger `model` shrinks the
    weights and the attention per device, and only `seq` shrinks the cache.)"""
    best = None
    model = min(s.kv_heads, system.devices)
    while model <= system.devices and s.heads % model == 0 and s.mlp % model == 0:
        seq = system.devices // model
        held = weight_bytes(s, model) + kv_bytes(s, 1, 2 ** 20, OSCAR_BITS, 1, model, seq)
        if best is None or held < best[0]:
            best = (held, model, seq)
        model *= 2
    return 1, best[1], best[2]


def rows(batch: int = 1) -> list[dict]:
    out = []
    for s in (LLAMA3_8B, LLAMA3_70B):
        for system in SYSTEMS:
            data, model, seq = layout(s, system)
            tp, sp = collective_bytes(s, batch, data, model, seq)
            for tokens in (128 * 1024, 1024 * 1024):
                for kv, bits in (("oscar", OSCAR_BITS), ("bf16", 16.0)):
                    w, c = weight_bytes(s, model), kv_bytes(s, batch, tokens, bits, data, model, seq)
                    out.append({"shape": s.name, "system": system.name, "mesh": f"model={model},seq={seq}",
                                "tokens": tokens, "kv": kv, "weights_gb": w / GB, "kv_gb": c / GB,
                                "total_gb": (w + c) / GB, "fits": w + c <= system.hbm_gb * GB,
                                "allreduce_kb": tp / 1e3, "gather_kb": sp / 1e3})
    return out


def table(batch: int = 1) -> str:
    lines = ["| shape | system | mesh | context | kv | weights GB | KV GB | total GB / device | "
             "TP all-reduce KB / step | SP all_gather KB / step |", "|" + "---|" * 10]
    for r in rows(batch):
        ctx = f"{r['tokens'] // 1024}K" if r["tokens"] < 2 ** 20 else f"{r['tokens'] // 2 ** 20}M"
        total = f"{r['total_gb']:.1f}" + ("" if r["fits"] else " (does not fit)")
        lines.append(f"| {r['shape']} | {r['system']} | {r['mesh']} | {ctx} | {r['kv']} | {r['weights_gb']:.2f} | "
                     f"{r['kv_gb']:.2f} | {total} | {r['allreduce_kb']:.0f} | {r['gather_kb']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
    print(f"\nOne sequence; GB = 1e9 bytes; bf16 weights in all: 8B {weight_bytes(LLAMA3_8B, 1) / GB:.1f} GB, "
          f"70B {weight_bytes(LLAMA3_70B, 1) / GB:.1f} GB.")
