"""Tool calling (issue 30, item 3): tools / tool_choice / the `tool` role / assistant tool_calls,
with the official `openai` client against a live server on 127.0.0.1 (tiny float64 pool), and
the Hermes-format parser (server/tools.py) on its own:

- tool_choice named / required: the answer's tool_calls equal the plain constrained decoding of
  the target on the rendered prompt (greedy), their arguments validate against the function's
  schema, finish_reason is "tool_calls"; streamed deltas put together equal the whole answer;
- auto / none: equal to plain unconstrained decoding with / without the tools rendered;
- an agent loop: call -> tool result message -> final answer;
- malformed tools, tool_choice and history: a 400 naming the field.
"""

import json
from typing import Literal

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from pydantic import BaseModel, Field  # noqa: E402

from specrouter.config import SamplingParams  # noqa: E402
from specrouter.engine.engine import Engine  # noqa: E402
from specrouter.models.pool import Pool  # noqa: E402
from specrouter.models.tokenizer import apply_chat_template  # noqa: E402
from specrouter.server import ServerConfig, create_app  # noqa: E402
from specrouter.server.live import LiveServer  # noqa: E402
from specrouter.server.protocol import ChatCompletionRequest  # noqa: E402
from specrouter.server.tools import (  # noqa: E402
    Tool,
    ToolCallParser,
    ToolRequest,
    chat_messages,
    closed_schema,
    message_of,
    tool_grammar,
    tool_request,
)

KEY = "test-key-tools"


class Weather(BaseModel):
    city: str = Field(max_length=8)  # a random tiny model would write on
    unit: Literal["celsius", "fahrenheit"]


class Add(BaseModel):
    a: int = Field(ge=0, le=999)
    b: int = Field(ge=0, le=999)


def fn(name, model, desc="") -> dict:
    return {"type": "function", "function": {"name": name, "description": desc,
                                             "parameters": model.model_json_schema()}}


TOOLS = [fn("get_weather", Weather, "The weather in a city"), fn("add", Add, "Add two integers")]
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def pool_dirs(tmp_path_factory):
    """A tiny float64 target and draft with room for the tools' system prompt (~900 tokens of
    the tiny tokenizer)."""
    from fixtures import make_tiny_llama

    root, d = tmp_path_factory.mktemp("tools"), torch.float64
    target = make_tiny_llama(root / "target", hidden_size=64, num_layers=3, seed=1, dtype=d,
                             tie_word_embeddings=False, max_position_embeddings=2048)
    draft = make_tiny_llama(root / "draft", hidden_size=64, num_layers=3, seed=3, init_from=target,
                            noise=0.4, dtype=d, tie_word_embeddings=False, max_position_embeddings=2048)
    return {"target": target, "draft": draft}


def load_pool(dirs):
    return Pool.load([dirs["draft"], dirs["target"]], names=["draft", "target"], target="target",
                     dtype="float64")


@pytest.fixture(scope="module")
def pool(pool_dirs):
    return load_pool(pool_dirs)


@pytest.fixture(scope="module")
def server(pool_dirs):
    app = create_app(load_pool(pool_dirs), ServerConfig(api_key=KEY, chain=("ngram", "draft", "target"),
                                                       k=3, max_num_seqs=4, max_model_len=2048))
    with LiveServer(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)


def plain(pool, body: dict, n: int):
    """The target's plain decoding (greedy, no speculation) of the request `body` as the server
    renders and constrains it: (message fields, finish_reason)."""
    req = ChatCompletionRequest.model_validate({"messages": body["messages"], **{
        k: body[k] for k in ("tools", "tool_choice", "parallel_tool_calls") if k in body}})
    tr = tool_request(req)
    ids = apply_chat_template(pool.tokenizer, chat_messages(req.messages, tr))
    seq = Engine(pool).generate_ids([ids], [SamplingParams(max_new_tokens=n, grammar=tool_grammar(tr))],
                                    chain=("target",))[0]
    text = pool.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
    finish = seq.finish_reason if seq.finish_reason in ("stop", "grammar") else "length"
    return message_of(text, finish, tr)


