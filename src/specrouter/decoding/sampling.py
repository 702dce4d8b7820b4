"""The processed next-token distribution, and sampling from it. Pure tensor functions.

Every level of a chain (drafter, verifiers, target) turns its logits into probabilities with
the SAME `process_logits`, from the SAME per-row `SamplingTensors`; that shared processed
distribution is what speculative verification is lossless with respect to.

Processing order (the transformers / vLLM order), per row:
1. temperature: `logits / temperature`; a row with temperature 0 is greedy and gets a one-hot
   at `argmax(logits)` instead (ties: the lowest index, as `torch.argmax`), whatever its
   top-k / top-p.
2. min_p (`min_p > 0`, vLLM): drop the tokens whose probability is below min_p times the top
   token's, i.e. whose scaled logit is below `max + log(min_p)` (the top token always stays).
3. top-k (`top_k > 0` and `< V`): keep the tokens whose scaled logit is >= the k-th largest.
   Ties with the k-th largest are all kept (as transformers' TopKLogitsWarper), so more than k
   tokens survive only when logits tie exactly.
4. top-p (`top_p < 1`), on the softmax of what top-k kept: sort descending and keep the smallest
   prefix whose cumulative probability is >= top_p (a token is kept iff the mass strictly
   before it is < top_p, so the top token is always kept). Ties: every token whose probability
   equals the smallest kept probability is kept too, so the nucleus never depends on the sort
   order of equal values (it may then hold more mass than the strict smallest set).
5. softmax over the survivors (renormalized); filtered tokens get exactly 0.
Steps 3-4 on CPU tensors find the two thresholds from each row's top 64 values (`topk`, widened
x4 while under a quarter of the vocabulary), not a sort of the vocabulary (2.4-3.4 ms a row of
49152 sorted; `_top_k_top_p_mask_candidates`, row-invariant: a row's output does not depend on
the other rows and positions of the call); where the native kernels are built, the same cut bit
for bit in one native call (kernels/cut.h: `_top_k_top_p_mask_native`, and fused with the
sampling in `choose_at`; torch's float32 exp is MKL's, which the kernel calls too; a top-p row's
mass denominator is the whole row's in fixed point, `_row_mass`, exact in any order); elsewhere,
and for a row whose cuts lie past that, the sort (`_top_k_top_p_mask_sort`, the reference). The
nucleus mass is summed differently by the candidates and the sort, so
the kept sets may differ where a mass before a token lies within float rounding of top_p (seen:
1e-5 near 0.95 over ~1300 tokens; the sort path's float32 softmax is itself that far from the
float64 mass). Every level of a chain and plain decoding call the same function on the same
device, so their filtered sets, and the sampled tokens, are identical.
Logits processors that depend on the history (penalties, min_tokens) or on token sets
(logit_bias, allowed_token_ids) run before, on the raw logits (`processors.py`).

Dtype rule: computation and output are float32, or float64 when the logits are float64 (the
per-row parameters are stored as float32 and cast to the compute dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specrouter.config import SamplingParams
from specrouter.decoding import noise as noise_module
from specrouter.decoding.noise import check_tokens, coupled_argmax, native_ops, position_keys


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of a batch, as tensors on the logits' device, plus Python
    flags so that `process_logits` can take fast paths without a host sync."""

    temperature: torch.Tensor  # (B,) float32: 0 = greedy row
    top_k: torch.Tensor  # (B,) int64: 0 = no top-k filter
    top_p: torch.Tensor  # (B,) float32: 1.0 = no nucleus filter
    min_p: torch.Tensor  # (B,) float32: 0.0 = no min-p filter
    all_greedy: bool  # every row has temperature 0: process_logits is a one-hot argmax
    any_greedy: bool  # some row has temperature 0
    needs_sort: bool  # some non-greedy row uses top-k or top-p (else the sort is skipped)
    needs_min_p: bool = False  # some non-greedy row uses min_p

    @staticmethod
    def from_params(params: list[SamplingParams], device: torch.device | str = "cpu") -> "SamplingTensors":
        """One row per entry of `params` (a request may appear in several rows)."""
        assert len(params) > 0, "a batch needs at least one row"
        greedy = [p.temperature == 0.0 for p in params]
        filtered = [(not g) and (p.top_k > 0 or p.top_p < 1.0) for p, g in zip(params, greedy)]
        return SamplingTensors(
            temperature=torch.tensor([float(p.temperature) for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            top_p=torch.tensor([float(p.top_p) for p in params], dtype=torch.float32, device=device),
            min_p=torch.tensor([float(p.min_p) for p in params], dtype=torch.float32, device=device),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            needs_sort=any(filtered),
            needs_min_p=any((not g) and p.min_p > 0 for p, g in zip(params, greedy)),
        )

    def __len__(self) -> int:
        return self.temperature.shape[0]

    def select(self, rows: torch.Tensor) -> "SamplingTensors":
        """The sub-batch of `rows` (int64 indices or a (B,) bool mask), in that order. The flags
        are inherited when that decides them, else recomputed (one small host sync)."""
        rows = rows.to(self.temperature.device)
        temperature, top_k, top_p = self.temperature[rows], self.top_k[rows], self.top_p[rows]
        min_p = self.min_p[rows]
        greedy = temperature == 0
        if self.all_greedy or not self.any_greedy:
            all_greedy, any_greedy = self.all_greedy, self.any_greedy
        else:
            all_greedy, any_greedy = bool(greedy.all()), bool(greedy.any())
        needs_sort = self.needs_sort and not all_greedy
        if needs_sort:
            needs_sort = bool((~greedy & ((top_k > 0) | (top_p < 1.0))).any())
        needs_min_p = self.needs_min_p and not all_greedy and bool((~greedy & (min_p > 0)).any())
        return SamplingTensors(temperature, top_k, top_p, min_p, all_greedy, any_greedy, needs_sort,
                               needs_min_p)


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _one_hot_argmax(x: torch.Tensor) -> torch.Tensor:
    """One-hot at argmax over the last dim (ties: lowest index), same shape and dtype."""
    return torch.zeros_like(x).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)


def _min_p_mask(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """x: (B, M, V) temperature-scaled logits, min_p (B,). Tokens whose probability is below
    min_p * the top probability (scaled logit < max + log(min_p)) set to -inf."""
    B = x.shape[0]
    log_min_p = torch.log(min_p.to(x.dtype)).view(B, 1, 1)  # -inf for rows with min_p = 0
    thr = x.amax(dim=-1, keepdim=True) + log_min_p  # (B, M, 1)
    return x.masked_fill(x < thr, float("-inf"))


FORCE_SORT = False  # tests / benchmarks: every call takes the sort path (the reference)
NATIVE = True  # tests / benchmarks: False keeps CPU calls on the torch candidate path (the native cut's reference)
_CANDIDATES = 64  # the candidate path's first set (the top 64 of a row), widened x4
_CANDIDATE_SHARE = 4  # ... while 4 x the set fits in the row (else the sort path: it is faster there)


def _top_k_top_p_mask(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """x: (B, M, V) temperature-scaled logits. Returns x with filtered tokens set to -inf: the
    candidate path on CPU tensors (no sort of the vocabulary), the sort path elsewhere (CUDA:
    no host sync) or where a row's cut is not within a quarter of the vocabulary."""
    if not FORCE_SORT and x.device.type == "cpu":
        ops = native_filters() if x.dtype == torch.float32 else None
        out = (_top_k_top_p_mask_native(ops, x, top_k, top_p) if ops is not None
               else _top_k_top_p_mask_candidates(x, top_k, top_p))
        if out is not None:
            return out
    return _top_k_top_p_mask_sort(x, top_k, top_p)


_EXP_CHECKED: dict[int, bool] = {}


def native_filters():
    """The native kernels' ops where they compute the candidate path's cut (kernels/cut.h: it
    needs torch's own float32 exp, MKL's, checked once against torch.exp here), else None."""
    if not NATIVE:
        return None
    ops = native_ops()
    if ops is None:
        return None
    key = id(ops)
    if key not in _EXP_CHECKED:
        ok = bool(ops.has_torch_exp())
        if ok:
            g = torch.Generator().manual_seed(0)
            t = torch.cat([(torch.randn(4093, generator=g) * 12.0 - 8.0).clamp(max=0.0),
                           torch.tensor([0.0, -0.0, float("-inf"), -87.5, -103.9, -104.0, -150.0])])
            ok = torch.equal(ops.torch_exp(t), torch.exp(t))
        _EXP_CHECKED[key] = ok
    return ops if _EXP_CHECKED[key] else None


def _top_k_top_p_mask_native(ops, x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor | None:
    """`_top_k_top_p_mask_candidates` in one native call (kernels/cut.h: the same cut, bit for
    bit; each row on its own: row-invariant); rows whose cut the candidate path finds by sorting
    are sorted here alone, as there. None (the sort path for the whole call) on NaN scores."""
    B, M, V = x.shape
    N = B * M
    xr = x.reshape(N, V)
    k = top_k.view(B, 1).expand(B, M).reshape(N).contiguous()
    p = top_p.to(torch.float32).view(B, 1).expand(B, M).reshape(N).contiguous()
    out, status = ops.top_k_top_p_mask(xr, k, p)
    if bool((status != 0).any()):
        if bool((status == 2).any()):
            return None
        for i in torch.nonzero(status == 1).flatten().tolist():
            out[i] = _top_k_top_p_mask_sort(xr[i].view(1, 1, V), k[i:i + 1], p[i:i + 1].to(top_p.dtype))[0, 0]
    return out.view(B, M, V)


def _row_mass(e: torch.Tensor) -> torch.Tensor:
    """sum(e) of a row's exponentials e (V,) in fixed point: round(e * 2^S) summed as int64 (exact,
    so the same in any order: torch's and kernels/cut.h's `row_mass`), times 2^-S; S = 62 - the
    bit length of V (the rounding adds at most V * 2^-(S+1): 3.5e-10 of a mass >= 1 at V = 49152)."""
    S = 62 - e.shape[-1].bit_length()
    total = (e * 2.0 ** S).round().to(torch.int64).sum()
    return (total.to(torch.float64) * 2.0 ** -S).to(e.dtype)


def _exp_rows(t: torch.Tensor) -> torch.Tensor:
    """exp of (N, K) t, each row's values the same whatever N: one call while it is one chunk of
    torch's elementwise loop (no thread split; K a multiple of the vector width), else a call per
    row (a split can put a row's elements in a chunk's scalar tail, whose exp may differ by an ulp)."""
    N, K = t.shape
    if N * K <= 32768 or N == 1:  # at::internal::GRAIN_SIZE
        return torch.exp(t)
    return torch.stack([torch.exp(row) for row in t])


def _top_k_top_p_mask_candidates(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor | None:
    """`_top_k_top_p_mask_sort`'s kept set from each row's top K values (`topk`), K widened (x4)
    until every row's cuts lie inside them; rows whose cuts are not inside by K = V / 4
    (`_CANDIDATE_SHARE`) take the sort path, alone. The top-k threshold is the k-th candidate;
    top-p's mass is the candidates' exp(t - max) over z, cumulated (mass before = cumsum - p, the
    sort path's formula); z is the sum of exp(t - max) over the row's top-k survivors: the
    candidates' prefix sum at the last survivor (cumsum: sequential per row) for top-k rows, else
    the whole row's sum, one row at a time. Each row's result is thus ROW-INVARIANT: bit for bit
    the same whatever K and whatever other rows or positions share the call (plain decoding calls
    it with 1 x 1, verification with R rows x k+1 positions). The kept set can differ from the
    sort path's only where a mass before a token lands within float rounding of top_p (module
    docstring). Every CPU call takes this path (FORCE_SORT aside), so plain decoding and every
    level of a chain filter identically. None (the sort path for the whole call) on NaN scores."""
    B, M, V = x.shape
    N = B * M
    xr = x.reshape(N, V).contiguous()  # (N, V): every row contiguous
    k = top_k.view(B, 1).expand(B, M).reshape(N, 1)
    k_on = (k > 0) & (k < V)  # (N, 1)
    p = top_p.to(x.dtype).view(B, 1).expand(B, M).reshape(N, 1)
    p_on = p < 1.0
    neg_inf = torch.tensor(float("-inf"), dtype=x.dtype)
    kmax = int(torch.where(k_on, k, 0).max())  # one host sync (CPU: free)
    K = _CANDIDATES
    while K < kmax and _CANDIDATE_SHARE * 4 * K <= V:
        K *= 4
    whole_z = None  # (N, 1): the whole row's sum of exp(t - max) for top-p rows without top-k
    while True:
        K = min(K, V)
        vals = xr.topk(K, dim=-1).values  # (N, K), descending: its prefix does not depend on K
        mx = vals[:, :1]  # (N, 1)
        if bool(mx.isnan().any()):
            return None  # NaN scores: the sort path keeps them (and the sampler raises)
        thr_k = torch.where(k_on, vals.gather(-1, k.clamp(1, K) - 1), neg_inf)  # (N, 1)
        survives = (vals >= thr_k) & (vals > neg_inf)  # (N, K)
        covered = ~survives[:, -1:] | (K == V)  # every survivor of top-k (and min-p) is a candidate
        e = _exp_rows(vals - mx).masked_fill_(~survives, 0.0)  # (N, K)
        last = (survives.sum(-1, keepdim=True) - 1).clamp(min=0)  # (N, 1): the last survivor among them
        z = e.cumsum(dim=-1).gather(-1, last)  # top-k rows (covered): the survivors' sum
        whole = p_on & ~k_on
        if bool(whole.any()):
            if whole_z is None:
                whole_z = torch.ones(N, 1, dtype=x.dtype)
                for i in torch.nonzero(whole.view(-1)).flatten().tolist():  # per row: its own exp
                    whole_z[i] = _row_mass(torch.exp(xr[i] - mx[i]))
            z = torch.where(whole, whole_z, z)
        probs = e / z
        mass_before = probs.cumsum(dim=-1) - probs  # exactly 0 at i = 0
        # the prefix before the first mass >= p (not a count: a mass one ulp under p after it, in
        # float rounding, must not move the cut, nor make it depend on K)
        num_kept = (mass_before < p).cumprod(dim=-1).sum(dim=-1, keepdim=True).clamp(1, K)  # (N, 1)
        resolved = (~k_on | ((k <= K) & covered)) & (~p_on | (num_kept < K) | covered)  # (N, 1)
        widen = _CANDIDATE_SHARE * min(4 * K, V) <= V and K < V
        if bool(resolved.all()) or not widen:
            break
        K *= 4
    thr_p = torch.where(p_on, vals.gather(-1, num_kept - 1), neg_inf)  # the smallest kept value
    # keep t >= thr as t > the float below thr (F.threshold: a per-row scalar, ~10x faster than
    # a compare and masked_fill over the row)
    below = torch.nextafter(torch.maximum(thr_k, thr_p), neg_inf).view(-1).tolist()
    out = xr.clone()
    for i, th in enumerate(below):
        if th != float("-inf"):
            torch.nn.functional.threshold_(out[i], th, float("-inf"))
    rest = torch.nonzero(~resolved.view(-1)).flatten()
    if len(rest):  # cuts past the widest set: those rows sorted, each alone
        for i in rest.tolist():
            out[i] = _top_k_top_p_mask_sort(xr[i].view(1, 1, V), k[i], p[i].to(top_p.dtype))[0, 0]
    return out.view(B, M, V)


def _top_k_top_p_mask_sort(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The reference (and the CUDA path): sort the vocabulary. x: (B, M, V) temperature-scaled
    logits. Returns x with filtered tokens set to -inf."""
    B, M, V = x.shape
    sorted_x = x.sort(dim=-1, descending=True).values  # (B, M, V)
    # top-k: threshold = the k-th largest scaled logit (k = V when disabled)
    k = top_k.view(B, 1, 1)
    k = torch.where((k <= 0) | (k > V), V, k)
    thr_k = sorted_x.gather(-1, (k - 1).expand(B, M, 1))  # (B, M, 1)
    sorted_x = sorted_x.masked_fill(sorted_x < thr_k, float("-inf"))
    # top-p on what top-k kept: keep sorted position i iff the mass before it is < top_p
    sorted_probs = sorted_x.softmax(dim=-1)  # (B, M, V)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # (B, M, V); exactly 0 at i = 0
    p = top_p.to(x.dtype).view(B, 1, 1)
    num_kept = (mass_before < p).sum(dim=-1, keepdim=True).clamp(1, V)  # (B, M, 1), >= 1
    num_kept = torch.where(p >= 1.0, V, num_kept)  # disabled rows: float error must not cut tokens
    thr_p = sorted_x.gather(-1, num_kept - 1)  # (B, M, 1): the smallest kept logit
    thr = torch.maximum(thr_k, thr_p)  # (B, M, 1)
    return x.masked_fill(x < thr, float("-inf"))  # ties with the threshold survive


def scaled_logits(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """logits (B, ..., V) -> the processed distribution's log-probabilities up to a per-position
    constant (B, ..., V): temperature-scaled logits, -inf where top-k / top-p filter. Greedy rows
    get their logits unchanged (their processed distribution is a one-hot at the argmax). Same
    dtype rule as `process_logits`; softmax of it is `process_logits` for non-greedy rows."""
    B, V = logits.shape[0], logits.shape[-1]
    assert len(st) == B, f"{len(st)} sampling rows for {B} logit rows"
    x = logits.to(_compute_dtype(logits)).reshape(B, -1, V)  # (B, M, V)
    if st.all_greedy:
        return x.reshape(logits.shape)
    temperature = st.temperature.to(x.dtype).view(B, 1, 1)
    scaled = x / torch.where(temperature == 0, 1.0, temperature)  # (B, M, V)
    if st.needs_min_p:
        scaled = _min_p_mask(scaled, st.min_p)
    if st.needs_sort:
        scaled = _top_k_top_p_mask(scaled, st.top_k, st.top_p)
    return scaled.reshape(logits.shape)


def choose_tokens(logits: torch.Tensor, st: SamplingTensors, keys: torch.Tensor | None) -> torch.Tensor:
    """The token every position samples, with counter-based noise (`noise.py`): logits
    (B, M, V), keys (B, M) int64 position keys (None when every row is greedy) -> (B, M) int64.
    Greedy rows: argmax (ties: lowest index); sampling rows: argmax(scaled - log E(key)), an exact
    sample of `process_logits`, the same at every level for the same key (the coupling)."""
    B, M, V = logits.shape
    if st.all_greedy:
        return greedy(logits)  # (B, M)
    if not st.any_greedy:
        return coupled_argmax(scaled_logits(logits, st).reshape(B * M, V), keys.reshape(-1)).view(B, M)
    tokens = greedy(logits)  # (B, M)
    rows = torch.nonzero(st.temperature != 0).flatten()
    scores = scaled_logits(logits[rows], st.select(rows)).reshape(-1, V)  # (R*M, V)
    noisy = coupled_argmax(scores, keys[rows].reshape(-1)).view(len(rows), M)
    tokens[rows] = noisy
    return tokens


def choose_at(logits: torch.Tensor, st: SamplingTensors, rows: list[int], seed_keys: list[int],
              positions: list[int]) -> torch.Tensor:
    """`choose_tokens` with each position's key given by its row's seed key and its position, on
    the host: logits (B, M, V), row b of them being row `rows[b]` of `st` (a sub-batch without
    `select`), `seed_keys` (B) 32-bit keys, `positions` (B*M, row-major) each token's position
    -> (B, M) int64 host tokens. One native call (kernels/noise.cpp `choose_tokens`: the keys,
    the temperature, the rows' top-k / top-p / min-p cut (kernels/cut.h, the candidate path's,
    bit for bit) and the coupled argmax fused, the same tokens as below) for CPU logits, float32
    where a row of `st` filters; else (or where a row's cut needs the sort) the keys are hashed
    here and `choose_tokens` serves (a NaN score raises in both)."""
    B, M, _ = logits.shape
    filters = st.needs_sort or st.needs_min_p
    ops = native_filters() if filters and logits.dtype == torch.float32 else None if filters else native_ops()
    if filters and noise_module._use_triton(logits):
        ops = None  # the Triton noise (CUDA; tests force it on the CPU): `choose_tokens` below
    if (ops is not None and logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64)
            and logits.stride(-1) == 1 and st.temperature.device.type == "cpu"):
        cut = ()
        if filters:
            cut = (torch.log(st.min_p) if st.needs_min_p else None,
                   st.top_k if st.needs_sort else None, st.top_p if st.needs_sort else None)
        tokens = ops.choose_tokens(logits, st.temperature, rows, seed_keys, [] if st.all_greedy else positions, *cut)
        if not filters or not bool((tokens < 0).any()):
            return tokens
    dev = logits.device
    if rows == list(range(len(st))):
        sub = st
    else:
        sub = st.select(torch.tensor(rows, dtype=torch.long, device=st.temperature.device))
    keys = None
    if not sub.all_greedy:
        seeds = torch.tensor(seed_keys, dtype=torch.long, device=dev)[:, None]  # (B, 1)
        keys = position_keys(seeds, torch.tensor(positions, dtype=torch.long, device=dev).view(B, M))  # (B, M)
    # the tokens come to the host once per forward (the next level's feed is built from them);
    # the GPU's noise marks a row with NaN scores -1 rather than sync to raise: raised here
    tokens = choose_tokens(logits, sub, keys).cpu()
    return tokens if keys is None else check_tokens(tokens)


def process_logits(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """logits (B, ..., V) -> processed probabilities (B, ..., V), float32 (float64 for float64
    logits). Row b uses the parameters of row b of `st` at every middle position (for example
    all drafted positions of a verification forward). See the module docstring for the rules."""
    B, V = logits.shape[0], logits.shape[-1]
    assert len(st) == B, f"{len(st)} sampling rows for {B} logit rows"
    x = logits.to(_compute_dtype(logits)).reshape(B, -1, V)  # (B, M, V)
    if st.all_greedy:
        return _one_hot_argmax(x).reshape(logits.shape)
    temperature = st.temperature.to(x.dtype).view(B, 1, 1)
    greedy_rows = temperature == 0  # (B, 1, 1)
    scaled = x / torch.where(greedy_rows, 1.0, temperature)  # (B, M, V)
    if st.needs_min_p:
        scaled = _min_p_mask(scaled, st.min_p)
    if st.needs_sort:
        scaled = _top_k_top_p_mask(scaled, st.top_k, st.top_p)
    probs = scaled.softmax(dim=-1)  # (B, M, V)
    if st.any_greedy:
        probs = torch.where(greedy_rows, _one_hot_argmax(x), probs)
    return probs.reshape(logits.shape)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """probs (..., V), rows need not be exactly normalized -> tokens (...) int64, one draw per
    row with `torch.multinomial` from `generator` (reproducible for a seeded generator; zero
    probability tokens are never drawn, so a one-hot row always yields its index)."""
    V = probs.shape[-1]
    flat = probs.reshape(-1, V)  # (N, V)
    if flat.shape[0] == 0:
        return torch.zeros(probs.shape[:-1], dtype=torch.long, device=probs.device)
    if flat.dtype not in (torch.float32, torch.float64):
        flat = flat.float()
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits (..., V) -> argmax tokens (...) int64 (ties: the lowest index). `max(dim).indices`
    is `argmax` (the first maximal index, NaN the maximum; tests/test_sampling.py) at about a
    third of its time on the CPU (torch 2.13, 2 threads: 0.41 vs 1.15 ms over 33 x 49152
    float32 logits, a 32-node tree's verification; 0.033 vs 0.068 ms over one position)."""
    return logits.max(dim=-1).indices
