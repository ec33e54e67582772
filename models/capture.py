"""A decoder's q, k, v over windows of text: what calibration measures.

`collect` streams the full-precision q, k, v of the full-attention layers (the ones the OSCAR
cache serves) over consecutive windows of calibration text into `oscar_jax.calibrate`'s
accumulator and captures the held-aside windows after them; `heldout_errors` and
`compare_variants` measure a calibration's attention errors on those windows. `oscar
calibrate` (`calibration`), `oscar eval`'s calibration and the benchmarks use them.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from oscar_jax import calibrate as cal
from oscar_jax import learn
from oscar_jax.clips import CLIP_GRID, logit_error, output_error
from oscar_jax.config import QuantConfig
from oscar_jax.models import corpus
from oscar_jax.models.decoder import Decoder


def calibration_text(source: str) -> str:
    """'shakespeare' (the calibration split of `models.corpus`: no evaluation play) or a
    UTF-8 text file's path -> its text (`corpus.read_text_file`)."""
    if source == "shakespeare":
        return corpus.shakespeare_text("calibration")[0]
    return corpus.read_text_file(source)


def full_layers(model_cfg) -> tuple[int, ...]:
    """Indices of the full-attention layers (those with an OSCAR cache)."""
    return tuple(i for i, t in enumerate(model_cfg.layer_types) if t == "full_attention")


@functools.partial(jax.jit, static_argnames=("layers",))
def capture_qkv(model: Decoder, tokens: jax.Array, layers: tuple[int, ...]):
    """tokens int32 [B, T] -> (q [L, B, T, Hq, D], k, v [L, B, T, Hkv, D]) of `layers`, float32."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    _, _, cap = model(tokens, positions, mode="forward", capture_qkv=True)
    idx = jnp.asarray(layers)
    return tuple(x[idx].astype(jnp.float32) for x in (cap.q, cap.k, cap.v))


@jax.jit
def forward(model: Decoder, tokens: jax.Array) -> jax.Array:
    """Plain forward (no capture): tokens [B, T] -> hidden [B, T, H]."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return model(tokens, positions, mode="forward")[0]


def windows(token_ids: np.ndarray, seq_len: int) -> np.ndarray:
    """int32 [N] -> [N // seq_len, seq_len] consecutive windows (the tail is dropped)."""
    n = len(token_ids) // seq_len
    if n == 0:
        raise ValueError(f"{len(token_ids)} tokens are fewer than one window of seq_len={seq_len}")
    return np.asarray(token_ids[: n * seq_len], np.int32).reshape(n, seq_len)


@dataclasses.dataclass(frozen=True)
class CalibrationRun:
    """stats: statistics of the calibration tokens; heldout: (q, k, v) [L, B, T, H, D]
    of the held-aside windows; layers: model layer indices; seconds: wall time of the
    calibration forwards + accumulation."""

    stats: cal.Statistics
    heldout: tuple[np.ndarray, np.ndarray, np.ndarray]
    layers: tuple[int, ...]
    seconds: float


def collect(model: Decoder, calib_ids: np.ndarray, heldout_ids: np.ndarray, *, seq_len: int = 1024,
            config: cal.CalibConfig | None = None, progress=None) -> CalibrationRun:
    """Stream the model's activations over `calib_ids` (int [N]) in windows of `seq_len`
    into the accumulator, then capture `heldout_ids` (int [M], M >= seq_len).

    progress: an optional callable(n_tokens_done) called after each window.
    """
    cfg = model.cfg
    layers = full_layers(cfg)
    if not layers:
        raise ValueError("the model has no full-attention layer to calibrate")
    config = config or cal.CalibConfig(softmax_scale=cfg.softmax_scale)
    acc = cal.Accumulator.init(len(layers), cfg.num_kv_heads, cfg.head_dim, config)
    start = time.perf_counter()
    for row in windows(calib_ids, seq_len):
        q, k, v = capture_qkv(model, jnp.asarray(row[None]), layers)
        acc = cal.accumulate(acc, q, k, v)
        if progress is not None:
            progress(len(row))
    stats = cal.statistics(acc)
    seconds = time.perf_counter() - start
    return CalibrationRun(stats, capture_windows(model, heldout_ids, seq_len), layers, seconds)


