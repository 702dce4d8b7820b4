"""`specrouter bench --serve --quick` on a tiny pool: a live server subprocess on 127.0.0.1, the
openai async client at two concurrency levels, every system, greedy outputs identical."""

from __future__ import annotations

import json

import pytest

from specrouter.bench.serve import ServeBenchConfig, markdown, run_serve_bench, write


def test_serve_bench_quick_on_a_tiny_pool(tiny_pool_dirs, tmp_path):
    d = tiny_pool_dirs
    cfg = ServeBenchConfig.quick_preset(models=(str(d["draft"]), str(d["target"])), target=str(d["target"]),
                                        concurrency=(1, 2), requests=2, max_new_tokens=6, dtype="float64", temperatures=(0.0,),
                                        out_dir=str(tmp_path), plots=True, threads=1, rounds=2)
    result = run_serve_bench(cfg, log=lambda m: None)
    assert result["mismatches"] == []  # greedy: router, plain and static chains agree
    systems = {lv["system"] for lv in result["levels"]}
    assert {"router", "plain"} <= systems and any(s.startswith("static ") for s in systems)
    by = {(lv["system"], lv["concurrency"]): lv for lv in result["levels"]}
    # router and plain ran two rounds (pooled: both rounds' requests), a static chain one
    assert len(by[("router", 2)]["results"]) == len(by[("plain", 2)]["results"]) == 4
    assert all(len(lv["results"]) == 2 for (s, _), lv in by.items() if s.startswith("static "))
    assert len(result["rows"]) == 2 and all(r["router_tps"] > 0 and r["plain_tps"] > 0 for r in result["rows"])
    # why (issue 26): each server's steps by kind over the level, from its /metrics; the plain
    # server only plans plain steps; every token the clients received is a token of a step
    for r in result["rows"]:
        tokens = {name: sum(x.get("tokens", 0) for x in by[(name, r["concurrency"])]["results"])
                  for name in ("router", "plain")}
        assert set(r["plain_steps"]["kinds"]) == {"plain"}, r["plain_steps"]
        for name in ("router", "plain"):
            kinds = r[f"{name}_steps"]["kinds"]
            assert sum(x["steps"] * x["tokens_per_step"] for x in kinds.values()) == pytest.approx(tokens[name])
        assert sum(p["cycles"] for p in r["router_steps"]["plans"]) >= sum(
            x["steps"] for x in r["router_steps"]["kinds"].values())
    assert "| router | " in markdown(result) and "tokens / row-cycle" in markdown(result)
    # the plain baseline is its own router-off server (issue 25 item 4)
    assert "--static --chain target" in (tmp_path / "server-plain.log").read_text()
    # both servers run with the default batch (`specrouter serve`'s 8), not one sized to the
    # levels (2 here): the c=1 rows measure the server users start
    assert all("--max-num-seqs 8 " in (tmp_path / f).read_text() for f in ("server.log", "server-plain.log"))
    # the library beside the server at concurrency 1, greedy texts identical to the servers'
    lib = {r["library"]: r for r in result["library"]}
    assert set(lib) == {"API plain", "API router"}
    assert all(r["library_tps"] > 0 and r["server_tps"] > 0 and r["concurrency"] == 1 for r in lib.values())
    # and through the bare HTTP client, streamed and whole (their greedy texts are in the
    # mismatch check above), with the goal "streaming costs nothing extra" from the two
    assert all(r["raw_server_tps"] > 0 and r["raw_vs_library"] > 0 for r in lib.values())
    assert all(r["whole_server_tps"] > 0 and r["streamed_vs_whole"] == r["raw_server_tps"] / r["whole_server_tps"]
               for r in lib.values())
    # where the time goes: like with like, the plain chain takes as many engine steps per request
    # on every side (the library's counted around Engine.step, the servers' from their /metrics),
    # a step per token (the first one the prefill); the rest of each side's wall is outside them
    split = lib["API plain"]["split"]
    assert {s["steps"] for s in split.values()} == {cfg.max_new_tokens}, split
    assert all(s["step_ms"] > 0 and s["outside_ms"] >= 0 for s in split.values()), split
    assert split["library"]["client_cpu_ms"] is None and split["server"]["client_cpu_ms"] > 0
    # every ratio unit by unit too (bench/paired.py): one pair per request and round (c=1 goes
    # over the requests `rounds` times: 8 pairs left a median that moved between runs), in the table
    assert all(p["n"] == cfg.requests * cfg.rounds and p["lo"] <= p["median"] <= p["hi"]
               for r in lib.values() for p in r["paired"].values()), lib
    assert "| API plain | " in markdown(result).split("unit by unit")[1]
    assert "| API plain | server |" in markdown(result)
    # and each server side at the library's step speed (what the server adds), in the split table
    assert all(0 < r["at_library_step"][side] for r in lib.values() for side in ("server", "raw", "whole")), lib
    assert "/ library at its step" in markdown(result)
    goals = [g["goal"] for g in result["goals"]]
    assert any(g.startswith("server >= 0.95x the Python API") and "openai client" in g for g in goals)
    assert any(g.startswith("server >= 0.95x the Python API") and "raw HTTP client" in g for g in goals)
    assert any(g.startswith("streamed >= 0.95x whole") for g in goals)
    paths = write(result, tmp_path, plots=True)
    assert json.loads(paths[0].read_text())["goals"] and "router / plain" in markdown(result)
    assert "| API plain | 1 |" in markdown(result)
    assert paths[2].stat().st_size > 1000  # the PNG


