"""The router's memory of requests: per request, decayed acceptance and hit counts; across
requests, the alphas finished ones reached on their own (the upper-quantile prior of new ones,
see policy.py)."""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np
import numpy.ma  # noqa: F401 - np.quantile's first call imports it (below)

from specrouter.records.routing import Chain
from specrouter.router.similarity import Pair, decayed_add


@dataclass
class RequestState:
    """The router's memory of one request."""

    greedy: bool
    plan: tuple[Chain, int] | None = None  # current (chain, k)
    worse: int = 0  # consecutive decisions the plan was predicted slower than the best
    epoch: tuple[int, ...] = ()  # step-detector counts of the plan's models when it was chosen
    counts: dict[Pair, list[float]] = field(default_factory=dict)  # pair -> [accepted, rejections], decayed
    hits: dict[str, list[float]] = field(default_factory=dict)  # model-free drafter -> [hits, proposals], decayed
    tv: dict[Pair, list[float]] = field(default_factory=dict)  # pair -> [D_TV x positions, positions], decayed
    cycles: int = 0  # cycles observed
    table: object = None  # the PlanTable of its last decision (plan_batch weighs alternatives with it)
    version: int = 0  # increases when its own estimates moved materially (router/evidence.py)
    evidence: object = None  # its published estimates (evidence.RequestEvidence)
    cached: object = None  # its last decision (evidence.CachedDecision), reused while the key holds
    # realized vs predicted (the realized check, policy.py): the plan of its next cycle as
    # decided, (chain, predicted seconds per token); per chain, decayed [seconds, predicted
    # seconds of the tokens committed, tokens]; the corrections its decisions read (published
    # when they moved)
    pending: tuple[Chain, float] | None = None
    realized: dict[Chain, list[float]] = field(default_factory=dict)
    corrections: dict[Chain, float] = field(default_factory=dict)
    # pair -> (its cycle from which the pair may be probed again, the wait): a probe of it
    # refuted its optimism (router/probing.py, `Prober.judge`)
    probe_waits: dict[Pair, tuple[int, int]] = field(default_factory=dict)
    # its own estimates updated since they were last checked against its published evidence:
    # (pair or triple, mode) of an alpha, (drafter, None) of a hit rate (`settle`)
    notes: dict = field(default_factory=dict)

    def note(self, key, mode: str | None = None) -> None:
        """Its alpha of `key` in `mode` (a hit rate: `key` a drafter, mode None) was updated:
        checked when its version is next read (`settle`)."""
        self.notes[key] = mode

    def settle(self, board) -> None:
        """Check the noted estimates against its published evidence (evidence.py `note_alpha`,
        `note_hit`: a new version if one moved materially), once, where its version is read (a
        decision, a hold's check) rather than after every observation: ~15 us of a ~75 us
        observe_step on Sapphire Rapids, replayed. Stops at the first that moved (one new
        version is all a reader sees)."""
        if not self.notes:
            return
        notes, self.notes, version = self.notes, {}, self.version
        for key, mode in notes.items():
            if mode is None:
                board.note_hit(self, key)
            else:
                board.note_alpha(self, key, mode)
            if self.version != version:
                return

    def observe(self, pair: Pair, accepted: float, rejections: float, decay: float) -> None:
        c = self.counts.setdefault(pair, [0.0, 0.0])
        c[:] = decayed_add(c, (accepted, rejections), decay, accepted + rejections)

    def fade(self, pair: Pair, decay: float) -> bool:
        """A cycle passed without a trial of `pair`: its own counts and D_TV fade by `decay`
        (its estimate returns toward its prior; below a hundredth of a trial or position they
        are dropped, the prior alone). Whether it had any to fade."""
        had = False
        for store in (self.counts, self.tv):
            c = store.get(pair)
            if c is None:
                continue
            had = True
            if (c[0] + c[1] if store is self.counts else c[1]) * decay < 0.01:
                del store[pair]
            else:
                c[0] *= decay
                c[1] *= decay
        return had

    def observe_tv(self, pair: Pair, tv: float, positions: int, decay: float) -> None:
        t = self.tv.setdefault(pair, [0.0, 0.0])
        t[:] = decayed_add(t, (tv * positions, float(positions)), decay, positions)

    def sim_score(self, pair: Pair) -> tuple[float, float] | None:
        """(1 - its mean D_TV, positions measured) of a pair in this request, None if never."""
        t = self.tv.get(pair)
        return None if t is None or t[1] <= 0 else (1.0 - t[0] / t[1], t[1])

    def observe_realized(self, chain: Chain, seconds: float, tokens: int, predicted: float, decay: float) -> None:
        """A cycle of `chain` took `seconds` for `tokens` committed tokens, predicted at
        `predicted` seconds per token."""
        self.fade_realized(decay)
        r = self.realized.setdefault(chain, [0.0, 0.0, 0.0])
        r[:] = [r[0] + seconds, r[1] + tokens * predicted, r[2] + tokens]

    def fade_realized(self, decay: float) -> None:
        """One cycle passed: every chain's realized evidence fades, run or not (so a chain given
        up is tried again)."""
        for r in self.realized.values():
            r[:] = decayed_add(r, (0.0, 0.0, 0.0), decay, 1.0)

    def correction(self, chain: Chain, prior_tokens: float) -> float:
        """Realized / predicted seconds per token of `chain` in this request (1.0 untried),
        shrunk toward 1 by `prior_tokens` tokens that came as predicted."""
        r = self.realized.get(chain)
        if r is None or r[1] <= 0.0 or r[2] <= 0.0:
            return 1.0
        prior = prior_tokens * r[1] / r[2]  # seconds of those tokens at the mean predicted rate
        return (r[0] + prior) / (r[1] + prior)

    def observe_hit(self, drafter: str, hit: bool, decay: float) -> None:
        h = self.hits.setdefault(drafter, [0.0, 0.0])
        h[:] = decayed_add(h, (float(hit), 1.0), decay, 1.0)


class FinishedRequests:
    """Per (pair, mode), the acceptance rates the last `size` finished requests reached on their
    own evidence (pairs they ran for >= `min_trials` trials), and their `q`-quantile, computed
    when a request is recorded (rarely) rather than when it is read (every decision)."""

    def __init__(self, size: int, q: float, min_trials: float = 4.0, min_requests: int = 3):
        self.size, self.q, self.min_trials, self.min_requests = size, q, min_trials, min_requests
        self._alphas: dict[tuple[Pair, str], deque[float]] = {}
        self._quantiles: dict[tuple[Pair, str], float] = {}

    def record(self, req: RequestState, mode: str, skip: Collection[str] = ()) -> None:
        for pair, (acc, rej) in req.counts.items():
            if acc + rej >= self.min_trials and pair[0] not in skip:
                hist = self._alphas.setdefault((pair, mode), deque(maxlen=self.size))
                hist.append(acc / (acc + rej))
                if len(hist) >= self.min_requests:
                    # (np.quantile's first call in a process imported numpy.ma lazily, through
                    # np.unique: ~9 ms inside a request's last engine step on a Sapphire Rapids;
                    # imported with this module since session 29)
                    self._quantiles[(pair, mode)] = float(np.quantile(np.fromiter(hist, float), self.q))

    def quantile(self, pair: Pair, mode: str) -> float | None:
        """The q-quantile of the recorded rates, None before `min_requests` of them."""
        return self._quantiles.get((pair, mode))
