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


def stop_token_ids(tokenizer, stops: list[str]) -> tuple[int, ...]:
    """Token ids whose text is exactly a stop string."""
    ids = []
    for s in stops:
        enc = tokenizer.encode(s, add_special_tokens=False)
        if len(enc) == 1 and tokenizer.decode(enc, skip_special_tokens=False) == s:
            ids.append(enc[0])
    return tuple(ids)


class TextStream:
    """The output text of one request, token by token."""

    def __init__(self, tokenizer, stops: list[str] = ()):
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.max_stop = max((len(s) for s in self.stops), default=0)
        self.token_ids: list[int] = []
        self.sent = ""  # text handed out so far
        self.stopped = False  # a stop string was found: the text is final

    def _decode(self) -> str:
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=True)

    def _cut_at_stop(self, text: str) -> str | None:
        if not self.stops:
            return None
        start = max(0, len(self.sent) - self.max_stop)
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return text[: min(hits)] if hits else None

    def _delta(self, text: str) -> str:
        if not text.startswith(self.sent):  # not prefix-stable (unusual tokenizer): wait
            return ""
        delta = text[len(self.sent):]
        self.sent = text
        return delta

    def add(self, token_ids: list[int]) -> str:
        """Text that can be sent after these new tokens ("" if none yet, or after a stop)."""
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        text = self._decode()
        cut = self._cut_at_stop(text)
        if cut is not None:
            self.stopped = True
            return self._delta(cut)
        safe = len(text)
        while safe > len(self.sent) and text[safe - 1] == "\ufffd":
            safe -= 1
        hold = 0  # the longest tail that may grow into a stop string
        for s in self.stops:
            for n in range(min(len(s) - 1, safe - len(self.sent)), hold, -1):
                if text.endswith(s[:n], 0, safe):
                    hold = n
                    break
        safe -= hold
        return self._delta(text[:safe]) if safe > len(self.sent) else ""

    def finish(self) -> str:
        """The rest of the text once generation ended (held-back tails included)."""
        if self.stopped:
            return ""
        text = self._decode()
        cut = self._cut_at_stop(text)
        if cut is not None:
            self.stopped = True
            text = cut
        return self._delta(text)