def calls_of(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def streamed(client, **kw):
    """The stream's content, tool calls (put together by index) and finish reason."""
    content, calls, finish, ids = "", {}, None, set()
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            d = ch.delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                c = calls.setdefault(tc.index, ["", ""])
                if tc.id:
                    ids.add(tc.id)
                if tc.function and tc.function.name:
                    c[0] += tc.function.name
                if tc.function and tc.function.arguments:
                    c[1] += tc.function.arguments
            finish = ch.finish_reason or finish
    assert len(ids) == len(calls)  # one id per call, on its first delta
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


# -- the parser on its own ----------------------------------------------------------------------
TEXT = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "celsius", "x": [1, {"a": "}"}]}}\n</tool_call>\n<tool_call>\n{"name": "nope", '
        '"arguments": {}}\n</tool_call><tool_call>\n{"arguments": {"a": 1, "b": 2}, "name": "add"}'
        '\n</tool_call>')
TR = ToolRequest((Tool("get_weather", None, {}), Tool("add", None, {})), "auto")


def test_parser_whole_and_streamed_agree():
    fields, finish = message_of(TEXT, "stop", TR)
    assert finish == "tool_calls" and fields["content"] == "Let me check."
    got = [(c["function"]["name"], c["function"]["arguments"]) for c in fields["tool_calls"]]
    assert got == [("get_weather", '{"city": "Paris", "unit": "celsius", "x": [1, {"a": "}"}]}'),
                   ("add", '{"a": 1, "b": 2}')]  # the unknown function's block is skipped
    for size in (1, 3, 7):
        p = ToolCallParser(TR.names)
        deltas = []
        for i in range(0, len(TEXT), size):
            deltas += p.feed(TEXT[i:i + size])
        deltas += p.finish()
        assert "".join(d.get("content", "") for d in deltas) == "Let me check."
        args = {}
        for d in deltas:
            for tc in d.get("tool_calls", []):
                args[tc["index"]] = args.get(tc["index"], "") + tc["function"]["arguments"]
        assert [args[0], args[1]] == [a for _, a in got]
        assert len([d for d in deltas if "content" in d]) > 1 or size > 5  # content is streamed


def test_parser_without_a_call_keeps_the_text():
    for text in ["hello <tool_call> junk", "hello <tool_", "plain", "<tool_call>\n{\"name\": \"nope\"}"]:
        assert message_of(text, "stop", TR) == ({"content": text}, "stop")
    assert message_of("x", "stop", ToolRequest((), "none")) == ({"content": "x"}, "stop")
    # cut by max_tokens inside the arguments: the call so far, finish "length"
    fields, finish = message_of('<tool_call>\n{"name": "add", "arguments": {"a": 1', "length", TR)
    assert finish == "length" and fields["tool_calls"][0]["function"]["arguments"] == '{"a": 1'


def test_history_renders_calls_and_results():
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "system", "content": "Be brief."}, *MSGS,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
        {"role": "tool", "tool_call_id": "call_2", "content": "sunny"}], "tools": TOOLS})
    out = chat_messages(req.messages, tool_request(req))
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools") and '"name": "add"' in out[0]["content"]
    assert out[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                                 '"unit": "celsius"}}\n</tool_call>')
    assert out[3]["content"] == "<tool_response>\n18 degrees\n</tool_response>\n<tool_response>\nsunny\n</tool_response>"
    # tool_choice none: the tools are not rendered
    req = ChatCompletionRequest.model_validate({"messages": MSGS, "tools": TOOLS, "tool_choice": "none"})
    assert chat_messages(req.messages, tool_request(req)) == MSGS


def test_tool_arguments_are_closed_objects():
    """Objects that list properties and say nothing of others get additionalProperties false
    (a small model invents keys otherwise); what a schema says is kept."""
    s = closed_schema({"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {}}},
        "c": {"type": "array", "items": {"properties": {}}},
        "d": {"anyOf": [{"properties": {}}, {"type": "null"}]}}, "$defs": {"X": {"properties": {}}}})
    assert s["additionalProperties"] is False and s["properties"]["a"]["additionalProperties"] is False
    assert s["properties"]["c"]["items"]["additionalProperties"] is False
    assert s["properties"]["d"]["anyOf"][0]["additionalProperties"] is False
    assert s["$defs"]["X"]["additionalProperties"] is False and "additionalProperties" not in s["properties"]["a"]["properties"]["b"]
    assert closed_schema({"properties": {}, "additionalProperties": True})["additionalProperties"] is True
    assert "additionalProperties" not in closed_schema({"type": "object"})


