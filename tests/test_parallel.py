"""The decoder on 8 simulated CPU devices (tests/conftest.py): tensor, data and sequence parallel
prefill + decode give one device's logits, compile once, and hold the expected collectives;
past the KV heads each device holds one repeated KV head; weights load straight into their
shards; --mesh errors."""

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

from oscar_jax import cache as oc, sharding
from oscar_jax.models import generate as gen, kv_policy, parallel, weights
from oscar_jax.models.config import ModelConfig
from oscar_jax.models.decoder import Decoder, fold_values, forward_logits
from oscar_jax.models.safetensors_loader import load_hf

HF_LLAMA = Path(__file__).parent / "fixtures" / "hf_tiny" / "llama3"
LAYERS, STEPS = 2, 16
CFG = ModelConfig("llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=LAYERS, num_heads=8,
                  num_kv_heads=4, head_dim=16, rms_eps=1e-6, rope_theta=10000.0,
                  layer_types=("full_attention",) * LAYERS, tie_embeddings=False)
# sink 4 + window 8: the prompts' and the decoded tokens' history crosses slice boundaries under seq.
POLICY = kv_policy.QuantPolicy("oscar-small", kv_policy.QuantConfig(bits=2), 4, 8, clip_k=0.96, clip_v=0.92)
# Two KV heads of eight query heads: a `model` axis of 4 or 8 repeats each on 2 or 4 devices.
CFG_HKV2 = dataclasses.replace(CFG, num_kv_heads=2)
_RNG = np.random.default_rng(2)
# Calibrated-style OSCAR parameters, different for every (layer, KV head): a head served with
# another head's rotation or key shift would change the logits.
OSCAR_HKV2 = kv_policy.oscar_policy(oc.LayerParams.create(
    *(np.linalg.qr(_RNG.standard_normal((LAYERS, 2, 16, 16)))[0].astype(np.float32) for _ in range(2)), 0.96, 0.92,
    num_layers=LAYERS, kv_heads=2, k_shift=_RNG.standard_normal((LAYERS, 2, 16)).astype(np.float32)), sink=4, window=8)
PROMPTS = np.random.default_rng(0).integers(0, CFG.vocab_size, (4, 40)).astype(np.int32)
LENGTHS = np.array([40, 33, 21, 37], np.int32)
MESHES = {"data2-model4": ((2, 4), ("data", "model")), "seq8": ((8,), ("seq",)),
          "model2-seq4": ((2, 4), ("model", "seq"))}


def _mesh(name: str) -> Mesh:
    shape, axes = MESHES[name]
    return Mesh(np.array(jax.devices()).reshape(shape), axes)


def _run(model, mesh, tokens=None, policy=POLICY, steps=STEPS):
    """Prefill the prompts, then `steps` decode steps fed `tokens` [steps, B] (None: greedy);
    returns (logits [1 + steps, B, V], the tokens fed, the final state, decode_step's new compilations)."""
    kv = gen.init_state(model, policy, len(LENGTHS), int(LENGTHS.max()) + steps + 1, mesh=mesh)
    logits, kv = gen.prefill(model, kv, PROMPTS, LENGTHS)
    out, fed = [np.asarray(logits)], []
    compiled = gen.decode_step._cache_size()
    for i in range(steps):
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


REPEATED = {  # mesh devices and axes, KV policy, fold R_V into wo after sharding (as `oscar generate --mesh` does)
    "model4-oscar": ((4,), ("model",), "oscar", False),
    "model8-oscar-folded": ((8,), ("model",), "oscar", True),
    "data2-model4-oscar": ((2, 4), ("data", "model"), "oscar", False),
    "data2-model4-bf16": ((2, 4), ("data", "model"), "bf16", False),
    "model8-fp32": ((8,), ("model",), "fp32", False),
}
REPEATED_STEPS = 6


