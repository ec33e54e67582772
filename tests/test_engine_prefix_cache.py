"""The serving engine's prefix cache (docs/paged.md §5): a request's greedy tokens are the same
whether its prefix was a hit or a miss (oscar with sliding-window rings, fp8 and bf16), under
preemption while pages are shared, and after the cache went to disk and back; shared pages
are never written while cached; keys depend on the policy and its calibration; the scheduler
conserves pages with shared and cached ones and evicts only unreferenced entries (hypothesis)."""

from __future__ import annotations

import dataclasses

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from oscar_jax import cache as oc
from oscar_jax.models import kv_policy
from oscar_jax.models.serving import Engine, Request
from oscar_jax.models.serving import prefix_cache as pc
from oscar_jax.models.serving.scheduler import Scheduler
from test_serving_engine import MODELS, POLICIES, VOCAB

PAGE, CHUNK, MAX_LEN = 16, 4, 76  # oscar-small: sink 4 + window 8, so boundaries at 28, 44, 60 (dense: 16, 32, ...)


def _requests() -> list[Request]:
    """A (64 tokens) and a repeat of it; B, C share A's first 44 tokens (B finds A's entries 1-2
    without a snapshot at 2 and takes one, C restores it); E shares A's first 30."""
    rng = np.random.default_rng(2)
    ids = lambda n: [int(x) for x in rng.integers(0, VOCAB, n)]
    shared = ids(50)
    a = Request(tuple(shared + ids(14)), 10)
    return [a, Request(tuple(shared[:44] + ids(10)), 12), Request(tuple(shared[:44] + ids(5)), 8), a,
            Request(tuple(shared[:30] + ids(3)), 6)]


def _engine(model, policy, num_pages: int = 6) -> Engine:
    """Rounds of up to 3 decode steps: with 6 pages, a sequence holding shared pages is swapped out."""
    return Engine(model, policy, slots=3, max_len=MAX_LEN, page_tokens=PAGE, num_pages=num_pages,
                  prefill_chunk=CHUNK, prefix_cache=True, decode_steps=3)


def _check_pages(engine: Engine, seen: dict) -> None:
    """Pages are conserved (free + used + cached = pool), and a cached entry's page holds what
    it held when first seen (shared pages are never written)."""
    s, prefix = engine.scheduler, engine.prefix
    cached = {prefix.entries[k].page for k in prefix._lru}
    used = {p for seq in s.running for p in seq.pages} | {e.page for e in prefix.entries.values() if e.refs}
    assert not used & cached and not (used | cached) & s.allocator._free
    assert s.allocator.num_free + len(used) + len(cached) == engine.num_pages
    entries = [e for e in prefix.entries.values() if e.key not in seen or seen[e.key][0] == e.page]
    if entries:
        pages = jax.device_get(pc.read_pages(engine.state, jnp.asarray([e.page for e in entries], jnp.int32)))
        for i, e in enumerate(entries):
            now = jax.tree.map(lambda x: x[i], pages)
            if e.key in seen:
                assert all(jax.tree.leaves(jax.tree.map(np.array_equal, seen[e.key][1], now))), "a shared page changed"
            else:
                seen[e.key] = (e.page, now)


