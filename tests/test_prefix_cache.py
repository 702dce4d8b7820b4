"""Prefix caching (state/prefix_cache.py): a hit is bit-identical to recomputation.

Randomized interleavings of requests that share prefixes (multi-turn conversations, exact
retries, a shared system prompt, two tenants, aborts) over ragged batches and several chains
(pinned and the router's) give the same greedy outputs with the cache on as with it off, in
float64, float32 and bfloat16; right after every adoption each adopted model's cache equals a
fresh prefill. Eviction keeps parked KV under a tiny budget; a tenant never adopts another's
entry (checked on the runner's forwards: its first forward starts at position 0); a reserve that
reallocates drops parked slots; running requests reclaim parked slots from any engine."""

import random

import pytest
import torch
from fixtures import load_named_pool
from test_state import assert_cache_is_fresh_prefill

from specrouter.config import SamplingParams
from specrouter.engine.engine import Engine
from specrouter.state.prefix_cache import PrefixCache

NAMES = ["ngram", "draft", "mid", "target"]
CHAINS = [("target",), ("draft", "target"), ("ngram", "target"), ("draft", "mid", "target"),
          ("ngram", "draft", "target")]


@pytest.fixture(scope="module")
def flat_dirs(tmp_path_factory):
    """float32 checkpoints whose target logits sit close together (near-ties: one differing
    bit flips an argmax), as in test_greedy_exact_low_precision.py."""
    from fixtures import make_near_tie_pool

    return make_near_tie_pool(tmp_path_factory.mktemp("prefixpool"), max_position_embeddings=512)


def load(dirs, dtype):
    return load_named_pool(dirs, [n for n in NAMES if n != "ngram"], dtype=dtype, ngram=True)


