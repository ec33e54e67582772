"""Spending a bit budget unevenly: one quantiser per layer, chosen from measured sensitivity.

Given, for every layer and every candidate quantiser (say 2-bit or 4-bit codes, or another
group size), the error it leaves in the layer's attention output on held-aside tokens and the
bits per element it costs, `allocate` picks one candidate per layer that minimises the summed
error while the average bits per element stays within a target: an exact multiple-choice
knapsack over the bits, solved by dynamic programming on a fine grid of bit costs. `select`
then assembles one calibration from the per-candidate calibrations of the chosen quantisers.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from oscar_jax import calibrate as cal
from oscar_jax.config import CacheSpec, QuantConfig, bits_per_element

BIT_RESOLUTION = 1e-3  # the grid bit costs are rounded up to (so the target is never passed)


def allocate(errors: np.ndarray, bits: np.ndarray, target: float, weights: np.ndarray | None = None) -> np.ndarray:
    """One candidate per layer: argmin Σ_l errors[l, c_l] subject to
    Σ_l weights[l] · bits[l, c_l] <= target · Σ_l weights[l].

    errors, bits: float [L, C] (bits: each candidate's bits per K/V element in that layer, which
    may differ by layer, e.g. with its context); weights: float [L] >= 0, the layers' shares of
    the elements (default equal). Returns int [L] candidate indices. Raises ValueError when even
    the cheapest candidates pass the target.
    """
    errors = np.asarray(errors, np.float64)
    bits = np.asarray(bits, np.float64)
    if errors.ndim != 2 or bits.shape != errors.shape or errors.shape[1] < 1:
        raise ValueError(f"errors.shape={errors.shape}, bits.shape={bits.shape}: expected equal [L, C], C >= 1")
    if not (np.isfinite(errors).all() and np.isfinite(bits).all() and (bits > 0).all()):
        raise ValueError("errors and bits: expected finite values, bits > 0")
    n = errors.shape[0]
    weights = np.ones(n) if weights is None else np.asarray(weights, np.float64)
    if weights.shape != (n,) or (weights < 0).any() or weights.sum() <= 0:
        raise ValueError(f"weights.shape={weights.shape}: expected [L={n}] non-negative, not all zero")
    share = weights / weights.sum()
    cost = np.ceil(share[:, None] * bits / BIT_RESOLUTION - 1e-9).astype(np.int64)  # grid units
    capacity = int(np.floor(target / BIT_RESOLUTION + 1e-9))
    if cost.min(axis=1).sum() > capacity:
        cheapest = float((share[:, None] * bits).min(axis=1).sum())
        raise ValueError(f"target={target} bits/element is below the cheapest choice ({cheapest:.4f})")
    # best[u]: the least summed error of the layers so far at exactly u grid units of bits.
    best = np.full(capacity + 1, np.inf)
    best[0] = 0.0
    choice = np.zeros((n, capacity + 1), np.int64)
    for layer in range(n):
        nxt = np.full(capacity + 1, np.inf)
        for c in range(errors.shape[1]):
            w = cost[layer, c]
            if w > capacity:
                continue
            cand = np.full(capacity + 1, np.inf)
            cand[w:] = best[:capacity + 1 - w] + errors[layer, c]
            better = cand < nxt
            nxt[better] = cand[better]
            choice[layer, better] = c
        best = nxt
    units = int(np.argmin(best))
    picked = np.zeros(n, np.int64)
    for layer in range(n - 1, -1, -1):
        picked[layer] = choice[layer, units]
        units -= cost[layer, picked[layer]]
    return picked


def parse_candidates(text: str, head_dim: int) -> tuple[QuantConfig, ...]:
    """'BITS[:G],...' (e.g. '2:64,2:32,4:64'; G omitted = head_dim) -> one `QuantConfig`
    per candidate, each checked (bits 2, 4 or 8; G a power of two dividing head_dim; G =
    head_dim stored as None, the quantiser's own default)."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        bits, _, group = item.partition(":")
        try:
            size = int(group) if group else None
            quant = QuantConfig(bits=int(bits), group_size=None if size == head_dim else size)
        except ValueError as e:
            raise ValueError(f"candidate {item!r}: expected BITS[:G] ({e})") from None
        if head_dim % (quant.group_size or head_dim):
            raise ValueError(f"candidate {item!r}: G={quant.group_size} does not divide head_dim={head_dim}")
        out.append(quant)
    if len(set(out)) != len(out):
        raise ValueError(f"candidates {text!r}: each quantiser at most once")
    return tuple(out)


def candidate_bits(candidates: Sequence[QuantConfig], *, head_dim: int, sink: int, window: int,
                   context: int) -> np.ndarray:
    """Each candidate's stored bits per K/V element for a sequence of `context` tokens served
    with the bf16 sink and window (`config.bits_per_element`): float [C]."""
    spec = lambda q: CacheSpec(1, 1, 1, head_dim, max(context, sink + window), sink, window, q)
    return np.array([bits_per_element(spec(q), context) for q in candidates], np.float64)


def select(calibrations: Sequence[cal.Calibration], picked: np.ndarray) -> cal.Calibration:
    """One calibration from per-candidate ones (each [L] layers, the same statistics, each
    for its own quantiser): layer l takes rotations and clips from calibrations[picked[l]],
    and `layer_quant` names each layer's quantiser. picked: int [L] (`allocate`'s answer)."""
    first = calibrations[0]
    num_layers = first.clip_k.shape[0]
    picked = np.asarray(picked)
    if picked.shape != (num_layers,) or not ((0 <= picked) & (picked < len(calibrations))).all():
        raise ValueError(f"picked={picked.tolist()}: expected [L={num_layers}] indices into "
                         f"{len(calibrations)} calibrations")
    for c in calibrations:
        if (c.rot_k.spec, c.rot_v.spec, c.tokens, c.clip_mode) != (first.rot_k.spec, first.rot_v.spec, first.tokens,
                                                                   first.clip_mode):
            raise ValueError("calibrations: expected the same rotation variants, tokens and clip mode")
    take = lambda get: np.stack([np.asarray(get(calibrations[j]))[i] for i, j in enumerate(picked)])
    rotation = lambda which: cal.Rotation(*(take(lambda c, f=f: getattr(getattr(c, which), f))
                                            for f in ("rot", "dual", "eigenvalues")), getattr(first, which).spec)
    return dataclasses.replace(
        first, rot_k=rotation("rot_k"), rot_v=rotation("rot_v"), clip_k=take(lambda c: c.clip_k),
        clip_v=take(lambda c: c.clip_v), fit=None, layer_quant=tuple(calibrations[j].quant for j in picked))
