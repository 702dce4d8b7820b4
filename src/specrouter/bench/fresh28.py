"""The "fresh28" prompt set: held-out open-text prompts, the same four shapes as the original lists.

Written blind in session 28 (before reading the bench's lists, the draft's prompt generators, or
the distillation held-out set), then checked: no prompt shares a run of min(5, words) words with
seeded draws of the v1 / v2 prompt generators, the bench's strings, `distill.evaluate`'s
HELDOUT_PROMPTS, or the decoded rows of the s28 distillation corpus, and none is on a topic the
generators' lists name (tests/test_bench_fresh28.py re-checks the generators). It stays held out
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
    "def tide_peaks(heights: list[float]) -> list[int]:\n"
    '    """Return the indexes of the readings that are strictly higher than both neighbours\n'
    '    (the high tides in a series of water-level measurements)."""\n',
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
    "The lighthouse keeper's daughter had never once set foot on the mainland, but every autumn she",
    "Peat bogs preserve almost everything that falls into them, because the water is acidic, cold and"
    " nearly free of oxygen, which means that",
    "By the time the night ferry reached the third island, the cook had already",
    "Before refrigerated railcars existed, a growing city's supply of fresh milk depended on",
    "My grandmother kept a ledger of every jar she ever canned, and when we opened it after the funeral"
    " we found",
    "Lichens are not single organisms at all but partnerships between a fungus and",
]

CHAT = [
    "What should I pack for a three-day canoe trip on a quiet river in early autumn?",
    "Explain to a twelve-year-old why the moon looks bigger when it is near the horizon.",
    "Write a short, friendly note asking my neighbour to collect my mail while I am away for a week.",
    "What are the pros and cons of learning the accordion as an adult beginner?",
    "How does a sourdough starter stay alive, and what happens if I forget to feed it for a month?",
    "I keep forgetting to water my houseplants. Can you suggest a simple routine that sticks?",
]

EXTRACTION = [
    "Repeat the following list exactly, one item per line:\n"
    "- two spools of brass wire\n- a bag of river gravel\n- seven cedar shingles\n"
    "- one tin of linseed oil\n- a coil of hemp rope\n- three pairs of canvas gloves",
    'Convert this timetable to a JSON array of objects with the keys "station" and "minutes":\n'
    "Harbor Street 0\nMill Pond 4\nQuarry Lane 9\nOld Tannery 13\nNorth Orchard 18\nBell Tower 22",
    "Copy this Python function exactly, without any changes:\n\n"
    "def kiln_schedule(peak, ramp):\n    steps = []\n    temp = 20\n    while temp < peak:\n"
    "        temp = min(peak, temp + ramp)\n        steps.append(temp)\n    return steps",
    "List every person's name in this paragraph, one per line, in order of appearance:\n"
    "At the village fair, Ottoline Brask judged the marrow contest while her cousin Teodor Vime sold"
    " honey from a cart. Later, Priya Annerud and the blacksmith Caspar Holt argued about the"
    " tug-of-war rules until Wren Dalloway settled it with a coin toss.",
    "Repeat this paragraph word for word:\n"
    "The old footbridge over the Kessel was built from oak in 1887 and rebuilt in stone after the"
    " flood of 1921. Its three arches are uneven because the masons ran short of granite and"
    " finished the eastern span with brick taken from a demolished mill.",
    "Extract every date from this log and list them one per line, in the order they appear:\n"
    "2019-03-14 boiler inspected, valve replaced\n2019-07-02 roof gutter cleared\n"
    "2020-01-28 pipes lagged in the cellar\n2020-11-09 chimney swept\n"
    "2021-05-17 window frames repainted",
]

PROMPTS = {"code": CODE, "prose": PROSE, "chat": CHAT, "extraction": EXTRACTION}
