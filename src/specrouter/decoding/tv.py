"""Total-variation distance between two levels' next-token distributions at the same positions:
the router's similarity signal (docs/design.md, Pillar 1: SimScore = 1 - E[D_TV]).

At a verified position both distributions exist: the verifier's logits from its forward and the
drafter's from the forward that drafted the candidate (a draft model, a draft head, or a lower
verifier passing its output up). `level_tv` compares them for every row of a level at once. Each
row's distributions are its processed ones (`sampling.scaled_logits`: temperature, min-p, top-k,
top-p). Sampled rows only: the router reads no greedy row's D_TV (the executor measures none,
`ChainExecutor.measures_tv`, since session 22), so a greedy row (temperature 0) among the rows
measured is an error; the table's other rows may be greedy. (Greedy rows were compared at
temperature 1, unfiltered: reached only by unit tests after session 22, removed by prune23,
issue 27.)

`tv_rows` (the executor's entry) computes it natively where the kernels are built
(kernels/tv.cpp `tv_rows`: the scaling, min-p, top-k, top-p, both softmaxes and the distance in
three passes over the vocabulary, ~25 us a position on a Sapphire Rapids instead of ~170, and
without the torch path's sort of the vocabulary for top-k / top-p rows); non-CPU logits and
processes without the kernels take the torch path (`level_tv_torch`). Each side's kept set is
the sampler's, bit for bit (kernels/cut.h, shared with sampling.py's native cut; where the
sampler sorts, a nucleus past 4096 of 49152 tokens, the candidates' cut, which may differ only
on a rounding boundary); the distances agree within float rounding (tests/test_tv_native.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from specrouter.decoding.sampling import SamplingTensors, native_filters, scaled_logits


def candidate_mask(num_candidates: torch.Tensor, n: int) -> torch.Tensor:
    """(B, n) bool: position i of row b holds a valid candidate (i < num_candidates[b])."""
    return torch.arange(n, device=num_candidates.device)[None, :] < num_candidates[:, None]


def tv_distance(draft_probs: torch.Tensor, verifier_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) float64: per row, the mean over masked positions of D_TV = 1/2 sum_v |p - q|.

    draft_probs (B, n, V): the proposal distribution at each candidate position; verifier_probs
    (B, >= n, V): the verifier's at the same positions (its extra bonus position is ignored);
    mask (B, n): valid candidates. Rows without any get NaN."""
    n = draft_probs.shape[1]
    if n == 0:
        return torch.full((draft_probs.shape[0],), math.nan, dtype=torch.float64)
    tv = 0.5 * (draft_probs - verifier_probs[:, :n].to(draft_probs.dtype)).abs().sum(-1)  # (B, n)
    m = mask[:, :n].to(torch.float64)
    count = m.sum(1)  # (B,)
    total = (tv.to(torch.float64) * m).sum(1)
    return torch.where(count > 0, total / count.clamp_min(1), torch.full_like(total, math.nan))


def candidate_tv(draft_probs: torch.Tensor, verifier_probs: torch.Tensor, num_candidates: torch.Tensor) -> torch.Tensor:
    """(B,) per-row mean D_TV at a level's valid candidates, from what the executor has at the
    level: draft_probs (B, n, V), verifier_probs (B, n + 1, V), num_candidates (B,). NaN: none."""
    return tv_distance(draft_probs, verifier_probs, candidate_mask(num_candidates, draft_probs.shape[1]))


