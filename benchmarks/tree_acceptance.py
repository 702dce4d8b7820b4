"""Token trees against chains on the embedded default pool (the shipped draft -> SmolLM2-135M),
single stream, held-out prompts of the bench's request types: mean committed tokens per target
verification (accepted + the target's own token) and tokens/s, side by side in one process, every
system on the same prompts (issue 28's first goal: a tree's tokens per verification >= 1.3x the
best chain's at the same number of verified tokens).

A chain of k drafts verifies k + 1 tokens; a tree of N nodes verifies N + 1 (its root is the
chain's first token); `verified` is the mean measured per target forward (a suffix chain or tree
is often shorter than asked: the drafter proposes what its match offers). `tree:K:N:W[:C]`: a tree the draft grows K deep (K draft forwards, like a chain
of K), expanding the W best nodes of each depth into their C (default W) best children each, of
which the target verifies the N best by cumulative draft probability (decoding/tree_drafting.py).
`suffix:K`: the suffix drafter's chain of at most K; `suffix-tree:K:N`: its tree of every
continuation of its match weighted by frequency, at most N nodes, K deep (drafters/trees.py).
Learning drafters start every system with nothing learned (they learn across its prompts).

    python benchmarks/tree_acceptance.py [--kinds code prose chat] [--prompts 3] [--tokens 48]
        [--temperature 0] [--threads 2]
        [--configs plain chain:4 tree:3:4:2 suffix:8 suffix-tree:8:15]
"""

from __future__ import annotations

import argparse
import time

import torch

from specrouter import SpecRouter
from specrouter.bench.workloads import requests_of
from specrouter.drafters.suffix import SuffixDrafter
from specrouter.engine.tree_policy import FixedTreeShape


class Count(FixedTreeShape):
    """A fixed tree shape (budget 0: the chain) that also counts target verifications and the
    tokens they verified (a tree's nodes + 1, a chain's candidates + 1)."""

    def __init__(self, budget: int, width: int, target: str, children: int | None = None):
        super().__init__(budget, width, children=children)
        self.target, self.forwards, self.verified = target, 0, 0
        self.cycles, self.seconds = 0, {"target": 0.0, "draft": 0.0, "host": 0.0}  # per step kind, summed

    def observe(self, result, rows) -> None:
        super().observe(result, rows)
        self.forwards += sum(f.count for f in result.forwards if f.model == self.target)
        self.cycles += 1
        target = result.forward_time.get(self.target, 0.0)
        others = sum(result.forward_time.values()) - target
        self.seconds["target"] += target
        self.seconds["draft"] += others
        self.seconds["host"] += max(0.0, result.wall_time - target - others)
        trees = {t.seq_id: t for t in result.trees}
        self.verified += sum(trees[o.seq_id].nodes + 1 if o.seq_id in trees else (o.drafted[-1] if len(o.chain) > 1 else 0) + 1
                             for o in result.outcomes)


def run(sr: SpecRouter, prompts, chain, k, shape, tokens: int, temperature: float):
    target = sr.pool.target
    counter = Count(*shape[:2], target=target, children=shape[2] if len(shape) > 2 else None)
    sr.engine.tree_policy = counter
    for d in sr.pool.drafters.values():  # a learning drafter starts each system with nothing learned
        if isinstance(d, SuffixDrafter):
            d.clear()
    committed, wall = 0, 0.0
    for p, chat in prompts:
        t0 = time.perf_counter()  # (per step: ms/cycle = target + draft forwards + host, the rest)
        r = sr.generate(p, max_new_tokens=tokens, ignore_eos=True, chain=chain, k=k, chat=chat,
                        temperature=temperature, seed=1)[0]
        wall += time.perf_counter() - t0
        committed += len(r.token_ids)
    return committed, counter.forwards, wall, counter.outcomes, counter.verified, counter


