"""The suffix drafter (suffix decoding): proposals from the request's own context and from
earlier requests, frequency-scored and sized by confidence; bounded memory with eviction;
thread safety; tenants kept apart; inside the engine: exact greedy output at depth 1-3 over a
ragged batch, the target's distribution in sampling, and a second identical request drafting
longer; the router prunes it when it never proposes."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from fixtures import QuietRouterHooks

from specrouter.drafters.suffix import SuffixConfig, SuffixDrafter, SuffixStore


def rows(tokens: torch.Tensor, lengths: torch.Tensor) -> list[list[int]]:
    return [tokens[b, : lengths[b]].tolist() for b in range(tokens.shape[0])]


def reference_request_tree(ctx: list[int], k: int, cfg: SuffixConfig) -> list[int]:
    """The request tree written plainly: occurrences of the longest earlier suffix match, then
    the most frequent next token while the cumulative frequency stays >= min_token_prob."""
    L = len(ctx)
    for n in range(min(cfg.max_depth, L - 1), cfg.min_context_match - 1, -1):
        ends = [e for e in range(n - 1, L - 1) if ctx[e - n + 1:e + 1] == ctx[L - n:]]
        if ends:
            break
    else:
        return []
    out, cum = [], 1.0
    cap = min(k, int(np.ceil(cfg.max_spec_factor * n)))
    for t in range(1, cap + 1):
        nxt = [ctx[e + t] if e + t < L else None for e in ends]
        counts = {}
        for x in nxt:
            if x is not None:
                counts[x] = counts.get(x, 0) + 1
        if not counts:
            break
        best = max(counts.values())
        tok = min(x for x, c in counts.items() if c == best)  # np.unique order breaks ties
        cum *= best / len(ends)
        if cum < cfg.min_token_prob:
            break
        out.append(tok)
        ends = [e for e, x in zip(ends, nxt) if x == tok]
    return out


def test_request_tree_matches_the_plain_reference():
    rng = np.random.default_rng(0)
    cfg = SuffixConfig(global_tree=False)
    drafter = SuffixDrafter(cfg)
    checked = 0
    for _ in range(300):
        L = int(rng.integers(2, 60))
        ctx = rng.integers(0, int(rng.integers(2, 8)), L).tolist()  # small alphabets: many matches
        k = int(rng.integers(1, 10))
        got = rows(*drafter.propose([ctx], k))[0]
        assert got == reference_request_tree(ctx, k, cfg), (ctx, k)
        checked += bool(got)
    assert checked > 100  # most cases proposed something


def test_confidence_is_frequency_and_stops_below_min_token_prob():
    d = SuffixDrafter(SuffixConfig(min_token_prob=0.3))
    d.observe_request([1, 2, 3, 4, 5, 6])
    d.observe_request([1, 2, 3, 4, 7, 8])
    d.observe_request([1, 2, 3, 4, 7, 9])
    tokens, lengths, conf = d.propose_scored([[50, 1, 2]], 8)
    # 3 of 3 continue with 3, 4; then 7 in 2 of 3 (0.667); then 8 or 9 (1 of 2): 0.333 >= 0.3
    assert rows(tokens, lengths) == [[3, 4, 7, 8]]
    assert conf[0, :4].tolist() == pytest.approx([1.0, 1.0, 2 / 3, 1 / 3])
    d2 = SuffixDrafter(SuffixConfig(min_token_prob=0.5))
    for r in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8], [1, 2, 3, 4, 7, 9]):
        d2.observe_request(r)
    assert rows(*d2.propose([[50, 1, 2]], 8)) == [[3, 4, 7]]  # stops before 1/3 < 0.5


def branchy_and_repeated() -> SuffixDrafter:
    """A store where after [1, 2] every request continues with 3, then 10 (5 of 8), 11 (3 of 5),
    12 (2 of 3), 13 (1 of 2): cumulative 1, 0.625, 0.375, 0.25, 0.125; and one continuation of
    [7, 8] seen 4 times, always the same (cumulative 1 throughout)."""
    d = SuffixDrafter(SuffixConfig(max_spec_factor=8.0))
    tails = [[10, 11, 12, 13], [10, 11, 12, 14], [10, 11, 15], [10, 16], [10, 17],
             [20, 21], [20, 22], [20, 23]]
    for t in tails:
        d.observe_request([1, 2, 3, *t])
    for _ in range(4):
        d.observe_request([7, 8, *range(30, 50)])
    return d


def test_confident_continuations_draft_long_and_branchy_ones_short():
    d = branchy_and_repeated()
    ctx = [[50, 1, 2], [50, 7, 8]]
    tokens, lengths, conf = d.propose_scored(ctx, 12)
    assert rows(tokens, lengths) == [[3, 10, 11, 12, 13], list(range(30, 42))]  # min_token_prob 0.1
    assert conf[0, :5].tolist() == pytest.approx([1.0, 0.625, 0.375, 0.25, 0.125])
    assert conf[1, :12].eq(1.0).all()


@pytest.mark.parametrize("floor, branchy", [(0.0, [3, 10, 11, 12, 13]), (0.2, [3, 10, 11, 12]),
                                            (0.3, [3, 10, 11]), (0.5, [3, 10]), (0.7, [3]), (1.0, [3])])
def test_min_confidence_cuts_where_the_cumulative_confidence_falls_below_it(floor, branchy):
    """The router's break-even acceptance as the floor: the branchy proposal stops before it,
    the repeated one (confidence 1) still drafts all k; rows of one call keep their own floors."""
    d = branchy_and_repeated()
    ctx = [[50, 1, 2], [50, 7, 8], [50, 1, 2]]
    got = rows(*d.propose(ctx, 12, min_confidence=[floor, floor, 0.0]))
    assert got == [branchy, list(range(30, 42)), [3, 10, 11, 12, 13]]
    with pytest.raises(ValueError):
        d.propose(ctx, 12, min_confidence=[0.5])


def test_longer_match_is_more_specific_and_short_matches_propose_little():
    d = SuffixDrafter(SuffixConfig(max_spec_factor=2.0))
    d.observe_request([9, 9, 1, 2, 10, 11, 12, 13, 14, 15, 16])
    d.observe_request([8, 1, 2, 20, 21, 22, 23, 24, 25, 26])
    # "9 1 2" matches only the first request (3 tokens, up to 6 proposed)
    assert rows(*d.propose([[9, 1, 2]], 16)) == [[10, 11, 12, 13, 14, 15]]
    # "1 2" alone: two occurrences, 1/2 each: a 2-token match proposes at most 4
    toks = rows(*d.propose([[7, 1, 2]], 16))[0]
    assert len(toks) <= 4 and toks[0] in (10, 20)


def test_global_tree_beats_a_weaker_request_tree_and_vice_versa():
    d = SuffixDrafter()
    d.observe_request([5, 6, 7, 8, 9, 10, 11, 12])
    # the context's own history says 5 6 -> 99 once; the global tree 5 6 7 -> ... matches longer
    ctx = [5, 6, 99, 1, 4, 5, 6, 7]
    assert rows(*d.propose([ctx], 4)) == [[8, 9, 10, 11]]
    # nothing global: the request's own continuation
    assert rows(*SuffixDrafter().propose([[1, 2, 3, 4, 1, 2]], 2)) == [[3, 4]]


def test_batch_shapes_padding_and_validation():
    d = SuffixDrafter()
    d.observe_request([1, 2, 3, 4, 5])
    tokens, lengths = d.propose([[1, 2], [7], [], np.array([3, 3, 3, 3]), torch.tensor([1, 2])], [3, 3, 3, 2, 0])
    assert tokens.shape == (5, 3) and tokens.dtype == lengths.dtype == torch.int64
    assert lengths.tolist() == [3, 0, 0, 1, 0]  # 3 3 3 3: the longest match (3 3 3) is followed by one token
    assert tokens[1:3].eq(0).all()
    with pytest.raises(ValueError):
        d.propose([[1, 2]], [1, 2])
    with pytest.raises(ValueError):
        d.propose([[1, 2]], 2, tenants=["a", "b"])
    with pytest.raises(ValueError):
        SuffixConfig(min_match=1)


def test_memory_is_bounded_and_the_oldest_requests_are_evicted():
    cfg = SuffixConfig(max_tokens=1000)
    d = SuffixDrafter(cfg)
    rng = np.random.default_rng(1)
    reqs = [rng.integers(0, 50_000, 100).tolist() for _ in range(40)]
    for r in reqs:
        d.observe_request(r)
        mem = d.memory()
        assert mem.tokens <= cfg.max_tokens
    assert mem.evicted_requests >= 30 and mem.requests + mem.evicted_requests == 40
    assert mem.bytes < 1000 * 24 + 4096  # ~20 bytes per kept token
    # the newest request is still drafted from, the oldest no longer
    assert rows(*d.propose([reqs[-1][:10]], 8))[0] == reqs[-1][10:18]
    assert rows(*d.propose([reqs[0][:10]], 8))[0] == []
    # one request over the bound keeps its last max_tokens tokens
    big = rng.integers(0, 50_000, 3000).tolist()
    d.observe_request(big)
    assert d.memory().tokens == 1000 and d.memory().requests == 1
    assert rows(*d.propose([big[-20:-10]], 4))[0] == big[-10:-6]


def test_store_index_stays_consistent_under_inserts_and_evictions(monkeypatch):
    """Appends, log sorts, compactions and lazy evictions keep the kept buffer and the index
    (compacted run + middle run + log) exactly the kept requests' bigrams; every older snapshot
    stays readable as it was."""
    import specrouter.drafters.suffix as suffix_module

    monkeypatch.setattr(suffix_module, "LOG_SIZE", 16)  # the middle run fills between compactions
    rng = np.random.default_rng(2)
    st = SuffixStore.empty()
    kept: list[list[int]] = []
    snapshots = []
    compactions = all_parts = 0
    for i in range(60):
        r = rng.integers(0, 6, int(rng.integers(2, 30))).tolist()
        buffer = st.buffer
        st = st.insert(np.array(r))
        kept.append(r)
        if i % 7 == 6:
            st = st.evict_oldest(2)
            kept = kept[2:]
        compactions += st.buffer is not buffer
        all_parts += st.r > 0 and st.mid.keys.shape[0] > 0 and st.keys.shape[0] > 0 and st.dead > 0
        buf = np.concatenate([np.concatenate([[-1], r]) for r in kept])
        assert st.kept().tolist() == buf.tolist()
        # every bigram inside a request is indexed exactly once, keys sorted, positions ascending per key
        expect = sorted(((int(buf[p - 1]) << 32 | int(buf[p])), st.live + p)
                        for p in range(1, len(buf)) if buf[p - 1] >= 0 and buf[p] >= 0)
        keys, ends = st.index()
        assert list(zip(keys.tolist(), ends.tolist())) == expect
        assert st.num_tokens == sum(map(len, kept))
        for key in set(keys.tolist()):  # a lookup finds every occurrence, in the sorted run or the log
            assert st.occurrences(key, 10**6).tolist() == [e for kk, e in expect if kk == key]
        assert st.occurrences((7 << 32) | 7, 10**6).shape == (0,)  # token 7 never occurs
        snapshots.append((st, st.kept().tolist(), [st.occurrences(key, 10**6).tolist() for key in keys[:5].tolist()]))
    assert 2 <= compactions < 30 and all_parts > 5  # most inserts append; compactions now and then
    for old, buf, occ in snapshots:  # later inserts never wrote into what a snapshot reads
        assert old.kept().tolist() == buf
        keys = old.index()[0]
        assert [old.occurrences(key, 10**6).tolist() for key in keys[:5].tolist()] == occ


def test_inserting_into_an_older_snapshot_does_not_disturb_the_newer_one():
    st = SuffixStore.empty().insert(np.array([1, 2, 3]))
    a = st.insert(np.array([4, 5, 6]))
    b = st.insert(np.array([7, 8, 9]))  # same parent: must not write where `a` reads
    assert a.kept().tolist() == [-1, 1, 2, 3, -1, 4, 5, 6]
    assert b.kept().tolist() == [-1, 1, 2, 3, -1, 7, 8, 9]
    assert a.occurrences((4 << 32) | 5, 10).tolist() == [a.live + 6]
    assert b.occurrences((4 << 32) | 5, 10).tolist() == []


def test_insert_cost_does_not_grow_with_the_store():
    """Appending a request is O(its tokens): at a full 262k-token store it costs about what it
    costs at a small one (the old sorted-array insert was O(store) on every request)."""
    import time

    rng = np.random.default_rng(3)
    big = SuffixDrafter(SuffixConfig(max_tokens=262_144))
    for _ in range(900):
        big.observe_request(rng.integers(0, 49_152, 300))
    small = SuffixDrafter(SuffixConfig(max_tokens=262_144))
    small.observe_request(rng.integers(0, 49_152, 300))

    def median_insert(d):
        times = []
        for _ in range(60):
            req = rng.integers(0, 49_152, 300)
            t0 = time.perf_counter()
            d.observe_request(req)
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    assert big.memory().tokens > 250_000
    assert median_insert(big) < 4 * median_insert(small) + 2e-4


def test_concurrent_inserts_and_proposals_are_safe():
    """4 threads insert while 4 propose: no exception, every proposal a true continuation."""
    d = SuffixDrafter(SuffixConfig(max_tokens=5000))
    seq = list(range(1000, 1400))  # every inserted request is a window of this sequence
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(150):
                a = int(rng.integers(0, 300))
                d.observe_request(seq[a:a + int(rng.integers(20, 100))], tenant=None if seed % 2 else "t")
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def reader(seed):
        rng = np.random.default_rng(100 + seed)
        try:
            n = 0
            while not stop.is_set() or n < 50:
                a = int(rng.integers(0, 390))
                ctx = [7, *seq[a:a + 3]]
                toks = rows(*d.propose([ctx], 8, tenants=[None if seed % 2 else "t"]))[0]
                assert toks == seq[a + 3:a + 3 + len(toks)]
                n += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    writers = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    readers = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
    for t in writers + readers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    for t in readers:
        t.join()
    assert not errors, errors[0]
    # which tenant's requests eviction left depends on the threads' interleaving: the newest
    # request of each tenant survives (oldest evicted first)
    d.observe_request(seq[:30], tenant=None)
    d.observe_request(seq[:30], tenant="t")
    mem = d.memory()
    assert 0 < mem.tokens <= 5000 and mem.tenants == 2
    assert mem.requests + mem.evicted_requests == 602  # and the two above


def test_tenants_are_kept_apart():
    d = SuffixDrafter()
    secret = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    d.observe_request(secret, tenant="alice")
    assert rows(*d.propose([[3, 1, 4]], 8, tenants=["alice"]))[0] == [1, 5, 9, 2, 6, 5]
    assert rows(*d.propose([[3, 1, 4]], 8, tenants=["bob"]))[0] == []
    assert rows(*d.propose([[3, 1, 4]], 8))[0] == []  # the shared store
    assert d.memory().tenants == 1


def test_a_fresh_drafter_has_learned_nothing():
    d = SuffixDrafter(SuffixConfig(max_tokens=123))
    d.observe_request([1, 2, 3, 4])
    f = d.fresh()
    assert f.config == d.config and f.memory().tokens == 0 and d.memory().tokens == 4


# ---------------------------------------------------------------------------------------------
# in the engine


@pytest.fixture(scope="module")
def sr(tiny_pool_dirs):
    from fixtures import named_router

    return named_router(tiny_pool_dirs, ("target", "mid", "draft"), adaptive=False)


def test_pool_registers_suffix_by_default(sr, tiny_pool_dirs):
    from specrouter.models.pool import Pool

    assert isinstance(sr.pool.drafters["suffix"], SuffixDrafter)
    assert sr.pool.order[:2] == ["ngram", "suffix"]
    p = Pool.load([tiny_pool_dirs["target"]], names=["target"], dtype="float64", suffix=False)
    assert "suffix" not in p.drafters and "suffix" not in p.order
    view = sr.pool.without_drafters(["suffix"])
    assert "suffix" not in view.order and "suffix" in sr.pool.order
    assert sr.pool.with_fresh_drafters().drafters["suffix"] is not sr.pool.drafters["suffix"]


CHAINS = [("suffix", "target"), ("suffix", "draft", "target"), ("suffix", "draft", "mid", "target")]


@pytest.mark.parametrize("chain", CHAINS, ids=lambda c: ">".join(c))
def test_greedy_output_equals_target_with_suffix_levels(sr, chain):
    """Depth 1-3 below the target, a ragged batch, twice: the second time the suffix drafter
    knows every output (it proposes long runs), the output is still the target's."""
    from fixtures import repeating_prompts
    from test_greedy_equivalence import MAX_NEW, PROMPT_LENS

    batch = repeating_prompts(PROMPT_LENS)
    plain = sr.generate(batch, max_new_tokens=MAX_NEW, ignore_eos=True, chain=("target",))
    pool = sr.pool.with_fresh_drafters()
    from specrouter import SpecRouter

    fresh = SpecRouter(pool)
    for k in (1, 3, 6):
        for _ in range(2):
            out = fresh.generate(batch, max_new_tokens=MAX_NEW, ignore_eos=True, chain=chain, k=k)
            assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    assert pool.drafters["suffix"].memory().requests == 3 * 2 * len(batch)


