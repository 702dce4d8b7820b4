"""Similarity and acceptance of model pairs (docs/design.md, Pillar 1): what the router believes
`alpha_ij`, the per-token acceptance of drafter i's tokens by verifier j, to be.

Per ordered pair (drafter, verifier) and decoding mode (greedy / sampling) it keeps:
- **SimScore** = 1 - E[D_TV], an EMA of the mean total-variation distance between the two
  models' processed next-token distributions at the same positions (`tv_distance`). In sampling
  mode the executor has both distributions at every drafted position, so active pairs are
  measured for free; in greedy mode it has the logits, and `tv_from_logits` compares the
  temperature-1 distributions (greedy's processed distributions are one-hot, which would make
  D_TV just a mismatch indicator).
- **observed acceptance**: the per-token MLE of the iid truncated-geometric model, accepted /
  (accepted + rejections), where a row rejects iff it accepted fewer than the candidates it
  received (`acceptance_trials`). Counts decay per trial (window ~1/(1 - decay) trials). For a
  model-free drafter the proposal counts as k long: a short proposal that was fully accepted
  also ends in the verifier's token, exactly like a rejection at its end, so the iid fit stays
  exact; a miss (no proposal at all) is a separate hit rate.
- **calibration** f(SimScore) -> alpha, per mode: alpha = clip(a + b * SimScore, 0, 1), fitted
  online by ridge-regularized weighted least squares from (SimScore, observed acceptance) pairs.
  Priors: identity for sampling (the acceptance of speculative sampling is exactly 1 - D_TV);
  `1.25 * S - 0.25` for greedy (greedy accepts less than 1 - D_TV at temperature 1 predicts).
  Only trials with their row's own measured SimScore teach it (`observe_acceptance`).

`alpha(pair, mode)` prefers the observed acceptance: with n trials of evidence it returns
(accepted + w * fallback) / (n + w), w = prior_strength * max(0, 1 - n / min_evidence): the
fallback's pseudo-trials fade out and from `min_evidence` trials on it is the plain MLE. The
fallback is f(SimScore) when the pair's SimScore is measured, else a transitive estimate
(D_TV is a metric: SimScore(i, k) >= SimScore(i, j) + SimScore(j, k) - 1, best j), else a cold
prior: from the relative model size for model drafters, low for model-free ones.

Pairs outside the active chains go stale: evidence fades linearly over `stale_after` row-cycles
without a measurement (`effective_trials`), `needs_probe` says which pairs have less than
`min_evidence` of it, `upper` gives their optimistic (Wilson upper bound) alpha, and a
`ProbeBudget` lets the router spend at most a fraction of row-cycles (5%) and of wall time (2%)
on probing them, with the cost accounted in seconds.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from specrouter.config import SimilarityConfig  # the estimator's settings (also importable from here)
from specrouter.decoding.tv import candidate_mask, candidate_tv, tv_distance, tv_from_logits  # noqa: F401  (re-exported)
from specrouter.records.routing import Pair
from specrouter.state.sequence import common_prefix_len

GREEDY = "greedy"
SAMPLING = "sampling"
MODES = (GREEDY, SAMPLING)


# ---------------------------------------------------------------------------------------------
# pure functions


def acceptance_trials(candidates: int, accepted: int, proposal_len: int | None = None) -> tuple[int, int]:
    """(accepted, rejections) of one row at one level for the iid truncated-geometric MLE: a
    rejection iff fewer were accepted than `proposal_len` (default: the candidates). A model-free
    drafter passes its draft length k as proposal_len (module docstring)."""
    if candidates <= 0:
        return 0, 0
    full = candidates if proposal_len is None else max(proposal_len, candidates)
    return accepted, int(accepted < full)


def shadow_match(proposal: Sequence[int], committed: Sequence[int], k: int) -> tuple[int, int]:
    """Shadow-score a model-free proposal made before a cycle against the tokens the target then
    committed: (accepted, rejections) as if it had drafted with length k. Exact in both modes:
    a committed token is a sample of the target's distribution, so it equals a one-hot proposal
    with the probability speculative sampling would have accepted it. Committing ended the
    evidence without a rejection when every committed token matched."""
    if not proposal:
        return 0, 0
    m = common_prefix_len(proposal, committed)
    return m, int(m < min(len(committed), k))


def decayed_add(totals: Sequence[float], added: Sequence[float], decay: float, trials: float) -> list[float]:
    """Running totals that forget: each old total is multiplied by decay ** trials (the window
    is ~1 / (1 - decay) trials) and the new amounts are added. Every decayed count of the
    router (acceptance, hit and calibration sums, global and per request) is updated here."""
    f = decay ** trials
    return [f * t + a for t, a in zip(totals, added)]


def shrink(successes: float, trials: float, prior: float, strength: float) -> float:
    """An estimate shrunk toward `prior` (empirical Bayes): (successes + strength * prior) /
    (trials + strength), the prior alone without any weight. Every blend of observed rates
    with a prior in the router is this."""
    if trials + strength <= 0:
        return prior
    return (successes + strength * prior) / (trials + strength)


def blend(accepted: float, rejections: float, fallback: float, prior_strength: float, min_evidence: float) -> float:
    """The observed acceptance with the fallback's pseudo-trials fading out (module docstring)."""
    n = accepted + rejections
    w = prior_strength * max(0.0, 1.0 - n / min_evidence) if min_evidence > 0 else 0.0
    return shrink(accepted, n, fallback, w)