def rank_table(outcomes, ranks: int = 8, depths: int = 4) -> list[str]:
    """Where the target's token sat among the draft's children, per depth (the last bucket: that
    depth and deeper), at the root and each accepted node the draft expanded: rows of shares."""
    counts = [[0] * (ranks + 1) for _ in range(depths)]
    for o in outcomes:
        for d, r in enumerate(o.ranks):
            counts[min(d, depths - 1)][r if 0 <= r < ranks else ranks] += 1
    out = []
    for d, row in enumerate(counts):
        n = sum(row)
        if n:
            shares = " ".join(f"{c / n:5.3f}" for c in row)
            out.append(f"  depth {d}{'+' if d == depths - 1 else ' '} (n={n:4d}): {shares}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", nargs="+", default=["code", "prose", "chat"])
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--configs", nargs="*", default=None,
                    help="e.g. chain:4 tree:3:8:3 (tree:K:N:W); default: a grid")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sr = SpecRouter.from_pretrained("default", adaptive=False)
    draft = [m for m in sr.pool.order if m in sr.pool.runners and m != sr.pool.target][0]
    prompts = [(r.prompt, r.chat) for kind in args.kinds for r in requests_of(kind, args.prompts)]
    configs = args.configs or (["plain"] + [f"chain:{k}" for k in (1, 2, 3, 4, 6, 8)]
                               + [f"tree:{k}:{n}:{w}" for k in (2, 3, 4) for w in (3, 4)
                                  for n in sorted({k + 1, 2 * k, 3 * k, min(15, 4 * k)}) if n <= k * w])
    sr.generate(prompts[0][0], max_new_tokens=4, chat=prompts[0][1])  # warm-up (kernels, caches)
    from specrouter.bench.provenance import describe, provenance

    print(f"pool: {sr.pool.order}, draft {draft}; {len(prompts)} prompts x {args.tokens} tokens, "
          f"temperature {args.temperature}")
    print(describe(provenance()))
    print(f"{'system':<18} {'verified':>8} {'tok/verif':>9} {'tok/s':>7} {'alt-acc':>7} {'trees':>5}"
          f" {'ms/cyc':>6} {'target':>6} {'draft':>6} {'host':>6}")
    ranks = {}
    base = None
    for c in configs:
        parts = c.split(":")
        if parts[0] == "plain":
            chain, k, shape = [sr.pool.target], None, (0, 1)
        elif parts[0] == "chain":
            chain, k, shape = [draft, sr.pool.target], int(parts[1]), (0, 1)
        elif parts[0] == "tree":
            chain, k = [draft, sr.pool.target], int(parts[1])
            shape = tuple(int(x) for x in parts[2:5])  # (N, W) or (N, W, C: children per node)
        elif parts[0] == "suffix":  # the suffix drafter's chain of at most k
            chain, k, shape = ["suffix", sr.pool.target], int(parts[1]), (0, 1)
        else:  # suffix-tree:K:N: its tree of at most N nodes, K deep, verified whole
            chain, k, shape = ["suffix", sr.pool.target], int(parts[1]), (int(parts[2]), 1)
        committed, forwards, wall, outcomes, verified, counter = run(sr, prompts, chain, k, shape, args.tokens,
                                                                     args.temperature)
        alt = sum(o.accepted > o.main_accepted for o in outcomes)
        tps = committed / wall
        base = base or tps
        ms = {key: 1e3 * v / max(counter.cycles, 1) for key, v in counter.seconds.items()}
        print(f"{c:<18} {verified / forwards:>8.2f} {committed / forwards:>9.3f} {tps:>7.1f} {alt:>7} {len(outcomes):>5}"
              f" {sum(ms.values()):>6.2f} {ms['target']:>6.2f} {ms['draft']:>6.2f} {ms['host']:>6.2f}"
              f"  ({tps / base:.2f}x plain)")
        if outcomes:
            ranks[c] = rank_table(outcomes)
    for c, rows in ranks.items():  # shares of rank 0..7, then "none of the children"
        print(f"rank of the target's token among the draft's children, {c}:", *rows, sep="\n")
    print(describe(provenance()))


if __name__ == "__main__":
    main()
