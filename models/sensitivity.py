"""How far one layer's quantised cache moves the model's output.

For every full-attention layer, one at a time: the forward runs in full precision except
that layer, whose attention sees its keys and values as a calibration stores them (the bf16
sink and the recent ring exact, as a serving chunk leaves them: `budget.served_attention`);
the layers after it run on the perturbed stream. The KL of the next-token distribution
against the full-precision forward, at query positions spread over the sequence, is that
layer's cost to the output; with the layer's own relative attention-output error in the same
run it gives the weight (`budget.output_weights`) that turns the bit budget's per-layer
errors into output cost (`oscar calibrate --budget-weights kl`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from oscar_jax import budget, learn
from oscar_jax import calibrate as cal
from oscar_jax.models.config import LayerType, ModelConfig
from oscar_jax.models.decoder import Decoder, _forward_layer, output_and_mlp, project_qkv


@functools.partial(jax.jit, static_argnames=("cfg", "kind", "quant", "sink", "window", "chunk"))
def _served_layer(w, x, positions, rot_k, dual_k, shift, clip_k, rot_v, dual_v, clip_v, *, cfg: ModelConfig,
                  kind: LayerType, quant, sink: int, window: int, chunk: int):
    """One full-attention layer with its K/V served quantised: x [1, T, H] -> (x, Σ |o - ô|²,
    Σ |o|²) over every query."""
    q, k, v = project_qkv(cfg, kind, w, x, positions)
    f32 = lambda a: a.astype(jnp.float32)
    k_hat = learn._served_values(f32(k), rot_k, dual_k, shift, quant, clip_k)
    v_hat = learn._served_values(f32(v), rot_v, dual_v, jnp.zeros_like(shift), quant, clip_v)
    o, o_hat = budget.served_attention(f32(q[0]), f32(k[0]), f32(v[0]), k_hat[0], v_hat[0], sink=sink,
                                       window=window, chunk=chunk, scale=cfg.softmax_scale)
    err, ref = jnp.sum((o - o_hat) ** 2), jnp.sum(o * o)
    return output_and_mlp(cfg, w, x, o_hat[None].astype(x.dtype)), err, ref


@jax.jit
def _log_probs(model: Decoder, hidden: jax.Array, pos: jax.Array) -> jax.Array:
    """hidden [1, T, H], pos int32 [N] -> log-softmax of the logits at pos [N, V]."""
    return jax.nn.log_softmax(model.logits(hidden[0, pos]), axis=-1)


def layer_kl(model: Decoder, ids: np.ndarray, calib: cal.Calibration, *, sink: int, window: int, chunk: int = 1,
             queries: int = 256, progress=None) -> tuple[np.ndarray, np.ndarray]:
    """Per full-attention layer j (the calibration's layers, in order), with only that layer
    served through `calib` (its rotations, clips, key shift and quantiser, `calib.layer_quant`
    when set): (mean KL(p || p̂) over `queries` positions per sequence spread over it
    (`budget.query_positions`), relative attention-output error Σ |o - ô|² / Σ |o|² over every
    query of that layer): float64 [L], [L].

    ids: int [B, T] held-aside sequences (T > sink + window); chunk: the serving chunk
    (1 <= chunk <= window); progress: optional callable() after each (sequence, layer)."""
    cfg = model.cfg
    ids = np.asarray(ids, np.int32)
    full = tuple(i for i, t in enumerate(cfg.layer_types) if t == "full_attention")
    if ids.ndim != 2 or ids.shape[1] <= sink + window:
        raise ValueError(f"ids.shape={ids.shape}: expected [B, T] with T > sink + window = {sink + window}")
    if not 1 <= chunk <= window:
        raise ValueError(f"chunk={chunk}: expected 1 <= chunk <= window={window}")
    if calib.clip_k.shape[0] != len(full):
        raise ValueError(f"calib has {calib.clip_k.shape[0]} layers, the model {len(full)} full-attention layers")
    t = ids.shape[1]
    positions = jnp.arange(t, dtype=jnp.int32)[None]
    lengths = jnp.full((1,), t, jnp.int32)
    pos = jnp.asarray(budget.query_positions(t, queries))
    hkv, d = cfg.num_kv_heads, cfg.head_dim
    shift = np.zeros((len(full), hkv, d), np.float32) if calib.k_shift is None else calib.k_shift
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    run = lambda i, x: _forward_layer(model.layers[i].arrays(), x, positions, lengths, cfg=cfg,
                                      kind=cfg.layer_types[i], capture=False, kv_dtype=None, exact_prefix=0)[0]
    kl, err, ref = np.zeros(len(full)), np.zeros(len(full)), np.zeros(len(full))
    for row in ids:
        x = model.embed_tokens(jnp.asarray(row[None]))
        inputs = []
        for i in range(cfg.num_layers):
            inputs.append(x)
            x = run(i, x)
        clean = _log_probs(model, x, pos)
        for j, i in enumerate(full):
            quant = calib.quant if calib.layer_quant is None else calib.layer_quant[j]
            x, e, r = _served_layer(model.layers[i].arrays(), inputs[i], positions, f32(calib.rot_k.rot[j]),
                                    f32(calib.rot_k.dual[j]), f32(shift[j]), f32(calib.clip_k[j]),
                                    f32(calib.rot_v.rot[j]), f32(calib.rot_v.dual[j]), f32(calib.clip_v[j]),
                                    cfg=cfg, kind=cfg.layer_types[i], quant=quant, sink=sink, window=window,
                                    chunk=chunk)
            for later in range(i + 1, cfg.num_layers):
                x = run(later, x)
            lp = _log_probs(model, x, pos)
            kl[j] += float(jnp.sum(jnp.exp(clean) * (clean - lp))) / len(pos)
            err[j] += float(e)
            ref[j] += float(r)
            if progress is not None:
                progress()
    return kl / len(ids), err / ref
