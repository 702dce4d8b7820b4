"""OpenAI wire format: request models (validated strictly) and response models.

Requests are strict: wrong JSON types are errors (no "10" -> 10), unknown fields are errors
(a field SpecRouter would silently ignore could change what the client expects), and OpenAI
fields whose non-default values SpecRouter does not implement (logprobs, best_of, penalties,
tools, n > 1, ...) are rejected by `unsupported()` with the field named. Extension fields:
`top_k`, `ignore_eos` (as vLLM), `specrouter_chain` (pin the chain: pool model names, the
target last) and `specrouter_k` (the draft length).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from specrouter.config import MAX_DRAFT_LENGTH


class RequestError(Exception):
    """A request the server refuses, with the HTTP status and the OpenAI error fields."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param
        self.type, self.code, self.headers = type, code, headers


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def validation_error(e: ValidationError) -> RequestError:
    """The first pydantic error as a 400 naming the field (`messages.0.role`)."""
    err = e.errors()[0]
    param = ".".join(str(x) for x in err["loc"]) or None
    if err["type"] == "extra_forbidden":
        msg = (f"unsupported field '{param}': SpecRouter does not implement it, and ignoring it "
               "could change the result; remove it")
    elif err["type"] == "missing":
        msg = f"missing required field '{param}'"
    else:
        got = err.get("input")
        got = repr(got) if len(repr(got)) <= 80 else type(got).__name__
        why = err["msg"].removeprefix("Value error, ")
        msg = f"invalid value for '{param}': {why} (got {got})"
    return RequestError(msg, param=param)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False  # send a last chunk with usage and empty choices


# fields of OpenAI requests that are accepted only at their default (no effect) value
_DEFAULT_ONLY = {
    "n": (None, 1), "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
    "logprobs": (None, False), "top_logprobs": (None, 0), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}), "tools": (None, []),
    "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "parallel_tool_calls": (None, False), "response_format": (None, {"type": "text"}),
    "store": (None, False), "modalities": (None, ["text"]),
}


class _GenerationRequest(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = None  # the served model's name (see /v1/models); None: that model
    max_tokens: int | None = Field(None, ge=1)  # tokens to generate; default depends on the endpoint
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # OpenAI's default; 0 = greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # extension (vLLM): 0 or -1 disables it
    stop: Any = None  # a string or a list of up to 16 strings (checked in stop_strings())
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, not used
    ignore_eos: bool = False  # extension (vLLM): keep generating past EOS
    specrouter_chain: list[str] | None = None  # extension: pin the chain (pool names, target last)
    specrouter_k: int | None = Field(None, ge=1, le=MAX_DRAFT_LENGTH)  # extension: draft length
    # accepted only at their default value (see unsupported())
    n: int | None = None
    logprobs: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None

    def unsupported(self) -> RequestError | None:
        """A 400 for the first field set to a value SpecRouter does not implement."""
        for name in self.model_fields_set:
            allowed = _DEFAULT_ONLY.get(name)
            if allowed is None:
                continue
            value = getattr(self, name)
            if not any(value == a and type(value) is type(a) or value is a for a in allowed):
                what = {"n": "only n=1 is supported (send several requests)"}.get(
                    name, f"only its default value {allowed[-1]!r} (or null) is supported")
                return RequestError(f"unsupported value {value!r} for '{name}': {what}", param=name)
        return None

    def stop_strings(self) -> list[str]:
        stop = self.stop
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)
                and len(stop) <= 16):
            raise RequestError("'stop' must be a non-empty string or a list of at most 16 "
                               "non-empty strings", param="stop")
        return list(dict.fromkeys(stop))


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions."""

    prompt: Any  # a string, a list of token ids, or a list holding one of those
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None

    def prompt_value(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one
        elif isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
            raise RequestError(f"'prompt' holds {len(p)} prompts; this server takes one prompt "
                               "per request: send several requests", param="prompt")
        if isinstance(p, str):
            return p
        if isinstance(p, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            return list(p)
        raise RequestError("'prompt' must be a string, a list of token ids, or a list holding "
                           "one of those", param="prompt")


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Any  # a string, or a list of {"type": "text", "text": ...} parts
    name: str | None = None  # accepted, not rendered (chat templates do not take it)

    @field_validator("content")
    @classmethod
    def _text_only(cls, v):
        if isinstance(v, str):
            return v
        if isinstance(v, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            and set(p) == {"type", "text"} for p in v
        ):
            return "".join(p["text"] for p in v)
        raise ValueError("content must be a string or a list of text parts "
                         "{\"type\": \"text\", \"text\": ...}; other content is not supported")

    def text(self) -> str:
        return self.content


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: Any = None
    functions: list | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None
    store: bool | None = None
    modalities: list[str] | None = None
    metadata: dict[str, str] | None = None  # accepted, not used

    def template_messages(self) -> list[dict]:
        """Messages for the chat template ("developer" is OpenAI's newer name of "system")."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]


# -- responses -------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    specrouter: dict | None = None  # the request's stats: chains, acceptance, tokens/s


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: dict[str, str]  # {"role": "assistant"} first, then {"content": ...}, {} last
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specrouter"
    specrouter: dict | None = None  # pool: models cheapest first, target, failed models


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
