"""Learned rotations (docs/method.md §1.6): R_K and R_V trained on the served attention output.

Per layer (or per KV head, "learned/head") a rotation R = R0 · cayley(W), with
cayley(W) = (I - A)^{-1} (I + A) and A = (W - Wᵀ)/2 skew-symmetric: cayley(W) is orthogonal
for every W, and W = 0 gives R0, a calibrated variant (`LearnConfig.init`, the published
U·H·P by default). R is orthogonal when R0 is; from the error-shaped "shaped" R0 (not
orthogonal, dual R0^{-T}) the dual is R0^{-T} · cayley(W), exactly R^{-T}. W is trained
with optax Adam on batches of calibration activations q [L, B, T, Hq, D], k, v
[L, B, T, Hkv, D] (post-RoPE, streamed by the caller) to minimise, per layer, the relative
error of the attention output as the cache serves it,

    Σ |o - ô|² / Σ |o|²,   o = softmax(s·q·kᵀ) v,   ô = softmax(s·q·k̂ᵀ) v̂   (causal),

over query positions sampled at >= sink + window. A key or value is exact in the sink
(position < sink) and the recent window (within `window` positions of the query, the
query included); else k̂ = Q((k - μ) R_K) R_Kᵀ + μ and v̂ = Q(v R_V) R_Vᵀ (R^{-1} = the
dual's transpose for a non-orthogonal one such as "shaped"), with Q the
cache's quantiser (`oscar_jax.quant` over bf16-stored rotated vectors, at fixed clip
ratios) and μ the key mean when the keys are centered. The forward values are the
quantiser's exactly; the gradient is the straight-through estimator plus the step size's
own dependence on the group's range (as LSQ): dQ(x) = dx + d(step)·r, r the rounding
residual in steps held constant.

Layers train independently (the loss is a sum of per-layer terms and Adam is
per-parameter). The returned rotations (and duals) are formed in float64 from R0 (its dual)
and W and rounded to float32: from an orthogonal R0, orthogonal to float32 precision.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from oscar_jax import calibrate as cal
from oscar_jax import quant
from oscar_jax.activations import check_activations, group_queries
from oscar_jax.cache import STORE_DTYPE
from oscar_jax.clips import CLIP_GRID, fit_clips
from oscar_jax.config import LLOYD_MAX_SPAN, QuantConfig

INIT_KINDS = tuple(k for k in cal.ROTATION_KINDS if k != "learned")
_HI = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class LearnConfig:
    """init: the variant (in INIT_KINDS) the rotations start from, per layer or
    per KV head as the learned spec; epochs: passes over the calibration windows;
    steps_per_batch: Adam steps per streamed batch, each on freshly sampled queries;
    queries: query positions sampled per sequence and step; learning_rate: Adam's;
    seed: seeds the query sampling."""

    init: str = "uhp"
    epochs: int = 1
    steps_per_batch: int = 4
    queries: int = 128
    learning_rate: float = 1e-3
    seed: int = 0

    def __post_init__(self):
        if self.init not in INIT_KINDS:
            raise ValueError(f"LearnConfig.init={self.init!r}: expected one of {INIT_KINDS}")
        for field in ("epochs", "steps_per_batch", "queries"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LearnConfig.{field}={value!r}: expected an int >= 1")
        if not (isinstance(self.learning_rate, (int, float)) and 0 < self.learning_rate <= 1):
            raise ValueError(f"LearnConfig.learning_rate={self.learning_rate!r}: expected a number in (0, 1]")


def cayley(w: jax.Array) -> jax.Array:
    """[..., D, D] any -> the orthogonal (I - A)^{-1} (I + A) = 2 (I - A)^{-1} - I, A = (w - wᵀ)/2
    (I at w = 0). An inverse, not a solve: its gradient is two matrix products."""
    a = 0.5 * (w - jnp.swapaxes(w, -1, -2))
    eye = jnp.eye(w.shape[-1], dtype=w.dtype)
    return 2.0 * jnp.linalg.inv(eye - a) - eye


def _step_size(x: jax.Array, cfg: QuantConfig, clip) -> jax.Array:
    """The quantiser's step per token group of x [..., D], differentiably (float32, before the
    rounding to the metadata dtype): [..., D/G, 1]."""
    g = cfg.group_size or x.shape[-1]
    xg = x.reshape(*x.shape[:-1], x.shape[-1] // g, g)
    if cfg.codebook == "uniform":
        span = jnp.max(xg, -1, keepdims=True) - jnp.min(xg, -1, keepdims=True)
    else:
        var = jnp.mean((xg - jnp.mean(xg, -1, keepdims=True)) ** 2, -1, keepdims=True)
        span = 2.0 * LLOYD_MAX_SPAN * jnp.sqrt(var + 1e-30)
    return clip * span / float(cfg.levels[-1])


def quantize_ste(x: jax.Array, cfg: QuantConfig, clip) -> jax.Array:
    """x float32 [..., T, D] (rotated) -> x̂ [..., T, D]: forward, exactly what the cache returns
    (x stored as bf16, `quant.quantize`, `quant.dequantize`); gradient dx + d(step)·r."""
    exact = jax.lax.stop_gradient(quant.dequantize(quant.quantize(x.astype(STORE_DTYPE), cfg, clip), cfg))
    step = _step_size(x, cfg, clip)
    grouped = step.shape[:-1] + (x.shape[-1] // step.shape[-2],)
    diff = jax.lax.stop_gradient(exact - x).reshape(grouped)
    safe = jnp.where(step > 0, step, 1.0)
    resid = jax.lax.stop_gradient(jnp.where(step > 0, diff / safe, 0.0))
    return exact + (x - jax.lax.stop_gradient(x)) + ((step - jax.lax.stop_gradient(step)) * resid).reshape(x.shape)


def _served_values(x, rot, dual, shift, cfg: QuantConfig, clip):
    """x [B, T, H, D], rot, dual [H, D, D] (dual = rot^{-T}), shift [H, D] ->
    Q((x - shift) rot) dualᵀ + shift [B, T, H, D]."""
    x_rot = jnp.einsum("bthd,hde->bthe", x - shift, rot, precision=_HI)
    return jnp.einsum("bthe,hde->bthd", quantize_ste(x_rot, cfg, clip), dual, precision=_HI) + shift


def _output_sums(q, k, v, k_hat, v_hat, pos, sink: int, window: int, scale: float):
    """One layer: q [B, T, Hq, D]; k, v, k_hat, v_hat [B, T, Hkv, D]; pos int32 [B, N] query
    positions -> (Σ |o - ô|², Σ |o|²) over the N queries, ô with sink and window exact."""
    b, t, hkv, _ = k.shape
    qs = jnp.take_along_axis(q, pos[:, :, None, None], axis=1)
    qg = group_queries(qs, hkv)  # [B, N, Hkv, g, D]
    s = jnp.einsum("bnhgd,bthd->bhgnt", qg, k, precision=_HI) * scale
    s_hat = jnp.einsum("bnhgd,bthd->bhgnt", qg, k_hat, precision=_HI) * scale
    keys = jnp.arange(t)[None, None, :]
    causal = (keys <= pos[:, :, None])[:, None, None]  # [B, 1, 1, N, T]
    exact = ((keys < sink) | (keys > pos[:, :, None] - window))[:, None, None]
    p = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)
    p_hat = jax.nn.softmax(jnp.where(causal, jnp.where(exact, s, s_hat), -jnp.inf), axis=-1)
    o = jnp.einsum("bhgnt,bthd->bhgnd", p, v, precision=_HI)
    o_hat = (jnp.einsum("bhgnt,bthd->bhgnd", jnp.where(exact, p_hat, 0.0), v, precision=_HI)
             + jnp.einsum("bhgnt,bthd->bhgnd", jnp.where(exact, 0.0, p_hat), v_hat, precision=_HI))
    return jnp.sum((o - o_hat) ** 2), jnp.sum(o * o)


def _check_positions(t: int, sink: int, window: int) -> None:
    if t <= sink + window:
        raise ValueError(f"sequences of {t} tokens: expected more than sink + window = {sink + window} "
                         f"(no token would be quantised)")


@functools.partial(jax.jit, static_argnames=("cfg", "sink", "window", "scale"))
def _attention_sums(q, k, v, rot_k, dual_k, rot_v, dual_v, shift, clip_k, clip_v, cfg, sink, window, scale):
    """One layer, every query at >= sink + window: (Σ |o - ô|², Σ |o|²)."""
    b, t = k.shape[:2]
    pos = jnp.broadcast_to(jnp.arange(sink + window, t, dtype=jnp.int32), (b, t - sink - window))
    k_hat = _served_values(k, rot_k, dual_k, shift, cfg, clip_k)
    v_hat = _served_values(v, rot_v, dual_v, jnp.zeros_like(shift), cfg, clip_v)
    return _output_sums(q, k, v, k_hat, v_hat, pos, sink, window, scale)


def attention_error(q, k, v, rot_k: cal.Rotation, rot_v: cal.Rotation, clip_k, clip_v, cfg: QuantConfig, *,
                    sink: int, window: int, k_shift=None, softmax_scale: float | None = None) -> np.ndarray:
    """Relative attention-output error per layer on held-aside tokens, keys and values as the
    cache serves them (sink and window exact, the rest rotated and quantised, the key mean
    `k_shift` [L, Hkv, D] removed first when given): Σ |o - ô|² / Σ |o|² over the queries at
    positions >= sink + window. q [L, B, T, Hq, D], k, v [L, B, T, Hkv, D]; clip_k,
    clip_v [L] -> float64 [L]."""
    check_activations(q, k, v)
    _check_positions(k.shape[2], sink, window)
    num_layers, _, _, hkv, d = k.shape
    shift = np.zeros((num_layers, hkv, d), np.float32) if k_shift is None else np.asarray(k_shift, np.float32)
    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    out = []
    for i in range(num_layers):
        err = ref = 0.0
        for row in range(k.shape[1]):  # one sequence at a time: [Hq, T, T] scores
            e, r = _attention_sums(*(f32(x[i, row: row + 1]) for x in (q, k, v)), f32(rot_k.rot[i]),
                                   f32(rot_k.dual[i]), f32(rot_v.rot[i]), f32(rot_v.dual[i]), f32(shift[i]),
                                   float(clip_k[i]), float(clip_v[i]), cfg, sink, window, scale)
            err, ref = err + float(e), ref + float(r)
        out.append(err / ref)
    return np.array(out)


class RotationLearner:
    """Trains R_K and/or R_V of every layer from their initial rotations.

    init_k, init_v: `calibrate.Rotation` [L, Hkv, D, D]; train: which of "k", "v" to train
    (each R0 · cayley(W), dual R0^{-T} · cayley(W); an untrained one stays as given);
    per_head: one W per KV head (else one per layer, shared by its heads); clip_k, clip_v
    [L]: fixed ratios used while training;
    k_shift [L, Hkv, D] or None: the key mean removed before quantising.
    `step(q, k, v)` runs `config.steps_per_batch` Adam steps on one batch and returns the
    per-layer training losses of the last one; `rotations()` the current (rot_k, rot_v).
    """

    def __init__(self, init_k: cal.Rotation, init_v: cal.Rotation, train: tuple[str, ...], *, per_head: bool,
                 clip_k, clip_v, quant_cfg: QuantConfig, sink: int, window: int, k_shift=None,
                 softmax_scale: float | None = None, config: LearnConfig = LearnConfig()):
        if not train or set(train) - {"k", "v"}:
            raise ValueError(f"train={train!r}: expected a non-empty subset of ('k', 'v')")
        if init_k.rot.shape != init_v.rot.shape:
            raise ValueError(f"init_k.rot.shape={init_k.rot.shape}, init_v.rot.shape={init_v.rot.shape}: "
                             f"expected equal [L, Hkv, D, D]")
        if sink < 0 or window < 1:
            raise ValueError(f"sink={sink}, window={window}: expected sink >= 0 and window >= 1")
        self.init = {"k": init_k, "v": init_v}
        self.train, self.per_head, self.config = tuple(train), per_head, config
        num_layers, hkv, d, _ = init_k.rot.shape
        heads = hkv if per_head else 1
        self.params = {w: jnp.zeros((num_layers, heads, d, d), jnp.float32) for w in self.train}
        self.fixed = {
            **{f"{name}_{w}": jnp.asarray(getattr(r, field), jnp.float32) for w, r in (("k", init_k), ("v", init_v))
               for name, field in (("r0", "rot"), ("d0", "dual"))},
            "clip_k": jnp.broadcast_to(jnp.asarray(clip_k, jnp.float32), (num_layers,)),
            "clip_v": jnp.broadcast_to(jnp.asarray(clip_v, jnp.float32), (num_layers,)),
            "shift": (jnp.zeros((num_layers, hkv, d), jnp.float32) if k_shift is None
                      else jnp.asarray(k_shift, jnp.float32))}
        self.optimizer = optax.adam(config.learning_rate)
        self.opt_state = self.optimizer.init(self.params)
        self.key = jax.random.key(config.seed)
        self.steps = 0
        self._update = jax.jit(functools.partial(
            _update, optimizer=self.optimizer, cfg=quant_cfg, sink=sink, window=window, queries=config.queries,
            scale=d ** -0.5 if softmax_scale is None else float(softmax_scale)))
        self.sink, self.window = sink, window

    def step(self, q, k, v) -> np.ndarray:
        """`config.steps_per_batch` steps on q [L, B, T, Hq, D], k, v [L, B, T, Hkv, D] ->
        the last step's per-layer relative errors (before its update) float64 [L]."""
        check_activations(q, k, v, self.fixed["r0_k"].shape[:2] + self.fixed["r0_k"].shape[-1:])
        _check_positions(k.shape[2], self.sink, self.window)
        q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
        for _ in range(self.config.steps_per_batch):
            self.key, sub = jax.random.split(self.key)
            self.params, self.opt_state, losses = self._update(self.params, self.opt_state, q, k, v, self.fixed, sub)
            self.steps += 1
        return np.asarray(losses, np.float64)

    def rotations(self) -> tuple[cal.Rotation, cal.Rotation]:
        """(rot_k, rot_v) [L, Hkv, D, D]: R0 · cayley(W) and its dual R0^{-T} · cayley(W) in
        float64, rounded to float32 (one array for an orthogonal R0: dual = rot); the trained
        ones named "learned" (per head or per layer), with the init's eigenvalues."""
        out = []
        for which in ("k", "v"):
            init = self.init[which]
            if which not in self.params:
                out.append(init)
                continue
            w = np.asarray(self.params[which], np.float64)
            a = 0.5 * (w - np.swapaxes(w, -1, -2))
            eye = np.eye(w.shape[-1])
            turn = np.linalg.solve(eye - a, eye + a)
            times = lambda r0: np.einsum("lhde,lhef->lhdf", np.asarray(r0, np.float64), turn).astype(np.float32)
            rot = times(init.rot)
            dual = rot if np.array_equal(init.rot, init.dual) else times(init.dual)
            out.append(cal.Rotation(rot, dual, init.eigenvalues, cal.RotationSpec("learned", self.per_head)))
        return out[0], out[1]


