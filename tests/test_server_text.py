"""server/text.py and models/tokenizer.py: incremental detokenization.

The streamed text (the deltas of `TextStream.add` + `finish`) equals the full decode of the
output, cut before the first stop string, for byte-level tokens that split multi-byte UTF-8
characters, for random token ids (special tokens, invalid byte sequences), for a SentencePiece-
style tokenizer whose decoder drops the first token's leading space, in every chunking; and the
work per event is bounded (a window, not the whole output: the decode was quadratic)."""

import random

import pytest

from specrouter.models.tokenizer import IncrementalDecoder
from specrouter.server.text import TextStream

TRICKY = ["héllo wörld", "naïve café — 東京タワー 🗼 ok", "🙂🙃 emoji 👩‍👩‍👧 family", "日本語のテキスト。",
          "mixed ascii and 한국어 and Ελληνικά", "\u00e9\u0301 combining", "tab\tnewline\n😀end"]


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    """A byte-level BPE tokenizer (as SmolLM2's, GPT-2's, Llama 3's)."""
    from fixtures import make_tiny_tokenizer
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("bl")
    make_tiny_tokenizer(out)
    return AutoTokenizer.from_pretrained(out)


@pytest.fixture(scope="module")
def sentencepiece_like():
    """Llama-2-style: Metaspace '▁' for spaces, byte fallback <0xNN> tokens, a decoder that strips
    the leading space of the decoded sequence (so decoding a window from the middle differs)."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for w in ["▁", "▁hello", "▁world", "▁caf", "é", "▁the", "▁a", "b", "c", "▁stop", "STOP"]:
        vocab.setdefault(w, len(vocab))
    model = models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def byte_level_chars() -> dict[int, str]:
    """GPT-2's byte -> character map of byte-level BPE vocabularies."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokens(tok, text: str) -> list[int]:
    """One token per UTF-8 byte of `text`: every multi-byte character is split across tokens."""
    chars = byte_level_chars()
    ids = tok.convert_tokens_to_ids([chars[b] for b in text.encode("utf-8")])
    assert None not in ids and tok.unk_token_id not in ids
    return ids


def fallback_tokens(tok, text: str) -> list[int]:
    return tok.convert_tokens_to_ids([f"<0x{b:02X}>" for b in text.encode("utf-8")])


def chunked(ids: list[int], rng: random.Random) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3, 5])
        out.append(ids[i:i + n])
        i += n
    return out


def stream(tok, ids, chunks, stops=()):
    ts = TextStream(tok, list(stops))
    parts = [ts.add(c) for c in chunks] + [ts.finish()]
    assert ts.token_ids == ids or ts.stopped
    return parts, ts


def reference(tok, ids, stops=()) -> str:
    text = tok.decode(ids, skip_special_tokens=True)
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return text[:min(hits)] if hits else text


def sequences(tok, rng, split):
    """Token sequences mixing ordinary encodings with byte-split characters."""
    for text in TRICKY:
        yield split(tok, text)
        yield tok.encode(text, add_special_tokens=False)
        mixed = []
        for word in text.split(" "):
            piece = split(tok, word) if rng.random() < 0.5 else tok.encode(" " + word, add_special_tokens=False)
            mixed += piece
        yield mixed


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece_like"])
def test_streamed_text_equals_the_full_decode(kind, request):
    tok = request.getfixturevalue(kind)
    split = byte_tokens if kind == "byte_level" else fallback_tokens
    rng = random.Random(0)
    checked = 0
    for ids in sequences(tok, rng, split):
        for _ in range(4):
            parts, _ = stream(tok, ids, chunked(ids, rng))
            assert "".join(parts) == tok.decode(ids, skip_special_tokens=True), (kind, ids)
            # a split character is held back whole: no delta shows half of one
            assert all("\ufffd" not in p for p in parts)
            dec = IncrementalDecoder(tok)  # the API's decoder (SpecRouter.stream), the same
            assert "".join([dec.add(c) for c in chunked(ids, rng)] + [dec.finish()]) == dec.text
            assert dec.text == tok.decode(ids, skip_special_tokens=True)
            checked += 1
    assert checked >= 80


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece_like"])
def test_random_ids_special_tokens_and_invalid_bytes(kind, request):
    """Any ids at all: lone continuation bytes, truncated sequences, special tokens. (For byte
    fallback only the non-byte tokens and whole characters: its decoder turns a run of <0xNN>
    tokens that is not valid UTF-8 into one U+FFFD per token, valid bytes before the bad one
    included, so a later token changes text already final; no stream can take that back.)"""
    tok = request.getfixturevalue(kind)
    rng = random.Random(1)
    for ids in random_ids(tok, kind, rng, 150):
        parts, _ = stream(tok, ids, chunked(ids, rng))
        assert "".join(parts) == tok.decode(ids, skip_special_tokens=True), ids


