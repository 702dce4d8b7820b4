"""OpenAI wire format: request models (lenient like vLLM) and response models.

How a request field is treated (docs/openai-compatibility.md has the table per field):
- honoured: declared here and acted on (sampling controls, stop, seed, logprobs, n, ...);
- explicit `null` is the field's default (OpenAI and vLLM do the same);
- recognised but not implemented (legacy `functions`, beam search, ...): accepted at their
  default value, a 400 naming the field otherwise (`unsupported()`);
- unknown: accepted and ignored, named in the response header `X-SpecRouter-Ignored-Fields`
  and in a log line (`ignored_fields()`), as vLLM and llama-server accept what they do not know
  (LiteLLM pass-through, Open WebUI's settings, llama-server's `cache_prompt`).
Types of declared fields stay strict (no "10" -> 10). Extension fields: vLLM's sampling
extras (`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `stop_token_ids`, ...),
`specrouter_chain` (pin the chain: pool model names, the target last) and `specrouter_k`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from specrouter.config import MAX_DRAFT_LENGTH

IGNORED_FIELDS_HEADER = "X-SpecRouter-Ignored-Fields"
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs (completions' logprobs: 5; vLLM allows 20)
MAX_N = 16  # rows one request may ask for (n, best_of)


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
        msg = f"unsupported field '{param}'"
    elif err["type"] == "missing":
        msg = f"missing required field '{param}'"
    else:
        got = err.get("input")
        got = repr(got) if len(repr(got)) <= 80 else type(got).__name__
        why = err["msg"].removeprefix("Value error, ")
        msg = f"invalid value for '{param}': {why} (got {got})"
    return RequestError(msg, param=param)


def _drop_nulls(data):
    """Explicit null = the default: top-level keys whose value is null are removed."""
    if isinstance(data, dict):
        return {k: v for k, v in data.items() if v is not None}
    return data


class _Lenient(BaseModel):
    """Unknown fields are kept aside (`model_extra`), null is the default, declared types are
    strict."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data):
        return _drop_nulls(data)

    def ignored_fields(self, prefix: str = "") -> list[str]:
        """Names of the unknown fields this request carried (sorted), nested ones dotted."""
        names = [prefix + k for k in (self.model_extra or {})]
        for name in self.model_fields_set:
            value = getattr(self, name)
            items = value if isinstance(value, list) else [value]
            for i, v in enumerate(items):
                if isinstance(v, _Lenient):
                    sub = f"{prefix}{name}.{i}." if isinstance(value, list) else f"{prefix}{name}."
                    names += v.ignored_fields(sub)
        return sorted(names)


class StreamOptions(_Lenient):
    include_usage: bool = False  # send a last chunk with usage and empty choices (usage only there)
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk (not implemented: 400)


# Fields SpecRouter recognises but does not implement: accepted only at these (no-effect)
# values; anything else is a 400 naming the field and saying why.
_NOT_IMPLEMENTED: dict[str, tuple[tuple, str]] = {
    "suffix": (("",), "insertion (suffix) is not implemented"),
    "functions": (([],), "function calling is not implemented"),
    "function_call": (("none", "auto"), "function calling is not implemented"),
    "store": ((False,), "stored completions are not implemented"),
    "modalities": ((["text"],), "only text output is implemented"),
    "audio": ((), "audio output is not implemented"),
    "prediction": ((), "predicted outputs are not implemented"),
    "web_search_options": ((), "web search is not implemented"),
    "reasoning_effort": ((), "reasoning effort is not implemented"),
    "service_tier": (("auto", "default"), "service tiers are not implemented"),
    "use_beam_search": ((False,), "beam search is not implemented"),
    "length_penalty": ((1.0, 1), "length_penalty applies to beam search, which is not implemented"),
    "include_stop_str_in_output": ((False,), "stop strings are never included in the output"),
    "skip_special_tokens": ((True,), "special tokens are always skipped in the text"),
    "spaces_between_special_tokens": ((True,), "special tokens are always skipped in the text"),
    "bad_words": (([],), "bad_words is not implemented (use logit_bias for single tokens)"),
    "prompt_embeds": ((), "prompt embeddings are not implemented"),
    "structural_tag": ((), "structural tags are not implemented (response_format, guided_* or "
                           "tools constrain the output)"),
    "guided_decoding_backend": ((), "the grammar engine is llguidance; no other backend is offered"),
    "guided_whitespace_pattern": ((), "JSON is written as json.dumps writes it (no free "
                                      "whitespace); a whitespace pattern is not implemented"),
    "priority": ((0,), "priority scheduling is not implemented"),
    "logits_processors": (([],), "custom logits processors are not accepted"),
    "chat_template": ((), "a per-request chat template is not accepted (start the server with "
                          "--chat-template FILE)"),
    "mm_processor_kwargs": (({},), "multimodal input is not implemented"),
    "kv_transfer_params": (({},), "disaggregated serving is not implemented"),
    "vllm_xargs": (({},), "vLLM extension arguments are not implemented"),
    "continue_final_message": ((False,), "continuing the final message is not implemented"),
    "documents": (([],), "documents (RAG templates) are not implemented"),
}

