"""Adaptive routing vs every static chain vs the per-request oracle, side by side, one run.

Workload: a mixed stream of request types where the best static chain differs by type:
extraction / repetition prompts (the answer copies the prompt: n-gram drafting wins) and
open-ended prose / chat (drafts that do not know the text lose: plain decoding or a model draft
wins). Every system decodes the same requests, greedy, interleaved request by request to cancel
drift; every output is checked identical to target-only greedy (the run fails otherwise).

    python benchmarks/router_mixed.py                  # the embedded default pool
    python benchmarks/router_mixed.py --models d t     # any pool (n-gram added)

Prints tokens/s per system, ratios to target-only and to the best static chain, and the oracle:
the best static chain chosen per request in hindsight (its time summed over requests).
"""

from __future__ import annotations

import argparse
import time

import torch

EXTRACTION = [
    "Repeat the following list exactly, one item per line: apples, bananas, cherries, dates, "
    "elderberries, figs, grapes, honeydew, kiwis, lemons.",
    "Repeat this paragraph word for word: Speculative decoding drafts several tokens with a "
    "small model and lets the large model check them all in one forward pass. When the draft is "
    "right, many tokens are produced for the price of one step of the large model; when it is "
    "wrong, the large model's own token is kept, so the output never changes.",
    "Copy this sentence three times: The quick brown fox jumps over the lazy dog.",
    "Rewrite this Python code exactly as it is:\n\ndef add(a, b):\n    return a + b\n\n"
    "def sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n",
    "Extract the names from this text and list them: Alice met Bob at the station. Later, "
    "Carol and Dave joined Alice and Bob for dinner, and Erin arrived with Frank.",
]
PROSE = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten year old.",
    "What are three good habits for staying healthy?",
    "Describe a walk through a forest in autumn.",
    "Give me some advice for a job interview.",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=None, help="pool (default: the embedded one)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8], help="k of static chains")
    ap.add_argument("--rounds", type=int, default=1, help="passes over the workload")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from specrouter import SpecRouter
    from specrouter.router.cost_model import enumerate_chains

    paths = args.models
    if not paths:
        from specrouter.defaults import default_pool_paths

        paths = default_pool_paths()
    sr = SpecRouter.from_pretrained(paths, progress=True)
    pool = sr.pool
    statics = [(c, k) for c in enumerate_chains(pool.order, pool.target) for k in (args.ks if len(c) > 1 else [0])]
    systems = {("static", c, k): f"{'>'.join(c)}" + (f" k={k}" if k else "") for c, k in statics}
    systems[("adaptive", None, 0)] = "SpecRouter adaptive"
    requests = [("extraction", p) for p in EXTRACTION] + [("prose", p) for p in PROSE]
    requests = [r for pair in zip(requests[: len(EXTRACTION)], requests[len(EXTRACTION):]) for r in pair]  # interleave types
    requests = requests * args.rounds
    kw = dict(max_new_tokens=args.max_new_tokens, chat=True)
    sr.generate("Hello", max_new_tokens=4, chat=True)  # warm-up allocations
    times = {s: [] for s in systems}
    tokens = []
    for i, (kind, prompt) in enumerate(requests):
        ref = None
        for s in systems:
            mode, chain, k = s
            t0 = time.perf_counter()
            out = sr.generate(prompt, chain=chain, k=k or 4, **kw)[0]
            times[s].append(time.perf_counter() - t0)
            if ref is None:
                ref = out.token_ids
                tokens.append(len(ref))
            elif out.token_ids != ref:
                raise SystemExit(f"FAIL: {systems[s]} output differs from {systems[next(iter(systems))]} on request {i}")
        print(f"request {i} ({kind}): {tokens[-1]} tokens, " + ", ".join(
            f"{systems[s]} {tokens[-1] / times[s][-1]:.1f}" for s in systems), flush=True)
    total = sum(tokens)
    tps = {s: total / sum(t) for s, t in times.items()}
    target_only = ("static", (pool.target,), 0)
    best_static = max((s for s in systems if s[0] == "static"), key=lambda s: tps[s])
    oracle_time = sum(min(times[s][i] for s in systems if s[0] == "static") for i in range(len(requests)))
    oracle = total / oracle_time
    adaptive = ("adaptive", None, 0)
    print(f"\n{len(requests)} requests, {total} tokens, greedy outputs identical across all systems")
    print(f"{'system':<48}{'tok/s':>8}{'/ target-only':>15}")
    for s in systems:
        print(f"{systems[s]:<48}{tps[s]:>8.2f}{tps[s] / tps[target_only]:>14.2f}x")
    print(f"{'oracle (best static chain per request)':<48}{oracle:>8.2f}{oracle / tps[target_only]:>14.2f}x")
    print(f"\nSpecRouter / best static ({systems[best_static]}): {tps[adaptive] / tps[best_static]:.2f}x")
    print(f"SpecRouter / oracle: {tps[adaptive] / oracle:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