@pytest.mark.parametrize("model_name,policy_name", [("local-global", "oscar"), ("llama", "fp8"), ("llama", "bf16")])
def test_prefix_hits_give_the_tokens_of_a_miss_and_survive_disk(model_name, policy_name, tmp_path):
    model = MODELS[model_name]()
    policy = POLICIES.get(policy_name) or kv_policy.make_policy(policy_name, implementation="xla")
    reqs = _requests()
    engine = _engine(model, policy)
    swapped_shared = []
    if engine.paged:
        swap_out = engine.scheduler._swap_out
        engine.scheduler._swap_out = lambda seq: (swapped_shared.append(seq.shared), swap_out(seq))[1]
    seen: dict = {}
    ids = [engine.submit(reqs[0])]
    for nxt in ([reqs[1]], reqs[2:]):  # each wave comes once the previous one's prefixes are cached
        while not engine.results[ids[-1]].tokens:
            engine.step()
        ids += [engine.submit(r) for r in nxt]
    while not engine.done():
        engine.step()
        if engine.paged:
            _check_pages(engine, seen)
    together = [engine.results[i] for i in ids]
    restored = [0, 0, 44, 60, 0] if engine.paged else [0, 32, 32, 48, 16]  # tokens each request restored
    assert engine.prefix_hit_tokens == sum(restored) and engine.prompt_tokens == sum(len(r.prompt) for r in reqs)
    if engine.paged:
        assert engine.preemptions >= 1 and any(swapped_shared), "no sequence holding shared pages was swapped out"
    for req, got in zip(reqs, together):
        alone = _engine(model, policy)
        alone.submit(req)
        assert alone.run()[0] == got and alone.prefix_hit_tokens == 0
    assert engine.save_prefix_cache(tmp_path / "prefix") == len(engine.prefix.entries)
    warm = _engine(model, policy)
    assert warm.load_prefix_cache(tmp_path / "prefix") == len(engine.prefix.entries)
    for req, got in zip(reqs, together):
        rid = warm.submit(req)
        warm.run()
        assert warm.results[rid] == got
    assert warm.prefix_hit_tokens > sum(restored)
    with pytest.raises(ValueError, match="another model, weights, KV policy"):
        _engine(model, kv_policy.make_policy("fp32" if engine.paged else "oscar", implementation="xla")
                ).load_prefix_cache(tmp_path / "prefix")


def test_a_slot_a_sequence_left_never_writes_into_the_cached_pages_of_the_next():
    """A prompt restores cached pages into a slot whose last sequence finished at a length
    within those pages, then prefills its rest over two steps while another sequence decodes:
    the cached pages keep their contents and the prompt gets the tokens it gets alone."""
    model, policy = MODELS["local-global"](), POLICIES["oscar"]
    rng = np.random.default_rng(5)
    ids = lambda n: tuple(int(x) for x in rng.integers(0, VOCAB, n))
    cached, long, short = Request(ids(64), 3), Request(ids(20), 40), Request(ids(18), 3)
    hit = Request(cached.prompt[:60] + ids(8), 5)  # restores pages 28-60 and their snapshot, then 2 chunks
    make = lambda: Engine(model, policy, slots=2, max_len=MAX_LEN, page_tokens=PAGE, num_pages=12,
                          prefill_chunk=CHUNK, max_prefills=1, prefix_cache=True, decode_steps=1)
    engine, seen, slot_of = make(), {}, {}
    rids = [engine.submit(r) for r in (cached, long, short, hit)]
    while not engine.done():
        engine.step()
        _check_pages(engine, seen)
        slot_of.update((seq.rid, seq.slot) for seq in engine.scheduler.running)
    assert engine.prefix_hit_tokens == 60 and slot_of[rids[3]] == slot_of[rids[2]] != slot_of[rids[1]]
    alone = make()
    alone.submit(hit)
    assert alone.run()[0] == engine.results[rids[3]]


def test_keys_depend_on_the_policy_and_its_calibration():
    """Another calibration (rotations) or policy gives another salt, so none of its keys match."""
    model = MODELS["llama"]()
    base = POLICIES["oscar"]
    d = model.cfg.head_dim
    rot = np.linalg.qr(np.random.default_rng(0).normal(size=(d, d)))[0].astype(np.float32)
    params = oc.LayerParams.create(rot, rot, 0.96, 0.92, num_layers=2, kv_heads=model.cfg.num_kv_heads)
    other = np.linalg.qr(np.random.default_rng(1).normal(size=(d, d)))[0].astype(np.float32)
    policies = [base, dataclasses.replace(base, clip_k=0.9), dataclasses.replace(base, rotation="hadamard"),
                dataclasses.replace(base, rotation="artifact", layer_params=params),
                dataclasses.replace(base, rotation="artifact", layer_params=dataclasses.replace(
                    params, rot_k=jnp.broadcast_to(other, params.rot_k.shape)))]
    layout = {"page_tokens": PAGE}
    salts = {pc.salt(model, p, layout) for p in policies} | {pc.salt(model, base, {"page_tokens": 8})}
    assert len(salts) == len(policies) + 1
    assert pc.salt(model, base, layout) == pc.salt(model, dataclasses.replace(base), layout)
    prompt = list(range(40))
    keys = [pc.chain_keys(s, prompt, [28]) for s in salts]
    assert len({k[0] for k in keys}) == len(salts)


