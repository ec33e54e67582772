"""The serving path's structure on a tiny decoder (CPU): the decode step updates every layer's
cache in place and copies no cache or weight array; the layer-by-layer prefill equals a full
forward followed by the per-layer cache write, in logits and cache contents, for every policy;
its memory follows the token chunk and one layer; the segmented decode loop; `oscar bench`."""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from oscar_jax import cache as oc
from oscar_jax.models import generate as gen
from oscar_jax.models import kv_policy
from oscar_jax.models.config import ModelConfig
from oscar_jax.models.decoder import Decoder, forward_logits, prefill_layer

LLAMA = ModelConfig("llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
                    num_kv_heads=2, head_dim=32, rms_eps=1e-5, rope_theta=1e4, layer_types=("full_attention",) * 3)


def tiny_gemma() -> ModelConfig:
    """(2 sliding + 1 global) x 2 layers, window 8, qk-norm, one KV head."""
    return ModelConfig(
        family="gemma3", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=6, num_heads=4,
        num_kv_heads=1, head_dim=32, rms_eps=1e-6, rope_theta=1e6, rope_local_theta=1e4,
        layer_types=("sliding_attention", "sliding_attention", "full_attention") * 2, sliding_window=8,
        qk_norm=True, activation="gelu_tanh", query_pre_attn_scalar=32.0, embed_scale=True, post_norms=True,
        bos_token_id=2, eos_token_ids=(1,), hf_model_type="gemma3_text")


def _hlo_copies_of_arguments(compiled) -> list[str]:
    """Arguments of ndim >= 2 (cache arrays, weights) that the compiled module copies, transposes
    or slices as a whole: the op_name of each parameter read by such an instruction."""
    text = compiled.as_text()
    params = {name: (op, shape.count(",") + 1) for name, shape, op in re.findall(
        r"%(\S+) = \w+\[([\d,]+)\]\S* parameter\(\d+\), metadata=\{op_name=\"([^\"]+)\"", text)}
    copied = []
    for opcode, operands in re.findall(r"= \S+ (copy|transpose|slice|dynamic-slice)\(([^)]*)\)", text):
        for operand in operands.split(","):
            op, ndim = params.get(operand.strip().lstrip("%"), (None, 0))
            if op is not None and ndim >= 2:
                copied.append(f"{opcode} of {op}")
    return copied


