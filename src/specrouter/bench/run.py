"""The benchmark loop: every system on every request, interleaved, in one process.

1. Set-up: load the pool (native runners), the transformers twins of the target and of the
   assistant draft, build the systems, encode every prompt once, size every cache for the
   longest request (no reallocation while timing), warm every system up once.
2. Scenarios: each workload at each temperature, plus the mixed stream with a scripted slowdown
   of one model from a request onward (greedy). Within a scenario, request by request, every
   system decodes the request, the order of systems rotated by one per request, so drift
   (thermal, co-tenants, caches) and order effects fall on every system alike; target-only runs
   next to SpecRouter, so the floor ratio's two halves ran in the same seconds (bench/order.py).
3. Checks: in greedy scenarios every exact system (static chains, SpecRouter) must reproduce
   target-only's tokens; a difference raises `GreedyMismatchError` at once. The transformers
   baselines are compared and any difference is recorded, not fatal.
4. Summary per scenario: summary.py (best k per chain in hindsight, the oracle, ratios).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass

import torch

from specrouter.bench.order import run_order
from specrouter.bench.slowdown import Slowdown
from specrouter.bench.structured import schema_valid
from specrouter.bench.summary import (ADAPTIVE_CACHE, NO_HEAD, NO_SUFFIX, NO_TREES, NO_TV, TARGET_CACHE, chain_label,
                                      summarize)
from specrouter.bench.systems import (
    AdaptiveSystem,
    Decoding,
    HFSystem,
    NativeSystem,
    Outcome,
    System,
    assisted_schedule,
)
from specrouter.bench.workloads import (
    KINDS,
    MIXED_ORDER,
    Request,
    Scenario,
    build_workloads,
    conversation_messages,
    prompts_of,
)
from specrouter.config import MAX_DRAFT_LENGTH, RouterConfig
from specrouter.errors import SpecRouterError
from specrouter.models.pool import SUFFIX, resolved_dtype


class GreedyMismatchError(SpecRouterError):
    """A static chain or SpecRouter produced other tokens than target-only greedy decoding."""


@dataclass(frozen=True)
class BenchConfig:
    """What `specrouter bench` runs (the CLI flags map one to one)."""

    models: tuple[str, ...] | None = None  # pool paths ("ngram" and "suffix" are added); None: the embedded default pool
    target: str | None = None  # target name or path (default: the largest model)
    dtype: str = "auto"  # of every model, native and transformers (auto: see PoolConfig)
    device: str = "auto"  # where every model runs, native and transformers (see PoolConfig)
    workloads: tuple[str, ...] = ("code", "prose", "chat", "extraction", "mixed")
    kinds: tuple[str, ...] = MIXED_ORDER  # request types of the mixed stream, in stream order
    prompts_per_type: int = 3  # first n prompts of each type (workloads.py)
    prompt_set: str = "original"  # the four types' prompts: "original" or "fresh28" (workloads.PROMPT_SETS)
    mixed_block: int = 2  # the mixed stream changes type every this many requests
    repeat: int = 1  # passes over each workload's requests
    max_new_tokens: int = 64
    temperatures: tuple[float, ...] = (0.0, 0.7)  # 0: greedy (outputs checked identical)
    ks: tuple[int, ...] = (2, 4, 8)  # draft lengths of the static chains (best per chain in hindsight)
    max_levels: int = 3  # deepest static chain benchmarked
    hf: str = "all"  # transformers baselines in: all | greedy (greedy scenarios without slowdown) | none
    hf_assistant: str | None = None  # draft for assisted generation (default: the largest draft)
    peers: bool = True  # llama.cpp rows (bench/peers.py; needs the `peers` extra, else reported missing)
    slowdown: bool = True  # add the mixed stream with a scripted slowdown (greedy)
    slowdown_model: str | None = None  # model slowed (default: the largest draft)
    slowdown_factor: float = 4.0  # it runs this many times slower ...
    slowdown_at: float = 0.5  # ... from this fraction of the stream onward
    seed: int = 0  # request i samples with seed + i
    threads: int | None = None  # torch intra-op threads (None: torch's default)
    profile_path: str | None = None  # router cost profile (default: the cache dir)
    router: RouterConfig = dataclasses.field(default_factory=RouterConfig)  # SpecRouter's router
    plots: bool = True  # write PNGs (needs matplotlib)
    out_dir: str = "bench-out"
    quick: bool = False  # set by `quick_preset` (recorded in the output)
    suffix: bool = True  # the pool has the suffix drafter; SpecRouter also runs without it, side by side
    # also run target-only and SpecRouter with the prefix cache on ("target-only +cache",
    # "SpecRouter +cache"), side by side with every system without it
    prefix_cache: bool = True
    # sampling controls of every request (SamplingParams fields: presence_penalty, frequency_penalty,
    # repetition_penalty, min_p); with any, only the native systems run (transformers and llama.cpp
    # do not apply OpenAI's penalties the same way)
    controls: tuple[tuple[str, float], ...] = ()
    # where the "target-only" row decodes: "auto" times the target's 1-token step on every kernel
    # path this CPU runs and takes the fastest (bench/plain_path.py: the honest plain baseline;
    # target-only on SpecRouter's own path then stays as the greedy reference), "process" keeps
    # SpecRouter's path, a path name forces that path
    plain_path: str = "auto"

    def __post_init__(self) -> None:
        from specrouter.models.runners.kernels import PATHS

        if self.plain_path not in ("auto", "process", *PATHS):
            raise ValueError(f"plain_path must be 'auto', 'process' or one of {PATHS}, got {self.plain_path!r}")
        prompts_of(self.prompt_set)  # raises on an unknown prompt set
        if self.hf not in ("all", "greedy", "none"):
            raise ValueError(f"hf must be 'all', 'greedy' or 'none', got {self.hf!r}")
        streams = ("mixed", "templated", "multiturn", "structured")
        unknown = [w for w in self.workloads if w not in streams and w not in KINDS]
        if unknown or not self.workloads:
            raise ValueError(f"unknown workloads {unknown}; use some of {KINDS + streams}")
        if not self.ks or any(not 1 <= k <= MAX_DRAFT_LENGTH for k in self.ks):
            raise ValueError(f"ks must be draft lengths in 1..{MAX_DRAFT_LENGTH}, got {self.ks}")
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise ValueError(f"temperatures must be >= 0, got {self.temperatures}")
        if not 0 < self.slowdown_at < 1:
            raise ValueError(f"slowdown_at must be in (0, 1), got {self.slowdown_at}")
        if self.controls:
            from specrouter.config import SamplingParams

            SamplingParams(**dict(self.controls))  # checked before any model loads
            object.__setattr__(self, "hf", "none")
            object.__setattr__(self, "peers", False)

    @classmethod
    def quick_preset(cls, **overrides) -> "BenchConfig":
        """`--quick`: a smoke run meant for under 3 minutes on 2 quiet cores. The mixed stream
        only (one prompt per type, 32 new tokens), greedy and t=0.7, plus the slowdown run; one
        k (4) per static chain; transformers baselines in the greedy run only."""
        base = dict(workloads=("mixed",), prompts_per_type=1, mixed_block=1, max_new_tokens=32,
                    ks=(4,), hf="greedy", quick=True)
        base.update(overrides)
        return cls(**base)


def temperature_label(t: float) -> str:
    return "greedy" if t == 0 else f"t={t:g}"


def build_scenarios(cfg: BenchConfig) -> list[Scenario]:
    wls = build_workloads(cfg.workloads, cfg.prompts_per_type, cfg.mixed_block, cfg.repeat, cfg.kinds,
                          cfg.prompt_set)
    out = [Scenario(f"{wl.name} {temperature_label(t)}", wl, t, None,
                    cfg.hf == "all" or (cfg.hf == "greedy" and t == 0))
           for wl in wls for t in cfg.temperatures]
    if cfg.slowdown:
        mixed = build_workloads(("mixed",), cfg.prompts_per_type, cfg.mixed_block, cfg.repeat, cfg.kinds,
                                cfg.prompt_set)[0]
        start = min(max(1, round(len(mixed.requests) * cfg.slowdown_at)), len(mixed.requests) - 1)
        out.append(Scenario("mixed greedy + slowdown", mixed, 0.0, start, cfg.hf == "all"))
    return out


# ---------------------------------------------------------------------------------------------
# set-up


def model_aliases(pool) -> dict[str, str]:
    """Short names for tables: ngram, suffix, head (head1, ...), draft (draft1, draft2, ... by
    cost), target."""
    heads = [n for n in pool.order if n in pool.heads]
    drafts = pool.model_drafts
    out = {n: n for n in pool.drafters}
    out.update({n: "head" if len(heads) == 1 else f"head{i + 1}" for i, n in enumerate(heads)})
    out.update({n: "draft" if len(drafts) == 1 else f"draft{i + 1}" for i, n in enumerate(drafts)})
    out[pool.target] = "target"
    return out


def _resolve(pool, aliases: dict[str, str], name: str | None, default: str | None) -> str | None:
    if name is None:
        return default
    for full, short in aliases.items():
        if name in (full, short):
            return full
    raise ValueError(f"no model {name!r} in the pool {pool.order} (short names {list(aliases.values())})")


@dataclass
class Harness:
    """Everything loaded once for a whole bench run."""

    pool: object
    aliases: dict[str, str]
    systems: list[System]
    adaptive: AdaptiveSystem
    target_only: System  # plain decoding on the fastest path: every "x target-only" ratio's base
    hf_models: dict  # pool name -> transformers model
    assistant: str | None  # pool name of the assistant draft
    encoded: dict[Request, list[int]]
    peers_missing: list[str] = dataclasses.field(default_factory=list)  # peer rows left out, and why
    ablations: list[AdaptiveSystem] = dataclasses.field(default_factory=list)  # SpecRouter without
    # the suffix drafter, without the draft heads
    greedy_reference: System | None = None  # target-only on SpecRouter's kernel path, where
    # `target_only` runs on another (None: `target_only` is it)
    plain_path: object | None = None  # bench/plain_path.PlainPath: the paths probed

    @property
    def reference(self) -> System:
        """The system every exact system's greedy tokens must equal."""
        return self.greedy_reference or self.target_only


