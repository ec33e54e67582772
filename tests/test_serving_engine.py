"""The serving engine (oscar_jax.models.serving): every request's output through continuous
batching (ragged prompts, preemption by swapping to host, per-request sampling) equals the
same request run alone through the engine, and greedy outputs equal `generate.generate`'s
(the contiguous cache); a request that can never fit is refused while the others go on; the
scheduler conserves pages and slots over random arrivals and finishes (hypothesis)."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings

from oscar_jax.models import generate as gen
from oscar_jax.models import kv_policy
from oscar_jax.models.config import ModelConfig
from oscar_jax.models.decoder import Decoder
from oscar_jax.models.serving import Engine, Request
from oscar_jax.models.serving import programs
from oscar_jax.models.serving.programs import default_chunk_attention
from oscar_jax.models.serving.scheduler import Scheduler

VOCAB = 97
SLOTS, PAGE, MAX_LEN, NUM_PAGES = 3, 16, 76, 6  # 4 + 8 + 4 pages of 16: a slot holds 76 tokens


def _model(layer_types: tuple[str, ...], window: int | None = None) -> Decoder:
    """A tiny random decoder whose weights are scaled up so that its greedy tokens follow the
    context (at the usual 0.02 init it repeats one token whatever the cache holds)."""
    cfg = ModelConfig(family="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                      num_layers=len(layer_types), num_heads=4, num_kv_heads=2, head_dim=32, rms_eps=1e-6,
                      rope_theta=1e4, layer_types=layer_types, sliding_window=window)
    graph, state = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
    return nnx.merge(graph, jax.tree.map(lambda x: x * 8 if x.ndim >= 2 else x, state))


MODELS = {
    "llama": lambda: _model(("full_attention",) * 2),
    "local-global": lambda: _model(("sliding_attention", "full_attention", "sliding_attention"), window=6),
}
POLICIES = {
    "oscar": kv_policy.QuantPolicy("oscar-small", kv_policy.QuantConfig(bits=2), 4, 8, clip_k=0.96, clip_v=0.92,
                                   implementation="xla"),
    "fp8": kv_policy.make_policy("fp8", implementation="xla"),
}


def _requests() -> list[Request]:
    rng = np.random.default_rng(0)
    reqs = [Request(tuple(int(x) for x in rng.integers(0, VOCAB, size=int(rng.integers(5, 40)))),
                    int(rng.integers(8, 25))) for _ in range(5)]
    reqs[3] = Request(reqs[3].prompt, reqs[3].max_tokens, temperature=0.8, top_p=0.9, seed=3)
    reqs[4] = Request(reqs[4].prompt, 30, stop_ids=(reqs[4].prompt[-1],))
    return reqs


def _engine(model, policy, chunk: int | None, decode_steps: int = 8, num_pages: int = NUM_PAGES) -> Engine:
    return Engine(model, policy, slots=SLOTS, max_len=MAX_LEN, page_tokens=PAGE, num_pages=num_pages,
                  prefill_chunk=chunk, decode_steps=decode_steps)


@pytest.mark.parametrize("model_name,policy_name,chunk,decode_steps,num_pages", [
    ("llama", "oscar", None, 2, 6), ("local-global", "oscar", 4, 3, 5), ("local-global", "oscar", 16, 8, 5),
    ("llama", "fp8", None, 8, 6)])
def test_engine_output_equals_request_alone(model_name, policy_name, chunk, decode_steps, num_pages):
    """chunk: prompts enter in a first prefill of 1..C tokens, then chunks of C before each
    round's decode steps (C = 16: chunks twice the oscar policy's window of 8); decode_steps:
    the most steps a decode call runs (rounds of several steps, with sequences stopping inside them); num_pages: a pool
    smaller than the three slots' need (OSCAR sequences are swapped out)."""
    model, policy = MODELS[model_name](), POLICIES[policy_name]
    reqs = _requests()
    jax.clear_caches()  # the engine's programs compile here, whichever test ran before in this process
    engine = _engine(model, policy, chunk, decode_steps, num_pages)
    ids = [engine.submit(r) for r in reqs[:3]]
    with pytest.raises(ValueError, match="can never fit: a prompt of 70 tokens plus max_tokens=10 needs 79"):
        engine.submit(Request((1,) * 70, 10))
    ids += [engine.submit(r) for r in reqs[3:]]
    together = engine.run()
    assert all(together[i].finish is not None for i in ids)
    assert engine.decode_tokens == sum(len(together[i].tokens) - 1 for i in ids)  # the first from prefill
    for layer in engine.state.layers:  # no append ever missed its page
        if isinstance(layer, kv_policy.PagedLayer):
            assert not np.asarray(layer.cache.overflow).any()
    if engine.paged:
        assert engine.preemptions >= 1
        assert max(engine.pages_used) <= num_pages and engine.pages_used[-1] == 0
        assert engine.scheduler.allocator.num_free == num_pages
    warm = engine.compiles
    for i, req in zip(ids, reqs):
        alone = _engine(model, policy, chunk, decode_steps, num_pages)
        alone.submit(req)
        assert alone.run()[0] == together[i], f"request {i}"
        assert alone.compiles == 0, "a request alone compiled a new program after the warm-up"
    assert warm > 0
    one_step = _engine(model, policy, chunk, 1, num_pages)  # a sampled request's tokens, round by round
    one_step.submit(reqs[3])
    assert one_step.run()[0] == together[ids[3]]
    greedy = [(i, req) for i, req in zip(ids, reqs) if req.temperature == 0 and not req.stop_ids]
    for (i, req), tokens in zip(greedy, _contiguous(model, policy, [req for _, req in greedy], chunk)):
        assert together[i].tokens == tokens, f"request {i} against generate"