def size_prior(drafter_params: int, verifier_params: int, config: SimilarityConfig | None = None) -> float:
    """Cold-start acceptance of a model drafter: by default 0.75 + 0.1 * log10(size ratio), in
    [0.3, 0.85] (0.65 for a 10x smaller draft, 0.55 for 100x); 0.5 when a size is unknown
    (`SimilarityConfig.size_prior_*`). Mildly optimistic on purpose: the router tries a draft
    and learns, instead of never trying it."""
    cfg = config or SimilarityConfig()
    if drafter_params <= 0 or verifier_params <= 0:
        return cfg.unknown_size_prior
    lo, hi = cfg.size_prior_range
    return min(hi, max(lo, cfg.size_prior_base + cfg.size_prior_slope * math.log10(drafter_params / verifier_params)))


# ---------------------------------------------------------------------------------------------
# state


@dataclass
class PairStats:
    """What is known about one (pair, mode)."""

    tv: float = math.nan  # EMA of mean D_TV
    tv_positions: float = 0.0  # positions measured (not decayed)
    accepted: float = 0.0  # decayed accepted tokens
    rejections: float = 0.0  # decayed rejections
    sim_trials: float = 0.0  # decayed trials that came with the row's own SimScore ...
    sim_sum: float = 0.0  # ... and the sum of SimScore x trials over them (the SimScore of the counts)
    recent: tuple[float, float] = (0.0, 0.0)  # the same two sums over ~20 trials (drift_decay): SimScore now
    last_measured: int = -(1 << 60)  # row-cycle of the last measurement

    @property
    def trials(self) -> float:
        return self.accepted + self.rejections

    @property
    def observed(self) -> float:
        return self.accepted / self.trials if self.trials > 0 else math.nan


@dataclass
class _Calibration:
    """alpha = a + b * (S - center), ridge-regressed toward the prior line; the sums are over
    trials (x = centered SimScore, y = acceptance), decayed."""

    prior: tuple[float, float]  # (intercept, slope) of alpha = intercept + slope * S
    center: float  # SimScores are centered here for the fit
    spread: float  # typical spread of SimScores around it (scales the slope's prior)
    sw: float = 0.0  # sum of weights (trials)
    sx: float = 0.0
    sxx: float = 0.0
    sy: float = 0.0  # sum of accepted (= weight * observed acceptance)
    sxy: float = 0.0
    coef: tuple[float, float] | None = None  # cached fit, (intercept, slope) of alpha vs S

    def add(self, sim: float, accepted: float, trials: float, decay: float) -> None:
        x = sim - self.center
        self.sw, self.sx, self.sxx, self.sy, self.sxy = decayed_add(
            (self.sw, self.sx, self.sxx, self.sy, self.sxy),
            (trials, trials * x, trials * x * x, accepted, accepted * x), decay, trials)
        self.coef = None

    def fit(self, strength: float) -> tuple[float, float]:
        if self.coef is None:
            a0, b0 = self.prior
            c0 = a0 + b0 * self.center  # the prior's value at the center
            lam, lam_b = strength, strength * self.spread ** 2  # the slope's prior: lam trials at x = +-spread
            # ridge: [sw+lam, sx; sx, sxx+lam_b] [c; b] = [sy + lam c0; sxy + lam_b b0]
            m11, m12, m22 = self.sw + lam, self.sx, self.sxx + lam_b
            r1, r2 = self.sy + lam * c0, self.sxy + lam_b * b0
            det = m11 * m22 - m12 * m12
            c, b = (c0, b0) if det <= 0 else ((r1 * m22 - r2 * m12) / det, (m11 * r2 - m12 * r1) / det)
            self.coef = (c - b * self.center, b)
        return self.coef


