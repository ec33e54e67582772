"""The work schedule of the Mosaic GPU decode kernel, in plain numpy: its `Config` (chosen per
shape and SM count by `schedule`) and its `WorkLine`.

The work is split stream-K style: every (batch row, KV head) pair's sink and ring and then
its 256-token history tiles laid end to end (`WorkLine`) and cut into programs of equal
work, so a program takes pieces of one or two pairs (each piece's history one partial, a
sink and ring one more) and every SM is busy to the end, whatever B x Hkv is. Work is
counted in units of one history tile (a 256-token step of the kernel's loop); a 64-token
bf16 block of the sink or ring counts `Config.dense_tile_cost` units.

A `WorkLine` is cut at trace time for every pair at full capacity. A `LiveLine` (the paged
cache's: slots of one engine hold ragged lengths, some none) is cut at call time from the
rows' lengths: each pair's live history tiles alone are split into programs of about equal
work, so idle slots and the unused capacity of short rows cost no program's time.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

TILE_TOKENS = 256  # tokens of one history tile (64 packed rows of 4 tokens)
_WARPGROUPS = 3  # programs per block (and per SM) where there are enough of them


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings of the Mosaic GPU decode kernel (`Config.default` picks them per call).

    warpgroups: programs per block, each one warpgroup with its own TMA pipeline, barriers
      and reduction scratch. 3 at D <= 128 where the work makes more programs than one wave
      of 2 per SM holds (3 programs on an SM: ptxas fits a thread into 168 registers), else 1
      (at D = 256 shared memory holds one program per block).
    buffers: TMA pipeline depth per warpgroup: 2 with several warpgroups (the only depth
      where the sink and ring's buffers overlay each warpgroup's own code buffers), else 3.
    target_programs: the work line is cut into at most about this many programs:
      warpgroups x SMs with several warpgroups, else 2 x SMs at D <= 128 and 1024 at D = 256.
    dense_tile_cost: units of a 64-token bf16 block of the sink or ring (a sink and ring of
      5 blocks takes about as long as 6 history tiles).
    switch_cost: units a program that reaches into a second pair gives up (`WorkLine.cut`):
      the second piece's start (its q, its first tiles, an empty pipeline) and the first
      piece's store.
    warpgroup_shorter: units by which the programs of warpgroup k % len(warpgroup_shorter)
      are shorter, where warpgroups = len(warpgroup_shorter) and programs hold at least
      `shorter_from` units: a block's warpgroups run at different paces (warpgroup 0 ends
      last).
    """

    warpgroups: int
    buffers: int
    target_programs: int
    dense_tile_cost: float = 1.2
    switch_cost: int = 5
    warpgroup_shorter: tuple[int, ...] = (1, 0, 0)
    shorter_from: int = 64

    def __post_init__(self):
        if self.warpgroups < 1 or self.buffers < 1 or self.target_programs < 1:
            raise ValueError(f"Config(warpgroups={self.warpgroups}, buffers={self.buffers}, target_programs="
                             f"{self.target_programs}): expected each >= 1")
        if self.dense_tile_cost < 0 or self.switch_cost < 0 or min(self.warpgroup_shorter, default=0) < 0:
            raise ValueError(f"Config(dense_tile_cost={self.dense_tile_cost}, switch_cost={self.switch_cost}, "
                             f"warpgroup_shorter={self.warpgroup_shorter}): expected costs >= 0")

    @classmethod
    def default(cls, pairs: int, tiles: int, head_dim: int, *, dense_blocks: int, sms: int) -> "Config":
        """The heuristic: the rules above for B x Hkv = pairs of `tiles` history tiles and
        `dense_blocks` 64-token blocks of sink and ring on a GPU of `sms` SMs."""
        many = work_line(pairs, tiles, dense_blocks, cls(1, 3, _WARPGROUPS * sms)).programs > 2 * sms
        warpgroups = _WARPGROUPS if head_dim <= 128 and many else 1
        if warpgroups > 1:
            return cls(warpgroups, 2, warpgroups * sms)
        return cls(1, 3, 2 * sms if head_dim <= 128 else 1024)


