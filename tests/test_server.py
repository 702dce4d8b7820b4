"""The OpenAI-compatible server against the official `openai` client, on 127.0.0.1.

Greedy output through the server (completions and chat, streamed and not) equals target-only
greedy decoding; stop strings never leak into a stream; metrics, auth, admission control (429)
and client disconnects behave."""

import http.client
import json
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from specrouter.config import SamplingParams  # noqa: E402
from specrouter.engine.engine import Engine  # noqa: E402
from specrouter.models.pool import Pool  # noqa: E402
from specrouter.models.tokenizer import apply_chat_template  # noqa: E402
from specrouter.server import ServerConfig, create_app  # noqa: E402
from specrouter.server.live import LiveServer  # noqa: E402

KEY = "test-key-123"
CHAIN = ("ngram", "mid", "target")
PROMPTS = ["def add(a, b):", "The quick brown fox", "class Point:\n    def __init__(self, x, y):"]


def load_pool(dirs, names=("draft", "mid", "target")):
    return Pool.load([dirs[n] for n in names], names=list(names), target="target", dtype="float64")


def target_greedy(pool, prompt_ids, n):
    """Target-only greedy decoding of the prompt alone: (token ids, finish reason)."""
    seq = Engine(pool).generate_ids([prompt_ids], [SamplingParams(max_new_tokens=n)],
                                    chain=("target",))[0]
    return seq.output_ids, seq.finish_reason


@pytest.fixture(scope="module")
def ref_pool(tiny_pool_dirs):
    return load_pool(tiny_pool_dirs)


@pytest.fixture(scope="module")
def server(tiny_pool_dirs):
    app = create_app(load_pool(tiny_pool_dirs),
                     ServerConfig(api_key=KEY, chain=CHAIN, k=3, max_num_seqs=4, max_model_len=256))
    with LiveServer(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=30)