class SimilarityEstimator:
    """Per (drafter, verifier) pair and mode: SimScore, observed acceptance, calibration, priors,
    staleness (module docstring). `sizes`: parameter counts by model name; `model_free`: names
    of model-free drafters."""

    def __init__(
        self,
        sizes: Mapping[str, int] | None = None,
        model_free: Collection[str] = (),
        config: SimilarityConfig | None = None,
    ):
        self.config = config or SimilarityConfig()
        self.sizes = dict(sizes or {})
        self.model_free = frozenset(model_free)
        self.pairs: dict[tuple[Pair, str], PairStats] = {}
        cfg = self.config
        priors = {SAMPLING: cfg.sampling_calibration, GREEDY: cfg.greedy_calibration}
        self.calibrations = {m: _Calibration(priors[m], cfg.calibration_center, cfg.calibration_spread)
                             for m in MODES}
        self.hits: dict[str, list[float]] = {}  # model-free drafter -> [hits, proposals], decayed
        self.now = 0  # row-cycles seen (tick)
        self.version = 0  # increases with every observation, for callers that cache estimates
        # alpha_detail per (pair, mode), with the `version` it was computed at: a pure function of
        # the observations it reads (the evidence snapshot, a request's alphas and the probes read
        # the same pairs many times per decision), kept while none of them changed since
        # (`_changed`): its own pair's counts and D_TV, and the mode's calibration and D_TVs (the
        # similarity and transitive fallbacks, the drift), a triple's pair's too. A decision after
        # a hold recomputed every pair (the version moves with every observation); now only those
        # observed since
        self._alphas: dict[tuple, tuple[tuple[float, str], int]] = {}
        self._changed: dict = {}  # (pair, mode) or mode -> version of its last change

    def __setstate__(self, state: dict) -> None:
        """Unpickled (a recorded router's starting estimates, benchmarks/router_replay.py): the
        memo starts empty whatever the pickle holds."""
        self.__dict__.update(state)
        self._alphas, self._changed = {}, {}
        self.__dict__.pop("_alphas_version", None)

    def stats(self, pair: Pair, mode: str) -> PairStats:
        key = (tuple(pair), _check_mode(mode))
        if key not in self.pairs:
            self.pairs[key] = PairStats()
        return self.pairs[key]

    def tick(self, row_cycles: int = 1) -> None:
        self.now += row_cycles

    # -- observations -----------------------------------------------------------------------
    def observe_tv(self, pair: Pair, mode: str, tv: float, positions: int) -> None:
        """One measurement: mean D_TV `tv` over `positions` positions."""
        if positions <= 0 or not math.isfinite(tv):
            return
        s = self.stats(pair, mode)
        s.tv_positions += positions
        w = max(self.config.tv_alpha, positions / s.tv_positions)  # plain mean while young
        s.tv = tv if math.isnan(s.tv) else s.tv + w * (tv - s.tv)
        s.last_measured = self.now
        self.version += 1
        self._changed[(tuple(pair), mode)] = self._changed[mode] = self.version  # a D_TV: every fallback of the mode

    def observe_acceptance(self, pair: Pair, mode: str, accepted: float, rejections: float,
                           sim: float | None = None) -> None:
        """Trials of the iid model (see `acceptance_trials`), summed over rows. `sim`: the
        SimScore (1 - mean D_TV) measured at these very trials (one row's cycle): it teaches the
        mode's calibration f with the row's own similarity, and dates the counts (`drifted`).
        Trials without it (a step the TvSchedule skipped, a shadow-scored proposal) teach the
        calibration nothing (the pair's global SimScore as the row's stand-in was
        `calibrate_stand_in`, removed by prune22)."""
        trials = accepted + rejections
        if trials <= 0:
            return
        cfg = self.config
        s = self.stats(pair, mode)
        f = cfg.decay ** trials
        s.accepted, s.rejections = decayed_add((s.accepted, s.rejections), (accepted, rejections), cfg.decay, trials)
        s.sim_trials, s.sim_sum = f * s.sim_trials, f * s.sim_sum
        if sim is not None:
            s.sim_trials, s.sim_sum = s.sim_trials + trials, s.sim_sum + sim * trials
            s.recent = tuple(decayed_add(s.recent, (trials, sim * trials), cfg.drift_decay, trials))
        s.last_measured = self.now
        self.version += 1
        self._changed[(tuple(pair), mode)] = self.version
        if sim is not None:
            self.calibrations[mode].add(sim, accepted, trials, cfg.calib_decay)
            self._changed[mode] = self.version  # the calibration: every fallback and drift of the mode

    def touch(self, pair: Pair, mode: str) -> None:
        """The pair ran but yielded no trial (a model-free miss): it is not stale, nor known."""
        self.stats(pair, mode).last_measured = self.now

    def observe_hits(self, drafter: str, hits: int, proposals: int) -> None:
        """A model-free drafter was asked `proposals` times and proposed something `hits` times."""
        if proposals <= 0:
            return
        h = self.hits.setdefault(drafter, [0.0, 0.0])
        h[:] = decayed_add(h, (hits, proposals), self.config.hit_decay, proposals)
        self.version += 1

    # -- estimates --------------------------------------------------------------------------
    def sim_score(self, pair: Pair, mode: str) -> float | None:
        """1 - E[D_TV] when measured over enough positions, else None."""
        s = self.pairs.get((tuple(pair), mode))
        if s is None or s.tv_positions < self.config.min_tv_positions:
            return None
        return 1.0 - s.tv

    def transitive_sim(self, pair: Pair, mode: str) -> float | None:
        """Best lower bound max_j SimScore(i, j) + SimScore(j, k) - 1 over measured pairs."""
        i, k = pair
        best = None
        for (p, m), _ in self.pairs.items():
            if m != mode or p[0] != i or p[1] == k:
                continue
            first, second = self.sim_score(p, mode), self.sim_score((p[1], k), mode)
            if first is not None and second is not None:
                bound = max(0.0, first + second - 1.0)
                best = bound if best is None else max(best, bound)
        return best

    def calibrate(self, sim: float, mode: str) -> float:
        """f(SimScore) -> alpha for the mode."""
        a, b = self.calibrations[_check_mode(mode)].fit(self.config.calib_strength)
        return min(1.0, max(0.0, a + b * sim))

    def prior(self, pair: Pair) -> float:
        drafter, verifier = pair
        if drafter in self.model_free:
            return self.config.model_free_prior
        return size_prior(self.sizes.get(drafter, 0), self.sizes.get(verifier, 0), self.config)

    def fallback(self, pair: Pair, mode: str) -> tuple[float, str]:
        """(alpha, source) without the observed acceptance: similarity, transitive, prior. A
        triple (first, middle, verifier) (the verifier's acceptance of the middle level's
        tokens that the first also proposed: cost_model's confirmed tokens) falls back on the
        pair (middle, verifier): the iid model."""
        if len(pair) == 3:
            return self.alpha(pair[1:], mode), "pair"
        sim = self.sim_score(pair, mode)
        if sim is not None:
            return self.calibrate(sim, mode), "similarity"
        sim = self.transitive_sim(pair, mode)
        if sim is not None:
            return self.calibrate(sim, mode), "transitive"
        return self.prior(pair), "prior"

    def alpha_detail(self, pair: Pair, mode: str) -> tuple[float, str]:
        """(alpha, source): source is "observed" (MLE alone), "blend" (MLE with the fallback's
        fading pseudo-trials) or the fallback's source. Memoized while what it reads is unchanged
        (`_changed`, `__init__`)."""
        key = (tuple(pair), _check_mode(mode))
        hit = self._alphas.get(key)
        if hit is not None:
            changed, at = self._changed, hit[1]
            if (changed.get(key, -1) <= at and changed.get(mode, -1) <= at
                    and (len(key[0]) != 3 or changed.get((key[0][1:], mode), -1) <= at)):
                return hit[0]
        value = self._alpha_detail(key[0], mode)
        self._alphas[key] = (value, self.version)
        return value

    def _alpha_detail(self, pair: Pair, mode: str) -> tuple[float, str]:
        s = self.pairs.get((pair, mode))
        cfg = self.config
        if s is not None and s.trials >= cfg.min_evidence:
            return self.drifted(s, pair, mode, s.accepted / s.trials), "observed"
        fb, source = self.fallback(pair, mode)
        if s is None or s.trials <= 0:
            return fb, source
        value = blend(s.accepted, s.rejections, fb, cfg.prior_strength, cfg.min_evidence)
        return self.drifted(s, pair, mode, value), "observed" if s.trials >= cfg.min_evidence else "blend"

    def drifted(self, s: PairStats, pair: Pair, mode: str, observed: float) -> float:
        """The observed acceptance moved by what the similarity moved since its trials: f(SimScore
        now) - f(SimScore of the trials), both through the mode's calibration and weighted alike
        (per trial), "now" over ~20 trials (`drift_decay`), the counts over ~500: a change of
        regime shows in D_TV long before the counts catch up. Unchanged without both SimScores
        (`SimilarityConfig.drift` False left it unchanged always: removed by prune23, issue 27)."""
        cfg = self.config
        if s.recent[0] < cfg.min_tv_positions or s.sim_trials < cfg.min_tv_positions:
            return observed
        now, then = s.recent[1] / s.recent[0], s.sim_sum / s.sim_trials
        return min(1.0, max(0.0, observed + self.calibrate(now, mode) - self.calibrate(then, mode)))

    def alpha(self, pair: Pair, mode: str) -> float:
        return self.alpha_detail(pair, mode)[0]

    def hit_rate(self, drafter: str) -> float:
        """Probability that a model-free drafter proposes anything (global)."""
        h = self.hits.get(drafter)
        cfg = self.config
        if h is None:
            return cfg.hit_prior
        return blend(h[0], h[1] - h[0], cfg.hit_prior, cfg.prior_strength, cfg.min_evidence)

    def effective_trials(self, pair: Pair, mode: str) -> float:
        """Trials of evidence, discounted linearly to 0 over `stale_after` row-cycles without a
        measurement: what is known about a pair fades when it is not looked at."""
        s = self.pairs.get((tuple(pair), _check_mode(mode)))
        if s is None:
            return 0.0
        fresh = max(0.0, 1.0 - (self.now - s.last_measured) / self.config.stale_after)
        return (s.trials + s.tv_positions) * fresh

    def needs_probe(self, pair: Pair, mode: str) -> bool:
        """Less than `min_evidence` effective trials: never measured, thinly measured, or not
        measured for a while (`effective_trials`)."""
        return self.effective_trials(pair, mode) < self.config.min_evidence

    def upper(self, pair: Pair, mode: str, z: float = 1.5) -> float:
        """Optimistic alpha: the Wilson upper bound at the current estimate with the effective
        trials (1 with none). The router probes pairs that could win under it."""
        n = self.effective_trials(pair, mode)
        if n <= 0:
            return 1.0
        p = self.alpha(pair, mode)
        z2 = z * z
        centre = p + z2 / (2 * n)
        spread = z * math.sqrt(max(p * (1 - p), 0.0) / n + z2 / (4 * n * n))
        return min(1.0, (centre + spread) / (1 + z2 / n))


