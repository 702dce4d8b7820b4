"""Request validation: content type, body limits, JSON and Unicode checks, prompt
size, the OpenAI fields turned into what the engine takes (`prepare`). Every refusal is a
`RequestError`.

Choices written down here:
- JSON endpoints take `Content-Type: application/json` only (415 otherwise, a missing header
  included): a browser page cannot send that cross-origin without a CORS preflight, which this
  server answers only for the origins `--allowed-origins` names (none by default).
- Context accounting: a request fits when prompt + max_tokens <= the context limit
  (`max_model_len`, capped by the models); the draft length reserves nothing (it shrinks near
  the end of the context). Without `max_tokens`, chat completions get the room that is left
  (limit - prompt, as vLLM) and completions min(16, that room) (OpenAI's default).
- Tokenizing runs off the event loop for prompts over `INLINE_TOKENIZE_BYTES` (4 KiB; shorter
  ones on it: the thread hop costs more); a prompt whose UTF-8 size alone shows it cannot fit
  the context is refused before it is tokenized (`check_prompt_bytes`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from dataclasses import dataclass

import torch
from fastapi import Request
from pydantic import ValidationError

from specrouter.config import SamplingParams
from specrouter.decoding.grammar import GrammarError
from specrouter.errors import (
    ChainError,
    CheckpointError,
    ContextLengthError,
    SamplingParamsError,
)
from specrouter.server.protocol import RequestError, validation_error
from specrouter.server.service import Service
from specrouter.server.structured import grammar_of_request
from specrouter.server.text import stop_token_ids

logger = logging.getLogger("specrouter.server")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def tenant_of(srv: Service, request: Request) -> str | None:
    """Whose learned drafter statistics a request reads and feeds (ServerConfig.suffix_scope):
    None (shared) unless the scope is "api-key"; then the SHA-256 of its Authorization header
    value (so different keys, e.g. per-user keys a gateway forwards, never share), or
    "anonymous" without one."""
    if srv.config.suffix_scope != "api-key":
        return None
    header = request.headers.get("authorization", "").strip()
    if not header:
        return "anonymous"
    return "key-" + hashlib.sha256(header.encode()).hexdigest()[:32]


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


def check_content_type(request: Request) -> None:
    """415 unless the body is declared as JSON (`application/json`, parameters allowed)."""
    value = request.headers.get("content-type")
    media = (value or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        got = f"got {value!r}" if value is not None else "no Content-Type header was sent"
        raise RequestError(f"the request body must be JSON sent with 'Content-Type: "
                           f"application/json' ({got})", status=415,
                           code="unsupported_media_type")


async def read_json(request: Request, limit: int) -> dict:
    check_content_type(request)
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
    """The validated request: a 400 naming the field for a wrong type or a recognised field
    set to what SpecRouter does not implement; unknown fields are logged (and the app names
    them in the `X-SpecRouter-Ignored-Fields` header)."""
    try:
        req = cls.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
    bad = req.unsupported()
    if bad is not None:
        raise bad
    ignored = req.ignored_fields()
    if ignored:
        logger.info("ignored unknown request fields: %s", ", ".join(ignored))
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


def _room(srv: Service, prompt: list[int], chain: tuple[str, ...] | None, *, chat: bool) -> int:
    """Tokens that can still be generated after `prompt` (>= 1), or a 400 stating the limit."""
    engine, pool = srv.engine, srv.pool
    if chain is None and engine.router is not None:  # the router may run any model
        checked = tuple(m for m in pool.order if m in pool.runners)
    else:
        try:
            checked = pool.validate_chain(pool.default_chain if chain is None else chain)
        except ChainError as e:
            raise RequestError(str(e), param="specrouter_chain") from None
    limit = engine.context_limit(checked)
    if len(prompt) >= limit:
        raise RequestError(
            f"the prompt has {len(prompt)} tokens; this server accepts at most {limit - 1} "
            f"prompt tokens (context {limit} = prompt + at least 1 generated token): shorten "
            "the prompt", param="messages" if chat else "prompt", code="context_length_exceeded")
    return limit - len(prompt)


def _chain(srv: Service, req) -> tuple[str, ...] | None:
    if req.specrouter_chain is None:
        return srv.config.chain
    if not req.specrouter_chain:
        raise RequestError("'specrouter_chain' is empty: name the models of the chain, the target "
                           f"{srv.pool.target!r} last, or leave it out to let the server choose",
                           param="specrouter_chain")
    return tuple(req.specrouter_chain)


def check_model(srv: Service, model: str | None) -> None:
    """404 unless `model` is None, a served name (`--served-model-name`: the name and its
    aliases), the target's pool name or its role "target" (every reply is the target's)."""
    if model is not None and model not in (*srv.served_names, srv.pool.target, "target"):
        raise RequestError(f"the model {model!r} does not exist: this server serves "
                           f"{srv.model_name!r} (see /v1/models)", status=404, param="model",
                           code="model_not_found")


def truncate_prompt(req, prompt: list[int]) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the last N tokens of the prompt."""
    n = req.truncate_prompt_tokens
    return prompt[-n:] if n is not None and len(prompt) > n else prompt


