"""Field drafts: likely (not certain) drafts of a constrained row from its grammar and its
prompt's text (issue 30). Model-free drafters copy token runs of the context, and a JSON value
is rarely one: the prompt says `born 1815` or `record: Ada Lovelace,` where the output writes
`"born": 1815` and `"name": "Ada Lovelace"`, a value's text takes other tokens without the
space before it (`Ad|a` against ` Ada`), and the text before a value (`"born": `) occurs
nowhere in the prompt. A field draft works on text instead, and proposes, one piece after
another up to k tokens (each piece cut where the grammar refuses it):
1. forced text: the bytes the grammar forces next where they are no forced token (several
   tokenizations allow them: ` "` before a string value, also ` "A...`), in the tokenizer's own
   (canonical) tokens, the ones the model writes;
2. value copy: inside a value, the prompt text that follows the value's text so far (found at a
   word start as written, else in any case; the words title-cased when the value capitalised a
   lower-case source word), up to a delimiter, a clause, another item (`and a ...`) or, after a
   capitalised source word (a name), a lower-case word, tokenized together with what the value has
   already (the tokens a model writes for the whole value), then the value's end (`",`, `"}`,
   `,`, `},` ...: the first the grammar allows); a value whose text is not in the prompt (the
   model's own: a quantity it invents, `cucumbers` for `cucumber`) gets its end only, a string
   only where it left the prompt's text or ends a word of the prompt (not inside a word);
3. value start: at a value's first character, a guess of its first word from the prompt's last
   message: after the key's own words (`born 1815`: key-anchored), else the first word not yet
   used after the previous value's place there (the record's next field), a number for a number
   (a number word as digits: `ten` is `10`; first the one right before the key's word, its
   unit: `ten days`);
   never a label's word (`Year of birth: 1856`), a word of the sentence asking for JSON, a
   lower-case word with a digit for a string (`x2`), nor the one-word role line a chat template
   starts a message with (`user`).
The grammar-forced tokens between pieces are not field drafts: the executor puts them in as
certain candidates (decoding/certain_drafts.py) and asks again after them, so one draft spans
several fields (`", "city": "London", "occupation": "` holds 3 drafted tokens). A field draft is
verified like any candidate (exact: the target's tokens are committed, whatever is proposed);
what it changes is how much a cycle commits. The executor offers it in place of a model-free
drafter's proposal where they differ (`certain_drafts.preferred`; `ChainExecutor.field_drafts`),
while they pay in the row's request (`FieldDrafter.gate`: decoding/field_gate.py).
"""

from __future__ import annotations

import bisect
import itertools
import re
import time

from specrouter.decoding.field_gate import FieldGate
from specrouter.decoding.json_scan import JsonScan

STRUCTURAL = re.compile(r'["{}\[\]:]')  # JSON's structural characters: a value's text starts after the last
WORD = re.compile(r"[^\W\d_][\w'\-]*|\d+(?:\.\d+)?")  # words and numbers of the source text
DELIMITER = re.compile(r"[,.;:!?()\[\]{}|=\n\"]")  # a copied value ends before one of these ...
CLAUSE = re.compile(r"\s(?:who|which|that|where|when|in|at|from|for|with|on|over|to|was|is|born)\b|\s\S*\d"
                    r"|\s(?:and|or)\s+(?:a|an|the|some|\S*\d|one|two|three|four|five|six|seven|eight|nine|ten)\b",
                    re.I)  # ... or a clause, a number, another item (`lemons and a dozen eggs`) ...
MAX_WORDS = 4  # ... and after this many words
MARK = re.compile(r"[:=]")  # what follows a label (`Name: Ada`, `Location = Tokyo`) ...
LABEL_WORDS = 3  # ... of at most this many words
ASKS = re.compile(r"\bjson\b", re.I)  # a sentence naming JSON is the request's instruction (up to a colon) ...
SENTENCE_END = re.compile(r"[.!?](?=\s)|\n|:")  # ... and ends at one of these
CODE = re.compile(r"^[^A-Z]*\d[^A-Z]*$").search  # a lower-case word with a digit (`x2`): no string
# value's first word (a name with capitals and digits is one: `A320`, `MP3`, `iPhone15`; review22 N17)
ROLE = re.compile(r"[ \t]*[^\W\d_]+[ \t]*\n")  # a message's first line holding one word only: its role (`user`)
SKIP = frozenset("a an the of in on at for to and or is was are with by as from over next use it its be "
                 "will i you me my we our please this that what how can could would make write turn "
                 "extract give call read return list json".split())  # never a value's first word
