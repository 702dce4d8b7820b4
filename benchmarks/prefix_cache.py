"""Prefix cache on vs off, side by side in one process run (issue 29's goals), default pool:

1. multi-turn chat (5 turns, each re-sending the history with the previous answer): time to
   first token of turns 2+, target-only chain, cache on vs off;
2. an exactly repeated request (64 tokens, greedy): SpecRouter with the cache, second run, vs
   target-only without cache;
every greedy output compared on vs off. Each system on its own view of the pool
(`Pool.with_fresh_drafters()`), alternating which runs first.

    PYTHONPATH=src python benchmarks/prefix_cache.py
"""

from __future__ import annotations

import statistics
import time

from specrouter import SpecRouter
from specrouter.config import EngineConfig, SpecRouterConfig

TURNS = [
    "Hi! I am planning a trip to Lisbon next spring. What should I know before I go?",
    "What neighbourhoods are best to stay in for a first visit?",
    "And what should I eat there? I like seafood.",
    "How many days would you recommend, and is a day trip to Sintra worth it?",
    "Thanks. Can you summarize the plan in a short list?",
]


def make(sr: SpecRouter, cached: bool, adaptive: bool) -> SpecRouter:
    cfg = SpecRouterConfig(engine=EngineConfig(prefix_cache=cached))
    return SpecRouter(sr.pool.with_fresh_drafters(), sr.router if adaptive else None, cfg)


def ttft(sr: SpecRouter, messages, **kw):
    t0 = time.perf_counter()
    first, result = None, None
    for chunk in sr.stream(messages, chat=True, **kw):
        if first is None:
            first = time.perf_counter() - t0
        result = chunk.result or result
    return first, time.perf_counter() - t0, result


def main() -> None:
    base = SpecRouter.from_pretrained("default")
    on, off = make(base, True, False), make(base, False, False)
    history = {id(on): [], id(off): []}
    rows = []
    for t, user in enumerate(TURNS):
        out = {}
        for sr in ((on, off) if t % 2 == 0 else (off, on)):
            msgs = history[id(sr)] + [{"role": "user", "content": user}]
            first, total, res = ttft(sr, msgs, max_new_tokens=48, chain=["target"])
            out[sr is on] = (first, total, res)
            history[id(sr)] = msgs + [{"role": "assistant", "content": res.text}]
        assert out[True][2].token_ids == out[False][2].token_ids, f"turn {t}: outputs differ"
        rows.append((t + 1, out[True][2].prompt_tokens, out[True][2].stats.cached_tokens,
                     out[False][0], out[True][0]))
        print(f"turn {t + 1}: prompt {rows[-1][1]} tokens, cached {rows[-1][2]}; TTFT off "
              f"{1e3 * out[False][0]:.1f} ms, on {1e3 * out[True][0]:.1f} ms, "
              f"{out[False][0] / out[True][0]:.2f}x")
    later = [r[3] / r[4] for r in rows[1:]]
    print(f"multi-turn turns 2+: TTFT {statistics.median(later):.2f}x lower with the cache "
          f"(median; min {min(later):.2f}x); outputs identical on/off")

    # exact repeat: SpecRouter (router, cache on) second run vs target-only without cache
    sr_on = make(base, True, True)
    plain = make(base, False, False)
    prompt = "Repeat the following list exactly, one item per line: apples, bananas, cherries, dates, elderberries, figs, grapes, honeydew, kiwis, lemons."
    kw = dict(max_new_tokens=64, chat=True)
    sr_on.generate(prompt, **kw)  # first run: parks the request
    times = {"SpecRouter+cache (repeat)": [], "target-only no cache": []}
    outs = {}
    for i in range(3):
        for name in (list(times) if i % 2 == 0 else list(times)[::-1]):
            sr = sr_on if name.startswith("SpecRouter") else plain
            t0 = time.perf_counter()
            res = sr.generate(prompt, chain=None if sr is sr_on else ["target"], **kw)[0]
            times[name].append(time.perf_counter() - t0)
            outs[name] = res.token_ids
    assert len(set(map(tuple, outs.values()))) == 1, "repeat outputs differ"
    a, b = (statistics.median(v) for v in times.values())
    print(f"exact repeat (64 tokens): SpecRouter+cache {1e3 * a:.0f} ms, target-only no cache "
          f"{1e3 * b:.0f} ms: {b / a:.2f}x; outputs identical")


if __name__ == "__main__":
    main()
