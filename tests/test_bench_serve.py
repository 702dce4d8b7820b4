"""`specrouter bench --serve --quick` on a tiny pool: a live server subprocess on 127.0.0.1, the
openai async client at two concurrency levels, every system, greedy outputs identical."""

from __future__ import annotations

import json

from specrouter.bench.serve import ServeBenchConfig, markdown, run_serve_bench, write


def test_serve_bench_quick_on_a_tiny_pool(tiny_pool_dirs, tmp_path):
    d = tiny_pool_dirs
    cfg = ServeBenchConfig.quick_preset(models=(str(d["draft"]), str(d["target"])), target=str(d["target"]),
                                        concurrency=(1, 2), requests=2, max_new_tokens=6, dtype="float64", temperatures=(0.0,),
                                        out_dir=str(tmp_path), plots=True, threads=1)
    result = run_serve_bench(cfg, log=lambda m: None)
    assert result["mismatches"] == []  # greedy: router, plain and static chains agree
    systems = {lv["system"] for lv in result["levels"]}
    assert {"router", "plain"} <= systems and any(s.startswith("static ") for s in systems)
    assert len(result["rows"]) == 2 and all(r["router_tps"] > 0 and r["plain_tps"] > 0 for r in result["rows"])
    paths = write(result, tmp_path, plots=True)
    assert json.loads(paths[0].read_text())["goals"] and "router / plain" in markdown(result)
    assert paths[2].stat().st_size > 1000  # the PNG
