"""`specrouter bench --serve --quick` on a tiny pool: a live server subprocess on 127.0.0.1, the
openai async client at two concurrency levels, every system, greedy outputs identical."""

from __future__ import annotations

import json

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
    paths = write(result, tmp_path, plots=True)
    assert json.loads(paths[0].read_text())["goals"] and "router / plain" in markdown(result)
    assert paths[2].stat().st_size > 1000  # the PNG


def test_rounds_pool_into_tokens_over_summed_wall_time():
    from specrouter.bench.serve import RequestResult, level_result, pooled

    a = level_result("router", 0.0, 4, 2.0, [RequestResult("x", 10, 0.1, 0.01, 1.0)] * 4)
    b = level_result("router", 0.0, 4, 6.0, [RequestResult("y", 10, 0.3, 0.03, 1.0)] * 4)
    both = pooled([a, b])
    assert (a.tokens_per_s, b.tokens_per_s) == (20.0, 40 / 6)
    assert both.tokens_per_s == 80 / 8.0  # not the mean of the two rates (15.0)
    assert len(both.results) == 8 and both.ttft_p50 == 0.2 and both.wall == 8.0