def _layer_rotation(w, r0):
    """w [Hp, D, D] (Hp = Hkv or 1), r0 [Hkv, D, D] -> r0 · cayley(w) [Hkv, D, D]."""
    return jnp.broadcast_to(jnp.einsum("hde,hef->hdf", r0[: w.shape[0]], cayley(w), precision=_HI), r0.shape)


def _layer_loss(params, q, k, v, fixed, pos, cfg, sink, window, scale):
    """One layer's relative served attention-output error at query positions pos [B, N]."""
    rot = lambda w: ((_layer_rotation(params[w], fixed[f"r0_{w}"]), _layer_rotation(params[w], fixed[f"d0_{w}"]))
                     if w in params else (fixed[f"r0_{w}"], fixed[f"d0_{w}"]))
    k_hat = _served_values(k, *rot("k"), fixed["shift"], cfg, fixed["clip_k"])
    v_hat = _served_values(v, *rot("v"), jnp.zeros_like(fixed["shift"]), cfg, fixed["clip_v"])
    err, ref = _output_sums(q, k, v, k_hat, v_hat, pos, sink, window, scale)
    return err / ref


def _update(params, opt_state, q, k, v, fixed, key, *, optimizer, cfg, sink, window, queries, scale):
    """One Adam step over every layer (each layer's gradient from its own loss term) ->
    (params, opt_state, per-layer losses [L])."""
    b, t = k.shape[1:3]
    n = min(queries, t - sink - window)
    keys = jax.random.split(key, b)
    pos = sink + window + jax.vmap(lambda kk: jax.random.choice(kk, t - sink - window, (n,), replace=False))(keys)
    grad = jax.value_and_grad(functools.partial(_layer_loss, cfg=cfg, sink=sink, window=window, scale=scale))
    losses, grads = jax.lax.map(lambda a: grad(a[0], *a[1:], pos=pos.astype(jnp.int32)), (params, q, k, v, fixed))
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, losses


