"""Grammar-forced tokens as certain drafts (issue 30 item 2, decoding/certain_drafts.py).

1. With certain drafts (the default with jump forward), greedy and seeded outputs equal plain
   constrained decoding (the target alone, no jump forward) token for token, for model and
   model-free drafters, chains of depth 2-4, k = 2 and 5, float64 and bfloat16; the forced
   tokens did enter the drafts (counted) and the target committed some.
2. Certainty: no verifying level ever rejects a certain candidate first (`CertainCounts`);
   negative control: forced tokens put one position off (the first of each run dropped) are
   rejected (the counter sees it), and the output stays exact (they are verified like any
   candidate).
3. k counts a drafter's own tokens: a model drafter with k = 2 offers more candidates than 2,
   and the router's evidence (drafted / accepted per level) leaves the certain ones out.
4. A model drafter spends no draft step on a forced token: fewer draft-model forwards than with
   certain drafts off, for the same output.
"""

import pytest
import torch
from fixtures import FOUR_LEVELS, four_level_fixtures, load_named_pool

from specrouter.config import SamplingParams
from specrouter.decoding.grammar import GrammarSpec, RowGrammar
from specrouter.engine.engine import Engine

NAMES = FOUR_LEVELS
MAX_NEW = 40
CHAINS = [("same", "target"), ("draft", "target"), ("ngram", "target"), ("ngram", "same", "target"),
          ("draft", "mid", "target"), ("ngram", "draft", "mid", "target")]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["point", "line", "polygon"]},
        "n": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
    },
    "required": ["name", "kind", "n", "tags"],
    "additionalProperties": False,
}
SPECS = [GrammarSpec.json_schema(SCHEMA),
         GrammarSpec("lark", 'start: "The " ("fox" | "dog") " is " NUM " years old."\nNUM: /[0-9]{1,3}/')]


pool, prompts = four_level_fixtures()


def run(pool, prompts, params, chain, k=4, jump_forward=True, certain=None):
    engine = Engine(pool)
    engine.jump_forward = jump_forward
    if certain is not None:
        engine.executor.certain_drafts = certain
    seqs = engine.generate_ids(prompts, [params] * len(prompts), chain=chain, k=k)
    return [s.output_ids for s in seqs], seqs, engine


def plain(pool, prompts, params):
    return run(pool, prompts, params, ("target",), jump_forward=False)[0]


# -- 1. exact ---------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", SPECS, ids=["json_schema", "lark"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_with_certain_drafts_equal_plain_constrained_decoding(pool, prompts, spec, temperature):
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=temperature, seed=11, grammar=spec)
    expected = plain(pool, prompts, params)
    committed = offered = 0
    for chain in CHAINS:
        for k in (2, 5):
            got, seqs, engine = run(pool, prompts, params, chain, k)
            assert got == expected, (chain, k)
            c = engine.executor.certain_counts
            assert c.rejected == 0, (chain, k, c)
            committed += sum(s.stats.certain for s in seqs)
            offered += c.offered
    assert offered > 0 and committed > 0  # the forced tokens did enter the drafts


def test_bfloat16_native_equals_plain(tiny_pool_dirs, prompts):
    pool = load_named_pool(tiny_pool_dirs, NAMES, dtype="bfloat16", backend="native")
    params = SamplingParams(max_new_tokens=MAX_NEW, grammar=SPECS[0])
    expected = plain(pool, prompts, params)
    for chain in CHAINS[:3]:
        got, seqs, engine = run(pool, prompts, params, chain, 4)
        assert got == expected, chain
        assert engine.executor.certain_counts.rejected == 0


