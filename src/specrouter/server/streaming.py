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

from specrouter.server.generation import (
    Generation,
    asks_logprobs,
    choice_logprobs,
    sse,
    sse_text_template,
    token_namer,
    usage_of_rows,
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
            for i in range(n):
                yield sse(chunk(i, None, None, role=True))
        delivery = srv.metrics.stream_delivery_seconds
        async for i, delta, finish, logprobs in merged(gens):
            g, parser = gens[i], parsers[i]
            carried[i] += logprobs
            if echoes[i] is not None:  # the prompt first (its logprobs came with the first tokens)
                first = choice_logprobs(srv, req, g, chat, echoes[i], [], writers[i])
                yield sse(CompletionResponse(id=rid, created=created, model=model, choices=[
                    CompletionChoice(index=i, text=echoes[i], finish_reason=None, **first)]))
                echoes[i] = None
            if delta:
                for d in (parser.feed(delta) if parser is not None else [delta]):
                    yield text_sse(i, d)
                # resumed once the chunk was handed to the socket (StreamingResponse's send)
                delivery.observe(time.perf_counter() - g.committed)
            if finish is None:
                continue
            if parser is not None:
                for d in parser.finish():
                    yield text_sse(i, d)
                finish = finish_message(parser, finish)[1]
            yield sse(chunk(i, None, finish))
        if include_usage:  # usage once, on a last chunk with no choices (OpenAI)
            usage = usage_of_rows(gens)
            last = (ChatCompletionChunk if chat else CompletionResponse)(
                id=rid, created=created, model=model, choices=[], usage=usage)
            yield sse(last)
        yield "data: [DONE]\n\n"
    except RequestError as e:  # the response has started: report in the stream, as OpenAI does
        yield f"data: {json.dumps(error_body(e.message, e.type, e.param, e.code))}\n\n"
        yield "data: [DONE]\n\n"
    finally:  # also on client disconnect (the generator is cancelled or closed)
        for g in gens:
            if not g.handle.finished:
                srv.loop_engine.abort(g.handle)
