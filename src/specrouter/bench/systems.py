"""How each benchmarked system runs one request, and how it is timed.

Every system decodes one request at a time (batch 1: transformers assisted generation refuses
more), from the same prompt token ids, with the same decoding settings. Timed: the wall time of
the one generate call, prefill included (tokenization and decoding to text are not).
Tokens: the generated tokens, the stop token included.

Systems (`kind`):
- target-only: plain decoding with the native runner (chain `(target,)`); the reference;
- static: one pinned chain and draft length k through the same engine (no router); with `tree`
  (budget, width), its model draft's token tree of that shape instead of the chain (docs/trees.md);
- adaptive: SpecRouter, the router choosing chain and k per request every cycle; a fresh router
  per scenario (cold start from this machine's cost profile), fed only by its own cycles;
- target-only+cache, adaptive+cache: the same with the prefix cache on (state/prefix_cache.py:
  a request reuses the KV of the longest prefix an earlier request of the same system computed).
  Every other native system runs without it (the plain baseline, as before the cache existed);
  its engine never adopts another system's entries;
- hf-generate: transformers `generate()` of the target;
- hf-assisted: transformers assisted generation (`assistant_model=` a pool draft), with its
  default schedule (read from the assistant's generation config; recorded in bench.json).
`exact` systems must reproduce target-only greedy token for token (the bench fails otherwise);
the transformers baselines are only compared and reported.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specrouter.api import SpecRouter
from specrouter.config import EngineConfig, RouterConfig, SpecRouterConfig
from specrouter.records.stats import RequestStats


@dataclass(frozen=True)
class Decoding:
    """Decoding settings of one request (the same for every system)."""

    temperature: float  # 0: greedy
    max_new_tokens: int  # cap on generated tokens
    seed: int  # sampling seed (the request's; systems consume randomness differently)
    controls: tuple[tuple[str, float], ...] = ()  # SamplingParams controls (penalties, min_p): native systems only
    json_schema: str | None = None  # the output's JSON schema (structured workload): native systems only


@dataclass
class Outcome:
    """One system on one request."""

    token_ids: list[int]  # generated ids, prompt excluded, stop token included
    seconds: float  # wall time of the generate call
    stats: RequestStats | None = None  # native systems: chains, acceptance per level


class System:
    """A benchmarked system: a name for tables and `run(prompt_ids, decoding) -> Outcome`;
    `reset()` forgets what it learned (per scenario)."""

    name: str  # label in tables and plots
    kind: str  # target-only | static | adaptive | hf-generate | hf-assisted
    chain: tuple[str, ...] | None = None  # pool names, drafter first (static / target-only)
    k: int | None = None  # draft length of a static chain
    exact: bool = True  # greedy output must equal target-only's (else the bench fails)

    def run(self, prompt_ids: list[int], decoding: Decoding) -> Outcome:
        raise NotImplementedError

    def reset(self) -> None:
        pass


def _config(prefix_cache: bool, trees: bool | str = "greedy") -> SpecRouterConfig:
    return SpecRouterConfig(engine=EngineConfig(prefix_cache=prefix_cache, trees=trees))


def _forget(sr: SpecRouter | None) -> None:
    """Free the parked entries of a system's engine about to be replaced (a new scenario)."""
    if sr is not None and sr.engine.prefix_cache is not None:
        sr.engine.prefix_cache.forget(sr.engine.cache_scope)


class NativeSystem(System):
    """Target-only or a static chain at a fixed k, through the engine without a router. Its
    learning drafters (suffix) are its own: it learns only from the requests it served.
    `prefix_cache`: off unless asked (kind "target-only+cache" for target-only with it)."""

    def __init__(self, pool, name: str, chain: tuple[str, ...], k: int | None, *,
                 prefix_cache: bool = False, tree: tuple[int, int] | None = None):
        self.pool, self.name, self.chain, self.k = pool, name, tuple(chain), k
        self.prefix_cache = prefix_cache
        self.tree = tree  # (node budget, width) of a fixed token-tree shape; None: the chain
        self.kind = "target-only" if len(self.chain) == 1 else "static"
        if prefix_cache:
            self.kind += "+cache"
        self.reset()

    def reset(self) -> None:
        _forget(getattr(self, "sr", None))
        self.sr = SpecRouter(self.pool.with_fresh_drafters(), config=_config(self.prefix_cache))
        if self.tree is not None:
            from specrouter.engine.tree_policy import FixedTreeShape

            self.sr.engine.tree_policy = FixedTreeShape(*self.tree)

    def run(self, prompt_ids: list[int], decoding: Decoding) -> Outcome:
        t0 = time.perf_counter()
        res = self.sr.generate(prompt_ids, max_new_tokens=decoding.max_new_tokens,
                               temperature=decoding.temperature, seed=decoding.seed,
                               chain=self.chain, k=self.k or 4, json_schema=decoding.json_schema,
                               **dict(decoding.controls))[0]
        return Outcome(res.token_ids, time.perf_counter() - t0, res.stats)


