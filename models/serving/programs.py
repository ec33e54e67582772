"""The serving engine's device programs (`engine.Engine` calls them): a round of decode steps of
every slot with per-row sampling, a prefilled row's insertion into a slot and its pages, and a slot's
copies to and from host memory for swapping; and the attention its prefill chunks run. Each is
jitted once per shape; those that take the engine's state donate it, so the pool is updated in
place."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from oscar_jax import paged
from oscar_jax.models import generate, kv_policy


def default_chunk_attention(policy, cfg, backend: str | None = None) -> str | None:
    """Prefill chunks' attention where the engine is not told: on a GPU, cuDNN over the
    dequantised cache for an OSCAR policy left to "auto" (3.2x the Triton kernel a 256-token
    chunk deep in a 32K prompt at the 8B shape, docs/paged.md §6); else None, the policy's."""
    oscar_auto = isinstance(policy, kv_policy.QuantPolicy) and policy.implementation == "auto"
    fits = cfg.head_dim <= 256 and cfg.head_dim % 8 == 0  # cuDNN's flash attention
    return "cudnn" if (backend or jax.default_backend()) == "gpu" and oscar_auto and fits else None


def sample_rows(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, seeds: jax.Array,
                counts: jax.Array) -> jax.Array:
    """`generate.sample` with per-row parameters: logits f32 [B, V], temperature, top_p f32 [B],
    seeds, counts int32 [B] (row b draws with fold_in(key(seeds[b]), counts[b])) -> int32 [B].
    A batch of greedy rows only takes their argmax, and only where some row samples with
    top_p < 1 is the vocabulary sorted (`lax.cond`: a row's token never depends on the others')."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled = temperature > 0

    def draw():
        scaled = logits.astype(jnp.float32) / jnp.where(sampled, temperature, 1.0)[:, None]
        nucleus = sampled & (top_p < 1)
        scaled = jax.lax.cond(jnp.any(nucleus), lambda s: jnp.where(nucleus[:, None], _top_p_only(s, top_p), s),
                              lambda s: s, scaled)
        keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, counts)
        return jnp.where(sampled, jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32), greedy)

    return jax.lax.cond(jnp.any(sampled), draw, lambda: greedy)


def _top_p_only(scaled: jax.Array, top_p: jax.Array) -> jax.Array:
    """scaled f32 [B, V] with every token outside row b's top_p nucleus at -inf."""
    desc = jnp.sort(scaled, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    threshold = jnp.min(jnp.where(mass_before < top_p[:, None], desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def _with_tables(state: kv_policy.KVState, tables: jax.Array) -> kv_policy.KVState:
    def put(layer):
        if isinstance(layer, kv_policy.PagedLayer):
            return dataclasses.replace(layer, cache=dataclasses.replace(layer.cache, block_table=tables))
        return layer
    return dataclasses.replace(state, layers=tuple(put(layer) for layer in state.layers))


def _with_lengths(state: kv_policy.KVState, lengths: jax.Array) -> kv_policy.KVState:
    """`state` holding `lengths` int32 [B] tokens per row, in every layer's cache (each keeps
    its own copy of the state's lengths)."""
    def put(layer):
        if isinstance(layer, kv_policy.PagedLayer):
            return dataclasses.replace(layer, cache=dataclasses.replace(layer.cache, lengths=lengths))
        return dataclasses.replace(layer, lengths=lengths)
    return kv_policy.KVState(tuple(put(layer) for layer in state.layers), lengths)


@functools.partial(jax.jit, donate_argnames=("state",), static_argnames=("most",))
def decode(model, state, tables, tokens, live, temperature, top_p, seeds, counts, steps, *, most: int = 1):
    """`steps` (int32 scalar, 1..most; traced: one program for every count) decode steps of every
    slot, each step's tokens fed to the next: tokens int32 [B] enter the cache first ->
    (out int32 [most, B]: step i's tokens in row i, rows >= steps zero; state). Step i samples
    with counts + i. Before every step the rows not `live` (bool [B]: idle, prefilling or
    swapped-out slots) are emptied, so such a row attends to its one new token, not to the
    history a finished sequence left there. The caller holds the pages of `steps` more tokens
    for every live row (`Scheduler.ahead`)."""
    state = _with_tables(state, tables)

    def step(i, carry):
        tok, out, state = carry
        state = _with_lengths(state, jnp.where(live, state.lengths, 0))
        logits, state = generate._step_logits(model, state, tok[:, None])
        nxt = sample_rows(logits[:, 0], temperature, top_p, seeds, counts + i)
        return nxt, out.at[i].set(nxt), state

    out = jnp.zeros((most, tokens.shape[0]), jnp.int32)
    _, out, state = jax.lax.fori_loop(0, jnp.minimum(steps, most), step, (tokens, out, state))
    return out, state


sample = jax.jit(sample_rows)


@functools.partial(jax.jit, donate_argnames=("state",))
def insert(state, part, slot, tables, keep):
    """Put the one-row prefilled state `part` into slot `slot` (its pages: `tables`' row; the
    first `keep` are shared prefix pages, left unwritten)."""
    state = _with_tables(state, tables)

    def put(layer, row):
        if isinstance(layer, kv_policy.PagedLayer):
            return dataclasses.replace(layer, cache=paged.insert(layer.cache, slot[None], row.cache, keep[None]))
        leaves, treedef = jax.tree.flatten(layer)  # row's static spec says batch 1: pair the leaves
        return treedef.unflatten([jax.lax.dynamic_update_slice(x, r, (slot,) + (0,) * (x.ndim - 1))
                                  for x, r in zip(leaves, jax.tree.leaves(row))])

    layers = tuple(put(layer, row) for layer, row in zip(state.layers, part.layers))
    return kv_policy.KVState(layers, state.lengths.at[slot].set(part.lengths[0]))


@jax.jit
def read_slot(state, slot, ids):
    """A slot's rows of every layer (and its pages `ids` of the paged ones), to swap out."""
    def read(layer):
        if isinstance(layer, kv_policy.PagedLayer):
            return paged.read_slot(layer.cache, slot, ids)
        return jax.tree.map(lambda x: x[slot], layer)
    return tuple(read(layer) for layer in state.layers), state.lengths[slot]


@functools.partial(jax.jit, donate_argnames=("state",))
def write_slot(state, saved, slot, ids, tables):
    """`read_slot`'s copy back into slot `slot` and pages `ids` (padding ids < 0 skipped)."""
    rows, length = saved
    state = _with_tables(state, tables)

    def write(layer, row):
        if isinstance(layer, kv_policy.PagedLayer):
            return dataclasses.replace(layer, cache=paged.write_slot(layer.cache, slot, ids, row))
        return jax.tree.map(lambda x, r: x.at[slot].set(r), layer, row)

    layers = tuple(write(layer, row) for layer, row in zip(state.layers, rows))
    return kv_policy.KVState(layers, state.lengths.at[slot].set(length))
