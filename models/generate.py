"""Prefill, extend and a jitted decode loop over any KV policy.

- `prefill`: layer by layer, full-precision causal attention over the (right-padded)
  prompts (flash attention on a GPU), then a bulk write of that layer's k, v into its
  cache; projections and MLP in token chunks, so memory follows one layer, not the model.
- `extend`: C teacher-forced tokens per sequence through the cache
  (`attention.append_attend`'s rule, any C) -> logits for all C.
- `decode_step` / `decode`: one token, or a `lax.while_loop` of tokens, with
  greedy or temperature/top-p sampling from an explicit PRNG key; the cache is
  donated and updated in place, and the host sees the loop only between segments.
All take the `Decoder` as a pytree argument, so the same compiled code serves
every model of one architecture.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from numbers import Integral
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from oscar_jax import sharding
from oscar_jax.models import kv_policy, parallel
from oscar_jax.models.decoder import PREFILL_CHUNK_TOKENS, Decoder, prefill_layer, qkv_groups, rotation_digest

NO_TOKEN = -1  # filler after a sequence stopped


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy (argmax); otherwise softmax(logits / temperature)
    restricted to the smallest set of top tokens whose mass reaches top_p."""

    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self):
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"Sampling.temperature={self.temperature!r}: expected a finite value >= 0")
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


def init_state(model: Decoder, policy, batch: int, max_len: int, chunk: int = 1,
               mesh: jax.sharding.Mesh | None = None) -> kv_policy.KVState:
    """An empty KV state of `policy` for `batch` sequences of up to `max_len` tokens,
    with extend chunks of up to `chunk` tokens; with `mesh`, created in its shards there
    (`kv_policy.init_on_mesh`; a `seq` axis may round the capacity up)."""
    if batch < 1 or max_len < 1 or chunk < 1:
        raise ValueError(f"batch={batch}, max_len={max_len}, chunk={chunk}: expected positive ints")
    policy_folded = getattr(policy, "values_folded", False)
    if policy_folded != model.values_folded or (
            policy_folded and rotation_digest(policy.params(model.cfg)) != model.folded_rotation):
        raise ValueError(f"policy {policy.name!r} (values_folded={policy_folded}) and a model with "
                         f"values_folded={model.values_folded}: a folded model serves with the policy that "
                         "decoder.fold_values returned with it (the R_V in its output projections) only")
    groups = qkv_groups(model.cfg, model.layers[0].w_qkv.shape[-1])
    if groups != parallel.kv_groups(model.cfg, mesh):
        raise ValueError(f"model: its q/k/v are laid out in {groups} KV-head groups, a state on mesh="
                         f"{None if mesh is None else dict(mesh.shape)} takes {parallel.kv_groups(model.cfg, mesh)}: "
                         "place the model with parallel.shard(model, mesh) on the mesh its state is made for")
    if mesh is not None:
        return kv_policy.init_on_mesh(policy, model.cfg, batch, max_len, chunk, mesh)
    return policy.init(model.cfg, batch, max_len, chunk)


@jax.jit
def _embed(model: Decoder, tokens):
    return model.embed_tokens(tokens)


@jax.jit
def _last_logits(model: Decoder, hidden, lengths):
    """hidden [B, T, H] -> float32 logits [B, V] of each row's last held position."""
    return model.logits(hidden[jnp.arange(hidden.shape[0]), lengths - 1])


