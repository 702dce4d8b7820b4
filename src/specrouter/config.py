"""Configuration dataclasses shared by the Python API, the CLI and the server: per-request
`SamplingParams`; the pool's `PoolConfig`, the engine's `EngineConfig`, the router's
`RouterConfig` (with its acceptance estimator's `SimilarityConfig` and its cost profile's
`ProfileConfig`), the server's `ServerConfig`; and `SpecRouterConfig`, which composes pool,
engine, router and server and from which `SpecRouter.from_config`, `specrouter serve` and every
CLI command are built."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field

from specrouter.errors import ChainError, GrammarError, SamplingParamsError

MAX_DRAFT_LENGTH = 16  # k is searched in 1..MAX_DRAFT_LENGTH by the router
MAX_LOGPROBS = 20  # most alternatives per token (SamplingParams.logprobs; OpenAI's top_logprobs limit)
SUFFIX_SCOPES = ("shared", "api-key")  # ServerConfig.suffix_scope
DEFAULT_POOL = "default"  # the name of the embedded pool (models/default_pool.py)
DEFAULT_HEAD = "default-head"  # the draft head shipped for the default target (opt-in pool entry)
NGRAM = "ngram"  # the model-free n-gram / prompt-lookup drafter's pool name
SUFFIX = "suffix"  # the model-free suffix-decoding drafter (learns across requests)
# role aliases, accepted wherever a pool model name is (chains, the API, the server's "model"):
# "target" is the pool's target, "draft" its smallest neural draft
ROLE_ALIASES = ("target", "draft")
BACKENDS = ("auto", "native", "hf")
DEVICE_PATTERN = r"^(auto|cpu|cuda(:\d+)?)$"  # PoolConfig.device (models/device.py resolves it)
DTYPES = ("auto", "float32", "bfloat16", "float64", "float16", "fp32", "bf16", "fp64", "fp16")
# A temperature below this is greedy decoding (stored as 0.0). Dividing logits by a tiny
# temperature overflows (1e-39 turns them into inf and the softmax into NaN), and a sampled
# distribution that sharp is the argmax anyway; vLLM uses the same threshold (_SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-5
_INT64 = 2**63  # top_k and token ids become int64 tensors


GRAMMAR_KINDS = ("json_schema", "json_object", "lark", "regex")  # GrammarSpec.kind


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to (decoding/grammar.py applies it). `source`: the
    JSON schema (its JSON text, properties in their order) for "json_schema", "" for
    "json_object" (any JSON object), the grammar text for "lark" (llguidance's Lark dialect)
    and "regex"."""

    kind: str
    source: str = ""

    @classmethod
    def json_schema(cls, schema: dict | str | bool) -> "GrammarSpec":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if schema is True or schema == {}:
            return cls("json_object")
        if not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema, separators=(",", ":")))

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"grammar kind must be one of {GRAMMAR_KINDS}, got {self.kind!r}")
        if not isinstance(self.source, str):
            raise GrammarError(f"grammar source must be a string, got {type(self.source).__name__}")
        if self.kind in ("lark", "regex") and not self.source.strip():
            raise GrammarError(f"the {self.kind} grammar is empty")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters, validated on construction.

    temperature == 0 means greedy decoding (the output is the target's argmax, token for token);
    a temperature below `GREEDY_TEMPERATURE` (1e-5) is greedy too: it is stored as 0.0, so
    `SamplingParams(temperature=1e-300).temperature == 0.0`. top_k == 0 and top_p == 1.0
    disable those filters (a top_k at or over the vocabulary size keeps every token; the engine
    refuses one over the vocabulary size). The same processed distribution is used
    at every level of a chain, which is what makes speculative sampling lossless.
    """

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1.0 = no nucleus filter
    max_new_tokens: int = 64  # generated tokens per request, stop tokens included
    stop_token_ids: tuple[int, ...] = ()  # generation ends after any of these (EOS is added by the pool)
    seed: int | None = None  # the sampling seed: the noise at position i is a function of (seed, i), so the same request and seed give the same output whatever chains run it
    ignore_eos: bool = False  # keep generating past EOS (benchmarks)
    # logits processors (decoding/processors.py), applied identically at every level of a chain
    min_p: float = 0.0  # drop tokens whose probability is below min_p * the top probability (after temperature)
    presence_penalty: float = 0.0  # subtracted from the logit of every token generated so far (OpenAI)
    frequency_penalty: float = 0.0  # subtracted once per occurrence among the generated tokens (OpenAI)
    repetition_penalty: float = 1.0  # logits of tokens in the prompt or generated: / it if > 0, * it if < 0 (CTRL, vLLM)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs added to the logits
    min_tokens: int = 0  # EOS and stop tokens are masked until this many tokens were generated
    allowed_token_ids: tuple[int, ...] | None = None  # sample only among these (None: all)
    grammar: GrammarSpec | None = None  # constrain the output to a JSON schema / grammar (decoding/grammar.py)
    # log-probabilities (decoding/logprobs.py): None = not asked; n >= 0 = each committed token's
    # logprob under the distribution it was sampled from, with the n most likely alternatives
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (the target's raw distribution)

    @property
    def has_processors(self) -> bool:
        """Some history-dependent or token-level processor is on (min_p is not one: it is
        part of the temperature / top-k / top-p stage, sampling.py)."""
        return self.has_processors_besides_grammar or self.grammar is not None

    @property
    def has_processors_besides_grammar(self) -> bool:
        """A processor other than the grammar is on (penalties, logit_bias, min_tokens,
        allowed_token_ids): a grammar row's masks are then applied eagerly (decoding/lazy_mask.py)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.allowed_token_ids is not None)

    def __post_init__(self) -> None:
        def bad(msg: str) -> SamplingParamsError:
            return SamplingParamsError(f"invalid sampling parameters: {msg}")

        def number(name: str, lo: float, hi: float, lo_open: bool = False) -> None:
            v = getattr(self, name)
            if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                    or v < lo or v > hi or (lo_open and v == lo)):
                raise bad(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {v!r}")

        number("min_p", 0.0, 1.0)
        number("presence_penalty", -2.0, 2.0)
        number("frequency_penalty", -2.0, 2.0)
        number("repetition_penalty", 0.0, 2.0, lo_open=True)
        bias = tuple((int(t), float(b)) for t, b in dict(self.logit_bias).items()) \
            if not isinstance(self.logit_bias, tuple) else self.logit_bias
        for pair in bias:
            if (not isinstance(pair, tuple) or len(pair) != 2 or isinstance(pair[0], bool)
                    or not isinstance(pair[0], int) or not 0 <= pair[0] < _INT64
                    or not isinstance(pair[1], (int, float)) or not -100.0 <= pair[1] <= 100.0):
                raise bad(f"logit_bias must be (token id >= 0, bias in [-100, 100]) pairs, got {pair!r}")
        object.__setattr__(self, "logit_bias", bias)
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise bad(f"grammar must be a GrammarSpec, got {type(self.grammar).__name__}")
        m = self.min_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise bad(f"min_tokens must be an integer >= 0, got {m!r}")
        if m > self.max_new_tokens:
            raise bad(f"min_tokens ({m}) must be at most max_new_tokens ({self.max_new_tokens})")
        if self.allowed_token_ids is not None:
            ids = tuple(self.allowed_token_ids)
            if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < _INT64 for t in ids):
                raise bad(f"allowed_token_ids must be a non-empty list of token ids, got {self.allowed_token_ids!r}")
            object.__setattr__(self, "allowed_token_ids", ids)

        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_LOGPROBS):
                raise bad(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {n!r}")

        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise bad(f"temperature must be a finite number >= 0, got {t!r}")
        if t < GREEDY_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)  # greedy (see GREEDY_TEMPERATURE)
        if (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                or not 0 <= self.top_k < _INT64):
            raise bad(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise bad(f"top_p must be in (0, 1], got {p!r}")
        m = self.max_new_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise bad(f"max_new_tokens must be an integer >= 1, got {m!r}")
        for tok in self.stop_token_ids:
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < _INT64:
                raise bad(f"stop_token_ids must be non-negative integers, got {tok!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -_INT64 <= self.seed < 2 * _INT64):
            raise bad(f"seed must be an integer in [-2**63, 2**64) or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class SimilarityConfig:
    """How the router's acceptance estimator weighs evidence (router/similarity.py)."""

    measure_tv: bool = True  # the executor measures D_TV at verified positions (False: acceptance counts only)
    # ... at a row's first this many candidates of each level (a softmax over the vocabulary per
    # position and level: all 8 cost 2% of the step on the default pool, measured)
    tv_positions: int = 2
    # ... in which steps (router/evidence.py `TvSchedule`): a step with a row in its first
    # `tv_first_cycles` cycles (its own SimScore is its prior from its first cycle), and every
    # `tv_every`-th step with a row it measures besides (the calibration, drift and the global
    # SimScores). Measured in every step, D_TV cost a sampled single stream 0.5-0.6 ms of a
    # ~12 ms cycle on a Sapphire Rapids (2026-12-06, docs/router.md); natively (kernels/tv.cpp)
    # ~0.1 ms, and every step was still no faster than this schedule (tv19); 1: every step
    tv_every: int = 8
    tv_first_cycles: int = 4
    # Only sampled rows' D_TV feeds the estimator: a greedy row accepts on an argmax match,
    # which the temperature-1 D_TV only proxies, and feeding it cost greedy SpecRouter 10-20% on
    # the mixed stream (was `greedy_tv`; removed by prune22, issue 27). Only measured trials
    # teach the calibration (was `calibrate_stand_in`: the pair's global SimScore as a skipped
    # trial's stand-in; removed by prune22, docs/router.md)
    tv_alpha: float = 0.1  # EMA weight of one observation's mean D_TV (after the first few)
    # the observed acceptance is shifted by f(SimScore now) - f(SimScore of its trials)
    # (SimilarityEstimator.drifted; turning it off was `drift=False`: removed by prune23, issue 27)
    drift_decay: float = 0.95  # per trial: "SimScore now" forgets (~20 trials; the counts: ~500)
    min_tv_positions: int = 8  # positions measured before a pair's SimScore is used
    decay: float = 0.998  # per trial: the global acceptance counts forget (window ~500 trials)
    prior_strength: float = 4.0  # pseudo-trials of the fallback while evidence is thin
    min_evidence: float = 64.0  # trials from which the observed acceptance is used alone
    stale_after: int = 200  # row-cycles without a measurement before a pair needs a probe
    calib_strength: float = 50.0  # pseudo-trials of the calibration prior (ridge)
    calib_decay: float = 0.999  # per trial: the calibration data forget
    # calibration priors, alpha = intercept + slope * SimScore: the identity for sampling (its
    # acceptance is exactly 1 - D_TV); greedy accepts less than 1 - D_TV at temperature 1 says
    sampling_calibration: tuple[float, float] = (0.0, 1.0)
    greedy_calibration: tuple[float, float] = (-0.25, 1.25)
    calibration_center: float = 0.75  # SimScores are centered here for the ridge fit (a typical value)
    calibration_spread: float = 0.1  # typical spread of SimScores around it (scales the slope's prior)
    # cold-start alpha of a model drafter: size_prior_base + size_prior_slope * log10(size ratio),
    # clipped to size_prior_range; unknown_size_prior when a parameter count is unknown
    size_prior_base: float = 0.75
    size_prior_slope: float = 0.1
    size_prior_range: tuple[float, float] = (0.3, 0.85)
    unknown_size_prior: float = 0.5
    model_free_prior: float = 0.2  # acceptance prior of a model-free drafter (given a hit)
    hit_prior: float = 0.3  # prior probability that a model-free drafter proposes anything
    hit_decay: float = 0.98  # per proposal: the global hit counts forget

    def __post_init__(self) -> None:
        for name in ("decay", "calib_decay", "hit_decay", "drift_decay"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)!r}")
        if self.tv_positions < 1:
            raise ValueError(f"tv_positions must be >= 1, got {self.tv_positions!r}")
        if self.tv_every < 1 or self.tv_first_cycles < 0:
            raise ValueError(f"tv_every must be >= 1 and tv_first_cycles >= 0, got {self.tv_every!r}, "
                             f"{self.tv_first_cycles!r}")
        if not 0.0 < self.tv_alpha <= 1.0:
            raise ValueError(f"tv_alpha must be in (0, 1], got {self.tv_alpha!r}")
        if self.prior_strength < 0 or self.min_evidence < 0 or self.calib_strength < 0 or self.stale_after < 1:
            raise ValueError("prior_strength, min_evidence, calib_strength must be >= 0, stale_after >= 1")
        lo, hi = self.size_prior_range
        if not 0.0 <= lo <= hi <= 1.0:
            raise ValueError(f"size_prior_range must be 0 <= low <= high <= 1, got {self.size_prior_range!r}")
        for name in ("model_free_prior", "hit_prior", "unknown_size_prior"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")


@dataclass(frozen=True)
class ProfileConfig:
    """How fast the cost profile follows observed timings (router/profile.py)."""

    ema_alpha: float = 0.3  # weight of one observation in log(speed) (fast EMA)
    shape_alpha: float = 0.05  # weight of one residual in the grid cells it touches (slow)
    jump_ratio: float = 1.5  # an observation off by more than this factor (either way) ...
    jump_after: int = 2  # ... this many times in a row, same direction, resets speed at once
    # a model's usual speed: a slow EMA of its observations' log speed levels, each clipped to
    # jump_ratio around it (a stall moves it by 2% at most, a lasting slowdown enters it over
    # some tens of observations): what the prober expects of a model read slow and not run
    # since (router/probing.py)
    usual_alpha: float = 0.05
    # A swept or loaded grid is installed as timed (making it monotone on every axis,
    # `ProfileConfig.monotone`, ran greedy streams 2-5% slower in 8 of 10 side-by-side runs on a
    # Sapphire Rapids, docs/router.md 2026-12-06; removed by prune22, issue 27)

    def __post_init__(self) -> None:
        if not (0 < self.ema_alpha <= 1 and 0 <= self.shape_alpha <= 1):
            raise ValueError("ema_alpha must be in (0, 1] and shape_alpha in [0, 1]")
        if not 0 <= self.usual_alpha <= 1:
            raise ValueError("usual_alpha must be in [0, 1]")
        if self.jump_ratio <= 1 or self.jump_after < 1:
            raise ValueError("jump_ratio must be > 1 and jump_after >= 1")


@dataclass(frozen=True)
class RouterConfig:
    """Router settings (one object for the CLI, the server and the API): every constant of the
    policy (router/policy.py), its request memory (router/request_state.py), its acceptance
    estimator (`similarity`) and its cost profile's online refresh (`profile`)."""

    k_max: int = MAX_DRAFT_LENGTH  # draft lengths searched: 1..k_max
    max_levels: int = 4  # deepest chain considered
    switch_margin: float = 0.05  # switch at once when the best plan is predicted > 5% faster
    patience: int = 16  # ... or when it was predicted slower by > persist_margin this many decisions in a row
    persist_margin: float = 0.01  # the smallest gap that counts toward patience
    request_decay: float = 0.995  # per trial: a request's own acceptance counts forget (~200 trials)
    # ... and a model pair's (its D_TV too) by this per cycle of the request without a trial of
    # it (plain decoding, another chain): a draft's agreement comes in runs of some tokens
    # (prose: runs of ~15 agreeing tokens between runs of none), so what its first cycles showed
    # is not what the request's later ones will, and the request's estimate returns toward its
    # prior instead of keeping it plain to its end (router/policy.py `fade_idle`); 1.0: never
    request_idle_decay: float = 0.95
    # a single stream decoding without its model draft (plain, a model-free chain) catches the
    # draft up once it lags by this many generated tokens, and each of those positions is an
    # acceptance trial of (draft, target) for the request and the pair: the draft's token there
    # against the committed one (router/catch_up.py; ~1% of the plain steps it covers); 0: off
    catch_up_every: int = 8
    request_prior_strength: float = 8.0  # pseudo-trials of the global alpha in a request's estimate
    request_hit_prior_strength: float = 2.0  # pseudo-proposals of the global hit rate in a request's (one per cycle, not ~k trials)
    # a new request's prior for a model pair: the global alpha, or if higher this quantile of
    # the alphas finished requests reached on their own (request types differ: code and prose
    # accept a draft at different rates; the global mean is the prior of neither). Its None
    # option (the global alpha always; no faster: docs/router.md) was removed by prune24, issue 27
    request_prior_quantile: float = 0.75
    request_history: int = 32  # finished requests remembered per pair and mode for that quantile
    request_min_trials: float = 4.0  # trials a finished request needs on a pair for its alpha to count
    request_min_finished: int = 3  # finished requests before their quantile is used
    request_hit_decay: float = 0.95  # per proposal: a request's own model-free hit counts forget (~20)
    # a request's own D_TV (decayed like its counts) makes its prior for a pair f(its SimScore),
    # worth this many pseudo-trials per measured position, up to request_tv_cap pseudo-trials
    request_tv_weight: float = 4.0  # (a measured position gives a probability, a trial one 0/1 outcome)
    request_tv_cap: float = 32.0
    # decisions read a request's alphas and hit rates less this many standard errors of its own
    # estimate (sqrt(p (1 - p) / n), n its own decayed trials plus the prior's pseudo-trials),
    # per mode (router/evidence.py `decision_margin`): a plan chosen where its estimate is high
    # by chance delivers less (the winner's curse), and a new request's prior is the least
    # certain of all; probes keep their optimistic estimates. 0: the estimates as they are.
    # Sampling 0.5 (floor19, SPR, t=0.7, 24 side-by-side lines: +0.4% mean, 16 higher; prose 5 of
    # 5, code 4 of 4, chat 2 of 7: docs/router.md); greedy 0 (1.0 cost the greedy lines 4-8%: the
    # suffix / n-gram wins on code and the mixed stream start from thin evidence)
    decision_margin_sampling: float = 0.5
    decision_margin_greedy: float = 0.0
    shadow_k: int = MAX_DRAFT_LENGTH  # tokens asked of model-free drafters when shadow-scoring rows not running them
    probe_k: int = 8  # longest draft of a probe cycle
    # (a pair is probed with a chain it starts, router/probing.py; the optimistic best of every
    # chain measuring it, e.g. behind an n-gram whose misses teach nothing, was
    # `probe_first_pair=False`: removed by prune23, issue 27)
    probe_optimism: float = 1.5  # z of the Wilson upper bound that makes a stale pair worth a probe
    probe_recheck: int = 8  # row-cycles before looking again when no pair was worth a probe
    probe_max_wait: float = 4.0  # longest back-off between fruitless probes of a pair, in stale_after periods
    # a probe whose trials accepted no more than the request's estimate of its pair (the optimism
    # that chose it refuted) keeps that pair from the request's probes for this many of its
    # cycles, doubling with each further refutation (router/probing.py); 0: no such back-off
    probe_refute_wait: int = 32
    # (keeping it from every request's probes too was `probe_refute_global`: off, removed by
    # prune22, issue 27)
    # (a single stream's probe of a model draft that lags runs as decided, router/batch.py
    # `BatchPlanner.alone`; the catch-up check's veto of every such probe was
    # `probe_past_catch_up=False`: removed by prune23, issue 27)
    # a model read this much slower than its usual speed (CostProfile.usual), not timed for
    # probe_slow_after row-cycles, is re-probed at its usual speed (router/probing.py): a draft
    # read 13.7x slow in one stalled cycle (a co-tenant) was priced out of every plan and never
    # timed again; its re-probe waited for the pair evidence's stale_after (200 row-cycles)
    probe_slow_speed: float = 1.1
    probe_slow_after: int = 16
    probe_fraction: float = 0.05  # at most this fraction of row-cycles are probes
    probe_time_fraction: float | None = 0.02  # and their cost at most this fraction of wall time
    # (a probe observed alone is charged its realised extra seconds over the plan,
    # router/probing.py `Prober.settle`; charging it as predicted, before issue 31's fix, was
    # `probe_charge_realized=False`: removed by prune23, issue 27)
    overhead_alpha: float = 0.1  # EMA weight of one cycle's overhead (wall - forwards) and decide() time
    # (a model draft's host seconds per step, its steps' wall outside forwards, are charged k - 1
    # per draft of k: issue 33; folding them into the cycle's overhead whatever k, the switch
    # `draft_step_overhead=False`, was removed by prune24, issue 27)
    # Every plan pays decide()'s own seconds per cycle, not an engine step's measured host
    # seconds outside the executor (charging those to every plan, `charge_outside`, was 2-5%
    # slower greedy on the mixed stream; removed by prune22, issue 27; docs/router.md)...
    # ... but charge those where plain decoding is weighed against speculation, and only there
    # (router/host_time.py `PlainCharge`): the best speculative plan (as decide() prices it)
    # must beat plain decoding with each kind's measured outside seconds per cycle (always on
    # since lead23; its off switch `charge_leaving_plain=False`, the table alone, removed: issue 27)
    # (plain decoding's outside seconds are measured on held plain steps only, router/host_time.py
    # `OutsideClock`; every plain step's was `outside_plain_held=False`: removed in session 23, issue 27)
    # ... and a speculative cycle's where it leaves plain decoding (`PlainCharge`), on its held
    # steps only (a firm stream hold's; every speculative step's until one is measured), as plain
    # decoding's are (floor21): a stream that rarely speculates runs mostly decided speculative
    # steps (probes, a request's first), so the EMA over every one read 0.76 ms against 0.45 ms
    # a held step (AMD EPYC, chat t=0.7) and priced leaving plain ~0.3 ms a cycle too high.
    # On since floor21 with the plain stream's lease ("lease-held": t=0.7 chat / prose, with and without
    # penalties, 15 of 16 side-by-side ratios >= 1.0, geometric mean 1.040; mixed +3.1 / +4.2%;
    # docs/router.md). Always so since lead23 (`outside_spec_held=False`, every speculative
    # step's mean, removed: issue 27)
    context_bucket: int = 32  # cost rows are cached per (b, L // context_bucket)
    prune_below: float = 0.02  # chains with an alpha (or a model-free hit rate) below this are not evaluated
    alpha_decimals: int = 4  # alphas are rounded to this many decimals (repeat decisions hit the plan cache)
    log_size: int = 10_000  # decision events kept
    # the decision cache (router/evidence.py): a row's decision is reused while its inputs are
    # unchanged; the evidence it reads is republished only when it moves materially (always on:
    # `decision_cache=False` removed by decide24, issue 27; tests/test_decision_cache.py builds
    # its uncached reference itself)
    decision_tolerance: float = 0.05  # an alpha (global or a request's) that moved more republishes
    decision_hit_tolerance: float = 0.1  # a model-free hit rate that moved more (they are noisier: ~20-proposal windows)
    decision_time_tolerance: float = 0.05  # a model's speed (relative), a per-cycle overhead (fraction of the target's step)
    decision_refresh: int = 128  # republish at least every this many observed steps (slow profile refinements)
    # plain hold (router/batch.py): after the batch planner found plain decoding best for a
    # multi-row batch, the same number of rows stays plain without re-planning for 2, 4, ...
    # up to this many steps (0: re-plan every step); a row leaving ends the hold
    plain_hold_max: int = 16
    # speculative hold (router/batch.py): a multi-row batch's speculative plans are kept for the
    # same rows this many steps (1: re-planned every step); planning a 2-4 row batch afresh
    # (every row decided, the joint alternatives weighed) costs ~1-1.5 ms of a ~13 ms step.
    # 4 since load26 (2 before: at c=2 on a Zen 5 a 2-row speculative step paid 0.40 ms of
    # planning and 0.11 of shadow proposals of its 0.8 ms outside the executor, ~10% of an 8 ms
    # step, and the batch calibration, which counts a step's planning, read such steps 5% slower:
    # docs/router.md "load26")
    spec_hold_steps: int = 4
    # a single stream's speculative hold (router/stream_hold.py): a speculative plan decide()
    # kept ("same" or "hysteresis") runs this many steps without decide() unless its evidence,
    # its models' speeds or a due probe release it first (1: decided every step); deciding cost
    # 1.5-2.6 ms of a ~20-35 ms speculative step on a Zen 1 (avx2). 8 since lean20 (with the
    # firm hold and deferred observations: "lazy8", docs/router.md); 4 before
    stream_hold_steps: int = 8
    # ... and a plain plan decide() kept by hysteresis (speculation predicted faster by less than
    # switch_margin) is held alike (a settled plain plan, kept as the best, is the batch
    # planner's plain hold). A speculative hold is firm (lean18, on since lean20: router share
    # of a single-stream speculative step 0.95 -> 0.64 ms at t=0.7, +1.9% tokens/s over 40
    # side-by-side ratios, SPR; docs/router.md): it starts after every decided speculative plan
    # but a probe, lasts its span whatever the request's own evidence does but its first pair
    # falling past the tolerance or its plan's break-even with plain decoding, and its steps'
    # observations are folded when next read (router/deferred.py, lean19). The "as before"
    # paths were `stream_hold_plain`, `stream_hold_firm`, `stream_hold_break_even` and
    # `defer_observations` (on; removed by prune23, issue 27), and a firm hold's span doubling
    # `stream_hold_max` (removed by prune22)
    # (a settled plain single stream's hold runs on an engine lease, as a multi-row batch's,
    # router/batch.py `BatchPlanner.plan`, floor21: a held plain step's host seconds 0.31 ->
    # 0.22 ms; every held step planned, shadows every 4th, was `plain_lease=False`: removed by
    # prune23, issue 27)
    # (model-free drafters' forwards reaching the cost profile `free_timing_batch` at a time,
    # seconds summed: off at 1, not kept; removed by prune22, issue 27)
    # a multi-row batch speculates only where the planner predicts it beats plain continuous
    # batching by this fraction for each row beside the first (a speculating row slows every row
    # of the step; acceptance is an estimate, and under-estimating plain's rate costs every row;
    # rows that commit unlike finish out of step: router/batch.py `BatchPlanner.plain_margin`)
    batch_plain_margin: float = 0.10
    # sampled rows speculate only in batches of at most this many rows (their acceptance is an
    # estimate from similarity, above what coupled drafts get; at t=0.7 speculation lost ~3% to
    # plain batching at 8 rows and broke even at 4 in the serving bench; at 2 rows it gained
    # nothing on a Zen 4 (1.02x, avx512bf16) and lost 7-10% on a Zen 1 (avx2: 2-row sampled
    # speculative steps 61 tok/s against plain's 64-69 in-process, 42 against 55 in the server,
    # the planner choosing them ~100 times in 1000 steps through the batch calibration)
    sampling_spec_max_batch: int = 1
    # batch calibration (router/batch.py): in a multi-row batch, each kind of step (speculative,
    # plain) has its predicted throughput scaled by its predicted / realised seconds at that many
    # rows (planning included; the tokens are the requests' own evidence), over discounted sums
    # of ~1 / (1 - this) steps; shrunk toward no correction by batch_calibration_prior
    # pseudo-steps, and a kind not run at that batch size forgets its correction by this factor
    # per step (it is tried again), but a speculative try that lost to plain steps of the same
    # minutes by the plain margin keeps its own (StepCalibration.failed)
    batch_calibration_discount: float = 0.9
    batch_calibration_prior: float = 1.0
    batch_calibration_forget: float = 0.98
    # the realized check (router/policy.py, step 1b): in a one-row step, each chain drafted by a
    # model-free drafter that a request ran has its predicted seconds per token scaled by what
    # it realized there (every chain's sums decayed by this per cycle of the request, shrunk
    # toward no correction by realized_prior_tokens tokens that came as predicted, clipped to
    # realized_clip: by default it only slows a chain down, so noise never makes a chain look
    # faster than its estimates say); a move above realized_tolerance republishes it. (Turning
    # it off was `realized_check=False`: removed by prune23, issue 27)
    # (confirmed tokens, router/cost_model.py point 4, are always estimated per (first, middle,
    # target) triple; the iid model was `confirmed_alpha=False`: removed by lead23, issue 27)
    # (a model draft's next cycle priced by its request's current run of accepted tokens was
    # `burst_acceptance` with `burst_max_run`, `burst_min_run`, `burst_prior`, `burst_decay` and
    # router/burst.py: off, not measured better end to end; removed by prune22, issue 27)
    realized_decay: float = 0.9
    # ... and by this per cycle of any other chain (a model draft, plain decoding): a chain
    # penalized once is tried again some tens of cycles later, not never (it was never)
    realized_fade: float = 0.97
    realized_prior_tokens: float = 4.0
    realized_tolerance: float = 0.05
    realized_clip: tuple[float, float] = (1.0, 10.0)
    similarity: SimilarityConfig = field(default_factory=SimilarityConfig)  # the acceptance estimator
    profile: ProfileConfig = field(default_factory=ProfileConfig)  # the cost profile's online refresh

    def __post_init__(self) -> None:
        if not 1 <= self.k_max <= MAX_DRAFT_LENGTH:
            raise ValueError(f"k_max must be in 1..{MAX_DRAFT_LENGTH}, got {self.k_max}")
        if not 1 <= self.max_levels <= 4:
            raise ValueError(f"max_levels must be in 1..4, got {self.max_levels}")
        if self.probe_refute_wait < 0:
            raise ValueError(f"probe_refute_wait must be >= 0, got {self.probe_refute_wait!r}")
        if self.switch_margin < 0 or self.patience < 1 or self.probe_k < 1:
            raise ValueError("switch_margin must be >= 0, patience and probe_k >= 1")
        for name in ("request_decay", "request_hit_decay", "request_idle_decay"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)!r}")
        if not 0.0 < self.realized_decay <= 1.0 or not 0.0 < self.realized_fade <= 1.0 or self.realized_prior_tokens < 0 or self.realized_tolerance < 0 \
                or not 0.0 < self.realized_clip[0] <= 1.0 <= self.realized_clip[1]:
            raise ValueError("realized_decay and realized_fade must be in (0, 1], realized_prior_tokens and realized_tolerance "
                             ">= 0, realized_clip a (low <= 1 <= high) pair above 0")
        if isinstance(self.catch_up_every, bool) or not isinstance(self.catch_up_every, int) or self.catch_up_every < 0:
            raise ValueError(f"catch_up_every must be an int >= 0 (0: off), got {self.catch_up_every!r}")
        if self.request_prior_strength < 0 or self.request_hit_prior_strength < 0:
            raise ValueError("request prior strengths must be >= 0")
        if self.decision_margin_sampling < 0 or self.decision_margin_greedy < 0:
            raise ValueError("decision margins must be >= 0")
        if isinstance(self.request_prior_quantile, bool) or not isinstance(self.request_prior_quantile, (int, float)) \
                or not 0.0 <= self.request_prior_quantile <= 1.0:
            raise ValueError(f"request_prior_quantile must be a number in [0, 1], got {self.request_prior_quantile!r}")
        if self.request_history < 1 or self.request_min_finished < 1 or self.shadow_k < 1:
            raise ValueError("request_history, request_min_finished and shadow_k must be >= 1")
        if not 0.0 < self.overhead_alpha <= 1.0 or self.context_bucket < 1 or self.log_size < 1:
            raise ValueError("overhead_alpha must be in (0, 1], context_bucket and log_size >= 1")
        if min(self.decision_tolerance, self.decision_hit_tolerance, self.decision_time_tolerance) < 0 \
                or self.decision_refresh < 1 or self.plain_hold_max < 0 or self.batch_plain_margin < 0 \
                or self.spec_hold_steps < 1 or self.stream_hold_steps < 1 \
                or self.sampling_spec_max_batch < 1 or self.batch_calibration_prior < 0 \
                or not 0.0 < self.batch_calibration_discount < 1.0 \
                or not 0.0 < self.batch_calibration_forget <= 1.0:
            raise ValueError("decision tolerances, plain_hold_max, batch_plain_margin and batch_calibration_prior "
                             "must be >= 0, decision_refresh, spec_hold_steps, stream_hold_steps and sampling_spec_max_batch >= 1, "
                             "batch_calibration_discount in (0, 1), batch_calibration_forget in (0, 1]")
        if not isinstance(self.similarity, SimilarityConfig) or not isinstance(self.profile, ProfileConfig):
            raise ValueError("similarity and profile must be a SimilarityConfig and a ProfileConfig")


@dataclass(frozen=True)
class ServerConfig:
    """Everything `specrouter serve` configures (its flags map onto these fields)."""

    served_model_name: str | None = None  # name in /v1/models and responses; None: the target's
    model_aliases: tuple[str, ...] = ()  # more names requests may use for the served model (vLLM: --served-model-name a b)
    # browser origins (scheme://host[:port], "*" any) allowed to call the API cross-origin
    # (CORS, preflight answered); None: no CORS headers at all (browsers refuse cross-origin calls)
    allowed_origins: tuple[str, ...] | None = None
    chat_template: str | None = None  # a Jinja chat template replacing the target's (serve --chat-template FILE)
    api_key: str | None = None  # required as "Authorization: Bearer <key>" on /v1/* when set
    metrics_auth: bool = False  # with api_key: /metrics and /health require the key too
    # Host names (no port) requests may name; "*" any, "*.example.com" a domain. None: on a
    # connection that arrives at a loopback address only loopback names (localhost, *.localhost,
    # 127.0.0.1, ::1) are accepted (DNS rebinding), any name elsewhere
    allowed_hosts: tuple[str, ...] | None = None
    max_num_seqs: int = 8  # rows in the running batch (cache slots per model)
    max_model_len: int = 2048  # positions per row: prompt + output (the draft length shrinks near the end); capped by the models
    chain: tuple[str, ...] | None = None  # default chain; None: the engine's (router / pool default)
    k: int = 4  # default draft length
    model_timeout: float | None = 30.0  # seconds a model forward may take before it is taken out
    max_queue: int = 64  # requests waiting for a row; beyond: 429
    # steps whose tokens one SSE chunk of a streamed row may carry while other rows run in the
    # batch (vLLM's --stream-interval): fewer chunks for the event loop to write and the client
    # to parse under load; a row's first tokens and its last are never held, nor with n > 1 a lone row (1: a
    # chunk every step). Rows with stop strings read every step (they end as soon as one appears).
    # 0 (the default): paced by what a hand-off costs on this machine, the fewest steps that keep
    # the hand-offs within 1.5% of the engine's time and a chunk at least every 100 ms
    # (server/async_engine.py StreamPacer: 4-7 steps at c=4 / c=8 on a 2-core Sapphire Rapids,
    # 1-2 where steps are 40-80 ms; docs/serving-performance.md); with 0 a lone stream is paced
    # too, a chunk at least every 50 ms (3 steps at c=1 there)
    stream_interval: int = 0
    # the engine thread runs on fewer torch threads while another process takes one of its cores
    # (engine/contention.py `TeamGovernor`: a starved OpenMP team spins through its barriers);
    # False: always on its own count
    team_governor: bool = True
    max_body_bytes: int = 1 << 20  # request body limit (413 beyond)
    retry_after_s: int = 1  # Retry-After of a 429
    seed: int | None = None  # seed of the engine's random stream (unseeded sampling requests)
    adaptive: bool = True  # the router picks chain and k per request (unless a chain is pinned)
    # whose earlier requests a learning drafter (suffix) drafts from: "shared" (every request's),
    # or "api-key": only those sent with the same Authorization header value (a tenant is the
    # SHA-256 of that value; requests without one form one anonymous tenant). The router's
    # acceptance rates (aggregate numbers, no text) stay shared.
    suffix_scope: str = "shared"  # also the prefix cache's scope: with "api-key" a key never reads another's
    prefix_cache: bool = True  # see EngineConfig (set from it by SpecRouterConfig)
    kv_cache_gb: float | None = None  # see EngineConfig
    router: RouterConfig = field(default_factory=RouterConfig)  # settings of the served router

    def __post_init__(self):
        for name in ("max_num_seqs", "max_model_len", "k", "max_queue", "max_body_bytes", "stream_interval"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < (0 if name == "stream_interval" else 1):
                raise ValueError(f"{name} must be a positive integer{' or 0' if name == 'stream_interval' else ''}"
                                 f", got {v!r}")
        if self.suffix_scope not in SUFFIX_SCOPES:
            raise ValueError(f"suffix_scope must be one of {SUFFIX_SCOPES}, got {self.suffix_scope!r}")
        if self.allowed_hosts is not None and (
                isinstance(self.allowed_hosts, str)
                or not all(isinstance(h, str) and h for h in self.allowed_hosts)):
            raise ValueError(f"allowed_hosts must be a tuple of host names, got {self.allowed_hosts!r}")
        if self.model_timeout is not None and not self.model_timeout > 0:
            raise ValueError(f"model_timeout must be > 0 seconds or None, got {self.model_timeout!r}")
        for name in ("model_aliases", "allowed_origins"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, str) or not all(isinstance(h, str) and h for h in v)):
                raise ValueError(f"{name} must be a tuple of non-empty strings, got {v!r}")
        if self.chat_template is not None and not (isinstance(self.chat_template, str)
                                                   and self.chat_template.strip()):
            raise ValueError("chat_template must be a non-empty Jinja template string")


def check_kv_cache_gb(gb) -> None:
    if gb is not None and (isinstance(gb, bool) or not isinstance(gb, (int, float))
                           or not math.isfinite(gb) or gb < 0):
        raise ValueError(f"kv_cache_gb must be a number of GB >= 0 (0: nothing parked) or None, got {gb!r}")


def kv_cache_bytes(gb: float | None) -> int | None:
    return None if gb is None else int(gb * (1 << 30))


def check_chain_names(chain: tuple[str, ...]) -> None:
    """What can be said of a chain before any model loads: 1..4 levels, no model twice, the
    model-free drafter only first (pool.py checks the names against the loaded pool)."""
    if not chain:
        raise ChainError("a chain needs at least the target")
    if len(chain) > 4:
        raise ChainError(f"chains have at most 4 levels, got {len(chain)}")
    if len(set(chain)) != len(chain):
        raise ChainError(f"a model appears twice in chain {chain}")
    if NGRAM in chain[1:]:
        raise ChainError(f"the model-free drafter {NGRAM!r} can only be the first level: {chain}")


@dataclass(frozen=True)
class PoolConfig:
    """Which models are loaded, and how (the pool flags of every command map onto these)."""

    # checkpoint directories, .gguf files, draft-head folders (distill --head), "ngram";
    # "default" is the embedded pool (n-gram, the shipped draft, SmolLM2-135M-Instruct)
    models: tuple[str, ...] = (DEFAULT_POOL,)
    target: str | None = None  # target name, role or path; None: the model with the most parameters
    names: tuple[str, ...] | None = None  # pool names, one per entry of models; None: folder names
    backend: str = "auto"  # auto (native runner for Llama-family models) | native | hf
    # of every model: auto | float32 | bfloat16 | float64 | float16; auto: bfloat16 on the native
    # kernels, float32 elsewhere (the fastest precision that is exact: greedy output is the
    # target's plain decoding at that precision, token for token)
    dtype: str = "auto"
    ngram: bool = True  # add the model-free n-gram drafter
    suffix: bool = True  # add the model-free suffix drafter (drafts from earlier requests too)
    threads: int | None = None  # torch intra-op threads; None: torch's default
    # where every model runs: auto (the first CUDA GPU when torch sees one, else the CPU) | cpu |
    # cuda | cuda:N; a CUDA device torch cannot use here is a DeviceError when the pool loads
    device: str = "auto"
    trust_remote_code: bool = False  # let transformers run a checkpoint's own code (never in serve)
    profile_path: str | None = None  # this machine's cost profile of the models; None: the cache dir

    def __post_init__(self) -> None:
        models = (self.models,) if isinstance(self.models, str) else tuple(str(m) for m in self.models)
        object.__setattr__(self, "models", models)
        if not models:
            raise ValueError("models: give at least one model (or 'default', the embedded pool)")
        if self.names is not None:
            object.__setattr__(self, "names", tuple(self.names))
            if len(self.names) != len(models):
                raise ValueError("names: one name per entry of models")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES[:5])}, got {self.dtype!r}")
        if not isinstance(self.device, str) or not re.match(DEVICE_PATTERN, self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        t = self.threads
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
            raise ValueError(f"threads must be an integer >= 1, got {t!r}")
        if self.names is not None and DEFAULT_POOL in models:
            raise ValueError(f"names: cannot name the models of the {DEFAULT_POOL!r} pool")
        if not self.ngram and NGRAM in models:
            raise ValueError(f"models lists {NGRAM!r} but ngram is off (--no-ngram)")
        if self.target == "draft":
            raise ValueError("target: 'draft' names the smallest draft, not a target")


TREE_MODES = ("off", "greedy", "on")  # EngineConfig.trees: which rows may verify token trees


@dataclass(frozen=True)
class EngineConfig:
    """How requests are decoded unless they ask otherwise."""

    chain: tuple[str, ...] | None = None  # pin this chain (pool names or roles); None: the router's
    k: int = 4  # draft length of a pinned chain (the router picks its own)
    adaptive: bool = True  # the router picks chain and k per request every cycle; False: the pool's default chain
    prefix_cache: bool = True  # reuse the KV of earlier requests' shared prefixes (state/prefix_cache.py)
    kv_cache_gb: float | None = None  # parked-KV budget of the prefix cache; None: a tenth of RAM, at most 4 GiB
    # where the router may verify token trees instead of chains (its tree policy picks a tree only
    # where measured costs predict a gain; a single stream only): "greedy" (default: greedy rows),
    # "on" (sampled rows too), "off" (chains only); True / False read as "on" / "off". Greedy rows
    # by default since session 29: with verification nearly flat (Intel AMX, T(9)/T(1) 1.3) and a
    # tree cycle's host work halved, the router with trees ran 1.02-1.23x the router without them
    # on greedy workloads, level (0.95-1.08x) at t=0.7 (docs/trees.md "Trees by default")
    # (the library, generate, chat, demo and bench; `specrouter serve` keeps chains: its batches
    # are planned by the batch planner, which does not price trees)
    trees: str | bool = "greedy"

    def __post_init__(self) -> None:
        check_kv_cache_gb(self.kv_cache_gb)
        if isinstance(self.trees, bool):
            object.__setattr__(self, "trees", "on" if self.trees else "off")
        if self.trees not in TREE_MODES:
            raise ValueError(f"trees must be one of {', '.join(TREE_MODES)} (or a bool), got {self.trees!r}")
        if self.chain is not None:
            object.__setattr__(self, "chain", tuple(self.chain))
            check_chain_names(self.chain)
        k = self.k
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DRAFT_LENGTH:
            raise ChainError(f"draft length k must be an integer in 1..{MAX_DRAFT_LENGTH}, got {k!r}")

    @property
    def routed(self) -> bool:
        """Whether the router decides (no pinned chain, adaptive on)."""
        return self.adaptive and self.chain is None


@dataclass(frozen=True)
class SpecRouterConfig:
    """The whole configuration: pool, engine, router, server. `server` always carries the
    engine's chain, k and adaptive and the router's settings (set here), so the server is built
    from the same values as the Python API and the CLI."""

    pool: PoolConfig = field(default_factory=PoolConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

    def __post_init__(self) -> None:
        e = self.engine
        if e.chain is not None and e.chain[0] == NGRAM and not self.pool.ngram:
            raise ChainError(f"the chain {e.chain} starts with {NGRAM!r} but the pool has no "
                             "n-gram drafter (ngram=False / --no-ngram)")
        server = dataclasses.replace(self.server, chain=e.chain, k=e.k, adaptive=e.adaptive,
                                     prefix_cache=e.prefix_cache, kv_cache_gb=e.kv_cache_gb,
                                     router=self.router)
        object.__setattr__(self, "server", server)
