"""Token-tree verification in one forward is exact (issue 28; runners/base.py
`ForwardBatch.parents`, decoding/tree.py): every node's logits are bitwise those of sequential
decoding of its branch, in float32 and bfloat16, on the native kernels and torch's, in ragged
batches beside chain rows and plain rows; after `move_kv` the accepted branch's KV equals a
from-scratch prefill; decoding by trees (random trees, random acceptance) commits exactly plain
decoding's tokens, greedy and sampled. The negative control feeds the same tree with positions
by node index (as a chain) and must see node logits change."""

import random

import pytest
import torch
from test_row_invariance import SMOLLM2_135M, random_runner

from specrouter.config import SamplingParams
from specrouter.decoding.noise import position_keys, seed_key
from specrouter.decoding.sampling import SamplingTensors, choose_tokens
from specrouter.decoding.tree import TokenTree, feed_parents, token_offsets, walk
from specrouter.models.runners.base import ForwardBatch
from specrouter.models.runners.kernels import why_not_native

PROMPT = 61  # the prompt crosses a key chunk (64) once the tree is appended


@pytest.fixture(scope="module", params=[(d, k) for k in ("native", "torch") for d in (torch.float32, torch.bfloat16)],
                ids=[f"{k}-{d}" for k in ("native", "torch") for d in ("fp32", "bf16")])
def runner(request):
    dtype, kernels = request.param
    if kernels == "native" and why_not_native():
        pytest.skip(why_not_native())
    # the 135M widths, heads and vocabulary; 3 of its 30 layers
    return random_runner(SMOLLM2_135M, dtype, num_slots=6, max_len=128, num_layers=3, kernels=kernels)


def random_tree(rng: random.Random, n: int, vocab: int) -> TokenTree:
    parents, tokens, used = [], [], set()
    for i in range(n):
        p = rng.randrange(-1, i) if rng.random() < 0.7 else i - 1  # bushy, with long branches
        t = rng.randrange(vocab)
        while (p, t) in used:
            t = rng.randrange(vocab)
        used.add((p, t))
        parents.append(p), tokens.append(t)
    return TokenTree(tuple(tokens), tuple(parents))


def _logits(runner, rows, parents=None):
    """One forward of rows (slot, start, tokens), logits at every new token; per row (n, V)."""
    batch = ForwardBatch.build([s for s, _, _ in rows], [p for _, p, _ in rows], [t for _, _, t in rows],
                               [list(range(len(t))) for _, _, t in rows], parents=parents)
    out = runner.forward(batch)
    return [out[b, : len(t)] for b, (_, _, t) in enumerate(rows)]


def _sequential(runner, slot: int, prefix: list[int], tokens: list[int]) -> torch.Tensor:
    """Plain decoding's logits: the prefix in one prefill, then one token per forward."""
    _logits(runner, [(slot, 0, prefix)])
    return torch.stack([_logits(runner, [(slot, len(prefix) + i, [t])])[0][0] for i, t in enumerate(tokens)])


def test_node_logits_are_sequential_decodings_bits_in_a_ragged_batch(runner):
    V = runner.vocab_size
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, V, (PROMPT,), generator=g).tolist()
    other = torch.randint(0, V, (40,), generator=g).tolist()
    rng = random.Random(3)
    tree = random_tree(rng, 13, V)
    pending = 3  # the tree row catches up 3 committed tokens, the last one is the root
    start = PROMPT - pending
    _logits(runner, [(0, 0, prompt[:start]), (1, 0, other[:30]), (2, 0, other[:9])])
    feed = prompt[start:] + list(tree.tokens)
    rows = [(0, start, feed), (1, 30, other[30:35]), (2, 9, other[9:10])]  # tree, chain, plain
    parents = [feed_parents(pending, tree), list(range(-1, 4)), [-1]]
    tree_out, chain_out, plain_out = _logits(runner, rows, parents)
    # the chain row and the plain row: the bits of their own forwards without a tree beside
    ref_chain, ref_plain = _logits(runner, [(1, 30, other[30:35]), (2, 9, other[9:10])])
    assert torch.equal(chain_out, ref_chain) and torch.equal(plain_out, ref_plain)
    # the pending tokens, and every node: sequential decoding of its branch
    assert torch.equal(tree_out[:pending], _sequential(runner, 3, prompt[:start], prompt[start:]))
    for i in range(len(tree)):
        branch = [tree.tokens[j] for j in tree.branch(i)]
        ref = _sequential(runner, 3, prompt, branch)[-1]
        assert torch.equal(tree_out[pending + i], ref), f"node {i} (depth {tree.depths[i]})"


