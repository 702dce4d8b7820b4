"""`specrouter bench --serve --fresh-rounds` (bench/serve_fresh.py, bench/library_worker.py): issue
34's lines with new server and library processes every round, the verdict the median of the
per-round ratios."""

from __future__ import annotations

import json

import pytest

from specrouter.bench.serve import SIDES, ServeBenchConfig
from specrouter.bench.serve_fresh import Unit, markdown_fresh, run_fresh_bench, summarize_fresh
from specrouter.bench.serve_steps import Steps


def _round(lib_tps: float, side_tps: dict[str, float], texts=("a", "b")) -> dict:
    """One round of the c=4 line: every side 128 tokens at its rate, 2 requests' texts."""
    out = {}
    for side in SIDES:
        tps = lib_tps if side == "library" else side_tps[side]
        u = Unit()
        u.add(128, 128 / tps, Steps(32, 0.9 * 128 / tps), list(texts))
        out[side] = u
    return {"c=4 batched": out}


def test_the_verdict_is_the_median_of_per_round_ratios_not_the_pooled_one():
    """Four rounds on fresh processes; in one the library's process drew slow steps (a 2x
    ratio): the pooled ratio would read 1.17x, the median of the rounds 0.96x. A server
    slower in every round fails (the negative control)."""
    cfg = ServeBenchConfig(concurrency=(4,), fresh_rounds=4)
    fast = {"server": 96.0, "raw": 96.0, "whole": 100.0}
    rounds = [_round(100, fast), _round(100, fast), _round(50, fast), _round(100, fast)]
    result = summarize_fresh(cfg, rounds)
    m = result["lines"]["c=4 batched"]["medians"]
    assert m["raw"] == {"median": 0.96, "lo": 0.96, "hi": 1.92, "n": 4}
    assert m["streamed_vs_whole"]["median"] == pytest.approx(0.96)
    pooled = 4 * 128 / (sum(128 / t for t in (96,) * 4)) / (4 * 128 / (3 * 128 / 100 + 128 / 50))
    assert pooled > 1.15  # what a pooled ratio would have said
    goal = next(g for g in result["goals"] if g["goal"].startswith("server >= 0.95x the engine's batching")
                and "raw" in g["goal"])
    assert goal["value"] == pytest.approx(0.96) and goal["met"]
    assert "0.96x (0.96-1.92, 4 rounds)" in markdown_fresh(result)
    slow = summarize_fresh(cfg, [_round(100, {"server": 90.0, "raw": 93.0, "whole": 99.0})] * 3
                           + [_round(50, fast)])
    goal = next(g for g in slow["goals"] if g["goal"].startswith("server >= 0.95x the engine's batching")
                and "raw" in g["goal"])
    assert goal["value"] == pytest.approx(0.93) and not goal["met"]


def test_other_processes_cpu_is_the_machines_busy_time_less_the_benchs_own(tmp_path):
    """bench/machine_cpu.py from scripted /proc files: over a span the machine ran 3.0 busy CPU
    seconds, the bench's two processes 1.2 + 0.6 of them, so others took 1.2; an exited process
    counts nothing, and a span with only the bench's own work leaves others at 0."""
    import os

    from specrouter.bench import machine_cpu

    hz = os.sysconf("SC_CLK_TCK")
    stat, proc = tmp_path / "stat", tmp_path / "proc"

    def world(busy: float, idle: float, steal: float, ours: dict[int, float]) -> None:
        # user nice system idle iowait irq softirq steal, in ticks (busy split user / system)
        stat.write_text(f"cpu  {int(busy * hz * 0.75)} 0 {int(busy * hz * 0.25)} {int(idle * hz)} 0 0 0 "
                        f"{int(steal * hz)} 0 0\n")
        for pid, cpu in ours.items():
            (proc / str(pid)).mkdir(parents=True, exist_ok=True)
            fields = ["S"] + ["0"] * 10 + [str(int(cpu * hz * 0.5)), str(int(cpu * hz * 0.5))] + ["0"] * 30
            (proc / str(pid) / "stat").write_text(f"{pid} (python -m x) " + " ".join(fields))

    world(10.0, 50.0, 1.0, {11: 2.0, 12: 1.0})
    a = machine_cpu.read([11, 12, 99], str(stat), str(proc))
    world(13.0, 51.0, 1.5, {11: 3.2, 12: 1.6})
    span = machine_cpu.read([11, 12, 99], str(stat), str(proc)) - a
    assert (span.busy, span.idle, span.steal, span.ours) == pytest.approx((3.0, 1.0, 0.5, 1.8))
    assert span.others == pytest.approx(1.2)
    world(14.0, 52.0, 1.5, {11: 3.7, 12: 2.1})  # the control: only the bench's own CPU
    assert (machine_cpu.read([11, 12], str(stat), str(proc)) - a - span).others == pytest.approx(0.0)
    assert machine_cpu.read([11], str(tmp_path / "absent"), str(proc)) is None


def test_a_side_whose_text_differs_is_a_mismatch():
    fast = {"server": 96.0, "raw": 96.0, "whole": 100.0}
    rounds = [_round(100, fast)]
    rounds[0]["c=4 batched"]["whole"].texts = ["a", "B"]
    result = summarize_fresh(ServeBenchConfig(concurrency=(4,), fresh_rounds=1), rounds)
    assert result["mismatches"] == [{"line": "c=4 batched", "round": 0, "side": "whole", "requests": [1]}]
    assert not result["goals"][-1]["met"]


