"""The fused native choice (kernels/noise.cpp `choose_tokens`, reached through
`sampling.choose_at`) against the unfused torch path it replaces on the CPU: the same token at
every position for greedy rows (torch's `max(dim).indices`: the first maximal index, a NaN
first) and for sampling rows (the coupled argmax of the temperature-scaled logits at the
position's key, equal to the materialized reference), in sub-batches of a sampling table,
float32 and float64, strided logits, filtered (-inf) and infinite logits; NaN scores raise."""

from __future__ import annotations

import pytest
import torch

from specrouter.config import SamplingParams
from specrouter.decoding.noise import BLOCK, coupled_argmax_reference, native_ops, position_keys, seed_key
from specrouter.decoding.sampling import SamplingTensors, choose_at, choose_tokens, scaled_logits


@pytest.fixture
def ops():
    if native_ops() is None:
        pytest.skip("native kernels unavailable here")
    return native_ops()


def unfused(logits, st, rows, seeds, positions):
    """The torch path: select the rows, hash the keys, scale, coupled argmax (greedy: argmax)."""
    B, M, _ = logits.shape
    sub = st.select(torch.tensor(rows))
    keys = position_keys(torch.tensor(seeds)[:, None], torch.tensor(positions).view(B, M))
    return choose_tokens(logits, sub, keys)


def reference(logits, st, rows, seeds, positions):
    """Materialized: every token's noise, argmax of scaled scores minus log noise."""
    B, M, V = logits.shape
    sub = st.select(torch.tensor(rows))
    keys = position_keys(torch.tensor(seeds)[:, None], torch.tensor(positions).view(B, M)).reshape(-1)
    out = coupled_argmax_reference(scaled_logits(logits, sub).reshape(B * M, V), keys).view(B, M)
    greedy = sub.temperature == 0
    out[greedy] = logits[greedy].max(-1).indices
    return out


TEMPS = [0.0, 0.7, 1.0, 0.0, 1.3, 0.05, 2.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("V", [5, BLOCK, 1000, 4097, 49152])
def test_native_choice_equals_the_torch_path(ops, V, dtype):
    g = torch.Generator().manual_seed(V)
    st = SamplingTensors.from_params([SamplingParams(temperature=t) for t in TEMPS])
    rows = [4, 1, 0, 2, 6, 5]  # a sub-batch, out of order
    B, M = len(rows), 5
    logits = (torch.randn(B, M, V + 3, generator=g, dtype=torch.float64) * 4).to(dtype)[..., :V]  # strided rows
    logits[1, :, V // 2:] = -torch.inf  # filtered tokens
    logits[2, 0, :] = 0.0  # a flat position: ties (greedy) and a wide search (sampling)
    seeds = [seed_key(100 + b) for b in range(B)]
    positions = [17 * b + 3 * m for b in range(B) for m in range(M)]
    got = choose_at(logits, st, rows, seeds, positions)
    assert got.dtype == torch.long and got.shape == (B, M)
    assert torch.equal(got, unfused(logits, st, rows, seeds, positions))
    assert torch.equal(got, reference(logits, st, rows, seeds, positions))
    # the same call on the native op directly (choose_at took it)
    assert torch.equal(got, ops.choose_tokens(logits, st.temperature, rows, seeds, positions))


def test_greedy_rows_are_torch_max_indices(ops):
    """Ties: the first maximal index (-0.0 == 0.0); a NaN: the first NaN; all -inf: 0."""
    nan, inf = float("nan"), float("inf")
    rows = [[1.0, nan, 3.0, nan], [2.0, 5.0, 5.0, 1.0], [-0.0, 0.0, -1.0, -2.0], [-inf] * 4,
            [inf, 1.0, inf, 2.0], [1.0, 2.0, 3.0, nan]]
    for dtype in (torch.float32, torch.float64):
        x = torch.tensor(rows, dtype=dtype)[:, None, :]  # (6, 1, 4)
        long = torch.randn(6, 1, 300, dtype=dtype).repeat(1, 1, 1)
        long[0, 0, 250] = nan
        long[1, 0, 17] = long[1, 0, 200] = 50.0
        for logits in (x, long):
            st = SamplingTensors.from_params([SamplingParams()] * len(logits))
            got = choose_at(logits, st, list(range(len(logits))), [0] * len(logits), [])
            assert torch.equal(got, logits.max(-1).indices), (got, logits.max(-1).indices)


def test_infinite_logits_in_sampling_rows_go_to_the_first(ops):
    logits = torch.randn(2, 3, 500, dtype=torch.float64)
    logits[0, :, [30, 70, 400]] = torch.inf  # three tied +inf scores, in different blocks
    st = SamplingTensors.from_params([SamplingParams(temperature=0.9)] * 2)
    seeds, positions = [seed_key(1), seed_key(2)], list(range(6))
    got = choose_at(logits, st, [0, 1], seeds, positions)
    assert got[0].tolist() == [30, 30, 30]
    assert torch.equal(got, reference(logits, st, [0, 1], seeds, positions))


def test_nan_scores_raise_in_sampling_rows_only(ops):
    logits = torch.zeros(2, 1, 100)
    logits[1, 0, 3] = float("nan")
    greedy = SamplingTensors.from_params([SamplingParams(), SamplingParams()])
    assert choose_at(logits, greedy, [0, 1], [1, 2], []).tolist() == [[0], [3]]
    sampled = SamplingTensors.from_params([SamplingParams(), SamplingParams(temperature=0.5)])
    with pytest.raises(RuntimeError, match="NaN"):
        choose_at(logits, sampled, [0, 1], [1, 2], [0, 0])
    # a NaN temperature (params corrupted past validation): NaN scores, as the torch path raises
    sampled.temperature[1] = float("nan")
    with pytest.raises(RuntimeError, match="NaN"):
        choose_at(torch.zeros(2, 1, 100), sampled, [0, 1], [1, 2], [0, 0])
    with pytest.raises(RuntimeError, match="NaN"):
        unfused(torch.zeros(2, 1, 100), sampled, [0, 1], [1, 2], [0, 0])
    # an infinite one: uniform over finite logits (as torch), NaN over an infinite logit
    sampled.temperature[1] = float("inf")
    flat = torch.zeros(2, 1, 100)
    assert torch.equal(choose_at(flat, sampled, [0, 1], [1, 2], [0, 0]), unfused(flat, sampled, [0, 1], [1, 2], [0, 0]))
    flat[1, 0, 7] = -float("inf")
    with pytest.raises(RuntimeError, match="NaN"):
        choose_at(flat, sampled, [0, 1], [1, 2], [0, 0])


def test_filters_take_the_torch_path():
    """A top-k / top-p / min-p row in the table: the unfused path (same tokens as before)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 2, 300, generator=g)
    st = SamplingTensors.from_params([SamplingParams(temperature=0.8, top_k=5), SamplingParams(),
                                      SamplingParams(temperature=1.0, min_p=0.1)])
    seeds, positions = [seed_key(b) for b in range(3)], list(range(6))
    got = choose_at(logits, st, [0, 1, 2], seeds, positions)
    assert torch.equal(got, unfused(logits, st, [0, 1, 2], seeds, positions))
    assert got[0].tolist() and set(got[0].tolist()) <= set(logits[0].topk(5).indices.flatten().tolist())
