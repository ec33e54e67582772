"""Bytes-moved model of one decode step of `mixed_attention` on TPU (a model, not a measurement).

time = HBM bytes read / published HBM bandwidth. Per layer, sequence and KV
head the kernel reads the packed history (K + V codes and lo/scale), the bf16
sink and ring; queries and outputs are negligible. `meta_padding` multiplies
the metadata bytes to model the TPU tile padding of the [ng, tpb, R] layout
(docs/tpu.md §3). Run `python -m oscar_jax.pallas_kernels.tpu.cost_model` for
the table in docs/tpu.md §4.
"""

from __future__ import annotations

import dataclasses
import math

# Published per-chip HBM bandwidth, bytes/s (Google Cloud TPU v5e and v6e documentation).
HBM_BYTES_PER_S = {"TPU v5e": 819e9, "TPU v6e": 1638e9}


@dataclasses.dataclass(frozen=True)
class DecodeShape:
    """One decode step: `layers` x `kv_heads` x `batch` sequences of `context` tokens."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    context: int
    batch: int = 1
    sink: int = 64
    window: int = 256
    bits: int = 2
    group_size: int | None = None
    meta_bytes: int = 2  # bf16 lo/scale
    meta_padding: int = 1


def bytes_per_step(s: DecodeShape) -> int:
    """HBM bytes the kernel reads for one decode step over all layers, heads and rows."""
    if s.context <= s.sink + s.window:
        raise ValueError(f"context={s.context} must exceed sink + window = {s.sink + s.window}")
    hist = s.context - s.sink - s.window
    groups = s.head_dim // (s.group_size or s.head_dim)
    codes = 2 * hist * s.head_dim * s.bits // 8
    meta = 2 * 2 * hist * groups * s.meta_bytes * s.meta_padding
    dense = 2 * (s.sink + s.window) * s.head_dim * 2
    return (codes + meta + dense) * s.layers * s.kv_heads * s.batch


def bf16_bytes_per_step(s: DecodeShape) -> int:
    """The same step over a plain bf16 cache."""
    return 2 * s.context * s.head_dim * 2 * s.layers * s.kv_heads * s.batch


def bits_per_element(s: DecodeShape) -> float:
    """Stored bits per K/V element implied by `bytes_per_step` (padding included)."""
    return 8 * bytes_per_step(s) / (2 * s.context * s.head_dim * s.layers * s.kv_heads * s.batch)


def grid_steps(s: DecodeShape, hist_rows: int = 2048) -> int:
    """Grid steps of `mixed_attention` (each costs ~0.35 us of pipeline overhead)."""
    rows = math.ceil((s.context - s.sink - s.window) * s.bits / 8)
    return s.batch * s.kv_heads * s.layers * max(1, math.ceil(rows / hist_rows))


SHAPES = (
    DecodeShape("32 x 8 x D128, T=131072 (Llama-3-8B shape)", 32, 8, 128, 131072),
    DecodeShape("same, metadata 4x tile-padded", 32, 8, 128, 131072, meta_padding=4),
    DecodeShape("32 x 8 x D128, T=32768", 32, 8, 128, 32768),
    DecodeShape("30 x 3 x D64, T=8192, B=32 (SmolLM2-135M shape)", 30, 3, 64, 8192, batch=32),
)


def main() -> None:
    print("MODEL (bytes / published HBM bandwidth), 2-bit history, S0=64, W=256, G=D, bf16 meta")
    print(f"{'shape':50s} {'bpe':>5s} {'GB/step':>8s} " + " ".join(
        f"{k + ' ms':>12s} {'bf16 ms':>8s}" for k in HBM_BYTES_PER_S) + f" {'steps':>6s}")
    for s in SHAPES:
        b, b16 = bytes_per_step(s), bf16_bytes_per_step(s)
        times = " ".join(f"{b / bw * 1e3:12.2f} {b16 / bw * 1e3:8.2f}" for bw in HBM_BYTES_PER_S.values())
        print(f"{s.name:50s} {bits_per_element(s):5.2f} {b / 1e9:8.3f} {times} {grid_steps(s):6d}")


if __name__ == "__main__":
    main()
