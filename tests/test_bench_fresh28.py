"""The bench's "fresh28" prompt set (bench/fresh28.py): 6 prompts of each open-text type in the
original set's shapes, chosen by `prompt_set` / `--prompt-set`, and held out: neither draft prompt
generator (v1, v2) writes a word run of min(5, its words) of any of them in a few thousand seeded
draws, and none shares such a run with the bench's other strings or the distillation held-out set;
no topic stem of fresh28.TOPICS begins a word of those draws or of the generators' module-level
lists (review28 N4: a generator taught a fresh28 topic in other words)."""

from __future__ import annotations

import pytest
from test_distill_heldout import (  # noqa: F401  (generated: the generators' draws, a fixture)
    _bench_strings,
    _draws,
    generated,
    _list_strings,
    _shared,
    _teach,
    _topic_hits,
    _v1,
    _v2,
    _words,
)

from specrouter.bench import BenchConfig, fresh28
from specrouter.bench.workloads import (
    CHAT_KINDS,
    KINDS,
    PROMPT_SETS,
    build_workloads,
    mixed_stream,
    requests_of,
)
from specrouter.cli.bench import config_from_args
from specrouter.cli.main import build_parser, main
from specrouter.distill.evaluate import HELDOUT_PROMPTS

FRESH = [t for k in KINDS for t in fresh28.PROMPTS[k]]
TOPICS = [stems for k in KINDS for stems in fresh28.TOPICS[k]]
# two prompts of the blind draft (commit 566fcc2) that the check replaced: v2's travel ask writes
# "what should I pack for a ...", v1's chat ask "what are the pros and cons of ..."
BLIND = {"v2": "What should I pack for a three-day canoe trip on a quiet river in early autumn?",
         "v1": "What are the pros and cons of learning the accordion as an adult beginner?"}



def test_six_distinct_prompts_of_each_type_in_the_original_shapes():
    assert set(PROMPT_SETS) == {"original", "fresh28"}
    assert {k: len(fresh28.PROMPTS[k]) for k in KINDS} == {k: 6 for k in KINDS}
    assert len(set(FRESH)) == len(FRESH) and all(len(_words(t)) >= 8 for t in FRESH)
    for t in fresh28.CODE:  # a stub: a header (sometimes after an import) and a docstring, no body
        assert t.startswith(("def ", "class ", "import ")) and t.count('"""') == 2 and t.endswith("\n")
    for t in fresh28.PROSE:  # an opening fragment to continue, not a finished sentence
        assert not t.rstrip().endswith((".", "?", "!", '"'))
    for t in fresh28.EXTRACTION:  # the payload to copy follows the request
        ask, payload = t.split("\n", 1)
        assert ask.endswith(":") and len(_words(payload)) >= 10
    for kind in KINDS:  # one entry of topic stems per prompt, in order, naming its own prompt's topic
        assert len(fresh28.TOPICS[kind]) == len(fresh28.PROMPTS[kind])
        for text, stems in zip(fresh28.PROMPTS[kind], fresh28.TOPICS[kind]):
            assert stems and _topic_hits([stems], [text]), (stems, text)
    for kind in KINDS:
        reqs = requests_of(kind, 6, "fresh28")
        assert [r.prompt for r in reqs] == fresh28.PROMPTS[kind]
        assert all(r.chat == (kind in CHAT_KINDS) and r.kind == kind for r in reqs)


def test_the_prompt_set_reaches_every_open_text_workload_and_the_config():
    fresh = build_workloads(("code", "mixed", "templated"), 2, prompt_set="fresh28")
    orig = build_workloads(("code", "mixed", "templated"), 2)
    assert [r.prompt for r in fresh[0].requests] == fresh28.CODE[:2]
    assert [r.prompt for r in fresh[1].requests] == [r.prompt for r in mixed_stream(2, prompt_set="fresh28")]
    assert {r.prompt for r in fresh[1].requests} <= set(FRESH)
    assert not {r.prompt for r in orig[0].requests + orig[1].requests} & set(FRESH)  # default: original
    assert fresh[2] == orig[2]  # the other streams are the same in both sets
    with pytest.raises(ValueError, match="unknown prompt set"):
        build_workloads(("code",), 1, prompt_set="fresh")
    with pytest.raises(ValueError, match="unknown prompt set"):
        BenchConfig(prompt_set="fresh")
    parser = build_parser()
    assert config_from_args(parser.parse_args(["bench"])).prompt_set == "original"
    for name in PROMPT_SETS:  # the flag takes every set, and nothing else
        assert config_from_args(parser.parse_args(["bench", "--prompt-set", name])).prompt_set == name
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--prompt-set", "fresh"])
    assert main(["bench", "--serve", "--prompt-set", "fresh28"]) == 2  # the serve bench has its own mix


def test_the_check_finds_the_blind_drafts_replaced_prompts(generated):
    # negative control: the check catches the two blind-draft prompts it made us replace, and a
    # fresh28 prompt among the bench strings (it is one: _bench_strings walks PROMPT_SETS)
    for name, text in BLIND.items():
        assert _shared([text], generated[name]), name
    assert _shared([fresh28.CHAT[0]], _bench_strings())


def test_the_topic_check_finds_a_generator_taught_a_fresh28_topic(monkeypatch):
    # negative control (review28 N4): fresh28 topics added in other words to v1's _TOPICS and v2's
    # CODE_TASKS are found in the lists and in the draws
    _teach(monkeypatch, "_TOPICS", "church bells")
    _teach(monkeypatch, "CODE_TASKS", "score a game of ten-pin bowling")
    assert {"bowling", "church bell"} <= {s for s, _ in _topic_hits(TOPICS, _list_strings())}
    assert "church bell" in {s for s, _ in _topic_hits(TOPICS, _draws(_v1))}
    assert "bowling" in {s for s, _ in _topic_hits(TOPICS, _draws(_v2))}


@pytest.mark.parametrize("which", ["v1", "v2"])
def test_no_generator_draws_a_fresh28_topic(generated, which):
    hits = _topic_hits(TOPICS, generated[which])
    assert not hits, f"the {which} generator writes fresh28 topics: {hits}"


def test_no_generator_list_holds_a_fresh28_topic():
    hits = _topic_hits(TOPICS, _list_strings())
    assert not hits, f"the generators' lists hold fresh28 topics: {hits}"


@pytest.mark.parametrize("which", ["v1", "v2"])
def test_no_generator_writes_a_fresh28_prompt(generated, which):
    hits = _shared(FRESH, generated[which])
    assert not hits, f"the {which} generator writes word runs of fresh28 prompts: {hits}"


def test_no_fresh28_prompt_shares_a_run_with_other_bench_strings_or_the_held_out_set():
    others = [s for s in _bench_strings() if s not in set(FRESH)]
    others += [t for _, t, _ in HELDOUT_PROMPTS]
    hits = _shared(FRESH, others)
    assert not hits, f"fresh28 prompts share word runs with the bench or HELDOUT_PROMPTS: {hits}"
