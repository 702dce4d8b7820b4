"""The per-step work between the engine thread and the event loop (server/async_engine.py,
generation.py, streaming.py; docs/serving-performance.md, fifth round):

- a row nobody reads step by step (a whole response: no stream, no stop string, no logprobs)
  gets ONE event, when it finishes, holding every token, and a step none of whose rows needs a
  hand-off makes none; a streamed row gets an event per step (the control);
- a streamed text chunk is written from its choice's template, byte for byte what pydantic
  writes for the same chunk, for every code point.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from specrouter.config import SamplingParams, ServerConfig
from specrouter.engine.engine import Engine
from specrouter.models.pool import Pool
from specrouter.server.async_engine import AsyncEngine, StreamPacer
from specrouter.server.generation import reads_each_step, sse, sse_text_template, stream_interval
from specrouter.server.protocol import (
    ChatCompletionChunk,
    ChatStreamChoice,
    CompletionChoice,
    CompletionResponse,
)
from specrouter.server.validate import Prepared

PARAMS = SamplingParams(max_new_tokens=7, ignore_eos=True)


@pytest.fixture
def engine(tiny_pool_dirs):
    pool = Pool.load([tiny_pool_dirs["target"]], names=["target"], target="target", dtype="float64")
    return Engine(pool, max_num_seqs=4, max_model_len=64)


def _serve(engine, per_step: list[bool], interval: int = 1, params: SamplingParams = PARAMS):
    """Submit one row per flag (each with the stream `interval`); every event each got, and the
    number of hand-offs made."""
    handoffs = []

    async def main():
        # Every row joins the first step: the handler's `arriving` hold (the server's own way)
        # keeps the idle engine from starting a batch before the last submit (a row joining a
        # step late would finish a step late: one hand-off more, under a loaded CI machine).
        ae = AsyncEngine(engine, seed=0, admission_wait=60.0)
        deliver = ae._deliver

        def counted(deliveries):
            if deliveries:  # (stop hands over an empty list: nobody left)
                handoffs.append(len(deliveries))
            return deliver(deliveries)

        ae._deliver = counted
        ae.start()
        try:
            with ae.arriving():
                handles = [ae.submit([5, 6, 7], params, chain=("target",), k=1, per_step=p,
                                     interval=interval) for p in per_step]
            events = []
            for h in handles:
                got = [await h.events.get()]
                while not got[-1].done:
                    got.append(await h.events.get())
                events.append(got)
            return events
        finally:
            await asyncio.to_thread(ae.stop)

    return asyncio.run(main()), handoffs


def test_a_row_read_at_its_end_gets_one_event_and_no_hand_off_per_step(engine):
    (events,), handoffs = _serve(engine, [False])
    assert len(events) == 1 and events[0].done and events[0].finish_reason == "length"
    assert len(events[0].token_ids) == PARAMS.max_new_tokens
    assert handoffs == [1]  # only the step that finished it handed anything over


def test_a_streamed_row_gets_an_event_per_step_with_the_same_tokens(engine):
    (streamed, whole), handoffs = _serve(engine, [True, False])
    assert len(streamed) == PARAMS.max_new_tokens  # target-only: one token a step (the control)
    assert [t for ev in streamed for t in ev.token_ids] == whole[0].token_ids
    assert len(handoffs) == PARAMS.max_new_tokens


def test_a_stream_interval_coalesces_steps_while_other_rows_run(engine):
    """interval 3, two streamed rows of 7 tokens (one a step): the first token at once, then one
    event per 3 steps, the last at the end: 3 events a row, 3 hand-offs, the same tokens."""
    (a, b, whole), handoffs = _serve(engine, [True, True, False], interval=3)
    for streamed in (a, b):
        assert [len(ev.token_ids) for ev in streamed] == [1, 3, 3], streamed
        assert [t for ev in streamed for t in ev.token_ids] == whole[0].token_ids
    assert len(handoffs) == 3
    # the control: interval 1 hands every step's token over (7 events a row)
    (a, _), _ = _serve(engine, [True, True], interval=1)
    assert [len(ev.token_ids) for ev in a] == [1] * 7


def test_a_lone_streamed_row_with_a_fixed_interval_is_never_held(engine):
    (alone,), handoffs = _serve(engine, [True], interval=3)
    assert [len(ev.token_ids) for ev in alone] == [1] * 7 and len(handoffs) == 7


def test_held_steps_carry_their_logprobs(engine):
    params = SamplingParams(max_new_tokens=7, ignore_eos=True, logprobs=1)
    (a, b), _ = _serve(engine, [True, True], interval=3, params=params)
    (one, _), _ = _serve(engine, [True, True], interval=1, params=params)
    assert [len(ev.logprobs) for ev in a] == [len(ev.token_ids) for ev in a] == [1, 3, 3]
    assert [x.token for ev in a for x in ev.logprobs] == [t for ev in a for t in ev.token_ids]
    assert [x.logprob for ev in a for x in ev.logprobs] == pytest.approx([x.logprob for ev in one for x in ev.logprobs])


def _prepared(**over) -> Prepared:
    params = SamplingParams(**{"max_new_tokens": 4, **over.pop("params", {})})
    return Prepared(**{"prompt": [1, 2], "params": params, "chain": None, "k": 1, "stops": [],
                       "generator": None, **over})


def test_which_rows_read_each_step():
    assert not reads_each_step(_prepared(), stream=False)
    assert reads_each_step(_prepared(), stream=True)
    assert reads_each_step(_prepared(stops=["\n\n"]), stream=False)  # searched in the text
    assert reads_each_step(_prepared(params={"logprobs": 0}), stream=False)
    assert reads_each_step(_prepared(params={"prompt_logprobs": 1}), stream=False)


def test_which_rows_a_stream_interval_holds():
    srv = SimpleNamespace(config=ServerConfig(stream_interval=4))
    assert stream_interval(srv, _prepared(), stream=True) == 4
    assert stream_interval(srv, _prepared(stops=["\n\n"]), stream=True) == 1  # ends when one appears
    assert stream_interval(srv, _prepared(), stream=False) == 1
    assert stream_interval(SimpleNamespace(config=ServerConfig()), _prepared(), stream=True) == 0  # paced
    with pytest.raises(ValueError, match="stream_interval"):
        ServerConfig(stream_interval=-1)


def _texts():
    """Every code point (surrogates excepted: no str of decoded text holds one), quoted,
    escaped and mixed."""
    chars = [chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000]
    yield from ("".join(chars[i:i + 512]) for i in range(0, len(chars), 512))
    yield from ('"', "\\", "a\"b\\c\n\t\r\x00\x1f\x7f", "é 😀 \u2028\u2029", " " * 3, "</script>")


@pytest.mark.parametrize("chat", [True, False])
def test_the_text_chunk_template_writes_what_pydantic_writes(chat):
    def make(text):
        if chat:
            return ChatCompletionChunk(id="chatcmpl-1", created=7, model="m/ö", choices=[
                ChatStreamChoice(index=2, delta={"content": text}, finish_reason=None)])
        return CompletionResponse(id="cmpl-1", created=7, model="m/ö", choices=[
            CompletionChoice(index=2, text=text, finish_reason=None)])

    before, after = sse_text_template(make)
    for text in _texts():
        assert before + json.dumps(text, ensure_ascii=False) + after == sse(make(text))


def test_the_template_control_a_changed_field_differs():
    """The check above can fail: a template of another choice index is not the same bytes."""
    before, after = sse_text_template(lambda t: CompletionResponse(
        id="cmpl-1", created=7, model="m", choices=[CompletionChoice(index=0, text=t, finish_reason=None)]))
    other = sse(CompletionResponse(id="cmpl-1", created=7, model="m",
                                   choices=[CompletionChoice(index=1, text="x", finish_reason=None)]))
    assert before + json.dumps("x") + after != other


def test_held_rows_ride_along_with_any_hand_off(engine):
    """A row that joins while others stream (interval 3) gets its first token at once; the rows
    held at that step go with it, and from then on the three rows share every hand-off (one
    phase) instead of a hand-off every step or two for rows in different phases. Control: the
    same scenario with the held rows left out of hand-offs they are not due for keeps the
    phases apart (more hand-offs, some carrying only part of the rows)."""
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)

    def run(ride_along: bool):
        handoffs = []

        async def main():
            ae = AsyncEngine(engine, seed=0, admission_wait=60.0)
            deliver, events = ae._deliver, ae._events
            if not ride_along:  # the control: a row's tokens only when it is due itself
                def events_alone(outputs, now, rows=1):
                    got, tokens = [], 0
                    for o in outputs:
                        out, n = events([o], now, rows)
                        got, tokens = got + out, tokens + n
                    return got, tokens
                ae._events = events_alone

            def counted(deliveries):
                if deliveries:
                    handoffs.append({id(h) for h, _ in deliveries})
                return deliver(deliveries)

            ae._deliver = counted
            ae.start()
            try:
                with ae.arriving():
                    a, b = (ae.submit([5, 6, 7], params, chain=("target",), k=1, interval=3) for _ in range(2))
                await a.events.get()  # A and B are running: C joins a later step
                c = ae.submit([5, 6, 8], params, chain=("target",), k=1, interval=3)
                got = {}
                for h in (a, b, c):
                    evs = [await h.events.get()]
                    while not evs[-1].done:
                        evs.append(await h.events.get())
                    got[id(h)] = evs
                return a, b, c, got
            finally:
                await asyncio.to_thread(ae.stop)

        a, b, c, got = asyncio.run(main())
        return [id(a), id(b), id(c)], handoffs, got

    (ia, ib, ic), handoffs, got = run(ride_along=True)
    first_c = next(i for i, x in enumerate(handoffs) if ic in x)
    assert handoffs[first_c] == {ia, ib, ic}  # A and B rode along with C's first token
    for x in handoffs[first_c:]:
        # every later hand-off carries every row still running (A and B end before or with C)
        assert x in ({ia, ib, ic}, {ic}), handoffs
    # (A's first event was read before C was submitted)
    assert sum(len(ev.token_ids) for ev in got[ia]) == 9 and sum(len(ev.token_ids) for ev in got[ic]) == 10
    (ia, ib, ic), control, _ = run(ride_along=False)
    first_c = next(i for i, x in enumerate(control) if ic in x)
    assert any(x not in ({ia, ib, ic}, {ic}) for x in control[first_c:]), control
    assert len(control) > len(handoffs)


def test_the_pacer_keeps_hand_offs_within_its_budget_of_the_engine_time():
    """StreamPacer (interval 0): the fewest steps whose hand-offs take at most `budget` of the
    engine's time, never holding more than `max_hold` seconds of steps."""
    def paced(step: float, handoff: float) -> int:
        p = StreamPacer(budget=0.015, max_hold=0.1)
        p.observe_handoff(handoff)
        p.observe_step(step)
        return p.interval

    assert StreamPacer(start=2).interval == 2  # nothing measured yet
    assert paced(0.014, 0.0006) == 3  # a Sapphire Rapids at c=4: 0.6 ms a hand-off, 14 ms steps
    assert paced(0.015, 0.0008) == 4  # ... at c=8
    assert paced(0.078, 0.0011) == 1  # a Zen 1 at c=8: the hand-off is 1.4% of a step already
    assert paced(0.004, 0.0005) == 9  # ceil(8.33): short steps, ...
    assert paced(0.001, 0.003) == 100  # ... capped by 100 ms of steps (200 by the budget)
    assert paced(0.2, 0.05) == 1  # a step over max_hold: a chunk every step

    def lone(step: float, handoff: float) -> int:
        p = StreamPacer(budget=0.015, max_hold=0.1, max_hold_lone=0.05)
        p.observe_handoff(handoff)
        p.observe_step(step)
        return p.lone

    assert StreamPacer(start=2).lone == 2
    assert lone(0.010, 0.00035) == 3  # c=1 on a Sapphire Rapids: a chunk every ~30 ms
    assert lone(0.004, 0.0005) == 9  # the same rule as the batch's ...
    assert lone(0.001, 0.003) == 50  # ... within 50 ms of steps (the batch's: 100)
    assert lone(0.06, 0.0005) == 1  # a step over max_hold_lone: a chunk every step
    p = StreamPacer(weight=0.5)  # running means
    p.observe_handoff(0.001)
    p.observe_handoff(0.0)
    assert p.handoff == pytest.approx(0.0005)


