"""Structured output through the OpenAI-compatible server (issue 30, items 3 and 4), with the
official `openai` client against a live server on 127.0.0.1 (tiny float64 pool):

- response_format json_object / json_schema (strict) and vLLM's guided_* in chat and
  completions: the output equals the engine's plain constrained decoding of the target (greedy),
  streamed equals non-streamed, finished outputs validate; the SDK's
  `beta.chat.completions.parse` with a pydantic model returns the parsed object;
- bad shapes and schemas that do not compile: a 400 naming the field and the problem.
"""

import json
from typing import Literal

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from pydantic import BaseModel  # noqa: E402

from specrouter.config import SamplingParams  # noqa: E402
from specrouter.decoding.grammar import GrammarSpec  # noqa: E402
from specrouter.engine.engine import Engine  # noqa: E402
from specrouter.models.pool import Pool  # noqa: E402
from specrouter.models.tokenizer import apply_chat_template  # noqa: E402
from specrouter.server import ServerConfig, create_app  # noqa: E402
from specrouter.server.live import LiveServer  # noqa: E402

KEY = "test-key-structured"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                           "size": {"enum": ["small", "large"]}},
          "required": ["name", "size"], "additionalProperties": False}


class Item(BaseModel):
    kind: Literal["tool", "toy"]
    fragile: bool


def load_pool(dirs):
    return Pool.load([dirs[n] for n in ("draft", "mid", "target")], names=["draft", "mid", "target"],
                     target="target", dtype="float64")


@pytest.fixture(scope="module")
def pool(tiny_pool_dirs):
    return load_pool(tiny_pool_dirs)


@pytest.fixture(scope="module")
def server(tiny_pool_dirs):
    app = create_app(load_pool(tiny_pool_dirs), ServerConfig(api_key=KEY, chain=("ngram", "draft", "target"),
                                                            k=3, max_num_seqs=4, max_model_len=256))
    with LiveServer(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60)


def plain(pool, ids, spec, n):
    seq = Engine(pool).generate_ids([ids], [SamplingParams(max_new_tokens=n, grammar=spec)], chain=("target",))[0]
    return pool.tokenizer.decode(seq.output_ids, skip_special_tokens=True), seq.finish_reason


def chat_ids(pool, text):
    return apply_chat_template(pool.tokenizer, [{"role": "user", "content": text}])


@pytest.mark.parametrize("fmt", ["json_object", "json_schema"])
def test_chat_response_format_equals_plain_constrained_decoding(client, pool, fmt):
    rf = ({"type": "json_object"} if fmt == "json_object" else
          {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}})
    spec = GrammarSpec("json_object") if fmt == "json_object" else GrammarSpec.json_schema(SCHEMA)
    msgs = [{"role": "user", "content": "Describe a thing as JSON."}]
    r = client.chat.completions.create(model="target", messages=msgs, temperature=0, max_tokens=60,
                                       response_format=rf)
    text, finish = plain(pool, chat_ids(pool, msgs[0]["content"]), spec, 60)
    assert r.choices[0].message.content == text and r.choices[0].finish_reason == finish
    stream = client.chat.completions.create(model="target", messages=msgs, temperature=0, max_tokens=60,
                                            response_format=rf, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
    if finish == "stop":
        doc = json.loads(text)
        if fmt == "json_schema":
            assert set(doc) == {"name", "size"} and doc["size"] in ("small", "large")
    unconstrained = client.chat.completions.create(model="target", messages=msgs, temperature=0, max_tokens=60)
    assert unconstrained.choices[0].message.content != text


def test_completions_response_format_and_guided_fields(client, pool):
    ids = pool.tokenizer("def add(a, b):", add_special_tokens=False)["input_ids"]
    rf = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    r = client.completions.create(model="target", prompt="def add(a, b):", temperature=0, max_tokens=50,
                                  extra_body={"response_format": rf})
    assert (r.choices[0].text, r.choices[0].finish_reason) == plain(pool, ids, GrammarSpec.json_schema(SCHEMA), 50)
    r = client.completions.create(model="target", prompt="def add(a, b):", temperature=0, max_tokens=20,
                                  extra_body={"guided_choice": ["yes (sure)", "no.", "maybe"]})
    assert r.choices[0].text in ("yes (sure)", "no.", "maybe")
    r = client.completions.create(model="target", prompt="def add(a, b):", temperature=0, max_tokens=20,
                                  extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
    assert len(r.choices[0].text) == 6 and r.choices[0].text[3] == "-"
    r = client.completions.create(model="target", prompt="x", temperature=0, max_tokens=40,
                                  extra_body={"guided_json": json.dumps(SCHEMA)})
    assert r.choices[0].text.startswith('{"name": "')
    # llama-server's fields: json_schema, grammar (GBNF), response_format json_object with a schema
    expected = plain(pool, ids, GrammarSpec.json_schema(SCHEMA), 50)
    for extra in ({"json_schema": SCHEMA}, {"response_format": {"type": "json_object", "schema": SCHEMA}}):
        r = client.completions.create(model="target", prompt="def add(a, b):", temperature=0, max_tokens=50,
                                      extra_body=extra)
        assert (r.choices[0].text, r.choices[0].finish_reason) == expected, extra
    r = client.completions.create(model="target", prompt="def add(a, b):", temperature=0, max_tokens=20,
                                  extra_body={"grammar": 'root ::= ("yes" | "no") " " [0-9]'})
    assert r.choices[0].text[:-1] in ("yes ", "no ") and r.choices[0].text[-1].isdigit()


def test_sdk_parse_with_a_pydantic_model(client):
    r = client.beta.chat.completions.parse(
        model="target", messages=[{"role": "user", "content": "An item, please."}], temperature=0,
        max_tokens=120, response_format=Item)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(msg.parsed, Item) and msg.parsed == Item.model_validate_json(msg.content)


def test_bad_formats_and_schemas_get_a_400_naming_the_problem(client):
    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        ({"response_format": {"type": "xml"}}, "response_format.type", "xml"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
         "response_format.json_schema.name", "letters"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
         "response_format", "objekt"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/defs/none"}}}}}},
         "response_format", "/defs/none"),
        ({"guided_json": "{oops"}, "guided_json", "not valid JSON"),
        ({"guided_regex": "(unclosed"}, "guided_regex", "regex"),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        ({"guided_grammar": "start: ("}, "guided_grammar", "lark"),
        ({"grammar": "root ::= ("}, "grammar", "GBNF"),
        ({"json_schema": {"type": "objekt"}}, "json_schema", "objekt"),
        ({"guided_json": SCHEMA, "response_format": {"type": "json_object"}}, "guided_json", "give one"),
    ]
    for extra, param, words in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="target", messages=msgs, max_tokens=5, extra_body=extra)
        err = e.value.body
        assert err["param"] == param and words.lower() in err["message"].lower(), (extra, err)
    ok = client.chat.completions.create(model="target", messages=msgs, max_tokens=3,
                                        response_format={"type": "text"})  # text: unconstrained
    assert ok.choices[0].finish_reason in ("stop", "length")
