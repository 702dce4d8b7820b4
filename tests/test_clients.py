"""Three real clients against a live `specrouter serve` on 127.0.0.1 with the default pool
(issue 30, item 5): the openai SDK's `beta.chat.completions.parse`, LangChain's
`ChatOpenAI.bind_tools` / `.with_structured_output` and an agent loop (tool call -> tool result
-> final answer), LiteLLM's `completion` with `response_format` and with tools. Every output
must validate against its schema.

Marked `clients` (`make test-clients`: installs the `clients` extra, about 250 MB with LiteLLM,
and builds the default pool in the test cache, about a minute): not in the default run.
"""

import os
import subprocess
import sys
from typing import Literal

import pytest
from fixtures import free_port, stop_server, wait_for_health
from pydantic import BaseModel, Field

pytestmark = pytest.mark.clients

openai = pytest.importorskip("openai")
KEY = "clients-key"
LAUNCH = "import sys\nfrom specrouter.cli.main import main\nsys.exit(main(sys.argv[1:]))\n"


class Person(BaseModel):
    """A person mentioned in the text."""

    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=150)
    city: str = Field(max_length=40)


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str = Field(max_length=40, description="the city, e.g. Paris")
    unit: Literal["celsius", "fahrenheit"]


TEXT = "Maria Garcia is 34 years old and lives in Madrid, where she works as a nurse."
ASK_WEATHER = "What is the weather like in Paris today? Use celsius."


@pytest.fixture(scope="module")
def server():
    """`specrouter serve` with the default pool (its router on), 127.0.0.1, an API key."""
    port = free_port()
    env = {**os.environ, "SPECROUTER_API_KEY": KEY}
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH, "serve", "--port", str(port), "--log-level",
                             "warning", "--max-num-seqs", "2", "--max-model-len", "1024"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for_health(proc, port, 600, "specrouter serve (default pool)")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def model(server):
    return openai.OpenAI(base_url=server, api_key=KEY).models.list().data[0].id


def test_openai_sdk_parse(server, model):
    client = openai.OpenAI(base_url=server, api_key=KEY, max_retries=0, timeout=300)
    r = client.beta.chat.completions.parse(
        model=model, temperature=0, max_tokens=80, response_format=Person,
        messages=[{"role": "user", "content": f"Extract the person: {TEXT}"}])
    assert r.choices[0].finish_reason == "stop"
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and person == Person.model_validate_json(r.choices[0].message.content)


def _chat(server, model):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(base_url=server, api_key=KEY, model=model, temperature=0,
                                       max_tokens=80, max_retries=0, timeout=300)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(server, model, method):
    llm = _chat(server, model).with_structured_output(Person, method=method)
    person = llm.invoke(f"Extract the person: {TEXT}")
    assert isinstance(person, Person)


def test_langchain_bind_tools_and_agent_loop(server, model):
    from langchain_core.messages import HumanMessage, ToolMessage

    chat = _chat(server, model)
    llm = chat.bind_tools([GetWeather], tool_choice="GetWeather")
    history = [HumanMessage(ASK_WEATHER)]
    ai = llm.invoke(history)
    assert ai.response_metadata["finish_reason"] == "tool_calls" and len(ai.tool_calls) >= 1
    call = ai.tool_calls[0]
    assert call["name"] == "GetWeather"
    args = GetWeather.model_validate(call["args"])
    # the tool's result goes back; the final answer is text (tools still offered, "auto")
    history += [ai, ToolMessage(f"18 degrees {args.unit}, sunny in {args.city}", tool_call_id=call["id"])]
    final = chat.bind_tools([GetWeather]).invoke(history)
    assert final.content or final.tool_calls
    # streamed: LangChain puts the tool-call deltas together into the same call
    chunks = list(llm.stream([HumanMessage(ASK_WEATHER)]))
    merged = chunks[0]
    for c in chunks[1:]:
        merged += c
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [(c["name"], c["args"]) for c in ai.tool_calls]


def test_litellm_response_format_and_tools(server, model):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the cost map
    litellm = pytest.importorskip("litellm")
    kw = dict(model=f"openai/{model}", api_base=server, api_key=KEY, temperature=0, max_tokens=80,
              timeout=300, num_retries=0)
    r = litellm.completion(messages=[{"role": "user", "content": f"Extract the person: {TEXT}"}],
                           response_format=Person, **kw)
    Person.model_validate_json(r.choices[0].message.content)
    tool = {"type": "function", "function": {"name": "get_weather", "description": GetWeather.__doc__,
                                             "parameters": GetWeather.model_json_schema()}}
    r = litellm.completion(messages=[{"role": "user", "content": ASK_WEATHER}], tools=[tool],
                           tool_choice="required", **kw)
    assert r.choices[0].finish_reason == "tool_calls"
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    GetWeather.model_validate_json(call.function.arguments)
