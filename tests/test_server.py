"""`oscar serve` end to end: the real SmolLM2 on CPU (OSCAR cache) in a server subprocess on
loopback, driven by the `openai` client, and by raw HTTP for bodies that client cannot send.
Greedy requests give the same text whether they run alone, streamed or among 32 concurrent
streams; bad requests get OpenAI-style 4xx errors and the server keeps serving; a client that
goes away mid-stream frees its sequence; two prompts sharing a prefix move the prefix-cache
metrics; SIGTERM lets a running stream finish, saves the prefix cache and exits 0."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from oscar_jax.models import registry

MODEL = "smollm2"
PROMPTS = ["To be or not to be", "Once upon a time", "The capital of France is", "Shall I compare thee"]
MAX_TOKENS = 6


@dataclasses.dataclass
class Server:
    base: str
    proc: subprocess.Popen
    prefix_dir: Path
    texts: dict = dataclasses.field(default_factory=dict)  # prompt -> its greedy text alone (`alone_text`)

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key="unused", max_retries=0, **kw)

    def alone_text(self, prompt: str) -> str:
        """The greedy text of `prompt` requested alone (once per server: the tests that need it share it)."""
        if prompt not in self.texts:
            self.texts[prompt] = _alone(self.client(), prompt).choices[0].text
        return self.texts[prompt]

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.base}/metrics").text
        match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        return float(match.group(1)) if match else 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    try:
        registry.model_path(MODEL)
    except registry.ModelNotInstalled:
        pytest.skip("smollm2 package missing: run scripts/setup.sh")
    port = _free_port()
    prefix_dir = tmp_path_factory.mktemp("serve") / "prefix-cache"
    oscar = [sys.executable, "-c", "from oscar_jax.models.cli import main; main()"]
    # The server runs its few programs many times: XLA's default code generation, not the
    # unoptimised one tests/conftest.py sets for the compile-bound test processes (this module
    # runs ~1.2x faster so). Where xdist splits the module over two workers, each starts a
    # server: the second loads the programs the first compiled from a compilation cache of this
    # session (its workers' common temporary directory; file-locked, as JAX locks it once it has
    # a size limit).
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_backend_optimization_level")]
    session = tmp_path_factory.getbasetemp()
    session = session.parent if os.environ.get("PYTEST_XDIST_WORKER") else session
    env = {**os.environ, "XLA_FLAGS": " ".join(flags),
           "JAX_COMPILATION_CACHE_DIR": str(session / "serve-compilation-cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_COMPILATION_CACHE_MAX_SIZE": str(1 << 30)}
    proc = subprocess.Popen(
        [*oscar, "serve", "--model", MODEL, "--kv", "oscar", "--port", str(port), "--slots", "8", "--max-len", "1024",
         "--max-queue", "64", "--max-body-bytes", "65536", "--page-tokens", "64", "--prefix-cache-dir",
         str(prefix_dir), "--no-warm-up"],  # programs compile on first use (warm-up: test_serving_engine)
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    srv = Server(f"http://127.0.0.1:{port}", proc, prefix_dir)
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited ({proc.returncode}): {proc.stdout.read()}")
        try:
            if httpx.get(f"{srv.base}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the server did not answer /health within 300 s")
        time.sleep(1)
    yield srv
    if proc.poll() is None:
        proc.kill()


def _alone(client, prompt: str, **kw) -> openai.types.Completion:
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, **kw)


def test_completions_chat_streaming_and_stop_strings(server):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    done = _alone(client, PROMPTS[0])
    text = done.choices[0].text
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == MAX_TOKENS and text
    assert server.texts.setdefault(PROMPTS[0], text) == text  # `alone_text`'s (greedy: as any earlier request)
    streamed = _alone(client, PROMPTS[0], stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text
    # a stop string cuts the text before it, finish "stop"
    words = text.split()
    stop = " " + words[len(words) // 2]
    cut = _alone(client, PROMPTS[0], stop=[stop, "never-produced"])
    assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    reply = chat.choices[0].message
    assert reply.role == "assistant" and reply.content
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reply.content
    assert chunks[-1].choices[0].finish_reason == chat.choices[0].finish_reason


def _raw(server, body: bytes | dict, path: str = "/v1/completions") -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.base}{path}", content=content, headers={"content-type": "application/json"})


def test_bad_requests_get_4xx_and_the_server_keeps_serving(server):
    ok = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    cases = [
        (b"{not json", 400, None),
        ({"prompt": "hello"}, 400, "model"),
        ({**ok, "max_tokens": "many"}, 400, "max_tokens"),
        ({**ok, "max_tokens": 0}, 400, "max_tokens"),
        ({**ok, "temperature": -1}, 400, "temperature"),
        ({**ok, "prompt": "hello " * 1100}, 400, "prompt"),  # longer than a slot's 1024 tokens
        ({**ok, "prompt": [1, 2, 3.5]}, 400, "prompt"),
        ({**ok, "prompt": [True, False]}, 400, "prompt"),
        ({**ok, "prompt": []}, 400, "prompt"),
        ({**ok, "model": "gpt-4"}, 404, "model"),
        ({**ok, "prompt": "x" * 70000}, 413, None),  # past --max-body-bytes
        ({**ok, "n": 2}, 400, "n"),
        ({**ok, "logprobs": 3}, 400, "logprobs"),
        ({**ok, "frobnicate": True}, 400, "frobnicate"),
    ]
    for body, status, param in cases:
        r = _raw(server, body)
        assert r.status_code == status, (body if isinstance(body, bytes) else {**body, "prompt": "..."}, r.text)
        error = r.json()["error"]
        assert error["message"] and error["type"]
        if param:
            assert error["param"] == param and param in error["message"], error
    r = _raw(server, {"model": MODEL, "messages": []}, "/v1/chat/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="hello", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hello", max_tokens=2)
    assert httpx.get(f"{server.base}/health").status_code == 200
    assert client.completions.create(**ok).choices[0].finish_reason in ("length", "stop")


def test_32_concurrent_streams_each_get_their_text_alone(server):
    alone = {p: server.alone_text(p) for p in PROMPTS}
    aclient = openai.AsyncOpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0)

    async def one(prompt: str) -> str:
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                                  temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def run():
        prompts = PROMPTS * 8
        return prompts, await asyncio.gather(*(one(p) for p in prompts))

    prompts, texts = asyncio.run(run())
    assert len(texts) == 32
    for prompt, text in zip(prompts, texts):
        assert text == alone[prompt], prompt


def test_a_client_leaving_mid_stream_frees_its_sequence(server):
    cancelled = 'oscar_requests_total{finish="cancelled"}'
    before = server.metric(cancelled)
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 900, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.base}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = r.iter_lines()
        while not next(events).startswith("data: "):
            pass
    deadline = time.monotonic() + 60  # far less than 900 tokens take
    while server.metric(cancelled) <= before or server.metric("oscar_requests_running") > 0:
        assert time.monotonic() < deadline, "the abandoned request is still running"
        time.sleep(0.5)
    assert server.metric("oscar_kv_pages_used") == 0


def test_prompts_sharing_a_prefix_move_the_hit_rate(server):
    """Sink 64 + window 256 + pages of 64: boundaries at 384, 448, ...; a 512-token prompt
    snapshots at 448, and a second one with the same first 448 tokens restores them."""
    client = server.client()
    ids = [int(x) for x in np.random.default_rng(0).integers(100, 40000, 576)]
    hits, prompts = server.metric("oscar_prefix_cache_hit_tokens_total"), server.metric("oscar_prompt_tokens_total")
    for prompt in (ids[:512], ids[:448] + ids[512:]):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    deadline = time.monotonic() + 30
    while server.metric("oscar_prompt_tokens_total") < prompts + 1024:
        assert time.monotonic() < deadline, "the prompt-token metric did not move"
        time.sleep(0.2)
    assert server.metric("oscar_prefix_cache_hit_tokens_total") == hits + 448
    assert 0 < server.metric("oscar_prefix_cache_hit_rate") <= 448 / 1024


def test_sigterm_finishes_the_running_stream_then_exits_0(server):
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 20, "temperature": 0, "stream": True}
    lines = []
    with httpx.stream("POST", f"{server.base}/v1/completions", json=body, timeout=120) as r:
        for line in filter(None, r.iter_lines()):
            lines.append(line)
            if len(lines) == 1:
                server.proc.send_signal(signal.SIGTERM)
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert lines[-1] == "data: [DONE]" and events[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert server.proc.wait(timeout=60) == 0
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.base}/health", timeout=2)
    assert server.prefix_dir.is_dir(), "the prefix cache was not saved at SIGTERM"


def test_admission_queue_is_bounded_429_then_drains():
    """In process, with a tiny random decoder: past `max_queue` waiting requests a submission is
    refused with 429 and a Retry-After; once the engine has taken the queue, submissions pass."""
    from flax import nnx

    from oscar_jax.models import kv_policy
    from oscar_jax.models.config import ModelConfig
    from oscar_jax.models.decoder import Decoder
    from oscar_jax.models.serving import Engine, Request, api, server as srv

    cfg = ModelConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16, rms_eps=1e-6, rope_theta=1e4,
                      layer_types=("full_attention",))
    engine = Engine(Decoder(cfg, rngs=nnx.Rngs(0)), kv_policy.make_policy("bf16", implementation="xla"),
                    slots=1, max_len=32)
    loop = srv.EngineLoop(engine, srv.Metrics(), max_queue=2)

    async def run():
        job = lambda: srv._Job(Request((1, 2, 3), 2), asyncio.Queue(), asyncio.get_running_loop())
        first = [job(), job()]
        for j in first:
            loop.submit(j)
        with pytest.raises(api.APIError) as refused:
            loop.submit(job())
        assert refused.value.status == 429 and refused.value.headers["Retry-After"]
        loop.start()
        for j in first:  # both run to the end: token lists, then their finish reason
            items = [await j.tokens.get()]
            while not isinstance(items[-1], str):
                items.append(await j.tokens.get())
            assert sum(map(len, items[:-1])) == 2 and items[-1] == "length"
        loop.submit(job())  # the queue is empty again
        loop.stop()

    asyncio.run(run())


def test_byte_tokenizer_round_trips_text_and_marks_other_ids():
    """A model without a tokenizer (random weights) is served with text as UTF-8 bytes; ids past
    255 show as one mark each, and an incomplete UTF-8 sequence is held back by TextStream."""
    from oscar_jax.models.serving import api

    tok = api.ByteTokenizer(1000)
    text = "naïve — ok"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([104, 300, 105, 999]) == "h\u25a1i\u25a1"
    stream = api.TextStream(tok.decode, None)
    ids = tok.encode("é")
    assert stream.feed(ids[:1]) == "" and stream.feed(ids[1:]) == "é"
    with pytest.raises(ValueError, match="vocab_size"):
        api.ByteTokenizer(100)
