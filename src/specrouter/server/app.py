"""The OpenAI-compatible HTTP server (FastAPI): `create_app(pool, ServerConfig(...))`.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `stream: true`: SSE
`data: {...}` chunks then `data: [DONE]`), GET /v1/models, GET /health, GET /metrics.

Choices written down here (where OpenAI / vLLM leave room):
- The server serves ONE model, named after the target (or `served_model_name`); `model` may
  be omitted; another name is a 404 `model_not_found`.
- `max_tokens` defaults to min(16, room left) for completions (OpenAI) and to the room left
  in the context for chat (limit - prompt tokens, as vLLM); a request fits when prompt +
  max_tokens <= the context limit: the draft length reserves nothing (validate.py).
- `temperature` below 1e-5 (`config.GREEDY_TEMPERATURE`) is greedy decoding; `top_k` is at
  most the vocabulary size; every numeric field is range-checked (protocol.py, validate.py).
- Edge checks before routing (edge.py): the Host name (on a loopback address only loopback
  names, against DNS rebinding; `allowed_hosts` otherwise), then the API key (if any) on every
  /v1 path, and on /health and /metrics with `metrics_auth` (open otherwise, as vLLM).
- JSON endpoints need `Content-Type: application/json` (415 otherwise); prompts are tokenized
  off the event loop, and one too long in bytes to fit is refused before tokenizing.
- One failing request never costs another: a row whose sampling or planning raises ends alone
  (engine/isolation.py) with a 500 or an error chunk; the other rows finish unchanged.
- Errors are OpenAI-shaped `{"error": {"message", "type", "param", "code"}}`, never FastAPI's
  422 shape: 400 bad request (named field), 401 auth, 404 model/route, 413 body too large,
  415 not JSON, 421 Host not served, 429 queue full (Retry-After), 431 header block too large,
  500 model failure, 503 target down / engine stopped. Errors of the HTTP layer itself
  (unparseable requests) are in the same shape (http11.py).
- Per-request stats (chains used, acceptance per level, mean acceptance length, tokens/s) are in
  `usage.specrouter`; a stream carries `usage` once, on a last chunk with no choices, and only
  when `stream_options.include_usage` asks (as OpenAI: clients that add up usage count it once).
- Unknown request fields are ignored and named in the `X-SpecRouter-Ignored-Fields` response
  header; recognised fields SpecRouter does not implement are a 400 naming them (protocol.py).
- CORS only for `allowed_origins` (`--allowed-origins`; none by default). /tokenize and
  /detokenize answer in vLLM's and llama-server's shapes (tokenize.py).
- A request that pins a chain with a failed model runs without that model.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specrouter.config import ServerConfig
from specrouter.models.pool import Pool
from specrouter.server.async_engine import (
    QueueFull,
    RequestHandle,
    TokenEvent,
)
from specrouter.server.edge import EdgeGuard
from specrouter.server.logprobs import (
    CompletionLogprobWriter,
    TokenIds,
    chat_logprobs,
    vllm_prompt_logprobs,
)
from specrouter.server.metrics import ServerMetrics
from specrouter.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    IGNORED_FIELDS_HEADER,
    ModelCard,
    ModelList,
    RequestError,
    Usage,
    error_body,
)
from specrouter.server.service import Service
from specrouter.server.text import TextStream
from specrouter.server.tokenize import tokenize_routes
from specrouter.server.tools import (
    ToolCallParser,
    ToolRequest,
    chat_messages,
    finish_message,
    message_of,
    tool_request,
)
from specrouter.server.validate import (
    Prepared,
    parse,
    prepare,
    read_json,
    render_chat,
    tenant_of,
    tokenize_prompt,
)

logger = logging.getLogger("specrouter.server")



def _submit(srv: Service, p: Prepared, tenant: str | None = None) -> RequestHandle:
    try:
        return srv.loop_engine.submit(p.prompt, p.params, chain=p.chain, k=p.k,
                                      generator=p.generator, tenant=tenant)
    except QueueFull as e:
        raise RequestError(str(e), status=429, type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(srv.config.retry_after_s)}) from None
    except RuntimeError as e:
        raise RequestError(str(e), status=503, type="server_error") from None


def _usage(prompt_len: int, ts: TextStream, stats: dict | None) -> Usage:
    n = len(ts.token_ids)
    cached = (stats or {}).get("cached_tokens", 0)
    return Usage(prompt_tokens=prompt_len, completion_tokens=n, total_tokens=prompt_len + n,
                 prompt_tokens_details={"cached_tokens": cached}, specrouter=stats)


class _Generation:
    """Runs one request: yields (text delta, finish_reason or None, event stats)."""

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

    async def watch_disconnect(self, request: Request) -> None:
        """Non-streaming: abort the row as soon as the client goes away (after the body was
        read, the next ASGI message is the disconnect)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.srv.loop_engine.abort(self.handle)
        self.handle.events.put_nowait(TokenEvent([], True, "abort"))

    async def events(self) -> AsyncIterator[tuple[str, str | None]]:
        """Text deltas; the last item carries the finish reason. Raises RequestError(500) if a
        model failure ended the row, _ClientGone if the client went away."""
        h = self.handle
        while True:
            ev = await h.events.get()
            self.committed = ev.committed
            if ev.finish_reason == "abort":
                raise _ClientGone()
            if ev.token_ids and self.first_token_at is None:
                self.first_token_at = time.perf_counter()
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