def random_ids(tok, kind, rng, n):
    """`n` random id sequences of up to 30 pieces: any token (special ones, lone continuation
    bytes, truncated sequences); for byte fallback the non-byte tokens and whole characters."""
    if kind == "byte_level":
        pieces = [[i] for i in range(len(tok))]
    else:
        pieces = [[i] for i in range(len(tok)) if not tok.convert_ids_to_tokens(i).startswith("<0x")]
        pieces += [fallback_tokens(tok, ch) for ch in "é東🙂a\n"]
    for _ in range(n):
        yield [i for _ in range(rng.randrange(1, 30)) for i in rng.choice(pieces)]


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece_like"])
def test_stop_strings_cut_the_stream_exactly(kind, request):
    tok = request.getfixturevalue(kind)
    split = byte_tokens if kind == "byte_level" else fallback_tokens
    rng = random.Random(2)
    cases = [("naïve café 東京 STOP more", ["STOP"]), ("ab東京cd", ["京c"]), ("a 🙂 b 🙂 c", ["🙂 c", "b 🙂"]),
             ("hello world", ["xyz"]), ("the cat sat", ["t s", "cat"]), ("日本語", ["語"])]
    for text, stops in cases:
        for ids in (split(tok, text), tok.encode(text, add_special_tokens=False)):
            for _ in range(5):
                parts, ts = stream(tok, ids, chunked(ids, rng), stops)
                want = reference(tok, ids, stops)
                assert "".join(parts) == want, (text, stops)
                assert ts.stopped == (want != tok.decode(ids, skip_special_tokens=True))
                assert ts.sent == want
    # negative control: the reference does cut (the assertion above could not pass by accident)
    ids = byte_tokens(tok, "a STOP b") if kind == "byte_level" else fallback_tokens(tok, "a STOP b")
    assert "".join(stream(tok, ids, [ids], ["STOP"])[0]) == "a "


def test_the_work_per_event_is_a_window_not_the_whole_output(byte_level):
    """Decoding one token at a time touches O(n) tokens in all, not n^2 / 2 as a decode of the
    whole output per event did."""
    decoded = []

    class Counting:
        def decode(self, ids, **kw):
            decoded.append(len(ids))
            return byte_level.decode(ids, **kw)

    ids = []
    for text in TRICKY * 20:
        ids += byte_tokens(byte_level, text + " ")
    n = len(ids)
    ts = TextStream(Counting(), ["never appears"])
    out = "".join([ts.add([i]) for i in ids] + [ts.finish()])
    assert out == byte_level.decode(ids, skip_special_tokens=True)
    assert sum(decoded) <= 12 * n, (sum(decoded), n)
    # negative control: the whole-output decode per event is far over the bound at this length
    assert n * (n + 1) // 2 > 20 * 12 * n


