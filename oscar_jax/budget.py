"""Spending a bit budget unevenly: one quantiser per layer, chosen from measured sensitivity.

Given, for every layer and every candidate quantiser (say 2-bit or 4-bit codes, or another
group size), the error it leaves in the layer's attention output on held-aside tokens and the
bits per element it costs, `allocate` picks one candidate per layer that minimises the summed
error while the average bits per element stays within a target: an exact multiple-choice
knapsack over the bits, solved by dynamic programming on a fine grid of bit costs. `select`
then assembles one calibration from the per-candidate calibrations of the chosen quantisers.

The bf16 sink and recent window are part of the choice: every layer's cache shares one
(sink, window), whose bf16 tokens cost bits like the quantised history does, so
`allocate_segments` runs the knapsack once per candidate (sink, window) and keeps the one of
least summed error. The errors it compares (`context_errors`) are measured at the context the
bits are counted at, on queries spread over the whole sequence as an evaluation weighs them:
on short sequences the window covers a large share of every query's keys and its worth is
overstated.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from oscar_jax import calibrate as cal
from oscar_jax import learn
from oscar_jax.activations import check_activations, group_queries
from oscar_jax.clips import CLIP_GRID
from oscar_jax.config import CacheSpec, QuantConfig, bits_per_element

BIT_RESOLUTION = 1e-3  # the grid the bits above each layer's cheapest are rounded up to (target never passed)


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
    spent = weights[:, None] / weights.sum() * bits
    base = spent.min(axis=1)  # each layer's cheapest, counted exactly: only the bits above it are rounded
    cheapest = float(base.sum())
    if cheapest > target + 1e-12:
        raise ValueError(f"target={target} bits/element is below the cheapest choice ({cheapest:.6f})")
    cost = np.ceil((spent - base[:, None]) / BIT_RESOLUTION - 1e-9).astype(np.int64)  # grid units
    capacity = max(int(np.floor((target - cheapest) / BIT_RESOLUTION + 1e-9)), 0)
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


def allocate_segments(errors: np.ndarray, bits: np.ndarray, target: float) -> tuple[int, np.ndarray]:
    """The (sink, window) and the per-layer candidates of least summed error within `target`:
    `allocate` for each segment s whose cheapest choice fits, the least Σ_l errors[s, l, c_l]
    kept. errors: float [S, L, C] (segment s, layer l, candidate c); bits: float [S, C] (each
    candidate's bits per element with segment s; the layers weigh equally). Returns (s, int
    [L]). Raises ValueError when no segment's cheapest choice fits."""
    errors = np.asarray(errors, np.float64)
    bits = np.asarray(bits, np.float64)
    if errors.ndim != 3 or bits.shape != (errors.shape[0], errors.shape[2]):
        raise ValueError(f"errors.shape={errors.shape}, bits.shape={bits.shape}: expected [S, L, C] and [S, C]")
    best = None
    for s in range(errors.shape[0]):
        if bits[s].min() > target + 1e-12:
            continue
        picked = allocate(errors[s], np.broadcast_to(bits[s], errors.shape[1:]), target)
        total = errors[s, np.arange(errors.shape[1]), picked].sum()
        if best is None or total < best[0]:
            best = (total, s, picked)
    if best is None:
        raise ValueError(f"target={target} bits/element is below every segment's cheapest choice "
                         f"({bits.min(axis=1).min():.4f})")
    return best[1], best[2]