def setup(cfg: BenchConfig, *, progress: bool = True, log=print) -> Harness:
    from specrouter.api import SpecRouter
    from specrouter.models.pool import _dtype
    from specrouter.router.cost_model import enumerate_chains

    paths = list(cfg.models) if cfg.models else None
    if paths is None:
        from specrouter.models.default_pool import default_pool_paths

        paths = default_pool_paths(progress=progress)
    sr = SpecRouter.from_pretrained(paths, target=cfg.target, dtype=cfg.dtype, adaptive=False,
                                    suffix=cfg.suffix, progress=progress, device=cfg.device)
    pool = sr.pool
    aliases = model_aliases(pool)
    drafts = pool.model_drafts
    log(f"pool (cheapest first): {' < '.join(f'{aliases[n]} ({n})' for n in pool.order)}")

    from specrouter.router.setup import load_or_sweep_profile

    profile = load_or_sweep_profile(pool, path=cfg.profile_path, progress=progress)  # once per run
    max_nodes = profile.max_new_tokens(pool.target) - 1  # a tree's verification: as swept (tree_policy)
    systems: list[System] = []
    for chain in enumerate_chains(pool.order, pool.target, cfg.max_levels):
        if any(m in pool.drafters or m in pool.heads for m in chain[1:]):
            continue
        for k in (cfg.ks if len(chain) > 1 else (None,)):
            label = "target-only" if len(chain) == 1 else chain_label(chain, aliases, k)
            systems.append(NativeSystem(pool, label, chain, k))
            if len(chain) == 2 and chain[0] in pool.runners and pool.runners[pool.target].supports_trees:
                # beside each model-draft chain: its token tree of twice the nodes (docs/trees.md)
                nodes = min(2 * k, max_nodes)
                systems.append(NativeSystem(pool, f"{label} tree N={nodes} w=3", chain, k, tree=(nodes, 3)))
    target_only, greedy_reference, plain = systems[0], None, None
    if cfg.plain_path != "process":
        from specrouter.bench.plain_path import fastest_plain_path

        forced = None if cfg.plain_path == "auto" else cfg.plain_path
        plain = fastest_plain_path(pool, None if forced is None else [forced], force=forced, log=log)
        if plain is not None and plain.runner is not None:  # plain decoding is faster on another path
            greedy_reference = systems[0]
            greedy_reference.name = f"target-only {plain.process_path} (greedy reference)"
            target_only = NativeSystem(pool.target_only_view(plain.runner), "target-only", (pool.target,), None)
            target_only.exact = False  # other kernels, other bits: differences are recorded
            systems.insert(0, target_only)
    adaptive = AdaptiveSystem(pool, "SpecRouter", profile_path=cfg.profile_path, progress=progress,
                              profile=profile, router_config=cfg.router)
    systems.append(adaptive)
    ablations = []
    if cfg.router.similarity.measure_tv and pool.runners.keys() - {pool.target}:  # a pair to measure
        no_tv = dataclasses.replace(cfg.router, similarity=dataclasses.replace(cfg.router.similarity, measure_tv=False))
        ablations.append(AdaptiveSystem(pool, NO_TV, profile=profile, router_config=no_tv))
    if SUFFIX in pool.drafters:
        ablations.append(AdaptiveSystem(pool.without_drafters([SUFFIX]), NO_SUFFIX, profile=profile))
    if pool.model_drafts and pool.runners[pool.target].supports_trees:
        ablations.append(AdaptiveSystem(pool, NO_TREES, profile=profile, router_config=cfg.router, trees="off"))
    if pool.heads:
        ablations.append(AdaptiveSystem(pool.without_drafters(pool.heads), NO_HEAD, profile=profile))
    systems += ablations
    if cfg.prefix_cache:  # the same two systems with the prefix cache on
        systems.append(NativeSystem(pool, TARGET_CACHE, (pool.target,), None, prefix_cache=True))
        systems.append(AdaptiveSystem(pool, ADAPTIVE_CACHE, profile=profile, router_config=cfg.router,
                                      prefix_cache=True))

    hf_models: dict = {}
    assistant = _resolve(pool, aliases, cfg.hf_assistant, drafts[-1] if drafts else None)
    if assistant is not None and assistant not in pool.runners:
        raise ValueError(f"the assistant of assisted generation must be a neural draft, got {assistant!r}")
    if cfg.hf != "none":
        from specrouter.bench.systems import load_hf_model

        dt = _dtype(cfg.dtype, pool.device)
        hf_models[pool.target] = load_hf_model(pool.runners[pool.target].checkpoint_dir, dt).to(pool.device)
        eos = tuple(pool.eos_ids)
        pad = pool.tokenizer.pad_token_id if pool.tokenizer.pad_token_id is not None else eos[0]
        systems.append(HFSystem("HF generate", hf_models[pool.target], eos_ids=eos, pad_id=pad))
        if dt == torch.bfloat16:  # transformers' bfloat16 is slower than its float32 on AVX2 CPUs:
            # show its fastest exact precision too, so no ratio leans on a handicapped baseline
            from specrouter.bench.report import HF_FP32

            systems.append(HFSystem(HF_FP32, load_hf_model(pool.runners[pool.target].checkpoint_dir, torch.float32),
                                    eos_ids=eos, pad_id=pad))
        if assistant is not None:
            hf_models[assistant] = load_hf_model(pool.runners[assistant].checkpoint_dir, dt).to(pool.device)
            systems.append(HFSystem("HF assisted", hf_models[pool.target],
                                    assistant=hf_models[assistant], eos_ids=eos, pad_id=pad))
        else:
            log("no neural draft in the pool: transformers assisted generation is left out")

    encoded: dict[Request, list[int]] = {}
    longest = 0
    scenarios = build_scenarios(cfg)
    for sc in scenarios:
        for req in sc.workload.requests:
            if req not in encoded:
                encoded[req] = sr.encode(req.prompt, chat=req.chat)  # multi-turn: the first turn's form
            if req.conversation is None:
                longest = max(longest, len(encoded[req]))
            else:  # every message of the conversation so far (each with the template's overhead)
                sent = [r for r in sc.workload.requests
                        if r.conversation == req.conversation and r.turn <= req.turn]
                longest = max(longest, sum(len(encoded.get(r) or sr.encode(r.prompt, chat=True)) for r in sent)
                          + req.turn * (cfg.max_new_tokens + 8))
    # size every cache once for the longest request (the router may pick any k up to the max;
    # multi-turn: every earlier turn's message and reply, template included, bounded above)
    need = longest + cfg.max_new_tokens + MAX_DRAFT_LENGTH + 2
    slots = 1
    if cfg.prefix_cache:  # positions as the engine rounds them (no reallocation while timing), and
        # a slot per request each cached system may keep parked (nothing evicted for room)
        from specrouter.state.prefix_cache import MAX_PARKED_SLOTS

        ctx = min(getattr(r, "max_context", need) for r in pool.runners.values())
        need = max(need, min(max(256, 1 << (need - 1).bit_length()), ctx))
        distinct = max(len(set(sc.workload.requests)) for sc in scenarios)
        slots += min(MAX_PARKED_SLOTS, 2 * distinct)
    for r in [*pool.runners.values(), *([plain.runner] if plain is not None and plain.runner else [])]:
        r.reserve(max(r.num_slots, slots), max(r.max_len, need))
    peers_missing = ["every llama.cpp row: --no-peers"]
    if cfg.peers:
        from specrouter.bench.peers import peer_systems

        peers, peers_missing = peer_systems(pool, dtype=cfg.dtype, threads=cfg.threads or torch.get_num_threads(),
                                            n_ctx=need + 8, draft=drafts[-1] if drafts else None, log=log)
        systems += peers
    return Harness(pool, aliases, systems, adaptive, target_only, hf_models, assistant, encoded,
                   peers_missing, ablations, greedy_reference, plain)


