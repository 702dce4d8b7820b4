"""The "fresh28" prompt set: held-out open-text prompts, the same four shapes as the original lists.

Written blind in session 28 (before reading the bench's lists, the draft's prompt generators, or
the distillation held-out set), then checked: no prompt shares a run of min(5, words) words with
seeded draws of the v1 / v2 prompt generators, the bench's strings, `distill.evaluate`'s
HELDOUT_PROMPTS, or the decoded rows of the s28 distillation corpus, and none is on a topic the
generators' lists name (tests/test_bench_fresh28.py re-checks the generators: word runs, and the
topic stems of TOPICS in their draws and module-level lists). It stays held out
until someone tunes on it. Shapes, ordered most typical first (`--prompts-per-type n` takes n):
- code: raw completion of a Python stub (header + docstring, sometimes an import);
- prose: raw continuation of an opening sentence fragment;
- chat: a user message answered freely (chat template);
- extraction: a chat request whose answer copies from the payload in the prompt.
"""

from __future__ import annotations

CODE = [
    "import datetime\n\n\ndef business_days_between(start: datetime.date, end: datetime.date) -> int:\n"
    '    """Count the weekdays from `start` (inclusive) to `end` (exclusive), skipping Saturdays\n'
    '    and Sundays. Returns 0 when `end` is not after `start`."""\n',
    "def split_bill(total_cents: int, shares: dict[str, int]) -> dict[str, int]:\n"
    '    """Divide a bill between people in proportion to their shares, in whole cents, so that\n'
    '    the parts add up to `total_cents` exactly; leftover cents go to the largest shares."""\n',
    "def bowling_score(rolls: list[int]) -> int:\n"
    '    """Score a complete game of ten-pin bowling from the pins knocked down by each roll,\n'
    '    with the bonuses for strikes and spares and the extra rolls of the tenth frame."""\n',
    "class SeatingChart:\n"
    '    """Assigns wedding guests to numbered tables of a fixed size, keeping guests who asked\n'
    '    to sit together at the same table."""\n\n'
    "    def __init__(self, table_size: int) -> None:\n",
    "import re\n\n\ndef parse_quantity(text: str) -> tuple[float, str]:\n"
    '    """Read an amount such as "1 1/2 cups" or "250 g" and return the number and the unit.\n'
    '    Raises ValueError when no number is found."""\n',
    "def hex_neighbors(q: int, r: int) -> list[tuple[int, int]]:\n"
    '    """Return the six axial coordinates adjacent to the hexagon (q, r), clockwise,\n'
    '    starting from the east side."""\n',
]

PROSE = [
    "The salt merchants of the delta never wrote anything down, so when the river shifted its course"
    " one spring they",
    "Peat bogs preserve almost everything that falls into them, because the water is acidic, cold and"
    " nearly free of oxygen, which means that",
    "By the time the snowplough reached the last farmhouse on the ridge, the family had already",
    "In the decades before pasteurisation, a growing city's supply of fresh milk depended on",
    "My grandmother kept a ledger of every jar she ever canned, and when we opened it after the funeral"
    " we found",
    "A church bell is tuned after it is cast, by shaving thin rings of metal from its inner wall,"
    " which lowers",
]

CHAT = [
    "I'm hosting my first board game evening for six adults who rarely play. Which kinds of games suit a mixed group?",
    "Explain to a twelve-year-old why a rubber band feels warm right after you stretch it quickly.",
    "Write a short, friendly note asking my neighbour to collect my mail while I am away for a week.",
    "What is a fair way to split household chores between three flatmates who work different shifts?",
    "My sewing machine keeps skipping stitches on thick denim. What are the usual causes?",
    "Suggest a name and a short motto for our village's new volunteer fire brigade.",
]

EXTRACTION = [
    "Write out this shopping list again exactly as given, keeping each item on its own line:\n"
    "- two spools of brass wire\n- a bag of river gravel\n- seven cedar shingles\n"
    "- one tin of linseed oil\n- a coil of hemp rope\n- three pairs of canvas gloves",
    'Turn these rowing results into JSON, an array of objects whose keys are "crew" and "seconds":\n'
    "Kingfisher 412\nOtter Bend 419\nGrey Heron 425\nWillow Reach 431\nStone Lock 438\nAlder Point 446",
    "Copy this Python function exactly, without any changes:\n\n"
    "def kiln_schedule(peak, ramp):\n    steps = []\n    temp = 20\n    while temp < peak:\n"
    "        temp = min(peak, temp + ramp)\n        steps.append(temp)\n    return steps",
    "List every person's name in this paragraph, one per line, in order of appearance:\n"
    "At the village fair, Ottoline Brask judged the marrow contest while her cousin Teodor Vime sold"
    " plum jam from a cart. Later, Ilse Annerud and the blacksmith Caspar Holt argued about the"
    " tug-of-war rules until Wren Dalloway settled it with a coin toss.",
    "Reproduce the paragraph below verbatim:\n"
    "The old footbridge over the Kessel was built from oak in 1887 and rebuilt in stone after the"
    " flood of 1921. Its three arches are uneven because the masons ran short of granite and"
    " finished the eastern span with brick taken from a demolished mill.",
    "Extract every date from this log and list them one per line, in the order they appear:\n"
    "2019-03-14 boiler inspected, valve replaced\n2019-07-02 roof gutter cleared\n"
    "2020-01-28 pipes lagged in the cellar\n2020-11-09 chimney swept\n"
    "2021-05-17 window frames repainted",
]

PROMPTS = {"code": CODE, "prose": PROSE, "chat": CHAT, "extraction": EXTRACTION}

# the topic of each prompt, same order as PROMPTS[kind]: stems that begin a word (case-insensitive;
# "-" and "_" read as spaces, camelCase split) of no v1/v2 generator draw or list string
TOPICS = {
    "code": [("business day", "weekday"), ("split bill", "split the bill"), ("bowling",),
             ("seating", "wedding"), ("parse quantit", "1 1/2 cups"), ("hexagon", "hex neighbo")],
    "prose": [("salt merchant",), ("peat",), ("snowplough", "snowplow"), ("pasteur",),
              ("ledger", "canned"), ("church bell",)],
    "chat": [("board game",), ("rubber band",), ("neighbo", "collect my mail"), ("chore", "flatmate"),
             ("sewing", "stitch"), ("fire brigade", "motto")],
    "extraction": [("linseed", "cedar shingle"), ("rowing", "regatta"), ("kiln",),
                   ("marrow", "village fair"), ("footbridge",), ("boiler", "chimney")],
}