def script(eng: Engine, seed: int, check_fresh: bool = False, scratch=None) -> list[list[int]]:
    """A deterministic stream of requests sharing prefixes, run on `eng` step by step; returns
    every request's output. Later prompts are built from earlier outputs (multi-turn), so any
    difference in one output shows in the following requests too."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 300) for _ in range(40)]  # a shared system prompt
    convs: list[list[int]] = [[] for _ in range(3)]  # multi-turn histories
    outputs, history, live = {}, [], {}

    def step():
        eng.step()
        for sid, (s, conv, abort) in list(live.items()):
            if abort and s.num_generated >= 2 and not s.done:
                eng.abort(sid)
            if s.done:
                if conv is not False and s.finish_reason != "abort":
                    convs[conv] = list(s.tokens)
                outputs[s.request] = (s.finish_reason, s.output_ids)
                del live[sid]

    for i in range(22):
        while len(eng.running) >= 5:
            step()
        kind = rng.choice(["turn", "turn", "retry", "system", "fresh"])
        if kind == "turn":
            c = rng.randrange(3)
            prompt = (convs[c] or system[:rng.randint(5, 40)]) + [rng.randrange(3, 300) for _ in range(rng.randint(1, 6))]
        elif kind == "retry" and history:
            prompt = list(rng.choice(history))
        elif kind == "system":
            prompt = system + [rng.randrange(3, 300) for _ in range(rng.randint(1, 8))]
        else:
            prompt = [rng.randrange(3, 300) for _ in range(rng.randint(2, 20))]
        history.append(prompt)
        tenant = rng.choice([None, "A", "B"])
        chain = rng.choice(CHAINS + [None] * 2) if eng.router is not None else rng.choice(CHAINS)
        params = SamplingParams(max_new_tokens=rng.randint(4, 14), ignore_eos=True)
        seq = eng.add_request(prompt, params, chain=chain, k=rng.randint(1, 5), tenant=tenant)
        if check_fresh:
            for name, st in eng.state.states_of(seq.seq_id).items():
                assert_cache_is_fresh_prefill(eng.pool.runners[name], st, seq.tokens, scratch[name])
        seq.request = i
        live[seq.seq_id] = (seq, kind == "turn" and c, rng.random() < 0.1)
        # run a random number of steps: ragged batches, requests joining and leaving
        for _ in range(rng.randint(0, 6)):
            step()
    while live:
        step()
    return outputs


def run_pair(dirs, dtype, seed, routed=False, **engine_kw):
    """The script with the cache on and off (each on its own pool) -> (on, off, cache)."""
    out = []
    for cached in (True, False):
        pool = load(dirs, dtype)
        router = None
        if routed:
            from test_engine_kv import scripted_profile

            from specrouter.router.policy import Router
            router = Router.from_pool(pool, scripted_profile({}))
        eng = Engine(pool, router=router, prefix_cache=cached, clock=lambda: 0.0, **engine_kw)
        scratch = {n: r for n, r in pool.runners.items()}
        if cached:
            scratch = {n: r.allocate_slot() for n, r in pool.runners.items()}
        out.append((script(eng, seed, check_fresh=cached, scratch=scratch), eng))
    (on, eng_on), (off, _) = out
    return on, off, eng_on.prefix_cache


@pytest.mark.parametrize("dtype,seed,routed", [("float64", 0, False), ("float64", 1, True),
                                               ("float32", 2, False), ("bfloat16", 3, False),
                                               ("bfloat16", 4, True)])
def test_interleaved_requests_identical_with_cache_on_and_off(tiny_pool_dirs, flat_dirs, dtype, seed, routed):
    dirs = tiny_pool_dirs if dtype == "float64" else flat_dirs
    on, off, cache = run_pair(dirs, dtype, seed, routed=routed, max_num_seqs=6, max_model_len=256)
    assert sorted(on) == sorted(off)
    for i, (reason, out) in on.items():
        other_reason, other = off[i]
        if "abort" in (reason, other_reason):  # aborted after a step: where it stopped may differ
            n = min(len(out), len(other))
            assert out[:n] == other[:n]
        else:
            assert (reason, out) == (other_reason, other), i
    s = cache.stats
    print(f"\n{dtype}: {s}")
    assert s.hits >= 4 and s.cached_tokens >= 100, s  # the cache was really used
    assert s.copies + s.moves == s.hits and s.copies >= 1, s


def test_offline_generate_ids_multiturn_identical(tiny_pool_dirs):
    """The offline path (reserve per call, no fixed capacity): turns of a conversation."""
    outs = []
    for cached in (True, False):
        eng = Engine(load(tiny_pool_dirs, "float64"), prefix_cache=cached)
        conv, turns = [5, 6, 7], []
        for t in range(5):
            conv = conv + [10 + t, 20 + t, 30 + t]
            (seq,) = eng.generate_ids([conv], [SamplingParams(max_new_tokens=8, ignore_eos=True)],
                                      chain=("draft", "target"))
            turns.append((seq.output_ids, seq.stats.cached_tokens, len(seq.tokens)))
            conv = list(seq.tokens)
        outs.append(turns)
        if cached:  # every later turn took the previous turn's slots (nothing else needs them)
            assert eng.prefix_cache.stats.moves == 4 and eng.prefix_cache.stats.copies == 0
    on, off = outs
    assert [o for o, _, _ in on] == [o for o, _, _ in off]
    assert [c for _, c, _ in off] == [0] * 5
    # turn t adopts everything the previous turn cached: its tokens but the last (never fed)
    assert [c for _, c, _ in on] == [0] + [n - 1 for _, _, n in on][:-1], on


def test_budget_bounds_parked_bytes_and_evicts(tiny_pool_dirs):
    pool = load(tiny_pool_dirs, "float64")
    probe = PrefixCache(pool.runners, 0)
    eng = Engine(pool, max_num_seqs=2, max_model_len=128, prefix_cache=True, kv_cache_bytes=1 << 30)
    cache = eng.prefix_cache
    assert cache is probe  # one cache per set of runners (the engine's budget replaced the probe's)
    one = sum(cache.slot_bytes(n) for n in ("draft", "mid", "target"))
    cache.budget_bytes = int(1.5 * one)  # room for one sequence's KV in every model
    rng = random.Random(0)
    for i in range(8):
        prompt = [rng.randrange(3, 300) for _ in range(12)]
        eng.generate_ids([prompt], [SamplingParams(max_new_tokens=4, ignore_eos=True)], chain=("draft", "mid", "target"))
        assert cache.parked_bytes <= cache.budget_bytes
        assert len(cache.entries) <= 1
    assert cache.stats.evictions >= 6


def test_the_transformers_runner_counts_its_parked_bytes_for_real(tiny_pool_dirs):
    """The fallback runner's caches grow on demand: a parked slot costs what it holds (it was
    counted as 0 bytes, so no budget ever evicted one)."""
    from specrouter.models.pool import Pool

    pool = Pool.load([tiny_pool_dirs["target"]], names=["target"], target="target", dtype="float64",
                     backend="hf")
    runner = pool.runners["target"]
    assert type(runner).__name__ == "HFRunner" and runner.kv_bytes_per_position() == 0
    eng = Engine(pool, max_num_seqs=2, max_model_len=128, kv_cache_bytes=1 << 30)
    cache = eng.prefix_cache
    params = [SamplingParams(max_new_tokens=4, ignore_eos=True)]
    eng.generate_ids([list(range(5, 25))], params, chain=("target",))
    (entry,) = cache.entries
    held = runner._caches[entry.parts["target"].slot].get_seq_length()
    per_position = 2 * 3 * 2 * 16 * 8  # (k, v) x 3 layers x 2 KV heads x head dim 16 x float64
    assert held >= 20 and per_position * held <= cache.parked_bytes <= per_position * 128
    # the budget evicts by those bytes: room for one such entry, a second prompt evicts the first
    cache.budget_bytes = int(1.5 * cache.parked_bytes)
    eng.generate_ids([list(range(100, 121))], params, chain=("target",))
    assert len(cache.entries) == 1 and cache.entries[0] is not entry and cache.stats.evictions == 1
    assert 0 < cache.parked_bytes <= cache.budget_bytes


def test_tenant_never_adopts_another_tenants_entry(tiny_pool_dirs):
    """A recording runner: the first forward of B's request (same prompt as A's parked one)
    starts at position 0; A's retry starts past the cached prefix."""
    pool = load(tiny_pool_dirs, "float64")
    eng = Engine(pool, max_num_seqs=2, max_model_len=128)
    target = pool.runners["target"]
    starts: list[tuple[int, int]] = []  # (slot, start) of every target row
    forward = target.forward
    target.forward = lambda batch: (starts.extend(zip(batch.slots_list, batch.starts_list)), forward(batch))[1]
    prompt = list(range(3, 40))

    def first_start(tenant, eng=eng):
        starts.clear()
        seq = eng.add_request(prompt, SamplingParams(max_new_tokens=3, ignore_eos=True), chain=("target",), tenant=tenant)
        slot = eng.state.state(seq.seq_id, "target").slot
        while not seq.done:
            eng.step()
        return next(s for sl, s in starts if sl == slot), seq.stats.cached_tokens

    assert first_start("A") == (0, 0)
    assert first_start("B") == (0, 0)  # B cannot see A's entry
    assert first_start("A") == (len(prompt) - 1, len(prompt) - 1)
    assert first_start(None) == (0, 0)  # nor can the shared scope
    # another engine over a view of the same pool (a side-by-side comparison) sees nothing either
    other = Engine(pool.with_fresh_drafters(), max_num_seqs=2, max_model_len=128)
    assert other.prefix_cache is eng.prefix_cache
    assert first_start("A", other) == (0, 0)
    assert first_start("A", other) == (len(prompt) - 1, len(prompt) - 1)


