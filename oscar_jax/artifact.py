"""The calibration artifact: one versioned orbax checkpoint directory (docs/method.md §1.5).

Layout: `arrays/` (orbax StandardSave of rot_k, rot_v, dual_k, dual_v [L, Hkv, D, D],
eigenvalues_k, eigenvalues_v [L, Hkv, D], clip_k, clip_v [L], with center_keys also
k_shift [L, Hkv, D], all float32) and
`metadata/` (orbax JsonSave of `ArtifactMetadata`, including a SHA-256 of the
arrays and of every other metadata field). `save` writes a unique temporary directory
beside the target and renames it into place, so a reader or a second writer never sees a
partial artifact, and at most one of several concurrent writers succeeds. `read_metadata`
validates every field; `load` also checks format version, model name, config hash and head
dim against the caller's model, and the checksum against the arrays and metadata, and
refuses any mismatch or a truncated/corrupted directory with a `ValueError` that says why.
Format 3 adds `layer_quant` (one quantiser per layer, a bit budget); format 2 still reads.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import operator
import os
import re
import shutil
import uuid
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp

from oscar_jax import calibrate as cal
from oscar_jax.cache import LayerParams
from oscar_jax.calibrate import Calibration
from oscar_jax.config import QuantConfig

FORMAT_VERSION = 3  # 2: the checksum covers the metadata too; 3: layer_quant
READ_VERSIONS = (2, 3)  # a version-2 artifact reads as layer_quant None
_ADDED_IN = {"layer_quant": 3}  # metadata fields a version before this lacks
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
    the calibration text; checksum: SHA-256 of the arrays and every other field;
    created: ISO-8601 UTC; sink, window: the bf16 segments of the cache the artifact
    is served with; center_keys: the arrays include k_shift [L, Hkv, D], the key mean
    removed before quantising; layer_quant: None (every layer `quant`), or QuantConfig fields
    per layer (a bit budget, `oscar_jax.budget`), each layer's clips fitted for its own.
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
    sink: int
    window: int
    center_keys: bool
    layer_quant: tuple[dict, ...] | None = None

    @property
    def group_size(self) -> int:
        return self.quant.get("group_size") or self.head_dim

    def layer_quants(self) -> tuple[QuantConfig, ...] | None:
        """The per-layer quantisers, or None when every layer has `quant`."""
        return None if self.layer_quant is None else tuple(QuantConfig(**q) for q in self.layer_quant)


def _stored_fields(meta: ArtifactMetadata) -> dict:
    """The metadata fields its format version stores (the checksum covers these)."""
    return {k: v for k, v in dataclasses.asdict(meta).items() if meta.format_version >= _ADDED_IN.get(k, 0)}


def _arrays(calibration: Calibration) -> dict[str, np.ndarray]:
    c = calibration
    values = (c.rot_k.rot, c.rot_v.rot, c.rot_k.dual, c.rot_v.dual, c.rot_k.eigenvalues,
              c.rot_v.eigenvalues, c.clip_k, c.clip_v) + (() if c.k_shift is None else (c.k_shift,))
    return {name: np.ascontiguousarray(np.asarray(a, np.float32)) for name, a in zip(
        _array_names(c.k_shift is not None), values)}


def _array_names(center_keys: bool) -> tuple[str, ...]:
    return _ARRAY_NAMES + (("k_shift",) if center_keys else ())


def _checksum(arrays: dict[str, np.ndarray], meta: dict) -> str:
    """SHA-256 of the arrays (names, shapes, float32 bytes) and of every metadata field but
    the checksum itself (canonical JSON)."""
    h = hashlib.sha256()
    for name in _array_names("k_shift" in arrays):
        a = np.ascontiguousarray(np.asarray(arrays[name], np.float32))
        h.update(f"{name}{a.shape}".encode())
        h.update(a.tobytes())
    fields = {k: list(v) if isinstance(v, tuple) else v for k, v in meta.items() if k != "checksum"}
    h.update(json.dumps(fields, sort_keys=True).encode())
    return h.hexdigest()


_HEX64 = re.compile(r"[0-9a-f]{64}")


def validate_metadata(raw: dict) -> ArtifactMetadata:
    """The `ArtifactMetadata` of a JSON dict, every field checked for type and range
    (ValueError naming the first bad field)."""
    names = [f.name for f in dataclasses.fields(ArtifactMetadata)
             if not isinstance(raw.get("format_version"), int) or raw["format_version"] >= _ADDED_IN.get(f.name, 0)]
    missing, unknown = [n for n in names if n not in raw], sorted(set(raw) - set(names))
    if missing or unknown:
        raise ValueError(f"metadata fields missing: {missing}, unknown: {unknown}")

    def bad(field, expected):
        return ValueError(f"metadata {field}={raw[field]!r}: expected {expected}")

    is_int = lambda x: isinstance(x, int) and not isinstance(x, bool)
    for field, low in (("format_version", 1), ("num_layers", 1), ("kv_heads", 1), ("head_dim", 1),
                       ("tokens", 1), ("sink", 0), ("window", 1)):
        if not is_int(raw[field]) or raw[field] < low:
            raise bad(field, f"an int >= {low}")
    for field in ("model_name", "rotation_k", "rotation_v", "value_weighting", "clip_mode", "created"):
        if not isinstance(raw[field], str):
            raise bad(field, "a string")
    for field in ("config_hash", "corpus_hash", "checksum"):
        if not isinstance(raw[field], str) or not _HEX64.fullmatch(raw[field]):
            raise bad(field, "a SHA-256 hex digest")
    if not isinstance(raw["center_keys"], bool):
        raise bad("center_keys", "true or false")
    layers = raw["layers"]
    if (not isinstance(layers, (list, tuple)) or len(layers) != raw["num_layers"]
            or not all(is_int(i) and i >= 0 for i in layers) or list(layers) != sorted(set(layers))):
        raise bad("layers", f"num_layers={raw['num_layers']} increasing layer indices >= 0")
    if not isinstance(raw["quant"], dict):
        raise bad("quant", "a dict of QuantConfig fields")
    try:
        QuantConfig(**raw["quant"]).groups(raw["head_dim"])
    except (TypeError, ValueError) as e:
        raise bad("quant", f"QuantConfig fields for head_dim={raw['head_dim']} ({e})") from None
    layer_quant = raw.get("layer_quant")
    if layer_quant is not None:
        expected = f"null or num_layers={raw['num_layers']} dicts of QuantConfig fields for head_dim={raw['head_dim']}"
        if not isinstance(layer_quant, (list, tuple)) or len(layer_quant) != raw["num_layers"]:
            raise bad("layer_quant", expected)
        try:
            for q in layer_quant:
                QuantConfig(**q).groups(raw["head_dim"])
        except (TypeError, ValueError) as e:
            raise bad("layer_quant", f"{expected} ({e})") from None
        layer_quant = tuple(dict(q) for q in layer_quant)
    for field in ("rotation_k", "rotation_v"):
        try:
            cal.RotationSpec.parse(raw[field])
        except ValueError as e:
            raise bad(field, f"a rotation name ({e})") from None
    if raw["value_weighting"] not in cal.VALUE_WEIGHTINGS:
        raise bad("value_weighting", f"one of {cal.VALUE_WEIGHTINGS}")
    if raw["clip_mode"] not in ("fit", "fixed"):
        raise bad("clip_mode", "'fit' or 'fixed'")
    try:
        datetime.datetime.fromisoformat(raw["created"])
    except ValueError:
        raise bad("created", "an ISO-8601 time") from None
    return ArtifactMetadata(**{**raw, "layers": tuple(layers), "layer_quant": layer_quant})


def save(path: str | Path, calibration: Calibration, *, model_name: str, config_hash: str,
         corpus_hash: str, layers: tuple[int, ...] | None = None, sink: int = 64,
         window: int = 256) -> ArtifactMetadata:
    """Write `calibration` to the new directory `path` (must not exist; ValueError if it
    appears while this writes); sink/window: the cache's bf16 segments it is to be served with."""
    path = Path(path).absolute()
    if path.exists():
        raise ValueError(f"path={str(path)!r} already exists; artifacts are never overwritten")
    arrays = _arrays(calibration)
    num_layers, kv_heads, head_dim = arrays["rot_k"].shape[:3]
    layers = tuple(range(num_layers)) if layers is None else tuple(int(i) for i in layers)
    if len(layers) != num_layers:
        raise ValueError(f"layers has {len(layers)} entries: expected one per layer ({num_layers})")
    raw = dict(
        format_version=FORMAT_VERSION, model_name=model_name, config_hash=config_hash,
        num_layers=int(num_layers), kv_heads=int(kv_heads), head_dim=int(head_dim), layers=list(layers),
        quant=dataclasses.asdict(calibration.quant), rotation_k=calibration.rot_k.spec.name,
        rotation_v=calibration.rot_v.spec.name, value_weighting=calibration.value_weighting,
        clip_mode=calibration.clip_mode, corpus_hash=corpus_hash, tokens=int(calibration.tokens),
        sink=operator.index(sink), window=operator.index(window), center_keys=calibration.k_shift is not None,
        layer_quant=None if calibration.layer_quant is None else [
            dataclasses.asdict(q) for q in calibration.layer_quant],
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    raw["checksum"] = _checksum(arrays, raw)
    meta = validate_metadata(raw)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckpt:
            ckpt.save(tmp, ocp.args.Composite(arrays=ocp.args.StandardSave(arrays),
                                              metadata=ocp.args.JsonSave(raw)))
        if path.exists():  # rename would replace an empty directory: refuse any
            raise FileExistsError(path)
        os.rename(tmp, path)  # fails when another writer's artifact is there
    except OSError:
        if path.exists():
            raise ValueError(f"path={str(path)!r} appeared while this artifact was written "
                             f"(another writer?); artifacts are never overwritten") from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta


def read_metadata(path: str | Path) -> ArtifactMetadata:
    """The metadata of the artifact at `path` (raises ValueError if missing or malformed)."""
    path = Path(path).absolute()
    if not path.is_dir():
        raise ValueError(f"no calibration artifact at {str(path)!r} (not a directory)")
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckpt:
            raw = ckpt.restore(path, ocp.args.Composite(metadata=ocp.args.JsonRestore()))["metadata"]
    except Exception as e:  # orbax raises several types for a damaged directory
        raise ValueError(f"calibration artifact {str(path)!r} is truncated or corrupted: "
                         f"its metadata cannot be read ({type(e).__name__}: {e})") from e
    if not isinstance(raw, dict):
        raise ValueError(f"calibration artifact {str(path)!r} is corrupted: its metadata is not a JSON object")
    if raw.get("format_version") not in READ_VERSIONS:
        raise ValueError(f"calibration artifact {str(path)!r} has format_version="
                         f"{raw.get('format_version')!r}; this oscar-jax reads {READ_VERSIONS}: "
                         f"recalibrate with `oscar calibrate`")
    try:
        return validate_metadata(raw)
    except ValueError as e:
        raise ValueError(f"calibration artifact {str(path)!r} is corrupted: {e}") from None


def load(path: str | Path, *, model_name: str | None, config_hash: str, head_dim: int,
         layers: tuple[int, ...] | None = None, v_folded: bool = False
         ) -> tuple[LayerParams, ArtifactMetadata]:
    """Load the artifact for the caller's model -> (stacked LayerParams [L, Hkv, D, D], metadata).

    Refuses (ValueError) another format version, model name (None: not checked),
    config hash, head dim or layer list (None: not checked), and an artifact whose
    metadata is invalid, whose arrays are missing or misshapen, or that fails the checksum.
    """
    path = Path(path).absolute()
    meta = read_metadata(path)
    expected = {"model_name": model_name, "config_hash": config_hash, "head_dim": head_dim,
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
    if _checksum(arrays, _stored_fields(meta)) != meta.checksum:
        raise ValueError(f"calibration artifact {str(path)!r} is corrupted: its arrays and metadata "
                         f"do not match the checksum recorded at save time")
    n, h, d = meta.num_layers, meta.kv_heads, meta.head_dim
    shapes = {**dict.fromkeys(("rot_k", "rot_v", "dual_k", "dual_v"), (n, h, d, d)),
              **dict.fromkeys(("eigenvalues_k", "eigenvalues_v", "k_shift"), (n, h, d)),
              **dict.fromkeys(("clip_k", "clip_v"), (n,))}
    for name, a in arrays.items():
        if a.shape != (want := shapes[name]):
            raise ValueError(f"calibration artifact {str(path)!r} is corrupted: {name}.shape={a.shape}, "
                             f"expected {want} from its metadata")
    orthogonal = lambda r, d: np.array_equal(r, d)
    return LayerParams.create(
        arrays["rot_k"], arrays["rot_v"], arrays["clip_k"], arrays["clip_v"],
        num_layers=meta.num_layers, kv_heads=meta.kv_heads, v_folded=v_folded,
        dual_k=None if orthogonal(arrays["rot_k"], arrays["dual_k"]) else arrays["dual_k"],
        dual_v=None if orthogonal(arrays["rot_v"], arrays["dual_v"]) else arrays["dual_v"],
        k_shift=arrays.get("k_shift"),
    ), meta


def load_for_model(path: str | Path, *, model_cfg, model_name: str | None = None,
                   v_folded: bool = False) -> tuple[LayerParams, ArtifactMetadata]:
    """(LayerParams [L_full, Hkv, D, D], metadata) for a decoder config (a dataclass with
    `head_dim` and `layer_types`): checks the config hash, head dim and that the artifact
    covers exactly the config's full-attention layers (see `load`)."""
    layers = tuple(i for i, t in enumerate(model_cfg.layer_types) if t == "full_attention")
    return load(path, model_name=model_name, config_hash=fingerprint(model_cfg),
                head_dim=model_cfg.head_dim, layers=layers, v_folded=v_folded)


def load_layer_params(path: str | Path, *, model_cfg, model_name: str | None = None,
                      v_folded: bool = False) -> LayerParams:
    """The LayerParams of `load_for_model`."""
    return load_for_model(path, model_cfg=model_cfg, model_name=model_name, v_folded=v_folded)[0]
