"""The benchmark harness end to end on the tiny pool: files written and consistent, the greedy
check fires on a broken system, transformers differences are reported, not fatal."""

import dataclasses
import json
import time
from types import SimpleNamespace

import pytest

from specrouter.bench import BenchConfig, GreedyMismatchError, run_bench
from specrouter.bench.slowdown import Slowdown
from specrouter.bench.systems import AdaptiveSystem, HFSystem
from specrouter.cli.main import main


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    return str(tmp_path_factory.mktemp("bench-profile") / "profile.json")


def tiny_config(d, profile_path, out_dir, **kw):
    base = dict(models=(str(d["draft"]), str(d["target"])), target="target", dtype="float64",
                max_new_tokens=8, profile_path=profile_path, out_dir=str(out_dir), plots=False)
    base.update(kw)
    return BenchConfig.quick_preset(**base)


@pytest.fixture(scope="module")
def bench_out(tiny_pool_dirs, profile_path, tmp_path_factory):
    """`specrouter bench --quick` on the tiny pool, through the CLI."""
    d = tiny_pool_dirs
    out = tmp_path_factory.mktemp("bench-out")
    t0 = time.perf_counter()
    rc = main(["bench", "--quick", "--models", str(d["draft"]), str(d["target"]), "--target", "target",
               "--dtype", "float64", "--max-new-tokens", "8", "--profile-path", profile_path,
               "--out-dir", str(out)])
    assert rc == 0
    print(f"tiny quick bench: {time.perf_counter() - t0:.1f} s")
    return out