def _prefill_args(model: Decoder, kv, i: int, x, lengths, chunk_tokens: int, attention: str):
    """(args, static kwargs) of layer i's `prefill_layer` call."""
    cfg = model.cfg
    kwargs = dict(cfg=cfg, kind=cfg.layer_types[i], chunk=max(1, chunk_tokens // x.shape[0]), attention=attention)
    return (model.layers[i].arrays(), x, lengths, kv.layers[i]), kwargs


def compile_prefill(model: Decoder, kv: kv_policy.KVState, tokens, lengths, *,
                    chunk_tokens: int = PREFILL_CHUNK_TOKENS, attention: str = "auto") -> dict:
    """Compile `prefill`'s layer programs ahead of time for these shapes (one per distinct
    layer signature): pass the result as `prefill(..., programs=...)`."""
    b, t = np.shape(tokens)
    x = jax.ShapeDtypeStruct((b, t, model.cfg.hidden_size), model.embed.dtype)
    programs = {}
    for i in range(model.cfg.num_layers):
        args, kwargs = _prefill_args(model, kv, i, x, jnp.asarray(lengths, jnp.int32), chunk_tokens, attention)
        key = (kwargs["kind"], jax.tree.structure(args[3]))
        if key not in programs:
            programs[key] = prefill_layer.lower(*args, **kwargs).compile()
    return programs


def prefill(model: Decoder, kv: kv_policy.KVState, tokens, lengths, *, chunk_tokens: int = PREFILL_CHUNK_TOKENS,
            attention: str = "auto", programs: dict | None = None) -> tuple[jax.Array, kv_policy.KVState]:
    """tokens int32 [B, T] right-padded, lengths int32 [B] in [1, T] ->
    (float32 logits [B, V] of each prompt's last token, kv holding the prompts). kv is donated.

    Layer by layer (`decoder.prefill_layer`): full-precision attention over the whole prompt
    (`attention`: "auto" is cuDNN's flash attention on a GPU, see `causal_attention`), each
    layer's k, v written into its cache before the next layer runs, projections and MLP
    `chunk_tokens` tokens (over the batch) at a time. Peak memory: weights + cache + one
    layer's prompt q, k, v and output + one chunk's activations. programs: from
    `compile_prefill` (else each layer program compiles on first use)."""
    b = kv.lengths.shape[0]
    t, n = _ints(tokens, "tokens"), _ints(lengths, "lengths")
    if t.ndim != 2 or t.shape[0] != b:
        raise ValueError(f"tokens.shape={t.shape}: expected [B={b}, T]")
    if n.shape != (b,) or n.min() < 1 or n.max() > t.shape[1]:
        raise ValueError(f"lengths={n.tolist()}: expected [B={b}] ints in [1, T={t.shape[1]}]")
    _check_vocab(model, t)
    tokens, lengths = jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths, jnp.int32)
    kv_policy.check_fits(kv, n)
    model.check_output_basis("prefill", kv)
    x = _embed(model, tokens)
    layers = list(kv.layers)
    on_mesh = isinstance(getattr(kv.lengths, "sharding", None), jax.sharding.NamedSharding)
    for i in range(model.cfg.num_layers):
        args, kwargs = _prefill_args(model, kv, i, x, lengths, chunk_tokens, attention)
        program = None if programs is None else programs.get((kwargs["kind"], jax.tree.structure(args[3])))
        shardings = jax.tree.map(lambda a: a.sharding, layers[i]) if on_mesh else None
        x, layers[i] = program(*args) if program is not None else prefill_layer(*args, **kwargs)
        if on_mesh:  # the state keeps its layout (the decode program's), whatever the prefill's partitioner chose
            layers[i] = jax.device_put(layers[i], shardings)
    if on_mesh:
        lengths = jax.device_put(lengths, kv.lengths.sharding)
    return _last_logits(model, x, lengths), kv_policy.KVState(tuple(layers), lengths)


def _step_logits(model: Decoder, kv, tokens):
    """tokens [B, C] at positions kv.lengths + c -> (logits [B, C, V], kv)."""
    positions = kv.lengths[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    hidden, kv, _ = model(tokens, positions, mode="step", kv=kv)
    return model.logits(hidden), kv


_extend = jax.jit(_step_logits, donate_argnames=("kv",))


def extend(model: Decoder, kv: kv_policy.KVState, tokens) -> tuple[jax.Array, kv_policy.KVState]:
    """Teacher-forced chunk: tokens int32 [B, C] -> (float32 logits [B, C, V], kv). kv is donated."""
    t = _ints(tokens, "tokens")
    b = kv.lengths.shape[0]
    if t.ndim != 2 or t.shape[0] != b or t.shape[1] < 1:
        raise ValueError(f"tokens.shape={t.shape}: expected [B={b}, C >= 1]")
    _check_vocab(model, t)
    tokens = jnp.asarray(tokens, jnp.int32)
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


DECODE_SEGMENT = 64  # steps per call of the compiled loop: the host sees Ctrl-C between calls


def _loop_start(first, eos, max_new_tokens: int):
    """The decode loop's state: (next column i, last token [B], tokens out [B, max_new_tokens],
    done [B], count [B]), with `first` in column 0."""
    b = first.shape[0]
    out = jnp.full((b, max_new_tokens), NO_TOKEN, jnp.int32).at[:, 0].set(first)
    return jnp.int32(1), first, out, jnp.isin(first, eos), jnp.ones((b,), jnp.int32)


@functools.partial(jax.jit, donate_argnames=("kv", "loop"), static_argnames=("sampling",))
def _decode(model: Decoder, kv, loop, key, stop, eos, sampling: Sampling):
    """Run the decode loop from its column i up to column `stop` (traced: every segment of a
    decode reuses one program) or until every row is done. Returns (loop, key, kv)."""

    def cond(s):
        (i, _, _, done, _), _, _ = s
        return (i < stop) & ~jnp.all(done)

    def body(s):
        (i, tok, out, done, count), kv, key = s
        key, sub = jax.random.split(key)
        with jax.named_scope("decode_step"):
            logits, kv = _step_logits(model, kv, tok[:, None])
        nxt = sample(logits[:, 0], sub, sampling)
        out = out.at[:, i].set(jnp.where(done, NO_TOKEN, nxt))
        count = count + (~done).astype(jnp.int32)
        return (i + 1, nxt, out, done | jnp.isin(nxt, eos), count), kv, key

    loop, kv, key = jax.lax.while_loop(cond, body, (loop, kv, key))
    return loop, key, kv


def compile_decode(model: Decoder, kv: kv_policy.KVState, key, *, max_new_tokens: int,
                   sampling: Sampling = Sampling(), eos_ids: Sequence[int] = ()):
    """`decode`'s loop program compiled ahead of time (pass it as `decode(..., program=...)`);
    kv may be abstract (`jax.eval_shape`)."""
    first = jax.ShapeDtypeStruct(kv.lengths.shape, jnp.int32)
    loop = jax.eval_shape(functools.partial(_loop_start, max_new_tokens=max_new_tokens), first, _eos_array(eos_ids))
    shardings = _loop_shardings(kv, loop)
    if shardings is not None:
        loop = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), loop, shardings)
    return _decode.lower(model, kv, loop, key, jnp.int32(0), _eos_array(eos_ids), sampling).compile()


