"""How bursty the draft's agreement is (issue 27's k ramp): on the default pool, the target
writes each prompt's continuation greedily; at every generated position the draft's greedy
token given the target's prefix is compared with the target's (teacher forcing), and the
agreement sequence is summarised as a two-state Markov chain: P(agree), P(agree | the last
position agreed) = p11, P(agree | the last disagreed) = p01, and their difference rho (the
lag-1 autocorrelation that router/burst.py priced by, with `RouterConfig.burst_acceptance`: off,
removed by prune22, issue 27; this measurement stands).

    python benchmarks/burst_acceptance.py [--tokens 96] [--prompts-per-type 3]
"""

from __future__ import annotations

import argparse

import torch

from specrouter import SpecRouter
from specrouter.bench.run import BenchConfig, build_scenarios
from specrouter.models.default_pool import default_pool_paths
from specrouter.models.runners.base import ForwardBatch


def greedy_of(runner, tokens: list[int], first: int) -> list[int]:
    """The runner's greedy token at positions first..len(tokens)-1 given the prefix."""
    runner.reserve(1, len(tokens) + 1)
    b = ForwardBatch.build([0], [0], [tokens], [list(range(first - 1, len(tokens) - 1))])
    return runner.forward(b)[0].argmax(-1).tolist()


def markov(seq: list[int]) -> tuple[int, int, int, int]:
    """(n11, n10, n01, n00): transitions of an agreement sequence."""
    n = [0, 0, 0, 0]
    for a, b in zip(seq, seq[1:]):
        n[(0 if a else 2) + (0 if b else 1)] += 1
    return tuple(n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--prompts-per-type", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    sr = SpecRouter.from_pretrained(default_pool_paths(progress=False), adaptive=False, progress=False)
    pool = sr.pool
    draft = next(n for n in reversed(pool.order) if n in pool.runners and n != pool.target)
    cfg = BenchConfig(workloads=("mixed",), prompts_per_type=args.prompts_per_type, temperatures=(0.0,),
                      max_new_tokens=args.tokens, slowdown=False, hf="none", peers=False)
    by_kind: dict[str, list[int]] = {}
    for req in build_scenarios(cfg)[0].workload.requests:
        prompt = sr.encode(req.prompt, chat=req.chat)
        out = sr.generate([prompt], max_new_tokens=args.tokens, temperature=0.0, chain=(pool.target,))[0]
        tokens = prompt + out.token_ids
        target = greedy_of(pool.runners[pool.target], tokens, len(prompt))
        guess = greedy_of(pool.runners[draft], tokens, len(prompt))
        seq = [int(a == b) for a, b in zip(guess, target)]
        n = markov(seq)
        tot = by_kind.setdefault(req.kind, [0, 0, 0, 0, 0, 0])
        tot[0] += sum(seq)
        tot[1] += len(seq)
        for i in range(4):
            tot[2 + i] += n[i]
        print(f"{req.kind:10s} {''.join(map(str, seq))}")
    print(f"draft {draft!r} -> target {pool.target!r}, greedy, teacher forced")
    print(f"{'type':10s} {'tokens':>6} {'P(agree)':>8} {'p11':>6} {'p01':>6} {'rho':>6}")
    all_ = [sum(v[i] for v in by_kind.values()) for i in range(6)]
    for kind, v in [*by_kind.items(), ("all", all_)]:
        p, p11, p01 = v[0] / v[1], v[2] / max(1, v[2] + v[3]), v[4] / max(1, v[4] + v[5])
        print(f"{kind:10s} {v[1]:>6} {p:>8.3f} {p11:>6.3f} {p01:>6.3f} {p11 - p01:>6.3f}")


if __name__ == "__main__":
    main()
