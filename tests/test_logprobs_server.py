"""Logprobs through the server (issue 31, item 2) with the real openai client on 127.0.0.1: a
speculating server (ngram > mid > target, k=3, float32: row-invariant) returns exactly the
logprobs of the engine's plain decoding of the target; streamed chunks add up to the whole
response; completions `echo` carries the prompt's logprobs; vLLM's `prompt_logprobs`."""

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from fixtures import load_named_pool  # noqa: E402

from specrouter.config import SamplingParams  # noqa: E402
from specrouter.engine.engine import Engine  # noqa: E402
from specrouter.server import ServerConfig, create_app  # noqa: E402
from specrouter.server.live import LiveServer  # noqa: E402
from specrouter.server.logprobs import FILTERED_LOGPROB  # noqa: E402

NAMES = ("target", "mid")
PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):"


@pytest.fixture(scope="module")
def pool(tiny_pool_dirs):
    return load_named_pool(tiny_pool_dirs, NAMES, dtype="float32")


@pytest.fixture(scope="module")
def server(tiny_pool_dirs):
    cfg = ServerConfig(chain=("ngram", "mid", "target"), k=3, max_num_seqs=4, max_model_len=256)
    with LiveServer(create_app(load_named_pool(tiny_pool_dirs, NAMES, dtype="float32"), cfg)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)


def plain(pool, ids, **sp):
    return Engine(pool).generate_ids([ids], [SamplingParams(**sp)], chain=("target",))[0]


def text_of(pool, t):
    return pool.tokenizer.decode([t], skip_special_tokens=False)


CHAT_CASES = [
    (dict(temperature=0), dict()),
    (dict(temperature=0.7, seed=5, presence_penalty=0.8, extra_body={"top_k": 40}),
     dict(temperature=0.7, seed=5, presence_penalty=0.8, top_k=40)),
]


@pytest.mark.parametrize("case", range(len(CHAT_CASES)))
def test_chat_logprobs_equal_plain_decoding_and_stream(pool, client, case):
    body, sp = CHAT_CASES[case]
    msgs = [{"role": "user", "content": PROMPT}]
    from specrouter.models.tokenizer import apply_chat_template

    ids = apply_chat_template(pool.tokenizer, msgs, add_generation_prompt=True)
    ref = plain(pool, ids, max_new_tokens=12, logprobs=3, **sp)
    r = client.chat.completions.create(model="target", messages=msgs, max_tokens=12, logprobs=True,
                                       top_logprobs=3, **body)
    content = r.choices[0].logprobs.content
    assert len(content) == len(ref.output_ids) == r.usage.completion_tokens
    for c, e in zip(content, ref.logprobs):
        assert c.token == text_of(pool, e.token) and c.logprob == e.logprob  # exactly
        assert c.bytes == list(c.token.encode())
        assert [(t.token, t.logprob) for t in c.top_logprobs] == [(text_of(pool, t), lp) for t, lp in e.top]
    # streamed: the chunks' logprobs add up to the whole response's
    chunks = list(client.chat.completions.create(model="target", messages=msgs, max_tokens=12,
                                                 logprobs=True, top_logprobs=3, stream=True, **body))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs
                for c in ch.choices[0].logprobs.content]
    assert [c.model_dump() for c in streamed] == [c.model_dump() for c in content]
    # without logprobs: none
    assert client.chat.completions.create(model="target", messages=msgs, max_tokens=3,
                                          **body).choices[0].logprobs is None


def test_completions_logprobs_and_echo(pool, client):
    ids = pool.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    ref = plain(pool, ids, max_new_tokens=6, logprobs=2, prompt_logprobs=2)
    r = client.completions.create(model="target", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == [e.logprob for e in ref.logprobs]
    assert lp.tokens == [text_of(pool, e.token) for e in ref.logprobs]
    for top, e in zip(lp.top_logprobs, ref.logprobs):  # the n best and the token itself
        want = {}
        for t, v in [*e.top, (e.token, e.logprob)]:  # a text two tokens share: the likelier
            want.setdefault(text_of(pool, t), v)
        assert top == want
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # echo: the prompt first, its first token without a logprob, then the same completion
    e = client.completions.create(model="target", prompt=PROMPT, max_tokens=6, temperature=0,
                                  logprobs=2, echo=True)
    assert e.choices[0].text == PROMPT + r.choices[0].text
    elp = e.choices[0].logprobs
    assert elp.token_logprobs[0] is None and elp.top_logprobs[0] is None
    assert elp.token_logprobs[1:len(ids)] == [x.logprob for x in ref.prompt_logprobs]
    assert elp.token_logprobs[len(ids):] == lp.token_logprobs
    assert elp.tokens == [text_of(pool, t) for t in ids] + lp.tokens
    # echo streamed: the prompt's chunk first, the chunks add up to the whole
    chunks = list(client.completions.create(model="target", prompt=PROMPT, max_tokens=6, temperature=0,
                                            logprobs=2, echo=True, stream=True))
    assert chunks[0].choices[0].text == PROMPT
    assert "".join(c.choices[0].text for c in chunks if c.choices) == e.choices[0].text
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for c in chunks if c.choices and c.choices[0].logprobs
                for x in getattr(c.choices[0].logprobs, key)] == getattr(elp, key), key
    # vLLM's return_tokens_as_token_ids: tokens named by id
    ti = client.completions.create(model="target", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2,
                                   extra_body={"return_tokens_as_token_ids": True})
    assert ti.choices[0].logprobs.tokens == [f"token_id:{x.token}" for x in ref.logprobs]
    assert ti.choices[0].logprobs.token_logprobs == lp.token_logprobs
    # echo without logprobs: the text only
    plain_echo = client.completions.create(model="target", prompt=PROMPT, max_tokens=6, temperature=0, echo=True)
    assert plain_echo.choices[0].text == e.choices[0].text and plain_echo.choices[0].logprobs is None


def test_vllm_prompt_logprobs_and_filtered_tokens(pool, server, client):
    import httpx

    ids = pool.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    ref = plain(pool, ids, max_new_tokens=4, prompt_logprobs=1, logprobs=2, temperature=1.0, top_k=1, seed=1)
    body = {"prompt": PROMPT, "max_tokens": 4, "prompt_logprobs": 1, "logprobs": 2, "temperature": 1.0,
            "top_k": 1, "seed": 1}
    out = httpx.post(server.base_url + "/completions", json=body, timeout=60).json()["choices"][0]
    pl = out["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(ids)
    for d, e in zip(pl[1:], ref.prompt_logprobs):
        assert d[str(e.token)] == {"logprob": e.logprob, "rank": e.rank, "decoded_token": text_of(pool, e.token)}
        best, lp = e.top[0]
        assert d[str(best)]["rank"] == 1 and d[str(best)]["logprob"] == lp
    # top_k=1: every other token was filtered out: its logprob is -inf, written -9999.0
    for top, e in zip(out["logprobs"]["top_logprobs"], ref.logprobs):
        assert e.logprob == 0.0 and e.top[1][1] == float("-inf")
        assert sorted(top.values()) == sorted({0.0, -9999.0} if len(top) == 2 else {0.0})
    assert FILTERED_LOGPROB == -9999.0
    json.dumps(out)  # finite JSON


def test_top_logprobs_needs_logprobs(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="target", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2, top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs"