def _check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"mode must be {GREEDY!r} or {SAMPLING!r}, got {mode!r}")
    return mode


# ---------------------------------------------------------------------------------------------
# the probing budget


@dataclass
class ProbeBudget:
    """At most `fraction` of row-cycles may be probes, and (optionally) the probes' accounted
    cost at most `time_fraction` of the wall time of all cycles. The caller `tick`s every
    row-cycle that ran (probes included) and `charge`s every probe it makes."""

    fraction: float = 0.05  # probes / row-cycles, at most
    time_fraction: float | None = 0.02  # probe seconds / cycle seconds, at most (None: no cap)
    cycles: int = 0  # row-cycles ticked
    probes: int = 0  # probes charged
    seconds: float = 0.0  # accounted probe cost
    total_seconds: float = 0.0  # wall time of all ticked cycles
    history: list[float] = field(default_factory=list, repr=False)  # cost of each probe

    def __post_init__(self) -> None:
        if not 0 <= self.fraction <= 1 or (self.time_fraction is not None and not 0 <= self.time_fraction <= 1):
            raise ValueError("probe fractions must be in [0, 1]")

    def tick(self, row_cycles: int = 1, seconds: float = 0.0) -> None:
        self.cycles += row_cycles
        self.total_seconds += max(seconds, 0.0)

    def allow(self) -> bool:
        """May one more probe run now (counting the row-cycle it will take)?"""
        if self.probes + 1 > self.fraction * (self.cycles + 1):
            return False
        return self.time_fraction is None or self.seconds <= self.time_fraction * self.total_seconds

    def charge(self, seconds: float) -> None:
        self.probes += 1
        self.seconds += max(seconds, 0.0)
        if len(self.history) < 10_000:
            self.history.append(max(seconds, 0.0))

    def settle(self, predicted: float, realised: float) -> None:
        """A probe charged at `predicted` seconds cost `realised`: its charge becomes that."""
        self.seconds += max(realised, 0.0) - max(predicted, 0.0)
        if self.history and self.history[-1] == max(predicted, 0.0):
            self.history[-1] = max(realised, 0.0)