# Honoured sampling controls not yet wired into the engine are refused like the above until
# they are (they move to honoured in one place: here).
_NOT_YET: dict[str, tuple[tuple, str]] = {}


def _is_default(value, allowed: tuple) -> bool:
    return any(value == a and type(value) is type(a) for a in allowed)


class _GenerationRequest(_Lenient):
    """Fields shared by completions and chat completions (vLLM's names and defaults)."""

    model: str | None = None  # a served model name (see /v1/models); None: the served model
    max_tokens: int | None = Field(None, ge=1)  # tokens to generate; default depends on the endpoint
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # OpenAI's default; 0 = greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # vLLM: 0 or -1 disables it
    min_p: float = Field(0.0, ge=0.0, le=1.0)  # vLLM: drop tokens below min_p * the top probability
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)  # OpenAI: over generated tokens
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)  # OpenAI: over generated tokens
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)  # vLLM / CTRL: over prompt + generated
    logit_bias: dict[str, float] = Field(default_factory=dict)  # token id (as a string) -> bias
    stop: Any = None  # a string or a list of up to 16 strings (checked in stop_strings())
    stop_token_ids: list[int] = Field(default_factory=list)  # vLLM: token ids that end generation
    min_tokens: int = Field(0, ge=0)  # vLLM: EOS / stop tokens are masked before this many tokens
    allowed_token_ids: list[int] | None = None  # vLLM: sample only among these token ids
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, not used
    ignore_eos: bool = False  # vLLM: keep generating past EOS
    n: int = Field(1, ge=1, le=MAX_N)
    truncate_prompt_tokens: int | None = Field(None, ge=1)  # vLLM: keep the last N prompt tokens
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # vLLM: the prompt's, n alternatives
    request_id: str | None = None  # vLLM: accepted (the response id is the server's own)
    cache_salt: str | None = None  # vLLM: accepted; no cache is shared between requests' prompts
    specrouter_chain: list[str] | None = None  # extension: pin the chain (pool names, target last)
    specrouter_k: int | None = Field(None, ge=1, le=MAX_DRAFT_LENGTH)  # extension: draft length
    # structured output (server/structured.py): OpenAI's response_format, vLLM's guided_*,
    # llama-server's json_schema and grammar (GBNF)
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    json_schema: Any = None
    grammar: Any = None
    # recognised, refused unless at their default (see _NOT_IMPLEMENTED)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    priority: int = 0
    logits_processors: list | None = None
    return_tokens_as_token_ids: bool = False  # vLLM: logprobs name tokens "token_id:{id}"
    kv_transfer_params: dict | None = None
    vllm_xargs: dict | None = None

    def unsupported(self) -> RequestError | None:
        """A 400 for the first field (sorted by name) set to a value SpecRouter does not
        implement."""
        for name in sorted(self.model_fields_set):
            rule = _NOT_IMPLEMENTED.get(name) or _NOT_YET.get(name)
            if rule is None:
                continue
            allowed, why = rule
            value = getattr(self, name)
            if not _is_default(value, allowed):
                default = f" (only {allowed[0]!r} or null is accepted)" if allowed else ""
                return RequestError(f"unsupported value {_short(value)} for '{name}': {why}"
                                    f"{default}", param=name)
        best_of = self.rows()
        if best_of < self.n:
            return RequestError(f"'best_of' ({best_of}) must be at least 'n' ({self.n})",
                                param="best_of")
        if best_of > self.n and self.stream:
            return RequestError(f"'best_of' ({best_of}) over 'n' ({self.n}) cannot be streamed: "
                                "the best rows are known only at the end", param="best_of")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            return RequestError("unsupported value True for 'stream_options."
                                "continuous_usage_stats': usage is sent once, on the last chunk",
                                param="stream_options.continuous_usage_stats")
        return None

    def rows(self) -> int:
        """Rows the request runs: best_of when sent (default: n)."""
        return self.best_of if "best_of" in self.model_fields_set else self.n

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

    def logit_bias_ids(self) -> dict[int, float]:
        """logit_bias with integer keys (OpenAI sends token ids as JSON object keys)."""
        out = {}
        for key, bias in self.logit_bias.items():
            if not key.lstrip("-").isdigit():
                raise RequestError(f"'logit_bias' keys must be token ids, got {key!r}",
                                   param="logit_bias")
            if not -100.0 <= bias <= 100.0:
                raise RequestError(f"'logit_bias' values must be in [-100, 100], got {bias!r} "
                                   f"for token {key}", param="logit_bias")
            out[int(key)] = float(bias)
        return out


