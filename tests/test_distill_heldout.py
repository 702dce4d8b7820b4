"""evaluate.HELDOUT_PROMPTS stays held out: neither prompt generator (corpus.py's v1,
prompts_v2.py's v2) writes a word run of min(5, its words) of any held-out prompt in a few
thousand seeded draws, and none shares such a run with a bench prompt (review27 D2: v1 wrote the
old set's chat prompt whole)."""

from __future__ import annotations

import random
import re

import pytest

from specrouter.bench import structured, workloads
from specrouter.distill import corpus, prompts_v2, prompts_v2_raw
from specrouter.distill.evaluate import HELDOUT_PROMPTS

RUN = 5  # words; a shorter prompt must not appear whole
DRAWS = 3000


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def _runs(texts, n: int) -> set[tuple[str, ...]]:
    out = set()
    for t in texts:
        w = _words(t)
        out.update(tuple(w[i : i + n]) for i in range(len(w) - n + 1))
    return out


def _strings(o):
    if isinstance(o, str):
        yield o
    elif isinstance(o, (list, tuple, set, frozenset)):
        for x in o:
            yield from _strings(x)
    elif isinstance(o, dict):
        for k, x in o.items():
            yield from _strings(k)
            yield from _strings(x)


def _v1(rng: random.Random) -> list[str]:
    return ([m["content"] for m in corpus._chat_messages(rng)]
            + [corpus._prose_prompt(rng, []), corpus._code_prompt(rng, []), corpus._qa_prompt(rng)])


def _v2(rng: random.Random) -> list[str]:
    return ([m["content"] for m in prompts_v2.chat_messages(rng)[1]]
            + [prompts_v2_raw.prose_prompt(rng, []), prompts_v2_raw.code_prompt(rng, []), prompts_v2_raw.qa_prompt(rng)])


@pytest.fixture(scope="module")
def generated():
    out = {}
    for name, draw in (("v1", _v1), ("v2", _v2)):
        rng = random.Random(0)
        out[name] = {t for _ in range(DRAWS) for t in draw(rng)}
    return out


def _shared(prompts, texts) -> list[tuple[str, str]]:
    """(prompt, shared run) for each prompt with a run of min(RUN, its words) found in `texts`."""
    by_n = {}
    hits = []
    for text in prompts:
        w = _words(text)
        n = min(RUN, len(w))
        runs = by_n.setdefault(n, _runs(texts, n))
        hit = next((r for r in (tuple(w[i : i + n]) for i in range(len(w) - n + 1)) if r in runs), None)
        if hit:
            hits.append((text, " ".join(hit)))
    return hits


def _bench_strings() -> list[str]:
    return [s for mod in (workloads, structured) for name, o in vars(mod).items()
            if not name.startswith("_") and isinstance(o, (str, list, tuple, dict)) for s in _strings(o)]


def test_the_check_finds_a_prompt_a_generator_writes(generated):
    # negative control: the old set's chat prompt, which v1 writes whole (review27 D2), and one
    # draw of each generator are found; so the tests below can fail
    assert _shared(["Give me three tips for learning a new language."], generated["v1"])
    for name in ("v1", "v2"):
        sample = sorted(generated[name])[len(generated[name]) // 2]
        assert _shared([sample], generated[name]), name
    assert _shared([workloads.CHAT[1]], _bench_strings())


def test_held_out_prompts_are_well_formed():
    kinds = [k for k, _, _ in HELDOUT_PROMPTS]
    assert {k: kinds.count(k) for k in set(kinds)} == {"code": 4, "prose": 3, "chat": 3, "extraction": 2}
    texts = [t for _, t, _ in HELDOUT_PROMPTS]
    assert len(set(texts)) == len(texts) and all(len(_words(t)) >= 3 for t in texts)


@pytest.mark.parametrize("which", ["v1", "v2"])
def test_no_generator_writes_a_held_out_prompt(generated, which):
    hits = _shared([t for _, t, _ in HELDOUT_PROMPTS], generated[which])
    assert not hits, f"the {which} generator writes word runs of held-out prompts: {hits}"


def test_no_held_out_prompt_is_a_bench_prompt():
    hits = _shared([t for _, t, _ in HELDOUT_PROMPTS], _bench_strings())
    assert not hits, f"held-out prompts share word runs with the bench's prompts: {hits}"
