"""Offline OSCAR calibration (docs/method.md §1): activations -> statistics -> rotations, clips.

Pure functions of post-RoPE (and post qk-norm) Q/K/V batches; no model import.
Arrays carry a leading layer axis L so one call serves a whole layer stack:
  q: [L, B, T, Hq, D], k, v: [L, B, T, Hkv, D]; query head i belongs to KV head i // g.

Flow: `accumulate` streams chunks into an `Accumulator` (per-chunk float32 sums
at HIGHEST precision, added into float64 on host), `statistics` finalises C_h,
the key covariance and the score-weighted value covariance, `rotation_for` builds a
named variant per layer (or per KV head), `clips.fit_clips` picks clip ratios on
held-aside tokens, and `calibrate` ties them into a `Calibration` that yields
the serving `LayerParams`. The shape check, query grouping and value weightings
live in `oscar_jax.activations`.

Rotations act on rows (k_rot = k @ R). A variant with error shaping is not
orthogonal; it carries its dual R^{-T}: queries are rotated by the dual
(q_rot . k_rot = q . k) and outputs return by o = o_rot @ dual_v^T.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from oscar_jax import rotation
from oscar_jax.activations import attention_mass, check_activations, group_queries, published_weights
from oscar_jax.cache import LayerParams
from oscar_jax.clips import CLIP_GRID, ClipFit, fit_clips
from oscar_jax.config import QuantConfig

ValueWeighting = Literal["published", "attention_mass"]
VALUE_WEIGHTINGS = ("published", "attention_mass")
# identity / hadamard (H_D) / u / uh / uhp (published U.H.P_br) / uphg (U.P_br.blockdiag(H_G))
# / shaped (U.S.P_br.blockdiag(H_G), error shaping) / learned (trained on the attention output:
# `oscar_jax.learn`, not built from statistics alone).
ROTATION_KINDS = ("identity", "hadamard", "u", "uh", "uhp", "uphg", "shaped", "learned")
FIXED_CLIPS = {"k": 0.96, "v": 0.92}  # the public reference's ratios
_HI = jax.lax.Precision.HIGHEST


# ----------------------------------------------------------------------------
# Streaming statistics


@dataclasses.dataclass(frozen=True)
class CalibConfig:
    """value_weighting: "published" (w_h[t] = k_tᵀ C_h k_t, computed at the end over a
      bounded uniform sample of `sample_tokens` tokens: exact two-pass when the
      corpus fits in it) or "attention_mass" (w_h[t] = Σ p_qt² over the chunk's
      causal queries of group h, one pass over every token).
    softmax_scale: logit scale for the attention mass (None = D^-1/2).
    seed: seeds the sample's priorities.
    """

    value_weighting: ValueWeighting = "published"
    sample_tokens: int = 4096
    softmax_scale: float | None = None
    seed: int = 0

    def __post_init__(self):
        if self.value_weighting not in VALUE_WEIGHTINGS:
            raise ValueError(f"CalibConfig.value_weighting={self.value_weighting!r}: "
                             f"expected one of {VALUE_WEIGHTINGS}")
        if not isinstance(self.sample_tokens, int) or self.sample_tokens < 1:
            raise ValueError(f"CalibConfig.sample_tokens={self.sample_tokens!r}: expected an int >= 1")


@dataclasses.dataclass(frozen=True)
class Accumulator:
    """Running sums over the calibration tokens (host float64 unless noted).

    qq: [L, Hkv, D, D] Σ over tokens of the mean over the group's g query heads of q qᵀ;
    kk: [L, Hkv, D, D] Σ k kᵀ; k_sum: [L, Hkv, D] Σ k; wvv: [L, Hkv, D, D] Σ w v vᵀ and
    w: [L, Hkv] Σ w (attention-mass weighting only); tokens: tokens seen (B·T summed);
    sample_k, sample_v: float32 [L, N, Hkv, D] a uniform sample of N <= sample_tokens
    tokens (bottom-N of seeded random priorities [N]), kept for the published weighting only.
    """

    qq: np.ndarray
    kk: np.ndarray
    k_sum: np.ndarray
    wvv: np.ndarray
    w: np.ndarray
    tokens: int
    sample_k: np.ndarray
    sample_v: np.ndarray
    sample_priority: np.ndarray
    config: CalibConfig

    @classmethod
    def init(cls, num_layers: int, kv_heads: int, head_dim: int,
             config: CalibConfig = CalibConfig()) -> "Accumulator":
        cov = lambda: np.zeros((num_layers, kv_heads, head_dim, head_dim), np.float64)
        empty = lambda: np.zeros((num_layers, 0, kv_heads, head_dim), np.float32)
        return cls(cov(), cov(), np.zeros((num_layers, kv_heads, head_dim)), cov(),
                   np.zeros((num_layers, kv_heads)), 0, empty(), empty(), np.zeros((0,)), config)

    @property
    def shape(self) -> tuple[int, int, int]:
        """(L, Hkv, D)."""
        return self.qq.shape[:3]


@functools.partial(jax.jit, static_argnames=("attention_weighted", "softmax_scale"))
def _chunk_sums(q, k, v, attention_weighted: bool, softmax_scale):
    """Per-chunk float32 sums over tokens: qq (mean over the group's g heads), kk, wvv
    [L, Hkv, D, D], w [L, Hkv]."""
    f32 = lambda x: x.astype(jnp.float32)
    qg = group_queries(f32(q), k.shape[3])
    qq = jnp.einsum("lbthgd,lbthge->lhde", qg, qg, precision=_HI) / qg.shape[-2]
    kk = jnp.einsum("lbthd,lbthe->lhde", f32(k), f32(k), precision=_HI)
    if not attention_weighted:
        return qq, kk, None, None
    w = jax.lax.map(lambda qk: attention_mass(*qk, softmax_scale), (q, k))  # [L, B, T, Hkv]
    wvv = jnp.einsum("lbth,lbthd,lbthe->lhde", w, f32(v), f32(v), precision=_HI)
    return qq, kk, wvv, jnp.sum(w, axis=(1, 2))


def accumulate(acc: Accumulator, q: jax.Array, k: jax.Array, v: jax.Array) -> Accumulator:
    """Fold one chunk into the running sums. q [L, B, T, Hq, D], k, v [L, B, T, Hkv, D]
    post-RoPE; each of the B rows is a causal sequence (its own attention mass)."""
    check_activations(q, k, v, acc.shape)
    cfg = acc.config
    attention_weighted = cfg.value_weighting == "attention_mass"
    qq, kk, wvv, w = _chunk_sums(q, k, v, attention_weighted, cfg.softmax_scale)
    f64 = lambda x: np.asarray(x, np.float64)
    n_new = k.shape[1] * k.shape[2]
    k_sum = acc.k_sum + f64(jnp.sum(k.astype(jnp.float32), axis=(1, 2)))
    rows = lambda x: np.asarray(x, np.float32).reshape(x.shape[0], n_new, *x.shape[3:])
    if attention_weighted:  # one pass: no sample needed
        return dataclasses.replace(acc, qq=acc.qq + f64(qq), kk=acc.kk + f64(kk), k_sum=k_sum,
                                   wvv=acc.wvv + f64(wvv), w=acc.w + f64(w), tokens=acc.tokens + n_new)
    priority = np.concatenate([acc.sample_priority,
                               np.random.default_rng((cfg.seed, acc.tokens)).random(n_new)])
    keep = np.sort(np.argsort(priority, kind="stable")[:cfg.sample_tokens])
    sample = lambda old, new: np.concatenate([old, rows(new)], axis=1)[:, keep]
    return dataclasses.replace(
        acc, qq=acc.qq + f64(qq), kk=acc.kk + f64(kk), k_sum=k_sum, tokens=acc.tokens + n_new,
        sample_k=sample(acc.sample_k, k), sample_v=sample(acc.sample_v, v),
        sample_priority=priority[keep])


@dataclasses.dataclass(frozen=True)
class Statistics:
    """Finalised calibration statistics (float64).

    query_cov: C_h [L, Hkv, D, D] = mean over tokens and the group's g heads of q qᵀ;
    key_cov: [L, Hkv, D, D] = mean k kᵀ; key_mean: [L, Hkv, D] = mean k;
    value_cov: [L, Hkv, D, D] = Σ_t w_h[t] v vᵀ / Σ_t w_h[t] (weights normalised to average 1);
    tokens: calibration tokens; value_weighting: its name.
    """

    query_cov: np.ndarray
    key_cov: np.ndarray
    key_mean: np.ndarray
    value_cov: np.ndarray
    tokens: int
    value_weighting: ValueWeighting

    def centered_keys(self) -> "Statistics":
        """The statistics of k - key_mean (key_cov becomes the covariance about the mean)."""
        mu = self.key_mean
        return dataclasses.replace(self, key_cov=self.key_cov - np.einsum("lhd,lhe->lhde", mu, mu),
                                   key_mean=np.zeros_like(mu))


def statistics(acc: Accumulator) -> Statistics:
    """Finalise the accumulator (raises if it saw no tokens)."""
    if acc.tokens == 0:
        raise ValueError("statistics: the accumulator saw no tokens; call accumulate first")
    query_cov = acc.qq / acc.tokens
    if acc.config.value_weighting == "attention_mass":
        value_cov = acc.wvv / acc.w[..., None, None]
    else:
        w = published_weights(acc.sample_k, query_cov)
        v = np.asarray(acc.sample_v, np.float64)
        value_cov = np.einsum("lnh,lnhd,lnhe->lhde", w, v, v) / w.sum(axis=1)[..., None, None]
    return Statistics(query_cov, acc.kk / acc.tokens, acc.k_sum / acc.tokens, value_cov, acc.tokens,
                      acc.config.value_weighting)


# ----------------------------------------------------------------------------
# Rotations


@dataclasses.dataclass(frozen=True)
class RotationSpec:
    """A rotation variant: `kind` in ROTATION_KINDS, one per layer or per KV head.

    Spelled "kind" or "kind/head" (e.g. "uhp", "shaped/head"). "uphg" and
    "shaped" mix with blockdiag(H_G), G the quantiser's group size. "learned" is made
    by `oscar_jax.learn.learn_rotations`, not by `rotation_for`.
    """

    kind: str
    per_head: bool = False

    def __post_init__(self):
        if self.kind not in ROTATION_KINDS:
            raise ValueError(f"RotationSpec.kind={self.kind!r}: expected one of {ROTATION_KINDS}")

    @classmethod
    def parse(cls, name: str) -> "RotationSpec":
        kind, _, suffix = name.partition("/")
        if suffix not in ("", "head"):
            raise ValueError(f"rotation name {name!r}: expected 'KIND' or 'KIND/head' with "
                             f"KIND in {ROTATION_KINDS}")
        return cls(kind, suffix == "head")

    @property
    def name(self) -> str:
        return self.kind + ("/head" if self.per_head else "")

    @property
    def orthogonal(self) -> bool:
        return self.kind != "shaped"


@dataclasses.dataclass(frozen=True)
class Rotation:
    """rot: float32 [L, Hkv, D, D] (k_rot = k @ rot); dual: float32 [L, Hkv, D, D] = rot^{-T}
    (equal to rot for orthogonal variants); eigenvalues: float32 [L, Hkv, D] of the basis
    covariance, descending (zeros for identity/hadamard); spec: the variant."""

    rot: np.ndarray
    dual: np.ndarray
    eigenvalues: np.ndarray
    spec: RotationSpec


def _eigh_desc(c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric [D, D] -> (eigenvalues [D] descending, U [D, D] eigenvectors in columns)."""
    lam, u = np.linalg.eigh(0.5 * (c + c.T))
    return lam[::-1].copy(), u[:, ::-1].copy()


def spread_permutation(variance: np.ndarray) -> np.ndarray:
    """perm [D]: column br(i) takes the i-th largest `variance` (column perm[j] goes to j),
    so high-variance directions are dealt round-robin over the quantiser's groups."""
    d = variance.shape[0]
    sigma = np.argsort(-variance, kind="stable")
    perm = np.empty(d, np.int64)
    perm[rotation.bit_reversal(d)] = sigma
    return perm


def shaping_scales(importance: np.ndarray, spread: np.ndarray, floor: float = 1e-6) -> np.ndarray:
    """Error-shaping scales s [D] = (importance / spread)^(1/4), geometric mean 1.

    With white quantisation noise of power ∝ Σ s_i² spread_i after mixing, the weighted
    error Σ importance_i / s_i² is minimised (Cauchy-Schwarz) by s_i² ∝ sqrt(importance_i
    / spread_i). Both are floored at `floor` times their maximum.
    """
    imp = np.maximum(importance, floor * importance.max())
    spr = np.maximum(spread, floor * spread.max())
    log_s = 0.25 * (np.log(imp) - np.log(spr))
    return np.exp(log_s - log_s.mean())


def rotation_matrix(kind: str, basis_cov: np.ndarray, source_cov: np.ndarray, group_size: int,
                    weight_by_eigenvalues: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One rotation from [D, D] covariances (float64 math) -> (rot, dual, eigenvalues).

    basis_cov: the covariance whose eigenbasis U is used (keys: C_h, values: C_V);
    source_cov: covariance of the quantised vectors (keys: E[k kᵀ]; values: C_V);
    weight_by_eigenvalues: the error in eigen-direction i costs its eigenvalue (keys:
    the query energy) rather than 1 (values). dual = rot^{-T} (= rot when orthogonal).
    """
    d = basis_cov.shape[-1]
    lam, u = _eigh_desc(basis_cov)
    hd = np.asarray(rotation.hadamard(d), np.float64)
    hg = np.asarray(rotation.hadamard(d, group_size), np.float64)
    spread = np.einsum("di,de,ei->i", u, source_cov, u)
    if kind == "identity":
        rot, lam = np.eye(d), np.zeros(d)
    elif kind == "hadamard":
        rot, lam = hd, np.zeros(d)
    elif kind == "u":
        rot = u
    elif kind == "uh":
        rot = u @ hd
    elif kind == "uhp":
        rot = np.asarray(rotation.compose(u, lam), np.float64)
    elif kind == "uphg":
        rot = u[:, spread_permutation(spread)] @ hg
    elif kind == "shaped":
        s = shaping_scales(lam if weight_by_eigenvalues else np.ones(d), spread)
        perm = spread_permutation(s * s * spread)
        return (((u * s)[:, perm] @ hg).astype(np.float32),
                ((u / s)[:, perm] @ hg).astype(np.float32), lam.astype(np.float32))
    else:
        raise ValueError(f"kind={kind!r}: expected one of {ROTATION_KINDS} but 'learned' "
                         f"(made by oscar_jax.learn.learn_rotations)")
    rot = rot.astype(np.float32)
    return rot, rot, lam.astype(np.float32)


def rotation_for(stats: Statistics, which: Literal["k", "v"], spec: RotationSpec | str,
                 group_size: int | None = None) -> Rotation:
    """The `spec` rotation of keys ("k", basis C_h, error weighted by the query energy)
    or values ("v", basis C_V, uniform error weight), per layer (from the head means
    C_K = mean_h C_h, C_V = mean_h C_V,h) or per KV head. group_size: the quantiser's
    G (None = D), the Hadamard block of "uphg" and "shaped". Returns [L, Hkv, D, D]."""
    spec = RotationSpec.parse(spec) if isinstance(spec, str) else spec
    if which not in ("k", "v"):
        raise ValueError(f"which={which!r}: expected 'k' or 'v'")
    if spec.kind == "learned":
        raise ValueError(f"rotation {spec.name!r} is trained on activations, not built from statistics: "
                         f"use oscar_jax.learn.learn_rotations and pass its Rotation to calibrate")
    if which == "k":
        basis, source = stats.query_cov, stats.key_cov
    else:
        basis = source = stats.value_cov
    num_layers, kv_heads, d, _ = basis.shape
    g = d if group_size is None else group_size
    if d % g:
        raise ValueError(f"group_size={g} must divide head_dim={d}")
    if not spec.per_head:
        basis, source = basis.mean(axis=1, keepdims=True), source.mean(axis=1, keepdims=True)
    mats = [[rotation_matrix(spec.kind, basis[i, h], source[i, h], g, which == "k")
             for h in range(basis.shape[1])] for i in range(num_layers)]
    heads = lambda j: np.broadcast_to(
        np.array([[m[j] for m in row] for row in mats]), (num_layers, kv_heads) + mats[0][0][j].shape
    ).copy()
    return Rotation(heads(0), heads(1), heads(2), spec)


# ----------------------------------------------------------------------------
# The whole recipe


ClipMode = Literal["fit", "fixed"]


@dataclasses.dataclass(frozen=True)
class Calibration:
    """One model's calibration: key/value rotations, per-layer clips [L] and the
    names that made them (value weighting, clip mode), tokens: calibration tokens;
    quant: the quantiser the clips were fitted for; fit: the clip curves (None when fixed);
    k_shift: None, or the key mean [L, Hkv, D] removed before quantising (`LayerParams.k_shift`);
    layer_quant: None, or one quantiser per layer (a bit budget, `oscar_jax.budget.select`),
    each layer's clips fitted for its own."""

    rot_k: Rotation
    rot_v: Rotation
    clip_k: np.ndarray
    clip_v: np.ndarray
    clip_mode: ClipMode
    value_weighting: ValueWeighting
    tokens: int
    quant: QuantConfig
    fit: ClipFit | None = None
    k_shift: np.ndarray | None = None
    layer_quant: tuple[QuantConfig, ...] | None = None

    def layer_params(self, v_folded: bool = False) -> LayerParams:
        """The stacked serving parameters [L, Hkv, D, D] (duals only for non-orthogonal variants)."""
        num_layers, kv_heads = self.rot_k.rot.shape[:2]
        dual = lambda r: None if np.array_equal(r.rot, r.dual) else r.dual
        return LayerParams.create(self.rot_k.rot, self.rot_v.rot, self.clip_k, self.clip_v,
                                  num_layers=num_layers, kv_heads=kv_heads, v_folded=v_folded,
                                  dual_k=dual(self.rot_k), dual_v=dual(self.rot_v), k_shift=self.k_shift)


def centered(stats: Statistics, heldout: tuple[jax.Array, jax.Array, jax.Array] | None,
             center_keys: bool) -> tuple[Statistics, tuple | None, np.ndarray | None]:
    """(stats, heldout, k_shift) as the key rotation and clips see them: with center_keys
    the key mean k_shift float32 [L, Hkv, D] is removed from the statistics and from the
    held-aside keys [L, B, T, Hkv, D]; else unchanged and k_shift None."""
    if not center_keys:
        return stats, heldout, None
    k_shift = stats.key_mean.astype(np.float32)
    if heldout is not None:
        q_h, k_h, v_h = heldout
        heldout = (q_h, jnp.asarray(k_h, jnp.float32) - k_shift[:, None, None], v_h)
    return stats.centered_keys(), heldout, k_shift


def calibrate(stats: Statistics, heldout: tuple[jax.Array, jax.Array, jax.Array] | None, *,
              rotation_k: RotationSpec | str | Rotation = "uhp",
              rotation_v: RotationSpec | str | Rotation = "uhp",
              quant_cfg: QuantConfig = QuantConfig(), clips: ClipMode = "fit",
              grid=CLIP_GRID, softmax_scale: float | None = None, center_keys: bool = False
              ) -> Calibration:
    """Statistics (+ held-aside (q, k, v) batches [L, B, T, H, D] when clips="fit") ->
    Calibration. rotation_k/v: a variant name or spec built from the statistics, or a
    ready `Rotation` [L, Hkv, D, D] (a learned one) used as given. clips="fixed" uses the
    reference's 0.96 (K) / 0.92 (V) everywhere. center_keys: remove the calibration keys'
    mean before quantising (softmax-exact, see `LayerParams.k_shift`); the key rotation and
    clip then see centered keys."""
    stats, heldout, k_shift = centered(stats, heldout, center_keys)
    shape = stats.query_cov.shape
    for name, r in (("rotation_k", rotation_k), ("rotation_v", rotation_v)):
        if isinstance(r, Rotation) and r.rot.shape != shape:
            raise ValueError(f"{name}.rot.shape={r.rot.shape}: expected [L, Hkv, D, D] = {shape}")
    make = lambda which, r: r if isinstance(r, Rotation) else rotation_for(stats, which, r, quant_cfg.group_size)
    rot_k, rot_v = make("k", rotation_k), make("v", rotation_v)
    num_layers = stats.query_cov.shape[0]
    if clips == "fixed":
        full = lambda c: np.full(num_layers, c, np.float32)
        fit, clip_k, clip_v = None, full(FIXED_CLIPS["k"]), full(FIXED_CLIPS["v"])
    elif clips == "fit":
        if heldout is None:
            raise ValueError("clips='fit' needs heldout=(q, k, v) held-aside activations")
        fit = fit_clips(stats, *heldout, rot_k, rot_v, quant_cfg, grid, softmax_scale)
        clip_k, clip_v = fit.clip_k, fit.clip_v
    else:
        raise ValueError(f"clips={clips!r}: expected 'fit' or 'fixed'")
    return Calibration(rot_k, rot_v, clip_k, clip_v, clips, stats.value_weighting,
                       stats.tokens, quant_cfg, fit, k_shift)


def fold_output_projection(w_o: jax.Array, output_rot: jax.Array) -> jax.Array:
    """Fold the value back-rotation into the output projection, per query-head block.

    w_o: [Hq·D, hidden] (rows of head j are j·D..(j+1)·D-1); output_rot: [Hkv, D, D]
    (`LayerParams.output_rot` of one layer: R_V, or R_V^{-T} when not orthogonal).
    Returns [Hq·D, hidden] with block j = output_rotᵀ[j // g] · w_o block j, so that
    o_rot · folded = o · w_o for o = o_rot · output_rotᵀ.
    """
    kv_heads, d, _ = output_rot.shape
    if output_rot.shape != (kv_heads, d, d) or w_o.ndim != 2 or w_o.shape[0] % (kv_heads * d):
        raise ValueError(f"w_o.shape={w_o.shape}, output_rot.shape={output_rot.shape}: expected "
                         f"[Hq*D, hidden] with Hq a multiple of Hkv and [Hkv, D, D]")
    hq = w_o.shape[0] // d
    blocks = w_o.reshape(kv_heads, hq // kv_heads, d, w_o.shape[1])
    folded = jnp.einsum("hed,hgeo->hgdo", output_rot.astype(jnp.float32),
                        blocks.astype(jnp.float32), precision=_HI)
    return folded.reshape(w_o.shape).astype(w_o.dtype)
