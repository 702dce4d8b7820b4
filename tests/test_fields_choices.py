"""n and best_of (issue 31, item 3) through a live speculating server with the openai client:
streamed n > 1 (each choice's chunks, by index, add up to the whole response's choice; usage
once), best_of = the n rows with the highest mean logprob per token among best_of seeded rows
(checked against the same rows run as n = best_of with their logprobs)."""

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from fixtures import load_named_pool  # noqa: E402

from specrouter.server import ServerConfig, create_app  # noqa: E402
from specrouter.server.live import LiveServer  # noqa: E402

NAMES = ("target", "mid")
PROMPT = "The quick brown fox"
MSGS = [{"role": "user", "content": "Say something"}]


@pytest.fixture(scope="module")
def client(tiny_pool_dirs):
    cfg = ServerConfig(chain=("ngram", "mid", "target"), k=3, max_num_seqs=8, max_model_len=256)
    with LiveServer(create_app(load_named_pool(tiny_pool_dirs, NAMES, dtype="float32"), cfg)) as srv:
        yield openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=60)


def by_index(chunks, get):
    out = {}
    for ch in chunks:
        for c in ch.choices:
            out.setdefault(c.index, []).append(get(c))
    return out


def test_streamed_n_equals_whole(client):
    kw = dict(model="target", prompt=PROMPT, max_tokens=10, temperature=1.0, seed=21, n=3, logprobs=1)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    texts = by_index(chunks, lambda c: c.text)
    assert sorted(texts) == [0, 1, 2]
    assert ["".join(texts[i]) for i in range(3)] == [c.text for c in whole.choices]
    assert len({c.text for c in whole.choices}) == 3  # distinct rows
    lps = by_index(chunks, lambda c: c.logprobs.token_logprobs if c.logprobs else [])
    assert [sum(lps[i], []) for i in range(3)] == [c.logprobs.token_logprobs for c in whole.choices]
    finishes = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason]
    assert len(finishes) == 3
    usage = [ch.usage for ch in chunks if ch.usage is not None]
    assert len(usage) == 1 and not chunks[-1].choices
    assert usage[0].completion_tokens == whole.usage.completion_tokens
    assert usage[0].prompt_tokens == whole.usage.prompt_tokens  # the prompt counted once


def test_streamed_chat_n(client):
    kw = dict(model="target", messages=MSGS, max_tokens=8, temperature=0.9, seed=3, n=2)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    roles = [c.index for ch in chunks for c in ch.choices if c.delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
    parts = by_index(chunks, lambda c: c.delta.content or "")
    assert ["".join(parts[i]) for i in range(2)] == [c.message.content for c in whole.choices]
    # choice 0 of a seeded n is the n = 1 answer, streamed or not
    one = client.chat.completions.create(**{**kw, "n": 1})
    assert one.choices[0].message.content == whole.choices[0].message.content


def test_best_of_returns_the_rows_with_the_best_mean_logprob(client):
    kw = dict(model="target", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5)
    rows = client.completions.create(n=4, logprobs=0, **kw)  # the same 4 seeded rows
    means = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in rows.choices]
    best = sorted(range(4), key=lambda i: -means[i])[:2]
    assert len(set(means)) == 4  # the ranking is not a tie
    r = client.completions.create(n=2, extra_body={"best_of": 4}, **kw)
    assert [c.text for c in r.choices] == [rows.choices[i].text for i in best]
    assert [c.index for c in r.choices] == [0, 1] and all(c.logprobs is None for c in r.choices)
    assert r.usage.completion_tokens == rows.usage.completion_tokens  # every row was generated
    # best_of with logprobs asked: the chosen rows' own logprobs
    r2 = client.completions.create(n=1, logprobs=0, extra_body={"best_of": 4}, **kw)
    assert r2.choices[0].logprobs.token_logprobs == rows.choices[best[0]].logprobs.token_logprobs
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(n=2, stream=True, extra_body={"best_of": 3}, **kw)
    assert e.value.body["param"] == "best_of"
