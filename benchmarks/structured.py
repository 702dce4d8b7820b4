"""The `structured` workload (issue 30 item 6): constrained decoding with and without
speculation, side by side in one run, same prompts, each system on its own pool view.

Requests (chat template, greedy): extract a record's fields into a schema, produce a tool call
(a schema of a function's arguments) for a request, fill a JSON list. Systems:
- plain: the target alone, the grammar mask each step, no jump forward (plain constrained decoding);
- plain+jf: the target alone with grammar-forced tokens committed without a forward;
- specrouter-nocertain: the router, jump forward on, forced tokens NOT put into the drafts;
- specrouter-nofields: the router, jump forward on, forced tokens in the drafts as certain
  candidates (decoding/certain_drafts.py), no field drafts;
- specrouter: the router picks chain and k per request every cycle, jump forward on, certain
  candidates, and a constrained row's model-free drafts may be field drafts (the text the
  grammar forces, values copied from the prompt: decoding/field_drafts.py) while they pay in
  its request (decoding/field_gate.py).
Every round runs every system on fresh pool views (a learning drafter never sees an earlier
round's answers; the first round warms up). Every output must validate against its schema and
equal plain's token for token. Reported: tokens/s per system (generated tokens over wall time,
prefill included), the ratio to the fastest plain system, target forwards (steps that ran one),
the mask's share of the wall time (seconds in RowGrammar: masks and forced tokens) and the mask
seconds per target forward against the mean target forward, and tokens committed by jump
forward / as certain drafts; per request, target forwards of plain+jf / specrouter-nofields /
specrouter and specrouter's field gate.

Run: `python benchmarks/structured.py [--rounds 2] [--pool default]
[--requests original|reworded|heldout|unseen|fresh25|fresh26|all]`.
"""

from __future__ import annotations

import argparse
import copy
import platform
import subprocess
import time

# the requests and the validator are the `structured` workload's (`specrouter bench --workloads
# structured` runs them beside the other workloads, against every static chain)
from specrouter.bench.structured import FRESH25, FRESH26, HELDOUT, REWORDED, STRUCTURED, UNSEEN  # noqa: E402
from specrouter.bench.structured import schema_valid as valid  # noqa: E402


REQUESTS = STRUCTURED


