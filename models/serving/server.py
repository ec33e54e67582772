"""`oscar serve`'s HTTP server: OpenAI's completions and chat API over the serving engine.

FastAPI on uvicorn. The engine runs on its own thread (`EngineLoop`): between steps it takes
the requests and cancellations the HTTP handlers queued, then steps the engine and hands each
request its new tokens through its asyncio queue, so the event loop never waits on a device
step. A streaming response cancels its request when the client goes away (its slot and pages
are freed). Admission is bounded: with `max_queue` requests waiting, a new one gets 429 and a
Retry-After. On SIGTERM uvicorn stops accepting connections and lets the running responses
finish; then the engine thread stops and the prefix cache, if the server keeps one on disk,
is saved there.

    POST /v1/completions, POST /v1/chat/completions (stream or not), GET /v1/models,
    GET /health, GET /metrics (Prometheus)
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import queue
import threading
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import jax
import prometheus_client as prom
from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from oscar_jax.models import results
from oscar_jax.models.serving import api
from oscar_jax.models.serving.engine import Engine
from oscar_jax.models.serving.request import Request


@dataclasses.dataclass
class _Job:
    """A request between the HTTP handler and the engine thread."""

    request: Request
    tokens: asyncio.Queue  # lists of new token ids, then the finish reason (a str) or an APIError
    loop: asyncio.AbstractEventLoop
    rid: int | None = None
    sent: int = 0
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    last: float | None = None  # when its latest token reached the host

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.tokens.put_nowait, item)


class Metrics:
    """The server's Prometheus metrics, in their own registry."""

    def __init__(self):
        self.registry = prom.CollectorRegistry()
        gauge = lambda name, doc: prom.Gauge(name, doc, registry=self.registry)
        self.waiting = gauge("oscar_requests_waiting", "requests queued for admission")
        self.running = gauge("oscar_requests_running", "sequences being decoded")
        self.swapped = gauge("oscar_requests_swapped", "sequences swapped out to host memory")
        self.pages_used = gauge("oscar_kv_pages_used", "KV pages held by sequences")
        self.pages_free = gauge("oscar_kv_pages_free", "KV pages free")
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = prom.Histogram("oscar_time_to_first_token_seconds", "submission to first token",
                                   buckets=buckets, registry=self.registry)
        self.tpot = prom.Histogram("oscar_time_per_output_token_seconds", "between consecutive tokens of a request",
                                   buckets=buckets, registry=self.registry)
        self.requests = prom.Counter("oscar_requests", "requests by outcome", ["finish"], registry=self.registry)
        self.tokens = prom.Counter("oscar_generated_tokens", "tokens generated", registry=self.registry)
        self.prompt_tokens = prom.Counter("oscar_prompt_tokens", "prompt tokens prefilled or restored from the "
                                          "prefix cache", registry=self.registry)
        self.hit_tokens = prom.Counter("oscar_prefix_cache_hit_tokens", "prompt tokens restored from the prefix "
                                       "cache instead of prefilled", registry=self.registry)
        self.hit_rate = gauge("oscar_prefix_cache_hit_rate", "prefix-cache hit tokens / prompt tokens since start")
        self.pages_cached = gauge("oscar_kv_pages_cached", "KV pages held only by the prefix cache (evictable)")