def _contiguous(model, policy, reqs: list[Request], chunk: int | None) -> list[list[int]]:
    """Greedy tokens of each of `reqs` through `generate` on a contiguous cache. Without chunk:
    one `generate.generate` over the ragged batch, each row cut to its max_tokens (a row's greedy
    tokens depend neither on the other rows nor on the tokens after them). With chunk, one
    request at a time on a one-row cache: prefill of its first 1..chunk tokens, extend chunks,
    then one-token extends (the caches of one capacity: their programs compile once)."""
    if chunk is None:
        most = max(r.max_tokens for r in reqs)
        out = gen.generate(model, policy, [list(r.prompt) for r in reqs], max_new_tokens=most, eos_ids=()).tokens
        return [tokens[:r.max_tokens] for tokens, r in zip(out, reqs)]
    capacity = max([MAX_LEN] + [len(r.prompt) + r.max_tokens for r in reqs])
    return [_chunked(model, policy, r, chunk, capacity) for r in reqs]


def _chunked(model, policy, req: Request, chunk: int, capacity: int) -> list[int]:
    n = len(req.prompt)
    head = n - (n - 1) // chunk * chunk
    kv = gen.init_state(model, policy, 1, capacity, chunk)
    logits, kv = gen.prefill(model, kv, np.array([req.prompt[:head]]), np.array([head]))
    for i in range(head, n, chunk):
        chunk_logits, kv = gen.extend(model, kv, np.array([req.prompt[i:i + chunk]]))
        logits = chunk_logits[:, -1]
    out = [int(np.argmax(logits[0]))]
    while len(out) < req.max_tokens:
        step_logits, kv = gen.extend(model, kv, np.array([[out[-1]]]))
        out.append(int(np.argmax(step_logits[0, -1])))
    return out


def test_extend_pieces_split_any_tail_and_warm_up_compiles_every_piece():
    """`_pieces(n)` sums to n in chunks of C and the declared smaller sizes (each at most 3
    times); with C = 20 (C - 1 = 16 + 3 leaves out the 4-token piece) warm-up still compiles
    every piece, so prompts ending in any tail compile nothing after it."""
    jax.clear_caches()  # every piece compiles here, whichever test ran before in this process
    engine = Engine(MODELS["llama"](), POLICIES["fp8"], slots=2, max_len=92, page_tokens=20, prefill_chunk=20,
                    prefix_cache=True)
    for n in range(1, 200):
        pieces = engine._pieces(n)
        assert sum(pieces) == n and set(pieces) <= set(engine._piece_sizes())
        assert all(pieces.count(s) <= 3 for s in engine._piece_sizes()[1:]), (n, pieces)
    assert engine._piece_sizes() == [20, 16, 4, 1]
    engine.warm_up()
    compiled = engine.compiles
    rng = np.random.default_rng(1)
    for tail in (4, 5, 8, 17):  # past boundaries 20 and 40
        engine.submit(Request(tuple(int(x) for x in rng.integers(0, VOCAB, 40 + tail)), 2))
    engine.run()
    assert engine.compiles == compiled, "an extend piece compiled after warm_up"