def raw(server, method, path, body=None, headers=None):
    """(status, headers, parsed JSON or text) of one plain HTTP request."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    try:
        h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **(headers or {})}
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        conn.request(method, path, body=data, headers=h)
        r = conn.getresponse()
        text = r.read().decode()
        try:
            return r.status, dict(r.getheaders()), json.loads(text)
        except ValueError:
            return r.status, dict(r.getheaders()), text
    finally:
        conn.close()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completions_equal_target_greedy(client, ref_pool, prompt):
    ids = ref_pool.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ref_ids, ref_finish = target_greedy(ref_pool, ids, 24)
    ref_text = ref_pool.tokenizer.decode(ref_ids, skip_special_tokens=True)
    r = client.completions.create(model="target", prompt=prompt, max_tokens=24, temperature=0)
    assert r.choices[0].text == ref_text
    assert r.choices[0].finish_reason == ref_finish
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref_ids)
    assert r.usage.total_tokens == len(ids) + len(ref_ids)
    stats = r.usage.model_extra["specrouter"]
    assert set(stats["chains"]) <= {">".join(CHAIN), "target"} and stats["cycles"] >= 1
    assert stats["mean_acceptance_length"] >= 1.0 and "mid>target" in stats["acceptance_rates"]
    chunks = list(client.completions.create(model="target", prompt=prompt, max_tokens=24,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref_text
    assert [c.choices[0].finish_reason for c in chunks][-1] == ref_finish
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    # a prompt of token ids gives the same
    r2 = client.completions.create(model="target", prompt=ids, max_tokens=24, temperature=0)
    assert r2.choices[0].text == ref_text


def test_chat_equal_target_greedy(client, ref_pool):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "What is the capital of France?"}]
    ids = apply_chat_template(ref_pool.tokenizer, messages)
    ref_ids, ref_finish = target_greedy(ref_pool, ids, 20)
    ref_text = ref_pool.tokenizer.decode(ref_ids, skip_special_tokens=True)
    r = client.chat.completions.create(model="target", messages=messages, max_tokens=20, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref_text
    assert r.choices[0].finish_reason == ref_finish and r.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(
        model="target", messages=messages, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref_text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref_finish
    # max_completion_tokens is max_tokens' newer name; a content-part list is the same text
    r2 = client.chat.completions.create(
        model="target", temperature=0, max_completion_tokens=20,
        messages=[messages[0], {"role": "user", "content": [{"type": "text", "text": "What is the "},
                                                            {"type": "text", "text": "capital of France?"}]}])
    assert r2.choices[0].message.content == ref_text


def test_stop_strings_streamed_and_not(client, ref_pool):
    prompt = PROMPTS[1]
    ids = ref_pool.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ref_ids, _ = target_greedy(ref_pool, ids, 30)
    text = ref_pool.tokenizer.decode(ref_ids, skip_special_tokens=True)
    # a stop string from the middle of the greedy output, without replacement characters
    i = next(i for i in range(len(text) // 3, len(text) - 3)
             if "\ufffd" not in text[i:i + 3] and text.find(text[i:i + 3]) == i)
    stop = text[i:i + 3]
    expected = text[:i]
    r = client.completions.create(model="target", prompt=prompt, max_tokens=30, temperature=0,
                                  stop=[stop, "never-appears-xyz"])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="target", prompt=prompt, max_tokens=30,
                                            temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    # the EOS token as a stop string ends generation at the token level, never shown
    r = client.completions.create(model="target", prompt=prompt, max_tokens=30, temperature=0,
                                  stop=["<|endoftext|>"])
    assert r.choices[0].text == text


def test_pinned_chain_k_and_seeded_sampling(client, ref_pool):
    prompt = PROMPTS[0]
    ids = ref_pool.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ref_text = ref_pool.tokenizer.decode(target_greedy(ref_pool, ids, 16)[0], skip_special_tokens=True)
    for chain, k in [(["draft", "mid", "target"], 2), (["target"], 1), (["ngram", "target"], 5)]:
        r = client.completions.create(model="target", prompt=prompt, max_tokens=16, temperature=0,
                                      extra_body={"specrouter_chain": chain, "specrouter_k": k})
        assert r.choices[0].text == ref_text
        assert set(r.usage.model_extra["specrouter"]["chains"]) <= {">".join(chain), "target"}
    kw = dict(model="target", prompt=prompt, max_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
    a = client.completions.create(**kw).choices[0].text
    b = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
    assert a == b  # a seeded request has its own random stream: reproducible


def test_models_health_metrics(client, server):
    # the labels below come from a request of its own: pytest-xdist may run this module's
    # other tests (whose router choices fed them) on another worker, with a server of its own
    client.completions.create(model="target", prompt=PROMPTS[0] * 3, max_tokens=16, temperature=0,
                              extra_body={"specrouter_chain": ["ngram", "mid", "target"], "specrouter_k": 4})
    models = client.models.list()
    assert [m.id for m in models.data] == ["target"]
    assert models.data[0].model_extra["specrouter"]["pool"] == ["ngram", "suffix", "draft", "mid", "target"]
    status, _, health = raw(server, "GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["failed_models"] == []
    status, headers, text = raw(server, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    for name in ['specrouter_drafted_tokens_total{drafter="mid",verifier="target"}',
                 'specrouter_accepted_tokens_total{drafter="ngram",verifier="mid"}',
                 'specrouter_chain_choices_total{chain="ngram>mid>target"}',
                 'specrouter_forward_seconds_bucket{le="0.001",model="target"}',
                 "specrouter_acceptance_length_count", "specrouter_queue_depth",
                 "specrouter_running_rows", "specrouter_generated_tokens_total",
                 'specrouter_requests_total{endpoint="/v1/completions",status="200"}',
                 "specrouter_time_to_first_token_seconds_count", "specrouter_step_seconds_count",
                 # the engine thread's torch threads per step and its CPU in them (engine/contention.py)
                 "specrouter_steps_by_threads_total{threads=", "specrouter_steps_by_threads_cpu_seconds_total{",
                 "specrouter_engine_threads"]:
        assert name in text, name
    generated = float(next(line.split()[-1] for line in text.splitlines()
                           if line.startswith("specrouter_generated_tokens_total")))
    assert generated > 0


def test_auth(server):
    body = {"prompt": "hi", "max_tokens": 2}
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"},
                    {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"}):
        status, h, err = raw(server, "POST", "/v1/completions", body, headers)
        assert status == 401, headers
        assert err["error"]["type"] == "authentication_error" and "API key" in err["error"]["message"]
    assert raw(server, "GET", "/v1/models", None, {"Authorization": ""})[0] == 401
    assert raw(server, "POST", "/v1/completions", body)[0] == 200
    assert raw(server, "GET", "/health", None, {"Authorization": ""})[0] == 200


def _open_stream(server, body):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}).encode(),
                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    resp = conn.getresponse()
    return conn, resp


def _wait(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_disconnect_aborts_row(server, client, monkeypatch):
    engine = server.app.state.server.engine
    step = engine.step

    def paced_step():  # 240 tiny-model steps take ~0.2 s: paced, a starved test thread still sees the row run
        time.sleep(0.005)
        return step()

    monkeypatch.setattr(engine, "step", paced_step)
    conn, resp = _open_stream(server, {"prompt": "def add(a, b):", "max_tokens": 240,
                                       "temperature": 0, "ignore_eos": True, "specrouter_k": 1,
                                       "specrouter_chain": ["target"]})
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")  # it is running
    (seq,) = list(engine.running.values())
    conn.sock.shutdown(2)
    conn.close()
    _wait(lambda: not engine.running)  # the row was aborted and its state freed
    assert seq.finish_reason == "abort" and seq.num_generated < 240
    assert engine.state.live() == []
    # a non-streamed request whose client goes away is aborted too (server/generation.py watch_disconnect)
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    conn.request("POST", "/v1/completions", headers={"Authorization": f"Bearer {KEY}",
                                                    "Content-Type": "application/json"},
                 body=json.dumps({"prompt": "x", "max_tokens": 240, "temperature": 0,
                                  "ignore_eos": True, "specrouter_chain": ["target"]}).encode())
    _wait(lambda: engine.running)
    (seq,) = list(engine.running.values())
    conn.sock.shutdown(2)
    conn.close()
    _wait(lambda: not engine.running)
    assert seq.finish_reason == "abort" and seq.num_generated < 240
    r = client.completions.create(model="target", prompt="hi", max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_queue_full_gives_429(tiny_pool_dirs):
    app = create_app(load_pool(tiny_pool_dirs),
                     ServerConfig(chain=("target",), max_num_seqs=1, max_queue=1, max_model_len=256,
                                  retry_after_s=2))
    srv = app.state.server
    long = {"prompt": "def add(a, b):", "max_tokens": 220, "temperature": 0, "ignore_eos": True}
    with LiveServer(app) as live:
        c1, r1 = _open_stream(live, long)
        assert r1.readline().startswith(b"data: ")  # running: the only row
        c2, r2 = _open_stream(live, long)  # waits in the queue (its headers are sent already)
        _wait(lambda: srv.loop_engine.queue_depth == 1)
        status, headers, err = raw(live, "POST", "/v1/completions", long)
        assert status == 429 and headers["retry-after"] == "2"
        assert err["error"]["code"] == "queue_full" and "retry later" in err["error"]["message"]
        for conn in (c1, c2):
            conn.sock.shutdown(2)
            conn.close()
        _wait(lambda: not srv.engine.running and srv.loop_engine.queue_depth == 0)
        status, _, ok = raw(live, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 3})
        assert status == 200 and ok["usage"]["completion_tokens"] >= 1
    assert not srv.loop_engine.alive  # the engine thread stopped with the app


def _texts_streamed_together(live, prompts: list[str], max_tokens: int) -> list[list[str]]:
    """Streamed greedy completions of `prompts`, all sent before any is read: each one's text
    pieces, one per SSE chunk that carried text."""
    body = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    conns = []
    for p in prompts:
        conn = http.client.HTTPConnection(live.host, live.port, timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps({**body, "prompt": p}).encode(),
                     headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        conns.append(conn)
    out = []
    for conn in conns:
        events = conn.getresponse().read().decode().split("\n\n")
        conn.close()
        out.append([c["text"] for e in events if e.startswith("data: {")
                    for c in json.loads(e[6:])["choices"] if c["text"]])
    return out


def test_a_stream_interval_sends_fewer_chunks_of_the_same_text(tiny_pool_dirs):
    """stream_interval 4 with two rows streaming at once: the same text as whole responses in
    far fewer chunks than with 1 (the control: a chunk a step)."""
    pieces = {}
    for interval in (1, 4):
        app = create_app(load_pool(tiny_pool_dirs, names=("target",)),
                         ServerConfig(api_key=KEY, chain=("target",), adaptive=False, max_num_seqs=4,
                                      max_model_len=256, stream_interval=interval))
        with LiveServer(app) as live:
            pieces[interval] = _texts_streamed_together(live, PROMPTS[:2], 48)
            whole = [raw(live, "POST", "/v1/completions", {"prompt": p, "max_tokens": 48, "temperature": 0,
                                                           "ignore_eos": True})[2]["choices"][0]["text"]
                     for p in PROMPTS[:2]]
        assert ["".join(x) for x in pieces[interval]] == whole
    one, four = (sum(len(x) for x in pieces[i]) for i in (1, 4))
    assert four <= one / 2, (one, four)


def test_sampling_defaults_unseeded(client):
    """temperature defaults to 1.0 as OpenAI's: a seeded request without it is the request at
    temperature 1.0 (and neither greedy nor another temperature); unseeded requests draw from
    fresh random streams, so repeats differ."""
    kw = dict(model="target", prompt="The", max_tokens=16, extra_body={"ignore_eos": True})

    def text(**more):
        r = client.completions.create(**kw, **more)
        assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"
        return r.choices[0].text

    default = text(seed=77)
    assert default == text(seed=77, temperature=1.0)
    assert default != text(temperature=0)
    assert default != text(seed=77, temperature=0.3)
    assert len({text() for _ in range(3)}) > 1  # unseeded