class _ClientGone(Exception):
    pass


def _sse(obj) -> str:
    return f"data: {obj.model_dump_json()}\n\n"


# -- the app ------------------------------------------------------------------------------------
def create_app(pool: Pool, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app serving `pool`. The engine thread starts with the app (lifespan) and
    stops with it."""
    config = config or ServerConfig()
    srv = Service(pool, config)
    app = FastAPI(title="SpecRouter", lifespan=_lifespan(srv), docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = srv
    app.add_middleware(EdgeGuard, config=config)  # Host and API key, before any route
    if config.allowed_origins:  # outside EdgeGuard: a preflight carries no API key
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"],
                           expose_headers=[IGNORED_FIELDS_HEADER], max_age=600)
    app.add_middleware(_RequestMetrics, metrics=srv.metrics)  # outermost: counts refusals too
    _add_error_handlers(app)
    app.include_router(_ops_routes(srv))
    app.include_router(_v1_routes(srv))
    app.include_router(tokenize_routes(srv, config.max_body_bytes))
    return app


def _lifespan(srv: Service):
    @contextlib.asynccontextmanager
    async def lifespan(app):
        srv.loop_engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(srv.close)

    return lifespan


def _add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape, never FastAPI's."""

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, e: RequestError):
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        msg = {404: f"no route {request.url.path!r}", 405: f"method {request.method} is not allowed "
               f"on {request.url.path!r}"}.get(e.status_code, str(e.detail))
        return _error_response(RequestError(msg, status=e.status_code,
                                            code="not_found" if e.status_code == 404 else None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return _error_response(RequestError(f"internal error: {type(e).__name__}", status=500,
                                            type="server_error"))


def _ops_routes(srv: Service) -> APIRouter:
    """/health and /metrics (open unless `metrics_auth`: edge.py)."""
    router = APIRouter()

    @router.get("/health")
    async def health():
        eng = srv.engine
        body = {"status": "ok", "model": srv.model_name, "failed_models": sorted(eng.failed_models),
                "running": len(eng.running), "waiting": srv.loop_engine.queue_depth}
        if srv.target_down:
            body["status"] = "unavailable"
            if srv.loop_engine.error is not None:
                body["error"] = f"{type(srv.loop_engine.error).__name__}: {srv.loop_engine.error}"
            return Response(json.dumps(body), status_code=503, media_type="application/json")
        return body

    @router.get("/metrics")
    async def metrics():
        return Response(srv.metrics.render(), media_type=srv.metrics.content_type)

    return router


def _v1_routes(srv: Service) -> APIRouter:
    """The OpenAI endpoints (the API key is checked before them: edge.py)."""
    router, config = APIRouter(), srv.config

    @router.get("/v1/models")
    async def models():
        info = {"pool": list(srv.pool.order), "target": srv.pool.target,
                "heads": sorted(getattr(srv.pool, "heads", ())),
                "failed_models": sorted(srv.engine.failed_models),
                "max_model_len": srv.max_model_len, "max_num_seqs": config.max_num_seqs}
        cards = [ModelCard(id=name, created=srv.created, specrouter=info)
                 for name in srv.served_names]  # the served name first, then its aliases
        return Response(ModelList(data=cards).model_dump_json(), media_type="application/json")

    @router.post("/v1/completions")
    async def completions(request: Request):
        req = parse(CompletionRequest, await read_json(request, config.max_body_bytes))
        text = prompt = req.prompt_value()
        if isinstance(prompt, str):
            prompt = await tokenize_prompt(srv, prompt, req.add_special_tokens)
        p = prepare(srv, req, prompt, chat=False)
        echo = None
        if req.echo:  # the prompt as sent (decoded when sent as ids or truncated)
            echo = text if isinstance(text, str) and p.prompt == prompt else \
                srv.pool.tokenizer.decode(p.prompt, skip_special_tokens=False)
        return await _respond(srv, request, req, p, chat=False, echo=echo)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse(ChatCompletionRequest, await read_json(request, config.max_body_bytes))
        tools = tool_request(req)
        prompt = await render_chat(srv, chat_messages(req.messages, tools),
                                   add_generation_prompt=req.add_generation_prompt,
                                   template_kwargs=req.chat_template_kwargs,
                                   add_special_tokens=req.add_special_tokens)
        p = prepare(srv, req, prompt, chat=True)
        return await _respond(srv, request, req, p, chat=True, tools=tools)

    return router


def _row_seed(seed: int, i: int) -> int:
    """The seed of choice i of a seeded n > 1 request: the request's own for i = 0 (so its
    first choice is the n = 1 answer), a hash of (seed, i) otherwise (distinct, reproducible)."""
    if i == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}:{i}".encode()).digest()[:8], "little") >> 1


async def _respond_n(srv: Service, request: Request, req, p: Prepared, *, chat: bool,
                     tools: ToolRequest | None = None, echo: str | None = None):
    """n > 1 (not streamed): n rows sharing the prompt, run concurrently; seeded requests
    give each choice its own seed (`_row_seed`); usage counts the prompt once."""
    rows = []
    for i in range(req.n):
        params = p.params if p.params.seed is None else dataclasses.replace(
            p.params, seed=_row_seed(p.params.seed, i))
        rows.append(dataclasses.replace(p, params=params, generator=None))
    tenant = tenant_of(srv, request)
    gens = []
    try:
        for row in rows:
            gens.append(_Generation(srv, row, _submit(srv, row, tenant)))
    except RequestError:
        for g in gens:
            srv.loop_engine.abort(g.handle)
        raise

    async def collect(gen: _Generation) -> tuple[str, str | None]:
        parts, finish = [], None
        async for delta, finish in gen.events():
            parts.append(delta)
        return "".join(parts), finish

    watcher = asyncio.create_task(_watch_all(srv, request, gens))
    try:
        results = await asyncio.gather(*(collect(g) for g in gens))
    except _ClientGone:
        return Response(status_code=499)
    finally:
        watcher.cancel()
        for g in gens:
            if not g.handle.finished:
                srv.loop_engine.abort(g.handle)
    n_out = sum(len(g.text.token_ids) for g in gens)
    usage = Usage(prompt_tokens=len(p.prompt), completion_tokens=n_out,
                  total_tokens=len(p.prompt) + n_out,
                  specrouter={"choices": [g.stats for g in gens]})
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    if chat:
        choices = []
        for i, ((t, f), g) in enumerate(zip(results, gens)):
            fields, f = message_of(t, f, tools)  # tool calls parsed (server/tools.py)
            choices.append(ChatChoice(index=i, message=ChatMessageOut(**fields), finish_reason=f,
                                      **_logprobs(srv, req, g, chat)))
        body = ChatCompletionResponse(id=rid, created=created, model=srv.model_name, usage=usage,
                                      choices=choices)
    else:
        body = CompletionResponse(id=rid, created=created, model=srv.model_name, usage=usage,
                                  choices=[CompletionChoice(index=i, text=(echo or "") + t, finish_reason=f,
                                                            **_logprobs(srv, req, g, chat, echo))
                                           for i, ((t, f), g) in enumerate(zip(results, gens))])
    ignored = req.ignored_fields()
    return Response(body.model_dump_json(), media_type="application/json",
                    headers={IGNORED_FIELDS_HEADER: ",".join(ignored)} if ignored else {})


async def _watch_all(srv: Service, request: Request, gens: list) -> None:
    """Abort every row of an n > 1 request as soon as the client goes away."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for g in gens:
        srv.loop_engine.abort(g.handle)
        g.handle.events.put_nowait(TokenEvent([], True, "abort"))


def _logprobs(srv: Service, req, gen: _Generation, chat: bool, echo: str | None = None,
              entries: list | None = None, writer: CompletionLogprobWriter | None = None) -> dict:
    """The logprob fields of a choice (server/logprobs.py) for what the request asked:
    `entries` (default: all of the generation's), with the prompt's first for an echo."""
    out = {}
    entries = gen.logprobs if entries is None else entries
    text = TokenIds() if req.return_tokens_as_token_ids else srv.token_text
    if chat and req.logprobs:
        out["logprobs"] = chat_logprobs(entries, text)
    elif not chat and req.logprobs is not None:
        pairs = [(e.token, e) for e in entries]
        if echo is not None:
            prompt = gen.p.prompt
            pairs = [(prompt[0], None), *zip(prompt[1:], gen.prompt_logprobs or [None] * (len(prompt) - 1)),
                     *pairs]
        out["logprobs"] = (writer or CompletionLogprobWriter(text)).write(pairs)
    if req.prompt_logprobs is not None and gen.prompt_logprobs is not None:
        out["prompt_logprobs"] = vllm_prompt_logprobs(gen.prompt_logprobs, text)
    return out


async def _respond(srv: Service, request: Request, req, p: Prepared, *, chat: bool,
                   tools: ToolRequest | None = None, echo: str | None = None):
    if req.n > 1:
        return await _respond_n(srv, request, req, p, chat=chat, tools=tools, echo=echo)
    handle = _submit(srv, p, tenant_of(srv, request))
    gen = _Generation(srv, p, handle)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    ignored = req.ignored_fields()
    extra_headers = {IGNORED_FIELDS_HEADER: ",".join(ignored)} if ignored else {}
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_stream(srv, gen, rid, created, chat, include_usage, tools, req, echo),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                          **extra_headers})
    parts: list[str] = []
    finish = None
    watcher = asyncio.create_task(gen.watch_disconnect(request))
    try:
        async for delta, finish in gen.events():
            parts.append(delta)
    except _ClientGone:
        return Response(status_code=499)  # nobody reads it
    finally:
        watcher.cancel()
        if not handle.finished:
            srv.loop_engine.abort(handle)
    text = "".join(parts)
    usage = _usage(len(p.prompt), gen.text, gen.stats)
    if chat:
        fields, finish = message_of(text, finish, tools)  # tool calls parsed (server/tools.py)
        body = ChatCompletionResponse(id=rid, created=created, model=srv.model_name, usage=usage,
                                      choices=[ChatChoice(message=ChatMessageOut(**fields),
                                                          finish_reason=finish,
                                                          **_logprobs(srv, req, gen, chat))])
    else:
        body = CompletionResponse(id=rid, created=created, model=srv.model_name, usage=usage,
                                  choices=[CompletionChoice(text=(echo or "") + text, finish_reason=finish,
                                                            **_logprobs(srv, req, gen, chat, echo))])
    return Response(body.model_dump_json(), media_type="application/json", headers=extra_headers)


async def _stream(srv: Service, gen: _Generation, rid: str, created: int, chat: bool,
                  include_usage: bool, tools: ToolRequest | None = None, req=None,
                  echo: str | None = None) -> AsyncIterator[str]:
    """SSE chunks; with tools, the text goes through the tool-call parser (server/tools.py),
    whose deltas are content or tool_calls pieces. A chunk carries the logprobs of the tokens
    since the last one (the last chunk the rest); a completions echo comes first, with the
    prompt's logprobs."""
    model = srv.model_name
    parser = ToolCallParser(tools.names) if chat and tools is not None and tools.rendered else None
    writer = CompletionLogprobWriter(TokenIds() if req is not None and req.return_tokens_as_token_ids
                                     else srv.token_text)

    def chunk(text: str | dict | None, finish: str | None, usage: Usage | None = None,
              role: bool = False, logprobs: list | None = None):
        extra = {} if req is None or logprobs is None else _logprobs(srv, req, gen, chat, None,
                                                                       logprobs, writer)
        extra.pop("prompt_logprobs", None)
        if chat:
            delta = {"role": "assistant", "content": ""} if role else (
                text if isinstance(text, dict) else {"content": text} if text else {})
            return ChatCompletionChunk(id=rid, created=created, model=model, usage=usage,
                                       choices=[ChatStreamChoice(delta=delta, finish_reason=finish, **extra)])
        return CompletionResponse(id=rid, created=created, model=model, usage=usage,
                                  choices=[CompletionChoice(text=text or "", finish_reason=finish, **extra)])

    try:
        if chat:
            yield _sse(chunk(None, None, role=True))
        delivery = srv.metrics.stream_delivery_seconds
        async for delta, finish in gen.events():
            if echo is not None:  # the prompt first (its logprobs are known by the first tokens)
                first = _logprobs(srv, req, gen, chat, echo, [], writer)
                yield _sse(CompletionResponse(id=rid, created=created, model=model, choices=[
                    CompletionChoice(text=echo, finish_reason=None, **first)]))
                echo = None
            if delta:
                for d in (parser.feed(delta) if parser is not None else [delta]):
                    yield _sse(chunk(d, None, logprobs=gen.take_logprobs()))
                # resumed once the chunk was handed to the socket (StreamingResponse's send)
                delivery.observe(time.perf_counter() - gen.committed)
            if finish is None:
                continue
            if parser is not None:
                for d in parser.finish():
                    yield _sse(chunk(d, None))
                finish = finish_message(parser, finish)[1]
            yield _sse(chunk(None, finish, logprobs=gen.take_logprobs()))
            if include_usage:  # usage once, on a last chunk with no choices (OpenAI)
                last = chunk(None, None, _usage(len(gen.p.prompt), gen.text, gen.stats))
                last.choices = []
                yield _sse(last)
        yield "data: [DONE]\n\n"
    except RequestError as e:  # the response has started: report in the stream, as OpenAI does
        yield f"data: {json.dumps(error_body(e.message, e.type, e.param, e.code))}\n\n"
        yield "data: [DONE]\n\n"
    finally:  # also on client disconnect (the generator is cancelled or closed)
        if not gen.handle.finished:
            srv.loop_engine.abort(gen.handle)


def _error_response(e: RequestError) -> Response:
    return Response(json.dumps(error_body(e.message, e.type, e.param, e.code)),
                    status_code=e.status, headers=e.headers, media_type="application/json")


_ENDPOINTS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                        "/metrics", "/tokenize", "/detokenize"})


class _RequestMetrics:
    """ASGI middleware: counts requests by endpoint and status, times /v1 requests."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"] if scope["path"] in _ENDPOINTS else "other"
        status = [500]
        t0 = time.perf_counter()

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.requests.labels(path, str(status[0])).inc()
            if path.startswith("/v1/"):
                self.metrics.request_seconds.labels(path).observe(time.perf_counter() - t0)
