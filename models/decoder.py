"""One Flax NNX decoder for the Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2/3)
and Gemma 3, with config-driven variation (`ModelConfig`).

Each layer owns its weight arrays (`Block`) and the forward runs the layers one after
another. Two things make that the fast layout for serving (docs/serving.md §1): every
matmul reads its weight where it lies (a layer-stacked weight read through a slice inside
`lax.scan` is copied first), and every layer's KV cache is its own buffer, appended to in
place. Each layer is an inner `jax.jit` function, so JAX traces and lowers one layer of
each kind once, whatever the depth. The KV cache is never module state: it is an explicit
`KVState` argument and return value (see `kv_policy`).

Projection weights are stored as `x @ W` ([in, out]), a layer's q/k/v and gate/up weights
each joined into one matrix (`FUSED`); norm weights as the effective
multiplier (Gemma's `1 + w` already added). float32 weights multiply at HIGHEST precision
(the parity path); bf16 weights at the default (bf16 MMAs, float32 accumulation).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from oscar_jax import calibrate
from oscar_jax.models import kv_policy
from oscar_jax.models.config import LayerType, ModelConfig

Mode = Literal["forward", "step"]
PREFILL_CHUNK_TOKENS = 4096  # tokens per step of a prefill's token-wise work (projections, MLP)


def checkpoint_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Per-layer shapes of the checkpoint's tensors, in the decoder's [in, out] layout."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    shapes = {"attn_norm": (h,), "wq": (h, q), "wk": (h, kv), "wv": (h, kv), "wo": (q, h),
              "mlp_norm": (h,), "w_gate": (h, i), "w_up": (h, i), "w_down": (i, h)}
    if cfg.attention_bias:
        shapes.update(bq=(q,), bk=(kv,), bv=(kv,))
    if cfg.output_bias:
        shapes.update(bo=(h,))
    if cfg.qk_norm:
        shapes.update(q_norm=(d,), k_norm=(d,))
    if cfg.post_norms:
        shapes.update(post_attn_norm=(h,), post_mlp_norm=(h,))
    return shapes


# A layer's fused parameters and the checkpoint tensors each joins (`fuse`): one matmul reads
# the q/k/v weights and one the gate/up weights, so a decode step runs fewer, larger matmuls.
FUSED = {"w_qkv": ("wq", "wk", "wv"), "b_qkv": ("bq", "bk", "bv"), "w_gate_up": ("w_gate", "w_up")}


def layer_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Per-layer parameter shapes of `Block`: the checkpoint's, with `FUSED`'s parts joined."""
    shapes = checkpoint_param_shapes(cfg)
    for name, parts in FUSED.items():
        if parts[0] in shapes:
            *lead, _ = shapes[parts[0]]
            shapes[name] = (*lead, sum(shapes.pop(p)[-1] for p in parts))
    return shapes


def fuse(cfg: ModelConfig, name: str, parts):
    """The `FUSED` parameter `name` from its parts (numpy or jax arrays [..., out_p], joined on
    the last axis). q/k/v: grouped by KV head, [..., Hkv, G + 2, D] flattened (KV head j's G
    query heads, its k, its v), so a split of the last axis into whole groups (tensor parallel)
    keeps every query head with its KV head. Hkv is k's head count: cfg.num_kv_heads, or a
    multiple of it where a mesh repeats each KV head (`qkv_groups`). gate/up: interleaved,
    [..., I, 2] flattened."""
    xp = np if all(isinstance(p, np.ndarray) for p in parts) else jnp
    if name == "w_gate_up":
        return xp.stack(parts, axis=-1).reshape(*parts[0].shape[:-1], -1)
    q, k, v = parts
    hkv, d = k.shape[-1] // cfg.head_dim, cfg.head_dim
    grouped = [x.reshape(*x.shape[:-1], hkv, -1, d) for x in (q, k, v)]
    return xp.concatenate(grouped, axis=-2).reshape(*q.shape[:-1], -1)