@pytest.mark.parametrize("policy_name,chunk,prefix", [("oscar", 4, True), ("oscar", None, False), ("fp8", 8, True)])
def test_warm_up_compiles_every_program_and_leaves_the_engine_empty(policy_name, chunk, prefix):
    """After `warm_up`, ragged requests (two sharing a prefix, preemption by the small pool)
    compile nothing and get the tokens an engine without warm-up gives them; with
    max_prefills=1 at most one admitted prompt is still prefilling after any step."""
    model, policy = MODELS["local-global"](), POLICIES[policy_name]
    reqs = _requests()
    shared = reqs[0].prompt * 2  # 28 + tokens: past the prefix cache's first boundaries
    reqs += [Request(shared + (5, 6), 6), Request(shared + (7,), 9)]
    make = lambda limit: Engine(model, policy, slots=4, max_len=MAX_LEN + PAGE, page_tokens=PAGE,
                                num_pages=NUM_PAGES, prefill_chunk=chunk, max_prefills=limit, prefix_cache=prefix)
    warm = make(1)
    assert warm.warm_up() > 0
    compiled = warm.compiles
    ids = [warm.submit(r) for r in reqs]
    while not warm.done():
        warm.step()
        prefilling = [s for s in warm.scheduler.running if not warm.results[s.rid].tokens]
        assert len(prefilling) <= 1
    assert warm.compiles == compiled, "a program compiled after warm_up"
    with pytest.raises(ValueError, match="before the first request"):
        warm.warm_up()
    cold = make(None)
    expected = [cold.submit(r) for r in reqs]
    cold.run()
    for i, j in zip(ids, expected):
        assert warm.results[i] == cold.results[j], f"request {i}"
    assert warm.prompt_tokens == cold.prompt_tokens  # the warm-up's own requests are not counted


def test_chunk_attention_picks_the_extend_chunks_implementation_only():
    """chunk_attention: the one-row states of prefill's chunks attend through it while the pool
    keeps the policy's; tokens are those of the policy's own; names a policy cannot take are refused."""
    model, policy = MODELS["local-global"](), dataclasses.replace(POLICIES["oscar"], implementation="auto")
    chosen = Engine(model, policy, slots=SLOTS, max_len=MAX_LEN, page_tokens=PAGE, num_pages=NUM_PAGES,
                    prefill_chunk=4, chunk_attention="xla")
    part = chosen._empty_part(chosen.buckets[0])
    assert {layer.implementation for layer in part.layers if isinstance(layer, kv_policy.OscarLayer)} == {"xla"}
    pool = chosen.state.layers
    assert {layer.implementation for layer in pool if isinstance(layer, kv_policy.PagedLayer)} == {"auto"}
    default = _engine(model, policy, 4)
    reqs = _requests()
    ids = [(chosen.submit(r), default.submit(r)) for r in reqs]
    chosen.run()
    default.run()
    assert all(chosen.results[i] == default.results[j] for i, j in ids)
    for pol, name, choices in ((policy, "triton", "auto, xla, pallas, pallas_mosaic_gpu, pallas_tpu, cudnn"),
                               (POLICIES["fp8"], "triton", "auto, cudnn, xla, pallas"),
                               (kv_policy.make_policy("kivi"), "xla", "no implementation choice")):
        with pytest.raises(ValueError, match=f"implementation={name!r}: policy .* takes {choices}"):
            Engine(model, pol, slots=SLOTS, max_len=MAX_LEN, page_tokens=PAGE, chunk_attention=name)
    assert default.chunk_attention is None  # on CPU the policy's own
    cfg = model.cfg
    assert default_chunk_attention(policy, cfg, "gpu") == "cudnn"
    triton = dataclasses.replace(policy, implementation="pallas")
    for pol, backend in ((policy, "cpu"), (policy, "tpu"), (triton, "gpu"), (POLICIES["fp8"], "gpu")):
        assert default_chunk_attention(pol, cfg, backend) is None, (pol.name, backend)
    assert default_chunk_attention(policy, dataclasses.replace(cfg, head_dim=12), "gpu") is None


