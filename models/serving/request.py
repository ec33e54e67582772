"""A request to the serving engine and its result."""

from __future__ import annotations

import dataclasses


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
        if not self.temperature >= 0:
            raise ValueError(f"Request.temperature={self.temperature!r}: expected >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"Request.top_p={self.top_p!r}: expected in (0, 1]")


@dataclasses.dataclass
class Result:
    """tokens: generated ids; finish: "length" (max_tokens reached), "stop" (a stop id) or
    "cancelled" (`Engine.cancel`)."""

    tokens: list[int]
    finish: str | None = None