def _scheduler(num_pages: int, slots: int = 2) -> Scheduler:
    return Scheduler(slots, num_pages, lambda n: -(-max(n - 6, 0) // 8), capacity=80,
                     prefix=pc.PrefixCache(b"salt", None, host_bytes=1 << 20))


def _keys(prompt) -> tuple[bytes, ...]:
    return tuple(pc.chain_keys(b"salt", prompt, range(14, len(prompt), 8)))  # m_k = 6 + 8k


def test_lru_eviction_frees_only_unreferenced_entries_deepest_first():
    """Prompts of 37 tokens: 3 entries (boundaries 14, 22, 30) and 4 pages each."""
    sched = _scheduler(num_pages=8)
    old, live = list(range(37)), list(range(100, 137))
    seqs = [sched.submit(i, 37, 2, _keys(p)) for i, p in enumerate((old, live))]
    sched.schedule()
    for seq in seqs:
        sched.cache_prefix(seq, {3: (np.zeros(1), None)})
    sched.finish(seqs[0])  # old's 3 entries are cached, live's referenced
    assert sched.num_cached_pages == 3 and sched.allocator.num_free == 1 and sched.num_free_pages == 4
    new = sched.submit(2, 22, 2, _keys(list(range(200, 222))))  # 3 pages: 2 cached ones go
    sched.schedule()
    assert new in sched.running and not sched.swapped
    assert all(k in sched.prefix.entries for k in _keys(live)), "a referenced entry was evicted"
    assert [k in sched.prefix.entries for k in _keys(old)] == [True, False, False]  # the deepest first
    sched.finish(new)
    again = sched.submit(3, 37, 2, _keys(old))
    sched.schedule()  # old's prompt again: its remaining entry is shared (no snapshot there: nothing restored)
    assert again.shared == 1 and again.restored == 0 and again.pages[0] == sched.prefix.entries[_keys(old)[0]].page
    sched.cache_prefix(again, {3: (np.zeros(1), None)})
    assert sched.prefix.match(_keys(old)) == (3, 3)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 60), st.integers(1, 20)), min_size=1, max_size=10),
       st.integers(5, 12), st.integers(1, 3), st.data())
def test_scheduler_conserves_shared_and_cached_pages(requests, num_pages, slots, data):
    """Random arrivals of prompts over three shared prefixes, random finishes and cancellations:
    after every step free + used + cached = the pool (a shared page counted once), a sequence's
    shared pages are entries it references, each entry's refs = the running sequences holding
    it, swapped-out sequences hold nothing; every accepted request finishes."""
    chains = [list(np.random.default_rng(c).integers(0, 50, 60)) for c in range(3)]
    sched = _scheduler(num_pages, slots)
    accepted, pending = [], list(requests)
    for _ in range(2000):
        if pending and data.draw(st.booleans()):
            chain, prompt, max_tokens = pending.pop(0)
            try:
                accepted.append(sched.submit(len(accepted), prompt, max_tokens, _keys(chains[chain][:prompt])))
            except ValueError as e:
                assert "can never fit" in str(e)
        for event in sched.schedule():
            if event.kind == "admit":  # the engine registers the prefix after the prefill
                snaps = {k: (np.zeros(1), None) for k in range(1, len(event.seq.keys) + 1) if data.draw(st.booleans())}
                sched.cache_prefix(event.seq, snaps)
        for seq in list(sched.running):
            sched.advance(seq)
            if seq.length - seq.prompt_len + 1 >= seq.max_tokens or data.draw(st.integers(0, 20)) == 0:
                (sched.finish if data.draw(st.booleans()) else sched.cancel)(seq)
                seq.max_tokens = -1  # done
        entries = sched.prefix.entries
        cached = {entries[k].page for k in sched.prefix._lru}
        used = {p for s in sched.running for p in s.pages} | {e.page for e in entries.values() if e.refs}
        assert not cached & used
        assert sched.allocator.num_free + len(used) + len(cached) == num_pages
        assert len({e.page for e in entries.values()}) == len(entries)
        for s in sched.running:
            assert s.pages[:s.shared] == [entries[k].page for k in s.keys[:s.shared]]
            assert set(s.held) <= set(entries) and len(s.pages) >= sched.pages_for(s.length)
        own = [p for s in sched.running for p in s.pages if p not in {e.page for e in entries.values()}]
        assert len(own) == len(set(own))
        for key, e in entries.items():
            assert e.refs == sum(key in s.held for s in sched.running)
        assert all(not s.pages and not s.held and s.slot is None for s in sched.swapped)
        if not pending and not (sched.waiting or sched.running or sched.swapped):
            break
    assert all(s.max_tokens == -1 for s in accepted)


