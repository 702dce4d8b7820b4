"""Planning a step's batch (issue 14): every model runs one forward per step over all rows
that need it, padded to the widest row, so a row's speculation costs what it adds to shared
forwards. `plan_batch` weighs joint alternatives by predicted step throughput; `step_seconds`
predicts a step's seconds from the cost profile at the forwards' real rows and widths.
Functions of a `Router` (policy.py), which exposes them as methods."""

from __future__ import annotations

import math
from collections.abc import Sequence

from specrouter.router.records import Chain, Decision, RowContext
from specrouter.router.request_state import RequestState


def plan_batch(router, rows: Sequence[RowContext],
               pinned: Sequence[tuple[Chain, int]] = ()) -> list[Decision]:
    """The plans of a step's rows, chosen for the batch the step really runs.

    Every model runs one forward per step over all rows that need it, padded to the widest
    row, so a row's speculation costs what it adds to shared forwards: a batch of plain rows
    costs the target one 1-token forward of b rows, one speculating row makes it (b, k + 1).
    1. each row's own best plan (`decide`, with cost rows at the step's b);
    2. joint alternatives: every row plain; the speculating rows' k capped at K; only the m
       rows that gain most speculate;
    3. the predicted step throughput of each, sum of E[tokens] / predicted step seconds
       (`step_seconds`: every model's forwards at their real rows and widths, pinned rows
       included); the rows' own plans stay unless an alternative is better by more than
       `persist_margin`, and plain decoding wins unless speculation beats it by that much."""
    decisions = [router.decide(r) for r in rows]
    if not rows:
        return decisions
    L = max(1, sum(r.context_len for r in rows) // len(rows))
    plain = (router.target,)
    reqs = [router.requests.get(r.seq_id) for r in rows]

    def option(plans: list[tuple[Chain, int]]) -> tuple[float, list[tuple[Chain, int]]]:
        tokens = sum(expected_tokens(router, req, c, k) for req, (c, k) in zip(reqs, plans))
        tokens += len(pinned)  # pinned rows commit >= 1 token each, whatever we choose
        return tokens / step_seconds(router, list(plans) + list(pinned), L), plans

    own = [(d.chain, d.k) for d in decisions]
    if all(len(c) == 1 for c, _ in own):
        return decisions
    options = [option(own), option([(plain, 0)] * len(rows))]
    ks = sorted({k for _, k in own if k > 0})
    for cap in (1, 2, 3, 4, 6, 8):
        if cap < ks[-1]:
            options.append(option([(c, min(k, cap)) if k else (c, k) for c, k in own]))
    gain = sorted(range(len(rows)), key=lambda i: -expected_tokens(router, reqs[i], *own[i]))
    spec = [i for i in gain if own[i][1] > 0]
    for m in range(1, len(spec)):
        keep = set(spec[:m])
        options.append(option([own[i] if i in keep else (plain, 0) for i in range(len(rows))]))
    rate_own, rate_plain = options[0][0], options[1][0]
    rate, best = max(options, key=lambda o: o[0])
    margin = 1.0 + router.config.persist_margin
    if rate_plain * margin >= rate:
        best, reason = options[1][1], "batch-plain"
    elif rate_own * margin >= rate:
        return decisions
    else:
        reason = "batch"
    router.batch_events.append((router.similarity.now, len(rows) + len(pinned), reason, rate, rate_plain))
    out = []
    for d, (c, k) in zip(decisions, best):
        if (c, k) != (d.chain, d.k):
            d = Decision(c, k, d.t_eff, reason, d.min_confidence if c == d.chain else 0.0)
        out.append(d)
    return out


def expected_tokens(router, req: RequestState | None, chain: Chain, k: int) -> float:
    """E[target tokens committed per cycle] of a plan, from the request's last PlanTable."""
    if len(chain) == 1 or k == 0 or req is None or req.table is None:
        return 1.0
    i = router._chain_index.get(chain)
    if i is None or k > req.table.expected_tokens.shape[1]:
        return 1.0
    e = float(req.table.expected_tokens[i, k - 1])
    return e if math.isfinite(e) else 1.0


def step_seconds(router, plans: Sequence[tuple[Chain, int]], context_len: int) -> float:
    """Predicted seconds of one engine step running `plans` (one per row): every model's
    forwards at their real rows and padded widths (the verifier at level j of a row with
    draft length k gets at most k + j - 1 candidates), drafting steps, the step overhead."""
    verify: dict[str, list[int]] = {}  # model -> widths of the rows it verifies / drafts (first step)
    draft: dict[str, list[int]] = {}  # model drafter -> draft lengths
    speculative = False
    for chain, k in plans:
        if len(chain) == 1 or k == 0:
            verify.setdefault(chain[-1], []).append(1)
            continue
        speculative = True
        draft.setdefault(chain[0], []).append(k)
        for j, m in enumerate(chain[1:], start=1):
            verify.setdefault(m, []).append(k + j)
    total = router.overhead["spec" if speculative else "plain"]
    for m in router.order:
        ks = draft.get(m, [])
        if m in router.model_free:
            if ks and m in router.profile:
                total += router.predict(m, len(ks), max(ks), context_len)
            continue
        widths = verify.get(m, []) + [1] * len(ks)
        if widths:
            total += router.predict(m, len(widths), max(widths), context_len)
        for i in range(2, max(ks, default=0) + 1):
            total += router.predict(m, sum(1 for k in ks if k >= i), 1, context_len)
    return max(total, 1e-9)