def test_rounds_pool_into_tokens_over_summed_wall_time():
    from specrouter.bench.serve import RequestResult, level_result, pooled

    a = level_result("router", 0.0, 4, 2.0, [RequestResult("x", 10, 0.1, 0.01, 1.0)] * 4)
    b = level_result("router", 0.0, 4, 6.0, [RequestResult("y", 10, 0.3, 0.03, 1.0)] * 4)
    both = pooled([a, b])
    assert (a.tokens_per_s, b.tokens_per_s) == (20.0, 40 / 6)
    assert both.tokens_per_s == 80 / 8.0  # not the mean of the two rates (15.0)
    assert len(both.results) == 8 and both.ttft_p50 == 0.2 and both.wall == 8.0


def _paired_run(lib_rates: list[float], server_rates: list[float]) -> dict:
    """summarize() of one c=1 library run whose units ran at these tok/s (64 tokens each)."""
    from specrouter.bench.serve import LevelResult, RequestResult, ServeBenchConfig, summarize

    walls = [64 / r for r in lib_rates]
    run = {"name": "API plain", "system": "plain", "concurrency": 1, "server_concurrency": 1,
           "tokens_per_s": 64 * len(walls) / sum(walls), "unit_tps": lib_rates, "texts": []}
    for prefix in ("server_", "raw_server_", "whole_server_"):
        run |= {f"{prefix}tokens_per_s": 64 * len(server_rates) / sum(64 / r for r in server_rates),
                f"{prefix}unit_tps": server_rates}
    levels = [LevelResult(system, 0.0, 1, 40.0, None, None, None, None, 1.0, [RequestResult("x", 40, 0.1, None, 1.0)])
              for system in ("router", "plain")]
    return summarize(ServeBenchConfig(concurrency=(1,), temperatures=(0.0,)), levels, [], [], [run])


def test_server_ratios_are_medians_of_paired_units():
    """A unit where the machine stalled one side (a co-tenant took a core during one library
    request) does not decide the goal: the median of the pairs does; the pooled ratio is kept
    beside it. A server slower in every pair fails (the negative control)."""
    stalled = _paired_run([40, 40, 5, 40, 40], [39, 39, 39, 39, 39])
    row = stalled["library"][0]
    assert row["raw_vs_library"] > 1.3  # pooled: the stall decides it
    assert row["paired"]["raw"] == {"median": 39 / 40, "lo": 39 / 40, "hi": 39 / 5, "n": 5}
    goal = next(g for g in stalled["goals"] if "raw HTTP client; median of paired requests" in g["goal"])
    assert goal["value"] == 39 / 40 and goal["met"]
    assert "0.97x (0.97-7.80, 5 pairs)" in markdown(stalled)
    slow = _paired_run([40] * 5, [36, 37, 36, 37, 60])  # one lucky pair, pooled 0.99x
    assert slow["library"][0]["raw_vs_library"] > 0.95
    goal = next(g for g in slow["goals"] if "raw HTTP client; median of paired requests" in g["goal"])
    assert goal["value"] == 37 / 40 and not goal["met"]


def test_continuous_batching_keeps_at_most_c_rows_and_equals_one_by_one(tiny_pool_dirs):
    """The library's batched baseline: every request, at most c rows at once, outputs as alone."""
    from specrouter.bench.serve import continuous_batching
    from specrouter.config import PoolConfig, SamplingParams
    from specrouter.engine.engine import Engine
    from specrouter.models.pool import Pool

    d = tiny_pool_dirs
    pool = Pool.from_config(PoolConfig(models=(str(d["target"]),), dtype="float64", ngram=False, suffix=False))
    ids = [[5 + i, 9, 11 + i, 3] for i in range(5)]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    engine = Engine(pool, max_num_seqs=2, max_model_len=32)
    rows = []
    step = engine.step
    engine.step = lambda *a: (rows.append(len(engine.running)), step(*a))[1]
    seqs = continuous_batching(engine, ids, params, 2, (pool.target,))
    assert max(rows) == 2 and len(seqs) == 5 and all(len(s.output_ids) == 6 for s in seqs)
    alone = Engine(pool.with_fresh_drafters(), max_num_seqs=1, max_model_len=32)
    for x, s in zip(ids, seqs):
        assert alone.generate_ids([x], [params], chain=(pool.target,))[0].output_ids == s.output_ids


