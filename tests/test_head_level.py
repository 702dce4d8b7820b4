"""The draft head as a pool level (models/heads/level.py, decoding/head_drafting.py, state/features.py):
greedy output with the head in the chain equals plain decoding (float32, bfloat16, ragged rows
accepting different lengths, 3-level chains, chains switching every cycle), the stored target
features and the head's cache stay what a from-scratch computation gives, the router picks the
head on a scripted cost surface, and sampling follows the target's distribution.

The target has tied embeddings: a tied random model mostly repeats its input, so a head that
starts from the target's last layer (EagleHead's initialisation) agrees with it often but not
always, and rows accept different lengths."""

from __future__ import annotations

import random

import pytest
import torch
from fixtures import QuietRouterHooks, make_tiny_llama

from specrouter import SpecRouter
from specrouter.config import RouterConfig, SamplingParams
from specrouter.decoding.sampling import SamplingTensors, process_logits
from specrouter.engine.engine import Engine
from specrouter.errors import ChainError
from specrouter.models.heads.model import EagleHead, HeadConfig, save_head
from specrouter.models.pool import Pool
from specrouter.models.runners.base import ForwardBatch
from specrouter.models.runners.llama import read_checkpoint
from specrouter.router.cost_model import enumerate_chains
from specrouter.router.policy import Router
from specrouter.router.profile import CostProfile
from specrouter.records.routing import Decision
from specrouter.state.features import valid_features

PROMPT_LENS = (1, 2, 5, 9, 17)
MAX_NEW = 24


def _save_head(target, out, vocab_ids=None, noise=0.0, seed=0):
    config, _arch, tensors = read_checkpoint(target)
    ids = tuple(vocab_ids if vocab_ids is not None else range(config["vocab_size"]))
    head = EagleHead(HeadConfig(target_config=config, vocab_ids=ids), tensors)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(noise * torch.randn(p.shape, generator=g))
    save_head(out, head, dtype=torch.float32)
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("head-level")
    target = make_tiny_llama(root / "target", hidden_size=64, num_layers=2, seed=3, tie_word_embeddings=True)
    draft = make_tiny_llama(root / "draft", hidden_size=64, num_layers=2, seed=4, init_from=target, noise=0.3,
                            tie_word_embeddings=True)
    return {"target": target, "draft": draft, "head": _save_head(target, root / "head")}


def _router(dirs, dtype="float32", names=("target", "head"), **kw):
    return SpecRouter.from_pretrained([dirs[n] for n in names], names=list(names), target="target",
                                      dtype=dtype, adaptive=False, ngram=False, suffix=False, **kw)


def _prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in PROMPT_LENS]


def test_the_pool_loads_a_head_folder_as_a_first_level_only(dirs):
    sr = _router(dirs, names=("target", "draft", "head"))
    pool = sr.pool
    assert pool.heads == {"head"} and pool.order == ["head", "draft", "target"]
    assert pool.validate_chain(("head", "draft", "target")) == ("head", "draft", "target")
    assert pool.resolve_name("draft") == "draft"  # the role names a model draft, not the head
    with pytest.raises(ChainError, match="first level"):
        pool.validate_chain(("draft", "head", "target"))
    view = pool.without_drafters(["head", "draft"])  # the bench's "SpecRouter (no head)": verifiers stay
    assert view.heads == frozenset() and view.order == ["draft", "target"] and "head" not in view.runners
    assert pool.heads == {"head"} and "head" in pool.runners  # a view: the pool keeps its head


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_with_the_head_equals_plain_decoding(dirs, dtype):
    sr = _router(dirs, dtype, names=("target", "draft", "head"))
    prompts = _prompts()
    plain = sr.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True, chain=("target",))
    for chain, k in [(("head", "target"), 1), (("head", "target"), 4), (("head", "draft", "target"), 3)]:
        out = sr.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True, chain=chain, k=k)
        assert [r.token_ids for r in out] == [r.token_ids for r in plain], (chain, k)
        pair = f"{chain[0]}>{chain[1]}"
        accepted = [r.stats.accepted.get(pair, 0) for r in out]
        drafted = [r.stats.drafted.get(pair, 0) for r in out]
        assert sum(drafted) > 0 and 0 < sum(accepted) < sum(drafted), (chain, drafted, accepted)
        if k == 4:  # ragged: rows accept different lengths
            assert len({r.stats.mean_acceptance_length for r in out}) > 2, accepted


