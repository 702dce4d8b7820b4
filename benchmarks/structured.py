"""The `structured` workload (issue 30 item 6): constrained decoding with and without
speculation, side by side in one run, same prompts, each system on its own pool view.

Requests (chat template, greedy): extract a record's fields into a schema, produce a tool call
(a schema of a function's arguments) for a request, fill a JSON list. Systems:
- plain: the target alone, the grammar mask each step, no jump forward (plain constrained decoding);
- plain+jf: the target alone with grammar-forced tokens committed without a forward;
- specrouter: the router picks chain and k per request every cycle, jump forward on.
Every output must validate against its schema and equal plain's token for token. Reported:
tokens/s per system (generated tokens over wall time, prefill included), the ratio to the
fastest plain system, and the mask's share of the step (seconds in RowGrammar over wall time).

Run: `python benchmarks/structured.py [--rounds 2] [--pool default]`.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import time

# the requests and the validator are the `structured` workload's (`specrouter bench --workloads
# structured` runs them beside the other workloads, against every static chain)
from specrouter.bench.structured import STRUCTURED as REQUESTS  # noqa: E402
from specrouter.bench.structured import schema_valid as valid  # noqa: E402


def run_system(sr, name, chain, jump_forward, max_new):
    sr.engine.jump_forward = jump_forward
    outs, tokens, mask_s = [], 0, 0.0
    t0 = time.perf_counter()
    for kind, schema, prompt in REQUESTS:
        seq_box = []
        real_add = sr.engine.add_request

        def add(*a, **k):  # keep the row to read its grammar's mask time
            seq = real_add(*a, **k)
            seq_box.append(seq)
            return seq

        sr.engine.add_request = add
        try:
            r = sr.generate(prompt, chat=True, json_schema=schema, max_new_tokens=max_new, chain=chain)[0]
        finally:
            sr.engine.add_request = real_add
        mask_s += seq_box[0].grammar.mask_seconds
        outs.append(r)
        tokens += len(r.token_ids)
    wall = time.perf_counter() - t0
    return dict(name=name, outs=outs, tokens=tokens, wall=wall, mask_s=mask_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="passes over the requests (the first warms up)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--pool", nargs="+", default=["default"])
    args = ap.parse_args()
    from specrouter import SpecRouter

    sr = SpecRouter.from_pretrained(args.pool if len(args.pool) > 1 else args.pool[0], progress=True)
    target = sr.pool.target
    views = {
        "plain": SpecRouter(sr.pool.with_fresh_drafters(), None, sr.config),
        "plain+jf": SpecRouter(sr.pool.with_fresh_drafters(), None, sr.config),
        "specrouter": SpecRouter(sr.pool.with_fresh_drafters(), sr.router, sr.config),
    }
    plan = {"plain": ((target,), False), "plain+jf": ((target,), True), "specrouter": (None, True)}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"pool {' < '.join(sr.pool.order)}; commit {commit}; {platform.processor() or platform.machine()}; "
          f"load {open('/proc/loadavg').read().split()[:3]}")
    results = {}
    for r in range(args.rounds):
        for name, view in views.items():
            chain, jf = plan[name]
            results[name] = run_system(view, name, chain, jf, args.max_new_tokens)
        print(f"round {r + 1}: " + ", ".join(f"{n} {v['tokens'] / v['wall']:.1f} tok/s" for n, v in results.items()))
    base = results["plain"]["outs"]
    fastest_plain = max(results[n]["tokens"] / results[n]["wall"] for n in ("plain", "plain+jf"))
    for name, res in results.items():
        same = all(a.token_ids == b.token_ids for a, b in zip(res["outs"], base))
        ok = sum(valid(o.text, s) for o, (_, s, _) in zip(res["outs"], REQUESTS))
        tps = res["tokens"] / res["wall"]
        print(f"{name:11s} {res['tokens']:4d} tokens {res['wall']:6.2f} s {tps:6.1f} tok/s "
              f"x{tps / fastest_plain:.2f} vs fastest plain; identical to plain {same}; "
              f"valid {ok}/{len(REQUESTS)}; mask {100 * res['mask_s'] / res['wall']:.2f}% of wall")
    for (kind, _, _), o in zip(REQUESTS, results["specrouter"]["outs"]):
        print(f"  {kind:8s} {o.finish_reason:6s} {o.text[:110]!r}  chains {dict(o.stats.chains)}")
    print(f"load {open('/proc/loadavg').read().split()[:3]}")


if __name__ == "__main__":
    main()
