"""The tree-shape policy (engine/tree_policy.py) picks what its closed form says: from fake
costs T(n) and per-depth rank evidence, a tree (its depth, width and budget) when the drafter's
other children are often the target's token and verifying more nodes is cheap, the chain when
they are not, when nodes are expensive, or when the host time per tree depth measured from the
steps eats the gain; only for a model drafter of a 2-level chain in a single stream."""

from types import SimpleNamespace

from specrouter.engine.tree_policy import RankEvidence, TreePolicy, expected_tokens, node_values


def _policy(per_token: float, drafters=frozenset({"draft"}), draft_per_token: float = 0.0):
    return TreePolicy(lambda n, L: 1.0 + per_token * (n - 1), lambda d, n, L: 0.05 + draft_per_token * (n - 1),
                      drafters)


def test_expected_tokens_closed_form():
    rates = lambda d: [0.5, 0.2, 0.1, 0.0]  # noqa: E731
    assert expected_tokens(rates, 3, 3, 1) == 1 + 0.5 + 0.25 + 0.125  # the chain
    # depth 2, width 2: depth 0 children 0.5, 0.2; both expanded: 0.25, 0.1, 0.1, 0.04
    assert [round(v, 12) for v in node_values(rates, 2, 2)] == [0.5, 0.25, 0.2, 0.1, 0.1, 0.04]
    assert abs(expected_tokens(rates, 2, 3, 2) - (1 + 0.5 + 0.25 + 0.2)) < 1e-12
    # only the width best of a depth are expanded: depth 3, width 1 from a bushier depth is a chain
    assert expected_tokens(lambda d: [0.5, 0.4], 3, 3, 1) == 1 + 0.5 + 0.25 + 0.125
    # per depth: deeper nodes are worth what the deeper rates say
    assert expected_tokens(lambda d: [0.5] if d == 0 else [1.0], 3, 3, 1) == 1 + 0.5 * 3


def test_trees_where_other_children_pay_chains_where_they_do_not():
    evidence = _policy(0).evidence
    cheap, dear, never = _policy(0.01), _policy(5.0), _policy(0.01)
    cheap.evidence = dear.evidence = evidence
    for _ in range(300):  # the draft's first child 80% of the time, its second 20%
        evidence.setdefault(("draft", True), cheap._evidence("draft", True)).observe((0, 0, 0, 0, 1))
    budget, width, depth, _ = cheap.shape("draft", True, 3, 100)
    assert budget > depth and width >= 2  # a node costs 1% of a step: the other children pay
    assert dear.shape("draft", True, 3, 100) == (0, 1, 3)  # five steps a node: the chain
    for _ in range(300):  # other children never hit
        never._evidence("draft", True).observe((0, 0, -1))
    assert never.shape("draft", True, 3, 100) == (0, 1, 3)


def test_host_time_per_tree_depth_is_measured_and_priced():
    """Steps' wall time minus their forwards, per depth: a tree whose drafting costs a step of
    host time per depth is not worth it."""
    p = _policy(0.01)
    for _ in range(300):
        p._evidence("draft", True).observe((0, 0, 0, 0, 1))
    assert p.shape("draft", True, 3, 100)[0] > 0

    row = SimpleNamespace(seq_id=1, params=SimpleNamespace(greedy=True))
    for _ in range(100):
        p.observe(_step([], 4, 1.2, 1.0), [row])
        p.observe(_step([_tree(3, (0, 0, 0, 0, 1))], 4, 5.0, 1.0), [row])
    assert abs(p.host["chain"] - 0.05) < 1e-3 and abs(p.host["tree"] - 1.0) < 1e-3
    assert p.shape("draft", True, 3, 100) == (0, 1, 3)


def _step(trees, k, wall=1.0, forwards=0.9, accepted=2):
    outcome = SimpleNamespace(seq_id=1, chain=("draft", "target"), k=k, drafted=[k, k], accepted=[0, accepted])
    return SimpleNamespace(outcomes=[outcome], trees=trees, wall_time=wall, forward_time={"target": forwards})


def _tree(accepted, ranks):
    return SimpleNamespace(seq_id=1, accepted=accepted, ranks=ranks, width=4, children=4)


def test_trees_that_commit_less_than_expected_are_dropped():
    """The expected tokens are calibrated by what cycles commit: trees that commit one token
    a cycle whatever the evidence says are no longer chosen; chains' rejections count as rank
    evidence too (the first child missed)."""
    p = _policy(0.01)
    seq = SimpleNamespace(seq_id=1, params=SimpleNamespace(greedy=True), tokens=[1] * 10)
    for _ in range(300):
        p._evidence("draft", True).observe((0, 0, 0, 0, 1))
    assert p.shapes([seq], [(("draft", "target"), 3)])[0][0] > 0
    for _ in range(200):
        shape = p.shapes([seq], [(("draft", "target"), 3)])[0]
        if not shape[0]:
            break
        p.observe(_step([_tree(0, (0, 0, 0, 0, 1))], shape[2]), [seq])
    assert p.shapes([seq], [(("draft", "target"), 3)])[0][0] == 0 and p._calibration("tree") < 0.7
    ev = p._evidence("draft", True)
    before = ev.rates(1)[0]
    for _ in range(50):
        p.observe(_step([], 3, accepted=1), [seq])  # depth 0 accepted, depth 1 rejected
    assert ev.rates(1)[0] < before / 2 and ev.rates(0)[0] > 0.9


def test_only_model_drafters_of_two_level_chains_in_a_single_stream():
    p = _policy(0.01)
    seq = SimpleNamespace(seq_id=1, params=SimpleNamespace(greedy=True), tokens=[1] * 10)
    assert p.shapes([seq], [(("draft", "target"), 3)]) is not None
    assert p.shapes([seq], [(("ngram", "target"), 3)]) is None
    assert p.shapes([seq], [(("draft", "mid", "target"), 3)]) is None
    assert p.shapes([seq, seq], [(("draft", "target"), 3)] * 2) is None


