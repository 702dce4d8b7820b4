"""Reading llguidance's packed masks (decoding/grammar.py, session 26): numpy's unpack equals
the shift-and-mask reading bit t % 32 of word t // 32, at any vocabulary cut; `any_allowed`
looks only below the vocabulary (negative control: a bit past it alone allows nothing)."""

import numpy as np
import pytest
import torch

from specrouter.decoding import grammar as grammar_mod
from specrouter.decoding.grammar import any_allowed, unpack_bitmask


def shifted(bits, vocab):
    shifts = torch.arange(32, dtype=torch.int32)
    return ((bits[:, :, None] >> shifts) & 1).view(bits.shape[0], -1)[:, :vocab].bool()


@pytest.mark.parametrize("vocab", [320, 331, 49152])
def test_unpacked_bits_are_the_tokens(vocab):
    g = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32 + 1
    bits = torch.randint(-2**31, 2**31 - 1, (3, words), dtype=torch.int32, generator=g)
    bits[1] = 0
    bits[2] = -1
    got = unpack_bitmask(bits, vocab)
    assert got.dtype == torch.bool and got.shape == (3, vocab)
    assert torch.equal(got, shifted(bits, vocab))
    one = torch.zeros((1, words), dtype=torch.int32)
    one[0, 7 // 32] = 1 << 7
    assert unpack_bitmask(one, vocab)[0].nonzero().flatten().tolist() == [7]


def test_the_big_endian_path_reads_the_same(monkeypatch):
    bits = torch.randint(-2**31, 2**31 - 1, (2, 11), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    little = unpack_bitmask(bits, 340)
    monkeypatch.setattr(grammar_mod, "LITTLE_ENDIAN", False)
    assert torch.equal(unpack_bitmask(bits, 340), little)


def test_any_allowed_looks_below_the_vocabulary_only():
    words = np.zeros(11, dtype=np.int32)
    assert not any_allowed(words, 340)
    words[10] = 1 << 3  # token 323 < 340
    assert any_allowed(words, 340)
    words[10] = 1 << 20  # token 340: past the vocabulary
    assert not any_allowed(words, 340)
    assert any_allowed(words, 341)
    words[:] = 0
    words[2] = np.int32(-2**31)  # token 95 (the sign bit)
    assert any_allowed(words, 96) and not any_allowed(words, 95)
