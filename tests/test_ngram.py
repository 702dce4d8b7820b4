"""The n-gram (prompt lookup) drafter: proposes what followed the longest earlier match of the
context's suffix, and nothing when there is none; checked against a plain reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specrouter.drafters.ngram import NgramConfig, NgramDrafter, ngram_lookup


def reference_lookup(ctx: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The rule written plainly: longest n first; among its earlier occurrences, the most recent
    one with k following tokens, else the most recent one."""
    L = len(ctx)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        suffix = ctx[L - n :]
        ends = [e for e in range(n - 1, L - 1) if ctx[e - n + 1 : e + 1] == suffix]
        if ends:
            full = [e for e in ends if e + k <= L - 1]
            e = full[-1] if full else ends[-1]
            return ctx[e + 1 : e + 1 + k]
    return []


def rows(tokens: torch.Tensor, lengths: torch.Tensor) -> list[list[int]]:
    return [tokens[b, : lengths[b]].tolist() for b in range(tokens.shape[0])]


def test_repetitive_context_proposes_continuation():
    ctx = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    tokens, lengths = NgramDrafter().propose([ctx], k=3)
    assert tokens.dtype == torch.int64 and lengths.dtype == torch.int64
    assert tokens.shape == (1, 3)
    assert rows(tokens, lengths) == [[8, 9, 1]]


def test_longest_match_wins():
    # suffix "2 3 4": the 3-gram occurred at the start (-> 10 11), the 2-gram "3 4" more recently
    # (-> 20 21); the longer match wins unless max_ngram rules it out
    ctx = [2, 3, 4, 10, 11, 0, 3, 4, 20, 21, 0, 2, 3, 4]
    assert rows(*NgramDrafter().propose([ctx], k=2)) == [[10, 11]]
    assert rows(*NgramDrafter(NgramConfig(max_ngram=2)).propose([ctx], k=2)) == [[20, 21]]


def test_most_recent_occurrence_preferred():
    ctx = [1, 2, 30, 31, 9, 1, 2, 40, 41, 9, 1, 2]
    assert rows(*NgramDrafter().propose([ctx], k=2)) == [[40, 41]]


def test_no_match_gives_length_zero_and_zero_padding():
    drafter = NgramDrafter()
    tokens, lengths = drafter.propose([[1, 2, 3, 4, 5], [7], [], [1, 2, 1]], k=4)
    assert tokens.shape == (4, 4)
    assert lengths.tolist() == [0, 0, 0, 2]
    assert tokens[:3].eq(0).all() and tokens[3].tolist() == [2, 1, 0, 0]


def test_min_ngram_rejects_short_matches():
    ctx = [1, 2, 3, 9, 4, 5, 3]  # only the 1-gram "3" repeats
    assert rows(*NgramDrafter(NgramConfig(min_ngram=1)).propose([ctx], k=2)) == [[9, 4]]
    assert rows(*NgramDrafter(NgramConfig(min_ngram=2)).propose([ctx], k=2)) == [[]]


def test_k_caps_the_proposal_and_k_zero():
    ctx = list(range(50)) + list(range(10))
    tokens, lengths = NgramDrafter().propose([ctx], k=5)
    assert rows(tokens, lengths) == [[10, 11, 12, 13, 14]]
    tokens, lengths = NgramDrafter().propose([ctx, ctx], k=0)
    assert tokens.shape == (2, 0) and lengths.tolist() == [0, 0]
    tokens, lengths = NgramDrafter().propose([ctx, ctx], k=[2, 7])  # per-row draft lengths
    assert tokens.shape == (2, 7) and rows(tokens, lengths) == [[10, 11], list(range(10, 17))]


def test_continuation_near_the_end_is_shortened_or_taken_from_older_occurrence():
    # period-2 text: the most recent "a b" ends 2 before the end, so it has only 2 followers;
    # an older occurrence with 4 followers is preferred for k=4 (same tokens, longer)
    ctx = [7, 1, 2, 1, 2, 1, 2, 1, 2]
    assert rows(*NgramDrafter().propose([ctx], k=4)) == [[1, 2, 1, 2]]
    # only one earlier occurrence, right before the end: it gives what it has
    assert rows(*NgramDrafter().propose([[7, 8, 1, 2, 1, 2]], k=4)) == [[1, 2]]


def test_input_types_and_ragged_batch():
    ctx = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4]
    want = [[1, 5, 9]]
    drafter = NgramDrafter()
    assert rows(*drafter.propose([ctx], 3)) == want
    assert rows(*drafter.propose([np.array(ctx, dtype=np.int32)], 3)) == want
    assert rows(*drafter.propose([torch.tensor(ctx)], 3)) == want
    tokens, lengths = drafter.propose([ctx, [1, 2, 3], ctx[:4]], 3)
    assert rows(tokens, lengths) == [[1, 5, 9], [], [4, 1]]


def test_max_lookback_limits_the_search():
    ctx = [1, 2, 50, 51] + [0] * 20 + [3, 9, 1, 2]  # only match is far back
    assert rows(*NgramDrafter().propose([ctx], k=2)) == [[50, 51]]
    near = NgramDrafter(NgramConfig(max_lookback=10))
    assert rows(*near.propose([ctx], k=2)) == [[]]


@pytest.mark.parametrize("seed", range(6))
def test_matches_reference_and_proposals_exist_in_context(seed):
    """Random small-vocabulary contexts (many partial matches): equal to the plain reference, and
    every proposal is the continuation of an earlier occurrence of a matched suffix."""
    rng = np.random.default_rng(seed)
    cfg = NgramConfig(max_ngram=int(rng.integers(1, 6)), min_ngram=1)
    cfg = NgramConfig(max_ngram=cfg.max_ngram, min_ngram=int(rng.integers(1, cfg.max_ngram + 1)))
    drafter = NgramDrafter(cfg)
    contexts = [rng.integers(0, int(rng.integers(2, 12)), size=int(rng.integers(0, 80))).tolist()
                for _ in range(40)]  # fmt: skip
    for k in (1, 3, 8):
        got = rows(*drafter.propose(contexts, k))
        for ctx, prop in zip(contexts, got):
            assert prop == reference_lookup(ctx, k, cfg.max_ngram, cfg.min_ngram)
            assert len(prop) <= k
            if prop:
                arr = np.asarray(ctx, dtype=np.int64)
                ref_prop, n = ngram_lookup(arr, k, cfg.max_ngram, cfg.min_ngram)
                assert ref_prop.tolist() == prop and n >= cfg.min_ngram
                suffix = ctx[len(ctx) - n :]
                assert any(
                    ctx[e - n + 1 : e + 1] == suffix and ctx[e + 1 : e + 1 + len(prop)] == prop
                    for e in range(n - 1, len(ctx) - 1)
                )


def test_config_validation():
    with pytest.raises(ValueError, match="min_ngram"):
        NgramConfig(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="min_ngram"):
        NgramConfig(min_ngram=0)
    with pytest.raises(ValueError, match="max_lookback"):
        NgramConfig(max_lookback=-1)
    with pytest.raises(ValueError, match="draft lengths"):
        NgramDrafter().propose([[1, 2]], k=-1)
    with pytest.raises(ValueError, match="2 draft lengths for 1"):
        NgramDrafter().propose([[1, 2]], k=[1, 2])
    assert NgramDrafter().name == "ngram"