def decode(model: Decoder, kv: kv_policy.KVState, first, key, *, max_new_tokens: int,
           sampling: Sampling = Sampling(), eos_ids: Sequence[int] = (), program=None,
           segment: int = DECODE_SEGMENT, on_segment: Callable[[int], bool | None] | None = None):
    """Generate up to `max_new_tokens` tokens per sequence in a compiled loop.

    first int32 [B]: the first new token (sampled from prefill's logits); it is
    fed to the cache, and so on. Stops per sequence after an EOS id, globally
    when all stopped. The loop runs `segment` steps per call (one program for every call),
    so the host can stop it between calls: on_segment(i) runs after each call has finished on
    the device, with the number of columns filled, and a true result ends the loop there (the
    tokens so far are returned). Returns (tokens int32
    [B, max_new_tokens], `first` in column 0, NO_TOKEN after a stop; count int32 [B]
    tokens generated incl. EOS; kv). kv is donated. program: from `compile_decode` (with this
    `sampling` and `eos_ids`).
    """
    first = jnp.asarray(first, jnp.int32)
    check_count(max_new_tokens, "max_new_tokens")
    if first.shape != kv.lengths.shape:
        raise ValueError(f"first.shape={first.shape}: expected [B={kv.lengths.shape[0]}]")
    if segment < 1:
        raise ValueError(f"segment={segment}: expected >= 1")
    kv_policy.check_fits(kv, np.asarray(kv.lengths) + max_new_tokens - 1)
    eos = _eos_array(eos_ids)
    run = functools.partial(_decode, sampling=sampling) if program is None else program
    loop = _loop_start(first, eos, max_new_tokens)
    shardings = _loop_shardings(kv, loop)
    i = 1
    while i < max_new_tokens:
        i = min(i + segment, max_new_tokens)
        if shardings is not None:  # the loop state as the program takes it (a local slice, no transfer)
            loop, key = jax.device_put((loop, key), (shardings, jax.sharding.NamedSharding(kv.lengths.sharding.mesh,
                                                                                         sharding.spec())))
        loop, key, kv = run(model, kv, loop, key, jnp.int32(i), eos)
        finished = bool(jnp.all(loop[3]))  # waits for the call
        if (on_segment is not None and on_segment(i)) or finished:
            break
    _, _, out, _, count = loop
    return out, count, kv