def _workload_module():
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(__file__).parents[1] / "bench" / "workload.py"
    spec = importlib.util.spec_from_file_location("bench_workload", path)
    workload = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(workload)
    return workload


@pytest.mark.parametrize("model_name,chunk", [("llama", CHUNK), ("local-global", CHUNK), ("local-global", None)])
def test_workload_budget_counts_every_byte_of_the_engines_cache(model_name, chunk):
    """bench/workload.py's page and slot bytes: an engine of 3 slots and 5 pages holds exactly
    5 pages' and 3 slots' bytes of cache (its rotations apart), with sliding-window rings,
    chunked or not."""
    workload = _workload_module()
    model, policy = MODELS[model_name](), POLICIES["oscar"]
    page_b, slot_b = workload.paged_bytes(policy, model.cfg, MAX_LEN, chunk or 1, PAGE)
    engine = Engine(model, policy, slots=3, max_len=MAX_LEN, page_tokens=PAGE, num_pages=5, prefill_chunk=chunk)
    caches = [getattr(layer, "cache", layer) for layer in engine.state.layers]
    held = sum(x.nbytes for x in jax.tree.leaves(caches))
    assert page_b > 0 and slot_b > 0 and held == 5 * page_b + 3 * slot_b, (held, page_b, slot_b)


def test_workload_bench_runs_at_tiny_scale(tmp_path):
    """bench/workload.py on the tiny model: every request finishes, nothing compiles after the
    warm-up, the prefix cache restores part of the shared prefix, pages in use and sequences
    holding a slot are recorded; with --warm-up-only it writes nothing."""
    workload = _workload_module()
    out = tmp_path / "w.json"
    argv = ["--model", "tiny", "--scale", "0.004", "--requests", "6", "--rate", "4", "--kv", "oscar", "--prefix-cache",
            "on", "--kv-gib", "0.0002", "--dtype", "float32", "--prompt-tokens", "8192,16384", "--output-tokens",
            "512,1024"]
    workload.main([*argv, "--out", str(out)])
    (row,) = results_rows(out)
    assert row["requests"] == 6 and row["compiles_timed"] == 0 and row["shared_requests"] >= 2
    assert 0 < row["prefix_hit_tokens"] <= row["shared_prefix_tokens"] and row["pages_in_use"]
    assert row["output_tokens"] >= 6 * 2 and row["ttft_p99_s"] >= row["ttft_p50_s"] > 0
    assert 1 <= row["tokens_per_decode_step"] <= row["slots"]
    running = [n for _, n in row["sequences_running"]]
    assert len(running) == len(row["pages_in_use"]) and 0 < max(running) <= row["slots"]
    assert 0 < row["delivery_gap_p50_s"] <= row["delivery_gap_p99_s"]
    assert out.with_suffix(".png").stat().st_size > 0
    only = tmp_path / "warm.json"  # both modes at the lengths above: the programs that run compiled
    workload.main([*argv, "--prefix-cache", "off,on", "--warm-up-only", "--out", str(only)])
    assert not only.exists()  # it warms up and stops


def test_workload_plot_draws_what_the_rows_hold(tmp_path):
    """bench/workload.plot: a dense run (no pages) with its sequences holding a slot gets a
    figure; rows holding neither series leave none, a stale one removed."""
    workload = _workload_module()
    dense = {"kv": "bf16", "prefix_cache": True, "num_pages": 0, "pages_in_use": [(0.0, 0), (1.0, 0)],
             "sequences_running": [(0.0, 1), (1.0, 3)]}
    path = tmp_path / "w.png"
    workload.plot([dense], "dense", path)
    assert path.stat().st_size > 0
    workload.plot([{k: v for k, v in dense.items() if k != "sequences_running"}], "nothing", path)
    assert not path.exists()


def results_rows(path) -> list[dict]:
    from oscar_jax.models import results
    return results.read(path)["rows"]
