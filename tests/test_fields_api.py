"""The request fields clients send (issue 31, part a), against a live server on 127.0.0.1 with
the real `openai` client: unknown fields are ignored and named in a header, explicit null is
the default, usage comes once per stream and only when asked (checked with LangChain's own
aggregation), CORS only for the allowed origins, /tokenize and /detokenize in vLLM's and
llama-server's shapes, served-model aliases, a chat template file and `chat_template_kwargs`."""

import http.client
import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from specrouter.models.pool import Pool  # noqa: E402
from specrouter.models.tokenizer import apply_chat_template  # noqa: E402
from specrouter.server import ServerConfig, create_app  # noqa: E402
from specrouter.server.live import LiveServer  # noqa: E402
from specrouter.server.protocol import IGNORED_FIELDS_HEADER  # noqa: E402

KEY = "fields-key"
ORIGIN = "http://localhost:3000"
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>"
            "{% endfor %}{% if greeting is defined %}[{{ greeting }}]{% endif %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
MSGS = [{"role": "user", "content": "Say hi"}]


def load_pool(dirs):
    names = ["mid", "target"]
    return Pool.load([dirs[n] for n in names], names=names, target="target", dtype="float64")


@pytest.fixture(scope="module")
def server(tiny_pool_dirs):
    cfg = ServerConfig(api_key=KEY, chain=("ngram", "mid", "target"), k=3, max_num_seqs=4,
                       max_model_len=256, served_model_name="tiny-chat",
                       model_aliases=("gpt-3.5-turbo", "tiny"), allowed_origins=(ORIGIN,),
                       chat_template=TEMPLATE)
    with LiveServer(create_app(load_pool(tiny_pool_dirs), cfg)) as srv:
        yield srv


@pytest.fixture(scope="module")
def plain_server(tiny_pool_dirs):
    """Defaults: no CORS, the target's own template, one name."""
    with LiveServer(create_app(load_pool(tiny_pool_dirs), ServerConfig(max_model_len=256))) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tok(tiny_pool_dirs):
    return load_pool(tiny_pool_dirs).tokenizer


def send(srv, method, path, body=None, headers=None):
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
    try:
        h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **(headers or {})}
        h = {k: v for k, v in h.items() if v is not None}
        conn.request(method, path, body=None if body is None else json.dumps(body).encode(), headers=h)
        r = conn.getresponse()
        text = r.read().decode()
        try:
            return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(text)
        except ValueError:
            return r.status, {k.lower(): v for k, v in r.getheaders()}, text
    finally:
        conn.close()


# -- lenient parsing ---------------------------------------------------------------------------
def test_unknown_fields_are_ignored_and_named(server, client):
    base = {"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0}
    status, hdrs, plain = send(server, "POST", "/v1/completions", base)
    assert status == 200 and IGNORED_FIELDS_HEADER.lower() not in hdrs
    extra = {"cache_prompt": True, "n_predict": 5, "litellm_trace": {"a": 1}}
    status, hdrs, body = send(server, "POST", "/v1/completions", {**base, **extra})
    assert status == 200, body
    assert hdrs[IGNORED_FIELDS_HEADER.lower()] == "cache_prompt,litellm_trace,n_predict"
    assert body["choices"][0]["text"] == plain["choices"][0]["text"]
    # through the openai client (extra_body), chat, and an unknown field inside a message
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-chat", messages=[{"role": "user", "content": "hi", "weight": 1}],
        max_tokens=4, temperature=0, extra_body={"cache_prompt": True})
    assert raw.headers[IGNORED_FIELDS_HEADER] == "cache_prompt,messages.0.weight"
    assert raw.parse().choices[0].message.content is not None


def test_explicit_null_is_the_default(server):
    base = {"prompt": "The quick brown fox", "max_tokens": 8, "seed": 7}
    nulls = {"temperature": None, "top_p": None, "top_k": None, "stream": None, "stop": None,
             "n": None, "logprobs": None, "presence_penalty": None, "user": None,
             "stream_options": None, "min_p": None, "logit_bias": None}
    s1, _, a = send(server, "POST", "/v1/completions", base)
    s2, _, b = send(server, "POST", "/v1/completions", {**base, **nulls})
    assert s1 == s2 == 200, b
    assert a["choices"][0]["text"] == b["choices"][0]["text"]  # temperature 1.0, seeded


def test_recognised_but_not_implemented_is_a_400_naming_it(server):
    status, _, body = send(server, "POST", "/v1/chat/completions",
                           {"messages": MSGS, "functions": [{"name": "f"}]})
    assert status == 400 and body["error"]["param"] == "functions", body
    assert "not implemented" in body["error"]["message"], body
    # at its default value it is accepted
    status, _, body = send(server, "POST", "/v1/chat/completions",
                           {"messages": MSGS, "max_tokens": 2, "use_beam_search": False,
                            "tool_choice": "none", "tools": [], "skip_special_tokens": True})
    assert status == 200, body


