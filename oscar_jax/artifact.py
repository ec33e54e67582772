"""The calibration artifact: one versioned orbax checkpoint directory (DESIGN §1.1 step 6).

Layout: `arrays/` (orbax StandardSave of rot_k, rot_v, dual_k, dual_v [L, Hkv, D, D],
eigenvalues_k, eigenvalues_v [L, Hkv, D], clip_k, clip_v [L], with center_keys also
k_shift [L, Hkv, D], all float32) and
`metadata/` (orbax JsonSave of `ArtifactMetadata`, including a SHA-256 of the
arrays). `load` checks format version, model name, config hash and head dim
against the caller's model, and the checksum against the arrays, and refuses
any mismatch or a truncated/corrupted directory with a `ValueError` that says why.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp

from oscar_jax.cache import LayerParams
from oscar_jax.calibrate import Calibration

FORMAT_VERSION = 1
_ARRAY_NAMES = ("rot_k", "rot_v", "dual_k", "dual_v", "eigenvalues_k", "eigenvalues_v",
                "clip_k", "clip_v")


def fingerprint(obj) -> str:
    """SHA-256 hex of a model config (dict or dataclass, canonical JSON; a dataclass's fields
    marked `metadata={"fingerprint": False}` are left out), a text (str), raw bytes, or a
    token-id array (its int64 bytes)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        skip = {f.name for f in dataclasses.fields(obj) if f.metadata.get("fingerprint") is False}
        obj = {k: v for k, v in dataclasses.asdict(obj).items() if k not in skip}
    if isinstance(obj, dict):
        data = json.dumps(obj, sort_keys=True, default=str).encode()
    elif isinstance(obj, str):
        data = obj.encode()
    elif isinstance(obj, bytes):
        data = obj
    else:
        data = np.ascontiguousarray(np.asarray(obj, np.int64)).tobytes()
    return hashlib.sha256(data).hexdigest()


@dataclasses.dataclass(frozen=True)
class ArtifactMetadata:
    """What an artifact was made for and from.

    layers: the model's layer indices the stack covers, in order (e.g. Gemma 3's
    global layers); quant: QuantConfig fields the clips were fitted for;
    rotation_k/v, value_weighting, clip_mode: variant names; corpus_hash, tokens:
    the calibration text; checksum: SHA-256 of the arrays; created: ISO-8601 UTC;
    sink, window: the bf16 segments of the cache the artifact is served with
    (artifacts written before these fields existed read as 64 / 256); center_keys:
    the arrays include k_shift [L, Hkv, D], the key mean removed before quantising.
    """

    format_version: int
    model_name: str
    config_hash: str
    num_layers: int
    kv_heads: int
    head_dim: int
    layers: tuple[int, ...]
    quant: dict
    rotation_k: str
    rotation_v: str
    value_weighting: str
    clip_mode: str
    corpus_hash: str
    tokens: int
    checksum: str
    created: str
    sink: int = 64
    window: int = 256
    center_keys: bool = False

    @property
    def group_size(self) -> int:
        return self.quant.get("group_size") or self.head_dim


def _arrays(calibration: Calibration) -> dict[str, np.ndarray]:
    c = calibration
    values = (c.rot_k.rot, c.rot_v.rot, c.rot_k.dual, c.rot_v.dual, c.rot_k.eigenvalues,
              c.rot_v.eigenvalues, c.clip_k, c.clip_v) + (() if c.k_shift is None else (c.k_shift,))
    return {name: np.ascontiguousarray(np.asarray(a, np.float32)) for name, a in zip(
        _array_names(c.k_shift is not None), values)}


def _array_names(center_keys: bool) -> tuple[str, ...]:
    return _ARRAY_NAMES + (("k_shift",) if center_keys else ())