def test_paced_streams_get_fewer_events_with_the_same_tokens(engine):
    """interval 0 (the default): the engine's pacer holds streamed rows while others run (tiny
    steps against a hand-off: the 100 ms cap's many steps), every token arrives, in order; a lone
    paced row too (within 50 ms), its first token at once, its last with the row's end."""
    (a, b, whole), handoffs = _serve(engine, [True, True, False], interval=0)
    for streamed in (a, b):
        assert len(streamed) < PARAMS.max_new_tokens and len(streamed[0].token_ids) == 1
        assert [t for ev in streamed for t in ev.token_ids] == whole[0].token_ids
    (alone,), handoffs = _serve(engine, [True], interval=0)
    assert len(alone) < PARAMS.max_new_tokens and len(alone[0].token_ids) == 1 and alone[-1].done
    assert [t for ev in alone for t in ev.token_ids] == whole[0].token_ids
    assert len(handoffs) == len(alone)  # (the control, a fixed interval: 7 hand-offs, above)


def test_short_prompts_are_tokenized_on_the_loop_long_ones_on_a_thread(monkeypatch):
    """off_loop_if_long: the thread hop only for inputs over INLINE_TOKENIZE_BYTES (a short prompt's
    tokenizing costs less than the hop; a long one must not hold the event loop). Requests sent
    together still start together without the hop's overlap: test_server_admission.py (the linger,
    the returning clients)."""
    from specrouter.server import validate

    hops = []

    async def to_thread(fn, *a, **k):
        hops.append(fn)
        return fn(*a, **k)

    monkeypatch.setattr(validate.asyncio, "to_thread", to_thread)
    assert asyncio.run(validate.off_loop_if_long(validate.INLINE_TOKENIZE_BYTES, len, "ab")) == 2
    assert hops == []
    assert asyncio.run(validate.off_loop_if_long(validate.INLINE_TOKENIZE_BYTES + 1, len, "abc")) == 3
    assert hops == [len]