def test_reallocation_drops_parked_slots_and_stale_parts_are_never_adopted(tiny_pool_dirs):
    pool = load(tiny_pool_dirs, "float64")
    eng = Engine(pool)
    prompt = list(range(3, 30))
    eng.generate_ids([prompt], [SamplingParams(max_new_tokens=4, ignore_eos=True)], chain=("draft", "target"))
    cache = eng.prefix_cache
    assert len(cache.entries) == 1
    gen = pool.runners["target"].generation
    eng.reserve(pool.runners["target"].num_slots + 1, 16)  # more rows: every cache reallocates
    assert cache.entries == [] and pool.runners["target"].generation > gen
    # a part whose runner moved on (a runner that reallocated without telling) is not adopted
    (seq,) = eng.generate_ids([prompt], [SamplingParams(max_new_tokens=4, ignore_eos=True)], chain=("draft", "target"))
    assert seq.stats.cached_tokens == 0
    for part in cache.entries[0].parts.values():
        part.generation -= 1
    (again,) = eng.generate_ids([prompt], [SamplingParams(max_new_tokens=4, ignore_eos=True)], chain=("draft", "target"))
    assert again.stats.cached_tokens == 0 and again.output_ids == seq.output_ids


def test_running_requests_reclaim_parked_slots_from_any_engine(tiny_pool_dirs):
    pool = load(tiny_pool_dirs, "float64")
    cached = Engine(pool, max_num_seqs=2, max_model_len=128)
    plain = Engine(pool.with_fresh_drafters(), max_num_seqs=2, max_model_len=128, prefix_cache=False)
    target = pool.runners["target"]
    rng = random.Random(1)
    for _ in range(target.num_slots):  # park more sequences than there are free slots
        cached.generate_ids([[rng.randrange(3, 300) for _ in range(10)]],
                            [SamplingParams(max_new_tokens=3, ignore_eos=True)], chain=("target",))
    assert cached.prefix_cache.entries and not target._free_list() or len(cached.prefix_cache.entries) >= 1
    # the other engine (cache off) takes every slot: parked ones are reclaimed for it
    seqs = [plain.add_request([5, 6, 7], SamplingParams(max_new_tokens=2, ignore_eos=True), chain=("target",))
            for _ in range(2)]
    held = [plain.state.state(s.seq_id, "target").slot for s in seqs]
    extra = [target.allocate_slot() for _ in range(len(target._free_list()))]
    with pytest.raises(RuntimeError):  # only running sequences left: nothing to reclaim
        while True:
            extra.append(target.allocate_slot())
    assert not any("target" in e.parts for e in cached.prefix_cache.entries)
    assert len(set(held + extra)) == target.num_slots


