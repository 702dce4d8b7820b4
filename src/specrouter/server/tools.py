"""Tool calling on the OpenAI surface (issue 30; docs/structured-output.md, "Tool calls").

The format is Hermes' (vLLM's `hermes` tool parser, Qwen2.5's chat template), rendered into the
messages for ANY chat template, so a model whose template knows nothing of tools (SmolLM2's)
still sees them in one documented format:
- the tools: a system-prompt section listing each `{"type": "function", "function": {...}}`
  inside `<tools></tools>`, appended to the first system message (or a new first one);
- a call the model makes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
  an assistant message's `tool_calls` in the history are rendered the same way;
- a `tool` message (a call's result): a user turn `<tool_response>\\n...\\n</tool_response>`
  (consecutive results share one turn).

`tool_choice`:
- "none" (the default without tools): tools are not rendered, nothing is parsed;
- "auto" (the default with tools): the model writes freely; `<tool_call>` blocks naming a tool
  become `message.tool_calls` (`ToolCallParser`), the text before the first one is the content;
- "required" / `{"type": "function", "function": {"name": ...}}`: the output is constrained by a
  grammar (`tool_grammar`) to tool-call blocks of the allowed tools whose arguments match each
  function's `parameters` schema (one block, or several when `parallel_tool_calls`).
A response with calls has `finish_reason` "tool_calls" (when generation ended by itself); a
stream sends each call as OpenAI does: a delta with its index, id, type and name, then
`arguments` deltas as the text arrives. The non-streamed answer is the streamed deltas put
together (the same parser), so both are identical by construction.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from specrouter.decoding.grammar import JSON_OPTIONS, GrammarSpec
from specrouter.server.protocol import RequestError

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
# `{"name": "f", "arguments": ` (or "parameters"), up to the first character of the arguments
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')

SYSTEM_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict  # the JSON schema of the arguments (an object)


@dataclass(frozen=True)
class ToolRequest:
    """A request's tools and what it asks of them (`tool_request`)."""

    tools: tuple[Tool, ...]
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None = None  # the function tool_choice names
    parallel: bool = True  # parallel_tool_calls: several calls allowed (required / named)

    @property
    def rendered(self) -> bool:
        """The tools are written into the prompt and the output is parsed for calls."""
        return bool(self.tools) and self.choice != "none"

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tools)


# -- the request ------------------------------------------------------------------------------
def _tool(i: int, t) -> Tool:
    where = f"tools.{i}"
    if not isinstance(t, dict) or t.get("type") != "function":
        raise RequestError(f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}} "
                           "(only function tools exist)", param=f"{where}.type")
    fn = t.get("function")
    if not isinstance(fn, dict):
        raise RequestError(f"'{where}.function' must be an object with a 'name'", param=f"{where}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise RequestError(f"'{where}.function.name' must be 1-64 letters, digits, '_' or '-', got "
                           f"{name!r}", param=f"{where}.function.name")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise RequestError(f"'{where}.function.description' must be a string", param=f"{where}.function.description")
    params = fn.get("parameters")
    if params is None:
        params = _EMPTY_PARAMETERS
    if not isinstance(params, dict):
        raise RequestError(f"'{where}.function.parameters' must be a JSON schema object",
                           param=f"{where}.function.parameters")
    return Tool(name, desc, params)


def tool_request(req) -> ToolRequest:
    """The request's tools and tool_choice, checked (a 400 naming the field otherwise)."""
    raw = getattr(req, "tools", None)
    if raw is not None and not isinstance(raw, list):
        raise RequestError("'tools' must be a list of function tools", param="tools")
    tools = tuple(_tool(i, t) for i, t in enumerate(raw or []))
    names = [t.name for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise RequestError(f"'tools' names the function {dup!r} twice", param="tools")
    choice = getattr(req, "tool_choice", None)
    parallel = getattr(req, "parallel_tool_calls", True)
    if choice is None:
        return ToolRequest(tools, "auto" if tools else "none", parallel=parallel)
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise RequestError("'tool_choice' \"required\" needs 'tools'", param="tool_choice")
        return ToolRequest(tools, choice, parallel=parallel)
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": "
                           "\"function\", \"function\": {\"name\": ...}}", param="tool_choice")
    if fn["name"] not in names:
        raise RequestError(f"'tool_choice' names the function {fn['name']!r}, which is not in "
                           f"'tools' ({', '.join(names) or 'none given'})", param="tool_choice")
    return ToolRequest(tools, "named", fn["name"], parallel)