@pytest.mark.parametrize("model_name,policy_name", [("local-global", "oscar"), ("llama", "fp8")])
def test_rows_without_a_sequence_hold_no_tokens_after_a_step(model_name, policy_name):
    """A decode step empties every row with no running sequence (finished, not yet admitted or
    still prefilling) before its append, so such a row holds at most the one token it just
    appended, in the state and in every layer's cache, however long the sequence that left it
    was; a running row's layers all hold its length."""
    model, policy = MODELS[model_name](), POLICIES[policy_name]
    engine = Engine(model, policy, slots=SLOTS, max_len=MAX_LEN, page_tokens=PAGE, num_pages=3 * 5,
                    prefill_chunk=4)
    rng = np.random.default_rng(2)
    for prompt_len, max_tokens in ((40, 3), (9, 30), (30, 20)):  # the first finishes long before the others
        engine.submit(Request(tuple(int(x) for x in rng.integers(0, VOCAB, prompt_len)), max_tokens))
    emitted, emit = set(), engine._emit  # the slots of the sequences given a token in a step

    def recording_emit(seq, token):
        emitted.add(seq.slot)
        emit(seq, token)

    engine._emit = recording_emit
    decoding = lambda: {s.slot for s in engine.scheduler.running if s.rid in engine._next_token}
    idle_steps = 0
    while not engine.done():
        before = decoding()
        emitted.clear()
        engine.step()
        after, lengths = decoding(), np.asarray(engine.state.lengths)
        for layer in engine.state.layers:
            np.testing.assert_array_equal(np.asarray(getattr(layer, "cache", layer).lengths), lengths)
        idle = [b for b in range(SLOTS) if b not in before | after | emitted]  # no sequence decoded there
        assert (lengths[idle] <= 1).all(), lengths
        idle_steps += bool(after) and bool(idle)
    assert idle_steps >= 3


