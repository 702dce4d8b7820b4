"""Grammar-constrained decoding (issue 30): a request's grammar (a JSON schema, any JSON
object, a Lark grammar or a regex) is one more logits processor, a token mask, applied like
the others (decoding/processors.py) at EVERY level of the chain, so the output is exactly plain
constrained decoding of the target: greedy token for token, sampled in distribution (the
coupled noise samples the masked distribution at every level).

The engine is llguidance (docs/structured-output.md says why: no dependencies, explicit
rollback, forced-token computation, ~20 us a mask on SmolLM2's 49k vocabulary here).

The mask is stateful, so each row keeps one `RowGrammar` (on its `Sequence`), a matcher that
has consumed exactly the row's committed generated tokens (it re-syncs lazily, so a row rolled
back by the engine's failure isolation is followed). At a call for positions g = 0..G-1 after
a draft path (the same convention as `RowHistory`: position g follows the committed tokens and
`path[: offset + g]`), the matcher advances along the path, computing each position's mask,
then rolls back. A path token the grammar refuses (a model-free drafter's guess) leaves the
later positions unmasked: they follow a rejected candidate, so what is sampled there is never
committed. `valid_prefix` cuts such drafts before they are verified.

Forced tokens (`forced_tokens`): while the mask allows exactly one token, the target's masked
distribution is one-hot there, so greedy and sampled decoding both produce it. After the
committed tokens the engine commits them without any forward ("jump forward"; every model is
fed them as pending tokens at its next forward); after a draft path the executor puts them into
the draft as certain candidates (decoding/executor.py: no model proposes them, the drafter
continues after them, and every level accepts them: its masked distribution is one-hot there).
"""

from __future__ import annotations

import functools
import sys
import time

import numpy as np
import torch

from specrouter.config import GrammarSpec
from specrouter.errors import GrammarError

__all__ = ["GrammarError", "GrammarSpec", "RowGrammar", "check_grammar", "to_llguidance"]

# JSON text as json.dumps writes it ({"a": 1, "b": [2, 3]}): no free whitespace, so a small
# model cannot run away into newlines, and more of the text is forced
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_ANY_JSON_OBJECT = {"type": "object"}
LITTLE_ENDIAN = sys.byteorder == "little"


def to_llguidance(spec: GrammarSpec) -> str:
    """The grammar in llguidance's serialized form (compiled when a matcher is built)."""
    import llguidance

    M = llguidance.LLMatcher
    if spec.kind == "json_object":
        return M.grammar_from_json_schema(_ANY_JSON_OBJECT, overrides=JSON_OPTIONS)
    if spec.kind == "json_schema":
        return M.grammar_from_json_schema(spec.source, overrides=JSON_OPTIONS)
    if spec.kind == "lark":
        return M.grammar_from_lark(spec.source)
    return M.grammar_from_regex(spec.source)


@functools.lru_cache(maxsize=8)
def _ll_tokenizer(tokenizer, eos_ids: tuple[int, ...], vocab_width: int):
    """llguidance's view of a pool's tokenizer (about 0.5 s to build: once per pool)."""
    import llguidance.hf

    n_vocab = max(vocab_width, len(tokenizer))
    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=list(eos_ids) or None)


def check_grammar(spec: GrammarSpec, tokenizer, eos_ids: tuple[int, ...], vocab_width: int) -> None:
    """Raise GrammarError naming the problem when `spec` does not compile for this tokenizer."""
    import llguidance

    try:
        grammar = to_llguidance(spec)
    except ValueError as e:
        raise GrammarError(f"invalid {spec.kind.replace('_', ' ')}: {e}") from None
    err = llguidance.LLMatcher.validate_grammar(grammar, _ll_tokenizer(tokenizer, eos_ids, vocab_width))
    if err and not err.startswith("WARNING"):
        raise GrammarError(f"invalid {spec.kind.replace('_', ' ')}: {err.strip()}")


