"""Runs of agreement (issue 27's k ramp): a model draft's acceptance by the level above it
depends on how many of its tokens in a row were just accepted.

Teacher forced on the default pool (greedy, the mixed stream's prompts, Sapphire Rapids,
`benchmarks/burst_acceptance.py`), the draft agreed with the target on 46% of positions, but
41% right after a disagreement, 52% after 2 agreements, 75-89% after 5-8: agreement comes in
runs (copied text, a formula, a list), and an iid acceptance estimate over ~200 trials moved k
2 -> 4 -> 7-8 over ~6 cycles while a run lasts ~8 tokens, and kept a long k for a cycle or two
after the run ended.

`BurstModel` learns, per (pair, mode), the acceptance after r accepted tokens in a row
(r = 0 .. `RouterConfig.burst_max_run`, the last bucket for every longer run): decayed counts
(`burst_decay` per trial), each shrunk toward the pair's global alpha by `burst_prior`
pseudo-trials. A request's run of a pair (`RequestState.runs`) is the number of its last
candidates in a row the pair's verifier accepted: a cycle that accepted all n candidates adds n,
one that rejected one resets it to 0; a cycle that did not run the pair at its first verifier
forgets it (what the draft would have said of the tokens between is unknown). Where it is
known, decide() prices the next cycle of the chains that start with the pair by the schedule
g(r), g(r + 1), ... (cost_model.py, point 5), each shifted by the request's own alpha minus
the global one (a request that agrees more than the stream does so in every run length).
Only model drafters' first pairs: a model-free drafter's proposal is all or nothing
(`similarity.acceptance_trials`), and a suffix drafter sizes its own drafts by confidence.
The offsets g(r) - alpha are read as of the published evidence (one computation per
publication), so a decision is a function of its key as the decision cache requires; the key
holds the request's runs (`evidence.decision_key`). `RouterConfig(burst_acceptance=False)`:
iid, as before.
"""

from __future__ import annotations

from collections.abc import Mapping

from specrouter.config import RouterConfig
from specrouter.router.cost_model import RUN
from specrouter.router.similarity import Pair, shrink


def run_key(req, config: RouterConfig) -> tuple:
    """A request's runs as its decisions read them (`RequestState.run_key`; () with
    `burst_acceptance` off): in the decision key, the stream hold, hysteresis."""
    return req.run_key(config.burst_max_run, config.burst_min_run) if config.burst_acceptance else ()


class BurstModel:
    """Acceptance per run length of each (pair, mode) (module docstring)."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.counts: dict[tuple[Pair, str], list[list[float]]] = {}  # -> per run length [accepted, trials]
        self._offsets: dict[tuple[Pair, str], tuple[int, tuple | None]] = {}  # -> (version, offsets)

    def observe(self, pair: Pair, mode: str, run: int, candidates: int, accepted: int) -> int:
        """A cycle's candidates of `pair` (its first verifier judged `candidates`, accepted the
        first `accepted`), the request's run before it `run`; returns the run after it."""
        cfg = self.config
        top = cfg.burst_max_run
        stats = self.counts.get((pair, mode))
        if stats is None:
            stats = self.counts[(pair, mode)] = [[0.0, 0.0] for _ in range(top + 1)]
        judged = min(accepted + 1, candidates)  # the accepted ones and the one rejected
        if judged <= 0:
            return run
        f = cfg.burst_decay ** judged
        for s in stats:
            s[0] *= f
            s[1] *= f
        for i in range(judged):
            s = stats[min(run + i, top)]
            s[0] += float(i < accepted)
            s[1] += 1.0
        return run + candidates if accepted >= candidates else 0

    def observe_row(self, req, chain: tuple[str, ...], k: int, candidates: int, accepted: int, mode: str,
                    model_free: frozenset[str]) -> None:
        """A cycle of `req` (router/request_state.py) ran `chain` at draft length k, its first
        verifier accepting `accepted` of `candidates`: the run of the pair its chain starts with
        (a model drafter's), counted into the acceptance per run length where the run before it
        was known; every other pair's run is forgotten (its draft did not judge the tokens
        between)."""
        first = (chain[0], chain[1]) if len(chain) > 1 and k > 0 and chain[0] not in model_free else None
        run = req.runs.get(first) if first is not None else None
        req.runs.clear()
        if first is None:
            return
        if run is None:
            req.runs[first] = candidates if accepted >= candidates else 0
        else:
            req.runs[first] = self.observe(first, mode, run, candidates, accepted)

    def offsets(self, pair: Pair, mode: str, glob: float, version: int) -> tuple[float, ...] | None:
        """g(r) - glob for r = 0 .. burst_max_run (`glob`: the pair's global alpha), as of the
        published evidence `version` (the router's decisions read published evidence only:
        router/evidence.py), None before any count."""
        hit = self._offsets.get((pair, mode))
        if hit is not None and hit[0] == version:
            return hit[1]
        stats = self.counts.get((pair, mode))
        offsets = None if stats is None else tuple(shrink(a, n, glob, self.config.burst_prior) - glob for a, n in stats)
        self._offsets[(pair, mode)] = (version, offsets)
        return offsets

    def schedules(self, runs: Mapping[Pair, int], mode: str, alphas: Mapping, globs: Mapping[Pair, float],
                  version: int) -> dict:
        """alphas[(drafter, verifier, RUN)] of a request's known runs (cost_model.py, point 5):
        from its run r, g(r), g(r + 1), ... up to the last bucket, each the request's own alpha
        plus the pair's offset at that run length."""
        cfg = self.config
        top, digits = cfg.burst_max_run, cfg.alpha_decimals
        out = {}
        for pair, run in runs.items():
            if run < self.config.burst_min_run:  # after a rejection: the iid estimate (module docstring)
                continue
            offsets = self.offsets(pair, mode, globs[pair], version) if pair in alphas else None
            if offsets is not None:
                a = alphas[pair]
                out[(*pair, RUN)] = tuple(round(min(1.0, max(0.0, a + d)), digits) for d in offsets[min(run, top):])
        return out