def run_system(sr, name, chain, jump_forward, max_new, certain=True, fields=True):
    sr.engine.jump_forward = jump_forward
    sr.engine.executor.certain_drafts = jump_forward and certain
    sr.engine.executor.field_drafts = fields
    outs, tokens, mask_s, fields_s = [], 0, 0.0, 0.0
    steps = []  # per step: the target's forward seconds
    per_request = []  # target forwards per request
    gates = []  # per request: its field gate's contests won / lost / scored while closed

    def on_cycle(stats):
        if stats.forward_time and target in stats.forward_time:
            steps.append(stats.forward_time[target])

    target = sr.pool.target
    real_generate_ids = sr.engine.generate_ids
    sr.engine.generate_ids = lambda *a, **k: real_generate_ids(*a, **{**k, "on_cycle": on_cycle})
    t0 = time.perf_counter()
    for kind, schema, prompt in REQUESTS:
        seq_box = []
        real_add = sr.engine.add_request

        def add(*a, **k):  # keep the row to read its grammar's mask time
            seq = real_add(*a, **k)
            seq_box.append(seq)
            return seq

        sr.engine.add_request = add
        before = len(steps)
        try:
            r = sr.generate(prompt, chat=True, json_schema=schema, max_new_tokens=max_new, chain=chain)[0]
        finally:
            sr.engine.add_request = real_add
        mask_s += seq_box[0].grammar.mask_seconds
        fields_s += seq_box[0].grammar.fields.seconds if seq_box[0].grammar.fields is not None else 0.0
        per_request.append(len(steps) - before)
        gate = seq_box[0].grammar.fields.gate if seq_box[0].grammar.fields is not None else None
        gates.append(f"{gate.won}/{gate.lost}/{gate.closed}" if gate is not None and fields else "-")
        outs.append(r)
        tokens += len(r.token_ids)
    wall = time.perf_counter() - t0
    sr.engine.generate_ids = real_generate_ids
    return dict(name=name, outs=outs, tokens=tokens, wall=wall, mask_s=mask_s, fields_s=fields_s,
                target_steps=len(steps), per_request=per_request, gates=gates,
                target_s=sum(steps), jumped=sum(o.stats.jumped for o in outs),
                certain=sum(o.stats.certain for o in outs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="passes over the requests (the first warms up)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--pool", nargs="+", default=["default"])
    ap.add_argument("--requests",
                    choices=["original", "reworded", "heldout", "unseen", "fresh25", "fresh26", "all"],
                    default="original",
                    help="the bench's 9 requests, the 6 reworded ones (bench/structured.py REWORDED), "
                    "the 9 of session 23 (HELDOUT), the 9 of session 24 (UNSEEN), the 12 held out in "
                    "session 25 (FRESH25), the 12 held out in session 26 (FRESH26), or all six sets")
    args = ap.parse_args()
    global REQUESTS
    REQUESTS = {"original": STRUCTURED, "reworded": REWORDED, "heldout": HELDOUT, "unseen": UNSEEN,
                "fresh25": FRESH25, "fresh26": FRESH26,
                "all": STRUCTURED + REWORDED + HELDOUT + UNSEEN + FRESH25 + FRESH26}[args.requests]
    from specrouter import SpecRouter
    from specrouter.router.policy import Router

    sr = SpecRouter.from_pretrained(args.pool if len(args.pool) > 1 else args.pool[0], progress=True)
    target = sr.pool.target
    def fresh_router(pool):  # every router system learns alone (as `specrouter bench` does)
        return Router.from_pool(pool, copy.deepcopy(sr.router.profile), config=sr.router.config)

    def router_view():
        pool = sr.pool.with_fresh_drafters()
        return SpecRouter(pool, fresh_router(pool), sr.config)

    def views():  # fresh every round: no system learns from an earlier round's outputs
        return {
            "plain": SpecRouter(sr.pool.with_fresh_drafters(), None, sr.config),
            "plain+jf": SpecRouter(sr.pool.with_fresh_drafters(), None, sr.config),
            "specrouter-nocertain": router_view(),
            "specrouter-nofields": router_view(),
            "specrouter": router_view(),
        }

    plan = {"plain": ((target,), False, False, False), "plain+jf": ((target,), True, False, False),
            "specrouter-nocertain": (None, True, False, False), "specrouter-nofields": (None, True, True, False),
            "specrouter": (None, True, True, True)}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"pool {' < '.join(sr.pool.order)}; commit {commit}; {platform.processor() or platform.machine()}; "
          f"load {open('/proc/loadavg').read().split()[:3]}")
    results = {}
    for r in range(args.rounds):
        for name, view in views().items():
            chain, jf, certain, fields = plan[name]
            results[name] = run_system(view, name, chain, jf, args.max_new_tokens, certain, fields)
        print(f"round {r + 1}: " + ", ".join(f"{n} {v['tokens'] / v['wall']:.1f} tok/s" for n, v in results.items()))
    base = results["plain"]["outs"]
    fastest_plain = max(results[n]["tokens"] / results[n]["wall"] for n in ("plain", "plain+jf"))
    for name, res in results.items():
        same = all(a.token_ids == b.token_ids for a, b in zip(res["outs"], base))
        ok = sum(valid(o.text, s) for o, (_, s, _) in zip(res["outs"], REQUESTS))
        tps = res["tokens"] / res["wall"]
        print(f"{name:20s} {res['tokens']:4d} tokens {res['wall']:6.2f} s {tps:6.1f} tok/s "
              f"x{tps / fastest_plain:.2f} vs fastest plain; identical to plain {same}; "
              f"valid {ok}/{len(REQUESTS)}; target forwards {res['target_steps']}; mask "
              f"{100 * res['mask_s'] / res['wall']:.2f}% of wall, {1e3 * res['mask_s'] / max(res['target_steps'], 1):.2f} ms "
              f"per target forward of {1e3 * res['target_s'] / max(res['target_steps'], 1):.1f} ms; "
              f"field drafts {100 * res['fields_s'] / res['wall']:.2f}% of wall; "
              f"jumped {res['jumped']}, certain {res['certain']}")
    print("per request: target forwards plain+jf / specrouter-nofields / specrouter, the output, "
          "specrouter's field gate (contests won / lost / scored while closed: decoding/field_gate.py), "
          "specrouter's chains (cycles), specrouter-nofields' chains")
    for (kind, _, _), o, n, fj, fn, fs, g in zip(REQUESTS, results["specrouter"]["outs"], results["specrouter-nofields"]["outs"],
                                                 results["plain+jf"]["per_request"],
                                                 results["specrouter-nofields"]["per_request"],
                                                 results["specrouter"]["per_request"], results["specrouter"]["gates"]):
        print(f"  {kind:8s} {fj:3d} / {fn:3d} / {fs:3d} {o.finish_reason:6s} {o.text[:110]!r}  gate {g}  "
              f"chains {dict(o.stats.chains)}  nofields {dict(n.stats.chains)}")
    print(f"load {open('/proc/loadavg').read().split()[:3]}")


if __name__ == "__main__":
    main()