# -- 2. certainty and its negative control ----------------------------------------------------
def test_certain_candidates_are_always_accepted_and_misplaced_ones_are_caught(pool, prompts, monkeypatch):
    params = SamplingParams(max_new_tokens=MAX_NEW, grammar=SPECS[0])
    expected = plain(pool, prompts, params)
    _, _, engine = run(pool, prompts, params, ("same", "target"), 4)
    c = engine.executor.certain_counts
    # the "same" draft is the target: every candidate is accepted, certain ones included
    assert c.offered > 0 and c.accepted == c.offered and c.rejected == 0
    real = RowGrammar.forced_tokens

    def one_off(self, generated, limit, path=()):  # a run's first forced token left out
        out = real(self, generated, limit + 1, path)
        return out[1:] if path else out

    monkeypatch.setattr(RowGrammar, "forced_tokens", one_off)
    for chain in (("same", "target"), ("draft", "target"), ("ngram", "target")):
        got, _, engine = run(pool, prompts, params, chain, 4)
        assert got == expected, chain  # still exact: certain candidates are verified
        if chain[0] == "same":
            assert engine.executor.certain_counts.rejected > 0  # the counter sees misplaced ones


# -- 3. k and the router's evidence -----------------------------------------------------------
def test_k_counts_own_tokens_and_the_evidence_leaves_certain_ones_out(pool, prompts):
    params = SamplingParams(max_new_tokens=MAX_NEW, grammar=SPECS[0])
    engine = Engine(pool)
    outcomes = []
    real = engine.executor._result

    def spy(work, t_start):
        result = real(work, t_start)
        outcomes.extend(zip([len(w.cand) for w in work], result.outcomes))
        return result

    engine.executor._result = spy
    engine.generate_ids(prompts, [params] * len(prompts), chain=("same", "target"), k=2)
    outcomes = [(n, o) for n, o in outcomes if len(o.chain) == 2]  # (near the end: plain steps)
    assert outcomes and all(o.drafted[0] <= 2 and o.drafted[1] <= 2 for _, o in outcomes)  # own tokens only
    # a cycle that committed certain tokens committed more than k + 1 (the same draft: all accepted)
    long = [(n, o) for n, o in outcomes if o.certain]
    assert long and all(n == o.accepted[1] + o.certain + 1 for n, o in long)
    assert max(n for n, _ in long) > 3


# -- 4. no draft step on a forced token -------------------------------------------------------
def test_a_model_drafter_spends_no_step_on_forced_tokens(pool, prompts):
    params = SamplingParams(max_new_tokens=MAX_NEW, grammar=SPECS[0])
    counts = {}
    outs = {}
    for on in (True, False):
        engine = Engine(pool)
        engine.executor.certain_drafts = on
        draft_forwards = []
        engine.on_cycle = lambda stats: draft_forwards.append(stats.forward_tokens.get("same", 0))
        seqs = []
        for p in prompts:  # one row at a time: forwards are this row's
            seqs += engine.generate_ids([p], [params], chain=("same", "target"), k=4, on_cycle=engine.on_cycle)
        outs[on] = [s.output_ids for s in seqs]
        counts[on] = (sum(s.stats.cycles for s in seqs), len(draft_forwards))
    assert outs[True] == outs[False]
    assert counts[True][0] < counts[False][0], counts  # fewer cycles: certain tokens ride free


# -- 5. the router's cost model ---------------------------------------------------------------
def test_the_cost_model_widens_verification_by_the_certain_rate():
    import numpy as np
    from test_router import make_router

    from specrouter.records.routing import RowContext
    from specrouter.router.cost_model import with_certain

    row = np.arange(9, dtype=np.float64)  # T(t) = t
    assert with_certain({"T": row}, 1.0)["T"].tolist() == [0, 1, 3, 5, 7, 8, 8, 8, 8]  # 1 + 2(t - 1)
    assert with_certain({"T": row}, 0.0)["T"].tolist() == row.tolist()
    router = make_router()
    base, _ = router.evaluate(RowContext(1, 300))
    cert, _ = router.evaluate(RowContext(1, 300, certain_rate=1.5))
    assert cert.t_eff[0, 0] == base.t_eff[0, 0]  # plain decoding verifies nothing
    spec = np.isfinite(base.t_eff[1:])
    assert (cert.t_eff[1:][spec] >= base.t_eff[1:][spec]).all() and (cert.t_eff[1:][spec] > base.t_eff[1:][spec]).any()
    best_k = lambda t: t[1:].argmin(axis=1)  # noqa: E731
    assert (best_k(cert.t_eff) <= best_k(base.t_eff)).all() and (best_k(cert.t_eff) < best_k(base.t_eff)).any()