def warm_up(h: Harness, ids: list[int], json_schema: str | None = None) -> None:
    """One short request per system (first forwards allocate); builds the adaptive system's
    router, which sweeps the cost profile the first time on this machine. With `json_schema`
    (a structured workload runs) the systems that decode with the grammar also run one short
    constrained request: the grammar's one-time set-up is not timed in whichever system runs
    the first structured request. (Every scenario resets the systems: nothing learned here is
    kept.)"""
    h.adaptive.reset()
    for s in h.systems:
        s.run(ids, Decoding(0.0, 8, 0))
        if json_schema is not None and not isinstance(s, HFSystem) and s.kind != "peer":
            s.run(ids, Decoding(0.0, 8, 0, (), json_schema))


# ---------------------------------------------------------------------------------------------
# the loop


def first_difference(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def check_greedy(sc: Scenario, i: int, req: Request, outs: dict[str, Outcome],
                 systems: list[System], reference: str) -> dict:
    """Raise GreedyMismatchError if an exact system's tokens differ from target-only's;
    return the differences of the other systems (name -> details)."""
    ref = outs[reference].token_ids
    other = {}
    for s in systems:
        got = outs[s.name].token_ids
        if got == ref:
            continue
        j = first_difference(ref, got)
        if s.exact:
            raise GreedyMismatchError(
                f"GREEDY OUTPUT MISMATCH: {s.name} differs from target-only greedy decoding in "
                f"scenario {sc.name!r}, request {i} ({req.kind}: {req.prompt[:50]!r}): first "
                f"difference at generated token {j} (target-only {ref[j:j + 6]}, {s.name} "
                f"{got[j:j + 6]}; lengths {len(ref)} vs {len(got)}). Speculative decoding must "
                f"reproduce the target's greedy output exactly: this is a bug."
            )
        other[s.name] = {"first_difference": j, "reference_tokens": len(ref), "tokens": len(got)}
    return other


def _runs_in(s: System, sc: Scenario) -> bool:
    """transformers baselines where the scenario asks for them; llama.cpp peers outside the
    scripted slowdown (it slows a pool model, not theirs); neither in the structured workload
    (they decode without the grammar)."""
    if sc.workload.name == "structured" and (isinstance(s, HFSystem) or s.kind == "peer"):
        return False
    if isinstance(s, HFSystem):
        return sc.hf
    return s.kind != "peer" or sc.slowdown_start is None


def _prefix_cache(h: Harness):
    """The pool's prefix cache (shared by every cached system), None when none runs one."""
    for s in h.systems:
        sr = getattr(s, "sr", None)
        if getattr(s, "prefix_cache", False) and sr is not None:
            return sr.engine.prefix_cache
    return None


def run_scenario(sc: Scenario, h: Harness, cfg: BenchConfig, slowdown: Slowdown | None, bar) -> dict:
    """Every system of the scenario on every request, interleaved; returns its summary."""
    from specrouter.models.tokenizer import apply_chat_template

    events: list[dict] = []
    histories: dict[tuple[str, int], list[dict]] = {}  # multi-turn: (system, conversation) -> messages
    cache = _prefix_cache(h)
    parked_max = 0
    current = [-1]
    aliases = h.aliases

    def on_decision(ev) -> None:
        events.append({"request": current[0], "step": int(ev.step), "chain": chain_label(ev.chain, aliases),
                       "k": int(ev.k), "reason": ev.reason, "t_eff": float(ev.t_eff)})

    h.adaptive.reset(on_decision)
    for s in h.systems:  # each scenario starts with nothing learned (suffix drafter)
        if s is not h.adaptive:
            s.reset()
    systems = [s for s in h.systems if _runs_in(s, sc)]
    pair = (h.adaptive, h.target_only) if h.adaptive in systems and h.target_only in systems else None
    requests = []
    for i, req in enumerate(sc.workload.requests):
        current[0] = i
        slowed = sc.slowdown_start is not None and i >= sc.slowdown_start
        if slowdown is not None:
            slowdown.active = slowed
        ids = h.encoded[req]
        decoding = Decoding(sc.temperature, cfg.max_new_tokens, cfg.seed + i, cfg.controls, req.json_schema)
        outs: dict[str, Outcome] = {}
        sent: dict[str, int] = {}
        for s in run_order(systems, i, pair):  # rotated; target-only next to SpecRouter
            if req.conversation is not None:  # re-send the conversation: this system's own replies
                key = (s.name, req.conversation)
                messages = conversation_messages(req, histories.get(key, []))
                ids = apply_chat_template(h.pool.tokenizer, messages)
            outs[s.name] = s.run(ids, decoding)
            sent[s.name] = len(ids)
            if req.conversation is not None:
                reply = h.pool.tokenizer.decode(outs[s.name].token_ids, skip_special_tokens=True)
                histories[key] = messages + [{"role": "assistant", "content": reply}]
            if cache is not None:
                parked_max = max(parked_max, cache.parked_bytes)
            if bar is not None:
                bar.set_postfix_str(f"{sc.name}: request {i + 1}/{len(sc.workload.requests)}, {s.name}")
                bar.update(1)
        if slowdown is not None:
            slowdown.active = False
        record = {"index": i, "kind": req.kind, "prompt": req.prompt[:60], "prompt_tokens": len(ids),
                  "prompt_tokens_sent": sent, "turn": req.turn, "slowed": slowed,
                  "first_token_seconds": {n: o.stats.first_token_time for n, o in outs.items()
                                          if o.stats is not None},
                  "cached_tokens": {n: o.stats.cached_tokens for n, o in outs.items() if o.stats is not None},
                  "tokens": {n: len(o.token_ids) for n, o in outs.items()},
                  "seconds": {n: o.seconds for n, o in outs.items()},
                  "stats": {n: o.stats for n, o in outs.items() if o.stats is not None}}
        if sc.temperature == 0:
            record["mismatches"] = check_greedy(sc, i, req, outs, systems, h.reference.name)
        if req.json_schema is not None:  # every output must follow its schema (finished ones)
            schema = json.loads(req.json_schema)
            record["schema_valid"] = {n: schema_valid(h.pool.tokenizer.decode(o.token_ids, skip_special_tokens=True), schema)
                                      for n, o in outs.items()}
        requests.append(record)
    out = summarize(sc, systems, requests, events, aliases=h.aliases,
                    reference=h.target_only.name, adaptive=h.adaptive.name)
    suffix = h.adaptive.sr.pool.drafters.get(SUFFIX) if h.adaptive.sr is not None else None
    if suffix is not None:  # memory and per-proposal cost of what SpecRouter learned
        mem = dataclasses.asdict(suffix.memory())
        mem["us_per_proposal"] = 1e6 * mem["propose_seconds"] / mem["proposals"] if mem["proposals"] else None
        out["suffix"] = mem
    if cache is not None:  # memory: parked KV never above the budget
        out["prefix_cache"] = {"parked_bytes_max": parked_max, "budget_bytes": cache.budget_bytes,
                               "slots": {h.aliases[n]: r.num_slots for n, r in h.pool.runners.items()},
                               "positions": {h.aliases[n]: r.max_len for n, r in h.pool.runners.items()},
                               **dataclasses.asdict(cache.stats)}
    if out["slowdown"] is not None and slowdown is not None:
        out["slowdown"].update(slowdown_shares(events, h.aliases[slowdown.model], sc.slowdown_start),
                               model=h.aliases[slowdown.model], factor=slowdown.factor)
    return out


def slowdown_shares(events: list[dict], model: str, start: int) -> dict:
    """Fraction of SpecRouter's planned cycles (probes excluded) whose chain uses `model`,
    before and after the slowdown starts."""
    def share(evs):
        return sum(model in e["chain"].split(">") for e in evs) / len(evs) if evs else None

    plan = [e for e in events if e["reason"] != "probe"]
    return {"specrouter_cycles_using_it_before": share([e for e in plan if e["request"] < start]),
            "specrouter_cycles_using_it_after": share([e for e in plan if e["request"] >= start])}


# ---------------------------------------------------------------------------------------------
# the whole run


def _meta(cfg: BenchConfig, h: Harness, scenarios: list[Scenario]) -> dict:
    import platform

    import transformers

    from specrouter.router.profile import machine_fingerprint

    pool = h.pool
    from specrouter.bench.provenance import provenance

    meta = {
        "provenance": provenance(),
        "machine": {**machine_fingerprint(), "python": platform.python_version(),
                    "transformers": transformers.__version__, "cores": _cores()},
        "config": dataclasses.asdict(cfg),
        "pool": {"order": [h.aliases[n] for n in pool.order], "names": {h.aliases[n]: n for n in pool.order},
                 "target": pool.target, "dtype": resolved_dtype(cfg.dtype)},
        "systems": [{"name": s.name, "kind": s.kind, "exact": s.exact,
                     "chain": chain_label(s.chain, h.aliases) if s.chain else None, "k": s.k}
                    for s in h.systems],
        "scenarios": [{"name": sc.name, "requests": len(sc.workload.requests), "hf": sc.hf,
                       "slowdown_start": sc.slowdown_start} for sc in scenarios],
        "timing": "tokens/s = generated tokens (stop token included) / wall seconds of the "
                  "generate calls, prefill included; batch 1, one request at a time",
        "k_selection": f"every static chain ran at every k in {list(cfg.ks)} on every request; "
                       "each chain is reported at its best k in hindsight, per scenario",
        "oracle": "per request, the fastest static (chain, k) measured on that request (target-only "
                  "included); tokens and seconds summed",
        "best_static": "the fastest static (chain, k) of the scenario, target-only included",
        "interleaving": "request by request, every system in turn, the order rotated by one per request; "
                        "target-only next to SpecRouter (after it on even requests, before it on odd ones)",
        "adaptive": "a fresh router per scenario (cold start from this machine's cost profile), "
                    "learning only from its own cycles",
    }
    if h.assistant is not None and h.assistant in h.hf_models:
        meta["hf_assisted"] = {"assistant": h.aliases[h.assistant],
                               "schedule": assisted_schedule(h.hf_models[h.assistant])}
    if cfg.slowdown:
        meta["slowdown"] = {"model": h.aliases[_slowdown_model(cfg, h)], "factor": cfg.slowdown_factor,
                            "from_fraction": cfg.slowdown_at}
    omitted = []
    if cfg.hf == "greedy":
        omitted.append("transformers baselines run in greedy scenarios without slowdown only")
    if cfg.hf == "none":
        omitted.append("no transformers baselines")
    if cfg.quick:
        omitted.append("quick: mixed stream only, one prompt per type, one k per static chain")
    meta["omitted"] = omitted
    if h.plain_path is not None:  # the 1-token step per kernel path, and where target-only ran
        meta["plain_path"] = h.plain_path.to_json()
    meta["peers_missing"] = list(h.peers_missing)
    meta["peers"] = {s.name: getattr(s, "gguf_path", None) for s in h.systems if s.kind == "peer"}
    meta["peer_notes"] = {s.name: s.note for s in h.systems if s.kind == "peer" and getattr(s, "note", None)}
    return meta


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


def _load_average() -> float | None:
    """The 1-minute load average: other processes on the cores distort every timing."""
    import os

    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def _slowdown_model(cfg: BenchConfig, h: Harness) -> str:
    pool = h.pool
    drafts = pool.model_drafts
    default = drafts[-1] if drafts else (next(iter(pool.drafters)) if pool.drafters else pool.target)
    return _resolve(pool, h.aliases, cfg.slowdown_model, default)


def run_bench(cfg: BenchConfig, *, progress: bool = True, log=print, harness: Harness | None = None) -> dict:
    """Run every scenario of `cfg`; returns the result (report.py writes it)."""
    t0 = time.perf_counter()
    load_start = _load_average()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError as e:
            raise SpecRouterError("the plots need matplotlib: pip install 'specrouter[bench]' "
                                  "(or pass --no-plots)") from e
    h = harness or setup(cfg, progress=progress, log=log)
    scenarios = build_scenarios(cfg)
    t_setup = time.perf_counter()
    schema = next((r.json_schema for sc in scenarios for r in sc.workload.requests if r.json_schema), None)
    warm_up(h, h.encoded[scenarios[0].workload.requests[0]], schema)
    t_warm = time.perf_counter()
    slowdown = None
    if any(sc.slowdown_start is not None for sc in scenarios):
        slowdown = Slowdown(_slowdown_model(cfg, h), cfg.slowdown_factor).install(h.pool, h.hf_models)
    total = sum(len(sc.workload.requests) * sum(1 for s in h.systems if _runs_in(s, sc)) for sc in scenarios)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc="bench", unit="run")
    try:
        results = [run_scenario(sc, h, cfg, slowdown, bar) for sc in scenarios]
    finally:
        if bar is not None:
            bar.close()
        if slowdown is not None:
            slowdown.remove()
    meta = _meta(cfg, h, scenarios)
    meta["machine"]["load_average"] = {"start": load_start, "end": _load_average()}
    meta["seconds"] = {"setup": t_setup - t0, "warm_up": t_warm - t_setup,
                       "total": time.perf_counter() - t0}
    return {"meta": meta, "scenarios": results}
