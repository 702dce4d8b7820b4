"""Token trees from the suffix drafter (issue 28, docs/trees.md "Suffix trees"): where the matched
context suffix was followed by different tokens, the drafter proposes them all, weighted by
frequency (drafters/trees.py), and the target verifies the tree in one forward.

Unit: `grow` builds the best-first tree the frequencies give (its main path is the chain proposal
`walk` gives), `merge` the union of two trees; the policy's `prune` picks the nodes worth their
measured T(n). Engine: rows verifying suffix trees generate exactly plain decoding's tokens
(float32 and bfloat16, greedy and t=0.8, ragged batches beside chain rows), alternatives below
the main path are accepted, and a negative control (the tree's nodes fed as a chain: positions by
node index) breaks the output."""

import numpy as np
import pytest
from fixtures import generated_ids, named_router, repeating_prompts

from specrouter.drafters.suffix import SuffixConfig, SuffixDrafter, walk
from specrouter.drafters.trees import EMPTY_TREE, TreeProposal, grow, merge
from specrouter.engine.tree_policy import FixedTreeShape, TreePolicy


def _paths(t: TreeProposal) -> dict[tuple[int, ...], float]:
    out: list[tuple[int, ...]] = []
    for tok, p in zip(t.tokens.tolist(), t.parents.tolist()):
        out.append((*(out[p] if p >= 0 else ()), tok))
    return dict(zip(out, t.confidence.tolist()))


def _check_tree(t: TreeProposal) -> None:
    """Best-first order: parents first, confidences non-increasing, siblings most confident first."""
    assert all(-1 <= p < i for i, p in enumerate(t.parents.tolist()))
    assert np.all(np.diff(t.confidence) <= 1e-12)
    for i, p in enumerate(t.parents.tolist()):
        if p >= 0:
            assert t.confidence[i] <= t.confidence[p] + 1e-12


def test_grow_counts_every_continuation():
    # the suffix (5, 6) occurs 3 times, followed by 7, 8, 7; then 7 by 1 and 3
    corpus = np.array([5, 6, 7, 1, 5, 6, 8, 2, 5, 6, 7, 3, 9], dtype=np.int64)
    ends = np.array([1, 5, 9])
    t = grow(corpus, ends, corpus.shape[0], budget=10, max_depth=3, min_prob=0.0)
    _check_tree(t)
    paths = _paths(t)
    assert paths[(7,)] == pytest.approx(2 / 3) and paths[(8,)] == pytest.approx(1 / 3)
    assert paths[(7, 1)] == pytest.approx(1 / 3) and paths[(7, 3)] == pytest.approx(1 / 3)
    assert paths[(8, 2)] == pytest.approx(1 / 3) and paths[(7, 1, 5)] == pytest.approx(1 / 3)
    assert (7, 3, 9) in paths and len(t) == 8  # (7, 3) ends at 9, then the corpus ends
    assert [int(t.tokens[i]) for i in t.main_path()] == [7, 1, 5]
    # budget, depth and the confidence floor bound it
    assert len(grow(corpus, ends, corpus.shape[0], 3, 3, 0.0)) == 3
    assert max(len(p) for p in _paths(grow(corpus, ends, corpus.shape[0], 10, 2, 0.0))) == 2
    assert set(_paths(grow(corpus, ends, corpus.shape[0], 10, 3, 0.5))) == {(7,)}
    assert grow(corpus, ends[:0], corpus.shape[0], 10, 3, 0.0) is EMPTY_TREE


def test_the_main_path_is_walks_chain():
    rng = np.random.default_rng(0)
    for _ in range(200):
        corpus = rng.integers(0, 4, size=60).astype(np.int64)
        ends = np.flatnonzero(corpus[:-1] == corpus[-1])
        if ends.shape[0] == 0:
            continue
        depth, floor = int(rng.integers(1, 6)), float(rng.choice([0.0, 0.1, 0.3]))
        t = grow(corpus, ends, corpus.shape[0], 64, depth, floor)
        _check_tree(t)
        chain = walk(corpus, ends, corpus.shape[0], depth, floor)
        assert [int(t.tokens[i]) for i in t.main_path()] == chain.tokens.tolist()
        assert np.allclose(t.confidence[t.main_path()], chain.confidence)
        # a smaller budget keeps the most confident nodes: a prefix of the full tree
        small = grow(corpus, ends, corpus.shape[0], 5, depth, floor)
        assert small.tokens.tolist() == t.tokens[:5].tolist() and small.parents.tolist() == t.parents[:5].tolist()