def test_sampling_rows_are_independent_of_the_batch():
    """`sample_rows`: a greedy row takes its argmax; a row's draw is the same in any batch (with
    greedy rows only, or beside rows that sample with or without top_p) as alone; a top_p row
    only draws inside its nucleus, and a top_p = 1 row also outside it."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(4, 50)) * 2, jnp.float32)
    temperature = jnp.asarray([0.0, 1.0, 1.0, 0.0], jnp.float32)
    top_p = jnp.asarray([1.0, 1.0, 0.5, 0.3], jnp.float32)
    draws = []
    for seed in range(200):
        seeds, counts = jnp.full((4,), seed, jnp.int32), jnp.arange(4, dtype=jnp.int32)
        batch = np.asarray(programs.sample(logits, temperature, top_p, seeds, counts))
        for b in range(4):
            alone = programs.sample(logits[b:b + 1], temperature[b:b + 1], top_p[b:b + 1], seeds[b:b + 1],
                                    counts[b:b + 1])
            assert int(alone[0]) == batch[b], (seed, b)
        draws.append(batch)
    draws, lg = np.stack(draws), np.asarray(logits)
    np.testing.assert_array_equal(draws[:, [0, 3]], np.broadcast_to(np.argmax(lg, -1)[[0, 3]], (200, 2)))
    order = np.argsort(-lg, -1)
    mass = np.cumsum(np.take_along_axis(np.exp(lg) / np.exp(lg).sum(-1, keepdims=True), order, -1), -1)
    nucleus = lambda b, p: set(order[b, :int(np.searchsorted(mass[b], p)) + 1].tolist())
    assert set(draws[:, 2].tolist()) <= nucleus(2, 0.5)
    assert set(draws[:, 1].tolist()) - nucleus(1, 0.5)


def test_sampled_rows_follow_their_own_temperature_and_nucleus():
    """Rows of one batch, alternating temperature 0.7 with top_p 1 and temperature 1 with top_p
    0.8, each seeded apart: the first draw from softmax(logits / 0.7), the second only from the
    smallest prefix of sorted tokens with mass >= 0.8 (here the first two), by its softmax."""
    logits = np.array([2.0, 1.0, 0.5, -1.0, -3.0], np.float32)
    n = 4000
    temperature = np.tile(np.float32([0.7, 1.0]), n // 2)
    top_p = np.tile(np.float32([1.0, 0.8]), n // 2)
    drawn = np.asarray(programs.sample(jnp.asarray(np.tile(logits, (n, 1))), jnp.asarray(temperature),
                                       jnp.asarray(top_p), jnp.arange(n, dtype=jnp.int32), jnp.zeros(n, jnp.int32)))
    freq = [np.bincount(drawn[k::2], minlength=5) / (n // 2) for k in (0, 1)]
    tolerance = 4 * np.sqrt(0.25 / (n // 2))
    assert np.abs(freq[0] - np.asarray(jax.nn.softmax(logits / 0.7))).max() < tolerance
    assert freq[1][2:].sum() == 0
    assert np.abs(freq[1][:2] - np.asarray(jax.nn.softmax(logits[:2]))).max() < tolerance


@pytest.mark.parametrize("policy_name,prefix", [("oscar", True), ("fp8", False)])
def test_a_dropped_engine_frees_its_pool_at_once(policy_name, prefix):
    """An engine is in no reference cycle: with the cycle collector off, dropping the last name
    for a served engine frees it (and its pool) there and then, before another is made."""
    engine = Engine(MODELS["local-global"](), POLICIES[policy_name], slots=SLOTS, max_len=MAX_LEN, page_tokens=PAGE,
                    num_pages=NUM_PAGES, prefill_chunk=4, prefix_cache=prefix)
    engine.submit(_requests()[0])
    engine.run()
    gc.disable()
    try:
        alive = weakref.ref(engine)
        del engine
        assert alive() is None
    finally:
        gc.enable()


def test_request_never_fitting_the_pool_is_refused():
    engine = Engine(MODELS["llama"](), POLICIES["oscar"], slots=2, max_len=MAX_LEN, page_tokens=PAGE, num_pages=2)
    with pytest.raises(ValueError, match="can never fit: it needs 4 pages and the pool has 2"):
        engine.submit(Request((1,) * 50, 20))
    with pytest.raises(ValueError, match="vocab_size"):
        engine.submit(Request((VOCAB,), 2))


@pytest.mark.parametrize("kwargs, match", [
    ({"slots": 0}, "slots=0: expected an int >= 1"),
    ({"slots": 2.5}, "slots=2.5: expected an int >= 1"),
    ({"max_len": 0}, "max_len=0: expected an int >= 1"),
    ({"max_len": -5}, "max_len=-5: expected an int >= 1"),
    ({"page_tokens": 0, "policy": "fp8"}, "page_tokens=0: expected an int >= 1"),
    ({"min_bucket": 0}, "min_bucket=0: expected an int >= 1"),
    ({"max_len": 200}, "max_len=200 = 200 tokens exceeds the model's context length of 128"),
])
def test_engine_refuses_bad_arguments_naming_them(kwargs, match):
    model = _model(("full_attention",))
    model = type(model)(dataclasses.replace(model.cfg, max_position=128), rngs=nnx.Rngs(0))
    policy = POLICIES[kwargs.pop("policy", "oscar")]
    with pytest.raises(ValueError, match=match):
        Engine(model, policy, **{"slots": SLOTS, "max_len": MAX_LEN, "page_tokens": PAGE, **kwargs})


def test_a_whole_prompt_is_one_prefill_piece_and_later_rounds_are_whole():
    """decode_steps = 8, unchunked: the round that prefills a request (one piece) decodes one
    step, so its first token is out after that round with one more; the next round decodes 8;
    the last stops at max_tokens (20 = 2 + 8 + 8 + 2)."""
    engine = _engine(MODELS["llama"](), POLICIES["oscar"], None)
    rid = engine.submit(Request((5, 17, 3, 60, 8), 20))
    counts = []
    while not engine.done():
        engine.step()
        counts.append(len(engine.results[rid].tokens))
    assert counts == [2, 10, 18, 20]


def test_a_round_that_prefills_decodes_one_step_per_chunks_per_step_pieces():
    """Chunks of 4, two a step, rounds of up to 8: a round that runs a prompt's first prefill and
    its five chunks (6 pieces) decodes 3 steps of the running request, and the prompt that
    entered in it joins them (its first token and 3 more); rounds without prefill decode 8, the
    next only 6, where the second reaches its max_tokens of 10."""
    model, policy = MODELS["llama"](), POLICIES["oscar"]
    engine = Engine(model, policy, slots=SLOTS, max_len=MAX_LEN, page_tokens=PAGE, num_pages=NUM_PAGES,
                    prefill_chunk=4, chunks_per_step=2, decode_steps=8)
    first = engine.submit(Request((5, 17, 3), 30))
    counts = []
    for i in range(6):
        if i == 2:
            second = engine.submit(Request(tuple(range(1, 22)), 10))  # a first prefill of 1 token, 5 chunks
        engine.step()
        counts.append(len(engine.results[first].tokens))
        if i == 2:
            assert len(engine.results[second].tokens) == 4
    assert counts == [2, 10, 13, 19, 27, 30]
    assert engine.decode_step_count == 1 + 8 + 3 + 6 + 8 + 3


def test_a_round_prefills_for_the_steps_it_may_run_and_stops_where_a_prompt_enters():
    """Chunks of 4, one a step, rounds of up to 8. A (max_tokens 5) decodes beside B's prefill:
    the round may run only A's 3 last steps, so B gets its first prefill and 3 chunks (of 6),
    and A decodes 3; the next round ends B's prefill (3 chunks, 3 steps). E (max_tokens 2)
    prefilling beside F bounds its rounds to one step, so it gets one chunk a round (F decodes
    two steps in E's first round: its first prefill and a chunk). Then C (1 chunk after its
    first prefill) and D (6) are admitted together: C enters after its chunk and D gets no
    chunk past that one, so the round decodes 3 steps (2 first prefills, 1 chunk)."""
    engine = Engine(MODELS["llama"](), POLICIES["oscar"], slots=SLOTS, max_len=MAX_LEN, page_tokens=PAGE,
                    num_pages=NUM_PAGES, prefill_chunk=4, chunks_per_step=1, decode_steps=8)
    a = engine.submit(Request((5, 17, 3), 5))
    engine.step()
    b = engine.submit(Request(tuple(range(1, 26)), 10))  # a first prefill of 1 token, 6 chunks
    engine.step()
    assert len(engine.results[a].tokens) == 5 and not engine.results[b].tokens
    assert engine.decode_step_count == 1 + 3
    engine.step()
    assert len(engine.results[b].tokens) == 1 + 3 and engine.decode_step_count == 1 + 3 + 3
    engine.run()
    f = engine.submit(Request((5, 17, 3), 30))
    engine.step()
    e = engine.submit(Request(tuple(range(1, 26)), 2))
    engine.step()
    assert len(engine.results[f].tokens) == 2 + 2 and not engine.results[e].tokens
    engine.run()
    c, d = engine.submit(Request(tuple(range(1, 6)), 10)), engine.submit(Request(tuple(range(1, 26)), 10))
    engine.step()
    assert len(engine.results[c].tokens) == 1 + 3 and not engine.results[d].tokens


def test_a_prompt_filling_its_slot_with_one_token_to_generate_serves():
    """A chunked prompt of a slot's whole capacity with max_tokens = 1 holds the pages of its
    prompt alone (its one token comes from the prefill; asking for one token more overran the
    block table), then finishes with `generate`'s token."""
    model, policy = MODELS["llama"](), POLICIES["oscar"]
    engine = _engine(model, policy, 4)
    req = Request(tuple(range(1, MAX_LEN + 1)), 1)
    rid = engine.submit(req)
    assert engine.run()[rid].tokens == _contiguous(model, policy, [req], 4)[0]


