"""One row of a request on the asyncio side (`Generation`): its submission to the engine loop,
its text deltas (server/text.py: stop strings, held-back tails), its logprobs, its usage.
A request runs one row, or n / best_of rows sharing the prompt (server/choices.py); its
response is whole (choices.py) or streamed (streaming.py)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable

from specrouter.server.async_engine import QueueFull, RequestHandle, TokenEvent
from specrouter.server.logprobs import CompletionLogprobWriter, TokenIds, chat_logprobs, vllm_prompt_logprobs
from specrouter.server.protocol import RequestError, Usage
from specrouter.server.service import Service
from specrouter.server.text import TextStream
from specrouter.server.validate import Prepared


class ClientGone(Exception):
    """The client went away: nobody reads the response."""


def reads_each_step(p: Prepared, stream: bool) -> bool:
    """Whether a row's handler reads its tokens step by step: a stream sends them, a stop
    string is searched in the text so far (the row ends as soon as it appears), logprobs come
    with their tokens. A whole response without these reads its tokens once, at the end, and the
    engine thread hands it nothing before (server/async_engine.py: no hand-off per step)."""
    return stream or bool(p.stops) or p.params.logprobs is not None or p.params.prompt_logprobs is not None


def stream_interval(srv: Service, p: Prepared, stream: bool) -> int:
    """Steps one event of a row may hold while other rows run (ServerConfig.stream_interval): a
    stream's, unless a stop string is searched in its text (its row ends as soon as one appears,
    and its usage counts the tokens up to that step); 1 for everything else."""
    return srv.config.stream_interval if stream and not p.stops else 1


def submit(srv: Service, p: Prepared, tenant: str | None = None, *, stream: bool = True) -> RequestHandle:
    """Queue a prepared row on the engine loop (429 queue full, 503 engine down)."""
    try:
        return srv.loop_engine.submit(p.prompt, p.params, chain=p.chain, k=p.k,
                                      generator=p.generator, tenant=tenant,
                                      per_step=reads_each_step(p, stream),
                                      interval=stream_interval(srv, p, stream))
    except QueueFull as e:
        raise RequestError(str(e), status=429, type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(srv.config.retry_after_s)}) from None
    except RuntimeError as e:
        raise RequestError(str(e), status=503, type="server_error") from None


def usage_of(prompt_len: int, ts: TextStream, stats: dict | None) -> Usage:
    """One row's usage (with its stats in `usage.specrouter`)."""
    n = len(ts.token_ids)
    cached = (stats or {}).get("cached_tokens", 0)
    return Usage(prompt_tokens=prompt_len, completion_tokens=n, total_tokens=prompt_len + n,
                 prompt_tokens_details={"cached_tokens": cached}, specrouter=stats)


def usage_of_rows(gens: list["Generation"]) -> Usage:
    """A request's usage: its one row's, or its n rows' completion tokens summed (each row's
    stats in `usage.specrouter["choices"]`)."""
    prompt_len = len(gens[0].p.prompt)
    if len(gens) == 1:
        return usage_of(prompt_len, gens[0].text, gens[0].stats)
    out = sum(len(g.text.token_ids) for g in gens)
    return Usage(prompt_tokens=prompt_len, completion_tokens=out, total_tokens=prompt_len + out,
                 specrouter={"choices": [g.stats for g in gens]})


def sse(obj) -> str:
    return f"data: {obj.model_dump_json()}\n\n"


_MARK = "\x00specrouter-text\x00"


def sse_text_template(make: Callable[[str], object]) -> tuple[str, str]:
    """The SSE event of `make(text)`, a chunk whose only varying field is `text`, split around
    that JSON string: `before + json.dumps(text, ensure_ascii=False) + after` is
    `sse(make(text))` byte for byte (pydantic writes strings as json.dumps does without ASCII
    escaping; tests/test_server_text.py checks every code point), without building and
    serializing a pydantic object per chunk."""
    before, mark, after = sse(make(_MARK)).partition(json.dumps(_MARK, ensure_ascii=False))
    assert mark and _MARK not in after, "the template's text appears once"
    return before, after


def asks_logprobs(req, chat: bool) -> bool:
    """Whether the request's choices carry logprobs (a chat's `logprobs: true`, a completion's
    `logprobs: n`)."""
    return bool(req.logprobs) if chat else req.logprobs is not None