def tv_from_logits(
    draft_logits: torch.Tensor, verifier_logits: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """`tv_distance` of softmax(logits / temperature): greedy mode's SimScore (temperature 1)."""
    n = draft_logits.shape[1]
    d = torch.softmax(draft_logits.to(torch.float32) / temperature, dim=-1)  # (B, n, V)
    v = torch.softmax(verifier_logits[:, :n].to(torch.float32) / temperature, dim=-1)  # (B, n, V)
    return tv_distance(d, v, mask)


def level_tv(draft_logits: torch.Tensor, verifier_logits: torch.Tensor, num_candidates: torch.Tensor,
             st: SamplingTensors) -> torch.Tensor:
    """(B,) float64 mean D_TV per row between the drafter's and the verifier's processed
    distributions at the row's candidates (module docstring). draft_logits (B, n, V) at the
    candidate positions (right-padded), verifier_logits (B, >= n, V) from the same positions on,
    num_candidates (B,), st: the rows' sampling parameters. NaN for a row without candidates."""
    B, n = draft_logits.shape[:2]
    counts = [min(c, n) for c in num_candidates.tolist()]
    drafts = [[draft_logits[b, i] for i in range(c)] for b, c in enumerate(counts)]
    rows = list(range(B))
    return torch.tensor(tv_rows(drafts, verifier_logits, rows, st, rows), dtype=torch.float64)


def tv_rows(drafts: Sequence[Sequence[torch.Tensor]], verifier: torch.Tensor, vrows: Sequence[int],
            st: SamplingTensors, srows: Sequence[int]) -> list[float]:
    """Per row r, the mean D_TV between `drafts[r][i]` (the drafter's logits (V,) at its
    candidate i) and `verifier[vrows[r], i]` (verifier (B, G, V)) over its candidates, with row
    `srows[r]` of `st`'s sampling parameters: `level_tv` without the stacking and the `select`
    (the executor's entry). NaN for a row without candidates. Every row `srows` names must be
    sampled (temperature > 0: module docstring); a greedy one raises."""
    R = len(drafts)
    assert len(vrows) == R and len(srows) == R, "vrows and srows: one per row"
    if R == 0:
        return []
    ops = _native_ops()
    if ops is not None and (st.needs_sort or st.needs_min_p) and native_filters() is None:
        ops = None  # (the native cut needs torch's own exp: kernels/cut.h)
    if ops is not None and verifier.device.type == "cpu" and st.temperature.device.type == "cpu":
        v = verifier if verifier.dtype == torch.float32 and verifier.stride(-1) == 1 else verifier.float().contiguous()
        flat = [d if d.dtype == torch.float32 and d.is_contiguous() else d.float().contiguous()
                for ds in drafts for d in ds]
        lmp = torch.log(st.min_p) if st.needs_min_p else _EMPTY
        top_k, top_p = (st.top_k, st.top_p) if st.needs_sort else (_EMPTY_LONG, _EMPTY)
        try:
            return ops.tv_rows(flat, v, list(vrows), [len(ds) for ds in drafts], st.temperature, lmp, top_k, top_p,
                               list(srows)).tolist()
        except RuntimeError as e:  # the kernel's checks (TORCH_CHECK) as the torch path raises them
            raise ValueError(str(e).splitlines()[0]) from e
    n = max(len(ds) for ds in drafts)
    draft = verifier.new_zeros((R, max(n, 1), verifier.shape[-1]))  # (R, n, V)
    for r, ds in enumerate(drafts):
        if ds:
            draft[r, : len(ds)] = torch.stack(list(ds))
    rows = torch.tensor(list(vrows), dtype=torch.long, device=verifier.device)
    num = torch.tensor([len(ds) for ds in drafts], dtype=torch.long)
    sub = st.select(torch.tensor(list(srows), dtype=torch.long))
    return level_tv_torch(draft[:, :n], verifier[rows], num, sub).tolist()


def level_tv_torch(draft_logits: torch.Tensor, verifier_logits: torch.Tensor, num_candidates: torch.Tensor,
                   st: SamplingTensors) -> torch.Tensor:
    """`level_tv` in torch ops (the portable path): `scaled_logits`, two softmaxes over the
    vocabulary and `tv_distance`; sampled rows only (a greedy row raises: module docstring)."""
    n = draft_logits.shape[1]
    if st.any_greedy:
        raise ValueError("tv_rows: a greedy row (temperature 0): D_TV is measured for sampled rows only")
    d = torch.softmax(scaled_logits(draft_logits.float(), st), dim=-1)  # (B, n, V)
    v = torch.softmax(scaled_logits(verifier_logits[:, :n].float(), st), dim=-1)  # (B, n, V)
    return tv_distance(d, v, candidate_mask(num_candidates.to(d.device), n))


_EMPTY = torch.empty(0, dtype=torch.float32)
_EMPTY_LONG = torch.empty(0, dtype=torch.long)


def _native_ops():
    """The native kernels' ops (kernels/tv.cpp `tv_rows`) where they are built, else None."""
    from specrouter.models.runners.kernels import rowinv

    return rowinv()