KEY_GAP = frozenset("is was are of".split())  # words that may stand between a key's words and its value
GAP = re.compile(r"[\s:=\-]*")  # and the characters
NUMBERS = {w: str(i) for i, w in enumerate("zero one two three four five six seven eight nine ten eleven "
                                           "twelve".split())}  # a number written as a word
SMALL = frozenset("and of the in on for to or a an".split())  # kept lower-case in a title-cased copy
STRING_ENDS = ('",', '"}}', '"}', '"]', '"')  # a copied string's end: the first the grammar allows
NUMBER_ENDS = (",", "},", "}}", "}", "]}", "]")
NEAR = 12  # a string value's first word: a capitalised one among the next this many candidates
STEM = 2  # a written value's last characters that may differ from the prompt's word (`cucumbers`)
WINDOW = 256  # the output's last this many tokens are what a piece reads (keys, values so far)
REACH = 200  # characters of the source a copy reads after its match
ROUNDS = 8  # pieces per draft at most


def _data_elsewhere(after: int, outside: int) -> bool:
    """Whether the words after `JSON` in the sentence asking for it are the request's own: the
    rest of the message holds more words than they are (the record, the list: `Convert this row
    to JSON with name, born, city.` + a CSV row; `Give the JSON shopping list.` after the items);
    else they are the data (`Make a JSON list of 2 apples and 3 pears.`, `Thanks!` after it)."""
    return outside > after