class RandomRouter(QuietRouterHooks):
    """A random chain (the head's included) and draft length for every row, every cycle."""

    def __init__(self, pool, seed=0):
        self.rng = random.Random(seed)
        first = set(pool.drafters) | set(pool.heads)
        self.chains = [c for c in enumerate_chains(pool.order, pool.target) if not first & set(c[1:])]

    def decide(self, row):
        chain = self.rng.choice(self.chains)
        return Decision(chain=chain, k=0 if len(chain) == 1 else self.rng.randint(1, 6), t_eff=0.0, reason="random")


def _check_features_and_head_cache(eng, pool, seq, scratch):
    """The stored target features equal a fresh forward's, and the head's cache continues like
    a head that caught up from position 0 on them."""
    target, head = pool.runners["target"], pool.runners["head"]
    states = eng.state.states_of(seq.seq_id)
    tst = states["target"]
    have = valid_features(tst.features, tst.cache_len)
    if have == 0:
        return 0
    _, fresh = target.forward_with_features(ForwardBatch.build([scratch["target"]], [0], [seq.tokens[:have]], [[0]]))
    torch.testing.assert_close(eng.state.features.read(tst.slot, 0, have), fresh[0], rtol=0, atol=0)
    hst = states.get("head")
    p = hst.cache_len if hst is not None else 0
    if hst is None or p == 0 or have <= p or len(seq.tokens) <= p + 1:
        return 1
    f = fresh[0]
    got, gf = head.step(ForwardBatch.build([hst.slot], [p], [[seq.tokens[p + 1]]], [[0]]), f[None, p : p + 1])
    want, wf = head.step(ForwardBatch.build([scratch["head"]], [0], [seq.tokens[1 : p + 2]], [[p]]), f[None, : p + 1])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(gf[0, 0], wf[0, p], rtol=0, atol=0)
    return 2


def test_features_and_head_cache_stay_exact_while_chains_switch(dirs):
    """Random chains every cycle (head, draft, plain, mixed in one batch): steps without a head
    leave gaps in the features that the target re-feeds; after every step the features and the
    head's cache equal a from-scratch computation, and the output is plain decoding's."""
    sr = _router(dirs, names=("target", "draft", "head"))
    pool = sr.pool
    prompts = _prompts(1)
    plain = sr.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True, chain=("target",))
    router = RandomRouter(pool, seed=3)
    eng = Engine(pool, max_num_seqs=len(prompts) + 1, max_model_len=64, router=router)
    scratch = {n: pool.runners[n].allocate_slot() for n in ("target", "head")}
    seqs = [eng.add_request(p, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)) for p in prompts]
    checks = 0
    while eng.has_unfinished():
        eng.step()
        for seq in eng.running.values():
            checks += _check_features_and_head_cache(eng, pool, seq, scratch)
    assert [s.output_ids for s in seqs] == [r.token_ids for r in plain]
    assert checks > 60
    assert any(s.stats.accepted.get("head>target", 0) for s in seqs)


def test_plain_decoding_keeps_no_features(dirs):
    sr = _router(dirs)
    eng = Engine(sr.pool)
    seq, = eng.generate_ids([_prompts()[3]], [SamplingParams(max_new_tokens=6, ignore_eos=True)], chain=("target",))
    assert seq.stats.cycles == 6
    assert eng.state.features.buffer.numel() == 0  # never written: no step had a head


