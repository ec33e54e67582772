"""Prefill, extend and a jitted decode loop over any KV policy.

- `prefill`: full-precision causal attention over the (right-padded) prompts,
  then one bulk write of every layer's k, v into the cache.
- `extend`: C teacher-forced tokens per sequence through the cache
  (append-then-attend; C <= the policy's chunk limit) -> logits for all C.
- `decode_step` / `decode`: one token, or a `lax.while_loop` of tokens, with
  greedy or temperature/top-p sampling from an explicit PRNG key; the cache is
  donated and nothing returns to the host until the loop ends.
All take the `Decoder` as a pytree argument, so the same compiled code serves
every model of one architecture.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from oscar_jax.models import kv_policy
from oscar_jax.models.decoder import Decoder, rotation_digest

NO_TOKEN = -1  # filler after a sequence stopped


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy (argmax); otherwise softmax(logits / temperature)
    restricted to the smallest set of top tokens whose mass reaches top_p."""

    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"Sampling.temperature={self.temperature!r}: expected >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"Sampling.top_p={self.top_p!r}: expected in (0, 1]")


def sample(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """logits float32 [B, V] -> token ids int32 [B]."""
    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits.astype(jnp.float32) / sampling.temperature
    if sampling.top_p < 1:
        desc = jnp.sort(scaled, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(desc, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        kept = jnp.where(mass_before < sampling.top_p, desc, jnp.inf)
        threshold = jnp.min(kept, axis=-1, keepdims=True)
        scaled = jnp.where(scaled >= threshold, scaled, -jnp.inf)
    return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)


def init_state(model: Decoder, policy, batch: int, max_len: int, chunk: int = 1) -> kv_policy.KVState:
    """An empty KV state of `policy` for `batch` sequences of up to `max_len` tokens,
    with extend chunks of up to `chunk` tokens."""
    if batch < 1 or max_len < 1 or chunk < 1:
        raise ValueError(f"batch={batch}, max_len={max_len}, chunk={chunk}: expected positive ints")
    policy_folded = getattr(policy, "values_folded", False)
    if policy_folded != model.values_folded or (
            policy_folded and rotation_digest(policy.params(model.cfg)) != model.folded_rotation):
        raise ValueError(f"policy {policy.name!r} (values_folded={policy_folded}) and a model with "
                         f"values_folded={model.values_folded}: a folded model serves with the policy that "
                         "decoder.fold_values returned with it (the R_V in its output projections) only")
    return policy.init(model.cfg, batch, max_len, chunk)


@functools.partial(jax.jit, donate_argnames=("kv",))
def _prefill(model: Decoder, kv, tokens, lengths):
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    with jax.named_scope("prefill"):
        hidden, kv, _ = model(tokens, positions, mode="prefill", kv=kv, lengths=lengths)
    last = hidden[jnp.arange(b), lengths - 1]
    return model.logits(last), kv


def prefill(model: Decoder, kv: kv_policy.KVState, tokens, lengths) -> tuple[jax.Array, kv_policy.KVState]:
    """tokens int32 [B, T] right-padded, lengths int32 [B] in [1, T] ->
    (float32 logits [B, V] of each prompt's last token, kv holding the prompts). kv is donated."""
    tokens = jnp.asarray(tokens, jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    b = kv.lengths.shape[0]
    if tokens.ndim != 2 or tokens.shape[0] != b:
        raise ValueError(f"tokens.shape={tokens.shape}: expected [B={b}, T]")
    n = np.asarray(lengths)
    if n.shape != (b,) or n.min() < 1 or n.max() > tokens.shape[1]:
        raise ValueError(f"lengths={n.tolist()}: expected [B={b}] ints in [1, T={tokens.shape[1]}]")
    _check_vocab(model, tokens)
    kv_policy.check_fits(kv, n)
    return _prefill(model, kv, tokens, lengths)


def _step_logits(model: Decoder, kv, tokens):
    """tokens [B, C] at positions kv.lengths + c -> (logits [B, C, V], kv)."""
    positions = kv.lengths[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    hidden, kv, _ = model(tokens, positions, mode="step", kv=kv)
    return model.logits(hidden), kv


_extend = jax.jit(_step_logits, donate_argnames=("kv",))


def extend(model: Decoder, kv: kv_policy.KVState, tokens) -> tuple[jax.Array, kv_policy.KVState]:
    """Teacher-forced chunk: tokens int32 [B, C] -> (float32 logits [B, C, V], kv). kv is donated."""
    tokens = jnp.asarray(tokens, jnp.int32)
    b = kv.lengths.shape[0]
    if tokens.ndim != 2 or tokens.shape[0] != b:
        raise ValueError(f"tokens.shape={tokens.shape}: expected [B={b}, C]")
    _check_vocab(model, tokens)
    kv_policy.check_fits(kv, np.asarray(kv.lengths) + tokens.shape[1])
    return _extend(model, kv, tokens)


@functools.partial(jax.jit, donate_argnames=("kv",), static_argnames=("sampling",))
def decode_step(model: Decoder, kv, tokens, key, sampling: Sampling = Sampling()):
    """One decode step: tokens int32 [B] enter the cache; returns (next int32 [B], logits [B, V], kv).

    No host check per step: past `kv_policy.capacity` a dense cache drops the token and
    an OSCAR cache flags `overflow`; `decode` checks the whole loop up front."""
    with jax.named_scope("decode_step"):
        logits, kv = _step_logits(model, kv, tokens[:, None])
    return sample(logits[:, 0], key, sampling), logits[:, 0], kv


@functools.partial(jax.jit, donate_argnames=("kv",), static_argnames=("max_new_tokens", "sampling"))
def _decode(model: Decoder, kv, first, key, eos, max_new_tokens: int, sampling: Sampling):
    b = first.shape[0]
    out = jnp.full((b, max_new_tokens), NO_TOKEN, jnp.int32).at[:, 0].set(first)
    done = jnp.isin(first, eos)
    count = jnp.ones((b,), jnp.int32)

    def cond(s):
        i, _, _, _, _, done, _ = s
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(s):
        i, tok, kv, key, out, done, count = s
        key, sub = jax.random.split(key)
        with jax.named_scope("decode_step"):
            logits, kv = _step_logits(model, kv, tok[:, None])
        nxt = sample(logits[:, 0], sub, sampling)
        out = out.at[:, i].set(jnp.where(done, NO_TOKEN, nxt))
        count = count + (~done).astype(jnp.int32)
        done = done | jnp.isin(nxt, eos)
        return i + 1, nxt, kv, key, out, done, count

    _, _, kv, _, out, _, count = jax.lax.while_loop(cond, body, (1, first, kv, key, out, done, count))
    return out, count, kv


def decode(model: Decoder, kv: kv_policy.KVState, first, key, *, max_new_tokens: int,
           sampling: Sampling = Sampling(), eos_ids: Sequence[int] = ()):
    """Generate up to `max_new_tokens` tokens per sequence in one compiled loop.

    first int32 [B]: the first new token (sampled from prefill's logits); it is
    fed to the cache, and so on. Stops per sequence after an EOS id, globally
    when all stopped. Returns (tokens int32 [B, max_new_tokens], `first` in
    column 0, NO_TOKEN after a stop; count int32 [B] tokens generated incl. EOS; kv).
    """
    first = jnp.asarray(first, jnp.int32)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: expected >= 1")
    if first.shape != kv.lengths.shape:
        raise ValueError(f"first.shape={first.shape}: expected [B={kv.lengths.shape[0]}]")
    kv_policy.check_fits(kv, np.asarray(kv.lengths) + max_new_tokens - 1)
    return _decode(model, kv, first, key, _eos_array(eos_ids), max_new_tokens, sampling)


def _eos_array(eos_ids: Sequence[int]) -> jax.Array:
    """EOS ids as a traced int32 [E] array (E >= 1), so new EOS sets do not recompile."""
    return jnp.asarray(tuple(int(e) for e in eos_ids) or (NO_TOKEN,), jnp.int32)


def _check_vocab(model: Decoder, tokens: jax.Array) -> None:
    t = np.asarray(tokens)
    if t.size and (t.min() < 0 or t.max() >= model.cfg.vocab_size):
        raise ValueError(f"token ids must lie in [0, vocab_size={model.cfg.vocab_size}); "
                         f"got min {t.min()}, max {t.max()}")


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Ragged prompts -> (tokens int32 [B, T_max] right-padded, lengths int32 [B])."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts: expected a non-empty list of non-empty token lists")
    lengths = np.array([len(p) for p in prompts], np.int32)
    tokens = np.full((len(prompts), lengths.max()), pad_id, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    return tokens, lengths


@dataclasses.dataclass(frozen=True)
class Generation:
    """tokens: per prompt, the new token ids (through EOS); kv: the final KV state;
    seconds: wall times of "compile", "prefill" and "decode" (compile excluded from the others)."""

    tokens: list[list[int]]
    kv: kv_policy.KVState
    seconds: dict[str, float]

    @property
    def decode_tokens_per_s(self) -> float:
        n = sum(len(t) for t in self.tokens)
        return n / max(self.seconds["decode"], 1e-9)


def generate(model: Decoder, policy, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             sampling: Sampling = Sampling(), key: jax.Array | None = None,
             eos_ids: Sequence[int] | None = None) -> Generation:
    """Prefill ragged `prompts` (token id lists), then decode up to `max_new_tokens` each."""
    tokens, lengths = pad_prompts(prompts)
    eos = tuple(model.cfg.eos_token_ids if eos_ids is None else eos_ids)
    key = jax.random.key(0) if key is None else key
    max_len = int(lengths.max()) + max_new_tokens
    kv = init_state(model, policy, len(prompts), max_len)
    prefill_key, decode_key = jax.random.split(key)
    t0 = time.perf_counter()
    prefill_c = _prefill.lower(model, kv, tokens, lengths).compile()
    kv_after = jax.eval_shape(lambda *a: _prefill(*a)[1], model, kv, tokens, lengths)
    first_abs = jax.ShapeDtypeStruct((len(prompts),), jnp.int32)
    eos_arr = _eos_array(eos)
    decode_c = _decode.lower(model, kv_after, first_abs, decode_key, eos_arr, max_new_tokens, sampling).compile()
    t1 = time.perf_counter()
    logits, kv = prefill_c(model, kv, tokens, lengths)
    first = sample(logits, prefill_key, sampling)
    first.block_until_ready()
    t2 = time.perf_counter()
    out, count, kv = decode_c(model, kv, first, decode_key, eos_arr)
    out = np.asarray(out)
    t3 = time.perf_counter()
    new = [out[i, :c].tolist() for i, c in enumerate(np.asarray(count))]
    return Generation(new, kv, {"compile": t1 - t0, "prefill": t2 - t1, "decode": t3 - t2})