def test_merge_is_the_union_with_the_larger_confidence():
    a = TreeProposal(np.array([1, 2, 3]), np.array([-1, 0, -1]), np.array([0.6, 0.5, 0.3]), 2)
    b = TreeProposal(np.array([1, 4, 2]), np.array([-1, 0, 0]), np.array([0.9, 0.6, 0.2]), 3)
    m = merge([a, b], budget=10)
    _check_tree(m)
    assert _paths(m) == {(1,): 0.9, (1, 4): 0.6, (1, 2): 0.5, (3,): 0.3}
    assert m.match_len == 3
    assert _paths(merge([a, b], budget=2)) == {(1,): 0.9, (1, 4): 0.6}
    assert merge([a, EMPTY_TREE], 10) is a and merge([], 10) is EMPTY_TREE


def test_the_drafter_proposes_its_chain_as_the_main_path():
    d = SuffixDrafter(SuffixConfig(min_token_prob=0.1))
    ctx = np.array([5, 6, 7, 1, 5, 6, 8, 2, 5, 6, 7, 3, 9, 5, 6], dtype=np.int64)
    tree = d.propose_tree_row(ctx, 10, 4)
    chain = d.propose_row(ctx, 4)
    assert [int(tree.tokens[i]) for i in tree.main_path()] == chain.tokens.tolist()
    assert {(7,), (8,)} <= set(_paths(tree))
    # what earlier requests did joins the request's own continuations
    d.observe_request([5, 6, 9, 9, 4])
    paths = _paths(d.propose_tree_row(ctx, 10, 4))
    assert paths[(9, 9, 4)] == 1.0 and (7,) in paths and (8,) in paths
    assert len(d.propose_tree_row(ctx, 3, 4)) == 3 and len(d.propose_tree_row(ctx, 0, 4)) == 0


class _Row:  # what prune reads of the executor's RowWork
    def __init__(self):
        self.start, self.k = 100, 4
        self.seq = type("S", (), {"seq_id": 1})()


def test_prune_buys_nodes_at_their_measured_cost():
    # a main path of 3 (confidence 0.5 each) and alternatives at 0.4, 0.3 below the root
    prop = TreeProposal(np.array([1, 2, 9, 3, 8]), np.array([-1, 0, -1, 1, -1]),
                        np.array([0.5, 0.5, 0.4, 0.5, 0.3]), 4)
    flat = TreePolicy(lambda n, L: 0.010, lambda d, n, L: 0.0, frozenset(), free=frozenset({"suffix"}))
    assert flat.prune(_Row(), prop) == 5  # verifying more costs nothing: every node
    steep = TreePolicy(lambda n, L: 0.010 * n, lambda d, n, L: 0.0, frozenset(), free=frozenset({"suffix"}))
    assert steep.prune(_Row(), prop) == 0  # each node costs a step: the chain
    # a main-path-only prefix is the chain, never a tree
    chain = TreeProposal(np.array([1, 2]), np.array([-1, 0]), np.array([0.9, 0.8]), 4)
    assert flat.prune(_Row(), chain) == 0
    # the shape offered: the most nodes, k deep, for a single stream on a suffix chain
    seq = type("S", (), {"seq_id": 1, "params": None, "tokens": [0] * 10})()
    assert flat.shapes([seq], [(("suffix", "target"), 4)]) == [(15, 1, 4)]
    assert flat.shapes([seq, seq], [(("suffix", "target"), 4)] * 2) is None


# ---------------------------------------------------------------------------------------------
# through the engine

PROMPT_LENS = (3, 9, 14, 22, 5)
MAX_NEW = 24


@pytest.fixture(scope="module")
def pool(near_tie_pool_dirs):
    return near_tie_pool_dirs


def _gen(sr, prompts, **kw):
    return generated_ids(sr, prompts, MAX_NEW, **kw)