def test_engine_max_len_within_sink_and_window_serves():
    """A slot shorter than the OSCAR policy's sink + window (4 + 8) still gets one page (the pool
    cannot be empty), and its greedy tokens are `generate`'s."""
    model, policy = MODELS["llama"](), POLICIES["oscar"]
    engine = Engine(model, policy, slots=2, max_len=10, page_tokens=PAGE)
    req = Request((5, 17, 3, 60, 8), 5)
    rid = engine.submit(req)
    assert engine.run()[rid].tokens == _contiguous(model, policy, [req], None)[0]


@pytest.mark.parametrize("kwargs, match", [
    ({"prompt": "hello"}, "Request.prompt='hello': expected a sequence of int token ids"),
    ({"prompt": (1, 2.5)}, "Request.prompt=.*expected a sequence of int"),
    ({"max_tokens": 2.5}, "Request.max_tokens=2.5: expected an int"),
    ({"seed": 2 ** 40}, r"Request.seed=1099511627776: expected an int in \[-2\*\*31, 2\*\*31\)"),
    ({"stop_ids": 5}, "Request.stop_ids=5: expected a sequence of int"),
    ({"temperature": float("inf")}, "Request.temperature=inf: expected a finite value"),
])
def test_request_fields_are_checked_and_the_engine_goes_on(kwargs, match):
    """A bad field is refused where the Request is made (a seed past int32 or an int stop_ids used
    to pass and then stop every running request at the next step); the engine goes on serving."""
    with pytest.raises(ValueError, match=match):
        Request(**{"prompt": (1, 2, 3), "max_tokens": 3, **kwargs})
    engine = Engine(MODELS["llama"](), POLICIES["fp8"], slots=1, max_len=16)
    rid = engine.submit(Request(np.array([1, 2, 3]), 3, stop_ids=[96]))  # arrays and lists of ints are taken
    with pytest.raises(ValueError, match="rid=7"):
        engine.cancel(7)
    assert engine.requests[rid].prompt == (1, 2, 3) and len(engine.run()[rid].tokens) == 3


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 60), st.integers(1, 30)), min_size=1, max_size=12),
       st.integers(3, 12), st.integers(1, 4), st.integers(1, 9), st.data())