def parse_segments(text: str) -> tuple[tuple[int, int], ...]:
    """'SINK+WINDOW,...' (e.g. '64+256,16+112') -> ((sink, window), ...), sink >= 0, window >= 1,
    each pair at most once."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        sink, plus, window = item.partition("+")
        try:
            pair = (int(sink), int(window))
        except ValueError:
            pair = None
        if not plus or pair is None or pair[0] < 0 or pair[1] < 1:
            raise ValueError(f"segment {item!r}: expected SINK+WINDOW, SINK >= 0 and WINDOW >= 1 tokens")
        out.append(pair)
    if len(set(out)) != len(out):
        raise ValueError(f"segments {text!r}: each SINK+WINDOW at most once")
    return tuple(out)


def query_positions(context: int, queries: int) -> np.ndarray:
    """`queries` positions spread evenly over [0, context) (every position when there are
    fewer): int32 [N], ascending."""
    if queries >= context:
        return np.arange(context, dtype=np.int32)
    return ((np.arange(queries) + 0.5) * context / queries).astype(np.int32)


@functools.partial(jax.jit, static_argnames=("segments", "chunk", "scale"))
def _segment_sums(q, k, v, k_hat, v_hat, pos, segments, chunk, scale):
    """One layer, one sequence: q [T, Hq, D]; k, v, k_hat, v_hat [T, Hkv, D]; pos int32 [N] ->
    (Σ |o - ô|² per segment [S], Σ |o|²) over the queries at pos. The cache holds a chunk's
    newest `window` positions bf16, so query p sees exact keys < sink or > its chunk's last
    position - window."""
    t, hkv, _ = k.shape
    qg = group_queries(q[pos], hkv)  # [N, Hkv, g, D]
    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("nhgd,thd->hgnt", qg, k, precision=hi) * scale
    s_hat = jnp.einsum("nhgd,thd->hgnt", qg, k_hat, precision=hi) * scale
    keys = jnp.arange(t)[None, :]
    causal = keys <= pos[:, None]  # [N, T]
    last = jnp.minimum((pos // chunk + 1) * chunk - 1, t - 1)[:, None]
    o = jnp.einsum("hgnt,thd->hgnd", jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1), v, precision=hi)
    errs = []
    for sink, window in segments:
        exact = (keys < sink) | (keys > last - window)
        p_hat = jax.nn.softmax(jnp.where(causal, jnp.where(exact, s, s_hat), -jnp.inf), axis=-1)
        o_hat = (jnp.einsum("hgnt,thd->hgnd", jnp.where(exact, p_hat, 0.0), v, precision=hi)
                 + jnp.einsum("hgnt,thd->hgnd", jnp.where(exact, 0.0, p_hat), v_hat, precision=hi))
        errs.append(jnp.sum((o - o_hat) ** 2))
    return jnp.stack(errs), jnp.sum(o * o)


@functools.partial(jax.jit, static_argnames=("sink", "window", "chunk", "scale", "block"))
def served_attention(q, k, v, k_hat, v_hat, *, sink: int, window: int, chunk: int, scale: float, block: int = 512):
    """Every query's attention output as the served cache gives it, one sequence: q [T, Hq, D];
    k, v, k_hat, v_hat [T, Hkv, D] -> (o exact, ô served) float32 [T, Hq, D] each. Query p
    sees keys < sink and > its chunk's last position - window exact (k, v), the others as
    (k_hat, v_hat); queries are taken `block` at a time ([Hq, block, T] scores)."""
    t, hkv, d = k.shape
    hq = q.shape[1]
    nb = -(-t // block)
    qb = jnp.pad(q, ((0, nb * block - t), (0, 0), (0, 0))).reshape(nb, block, hkv, hq // hkv, d)
    hi = jax.lax.Precision.HIGHEST
    keys = jnp.arange(t)[None, :]

    def one(args):
        qg, p0 = args  # [block, Hkv, g, D], first position
        pos = p0 + jnp.arange(block)
        s = jnp.einsum("nhgd,thd->hgnt", qg, k, precision=hi) * scale
        s_hat = jnp.einsum("nhgd,thd->hgnt", qg, k_hat, precision=hi) * scale
        causal = keys <= pos[:, None]
        last = jnp.minimum((pos // chunk + 1) * chunk - 1, t - 1)[:, None]
        exact = (keys < sink) | (keys > last - window)
        p = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)
        p_hat = jax.nn.softmax(jnp.where(causal, jnp.where(exact, s, s_hat), -jnp.inf), axis=-1)
        o = jnp.einsum("hgnt,thd->nhgd", p, v, precision=hi)
        o_hat = (jnp.einsum("hgnt,thd->nhgd", jnp.where(exact, p_hat, 0.0), v, precision=hi)
                 + jnp.einsum("hgnt,thd->nhgd", jnp.where(exact, 0.0, p_hat), v_hat, precision=hi))
        return o, o_hat

    o, o_hat = jax.lax.map(one, (qb, jnp.arange(nb) * block))
    return tuple(x.reshape(nb * block, hq, d)[:t] for x in (o, o_hat))


def context_errors(held, calibrations: Sequence[cal.Calibration], segments: Sequence[tuple[int, int]], *,
                   chunk: int = 1, queries: int = 256, softmax_scale: float | None = None) -> np.ndarray:
    """Relative served attention-output error Σ |o - ô|² / Σ |o|² of every candidate calibration
    with every (sink, window), per layer, on held-aside sequences as long as the context the
    bits are counted at: float64 [S, L, C].

    held: (q [L, B, T, Hq, D], k, v [L, B, T, Hkv, D]) float32; calibrations: C candidates (each
    [L] layers, its own quantiser `quant`, keys centered by `k_shift` when set); the queries:
    `queries` positions per sequence spread over [0, T) (`query_positions`), every one counted
    (a query inside the bf16 segments adds no error), the same for every segment; chunk: the
    serving chunk (1: token by token; an evaluation's prefill/extend chunk), which sets how many
    recent tokens a query sees in bf16."""
    q, k, v = held
    check_activations(q, k, v)
    num_layers, rows, t, hkv, d = k.shape
    if chunk < 1 or any(chunk > w for _, w in segments):
        raise ValueError(f"chunk={chunk}: expected 1 <= chunk <= every window {[w for _, w in segments]}")
    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    pos = jnp.asarray(query_positions(t, queries))
    segments = tuple((int(s), int(w)) for s, w in segments)
    out = np.zeros((len(segments), num_layers, len(calibrations)))
    for c, calib in enumerate(calibrations):
        shift = np.zeros((num_layers, hkv, d), np.float32) if calib.k_shift is None else calib.k_shift
        for i in range(num_layers):
            err, ref = np.zeros(len(segments)), 0.0
            f32 = lambda x: jnp.asarray(x, jnp.float32)
            for row in range(rows):
                qi, ki, vi = (f32(x[i, row: row + 1]) for x in (q, k, v))
                k_hat = learn._served_values(ki, f32(calib.rot_k.rot[i]), f32(calib.rot_k.dual[i]), f32(shift[i]),
                                             calib.quant, float(calib.clip_k[i]))
                v_hat = learn._served_values(vi, f32(calib.rot_v.rot[i]), f32(calib.rot_v.dual[i]),
                                             jnp.zeros((hkv, d), jnp.float32), calib.quant, float(calib.clip_v[i]))
                e, r = _segment_sums(qi[0], ki[0], vi[0], k_hat[0], v_hat[0], pos, segments, chunk, scale)
                err, ref = err + np.asarray(e, np.float64), ref + float(r)
            out[:, i, c] = err / ref
    return out


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


@dataclasses.dataclass(frozen=True)
class BudgetChoice:
    """A bit budget's outcome: calibration (each layer's rotations, clips and quantiser);
    segment: the (sink, window) it is served with; errors [S, L, C], bits [S, C]: the measured
    error and bits per element of every (segment, layer, candidate); chosen: the segment's
    index; picked: int [L] each layer's candidate; weights [L]: what each layer's errors were
    multiplied by before the knapsack (ones: the errors as measured)."""

    calibration: cal.Calibration
    segment: tuple[int, int]
    errors: np.ndarray
    bits: np.ndarray
    chosen: int
    picked: np.ndarray
    weights: np.ndarray


def calibrate_within(stats: cal.Statistics, heldout, context_held, rot_k, rot_v, candidates: Sequence[QuantConfig],
                     target: float, segments: Sequence[tuple[int, int]], clips: cal.ClipMode = "fit",
                     grid=CLIP_GRID, softmax_scale: float | None = None, *, chunk: int = 1, queries: int = 256,
                     center_keys: bool = False,
                     weigh: Callable[[cal.Calibration], np.ndarray] | None = None) -> BudgetChoice:
    """A calibration within `target` bits/element: every candidate quantiser calibrated
    (`calibrate.calibrate` on `stats`, clips fitted on `heldout`), its served attention-output
    error per layer with every (sink, window) of `segments` measured on `context_held`
    ((q, k, v) [L, B, T, H, D]: sequences of the T-token context the bits are counted at,
    text neither the statistics nor the clips saw; `context_errors`), and the segment and
    per-layer candidates of least summed error (`allocate_segments`) joined by `select`.
    weigh: given the first candidate's calibration, each layer's weight [L] >= 0 (e.g.
    `output_weights`): the knapsack then minimises Σ_l weight[l] · error[s, l, c_l]."""
    head_dim = stats.query_cov.shape[-1]
    context = context_held[1].shape[2]
    bits = np.stack([candidate_bits(candidates, head_dim=head_dim, sink=s, window=w, context=context)
                     for s, w in segments])
    calibrations = [cal.calibrate(stats, heldout, rotation_k=rot_k, rotation_v=rot_v, quant_cfg=q, clips=clips,
                                  grid=grid, softmax_scale=softmax_scale, center_keys=center_keys)
                    for q in candidates]
    errors = context_errors(context_held, calibrations, segments, chunk=chunk, queries=queries,
                            softmax_scale=softmax_scale)
    weights = np.ones(errors.shape[1]) if weigh is None else weigh(calibrations[0])
    return choose(calibrations, segments, errors, bits, weights, target)


def choose(calibrations: Sequence[cal.Calibration], segments: Sequence[tuple[int, int]], errors: np.ndarray,
           bits: np.ndarray, weights: np.ndarray, target: float) -> BudgetChoice:
    """The segment and per-layer candidates of least Σ_l weights[l] · errors[s, l, c_l] within
    `target` (`allocate_segments`), joined by `select`. calibrations: the C candidates' (each
    [L] layers); errors [S, L, C], bits [S, C]: as measured for them (`context_errors`,
    `candidate_bits`); weights [L] >= 0."""
    errors, bits = np.asarray(errors, np.float64), np.asarray(bits, np.float64)
    weights = np.asarray(weights, np.float64)
    layers = calibrations[0].clip_k.shape[0]
    if errors.shape != (len(segments), layers, len(calibrations)) or bits.shape != (len(segments), len(calibrations)):
        raise ValueError(f"errors.shape={errors.shape}, bits.shape={bits.shape}: expected [S={len(segments)}, "
                         f"L={layers}, C={len(calibrations)}] and [S, C]")
    if weights.shape != (layers,) or not (np.isfinite(weights).all() and (weights >= 0).all()):
        raise ValueError(f"weights={weights}: expected [L={layers}] finite weights >= 0")
    chosen, picked = allocate_segments(errors * weights[None, :, None], bits, target)
    return BudgetChoice(select(calibrations, picked), tuple(segments[chosen]), errors, bits, chosen, picked, weights)


def output_weights(kl: np.ndarray, err: np.ndarray) -> np.ndarray:
    """Each layer's cost to the model's output per unit of its attention-output error:
    kl [L] (the output KL against full precision when only that layer is served quantised),
    err [L] (that layer's relative served attention-output error in the same run) -> kl / err
    [L] (0 where err is 0: a layer its quantiser leaves exact costs nothing)."""
    kl, err = np.asarray(kl, np.float64), np.asarray(err, np.float64)
    if kl.shape != err.shape or kl.ndim != 1 or (err < 0).any() or not np.isfinite(kl).all():
        raise ValueError(f"kl.shape={kl.shape}, err.shape={err.shape}: expected equal [L], err >= 0, kl finite")
    return np.where(err > 0, np.maximum(kl, 0.0) / np.where(err > 0, err, 1.0), 0.0)