_SUBSCHEMAS = ("items", "additionalItems", "not", "if", "then", "else", "contains")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def closed_schema(schema):
    """`schema` with `additionalProperties: false` wherever an object lists `properties` and
    says nothing of others: a function's arguments are its parameters, as vLLM's xgrammar
    backend reads a schema (strict mode). (An open object lets a small model invent keys until
    max_tokens; LangChain's tools and many clients' schemas leave it unsaid.)"""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in _SUBSCHEMAS:
        if k in out:
            out[k] = closed_schema(out[k])
    for k in _SCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [closed_schema(v) for v in out[k]]
    for k in _SCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {n: closed_schema(v) for n, v in out[k].items()}
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def tool_grammar(tr: ToolRequest) -> GrammarSpec | None:
    """The grammar of a required / named tool choice (a Lark grammar with one JSON schema per
    allowed function: `{"name": <const>, "arguments": <its parameters, closed_schema>}` written
    as json.dumps writes it), or None when the output is free."""
    if not tr.constrained:
        return None
    allowed = [t for t in tr.tools if tr.choice == "required" or t.name == tr.named]
    rules = []
    for i, t in enumerate(allowed):
        schema = {"type": "object", "properties": {"name": {"const": t.name}, "arguments": closed_schema(t.parameters)},
                  "required": ["name", "arguments"], "additionalProperties": False,
                  "x-guidance": JSON_OPTIONS}
        rules.append(f"fn{i}: %json {json.dumps(schema)}")
    call = f'call: "{CALL_OPEN}\\n" ({" | ".join(f"fn{i}" for i in range(len(allowed)))}) "\\n{CALL_CLOSE}"'
    start = 'start: call ("\\n" call)*' if tr.parallel else "start: call"
    return GrammarSpec("lark", "\n".join([start, call, *rules]) + "\n")


# -- the prompt -------------------------------------------------------------------------------
def _call_text(i: int, j: int, call) -> str:
    where = f"messages.{i}.tool_calls.{j}"
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError(f"'{where}' must be {{\"id\", \"type\": \"function\", \"function\": "
                           "{\"name\", \"arguments\"}}", param=where)
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise RequestError(f"'{where}.function.arguments' is not valid JSON", param=f"{where}.function.arguments") from None
    return f"{CALL_OPEN}\n{json.dumps({'name': fn['name'], 'arguments': args}, ensure_ascii=False)}\n{CALL_CLOSE}"


def chat_messages(messages, tr: ToolRequest | None = None) -> list[dict]:
    """The request's messages as the chat template takes them ({"role", "content"} strings),
    with the tools, calls and results rendered in the Hermes format (module docstring);
    "developer" is OpenAI's newer name of "system"."""
    out: list[dict] = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        text = m.text()
        if m.tool_calls is not None:
            if role != "assistant" or not isinstance(m.tool_calls, list):
                raise RequestError("'tool_calls' must be a list, in an assistant message",
                                   param=f"messages.{i}.tool_calls")
            calls = "\n".join(_call_text(i, j, c) for j, c in enumerate(m.tool_calls))
            text = f"{text}\n{calls}" if text else calls
        if role == "tool":
            if not any(o["role"] == "assistant" and CALL_OPEN in o["content"] for o in out):
                raise RequestError(f"messages.{i}: a 'tool' message must follow an assistant "
                                   "message with 'tool_calls'", param=f"messages.{i}.role")
            result = f"<tool_response>\n{text}\n</tool_response>"
            if out and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + result
                continue
            out.append({"role": "user", "content": result, "_tool": True})
            continue
        out.append({"role": role, "content": text})
    if tr is not None and tr.rendered:
        listing = "\n".join(json.dumps({"type": "function", "function": {
            "name": t.name, **({"description": t.description} if t.description else {}),
            "parameters": t.parameters}}, ensure_ascii=False) for t in tr.tools)
        section = SYSTEM_PROMPT.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{section}" if out[0]["content"] else section
        else:
            out.insert(0, {"role": "system", "content": section})
    return [{"role": o["role"], "content": o["content"]} for o in out]


