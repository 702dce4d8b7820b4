"""A request's rows and its whole (not streamed) response: one row, or `n` / `best_of` rows
sharing the prompt, run concurrently (one engine batch; the prefix cache shares the prompt's
KV once a row parked it).

- seeds: a seeded request gives row i the seed `row_seed(seed, i)`: the request's own for
  i = 0 (so choice 0 is the n = 1 answer), a hash of (seed, i) otherwise (distinct,
  reproducible); unseeded rows draw their own.
- `best_of` (> n, not streamed): best_of rows run and the n with the highest mean logprob per
  token (OpenAI's "highest log probability per token"; the logprobs of decoding/logprobs.py,
  under the distribution each token was sampled from) are returned, best first; usage counts
  every row's tokens (they were generated).
- usage counts the prompt once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import math
import time
import uuid

from fastapi import Request
from fastapi.responses import Response

from specrouter.server.generation import (
    ClientGone,
    Generation,
    choice_logprobs,
    submit,
    usage_of_rows,
    watch_disconnect,
)
from specrouter.server.protocol import (
    IGNORED_FIELDS_HEADER,
    ChatChoice,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionResponse,
    RequestError,
)
from specrouter.server.service import Service
from specrouter.server.tools import ToolRequest, message_of
from specrouter.server.validate import Prepared, tenant_of


def row_seed(seed: int, i: int) -> int:
    """The seed of row i of a seeded request (module docstring)."""
    if i == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}:{i}".encode()).digest()[:8], "little") >> 1


def start_rows(srv: Service, request: Request, req, p: Prepared) -> list[Generation]:
    """Submit the request's rows (`req.rows()`: best_of, else n); on a refusal none stays queued."""
    count = req.rows()
    rows = []
    for i in range(count):
        params = p.params
        if params.seed is not None and count > 1:
            params = dataclasses.replace(params, seed=row_seed(params.seed, i))
        if count > req.n and params.logprobs is None:  # best_of ranks rows by their logprobs
            params = dataclasses.replace(params, logprobs=0)
        rows.append(p if params is p.params else dataclasses.replace(p, params=params, generator=None))
    tenant = tenant_of(srv, request)
    gens = []
    try:
        for row in rows:
            gens.append(Generation(srv, row, submit(srv, row, tenant, stream=bool(req.stream))))
    except RequestError:
        for g in gens:
            srv.loop_engine.abort(g.handle)
        raise
    return gens


def mean_logprob(gen: Generation) -> float:
    lps = [e.logprob for e in gen.logprobs]
    return sum(lps) / len(lps) if lps else -math.inf


async def respond_whole(srv: Service, request: Request, req, gens: list[Generation], *, chat: bool,
                        tools: ToolRequest | None = None, echo: str | None = None) -> Response:
    """The whole response of a request's rows (module docstring)."""

    async def collect(gen: Generation) -> tuple[str, str | None]:
        parts, finish = [], None
        async for delta, finish in gen.events():
            parts.append(delta)
        return "".join(parts), finish

    watcher = asyncio.create_task(watch_disconnect(request.receive, gens))
    try:
        results = await asyncio.gather(*(collect(g) for g in gens))
    except ClientGone:
        return Response(status_code=499)  # nobody reads it
    finally:
        watcher.cancel()
        for g in gens:
            if not g.handle.finished:
                srv.loop_engine.abort(g.handle)
    usage = usage_of_rows(gens)
    order = list(range(len(gens)))
    if len(gens) > req.n:  # best_of: the n best by mean logprob per token, best first
        order = sorted(order, key=lambda i: -mean_logprob(gens[i]))[: req.n]
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    if chat:
        choices = []
        for index, i in enumerate(order):
            fields, f = message_of(*results[i], tools)  # tool calls parsed (server/tools.py)
            choices.append(ChatChoice(index=index, message=ChatMessageOut(**fields), finish_reason=f,
                                      **choice_logprobs(srv, req, gens[i], chat)))
        body = ChatCompletionResponse(id=rid, created=created, model=srv.model_name, usage=usage,
                                      choices=choices)
    else:
        body = CompletionResponse(id=rid, created=created, model=srv.model_name, usage=usage, choices=[
            CompletionChoice(index=index, text=(echo or "") + results[i][0], finish_reason=results[i][1],
                             **choice_logprobs(srv, req, gens[i], chat, echo))
            for index, i in enumerate(order)])
    ignored = req.ignored_fields()
    return Response(body.model_dump_json(), media_type="application/json",
                    headers={IGNORED_FIELDS_HEADER: ",".join(ignored)} if ignored else {})
