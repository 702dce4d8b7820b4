"""POST /tokenize and /detokenize, in vLLM's and llama-server's shapes (one route each).

- vLLM: `{"prompt": str, "add_special_tokens": true, "return_token_strs": false}` or a chat
  `{"messages": [...], "add_generation_prompt": true, "chat_template_kwargs": {...}}` ->
  `{"count", "max_model_len", "tokens", "token_strs"}`; `/detokenize {"tokens": [...]}` ->
  `{"prompt": text}`.
- llama-server: `{"content": str, "add_special": false, "with_pieces": false}` ->
  `{"tokens": [ids]}` (with pieces: `[{"id", "piece"}]`); `/detokenize` -> `{"content": text}`.
A body with `content` is llama-server's; the detokenize reply carries both `prompt` and
`content` (the same text), so either client reads its own key. The API key guards both
routes (edge.py). Unknown fields are ignored, as on the generation endpoints.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Field

from specrouter.server.protocol import (
    IGNORED_FIELDS_HEADER,
    ChatMessage,
    RequestError,
    _Lenient,
)
from specrouter.server.service import Service
from specrouter.server.tools import chat_messages
from specrouter.server.validate import check_model, parse, read_json, render_chat, tokenize_prompt


class TokenizeRequest(_Lenient):
    """One of: `prompt` (vLLM completion), `messages` (vLLM chat), `content` (llama-server)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    content: str | None = None
    add_special_tokens: bool | None = None  # vLLM (completion default true, chat default false)
    add_special: bool = False  # llama-server
    add_generation_prompt: bool = True
    chat_template_kwargs: dict = Field(default_factory=dict)
    return_token_strs: bool = False  # vLLM
    with_pieces: bool = False  # llama-server

    def unsupported(self) -> RequestError | None:
        given = [f for f in ("prompt", "messages", "content") if f in self.model_fields_set]
        if len(given) != 1:
            return RequestError("send exactly one of 'prompt' (text), 'messages' (a chat) or "
                                f"'content' (llama-server's field); got {given or 'none'}",
                                param=given[1] if len(given) > 1 else "prompt")
        return None


class DetokenizeRequest(_Lenient):
    model: str | None = None
    tokens: list[int]

    def unsupported(self) -> RequestError | None:
        return None


def tokenize_routes(srv: Service, max_body_bytes: int) -> APIRouter:
    router = APIRouter()
    tok = srv.pool.tokenizer

    @router.post("/tokenize")
    async def tokenize(request: Request):
        req = parse(TokenizeRequest, await read_json(request, max_body_bytes))
        check_model(srv, req.model)
        if req.messages is not None:
            ids = await render_chat(srv, chat_messages(req.messages),
                                    add_generation_prompt=req.add_generation_prompt,
                                    template_kwargs=req.chat_template_kwargs,
                                    add_special_tokens=bool(req.add_special_tokens))
        elif req.content is not None:
            ids = await tokenize_prompt(srv, req.content, req.add_special, param="content")
        else:
            special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = await tokenize_prompt(srv, req.prompt, special)
        headers = _ignored_header(req)
        if req.content is not None:  # llama-server
            body = {"tokens": [{"id": i, "piece": tok.decode([i])} for i in ids]
                    if req.with_pieces else ids}
        else:
            body = {"count": len(ids), "max_model_len": srv.max_model_len, "tokens": ids,
                    "token_strs": tok.convert_ids_to_tokens(ids) if req.return_token_strs else None}
        return _json(body, headers)

    @router.post("/detokenize")
    async def detokenize(request: Request):
        req = parse(DetokenizeRequest, await read_json(request, max_body_bytes))
        check_model(srv, req.model)
        bad = [t for t in req.tokens if not 0 <= t < len(tok)]
        if bad:
            raise RequestError(f"'tokens' holds {bad[0]}, not a token id of this vocabulary "
                               f"(0..{len(tok) - 1})", param="tokens")
        text = await asyncio.to_thread(tok.decode, req.tokens)
        return _json({"prompt": text, "content": text}, _ignored_header(req))

    return router


def _ignored_header(req) -> dict[str, str]:
    ignored = req.ignored_fields()
    return {IGNORED_FIELDS_HEADER: ",".join(ignored)} if ignored else {}


def _json(body: dict, headers: dict[str, str]) -> Response:
    import json

    return Response(json.dumps(body), media_type="application/json", headers=headers)