def prepare(srv: Service, req, prompt: list[int], *, chat: bool) -> Prepared:
    check_model(srv, req.model)
    if srv.target_down:
        raise RequestError("the target model failed: the server cannot generate (see /health)",
                           status=503, type="server_error", code="target_unavailable")
    engine, pool = srv.engine, srv.pool
    k = req.specrouter_k if req.specrouter_k is not None else srv.config.k
    chain = _chain(srv, req)
    prompt = truncate_prompt(req, prompt)
    room = _room(srv, prompt, chain, chat=chat)
    stops = req.stop_strings()
    max_tokens = req.max_tokens
    if chat and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    if max_tokens is None:
        max_tokens = room if chat else min(COMPLETIONS_DEFAULT_MAX_TOKENS, room)
    if req.top_k > pool.vocab_width:
        raise RequestError(f"invalid value for 'top_k': at most the vocabulary size "
                           f"{pool.vocab_width} (0 or -1 disables it), got {req.top_k}",
                           param="top_k")
    grammar, grammar_field = grammar_of_request(req)
    try:
        params = SamplingParams(
            temperature=float(req.temperature), top_k=max(0, req.top_k), top_p=float(req.top_p),
            max_new_tokens=max_tokens,
            stop_token_ids=_stop_ids(pool, stop_token_ids(pool.tokenizer, stops), req),
            seed=req.seed, ignore_eos=req.ignore_eos, min_p=float(req.min_p),
            presence_penalty=float(req.presence_penalty),
            frequency_penalty=float(req.frequency_penalty),
            repetition_penalty=float(req.repetition_penalty),
            logit_bias=tuple(_token_ids(pool, req.logit_bias_ids(), "logit_bias").items()),
            min_tokens=_min_tokens(req, max_tokens),
            allowed_token_ids=(None if req.allowed_token_ids is None else tuple(
                _token_ids(pool, dict.fromkeys(req.allowed_token_ids), "allowed_token_ids"))),
            grammar=grammar, **_logprob_params(req, chat))
        engine.check_request(prompt, params, chain, k)
    except ContextLengthError as e:
        raise RequestError(str(e), param="max_tokens", code="context_length_exceeded") from None
    except GrammarError as e:  # a schema / grammar that does not compile: its field
        raise RequestError(str(e), param=grammar_field) from None
    except SamplingParamsError as e:
        raise RequestError(str(e)) from None
    except ChainError as e:
        raise RequestError(str(e), param="specrouter_chain") from None
    except ValueError as e:  # the prompt itself (empty, token ids out of range)
        raise RequestError(str(e), param="messages" if chat else "prompt") from None
    generator = None
    if req.seed is not None and not params.greedy:  # a seeded request has its own stream
        generator = torch.Generator()
        generator.manual_seed(req.seed)
    return Prepared(prompt, params, chain, k, stops, generator)


def _logprob_params(req, chat: bool) -> dict:
    """SamplingParams' logprobs / prompt_logprobs of a request (server/logprobs.py): chat's
    `logprobs` + `top_logprobs`, completions' `logprobs` (n alternatives), which with `echo` asks
    for the prompt's too; vLLM's `prompt_logprobs` on either."""
    if chat:
        logprobs = req.top_logprobs if req.logprobs else None
    else:
        logprobs = req.logprobs
    prompt = req.prompt_logprobs
    if not chat and req.echo and logprobs is not None:
        prompt = max(logprobs, prompt or 0)
    return {"logprobs": logprobs, "prompt_logprobs": prompt}


def _min_tokens(req, max_tokens: int) -> int:
    if req.min_tokens > max_tokens:
        raise RequestError(f"'min_tokens' ({req.min_tokens}) is over the tokens this request may "
                           f"generate ({max_tokens})", param="min_tokens")
    return req.min_tokens


def _token_ids(pool, ids: dict, param: str) -> dict:
    """`ids` (keys: token ids), or a 400 naming `param` for an id outside the vocabulary."""
    for t in ids:
        if not 0 <= t < pool.vocab_width:
            raise RequestError(f"'{param}' holds {t}, not a token id of this vocabulary "
                               f"(0..{pool.vocab_width - 1})", param=param)
    if param == "allowed_token_ids" and not ids:
        raise RequestError("'allowed_token_ids' is empty: no token could be sampled", param=param)
    return ids


