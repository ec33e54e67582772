"""Spending a bit budget unevenly: one quantiser per layer, chosen from measured sensitivity.

Given, for every layer and every candidate quantiser (say 2-bit or 4-bit codes, or another
group size), the error it leaves in the layer's attention output on held-aside tokens and the
bits per element it costs, `allocate` picks one candidate per layer that minimises the summed
error while the average bits per element stays within a target: an exact multiple-choice
knapsack over the bits, solved by dynamic programming on a fine grid of bit costs.
"""

from __future__ import annotations

import numpy as np

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
