"""How many tokens per target verification the suffix drafter's chain and its token tree would
commit, replayed over the target's own greedy outputs (no speculation engine: the ceiling of
each proposal, independent of timing noise). docs/trees.md "Suffix trees".

1. The target alone generates each workload's requests greedily (the bench's workloads, chat
   template where the bench uses it, structured requests with their grammar).
2. Replay, request by request, a fresh drafter learning each finished request as the engine
   does: at each cycle the proposal for the context so far is walked against the target's next
   tokens (a chain: its accepted prefix; a tree: the branch equal to them), the cycle commits
   those plus the target's own token.
Proposals: `chain` (`SuffixDrafter.propose_row`, k), `tree` (`propose_tree_row`, at most N nodes,
k deep), each with the request tree matching from two tokens (as before 85f0394) and from one
(`SuffixConfig.min_context_match`, the default since: prompt lookup's shortest n-gram).

    python benchmarks/suffix_tree_replay.py [--prompts 3] [--workloads mixed templated structured]
        [--k 8] [--nodes 15] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import numpy as np
import torch

from specrouter import SpecRouter
from specrouter.bench.workloads import build_workloads
from specrouter.drafters.suffix import SuffixConfig, SuffixDrafter
from specrouter.drafters.trees import TreeProposal


def accepted_in_tree(tree: TreeProposal, target: list[int]) -> int:
    children = {(p, t): i for i, (t, p) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist()))}
    node, n = -1, 0
    while n < len(target) and (node, target[n]) in children:
        node, n = children[(node, target[n])], n + 1
    return n


def propose(d: SuffixDrafter, mode: str, ctx: np.ndarray, k: int, nodes: int):
    return d.propose_row(ctx, k) if mode == "chain" else d.propose_tree_row(ctx, nodes, k)


def replay(rows, mode: str, k: int, nodes: int, min_context_match: int) -> tuple[float, float]:
    """(committed tokens per verification, tokens verified per verification)."""
    d = SuffixDrafter(SuffixConfig(min_context_match=min_context_match))
    cycles = tokens = verified = 0
    for prompt, out in rows:
        i = 0
        while i < len(out):
            p = propose(d, mode, np.asarray(prompt + out[:i], dtype=np.int64), k, nodes)
            if isinstance(p, TreeProposal):
                acc = accepted_in_tree(p, out[i:])
                verified += len(p) + 1
            else:
                acc = 0
                while acc < len(p.tokens) and i + acc < len(out) and p.tokens[acc] == out[i + acc]:
                    acc += 1
                verified += len(p.tokens) + 1
            i, cycles = i + acc + 1, cycles + 1
        tokens += len(out)
        d.observe_request(prompt + out)
    return tokens / cycles, verified / cycles


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--workloads", nargs="+", default=["mixed", "templated", "structured"])
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--nodes", type=int, default=15)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sr = SpecRouter.from_pretrained("default", adaptive=False)
    target = sr.pool.target
    for wl in build_workloads(tuple(args.workloads), args.prompts):
        rows = []
        for r in wl.requests:
            kw = dict(json_schema=r.json_schema) if r.json_schema else {}
            ids = sr.encode(r.prompt, chat=r.chat)
            res = sr.generate(ids, max_new_tokens=args.max_new_tokens, chain=[target], **kw)[0]
            rows.append((ids, res.token_ids))
        line = []
        for mode, m in (("chain", 2), ("tree", 2), ("chain", 1), ("tree", 1)):
            per, ver = replay(rows, mode, args.k, args.nodes, m)
            line.append(f"{mode} (match >= {m}) {per:.3f} ({ver:.2f} verified)")
        print(f"{wl.name} ({len(rows)} requests): " + "  ".join(line))


if __name__ == "__main__":
    main()