@pytest.fixture(scope="module")
def hkv2_one_device():
    """The two-KV-head model and its one-device (logits, tokens) per KV policy."""
    model = Decoder(CFG_HKV2, rngs=nnx.Rngs(1))
    policies = {"oscar": OSCAR_HKV2, "bf16": kv_policy.make_policy("bf16"), "fp32": kv_policy.make_policy("fp32")}
    runs = {name: _run(model, None, policy=p, steps=REPEATED_STEPS)[:2] for name, p in policies.items()}
    return model, policies, runs


@pytest.mark.parametrize("case", list(REPEATED))
def test_kv_heads_repeated_past_hkv_give_one_devices_logits(hkv2_one_device, case):
    """Hkv = 2 on model = 4 or 8: each KV head repeated on model / 2 devices, every device one KV
    head (its cache slice and OSCAR parameters) beside its query heads; prefill + decode within
    float tolerance of one device, one compilation, w_qkv split (1/model of the repeated layout
    per device, not replicated), two all-reduces per layer."""
    model, policies, runs = hkv2_one_device
    shape, axes, kv_name, fold = REPEATED[case]
    mesh = Mesh(np.array(jax.devices()[:np.prod(shape)]).reshape(shape), axes)
    m, hq, d = mesh.shape["model"], CFG_HKV2.num_heads, CFG_HKV2.head_dim
    assert parallel.kv_groups(CFG_HKV2, mesh) == m
    sharded, policy = parallel.shard(model, mesh), policies[kv_name]
    if fold:
        sharded, policy = fold_values(sharded, policy)
        sharded = parallel.shard(sharded, mesh)
    want, tokens = runs[kv_name]
    got, _, kv, compiled = _run(sharded, mesh, tokens, policy=policy, steps=REPEATED_STEPS)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert compiled == 1

    w_qkv = sharded.layers[0].w_qkv[...]
    assert w_qkv.shape == (CFG_HKV2.hidden_size, (hq + 2 * m) * d)  # m groups of hq / m queries, k, v
    assert {s.data.shape for s in w_qkv.addressable_shards} == {(w_qkv.shape[0], w_qkv.shape[1] // m)}
    layer, batch = kv.layers[0], len(LENGTHS) // mesh.shape.get("data", 1)
    if kv_name == "oscar":  # (array, its batch axis, its KV-head axis)
        held = [(layer.cache.hist_codes_k, 0, 1), (layer.cache.sink_v, 0, 1), (layer.cache.recent_k, 0, 1),
                (layer.params.rot_k, None, 0), (layer.params.k_shift, None, 0)]
        # head j holds the policy's head j // (m / 2)
        np.testing.assert_array_equal(np.asarray(layer.params.rot_k),
                                      np.repeat(np.asarray(OSCAR_HKV2.layer_params.rot_k[0]), m // 2, axis=0))
    else:
        held = [(layer.k, 0, 2), (layer.v, 0, 2)]
    for x, batch_axis, head_axis in held:
        assert x.shape[head_axis] == m
        for s in x.addressable_shards:
            assert s.data.shape[head_axis] == 1 and (batch_axis is None or s.data.shape[batch_axis] == batch)

    hlo = gen.decode_step.lower(sharded, kv, jnp.zeros(len(LENGTHS), jnp.int32),
                                jax.random.key(0)).compile().as_text()
    assert _collectives(hlo, "all-reduce", "_step_layer") == 2 * LAYERS
    if kv_name == "oscar" or "data" not in axes:  # XLA partitions a dense cache's scatter over `data` with
        assert _collectives(hlo, "all-gather", "_step_layer") == 0  # gathers, repeated KV heads or not


def test_kv_groups_repeat_split_or_replicate():
    """The KV-head layout per mesh: split where `model` divides Hkv, repeated where it is a multiple
    of Hkv dividing the query heads, else replicated (w_qkv whole on every device); `qkv_layout`
    refuses a group count that is neither."""
    mesh = lambda m: Mesh(np.array(jax.devices()[:m]), ("model",))
    assert [parallel.kv_groups(CFG_HKV2, mesh(m)) for m in (1, 2, 4, 8)] == [2, 2, 4, 8]
    assert parallel.kv_groups(CFG, mesh(2)) == 4 and parallel.kv_groups(CFG, mesh(8)) == 8
    smol = dataclasses.replace(CFG, num_heads=12, num_kv_heads=3, intermediate_size=96)  # 3 KV heads on 4
    assert parallel.kv_groups(smol, mesh(4)) == 3
    assert parallel.param_spec(smol, mesh(4), "w_qkv", 2) == P()
    assert parallel.param_spec(CFG_HKV2, mesh(8), "w_qkv", 2) == P(None, "model")
    w = np.arange(64 * (8 + 2 * 2) * 16, dtype=np.float32).reshape(64, -1)
    with pytest.raises(ValueError, match="groups=3; expected a multiple of num_kv_heads=2"):
        parallel.qkv_layout(CFG_HKV2, w, 3)
    back = parallel.qkv_layout(CFG_HKV2, parallel.qkv_layout(CFG_HKV2, w, 8), 2)  # repeat, then undo
    np.testing.assert_array_equal(back, w)


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


@pytest.mark.parametrize("family, tp", [("llama3", 4), ("llama3", 2), ("qwen2", 4)])
def test_weights_load_straight_into_their_shards(family, tp):
    """An HF checkpoint (2 KV heads of 4 query heads) on data x model: w_qkv (and Qwen2's b_qkv)
    column-parallel in KV-head groups, one a device (model=2: each KV head with its 2 query heads,
    as in the checkpoint; model=4: each KV head repeated on 2 devices, each with 1 of its query
    heads); w_gate_up column-parallel, wo and w_down row-parallel, the LM head over vocab columns,
    norms replicated; each device holds its slice only; the forward equals the unsharded model's."""
    mesh = Mesh(np.array(jax.devices()).reshape(8 // tp, tp), ("data", "model"))
    path = HF_LLAMA.parent / family
    model, sharded = load_hf(path), load_hf(path, sharding=mesh)
    cfg, layer = model.cfg, sharded.layers[0]
    specs = {name: getattr(layer, name)[...].sharding.spec for name in ("w_qkv", "wo", "w_gate_up", "w_down",
                                                                        "attn_norm")}
    assert specs == {"w_qkv": P(None, "model"), "wo": P("model"), "w_gate_up": P(None, "model"), "w_down": P("model"),
                     "attn_norm": P()}
    assert sharded.lm_head[...].sharding.spec == P(None, "model")
    assert sharded.embed[...].sharding.spec == P()
    wo = layer.wo[...]
    assert {s.data.shape for s in wo.addressable_shards} == {(wo.shape[0] // tp, wo.shape[1])}
    ckpt = load_file(path / "model.safetensors")
    d, g = cfg.head_dim, cfg.num_heads // tp  # query heads a device
    fused = [("w_qkv", "weight")] + [("b_qkv", "bias")] * cfg.attention_bias
    assert [name for name, _ in fused] == (["w_qkv", "b_qkv"] if family == "qwen2" else ["w_qkv"])
    for name, kind in fused:
        wq, wk, wv = (ckpt[f"model.layers.0.self_attn.{p}_proj.{kind}"].T for p in "qkv")  # [(H,) heads * D]
        for shard in getattr(layer, name)[...].addressable_shards:
            assert shard.data.shape[-1] == (g + 2) * d
            j = (shard.index[-1].start or 0) // shard.data.shape[-1]  # the device's group, KV head j // (tp / Hkv)
            kv = j * cfg.num_kv_heads // tp
            grouped = np.asarray(shard.data).reshape(*shard.data.shape[:-1], g + 2, d)
            np.testing.assert_array_equal(grouped[..., :g, :].reshape(*wq.shape[:-1], -1),
                                          wq[..., j * g * d:(j + 1) * g * d])
            np.testing.assert_array_equal(grouped[..., g, :], wk[..., kv * d:(kv + 1) * d])
            np.testing.assert_array_equal(grouped[..., g + 1, :], wv[..., kv * d:(kv + 1) * d])
    tokens = jnp.arange(24, dtype=jnp.int32).reshape(2, 12)
    np.testing.assert_allclose(np.asarray(jax.jit(forward_logits)(sharded, tokens)),
                               np.asarray(jax.jit(forward_logits)(model, tokens)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cfg", [CFG, CFG_HKV2], ids=["hkv4", "hkv2"])
def test_random_weights_are_created_in_their_shards(cfg):
    """The one-device model's weights, made in their shards: 4 KV heads split over model=4, or 2
    each repeated on 2 devices (the one-device model placed by `parallel.shard`)."""
    mesh = _mesh("data2-model4")
    sharded, plain = parallel.init_decoder(cfg, mesh, seed=3), parallel.shard(Decoder(cfg, rngs=nnx.Rngs(3)), mesh)
    assert sharded.layers[1].w_down[...].sharding.spec == P("model")
    assert sharded.layers[1].w_qkv[...].sharding.spec == P(None, "model")  # 4 KV-head groups over model=4
    assert sharded.layers[1].w_qkv[...].shape == (cfg.hidden_size, (cfg.num_heads + 2 * 4) * cfg.head_dim)
    for a, b in zip(jax.tree.leaves(nnx.state(sharded)), jax.tree.leaves(nnx.state(plain))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-8)  # jit vs eager sampling
    saved, alone = weights.hf_tensors(sharded), weights.hf_tensors(Decoder(cfg, rngs=nnx.Rngs(3)))
    assert saved.keys() == alone.keys()  # saved with each KV head once, whatever the layout
    for name in saved:
        np.testing.assert_allclose(saved[name], alone[name], rtol=1e-6, atol=1e-8, err_msg=name)
    if parallel.kv_groups(cfg, mesh) != cfg.num_kv_heads:  # a state off the mesh the model is laid out for
        with pytest.raises(ValueError, match="laid out in 4 KV-head groups, a state on mesh=None takes 2"):
            gen.init_state(sharded, POLICY, 1, 32)


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
    19.6 GB at 2.28 bits; past Hkv one repeated KV head a device, replicated where `model` neither
    divides Hkv nor is a multiple of it), its weights and collective payloads by formula, and
    docs/serving.md holding its table."""
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
    assert plan.kv_bytes(plan.LLAMA3_70B, 1, m, 16, 1, 16, 4) == 2 * 80 * 1 * 128 * m * 2 / 4  # 8 heads on 16: one
    three = dataclasses.replace(plan.LLAMA3_8B, kv_heads=3, heads=12)  # 3 KV heads on 4: replicated
    assert plan.kv_bytes(three, 1, m, 16, 1, 4, 1) == 2 * 32 * 3 * 128 * m * 2
    assert plan.collective_bytes(plan.LLAMA3_8B, 8, 2, 4, 2) == (2 * 32 * 4 * 4096 * 2, 32 * 4 * 8 * 129 * 4)
    assert plan.collective_bytes(plan.LLAMA3_70B, 1, 1, 32, 8)[1] == 80 * 2 * 129 * 4  # 2 query heads a device
    assert round(plan.weight_bytes(plan.LLAMA3_8B, 1) / 1e9, 2) == 16.06
    h, v = 8192, plan.LLAMA3_70B.vocab  # 70B on model=16: wk, wv of one (repeated) KV head a device
    layer = 2 * h * 8192 / 16 + 2 * h * 128 + 3 * h * 28672 / 16 + 2 * h
    assert plan.weight_bytes(plan.LLAMA3_70B, 16) == 2 * (80 * layer + v * h + h * v / 16 + h)
    assert plan.table() in (Path(__file__).parents[1] / "docs" / "serving.md").read_text()