def _teach_wrong_turns(drafter, prompts, outputs, vocab: int = 300) -> None:
    """The store learns each request's true continuation once and, at a few places, a wrong
    token twice: there the drafter's main path is wrong and the target's token an alternative."""
    for p, o in zip(prompts, outputs):
        drafter.observe_request(p + o)
        for j in range(0, len(o) - 2, 5):
            wrong = (o[j] + 7) % vocab
            for _ in range(2):
                drafter.observe_request(p + o[:j] + [wrong] + o[j + 1:])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_suffix_tree_rows_generate_plain_decodings_tokens(pool, dtype, temperature):
    prompts = repeating_prompts(PROMPT_LENS)
    sr = named_router(pool, ("target",), dtype, ngram=False, suffix=True, adaptive=False)
    kw = dict(temperature=temperature, seed=5) if temperature else {}
    plain = _gen(sr, prompts, chain=["target"], **kw)
    drafter = sr.pool.drafters["suffix"]
    drafter.clear()
    _teach_wrong_turns(drafter, prompts, plain)
    # every other request verifies a tree, the rest their chain (a ragged batch); one alone
    fixed = FixedTreeShape(12, 1, rows=lambda s: s.seq_id % 2 == 0)
    sr.engine.tree_policy = fixed
    assert _gen(sr, prompts, chain=["suffix", "target"], k=4, **kw) == plain
    sr.engine.tree_policy = alone = FixedTreeShape(15, 1)
    assert _gen(sr, prompts[:1], chain=["suffix", "target"], k=6, **kw) == plain[:1]
    outcomes = fixed.outcomes + alone.outcomes
    assert outcomes and max(o.nodes for o in outcomes) >= 6, "trees must have been verified"
    assert any(o.accepted > o.main_accepted for o in outcomes), "an alternative must have been accepted"
    assert any(o.accepted >= 3 for o in outcomes)


def test_suffix_trees_fed_as_chains_break_the_output(pool, monkeypatch):
    """Negative control: the same trees fed to the target as a chain (each node's position its
    index, attending every earlier node) give other logits, so other tokens."""
    import specrouter.decoding.executor as executor

    prompts = repeating_prompts(PROMPT_LENS)
    sr = named_router(pool, ("target",), "float32", ngram=False, suffix=True, adaptive=False)
    plain = _gen(sr, prompts, chain=["target"])
    sr.pool.drafters["suffix"].clear()
    _teach_wrong_turns(sr.pool.drafters["suffix"], prompts, plain)
    sr.engine.tree_policy = FixedTreeShape(12, 1)
    monkeypatch.setattr(executor, "feed_parents", lambda pending, tree: list(range(-1, pending + len(tree) - 1)))
    assert _gen(sr, prompts, chain=["suffix", "target"], k=4) != plain


def test_the_router_prunes_suffix_trees_and_stays_exact(pool, monkeypatch):
    """With the router on (its TreePolicy prunes each proposal by a scripted, rising T(n)), a
    single stream on a suffix chain generates plain decoding's tokens, and some of the trees it
    verifies are proposals cut short (a best-first prefix: parents before children). With a
    flat T(n) the policy verifies whole proposals or chains only, and the last assert fails."""
    prompts = repeating_prompts(PROMPT_LENS[:2])
    sr = named_router(pool, ("target",), "float32", ngram=False, suffix=True, trees=True)
    plain = _gen(sr, prompts, chain=["target"])
    sr.pool.drafters["suffix"].clear()
    _teach_wrong_turns(sr.pool.drafters["suffix"], prompts, plain)
    policy = sr.engine.tree_policy
    assert policy is not None and "suffix" in policy.free
    # the choice must not hang on this machine's timings (under a loaded CPU the measured T(n)
    # once grew so fast that no tree paid): T(n) = 1 + 0.1 n seconds, so the host seconds weigh
    # nothing and a node is worth verifying only where its confidence buys its 0.1 s
    policy.target_cost = lambda n, context: 1.0 + 0.1 * n
    policy._costs.clear()
    pruned: list[tuple[int, int]] = []  # (nodes verified, nodes proposed)
    prune = policy.prune
    monkeypatch.setattr(policy, "prune", lambda row, proposal: pruned.append((n := prune(row, proposal), len(proposal))) or n)
    for p, o in zip(prompts, plain):
        assert _gen(sr, [p]) == [o]
    assert policy.chosen, "the policy must have verified some suffix trees"
    assert any(0 < n < total for n, total in pruned), f"no tree was cut short: {pruned}"
    # trees for greedy rows by default (a policy that keeps sampled rows on chains); "off": no policy
    default = named_router(pool, ("target",), "float32", ngram=False, suffix=True).engine.tree_policy
    assert default is not None and not default.sampled and policy.sampled
    assert named_router(pool, ("target",), "float32", ngram=False, suffix=True, trees="off").engine.tree_policy is None