def test_chat_keeps_its_conversation_cached_between_turns(tiny_pool_dirs):
    """What `specrouter chat` does (SpecRouter.stream of the whole conversation every turn, the
    same engine as generate and the server): each later turn takes the conversation so far from
    the cache, and the replies are those of the same conversation with the cache off."""
    from specrouter import SpecRouter
    from specrouter.config import EngineConfig, SpecRouterConfig

    replies = {}
    for cached in (True, False):
        pool = load(tiny_pool_dirs, "float64")
        sr = SpecRouter(pool, config=SpecRouterConfig(engine=EngineConfig(prefix_cache=cached)))
        messages, turns = [], []
        for user in ["hello there", "and then what", "tell me more please", "thanks"]:
            messages = messages + [{"role": "user", "content": user}]
            prompt = sr.encode(messages)
            result = [c.result for c in sr.stream(messages, max_new_tokens=6, chain=["draft", "target"])][-1]
            turns.append((result.token_ids, result.stats.cached_tokens, len(prompt)))
            messages = messages + [{"role": "assistant", "content": result.text}]
        replies[cached] = turns
    assert [t[0] for t in replies[True]] == [t[0] for t in replies[False]]
    assert all(c == 0 for _, c, _ in replies[False])
    on = replies[True]
    assert on[0][1] == 0
    for (_, _, before), (_, cached, n) in zip(on, on[1:]):  # about the previous turn's prompt at
        assert before - 2 <= cached < n, on  # least (its last tokens may re-tokenize with the reply)