class FloorRouter(QuietRouterHooks):
    """Random suffix plans (depth 1-3), k and confidence floors every cycle: the engine must hand
    each row's floor to the drafter, and the output must stay the target's."""

    def __init__(self, seed=0):
        import random

        self.rng = random.Random(seed)

    def decide(self, row):
        from specrouter.records.routing import Decision

        chain = self.rng.choice(CHAINS)
        return Decision(chain, self.rng.randint(1, 8), 0.0, "random", self.rng.choice([0.0, 0.3, 0.7, 1.0]))


def test_greedy_output_equals_target_with_router_confidence_floors(sr):
    """Router-driven suffix plans with floors from 0 to 1, twice (the second time the drafter
    knows every output): identical to plain decoding, and the floors reached the drafter."""
    from test_greedy_equivalence import MAX_NEW

    from specrouter import SpecRouter

    g = torch.Generator().manual_seed(1)
    batch = [(torch.randint(3, 300, (n // 2,), generator=g).tolist() * 3)[:n] for n in (4, 9, 15, 22)]
    plain = sr.generate(batch, max_new_tokens=MAX_NEW, ignore_eos=True, chain=("target",))
    pool = sr.pool.with_fresh_drafters()
    suffix = pool.drafters["suffix"]
    seen, propose = [], suffix.propose

    def spy(contexts, k, tenants=None, min_confidence=None):
        seen.append(min_confidence)
        return propose(contexts, k, tenants, min_confidence)

    suffix.propose = spy
    fresh = SpecRouter(pool, FloorRouter())
    for _ in range(2):
        out = fresh.generate(batch, max_new_tokens=MAX_NEW, ignore_eos=True)
        assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    floors = {f for call in seen if call is not None for f in call}
    assert {0.3, 0.7, 1.0} <= floors  # the executor passed the rows' floors (0.0 rows ride along)
    assert sum(r.stats.accepted.get("suffix>target", 0) for r in out) > 0  # it drafted, and was right


def test_a_second_identical_request_drafts_longer(sr):
    from specrouter import SpecRouter

    fresh = SpecRouter(sr.pool.with_fresh_drafters())
    prompt = [5, 17, 42, 99, 7, 250, 31, 8]
    first = fresh.generate(prompt, max_new_tokens=40, ignore_eos=True, chain=("suffix", "target"), k=8)[0]
    second = fresh.generate(prompt, max_new_tokens=40, ignore_eos=True, chain=("suffix", "target"), k=8)[0]
    assert second.token_ids == first.token_ids
    a1, a2 = first.stats.accepted.get("suffix>target", 0), second.stats.accepted.get("suffix>target", 0)
    assert a2 >= 30 and a2 > a1
    assert second.stats.cycles <= 40 / 8 + 1 < first.stats.cycles
    assert second.stats.mean_acceptance_length > 6


def test_engine_feeds_each_finished_request_with_its_tenant(sr):
    from specrouter.config import SamplingParams
    from specrouter.engine.engine import Engine

    pool = sr.pool.with_fresh_drafters()
    engine = Engine(pool)
    engine.reserve(2, 64)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    a = engine.add_request([1, 2, 3, 4], params, chain=("suffix", "target"), k=4, tenant="alice")
    b = engine.add_request([1, 2, 3, 4], params, chain=("suffix", "target"), k=4)
    while engine.has_unfinished():
        engine.step()
    suffix = pool.drafters["suffix"]
    assert suffix.memory().tenants == 2 and suffix.memory().requests == 2
    assert a.tokens == b.tokens
    assert rows(*suffix.propose([a.tokens[:4]], 6, tenants=["alice"]))[0] == a.tokens[4:10]
    assert rows(*suffix.propose([a.tokens[:4]], 6, tenants=["mallory"]))[0] == []


@pytest.mark.slow  # 75 s on 2 cores (50k rows); the engine-level sampling tests run by default
def test_sampling_with_a_suffix_level_keeps_the_target_distribution():
    """The engine-sampling test's joint of two tokens, with the suffix drafter first and a
    global tree that proposes often (fed with earlier "outputs")."""
    import tempfile
    from pathlib import Path

    import test_engine_sampling as es
    from fixtures import make_tiny_llama

    from specrouter.engine.engine import Engine
    from specrouter.models.pool import Pool, load_runner

    root = Path(tempfile.mkdtemp())
    kw = dict(vocab_size=es.V, hidden_size=16, num_heads=2, num_kv_heads=1, with_tokenizer=False,
              tie_word_embeddings=False, dtype=torch.float64)
    target = make_tiny_llama(root / "target", num_layers=2, seed=11, **kw)
    draft = make_tiny_llama(root / "draft", num_layers=1, seed=13, **kw)
    runners = {n: load_runner(p, name=n, dtype=torch.float64) for n, p in [("draft", draft), ("target", target)]}
    suffix = SuffixDrafter(SuffixConfig(min_token_prob=0.01))
    for a in range(es.V):  # after the prompt, every first token, then token (a + 3) % V
        suffix.observe_request(es.PROMPT + [a, (a + 3) % es.V, 0])
    suffix.observe_request = lambda tokens, tenant=None: None  # not 100k more inserts: fixed statistics
    pool = Pool(runners=runners, drafters={"suffix": suffix}, order=["suffix", "draft", "target"],
                target="target", tokenizer=None, eos_ids=(), vocab_width=es.V)
    exact = es.target_joint(pool)
    rows_n = 50_000
    for chain in (("suffix", "target"), ("suffix", "draft", "target")):
        g = torch.Generator().manual_seed(99)
        seqs = Engine(pool).generate_ids([es.PROMPT] * 4, [es.PARAMS] * 4, chain=chain, k=2, generator=g)
        assert sum(s.stats.drafted.get(f"suffix>{chain[1]}", 0) for s in seqs) > 0  # it proposed
        seqs = Engine(pool).generate_ids([es.PROMPT] * rows_n, [es.PARAMS] * rows_n, chain=chain, k=2,
                                         generator=g)
        out = torch.tensor([s.output_ids for s in seqs])  # (rows, 2)
        counts = torch.zeros(es.V, es.V, dtype=torch.float64)
        counts.index_put_((out[:, 0], out[:, 1]), torch.ones(rows_n, dtype=torch.float64), accumulate=True)
        tv = 0.5 * (counts / rows_n - exact).abs().sum().item()
        assert tv < 0.03, (chain, tv)  # 64 outcomes, 50k draws: noise alone gives TV ~ 0.014


# ---------------------------------------------------------------------------------------------
# router


def suffix_router(hit: bool):
    """A router over [suffix, d1, T] after 300 shadow-scored cycles in which the suffix drafter
    always (hit) or never proposed the committed tokens."""
    from test_router import StepTimer, swept_profile

    from specrouter.router.policy import Router
    from specrouter.records.routing import RowContext

    profile = swept_profile(("d1", "T"), ngram=False)
    sizes = {"d1": 10_000_000, "T": 135_000_000}
    router = Router(["suffix", "d1", "T"], "T", profile, model_free={"suffix"}, sizes=sizes, timer=StepTimer())
    for i in range(300):
        router.decide(RowContext(0, 100 + i))
        committed = [1, 2, 3, 4, 5]
        router.observe_shadow(0, "suffix", committed if hit else [], committed, 16)
    return router


def test_router_prunes_a_suffix_drafter_that_never_proposes_and_uses_one_that_does():
    from specrouter.records.routing import RowContext

    useless = suffix_router(hit=False)
    row = RowContext(0, 400)
    table, _ = useless.evaluate(row, useless.requests[0], prune=True)
    pruned = [c for c, t in zip(table.chains, table.t_eff) if c[0] == "suffix" and np.isinf(t).all()]
    assert len(pruned) == 2 and useless.hit_rate("suffix", useless.requests[0]) < useless.config.prune_below
    assert all(e.chain[0] != "suffix" for e in list(useless.events)[-50:] if e.reason != "probe")
    useful = suffix_router(hit=True)
    assert useful.decide(row).chain[0] == "suffix"


def test_router_gives_a_suffix_plan_its_break_even_confidence():
    """The floor is the chain's verifiers' extra seconds per candidate over the plan's T_eff:
    higher where a candidate costs more (a batch of 8 rows: the target's forward is wider)."""
    from specrouter.router.cost_model import break_even_confidence
    from specrouter.records.routing import RowContext

    router = suffix_router(hit=True)
    floors = {}
    for b in (1, 8):
        d = router.decide(RowContext(100 + b, 400, batch_size=b))
        assert d.chain[0] == "suffix" and d.k >= 1
        rows = router.board.cost_rows(b, 400, router.t_width)
        assert d.min_confidence == pytest.approx(break_even_confidence([rows[m] for m in d.chain[1:]], d.k, d.t_eff))
        floors[b] = d.min_confidence
    assert 0.0 < floors[1] < floors[8] < 1.0
    plain = router.decide(RowContext(200, 400, remaining=1))  # no room to draft
    assert plain.k == 0 and plain.min_confidence == 0.0


# ---------------------------------------------------------------------------------------------
# server: whose statistics a request uses


def test_server_tenant_is_the_authorization_header_when_scoped_per_key():
    from types import SimpleNamespace

    from specrouter.config import ServerConfig
    from specrouter.server.validate import tenant_of

    def req(auth=None):
        return SimpleNamespace(headers={} if auth is None else {"authorization": auth})

    shared = SimpleNamespace(config=ServerConfig())
    assert tenant_of(shared, req("Bearer a")) is None  # default: one shared store
    per_key = SimpleNamespace(config=ServerConfig(suffix_scope="api-key"))
    a, b = tenant_of(per_key, req("Bearer key-a")), tenant_of(per_key, req("Bearer key-b"))
    assert a != b and a == tenant_of(per_key, req("Bearer key-a")) and "key-a" not in a
    assert tenant_of(per_key, req()) == "anonymous"
    with pytest.raises(ValueError, match="suffix_scope"):
        ServerConfig(suffix_scope="user")


def test_a_confident_suffix_draft_runs_where_the_router_plans_plain(tiny_pool_dirs, monkeypatch):
    """Suffix decoding's rule on top of the router: a router that plans plain decoding for every
    row (scripted) still drafts an exact retry from the suffix drafter's long confident match,
    because the cost model says a wide verification of it pays; the output stays the target's,
    and a sampled row never gets such a draft (its confidence is not the target's probability)."""
    from fixtures import named_router

    from specrouter.records.routing import Decision

    sr = named_router(tiny_pool_dirs, ("target", "draft"))
    router = sr.router
    monkeypatch.setattr(router, "decide", lambda row: Decision((router.target,), 0, 0.0, "scripted", 0.0))
    prompt = torch.randint(3, 300, (12,), generator=torch.Generator().manual_seed(7)).tolist()
    plain = sr.generate(prompt, max_new_tokens=40, ignore_eos=True, chain=("target",))[0]
    first = sr.generate(prompt, max_new_tokens=40, ignore_eos=True)[0]  # the store knows `plain`'s text
    again = sr.generate(prompt, max_new_tokens=40, ignore_eos=True)[0]
    for out in (first, again):
        assert out.token_ids == plain.token_ids
        assert out.stats.accepted.get("suffix>target", 0) >= 30 and out.stats.cycles <= 10
    sampled = sr.generate(prompt, max_new_tokens=40, ignore_eos=True, temperature=0.7, seed=3)[0]
    assert sampled.stats.cycles == 40 and not sampled.stats.accepted.get("suffix>target", 0)


@pytest.mark.parametrize("order", [("alice", "bob"), ("bob", "alice")])
def test_a_batch_mixing_tenants_gives_each_row_its_own_tenants_continuations(order):
    """Rows of two tenants proposed together, in both orders: each row drafts only from its own
    tenant's store (a drafter that proposed every row from row 0's tenant fails one order)."""
    d = SuffixDrafter()
    learned = {"alice": [3, 1, 4, 1, 5, 9, 2, 6], "bob": [3, 1, 4, 2, 7, 1, 8, 2]}
    for tenant, tokens in learned.items():
        d.observe_request(tokens, tenant=tenant)
    ctx = [3, 1, 4]
    got = rows(*d.propose([ctx, ctx, ctx], 8, tenants=[*order, None]))
    assert got == [learned[order[0]][3:], learned[order[1]][3:], []]  # None: the empty shared store
    # scored and per-row floors too, and a tenant nobody has taught
    tokens, lengths, _ = d.propose_scored([ctx, ctx], [4, 4], tenants=[order[1], "mallory"],
                                          min_confidence=[0.0, 0.0])
    assert rows(tokens, lengths) == [learned[order[1]][3:7], []]


@pytest.mark.parametrize("order", [("alice", "bob"), ("bob", "alice")])
def test_engine_rows_of_two_tenants_in_one_batch_draft_as_they_would_alone(sr, order):
    """Through the engine (`suffix > target` rows drafting in the same step): alice's store
    knows this prompt's continuation, bob's does not; batched together, in either order, each
    row accepts exactly what it accepts alone, so neither row drafted from the other's store."""
    from specrouter.config import SamplingParams
    from specrouter.engine.engine import Engine

    prompt = [5, 17, 42, 99, 7, 250, 31, 8]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = sr.generate(prompt, max_new_tokens=24, ignore_eos=True, chain=("target",))[0].token_ids

    def run(tenants):
        pool = sr.pool.with_fresh_drafters()
        pool.drafters["suffix"].observe_request(prompt + plain, tenant="alice")  # only alice has seen it
        engine = Engine(pool)
        engine.reserve(len(tenants), 64)
        seqs = [engine.add_request(prompt, params, chain=("suffix", "target"), k=8, tenant=t) for t in tenants]
        while engine.has_unfinished():
            engine.step()
        assert all(s.output_ids == plain for s in seqs)
        return [s.stats.accepted.get("suffix>target", 0) for s in seqs]

    alone = {t: run([t])[0] for t in ("alice", "bob")}
    assert alone["alice"] >= 20 > alone["bob"] + 10  # the test can tell the stores apart
    assert run(list(order)) == [alone[t] for t in order]