def slices_per_tile(g: int, head_dim: int) -> int:
    """Token slices whose scores share one [64, 8] tile: each takes a block of 8 / P columns,
    g padded to a power of two (g = 4: 2 slices, g <= 2: all 4, g > 4: 1). At D = 256 one
    slice per tile (packing keeps more A operands live there, which spills)."""
    if head_dim > 128:
        return 1
    return min(4, 8 // (1 << (g - 1).bit_length()))


class _Line:
    """What the kernel reads of a work line: pairs of `dense` + `tiles` units laid end to end,
    `programs` programs (program k takes units [bounds[k], bounds[k + 1])) and the table
    layout (bounds [programs + 1], each pair's first program with history tiles [pairs], each
    pair's partials [pairs], end to end)."""

    pairs: int
    tiles: int
    dense: int

    @property
    def unit(self) -> int:
        return self.dense + self.tiles

    def piece(self, u0, u1, i, xp=np):
        """The i-th pair of a program of units [u0, u1) -> (pair, whether the program takes
        its sink and ring, its first and end history tile there)."""
        pair = u0 // self.unit + i
        base = pair * self.unit
        t_begin = xp.clip(u0 - base - self.dense, 0, self.tiles)
        t_end = xp.clip(u1 - base - self.dense, 0, self.tiles)
        return pair, (u0 <= base) & (base < u1), t_begin, t_end

    def pieces(self, u0, u1):
        """Pairs that a program of units [u0, u1) touches: 1 or 2."""
        return 1 + ((u0 // self.unit + 1) * self.unit < u1).astype(np.int32)

    @property
    def table_offsets(self) -> tuple[int, int]:
        """Where the first programs and the partials start in the table."""
        return self.programs + 1, self.programs + 1 + self.pairs

    @property
    def table_size(self) -> int:
        return self.programs + 1 + 2 * self.pairs


@dataclasses.dataclass(frozen=True)
class WorkLine(_Line):
    """The kernel's work decomposition (stream-K): each (batch row, KV head) pair's work laid
    end to end, `unit` units a pair (the sink and ring's `dense` units, then its `tiles`
    256-token history tiles), cut into programs: program k takes units [bounds[k],
    bounds[k + 1]), never cutting a sink and ring (`cut`) and at most one pair's units (so
    at most two pairs). Its history tiles of a pair are one piece, one partial; the pieces
    of a pair have partials 0, 1, ... in program order, its sink and ring the next one."""

    pairs: int
    tiles: int
    dense: int
    bounds: tuple[int, ...]

    @property
    def programs(self) -> int:
        return len(self.bounds) - 1

    @property
    def max_partials(self) -> int:
        """The most partials a pair has (the kernel's partial slots a pair)."""
        return int(self.tables()[2].max())

    @classmethod
    def cut(cls, pairs: int, tiles: int, dense: int, per_program: int, switch: int = 0,
            shorter: tuple[int, ...] = ()) -> "WorkLine":
        """Programs of per_program units (the last one fewer), program k shorter by
        shorter[k % len(shorter)] where given (a block's warpgroups run at different paces),
        each cut that would fall inside a sink and ring moved to before it (or after it where
        the program would be empty); a program that reaches into a second pair is `switch`
        units shorter (its second piece's start and its first piece's end cost time of their
        own)."""
        unit, total = dense + tiles, pairs * (dense + tiles)
        most = max(shorter, default=0)
        if min(pairs, tiles) < 1 or dense < 0 or switch < 0 or min(shorter, default=0) < 0 or \
                not 1 + most <= per_program <= unit:
            raise ValueError(f"pairs={pairs}, tiles={tiles}, dense={dense}, per_program={per_program}, "
                             f"switch={switch}, shorter={shorter}: expected pairs, tiles >= 1, dense, switch, "
                             f"shorter >= 0 and {1 + most} <= per_program <= {unit}")
        bounds = [0]
        while bounds[-1] < total:
            k = len(bounds) - 1
            end = min(bounds[-1] + per_program - (shorter[k % len(shorter)] if shorter else 0), total)
            base = end // unit * unit
            if bounds[-1] < base < end:  # two pairs
                end = max(base, end - switch)
            if base < end < base + dense:
                end = base if base > bounds[-1] else base + dense
            bounds.append(end)
        return cls(pairs, tiles, dense, tuple(bounds))

    def tables(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """int32 (bounds [programs + 1], each pair's first program with history tiles of it
        [pairs], each pair's partials [pairs]: its pieces and the sink and ring's)."""
        bounds = np.asarray(self.bounds, np.int32)
        base = np.arange(self.pairs) * self.unit
        program_of = lambda u: np.searchsorted(bounds, u, side="right") - 1
        first, last = program_of(base + self.dense), program_of(base + self.unit - 1)
        return bounds, first.astype(np.int32), (last - first + 2).astype(np.int32)

    def table(self) -> np.ndarray:
        """int32 [programs + 1 + 2 pairs]: `tables()` end to end, one constant for the kernels
        (XLA makes a constant whose elements are all equal, as first and partials often are,
        into a broadcast kernel of its own)."""
        return np.concatenate(self.tables())


def work_line(pairs: int, tiles: int, dense_blocks: int, config: Config) -> WorkLine:
    """The work line of `config`: programs of the fewest units each (at most a pair's) that
    `WorkLine.cut` makes into at most `config.target_programs`, each warpgroup's shorter by
    `config.warpgroup_shorter` where that applies."""
    dense = math.ceil(config.dense_tile_cost * dense_blocks)
    unit, total = tiles + dense, pairs * (tiles + dense)
    target = config.target_programs
    per_program = min(unit, -(-total // target))
    shorter = config.warpgroup_shorter if config.warpgroups == len(config.warpgroup_shorter) else ()
    shorter = shorter if per_program >= config.shorter_from else ()
    cut = WorkLine.cut(pairs, tiles, dense, per_program, config.switch_cost, shorter)
    while cut.programs > target and per_program < unit:  # the moved cuts added some
        per_program += 1
        cut = WorkLine.cut(pairs, tiles, dense, per_program, config.switch_cost, shorter)
    return cut


def schedule(pairs: int, tiles: int, head_dim: int, *, sms: int, dense_blocks: int = 0,
             config: Config | None = None) -> tuple[Config, WorkLine]:
    """(config, work line) for B x Hkv = pairs of `tiles` history tiles and `dense_blocks`
    64-token blocks of sink and ring at head dim D on a GPU of `sms` SMs; config None: the
    heuristic's (`Config.default`)."""
    if config is None:
        config = Config.default(pairs, tiles, head_dim, dense_blocks=dense_blocks, sms=sms)
    if config.warpgroups > 1 and head_dim > 128:
        raise ValueError(f"warpgroups={config.warpgroups}: expected 1 at D = {head_dim} > 128 "
                         "(shared memory holds one such program per block)")
    if config.warpgroups > 1 and config.buffers != 2:
        raise ValueError(f"buffers={config.buffers} at warpgroups={config.warpgroups}: expected 2 with several "
                         "warpgroups (the sink and ring's buffers then overlay each warpgroup's own code buffers)")
    return config, work_line(pairs, tiles, dense_blocks, config)


@dataclasses.dataclass(frozen=True)
class LiveLine(_Line):
    """A work line cut at call time (`table`) from the rows' lengths: pair p's L_p live history
    tiles (its row's history tokens / 256, rounded up) go to m_p = max(1, ceil(L_p / per))
    programs of one pair each, the first also taking the sink and ring, the last also the
    capacity past L_p (where the kernel's pieces stop at the row's length). per = the live
    work / `target`, raised so no pair has more than `max_partials` partials. Programs past
    the m_p's total take no units. `programs` and `max_partials` bound any lengths' cut."""

    pairs: int
    tiles: int
    dense: int
    kv_heads: int
    target: int
    max_partials: int
    programs: int

    @classmethod
    def like(cls, line: WorkLine, config: Config, kv_heads: int) -> "LiveLine":
        """The live line over `line`'s pairs, tiles and sink-and-ring units, cut for `config`'s
        target programs, with at least `line`'s partial slots a pair (more where few pairs
        would otherwise leave SMs idle)."""
        target = config.target_programs
        partials = max(line.max_partials, min(line.tiles, -(-target // line.pairs)) + 2)
        programs = min(line.pairs + target, line.pairs * (partials - 1))
        return cls(line.pairs, line.tiles, line.dense, kv_heads, target, partials, programs)

    def table(self, lengths: jax.Array, *, sink: int, window: int, xp=jnp) -> jax.Array:
        """int32 [programs + 1 + 2 pairs]: bounds, first programs and partials (`_Line`) for
        rows of `lengths` int32 [B] tokens (B x kv_heads = pairs), sink and window tokens
        before the history (xp: jnp, or np for a host copy)."""
        n_hist = xp.clip(lengths.astype(np.int32) - sink - window, 0, self.tiles * TILE_TOKENS)
        live = xp.repeat(-(-n_hist // TILE_TOKENS), self.kv_heads)  # [pairs]
        work = xp.sum(live) + self.pairs * self.dense
        per = xp.maximum(xp.maximum(-(-work // self.target), -(-xp.max(live) // (self.max_partials - 1))), 1)
        count = xp.maximum(1, -(-live // per))  # programs a pair
        first = xp.cumsum(count) - count
        k = xp.arange(self.programs, dtype=np.int32)
        pair = xp.sum(first[None, :] <= k[:, None], axis=1, dtype=np.int32) - 1  # [programs]
        j = k - first[pair]
        cut = xp.where(j == 0, 0, self.dense + j * live[pair] // count[pair])
        end = self.pairs * self.unit
        bounds = xp.where(k < xp.sum(count), pair * self.unit + cut, end)
        return xp.concatenate([bounds, xp.full((1,), end, np.int32), first, count + 1]).astype(np.int32)
