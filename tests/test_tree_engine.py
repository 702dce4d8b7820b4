"""Token trees through the engine (issue 28): with a model draft below the target, rows that
verify token trees (the draft's main path plus its alternatives, grown best-first under a node
budget) generate exactly what plain decoding of the target generates, greedy and sampled, in
float32 and bfloat16 (near-tie target logits, where one differing bit flips an argmax), in
ragged batches beside chain rows and plain rows; and the trees were verified and sometimes
accepted an alternative."""

import pytest
from fixtures import named_router, repeating_prompts

from specrouter.engine.tree_policy import FixedTreeShape

PROMPT_LENS = (3, 9, 14, 22, 5)
MAX_NEW = 24


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    from fixtures import make_near_tie_pool

    return make_near_tie_pool(tmp_path_factory.mktemp("treepool"), max_position_embeddings=256)


def _gen(sr, prompts, **kw):
    return [r.token_ids for r in sr.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True, **kw)]


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


def test_a_pruning_level_keeps_the_chain(pool):
    """Trees are verified by the target straight above a model draft; a chain with a middle
    level (which would prune the tree) keeps its chain: no tree is verified, output unchanged."""
    prompts = repeating_prompts(PROMPT_LENS[:2])
    sr = named_router(pool, ("target", "mid", "draft"), "float32", ngram=False, suffix=False, adaptive=False)
    plain = _gen(sr, prompts, chain=["target"])
    sr.engine.tree_policy = fixed = FixedTreeShape(9, 3)
    assert _gen(sr, prompts, chain=["draft", "mid", "target"], k=4) == plain
    assert fixed.outcomes == []