def _stop_ids(pool, from_strings, req) -> tuple[int, ...]:
    """Stop token ids: those of single-token stop strings and the request's `stop_token_ids`."""
    for t in req.stop_token_ids:
        if not 0 <= t < pool.vocab_width:
            raise RequestError(f"'stop_token_ids' holds {t}, not a token id of this vocabulary "
                               f"(0..{pool.vocab_width - 1})", param="stop_token_ids")
    return tuple(dict.fromkeys([*from_strings, *req.stop_token_ids]))


# -- prompts: size check, then tokenizing off the event loop -----------------------------------
# UTF-8 bytes one token may stand for, over the longest vocabulary entry: a normalizer that
# composes characters (NFC joins three Hangul jamo of 3 bytes into one syllable of 3) shrinks text
NORMALIZER_SLACK = 4
# a prompt of at most this many UTF-8 bytes is tokenized on the event loop (20-170 us for the
# bench's prompts, chat template included, on a Sapphire Rapids); a longer one on a worker thread.
# The hop cost more than a short prompt's tokenizing: four requests arriving together spent 3-4 ms
# in their hops (the loop, the executor's threads and the engine thread taking turns on the GIL)
# before their batch could start (docs/serving-performance.md, fifteenth round). Requests sent
# together still start together without the hop's overlap: the idle engine's gather waits for
# requests on their way by its own rules (server/async_engine.py `AsyncEngine._gather`)
INLINE_TOKENIZE_BYTES = 4096
CHAT_MESSAGE_BYTES = 64  # a chat template's text around one message, counted against the above


async def off_loop_if_long(size: int, fn, *args, **kwargs):
    """`fn(*args, **kwargs)`: here when `size` (the input's UTF-8 bytes) is at most
    `INLINE_TOKENIZE_BYTES`, else on a worker thread (a long prompt must not hold the loop)."""
    if size <= INLINE_TOKENIZE_BYTES:
        return fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)


def check_prompt_bytes(srv: Service, texts: list[str], *, param: str) -> int:
    """Refuse, without tokenizing, a prompt too long in bytes to fit any context this server
    has (a 1 MB prompt costs seconds of tokenizing only to be refused); its UTF-8 bytes."""
    size = sum(len(t.encode("utf-8")) for t in texts)
    limit = srv.max_model_len
    bound = limit * srv.longest_token_bytes * NORMALIZER_SLACK
    if size > bound:
        raise RequestError(
            f"the prompt is {size} bytes: more than {limit - 1} tokens, the most this server "
            f"accepts (context {limit} = prompt + at least 1 generated token; no prompt over "
            f"{bound} bytes fits): shorten the prompt", param=param,
            code="context_length_exceeded")
    return size


async def tokenize_prompt(srv: Service, text: str, add_special_tokens: bool = False,
                          param: str = "prompt") -> list[int]:
    """Token ids of a completions prompt (after `check_prompt_bytes`), off the event loop when
    long (`off_loop_if_long`)."""
    size = check_prompt_bytes(srv, [text], param=param)
    return await off_loop_if_long(size, srv.encode, text, add_special_tokens)


async def render_chat(srv: Service, messages: list[dict], *, add_generation_prompt: bool = True,
                      template_kwargs: dict | None = None,
                      add_special_tokens: bool = False) -> list[int]:
    """Token ids of a chat (the server's template applied, with the request's
    `chat_template_kwargs` as extra template variables), off the event loop when long."""
    from specrouter.models.tokenizer import apply_chat_template

    # a template may trim each message: only the trimmed text surely reaches the tokenizer
    size = check_prompt_bytes(srv, [m["content"].strip() for m in messages], param="messages")
    # what the loop would render and encode: the contents, the template's text around each
    # message (a chat of 30,000 empty messages is 0 content bytes yet ~480 ms of work) and the
    # request's template variables
    work = size + CHAT_MESSAGE_BYTES * len(messages) + len(repr(template_kwargs or ""))
    try:
        return await off_loop_if_long(
            work, apply_chat_template, srv.pool.tokenizer, messages,
            add_generation_prompt=add_generation_prompt, template=srv.chat_template,
            template_kwargs=template_kwargs, add_special_tokens=add_special_tokens)
    except CheckpointError as e:
        raise RequestError(str(e), param="messages") from None
    except Exception as e:  # a template that refuses the conversation (e.g. role order)
        raise RequestError(f"the chat template of {srv.pool.target!r} rejected the "
                           f"messages: {e}", param="messages") from None
