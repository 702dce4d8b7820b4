"""Structured output on the OpenAI surface (docs/structured-output.md): a request's
`response_format` (OpenAI) or vLLM's `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar` become the row's `GrammarSpec` (decoding/grammar.py). A malformed field is a
400 naming it; a schema that does not compile is a 400 from `prepare` (GrammarError).

- `{"type": "text"}` or null: no constraint;
- `{"type": "json_object"}`: any JSON object;
- `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`: the
  schema (strict or not, the output always follows it: llguidance enforces the schema);
- `guided_json` (a schema, object or text), `guided_regex` (a regex), `guided_choice` (a list
  of strings: exactly one of them), `guided_grammar` (a Lark grammar, llguidance's dialect);
- llama-server's `json_schema` (a schema object), `grammar` (a GBNF grammar, converted to
  Lark by llguidance's `gbnf_to_lark`) and `response_format` `{"type": "json_object",
  "schema": {...}}` (the schema).
At most one of them per request; a tool_choice "required" or naming a function constrains the
output too (server/tools.py: `tool_grammar`), so it excludes them as well.
"""

from __future__ import annotations

import json
import re

from specrouter.decoding.grammar import GrammarError, GrammarSpec
from specrouter.server.protocol import RequestError
from specrouter.server.tools import tool_grammar, tool_request

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "json_schema", "grammar")
_META = set("\\.^$|?*+()[]{}/")


def literal_regex(text: str) -> str:
    """A regex matching exactly `text` (only regex metacharacters escaped)."""
    return "".join("\\" + c if c in _META else c for c in text)


def _spec_of_response_format(rf) -> GrammarSpec | None:
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise RequestError("'response_format' must be an object with a 'type': \"text\", "
                           "\"json_object\" or \"json_schema\"", param="response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        schema = rf.get("schema")  # llama-server: a schema here constrains to it
        if schema is None:
            return GrammarSpec("json_object")
        if not isinstance(schema, dict):
            raise RequestError("'response_format.schema' must be a JSON schema object", param="response_format.schema")
        return GrammarSpec.json_schema(schema)
    if kind != "json_schema":
        raise RequestError(f"unsupported 'response_format.type' {kind!r}: \"text\", \"json_object\" "
                           "or \"json_schema\"", param="response_format.type")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise RequestError("'response_format.json_schema' must be an object with 'name' and "
                           "'schema'", param="response_format.json_schema")
    name = js.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise RequestError("'response_format.json_schema.name' must be 1-64 letters, digits, '_' or "
                           "'-'", param="response_format.json_schema.name")
    schema = js.get("schema")
    if schema is None:
        return GrammarSpec("json_object")  # OpenAI: a schema-less json_schema is any JSON object
    if not isinstance(schema, dict):
        raise RequestError("'response_format.json_schema.schema' must be a JSON schema object",
                           param="response_format.json_schema.schema")
    return GrammarSpec.json_schema(schema)


def _spec_of_guided(name: str, value) -> GrammarSpec:
    if name in ("guided_json", "json_schema"):
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise RequestError(f"'{name}' is not valid JSON: {e}", param=name) from None
        if not isinstance(value, dict):
            raise RequestError(f"'{name}' must be a JSON schema (an object or its JSON text)", param=name)
        return GrammarSpec.json_schema(value)
    if name == "guided_choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise RequestError("'guided_choice' must be a non-empty list of non-empty strings", param=name)
        return GrammarSpec("regex", "|".join(f"({literal_regex(c)})" for c in value))
    if not isinstance(value, str) or not value.strip():
        raise RequestError(f"'{name}' must be a non-empty string", param=name)
    if name == "grammar":  # llama-server's GBNF
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            return GrammarSpec("lark", gbnf_to_lark(value))
        except Exception as e:  # noqa: BLE001 - GbnfToLarkError and the parser's own errors
            raise RequestError(f"invalid GBNF grammar: {e}", param=name) from None
    return GrammarSpec("regex" if name == "guided_regex" else "lark", value)


def grammar_of_request(req) -> tuple[GrammarSpec | None, str | None]:
    """The request's GrammarSpec and the field it came from (None, None: unconstrained)."""
    given = [n for n in ("response_format", *_GUIDED) if getattr(req, n, None) is not None]
    tools = tool_grammar(tool_request(req))
    if tools is not None:
        given.insert(0, "tool_choice")
    if len(given) > 1:
        raise RequestError(f"{' and '.join(repr(n) for n in given)} both constrain the output: "
                           "give one of them", param=given[1])
    if not given:
        return None, None
    name = given[0]
    if tools is not None:
        return tools, "tools"  # a schema that does not compile is a 400 naming 'tools'
    value = getattr(req, name)
    try:
        spec = _spec_of_response_format(value) if name == "response_format" else _spec_of_guided(name, value)
    except GrammarError as e:
        raise RequestError(str(e), param=name) from None
    return spec, name