class FieldDrafter:
    """One constrained row's field drafts: its prompt's text, the tokenizer's encode/decode."""

    def __init__(self, encode, decode, prompt_ids: list[int], special_ids: frozenset[int]):
        self.encode = encode  # text -> canonical token ids (models/tokenizer.py text_encoder)
        self.decode = decode  # ids -> text (special tokens skipped)
        self.source = decode(prompt_ids)  # where values are copied from
        self.low = self.source.lower()
        # the last message (the text after the prompt's last special token that has words): where
        # a value's first word is guessed (not the system prompt, not the assistant's header)
        cut, start = [i for i, t in enumerate(prompt_ids) if t in special_ids], 0
        for a, b in zip([-1, *cut], [*cut, len(prompt_ids)]):
            if len(WORD.findall(decode(prompt_ids[a + 1: b]))) >= 3:
                start = a + 1
        end = next((c for c in cut if c >= start), len(prompt_ids))
        self.message_start = len(decode(prompt_ids[:start]))
        self.message_end = len(decode(prompt_ids[:end]))
        role = ROLE.match(self.source, self.message_start, self.message_end)  # `user\n` (ChatML's header)
        if role:
            self.message_start = role.end()
        self.words = [(m.start(), m.end(), m.group())
                      for m in WORD.finditer(self.source, self.message_start, self.message_end)]
        self.labels = self._labels() | self._instruction()
        self.lower_words = [w[2].lower() for w in self.words]
        self.word_set = frozenset(self.lower_words)
        # the data of an instruction ("... from this record: Ada ...") follows its last colon
        colon = self.source.rfind(": ", self.message_start, self.message_end)
        self.data_start = colon + 2 if colon >= 0 else self.message_start
        self._encoded: dict[str, list[int]] = {}
        self.seconds = 0.0  # time spent proposing
        self.proposed = 0  # tokens proposed (drafts and the router's shadow proposals)
        self.values_reached = self.values_taken = 0  # drafted values the target reached / accepted whole
        self._scan, self._scanned = JsonScan(), []  # the JSON scan of the output's first len(_scanned) tokens
        self.gate = FieldGate()  # whether they are offered: their realised gain in this request (field_gate.py)

    def _labels(self) -> frozenset[int]:
        """The start offsets of the message's label words: up to LABEL_WORDS words (spaces only
        between them) right before a `:` or `=` (`Year of birth: 1856`, `Location = Tokyo`):
        what names a value, never a value's first word."""
        starts, words = set(), self.words
        for m in MARK.finditer(self.source, self.message_start, self.message_end):
            i, end = bisect.bisect_left(words, (m.start(),)) - 1, m.start()  # the last word before it
            for _ in range(LABEL_WORDS):
                if i < 0 or self.source[words[i][1]:end].strip(" \t") or not words[i][2][0].isalpha():
                    break
                starts.add(words[i][0])
                end, i = words[i][0], i - 1
        return frozenset(starts)

    def scan(self, generated: list[int], path: list[int] | tuple = ()) -> JsonScan:
        """The JSON scan of the text of `generated` + `path` (a new JsonScan): the scan of the
        row's output is carried across its proposals, fed only the tokens committed since (the
        whole output is scanned again only where `generated` does not extend the last one)."""
        n = len(self._scanned)
        if len(generated) < n or generated[:n] != self._scanned:
            self._scan, self._scanned, n = JsonScan(), [], 0
        if len(generated) > n:
            self._scan.feed(self.decode(generated[n:]))
            self._scanned = list(generated)
        scan = self._scan.copy()
        return scan.feed(self.decode(list(path))) if path else scan

    def _instruction(self) -> frozenset[int]:
        """The start offsets of the request's own words in the message's sentences that name
        JSON, up to a colon (`... as JSON from this record: Ada ...`: the data follows): never a
        value's first word. The words before `JSON` (`Convert this row to`, `Give the`); the words
        after it (`with name, born ...`, `shopping list`) where the data is elsewhere
        (`_data_elsewhere`), not in a request of one sentence (`Give me JSON for Ada Lovelace,
        born 1815 in London.`: review24 N13)."""
        starts, lo, hi = set(), self.message_start, self.message_end
        for m in ASKS.finditer(self.source, lo, hi):
            begin = max((e.end() for e in SENTENCE_END.finditer(self.source, lo, m.start())), default=lo)
            end = SENTENCE_END.search(self.source, m.end(), hi)
            end = end.start() if end else hi
            before = [w[0] for w in self.words if begin <= w[0] < m.start()]
            after = [w[0] for w in self.words if m.end() <= w[0] < end]
            outside = sum(1 for w in self.words if w[0] < begin or w[0] >= end)
            starts.update(before + (after if _data_elsewhere(len(after), outside) else []))
        return frozenset(starts)

    def _enc(self, text: str) -> list[int]:
        ids = self._encoded.get(text)
        if ids is None:
            ids = self._encoded[text] = list(self.encode(text))
        return ids

    # -- the draft --------------------------------------------------------------------------
    def propose(self, grammar, generated: list[int], path: list[int], k: int) -> list[int]:
        """Up to k field-draft tokens after `generated` + `path` (a draft path the grammar
        accepts), stopping where the grammar forces tokens (the executor's certain candidates)."""
        t0 = time.perf_counter()
        grammar.sync(generated)
        m = grammar.matcher
        steps, ok = grammar._advance(path)
        out: list[int] = []
        try:
            if ok:
                for _ in range(ROUNDS):
                    if len(out) >= k or m.is_stopped() or m.compute_ff_tokens():
                        break
                    piece = self._piece(m, generated + list(path) + out)
                    piece = piece[: m.validate_tokens(piece)] if piece else piece
                    if not piece:
                        break
                    m.consume_tokens(piece)
                    steps += len(piece)
                    out += piece
        finally:
            if steps:
                m.rollback(steps)
            self.seconds += time.perf_counter() - t0
        self.proposed += min(len(out), k)
        return out[:k]

    def _piece(self, m, tokens: list[int]) -> list[int]:
        """The next piece (steps 1-3 of the module docstring) after `tokens` (the output so far)."""
        forced = bytes(m.compute_ff_bytes())
        if forced:
            try:
                return self._enc(forced.decode("utf-8"))
            except UnicodeDecodeError:
                return []
        text = self.decode(tokens[-WINDOW:])
        last = None
        for last in STRUCTURAL.finditer(text):
            pass
        quoted = last is not None and last.group() == '"'
        fragment = text[last.end() if last else 0:]
        value = fragment.lstrip(" ")
        if value:
            return self._copy(m, tokens, fragment, value, quoted)
        return self._first_word(m, text, quoted)

    def _copy(self, m, tokens: list[int], fragment: str, value: str, quoted: bool) -> list[int]:
        """Step 2: the rest of the value being written, copied from the source, and its end."""
        at = self._find(value.lower(), value)
        if at < 0:  # the model's own value (`10`, `cucumbers`): it ends here, the best guess ...
            if quoted and not self._own_end(tokens, value):  # ... where a string's end is likely
                return []
            return self._end(m, [], quoted)
        rest = self.source[at + len(value): at + len(value) + REACH]
        if quoted:
            stop = min((p.start() for p in (DELIMITER.search(rest), CLAUSE.search(rest)) if p), default=len(rest))
            rest = rest[:stop].rstrip()
            words = list(re.finditer(r"\S+", rest))
            # words left to copy (the first one may be the end of the value's last word)
            keep = MAX_WORDS - len(value.split()) + (not rest[:1].isspace())
            if len(words) > keep:
                keep = max(keep, 0)
                rest = rest[: words[keep - 1].end()] if keep else ""
            if self.source[at:at + 1].isupper():  # a name goes on through capitalised words only
                rest = self._name(rest)
            if value[:1].isupper() and self.source[at:at + 1].islower():  # title-cased by the model
                rest = re.sub(r"(?<= )(\w+)", lambda w: w.group(1) if w.group(1) in SMALL else w.group(1).capitalize(), rest)
        else:
            rest = re.match(r"\d*", rest).group()
        whole, own = self._enc(fragment + rest), self._enc(fragment)
        if whole[: len(own)] == own and tokens[len(tokens) - len(own):] == own:
            ids = whole[len(own):]  # the value tokenized whole, less what it has already
        else:
            ids = self._enc(rest) if rest else []
        return self._end(m, ids, quoted)

    @staticmethod
    def _name(rest: str) -> str:
        """`rest` (a copy's words after a capitalised source word) up to its first lower-case
        word (`Gothenburg` of `Gothenburg since I`, `Albert Einstein` of `... and he`), a small
        word between capitalised ones kept (`Bank of America`); the first word's end is kept
        (`Ada` + `lace`)."""
        words = list(re.finditer(r"\S+", rest))
        for i, w in enumerate(words):
            word = w.group()
            if w.start() == 0 or word[0].isupper() or (
                    word in SMALL and i + 1 < len(words) and words[i + 1].group()[0].isupper()):
                continue
            return rest[: w.start()].rstrip()
        return rest

    def _own_end(self, tokens: list[int], value: str) -> bool:
        """Whether a string value the model writes on its own (`value`, not in the prompt) likely
        ends here: at the token where it left the prompt's text (`cucumbers` after `cuc`, `water`),
        or where its text ends a word of the prompt (`spunky spinach`); not inside a word it is
        still writing (`Barc`, `spun`): each such end, refused, costs a forward where a drafter's
        copy could be verified instead (a CRM cell written on as `Hygienist, Lakers, Gold, 1988-...`)."""
        last = self.decode(tokens[-1:])
        if len(last) >= len(value) or self._find(value[: -len(last)].lower()) >= 0:
            return True
        word = WORD.findall(value)
        return bool(word) and value.endswith(word[-1]) and word[-1].lower() in self.word_set

    def _end(self, m, ids: list[int], quoted: bool) -> list[int]:
        """`ids` (the rest of a value) and the value's end: the first the grammar allows."""
        for end in (STRING_ENDS if quoted else NUMBER_ENDS):
            tail = self._enc(end)
            if m.validate_tokens(ids + tail) == len(ids) + len(tail):
                return ids + tail
        return ids

    def _find(self, f: str, cased: str | None = None) -> int:
        """Where `f` (lower-case) first occurs at a word start: in the last message, else anywhere
        (-1: nowhere); with `cased` (`f` as written), where that occurs first in each (`O` at
        `Okafor`, not at `occupation`)."""
        for lo, hi in ((self.message_start, self.message_end), (0, len(self.low))):
            for text, g in ((self.source, cased if cased != f else None), (self.low, f)):
                at = text.find(g, lo, hi) if g is not None else -1
                while at >= 0:
                    if at == 0 or not text[at - 1].isalnum():
                        return at
                    at = text.find(g, at + 1, hi)
        return -1

    def _first_word(self, m, text: str, quoted: bool) -> list[int]:
        """Step 3: the tokens of a guess of the first word of the value starting here ([]: none):
        the first of the candidates (`_first_words`) the grammar allows whole (an enum's
        `celsius` after a guess of `days`), else the first, cut where the grammar refuses it."""
        first = None
        for i, word in enumerate(itertools.islice(self._first_words(text, quoted), NEAR)):
            ids = self._enc(word)
            if m.validate_tokens(ids) == len(ids):
                return ids
            if i == 0:
                first = ids
        return first or []

    def _first_words(self, text: str, quoted: bool):
        """The guesses of the first word of the value starting here, the likeliest first."""
        if not (quoted or text.endswith((": ", "["))):
            return
        keys = re.findall(r'"([^"]*)":', text)
        key = keys[-1].lower() if keys else ""
        values = re.findall(r'"([^"]+)"[,}\]]', text)  # the string values written so far
        used = {w.lower() for w in WORD.findall(" ".join(re.findall(r'"([^"]*)"', text)))}

        def fits(word: tuple[int, int, str]) -> bool:
            w = word[2]
            lw = w.lower()
            return ((w[0].isdigit() != quoted or not quoted and lw in NUMBERS) and lw not in SKIP and lw != key
                    and word[0] not in self.labels
                    and not (quoted and CODE(w))
                    and not (quoted and any(lw.startswith(u) for u in used if len(u) > 2 or u == lw))
                    and not (quoted and any(u.startswith(lw) for u in used if 2 < len(lw) >= len(u) - STEM)))

        def cased(word: str):
            capital = self._cased(word, values)
            yield capital
            if capital != word:
                yield word

        def number(word: str) -> str:  # a number's digits (`ten`: `10`)
            return NUMBERS.get(word.lower(), word)

        words, lower = self.words, self.lower_words
        key_words = key.replace("_", " ").split()
        if key_words:  # key-anchored: the key's words, then the value (only KEY_GAP between)
            n = len(key_words)
            for i in range(len(words) - n):
                if lower[i] == key_words[0] and lower[i:i + n] == key_words:
                    j = i + n
                    while j < len(words) and lower[j] in KEY_GAP:
                        j += 1
                    if (j < len(words) and fits(words[j])
                            and GAP.fullmatch(self.source[words[j - 1][1]:words[j][0]])):
                        yield from cased(words[j][2]) if quoted else [number(words[j][2])]
            if not quoted:  # a number before its unit: `3 days`, `ten days`, `a 5-day forecast`
                unit = key_words[0]
                for i in range(1, len(words)):
                    if (abs(len(lower[i]) - len(unit)) <= 1 and lower[i][:len(unit) - 1] == unit[:len(unit) - 1]
                            and len(unit) > 2 and fits(words[i - 1])
                            and GAP.fullmatch(self.source[words[i - 1][1]:words[i][0]])):
                        yield number(words[i - 1][2])
        # the cursor: the span of the last value of the output found in the source
        span = (self.data_start, self.data_start)
        for v in values:  # (numbers are too ambiguous to place)
            p, n = self._find_stem(v.lower())
            if p >= self.message_start:
                span = (p, p + n)
        at = bisect.bisect_left(words, (span[1],))  # the first word after the last value
        if not quoted:  # a number: the nearest to the last value (`2 apples, 3 bananas`)
            near = [w for w in words[max(0, at - NEAR): at + NEAR] if fits(w)]
            for w in sorted(near, key=lambda w: min(abs(w[1] - span[0]), abs(w[0] - span[1]))):
                yield number(w[2])
            return
        after = []
        for w in itertools.chain(words[at:], words[:at]):  # after the last value, else from the start
            if fits(w):
                after.append(w)
                if len(after) == NEAR:
                    break
        named = [w for w in after if w[2][0].isupper() and not w[2].isupper() and w[0] >= span[1]]
        for w in named + [w for w in after if w not in named]:
            yield from cased(w[2])

    def _find_stem(self, v: str) -> tuple[int, int]:
        """Where value `v` (lower-case) occurs in the source as `_find` finds it, else a stem of
        it (up to STEM last characters off: the prompt's `cucumber` for `cucumbers`), and the
        length found; (-1, 0) where neither is."""
        for n in range(len(v), min(len(v), max(len(v) - STEM, 4)) - 1, -1):
            at = self._find(v[:n])
            if at >= 0:
                return at, n
        return -1, 0

    @staticmethod
    def _cased(word: str, values: list[str]) -> str:
        """`word` capitalised when every string value so far starts with a capital (a model
        writing `"Ada Lovelace", "London"` writes `"Mathematician"` for `mathematician`)."""
        if values and all(v[:1].isupper() for v in values):
            return word[:1].upper() + word[1:]
        return word
