"""Drafting with a feature-level draft head (models/heads/level.py) inside one executor step.

Positions (EAGLE): the head's step at position p reads the target's feature f_p (what the
target computed after t_0..t_p) with the token t_{p+1}, and returns logits for t_{p+2} and its
prediction of f_{p+1}. A row with n committed tokens has target features for positions
0..n-2 (the target has not yet read its last committed token t_{n-1}: it stays pending), so a
cycle drafts as:
1. catch-up + first draft token: ONE head forward per step over the head rows, row b feeding
   positions h..n-2 (h: what its head cache holds) with the target's features f_h..f_{n-2} and
   the committed tokens t_{h+1}..t_{n-1}; the logits at n-2 give d_1 (position n), the
   predicted feature at n-2 is f^_{n-1};
2. draft steps i = 1..k-1: feed d_i at position n-2+i with the head's own f^_{n-2+i}, giving
   d_{i+1} (position n+i) and the next predicted feature (one forward over the rows still
   drafting: ragged k).
Each row samples its draft tokens like every level (`ChainExecutor._choose`: argmax, or the
row's counter-based noise at that position), so the head only proposes: the target's output
is unchanged whatever it drafts.

Rollback: the head's cache keeps only positions computed from the target's TRUE features and
committed tokens, [0, n-1) after step 1; its draft steps (predicted features) are never kept,
even where the target accepted their tokens, so after a verify the next catch-up re-reads the
target's fresh features of the accepted tokens. A row whose target features do not reach n-1
(its prefill, or steps in which no head drafted and the target kept none) proposes nothing
this cycle, and the target re-feeds the missing positions with features (`refeed_gaps`).
"""

from __future__ import annotations

import torch

from specrouter.decoding.sampling import SamplingTensors
from specrouter.models.runners.base import ForwardBatch
from specrouter.state.features import valid_features


def draft_with_head(ex, name: str, work: list, sampling: SamplingTensors) -> None:
    """Rows of `work` (RowWork, chain[0] == name, k > 0) draft with head `name` (see the module
    docstring); `ex` is the ChainExecutor."""
    if not work:
        return
    state, store = ex.state, ex.state.features
    ready, slots, starts, feeds, feats = [], [], [], [], []
    for w in work:
        w.cand, w.drafted[0] = [], 0
        n = w.start
        tst = state.state(w.seq.seq_id, ex.target)
        if n < 2 or valid_features(tst.features, tst.cache_len) < n - 1:
            continue  # no feature of position n-2 yet: the target feeds it this cycle
        hst = state.state(w.seq.seq_id, name)
        h = min(hst.cache_len, n - 2)
        slots.append(hst.slot)
        starts.append(h)
        feeds.append(w.seq.tokens[h + 1 : n])  # t_{h+1}..t_{n-1}
        feats.append(store.read(tst.slot, h, n - 1))  # (n-1-h, H): f_h..f_{n-2}
        hst.cache_len, hst.speculative = n - 1, []  # the true positions it now holds
        ready.append(w)
    if not ready:
        return
    # 1. catch-up + the first draft token
    batch = ForwardBatch.build(slots, starts, feeds, [[len(f) - 1] for f in feeds])
    features = torch.nn.utils.rnn.pad_sequence(feats, batch_first=True)  # (B, T, H)
    logits, predicted = ex._timed_head(name, batch, features, len(ready))  # (B, 1, V), (B, T, H)
    last = batch.num_tokens - 1  # (B,)
    fhat = predicted[torch.arange(len(ready)), last]  # (B, H): f^_{n-1}
    for w, t, x in zip(ready, ex._choose(logits, ready, sampling)[:, 0].tolist(), logits[:, 0]):
        w.cand, w.cand_logits = [t], [x.clone()] if ex.measures_tv(w) else None
    # 2. draft steps on the head's own features
    active = [b for b, w in enumerate(ready) if w.k > 1]
    i = 1
    while active:
        step = ex.draft_step_started()
        rows = [ready[b] for b in active]
        hslots = [state.state(w.seq.seq_id, name).slot for w in rows]
        batch = ForwardBatch.build(hslots, [w.start - 2 + i for w in rows], [[w.cand[-1]] for w in rows],
                                   [[0]] * len(rows))
        idx = torch.tensor(active)
        logits, predicted = ex._timed_head(name, batch, fhat[idx][:, None], len(rows))  # (B', 1, V), (B', 1, H)
        fhat[idx] = predicted[:, 0].to(fhat.dtype)
        for w, t, x in zip(rows, ex._choose(logits, rows, sampling, offset=i)[:, 0].tolist(), logits[:, 0]):
            w.cand.append(t)
            if w.cand_logits is not None and len(w.cand_logits) < ex.tv_positions:
                w.cand_logits.append(x.clone())
        i += 1
        active = [b for b in active if ready[b].k > i]
        ex.draft_step_done(step)
    for w in ready:
        w.drafted[0] = len(w.cand)
        if w.seq.params.greedy:
            w.proposal = list(w.cand)


def refeed_gaps(ex, work: list) -> None:
    """Before the target's forward in a step where a head drafts: a head row whose stored
    features stop short of the target's cache rolls the target back to them (O(1)), so this
    forward re-feeds the missing positions and keeps their features."""
    for w in work:
        if w.chain[0] in ex.heads:
            tst = ex.state.state(w.seq.seq_id, ex.target)
            tst.cache_len = valid_features(tst.features, tst.cache_len)