@pytest.mark.slow  # starts 5 processes a round: ~1 min on a 2-core CI machine
def test_fresh_rounds_on_a_tiny_pool(tiny_pool_dirs, tmp_path):
    d = tiny_pool_dirs
    cfg = ServeBenchConfig(models=(str(d["draft"]), str(d["target"])), target=str(d["target"]), concurrency=(1, 4),
                           requests=2, max_new_tokens=6, dtype="float64", out_dir=str(tmp_path), threads=1,
                           fresh_rounds=2, stream_interval=2, team_governor=False)
    result = run_fresh_bench(cfg, log=lambda m: None)
    assert result["mismatches"] == []  # greedy: every side's texts are the library's
    assert list(result["lines"]) == ["c=1 plain", "c=1 router", "c=4 batched"]
    for name, line in result["lines"].items():
        assert len(line["rounds"]) == 2 and line["medians"]["raw"]["n"] == 2
        for sides in line["rounds"]:
            assert set(sides) == set(SIDES) and all(x["tokens"] > 0 for x in sides.values())
            # the server's steps over each unit, from its /metrics; streamed sides' chunks
            assert all(x["steps"] > 0 for x in sides.values()), (name, sides)
            assert sides["raw"]["chunks"] > 0 and sides["whole"]["chunks"] == 0
            # the server's event loop CPU (its main thread, /proc) beside each server side
            assert sides["library"]["loop_cpu_ms"] is None and sides["raw"]["loop_cpu_ms"] is not None
            # the server's steps by torch threads (one: threads=1) with the engine thread's CPU in them
            t = sides["whole"]["threads"]
            assert sides["library"]["threads"] is None and t["threads"] == 1 and t["reduced_steps"] == 0.0
            assert 0 < t["cpu_share"] <= 1.05 and (t["drops"], t["restores"]) == (0, 0)
            # the machine's idle, other processes' and host-stolen CPU over every side's units (/proc)
            assert all(x[k] >= 0 for x in sides.values() for k in ("idle_ms", "others_ms", "steal_ms"))
    plain = result["lines"]["c=1 plain"]["rounds"][0]
    assert {x["steps"] for x in plain.values()} == {cfg.max_new_tokens}  # a step a token, every side
    # every round on its own processes: each round's server and library logs, the flag passed on
    logs = sorted(p.name for p in tmp_path.glob("fresh-r*.log"))
    ran = result["rounds"] + len(result["disturbed_rounds"])  # a round beside another process runs again
    assert logs == [f"fresh-r{r}-{w}.log" for r in range(ran)
                    for w in ("library", "plain", "router-raw", "router-server", "router-whole")]
    # the c=1 router line: every side's router had learnt from the same requests before each one
    # (the warm-up and the round's earlier requests once each): a router server per client side.
    # One server for the three (before) had seen (1, 4), (2, 5), (3, 6) on its sides
    for sides in result["lines"]["c=1 router"]["rounds"]:
        assert {tuple(x["seen"]) for x in sides.values()} == {(1, 2)}, sides
    assert "--stream-interval 2 --no-team-governor" in (tmp_path / "fresh-r1-plain.log").read_text()
    assert "--no-team-governor" in markdown_fresh(result)
    assert json.loads(json.dumps(result))["rounds"] == 2


def test_a_round_beside_another_process_is_run_again_and_listed(monkeypatch, tmp_path):
    """run_fresh_bench with scripted rounds: the second ran its library side beside 1.3 cores of
    another process (the twelfth round's pytest outside the lock); it is listed, not counted, and a
    fifth round takes its place. The control: a round at the machine's background (0.03 cores)
    counts."""
    from specrouter.bench import serve_fresh
    from specrouter.bench.machine_cpu import MachineCpu

    fast = {"server": 96.0, "raw": 96.0, "whole": 100.0}
    others = {1: 1.3}  # round index -> cores other processes took during its library side

    def one_round(cfg, models, r, log):
        got = _round(50 if r in others else 100, fast)
        for side, u in got["c=4 batched"].items():
            cores = others.get(r, 0.03) if side == "library" else 0.03
            u.machine = MachineCpu(busy=2.0 * u.wall, ours=(2.0 - cores) * u.wall, span=u.wall)
        return got

    monkeypatch.setattr(serve_fresh, "one_round", one_round)
    cfg = ServeBenchConfig(models=("x",), concurrency=(4,), fresh_rounds=4, out_dir=str(tmp_path))
    result = serve_fresh.run_fresh_bench(cfg, log=lambda m: None)
    assert result["rounds"] == 4 and result["disturbed_rounds"] == [
        {"round": 1, "line": "c=4 batched", "side": "library", "others_cores": pytest.approx(1.3)}]
    assert result["lines"]["c=4 batched"]["medians"]["raw"]["hi"] == pytest.approx(0.96)  # the 1.92 left out
    assert "round 2 (c=4 batched, library: 1.30 cores)" in markdown_fresh(result)


def test_the_library_workers_learning_drafters_forget_the_warm_up(tiny_pool_dirs):
    """The library worker warms each API with the request a server is warmed with, then drops what
    a learning drafter (suffix) took from it: a server side's requests run under their own API key,
    a tenant the warm-up (its own key) never fed, and the warm-up's prompt is the first measured
    one (a suffix draft of the warm-up's output led the library's first router request astray:
    docs/serving-performance.md, thirteenth round). The measured requests still feed it."""
    from specrouter.bench.library_worker import LibraryWorker

    d = tiny_pool_dirs
    w = LibraryWorker({"models": [str(d["draft"]), str(d["target"])], "target": str(d["target"]),
                       "dtype": "float64", "max_new_tokens": 4})
    suffix = {system: api.pool.drafters["suffix"] for system, (api, _) in w.apis.items()}
    assert suffix and all(s.memory().requests == 0 for s in suffix.values())
    w.one("router", "a measured prompt", False)
    assert suffix["router"].memory().requests == 1 and suffix["plain"].memory().requests == 0