class EngineLoop:
    """The engine on its own thread: `submit` and `cancel` are safe from any thread."""

    def __init__(self, engine: Engine, metrics: Metrics, *, max_queue: int):
        self.engine, self.metrics, self.max_queue = engine, metrics, max_queue
        self._inbox: queue.Queue = queue.Queue()
        self._jobs: dict[int, _Job] = {}
        self._pending = 0  # submitted, not yet admitted by the engine
        self._counted = (0, 0)  # the engine's prompt and prefix-hit tokens the metrics hold
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="oscar-engine", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def queued(self) -> int:
        """Requests waiting for admission (queued here or in the engine)."""
        with self._lock:
            return self._pending + len(self.engine.scheduler.waiting)

    def submit(self, job: _Job) -> None:
        """Queue `job`; APIError 429 when `max_queue` requests already wait."""
        with self._lock:
            if self._pending + len(self.engine.scheduler.waiting) >= self.max_queue:
                raise api.APIError(429, f"the server's admission queue is full ({self.max_queue} requests "
                                        "waiting); retry later", code="rate_limit_exceeded",
                                   kind="rate_limit_error", headers={"Retry-After": "1"})
            self._pending += 1
        self._inbox.put(("submit", job))

    def cancel(self, job: _Job) -> None:
        self._inbox.put(("cancel", job))

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._take(block=self.engine.done())
                if not self.engine.done():
                    self.engine.step()
                    self._deliver()
                self._observe()
        except BaseException as e:  # noqa: BLE001 - every waiting request learns the engine failed
            self.error = e
            for job in self._jobs.values():
                job.put(api.APIError(500, f"the engine failed: {type(e).__name__}: {e}", kind="server_error"))

    def _take(self, block: bool) -> None:
        """Carry out the queued submissions and cancellations (wait for one if `block`)."""
        while True:
            try:
                item = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if item is None:
                return
            kind, job = item
            if kind == "submit":
                with self._lock:
                    self._pending -= 1
                try:
                    job.rid = self.engine.submit(job.request)
                    self._jobs[job.rid] = job
                except ValueError as e:
                    job.put(api.APIError(400, str(e), param="prompt", code="context_length_exceeded"))
            elif job.rid is not None and job.rid in self._jobs:
                self.engine.cancel(job.rid)
                self._finish(job, "cancelled")

    def _deliver(self) -> None:
        now = time.perf_counter()
        for rid, job in list(self._jobs.items()):
            result = self.engine.results[rid]
            new = result.tokens[job.sent:]
            if new:
                if job.sent == 0:
                    self.metrics.ttft.observe(now - job.submitted)
                elif job.last is not None:
                    for _ in new:
                        self.metrics.tpot.observe((now - job.last) / len(new))
                job.sent, job.last = len(result.tokens), now
                self.metrics.tokens.inc(len(new))
                job.put(list(new))
            if result.finish is not None:
                self._finish(job, result.finish)

    def _finish(self, job: _Job, finish: str) -> None:
        self._jobs.pop(job.rid, None)
        self.metrics.requests.labels(finish).inc()
        job.put(finish)

    def _observe(self) -> None:
        s, m = self.engine.scheduler, self.metrics
        m.waiting.set(self.queued())
        m.running.set(len(s.running))
        m.swapped.set(len(s.swapped))
        m.pages_used.set(s.pages_in_use())
        m.pages_free.set(s.num_free_pages - s.num_cached_pages)
        m.pages_cached.set(s.num_cached_pages)
        e = self.engine
        m.prompt_tokens.inc(e.prompt_tokens - self._counted[0])
        m.hit_tokens.inc(e.prefix_hit_tokens - self._counted[1])
        self._counted = (e.prompt_tokens, e.prefix_hit_tokens)
        m.hit_rate.set(e.prefix_hit_rate)


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """What the server answers for: `name` (the id clients send), the engine, the tokenizer
    (`encode(text)`, `decode(ids)`, `eos_ids`), the chat template (None: no chat), the
    model's context length and the directory the prefix cache is saved to at shutdown."""

    name: str
    engine: Engine
    tokenizer: Any
    chat_template: api.ChatTemplate | None
    context: int
    prefix_cache_dir: Path | None = None  # where the prefix cache is saved at shutdown


