"""The decoder on 8 simulated CPU devices (tests/conftest.py): tensor, data and sequence parallel
prefill + decode give one device's logits, compile once, and hold the expected collectives;
weights load straight into their shards; --mesh errors."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file
from jax.sharding import Mesh, PartitionSpec as P

from oscar_jax import sharding
from oscar_jax.models import generate as gen, kv_policy, parallel
from oscar_jax.models.config import ModelConfig
from oscar_jax.models.decoder import Decoder, forward_logits, unfuse
from oscar_jax.models.safetensors_loader import load_hf

HF_LLAMA = Path(__file__).parent / "fixtures" / "hf_tiny" / "llama3"
LAYERS, STEPS = 2, 16
CFG = ModelConfig("llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=LAYERS, num_heads=8,
                  num_kv_heads=4, head_dim=16, rms_eps=1e-6, rope_theta=10000.0,
                  layer_types=("full_attention",) * LAYERS, tie_embeddings=False)
# sink 4 + window 8: the prompts' and the decoded tokens' history crosses slice boundaries under seq.
POLICY = kv_policy.QuantPolicy("oscar-small", kv_policy.QuantConfig(bits=2), 4, 8, clip_k=0.96, clip_v=0.92)
PROMPTS = np.random.default_rng(0).integers(0, CFG.vocab_size, (4, 40)).astype(np.int32)
LENGTHS = np.array([40, 33, 21, 37], np.int32)
MESHES = {"data2-model4": ((2, 4), ("data", "model")), "seq8": ((8,), ("seq",)),
          "model2-seq4": ((2, 4), ("model", "seq"))}


def _mesh(name: str) -> Mesh:
    shape, axes = MESHES[name]
    return Mesh(np.array(jax.devices()).reshape(shape), axes)


def _run(model, mesh, tokens=None):
    """Prefill the prompts, then STEPS decode steps fed `tokens` [STEPS, B] (None: greedy);
    returns (logits [1 + STEPS, B, V], the tokens fed, the final state, decode_step's new compilations)."""
    kv = gen.init_state(model, POLICY, len(LENGTHS), int(LENGTHS.max()) + STEPS + 1, mesh=mesh)
    logits, kv = gen.prefill(model, kv, PROMPTS, LENGTHS)
    out, fed = [np.asarray(logits)], []
    compiled = gen.decode_step._cache_size()
    for i in range(STEPS):
        tok = jnp.argmax(logits, -1).astype(jnp.int32) if tokens is None else jnp.asarray(tokens[i])
        fed.append(np.asarray(tok))
        _, logits, kv = gen.decode_step(model, kv, tok, jax.random.key(i))
        out.append(np.asarray(logits))
    return np.stack(out), np.stack(fed), kv, gen.decode_step._cache_size() - compiled


@pytest.fixture(scope="module")
def model():
    return Decoder(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def one_device(model):
    return _run(model, None)


def _collectives(hlo: str, op: str, scope: str) -> int:
    """Instructions `op` (all-reduce, all-gather) whose op_name contains `scope`."""
    return sum(1 for line in hlo.splitlines()
               if re.search(rf"= \S+ {op}(-start)?\(", line) and scope in line)


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_decoder_on_a_mesh_gives_one_devices_logits(model, one_device, mesh_name):
    """Prefill + 16 decode steps (the same tokens fed) within float tolerance of one device; one
    compilation of the step; the state keeps its shardings; the step's HLO holds two all-reduces
    per layer under tensor parallelism (after wo, after w_down) and one all_gather of the
    attention partials per layer under sequence parallelism, and nothing else per layer."""
    assert jax.device_count() == 8, "tests/conftest.py sets 8 host devices"
    mesh = _mesh(mesh_name)
    want, tokens, _, _ = one_device
    sharded = parallel.shard(model, mesh)
    got, _, kv, compiled = _run(sharded, mesh, tokens)
    # The partitioned program sums the projections in another order: a cached bf16 value can move by
    # one ulp, which moves the logits by ~1e-5.
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert compiled == 1
    cache = kv.layers[0].cache
    assert kv.layers[0].mesh is mesh
    assert cache.hist_codes_k.sharding == kv_policy.state_shardings(kv, mesh).layers[0].cache.hist_codes_k
    seq, tp = mesh.shape.get("seq", 1), mesh.shape.get("model", 1)
    axis = lambda name: name if name in mesh.shape else None
    assert cache.hist_codes_k.sharding.spec == sharding.spec(axis("data"), axis("model"), axis("seq"))
    assert cache.sink_k.sharding.spec == cache.recent_k.sharding.spec == sharding.spec(axis("data"), axis("model"))
    assert sharded.layers[0].w_qkv[...].sharding.spec == (P(None, "model") if tp > 1 else P())

    hlo = gen.decode_step.lower(sharded, kv, jnp.zeros(len(LENGTHS), jnp.int32),
                                jax.random.key(0)).compile().as_text()
    assert _collectives(hlo, "all-reduce", "_step_layer") == (2 * LAYERS if tp > 1 else 0)
    assert _collectives(hlo, "all-gather", "_step_layer") == (LAYERS if seq > 1 else 0)
    assert _collectives(hlo, "all-gather", "shard_map/all_gather") == (LAYERS if seq > 1 else 0)


def test_decode_loop_on_a_mesh_compiles_once_and_decodes_like_one_device(model, one_device):
    """The compiled decode loop (segments of 4 steps) on model 2 x seq 4: the one-device greedy
    tokens, one program for every segment."""
    mesh = _mesh("model2-seq4")
    sharded = parallel.shard(model, mesh)
    _, tokens, _, _ = one_device
    kv = gen.init_state(sharded, POLICY, len(LENGTHS), int(LENGTHS.max()) + STEPS + 1, mesh=mesh)
    logits, kv = gen.prefill(sharded, kv, PROMPTS, LENGTHS)
    compiled = gen._decode._cache_size()
    out, _, _ = gen.decode(sharded, kv, jnp.argmax(logits, -1).astype(jnp.int32), jax.random.key(0),
                           max_new_tokens=STEPS, segment=4)
    assert gen._decode._cache_size() - compiled == 1
    np.testing.assert_array_equal(np.asarray(out), tokens.T)


@pytest.mark.parametrize("mesh_name", ["data2-model4", "model2-seq4"])
def test_chunk_longer_than_the_window_on_a_mesh(model, mesh_name):
    """After the prompts, one teacher-forced chunk of 20 tokens (window 8): the one-device logits
    and cache lengths, with the chunk's first tokens pushed into a history split over `seq`."""
    chunk = np.random.default_rng(1).integers(0, CFG.vocab_size, (len(LENGTHS), 20)).astype(np.int32)

    def run(m, mesh):
        kv = gen.init_state(m, POLICY, len(LENGTHS), int(LENGTHS.max()) + chunk.shape[1], chunk=chunk.shape[1],
                            mesh=mesh)
        _, kv = gen.prefill(m, kv, PROMPTS, LENGTHS)
        logits, kv = gen.extend(m, kv, chunk)
        return np.asarray(logits), np.asarray(kv.lengths)

    mesh = _mesh(mesh_name)
    (want, want_lengths), (got, got_lengths) = run(model, None), run(parallel.shard(model, mesh), mesh)
    np.testing.assert_array_equal(got_lengths, want_lengths)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tp", [4, 2])
def test_weights_load_straight_into_their_shards(tp):
    """An HF checkpoint (2 KV heads) on data x model: w_qkv column-parallel in whole KV-head groups
    where the KV heads divide over `model` (each device's query heads beside their KV head, as in
    the checkpoint), else replicated; w_gate_up column-parallel, wo and w_down row-parallel, the LM
    head over vocab columns, norms replicated; each device holds its slice only; the forward
    equals the unsharded model's."""
    mesh = Mesh(np.array(jax.devices()).reshape(8 // tp, tp), ("data", "model"))
    model, sharded = load_hf(HF_LLAMA), load_hf(HF_LLAMA, sharding=mesh)
    cfg, layer = model.cfg, sharded.layers[0]
    groups = cfg.num_kv_heads % tp == 0
    specs = {name: getattr(layer, name)[...].sharding.spec for name in ("w_qkv", "wo", "w_gate_up", "w_down",
                                                                        "attn_norm")}
    assert specs == {"w_qkv": P(None, "model") if groups else P(), "wo": P("model"),
                     "w_gate_up": P(None, "model"), "w_down": P("model"), "attn_norm": P()}
    assert sharded.lm_head[...].sharding.spec == P(None, "model")
    assert sharded.embed[...].sharding.spec == P()
    wo = layer.wo[...]
    assert {s.data.shape for s in wo.addressable_shards} == {(wo.shape[0] // tp, wo.shape[1])}
    ckpt = load_file(HF_LLAMA / "model.safetensors")
    want = [ckpt[f"model.layers.0.self_attn.{p}_proj.weight"].T for p in "qkv"]  # [H, heads * D]
    split = tp if groups else 1
    local = dataclasses.replace(cfg, num_heads=cfg.num_heads // split, num_kv_heads=cfg.num_kv_heads // split)
    for shard in layer.w_qkv[...].addressable_shards:
        m = (shard.index[1].start or 0) // shard.data.shape[1]
        for got, full in zip(unfuse(local, "w_qkv", np.asarray(shard.data)), want):
            width = full.shape[1] // split
            np.testing.assert_array_equal(got, full[:, m * width:(m + 1) * width])
    tokens = jnp.arange(24, dtype=jnp.int32).reshape(2, 12)
    np.testing.assert_allclose(np.asarray(jax.jit(forward_logits)(sharded, tokens)),
                               np.asarray(jax.jit(forward_logits)(model, tokens)), rtol=1e-5, atol=1e-5)


def test_random_weights_are_created_in_their_shards():
    mesh = _mesh("data2-model4")
    sharded, plain = parallel.init_decoder(CFG, mesh, seed=3), Decoder(CFG, rngs=nnx.Rngs(3))
    assert sharded.layers[1].w_down[...].sharding.spec == P("model")
    assert sharded.layers[1].w_qkv[...].sharding.spec == P(None, "model")  # 4 KV-head groups over model=4
    for a, b in zip(jax.tree.leaves(nnx.state(sharded)), jax.tree.leaves(nnx.state(plain))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-8)  # jit vs eager sampling


@pytest.mark.parametrize("text, message", [
    ("data=2,model=2", "2 x 2 = 4 devices; this process has 8"),
    ("data=2,tensor=4", "unknown axis 'tensor'"),
    ("data=2,data=4", "axis 'data' given twice"),
    ("data:8", "expected axis=size pairs"),
    ("model=0,data=8", "expected a size >= 1"),
])
def test_parse_mesh_refuses_bad_specs(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parallel.parse_mesh(text)


def test_parse_mesh_and_model_divisibility():
    mesh = parallel.parse_mesh("model=2,seq=4")
    assert mesh.axis_names == ("model", "seq") and dict(mesh.shape) == {"model": 2, "seq": 4}
    parallel.check_model(CFG, parallel.parse_mesh("model=8"))  # 8 heads, 128 MLP columns
    with pytest.raises(ValueError, match="6 query heads"):
        parallel.check_model(ModelConfig(**{**CFG.__dict__, "num_heads": 6, "num_kv_heads": 2}),
                             parallel.parse_mesh("model=4,data=2"))


def test_cli_generate_mesh():
    """`oscar generate --mesh`: the one-device tokens on data 2 x model 4; a bad mesh is a usage error."""
    from typer.testing import CliRunner

    from oscar_jax.models.cli import app

    args = ["generate", "--model", str(HF_LLAMA), "--prompt", "hi there", "--kv", "oscar", "--max-new-tokens", "6"]
    plain = CliRunner().invoke(app, args)
    sharded = CliRunner().invoke(app, args + ["--mesh", "data=2,model=4"])
    assert plain.exit_code == sharded.exit_code == 0, sharded.output
    assert sharded.output.splitlines()[0] == plain.output.splitlines()[0]
    bad = CliRunner().invoke(app, args + ["--mesh", "model=8"])
    assert bad.exit_code == 2 and "--mesh model=8" in bad.output and "4 query heads" in bad.output


def test_parallel_plan_formulas_and_the_documented_table():
    """bench/parallel_plan.py: the KV sizes of the 8B and 70B shapes (1M tokens: 8B 137 GB in bf16,
    19.6 GB at 2.28 bits), its collective payloads by formula, and docs/serving.md holding its table."""
    import importlib.util
    import sys

    path = Path(__file__).parents[1] / "bench" / "parallel_plan.py"
    spec = importlib.util.spec_from_file_location("bench_parallel_plan", path)
    plan = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclasses need it registered
    spec.loader.exec_module(plan)
    m = 2 ** 20
    assert plan.kv_bytes(plan.LLAMA3_8B, 1, m, 16, 1, 1, 1) == 2 * 32 * 8 * 128 * m * 2
    assert round(plan.kv_bytes(plan.LLAMA3_8B, 1, m, plan.OSCAR_BITS, 1, 1, 1) / 1e9, 1) == 19.6
    assert plan.kv_bytes(plan.LLAMA3_70B, 4, m, 16, 2, 8, 4) == 2 * 80 * 4 * 8 * 128 * m * 2 / 64
    assert plan.kv_bytes(plan.LLAMA3_70B, 1, m, 16, 1, 16, 4) == 2 * 80 * 8 * 128 * m * 2 / 4  # 8 heads on 16: whole
    assert plan.collective_bytes(plan.LLAMA3_8B, 8, 2, 4, 2) == (2 * 32 * 4 * 4096 * 2, 32 * 4 * 8 * 129 * 4)
    assert round(plan.weight_bytes(plan.LLAMA3_8B, 1) / 1e9, 2) == 16.06
    assert plan.table() in (Path(__file__).parents[1] / "docs" / "serving.md").read_text()
