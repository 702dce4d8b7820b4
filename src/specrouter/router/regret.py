"""What speculation has cost a request against plain decoding, and the bound on it.

A single stream's decisions rest on predictions (acceptance estimates, hit rates, the cost
profile); where they are optimistic the cycles they choose realise fewer tokens than predicted.
That happens in exactly the requests speculation cannot help: a new request starts on a prior
(the upper quantile of finished requests' alphas, a draft's size prior), and every cycle that
fails at its first candidate is ONE trial of evidence, so with 8 pseudo-trials of a 0.6 prior a
request whose draft agrees on 5% of tokens needs ~30 cycles before its own estimate turns it
plain, while a model-free drafter corrected by the realized check hands over to the next
optimistic chain. Measured (chat, presence + frequency penalties, 2-core Zen 1): 25 speculative
cycles of one 64-token request at 1.0-1.1 tokens each, 3-7 ms dearer than a plain step each.

`RegretBank` keeps, per request, the seconds its speculative cycles (probes included) cost more
than plain decoding would have for the tokens they committed (the plan table's charged plain
seconds per token at the decision), and the request's elapsed seconds. While the loss exceeds
`RouterConfig.regret_fraction` (2%) of the elapsed seconds plus `regret_allowance` (1) plain
steps (so one unlucky first cycle of a request that gains does not stop it), a single stream decodes plainly
(`Router.decide`, reason "regret"); a request where speculation gains banks the gain, so the
bound never binds there. The loss it allows is the exploration that lets a request show its
own acceptance; beyond it, plain decoding is the safe default the design promises."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class RegretBank:
    """A request's realised loss of speculation against plain decoding (module docstring)."""

    lost: float = 0.0  # seconds: speculative cycles' seconds - plain seconds of their tokens (a gain < 0)
    elapsed: float = 0.0  # seconds of the request's observed steps (prefill included), outside time too

    def observe(self, seconds: float, tokens: int, speculative: bool, t_plain: float) -> None:
        """One step of the request took `seconds` (the executor's wall plus its kind's host
        seconds outside it) for `tokens` committed; `t_plain`: plain decoding's predicted
        seconds per token at its decision (NaN: none)."""
        self.elapsed += seconds
        if speculative and math.isfinite(t_plain):
            self.lost += seconds - t_plain * tokens

    def allows(self, fraction: float, allowance: float) -> bool:
        """May the request speculate: its loss within `fraction` of its elapsed seconds plus
        `allowance` seconds (what one unlucky first cycle of a request that gains may lose)?"""
        return self.lost <= fraction * self.elapsed + allowance