class AdaptiveSystem(System):
    """SpecRouter adaptive. `reset(on_decision)` gives it a fresh router and fresh learning
    drafters (call it per scenario); `on_decision` receives every `DecisionEvent`."""

    def __init__(self, pool, name: str = "SpecRouter", *, profile_path: str | Path | None = None,
                 progress: bool = True, profile=None, router_config: RouterConfig | None = None,
                 prefix_cache: bool = False, trees: bool | str = "greedy"):
        self.pool, self.name = pool, name
        self.trees = trees  # which rows the router may give token trees (EngineConfig.trees)
        self.prefix_cache = prefix_cache
        self.kind = "adaptive+cache" if prefix_cache else "adaptive"
        self.profile_path, self.progress = profile_path, progress
        self.profile = profile  # the cost profile every reset starts from (None: loaded at the first)
        self.router_config = router_config or RouterConfig()
        self.sr: SpecRouter | None = None

    def reset(self, on_decision=None) -> None:
        import copy

        from specrouter.router.policy import Router
        from specrouter.router.setup import load_or_sweep_profile

        if self.profile is None:  # loaded (or swept) once: not again per scenario on busy cores
            self.profile = load_or_sweep_profile(self.pool, path=self.profile_path, progress=self.progress)
        pool = self.pool.with_fresh_drafters()
        router = Router.from_pool(pool, copy.deepcopy(self.profile), on_decision=on_decision,
                                  config=self.router_config)
        _forget(self.sr)
        self.sr = SpecRouter(pool, router, _config(self.prefix_cache, self.trees))

    def run(self, prompt_ids: list[int], decoding: Decoding) -> Outcome:
        if self.sr is None:
            self.reset()
        t0 = time.perf_counter()
        res = self.sr.generate(prompt_ids, max_new_tokens=decoding.max_new_tokens,
                               temperature=decoding.temperature, seed=decoding.seed,
                               json_schema=decoding.json_schema, **dict(decoding.controls))[0]
        return Outcome(res.token_ids, time.perf_counter() - t0, res.stats)


class HFSystem(System):
    """transformers `generate()` of the target, or assisted generation with `assistant`.
    Sampling: `do_sample` with the same temperature and no top-k / top-p filter."""

    exact = False

    def __init__(self, name: str, model, *, assistant=None, eos_ids: tuple[int, ...],
                 pad_id: int):
        self.name, self.model, self.assistant = name, model, assistant
        self.kind = "hf-assisted" if assistant is not None else "hf-generate"
        self.eos_ids, self.pad_id = list(eos_ids), pad_id

    def run(self, prompt_ids: list[int], decoding: Decoding) -> Outcome:
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.model.device)
        kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=decoding.max_new_tokens,
                  eos_token_id=self.eos_ids, pad_token_id=self.pad_id)
        if decoding.temperature > 0:
            kw.update(do_sample=True, temperature=decoding.temperature, top_k=0, top_p=1.0)
            torch.manual_seed(decoding.seed)
        else:
            kw.update(do_sample=False)
        if self.assistant is not None:
            kw["assistant_model"] = self.assistant
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, **kw)
        seconds = time.perf_counter() - t0
        return Outcome(out[0, ids.shape[1]:].tolist(), seconds)


def assisted_schedule(assistant) -> dict:
    """The assistant's default speculation schedule (what `generate` reads): its generation
    config, and transformers' global defaults for what it leaves unset."""
    cfg = assistant.generation_config
    defaults_of = getattr(cfg, "_get_default_generation_params", None)
    defaults = defaults_of() if callable(defaults_of) else {}
    fields = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    return {f: getattr(cfg, f, None) if getattr(cfg, f, None) is not None else defaults.get(f)
            for f in fields}


def load_hf_model(checkpoint_dir: str | Path, dtype: torch.dtype):
    """A transformers model of a pool checkpoint, in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint_dir), dtype=dtype)
    return model.eval()
