"""The OpenAI completions and chat API as `oscar serve` speaks it: request schemas (pydantic),
OpenAI-style errors, the chat template and the incremental detokeniser.

Every field of OpenAI's request bodies is named here: the ones the engine serves are typed
and checked, the ones it does not (`UNSUPPORTED`) are refused by name with a 400 when a
client sets them to anything but their neutral value; an unknown field is refused too.
"""

from __future__ import annotations

from typing import Any, Literal

import jinja2.sandbox
from pydantic import BaseModel, ConfigDict, Field, field_validator


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {...}}` with HTTP `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# field -> its neutral value: a request may carry it at that value (clients often send defaults)
UNSUPPORTED: dict[str, Any] = {
    "n": 1, "best_of": 1, "echo": False, "logprobs": None, "top_logprobs": None, "logit_bias": None,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "suffix": None, "tools": None, "tool_choice": None,
    "functions": None, "function_call": None, "response_format": None, "parallel_tool_calls": None,
    "modalities": None, "audio": None, "prediction": None,
}


class _Common(BaseModel):
    """The sampling fields both endpoints share."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    # fields of OpenAI's API this server does not serve (UNSUPPORTED): accepted only at their neutral value
    n: int | None = 1
    best_of: int | None = None
    echo: bool | None = False
    logprobs: Any = None
    top_logprobs: Any = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, v):
        if v is not None and v < 1:
            raise ValueError(f"max_tokens={v}: expected an integer >= 1")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop: expected at most 4 non-empty strings")
        return stops

    def unsupported(self) -> list[str]:
        """The names of the unsupported fields set to something other than their neutral value."""
        bad = []
        for name in self.model_fields_set & UNSUPPORTED.keys():
            value, neutral = getattr(self, name), UNSUPPORTED[name]
            if value is not None and value != neutral:
                bad.append(name)
        return sorted(bad)

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Common):
    """POST /v1/completions."""

    prompt: str | list[int]
    max_tokens: int | None = 16
    suffix: str | None = None

    @field_validator("prompt", mode="before")  # before the union: an error names `prompt`, not a branch
    @classmethod
    def _prompt(cls, v):
        if not (isinstance(v, str) or isinstance(v, list) and all(type(t) is int for t in v)) or not v:
            raise ValueError("expected a non-empty string or list of int token ids")
        return v


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer"]
    content: str
    name: str | None = None


class ChatRequest(_Common):
    """POST /v1/chat/completions."""

    messages: list[Message]
    max_completion_tokens: int | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    parallel_tool_calls: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None

    @field_validator("messages")
    @classmethod
    def _messages(cls, v):
        if not v:
            raise ValueError("messages: expected at least one message")
        return v

    @field_validator("max_completion_tokens")
    @classmethod
    def _positive_completion(cls, v):
        return cls._positive(v)


def validation_error(errors: list[dict]) -> APIError:
    """pydantic's errors of a request body -> one 400 naming the first bad field."""
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":
        message = f"unknown field {param!r}: this server implements OpenAI's completions and chat fields"
    elif first.get("type") == "json_invalid":
        message, param = "the request body is not valid JSON", None
    else:
        message = f"{param or 'body'}: {first.get('msg', 'invalid value').removeprefix('Value error, ')}"
    return APIError(400, message, param=param, code="invalid_value")


class ChatTemplate:
    """A model's Jinja chat template (tokenizer metadata), rendered in a sandbox."""

    def __init__(self, source: str, *, bos: str = "", eos: str = ""):
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = self._raise
        self.template = env.from_string(source)
        self.bos, self.eos = bos, eos

    @staticmethod
    def _raise(message: str):
        raise APIError(400, f"the model's chat template refused the messages: {message}", param="messages")

    def render(self, messages: list[Message]) -> str:
        """The prompt text for `messages`, ending where the assistant's reply begins."""
        return self.template.render(messages=[m.model_dump(exclude_none=True) for m in messages],
                                    add_generation_prompt=True, bos_token=self.bos, eos_token=self.eos)


class ByteTokenizer:
    """Text as UTF-8 bytes, one id a byte, for a model served without a tokenizer (random
    weights: speed runs); an id past 255 decodes to "□", so every token shows in a stream."""

    eos_ids: tuple[int, ...] = ()
    bos_id = None

    def __init__(self, vocab_size: int):
        if vocab_size < 256:
            raise ValueError(f"vocab_size={vocab_size}: byte ids need at least 256")

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        return list(text.encode())

    def decode(self, ids) -> str:
        out, run = [], bytearray()
        for i in ids:
            if 0 <= i < 256:
                run.append(i)
            else:
                out += [run.decode(errors="replace"), "\u25a1"]
                run = bytearray()
        return "".join(out) + run.decode(errors="replace")


class TextStream:
    """Token ids -> text pieces, held back where the text may still change: an incomplete UTF-8
    sequence at the end, or a tail that could be the start of a stop string.

    `feed(ids)` returns the new text that is final; `stopped` says a stop string was met (the
    text ends before it); `flush()` returns what was held back once the request is done."""

    def __init__(self, decode, stops: list[str] | None):
        self.decode, self.stops = decode, list(stops or [])
        self.ids: list[int] = []
        self.sent = 0  # characters of the text already returned
        self.stopped = False

    def _text(self) -> str:
        return self.decode(self.ids)

    def feed(self, ids: list[int]) -> str:
        self.ids += ids
        text = self._text()
        for stop in self.stops:
            at = text.find(stop, max(self.sent - len(stop) + 1, 0))
            if at >= 0:
                text, self.stopped = text[:at], True
        if self.stopped:
            return self._take(text, len(text))
        safe = len(text) - (1 if text.endswith("\ufffd") else 0)
        if self.stops:
            safe = min(safe, len(text) - max(len(s) for s in self.stops) + 1)
        return self._take(text, safe)

    def flush(self) -> str:
        text = self._text()
        return "" if self.stopped else self._take(text, len(text))

    def _take(self, text: str, upto: int) -> str:
        piece = text[self.sent:max(upto, self.sent)]
        self.sent = max(upto, self.sent)
        return piece
