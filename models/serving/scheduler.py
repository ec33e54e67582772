"""The serving engine's host-side bookkeeping: which sequence holds which slot and which
pages, and in what order sequences enter, grow, leave for host memory and come back.

Pure Python over `oscar_jax.paged.PageAllocator`; the engine (`engine.py`) carries out the
events `schedule` returns on the device. Rules, in order, once per step:

1. every running sequence gets the pages the tokens of its next decode round need (up to
   `lookahead` tokens, never past its last: prompt + max_tokens - 1), oldest admission first; when
   too few are free, the most recently admitted running sequence is swapped out (its pages and
   slot freed; the engine copies them to host memory first), until enough are free;
2. swapped-out sequences come back (first out, first in) while a slot and the pages for their
   next round are free;
3. only when none is left swapped out, waiting requests are admitted (first come, first
   served) while a slot and the pages for their prompt and first decode round are free
   (and, when the engine bounds the prompts prefilling at once, while it has room for one).

With a prefix cache (`prefix_cache.PrefixCache`), pages held only by cached entries count as
free: they are evicted, least recently used first, when the free list runs out, before any
sequence is swapped out. An admitted request takes the cached entries its prompt's keys match
(`Sequence.shared` leading pages, never written by it) and starts its prefill from the deepest
one with a snapshot (`Sequence.restored`); `cache_prefix` adds its own after its prefill. A
sequence leaving (done, cancelled or swapped out) drops its references; a swapped-out one
comes back with private copies of all its pages.

A request that could never be held (more tokens than a slot holds, or more pages than the
pool) is refused at `submit`, so every admitted sequence can always finish: swapping out all
younger sequences frees the whole pool for the oldest.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from oscar_jax.models.serving.prefix_cache import PrefixCache
from oscar_jax.paged import PageAllocator


@dataclasses.dataclass
class Sequence:
    """One request's place in the engine. length: tokens in its cache; pages: page ids in
    block-table order; slot: its row while running, else None."""

    rid: int
    prompt_len: int
    max_tokens: int
    length: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    slot: int | None = None
    admitted: int = -1  # admission counter (order of entry into the running set)
    keys: tuple[bytes, ...] = ()  # its prompt's prefix-cache keys, one per boundary m_k < prompt_len
    shared: int = 0  # leading pages that are cached entries' (this sequence never writes them)
    restored: int = 0  # boundaries its prefill restores from the cache (0: prefilled from the start)
    held: list[bytes] = dataclasses.field(default_factory=list)  # entries it holds a reference on


@dataclasses.dataclass(frozen=True)
class Event:
    """kind: "swap_out" (copy slot and pages to host, then they are freed), "swap_in" (copy back
    into `seq.slot` and `seq.pages`), "admit" (prefill into `seq.slot`, `seq.pages`), "grow"
    (`new_pages` appended to the sequence's block table)."""

    kind: str
    seq: Sequence
    new_pages: tuple[int, ...] = ()
    old_slot: int | None = None
    old_pages: tuple[int, ...] = ()


class Scheduler:
    """slots: sequences decoded together (the compiled batch); num_pages: the pool (0: no paged
    layers, slots only); pages_for(length) -> pages a sequence of that many tokens holds;
    capacity: the most tokens one slot holds; prefix: a `PrefixCache` over `allocator` (None: off);
    lookahead: the most tokens one decode round feeds a sequence (the engine's decode steps a call)."""

    def __init__(self, slots: int, num_pages: int, pages_for: Callable[[int], int], capacity: int,
                 prefix: PrefixCache | None = None, lookahead: int = 1):
        if lookahead < 1:
            raise ValueError(f"lookahead={lookahead}: expected >= 1")
        self.slots = slots
        self.lookahead = lookahead
        self.allocator = PageAllocator(num_pages) if num_pages else None
        self.prefix = prefix
        if prefix is not None:
            prefix.allocator = self.allocator
        self.pages_for = pages_for if num_pages else (lambda n: 0)
        self.capacity = capacity
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []  # in admission order
        self.swapped: list[Sequence] = []
        self._free_slots = list(range(slots))
        self._admissions = 0

    @property
    def num_free_pages(self) -> int:
        """Pages free or held only by cached prefix entries (evicted on demand)."""
        return self.num_cached_pages + (self.allocator.num_free if self.allocator else 0)

    @property
    def num_cached_pages(self) -> int:
        return self.prefix.num_cached_pages if self.prefix and self.allocator else 0

    def submit(self, rid: int, prompt_len: int, max_tokens: int, keys: tuple[bytes, ...] = ()) -> Sequence:
        """Queue a request; ValueError if it can never be held."""
        if prompt_len < 1 or max_tokens < 1:
            raise ValueError(f"request {rid}: prompt of {prompt_len} tokens and max_tokens={max_tokens}: "
                             "expected at least 1 of each")
        most = prompt_len + max_tokens - 1  # the last token generated is never fed back
        if most > self.capacity:
            raise ValueError(f"request {rid} can never fit: a prompt of {prompt_len} tokens plus max_tokens="
                             f"{max_tokens} needs {most} cache tokens and a slot holds {self.capacity}")
        total = self.allocator.num_pages if self.allocator else 0
        if self.pages_for(most) > total:
            raise ValueError(f"request {rid} can never fit: it needs {self.pages_for(most)} pages and the pool "
                             f"has {total}")
        seq = Sequence(rid, prompt_len, max_tokens, keys=tuple(keys))
        self.waiting.append(seq)
        return seq

    def ahead(self, seq: Sequence, length: int | None = None) -> int:
        """Tokens seq's next decode round may feed it when it holds `length` (default: its own)
        tokens: `lookahead`, or fewer where that reaches its last fed token (prompt + max_tokens
        - 1: the last generated token is never fed back; 0 for a prompt whose one token comes
        from its prefill)."""
        held = seq.length if length is None else length
        return max(0, min(self.lookahead, seq.prompt_len + seq.max_tokens - 1 - held))

    def _take(self, n: int) -> list[int]:
        if n and self.prefix and n > self.allocator.num_free:
            self.prefix.evict(pages=n - self.allocator.num_free)
        return self.allocator.allocate(n) if n else []

    def _enter(self, seq: Sequence, length: int) -> None:
        seq.slot = self._free_slots.pop(0)
        seq.pages = seq.pages + self._take(self.pages_for(length) - len(seq.pages))
        seq.admitted = self._admissions
        self._admissions += 1
        self.running.append(seq)

    def _fits(self, length: int, held: int = 0) -> bool:
        return bool(self._free_slots) and self.pages_for(length) - held <= self.num_free_pages

    def _swap_out(self, seq: Sequence) -> Event:
        event = Event("swap_out", seq, old_slot=seq.slot, old_pages=tuple(seq.pages))
        self.finish(seq)
        self.swapped.append(seq)
        return event

    def schedule(self, admit: int | None = None) -> list[Event]:
        """This step's events, in the order the engine must carry them out; at most `admit`
        admissions (None: as many as fit)."""
        events: list[Event] = []
        for seq in list(self.running):
            if seq not in self.running:  # swapped out for an older sequence's pages
                continue
            need = self.pages_for(seq.length + self.ahead(seq)) - len(seq.pages)
            while need > self.num_free_pages and seq in self.running:
                events.append(self._swap_out(self.running[-1]))
            if seq in self.running and need > 0:
                new = self._take(need)
                seq.pages += new
                events.append(Event("grow", seq, tuple(new)))
        while self.swapped and self._fits(self.swapped[0].length + self.ahead(self.swapped[0])):
            seq = self.swapped.pop(0)
            self._enter(seq, seq.length + self.ahead(seq))
            events.append(Event("swap_in", seq))
        while not self.swapped and self.waiting and (admit is None or admit > 0):
            seq = self.waiting[0]
            shared, restored = self.prefix.match(seq.keys) if self.prefix else (0, 0)
            if not self.allocator:
                shared = restored  # no pages to share: only what a snapshot restores
            pinned = self.prefix.cached_pages_among(seq.keys[:shared]) if self.prefix and self.allocator else 0
            first = seq.prompt_len + self.ahead(seq, seq.prompt_len)  # its prompt and first round
            if not self._fits(first, held=shared - pinned):
                break
            self.waiting.pop(0)
            entries = [self.prefix.acquire(key) for key in seq.keys[:shared]]
            seq.held, seq.shared, seq.restored = list(seq.keys[:shared]), shared, restored
            seq.pages = [e.page for e in entries] if self.allocator else []
            seq.length = seq.prompt_len
            self._enter(seq, first)
            events.append(Event("admit", seq))
            admit = None if admit is None else admit - 1
        return events

    def cache_prefix(self, seq: Sequence, taken: dict[int, tuple]) -> None:
        """After seq's prefill wrote its pages: every boundary of its prompt becomes an entry
        held by seq (one that exists already is referenced, its page left as it is and seq's
        own copy kept private); `taken` maps a boundary k to the (snapshot, rows) seq's prefill
        took there, given to a new entry or to an existing one without a snapshot."""
        held = set(seq.held)
        for k, key in enumerate(seq.keys, 1):
            snapshot, rows = taken.get(k, (None, None))
            entry = self.prefix.entries.get(key)
            if entry is None:
                parent = seq.keys[k - 2] if k > 1 else None
                if parent is not None and parent not in self.prefix.entries:
                    return  # its parent was evicted (seq was swapped out meanwhile): the chain ends
                if not self.allocator and rows is None:
                    return  # a dense entry is its rows
                page = seq.pages[k - 1] if self.allocator else None
                self.prefix.add(key, parent, k, page, snapshot, rows)
                seq.held.append(key)
                continue
            if key not in held:
                self.prefix.acquire(key)
                seq.held.append(key)
            if entry.snapshot is None and snapshot is not None:
                self.prefix.attach(entry, snapshot)

    def advance(self, seq: Sequence) -> None:
        """One more token in seq's cache (a decode step fed it)."""
        seq.length += 1

    def finish(self, seq: Sequence) -> None:
        """seq leaves the running set (done, or swapped out): its slot and its own pages are
        free, its cached entries lose its reference."""
        self.running.remove(seq)
        entry_pages = {self.prefix.entries[k].page for k in seq.held} if seq.held else set()
        own = [p for p in seq.pages if p not in entry_pages]
        if own:
            self.allocator.free(own)
        if seq.held:
            self.prefix.release(seq.held)
        self._free_slots.append(seq.slot)
        self._free_slots.sort()
        seq.slot, seq.pages, seq.held, seq.shared = None, [], [], 0

    def cancel(self, seq: Sequence) -> None:
        """Drop seq wherever it is (waiting, running or swapped out); its slot and pages are free."""
        if seq in self.running:
            self.finish(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)

    def pages_in_use(self) -> int:
        """Pages held by running sequences (a shared one once) or by entries they reference."""
        return self.allocator.num_used - self.num_cached_pages if self.allocator else 0