class Generation:
    """Runs one row: yields (text delta, finish_reason or None)."""

    def __init__(self, srv: Service, p: Prepared, handle: RequestHandle):
        self.srv, self.p, self.handle = srv, p, handle
        self.text = TextStream(srv.pool.tokenizer, p.stops)
        self.stats: dict | None = None
        self.first_token_at: float | None = None
        self.committed = 0.0  # when the engine committed the tokens of the last event
        self.logprobs: list = []  # TokenLogprob of every token so far (requests asking)
        self.prompt_logprobs: list | None = None  # the prompt's (requests asking)
        self._taken = 0  # logprobs handed out by take_logprobs

    def take_logprobs(self) -> list:
        """The logprobs of the tokens since the last call (a stream's chunk carries them)."""
        out = self.logprobs[self._taken:]
        self._taken = len(self.logprobs)
        return out

    def abort(self) -> None:
        """Free the row now (client gone), waking whoever waits on its events."""
        self.srv.loop_engine.abort(self.handle)
        self.handle.events.put_nowait(TokenEvent([], True, "abort"))

    async def events(self) -> AsyncIterator[tuple[str, str | None]]:
        """Text deltas; the last item carries the finish reason. Raises RequestError(500) if a
        model failure ended the row, ClientGone if the client went away."""
        h = self.handle
        while True:
            ev = await h.events.get()
            self.committed = ev.committed
            if ev.finish_reason == "abort":
                raise ClientGone()
            if ev.token_ids and self.first_token_at is None:  # when it reached the loop, or
                # when the engine committed it (a row handed its tokens at its end)
                self.first_token_at = time.perf_counter() if h.per_step else h.first_commit
                self.srv.metrics.ttft_seconds.observe(self.first_token_at - h.submitted)
            if ev.finish_reason == "error":
                raise RequestError(f"generation failed: {ev.error}", status=500,
                                   type="server_error", code="model_failure")
            if ev.logprobs:
                self.logprobs.extend(ev.logprobs)
            if ev.prompt_logprobs is not None and self.prompt_logprobs is None:
                self.prompt_logprobs = ev.prompt_logprobs
            delta = self.text.add(ev.token_ids)
            if self.text.stopped:  # a stop string: done, free the row now
                self.srv.loop_engine.abort(h)
                self.stats = ev.stats
                yield delta, "stop"
                return
            if ev.done:
                self.stats = ev.stats
                # "grammar": the request's grammar reached a dead end (engine/constrained.py)
                yield delta + self.text.finish(), (ev.finish_reason if ev.finish_reason in ("stop", "grammar")
                                                   else "length")
                return
            if delta:
                yield delta, None


async def watch_disconnect(receive, gens: list[Generation]) -> None:
    """Abort every row of a request as soon as the client goes away (`receive`: the request's
    ASGI receive; after the body was read, the next message is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    for g in gens:
        g.abort()


def token_namer(srv: Service, req):
    """Token id -> its name in logprobs: its text, or "token_id:{id}" when asked."""
    return TokenIds() if req.return_tokens_as_token_ids else srv.token_text


def choice_logprobs(srv: Service, req, gen: Generation, chat: bool, echo: str | None = None,
                    entries: list | None = None, writer: CompletionLogprobWriter | None = None) -> dict:
    """The logprob fields of a choice (server/logprobs.py) for what the request asked:
    `entries` (default: all of the row's), with the prompt's first for an echo."""
    out = {}
    entries = gen.logprobs if entries is None else entries
    text = token_namer(srv, req)
    if not asks_logprobs(req, chat):
        pass
    elif chat:
        out["logprobs"] = chat_logprobs(entries, text)
    else:
        pairs = [(e.token, e) for e in entries]
        if echo is not None:
            prompt = gen.p.prompt
            pairs = [(prompt[0], None), *zip(prompt[1:], gen.prompt_logprobs or [None] * (len(prompt) - 1)),
                     *pairs]
        out["logprobs"] = (writer or CompletionLogprobWriter(text)).write(pairs)
    if req.prompt_logprobs is not None and gen.prompt_logprobs is not None:
        out["prompt_logprobs"] = vllm_prompt_logprobs(gen.prompt_logprobs, text)
    return out