def test_scheduler_conserves_pages_and_finishes_everything(requests, num_pages, slots, lookahead, data):
    """After every round: free + held pages = the pool, no page or slot held twice, swapped-out
    sequences hold none; before a round's decode steps every running sequence holds the pages of
    all the tokens the round may feed it (`ahead`: lookahead, or up to its last); every request
    that is accepted finishes."""
    page, sink_window = 8, 6
    pages_for = lambda n: -(-max(n - sink_window, 0) // page)
    sched = Scheduler(slots, num_pages, pages_for, capacity=80, lookahead=lookahead)
    accepted = []
    pending = list(requests)
    for _ in range(2000):
        if pending and data.draw(st.booleans()):
            prompt, max_tokens = pending.pop(0)
            try:
                accepted.append(sched.submit(len(accepted), prompt, max_tokens))
            except ValueError as e:
                assert "can never fit" in str(e)
        sched.schedule()
        for seq in list(sched.running):
            last = seq.prompt_len + seq.max_tokens - 1
            assert pages_for(min(seq.length + lookahead, last)) <= len(seq.pages) <= pages_for(last)
            if sched.ahead(seq) == 0:  # max_tokens 1: its one token came from its prefill
                sched.finish(seq)
                seq.max_tokens = -1
                continue
            for _ in range(sched.ahead(seq)):
                sched.advance(seq)
                if seq.length - seq.prompt_len + 1 >= seq.max_tokens or data.draw(st.integers(0, 20)) == 0:
                    sched.finish(seq)
                    seq.max_tokens = -1  # done
                    break
        held = [p for s in sched.running for p in s.pages]
        assert len(held) == len(set(held)) == sched.allocator.num_used
        assert sched.allocator.num_used + sched.allocator.num_free == num_pages
        assert len({s.slot for s in sched.running}) == len(sched.running) <= slots
        assert all(not s.pages and s.slot is None for s in sched.swapped)
        assert all(len(s.pages) >= sched.pages_for(s.length) for s in sched.running)
        if not pending and not (sched.waiting or sched.running or sched.swapped):
            break
    assert all(s.max_tokens == -1 for s in accepted)
