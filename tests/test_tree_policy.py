"""The tree-shape policy (engine/tree_policy.py) picks what its closed form says: from fake
costs T(n) and rank evidence, a tree when alternatives are often the target's token and
verifying more nodes is cheap, the chain when they are not or when nodes are expensive; only
for a model drafter of a 2-level chain in a single stream."""

from types import SimpleNamespace

from specrouter.engine.tree_policy import RankEvidence, TreePolicy, expected_tokens


def _policy(per_token: float, drafters=frozenset({"draft"})):
    return TreePolicy(lambda n, L: 1.0 + per_token * (n - 1), lambda d, L: 0.05, drafters)


def test_expected_tokens_closed_form():
    rates = [0.5, 0.2, 0.1, 0.0]
    assert expected_tokens(rates, 3, 3, 1) == 1 + 0.5 + 0.25 + 0.125  # the chain
    # 3 nodes, width 3: main d0 (0.5), main d1 (0.25), alt d0 r1 (0.2)
    assert abs(expected_tokens(rates, 3, 3, 3) - (1 + 0.5 + 0.25 + 0.2)) < 1e-12


def test_trees_where_alternatives_pay_chains_where_they_do_not():
    evidence = _policy(0).evidence
    cheap, dear, never = _policy(0.01), _policy(5.0), _policy(0.01)
    cheap.evidence = dear.evidence = evidence
    for _ in range(300):  # the draft's first choice 80% of the time, its second 20%
        evidence.setdefault(("draft", True), cheap._evidence("draft", True)).observe((0, 0, 0, 0, 1))
    budget, width = cheap.shape("draft", True, 3, 100)
    assert budget > 3 and width >= 2  # a node costs 1% of a step: the alternatives pay
    assert dear.shape("draft", True, 3, 100) == (0, 1)  # five steps a node: the chain
    for _ in range(300):  # alternatives never hit
        never._evidence("draft", True).observe((0, 0, -1))
    assert never.shape("draft", True, 3, 100) == (0, 1)


def test_only_model_drafters_of_two_level_chains_in_a_single_stream():
    p = _policy(0.01)
    seq = SimpleNamespace(params=SimpleNamespace(greedy=True), tokens=[1] * 10)
    assert p.shapes([seq], [(("draft", "target"), 3)]) is not None
    assert p.shapes([seq], [(("ngram", "target"), 3)]) is None
    assert p.shapes([seq], [(("draft", "mid", "target"), 3)]) is None
    assert p.shapes([seq, seq], [(("draft", "target"), 3)] * 2) is None


def test_rank_evidence_decays_towards_recent_ranks():
    ev = RankEvidence(width=3, decay=0.99)
    for _ in range(1000):
        ev.observe((1,))
    assert ev.rates()[1] > 0.9
    for _ in range(1000):
        ev.observe((0,))
    assert ev.rates()[0] > 0.9 and ev.rates()[1] < 0.05
