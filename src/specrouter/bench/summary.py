"""The summary of one benchmark scenario: tokens/s per system (total generated tokens / total
seconds), acceptance per level, each static chain at its best k *in hindsight* (every k of
`ks` ran on every request; the best per chain is picked after the fact, which favours the
static baselines), the best static chain (target-only included), the best 3-level chain, the
oracle (per request the fastest static (chain, k) measured on that request, tokens and times
summed), and the ratios of SpecRouter to each."""

from __future__ import annotations

from typing import TYPE_CHECKING

from specrouter.bench.workloads import Scenario

if TYPE_CHECKING:
    from specrouter.bench.systems import System


NO_SUFFIX = "SpecRouter (no suffix)"  # the same router over the pool without the suffix drafter
NO_HEAD = "SpecRouter (no head)"  # ... over the pool without its draft heads (issue 18's goal)
NO_TREES = "SpecRouter (no trees)"  # ... the router with chains only (token trees: greedy rows by default, issue 28)
NO_TV = "SpecRouter (no D_TV)"  # ... the same pool, the router learning from acceptance counts only
TARGET_CACHE = "target-only +cache"  # target-only with the prefix cache on (every other system: off)
ADAPTIVE_CACHE = "SpecRouter +cache"  # SpecRouter with the prefix cache on


def chain_label(chain: tuple[str, ...], aliases: dict[str, str], k: int | None = None) -> str:
    label = ">".join(aliases.get(m, m) for m in chain)
    return label + (f" k={k}" if k and len(chain) > 1 else "")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _aliased(key: str, aliases: dict[str, str]) -> str:
    return ">".join(aliases.get(m, m) for m in key.split(">"))


def _acceptance(stats: list, aliases: dict[str, str]) -> dict:
    """Acceptance per level summed over requests: rate per pair, mean acceptance length,
    cycles per chain."""
    drafted, accepted, chains = {}, {}, {}
    cycles = generated = 0
    for st in stats:
        cycles += st.cycles
        generated += st.generated
        for p, n in st.drafted.items():
            p = _aliased(p, aliases)
            drafted[p] = drafted.get(p, 0) + n
        for p, n in st.accepted.items():
            p = _aliased(p, aliases)
            accepted[p] = accepted.get(p, 0) + n
        for c, n in st.chains.items():
            c = _aliased(c, aliases)
            chains[c] = chains.get(c, 0) + n
    return {
        "acceptance": {p: accepted.get(p, 0) / d for p, d in drafted.items() if d},
        "drafted": drafted, "accepted": accepted,
        "mean_acceptance_length": generated / cycles if cycles else None,
        "chain_cycles": chains,
    }


def summarize(sc: Scenario, systems: list[System], requests: list[dict], events: list[dict], *,
              aliases: dict[str, str], reference: str, adaptive: str) -> dict:
    """The summary of one scenario (JSON-ready): `requests` are the loop's per-request records
    (their RequestStats are consumed), `reference` names target-only, `adaptive` SpecRouter."""
    out_systems = _per_system(systems, requests, aliases, reference)
    tps = {n: e["tokens_per_second"] for n, e in out_systems.items()}
    static = [s for s in systems if s.kind in ("static", "target-only")]
    best_static = max(static, key=lambda s: tps[s.name])
    three = [s for s in static if len(s.chain) == 3]
    best_three = max(three, key=lambda s: tps[s.name]) if three else None
    oracle = _oracle(static, requests)
    by_kind = _by_kind(systems, requests)
    for r in requests:  # JSON-ready: stats objects -> the adaptive system's chains only
        st = r.pop("stats")
        if adaptive in st:
            r["specrouter_chain_cycles"] = {_aliased(c, aliases): n for c, n in st[adaptive].chains.items()}
    return {
        "name": sc.name,
        "workload": sc.workload.name,
        "temperature": sc.temperature,
        "greedy": sc.temperature == 0,
        "slowdown": None if sc.slowdown_start is None else {"start_request": sc.slowdown_start},
        "requests": requests,
        "systems": out_systems,
        "static_chains_best_k": _best_k_per_chain(static, tps, aliases),
        "best_static": {"system": best_static.name, "tokens_per_second": tps[best_static.name]},
        "best_three_level": None if best_three is None else
            {"system": best_three.name, "tokens_per_second": tps[best_three.name]},
        "oracle": oracle,
        "ratios": _ratios(tps, tps.get(adaptive), reference, best_static.name,
                          best_three.name if best_three else None, oracle["tokens_per_second"]),
        "tokens_per_second_by_kind": by_kind,
        "hf_mismatch_requests": sum(1 for r in requests if r.get("mismatches")),
        # structured workload: per system, outputs that follow their JSON schema / requests
        "schema_valid": {s.name: [sum(r["schema_valid"][s.name] for r in requests if "schema_valid" in r),
                                  sum(1 for r in requests if "schema_valid" in r)]
                         for s in systems} if any("schema_valid" in r for r in requests) else None,
        "decisions": events,
    }


