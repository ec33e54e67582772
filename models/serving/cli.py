"""`oscar serve`: the OpenAI-compatible server (`server.create_app`) on uvicorn."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import typer

from oscar_jax.models.cli import (app, check_implementation, check_writable, console, fail, kv_policy_for, load_model,
                                  model_config)


@app.command()
def serve(
    model: str = typer.Option(..., help="smollm2 | gemma3 | a .gguf file | an HF checkpoint directory"),
    kv: str = typer.Option("oscar", help="KV cache: bf16 | fp8 | oscar | quarot | kivi | int2 | int4 | int8"),
    rotations: Path | None = typer.Option(None, help="calibration artifact directory (--kv oscar)"),
    host: str = typer.Option("127.0.0.1"),
    port: int = typer.Option(8000, min=1, max=65535),
    name: str | None = typer.Option(None, help="the model id clients send (default: --model)"),
    slots: int = typer.Option(8, min=1, help="sequences decoded together (the compiled batch)"),
    max_len: int | None = typer.Option(None, min=2, help="tokens a sequence holds at most (default: the context)"),
    page_tokens: int = typer.Option(256, min=1, help="tokens a KV page holds (OSCAR caches)"),
    num_pages: int | None = typer.Option(None, min=1, help="KV pages in the pool (default: every slot full)"),
    prefill_chunk: int | None = typer.Option(None, min=1, help="chunked prefill of this many tokens (with a prefix "
                                                               "cache: default --page-tokens)"),
    min_bucket: int = typer.Option(16, min=1, help="shortest prefill length (prompts are padded to powers of two)"),
    chunks_per_step: int = typer.Option(1, min=1, help="prefill pieces (a whole prompt or a chunk) per decode step"),
    max_prefills: int | None = typer.Option(None, min=1, help="prompts prefilling at once (default: no limit)"),
    decode_steps: int = typer.Option(8, min=1, help="most decode steps one call runs (tokens stream in rounds of "
                                                    "up to this many)"),
    chunk_attention: str | None = typer.Option(None, help="attention of the prefill chunks: auto, xla, pallas, "
                                                          "cudnn, ... (default: cudnn for oscar on a GPU, else "
                                                          "--kv's, as decode)"),
    warm_up: bool = typer.Option(True, help="compile every serving program before taking requests"),
    prefix_cache: bool = typer.Option(False, help="keep prompt prefixes' KV for later prompts (docs/paged.md)"),
    prefix_cache_dir: Path | None = typer.Option(None, help="restore the prefix cache from DIR at start (if there) "
                                                           "and save it there at SIGTERM; implies --prefix-cache"),
    prefix_cache_bytes: int = typer.Option(8 << 30, min=0, help="host memory for prefix-cache snapshots"),
    max_queue: int = typer.Option(256, min=1, help="requests waiting for admission before 429"),
    max_body_bytes: int = typer.Option(1 << 20, min=1024, help="largest request body"),
    dtype: str = typer.Option("float32", help="weights and activations: float32 | bfloat16"),
    random_weights: bool = typer.Option(False, help="the named architecture with random weights"),
    implementation: str = typer.Option("auto", help="attend() implementation for OSCAR-cache layers"),
):
    """Serve a model over OpenAI's completions and chat API (docs/serving.md). (Unless
    XLA_PYTHON_CLIENT_MEM_FRACTION is set, XLA may take 95% of the device's memory here.)"""
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    import jax.numpy as jnp
    import uvicorn

    from oscar_jax.models import registry, tokenizer as tokenizer_lib
    from oscar_jax.models.serving import Engine, api, server

    if dtype not in ("float32", "bfloat16"):
        fail(f"--dtype {dtype!r}: expected float32 or bfloat16")
    check_implementation(implementation)
    if prefix_cache_dir is not None and prefix_cache_dir.exists() and not prefix_cache_dir.is_dir():
        fail(f"--prefix-cache-dir {prefix_cache_dir} is a file; expected a directory (restored from, saved to)")
    if prefix_cache_dir is not None and not prefix_cache_dir.exists():  # saved there at SIGTERM
        check_writable(prefix_cache_dir, "--prefix-cache-dir", directory=True)
    if rotations and kv != "oscar":
        fail(f"--kv {kv} takes no --rotations; calibrated rotations are for --kv oscar")
    cfg = model_config(model, random_weights=random_weights)
    context = cfg.max_position or max_len or 8192
    if max_len is not None and cfg.max_position and max_len > cfg.max_position:
        fail(f"--max-len {max_len}: the model's context is {cfg.max_position} tokens")
    max_len = max_len or context
    policy = kv_policy_for(kv, rotations, cfg, implementation)
    decoder, tokenizer = load_model(model, dtype=jnp.dtype(dtype), random_weights=random_weights)
    if tokenizer is None:  # random weights or an HF directory without tokenizer.json: text as bytes
        console.print(f"{model} has no tokenizer: text is served as UTF-8 bytes, one token a byte", style="yellow")
        tokenizer = api.ByteTokenizer(decoder.cfg.vocab_size)
    prefix_cache = prefix_cache or prefix_cache_dir is not None
    try:
        engine = Engine(decoder, policy, slots=slots, max_len=max_len, page_tokens=page_tokens, num_pages=num_pages,
                        min_bucket=min_bucket, prefill_chunk=prefill_chunk or (page_tokens if prefix_cache else None),
                        chunks_per_step=chunks_per_step, max_prefills=max_prefills, prefix_cache=prefix_cache,
                        prefix_cache_bytes=prefix_cache_bytes, chunk_attention=chunk_attention,
                        decode_steps=decode_steps)
    except ValueError as e:
        fail(str(e))
    if warm_up:
        start = time.perf_counter()
        compiled = engine.warm_up()
        console.print(f"warm-up: {compiled} programs compiled in {time.perf_counter() - start:.1f} s", highlight=False)
    if prefix_cache_dir is not None and prefix_cache_dir.exists():
        try:
            console.print(f"prefix cache: {engine.load_prefix_cache(prefix_cache_dir)} entries from {prefix_cache_dir}",
                          highlight=False)
        except ValueError as e:
            console.print(f"prefix cache not restored, starting cold: {e}", style="yellow", highlight=False)
    source = None if isinstance(tokenizer, api.ByteTokenizer) else tokenizer_lib.read_chat_template(
        registry.model_path(model) if model in registry.MODELS else model)
    token_text = lambda i: tokenizer.tokenizer.id_to_token(i) if i is not None else ""  # a TextTokenizer's
    template = api.ChatTemplate(source, bos=token_text(tokenizer.bos_id),
                                eos=token_text(tokenizer.eos_ids[0] if tokenizer.eos_ids else None)) if source else None
    served = server.ServedModel(name or model, engine, tokenizer, template, min(context, engine.capacity),
                                prefix_cache_dir)
    console.print(f"serving {served.name} ({policy.name} cache, {slots} slots, {max_len} tokens each) "
                  f"on http://{host}:{port}", highlight=False)
    http = uvicorn.Server(uvicorn.Config(server.create_app(served, max_queue=max_queue, max_body_bytes=max_body_bytes),
                                         host=host, port=port, log_level="warning"))
    # On SIGTERM uvicorn stops accepting, lets the running responses finish, stops the engine (and
    # saves the prefix cache), then raises the signal again for the handler it found: this one,
    # so the exit code is 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    http.run()
    console.print("stopped: every running request finished", highlight=False)