@pytest.mark.parametrize("name", ["bf16", "fp8", "oscar"])
def test_decode_step_updates_every_cache_in_place(name):
    """bf16 weights, batch 2, 1024 positions: the compiled step aliases every cache byte from input
    to output (donated and updated in place), no instruction copies, transposes or slices a cache
    array or a weight, and the dense bf16 step holds less than one layer's K cache in temporaries
    (its attention reads the cache as it lies)."""
    model = Decoder(LLAMA, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    policy = kv_policy.make_policy(name, implementation="xla")
    kv = gen.init_state(model, policy, 2, 1024)
    compiled = gen.decode_step.lower(model, kv, jnp.zeros((2,), jnp.int32), jax.random.key(0)).compile()
    memory = compiled.memory_analysis()
    assert memory.alias_size_in_bytes >= kv_policy.nbytes(kv)
    assert _hlo_copies_of_arguments(compiled) == []
    if name == "bf16":
        assert memory.temp_size_in_bytes < kv.layers[0].k.size * kv.layers[0].k.dtype.itemsize


def test_hlo_copy_check_finds_a_copied_cache():
    """The check above finds a step that copies a layer's cache before updating it."""
    def step(cache, x):
        return cache.at[0].set(cache[1]) + 0, jnp.swapaxes(cache, 0, 1).sum() + x

    compiled = jax.jit(step).lower(jnp.ones((4, 8, 16)), jnp.float32(1)).compile()
    assert _hlo_copies_of_arguments(compiled)


POLICIES = ["fp32", "bf16", "fp8", "kivi", "int4", "oscar"]


@pytest.mark.parametrize("name", POLICIES)
def test_layerwise_prefill_equals_forward_then_cache_write(name):
    """Ragged prompts (37 and 20 tokens) through `generate.prefill` in 8-token chunks: the logits
    equal a full forward's at each prompt's last token, and every layer's cache equals that
    layer's `write_prompt` of the forward's captured k, v (the one-shot prefill)."""
    model = Decoder(tiny_gemma(), rngs=nnx.Rngs(1))
    policy = kv_policy.make_policy(name, implementation="xla")
    rng = np.random.default_rng(7)
    lengths = np.array([37, 20], np.int32)
    tokens = rng.integers(3, 97, (2, 37)).astype(np.int32)
    kv = gen.init_state(model, policy, 2, 48)
    logits, kv = gen.prefill(model, kv, tokens, lengths, chunk_tokens=16)
    want = np.asarray(jax.jit(forward_logits)(model, jnp.asarray(tokens), jnp.asarray(lengths)))
    np.testing.assert_allclose(np.asarray(logits), want[[0, 1], lengths - 1], rtol=2e-5, atol=2e-5)
    positions = jnp.broadcast_to(jnp.arange(37, dtype=jnp.int32), (2, 37))
    _, _, cap = model(jnp.asarray(tokens), positions, lengths=jnp.asarray(lengths), capture_qkv=True)
    oneshot = gen.init_state(model, policy, 2, 48)
    for i, layer in enumerate(oneshot.layers):
        want_layer = jax.jit(kv_policy.write_prompt)(layer, cap.k[i], cap.v[i], jnp.asarray(lengths))
        _assert_same_contents(kv.layers[i], want_layer, lengths)


def _assert_same_contents(got, want, lengths):
    """Two caches of one layer hold the same tokens up to the rounding of two compiled programs:
    stored floats within one unit of their dtype's last place; a quantised history (dequantised)
    within one level at the rare code that sits on a rounding boundary, else within 1e-5."""
    if isinstance(got, kv_policy.OscarLayer):
        for g, w in zip(oc.dense_view(got.cache)[:2], oc.dense_view(want.cache)[:2]):
            held = np.asarray(oc.dense_view(got.cache)[2])[:, None, :, None]
            g, w = np.where(held, np.asarray(g), 0), np.where(held, np.asarray(w), 0)
            level = np.abs(w).max()  # a bound on one level of any token's quantiser
            assert np.abs(g - w).max() <= level
            assert np.mean(np.abs(g - w) > 1e-5) < 0.01
        return
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g), np.asarray(w)
        if g.dtype.kind in "iub":
            np.testing.assert_array_equal(g, w)
            continue
        eps = max(float(jnp.finfo(g.dtype).eps), 1e-5)  # float32: a few ulps of two matmul orders
        if g.ndim == 4:  # [B, T, Hkv, D] or [B, Hkv, T, D]: compare held positions only
            t_axis = 1 if g.shape[1] >= lengths.max() and g.shape[2] < g.shape[1] else 2
            held = np.arange(g.shape[t_axis]) < lengths[:, None]
            held = held[:, :, None, None] if t_axis == 1 else held[:, None, :, None]
            g, w = np.where(held, g.astype(np.float32), 0), np.where(held, w.astype(np.float32), 0)
        np.testing.assert_allclose(g.astype(np.float32), w.astype(np.float32), rtol=eps, atol=1e-5)


def test_prefill_layer_memory_follows_the_chunk_not_the_prompt():
    """One prefill layer of a 2048-token prompt: temporaries grow with the token chunk, and with
    a 128-token chunk stay under what the unchunked MLP alone would hold ([T, I] float32 gate
    and up activations); one layer's q, k, v and output and a block of scores bound the rest."""
    cfg = dataclasses.replace(LLAMA, intermediate_size=32768, num_heads=2, num_kv_heads=1, num_layers=1,
                              layer_types=("full_attention",))
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    t = 2048
    kv = gen.init_state(model, kv_policy.make_policy("bf16"), 1, t)
    x = jax.ShapeDtypeStruct((1, t, cfg.hidden_size), jnp.float32)

    def temp(chunk):
        lowered = prefill_layer.lower(model.layers[0].arrays(), x, jnp.array([t], jnp.int32), kv.layers[0],
                                      cfg=cfg, kind="full_attention", chunk=chunk, attention="xla")
        return lowered.compile().memory_analysis().temp_size_in_bytes

    small, large = temp(128), temp(1024)
    unchunked_mlp = 2 * t * cfg.intermediate_size * 4
    one_layer_qkvo = t * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim * 4
    scores_block = cfg.num_heads * 2048 * t * 4  # the XLA path's query block of scores (f32)
    print(f"\nprefill layer temporaries: chunk 128 -> {small:,} B, chunk 1024 -> {large:,} B")
    assert small < large
    assert small < unchunked_mlp
    assert small < 2 * one_layer_qkvo + 4 * scores_block  # scores, mask, probabilities


