"""Continuous batching over a paged KV pool (docs/paged.md §4).

`Engine(model, policy, slots=..., max_len=..., page_tokens=..., num_pages=...)` decodes up to
`slots` sequences together in one compiled program. Requests (`Request`: prompt ids, max_tokens,
temperature, top_p, seed, stop ids) are queued by `submit`, which refuses a request that could
never be held; `step` runs one round of `scheduler.Scheduler`'s events and then decode steps for
every running sequence; `run` steps until every request is done.

- OSCAR policies (`kv_policy.QuantPolicy`): the full-attention layers are `kv_policy.PagedLayer`s
  (one `oscar_jax.paged.PagedCache` each: per-slot sink and ring, one page pool, the same page
  ids in every layer), sliding-window layers a ring per slot; dense policies (bf16, fp8) keep
  their caches per slot (admission by slots only).
- Prefill: one prompt at a time, right-padded to a bucket length (powers of two), through
  `generate.prefill` into a one-row cache of the policy, then inserted into the request's slot
  and pages (`paged.insert`); its last logits give the first token. With `prefill_chunk=C`
  (any C; longer than the window, a chunk attends on cuDNN where `chunk_attention` is
  "cudnn", else in XLA) the prompt's first 1..C tokens are prefilled so and the rest enters
  in chunks of C through `generate.extend` (each chunk attends to its own tokens as written,
  bf16, and to the earlier chunks through the cache: `oscar_jax.attention.append_attend`),
  first come first served over the prefilling requests, before each round's decode steps
  (Decode rounds below); the row is inserted after its last chunk. Chunked, every prompt's
  one-row cache holds a slot's capacity and its first 1..C tokens are padded to C (one
  compiled shape each, whatever the prompt's length); `max_prefills` bounds the prompts
  prefilling at once (admission waits), and with it the memory their one-row caches take.
- Sampling: temperature, top_p and the seed are per-row arrays of the one compiled program (not
  static arguments); token i of a request draws with `fold_in(key(seed), i)`, so a request's
  tokens do not depend on what else runs beside it.
- Preemption: a sequence pushed out for pages is copied to host memory (its slot rows and pages)
  and copied back later bitwise, so a quantised cache's contents never change.
- Prefix cache (`prefix_cache=True`, docs/paged.md §5): a prompt longer than the first boundary
  m_1 is prefilled in fixed segments, its first 1..C tokens in one prefill (the program of
  prompts without it) and chunks of C up to m_1, then each further page's tokens
  (m_k = m_1 + (k - 1) * page_tokens) and the rest in extend chunks; its boundaries become
  entries (pool pages shared by reference count, snapshots of the one-row state), and a later
  prompt with the same tokens up to m_j starts from entry j's state instead of token 0. The
  segments do not depend on whether a boundary was a hit, so a request's tokens do not either.
  `save_prefix_cache` / `load_prefix_cache` keep it on disk (orbax).
- Decode rounds: one call of the decode program runs up to `decode_steps` steps, each feeding
  the tokens it sampled to the next (fewer where a sequence holding a slot reaches
  max_tokens). Before them a round prefills: the admissions' first prefills, then prompt
  chunks, first come first served, `chunks_per_step` for each step the round may run (past
  the first `chunks_per_step`, none once a prefill ended in the round). A round that
  prefilled decodes one step per `chunks_per_step` pieces it ran (a first prefill or a chunk
  is one piece; rounded up), so prefill and decode keep the shares one step a call gives
  them, and a prompt's first token waits on at most `chunks_per_step` chunks of other prompts.
  A client gets a round's tokens at once, after its chunks. A call's fixed host cost
  (dispatching a program over every weight and cache array) is spread over its steps. A
  sequence that meets a stop id inside a round decodes to the round's end into its own pages
  (the scheduler holds the pages of a whole round); those tokens are dropped.
- Compiled shapes: the decode program (one batch, any step count), one prefill of C tokens
  (unchunked: one per bucket, with an insert each), the extend chunks, the swap copies;
  `warm_up` compiles them all before the first request, and `compiles` counts the
  compilations JAX reports since the engine was made.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from oscar_jax import paged
from oscar_jax.models import generate, kv_policy
from oscar_jax.models.serving import prefix_cache as pc, programs
from oscar_jax.models.serving.request import Request, Result
from oscar_jax.models.serving.scheduler import Event, Scheduler, Sequence

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_COMPILES = [0]  # compilations JAX has reported since this module loaded


def _count_compile(event: str, duration: float, **kwargs) -> None:
    if event == _COMPILE_EVENT:
        _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


@dataclasses.dataclass
class _Fill:
    """A prompt on its way into its one-row state: `done` tokens in `part`, the extend chunks
    still to run (`pieces`, lengths in order), the boundaries to snapshot (`snap_at`: prompt
    length -> boundary k) and the (snapshot, rows) taken there (`taken`), the last logits."""

    part: kv_policy.KVState
    done: int
    pieces: list[int]
    logits: jax.Array | None = None
    snap_at: dict[int, int] = dataclasses.field(default_factory=dict)
    taken: dict[int, tuple] = dataclasses.field(default_factory=dict)


def _pages_for(spec, page_tokens: int, length: int) -> int:
    """Pool pages a sequence of `length` tokens holds (`paged.pages_for`)."""
    return int(paged.pages_for(length, spec, page_tokens))


class Engine:
    """Continuous batching of `Request`s through one decoder (module docstring).

    policy: a `kv_policy.QuantPolicy` (paged full-attention layers) or `DensePolicy`; slots: the
    compiled decode batch; max_len: tokens a slot holds at most (rounded up to whole pages);
    page_tokens, num_pages: the pool (OSCAR policies); min_bucket: the shortest prefill length;
    prefill_chunk, max_prefills: chunked prefill; chunks_per_step: prefill pieces per decode
    step (module docstring);
    prefix_cache: keep prompt prefixes (needs prefill_chunk dividing page_tokens; dense policies
    cut them every page_tokens too); prefix_cache_bytes: host memory its snapshots and dense
    rows may take before unreferenced entries are evicted; chunk_attention: the attention
    implementation of prefill's extend chunks (a policy implementation name; None:
    `programs.default_chunk_attention`); decode keeps the policy's either way; decode_steps: the
    most decode steps one call runs (`step`: one call's fixed cost is spread over them).
    """

    def __init__(self, model, policy, *, slots: int, max_len: int, page_tokens: int = 256,
                 num_pages: int | None = None, min_bucket: int = 16, prefill_chunk: int | None = None,
                 chunks_per_step: int = 1, max_prefills: int | None = None, prefix_cache: bool = False,
                 prefix_cache_bytes: int = 8 << 30, chunk_attention: str | None = None, decode_steps: int = 8):
        if model.values_folded:
            raise ValueError("Engine serves unfolded decoders (decoder.fold_values's pair is not supported yet)")
        cfg = model.cfg
        for name, value in (("slots", slots), ("max_len", max_len), ("page_tokens", page_tokens),
                            ("min_bucket", min_bucket), ("decode_steps", decode_steps)):
            generate.check_count(value, name)
        cfg.check_context(max_len, f"max_len={max_len}")
        self.model, self.policy, self.slots, self.decode_steps = model, policy, slots, decode_steps
        self.chunk_attention = chunk_attention or programs.default_chunk_attention(policy, cfg)
        self._part_policy = kv_policy.with_implementation(policy, self.chunk_attention)
        if (prefill_chunk is not None and prefill_chunk < 1) or chunks_per_step < 1:
            raise ValueError(f"prefill_chunk={prefill_chunk}, chunks_per_step={chunks_per_step}: expected >= 1")
        if max_prefills is not None and max_prefills < 1:
            raise ValueError(f"max_prefills={max_prefills}: expected >= 1 or None (no limit)")
        self.chunk, self.chunks_per_step, self.max_prefills = prefill_chunk, chunks_per_step, max_prefills
        self.paged = isinstance(policy, kv_policy.QuantPolicy) and cfg.count(kv_policy.FULL) > 0
        self.page_tokens = page_tokens
        if self.paged:
            spec = policy.cache_spec(cfg, slots, max_len, self._chunk)
            paged.check_page_tokens(spec, page_tokens)
            # At least one page: a pool of none cannot be made (max_len within the sink + window).
            pages_per_seq = max(1, int(paged.pages_for(spec.max_len, spec, page_tokens)))
            self.capacity = spec.sink + spec.window + pages_per_seq * page_tokens
            self.num_pages = num_pages if num_pages is not None else slots * pages_per_seq
            self._spec = dataclasses.replace(spec, max_len=self.capacity)
            self.tables = np.full((slots, pages_per_seq), paged.NO_PAGE, np.int32)
        else:
            self.capacity, self.num_pages, self._spec = max_len, 0, None
            self.tables = np.full((slots, 1), paged.NO_PAGE, np.int32)
        # A function, not a bound method: the scheduler holds it, and a method would keep the engine
        # (and its pool) alive in a reference cycle after the last name for it is dropped.
        self._pages_for = functools.partial(_pages_for, self._spec, page_tokens)
        powers = (1 << i for i in range(max(min_bucket - 1, 0).bit_length(), self.capacity.bit_length()))
        self.buckets = tuple(t for t in powers if t < self.capacity) + (self.capacity,)  # prefill lengths
        self._prefix_cache_bytes = prefix_cache_bytes if prefix_cache else None
        self._empty_parts: dict[int, kv_policy.KVState] = {}  # prefill rows -> an empty one-row state
        self.state = None  # `_reset` allocates it
        self._reset()
        self._compiles_at_start = _COMPILES[0]

    def _reset(self) -> None:
        """Empty the engine: no request, a fresh pool, scheduler and prefix cache, zeroed counters."""
        self.prefix = self._prefix_cache(self._prefix_cache_bytes) if self._prefix_cache_bytes is not None else None
        self.scheduler = Scheduler(self.slots, self.num_pages, self._pages_for, self.capacity, self.prefix,
                                   lookahead=self.decode_steps)
        self.tables[:] = paged.NO_PAGE
        self.state = None  # free the old pool before the new one is allocated
        self.state = self._init_state()
        self.requests: dict[int, Request] = {}
        self.results: dict[int, Result] = {}
        self._seqs: dict[int, Sequence] = {}
        self._next_token: dict[int, int] = {}
        self._swapped: dict[int, object] = {}
        self._prefilling: dict[int, _Fill] = {}
        self.pages_used: list[int] = []  # pages in use after each step
        self.preemptions = 0
        self.prompt_tokens = 0  # prompt tokens of the requests whose prefill started
        self.prefix_hit_tokens = 0  # of those, the tokens restored from the prefix cache (not prefilled)
        # Wall time of the steps' scheduling, swaps and prefill work, and of their decode steps
        # (with the tokens those generated): the decode phase's throughput apart from prefill.
        self.prefill_seconds = self.decode_seconds = 0.0
        self.decode_tokens = 0
        self.decode_step_count = 0  # decode steps run (a round of k steps counts k)
        # The round under way: its prefill pieces (first prefills, chunks), the prefills it ended.
        self._pieces_run = self._entered = 0

    def warm_up(self) -> int:
        """Compile every program serving runs (the decode program, the prefill (unchunked: per
        bucket), the extend chunks, the insert, the swap copies; with the prefix cache its
        snapshots and restores) by serving synthetic requests one at a time, then empty the
        engine again (`_reset`). Returns the compilations that took. ValueError once a request
        was submitted."""
        if self.requests:
            raise ValueError("warm_up runs before the first request is submitted")
        before = self.compiles
        lengths = self._warm_up_lengths()
        prompt = tuple(int(t) for t in np.random.default_rng(0).integers(0, self.model.cfg.vocab_size, max(lengths)))
        for n in lengths:
            self.submit(Request(prompt[:n], 2))
            self.run()
        saved = jax.device_get(programs.read_slot(self.state, 0, self._padded([])))
        self.state = programs.write_slot(self.state, saved, 0, self._padded([], -1), jnp.asarray(self.tables))
        self._reset()
        return self.compiles - before

    def _warm_up_lengths(self) -> list[int]:
        """Prompt lengths whose prefills use every compiled shape: one a prefill bucket (chunked:
        one head and one head + an extend chunk), and with the prefix cache one past its second
        boundary ending in C - 1 tokens, twice (the second a hit), and one more for each
        extend piece C - 1 tokens do not use (C not a power of two)."""
        fits = lambda n: n + 1 <= self.capacity
        if self.chunk is None:
            return sorted({min(b, self.capacity - 1) for b in self.buckets} - {0})
        lengths = [n for n in (1, self.chunk + 1) if fits(n)]
        if self.prefix is not None:
            start = self._first_bound + self.page_tokens
            used = set(self._pieces(self.chunk - 1))
            missed = [t for t in self._piece_sizes()[1:] if t not in used]
            lengths += [n for n in [start + self.chunk - 1] * 2 + [start + t for t in missed] if fits(n)]
        return lengths

    def _prefix_cache(self, host_bytes: int) -> pc.PrefixCache:
        if not (self.paged or isinstance(self.policy, kv_policy.DensePolicy)):
            raise ValueError(f"prefix_cache=True serves OSCAR (paged) and dense policies, not {self.policy.name!r}")
        if self.chunk is None or self.page_tokens % self.chunk:
            raise ValueError(f"prefix_cache=True needs prefill_chunk dividing page_tokens={self.page_tokens} "
                             f"(got prefill_chunk={self.chunk}): prompts are prefilled a page at a time")
        self._first_bound = self.page_tokens + (self._spec.sink + self._spec.window if self.paged else 0)
        self._prefix_head = (self._first_bound - 1) % self.chunk + 1  # m_1 = head + a whole number of chunks
        layout = {"page_tokens": self.page_tokens, "chunk": self.chunk, "capacity": self.capacity,
                  "first": self._first_bound, "head": self._prefix_head}
        return pc.PrefixCache(pc.salt(self.model, self.policy, layout), None, host_bytes)

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens restored from the prefix cache / prompt tokens prefilled or restored."""
        return self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def compiles(self) -> int:
        """Compilations (any program, this engine's or not) since the engine was made."""
        return _COMPILES[0] - self._compiles_at_start

    @property
    def _chunk(self) -> int:
        """The extend chunk the caches are laid out for (1 without chunked prefill)."""
        return self.chunk or 1

    def _init_state(self) -> kv_policy.KVState:
        cfg, policy = self.model.cfg, self.policy
        if not self.paged:
            return generate.init_state(self.model, policy, self.slots, self.capacity, self._chunk)
        params = policy.params(cfg)
        layers, j = [], 0
        for kind in cfg.layer_types:
            if kind == kv_policy.FULL:
                spec = policy.cache_spec(cfg, self.slots, self.capacity, self._chunk, j)
                layers.append(kv_policy.PagedLayer(paged.PagedCache.init(spec, self.page_tokens, self.num_pages),
                                                   jax.tree.map(jnp.copy, params.layer(j)), policy.implementation))
                j += 1
            else:
                layers.append(kv_policy.ring_layer(cfg, self.slots, self._chunk))
        return kv_policy.KVState(tuple(layers), jnp.zeros((self.slots,), jnp.int32))

    # ------------------------------------------------------------------ requests

    def submit(self, request: Request) -> int:
        """Queue `request`; returns its id. ValueError if it can never be held (the engine goes on)."""
        if not request.prompt or request.max_tokens < 1:
            raise ValueError(f"request with a prompt of {len(request.prompt)} tokens and max_tokens="
                             f"{request.max_tokens}: expected at least one of each")
        vocab = self.model.cfg.vocab_size
        if not all(0 <= t < vocab for t in request.prompt):
            raise ValueError(f"request prompt holds ids outside [0, vocab_size={vocab})")
        rid = len(self.requests)
        keys = self.prefix.keys(request.prompt, self.prefix_bounds(len(request.prompt))) if self.prefix else ()
        self._seqs[rid] = self.scheduler.submit(rid, len(request.prompt), request.max_tokens, keys)
        self.requests[rid] = request
        self.results[rid] = Result([])
        return rid

    def cancel(self, rid: int) -> None:
        """Stop request `rid` now (a client went away): its slot and pages are freed, its result
        keeps the tokens so far with finish "cancelled". A finished request is left as it is."""
        if rid not in self._seqs:
            raise ValueError(f"rid={rid!r}: no request of this engine has that id")
        seq, result = self._seqs[rid], self.results[rid]
        if result.finish is not None:
            return
        if seq.slot is not None:
            self.tables[seq.slot] = paged.NO_PAGE
        self.scheduler.cancel(seq)
        self._next_token.pop(rid, None)
        self._prefilling.pop(rid, None)
        self._swapped.pop(rid, None)
        result.finish = "cancelled"

    def done(self) -> bool:
        s = self.scheduler
        return not (s.waiting or s.running or s.swapped)

    def run(self) -> dict[int, Result]:
        """Step until every submitted request is done; the results by request id."""
        while not self.done():
            self.step()
        return self.results

    # ------------------------------------------------------------------ the prefix cache on disk

    def save_prefix_cache(self, path) -> int:
        """Write the prefix cache to the directory `path` (orbax; replaced if there): its entries'
        keys, pages, snapshots and rows. Returns the entries written."""
        if self.prefix is None:
            raise ValueError("save_prefix_cache: this engine has no prefix cache (prefix_cache=False)")
        entries = self.prefix.chains()
        pages = jax.device_get(pc.read_pages(self.state, jnp.asarray([e.page for e in entries], jnp.int32))) \
            if self.paged and entries else None
        pc.save(path, self.prefix.salt, entries, pages)
        return len(entries)

    def load_prefix_cache(self, path) -> int:
        """Fill this engine's empty prefix cache from `save_prefix_cache`'s directory `path`: as
        many entries as the free pages hold, the most recently used, all unreferenced. Returns
        the entries loaded. ValueError: no prefix cache here, requests taken already, or a cache
        saved for another model, weights, policy, calibration or engine layout."""
        if self.prefix is None:
            raise ValueError("load_prefix_cache: this engine has no prefix cache (prefix_cache=False)")
        if self.requests or self.prefix.entries:
            raise ValueError("load_prefix_cache: only into an engine that has taken no request yet")
        metas, arrays = pc.load(path, self.prefix.salt)
        first = max(0, len(metas) - self.scheduler.allocator.num_free) if self.paged else 0
        reachable: set[str] = set()
        for i in sorted(range(first, len(metas)), key=lambda i: metas[i]["depth"]):
            if metas[i]["parent"] is None or metas[i]["parent"] in reachable:
                reachable.add(metas[i]["key"])
        keep = [i for i in range(first, len(metas)) if metas[i]["key"] in reachable]
        pages: list = [None] * len(keep)
        if self.paged and keep:
            pages = self.scheduler.allocator.allocate(len(keep))
            self.state = pc.write_pages(self.state, jnp.asarray(pages, jnp.int32),
                                        jax.tree.map(lambda x: x[np.asarray(keep)], arrays["pages"]))
        for i, page in zip(keep, pages):
            m = metas[i]
            self.prefix.add(bytes.fromhex(m["key"]), bytes.fromhex(m["parent"]) if m["parent"] else None, m["depth"],
                            page, arrays.get("snapshots", {}).get(str(i)), arrays.get("rows", {}).get(str(i)), refs=0)
        return len(keep)

    # ------------------------------------------------------------------ one step

    def step(self) -> None:
        """One round: the scheduler's events (swaps, admissions with their first prefill, new
        pages), prompt chunks, then decode steps of every running sequence in one call (module
        docstring: up to `decode_steps`, one per `chunks_per_step` prefill pieces where the
        round prefilled, fewer where a sequence reaches max_tokens)."""
        start = time.perf_counter()
        self._pieces_run = self._entered = 0
        room = None if self.max_prefills is None else max(0, self.max_prefills - len(self._prefilling))
        for event in self.scheduler.schedule(admit=room):
            self._apply(event)
        # The round's most steps: every sequence holding a slot may decode in it (a prompt whose
        # prefill ends in it too; one of max_tokens 1 never does).
        most = min((max(1, self.scheduler.ahead(s)) for s in self.scheduler.running if s.slot is not None),
                   default=self.decode_steps)
        self._prefill_chunks(self.chunks_per_step * most)
        jax.block_until_ready([fill.part for fill in self._prefilling.values()])
        decode_start = time.perf_counter()
        self.prefill_seconds += decode_start - start
        running = self._running()  # with the sequences whose prefill ended this round
        if running:
            b = self.slots
            tokens, temperature, top_p = np.zeros(b, np.int32), np.zeros(b, np.float32), np.ones(b, np.float32)
            seeds, counts, live = np.zeros(b, np.int32), np.zeros(b, np.int32), np.zeros(b, bool)
            for seq in running:
                req = self.requests[seq.rid]
                tokens[seq.slot], live[seq.slot] = self._next_token[seq.rid], True
                temperature[seq.slot], top_p[seq.slot], seeds[seq.slot] = req.temperature, req.top_p, req.seed
                counts[seq.slot] = len(self.results[seq.rid].tokens)
            steps = -(-self._pieces_run // self.chunks_per_step) if self._pieces_run else self.decode_steps
            steps = min(steps, *(self.scheduler.ahead(seq) for seq in running))
            out, self.state = programs.decode(self.model, self.state, jnp.asarray(self.tables), jnp.asarray(tokens),
                                              jnp.asarray(live), jnp.asarray(temperature), jnp.asarray(top_p),
                                              jnp.asarray(seeds), jnp.asarray(counts), jnp.int32(steps),
                                              most=self.decode_steps)
            out = np.asarray(out)
            self.decode_seconds += time.perf_counter() - decode_start
            self.decode_step_count += steps
            for seq in running:
                slot = seq.slot
                for i in range(steps):  # tokens past a stop are dropped (their appends went to its own pages)
                    self.scheduler.advance(seq)
                    self._emit(seq, int(out[i, slot]))
                    self.decode_tokens += 1
                    if seq.rid not in self._next_token:
                        break
        self.pages_used.append(self.scheduler.pages_in_use())

    def _running(self) -> list[Sequence]:
        """The running sequences holding a token to decode (not those still prefilling)."""
        return [s for s in self.scheduler.running if s.rid in self._next_token]

    def _set_table(self, slot: int, pages: list[int]) -> None:
        self.tables[slot] = paged.NO_PAGE
        self.tables[slot, :len(pages)] = pages

    def _apply(self, event: Event) -> None:
        seq = event.seq
        if event.kind == "grow":
            self._set_table(seq.slot, seq.pages)
        elif event.kind == "swap_out":  # a prefilling sequence's tokens are all in its one-row state
            ids = self._padded(event.old_pages)
            self._swapped[seq.rid] = None if seq.rid in self._prefilling else jax.device_get(
                programs.read_slot(self.state, event.old_slot, ids))
            self.tables[event.old_slot] = paged.NO_PAGE
            self.preemptions += 1
        elif event.kind == "swap_in":
            self._set_table(seq.slot, seq.pages)
            saved = self._swapped.pop(seq.rid)
            if saved is not None:
                self.state = programs.write_slot(self.state, saved, seq.slot, self._padded(seq.pages, -1),
                                                 jnp.asarray(self.tables))
        elif event.kind == "admit":
            self._set_table(seq.slot, seq.pages)
            self._prefill(seq)

    def _padded(self, pages, pad: int = 0) -> jax.Array:
        ids = np.full(self.tables.shape[1], pad, np.int32)
        ids[:len(pages)] = pages
        return jnp.asarray(ids)

    def _bucket(self, n: int) -> int:
        return next(t for t in self.buckets if t >= n)

    def prefix_bounds(self, n: int) -> list[int]:
        """The prefix-cache boundaries m_1 < m_2 < ... below a prompt of n tokens."""
        return list(range(self._first_bound, n, self.page_tokens))

    def _empty_part(self, bucket: int) -> kv_policy.KVState:
        """A fresh one-row state for a prompt of up to `bucket` tokens (a copy: prefill donates it)."""
        rows = self._pages_for(bucket) * self.page_tokens + self._spec.sink + self._spec.window if self.paged \
            else bucket
        if rows not in self._empty_parts:  # building a state costs far more than copying one
            self._empty_parts[rows] = generate.init_state(self.model, self._part_policy, 1, rows, self._chunk)
        return jax.tree.map(jnp.copy, self._empty_parts[rows])

    def _prefill_head(self, part: kv_policy.KVState, head) -> tuple[jax.Array, kv_policy.KVState]:
        """`head` (the first prompt tokens) through one prefill, right-padded to a bucket."""
        short = self.chunk is not None and len(head) <= self.chunk  # chunked: one width for every head
        tokens = np.zeros((1, self.chunk if short else self._bucket(len(head))), np.int32)
        tokens[0, :len(head)] = head
        self._pieces_run += 1
        return generate.prefill(self.model, part, tokens, np.array([len(head)], np.int32))

    def _pieces(self, n: int) -> list[int]:
        """Extend chunks for n tokens: chunks of C, then the rest in descending powers of four,
        each up to 3 times (`_piece_sizes`: few compiled shapes whatever n is, few launches)."""
        c, out = self.chunk, [self.chunk] * (n // self.chunk)
        rest = n % c
        for size in self._piece_sizes()[1:]:
            out += [size] * (rest // size)
            rest %= size
        return out

    def _piece_sizes(self) -> list[int]:
        """The extend chunk lengths `_pieces` uses, longest first: C, then the powers of four below C."""
        below, p = [], 1
        while p < self.chunk:
            below, p = [p] + below, 4 * p
        return [self.chunk] + below

    def _prefill(self, seq: Sequence) -> None:
        """Start seq's prefill: its first tokens (1..C when chunked, or a prefix-cache hit with
        the prefix cache) now; `_prefill_chunks` runs the rest."""
        prompt = self.requests[seq.rid].prompt
        n = len(prompt)
        self.prompt_tokens += n
        if seq.keys:
            fill = self._prefix_fill(seq)
        else:
            head = n if self.chunk is None else n - (n - 1) // self.chunk * self.chunk
            rows = self._bucket(n) if self.chunk is None else self.capacity  # chunked: one shape for every n
            logits, part = self._prefill_head(self._empty_part(rows), prompt[:head])
            fill = _Fill(part, head, [self.chunk] * ((n - head) // self.chunk) if self.chunk else [], logits)
        if fill.pieces:
            self._prefilling[seq.rid] = fill
        else:
            self._enter(seq, fill)

    def _prefix_fill(self, seq: Sequence) -> _Fill:
        """The fixed segments of a prompt past m_1: its first 1..C tokens (`_prefix_head`) in one
        prefill and C-token chunks up to m_1, or entry j's state on a hit (its pages and
        snapshot); then pages of C-token chunks up to the last boundary m_K, then the rest.
        Snapshots are taken at m_K and, where seq shares entries past the one it restores (a
        branch point: no snapshot there yet), at the last shared one; dense policies take every
        boundary's (their entries hold their rows)."""
        prompt, bounds = self.requests[seq.rid].prompt, self.prefix_bounds(len(self.requests[seq.rid].prompt))
        part, j, last = self._empty_part(self.capacity), seq.restored, bounds[-1]
        if j:
            part, done, logits = self._restore(seq, part), bounds[j - 1], None
            self.prefix_hit_tokens += done
        else:  # the first 1..C tokens, as without the prefix cache, then chunks of C up to m_1
            done = self._prefix_head
            logits, part = self._prefill_head(part, prompt[:done])
        due = range(j + 1, len(bounds) + 1) if not self.paged else {len(bounds)} | (
            {seq.shared} if seq.shared > j else set())
        fill = _Fill(part, done, [self.chunk] * ((last - done) // self.chunk) + self._pieces(len(prompt) - last),
                     logits, {bounds[k - 1]: k for k in due})
        self._snapshot_if_due(fill)
        return fill

    def _restore(self, seq: Sequence, part: kv_policy.KVState) -> kv_policy.KVState:
        """`part` as it was at boundary `seq.restored` of seq's prompt: the snapshot of that entry,
        the pages (OSCAR) or rows (dense) of it and its parents."""
        entries = [self.prefix.entries[key] for key in seq.keys[:seq.restored]]
        part = pc.with_snapshot(part, entries[-1].snapshot)
        if self.paged:
            ids = np.full(self.tables.shape[1], paged.NO_PAGE, np.int32)
            ids[:len(entries)] = [e.page for e in entries]
            return pc.with_pages(self.state, part, jnp.asarray(ids))
        for k, entry in enumerate(entries):
            part = pc.with_rows(part, entry.rows, jnp.int32(k * self.page_tokens))
        return part

    def _snapshot_if_due(self, fill: _Fill) -> None:
        k = fill.snap_at.get(fill.done)
        if k is not None:
            rows = None if self.paged else jax.device_get(
                pc.take_rows(fill.part, jnp.int32(fill.done - self.page_tokens), self.page_tokens))
            fill.taken[k] = (jax.device_get(pc.take_snapshot(fill.part)), rows)

    def _prefill_chunks(self, budget: int) -> None:
        """Up to `budget` prompt chunks of the prefilling sequences that hold a slot, first come
        first served; past the first `chunks_per_step`, none once a prefill ended in this round
        (its first token waits on no other prompt's chunks)."""
        run = 0
        for rid in list(self._prefilling):
            seq, fill, prompt = self._seqs[rid], self._prefilling[rid], self.requests[rid].prompt
            while run < budget and seq.slot is not None and fill.pieces and (
                    run < self.chunks_per_step or not self._entered):
                c = fill.pieces.pop(0)
                logits, fill.part = generate.extend(self.model, fill.part,
                                                    np.asarray([prompt[fill.done:fill.done + c]], np.int32))
                fill.done, fill.logits = fill.done + c, logits[:, -1]
                run += 1
                self._pieces_run += 1
                self._snapshot_if_due(fill)
            if not fill.pieces and seq.slot is not None:
                del self._prefilling[rid]
                self._enter(seq, fill)

    def _enter(self, seq: Sequence, fill: _Fill) -> None:
        """Insert seq's prefilled one-row state into its slot (its shared pages left as they are),
        its boundaries into the prefix cache; its first token from the last logits [1, V]."""
        self._entered += 1
        req = self.requests[seq.rid]
        self.state = programs.insert(self.state, fill.part, jnp.int32(seq.slot), jnp.asarray(self.tables),
                                     jnp.int32(seq.shared))
        if seq.keys:
            self.scheduler.cache_prefix(seq, fill.taken)
        first = programs.sample(fill.logits, jnp.asarray([req.temperature], jnp.float32),
                                jnp.asarray([req.top_p], jnp.float32), jnp.asarray([req.seed], jnp.int32),
                                jnp.zeros((1,), jnp.int32))
        self._emit(seq, int(first[0]))

    def _emit(self, seq: Sequence, token: int) -> None:
        """Record seq's next generated token; finish it on a stop id or at max_tokens."""
        result, req = self.results[seq.rid], self.requests[seq.rid]
        result.tokens.append(token)
        self._next_token.pop(seq.rid, None)
        if token in req.stop_ids:
            result.finish = "stop"
        elif len(result.tokens) >= req.max_tokens:
            result.finish = "length"
        else:
            self._next_token[seq.rid] = token
            return
        self.tables[seq.slot] = paged.NO_PAGE  # the idle slot's decode rows write nowhere
        self.scheduler.finish(seq)
