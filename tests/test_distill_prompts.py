"""The corpus's prompt sets: v2 (prompts_v2.py) is a function of its seed, produces every kind
of ask, system-prompted, plain and multi-turn chats, goes through a chat template, and keeps
long chats within the prompt budget; v1 stays selectable and old corpora read as v1."""

from __future__ import annotations

import json
import random

import pytest
import torch
from fixtures import make_tiny_llama, make_tiny_tokenizer

from specrouter.distill import prompts_v2, prompts_v2_raw
from specrouter.distill.corpus import GEN_MIX_V2, CorpusSpec, _chat_ids, _prompt_stream, build_corpus
from specrouter.errors import SpecRouterError


def _spec(**kw) -> CorpusSpec:
    base = dict(target="t", vocab_size=320, corpus_tokens=2000, generated_fraction=0.5, seq_len=64,
                teacher_topk=4, temperature=0.7, greedy_fraction=0.5, eval_fraction=0.2, seed=1)
    return CorpusSpec(**{**base, **kw})


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tok")
    make_tiny_tokenizer(folder)
    return AutoTokenizer.from_pretrained(str(folder))


def _draws(seed: int, n: int = 50):
    rng = random.Random(seed)
    return [(prompts_v2.chat_messages(rng), prompts_v2_raw.prose_prompt(rng, ["a doc paragraph"]),
             prompts_v2_raw.code_prompt(rng, ["def f(x):\n"]), prompts_v2_raw.qa_prompt(rng)) for _ in range(n)]


def test_v2_prompts_are_a_function_of_the_seed():
    assert _draws(5) == _draws(5)
    assert _draws(5) != _draws(6)


def test_v2_chats_cover_every_kind_system_prompts_and_earlier_turns():
    rng = random.Random(0)
    chats = [prompts_v2.chat_messages(rng) for _ in range(2000)]
    assert {kind for kind, _ in chats} == set(prompts_v2.CHAT_KINDS)
    shapes = {(m[0]["role"] == "system", sum(x["role"] == "user" for x in m)) for _, m in chats}
    assert {(False, 1), (True, 1), (False, 2), (True, 2), (False, 3)} <= shapes
    for _, messages in chats:  # a well-formed chat: alternating turns ending with the user's
        turns = [m["role"] for m in messages if m["role"] != "system"]
        assert turns[-1] == "user" and all(a != b for a, b in zip(turns, turns[1:]))
        assert all(m["content"].strip() for m in messages)
    # the other sources vary too: many distinct openings per seed
    draws = _draws(1, 300)
    for i in (1, 2, 3):
        assert len({d[i] for d in draws}) > 40


def test_v2_stream_goes_through_the_chat_template_within_the_prompt_budget(tokenizer):
    spec = _spec(prompts="v2", seq_len=96)
    stream = _prompt_stream(tokenizer, spec, random.Random(3))
    seen = {}
    for _ in range(400):
        name, ids, greedy, is_eval = next(stream)
        assert 0 < len(ids) <= spec.seq_len // 2 and all(isinstance(i, int) for i in ids)
        seen.setdefault(name, tokenizer.decode(ids))
    assert set(seen) == set(GEN_MIX_V2)
    assert seen["gen-chat"].rstrip().endswith("<|im_start|>assistant")


def test_a_long_chat_drops_its_earliest_exchanges_and_keeps_the_system_prompt(tokenizer):
    system = {"role": "system", "content": "Be brief."}
    old = [{"role": "user", "content": "first question " * 20}, {"role": "assistant", "content": "ok " * 20}]
    last = {"role": "user", "content": "last question"}
    ids = _chat_ids(tokenizer, [system, *old, last], max_prompt=40)
    text = tokenizer.decode(ids)
    assert len(ids) <= 40 and "Be brief." in text and "first question" not in text and "last question" in text
    # a single over-long turn is cut from the start, as v1 always did
    assert len(_chat_ids(tokenizer, [{"role": "user", "content": "word " * 200}], max_prompt=40)) == 40


def test_v1_stays_selectable_and_old_corpora_read_as_v1(tmp_path):
    assert _spec().prompts == "v1"
    with pytest.raises(SpecRouterError, match="prompts"):
        _spec(prompts="v3")
    target = make_tiny_llama(tmp_path / "target", vocab_size=320, hidden_size=32, num_layers=1, seed=3)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(target)).eval()
    tok = AutoTokenizer.from_pretrained(str(target))
    spec = _spec(target=str(target), corpus_tokens=600)
    build_corpus(model, tok, tmp_path / "c", spec, progress=False)
    # a corpus written before the prompts field existed: its spec.json lacks the key
    path = tmp_path / "c" / "spec.json"
    old = json.loads(path.read_text())
    del old["prompts"]
    path.write_text(json.dumps(old))
    assert build_corpus(None, None, tmp_path / "c", spec).tokens.shape[0] > 0
    with pytest.raises(SpecRouterError, match="other settings"):
        build_corpus(None, None, tmp_path / "c", _spec(target=str(target), corpus_tokens=600, prompts="v2"))
    # the same seed gives other prompts under v2 (the set is part of what a corpus is)
    v2 = build_corpus(model, tok, tmp_path / "c2", _spec(target=str(target), corpus_tokens=600, prompts="v2"),
                      progress=False)
    v1 = build_corpus(None, None, tmp_path / "c", spec)
    assert not torch.equal(v1.tokens[:4], v2.tokens[:4])


def test_v1_stream_is_pinned(tokenizer, monkeypatch):
    # the shipped draft's corpora were built from v1; `--prompts v1` rebuilds them only while
    # corpus.py's v1 helpers and the stream write the same prompts (review27 N2). Snippet sources
    # fixed (the machine's stdlib and /usr/share/doc vary); the text is hashed, not the ids, so a
    # tokenizers release that merges differently does not move it (no prompt is cut at 4096).
    import hashlib

    from specrouter.distill import corpus

    monkeypatch.setattr(corpus, "stdlib_files", lambda: [])
    monkeypatch.setattr(corpus, "doc_files", lambda: [])
    monkeypatch.setattr(corpus, "_code_snippets", lambda files, rng: ["def f(x):\n    return x\n"])
    monkeypatch.setattr(corpus, "_prose_snippets", lambda files, rng: ["A paragraph from a manual."])
    stream = _prompt_stream(tokenizer, _spec(seq_len=4096), random.Random(1))
    h = hashlib.sha256()
    for _ in range(50):
        name, ids, greedy, is_eval = next(stream)
        h.update(repr((name, tokenizer.decode(ids), greedy, is_eval)).encode())
    assert h.hexdigest()[:16] == "0ae5adc587b63cd3"


def test_v1_helpers_are_pinned():
    # the stream pin above draws 50 prompts (16 of v1's 52 topics, never the "Q: Why is ..." form):
    # 3,000 draws of each v1 helper reach every list entry and every form, so an edit of corpus.py's
    # v1 lists or templates moves this hash (review28 N6). No tokenizer: the text is hashed.
    import hashlib

    from specrouter.distill import corpus

    rng, h = random.Random(0), hashlib.sha256()
    for _ in range(3000):
        h.update(repr((corpus._chat_messages(rng), corpus._prose_prompt(rng, ["<prose snippet>"]),
                       corpus._code_prompt(rng, ["<code snippet>"]), corpus._qa_prompt(rng))).encode())
    assert h.hexdigest()[:16] == "8a94dd130e7141a2"
