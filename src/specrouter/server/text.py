"""Incremental detokenization with stop strings, the same for streamed and whole responses.

`TextStream.add(token_ids)` returns the text that may be sent now: the decoded output minus
what was already sent, holding back (a) a trailing U+FFFD (the bytes of a character split
across tokens) and (b) a tail that could be the start of a stop string, so a stop string never
leaks. When a stop string appears, the text is cut before it and `stopped` is set. A non-
streamed response is the concatenation of the same deltas, so both are identical by
construction.

A stop string that is exactly one token (including special tokens such as "<|im_end|>") is
also given to the engine as a stop token id (`stop_token_ids`), so generation ends at once.
"""

from __future__ import annotations

from specrouter.models.tokenizer import IncrementalDecoder


def stop_token_ids(tokenizer, stops: list[str]) -> tuple[int, ...]:
    """Token ids whose text is exactly a stop string."""
    ids = []
    for s in stops:
        enc = tokenizer.encode(s, add_special_tokens=False)
        if len(enc) == 1 and tokenizer.decode(enc, skip_special_tokens=False) == s:
            ids.append(enc[0])
    return tuple(ids)


class TextStream:
    """The output text of one request, token by token, in time linear in the output: the
    tokens are decoded incrementally (`IncrementalDecoder`: a window since the last stable
    offset), and only the text not yet sent (at most the longest stop string plus the new
    delta) is searched and held back."""

    def __init__(self, tokenizer, stops: list[str] = ()):
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.max_stop = max((len(s) for s in self.stops), default=0)
        self._decoder = IncrementalDecoder(tokenizer)
        self._held = ""  # final text not sent yet (it may be the start of a stop string)
        self._sent: list[str] = []  # the deltas handed out
        self._sent_tail = ""  # the last max_stop - 1 characters handed out
        self.stopped = False  # a stop string was found: the text is final

    @property
    def token_ids(self) -> list[int]:
        return self._decoder.token_ids

    @property
    def sent(self) -> str:
        """The text handed out so far."""
        return "".join(self._sent)

    def _send(self, text: str) -> str:
        if text:
            self._sent.append(text)
            if self.max_stop > 1:
                self._sent_tail = (self._sent_tail + text)[-(self.max_stop - 1):]
        return text

    def _stop_in(self, text: str) -> str | None:
        """`text` (what follows the sent text) cut before the first stop string, or None."""
        if not self.stops:
            return None
        window = self._sent_tail + text  # a stop string may begin in what was sent
        hits = [i for i in (window.find(s) for s in self.stops) if i >= 0]
        if not hits:
            return None
        self.stopped = True
        return text[: max(0, min(hits) - len(self._sent_tail))]

    def add(self, token_ids: list[int]) -> str:
        """Text that can be sent after these new tokens ("" if none yet, or after a stop)."""
        if self.stopped:
            return ""
        self._held += self._decoder.extend(token_ids)
        # the provisional text of a split character counts for stop strings before it
        cut = self._stop_in(self._held + self._decoder.pending)
        if cut is not None:
            self._held = ""
            return self._send(cut)
        hold = 0  # the longest tail that may grow into a stop string
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self._held)), hold, -1):
                if self._held.endswith(s[:n]):
                    hold = n
                    break
        out = self._held[: len(self._held) - hold]
        self._held = self._held[len(out):]
        return self._send(out)

    def finish(self) -> str:
        """The rest of the text once generation ended (held-back tails included)."""
        if self.stopped:
            return ""
        rest = self._held + self._decoder.finish()
        self._held = ""
        cut = self._stop_in(rest)
        return self._send(rest if cut is None else cut)