def create_app(served: ServedModel, *, max_queue: int = 256, max_body_bytes: int = 1 << 20) -> FastAPI:
    """The FastAPI app serving `served` (module docstring)."""
    metrics = Metrics()
    loop_box: dict[str, EngineLoop] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop_box["engine"] = EngineLoop(served.engine, metrics, max_queue=max_queue)
        loop_box["engine"].start()
        yield
        loop_box["engine"].stop()
        if served.prefix_cache_dir is not None:
            served.engine.save_prefix_cache(served.prefix_cache_dir)

    app = FastAPI(title="oscar serve", lifespan=lifespan)
    engine_loop = lambda: loop_box["engine"]

    @app.exception_handler(api.APIError)
    async def _api_error(request: HTTPRequest, e: api.APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: HTTPRequest, e: RequestValidationError):
        err = api.validation_error(e.errors())
        return JSONResponse(err.body(), status_code=err.status)

    @app.middleware("http")
    async def _limit_body(request: HTTPRequest, call_next):
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > max_body_bytes:
            err = api.APIError(413, f"the request body has {size} bytes; this server takes at most {max_body_bytes}")
            return JSONResponse(err.body(), status_code=413)
        if request.method == "POST" and size is None:
            body = await request.body()  # chunked: read it once, bounded
            if len(body) > max_body_bytes:
                err = api.APIError(413, f"the request body passes {max_body_bytes} bytes")
                return JSONResponse(err.body(), status_code=413)
        return await call_next(request)

    @app.get("/health")
    async def health():
        if not engine_loop().alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok", "model": served.name, "device": results.device_kind(), "jax": jax.__version__}

    @app.get("/metrics")
    async def prometheus():
        return Response(prom.generate_latest(metrics.registry), media_type=prom.CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": 0,
                                            "owned_by": "oscar-jax"}]}

    def check(body: api._Common) -> None:
        if body.model != served.name:
            raise api.APIError(404, f"model {body.model!r} is not served here (this server serves "
                                    f"{served.name!r})", param="model", code="model_not_found")
        bad = body.unsupported()
        if bad:
            raise api.APIError(400, f"{', '.join(bad)}: not supported by this server", param=bad[0],
                               code="unsupported_parameter")

    def engine_request(ids: list[int], body: api._Common, max_tokens: int) -> Request:
        if len(ids) + max_tokens > served.context:
            raise api.APIError(400, f"the prompt has {len(ids)} tokens and max_tokens={max_tokens}: together "
                                    f"more than the model's context of {served.context} tokens",
                               param="max_tokens" if len(ids) < served.context else "prompt",
                               code="context_length_exceeded")
        if any(not 0 <= t < served.engine.model.cfg.vocab_size for t in ids):
            raise api.APIError(400, "prompt: token ids outside the vocabulary", param="prompt")
        return Request(tuple(ids), max_tokens, temperature=body.temperature, top_p=body.top_p,
                       seed=(body.seed if body.seed is not None else uuid.uuid4().int) % (1 << 31),
                       stop_ids=tuple(served.tokenizer.eos_ids))

    async def run(ids: list[int], body: api._Common, max_tokens: int, chunk, final) -> Response:
        """Submit, then stream (`chunk(text)` per piece) or answer at once (`final(text, finish, usage)`)."""
        job = _Job(engine_request(ids, body, max_tokens), asyncio.Queue(), asyncio.get_running_loop())
        engine_loop().submit(job)
        text = api.TextStream(served.tokenizer.decode, body.stop)

        async def pieces() -> AsyncIterator[tuple[str, str | None]]:
            finished = False
            try:
                while True:
                    item = await job.tokens.get()
                    if isinstance(item, api.APIError):
                        raise item
                    if isinstance(item, str):
                        finished = True
                        yield text.flush(), "length" if item == "length" else "stop"
                        return
                    piece = text.feed(item)
                    if text.stopped:
                        yield piece, "stop"
                        return
                    if piece:
                        yield piece, None
            finally:
                if not finished:
                    engine_loop().cancel(job)

        usage = lambda: {"prompt_tokens": len(ids), "completion_tokens": len(text.ids),
                         "total_tokens": len(ids) + len(text.ids)}
        if body.stream:
            first = await _first(pieces())  # errors before the first token answer with their status

            async def sse():
                try:
                    async for piece, finish in first:
                        yield f"data: {json.dumps(chunk(piece, finish))}\n\n"
                    if body.include_usage():
                        yield f"data: {json.dumps({**chunk('', None, final=True), 'usage': usage()})}\n\n"
                    yield "data: [DONE]\n\n"
                finally:  # the client went away (or the stream ended): nothing more is decoded for it
                    engine_loop().cancel(job)
            return StreamingResponse(sse(), media_type="text/event-stream")
        out, finish = [], None
        async for piece, finish in pieces():
            out.append(piece)
        return JSONResponse(final("".join(out), finish, usage()))

    @app.post("/v1/completions")
    async def completions(body: api.CompletionRequest):
        check(body)
        if body.suffix:
            raise api.APIError(400, "suffix: not supported by this server", param="suffix",
                               code="unsupported_parameter")
        ids = list(body.prompt) if isinstance(body.prompt, list) else served.tokenizer.encode(body.prompt)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": cid, "object": "text_completion", "created": created, "model": served.name}

        def chunk(piece, finish, final=False):
            return {**head, "choices": [] if final else [{"index": 0, "text": piece, "logprobs": None,
                                                            "finish_reason": finish}]}

        def final(text, finish, usage):
            return {**head, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
                    "usage": usage}
        return await run(ids, body, body.max_tokens, chunk, final)

    @app.post("/v1/chat/completions")
    async def chat(body: api.ChatRequest):
        check(body)
        if served.chat_template is None:
            raise api.APIError(400, f"model {served.name!r} has no chat template in its tokenizer metadata; "
                                    "use /v1/completions", param="messages")
        prompt = served.chat_template.render(body.messages)
        ids = served.tokenizer.encode(prompt, add_bos=not (served.chat_template.bos and
                                                           prompt.startswith(served.chat_template.bos)))
        max_tokens = body.max_completion_tokens or body.max_tokens or served.context - len(ids)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": served.name}
        started = []

        def chunk(piece, finish, final=False):
            if final:
                return {**head, "choices": []}
            delta = {"content": piece} if started else {"role": "assistant", "content": piece}
            started.append(True)
            return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        def final(text, finish, usage):
            return {**head, "object": "chat.completion",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "logprobs": None, "finish_reason": finish}], "usage": usage}
        return await run(ids, body, max_tokens, chunk, final)

    return app


async def _first(gen: AsyncIterator) -> AsyncIterator:
    """`gen` with its first item already awaited (so its errors raise here), then the rest."""
    try:
        head = await gen.__anext__()
    except StopAsyncIteration:
        head = None

    async def rest():
        if head is not None:
            yield head
        async for item in gen:
            yield item
    return rest()
