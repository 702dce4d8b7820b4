"""The `structured` workload of `specrouter bench` (issue 30, item 6): chat requests constrained
to a JSON schema (extraction, tool-call arguments, JSON lists), run by the native systems side
by side (greedy outputs checked identical by the bench), each output checked against its
schema and the counts reported; transformers and llama.cpp rows stay out (no grammar there)."""

import json

import pytest

from test_bench import tiny_config

from specrouter.bench import run_bench
from specrouter.bench.report import markdown
from specrouter.bench.structured import PERSON, SHOPPING, WEATHER_CALL, schema_valid
from specrouter.bench.workloads import build_workloads


def test_the_workload_interleaves_the_three_kinds():
    (wl,) = build_workloads(("structured",), 2)
    assert [r.kind for r in wl.requests] == ["extract", "tool", "list"] * 2
    assert all(r.chat and json.loads(r.json_schema)["type"] == "object" for r in wl.requests)


def test_schema_valid_checks_what_the_schemas_say():
    assert schema_valid('{"name": "Ada", "born": 1815, "city": "London", "occupation": "x"}', PERSON)
    assert not schema_valid('{"name": "Ada", "born": "1815", "city": "London", "occupation": "x"}', PERSON)
    assert not schema_valid('{"name": "Ada", "born": 1815, "city": "London"}', PERSON)  # required
    assert not schema_valid('{"name": "Ada", "born": 1815, "city": "L", "occupation": "x", "y": 1}', PERSON)
    assert schema_valid('{"name": "get_weather", "arguments": {"city": "P", "unit": "celsius", "days": 3}}', WEATHER_CALL)
    assert not schema_valid('{"name": "get_weather", "arguments": {"city": "P", "unit": "kelvin", "days": 3}}', WEATHER_CALL)
    assert not schema_valid('{"items": [' + ', '.join(['{"item": "a", "quantity": 1}'] * 6) + ']}', SHOPPING)
    assert not schema_valid('{"items": [', SHOPPING)


@pytest.mark.slow  # over ~30 s on a 2-core CI machine: `make test-slow`
def test_structured_runs_native_systems_with_the_grammar(tiny_pool_dirs, tmp_path):
    d = tiny_pool_dirs
    cfg = tiny_config(d, str(tmp_path / "profile.json"), tmp_path / "out", workloads=("structured",),
                      prompts_per_type=1, temperatures=(0.0,), hf="greedy", slowdown=False, peers=False,
                      max_new_tokens=200)
    result = run_bench(cfg, progress=False, log=lambda m: None)
    (s,) = result["scenarios"]
    assert not any(n.startswith("HF") for n in s["systems"])  # no grammar there: left out
    assert len({e["tokens"] for e in s["systems"].values()}) == 1  # greedy: the same tokens everywhere
    valid = s["schema_valid"]
    assert set(valid) == set(s["systems"]) and all(total == 3 for _, total in valid.values())
    assert len({ok for ok, _ in valid.values()}) == 1  # the same outputs, the same verdicts
    for r in s["requests"]:  # a finished output follows its schema (the tiny model may hit max_new_tokens)
        if r["tokens"]["target-only"] < cfg.max_new_tokens:
            assert r["schema_valid"]["target-only"], r
    assert "follow their JSON schema" in markdown(result)