def test_bench_writes_consistent_json_markdown_and_pngs(bench_out):
    result = json.loads((bench_out / "bench.json").read_text())
    md = (bench_out / "bench.md").read_text()
    for png in ["tokens_per_second.png", "router_mixed_greedy.png", "router_mixed_greedy_slowdown.png"]:
        assert (bench_out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    names = [s["name"] for s in result["scenarios"]]
    assert names == ["mixed greedy", "mixed t=0.7", "mixed greedy + slowdown"]
    assert result["meta"]["config"]["prompt_set"] == "original" and "(prompt set original)" in md
    for s in result["scenarios"]:
        systems = s["systems"]
        tps = {n: e["tokens_per_second"] for n, e in systems.items()}
        for n, e in systems.items():
            assert e["tokens_per_second"] == pytest.approx(e["tokens"] / e["seconds"], rel=1e-12)
            assert e["vs_target_only"] == tps[n] / tps["target-only"]
        r = s["ratios"]
        assert r["specrouter/target_only"] == tps["SpecRouter"] / tps["target-only"]
        assert r["specrouter/best_static"] == tps["SpecRouter"] / s["best_static"]["tokens_per_second"]
        assert r["specrouter/oracle"] == tps["SpecRouter"] / s["oracle"]["tokens_per_second"]
        static = {n: t for n, t in tps.items() if systems[n]["kind"] in ("static", "target-only")}
        assert s["best_static"]["tokens_per_second"] == max(static.values())
        assert s["best_three_level"]["system"] in ("ngram>draft>target k=4", "suffix>draft>target k=4")
        # SpecRouter also ran without the suffix drafter, side by side
        assert r["specrouter/no_suffix"] == tps["SpecRouter"] / tps["SpecRouter (no suffix)"]
        assert s["suffix"]["proposals"] > 0 and s["suffix"]["bytes"] > 0
        if s["greedy"]:  # same tokens everywhere: the per-request oracle is at least the best static
            assert s["oracle"]["tokens_per_second"] >= max(static.values())
            assert len({e["tokens"] for e in systems.values()}) == 1
        assert len(s["oracle"]["choices"]) == len(s["requests"]) == 4
        for q in s["requests"]:  # target-only ran next to SpecRouter (bench/order.py), alternating
            order = list(q["seconds"])
            a, b = order.index("SpecRouter"), order.index("target-only")
            assert b == (a + 1 if q["index"] % 2 == 0 else a - 1)
        assert [q["kind"] for q in s["requests"]] == ["extraction", "prose", "code", "chat"]
        assert s["decisions"] and {e["request"] for e in s["decisions"]} == {0, 1, 2, 3}
        assert all(isinstance(e["k"], int) and isinstance(e["step"], int) for e in s["decisions"])
        assert ("HF assisted" in systems) == (s["name"] == "mixed greedy")  # --quick: greedy only
        # markdown: every scenario with SpecRouter's tokens/s and ratio as in the JSON
        row = next(line for line in md.splitlines() if line.startswith(f"| {s['name']} |"))
        assert f"{tps['SpecRouter']:.1f}" in row and f"{r['specrouter/target_only']:.2f}x" in row
    slow = result["scenarios"][2]
    assert slow["slowdown"]["start_request"] == 2 and slow["slowdown"]["model"] == "draft"
    assert 0 <= slow["slowdown"]["specrouter_cycles_using_it_after"] <= 1
    assert "SpecRouter's cycles using draft:" in md
    assert [q["slowed"] for q in slow["requests"]] == [False, False, True, True]
    assert result["meta"]["slowdown"]["model"] == "draft"
    assert result["meta"]["hf_assisted"]["schedule"]["num_assistant_tokens"] is not None
    goals = {g["goal"]: g for g in result["goals"]}
    assert goals["greedy outputs identical to target-only (static chains, SpecRouter)"]["met"] is True
    assert "## Goals" in md and "acceptance per level" in md
    acc = result["scenarios"][0]["systems"]["draft>target k=4"]["acceptance"]
    assert set(acc) == {"draft>target"} and 0 <= acc["draft>target"] <= 1


@pytest.mark.slow  # over ~30 s on a 2-core CI machine: `make test-slow`
def test_greedy_mismatch_of_an_exact_system_fails_loudly(tiny_pool_dirs, profile_path, tmp_path, monkeypatch):
    real = AdaptiveSystem.run

    def broken(self, prompt_ids, decoding):
        out = real(self, prompt_ids, decoding)
        out.token_ids = out.token_ids[:-1] + [(out.token_ids[-1] + 1) % 300]
        return out

    monkeypatch.setattr(AdaptiveSystem, "run", broken)
    cfg = tiny_config(tiny_pool_dirs, profile_path, tmp_path, workloads=("code",), temperatures=(0.0,),
                      hf="none", slowdown=False)
    with pytest.raises(GreedyMismatchError, match="SpecRouter differs from target-only greedy"):
        run_bench(cfg, progress=False, log=lambda m: None)
    # through the CLI: exit status 2 and the message on stderr
    d = tiny_pool_dirs
    rc = main(["bench", "--quick", "--models", str(d["draft"]), str(d["target"]), "--target", "target",
               "--dtype", "float64", "--max-new-tokens", "8", "--profile-path", profile_path,
               "--out-dir", str(tmp_path / "cli"), "--workloads", "code", "--temperatures", "0",
               "--hf", "none", "--no-slowdown", "--no-plots"])
    assert rc == 2


@pytest.mark.slow  # over ~30 s on a 2-core CI machine: `make test-slow`
def test_transformers_difference_is_reported_not_fatal(tiny_pool_dirs, profile_path, tmp_path, monkeypatch):
    from specrouter.bench.report import write_report

    real = HFSystem.run

    def off_by_one(self, prompt_ids, decoding):
        out = real(self, prompt_ids, decoding)
        if self.kind == "hf-assisted":
            out.token_ids = [(out.token_ids[0] + 1) % 300] + out.token_ids[1:]
        return out

    monkeypatch.setattr(HFSystem, "run", off_by_one)
    cfg = tiny_config(tiny_pool_dirs, profile_path, tmp_path, workloads=("code",), temperatures=(0.0,),
                      hf="all", slowdown=False)
    result = run_bench(cfg, progress=False, log=lambda m: None)
    (s,) = result["scenarios"]
    assert s["hf_mismatch_requests"] == 1
    (mismatch,) = s["requests"][0]["mismatches"].items()
    assert mismatch[0] == "HF assisted" and mismatch[1]["first_difference"] == 0
    assert mismatch[1]["tokens"] == mismatch[1]["reference_tokens"]
    paths = write_report(result, tmp_path)
    assert "HF assisted from token 0" in paths["markdown"].read_text()


def test_slowdown_multiplies_a_model_forward_time_and_is_removed():
    class Runner:
        def forward(self, batch):
            time.sleep(0.01)
            return batch

    runner = Runner()
    pool = SimpleNamespace(runners={"m": runner}, drafters={}, order=["m"])
    slow = Slowdown("m", 3.0).install(pool)

    def timed():
        t0 = time.perf_counter()
        assert runner.forward(7) == 7
        return time.perf_counter() - t0

    assert timed() < 0.025
    slow.active = True
    assert timed() >= 0.029
    slow.remove()
    assert "forward" not in vars(runner) and timed() < 0.025
    with pytest.raises(ValueError, match="no model"):
        Slowdown("x", 2.0).install(pool)


def test_a_pool_with_a_draft_head_runs_specrouter_without_it_side_by_side(tiny_pool_dirs, tmp_path):
    """Issue 18's end-to-end comparison: with a draft head in the pool the bench runs the head's
    static chains and SpecRouter without the head, on the same requests, and reports the ratio
    and its goal; greedy outputs are checked identical across them."""
    from test_head_level import _save_head

    d = tiny_pool_dirs
    head = _save_head(d["target"], tmp_path / "head", noise=0.01)
    cfg = tiny_config(d, str(tmp_path / "profile.json"), tmp_path / "out", workloads=("code",),
                      temperatures=(0.0,), hf="none", slowdown=False, peers=False,
                      models=(str(d["draft"]), str(d["target"]), str(head)))
    result = run_bench(cfg, progress=False, log=lambda m: None)
    (s,) = result["scenarios"]
    tps = {n: e["tokens_per_second"] for n, e in s["systems"].items()}
    assert "head>target k=4" in tps and "head>draft>target k=4" in tps
    assert s["ratios"]["specrouter/no_head"] == tps["SpecRouter"] / tps["SpecRouter (no head)"]
    assert len({e["tokens"] for e in s["systems"].values()}) == 1  # greedy: the same tokens everywhere
    from specrouter.bench.report import evaluate_goals

    goal = next(g for g in evaluate_goals(result) if g["goal"].startswith("head:"))
    assert goal["value"] == s["ratios"]["specrouter/no_head"] and goal["met"] == (goal["value"] >= 1.3)


@pytest.mark.slow  # over ~30 s on a 2-core CI machine: `make test-slow`
def test_multiturn_and_templated_run_with_the_prefix_cache_on_and_off_side_by_side(tiny_pool_dirs, tmp_path):
    """Issue 29's bench: the multi-turn stream re-sends each system's own replies, target-only
    and SpecRouter also run with the prefix cache (the same greedy tokens as every system
    without it, checked by the bench), their later turns and retries take the earlier prompt
    from the cache while every other system recomputes it, and the goals and table come out."""
    from specrouter.bench.report import evaluate_goals, markdown

    d = tiny_pool_dirs
    cfg = tiny_config(d, str(tmp_path / "profile.json"), tmp_path / "out", workloads=("multiturn", "templated"),
                      prompts_per_type=2, temperatures=(0.0,), hf="none", slowdown=False, peers=False)
    result = run_bench(cfg, progress=False, log=lambda m: None)
    multi, templated = result["scenarios"]
    reqs = multi["requests"]
    assert [r["turn"] for r in reqs] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    for i, r in enumerate(reqs):
        sent = r["prompt_tokens_sent"]
        assert len(set(sent.values())) == 1  # greedy: every system re-sent the same conversation
        for name, cached in r["cached_tokens"].items():
            if name not in ("target-only +cache", "SpecRouter +cache"):
                assert cached == 0, (name, r)
            elif r["turn"] > 0:  # at least the previous turn's prompt (its reply too where the
                # text re-tokenizes as generated; the tiny model's random tokens often do not)
                assert reqs[i - 2]["prompt_tokens_sent"][name] - 2 <= cached < sent[name], (name, r)
            else:  # a first turn: at most the chat template's opening, shared with another conversation
                assert cached < 0.5 * sent[name], (name, r)
        assert r["first_token_seconds"]["target-only"] > 0
    later = [r for r in multi["requests"] if r["turn"] > 0]
    assert later[-1]["prompt_tokens_sent"]["target-only"] > later[0]["prompt_tokens_sent"]["target-only"]
    retries = [r for r in templated["requests"] if r["kind"] == "retry"]
    assert retries and all(r["cached_tokens"]["SpecRouter +cache"] == r["prompt_tokens"] - 1 for r in retries)
    assert all(r["cached_tokens"]["target-only"] == 0 for r in templated["requests"])
    for s in (multi, templated):
        assert len({e["tokens"] for e in s["systems"].values()}) == 1  # greedy: the same tokens everywhere
        assert s["systems"]["SpecRouter +cache"]["kind"] == "adaptive+cache"
        assert s["best_static"]["system"] not in ("target-only +cache", "SpecRouter +cache")
        pc = s["prefix_cache"]
        assert 0 < pc["parked_bytes_max"] <= pc["budget_bytes"] and pc["hits"] > 0
    goals = {g["goal"]: g for g in evaluate_goals(result)}
    ttft = goals["prefix cache: multi-turn turns 2+ time to first token >= 5x lower (target-only)"]
    e = multi["systems"]
    assert ttft["value"] == e["target-only"]["first_token_s_later_turns"] / e["target-only +cache"]["first_token_s_later_turns"]
    assert "prefix cache: an exactly repeated request >= 3x plain decoding without cache" in goals
    assert goals["prefix cache: parked KV within the budget (fraction used at most)"]["met"]
    assert "## Prefix cache" in markdown({**result, "goals": list(goals.values())})


def test_target_only_runs_on_the_fastest_plain_path_and_the_process_path_stays_the_greedy_reference(
        tiny_pool_dirs, tmp_path):
    """Where another kernel path decodes plainly faster (here forced: `plain_path`), the bench's
    "target-only" row, the base of every "x target-only" ratio, runs there; SpecRouter's greedy
    tokens are still checked against target-only on its own path, a row of its own."""
    from specrouter.bench.run import setup
    from specrouter.models.runners.kernels import kernel_path

    here = kernel_path()
    if here == "torch":
        pytest.skip("the process already runs on torch's kernels: no second path to force")
    d = tiny_pool_dirs
    cfg = tiny_config(d, str(tmp_path / "profile.json"), tmp_path, dtype="float32", workloads=("code",),
                      temperatures=(0.0,), hf="none", slowdown=False, peers=False, prefix_cache=False,
                      plain_path="torch")
    h = setup(cfg, progress=False, log=lambda m: None)
    assert h.target_only.name == "target-only" and h.target_only.exact is False
    assert h.target_only.pool.runners["target"]._ops is None  # torch's kernels
    assert h.reference.name == f"target-only {here} (greedy reference)" and h.reference.exact
    assert h.reference.pool.runners["target"]._ops is not None  # the native path, as SpecRouter's
    assert set(h.plain_path.step_ms) == {here, "torch"} and all(ms > 0 for ms in h.plain_path.step_ms.values())
    result = run_bench(cfg, progress=False, log=lambda m: None, harness=h)
    (s,) = result["scenarios"]
    tps = {n: e["tokens_per_second"] for n, e in s["systems"].items()}
    assert s["ratios"]["specrouter/target_only"] == tps["SpecRouter"] / tps["target-only"]
    assert result["meta"]["plain_path"]["path"] == "torch"
    assert result["meta"]["plain_path"]["process_path"] == here
    # the process's path: no second row, no second copy
    cfg2 = dataclasses.replace(cfg, plain_path="process")
    h2 = setup(cfg2, progress=False, log=lambda m: None)
    assert h2.reference is h2.target_only and h2.plain_path is None
    assert not any("greedy reference" in s.name for s in h2.systems)
    with pytest.raises(ValueError, match="plain_path"):
        dataclasses.replace(cfg, plain_path="sse9")
