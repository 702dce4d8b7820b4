"""A corpus of malformed and hostile requests: each gets the right 4xx, in OpenAI's error shape,
with a message that says what is wrong, while a stream running at the same moment finishes
exactly as it would alone; the server keeps serving afterwards."""

import contextlib
import http.client
import json
import socket
import threading

import pytest

pytest.importorskip("fastapi")

from specrouter.models.pool import Pool  # noqa: E402
from specrouter.server import ServerConfig, create_app  # noqa: E402
from specrouter.server.live import LiveServer  # noqa: E402

KEY = "k-hostile"
LIMIT = 16 * 1024
CONTEXT = 128
C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
# the concurrent stream: greedy, long enough to be running while a hostile request is handled
STREAM = {"prompt": "The quick brown fox", "max_tokens": 32, "temperature": 0, "ignore_eos": True,
          "specrouter_chain": ["target"]}


def hostile_server(tiny_pool_dirs, **live):
    names = ["mid", "target"]
    pool = Pool.load([tiny_pool_dirs[n] for n in names], names=names, target="target", dtype="float64")
    app = create_app(pool, ServerConfig(api_key=KEY, chain=("ngram", "mid", "target"), k=3,
                                        max_num_seqs=3, max_model_len=CONTEXT, max_body_bytes=LIMIT))
    with LiveServer(app, **live) as srv:
        status, _, raw = send(srv, "POST", C, j(STREAM))
        assert status == 200, raw
        srv.reference = json.loads(raw)["choices"][0]["text"]  # the stream's text, run alone
        yield srv


@pytest.fixture(scope="module")
def server(tiny_pool_dirs):
    """The protocol and loop `specrouter serve` runs (httptools and uvloop: the dev extra)."""
    yield from hostile_server(tiny_pool_dirs)


@pytest.fixture(scope="module")
def h11_server(tiny_pool_dirs):
    """The fallback without httptools: h11 on asyncio's loop."""
    from specrouter.server.http11 import JSONErrorH11Protocol

    yield from hostile_server(tiny_pool_dirs, http=JSONErrorH11Protocol, loop="asyncio")


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


def send_raw(server, data: bytes):
    """Bytes on a socket (requests http.client will not write); returns status, headers, body."""
    chunks = []
    with socket.create_connection((server.host, server.port), timeout=30) as sock:
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):  # answered early
            sock.sendall(data)
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def j(obj) -> bytes:
    return json.dumps(obj).encode()