def test_segmented_decode_equals_one_call_and_reports_each_segment():
    """Decoding 20 tokens in segments of 3 gives the tokens of one 64-step segment, and calls
    on_segment after each of the ceil(19 / 3) calls with the columns filled."""
    model = Decoder(LLAMA, rngs=nnx.Rngs(2))
    policy = kv_policy.make_policy("oscar", implementation="xla")
    runs, seen = [], []
    for segment in (64, 3):
        kv = gen.init_state(model, policy, 2, 40)
        logits, kv = gen.prefill(model, kv, np.arange(3, 23).reshape(2, 10), np.array([10, 7]))
        first = jnp.argmax(logits, -1).astype(jnp.int32)
        out, count, _ = gen.decode(model, kv, first, jax.random.key(0), max_new_tokens=20, segment=segment,
                                   on_segment=seen.append if segment == 3 else None)
        runs.append(np.asarray(out))
    np.testing.assert_array_equal(runs[0], runs[1])
    assert seen == [4, 7, 10, 13, 16, 19, 20]


def test_oscar_bench_cli_end_to_end(tmp_path):
    """`oscar bench` on a tiny HF checkpoint: one row per scheme and context, the batch the
    largest that fits the budget, bits/element and throughput against bf16 filled in, a TTFT,
    the JSON in the results schema, the plot written."""
    from typer.testing import CliRunner

    from oscar_jax.models.bench import sequence_bytes
    from oscar_jax.models.cli import app, main  # noqa: F401  (main registers the commands)
    import oscar_jax.models.bench  # noqa: F401

    out = tmp_path / "bench.json"
    budget = 0.002
    result = CliRunner().invoke(app, ["bench", "--model", "tests/fixtures/hf_tiny/llama3", "--kv", "bf16,oscar",
                                      "--contexts", "256,512", "--steps", "8", "--segment", "4",
                                      "--kv-budget-gib", str(budget), "--dtype", "float32", "--out", str(out)])
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    assert {"device", "jax", "commit", "command", "date", "rows"} <= set(record)
    rows = record["rows"]
    assert [(r["kv"], r["context"]) for r in rows] == [("bf16", 256), ("oscar", 256), ("bf16", 512), ("oscar", 512)]
    from oscar_jax.models import registry

    decoder, _ = registry.load("tests/fixtures/hf_tiny/llama3")
    for r in rows:
        assert "error" not in r, r
        policy = kv_policy.make_policy(r["kv"])
        assert r["batch"] == int(budget * 2 ** 30 // sequence_bytes(decoder, policy, r["context"]))
        assert r["tpot_p50_ms"] > 0 and r["ttft_s"] > 0 and r["step_over_roofline"] > 0
        assert r["ceiling_vs_bf16"] == pytest.approx(16 / r["bits_per_element"])
        assert r["throughput_vs_bf16"] == pytest.approx(
            r["decode_tokens_per_s"] / next(b["decode_tokens_per_s"] for b in rows
                                            if b["kv"] == "bf16" and b["context"] == r["context"]))
    assert [r["bits_per_element"] for r in rows if r["kv"] == "bf16"] == [16.0, 16.0]
    assert out.with_suffix(".png").stat().st_size > 0


def test_oscar_bench_file_of_a_cut_off_run_lists_the_cells_left(tmp_path, monkeypatch):
    """A run stopped in its second cell leaves a file holding the first cell's row and every
    later cell marked as not run, in the order the run takes them."""
    from typer.testing import CliRunner

    from oscar_jax.models import bench
    from oscar_jax.models.cli import app, main  # noqa: F401  (main registers the commands)

    def cell(model, name, policy, context, spec, bandwidth, batch):
        if (name, context) != ("bf16", 256):
            raise KeyboardInterrupt  # the run is stopped here
        return {"kv": name, "context": context, "batch": 3, "tpot_p50_ms": 1.0, "step_over_roofline": 1.0,
                "decode_tokens_per_s": 3000.0}

    monkeypatch.setattr(bench, "bench_scheme", cell)
    monkeypatch.setattr(bench, "copy_bandwidth", lambda: 1e11)
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", "--model", "tests/fixtures/hf_tiny/llama3", "--kv", "bf16,oscar",
                                      "--contexts", "256,512", "--dtype", "float32", "--out", str(out)])
    assert result.exit_code != 0  # click aborts on the interrupt
    rows = json.loads(out.read_text())["rows"]
    assert [(r["kv"], r["context"], r.get("error")) for r in rows] == [
        ("bf16", 256, None), ("oscar", 256, bench.NOT_RUN), ("bf16", 512, bench.NOT_RUN), ("oscar", 512, bench.NOT_RUN)]