def capture_windows(model: Decoder, ids: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The (q, k, v) [L, B, seq_len, H, D] float32 of the full-attention layers over `ids`
    (int [N]) cut into B = N // seq_len windows, captured one window at a time."""
    layers = full_layers(model.cfg)
    caps = [tuple(np.asarray(x) for x in capture_qkv(model, jnp.asarray(row[None]), layers))
            for row in windows(ids, seq_len)]
    return tuple(np.concatenate(parts, axis=1) for parts in zip(*caps))


def capture_batches(model: Decoder, calib_ids: np.ndarray, *, seq_len: int = 1024, batch: int = 1):
    """A callable giving a fresh stream of (q, k, v) [L, B, T, H, D] over `calib_ids` (int [N]),
    `batch` windows of `seq_len` at a time (the last batch may be smaller), each captured
    when asked: the batches `learn.learn_rotations` trains on, one epoch per call."""
    rows = windows(calib_ids, seq_len)
    layers = full_layers(model.cfg)

    def stream():
        for i in range(0, len(rows), batch):
            yield capture_qkv(model, jnp.asarray(rows[i: i + batch]), layers)

    return stream


def _halves(run: CalibrationRun):
    """The held-aside windows split in two: (fit part, measured part), (q, k, v) each."""
    b = run.heldout[0].shape[1]
    if b < 2:
        raise ValueError(f"held-aside errors need >= 2 held-aside windows (fit on one half, measure on the other), "
                         f"got {b}")
    return tuple(x[:, : b // 2] for x in run.heldout), tuple(x[:, b // 2:] for x in run.heldout)


def heldout_errors(run: CalibrationRun, rot_k, rot_v, quant_cfg: QuantConfig, clips: cal.ClipMode = "fit",
                   grid=CLIP_GRID, softmax_scale: float | None = None, *, sink: int, window: int,
                   center_keys: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Held-aside relative attention-logit error (keys quantised), attention-output error
    (values quantised, keys exact) and served attention-output error (keys and values
    quantised, sink and window exact: `learn.attention_error`), per layer [L] each, of one
    calibration (rot_k, rot_v: names or `calibrate.Rotation`s; quant_cfg: its quantiser).
    Clips are fitted (clips="fit") on the first half of the held-aside windows and the errors
    measured on the second; center_keys: as the calibration (the key errors are then those
    of the centered keys)."""
    fit_part, (q_eval, k_eval, v_eval) = _halves(run)
    c = cal.calibrate(run.stats, fit_part, rotation_k=rot_k, rotation_v=rot_v, quant_cfg=quant_cfg,
                      clips=clips, grid=grid, softmax_scale=softmax_scale, center_keys=center_keys)
    k_c = k_eval if c.k_shift is None else k_eval - c.k_shift[:, None, None]
    served = learn.attention_error(q_eval, k_eval, v_eval, c.rot_k, c.rot_v, c.clip_k, c.clip_v, quant_cfg,
                                   sink=sink, window=window, k_shift=c.k_shift, softmax_scale=softmax_scale)
    return (logit_error(q_eval, k_c, c.rot_k, c.clip_k, quant_cfg),
            output_error(q_eval, k_eval, v_eval, c.rot_v, c.clip_v, quant_cfg, softmax_scale), served)


def split_variant(name: str) -> tuple[str, str]:
    """'K:V' -> (K, V); a single name -> (name, name)."""
    k_name, _, v_name = name.partition(":")
    return k_name, v_name or k_name


def compare_variants(run: CalibrationRun, names: tuple[str, ...], quant_cfg: QuantConfig,
                     clips: cal.ClipMode = "fit", grid=CLIP_GRID, softmax_scale: float | None = None, *,
                     sink: int, window: int, center_keys: bool = False,
                     learned: Callable[[str, str], tuple[cal.Rotation, cal.Rotation]] | None = None
                     ) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """`heldout_errors` per rotation variant: a name (used for K and V) or 'K:V' (each its
    own); learned(k_name, v_name) gives the (rot_k, rot_v) of a pair with a "learned" one."""
    _halves(run)
    out = {}
    for name in names:
        k_name, v_name = split_variant(name)
        if any(cal.RotationSpec.parse(n).kind == "learned" for n in (k_name, v_name)):
            if learned is None:
                raise ValueError(f"variant {name!r} needs learned=: a callable that trains it")
            rot_k, rot_v = learned(k_name, v_name)
        else:
            rot_k, rot_v = k_name, v_name
        out[name] = heldout_errors(run, rot_k, rot_v, quant_cfg, clips, grid, softmax_scale, sink=sink,
                                   window=window, center_keys=center_keys)
    return out


def eigen_spread(stats: cal.Statistics) -> tuple[np.ndarray, np.ndarray]:
    """Per layer, λ_max / λ_median of C_K and of C_V (head means): [L], [L]."""
    def spread(c):
        lam = np.linalg.eigvalsh(c.mean(axis=1))
        return lam[:, -1] / np.median(lam, axis=1)
    return spread(stats.query_cov), spread(stats.value_cov)
