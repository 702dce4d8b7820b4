"""Request validation: API key, body limits, JSON and Unicode checks, the OpenAI fields
turned into what the engine takes (`prepare`). Every refusal is a `RequestError`."""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass

import torch
from fastapi import Request
from pydantic import ValidationError

from specrouter.config import SamplingParams
from specrouter.errors import ChainError, ContextLengthError, SamplingParamsError
from specrouter.server.protocol import RequestError, validation_error
from specrouter.server.service import Service
from specrouter.server.text import stop_token_ids

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def check_auth(srv: Service, request: Request) -> None:
    key = srv.config.api_key
    if not key:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise RequestError("invalid or missing API key: send 'Authorization: Bearer <key>'",
                           status=401, type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _check_unicode(data) -> None:
    """Strings must be encodable as UTF-8 (JSON escapes can carry lone surrogates)."""
    todo = [(data, "")]  # iterative: nesting depth is the client's choice
    while todo:
        value, path = todo.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestError(f"'{path or 'body'}' contains a lone UTF-16 surrogate (an "
                                   "unpaired \\ud800-\\udfff escape): not valid Unicode text",
                                   param=path or None) from None
        elif isinstance(value, dict):
            for k, v in value.items():
                todo.append((k, path))
                todo.append((v, f"{path}.{k}" if path else k))
        elif isinstance(value, list):
            todo.extend((v, f"{path}.{i}") for i, v in enumerate(value))


async def read_json(request: Request, limit: int) -> dict:
    too_large = RequestError(f"the request body is over the limit of {limit} bytes", status=413,
                             code="request_too_large")
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise RequestError("invalid Content-Length header")
        if int(length) > limit:
            raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    if not body:
        raise RequestError("the request body is empty: send a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"the request body is not valid UTF-8: {e}") from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except ValueError as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise RequestError("the request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise RequestError(f"the request body must be a JSON object, got a {type(data).__name__}")
    _check_unicode(data)
    return data


def parse(cls, data: dict):
    try:
        req = cls.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
    bad = req.unsupported()
    if bad is not None:
        raise bad
    return req


@dataclass
class Prepared:
    """A validated request, ready for the engine."""

    prompt: list[int]
    params: SamplingParams
    chain: tuple[str, ...] | None
    k: int
    stops: list[str]
    generator: torch.Generator | None


def prepare(srv: Service, req, prompt: list[int], *, chat: bool) -> Prepared:
    # the served name, the target's pool name or its role "target" (every reply is the target's)
    if req.model is not None and req.model not in (srv.model_name, srv.pool.target, "target"):
        raise RequestError(f"the model {req.model!r} does not exist: this server serves "
                           f"{srv.model_name!r} (see /v1/models)", status=404, param="model",
                           code="model_not_found")
    if srv.target_down:
        raise RequestError("the target model failed: the server cannot generate (see /health)",
                           status=503, type="server_error", code="target_unavailable")
    engine, pool = srv.engine, srv.pool
    k = req.specrouter_k if req.specrouter_k is not None else srv.config.k
    chain = tuple(req.specrouter_chain) if req.specrouter_chain is not None else srv.config.chain
    try:
        checked = pool.validate_chain(chain or pool.default_chain)
    except ChainError as e:
        raise RequestError(str(e), param="specrouter_chain") from None
    limit = engine.context_limit(checked)
    room = limit - len(prompt) - k - 1  # tokens that can still be generated
    if room < 1:
        raise RequestError(
            f"the prompt has {len(prompt)} tokens; this server accepts at most {limit - k - 2} "
            f"prompt tokens (context {limit} = prompt + at least 1 generated + draft length "
            f"{k} + 1): shorten the prompt", param="messages" if chat else "prompt",
            code="context_length_exceeded")
    stops = req.stop_strings()
    max_tokens = req.max_tokens
    if chat and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    if max_tokens is None:
        max_tokens = room if chat else min(COMPLETIONS_DEFAULT_MAX_TOKENS, room)
    try:
        params = SamplingParams(
            temperature=float(req.temperature), top_k=max(0, req.top_k), top_p=float(req.top_p),
            max_new_tokens=max_tokens, stop_token_ids=stop_token_ids(pool.tokenizer, stops),
            seed=req.seed, ignore_eos=req.ignore_eos)
        engine.check_request(prompt, params, chain, k)
    except ContextLengthError as e:
        raise RequestError(str(e), param="max_tokens", code="context_length_exceeded") from None
    except SamplingParamsError as e:
        raise RequestError(str(e)) from None
    except ChainError as e:
        raise RequestError(str(e), param="specrouter_chain") from None
    except ValueError as e:  # the prompt itself (empty, token ids out of range)
        raise RequestError(str(e), param="messages" if chat else "prompt") from None
    generator = None
    if req.seed is not None and req.temperature > 0:  # a seeded request has its own stream
        generator = torch.Generator()
        generator.manual_seed(req.seed)
    return Prepared(prompt, params, chain, k, stops, generator)
