"""A request to the serving engine and its result."""

from __future__ import annotations

import dataclasses
import math
import reprlib
from collections.abc import Iterable
from numbers import Integral


@dataclasses.dataclass(frozen=True)
class Request:
    """prompt: token ids; max_tokens: tokens to generate at most; temperature 0 is greedy;
    top_p in (0, 1]; seed: this request's sampling key; stop_ids: tokens that end it (kept)."""

    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("prompt", "stop_ids"):  # any sequence of ints, kept as a tuple of Python ints
            ids = getattr(self, name)
            if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable) or not all(_is_int(t) for t in ids):
                raise ValueError(f"Request.{name}={reprlib.repr(ids)}: expected a sequence of int token ids")
            object.__setattr__(self, name, tuple(int(t) for t in ids))
        if not _is_int(self.max_tokens):
            raise ValueError(f"Request.max_tokens={self.max_tokens!r}: expected an int")
        if not (_is_int(self.seed) and -2 ** 31 <= self.seed < 2 ** 31):
            raise ValueError(f"Request.seed={self.seed!r}: expected an int in [-2**31, 2**31)")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"Request.temperature={self.temperature!r}: expected a finite value >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"Request.top_p={self.top_p!r}: expected in (0, 1]")


def _is_int(x) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)


@dataclasses.dataclass
class Result:
    """tokens: generated ids; finish: "length" (max_tokens reached), "stop" (a stop id) or
    "cancelled" (`Engine.cancel`)."""

    tokens: list[int]
    finish: str | None = None