def test_a_chat_of_many_empty_messages_is_rendered_on_a_thread(monkeypatch):
    """render_chat decides by the work the loop would do, not the content bytes alone: many
    empty messages are 0 content bytes yet the template renders text around each (30,000 of
    them held the loop ~480 ms); a short chat still renders on the loop."""
    from types import SimpleNamespace

    from specrouter.models import tokenizer as tok
    from specrouter.server import validate

    hops = []

    async def to_thread(fn, *a, **k):
        hops.append(fn)
        return fn(*a, **k)

    monkeypatch.setattr(validate.asyncio, "to_thread", to_thread)
    monkeypatch.setattr(tok, "apply_chat_template", lambda *a, **k: [1, 2])
    srv = SimpleNamespace(max_model_len=2048, longest_token_bytes=16, pool=SimpleNamespace(tokenizer=None),
                          chat_template=None)
    short = [{"role": "user", "content": "hi"}]
    assert asyncio.run(validate.render_chat(srv, short)) == [1, 2] and hops == []
    empty = [{"role": "user" if i % 2 == 0 else "assistant", "content": ""} for i in range(3000)]
    assert asyncio.run(validate.render_chat(srv, empty)) == [1, 2] and len(hops) == 1


def _asgi_post(app, path: str, body: dict) -> list[dict]:
    """POST `body` to `path` through the ASGI app itself (engine started as its lifespan does):
    every message the app sent."""
    data = json.dumps(body).encode()
    sent: list[dict] = []

    async def main():
        srv = app.state.server
        srv.loop_engine.start()
        given = False

        async def receive():
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": data, "more_body": False}
            await asyncio.Event().wait()  # the client stays

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
                 "root_path": "", "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                                              (b"content-length", str(len(data)).encode())],
                 "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}
        try:
            await app(scope, receive, send)
        finally:
            await asyncio.to_thread(srv.close)

    asyncio.run(main())
    return sent


