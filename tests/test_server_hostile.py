"""A corpus of malformed and hostile requests: each gets the right 4xx, in OpenAI's error shape,
with a message that says what is wrong; the server keeps serving afterwards."""

import http.client
import json

import pytest

pytest.importorskip("fastapi")

from specrouter.models.pool import Pool  # noqa: E402
from specrouter.server import ServerConfig, create_app  # noqa: E402
from specrouter.server.live import LiveServer  # noqa: E402

KEY = "k-hostile"
LIMIT = 16 * 1024
C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_pool_dirs):
    names = ["mid", "target"]
    pool = Pool.load([tiny_pool_dirs[n] for n in names], names=names, target="target", dtype="float64")
    app = create_app(pool, ServerConfig(api_key=KEY, chain=("ngram", "mid", "target"), k=3,
                                        max_num_seqs=2, max_model_len=128, max_body_bytes=LIMIT))
    with LiveServer(app) as srv:
        yield srv


def send(server, method, path, body=b"", headers=None, chunked=False):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    try:
        h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        h.update(headers or {})
        h = {k: v for k, v in h.items() if v is not None}
        if chunked:
            data = body
            conn.request(method, path, body=(data[i:i + 4096] for i in range(0, len(data), 4096)),
                         headers=h, encode_chunked=True)
        else:
            conn.request(method, path, body=body if body else None, headers=h)
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def j(obj) -> bytes:
    return json.dumps(obj).encode()