def _loop_shardings(kv: kv_policy.KVState, loop):
    """On a mesh (kv.lengths a NamedSharding): the decode loop state's shardings, its [B, ...]
    arrays split as kv.lengths is, so every segment's program takes what the last one returned;
    else None."""
    s = getattr(kv.lengths, "sharding", None)
    if not isinstance(s, jax.sharding.NamedSharding):
        return None
    batch = s.spec[0] if len(s.spec) else None
    return jax.tree.map(lambda x: jax.sharding.NamedSharding(s.mesh, sharding.spec(batch if x.ndim else None)), loop)


def _eos_array(eos_ids: Sequence[int]) -> jax.Array:
    """EOS ids as a traced int32 [E] array (E >= 1), so new EOS sets do not recompile."""
    return jnp.asarray(tuple(int(e) for e in eos_ids) or (NO_TOKEN,), jnp.int32)


def _ints(x, name: str) -> np.ndarray:
    """x as a host array of integers (its own dtype, before any int32 cast), or ValueError naming it."""
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise ValueError(f"{name}: expected integer token ids/counts, got dtype {a.dtype}")
    return a


def check_count(n, name: str) -> None:
    """ValueError naming `name` unless n is an int >= 1 (a bool is not)."""
    if not isinstance(n, Integral) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{name}={n!r}: expected an int >= 1")


def _check_vocab(model: Decoder, tokens: jax.Array) -> None:
    t = np.asarray(tokens)
    if t.size and (t.min() < 0 or t.max() >= model.cfg.vocab_size):
        raise ValueError(f"token ids must lie in [0, vocab_size={model.cfg.vocab_size}); "
                         f"got min {t.min()}, max {t.max()}")


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Ragged prompts -> (tokens int32 [B, T_max] right-padded, lengths int32 [B])."""
    if isinstance(prompts, (str, bytes)) or len(prompts) == 0 or any(
            isinstance(p, (str, bytes)) or not isinstance(p, Iterable) or len(p) == 0
            or not all(isinstance(t, Integral) for t in p) for p in prompts):
        raise ValueError("prompts: expected a non-empty list of non-empty lists of int token ids")
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
             eos_ids: Sequence[int] | None = None,
             on_segment: Callable[[int], bool | None] | None = None,
             mesh: jax.sharding.Mesh | None = None) -> Generation:
    """Prefill ragged `prompts` (token id lists), then decode up to `max_new_tokens` each
    (on_segment: as in `decode`, which may end the decoding early). mesh: the KV state's
    device mesh (`init_state`; the model's weights placed by `parallel.shard` or a loader)."""
    check_count(max_new_tokens, "max_new_tokens")
    tokens, lengths = pad_prompts(prompts)
    model.cfg.check_context(int(lengths.max()) + max_new_tokens, "the longest prompt + max_new_tokens")
    eos = tuple(model.cfg.eos_token_ids if eos_ids is None else eos_ids)
    key = jax.random.key(0) if key is None else key
    max_len = int(lengths.max()) + max_new_tokens
    kv = init_state(model, policy, len(prompts), max_len, mesh=mesh)
    prefill_key, decode_key = jax.random.split(key)
    t0 = time.perf_counter()
    prefill_programs = compile_prefill(model, kv, tokens, lengths)
    decode_program = compile_decode(model, kv, decode_key, max_new_tokens=max_new_tokens, sampling=sampling,
                                    eos_ids=eos)
    t1 = time.perf_counter()
    logits, kv = prefill(model, kv, tokens, lengths, programs=prefill_programs)
    first = sample(logits, prefill_key, sampling)
    first.block_until_ready()
    t2 = time.perf_counter()
    out, count, kv = decode(model, kv, first, decode_key, max_new_tokens=max_new_tokens, sampling=sampling,
                            eos_ids=eos, program=decode_program, on_segment=on_segment)
    out = np.asarray(out)
    t3 = time.perf_counter()
    new = [out[i, :c].tolist() for i, c in enumerate(np.asarray(count))]
    return Generation(new, kv, {"compile": t1 - t0, "prefill": t2 - t1, "decode": t3 - t2})