@pytest.mark.parametrize("chat", [False, True])
def test_a_stream_writes_once_an_event_and_ends_in_its_last_write(tiny_pool_dirs, chat):
    """EventStream (server/streaming.py): one body message (one socket write) per engine event of
    the row, its chunks joined; the last carries the finish chunk, the usage chunk and `[DONE]`
    and ends the body (more_body False) - Starlette's StreamingResponse sent those four apart; the
    text is the whole response's."""
    from specrouter.server import create_app

    pool = Pool.load([tiny_pool_dirs["target"]], names=["target"], target="target", dtype="float64")
    config = ServerConfig(max_num_seqs=2, max_model_len=64, adaptive=False, stream_interval=1)
    ask = {"max_tokens": 6, "temperature": 0, "ignore_eos": True,
           **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "def add(a, b):"})}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    msgs = _asgi_post(create_app(pool, config), path,
                      dict(ask, stream=True, stream_options={"include_usage": True}))
    assert msgs[0]["type"] == "http.response.start" and msgs[0]["status"] == 200
    bodies = msgs[1:]
    assert all(m["type"] == "http.response.body" for m in bodies)
    assert [m["more_body"] for m in bodies] == [True] * (len(bodies) - 1) + [False]
    texts = [m["body"].decode() for m in bodies]
    events = [[e for e in t.split("\n\n") if e] for t in texts]
    last = events[-1]
    assert last[-1] == "data: [DONE]" and '"usage"' in last[-2] and '"finish_reason":"length"' in last[-3]
    first_text = 1 if chat else 0  # a chat opens with its role chunk, alone (before any token)
    if chat:
        assert events[0] == [e for e in events[0] if '"role":"assistant"' in e] and len(events[0]) == 1
    assert all(len(e) == 1 for e in events[first_text:-1])  # one text chunk a write (one row, no parser)
    assert len(last) in (3, 4)  # the last tokens' text chunk (if any), finish, usage, [DONE]: one write

    def piece(event: str) -> str:
        c = json.loads(event[len("data: "):])["choices"]
        return "".join(((x.get("delta") or {}).get("content") or "") if chat else x.get("text", "") for x in c)

    streamed = "".join(piece(e) for es in events for e in es if e != "data: [DONE]")
    whole = json.loads(b"".join(m.get("body", b"") for m in _asgi_post(create_app(pool, config), path, ask)
                                if m["type"] == "http.response.body"))
    assert streamed == (whole["choices"][0]["message"]["content"] if chat else whole["choices"][0]["text"])