def test_server_reports_cached_tokens_and_metrics_and_keeps_tenants_apart(tiny_pool_dirs):
    """Real HTTP on 127.0.0.1 with the OpenAI client: a chat that re-sends its conversation gets
    usage.prompt_tokens_details.cached_tokens > 0 and the same reply as a server without the
    cache; with --suffix-scope api-key another key's identical request adopts nothing; /metrics
    exposes the counters."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    import urllib.request

    from specrouter.server import ServerConfig, create_app
    from specrouter.server.live import LiveServer

    def serve(cached):
        cfg = ServerConfig(chain=("draft", "target"), k=3, max_num_seqs=2, max_model_len=256,
                           suffix_scope="api-key", prefix_cache=cached)
        return LiveServer(create_app(load(tiny_pool_dirs, "float64"), cfg))

    def chat(srv, key, messages):
        c = openai.OpenAI(base_url=srv.base_url, api_key=key, max_retries=0, timeout=30)
        r = c.chat.completions.create(model="target", messages=messages, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
        return r.choices[0].message.content, r.usage

    turn1 = [{"role": "user", "content": "hello there, how are you"}]
    results = {}
    for cached in (True, False):
        with serve(cached) as srv:
            a1, u1 = chat(srv, "key-a", turn1)
            turn2 = turn1 + [{"role": "assistant", "content": a1}, {"role": "user", "content": "go on"}]
            a2, u2 = chat(srv, "key-a", turn2)
            b2, ub = chat(srv, "key-b", turn2)  # another tenant, the same conversation
            results[cached] = (a1, a2, b2)
            details = [u.prompt_tokens_details.cached_tokens for u in (u1, u2, ub)]
            if cached:
                # at least turn 1's prompt (its reply too where the text re-tokenizes as generated)
                assert details[0] == 0 and u1.prompt_tokens - 2 <= details[1] < u2.prompt_tokens
                assert details[2] == 0  # key B never reads key A's entry
                with urllib.request.urlopen(srv.base_url.rsplit("/v1", 1)[0] + "/metrics", timeout=10) as m:
                    text = m.read().decode()
                for name in ("hits", "cached_tokens", "hit_rate", "evictions", "bytes"):
                    assert f"specrouter_prefix_cache_{name} " in text, name
                assert f"specrouter_prefix_cache_cached_tokens {float(details[1])}" in text
            else:
                assert details == [0, 0, 0]
    assert results[True] == results[False]


def test_a_draft_head_chain_adopts_the_targets_features_too(tmp_path):
    """A pool with a draft head: the target's features are parked with its slot and adopted
    (moved, or copied beside a kept entry), so a later request feeds the target only the tokens
    past the cached prefix (counted on every forward) and the head drafts at once; the head's
    own KV is parked and adopted too (one position short), so its catch-up feeds only the new
    positions; outputs, and every cycle's drafted and accepted counts (the head's proposals),
    are those of the cache off. Negative control: features dropped at adoption make the target
    re-feed the whole prefix (the count shows it)."""
    from fixtures import make_tiny_llama
    from test_head_level import _save_head

    from specrouter import SpecRouter
    from specrouter.config import EngineConfig, SpecRouterConfig
    from specrouter.state.manager import StateManager

    target = make_tiny_llama(tmp_path / "target", hidden_size=64, num_layers=2, seed=3, tie_word_embeddings=True)
    head = _save_head(target, tmp_path / "head", noise=0.01)

    def run(cached, drop_features=False):
        sr = SpecRouter.from_pretrained([target, head], names=["target", "head"], target="target",
                                        dtype="float32", adaptive=False, ngram=False, suffix=False)
        eng = SpecRouter(sr.pool, config=SpecRouterConfig(engine=EngineConfig(prefix_cache=cached))).engine
        fed, outs = [], []
        conv = list(range(5, 45))
        for t in range(3):
            cycles = []
            (seq,) = eng.generate_ids([conv], [SamplingParams(max_new_tokens=8, ignore_eos=True)],
                                      chain=("head", "target"), k=3, on_cycle=cycles.append)
            fed.append({m: sum(c.forward_tokens.get(m, 0) for c in cycles) for m in ("target", "head")})
            outs.append((seq.output_ids, seq.stats.cached_tokens, [(c.drafted, c.accepted) for c in cycles]))
            conv = (list(seq.tokens) if t != 1 else conv) + [50 + t, 60 + t]  # turn 2 branches: a copy
        return fed, outs

    fed_off, off = run(False)
    fed_on, on = run(True)
    assert [o for o, _, _ in on] == [o for o, _, _ in off]
    assert [d for _, _, d in on] == [d for _, _, d in off]  # the head proposed the same tokens
    cached = [c for _, c, _ in on]
    assert cached[0] == 0 and all(c > 30 for c in cached[1:]), cached
    assert fed_on[0] == fed_off[0]
    for t in (1, 2):  # the target fed only what was not cached
        assert fed_off[t]["target"] - fed_on[t]["target"] == cached[t], (fed_on, fed_off, cached)
        # the head too, give or take its lag: it parks the positions of its last catch-up (the
        # tokens its last cycle accepted, at most k + 1, are not in it), adopted one short
        assert fed_on[t]["head"] <= fed_on[t]["target"] + 3 + 1 < fed_off[t]["head"] - 30, (fed_on, fed_off)
    adopt = StateManager.adopt
    try:  # negative control: features not adopted -> the target re-feeds the prefix
        StateManager.adopt = lambda self, *a, features=0, source=None: adopt(self, *a)
        fed_nf, nf = run(True)
    finally:
        StateManager.adopt = adopt
    assert [o for o, _, _ in nf] == [o for o, _, _ in off]
    assert fed_nf[1]["target"] >= fed_off[1]["target"] - 1, (fed_nf, fed_off)


def test_a_shared_prefix_serves_a_burst_when_the_cache_is_full_of_other_entries(tiny_pool_dirs):
    """A server whose parked slots are all taken (other tenants' entries): a burst of requests
    sharing a system prompt all adopt it (each copy evicts the least recently used other entry);
    taking the entry itself would leave every request after the first with nothing."""
    pool = load(tiny_pool_dirs, "float64")
    eng = Engine(pool, max_num_seqs=2, max_model_len=128)
    target = pool.runners["target"]
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    rng = random.Random(2)
    system = [rng.randrange(3, 300) for _ in range(30)]

    def run(prompt, tenant):
        seq = eng.add_request(prompt, params, chain=("draft", "target"), tenant=tenant)
        while not seq.done:
            eng.step()
        return seq

    for _ in range(target.num_slots):  # other tenants' entries fill every parked slot
        run([rng.randrange(3, 300) for _ in range(12)], "B")
    run(system + [7, 8], "A")
    assert not target._free_list()
    burst = [eng.add_request(system + [9 + i, 10 + i], params, chain=("draft", "target"), tenant="A")
             for i in range(2)]
    while any(not s.done for s in burst):
        eng.step()
    assert [s.stats.cached_tokens for s in burst] == [len(system)] * 2


def test_offline_rounding_of_positions_is_for_small_batches_only(tiny_pool_dirs):
    """A conversation (one row) gets positions rounded up (no reallocation, which drops parked
    slots, at every turn); a big batch of short rows gets exactly what it asked for (rounding
    100k rows of 10 positions up to 256 multiplied their memory 25x: an OOM)."""
    pool = load(tiny_pool_dirs, "float64")
    target = pool.runners["target"]
    asked = []
    target.reserve = lambda rows, positions: asked.append((rows, positions))
    eng = Engine(pool)
    eng.reserve(1, 20)
    eng.reserve(Engine.ROUND_ROWS + 1, 20)
    assert asked == [(1, min(256, eng.context_limit(tuple(pool.runners)))), (Engine.ROUND_ROWS + 1, 20)]
    assert asked[0][1] > 20
    Engine(pool, prefix_cache=False).reserve(1, 20)
    assert asked[-1] == (1, 20)
