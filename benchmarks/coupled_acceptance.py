"""Per-token acceptance of counter-based (Gumbel-max coupled) verification against standard
rejection sampling, on the embedded default pool (draft -> target), at the same positions.

The target writes each prompt's continuation at temperature `--temperature` (seeded); at every
generated position both models' processed distributions given the prefix are computed
(teacher forcing), and
- standard rejection sampling accepts a draft token with probability sum_v min(p_d, p_t) = 1 - D_TV;
- coupled verification accepts iff argmax(log p_d + g) == argmax(log p_t + g) for the shared
  noise g of (seed, position): estimated over `--keys` seeds per position.

    python benchmarks/coupled_acceptance.py [--temperature 0.7] [--tokens 48] [--keys 32]
"""

from __future__ import annotations

import argparse

import torch

from specrouter import SpecRouter
from specrouter.config import EngineConfig, SamplingParams, SpecRouterConfig
from specrouter.decoding.noise import coupled_argmax, position_keys, seed_key
from specrouter.decoding.sampling import SamplingTensors, process_logits, scaled_logits
from specrouter.models.runners.base import ForwardBatch

PROMPTS = [
    ("code", "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists.\"\"\"\n"),
    ("prose", "The old lighthouse keeper climbed the stairs every evening, and"),
    ("chat", "Explain in two sentences why the sky is blue."),
    ("qa", "Q: What is the capital of Australia?\nA:"),
]


def logits_of(runner, tokens: list[int], first: int, width: int) -> torch.Tensor:
    runner.reserve(1, len(tokens) + 1)
    b = ForwardBatch.build([0], [0], [tokens], [list(range(first - 1, len(tokens) - 1))])
    return runner.forward(b)[0, :, :width]  # (T, V): distributions of tokens[first:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--keys", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    # no prefix cache: teacher forcing below writes slot 0 of each runner, where the cache may
    # keep an earlier request's KV for reuse, so repeated prompts or seeds would read what this
    # script overwrote (found by dtemp27)
    sr = SpecRouter.from_config(SpecRouterConfig(engine=EngineConfig(adaptive=False, prefix_cache=False)))
    pool = sr.pool
    draft = next(n for n in pool.order if n in pool.runners and n != pool.target)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.tokens, seed=0)
    st = SamplingTensors.from_params([params])
    W = pool.vocab_width
    rows = []
    for kind, text in PROMPTS:
        prompt = sr.encode(text, chat=kind == "chat")
        out = sr.generate([prompt], max_new_tokens=args.tokens, temperature=args.temperature, top_p=args.top_p,
                          seed=0, chain=(pool.target,))[0]
        tokens = prompt + out.token_ids
        lt = logits_of(pool.runners[pool.target], tokens, len(prompt), W)  # (T, V)
        ld = logits_of(pool.runners[draft], tokens, len(prompt), W)
        pt, pd = process_logits(lt[None], st)[0], process_logits(ld[None], st)[0]
        rejection = (torch.minimum(pt, pd).sum(-1)).double()  # (T,) = 1 - D_TV
        T = lt.shape[0]
        seeds = torch.tensor([seed_key(s) for s in range(args.keys)], dtype=torch.long)
        keys = position_keys(seeds[:, None], torch.arange(T)[None, :] + len(prompt)).reshape(-1)  # (K*T,)
        st_t, st_d = scaled_logits(lt[None], st)[0], scaled_logits(ld[None], st)[0]
        yt = coupled_argmax(st_t.repeat(args.keys, 1), keys)
        yd = coupled_argmax(st_d.repeat(args.keys, 1), keys)
        coupled = (yt == yd).double().view(args.keys, T).mean(0)  # (T,)
        rows.append((kind, T, rejection.mean().item(), coupled.mean().item()))
    print(f"draft {draft!r} -> target {pool.target!r}, temperature {args.temperature}, top_p {args.top_p}")
    print(f"{'prompt':<8} {'tokens':>6} {'rejection (1-TV)':>17} {'coupled':>8} {'ratio':>6}")
    tot = [0, 0.0, 0.0]
    for kind, T, r, c in rows:
        print(f"{kind:<8} {T:>6} {r:>17.3f} {c:>8.3f} {c / r:>6.2f}")
        tot[0] += T
        tot[1] += r * T
        tot[2] += c * T
    print(f"{'all':<8} {tot[0]:>6} {tot[1] / tot[0]:>17.3f} {tot[2] / tot[0]:>8.3f} {tot[2] / tot[1]:>6.2f}")


if __name__ == "__main__":
    main()