def read_stream(server, body: dict, started: threading.Event | None = None) -> tuple[str, list]:
    """A streamed completion: (its text, the finish reasons and errors it carried)."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    try:
        conn.request("POST", C, body=j({**body, "stream": True}),
                     headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        text, ends = [], []
        for line in resp:
            if not line.startswith(b"data: "):
                continue
            if started is not None:
                started.set()
            data = line[6:].strip()
            if data == b"[DONE]":
                return "".join(text), ends
            chunk = json.loads(data)
            if "error" in chunk:
                ends.append(chunk["error"])
                continue
            text.append(chunk["choices"][0]["text"])
            if chunk["choices"][0]["finish_reason"]:
                ends.append(chunk["choices"][0]["finish_reason"])
        raise AssertionError("the stream ended without [DONE]")
    finally:
        conn.close()


@contextlib.contextmanager
def concurrent_stream(server):
    """Run the reference stream while the block runs; then check it finished exactly as alone."""
    started, out = threading.Event(), {}

    def run():
        try:
            out["result"] = read_stream(server, STREAM, started)
        except BaseException as e:  # noqa: BLE001 - reported below
            out["error"] = e
            started.set()

    t = threading.Thread(target=run)
    t.start()
    assert started.wait(30), "the concurrent stream did not start"
    yield
    t.join(60)
    assert "error" not in out, out.get("error")
    assert out["result"] == (server.reference, ["length"])


def check_error(status, raw, want_status, words=None, param=None):
    assert status == want_status, raw[:300]
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if words is not None:
        assert words in err["message"], err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


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
    ("best-of-streamed", C, j({"prompt": "hi", "n": 2, "best_of": 3, "stream": True}), None, 400, "cannot be streamed", "best_of"),
    ("best-of-under-n", C, j({"prompt": "hi", "n": 3, "best_of": 2}), None, 400, "at least 'n'", "best_of"),
    ("logprobs-over-20", C, j({"prompt": "hi", "logprobs": 50}), None, 400, "logprobs", "logprobs"),
    ("echo-string", C, j({"prompt": "hi", "echo": "yes"}), None, 400, "echo", "echo"),
    ("presence-penalty", C, j({"prompt": "hi", "presence_penalty": 2.5}), None, 400, "presence_penalty", "presence_penalty"),
    ("logit-bias", C, j({"prompt": "hi", "logit_bias": {"five": 10}}), None, 400, "logit_bias", "logit_bias"),
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
    ("chat-tool-role-first", CHAT, j({"messages": [{"role": "tool", "content": "hi"}]}), None, 400, "must follow an assistant message with 'tool_calls'", "messages.0.role"),
    ("chat-tool-calls-in-user", CHAT, j({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}), None, 400, "in an assistant message", "messages.0.tool_calls"),
    ("chat-tool-call-id-int", CHAT, j({"messages": [{"role": "tool", "content": "hi", "tool_call_id": 5}]}), None, 400, "tool_call_id", "messages.0.tool_call_id"),
    ("chat-missing-content", CHAT, j({"messages": [{"role": "user"}]}), None, 400, "missing required field", "messages.0.content"),
    ("chat-image-part", CHAT, j({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}), None, 400, "list of text parts", "messages.0.content"),
    ("chat-logprobs-string", CHAT, j({"messages": MSG, "logprobs": "yes"}), None, 400, "logprobs", "logprobs"),
    ("chat-tools-not-function", CHAT, j({"messages": MSG, "tools": [{"type": "retrieval"}]}), None, 400, "only function tools", "tools.0.type"),
    ("chat-over-context", CHAT, j({"messages": [{"role": "user", "content": "fox " * 300}]}), None, 400, "at most", "messages"),
    ("top-k-negative", C, j({"prompt": "hi", "top_k": -2}), None, 400, "top_k", "top_k"),
    ("ignore-eos-string", C, j({"prompt": "hi", "ignore_eos": "yes"}), None, 400, "ignore_eos", "ignore_eos"),
    ("stream-options-wrong-type", C, j({"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}}), None, 400, "include_usage", "stream_options.include_usage"),
    ("user-int", C, j({"prompt": "hi", "user": 5}), None, 400, "user", "user"),
    ("frequency-penalty", C, j({"prompt": "hi", "frequency_penalty": "0.5"}), None, 400, "frequency_penalty", "frequency_penalty"),
    ("suffix", C, j({"prompt": "hi", "suffix": "end"}), None, 400, "suffix", "suffix"),
    ("chat-max-completion-tokens-zero", CHAT, j({"messages": MSG, "max_completion_tokens": 0}), None, 400, "max_completion_tokens", "max_completion_tokens"),
    ("chat-top-logprobs-without-logprobs", CHAT, j({"messages": MSG, "top_logprobs": 3}), None, 400, "needs 'logprobs'", "top_logprobs"),
    ("chat-tool-choice-without-tools", CHAT, j({"messages": MSG, "tool_choice": "required"}), None, 400, "needs 'tools'", "tool_choice"),
    ("chat-functions", CHAT, j({"messages": MSG, "functions": [{"name": "f"}]}), None, 400, "functions", "functions"),
    ("chat-function-call", CHAT, j({"messages": MSG, "function_call": {"name": "f"}}), None, 400, "function_call", "function_call"),
    ("chat-parallel-tool-calls", CHAT, j({"messages": MSG, "parallel_tool_calls": "yes"}), None, 400, "parallel_tool_calls", "parallel_tool_calls"),
    ("chat-unknown-response-format", CHAT, j({"messages": MSG, "response_format": {"type": "xml"}}), None, 400, "xml", "response_format.type"),
    ("chat-store", CHAT, j({"messages": MSG, "store": True}), None, 400, "store", "store"),
    ("chat-audio-modality", CHAT, j({"messages": MSG, "modalities": ["text", "audio"]}), None, 400, "modalities", "modalities"),
    ("chat-metadata-int", CHAT, j({"messages": MSG, "metadata": {"a": 1}}), None, 400, "metadata", "metadata.a"),
    ("chat-name-int", CHAT, j({"messages": [{"role": "user", "content": "hi", "name": 5}]}), None, 400, "name", "messages.0.name"),
    ("oversized-body", C, j({"prompt": "x" * (LIMIT + 10)}), None, 413, "over the limit", None),
    ("missing-auth", C, j({"prompt": "hi"}), {"Authorization": None}, 401, "API key", None),
    ("wrong-auth", C, j({"prompt": "hi"}), {"Authorization": "Bearer nope"}, 401, "API key", None),
    ("empty-bearer", C, j({"prompt": "hi"}), {"Authorization": "Bearer "}, 401, "API key", None),
    ("unknown-route", "/v1/engines", j({"prompt": "hi"}), None, 404, "no route", None),
    # numeric fields at and past their bounds
    ("top-k-huge", C, j({"prompt": "hi", "max_tokens": 4, "temperature": 0, "top_k": 10**20}), None, 400, "vocabulary size", "top_k"),
    ("top-k-over-vocab", C, j({"prompt": "hi", "top_k": 100000}), None, 400, "vocabulary size", "top_k"),
    ("top-k-float", C, j({"prompt": "hi", "top_k": 5.0}), None, 400, "top_k", "top_k"),
    ("temperature-over-2", C, j({"prompt": "hi", "temperature": 2.5}), None, 400, "temperature", "temperature"),
    ("temperature-huge-exponent", C, b'{"prompt": "hi", "temperature": 1e999}', None, 400, "temperature", "temperature"),
    ("top-p-over-1", C, j({"prompt": "hi", "top_p": 1.5}), None, 400, "top_p", "top_p"),
    ("top-p-negative", C, j({"prompt": "hi", "top_p": -0.1}), None, 400, "top_p", "top_p"),
    ("seed-below-int64", C, j({"prompt": "hi", "seed": -(2**63) - 1}), None, 400, "seed", "seed"),
    ("max-tokens-2-64", C, j({"prompt": "hi", "max_tokens": 2**64}), None, 400, "tokens can be generated", "max_tokens"),
    ("k-float", C, j({"prompt": "hi", "specrouter_k": 1.5}), None, 400, "specrouter_k", "specrouter_k"),
    ("k-bool", C, j({"prompt": "hi", "specrouter_k": True}), None, 400, "specrouter_k", "specrouter_k"),
    # the chain
    ("chain-empty", C, j({"prompt": "hi", "specrouter_chain": []}), None, 400, "is empty", "specrouter_chain"),
    ("chain-twice", C, j({"prompt": "hi", "specrouter_chain": ["target", "target"]}), None, 400, "twice", "specrouter_chain"),
    ("chain-string", C, j({"prompt": "hi", "specrouter_chain": "target"}), None, 400, "specrouter_chain", "specrouter_chain"),
    ("chain-ints", C, j({"prompt": "hi", "specrouter_chain": [1]}), None, 400, "specrouter_chain", "specrouter_chain.0"),
    ("chain-ngram-last", C, j({"prompt": "hi", "specrouter_chain": ["target", "ngram"]}), None, 400, "end at the target", "specrouter_chain"),
    # the context: prompt + max_tokens <= 128, nothing reserved for drafting
    ("context-one-over", C, j({"prompt": list(range(1, CONTEXT)), "max_tokens": 2}), None, 400, "at most 1 tokens can be generated", "max_tokens"),
    ("context-prompt-fills-it", C, j({"prompt": list(range(1, CONTEXT + 1)), "max_tokens": 1}), None, 400, f"at most {CONTEXT - 1} prompt tokens", "prompt"),
    ("prompt-too-many-bytes", C, j({"prompt": "fox " * 3500}), None, 400, "bytes", "prompt"),
    ("chat-too-many-bytes", CHAT, j({"messages": [{"role": "user", "content": "fox " * 3500}]}), None, 400, "bytes", "messages"),
    # content types: JSON only (a page cannot send that cross-origin without a preflight)
    ("content-type-text", C, j({"prompt": "hi"}), {"Content-Type": "text/plain"}, 415, "application/json", None),
    ("content-type-form", C, j({"prompt": "hi"}), {"Content-Type": "application/x-www-form-urlencoded"}, 415, "application/json", None),
    ("content-type-missing", C, j({"prompt": "hi"}), {"Content-Type": None}, 415, "no Content-Type", None),
    ("content-type-multipart-chat", CHAT, j({"messages": MSG}), {"Content-Type": "multipart/form-data; boundary=x"}, 415, "application/json", None),
    # Host names (DNS rebinding): a loopback server answers loopback names only
    ("host-evil", C, j({"prompt": "hi"}), {"Host": "evil.example"}, 421, "not served here", None),
    ("host-evil-port", C, j({"prompt": "hi"}), {"Host": "evil.example:8000"}, 421, "not served here", None),
    ("host-loopback-lookalike", C, j({"prompt": "hi"}), {"Host": "127.0.0.1.nip.io"}, 421, "not served here", None),
    ("host-on-health", "/health", b"", {"Host": "rebound.example", "Authorization": None}, 421, "not served here", None),
    # the key is checked before routing
    ("unknown-v1-route-no-key", "/v1/engines", j({"prompt": "hi"}), {"Authorization": None}, 401, "API key", None),
    ("v1-root-no-key", "/v1", b"", {"Authorization": None}, 401, "API key", None),
    ("models-wrong-key", "/v1/models", b"", {"Authorization": "Bearer nope"}, 401, "API key", None),
]

# every other recognised field: a value SpecRouter refuses (not implemented, or the wrong type),
# a 400 naming the field (issue 31: recognised fields are honoured or refused by name)
_REFUSED = [  # (endpoint, field, value)
    (C, "min_p", 2.0), (C, "repetition_penalty", 0), (C, "stop_token_ids", [10**9]),
    (C, "min_tokens", 10**6), (C, "allowed_token_ids", []), (C, "truncate_prompt_tokens", 0),
    (C, "prompt_logprobs", 99), (C, "request_id", 5), (C, "cache_salt", 5),
    (C, "response_format", "json"), (C, "use_beam_search", True),
    (C, "length_penalty", 2.0), (C, "include_stop_str_in_output", True),
    (C, "skip_special_tokens", False), (C, "spaces_between_special_tokens", False),
    (C, "guided_json", 5), (C, "guided_regex", 5), (C, "guided_choice", "a"),
    (C, "guided_grammar", 5), (C, "guided_decoding_backend", "outlines"),
    (C, "json_schema", 5), (C, "grammar", 5),  # llama-server's structured-output fields
    (C, "guided_whitespace_pattern", " "), (C, "priority", 1), (C, "logits_processors", ["m.f"]),
    (C, "return_tokens_as_token_ids", "yes"), (C, "kv_transfer_params", {"a": 1}),
    (C, "vllm_xargs", {"a": 1}), (C, "add_special_tokens", "yes"), (C, "prompt_embeds", "AAAA"),
    (C, "n", 0), (CHAT, "top_logprobs", 99), (CHAT, "add_generation_prompt", "yes"),
    (CHAT, "chat_template_kwargs", "x"), (CHAT, "include_reasoning", "yes"),
    (CHAT, "metadata", "x"), (CHAT, "audio", {"voice": "x"}), (CHAT, "prediction", {"type": "content"}),
    (CHAT, "web_search_options", {}), (CHAT, "reasoning_effort", "high"), (CHAT, "service_tier", "flex"),
    (CHAT, "bad_words", ["x"]), (CHAT, "structural_tag", "{}"), (CHAT, "chat_template", "{{ x }}"),
    (CHAT, "mm_processor_kwargs", {"a": 1}), (CHAT, "continue_final_message", True),
    (CHAT, "documents", [{"title": "t", "text": "x"}]), (CHAT, "best_of", 0), (CHAT, "echo", "yes"),
    (CHAT, "add_special_tokens", 1), (C, "stream_options", {"include_usage": True, "continuous_usage_stats": True}),
]
CORPUS += [
    (f"refused-{'chat-' if ep == CHAT else ''}{field}", ep,
     j({("messages" if ep == CHAT else "prompt"): MSG if ep == CHAT else "hi", field: value,
        **({"stream": True} if field == "stream_options" else {})}),
     None, 400, field.split(".")[0],
     "stream_options.continuous_usage_stats" if field == "stream_options" else field)
    for ep, field, value in _REFUSED
]

# requests the HTTP parser itself refuses (httptools or h11): the same JSON shape (server/http11.py)
RAW = [
    ("content-length-minus-one", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
     b"Content-Type: application/json\r\nContent-Length: -1\r\n\r\n", 400, "malformed HTTP request"),
    ("oversized-header-block", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: "
     + b"a" * 20_000 + b"\r\n\r\n", 431, "header block is over the limit"),
    # a block still incomplete past 16 KiB: h11 gives up before it ends
    ("oversized-header-block-in-pieces", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: "
     + b"a" * 17_000, 431, "header block is over the limit"),
    ("many-headers", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
     + b"".join(b"X-H%d: v\r\n" % i for i in range(2000)) + b"\r\n", 431, "header block"),
    ("garbage-request-line", b"HELLO THERE\r\n\r\n", 400, "malformed HTTP request"),
    ("bad-header-line", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nno colon here\r\n\r\n", 400, "malformed"),
]


@pytest.mark.parametrize("case", CORPUS, ids=[c[0] for c in CORPUS])
def test_hostile_request(server, case):
    name, path, body, headers, status, words, param = case
    with concurrent_stream(server):
        got, hdrs, raw = send(server, "GET" if not body and path != C else "POST", path, body, headers)
    check_error(got, raw, status, words, param)
    if status == 401:
        assert hdrs.get("www-authenticate") == "Bearer"


def test_server_runs_httptools_on_uvloop(server):
    """The dev extra installs httptools and uvloop; the server runs them (the C parser and loop,
    docs/serving-performance.md)."""
    uvloop = pytest.importorskip("uvloop")
    pytest.importorskip("httptools")
    from specrouter.server.http11 import JSONErrorHttpToolsProtocol, http_protocol

    assert http_protocol() is JSONErrorHttpToolsProtocol is not None
    assert server.server.config.http is JSONErrorHttpToolsProtocol
    assert isinstance(server.server.servers[0].get_loop(), uvloop.Loop)


@pytest.mark.parametrize("protocol", ["httptools", "h11"])
@pytest.mark.parametrize("case", RAW, ids=[c[0] for c in RAW])
def test_http_layer_errors_are_json(request, protocol, case):
    server = request.getfixturevalue("server" if protocol == "httptools" else "h11_server")
    name, data, status, words = case
    with concurrent_stream(server):
        got, hdrs, raw = send_raw(server, data)
    assert hdrs["content-type"] == "application/json"
    check_error(got, raw, status, words)


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
    assert {c[4] for c in CORPUS} == {400, 401, 404, 413, 415, 421}
    assert {c[2] for c in RAW} == {400, 431}  # and the HTTP layer's own refusals
    assert len({c[0] for c in CORPUS}) == len(CORPUS), "case ids are unique"


def test_server_still_serves_after_hostile_requests(server):
    for _ in range(3):  # a few more bad ones, then good ones
        send(server, "POST", C, b"{{{{")
    status, _, _ = send(server, "GET", "/no-such-route")  # its own 404, so the test stands alone
    assert status == 404
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


# -- what is accepted at the edges -----------------------------------------------------------------
def test_values_at_their_bounds_are_served(server):
    vocab = server.app.state.server.pool.vocab_width
    ok = [
        (C, {"prompt": "hi", "max_tokens": 2, "top_k": vocab, "temperature": 0.7}, {}),
        (C, {"prompt": "hi", "max_tokens": 2, "top_p": 1e-300, "temperature": 2.0}, {}),
        (C, {"prompt": "hi", "max_tokens": 2, "seed": 2**64 - 1, "temperature": 1.0}, {}),
        (C, {"prompt": "hi", "max_tokens": 2, "seed": -(2**63), "temperature": 1.0}, {}),
        (C, {"prompt": "hi", "max_tokens": 2}, {"Content-Type": "application/json; charset=utf-8"}),
        (C, {"prompt": "hi", "max_tokens": 2}, {"Content-Type": "Application/JSON"}),
        (C, {"prompt": "hi", "max_tokens": 2}, {"Host": f"localhost:{server.port}"}),
        (C, {"prompt": "hi", "max_tokens": 2}, {"Host": "[::1]"}),
        (C, {"prompt": "hi", "max_tokens": 2}, {"Host": "api.localhost"}),
        (CHAT, {"messages": MSG, "max_tokens": 2, "specrouter_chain": ["ngram", "target"]}, {}),
    ]
    with concurrent_stream(server):
        for path, body, headers in ok:
            status, _, raw = send(server, "POST", path, j(body), headers)
            assert status == 200, (body, headers, raw[:300])


@pytest.mark.parametrize("temperature", [1e-39, 1e-300])
def test_tiny_temperature_is_greedy_over_http(server, temperature):
    body = {**STREAM, "max_tokens": 16}
    status, _, raw = send(server, "POST", C, j({**body, "temperature": 0}))
    greedy = json.loads(raw)["choices"][0]["text"]
    with concurrent_stream(server):
        for seed in range(5):
            status, _, raw = send(server, "POST", C, j({**body, "temperature": temperature,
                                                        "seed": seed}))
            assert status == 200, raw
            assert json.loads(raw)["choices"][0]["text"] == greedy, (temperature, seed)


def test_context_boundaries_router_off(server):
    check_context_boundaries(server, {"Authorization": f"Bearer {KEY}"})


def check_context_boundaries(server, auth: dict):
    """prompt + max_tokens == context is served; no max_tokens means the room that is left."""
    prompt = list(range(1, CONTEXT))  # CONTEXT - 1 tokens: room for exactly one
    status, _, raw = send(server, "POST", C, j({"prompt": prompt, "max_tokens": 1,
                                                "ignore_eos": True}), auth)
    assert status == 200, raw
    assert json.loads(raw)["usage"] == {"prompt_tokens": CONTEXT - 1, "completion_tokens": 1,
                                        "total_tokens": CONTEXT, **_stats(raw)}
    status, _, raw = send(server, "POST", C, j({"prompt": prompt, "ignore_eos": True}), auth)
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 1  # min(16, room)
    # chat without max_tokens (what most OpenAI clients send): generates up to the end
    status, _, raw = send(server, "POST", CHAT, j({"messages": MSG, "ignore_eos": True,
                                                   "temperature": 0}), auth)
    body = json.loads(raw)
    assert status == 200 and body["choices"][0]["finish_reason"] == "length", raw
    assert body["usage"]["total_tokens"] == CONTEXT
    n = body["usage"]["prompt_tokens"]
    status, _, raw = send(server, "POST", CHAT, j({"messages": MSG, "max_tokens": CONTEXT - n + 1}), auth)
    check_error(status, raw, 400, f"at most {CONTEXT - n} tokens can be generated", "max_tokens")


def _stats(raw) -> dict:
    """The usage fields the context checks do not pin: the request's stats and how many of its
    prompt tokens came from the prefix cache."""
    usage = json.loads(raw)["usage"]
    return {"specrouter": usage["specrouter"], "prompt_tokens_details": usage["prompt_tokens_details"]}


# -- one bad row never costs another, through the server --------------------------------------------
MAGIC = [300, 301, 302, 303]  # a prompt starting with these raises inside the engine's cycle


@pytest.fixture(scope="module")
def faulty(tiny_pool_dirs):
    names = ["draft", "target"]
    pool = Pool.load([tiny_pool_dirs[n] for n in names], names=names, target="target", dtype="float64")
    app = create_app(pool, ServerConfig(api_key=KEY, chain=("ngram", "draft", "target"), k=3,
                                        max_num_seqs=4, max_model_len=CONTEXT, adaptive=False))
    executor = app.state.server.engine.executor
    step, raised = executor.step, []  # one executor step runs every row of an engine step

    def step_with_a_bad_row(rows, *args, **kwargs):
        if any(r.tokens[:len(MAGIC)] == MAGIC for r in rows):
            raised.append(len(rows))
            raise FloatingPointError("injected: this row's sampling failed")
        return step(rows, *args, **kwargs)

    executor.step = step_with_a_bad_row
    with LiveServer(app) as srv:
        srv.raised = raised
        srv.reference = read_stream(srv, {**STREAM, "max_tokens": 100})[0]
        yield srv


def test_a_failing_request_does_not_end_the_others(faulty):
    results, started = {}, [threading.Event(), threading.Event()]

    def good(i):
        results[i] = read_stream(faulty, {**STREAM, "max_tokens": 100}, started[i])

    threads = [threading.Thread(target=good, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(30)
    bad = {"prompt": MAGIC + [5, 6], "max_tokens": 20, "temperature": 0,
           "specrouter_chain": STREAM["specrouter_chain"]}  # batched with the good rows
    status, _, raw = send(faulty, "POST", C, j(bad))  # its own 500 ...
    check_error(status, raw, 500, "FloatingPointError: injected")
    text, ends = read_stream(faulty, bad)  # ... or its own error chunk
    assert text == "" and ends and "FloatingPointError" in ends[0]["message"]
    for t in threads:
        t.join(60)
    assert results == {i: (faulty.reference, ["length"]) for i in range(2)}
    assert max(faulty.raised) > 1  # the bad row really ran in a batch with the good ones
    assert faulty.app.state.server.engine.state.live() == []


# -- a server with a 2 MiB body limit, the router on, the key on /health and /metrics -----------
@pytest.fixture(scope="module")
def routed(tiny_pool_dirs):
    names = ["draft", "mid", "target"]
    pool = Pool.load([tiny_pool_dirs[n] for n in names], names=names, target="target", dtype="float64")
    app = create_app(pool, ServerConfig(api_key=KEY, metrics_auth=True, max_num_seqs=3,
                                        max_model_len=CONTEXT, max_body_bytes=2 << 20))
    assert app.state.server.engine.router is not None
    with LiveServer(app) as srv:
        yield srv


def test_context_boundaries_router_on(routed):
    check_context_boundaries(routed, {"Authorization": f"Bearer {KEY}"})


def test_metrics_auth(routed):
    for path in ("/health", "/metrics"):
        status, hdrs, raw = send(routed, "GET", path, headers={"Authorization": None})
        check_error(status, raw, 401, "API key")
        assert send(routed, "GET", path)[0] == 200


def test_health_stays_fast_while_a_1mb_prompt_is_refused(routed):
    import time

    tok = routed.app.state.server.pool.tokenizer
    prompt = "Speculative decoding drafts tokens. " * 28_000  # ~1 MB
    t0 = time.perf_counter()
    tok(prompt, add_special_tokens=False)
    tokenize_s = time.perf_counter() - t0  # what the event loop would be blocked for
    done, refusals = threading.Event(), []

    def hostile():
        for _ in range(3):
            refusals.append(send(routed, "POST", C, j({"prompt": prompt, "max_tokens": 4})))
        done.set()

    t = threading.Thread(target=hostile)
    t.start()
    worst = 0.0
    while not done.is_set():
        t0 = time.perf_counter()
        assert send(routed, "GET", "/health")[0] == 200
        worst = max(worst, time.perf_counter() - t0)
        time.sleep(0.01)
    t.join()
    for status, _, raw in refusals:
        check_error(status, raw, 400, param="prompt")
    assert worst < max(tokenize_s / 3, 0.05), (worst, tokenize_s)


# -- the Host policy, unit by unit ----------------------------------------------------------------
def test_host_policy():
    from specrouter.server.edge import host_allowed, host_name

    assert [host_name(h) for h in ("127.0.0.1:8000", "[::1]:80", "LocalHost.", "::1", "a.b:x")] == \
        ["127.0.0.1", "::1", "localhost", "::1", "a.b:x"]
    # default (None): on a loopback address, loopback names only; elsewhere any name
    for name in ("localhost", "127.0.0.1", "127.8.9.10", "::1", "api.localhost"):
        for local in ("127.0.0.1", "::1", "::ffff:127.0.0.1"):
            assert host_allowed(name, None, local)
    assert not host_allowed("evil.example", None, "::ffff:127.0.0.1")  # dual-stack socket
    for name in ("evil.example", "127.0.0.1.nip.io", "0.0.0.0", "localhost.evil", "10.0.0.1"):
        assert not host_allowed(name, None, "127.0.0.1"), name
        assert host_allowed(name, None, "192.168.1.5") and host_allowed(name, None, None)
    # configured: exactly those (any port), on every address
    allowed = ("api.example.com", "*.corp.example")
    for local in ("127.0.0.1", "192.168.1.5"):
        assert host_allowed("api.example.com", allowed, local)
        assert host_allowed("x.corp.example", allowed, local)
        assert not host_allowed("corp.example.evil", allowed, local)
        assert not host_allowed("localhost", allowed, local)
    assert host_allowed("anything", ("*",), "127.0.0.1")


def test_allowed_hosts_option(tiny_pool_dirs):
    pool = Pool.load([tiny_pool_dirs["target"]], names=["target"], target="target", dtype="float64")
    app = create_app(pool, ServerConfig(allowed_hosts=("api.example.com",), max_model_len=CONTEXT,
                                        max_num_seqs=1))
    with LiveServer(app) as srv:
        assert send(srv, "GET", "/health", headers={"Host": "api.example.com:443"})[0] == 200
        status, _, raw = send(srv, "GET", "/health", headers={"Host": f"127.0.0.1:{srv.port}"})
        check_error(status, raw, 421, "api.example.com")