def _checksum(arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in _array_names("k_shift" in arrays):
        a = np.ascontiguousarray(np.asarray(arrays[name], np.float32))
        h.update(f"{name}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def save(path: str | Path, calibration: Calibration, *, model_name: str, config_hash: str,
         corpus_hash: str, layers: tuple[int, ...] | None = None, sink: int = 64,
         window: int = 256) -> ArtifactMetadata:
    """Write `calibration` to the new directory `path` (must not exist); sink/window:
    the cache's bf16 segments it is to be served with."""
    path = Path(path).absolute()
    if path.exists():
        raise ValueError(f"path={str(path)!r} already exists; artifacts are never overwritten")
    arrays = _arrays(calibration)
    num_layers, kv_heads, head_dim = arrays["rot_k"].shape[:3]
    layers = tuple(range(num_layers)) if layers is None else tuple(int(i) for i in layers)
    if len(layers) != num_layers:
        raise ValueError(f"layers has {len(layers)} entries: expected one per layer ({num_layers})")
    meta = ArtifactMetadata(
        format_version=FORMAT_VERSION, model_name=model_name, config_hash=config_hash,
        num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim, layers=layers,
        quant=dataclasses.asdict(calibration.quant), rotation_k=calibration.rot_k.spec.name,
        rotation_v=calibration.rot_v.spec.name, value_weighting=calibration.value_weighting,
        clip_mode=calibration.clip_mode, corpus_hash=corpus_hash, tokens=calibration.tokens,
        checksum=_checksum(arrays), sink=sink, window=window, center_keys=calibration.k_shift is not None,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckpt:
        ckpt.save(path, ocp.args.Composite(
            arrays=ocp.args.StandardSave(arrays),
            metadata=ocp.args.JsonSave(dataclasses.asdict(meta))))
    return meta


def read_metadata(path: str | Path) -> ArtifactMetadata:
    """The metadata of the artifact at `path` (raises ValueError if missing or malformed)."""
    path = Path(path).absolute()
    if not path.is_dir():
        raise ValueError(f"no calibration artifact at {str(path)!r} (not a directory)")
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckpt:
            raw = ckpt.restore(path, ocp.args.Composite(metadata=ocp.args.JsonRestore()))["metadata"]
        raw["layers"] = tuple(raw["layers"])
        return ArtifactMetadata(**raw)
    except Exception as e:  # orbax raises several types for a damaged directory
        raise ValueError(f"calibration artifact {str(path)!r} is truncated or corrupted: "
                         f"its metadata cannot be read ({type(e).__name__}: {e})") from e


def load(path: str | Path, *, model_name: str | None, config_hash: str, head_dim: int,
         layers: tuple[int, ...] | None = None, v_folded: bool = False
         ) -> tuple[LayerParams, ArtifactMetadata]:
    """Load the artifact for the caller's model -> (stacked LayerParams [L, Hkv, D, D], metadata).

    Refuses (ValueError) another format version, model name (None: not checked),
    config hash, head dim or layer list (None: not checked), and an artifact whose
    arrays are missing, misshapen or fail the checksum.
    """
    path = Path(path).absolute()
    meta = read_metadata(path)
    expected = {"format_version": FORMAT_VERSION, "model_name": model_name,
                "config_hash": config_hash, "head_dim": head_dim,
                "layers": None if layers is None else tuple(layers)}
    for field, want in expected.items():
        got = getattr(meta, field)
        if want is None:
            continue
        if got != want:
            raise ValueError(f"calibration artifact {str(path)!r} was made for {field}={got!r}, "
                             f"but this model has {field}={want!r}; recalibrate with "
                             f"`oscar calibrate` for this model")
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckpt:
            arrays = ckpt.restore(path, ocp.args.Composite(arrays=ocp.args.StandardRestore()))["arrays"]
        arrays = {name: np.asarray(arrays[name], np.float32) for name in _array_names(meta.center_keys)}
    except Exception as e:
        raise ValueError(f"calibration artifact {str(path)!r} is truncated or corrupted: its "
                         f"arrays cannot be read ({type(e).__name__}: {e})") from e
    if _checksum(arrays) != meta.checksum:
        raise ValueError(f"calibration artifact {str(path)!r} is corrupted: the arrays do not "
                         f"match the checksum recorded at save time")
    orthogonal = lambda r, d: np.array_equal(r, d)
    return LayerParams.create(
        arrays["rot_k"], arrays["rot_v"], arrays["clip_k"], arrays["clip_v"],
        num_layers=meta.num_layers, kv_heads=meta.kv_heads, v_folded=v_folded,
        dual_k=None if orthogonal(arrays["rot_k"], arrays["dual_k"]) else arrays["dual_k"],
        dual_v=None if orthogonal(arrays["rot_v"], arrays["dual_v"]) else arrays["dual_v"],
        k_shift=arrays.get("k_shift"),
    ), meta


def load_layer_params(path: str | Path, *, model_cfg, model_name: str | None = None,
                      v_folded: bool = False) -> LayerParams:
    """LayerParams [L_full, Hkv, D, D] for a decoder config (a dataclass with `head_dim`
    and `layer_types`): checks the config hash, head dim and that the artifact covers
    exactly the config's full-attention layers (see `load`)."""
    layers = tuple(i for i, t in enumerate(model_cfg.layer_types) if t == "full_attention")
    params, _ = load(path, model_name=model_name, config_hash=fingerprint(model_cfg),
                     head_dim=model_cfg.head_dim, layers=layers, v_folded=v_folded)
    return params
