"""The state of a scan of JSON text, carried along as the text grows (issue 30, session 24):
where a row's field drafts and the walk along a model-free draft (decoding/certain_drafts.py
`preferred`, `cut_values`) look for the places a value may start, they need to know whether
the output so far ends inside a string and which `{` / `[` are open. Each of them scanned the
whole output's text again on every proposal; now a row's field drafter keeps one scan of its
output (`FieldDrafter.scan`: fed only the tokens committed since) and the walk feeds it the
draft's tokens as it goes (review23 duplicates D3: one scanner for both)."""

from __future__ import annotations


class JsonScan:
    """JSON text scanned so far: its open `{` / `[` (outermost first), whether it ends inside a
    string, and after a backslash there. A row's field drafter carries the scan of its output
    across the row's proposals (`FieldDrafter.scan`: fed only the tokens committed since), and a
    walk along a draft feeds it the draft's tokens as it goes (`preferred`); `_value_starts`
    starts from one (it and the walk share this scan, not each their own pass over the output)."""

    __slots__ = ("nest", "quoted", "escaped")

    def __init__(self, nest: list[str] | None = None, quoted: bool = False, escaped: bool = False):
        self.nest, self.quoted, self.escaped = nest if nest is not None else [], quoted, escaped

    def copy(self) -> JsonScan:
        return JsonScan(list(self.nest), self.quoted, self.escaped)

    def step(self, ch: str) -> None:
        """One character more."""
        if self.quoted:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.quoted = False
        elif ch == '"':
            self.quoted = True
        elif ch in "{[":
            self.nest.append(ch)
        elif ch in "]}" and self.nest:
            self.nest.pop()

    def feed(self, text: str) -> JsonScan:
        """The scan after `text` more (self, updated)."""
        for ch in text:
            self.step(ch)
        return self