# -- over HTTP ----------------------------------------------------------------------------------
@pytest.mark.parametrize("choice", ["named", "required"])
def test_constrained_tool_call_equals_plain_constrained_decoding(client, pool, choice):
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else "required"
    body = {"messages": MSGS, "tools": TOOLS, "tool_choice": tool_choice, "parallel_tool_calls": False}
    r = client.chat.completions.create(model="target", temperature=0, max_tokens=120, **body)
    want, finish = plain(pool, body, 120)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == finish == "tool_calls"
    assert calls_of(msg) == [(c["function"]["name"], c["function"]["arguments"]) for c in want["tool_calls"]]
    assert msg.content is None and len(msg.tool_calls) == 1 and msg.tool_calls[0].id.startswith("call_")
    name, args = calls_of(msg)[0]
    if choice == "named":
        assert name == "get_weather"
    {"get_weather": Weather, "add": Add}[name].model_validate_json(args)  # validates
    content, calls, sfinish = streamed(client, model="target", temperature=0, max_tokens=120, **body)
    assert (content, calls, sfinish) == ("", calls_of(msg), "tool_calls")


def test_parallel_calls_and_n(client, pool):
    body = {"messages": MSGS, "tools": TOOLS, "tool_choice": "required"}
    r = client.chat.completions.create(model="target", temperature=0, max_tokens=200, n=2, **body)
    want, finish = plain(pool, body, 200)
    for ch in r.choices:
        assert ch.finish_reason == finish
        assert calls_of(ch.message) == [(c["function"]["name"], c["function"]["arguments"])
                                        for c in want["tool_calls"]]
        assert len(ch.message.tool_calls) >= 1


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_auto_and_none_equal_plain_decoding(client, pool, choice):
    body = {"messages": MSGS, "tools": TOOLS, "tool_choice": choice}
    r = client.chat.completions.create(model="target", temperature=0, max_tokens=40, **body)
    want, finish = plain(pool, body, 40)
    assert r.choices[0].message.content == want["content"] and r.choices[0].finish_reason == finish
    assert r.choices[0].message.tool_calls is None
    content, calls, sfinish = streamed(client, model="target", temperature=0, max_tokens=40, **body)
    assert (content, calls, sfinish) == (want["content"], [], finish)


def test_agent_loop(client):
    """call -> the tool's result -> the final answer (the tiny model's text)."""
    msgs = list(MSGS)
    r = client.chat.completions.create(model="target", temperature=0, max_tokens=120, messages=msgs,
                                       tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    call = r.choices[0].message.tool_calls[0]
    args = json.loads(call.function.arguments)
    msgs.append(r.choices[0].message.model_dump(exclude_none=True))
    msgs.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"args": args, "temp": 18})})
    final = client.chat.completions.create(model="target", temperature=0, max_tokens=20, messages=msgs,
                                           tools=TOOLS, tool_choice="none")
    assert final.choices[0].finish_reason in ("stop", "length") and final.choices[0].message.content
    assert final.choices[0].message.tool_calls is None


def test_bad_tools_get_a_400_naming_the_field(client):
    w = {"type": "function", "function": {"name": "get_weather"}}
    cases = [
        ({"tools": "get_weather"}, "tools", "list"),
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type", "function"),
        ({"tools": [{"type": "function"}]}, "tools.0.function", "name"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name", "letters"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
         "tools.0.function.parameters", "schema"),
        ({"tools": [w, w]}, "tools", "twice"),
        ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "required"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format", "give one"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
          "tool_choice": "required"}, "tools", "objekt"),
        ({"messages": [{"role": "tool", "content": "18", "tool_call_id": "x"}]}, "messages.0.role", "tool_calls"),
        ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "messages.0.tool_calls", "assistant"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]},
         "messages.0.tool_calls.0.function.arguments", "JSON"),
        ({"messages": [{"role": "assistant"}]}, "messages.0.content", "missing"),
    ]
    for extra, param, words in cases:
        body = {"messages": MSGS, **extra}
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="target", max_tokens=5, **body)
        err = e.value.body
        assert err["param"] == param and words in err["message"], (extra, err)