@pytest.mark.slow  # over ~30 s on a 2-core CI machine: `make test-slow`
def test_shared_prompt_workload_runs_cache_on_and_off_servers_side_by_side(tiny_pool_dirs, tmp_path):
    """`bench --serve --workloads shared-prompt` on a tiny pool: two live servers (the prefix
    cache on, `--no-prefix-cache`), concurrent clients sharing a system prompt, greedy replies
    identical, the cached tokens reported by the cache server only."""
    from specrouter.bench.serve_shared import SYSTEM, markdown_shared, run_shared_prompt_bench, write_shared

    d = tiny_pool_dirs
    cfg = ServeBenchConfig.quick_preset(models=(str(d["draft"]), str(d["target"])), target=str(d["target"]),
                                        concurrency=(3,), requests=4, max_new_tokens=6, dtype="float64",
                                        out_dir=str(tmp_path), threads=1, rounds=2)
    result = run_shared_prompt_bench(cfg, log=lambda m: None, system=SYSTEM[:160])
    assert result["mismatches"] == [] and result["clients"] == 3
    on, off = result["servers"]["cache"], result["servers"]["no cache"]
    assert on["requests"] == off["requests"] == 8  # 2 rounds x 4 requests, pooled
    # the tiny tokenizer spells the system prompt in ~140 tokens (the question ~40 more): every
    # request of the cache server adopted it, none of the other's
    assert on["prompt_tokens_mean"] == off["prompt_tokens_mean"] > 150
    cached = {name: [x["cached_tokens"] for lv in lvs for x in lv["results"]] for name, lvs in result["rounds"].items()}
    assert min(cached["cache"]) > 120 and max(cached["no cache"]) == 0
    assert "--no-prefix-cache" in (tmp_path / "server-no-cache.log").read_text()
    assert "--no-prefix-cache" not in (tmp_path / "server-cache.log").read_text()
    assert result["ttft_p50_ratio"] > 0 and result["throughput_ratio"] > 0
    assert [g["met"] for g in result["goals"]][-1] is True  # greedy replies identical
    paths = write_shared(result, tmp_path)
    assert json.loads(paths[0].read_text())["workload"] == "shared-prompt"
    assert "| prefix cache (default) |" in markdown_shared(result)


def test_serve_workloads_are_checked():
    from specrouter.cli.main import main

    assert main(["bench", "--serve", "--workloads", "templated"]) == 2


def test_raw_client_dechunks_and_parses_the_stream():
    """bench/raw_client.py: an HTTP/1.1 chunked body (a chunk may end inside an event) and the SSE
    events of a chat stream: choice 0's text, the usage's tokens; [DONE] and role chunks skipped."""
    from specrouter.bench.raw_client import dechunk, parse_sse

    events = (b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
              b'data: {"choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n'
              b'data: {"choices":[{"index":0,"delta":{"content":"lo \\u00e9"}}]}\n\n'
              b'data: {"choices":[],"usage":{"completion_tokens":3}}\n\ndata: [DONE]\n\n')
    cut = 70
    body = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(part), part) for part in (events[:cut], events[cut:])) + b"0\r\n\r\n"
    assert dechunk(body) == events
    assert parse_sse(events, chat=True) == ("Hello \u00e9", 3)
    completion = b'data: {"choices":[{"index":0,"text":"ab"}]}\n\ndata: {"choices":[{"index":0,"text":"c"}]}\n\n'
    assert parse_sse(completion, chat=False) == ("abc", 0)


def test_at_library_step_charges_the_server_what_it_adds_not_its_step_speed():
    """A server side at the library's step speed: the library's ms per request over (library step
    x the side's steps + the side's ms outside the steps)."""
    from specrouter.bench.serve_steps import at_library_step

    library = {"step_ms": 20.0, "steps": 64.0, "outside_ms": 3.0}
    # 64 more ms outside the steps (1 ms a token): 1283 / 1347
    assert at_library_step(library, {"step_ms": 20.0, "steps": 64.0, "outside_ms": 67.0}) == pytest.approx(1283 / 1347)
    # a server process whose steps ran 10% slower (the machine, not the server) adds nothing ...
    slow = {"step_ms": 22.0, "steps": 64.0, "outside_ms": 3.0}
    assert at_library_step(library, slow) == pytest.approx(1.0)
    # ... where the plain tok/s ratio (the control) reads it as the server's
    assert (20.0 * 64 + 3) / (22.0 * 64 + 3) < 0.92
    # more steps for the same tokens count at the library's step; a missing figure gives None
    assert at_library_step(library, {"step_ms": 20.0, "steps": 70.0, "outside_ms": 3.0}) == pytest.approx(1283 / 1403)
    assert at_library_step(library, {"step_ms": None, "steps": None, "outside_ms": None}) is None


def test_at_most_c_requests_run_at_once_started_in_order():
    """bench/serve.py `at_most`, every client loop of the serving benches: c workers, each taking
    the next request when its last one finished; results in request order."""
    import asyncio

    from specrouter.bench.serve import at_most

    running, peak, started = [0], [0], []

    async def job(i: int) -> int:
        started.append(i)
        running[0] += 1
        peak[0] = max(peak[0], running[0])
        await asyncio.sleep(0.001 * (3 - i % 3))
        running[0] -= 1
        return 10 * i

    assert asyncio.run(at_most(3, 8, job)) == [10 * i for i in range(8)]
    assert peak[0] == 3 and started == list(range(8))
    assert asyncio.run(at_most(4, 2, job)) == [0, 10]  # fewer requests than clients