def test_positions_by_node_index_change_the_logits(runner):
    """Negative control: the same tree fed as a chain (RoPE position start + node index, every
    earlier node attended) is not sequential decoding of a branch: node logits differ."""
    V = runner.vocab_size
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, V, (PROMPT,), generator=g).tolist()
    tree = TokenTree((5, 6, 7, 8), (-1, -1, 0, 1))  # two branches of two
    _logits(runner, [(0, 0, prompt[:-1])])
    right = _logits(runner, [(0, PROMPT - 1, prompt[-1:] + [5, 6, 7, 8])], [feed_parents(1, tree)])[0]
    wrong = _logits(runner, [(0, PROMPT - 1, prompt[-1:] + [5, 6, 7, 8])])[0]
    assert torch.equal(right[:2], wrong[:2])  # the root and node 0 sit where a chain puts them
    for node in (1, 3):  # node 1 is at depth 0 but index 1; node 3 sees node 0 as a chain would
        assert not torch.equal(right[1 + node], wrong[1 + node])
        ref = _sequential(runner, 1, prompt, [tree.tokens[j] for j in tree.branch(node)])[-1]
        assert torch.equal(right[1 + node], ref) and not torch.equal(wrong[1 + node], ref)


def test_the_accepted_branch_kv_equals_a_prefill(runner):
    V = runner.vocab_size
    g = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, V, (PROMPT,), generator=g).tolist()
    tree = random_tree(random.Random(7), 11, V)
    deepest = max(range(len(tree)), key=lambda i: (tree.depths[i], i))
    nodes = tree.branch(deepest)
    assert nodes != list(range(len(nodes))), "the branch must need moving"
    _logits(runner, [(0, 0, prompt[:-1])])
    _logits(runner, [(0, PROMPT - 1, prompt[-1:] + list(tree.tokens))], [feed_parents(1, tree)])
    runner.move_kv(0, PROMPT, nodes)
    branch = [tree.tokens[j] for j in nodes]
    _logits(runner, [(4, 0, prompt + branch)])  # a from-scratch prefill in another slot
    n = PROMPT + len(branch)
    for kc, vc in zip(runner._k, runner._v):  # (S, KV, P, D)
        assert torch.equal(kc[0, :, :n], kc[4, :, :n]) and torch.equal(vc[0, :, :n], vc[4, :, :n])
    # and decoding continues from it as from the prefill
    assert torch.equal(_logits(runner, [(0, n, [9])])[0], _logits(runner, [(4, n, [9])])[0])


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_decoding_by_random_trees_is_plain_decoding(runner, temperature):
    """Cycles of: a random tree (some nodes on plain decoding's path, some not), one forward,
    the target's token at every node (greedy, or counter-based noise by absolute position),
    `walk`, `move_kv`: the committed tokens are plain decoding's, token for token."""
    V, steps = runner.vocab_size, 24
    g = torch.Generator().manual_seed(8)
    prompt = torch.randint(0, V, (20,), generator=g).tolist()
    params = SamplingParams(temperature=temperature, seed=11)
    st = SamplingTensors.from_params([params])
    key = torch.tensor([[seed_key(11)]])

    def choose(logits: torch.Tensor, positions: list[int]) -> list[int]:
        keys = None if st.all_greedy else position_keys(key, torch.tensor([positions]))
        return choose_tokens(logits[None], st, keys)[0].tolist()

    # plain decoding, one token per forward
    plain = list(prompt)
    logits = _logits(runner, [(5, 0, prompt)])[0][-1:]
    for _ in range(steps):
        plain.append(choose(logits, [len(plain)])[0])
        logits = _logits(runner, [(5, len(plain) - 1, plain[-1:])])[0]
    truth = plain[len(prompt):]

    rng = random.Random(12)
    tokens, cache_len, forwards = list(prompt), 0, 0
    while len(tokens) < len(plain):
        done = len(tokens) - len(prompt)
        tree = random_tree(rng, rng.randrange(1, 9), V)
        # graft plain decoding's continuation onto a random node path, sometimes
        if rng.random() < 0.8:
            toks, pars = list(tree.tokens), list(tree.parents)
            parent = -1
            for j, t in enumerate(truth[done : done + rng.randrange(1, 5)]):
                kids = [i for i, p in enumerate(pars) if p == parent and toks[i] == t]
                if kids:
                    parent = kids[0]
                    continue
                toks.append(t), pars.append(parent)
                parent = len(toks) - 1
            order = sorted(range(len(toks)), key=lambda i: (TokenTree(tuple(toks), tuple(pars)).depths[i], i))
            remap = {old: new for new, old in enumerate(order)}
            tree = TokenTree(tuple(toks[i] for i in order), tuple(-1 if pars[i] < 0 else remap[pars[i]] for i in order))
        start = len(tokens)
        feed = tokens[cache_len:] + list(tree.tokens)
        pending = start - cache_len
        out = _logits(runner, [(0, cache_len, feed)], [feed_parents(pending, tree)])[0][pending - 1:]
        forwards += 1
        target = choose(out, [start + o for o in token_offsets(tree)])
        nodes, final = walk(tree, target)
        runner.move_kv(0, start, nodes)
        tokens += [tree.tokens[j] for j in nodes] + [final]
        cache_len = start + len(nodes)  # the final token stays pending
    assert tokens[: len(plain)] == plain
    assert forwards < steps, "the trees must have been accepted sometimes"