def _layers(x, idx: np.ndarray):
    """Layers idx of statistics, a rotation or an array [L, ...]."""
    if isinstance(x, cal.Statistics):
        return dataclasses.replace(x, **{f.name: getattr(x, f.name)[idx] for f in dataclasses.fields(x)
                                         if isinstance(getattr(x, f.name), np.ndarray)})
    if isinstance(x, cal.Rotation):
        return cal.Rotation(x.rot[idx], x.dual[idx], x.eigenvalues[idx], x.spec)
    return x[idx]


def learn_rotations(stats: cal.Statistics, batches: Callable[[], Iterable], *,
                    rotation_k: cal.RotationSpec | str, rotation_v: cal.RotationSpec | str,
                    quant_cfg: QuantConfig, sink: int, window: int, config: LearnConfig = LearnConfig(),
                    center_keys: bool = False, grid=CLIP_GRID, softmax_scale: float | None = None,
                    progress: Callable[[np.ndarray], None] | None = None,
                    start: tuple[cal.Rotation, cal.Rotation] | None = None,
                    layer_quant: Sequence[QuantConfig] | None = None) -> tuple[cal.Rotation, cal.Rotation]:
    """Train the "learned" ones of rotation_k, rotation_v (a "learned" spec trains from
    config.init with the same per-head setting; any other is built from `stats` and kept).

    stats: the calibration statistics; batches: called once per epoch, yields calibration
    (q, k, v) [L, B, T, H, D] (streamed: the caller computes each when asked); the clips
    used while training are fitted (`clips.fit_clips`) for the initial rotations on the
    first batch (fit the final clips on the learned ones with `calibrate.calibrate`); sink,
    window: the bf16 segments the cache is served with; progress(losses [L]) is called after
    each batch. start: (rot_k, rot_v) [L, Hkv, D, D] to start from in place of the built
    ones (e.g. rotations learned for another quantiser; with center_keys the key rotation
    acts on centered keys; an untrained one is returned as given; a per-layer learned one
    must be the same for every KV head); layer_quant: one quantiser per layer (a bit
    budget's), each layer trained with its own, quant_cfg then unused (default: quant_cfg
    everywhere). Returns (rot_k, rot_v) [L, Hkv, D, D] (learned from an orthogonal init:
    orthogonal)."""
    specs = [cal.RotationSpec.parse(s) if isinstance(s, str) else s for s in (rotation_k, rotation_v)]
    train = tuple(w for w, s in zip("kv", specs) if s.kind == "learned")
    if not train:
        raise ValueError(f"rotation_k={specs[0].name!r}, rotation_v={specs[1].name!r}: neither is 'learned'")
    if len({s.per_head for s in specs if s.kind == "learned"}) > 1:
        raise ValueError("rotation_k and rotation_v: learned ones must both be per head or both per layer")
    num_layers = stats.query_cov.shape[0]
    layer_quant = (quant_cfg,) * num_layers if layer_quant is None else tuple(layer_quant)
    if len(layer_quant) != num_layers:
        raise ValueError(f"layer_quant: {len(layer_quant)} quantisers, expected one per layer (L={num_layers})")
    if start is not None:
        if len(start) != 2 or any(r.rot.shape != stats.query_cov.shape or r.dual.shape != r.rot.shape for r in start):
            raise ValueError(f"start: expected (rot_k, rot_v) with rot and dual [L, Hkv, D, D] = "
                             f"{stats.query_cov.shape}")
        for r, s in zip(start, specs):
            if s.kind == "learned" and not s.per_head and not (r.rot == r.rot[:, :1]).all():
                raise ValueError(f"start: a per-layer {s.name!r} rotation must be the same for every KV head")
    stats_c, _, k_shift = cal.centered(stats, None, center_keys)
    per_head = next(s.per_head for s in specs if s.kind == "learned")
    groups = {q: np.array([i for i, x in enumerate(layer_quant) if x == q]) for q in dict.fromkeys(layer_quant)}
    if len(groups) == 1:  # every layer: no copy of the batches
        groups = {layer_quant[0]: slice(None)}
    learners: dict[QuantConfig, RotationLearner] = {}
    for _ in range(config.epochs):
        for q, k, v in batches():
            losses = np.zeros(num_layers)
            for cfg, idx in groups.items():
                part = [_layers(x, idx) for x in (q, k, v)]
                if cfg not in learners:
                    if start is not None:
                        init = [_layers(r, idx) for r in start]
                    else:
                        init = [cal.rotation_for(_layers(stats_c, idx), w, cal.RotationSpec(config.init, s.per_head)
                                                 if s.kind == "learned" else s, cfg.group_size)
                                for w, s in zip("kv", specs)]
                    _, (q_c, k_c, v_c), _ = cal.centered(_layers(stats, idx), part, center_keys)
                    fit = fit_clips(_layers(stats_c, idx), q_c, k_c, v_c, init[0], init[1], cfg, grid, softmax_scale)
                    learners[cfg] = RotationLearner(
                        init[0], init[1], train, per_head=per_head, clip_k=fit.clip_k, clip_v=fit.clip_v,
                        quant_cfg=cfg, sink=sink, window=window,
                        k_shift=None if k_shift is None else k_shift[idx], softmax_scale=softmax_scale, config=config)
                losses[idx] = learners[cfg].step(*part)
            if progress is not None:
                progress(losses)
    if not learners:
        raise ValueError("batches() yielded no calibration batch to learn from")
    learned = [learners[cfg].rotations() for cfg in groups]
    return tuple(_stitch([pair[i] for pair in learned], list(groups.values()), num_layers) for i in range(2))


def _stitch(parts: Sequence[cal.Rotation], indices: Sequence, num_layers: int) -> cal.Rotation:
    """Rotations of layer groups (parts[j] for layers indices[j]: indices or a slice) -> one
    [L, ...] rotation."""
    out = {}
    for field in ("rot", "dual", "eigenvalues"):
        first = getattr(parts[0], field)
        out[field] = np.zeros((num_layers, *first.shape[1:]), first.dtype)
        for part, idx in zip(parts, indices):
            out[field][idx] = getattr(part, field)
    return cal.Rotation(**out, spec=parts[0].spec)