# -- the output -------------------------------------------------------------------------------
class ToolCallParser:
    """The model's text, delta by delta, as OpenAI chat deltas: `{"content": ...}` before the
    first `<tool_call>`, then per call `{"tool_calls": [{"index", "id", "type", "function":
    {"name", "arguments": ""}}]}` and `{"tool_calls": [{"index", "function": {"arguments"}}]}`
    pieces. A block that does not name one of the tools is skipped; if no call was made at all,
    the text from the first `<tool_call>` on is content after all (sent at `finish`)."""

    def __init__(self, names: tuple[str, ...]):
        self.names = set(names)
        self.text = ""
        self.pos = 0  # text before pos is handled
        self.args_start = 0  # where the current call's arguments begin
        self.state = "content"  # content | header | args | tail
        self.first_open: int | None = None
        self.calls: list[dict] = []  # {"id", "type", "function": {"name", "arguments"}}
        self.content = ""

    def feed(self, delta: str) -> list[dict]:
        self.text += delta
        out: list[dict] = []
        while True:
            step = getattr(self, "_" + self.state)(out)
            if not step:
                return out

    def finish(self) -> list[dict]:
        """Deltas for what was held back, once the text is complete."""
        out: list[dict] = []
        t = self.text
        if self.state == "content" and self.first_open is None:
            self._emit_content(out, t[self.pos:])
        elif self.state == "header":
            block = t[self.pos:]
            self._fallback(out, block)
        elif self.state == "args":
            self._emit_args(out, t[self.pos:])
        self.pos, self.state = len(t), "done"
        if not self.calls and self.first_open is not None:
            self._emit_content(out, t[self.first_open:])
        return out

    def _emit_content(self, out: list[dict], text: str) -> None:
        if text:
            self.content += text
            out.append({"content": text})

    def _emit_args(self, out: list[dict], text: str) -> None:
        if text:
            self.calls[-1]["function"]["arguments"] += text
            out.append({"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": text}}]})

    def _new_call(self, out: list[dict], name: str, arguments: str = "") -> None:
        call = {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                "function": {"name": name, "arguments": ""}}
        self.calls.append(call)
        out.append({"tool_calls": [{"index": len(self.calls) - 1, **call,
                                    "function": {"name": name, "arguments": ""}}]})
        self._emit_args(out, arguments)

    # states: each returns True when it moved on (run the next state at once)
    def _content(self, out: list[dict]) -> bool:
        t = self.text
        i = t.find(CALL_OPEN, self.pos)
        if i >= 0:
            if self.first_open is None:
                self.first_open = i
                self._emit_content(out, t[self.pos:i])
            self.pos, self.state = i + len(CALL_OPEN), "header"
            return True
        if self.first_open is not None:
            return False  # between or after calls: text there is not content
        hold = next((n for n in range(min(len(CALL_OPEN) - 1, len(t) - self.pos), 0, -1)
                     if t.endswith(CALL_OPEN[:n])), 0)
        self._emit_content(out, t[self.pos:len(t) - hold])
        self.pos = len(t) - hold
        return False

    def _header(self, out: list[dict]) -> bool:
        t = self.text
        m = _HEADER.match(t, self.pos)
        close = t.find(CALL_CLOSE, self.pos)
        if m is not None and (close < 0 or m.end() <= close):
            name = json.loads(m.group(1))
            if name in self.names:
                self._new_call(out, name)
                self.pos = self.args_start = m.end()
                self.state = "args"
                return True
            self.state = "tail"  # not one of the tools: skip the block
            return True
        if close >= 0:  # a block in another shape (keys in another order, ...): whole
            self._fallback(out, t[self.pos:close])
            self.pos, self.state = close + len(CALL_CLOSE), "content"
            return True
        return False

    def _fallback(self, out: list[dict], block: str) -> None:
        try:
            obj, _ = json.JSONDecoder().raw_decode(block.strip())
        except ValueError:
            return
        if not isinstance(obj, dict) or obj.get("name") not in self.names:
            return
        args = obj.get("arguments", obj.get("parameters", {}))
        self._new_call(out, obj["name"], json.dumps(args, ensure_ascii=False))

    def _args(self, out: list[dict]) -> bool:
        t = self.text
        try:
            _, end = json.JSONDecoder().raw_decode(t, self.args_start)
        except ValueError:  # not complete yet: all of it is part of the arguments
            self._emit_args(out, t[self.pos:])
            self.pos = len(t)
            return False
        self._emit_args(out, t[self.pos:end])
        self.pos, self.state = end, "tail"
        return True

    def _tail(self, out: list[dict]) -> bool:
        close = self.text.find(CALL_CLOSE, self.pos)
        if close < 0:
            return False
        self.pos, self.state = close + len(CALL_CLOSE), "content"
        return True


def message_of(text: str, finish: str | None, tr: ToolRequest | None) -> tuple[dict, str | None]:
    """A whole response's message fields ({"content", "tool_calls"}) and finish reason."""
    if tr is None or not tr.rendered:
        return {"content": text}, finish
    p = ToolCallParser(tr.names)
    p.feed(text)
    p.finish()
    return finish_message(p, finish)


def finish_message(p: ToolCallParser, finish: str | None) -> tuple[dict, str | None]:
    if not p.calls:
        return {"content": p.content}, finish
    return ({"content": p.content if p.content.strip() else None, "tool_calls": p.calls},
            "tool_calls" if finish == "stop" else finish)
