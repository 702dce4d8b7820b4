"""SpecRouter variants side by side on the mixed stream (docs/router.md, "Measured"): each a
fresh router per temperature, every request decoded by every variant and by target-only in
turn (the order rotated per request), one process, the bench's prompts (3 per type, 64 new
tokens). Prints tokens/s per request and summed.

    python benchmarks/router_variants.py [--temperatures 0 0.7] [--variants no-tv tv-cap-8]
        [--workload mixed|chat|prose|code|extraction] [--prompts-per-type 3] [--max-new-tokens 64]
        [--presence-penalty P] [--frequency-penalty F] [--repetition-penalty R]
        [--arm NAME FIELD=VALUE ... [--arm ...]]

`--arm` adds a variant of its own RouterConfig fields (Python literals, as serve_engine.py's
`--arm`), beside the named ones.

Variants (RouterConfig changes against the default): no-tv (measure_tv=False), tv-cap-8
(request_tv_cap=8, request_tv_weight=1), no-hold (plain_hold_max=0: no plain hold, a
settled plain single stream decided every step), no-fade (realized_fade=1.0: the realized check's
evidence fades only on cycles of model-free chains, as before), no-stream-hold
(stream_hold_steps=1: a settled speculating single stream decided every step, as before),
no-refute (probe_refute_wait=0: a model pair's probe that refuted its
optimism sets no wait, as before), no-idle-fade (request_idle_decay=1.0: a request's evidence of a
model pair frozen while it runs plain, as before),
tv-always (tv_every=1: D_TV measured in every step with a sampled row, as before the TvSchedule),
prior-16 (request_prior_strength=16: a request's
own acceptance counts shrunk toward its prior by 16 pseudo-trials, not 8), tv-lean (tv_first_cycles=2,
tv_every=16: D_TV in a request's first 2 cycles and every 16th step), tv-first-8 (tv_first_cycles=8), tv-every-4 (tv_every=4), no-margin (decision_margin_sampling=0: a
sampled request's alphas and hit rates read as estimated, as before floor19), margin05 / margin1 / margin2 / m075 (z
0.5 / 1 / 2 / 0.75 standard errors off them), margin1g / margin05g (greedy rows too), probe-k2 (probe_k=2), m05-pk2 (z 0.5 and probe_k=2). Removed by prune22 (issue 27) with their fields: greedy-tv, outside, burst, burst2, monotone,
stand-in, tv-always-stand-in, monotone-m1g, monotone-m1, refute-global, free16, lean, lean16, firm16s.
Removed by prune23 (issue 27) with their fields (each an "as before" path of a default that stayed on):
any-probe, probe-predicted, catch-up-probes, stale, no-check, plain-lease, lease-held, lease-held-nm,
pre-floor21, no-plain-hold, firm, no-firm, firm8, lazy, lazy8, lazy8-nobe, per-step.
Removed by lead23 (issue 27) with their fields: iid (confirmed_alpha), no-leave-charge
(charge_leaving_plain), spec-held (outside_spec_held, on by default: the variant named the default),
decided-plain (outside_plain_held). Removed by prune24 (issue 27) with their fields' old options: no-step-host
(draft_step_overhead=False), prior-global (request_prior_quantile=None).

`--statics draft>target:4 draft>target:1`: static chains beside them ("draft" and "target" name
the pool's shipped draft and its target; k after the colon).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses

import torch

from specrouter.api import SpecRouter
from specrouter.bench.run import BenchConfig, build_scenarios
from specrouter.bench.systems import AdaptiveSystem, Decoding, NativeSystem
from specrouter.config import RouterConfig
from specrouter.models.default_pool import default_pool_paths
from specrouter.router.setup import load_or_sweep_profile


def variants(names: list[str]) -> dict[str, RouterConfig]:
    base = RouterConfig()
    sim = base.similarity
    known = {
        "no-tv": dataclasses.replace(base, similarity=dataclasses.replace(sim, measure_tv=False)),
        "tv-cap-8": dataclasses.replace(base, request_tv_cap=8.0, request_tv_weight=1.0),
        "no-hold": dataclasses.replace(base, plain_hold_max=0),
        "no-fade": dataclasses.replace(base, realized_fade=1.0),
        "no-stream-hold": dataclasses.replace(base, stream_hold_steps=1),
        "no-refute": dataclasses.replace(base, probe_refute_wait=0),
        "no-idle-fade": dataclasses.replace(base, request_idle_decay=1.0),
        "tv-always": dataclasses.replace(base, similarity=dataclasses.replace(sim, tv_every=1)),
        "prior-16": dataclasses.replace(base, request_prior_strength=16.0),
        "tv-lean": dataclasses.replace(base, similarity=dataclasses.replace(sim, tv_first_cycles=2, tv_every=16)),
        "tv-first-8": dataclasses.replace(base, similarity=dataclasses.replace(sim, tv_first_cycles=8)),
        "tv-every-4": dataclasses.replace(base, similarity=dataclasses.replace(sim, tv_every=4)),
        "margin05": dataclasses.replace(base, decision_margin_sampling=0.5),
        "margin1": dataclasses.replace(base, decision_margin_sampling=1.0),
        "margin2": dataclasses.replace(base, decision_margin_sampling=2.0),
        "margin1g": dataclasses.replace(base, decision_margin_sampling=1.0, decision_margin_greedy=1.0),
        "margin05g": dataclasses.replace(base, decision_margin_sampling=0.5, decision_margin_greedy=0.5),
        "no-margin": dataclasses.replace(base, decision_margin_sampling=0.0, decision_margin_greedy=0.0),
        "probe-k2": dataclasses.replace(base, probe_k=2),
        "m05-pk2": dataclasses.replace(base, decision_margin_sampling=0.5, probe_k=2),
        "m075": dataclasses.replace(base, decision_margin_sampling=0.75),
    }
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; use some of {list(known)}")
    return {"default": base, **{n: known[n] for n in names}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--variants", nargs="*", default=["no-tv"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workload", default="mixed")
    ap.add_argument("--prompts-per-type", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--arm", nargs="+", action="append", default=[], metavar="NAME [FIELD=VALUE ...]",
                    help="a variant of these RouterConfig fields (Python literals)")
    ap.add_argument("--statics", nargs="*", default=[], help="static chains beside them: draft>target:4 ...")
    for name in ("presence", "frequency", "repetition"):
        ap.add_argument(f"--{name}-penalty", type=float, default=None)
    args = ap.parse_args()
    controls = tuple((f"{n}_penalty", v) for n in ("presence", "frequency", "repetition")
                     if (v := getattr(args, f"{n}_penalty")) is not None)
    configs = variants(args.variants)
    for name, *fields in args.arm:
        if name in configs or name == "target-only" or name in args.statics:
            raise SystemExit(f"--arm {name}: the name is taken")
        try:
            configs[name] = dataclasses.replace(RouterConfig(), **{k: ast.literal_eval(v) for k, v in
                                                                   (f.split("=", 1) for f in fields)})
        except (TypeError, ValueError, SyntaxError) as e:
            raise SystemExit(f"--arm {name} {' '.join(fields)}: {e}") from None
    torch.set_num_threads(args.threads)
    sr = SpecRouter.from_pretrained(default_pool_paths(progress=False), adaptive=False, progress=False)
    pool = sr.pool
    profile = load_or_sweep_profile(pool, progress=False)
    systems = {n: AdaptiveSystem(pool, n, profile=profile, progress=False, router_config=c)
               for n, c in configs.items()}
    systems["target-only"] = NativeSystem(pool, "target-only", (pool.target,), None)
    aliases = {"draft": pool.order[-2], "target": pool.target}
    for spec in args.statics:
        chain, _, k = spec.partition(":")
        systems[spec] = NativeSystem(pool, spec, tuple(aliases.get(m, m) for m in chain.split(">")), int(k or 4))
    for s in systems.values():  # first forwards allocate
        s.run(sr.encode("hello"), Decoding(0.0, 8, 0))
    names = list(systems)
    for temp in args.temperatures:
        cfg = BenchConfig(workloads=(args.workload,), prompts_per_type=args.prompts_per_type, temperatures=(temp,),
                          max_new_tokens=args.max_new_tokens, slowdown=False, hf="none", peers=False, controls=controls)
        scenario = build_scenarios(cfg)[0]
        for s in systems.values():
            s.reset()
        total = {n: [0, 0.0] for n in names}
        differ = {n: 0 for n in names}  # greedy: requests whose output differs from target-only's
        for i, req in enumerate(scenario.workload.requests):
            ids = sr.encode(req.prompt, chat=req.chat)
            row, outs = {}, {}
            for j in range(len(names)):
                n = names[(i + j) % len(names)]
                out = systems[n].run(ids, Decoding(temp, cfg.max_new_tokens, cfg.seed + i, controls))
                total[n][0] += len(out.token_ids)
                total[n][1] += out.seconds
                row[n] = len(out.token_ids) / out.seconds
                outs[n] = list(out.token_ids)
            for n in names:
                differ[n] += outs[n] != outs["target-only"]
            print(f"t={temp:g} #{i} {req.kind:10s} " + " ".join(f"{n} {v:.0f}" for n, v in row.items()), flush=True)
        print(f"t={temp:g} total tokens/s: " + " ".join(f"{n} {t / s:.1f}" for n, (t, s) in total.items()), flush=True)
        if temp == 0:
            print(f"t=0 outputs differing from target-only's: " + " ".join(f"{n} {differ[n]}" for n in names), flush=True)


if __name__ == "__main__":
    main()