def test_token_noise_is_the_reference_noise_of_those_tokens():
    from specrouter.decoding.noise import exponential_noise, token_noise

    keys = position_keys(torch.tensor([[seed_key(1)], [seed_key(2)]]), torch.tensor([[5], [9]]))[:, 0]
    tokens = torch.tensor([[0, 63, 64, 300, 1000], [7, 8, 128, 129, 4095]])
    assert torch.equal(token_noise(keys, tokens), exponential_noise(keys, 4096).gather(1, tokens))


def test_token_noise_native_and_torch_hash_are_the_reference(monkeypatch):
    """`token_noise` with the native uniforms (kernels/noise.cpp `token_uniforms`, where built)
    and with the torch hash: the reference noise bit for bit, block argmins included."""
    from specrouter.decoding import noise

    g = torch.Generator().manual_seed(8)
    keys = torch.randint(0, 1 << 32, (6,), generator=g)
    tokens = torch.randint(0, 49152, (6, 32), generator=g)
    arg = (noise._uniform(keys[:, None], "block_arg", tokens[:, :3] // noise.BLOCK) * noise.BLOCK).long()
    tokens[:, :3] = tokens[:, :3] // noise.BLOCK * noise.BLOCK + arg.clamp(max=noise.BLOCK - 1)  # blocks' argmins
    want = noise.exponential_noise(keys, 49152).gather(1, tokens)
    assert torch.equal(noise.token_noise(keys, tokens), want)
    monkeypatch.setattr(noise, "_native", lambda: None)
    assert torch.equal(noise.token_noise(keys, tokens), want)


def test_draft_tree_keeps_the_best_nodes_as_a_tree():
    """DraftTree (decoding/tree_drafting.py): nodes grown depth by depth under expanded
    frontier nodes; `best` keeps the budget best by cumulative draft log-probability, always a
    tree (a parent before its children); `feed` is the frontier's ancestor closure with parents
    among itself; `evidence` reads the rank of the target's token along the accepted branch."""
    from specrouter.decoding.tree_drafting import DraftTree

    t = DraftTree()
    assert t.expand(-1, [10, 11, 12], [-0.1, -2.5, -3.0]) == [0, 1, 2]
    assert t.expand(0, [20, 21], [-0.5, -1.0]) == [3, 4]  # scores -0.6, -1.1
    assert t.expand(1, [22], [-0.05]) == [5]  # -2.55
    assert t.expand(3, [30, 31], [-0.2, -2.0]) == [6, 7]  # -0.8, -2.6
    assert t.depths == [0, 0, 0, 1, 1, 1, 2, 2] and t.ranks == [0, 1, 2, 0, 1, 0, 0, 1]
    tree, ids = t.best(1)
    assert tree == TokenTree.chain([10]) and ids == [0]
    tree, ids = t.best(5)  # -0.1 (10), -0.6 (20), -0.8 (30), -1.1 (21), -2.5 (11)
    assert ids == [0, 1, 3, 4, 6]
    assert tree.tokens == (10, 11, 20, 21, 30) and tree.parents == (-1, -1, 0, 0, 2)
    tree, ids = t.best(6)  # then 22 (-2.55) under 11
    assert tree.tokens[-1] == 30 and 22 in tree.tokens and tree.parents[tree.tokens.index(22)] == 1
    for n in range(1, len(t.tokens) + 1):  # every budget gives a tree whose nodes' parents are kept
        TokenTree(*map(tuple, (t.best(n)[0].tokens, t.best(n)[0].parents)))
    assert t.main_path() == [0, 3, 6]
    t.frontier = [6, 5]
    ids, parents, at = t.feed()
    assert ids == [0, 1, 3, 5, 6] and parents == [-1, -1, 0, 1, 2] and at == [4, 3]
    # the target's tokens: after the root 10 (rank 0), after node 0: 21 (rank 1), after node 4: 99
    assert t.evidence([0, 4], [10, 21, 99]) == (0, 1)  # node 4 was never expanded: no evidence
    assert t.evidence([0, 3], [10, 20, 31]) == (0, 0, 1)
    assert t.evidence([], [13]) == (-1,)
    # walking the kept tree with the target's tokens: root -> 10, node 0 -> 21 (an alternative)
    tree, ids = t.best(5)
    assert walk(tree, [10, 21, 5, 5, 99, 5]) == ([0, 3], 99)
    assert walk(tree, [10, 20, 5, 30, 5, 7]) == ([0, 2, 4], 7)
    assert walk(tree, [13, 5, 5, 5, 5, 5]) == ([], 13)


def test_position_key_is_position_keys():
    from specrouter.decoding.noise import position_key

    rng = random.Random(3)
    pairs = [(rng.randrange(1 << 32), rng.randrange(1 << 31)) for _ in range(500)] + [(0, 0), ((1 << 32) - 1, 0)]
    want = position_keys(torch.tensor([s for s, _ in pairs]), torch.tensor([p for _, p in pairs])).tolist()
    assert [position_key(s, p) for s, p in pairs] == want


@pytest.mark.skipif(bool(why_not_native()), reason="native kernels unavailable")
def test_native_topk_is_torch_topk_ties_included():
    """kernels/tree.cpp `topk_rows` replays torch's partial_sort: the same values and indices,
    in torch's order among equal values (which is not index order), NaNs first; rows of a
    draft's logits (-inf outside its vocabulary subset, bfloat16-rounded: many ties)."""
    from specrouter.decoding.tree_drafting import topk
    from specrouter.models.runners.kernels import rowinv

    ops, g, V = rowinv(), torch.Generator().manual_seed(5), 49152
    tie_orders_differ = 0
    for trial in range(60):
        R = 1 + trial % 5
        x = torch.full((R, V), float("-inf"))
        cols = torch.randperm(V, generator=g)[:16000]
        x[:, cols] = (torch.randn(R, len(cols), generator=g) * (0.5, 2.0, 8.0)[trial % 3]).to(torch.bfloat16).float()
        if trial % 4 == 0:
            x = torch.log_softmax(x, -1)
        if trial % 5 == 0:
            x = torch.randint(0, 12, (R, V), generator=g).float()  # ties everywhere
        if trial % 7 == 0:  # NaNs after the ties branch (trials 0, 35: on ties too), so they reach topk_rows
            x[0, cols[:3]] = float("nan")
        for k in (1, 3, 8, 32, 768):
            want_v, want_i = x.topk(k, dim=-1)
            got_v, got_i = ops.topk_rows(x, k)
            assert torch.equal(got_i, want_i) and torch.equal(got_v.nan_to_num(7.0), want_v.nan_to_num(7.0))
            assert torch.equal(topk(x, k)[1], want_i)
            stable = torch.sort(x.nan_to_num(float("inf")), dim=-1, descending=True, stable=True).indices[:, :k]
            tie_orders_differ += not torch.equal(want_i, stable)
    assert tie_orders_differ > 0, "the ties must exercise torch's own (non-index) order"
    x = torch.randn(3, V + 7, generator=g)[:, 5: V + 5]  # rows not contiguous
    assert torch.equal(ops.topk_rows(x, 4)[1], x.topk(4, dim=-1)[1])
    small = torch.randn(2, 100, generator=g)  # k * 64 > V: torch's nth_element path, kept
    assert torch.equal(topk(small, 3)[1], small.topk(3, dim=-1)[1])


@pytest.mark.skipif(bool(why_not_native()), reason="native kernels unavailable")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_move_kv_is_torch_indexing(dtype):
    """kernels/tree.cpp `move_kv` writes exactly what ModelRunner.move_kv's torch gather per layer
    writes (rows start + nodes[i] -> start + i, in increasing i), and nothing else."""
    from specrouter.models.runners.kernels import rowinv

    ops, rng, g = rowinv(), random.Random(11), torch.Generator().manual_seed(11)
    for _ in range(20):
        ks = [torch.randn(3, 2, 80, 16, generator=g).to(dtype) for _ in range(3)]  # (S, KV, P, D)
        vs = [torch.randn(3, 2, 80, 16, generator=g).to(dtype) for _ in range(3)]
        slot, start = rng.randrange(3), rng.randrange(40)
        nodes = sorted(rng.sample(range(30), rng.randrange(1, 8)))  # increasing, so nodes[i] >= i
        want_k, want_v = [c.clone() for c in ks], [c.clone() for c in vs]
        dst = torch.arange(start, start + len(nodes))
        src = torch.tensor(nodes) + start
        for kc, vc in zip(want_k, want_v):
            kc[slot, :, dst] = kc[slot, :, src]
            vc[slot, :, dst] = vc[slot, :, src]
        ops.move_kv(ks, vs, slot, start, nodes)
        assert all(torch.equal(a, b) for a, b in zip(ks + vs, want_k + want_v))
