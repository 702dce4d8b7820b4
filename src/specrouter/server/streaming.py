"""A request's streamed response (SSE): the chunks of its n rows as they come, each with its
choice `index`, then `data: [DONE]`.

- chat: each choice opens with a `{"role": "assistant"}` delta; with tools, a choice's text goes
  through its own tool-call parser (server/tools.py), whose deltas are content or tool_calls
  pieces; every choice ends with a chunk carrying its finish_reason;
- completions `echo`: a choice's prompt is its first chunk (with the prompt's logprobs);
- logprobs: a chunk carries those of the tokens since the choice's last chunk;
- usage once, on a last chunk with no choices, only when `stream_options.include_usage` asks
  (the prompt counted once, every row's tokens);
- an error after the response started is an error chunk, then `data: [DONE]` (as OpenAI).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse

from specrouter.server.generation import (
    ClientGone,
    Generation,
    asks_logprobs,
    choice_logprobs,
    sse,
    sse_text_template,
    token_namer,
    usage_of_rows,
    watch_disconnect,
)
from specrouter.server.logprobs import CompletionLogprobWriter
from specrouter.server.protocol import (
    ChatCompletionChunk,
    ChatStreamChoice,
    CompletionChoice,
    CompletionResponse,
    RequestError,
    error_body,
)
from specrouter.server.service import Service
from specrouter.server.tools import ToolCallParser, ToolRequest, finish_message


DONE = "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """A request's SSE response (`stream`'s writes): one `send`, so one socket write, per engine
    event of a row (its chunks joined; the rows' last event carries the usage chunk, `[DONE]` and
    the end of the chunked body too); the client gone, `watch_disconnect` aborts the rows, as for
    a whole response. Starlette's StreamingResponse, with the ASGI 2.3 that uvicorn speaks, runs
    an anyio task group per response to listen for the disconnect, and a stream's end took four
    writes after its last tokens (finish chunk, usage, `[DONE]`, end of body), each a loopback
    send of ~0.1 ms that wakes the client, inside the engine thread's hand-off wait at c=8
    (docs/serving-performance.md, sixteenth round)."""

    def __init__(self, content: AsyncIterator[str], gens: list[Generation], headers: dict[str, str]):
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.gens = gens

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        watcher = asyncio.create_task(watch_disconnect(receive, self.gens))
        ended = False
        try:
            async for text in self.body_iterator:  # resumed after each send: `stream` times it
                ended = text.endswith(DONE)
                await send({"type": "http.response.body", "body": text.encode(), "more_body": not ended})
            if not ended:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except ClientGone:
            pass  # nobody reads it: its rows were aborted
        finally:
            watcher.cancel()
            await self.body_iterator.aclose()  # a stream left early aborts its rows (`stream`)


async def merged(gens: list[Generation]) -> AsyncIterator[tuple[int, str, str | None, list]]:
    """(row, text delta, finish_reason or None, logprobs of its new tokens) of every row as they
    come; one row is read directly (no task in between)."""
    if len(gens) == 1:
        g = gens[0]
        async for delta, finish in g.events():
            yield 0, delta, finish, g.take_logprobs()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, g: Generation) -> None:
        try:
            async for delta, finish in g.events():
                queue.put_nowait((i, delta, finish, g.take_logprobs(), None))
        except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait((i, None, None, None, e))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, delta, finish, logprobs, error = await queue.get()
            if error is not None:
                raise error
            yield i, delta, finish, logprobs
            left -= finish is not None
    finally:
        for t in tasks:
            t.cancel()


async def stream(srv: Service, gens: list[Generation], rid: str, created: int, chat: bool,
                 include_usage: bool, req, tools: ToolRequest | None = None,
                 echo: str | None = None) -> AsyncIterator[str]:
    """The SSE chunks of a request's rows (module docstring)."""
    model = srv.model_name
    n = len(gens)
    namer = token_namer(srv, req)
    writers = [CompletionLogprobWriter(namer) for _ in gens]
    parsers = [ToolCallParser(tools.names) if chat and tools is not None and tools.rendered else None
               for _ in gens]
    carried: list[list] = [[] for _ in gens]  # logprobs not sent yet, per choice
    echoes = [echo] * n

    # a text chunk of a request without logprobs: its choice's template (sse_text_template)
    templates: list[tuple[str, str] | None] = [None] * n
    plain = not asks_logprobs(req, chat)

    def text_sse(i: int, text: str | dict) -> str:
        """The SSE event of choice i's text piece (a dict: a chat delta such as tool calls)."""
        if not (plain and isinstance(text, str) and text):
            return sse(chunk(i, text, None))
        if templates[i] is None:
            templates[i] = sse_text_template(lambda t: chunk(i, t, None))
        before, after = templates[i]
        return before + json.dumps(text, ensure_ascii=False) + after

    def chunk(i: int, text: str | dict | None, finish: str | None, role: bool = False):
        extra = {}
        if not role:
            logprobs, carried[i] = carried[i], []
            extra = choice_logprobs(srv, req, gens[i], chat, None, logprobs, writers[i])
            extra.pop("prompt_logprobs", None)
        if chat:
            delta = {"role": "assistant", "content": ""} if role else (
                text if isinstance(text, dict) else {"content": text} if text else {})
            return ChatCompletionChunk(id=rid, created=created, model=model, choices=[
                ChatStreamChoice(index=i, delta=delta, finish_reason=finish, **extra)])
        return CompletionResponse(id=rid, created=created, model=model, choices=[
            CompletionChoice(index=i, text=text or "", finish_reason=finish, **extra)])

    try:
        if chat:
            yield "".join(sse(chunk(i, None, None, role=True)) for i in range(n))
        delivery = srv.metrics.stream_delivery_seconds
        running = n  # rows not finished
        async for i, delta, finish, logprobs in merged(gens):
            g, parser = gens[i], parsers[i]
            carried[i] += logprobs
            out = []  # this event's SSE events: one write
            if echoes[i] is not None:  # the prompt first (its logprobs came with the first tokens)
                first = choice_logprobs(srv, req, g, chat, echoes[i], [], writers[i])
                out.append(sse(CompletionResponse(id=rid, created=created, model=model, choices=[
                    CompletionChoice(index=i, text=echoes[i], finish_reason=None, **first)])))
                echoes[i] = None
            if delta:
                out += [text_sse(i, d) for d in (parser.feed(delta) if parser is not None else [delta])]
            if finish is not None:
                if parser is not None:
                    out += [text_sse(i, d) for d in parser.finish()]
                    finish = finish_message(parser, finish)[1]
                out.append(sse(chunk(i, None, finish)))
                running -= 1
            if not running:  # the last event: usage (if asked) and the end in the same write
                if include_usage:  # usage once, on a last chunk with no choices (OpenAI)
                    last = (ChatCompletionChunk if chat else CompletionResponse)(
                        id=rid, created=created, model=model, choices=[], usage=usage_of_rows(gens))
                    out.append(sse(last))
                out.append(DONE)
            if out:
                yield "".join(out)
            if delta:  # resumed once the write was handed to the socket (EventStream)
                delivery.observe(time.perf_counter() - g.committed)
    except RequestError as e:  # the response has started: report in the stream, as OpenAI does
        yield f"data: {json.dumps(error_body(e.message, e.type, e.param, e.code))}\n\n" + DONE
    finally:  # also on client disconnect (the generator is cancelled or closed)
        for g in gens:
            if not g.handle.finished:
                srv.loop_engine.abort(g.handle)