def unpack_bitmask(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """(G, W) int32 bitmasks (bit t % 32 of word t // 32: token t allowed) -> (G, vocab) bool.
    On a little-endian host a word's bytes lie in bit order, so numpy's `unpackbits` reads bit
    t at index t in one pass (~6 us a position against ~50 us for torch's shift-and-mask over a
    (G, W, 32) int32 tensor: session 26); a big-endian host shifts."""
    if LITTLE_ENDIAN:
        b = np.unpackbits(bits.numpy().view(np.uint8), axis=-1, bitorder="little")[:, :vocab]  # (G, V) 0/1
        return torch.from_numpy(b.view(np.bool_))
    shifts = torch.arange(32, dtype=torch.int32)
    return ((bits[:, :, None] >> shifts) & 1).view(bits.shape[0], -1)[:, :vocab].bool()  # (G, W*32) -> (G, V)


def any_allowed(words: np.ndarray, vocab: int) -> bool:
    """Whether a packed mask's words (W,) allow some token below `vocab`."""
    full, rest = divmod(vocab, 32)
    return bool(words[:full].any()) or bool(rest and int(words[full]) & ((1 << rest) - 1))


class RowGrammar:
    """One row's grammar state: a matcher at the row's committed generated tokens."""

    def __init__(self, spec: GrammarSpec, tokenizer, eos_ids: tuple[int, ...], vocab_width: int,
                 stop_ids: frozenset[int]):
        import llguidance

        self.spec = spec
        self.vocab = vocab_width
        self.stop_ids = stop_ids
        ll_tok = _ll_tokenizer(tokenizer, eos_ids, vocab_width)
        self._words = (ll_tok.vocab_size + 31) // 32
        try:
            grammar = to_llguidance(spec)
        except ValueError as e:
            raise GrammarError(f"invalid {spec.kind.replace('_', ' ')}: {e}") from None
        self.matcher = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"invalid {spec.kind.replace('_', ' ')}: {self.matcher.get_error()}")
        self.consumed: list[int] = []  # generated tokens the matcher has consumed
        self.mask_seconds = 0.0  # time spent computing masks (reported against the step)
        self.masks_computed = 0
        self.fields = None  # its FieldDrafter (decoding/field_drafts.py), set by the engine at admission

    # -- following the committed tokens -----------------------------------------------------
    def sync(self, generated: list[int]) -> None:
        """Make the matcher's consumed tokens equal `generated` (roll back what differs)."""
        c = self.consumed
        if len(generated) >= len(c) and generated[: len(c)] == c:
            new = generated[len(c):]
        else:
            n = 0
            for a, b in zip(c, generated):
                if a != b:
                    break
                n += 1
            self.matcher.rollback(len(c) - n)
            del c[n:]
            new = generated[n:]
        for t in new:
            if t in self.stop_ids or not self.matcher.consume_token(t):
                break  # a stop token ends the row; a refused token leaves the matcher in error
            c.append(t)

    @property
    def dead_end(self) -> bool:
        """The matcher refused a token or allows nothing (error state)."""
        return self.matcher.is_error()

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing but a stop token."""
        return self.matcher.is_stopped() and not self.matcher.is_error()

    def error(self) -> str:
        return self.matcher.get_error()

    # -- masks along a draft path -----------------------------------------------------------
    def allowed(self, generated: list[int], path: list[int], offset: int, G: int) -> torch.Tensor:
        """(G, V) bool: the tokens the grammar allows at positions g = 0..G-1, position g
        following `generated` + `path[: offset + g]`; positions after a refused or stop path
        token, or past the path (a shorter row's padding), are all True (nothing sampled there
        is committed)."""
        bits = torch.full((G, self._words), -1, dtype=torch.int32)  # (G, W): all allowed
        for _ in self._masks_along(generated, path, offset, G, bits):
            pass
        return unpack_bitmask(bits, self.vocab)  # (G, V)

    def refused(self, generated: list[int], path: list[int], offset: int, tokens: list[int]):
        """A greedy row's masks, applied lazily (`allowed`'s positions and path walk), as a
        generator: `tokens[g]` is the argmax of the UNMASKED logits at position g; where the
        mask allows it, it is the masked argmax too (masking only sets refused tokens to -inf:
        the maximum and the first index holding it stay), so that position's mask is read for
        one bit and neither unpacked nor applied. Yields (g, (V,) bool mask) at each position
        whose token the mask refuses; the caller masks there, chooses again and writes the new
        token into `tokens[g]` before asking for the next. The positions `allowed` leaves
        unmasked (after a refused or stop path token, past the path) are skipped alike, and so
        are those after the first position whose token (as the caller left it) differs from
        the path's candidate there: verification keeps the accepted candidates and the token at
        the first rejection, so nothing sampled after it is committed or read (session 26).
        (The bit is read from the mask, not from `validate_tokens`: llguidance's token check
        accepts more than its mask where the grammar forces text, e.g. 'T' where the mask
        allows only the token 'The'.)"""
        bits = torch.empty((len(tokens), self._words), dtype=torch.int32)
        words = bits.numpy()  # (a view: one bit read without torch's per-element cost)
        walk = self._masks_along(generated, path, offset, len(tokens), bits)
        try:
            for g in walk:
                at = offset + g  # the candidate at position g: path[at]
                t = tokens[g]
                if t >= self.vocab or not (int(words[g, t >> 5]) >> (t & 31)) & 1:
                    yield g, unpack_bitmask(bits[g : g + 1], self.vocab)[0]
                if at >= len(path) or tokens[g] != path[at]:
                    return  # the first rejection (or the bonus position): nothing after it is read
        finally:
            walk.close()  # (rolls the matcher back to `generated`)

    def _masks_along(self, generated: list[int], path: list[int], offset: int, G: int,
                     bits: torch.Tensor):
        """Fill `bits[g]` (G, W) int32 with the packed mask of position g = 0, 1, ... (position g
        following `generated` + `path[: offset + g]`) and yield g once it is filled; the walk
        stops after a refused or stop path token or at the path's end (a shorter row's padding),
        and the matcher is rolled back to `generated` when the caller has taken every position
        or closes the walk. Path tokens are validated before they are consumed: a refused one
        would leave the matcher in its error state, which no rollback clears (a draft whose
        masked logits were all -inf, e.g. a draft vocabulary without the one allowed token,
        proposes such a token)."""
        import llguidance.torch as lt

        t0 = time.perf_counter()
        self.sync(generated)
        m = self.matcher
        steps, ok = self._advance(path[:offset])
        try:
            if ok and len(path) >= offset:
                for g in range(G):
                    lt.fill_next_token_bitmask(m, bits, g)
                    self.masks_computed += 1
                    yield g
                    if g + 1 < G:
                        if offset + g >= len(path):
                            break  # padding positions of a shorter row
                        t = path[offset + g]
                        if t in self.stop_ids or m.validate_tokens([t]) != 1:
                            break
                        m.consume_token(t)
                        steps += 1
        finally:
            if steps:
                m.rollback(steps)
            self.mask_seconds += time.perf_counter() - t0

    def allows_some(self, generated: list[int]) -> bool:
        """Whether the grammar allows some token after `generated` (`allowed(generated, [], 0,
        1).any()`, read on the packed mask without unpacking it)."""
        bits = torch.empty((1, self._words), dtype=torch.int32)
        for _ in self._masks_along(generated, [], 0, 1, bits):
            pass
        return any_allowed(bits.numpy()[0], self.vocab)

    def _advance(self, path) -> tuple[int, bool]:
        """Consume `path` after the committed tokens, each token validated first (a refused one
        would leave the matcher in its error state, which no rollback clears): (tokens
        consumed, to roll back; whether the whole path was)."""
        m = self.matcher
        for i, t in enumerate(path):
            if m.is_error() or t in self.stop_ids or m.validate_tokens([t]) != 1:
                return i, False
            m.consume_token(t)
        return len(path), not m.is_error()

    def valid_prefix(self, generated: list[int], tokens: list[int], path: list[int] | tuple = ()) -> int:
        """How many leading `tokens` the grammar accepts after `generated` + `path` (a draft
        path: none when it leaves the grammar; a stop token counts when the grammar may end
        there)."""
        self.sync(generated)
        if self.matcher.is_error():
            return 0
        steps, ok = self._advance(path)
        n = self.matcher.validate_tokens(list(tokens)) if ok else 0
        if steps:
            self.matcher.rollback(steps)
        return n

    def forced_tokens(self, generated: list[int], limit: int, path: list[int] | tuple = ()) -> list[int]:
        """Up to `limit` tokens the grammar forces after `generated` + `path` (a draft path:
        none when it holds a refused or stop token): at each, the mask allows exactly one token
        and it is not a stop token (a stop token is left to the model: it ends the row,
        min_tokens may mask it)."""
        import llguidance.torch as lt

        t0 = time.perf_counter()
        self.sync(generated)
        m = self.matcher
        out: list[int] = []
        steps, ok = self._advance(path)
        if not ok:
            limit = 0  # the path leaves the grammar: nothing is forced after it
        bits = torch.empty((1, self._words), dtype=torch.int32)
        words = bits.numpy()[0]  # (a view of the mask's words)
        while len(out) < limit and not m.is_error() and not m.is_stopped():
            lt.fill_next_token_bitmask(m, bits, 0)
            nz = np.flatnonzero(words)
            if nz.shape[0] != 1:
                break
            w = int(nz[0])
            word = int(words[w]) & 0xFFFFFFFF
            if word & (word - 1):
                break  # more than one bit
            t = w * 32 + word.bit_length() - 1
            if t >= self.vocab or t in self.stop_ids or not m.consume_token(t):
                break
            out.append(t)
        if out or steps:
            m.rollback(len(out) + steps)
        self.mask_seconds += time.perf_counter() - t0
        return out