# (case id, path, raw body, extra headers, expected status, words the message must contain, param)
CORPUS = [
    ("truncated-json", C, b'{"prompt": "hi",', None, 400, "not valid JSON", None),
    ("empty-body", C, b"", None, 400, "empty", None),
    ("array-body", C, b"[1, 2]", None, 400, "JSON object", None),
    ("string-body", C, b'"hello"', None, 400, "JSON object", None),
    ("nan", C, b'{"prompt": "hi", "temperature": NaN}', None, 400, "NaN", None),
    ("infinity", C, b'{"prompt": "hi", "max_tokens": Infinity}', None, 400, "Infinity", None),
    ("raw-nul-byte", C, b'{"prompt": "hi"\x00}', None, 400, "not valid JSON", None),
    ("raw-control-char-in-string", C, b'{"prompt": "a\x00b"}', None, 400, "not valid JSON", None),
    ("invalid-utf8", C, b'{"prompt": "\xff\xfe"}', None, 400, "UTF-8", None),
    ("lone-surrogate", C, b'{"prompt": "abc\\ud800def"}', None, 400, "surrogate", "prompt"),
    ("lone-low-surrogate-chat", CHAT,
     b'{"messages": [{"role": "user", "content": "\\udc00"}]}', None, 400, "surrogate",
     "messages.0.content"),
    ("deep-nesting", C, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", None, 400, "nested", None),
    ("prompt-int", C, j({"prompt": 123}), None, 400, "'prompt' must be", "prompt"),
    ("prompt-mixed-list", C, j({"prompt": [1, "a"]}), None, 400, "'prompt' must be", "prompt"),
    ("several-prompts", C, j({"prompt": ["a", "b"]}), None, 400, "one prompt per request", "prompt"),
    ("token-id-out-of-range", C, j({"prompt": [1, 999999]}), None, 400, "token ids", "prompt"),
    ("negative-token-id", C, j({"prompt": [-1, 5]}), None, 400, "token ids", "prompt"),
    ("empty-prompt", C, j({"prompt": ""}), None, 400, "empty", "prompt"),
    ("missing-prompt", C, j({"max_tokens": 5}), None, 400, "missing required field 'prompt'", "prompt"),
    ("max-tokens-negative", C, j({"prompt": "hi", "max_tokens": -5}), None, 400, "max_tokens", "max_tokens"),
    ("max-tokens-zero", C, j({"prompt": "hi", "max_tokens": 0}), None, 400, "max_tokens", "max_tokens"),
    ("max-tokens-huge", C, j({"prompt": "hi", "max_tokens": 10**12}), None, 400, "over the context", "max_tokens"),
    ("max-tokens-string", C, j({"prompt": "hi", "max_tokens": "ten"}), None, 400, "max_tokens", "max_tokens"),
    ("max-tokens-float", C, j({"prompt": "hi", "max_tokens": 10.5}), None, 400, "max_tokens", "max_tokens"),
    ("temperature-string", C, j({"prompt": "hi", "temperature": "hot"}), None, 400, "temperature", "temperature"),
    ("temperature-negative", C, j({"prompt": "hi", "temperature": -1}), None, 400, "temperature", "temperature"),
    ("temperature-bool", C, j({"prompt": "hi", "temperature": True}), None, 400, "temperature", "temperature"),
    ("top-p-zero", C, j({"prompt": "hi", "top_p": 0}), None, 400, "top_p", "top_p"),
    ("n-2", C, j({"prompt": "hi", "n": 2}), None, 400, "only n=1", "n"),
    ("best-of", C, j({"prompt": "hi", "best_of": 3}), None, 400, "best_of", "best_of"),
    ("logprobs", C, j({"prompt": "hi", "logprobs": 5}), None, 400, "logprobs", "logprobs"),
    ("echo", C, j({"prompt": "hi", "echo": True}), None, 400, "echo", "echo"),
    ("presence-penalty", C, j({"prompt": "hi", "presence_penalty": 0.5}), None, 400, "presence_penalty", "presence_penalty"),
    ("logit-bias", C, j({"prompt": "hi", "logit_bias": {"5": 10}}), None, 400, "logit_bias", "logit_bias"),
    ("unknown-field", C, j({"prompt": "hi", "foo": 1}), None, 400, "unsupported field 'foo'", "foo"),
    ("stream-wrong-type", C, j({"prompt": "hi", "stream": "yes"}), None, 400, "stream", "stream"),
    ("stop-wrong-type", C, j({"prompt": "hi", "stop": 5}), None, 400, "'stop' must be", "stop"),
    ("stop-too-many", C, j({"prompt": "hi", "stop": [f"s{i}" for i in range(20)]}), None, 400, "'stop' must be", "stop"),
    ("stop-empty-string", C, j({"prompt": "hi", "stop": [""]}), None, 400, "'stop' must be", "stop"),
    ("seed-string", C, j({"prompt": "hi", "seed": "42"}), None, 400, "seed", "seed"),
    ("seed-huge", C, j({"prompt": "hi", "seed": 2**70}), None, 400, "seed", "seed"),
    ("unknown-model", C, j({"prompt": "hi", "model": "gpt-4"}), None, 404, "does not exist", "model"),
    ("chain-not-ending-at-target", C, j({"prompt": "hi", "specrouter_chain": ["mid"]}), None, 400, "must end at the target", "specrouter_chain"),
    ("chain-unknown-model", C, j({"prompt": "hi", "specrouter_chain": ["evil", "target"]}), None, 400, "unknown model", "specrouter_chain"),
    ("k-zero", C, j({"prompt": "hi", "specrouter_k": 0}), None, 400, "specrouter_k", "specrouter_k"),
    ("k-huge", C, j({"prompt": "hi", "specrouter_k": 99}), None, 400, "less than or equal to 16", "specrouter_k"),
    ("prompt-over-context", C, j({"prompt": "Speculative decoding drafts tokens. " * 40}), None, 400, "at most", "prompt"),
    ("chat-empty-messages", CHAT, j({"messages": []}), None, 400, "messages", "messages"),
    ("chat-messages-string", CHAT, j({"messages": "hi"}), None, 400, "messages", "messages"),
    ("chat-wrong-role", CHAT, j({"messages": [{"role": "wizard", "content": "hi"}]}), None, 400, "role", "messages.0.role"),
    ("chat-tool-role", CHAT, j({"messages": [{"role": "tool", "content": "hi"}]}), None, 400, "role", "messages.0.role"),
    ("chat-missing-content", CHAT, j({"messages": [{"role": "user"}]}), None, 400, "missing required field", "messages.0.content"),
    ("chat-image-part", CHAT, j({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}), None, 400, "list of text parts", "messages.0.content"),
    ("chat-prompt-field", CHAT, j({"messages": MSG, "prompt": "hi"}), None, 400, "unsupported field 'prompt'", "prompt"),
    ("chat-logprobs", CHAT, j({"messages": MSG, "logprobs": True}), None, 400, "logprobs", "logprobs"),
    ("chat-tools", CHAT, j({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}), None, 400, "tools", "tools"),
    ("chat-over-context", CHAT, j({"messages": [{"role": "user", "content": "fox " * 300}]}), None, 400, "at most", "messages"),
    ("top-k-negative", C, j({"prompt": "hi", "top_k": -2}), None, 400, "top_k", "top_k"),
    ("ignore-eos-string", C, j({"prompt": "hi", "ignore_eos": "yes"}), None, 400, "ignore_eos", "ignore_eos"),
    ("stream-options-wrong-type", C, j({"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}}), None, 400, "include_usage", "stream_options.include_usage"),
    ("user-int", C, j({"prompt": "hi", "user": 5}), None, 400, "user", "user"),
    ("frequency-penalty", C, j({"prompt": "hi", "frequency_penalty": 0.5}), None, 400, "frequency_penalty", "frequency_penalty"),
    ("suffix", C, j({"prompt": "hi", "suffix": "end"}), None, 400, "suffix", "suffix"),
    ("chat-max-completion-tokens-zero", CHAT, j({"messages": MSG, "max_completion_tokens": 0}), None, 400, "max_completion_tokens", "max_completion_tokens"),
    ("chat-top-logprobs", CHAT, j({"messages": MSG, "top_logprobs": 3}), None, 400, "top_logprobs", "top_logprobs"),
    ("chat-tool-choice", CHAT, j({"messages": MSG, "tool_choice": "auto"}), None, 400, "tool_choice", "tool_choice"),
    ("chat-functions", CHAT, j({"messages": MSG, "functions": [{"name": "f"}]}), None, 400, "functions", "functions"),
    ("chat-function-call", CHAT, j({"messages": MSG, "function_call": "auto"}), None, 400, "function_call", "function_call"),
    ("chat-parallel-tool-calls", CHAT, j({"messages": MSG, "parallel_tool_calls": True}), None, 400, "parallel_tool_calls", "parallel_tool_calls"),
    ("chat-json-response-format", CHAT, j({"messages": MSG, "response_format": {"type": "json_object"}}), None, 400, "response_format", "response_format"),
    ("chat-store", CHAT, j({"messages": MSG, "store": True}), None, 400, "store", "store"),
    ("chat-audio-modality", CHAT, j({"messages": MSG, "modalities": ["text", "audio"]}), None, 400, "modalities", "modalities"),
    ("chat-metadata-int", CHAT, j({"messages": MSG, "metadata": {"a": 1}}), None, 400, "metadata", "metadata.a"),
    ("chat-name-int", CHAT, j({"messages": [{"role": "user", "content": "hi", "name": 5}]}), None, 400, "name", "messages.0.name"),
    ("oversized-body", C, j({"prompt": "x" * (LIMIT + 10)}), None, 413, "over the limit", None),
    ("missing-auth", C, j({"prompt": "hi"}), {"Authorization": None}, 401, "API key", None),
    ("wrong-auth", C, j({"prompt": "hi"}), {"Authorization": "Bearer nope"}, 401, "API key", None),
    ("empty-bearer", C, j({"prompt": "hi"}), {"Authorization": "Bearer "}, 401, "API key", None),
    ("unknown-route", "/v1/engines", j({"prompt": "hi"}), None, 404, "no route", None),
]


@pytest.mark.parametrize("case", CORPUS, ids=[c[0] for c in CORPUS])
def test_hostile_request(server, case):
    name, path, body, headers, status, words, param = case
    got, hdrs, raw = send(server, "POST", path, body, headers)
    assert got == status, (name, raw[:300])
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert words in err["message"], (name, err["message"])
    if param is not None:
        assert err["param"] == param, (name, err)
    if status == 401:
        assert hdrs.get("www-authenticate") == "Bearer"


def test_more_hostile_shapes(server):
    # an oversized body without Content-Length (chunked) is cut off as it arrives
    status, _, raw = send(server, "POST", C, j({"prompt": "y" * (2 * LIMIT)}), chunked=True)
    assert status == 413 and "over the limit" in json.loads(raw)["error"]["message"]
    # wrong method: 405 in the same error shape
    status, _, raw = send(server, "GET", C)
    assert status == 405 and "not allowed" in json.loads(raw)["error"]["message"]


def test_corpus_covers_every_request_field():
    """Every field a request may carry (the protocol's models, read here) has a hostile case
    naming it, and every refusal status is exercised: a field added to the protocol without a
    case, or a case dropped, fails here."""
    from specrouter.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest

    params = {c[6] for c in CORPUS if c[6] is not None}
    fields = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    fields |= {f"messages.0.{f}" for f in ChatMessage.model_fields}
    uncovered = {f for f in fields if not any(p == f or p.startswith(f + ".") for p in params)}
    assert not uncovered, f"fields without a hostile case: {sorted(uncovered)}"
    assert {c[4] for c in CORPUS} == {400, 401, 404, 413}
    assert len({c[0] for c in CORPUS}) == len(CORPUS), "case ids are unique"


def test_server_still_serves_after_hostile_requests(server):
    for _ in range(3):  # a few more bad ones, then good ones
        send(server, "POST", C, b"{{{{")
    # unicode edge cases that ARE valid: escaped NUL, emoji (surrogate pair), combining, RTL
    for prompt in ["a\u0000b", "smile \U0001F600 ok", "e\u0301\u0301 \u05e9\u05dc\u05d5\u05dd"]:
        status, _, raw = send(server, "POST", C, j({"prompt": prompt, "max_tokens": 4, "temperature": 0}))
        assert status == 200, raw
        assert json.loads(raw)["usage"]["completion_tokens"] >= 1
    status, _, raw = send(server, "POST", CHAT, j({"messages": MSG, "max_tokens": 5, "temperature": 0}))
    body = json.loads(raw)
    assert status == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    status, _, raw = send(server, "GET", "/health", headers={"Authorization": None})
    assert status == 200 and json.loads(raw)["status"] == "ok"
    status, _, raw = send(server, "GET", "/metrics")
    text = raw.decode()
    assert 'specrouter_requests_total{endpoint="/v1/completions",status="400"}' in text
    assert 'specrouter_requests_total{endpoint="other",status="404"}' in text