class Counted:
    """`tok` with its decode calls counted: transformers' Python `decode` (`wrapper`) and its
    Rust tokenizer's (`rust`); `fast=False` hides the Rust tokenizer (the slow path)."""

    def __init__(self, tok, fast: bool = True, clean_up: bool | None = None):
        self.tok, self.wrapper, self.rust = tok, 0, 0
        self.is_fast = fast
        self.clean_up_tokenization_spaces = tok.clean_up_tokenization_spaces if clean_up is None else clean_up
        outer = self

        class Backend:
            decoder = tok.backend_tokenizer.decoder

            def decode(self, ids, skip_special_tokens=False):
                outer.rust += 1
                return tok.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

        self.backend_tokenizer = Backend()

    def decode(self, ids, **kw):
        self.wrapper += 1
        return self.tok.decode(ids, **kw)


def awkward(tok, kind, rng):
    """Byte-split characters, ordinary encodings, and random ids (special tokens, lone
    continuation bytes, truncated sequences) as in the tests above."""
    yield from sequences(tok, rng, byte_tokens if kind == "byte_level" else fallback_tokens)
    yield from random_ids(tok, kind, rng, 100)


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece_like"])
def test_the_rust_decode_gives_the_slow_path_s_deltas(kind, request):
    """The decoder on the Rust tokenizer (one decode an add for byte-level BPE) hands out the
    same deltas, chunk by chunk, as the slow path (transformers' `decode`, a window from the step
    before), and the same final text as one full decode."""
    tok = request.getfixturevalue(kind)
    rng = random.Random(3)
    for ids in awkward(tok, kind, rng):
        chunks = chunked(ids, rng)
        fast, slow = IncrementalDecoder(tok), IncrementalDecoder(Counted(tok, fast=False))
        assert [fast.add(c) for c in chunks] + [fast.finish()] == [slow.add(c) for c in chunks] + [slow.finish()]
        assert fast.text == slow.text == tok.decode(ids, skip_special_tokens=True), ids


def test_byte_level_decodes_once_an_add_with_the_rust_tokenizer(byte_level, sentencepiece_like):
    ids = [i for text in TRICKY for i in byte_tokens(byte_level, text + " ")]
    tok = Counted(byte_level)
    dec = IncrementalDecoder(tok)
    assert "".join([dec.add([i]) for i in ids] + [dec.finish()]) == byte_level.decode(ids, skip_special_tokens=True)
    assert (tok.wrapper, tok.rust) == (0, len(ids))
    # negative control: the slow path calls transformers' decode, twice an add where text is final
    slow = Counted(byte_level, fast=False)
    dec = IncrementalDecoder(slow)
    [dec.add([i]) for i in ids]
    assert slow.rust == 0 and slow.wrapper > len(ids)
    # a SentencePiece-style decoder keeps the window from the step before (it does not join) on
    # the Rust tokenizer; a tokenizer that cleans up spaces keeps transformers' decode (its clean-up)
    sp = Counted(sentencepiece_like)
    IncrementalDecoder(sp).add(sentencepiece_like.encode("hello world café", add_special_tokens=False))
    assert sp.wrapper == 0 and sp.rust == 2
    clean = Counted(byte_level, clean_up=True)
    IncrementalDecoder(clean).add(ids[:5])
    assert clean.rust == 0 and clean.wrapper >= 1


def test_a_decoder_that_does_not_join_would_change_the_text(sentencepiece_like, monkeypatch):
    """Negative control of the join rule: decoding SentencePiece-style windows from `read` on (as
    if its decoder joined) loses the spaces the decoder strips from a window's first token."""
    from specrouter.models import tokenizer as tk

    real = tk.text_decoder
    monkeypatch.setattr(tk, "text_decoder", lambda t: (real(t)[0], True))
    ids = sentencepiece_like.encode("hello world café", add_special_tokens=False)
    dec = IncrementalDecoder(sentencepiece_like)
    text = "".join([dec.add([i]) for i in ids] + [dec.finish()])
    assert text != sentencepiece_like.decode(ids, skip_special_tokens=True)