def test_bench_shrinks_a_batch_whose_decode_loop_does_not_fit():
    """int8 attends in XLA, whose temporaries grow with the batch. Given a device whose memory
    holds the budget's batch of int8 states but not their compiled decode loop (the loop's
    memory analysis at that batch and at half of it, taken here, brackets the limit), the row
    runs a batch between the two, says why, and its loop fits the limit."""
    from oscar_jax.models import bench, registry

    model, _ = registry.load("tests/fixtures/hf_tiny/llama3")
    policy = kv_policy.make_policy("int8")
    spec = bench.BenchSpec(("int8",), (512,), steps=4, segment=2, budget_gib=0.004, ttft=())
    budget = bench.budget_batch(bench.sequence_bytes(model, policy, 512), spec)

    def need(batch):
        kv = jax.eval_shape(lambda: policy.init(model.cfg, batch, 512))
        use = gen.compile_decode(model, kv, jax.random.key(1), max_new_tokens=7).memory_analysis()
        return use.argument_size_in_bytes + use.temp_size_in_bytes

    limit = (need(budget // 2) + need(budget)) / 2
    assert bench.per_device_bytes(model, budget * bench.sequence_bytes(model, policy, 512), None) < limit
    row = bench.bench_scheme(model, "int8", policy, 512, dataclasses.replace(spec, device_bytes=int(limit / 0.95)),
                             bandwidth=1e11)
    assert budget // 2 <= row["batch"] < budget, (row["batch"], budget)
    assert row["batch_limited_by"] == "the decode loop's temporaries"
    assert need(row["batch"]) <= limit and row["decode_tokens_per_s"] > 0


@pytest.mark.gpu
@pytest.mark.gpu_serving
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("name", ["bf16", "oscar"])
def test_gpu_serving_path_matches_the_xla_path(name):
    """On the GPU, bf16 weights: the prefill with cuDNN's flash attention and the decode steps
    (cuDNN for the bf16 cache, the Mosaic GPU kernel for OSCAR's) against the same calls through
    XLA attention, ragged prompts (300 and 177 tokens, a 64-token chunk), 4 decode steps:
    logits within bf16 rounding of each other, and the greedy tokens agree."""
    model = Decoder(dataclasses.replace(LLAMA, head_dim=128, num_heads=8, num_kv_heads=2, hidden_size=256),
                    rngs=nnx.Rngs(3), dtype=jnp.bfloat16)
    rng = np.random.default_rng(11)
    lengths = np.array([300, 177], np.int32)
    tokens = rng.integers(0, 64, (2, 300)).astype(np.int32)
    runs = []
    for fast in (True, False):
        policy = kv_policy.make_policy(name, implementation="auto" if fast else "xla")
        kv = gen.init_state(model, policy, 2, 320)
        logits, kv = gen.prefill(model, kv, tokens, lengths, chunk_tokens=128, attention="auto" if fast else "xla")
        out = [np.asarray(logits)]
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
        for i in range(4):
            tok, logits, kv = gen.decode_step(model, kv, tok, jax.random.key(i))
            out.append(np.asarray(logits))
        runs.append(np.stack(out))
    scale = np.abs(runs[1]).max()
    print(f"\n{name}: max|logit diff| fast vs XLA = {np.abs(runs[0] - runs[1]).max():.3g} (|logits| <= {scale:.2f})")
    np.testing.assert_allclose(runs[0], runs[1], atol=0.05 * scale, rtol=0)
    assert (runs[0].argmax(-1) == runs[1].argmax(-1)).mean() >= 0.9


@pytest.mark.gpu
@pytest.mark.gpu_serving
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_gpu_dense_chunk_on_cudnn_matches_float32(dtype):
    """A 64-query chunk appended to ragged dense caches (held 0, 37 and 700 of 1024 positions,
    random values in every position beyond them) and attended on cuDNN against the same call in
    float32 XLA: outputs within bf16 rounding (2% of the largest |o|). Admitting one unheld or
    later position moves an output by O(1)."""
    from oscar_jax.models import dense_cache as dc
    rng = np.random.default_rng(5)
    b, t_max, hkv, hq, d, c = 3, 1024, 2, 8, 128, 64
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    lengths = jnp.array([0, 37, 700], jnp.int32)
    q, k, v = draw(b, c, hq, d).astype(jnp.bfloat16), draw(b, c, hkv, d), draw(b, c, hkv, d)
    held_k, held_v = 3 * draw(b, t_max, hkv, d), 3 * draw(b, t_max, hkv, d)
    outs = []
    for implementation in ("cudnn", "xla"):
        layer = dc.DenseCache.init(b, hkv, d, t_max, jnp.dtype(dtype), implementation=implementation)
        layer = dc.write_prompt(layer, held_k, held_v, lengths)
        o, after = jax.jit(dc.append_attend, static_argnums=4)(layer, q, k, v, d ** -0.5)
        np.testing.assert_array_equal(np.asarray(after.lengths), np.asarray(lengths) + c)
        outs.append(np.asarray(o, np.float32))
    scale = np.abs(outs[1]).max()
    print(f"\n{dtype}: max|o diff| cuDNN vs float32 = {np.abs(outs[0] - outs[1]).max():.3g} (|o| <= {scale:.2f})")
    np.testing.assert_allclose(outs[0], outs[1], atol=0.02 * scale, rtol=0)


@pytest.mark.gpu
@pytest.mark.gpu_serving
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("chunk", [64, 320])
@pytest.mark.parametrize("name", ["bf16", "fp8", "oscar"])
def test_gpu_extend_chunks_on_cudnn_match_the_xla_path(name, chunk):
    """On the GPU, bf16 weights: ragged prompts (300 and 177 tokens) then extend chunks of 64
    tokens (three) or 320 (two; longer than OSCAR's window of 256) whose attention runs on
    cuDNN's flash attention (the dense caches' "auto", fp8 read as bf16; OSCAR's "cudnn", the
    cache dequantised to bf16 with its ring, or the chunk's own tokens, in front) against the
    same chunks through XLA attention: logits within bf16 rounding of each other, and the
    greedy tokens agree."""
    model = Decoder(dataclasses.replace(LLAMA, head_dim=128, num_heads=8, num_kv_heads=2, hidden_size=256),
                    rngs=nnx.Rngs(3), dtype=jnp.bfloat16)
    rng = np.random.default_rng(12)
    lengths = np.array([300, 177], np.int32)
    tokens = rng.integers(0, 64, (2, 300)).astype(np.int32)
    chunks = rng.integers(0, 64, (3 if chunk == 64 else 2, 2, chunk)).astype(np.int32)
    runs = []
    for implementation in ("cudnn" if name == "oscar" else "auto", "xla"):
        policy = kv_policy.with_implementation(kv_policy.make_policy(name), implementation)
        kv = gen.init_state(model, policy, 2, 1024, chunk=chunk)
        _, kv = gen.prefill(model, kv, tokens, lengths)
        out = []
        for tokens_c in chunks:
            logits, kv = gen.extend(model, kv, tokens_c)
            out.append(np.asarray(logits))
        runs.append(np.stack(out))
    scale = np.abs(runs[1]).max()
    print(f"\n{name}: max|logit diff| cuDNN vs XLA = {np.abs(runs[0] - runs[1]).max():.3g} (|logits| <= {scale:.2f})")
    np.testing.assert_allclose(runs[0], runs[1], atol=0.05 * scale, rtol=0)
    assert (runs[0].argmax(-1) == runs[1].argmax(-1)).mean() >= 0.9


def test_ctrl_c_stops_a_long_generation_promptly(tmp_path):
    """`oscar generate` of 400K tokens (minutes of decoding on this tiny model) gets SIGINT once
    it says its decode loop runs and stops within seconds: the loop runs in
    segments, the host sees the interrupt between them, prints the text so far and exits 130."""
    import json as json_lib
    import os
    import select
    import signal
    import subprocess
    import sys
    import time

    config = json_lib.loads(open("tests/fixtures/hf_tiny/llama3/config.json").read())
    (tmp_path / "config.json").write_text(json_lib.dumps({**config, "max_position_embeddings": 1 << 20}))
    proc = subprocess.Popen(
        [sys.executable, "-c", "from oscar_jax.models.cli import main; main()", "generate", "--model", str(tmp_path),
         "--random-weights", "--kv", "bf16", "--prompt", "hi", "--max-new-tokens", "400000"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        seen = b""  # the first decode segment has run
        deadline = time.monotonic() + 120
        while b"decoding" not in seen and time.monotonic() < deadline and proc.poll() is None:
            if select.select([proc.stdout], [], [], 1)[0]:
                seen += os.read(proc.stdout.fileno(), 4096)
        assert proc.poll() is None and b"decoding" in seen, seen.decode()
        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        output = seen.decode() + proc.communicate(timeout=60)[0]
        stopped_in = time.monotonic() - t0
    finally:
        proc.kill()
    print(f"\nstopped {stopped_in:.1f} s after SIGINT")
    assert proc.returncode == 130, output
    new_tokens = int(re.search(r"interrupted after (\d+) new tokens", output).group(1))
    assert 0 < new_tokens < 400000 and re.search(rf"new tokens\W+{new_tokens}\b", output)
    assert stopped_in < 15