def scripted_profile(head_slow: float = 1.0) -> CostProfile:
    prof = CostProfile()
    for name, (fixed, per_token) in {"head": (0.001, 1e-4), "target": (0.04, 2.5e-3)}.items():
        f = head_slow if name == "head" else 1.0
        prof.set_function(name, lambda b, t, L, fixed=fixed, per_token=per_token, f=f: f * (fixed + per_token * b * t))
    return prof


def test_the_router_picks_the_head_and_leaves_it_when_it_slows_down(dirs):
    sr = _router(dirs)
    pool = sr.pool
    router = Router.from_pool(pool, scripted_profile(), config=RouterConfig(patience=2))
    assert ("head", "target") in router.chains
    eng = Engine(pool, router=router, clock=lambda: 0.0)  # forwards take no time: the script holds
    prompts = _prompts(2)
    out = eng.generate_ids(prompts, [SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)] * len(prompts))
    assert any(e.chain == ("head", "target") for e in router.events)
    plain = sr.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True, chain=("target",))
    assert [s.output_ids for s in out] == [r.token_ids for r in plain]
    router.profile = scripted_profile(head_slow=1000.0)  # the head now costs 25x the target
    n = len(router.events)
    eng.generate_ids(prompts, [SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)] * len(prompts))
    late = [e.chain for e in list(router.events)[n:]][-len(prompts):]
    assert all(c == ("target",) for c in late), late


# ---- sampling: the committed tokens follow the target's distribution ----------------------------
V = 8
PROMPT = [1, 5, 2, 7]
PARAMS = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=3, ignore_eos=True)


def test_sampling_with_the_head_follows_the_target(tmp_path):
    kw = {"vocab_size": V, "hidden_size": 16, "num_heads": 2, "num_kv_heads": 1, "with_tokenizer": False}
    target = make_tiny_llama(tmp_path / "target", num_layers=2, seed=11, tie_word_embeddings=True, **kw)
    head_dir = _save_head(target, tmp_path / "head", noise=0.05)
    from specrouter.models.heads.level import load_head_level
    from specrouter.models.pool import load_runner

    runners = {"head": load_head_level(head_dir, target, name="head"), "target": load_runner(target, name="target")}
    pool = Pool(runners=runners, drafters={}, order=["head", "target"], target="target", tokenizer=None,
                eos_ids=(), vocab_width=V, heads=frozenset({"head"}))
    r = runners["target"]
    r.reserve(1, 16)
    st = SamplingTensors.from_params([PARAMS])

    def dist(tokens):
        return process_logits(r.forward(ForwardBatch.build([0], [0], [tokens], [[len(tokens) - 1]]))[:, :, :V], st)[0, 0]

    first = dist(PROMPT)  # exact P(t2, t3): the positions the head drafts
    exact = sum(first[a] * torch.stack([dist(PROMPT + [a])[b] * dist(PROMPT + [a, b]) for b in range(V)])
                for a in range(V))  # (V, V)
    rows = 15_000  # TV noise ~0.02 at 64 cells
    seqs = Engine(pool).generate_ids([PROMPT] * rows, [PARAMS] * rows, chain=("head", "target"), k=2,
                                     generator=torch.Generator().manual_seed(7))
    out = torch.tensor([s.output_ids for s in seqs])  # (rows, 3)
    counts = torch.zeros(V, V, dtype=torch.float64)
    counts.index_put_((out[:, 1], out[:, 2]), torch.ones(rows, dtype=torch.float64), accumulate=True)
    tv = 0.5 * (counts / rows - exact.double()).abs().sum().item()
    drafted = sum(s.stats.drafted.get("head>target", 0) for s in seqs)
    accepted = sum(s.stats.accepted.get("head>target", 0) for s in seqs)
    assert drafted >= rows and 0 < accepted < drafted, (drafted, accepted)
    assert tv < 0.035, tv