def qkv_groups(cfg: ModelConfig, width: int) -> int:
    """The KV-head groups of a fused q/k/v of `width` output features, (Hq + 2 Hkv) D: the
    model's num_kv_heads, or more where tensor parallelism repeats each KV head on several
    devices (`parallel.qkv_layout`; each group then holds fewer query heads)."""
    return (width // cfg.head_dim - cfg.num_heads) // 2


def unfuse(cfg: ModelConfig, name: str, x) -> tuple:
    """Inverse of `fuse`: x [..., out] -> its parts in `FUSED[name]` order (also splits a fused
    matmul's outputs; k and v have `qkv_groups` heads)."""
    if name == "w_gate_up":
        pairs = x.reshape(*x.shape[:-1], -1, 2)
        return pairs[..., 0], pairs[..., 1]
    hkv, d = qkv_groups(cfg, x.shape[-1]), cfg.head_dim
    g = cfg.num_heads // hkv
    grouped = x.reshape(*x.shape[:-1], hkv, g + 2, d)
    flat = lambda a: a.reshape(*x.shape[:-1], -1)
    return flat(grouped[..., :g, :]), flat(grouped[..., g, :]), flat(grouped[..., g + 1, :])


class Block(nnx.Module):
    """One decoder layer's weights: parameter `name` has shape `layer_param_shapes(cfg)[name]`."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        for name, shape in layer_param_shapes(cfg).items():
            if name.endswith("norm"):
                value = jnp.ones(shape, dtype)
            elif name.startswith("b"):
                value = jnp.zeros(shape, dtype)
            else:
                value = (0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
            setattr(self, name, nnx.Param(value))

    def arrays(self) -> dict[str, jax.Array]:
        return {name: getattr(self, name)[...] for name in vars(self) if isinstance(getattr(self, name), nnx.Param)}


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x [..., N] normalised in float32 and scaled by weight [N]; returns x.dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half RoPE (transformers' layout). x [B, T, H, D], positions int32 [B, T]."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x.astype(jnp.float32) * cos + rotated * sin).astype(x.dtype)


def matmul(a: jax.Array, w: jax.Array) -> jax.Array:
    """a [..., K] @ w [K, N]: HIGHEST precision for float32 weights, the default for bf16."""
    return jnp.dot(a, w, precision=jax.lax.Precision.HIGHEST if w.dtype == jnp.float32 else None)


def prompt_attention_implementation(q: jax.Array, implementation: str = "auto") -> str:
    """"cudnn" (flash attention: no [T, T] scores) or "xla" for `causal_attention`. "auto"
    takes cuDNN on a GPU for bf16/fp16 queries of head dim <= 256 (a multiple of 8)."""
    if implementation not in ("auto", "cudnn", "xla"):
        raise ValueError(f"implementation={implementation!r}: expected 'auto', 'cudnn' or 'xla'")
    if implementation != "auto":
        return implementation
    d = q.shape[-1]
    fits = jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16) and d <= 256 and d % 8 == 0
    return "cudnn" if fits else "xla"


def causal_attention(q, k, v, lengths, *, softmax_scale: float, window: int | None,
                     implementation: str = "auto", query_block: int = 2048):
    """Full-precision attention over a whole (right-padded) prompt.

    q [B, T, Hq, D], k, v [B, T, Hkv, D], lengths int32 [B]: query t sees keys
    s <= t with s < lengths[b] (and t - s < window for sliding layers).
    Returns o [B, T, Hq, D]. "cudnn" runs cuDNN's flash attention. "xla" attends prompts
    longer than `query_block` one block of queries after another (`lax.map`), so scores
    take [B, Hq, query_block, S]: S = T keys for full layers, only the query_block + window
    - 1 it can see for sliding ones.
    """
    local = None if window is None else (window - 1, 0)
    if prompt_attention_implementation(q, implementation) == "cudnn":
        return jax.nn.dot_product_attention(q, k, v, scale=softmax_scale, is_causal=True,
                                            key_value_seq_lengths=lengths, local_window_size=local,
                                            implementation="cudnn")
    b, t, hq, d = q.shape
    if t <= query_block:
        return jax.nn.dot_product_attention(q, k, v, scale=softmax_scale, is_causal=True,
                                            key_value_seq_lengths=lengths, local_window_size=local)
    nb = -(-t // query_block)
    tail = nb * query_block - t
    qb = jnp.pad(q, ((0, 0), (0, tail), (0, 0), (0, 0)))
    qb = jnp.moveaxis(qb.reshape(b, nb, query_block, hq, d), 1, 0)  # [nb, B, blk, Hq, D]
    front = 0 if window is None else window - 1  # key index i holds position i - front
    span = t if window is None else query_block + window - 1
    pad_kv = lambda x: jnp.pad(x, ((0, 0), (front, 0 if window is None else tail), (0, 0), (0, 0)))
    k, v = pad_kv(k), pad_kv(v)

    def block(args):
        q_blk, q0 = args
        kb, vb = (x if window is None else jax.lax.dynamic_slice_in_dim(x, q0, span, axis=1) for x in (k, v))
        q_pos = q0 + jnp.arange(query_block)[:, None]
        k_pos = (0 if window is None else q0 - front) + jnp.arange(span)[None, :]
        mask = (k_pos <= q_pos) & (k_pos >= 0)
        if window is not None:
            mask &= q_pos - k_pos < window
        held = k_pos[None] < lengths[:, None, None]  # [B, 1, S]
        return jax.nn.dot_product_attention(q_blk, kb, vb, scale=softmax_scale,
                                            mask=(mask[None] & held)[:, None])

    o = jax.lax.map(block, (qb, jnp.arange(nb) * query_block))
    return jnp.moveaxis(o, 0, 1).reshape(b, nb * query_block, hq, d)[:, :t]


# ----------------------------------------------------------------------------
# One layer, split where its token-wise work meets attention


def project_qkv(cfg: ModelConfig, kind: LayerType, w: dict, x: jax.Array, positions: jax.Array):
    """Pre-norm, q/k/v projections (+ bias, qk-norm) and RoPE: x [B, T, H], positions [B, T]
    -> q [B, T, Hq, D], k, v [B, T, Hkv, D] (post-RoPE; Hkv: w_qkv's `qkv_groups`)."""
    b, t, _ = x.shape
    d, hq, hkv = cfg.head_dim, cfg.num_heads, qkv_groups(cfg, w["w_qkv"].shape[-1])
    h = rms_norm(x, w["attn_norm"], cfg.rms_eps)
    qkv = matmul(h, w["w_qkv"])
    if cfg.attention_bias:
        qkv = qkv + w["b_qkv"]
    q, k, v = unfuse(cfg, "w_qkv", qkv)
    q, k, v = q.reshape(b, t, hq, d), k.reshape(b, t, hkv, d), v.reshape(b, t, hkv, d)
    if cfg.qk_norm:
        q, k = rms_norm(q, w["q_norm"], cfg.rms_eps), rms_norm(k, w["k_norm"], cfg.rms_eps)
    inv_freq = jnp.asarray(cfg.inv_freq(kind), jnp.float32)
    return rope(q, positions, inv_freq), rope(k, positions, inv_freq), v


def output_and_mlp(cfg: ModelConfig, w: dict, x: jax.Array, o: jax.Array) -> jax.Array:
    """Attention output projection, residual and MLP block: x [B, T, H], o [B, T, Hq, D] -> x."""
    b, t, _ = x.shape
    o = matmul(o.reshape(b, t, -1).astype(x.dtype), w["wo"])
    if cfg.output_bias:
        o = o + w["bo"]
    if cfg.post_norms:
        o = rms_norm(o, w["post_attn_norm"], cfg.rms_eps)
    x = x + o
    h = rms_norm(x, w["mlp_norm"], cfg.rms_eps)
    gate, up = unfuse(cfg, "w_gate_up", matmul(h, w["w_gate_up"]))
    act = jax.nn.silu(gate) if cfg.activation == "silu" else jax.nn.gelu(gate, approximate=True)
    m = matmul(act * up, w["w_down"])
    if cfg.post_norms:
        m = rms_norm(m, w["post_mlp_norm"], cfg.rms_eps)
    return x + m


def _window(cfg: ModelConfig, kind: LayerType) -> int | None:
    return cfg.sliding_window if kind == kv_policy.SLIDING else None


@functools.partial(jax.jit, static_argnames=("cfg", "kind", "capture", "kv_dtype", "exact_prefix"))
def _forward_layer(w, x, positions, lengths, *, cfg: ModelConfig, kind: LayerType, capture: bool,
                   kv_dtype, exact_prefix: int):
    """A layer of a full forward (no cache): x [B, T, H] -> (x, (q, k, v) or None)."""
    q, k, v = project_qkv(cfg, kind, w, x, positions)
    attend = lambda k, v: causal_attention(q, k, v, lengths, softmax_scale=cfg.softmax_scale,
                                           window=_window(cfg, kind))
    if kv_dtype is None:
        o = attend(k, v)
    else:
        o = attend(*(a.astype(kv_dtype).astype(a.dtype) for a in (k, v)))
        if exact_prefix:
            o = jnp.where((positions < exact_prefix)[:, :, None, None], attend(k, v), o)
    return output_and_mlp(cfg, w, x, o), ((q, k, v) if capture else None)


@functools.partial(jax.jit, static_argnames=("cfg", "kind"))
def _step_layer(w, x, positions, layer_kv, *, cfg: ModelConfig, kind: LayerType):
    """A layer of extend/decode: append the new tokens' k, v to `layer_kv` first, then attend.
    x [B, C, H], positions [B, C] -> (x, layer_kv)."""
    q, k, v = project_qkv(cfg, kind, w, x, positions)
    o, layer_kv = kv_policy.append_attend(layer_kv, q, k, v, softmax_scale=cfg.softmax_scale)
    return output_and_mlp(cfg, w, x, o), layer_kv


def _tokenwise(fn, inputs: tuple[jax.Array, ...], chunk: int):
    """fn over `inputs` ([B, T, ...] each) `chunk` tokens at a time; returns fn's outputs
    ([B, T, ...] each, a tuple, or one array). Token-wise work only (nothing mixes tokens),
    so peak memory follows the chunk, not T."""
    t = inputs[0].shape[1]
    if t <= chunk:
        return fn(*inputs)
    n = -(-t // chunk)
    padded = tuple(jnp.pad(a, [(0, 0), (0, n * chunk - t)] + [(0, 0)] * (a.ndim - 2)) for a in inputs)
    piece = lambda i: tuple(jax.lax.dynamic_slice_in_dim(a, i * chunk, chunk, axis=1) for a in padded)
    shapes = jax.eval_shape(fn, *piece(0))
    outs = jax.tree.map(lambda s: jnp.zeros((s.shape[0], n * chunk, *s.shape[2:]), s.dtype), shapes)

    def body(i, outs):
        return jax.tree.map(lambda o, y: jax.lax.dynamic_update_slice_in_dim(o, y, i * chunk, axis=1),
                            outs, fn(*piece(i)))

    outs = jax.lax.fori_loop(0, n, body, outs)
    return jax.tree.map(lambda o: o[:, :t], outs)


@functools.partial(jax.jit, static_argnames=("cfg", "kind", "chunk", "attention"),
                   donate_argnames=("x", "layer_kv"))
def prefill_layer(w, x, lengths, layer_kv, *, cfg: ModelConfig, kind: LayerType, chunk: int,
                  attention: str = "auto"):
    """One layer of a prefill: x [B, T, H] (right-padded prompts, lengths int32 [B]) -> (x, layer_kv
    holding the prompts' k, v). Projections and MLP run `chunk` tokens at a time; attention is
    full precision over the whole prompt (`causal_attention`, flash attention on a GPU); the
    layer's k, v go into its cache before the next layer runs. x and layer_kv are donated."""
    b, t, _ = x.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    q, k, v = _tokenwise(functools.partial(project_qkv, cfg, kind, w), (x, positions), chunk)
    # In the basis of the layer's attention outputs (`fold_values`).
    o = causal_attention(q, k, kv_policy.values_in_output_basis(layer_kv, v), lengths,
                         softmax_scale=cfg.softmax_scale, window=_window(cfg, kind), implementation=attention)
    layer_kv = kv_policy.write_prompt(layer_kv, k, v, lengths)
    return _tokenwise(functools.partial(output_and_mlp, cfg, w), (x, o), chunk), layer_kv


@dataclasses.dataclass(frozen=True)
class Captured:
    """Per-layer activations of a forward, layer-stacked: q [L, B, T, Hq, D],
    k, v [L, B, T, Hkv, D], post-RoPE (and post qk-norm), in the model's basis."""

    q: jax.Array
    k: jax.Array
    v: jax.Array


jax.tree_util.register_dataclass(Captured, data_fields=["q", "k", "v"], meta_fields=[])


class Decoder(nnx.Module):
    """Token ids -> hidden states -> logits, with the KV cache passed explicitly.

    embed [V, H]; layers: one `Block` per layer; final_norm [H]; lm_head [H, V] or None (tied).
    values_folded: the full-attention layers' output projections hold R_Vᵀ (`fold_values`; the
    fingerprint of that rotation in folded_rotation).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        self.values_folded, self.folded_rotation = False, ""
        embed = 0.02 * jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size))
        self.embed = nnx.Param(embed.astype(dtype))
        self.layers = nnx.List([Block(cfg, rngs=rngs, dtype=dtype) for _ in range(cfg.num_layers)])
        self.final_norm = nnx.Param(jnp.ones((cfg.hidden_size,), dtype))
        self.lm_head = None if cfg.tie_embeddings else nnx.Param(
            (0.02 * jax.random.normal(rngs.params(), (cfg.hidden_size, cfg.vocab_size))).astype(dtype))

    # ------------------------------------------------------------------ heads

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """tokens int32 [B, T] -> hidden [B, T, H] (Gemma multiplies by sqrt(H))."""
        x = jnp.take(self.embed[...], tokens, axis=0)
        if self.cfg.embed_scale:
            x = x * jnp.asarray(np.sqrt(self.cfg.hidden_size), jnp.float32).astype(x.dtype)
        return x

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Final norm + LM head: hidden [..., H] -> float32 logits [..., V]."""
        h = rms_norm(hidden, self.final_norm[...], self.cfg.rms_eps)
        w = self.embed[...].T if self.lm_head is None else self.lm_head[...]
        precision = jax.lax.Precision.HIGHEST if w.dtype == jnp.float32 else None
        return jnp.dot(h, w, preferred_element_type=jnp.float32, precision=precision)

    # ------------------------------------------------------------------ body

    def __call__(self, tokens: jax.Array, positions: jax.Array, *, mode: Mode = "forward",
                 kv: kv_policy.KVState | None = None, lengths: jax.Array | None = None,
                 capture_qkv: bool = False, kv_dtype=None, exact_prefix: int = 0):
        """Run the layers.

        tokens, positions: int32 [B, T]. mode:
          "forward": full-precision causal attention over the prompt (`lengths` [B]
             masks right padding; defaults to T); no cache.
          "step":    extend/decode: append the T new tokens to `kv` FIRST, then
             attend over the cache (T <= the policy's chunk limit).
        (Prefill, full-precision attention then a bulk cache write, is `generate.prefill`.)
        Returns (hidden [B, T, H], kv or None, Captured or None). With
        capture_qkv ("forward"), Captured holds every layer's post-RoPE q, k, v.
        kv_dtype ("forward" only): round each layer's post-RoPE k, v to this dtype
        before attention, as a dense cache of that dtype would store them; queries at
        positions < exact_prefix still see them unrounded, as they do in a prefill
        of that many tokens (full-precision attention, then the cache write).
        """
        cfg = self.cfg
        b, t = tokens.shape
        if mode not in ("forward", "step"):
            raise ValueError(f"mode={mode!r}: expected 'forward' or 'step' (prefill is generate.prefill)")
        if mode == "step" and kv is None:
            raise ValueError("mode='step' needs a KVState (kv=...)")
        if (kv_dtype is not None or capture_qkv) and mode != "forward":
            raise ValueError("kv_dtype and capture_qkv apply to mode='forward' only")
        self.check_output_basis(mode, kv)
        x = self.embed_tokens(tokens)
        if mode == "step":
            layers = list(kv.layers)
            for i, kind in enumerate(cfg.layer_types):
                x, layers[i] = _step_layer(self.layers[i].arrays(), x, positions, layers[i], cfg=cfg, kind=kind)
            return x, dataclasses.replace(kv, layers=tuple(layers), lengths=kv.lengths + t), None
        if lengths is None:
            lengths = jnp.full((b,), t, jnp.int32)
        caps = []
        for i, kind in enumerate(cfg.layer_types):
            x, cap = _forward_layer(self.layers[i].arrays(), x, positions, lengths, cfg=cfg, kind=kind,
                                    capture=capture_qkv, kv_dtype=kv_dtype, exact_prefix=exact_prefix)
            caps.append(cap)
        captured = Captured(*(jnp.stack(a) for a in zip(*caps))) if capture_qkv else None
        return x, None, captured

    def check_output_basis(self, mode: str, kv) -> None:
        """A folded decoder (`fold_values`) runs with a policy that returns its full-attention
        outputs in the R_V basis, an unfolded one with any other: the two must agree."""
        full = [] if kv is None else kv.of_kind(self.cfg, kv_policy.FULL)
        rotated = bool(full) and isinstance(full[0], kv_policy.OscarLayer) and full[0].params.v_folded
        if self.values_folded and mode == "forward":
            raise ValueError("mode='forward' on a decoder with R_V folded into its output projections "
                             "(fold_values): it runs prefill and step, with its folded OSCAR cache")
        if kv is not None and rotated != self.values_folded:
            raise ValueError(f"kv: the full-attention layers' params have v_folded={rotated}, the decoder "
                             f"values_folded={self.values_folded}: fold both or neither (fold_values)")


def forward_logits(model: Decoder, tokens: jax.Array, lengths: jax.Array | None = None,
                   kv_dtype=None, exact_prefix: int = 0) -> jax.Array:
    """Full-sequence forward: tokens int32 [B, T] -> float32 logits [B, T, V].
    kv_dtype, exact_prefix: the dense-cache oracle (K/V rounded after RoPE, except for
    queries in the first exact_prefix positions; see `Decoder.__call__`)."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    hidden, _, _ = model(tokens, positions, mode="forward", lengths=lengths, kv_dtype=kv_dtype,
                         exact_prefix=exact_prefix)
    return model.logits(hidden)


def fold_values(model: Decoder, policy) -> tuple[Decoder, object]:
    """(model, policy) -> the pair serving with R_Vᵀ folded into the full-attention layers'
    output projections (docs/method.md §3.2): attention then returns o_rot = o R_V and
    skips its back-rotation (on the GPU kernel path `decode_finish` only merges). A policy without
    OSCAR-cache layers (not a `kv_policy.QuantPolicy`, or a model with no full-attention
    layer) comes back unchanged, as does a pair already folded; a pair folded on one side only
    is refused, and so (for a model that is not float32) is a non-orthogonal R_V.

    The model's copy (its other arrays shared) has each full-attention layer's wo folded by
    `calibrate.fold_output_projection` with the policy's `LayerParams.output_rot` of that layer,
    and runs prefill and step with the folded policy only: in prefill those layers attend
    over values rotated by R_V (`kv_policy.values_in_output_basis`).
    """
    cfg = model.cfg
    policy_folded = getattr(policy, "values_folded", False)
    if model.values_folded or policy_folded:
        if model.values_folded and policy_folded:
            return model, policy
        raise ValueError(f"fold_values: model values_folded={model.values_folded}, policy values_folded="
                         f"{policy_folded}: expected an unfolded pair (or a folded one, returned as it is)")
    if not isinstance(policy, kv_policy.QuantPolicy) or not cfg.count(kv_policy.FULL):
        return model, policy
    policy = dataclasses.replace(policy, values_folded=True)
    params = policy.params(cfg)
    full = [i for i, kind in enumerate(cfg.layer_types) if kind == kv_policy.FULL]
    if params.dual_v is not None and model.layers[full[0]].wo.dtype != jnp.float32:
        raise ValueError(f"fold_values: the policy's R_V is not orthogonal and wo is {model.layers[full[0]].wo.dtype}: "
                         "attention's o_rot times a wo holding R_V^-1 would magnify its rounding; fold float32 "
                         "models only (or serve unfolded)")
    folded = nnx.clone(model)  # new variables over the same arrays
    for j, i in enumerate(full):
        folded.layers[i].wo[...] = calibrate.fold_output_projection(model.layers[i].wo[...], params.output_rot[j])
    folded.values_folded, folded.folded_rotation = True, rotation_digest(params)
    return folded, policy


def rotation_digest(params) -> str:
    """A fingerprint of `LayerParams.output_rot` (host side): what `fold_values` folded, which
    `generate.init_state` compares with the policy it is given."""
    return hashlib.sha256(np.asarray(params.output_rot, np.float32).tobytes()).hexdigest()[:16]


def abstract_decoder(cfg: ModelConfig, dtype=jnp.float32) -> Decoder:
    """The model's structure with ShapeDtypeStruct leaves (no memory), for loaders."""
    return nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0), dtype=dtype))