def _short(value) -> str:
    r = repr(value)
    return r if len(r) <= 80 else type(value).__name__


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions."""

    prompt: Any  # a string, a list of token ids, or a list holding one of those
    best_of: int = Field(1, ge=1, le=MAX_N)
    echo: bool = False  # the prompt before the completion (with its logprobs when `logprobs` is set)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # each token's logprob + n alternatives
    suffix: str = ""
    add_special_tokens: bool = False  # vLLM's default is true; this server's prompts are text as sent
    prompt_embeds: Any = None

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


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any  # a string, or a list of {"type": "text", "text": ...} parts ("" when an
    # assistant message with tool_calls leaves it out or null)
    name: str | None = None  # accepted, not rendered (chat templates do not take it)
    tool_calls: Any = None  # assistant: the calls it made (checked in server/tools.py)
    tool_call_id: str | None = None  # tool: the call this message answers

    @model_validator(mode="before")
    @classmethod
    def _calls_without_content(cls, data):
        data = _drop_nulls(data)
        if isinstance(data, dict) and data.get("role") == "assistant" and data.get("tool_calls"):
            data.setdefault("content", "")
        return data

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
    logprobs: bool = False  # each generated token's logprob (choices[i].logprobs.content)
    top_logprobs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)  # alternatives per token (needs logprobs)
    best_of: int = Field(1, ge=1, le=MAX_N)
    echo: bool = False  # vLLM: prepend the last message of the same role (not implemented)
    add_generation_prompt: bool = True  # vLLM: passed to the chat template
    add_special_tokens: bool = False  # vLLM: add BOS etc. on top of the template's
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)  # extra template variables
    include_reasoning: bool = True  # vLLM: no reasoning parser runs, so nothing is removed
    parallel_tool_calls: bool = True  # tool_choice required / named: several calls allowed
    metadata: dict[str, str] | None = None  # accepted, not used
    # tool calling (server/tools.py): OpenAI's tools and tool_choice
    tools: Any = None
    tool_choice: Any = None
    # recognised, refused unless at their default (see _NOT_IMPLEMENTED)
    functions: list | None = None
    function_call: Any = None
    store: bool = False
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    service_tier: str | None = None
    bad_words: list[str] = Field(default_factory=list)
    structural_tag: Any = None
    chat_template: str | None = None
    mm_processor_kwargs: dict | None = None
    continue_final_message: bool = False
    documents: list | None = None

    def unsupported(self) -> RequestError | None:
        if self.top_logprobs and not self.logprobs:
            return RequestError(f"'top_logprobs' ({self.top_logprobs}) needs 'logprobs': true",
                                param="top_logprobs")
        if self.echo:
            return RequestError("unsupported value True for 'echo': echoing the last message is "
                                "not implemented (only False or null is accepted)", param="echo")
        return super().unsupported()


# -- responses -------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # OpenAI's {"cached_tokens": n}: prompt tokens taken from the prefix cache (not recomputed)
    prompt_tokens_details: dict | None = None
    specrouter: dict | None = None  # the request's stats: chains, acceptance, tokens/s


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions logprobs, one entry per token (server/logprobs.py)."""

    text_offset: list[int] = Field(default_factory=list)  # where each token's text starts in `text`
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: the prompt's first token
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)  # n best + the token


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    # vLLM's prompt_logprobs: per prompt token (None for the first) {token id: {logprob, rank, decoded_token}}
    prompt_logprobs: list[dict[str, dict] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None when the message is only tool calls
    # [{"id", "type": "function", "function": {"name", "arguments"}}]; left out when none
    tool_calls: list[dict] | None = Field(None, exclude_if=lambda v: v is None)


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    prompt_logprobs: list[dict[str, dict] | None] | None = None  # vLLM's, as in CompletionChoice


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: dict[str, Any]  # {"role": "assistant"} first, then {"content": ...} or
    # {"tool_calls": [...]} (server/tools.py), {} last
    logprobs: ChatLogprobs | None = None  # of the tokens since the last chunk
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