def _per_system(systems: list[System], requests: list[dict], aliases: dict[str, str],
                reference: str) -> dict[str, dict]:
    """Per system: its chain, tokens, seconds, tokens/s (total tokens / total seconds), its
    acceptance per level, and its ratio to `reference` (target-only)."""
    out = {}
    for s in systems:
        tokens = sum(r["tokens"][s.name] for r in requests)
        seconds = sum(r["seconds"][s.name] for r in requests)
        entry = {"kind": s.kind, "chain": [aliases.get(m, m) for m in s.chain] if s.chain else None,
                 "k": s.k, "tokens": tokens, "seconds": seconds,
                 "tokens_per_second": tokens / seconds if seconds else 0.0}
        stats = [r["stats"][s.name] for r in requests if s.name in r["stats"]]
        if stats:
            entry.update(_acceptance(stats, aliases))
            entry.update(_first_token(s.name, requests))
        out[s.name] = entry
    for e in out.values():
        e["vs_target_only"] = _ratio(e["tokens_per_second"], out[reference]["tokens_per_second"])
    return out


def _first_token(name: str, requests: list[dict]) -> dict:
    """Time to first token (mean seconds) over every request and over the later turns of
    multi-turn conversations (turn >= 2); prompt tokens taken from the prefix cache."""
    def mean(rows):
        vals = [r["first_token_seconds"][name] for r in rows if name in r.get("first_token_seconds", {})]
        return sum(vals) / len(vals) if vals else None

    later = [r for r in requests if r.get("turn", 0) >= 1]
    return {"first_token_s": mean(requests), "first_token_s_later_turns": mean(later) if later else None,
            "cached_tokens": sum(r.get("cached_tokens", {}).get(name, 0) for r in requests),
            "prompt_tokens": sum(r.get("prompt_tokens_sent", {}).get(name, r["prompt_tokens"]) for r in requests)}


def _best_k_per_chain(static: list[System], tps: dict[str, float], aliases: dict[str, str]) -> list[dict]:
    """Each static chain at its best k, in hindsight."""
    best_k: dict[str, System] = {}
    for s in static:
        key = chain_label(s.chain, aliases)
        if key not in best_k or tps[s.name] > tps[best_k[key].name]:
            best_k[key] = s
    return [{"chain": key, "k": s.k, "system": s.name, "levels": len(s.chain),
             "tokens_per_second": tps[s.name]} for key, s in best_k.items()]


def _oracle(static: list[System], requests: list[dict]) -> dict:
    """Per request the fastest static (chain, k) measured on it; tokens and seconds summed."""
    tokens = seconds = 0.0
    choices = []
    for r in requests:
        def per_token(s):
            n = r["tokens"][s.name]
            return r["seconds"][s.name] / n if n else float("inf")
        s = min(static, key=per_token)
        tokens += r["tokens"][s.name]
        seconds += r["seconds"][s.name]
        choices.append(s.name)
    return {"tokens_per_second": tokens / seconds if seconds else 0.0, "tokens": tokens,
            "seconds": seconds, "choices": choices}


def _by_kind(systems: list[System], requests: list[dict]) -> dict[str, dict[str, float]]:
    """Tokens/s per request type and system (the mixed stream's breakdown)."""
    by_kind = {}
    for kind in dict.fromkeys(r["kind"] for r in requests):
        rows = [r for r in requests if r["kind"] == kind]
        by_kind[kind] = {}
        for s in systems:
            seconds = sum(r["seconds"][s.name] for r in rows)
            by_kind[kind][s.name] = sum(r["tokens"][s.name] for r in rows) / seconds if seconds else 0.0
    return by_kind


def _ratios(tps: dict[str, float], sr: float | None, reference: str, best_static: str,
            best_three: str | None, oracle_tps: float) -> dict[str, float | None]:
    """SpecRouter's (`sr`, tokens/s) ratio to each baseline, and the HF baselines' to target-only."""
    hf_gen, hf_asst = tps.get("HF generate"), tps.get("HF assisted")
    return {
        "specrouter/target_only": _ratio(sr, tps[reference]),
        "specrouter/best_static": _ratio(sr, tps[best_static]),
        "specrouter/oracle": _ratio(sr, oracle_tps),
        "specrouter/best_three_level": _ratio(sr, tps[best_three]) if best_three else None,
        "specrouter/no_suffix": _ratio(sr, tps.get(NO_SUFFIX)),
        "specrouter/no_head": _ratio(sr, tps.get(NO_HEAD)),
        "specrouter/no_tv": _ratio(sr, tps.get(NO_TV)),
        "specrouter/no_trees": _ratio(sr, tps.get(NO_TREES)),
        "specrouter/hf_generate": _ratio(sr, hf_gen),
        "specrouter/hf_assisted": _ratio(sr, hf_asst),
        "hf_generate/target_only": _ratio(hf_gen, tps[reference]),
        "hf_assisted/target_only": _ratio(hf_asst, tps[reference]),
        # the prefix cache: SpecRouter with it against plain decoding without and with it
        "specrouter_cache/target_only": _ratio(tps.get(ADAPTIVE_CACHE), tps[reference]),
        "specrouter_cache/target_only_cache": _ratio(tps.get(ADAPTIVE_CACHE), tps.get(TARGET_CACHE)),
        "specrouter_cache/specrouter": _ratio(tps.get(ADAPTIVE_CACHE), sr),
        "target_only_cache/target_only": _ratio(tps.get(TARGET_CACHE), tps[reference]),
    }
