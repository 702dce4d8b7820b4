"""The fast logits processors (decoding/processors.py: every row's penalties at every position in
one flat pass, the committed history kept incrementally on a PenaltyMemo) equal the reference
(tests/processors_reference.py, the per-call implementation they replaced) BIT FOR BIT: random
batches mixing every control, float32 / float64 / bfloat16 logits, draft paths at every offset,
repeated tokens, signed zeros and -inf; and along a generation where the memo is reused while
tokens are committed (and rolled back). Negative controls: a memo that misses the committed
tokens, and a draft path one position off, must differ from the reference (the comparison can
fail)."""

import random

import pytest
import torch

import processors_reference as ref
from specrouter.config import SamplingParams
from specrouter.decoding import processors as fast

STOPS = frozenset({2, 5})


@pytest.fixture(autouse=True, params=["native", "numpy"])
def penalize_path(request, monkeypatch):
    """Every test on both paths of `penalize`: the native kernel (kernels/penalty.cpp, where
    built) and numpy."""
    if request.param == "numpy":
        monkeypatch.setattr(fast, "NATIVE", False)
    elif fast._native_penalize() is None:
        pytest.skip("native kernels unavailable here")
    return request.param


def random_params(rng: random.Random, V: int) -> SamplingParams:
    kind = rng.choice(["none", "presence", "frequency", "repetition", "all", "negative", "bias", "mixed"])
    kw = {}
    if kind in ("presence", "all", "mixed"):
        kw["presence_penalty"] = rng.choice([0.5, 1.5, 2.0])
    if kind in ("frequency", "all", "mixed"):
        kw["frequency_penalty"] = rng.choice([0.3, 0.8])
    if kind in ("repetition", "all"):
        kw["repetition_penalty"] = rng.choice([1.1, 1.8])
    if kind == "negative":
        kw.update(presence_penalty=-1.0, frequency_penalty=-0.5, repetition_penalty=0.7)
    if kind in ("bias", "mixed"):
        kw["logit_bias"] = ((rng.randrange(V), -100.0), (rng.randrange(V), 3.5))
        kw["min_tokens"] = rng.choice([0, 4])
    if kind == "mixed":
        kw["allowed_token_ids"] = tuple(sorted(rng.sample(range(V), V // 2)))
    return SamplingParams(max_new_tokens=64, **kw)


def random_logits(g: torch.Generator, B: int, G: int, V: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(B, G, V, generator=g, dtype=torch.float64) * 3
    x[torch.rand(B, G, V, generator=g) < 0.05] = 0.0
    x[torch.rand(B, G, V, generator=g) < 0.05] = -0.0
    x[torch.rand(B, G, V, generator=g) < 0.02] = float("-inf")
    return x.to(dtype)


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what) -> None:
    assert got.dtype == want.dtype, what
    # bit patterns: tells -0.0 from 0.0 (and NaNs would compare equal to themselves)
    ints = {torch.float32: torch.int32, torch.float64: torch.int64}[got.dtype]
    assert torch.equal(got.view(ints), want.view(ints)), what


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_fast_processors_equal_the_reference_bit_for_bit(dtype):
    rng, g = random.Random(0), torch.Generator().manual_seed(0)
    for case in range(60):
        V = rng.choice([40, 300])
        B, G = rng.randint(1, 5), rng.randint(1, 9)
        lo = max(1, V // 8)  # small histories so tokens repeat
        rows_fast, rows_ref = [], []
        for _ in range(B):
            params = random_params(rng, V)
            prompt = [rng.randrange(lo) for _ in range(rng.randint(1, 20))]
            out = [rng.randrange(lo) for _ in range(rng.randint(0, 12))]
            offset = rng.randint(0, 4)
            path = [rng.randrange(V if rng.random() < 0.5 else lo) for _ in range(offset + G - 1 + rng.randint(-1, 1))]
            args = (params, prompt + out, len(prompt), STOPS, path, offset)
            rows_fast.append(fast.RowHistory(*args))
            rows_ref.append(ref.RowHistory(*args))
        logits = random_logits(g, B, G, V, dtype)
        assert_bits_equal(fast.process_rows(logits, rows_fast), ref.process_rows(logits, rows_ref), case)


def test_the_full_vocabulary_with_a_long_history():
    rng, g = random.Random(1), torch.Generator().manual_seed(1)
    V, G = 49152, 5
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1)
    prompt = [rng.randrange(V) for _ in range(600)]
    out = [rng.choice(prompt[:50]) for _ in range(200)]
    path = [out[3], prompt[7], 12345, 12345]
    logits = random_logits(g, 2, G, V, torch.float32)
    rows = [(params, prompt + out, len(prompt), STOPS, path, 0), (params, prompt, len(prompt), STOPS, path[:2], 2)]
    got = fast.process_rows(logits, [fast.RowHistory(*a) for a in rows])
    assert_bits_equal(got, ref.process_rows(logits, [ref.RowHistory(*a) for a in rows]), "V=49152")


def generation(memo_update=None, shift=0, rollback=False):
    """A generation of 40 tokens committed 1-4 at a time; at each cycle a drafter's calls (G=1,
    offsets 0..k-1) and a verifier's (G=k+1, offset 0) with the row's memo reused. Yields
    (fast, reference) processed logits of every call."""
    rng, g = random.Random(2), torch.Generator().manual_seed(2)
    V = 120
    params = SamplingParams(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3,
                            logit_bias=((3, 2.0),), min_tokens=5)
    tokens = [rng.randrange(30) for _ in range(15)]
    prompt_len = len(tokens)
    memo = fast.PenaltyMemo()
    if memo_update is not None:
        memo.update = memo_update.__get__(memo)
    while len(tokens) < prompt_len + 40:
        k = rng.randint(1, 4)
        path = [rng.randrange(30) for _ in range(k)]
        calls = [(i, 1) for i in range(k)] + [(0, k + 1)]
        for offset, G in calls:
            logits = random_logits(g, 1, G, V, torch.float32)
            h = (params, list(tokens), prompt_len, STOPS, path, offset)
            got = fast.process_rows(logits, [fast.RowHistory(*h[:5], h[5] + shift, memo=memo)])
            yield got, ref.process_rows(logits, [ref.RowHistory(*h)])
        tokens += path[: rng.randint(0, k)] + [rng.randrange(30)]
        if rollback and rng.random() < 0.3:  # failure isolation: the cycle's tokens go, others come
            del tokens[-2:]
            tokens.append(rng.randrange(30, 60))


@pytest.mark.parametrize("rollback", [False, True])
def test_the_memo_follows_the_committed_tokens(rollback):
    for i, (got, want) in enumerate(generation(rollback=rollback)):
        assert_bits_equal(got, want, i)


def test_negative_controls_a_stale_memo_or_a_shifted_path_differ():
    real = fast.PenaltyMemo.update

    def once(self, tokens, prompt_len):  # counts the first call's tokens, never the later ones
        if not self.counted:
            real(self, tokens, prompt_len)

    assert any(not torch.equal(got, want) for got, want in generation(memo_update=once))
    assert any(not torch.equal(got, want) for got, want in generation(shift=1))


def test_rows_sharing_one_memo_keep_their_own_path_columns():
    """Draft-path tokens outside the history get scratch columns on the row's memo; two rows
    handed the same memo object must not read each other's (the second gets a fresh memo)."""
    g = torch.Generator().manual_seed(3)
    V, G = 200, 4
    params = SamplingParams(presence_penalty=0.9, frequency_penalty=0.4, repetition_penalty=1.2)
    memo = fast.PenaltyMemo()
    prompt, out = [1, 2, 3, 4], [5, 5, 6]
    rows = [(params, prompt + out, len(prompt), STOPS, [150, 151, 152, 5], 1),
            (params, prompt + out, len(prompt), STOPS, [160, 161, 6, 162], 0)]
    logits = random_logits(g, 2, G, V, torch.float32)
    got = fast.process_rows(logits, [fast.RowHistory(*a, memo=memo) for a in rows])
    assert_bits_equal(got, ref.process_rows(logits, [ref.RowHistory(*a) for a in rows]), "shared memo")


def test_in_place_processing_equals_a_copy_and_leaves_other_rows():
    """`process_rows(inplace=True)` (the executor: the forward's fresh logits) returns the logits
    themselves, processed as a copy would be; rows without processors keep their bits."""
    rng, g = random.Random(3), torch.Generator().manual_seed(3)
    V = 300
    for case in range(20):
        B, G = rng.choice([1, 3]), rng.choice([1, 4])
        logits = random_logits(g, B, G, V, torch.float32)
        rows = []
        for b in range(B):
            params = random_params(rng, V) if b or case % 2 else SamplingParams(max_new_tokens=8)
            tokens = [rng.randrange(V) for _ in range(rng.randrange(3, 30))]
            rows.append(fast.RowHistory(params, tokens, rng.randrange(1, 3), STOPS,
                                        [rng.randrange(V) for _ in range(G + 2)], rng.choice([0, 2])))
        want = fast.process_rows(logits, rows)
        before = logits.clone()
        got = fast.process_rows(logits, rows, inplace=True)
        assert got.data_ptr() == logits.data_ptr()
        assert_bits_equal(got, want, case)
        for b, h in enumerate(rows):
            if not h.params.has_processors:
                assert_bits_equal(logits[b], before[b], (case, b))


def test_in_place_on_inference_tensors_outside_inference_mode():
    """The executor's logits come from forwards under inference_mode and are processed outside
    it: in place, penalties and masks alike."""
    g = torch.Generator().manual_seed(4)
    params = SamplingParams(max_new_tokens=8, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                            logit_bias=((3, 2.0),), min_tokens=2)
    h = fast.RowHistory(params, [1, 2, 3, 4, 3], 2, STOPS, [5, 6, 7], 1)
    base = random_logits(g, 1, 3, 50, torch.float32)
    with torch.inference_mode():
        logits = base.clone()
    want = fast.process_rows(base, [h])
    got = fast.process_rows(logits, [h], inplace=True)
    assert got.data_ptr() == logits.data_ptr()
    assert_bits_equal(got, want, "inference")