def test_rank_evidence_decays_towards_recent_ranks_per_depth():
    ev = RankEvidence(width=3, decay=0.99)
    for _ in range(1000):
        ev.observe((1,))
    assert ev.rates()[1] > 0.9 and ev.rates(0)[1] > 0.9
    for _ in range(1000):
        ev.observe((0,))
    assert ev.rates()[0] > 0.9 and ev.rates()[1] < 0.05
    # depth 0: rank 1 hits; depth 2: rank 0 hits; an unseen depth follows all depths
    ev = RankEvidence(width=3, decay=1.0)
    for _ in range(200):
        ev.observe((1,))
        ev.observe((0, 0, 0))
    assert ev.rates(0)[1] > 0.45 and ev.rates(2)[0] > 0.9 and ev.rates(1)[0] > 0.9


def _profile(target_cost, new_tokens):
    from specrouter.router.profile import CostProfile

    prof = CostProfile()
    grid = dict(batch_sizes=(1, 4), new_tokens=new_tokens, context_lengths=(128, 1024))
    prof.set_function("target", lambda b, t, L: target_cost(t), **grid)
    prof.set_function("draft", lambda b, t, L: 0.001 + 0.00002 * t, **grid)
    return prof


def _evidence_of_a_good_draft(p: TreePolicy) -> None:
    # the target's token: the draft's first child 70% of the time, its 2nd 12%, 3rd 6%, 4th 3%
    ranks = [0] * 70 + [1] * 12 + [2] * 6 + [3] * 3 + [-1] * 9
    ev = p._evidence("draft", True)
    for i in range(400):
        ev.observe(tuple(ranks[(7 * i + 13 * d) % 100] for d in range(4)))


def test_the_node_cap_follows_the_profile_and_flat_costs_buy_bigger_trees():
    """Two scripted profiles: T(n) flat (verifying 32 tokens costs 1.1 steps, swept to n = 32)
    and steep (n steps a verification). The flat one's policy picks a tree of more than 15
    nodes; the steep one keeps the chain. Negative control: the same flat costs swept only to
    n = 16 cap the budget at 15 (the cap is the profile's, not a constant)."""
    flat = lambda t: 0.010 * (1 + (t - 1) / 300)  # noqa: E731
    steep = lambda t: 0.010 * t  # noqa: E731
    wide, narrow = (1, 2, 4, 8, 16, 32), (1, 2, 4, 8, 16)
    policies = {}
    for label, cost, grid in (("flat", flat, wide), ("steep", steep, wide), ("flat16", flat, narrow)):
        p = TreePolicy.from_profile(_profile(cost, grid), "target", frozenset({"draft"}))
        _evidence_of_a_good_draft(p)
        policies[label] = p
    assert policies["flat"].max_nodes == 31 and policies["flat16"].max_nodes == 15
    budget, width, depth, children = policies["flat"].shape("draft", True, 4, 200)
    assert budget > 15 and width >= 3, (budget, width, depth, children)
    assert policies["steep"].shape("draft", True, 4, 200) == (0, 1, 4)
    assert 0 < policies["flat16"].shape("draft", True, 4, 200)[0] <= 15


def test_more_children_than_the_frontier_and_censored_evidence():
    """Children beyond the frontier's width cost no draft forward: where the draft's 5th-8th
    guesses hit, the policy offers 8 children per node; a tree of C children that missed says
    only "not among the first C": it leaves ranks C.. their share (censored), not zero."""
    p = _policy(0.002)
    ev = p._evidence("draft", True)
    for _ in range(300):
        ev.observe((0, 5, 0, 6), 8)
    shape = p.shape("draft", True, 3, 100)
    assert shape[0] > 0 and shape[3] == 8 > shape[1], shape
    censored, blunt = RankEvidence(width=8), RankEvidence(width=8)
    for _ in range(200):
        censored.observe((-1,), 4)  # none of 4 children
        blunt.observe((-1,), 8)  # none of 8
    assert censored.rates(0)[4] > 0.02 and blunt.rates(0)[4] < 0.01
    assert censored.rates(0)[0] < 0.05


def test_greedy_mode_keeps_sampled_rows_on_chains():
    """EngineConfig.trees "greedy" (the default) builds the policy with sampled=False: a sampled
    row keeps its chain (None: no tree for the step) where a greedy row, and a sampled row under
    "on", get the tree; the config reads True / False as "on" / "off" and refuses other modes."""
    import pytest

    from specrouter.config import EngineConfig

    greedy_only, both = _policy(0.01), _policy(0.01)
    greedy_only.sampled = False
    for p in (greedy_only, both):
        for mode in (True, False):
            for _ in range(300):
                p._evidence("draft", mode).observe((0, 0, 0, 0, 1))
    plan = [(("draft", "target"), 3)]
    greedy = SimpleNamespace(seq_id=1, params=SimpleNamespace(greedy=True), tokens=[1] * 10)
    sampled = SimpleNamespace(seq_id=2, params=SimpleNamespace(greedy=False), tokens=[1] * 10)
    assert greedy_only.shapes([greedy], plan)[0][0] > 0 and both.shapes([sampled], plan)[0][0] > 0
    assert greedy_only.shapes([sampled], plan) is None
    assert EngineConfig().trees == "greedy"
    assert EngineConfig(trees=True).trees == "on" and EngineConfig(trees=False).trees == "off"
    with pytest.raises(ValueError, match="trees must be one of"):
        EngineConfig(trees="sometimes")