# -- usage once per stream ---------------------------------------------------------------------
def _usage_chunks(chunks):
    return [c.usage for c in chunks if c.usage is not None]


def test_stream_usage_once_and_only_when_asked(client):
    kw = dict(model="tiny", messages=MSGS, max_tokens=12, temperature=0, stream=True)
    chunks = list(client.chat.completions.create(**kw))
    assert _usage_chunks(chunks) == []
    chunks = list(client.chat.completions.create(**kw, stream_options={"include_usage": True}))
    usages = _usage_chunks(chunks)
    assert len(usages) == 1 and chunks[-1].choices == [] and chunks[-1].usage is usages[0]
    n = sum(1 for c in chunks if c.choices and c.choices[0].delta.content) 
    assert usages[0].completion_tokens >= n >= 1
    full = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=12, temperature=0)
    assert usages[0].prompt_tokens == full.usage.prompt_tokens
    assert usages[0].completion_tokens == full.usage.completion_tokens
    # completions too
    chunks = list(client.completions.create(model="tiny", prompt="def f(x):", max_tokens=6,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert len(_usage_chunks(chunks)) == 1 and chunks[-1].choices == []


def test_langchain_aggregated_usage_equals_the_servers(server, client):
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(base_url=server.base_url, api_key=KEY, model="tiny-chat", temperature=0,
                        max_tokens=12, stream_usage=True, max_retries=0)
    total = None
    for chunk in llm.stream("Say hi"):
        total = chunk if total is None else total + chunk
    full = client.chat.completions.create(model="tiny-chat", messages=MSGS, max_tokens=12,
                                          temperature=0)
    u = total.usage_metadata
    assert (u["input_tokens"], u["output_tokens"], u["total_tokens"]) == (
        full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens)
    assert total.content == full.choices[0].message.content


# -- CORS --------------------------------------------------------------------------------------
def test_cors_for_allowed_origins_only(server, plain_server):
    pre = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type", "Authorization": None}
    status, hdrs, _ = send(server, "OPTIONS", "/v1/chat/completions", headers=pre)
    assert status == 200 and hdrs["access-control-allow-origin"] == ORIGIN
    assert "POST" in hdrs["access-control-allow-methods"]
    status, hdrs, _ = send(server, "POST", "/v1/completions",
                           {"prompt": "hi", "max_tokens": 1, "foo": 1}, headers={"Origin": ORIGIN})
    assert status == 200 and hdrs["access-control-allow-origin"] == ORIGIN
    assert IGNORED_FIELDS_HEADER.lower() in hdrs["access-control-expose-headers"].lower()
    # another origin: no CORS grant (the browser refuses to read the answer)
    status, hdrs, _ = send(server, "OPTIONS", "/v1/chat/completions",
                           headers={**pre, "Origin": "http://evil.example"})
    assert status == 400 and "access-control-allow-origin" not in hdrs
    # the default: no CORS headers at all
    status, hdrs, _ = send(plain_server, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1},
                           headers={"Origin": ORIGIN, "Authorization": None})
    assert status == 200 and "access-control-allow-origin" not in hdrs
    status, hdrs, _ = send(plain_server, "OPTIONS", "/v1/completions", headers=pre)
    assert status == 405 and "access-control-allow-origin" not in hdrs


# -- /tokenize, /detokenize ----------------------------------------------------------------------
def test_tokenize_detokenize_vllm_shape(server, tok):
    text = "def add(a, b):"
    ids = tok(text, add_special_tokens=True)["input_ids"]
    status, _, body = send(server, "POST", "/tokenize", {"prompt": text, "return_token_strs": True})
    assert status == 200 and body["tokens"] == ids and body["count"] == len(ids)
    assert body["max_model_len"] == 256 and body["token_strs"] == tok.convert_ids_to_tokens(ids)
    status, _, body = send(server, "POST", "/detokenize", {"tokens": ids})
    assert status == 200 and body["prompt"] == tok.decode(ids)
    # a chat: the server's template (see test_chat_template_file)
    status, _, body = send(server, "POST", "/tokenize", {"messages": MSGS, "model": "tiny"})
    assert status == 200 and body["tokens"] == apply_chat_template(tok, MSGS, template=TEMPLATE)
    # the API key guards them; bad ids are a 400
    assert send(server, "POST", "/tokenize", {"prompt": "x"}, headers={"Authorization": None})[0] == 401
    status, _, body = send(server, "POST", "/detokenize", {"tokens": [10**9]})
    assert status == 400 and body["error"]["param"] == "tokens"
    status, _, body = send(server, "POST", "/tokenize", {"prompt": "a", "content": "b"})
    assert status == 400 and body["error"]["param"] == "content"


def test_tokenize_detokenize_llama_server_shape(server, tok):
    text = "The quick brown fox"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    status, _, body = send(server, "POST", "/tokenize", {"content": text})
    assert status == 200 and body == {"tokens": ids}
    status, _, body = send(server, "POST", "/tokenize", {"content": text, "with_pieces": True})
    assert [p["id"] for p in body["tokens"]] == ids
    assert "".join(p["piece"] for p in body["tokens"]) == tok.decode(ids)
    status, _, body = send(server, "POST", "/detokenize", {"tokens": ids})
    assert status == 200 and body["content"] == tok.decode(ids)


# -- served names, chat template -----------------------------------------------------------------
def test_served_model_name_and_aliases(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny-chat", "gpt-3.5-turbo", "tiny"]
    for name in ("tiny-chat", "gpt-3.5-turbo", "tiny", "target"):
        r = client.completions.create(model=name, prompt="hi", max_tokens=1)
        assert r.model == "tiny-chat"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=1)


def test_chat_template_file_and_kwargs(server, tok):
    def prompt_tokens(body):
        status, _, r = send(server, "POST", "/v1/chat/completions",
                            {"messages": MSGS, "max_tokens": 1, **body})
        assert status == 200, r
        return r["usage"]["prompt_tokens"]

    def n(text):
        return len(tok(text, add_special_tokens=False)["input_ids"])

    assert prompt_tokens({}) == n("<user>Say hi</user><assistant>")
    assert prompt_tokens({"chat_template_kwargs": {"greeting": "hello there"}}) == n(
        "<user>Say hi</user>[hello there]<assistant>")
    assert prompt_tokens({"add_generation_prompt": False}) == n("<user>Say hi</user>")
    status, _, body = send(server, "POST", "/v1/chat/completions",
                           {"messages": MSGS, "chat_template_kwargs": {"messages": []}})
    assert status == 400 and "chat_template_kwargs" in body["error"]["message"]


def test_serve_cli_flags(tmp_path):
    from specrouter.cli.main import build_parser
    from specrouter.cli.serve import config_from_args

    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    args = build_parser().parse_args(
        ["serve", "--served-model-name", "a", "b", "--allowed-origins", ORIGIN, "*",
         "--chat-template", str(f)])
    cfg = config_from_args(args).server
    assert (cfg.served_model_name, cfg.model_aliases) == ("a", ("b",))
    assert cfg.allowed_origins == (ORIGIN, "*") and cfg.chat_template == TEMPLATE


# -- sampling controls through the server ---------------------------------------------------------
def test_controls_through_the_server_equal_plain_decoding(server, client, tiny_pool_dirs, tok):
    """The server's chain (ngram > mid > target, k=3) with every control, greedy and seeded,
    equals the engine's plain decoding of the target with the same SamplingParams."""
    from specrouter.config import SamplingParams
    from specrouter.engine.engine import Engine

    pool = load_pool(tiny_pool_dirs)
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):"
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    cases = [
        (dict(temperature=0, presence_penalty=1.2, frequency_penalty=0.6),
         dict(presence_penalty=1.2, frequency_penalty=0.6)),
        (dict(temperature=0, logit_bias={"7": 5.0, "11": -100}, extra_body={
            "repetition_penalty": 1.5, "min_tokens": 20, "stop_token_ids": [13]}),
         dict(logit_bias=((7, 5.0), (11, -100.0)), repetition_penalty=1.5, min_tokens=20,
              stop_token_ids=(13,))),
        (dict(temperature=0.8, seed=11, presence_penalty=0.7, extra_body={"min_p": 0.05, "top_k": 40}),
         dict(temperature=0.8, seed=11, presence_penalty=0.7, min_p=0.05, top_k=40)),
    ]
    for body, sp in cases:
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, **body)
        seq = Engine(pool).generate_ids([ids], [SamplingParams(max_new_tokens=24, **sp)],
                                        chain=("target",))[0]
        assert r.choices[0].text == tok.decode(seq.output_ids, skip_special_tokens=True), body
        assert r.usage.completion_tokens == len(seq.output_ids)


# -- n > 1 ---------------------------------------------------------------------------------------
def test_n_choices_seeded_distinct_and_reproducible(client):
    kw = dict(model="tiny", prompt="The quick brown fox", max_tokens=12, temperature=1.0, seed=21)
    r = client.completions.create(n=3, **kw)
    texts = [c.text for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2] and len(set(texts)) == 3
    assert [c.text for c in client.completions.create(n=3, **kw).choices] == texts  # reproducible
    assert client.completions.create(**kw).choices[0].text == texts[0]  # choice 0 is the n=1 answer
    single = client.completions.create(**kw)
    assert r.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counted once
    # greedy: n identical rows, each plain greedy; chat too
    g = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=8, temperature=0, n=2)
    one = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=8, temperature=0)
    assert [c.message.content for c in g.choices] == [one.choices[0].message.content] * 2
    assert g.usage.completion_tokens == 2 * one.usage.completion_tokens
