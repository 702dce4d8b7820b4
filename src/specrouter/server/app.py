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
import json
import logging
import time
import uuid

from fastapi import APIRouter, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from specrouter.config import ServerConfig
from specrouter.models.pool import Pool
from specrouter.server.choices import respond_whole, start_rows
from specrouter.server.edge import EdgeGuard
from specrouter.server.generation import Generation
from specrouter.server.metrics import ServerMetrics
from specrouter.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    IGNORED_FIELDS_HEADER,
    ModelCard,
    ModelList,
    RequestError,
    error_body,
)
from specrouter.server.service import Service
from specrouter.server.streaming import EventStream, stream
from specrouter.server.tokenize import tokenize_routes
from specrouter.server.tools import ToolRequest, chat_messages, tool_request
from specrouter.server.validate import (
    parse,
    prepare,
    read_json,
    render_chat,
    tokenize_prompt,
)

logger = logging.getLogger("specrouter.server")



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

    # each handler holds `arriving()` until its rows are submitted: an idle engine waits for
    # requests on their way before it starts a batch (server/async_engine.py)
    @router.post("/v1/completions")
    async def completions(request: Request):
        with srv.loop_engine.arriving():
            req = parse(CompletionRequest, await read_json(request, config.max_body_bytes))
            text = prompt = req.prompt_value()
            if isinstance(prompt, str):
                prompt = await tokenize_prompt(srv, prompt, req.add_special_tokens)
            p = prepare(srv, req, prompt, chat=False)
            echo = None
            if req.echo:  # the prompt as sent (decoded when sent as ids or truncated)
                echo = text if isinstance(text, str) and p.prompt == prompt else \
                    srv.pool.tokenizer.decode(p.prompt, skip_special_tokens=False)
            gens = start_rows(srv, request, req, p)
        return await _respond(srv, request, req, gens, chat=False, echo=echo)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        with srv.loop_engine.arriving():
            req = parse(ChatCompletionRequest, await read_json(request, config.max_body_bytes))
            tools = tool_request(req)
            prompt = await render_chat(srv, chat_messages(req.messages, tools),
                                       add_generation_prompt=req.add_generation_prompt,
                                       template_kwargs=req.chat_template_kwargs,
                                       add_special_tokens=req.add_special_tokens)
            p = prepare(srv, req, prompt, chat=True)
            gens = start_rows(srv, request, req, p)
        return await _respond(srv, request, req, gens, chat=True, tools=tools)

    return router


async def _respond(srv: Service, request: Request, req, gens: list[Generation], *, chat: bool,
                   tools: ToolRequest | None = None, echo: str | None = None):
    """The response of a request's submitted rows (n, best_of: choices.py), streamed
    (streaming.py) or whole."""
    if not req.stream:
        return await respond_whole(srv, request, req, gens, chat=chat, tools=tools, echo=echo)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    ignored = req.ignored_fields()
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return EventStream(stream(srv, gens, rid, int(time.time()), chat, include_usage, req, tools, echo), gens,
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                **({IGNORED_FIELDS_HEADER: ",".join(ignored)} if ignored else {})})


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
