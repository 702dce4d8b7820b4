"""Token trees through the engine (issue 28): with a model draft below the target, rows that
verify token trees (grown by the draft depth by depth, its best frontier nodes expanded in one
tree forward per depth, the best nodes kept under a budget: decoding/tree_drafting.py) generate
exactly what plain decoding of the target generates, greedy and sampled, in float32 and bfloat16
(near-tie target logits, where one differing bit flips an argmax), in ragged batches beside chain
rows and plain rows; the trees were verified and accepted alternatives and nodes below them; and
a draft identical to the target drafts its trees right (its tree forwards see each node's own
branch), so every tree is accepted to its full depth."""

import pytest
from fixtures import generated_ids, named_router, repeating_prompts

from specrouter.engine.tree_policy import FixedTreeShape

PROMPT_LENS = (3, 9, 14, 22, 5)
MAX_NEW = 24


@pytest.fixture(scope="module")
def pool(near_tie_pool_dirs):
    return near_tie_pool_dirs


def _gen(sr, prompts, **kw):
    return generated_ids(sr, prompts, MAX_NEW, **kw)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_tree_rows_generate_plain_decodings_tokens(pool, dtype, temperature):
    prompts = repeating_prompts(PROMPT_LENS)
    sr = named_router(pool, ("target", "draft"), dtype, ngram=False, suffix=False, adaptive=False)
    kw = dict(temperature=temperature, seed=5) if temperature else {}
    plain = _gen(sr, prompts, chain=["target"], **kw)
    # every other request verifies a tree, the rest their chain; one request runs alone
    fixed = FixedTreeShape(9, 3, rows=lambda s: s.seq_id % 2 == 0)
    sr.engine.tree_policy = fixed
    assert _gen(sr, prompts, chain=["draft", "target"], k=4, **kw) == plain
    assert _gen(sr, prompts[:1], chain=["draft", "target"], k=4, **kw) == plain[:1]
    sr.engine.tree_policy = FixedTreeShape(12, 4)
    assert _gen(sr, prompts, chain=["draft", "target"], k=3, **kw) == plain
    outcomes = fixed.outcomes + sr.engine.tree_policy.outcomes
    assert outcomes and max(o.nodes for o in outcomes) > 4, "trees must have been verified"
    if not temperature:  # (sampled, the coupled draft agrees with the target almost always here)
        assert any(o.accepted > o.main_accepted for o in outcomes), "an alternative must have been accepted"
    # plain rows beside tree rows in one batch: the plain ones pin the target alone
    sr.engine.tree_policy = FixedTreeShape(9, 3)
    mixed = [r.token_ids for r in (sr.generate(prompts[:2], max_new_tokens=MAX_NEW, ignore_eos=True,
                                               chain=["draft", "target"], k=4, **kw))]
    assert mixed == plain[:2]


def test_a_tree_depth_other_than_k(pool):
    """The policy may grow a tree deeper or shallower than the router's k: the drafter runs that
    many depths, the output is unchanged."""
    prompts = repeating_prompts(PROMPT_LENS[:3])
    sr = named_router(pool, ("target", "draft"), "float32", ngram=False, suffix=False, adaptive=False)
    plain = _gen(sr, prompts, chain=["target"])
    for depth, k in ((2, 5), (6, 2)):
        sr.engine.tree_policy = fixed = FixedTreeShape(9, 3, depth=depth)
        assert _gen(sr, prompts, chain=["draft", "target"], k=k) == plain
        assert fixed.outcomes and max(len(o.ranks) for o in fixed.outcomes) <= depth
        assert max(o.main for o in fixed.outcomes) <= depth and max(o.accepted for o in fixed.outcomes) <= depth


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_more_children_than_the_frontier_and_31_nodes(pool, temperature):
    """Children per expanded node beyond the frontier's width (8 of 4 expanded, bfloat16) and a
    31-node budget (a verification of 32 tokens, the widened sweep's largest n): plain
    decoding's tokens; the trees offered 8 children (rank evidence up to rank 7 possible)."""
    prompts = repeating_prompts(PROMPT_LENS)
    sr = named_router(pool, ("target", "draft"), "bfloat16", ngram=False, suffix=False, adaptive=False)
    kw = dict(temperature=temperature, seed=3) if temperature else {}
    plain = _gen(sr, prompts, chain=["target"], **kw)
    sr.engine.tree_policy = fixed = FixedTreeShape(31, 4, rows=lambda s: s.seq_id % 2 == 0, depth=5, children=8)
    assert _gen(sr, prompts, chain=["draft", "target"], k=4, **kw) == plain
    assert _gen(sr, prompts[:1], chain=["draft", "target"], k=4, **kw) == plain[:1]
    assert fixed.outcomes and max(o.nodes for o in fixed.outcomes) > 16
    assert {o.children for o in fixed.outcomes} == {8}


def test_a_pruning_level_keeps_the_chain(pool):
    """Trees are verified by the target straight above a model draft; a chain with a middle
    level (which would prune the tree) keeps its chain: no tree is verified, output unchanged."""
    prompts = repeating_prompts(PROMPT_LENS[:2])
    sr = named_router(pool, ("target", "mid", "draft"), "float32", ngram=False, suffix=False, adaptive=False)
    plain = _gen(sr, prompts, chain=["target"])
    sr.engine.tree_policy = fixed = FixedTreeShape(9, 3)
    assert _gen(sr, prompts, chain=["draft", "mid", "target"], k=4) == plain
    assert fixed.outcomes == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_draft_equal_to_the_target_has_its_main_paths_accepted(tmp_path, dtype):
    """The draft is the target's own weights: a tree drafted right (each frontier node's logits
    those of drafting its branch, the draft's cache rolled back to the committed prefix between
    cycles) has the target's greedy path as its main path, so every verification accepts the main
    path as far as the tree kept it. A draft tree forward that mixed up positions or ancestors
    would miss (the negative control of the runner's tree exactness is test_tree_verification's)."""
    from fixtures import make_tiny_llama

    target = make_tiny_llama(tmp_path / "target", seed=4, num_layers=2, max_position_embeddings=256)
    dirs = {"target": target, "draft": make_tiny_llama(tmp_path / "draft", seed=5, init_from=target, noise=0.0,
                                                       num_layers=2, max_position_embeddings=256)}
    sr = named_router(dirs, ("target", "draft"), dtype, ngram=False, suffix=False, adaptive=False)
    prompts = repeating_prompts(PROMPT_LENS[:3], seed=3)
    plain = _gen(sr, prompts, chain=["target"])
    sr.engine.tree_policy = fixed = FixedTreeShape(10, 3)
    assert _gen(sr, prompts, chain=["draft", "target"], k=4) == plain
    assert fixed.outcomes
    # at every node expanded along the accepted branch (the root, then nodes of depth 0, 1, ...:
    # the deeper ones expanded by the draft's tree forwards), the draft's first child was the
    # target's token, so the tree's main path was accepted as far as the tree kept it
    assert all(o.ranks and set(o.ranks) == {0} and o.accepted == o.main_accepted == o.main
               for o in fixed.outcomes)
    assert max(len(o.ranks) for o in fixed.outcomes) >= 3
