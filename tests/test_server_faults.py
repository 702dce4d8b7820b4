"""Fault injection: a model that raises or hangs is taken out of the chain, the rows finish with
the rest of the chain, and the output is still exactly the target's greedy output. A hang is
the server's (its watchdog retires the engine thread and a new one carries on: faults.py)."""

import asyncio
import threading
import time

import pytest

from specrouter.config import SamplingParams
from specrouter.engine.engine import Engine
from specrouter.engine.faults import ForwardWatch, ModelFailure, Retired, guard_runners
from specrouter.models.pool import Pool

NAMES = ("draft", "mid", "target")
PROMPTS = [[5, 6, 7, 8, 9, 10], [40, 41, 42], [100, 7, 100, 7, 100, 7, 100], [12, 250, 31, 77, 9],
           [3, 4, 5, 3, 4, 5, 3, 4], [200, 201]]


def load_pool(dirs):
    return Pool.load([dirs[n] for n in NAMES], names=list(NAMES), target="target", dtype="float64")


@pytest.fixture(scope="module")
def reference(tiny_pool_dirs):
    """Target-only greedy output of each prompt alone (48 tokens, EOS ignored)."""
    pool = load_pool(tiny_pool_dirs)
    out = {}
    for p in PROMPTS:
        seq = Engine(pool).generate_ids([p], [SamplingParams(max_new_tokens=48, ignore_eos=True)],
                                        chain=("target",))[0]
        out[tuple(p)] = seq.output_ids
    return out


class Flaky:
    """Wraps a runner's forward: raises (or hangs for `hang` seconds) on calls N, 2N, ..."""

    def __init__(self, forward, every: int, hang: float = 0.0):
        self.forward, self.every, self.hang = forward, every, hang
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, batch):
        with self.lock:
            self.calls += 1
            bad = self.calls % self.every == 0
        if bad and self.hang:
            time.sleep(self.hang)
        elif bad:
            raise RuntimeError(f"injected failure on call {self.calls}")
        return self.forward(batch)


def flaky_pool(dirs, model, every, hang=0.0):
    pool = load_pool(dirs)
    flaky = Flaky(pool.runners[model].forward, every, hang)
    pool.runners[model].forward = flaky  # the runner's own forward, as a crash inside it would be
    return pool, flaky


def guarded_pool(dirs, model, every, hang=0.0, timeout=None):
    pool, flaky = flaky_pool(dirs, model, every, hang)
    pool.runners = guard_runners(pool.runners, ForwardWatch(timeout) if timeout else None)
    return pool, flaky


def run_all(eng, requests):
    seqs = [eng.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True), chain=c, k=k)
            for p, n, c, k in requests]
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        assert steps < 500
    return seqs


@pytest.mark.parametrize("timeout", [None, 5.0])
def test_engine_drops_a_raising_model_and_stays_exact(tiny_pool_dirs, reference, timeout):
    pool, flaky = guarded_pool(tiny_pool_dirs, "mid", every=4, timeout=timeout)
    failures = []
    eng = Engine(pool, max_num_seqs=6, max_model_len=96)
    eng.on_model_failure = failures.append
    chains = [("ngram", "draft", "mid", "target"), ("mid", "target"), ("ngram", "mid", "target")]
    reqs = [(p, 40, chains[i % 3], 2 + i % 3) for i, p in enumerate(PROMPTS)]
    seqs = run_all(eng, reqs)
    for s, (p, n, _, _) in zip(seqs, reqs):
        assert s.finish_reason == "length" and s.output_ids == reference[tuple(p)][:n]
    assert eng.failed_models == {"mid"} and len(failures) == 1
    assert failures[0].model == "mid" and failures[0].kind == "exception"
    assert flaky.calls == 4  # never called again once out
    assert eng.state.live() == []


def test_engine_target_exception_ends_rows_with_error(tiny_pool_dirs, reference):
    pool, flaky = guarded_pool(tiny_pool_dirs, "target", every=3)
    eng = Engine(pool, max_num_seqs=4, max_model_len=96)
    seqs = run_all(eng, [(PROMPTS[0], 30, ("draft", "target"), 3), (PROMPTS[1], 30, ("draft", "target"), 3)])
    assert [s.finish_reason for s in seqs] == ["error", "error"]
    assert eng.failed_models == set() and eng.state.live() == []
    flaky.every = 10**9  # the target recovers: it was not taken out, new requests run
    (s,) = run_all(eng, [(PROMPTS[2], 30, ("mid", "target"), 2)])
    assert s.output_ids == reference[tuple(PROMPTS[2])][:30]


def test_the_watchdog_retires_a_hung_forward_and_its_thread_touches_nothing(tiny_pool_dirs):
    """A forward past its deadline: the watchdog marks the runner failed and reports the thread;
    when the forward returns, the guard raises Retired in that thread (a BaseException); a
    forward within its deadline is not touched (the control)."""
    pool, flaky = flaky_pool(tiny_pool_dirs, "draft", every=2, hang=0.6)
    watch = ForwardWatch(0.2)
    pool.runners = guard_runners(pool.runners, watch)
    hung, seen = threading.Event(), {}

    def on_hang(failure, thread):
        seen["failure"], seen["thread"] = failure, thread
        hung.set()

    def forward():
        try:
            seen["out"] = pool.runners["draft"].forward(batch)
        except BaseException as e:  # noqa: BLE001 - what the thread saw
            seen["raised"] = e

    from specrouter.models.runners.base import ForwardBatch

    pool.runners["draft"].reserve(1, 16)
    batch = ForwardBatch.build([0], [0], [[5, 6, 7]], [[2]])
    watch.start(on_hang)
    try:
        t = threading.Thread(target=forward)
        t.start()
        t.join(5)  # call 1: in time
        assert "out" in seen and not hung.is_set()
        t = threading.Thread(target=forward)
        t.start()  # call 2 hangs 0.6 s
        assert hung.wait(5) and seen["thread"] is t and t.is_alive()
        assert seen["failure"].model == "draft" and seen["failure"].kind == "timeout"
        with pytest.raises(ModelFailure, match="timeout"):
            pool.runners["draft"].forward(batch)  # refused at once from now on
        t.join(5)
        assert isinstance(seen["raised"], Retired) and watch.retired == [t]
    finally:
        watch.stop()
    assert flaky.calls == 2


# -- through the server ------------------------------------------------------------------------
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from specrouter.server import ServerConfig, create_app  # noqa: E402
from specrouter.server.live import LiveServer  # noqa: E402


def _failures(text: str) -> dict[tuple[str, str], float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("specrouter_model_failures_total{"):
            labels, value = line.split("} ")
            kv = dict(x.split("=") for x in labels.split("{")[1].split(","))
            out[(kv["model"].strip('"'), kv["kind"].strip('"'))] = float(value)
    return out


def _serve_and_check(pool, reference, timeout, concurrency=6):
    """Serve `pool`, send every prompt (half streamed) concurrently twice; check outputs."""
    # the chain is pinned: no router (its start-up profile sweep would call the flaky model)
    app = create_app(pool, ServerConfig(chain=("ngram", "draft", "mid", "target"), k=3,
                                        max_num_seqs=4, max_model_len=96, model_timeout=timeout,
                                        adaptive=False))
    with LiveServer(app) as srv:
        client = openai.AsyncOpenAI(base_url=srv.base_url, api_key="-", max_retries=0, timeout=60)

        async def one(i, p):
            kw = dict(model="target", prompt=p, max_tokens=32, temperature=0,
                      extra_body={"ignore_eos": True})
            if i % 2:
                text_ids = []
                async for c in await client.completions.create(stream=True, **kw):
                    text_ids.append(c.choices[0].text)
                text = "".join(text_ids)
            else:
                text = (await client.completions.create(**kw)).choices[0].text
            return p, text

        async def main():
            sem = asyncio.Semaphore(concurrency)

            async def bounded(i, p):
                async with sem:
                    return await one(i, p)

            try:
                return await asyncio.wait_for(
                    asyncio.gather(*(bounded(i, p) for i, p in enumerate(PROMPTS * 2))), 120)
            finally:
                await client.close()

        results = asyncio.run(main())
        tok = pool.tokenizer
        for p, text in results:
            assert text == tok.decode(reference[tuple(p)][:32], skip_special_tokens=True), p
        import urllib.request

        metrics = urllib.request.urlopen(srv.url + "/metrics", timeout=10).read().decode()
        health = urllib.request.urlopen(srv.url + "/health", timeout=10).read().decode()
        engine = app.state.server.engine
        assert engine.state.live() == []
    for t in app.state.server.loop_engine.retired:  # engine threads left in a hung forward
        t.join(10)  # its forward returned: the thread unwound (Retired) and ended
        assert not t.is_alive()
    return _failures(metrics), health


def test_server_survives_a_draft_raising_every_nth_call(tiny_pool_dirs, reference):
    pool, flaky = flaky_pool(tiny_pool_dirs, "draft", every=7)
    failures, health = _serve_and_check(pool, reference, timeout=10.0)
    assert failures == {("draft", "exception"): 1.0} and flaky.calls == 7
    assert '"failed_models":["draft"]' in health and '"status":"ok"' in health


def test_server_survives_a_hanging_verifier(tiny_pool_dirs, reference):
    pool, flaky = flaky_pool(tiny_pool_dirs, "mid", every=5, hang=1.5)
    failures, health = _serve_and_check(pool, reference, timeout=0.5)
    assert failures == {("mid", "timeout"): 1.0} and flaky.calls == 5
    assert '"failed_models":["mid"]' in health


def test_server_with_a_hung_target_ends_its_requests_and_reports_it(tiny_pool_dirs):
    """A hung target is fatal: the request in flight ends with an error, the target is out, later
    requests end with an error at once, and /health says so. The governor off (`team_governor`):
    the new engine thread recovers without one."""
    pool, flaky = flaky_pool(tiny_pool_dirs, "target", every=3, hang=1.5)
    app = create_app(pool, ServerConfig(chain=("draft", "target"), k=2, max_num_seqs=2,
                                        max_model_len=96, model_timeout=0.5, adaptive=False,
                                        team_governor=False))
    import urllib.error
    import urllib.request

    with LiveServer(app) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="-", max_retries=0, timeout=30)
        for _ in range(2):
            with pytest.raises(openai.APIError):
                client.completions.create(model="target", prompt=PROMPTS[0], max_tokens=32,
                                          temperature=0, extra_body={"ignore_eos": True})
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(srv.url + "/health", timeout=10)
        metrics = urllib.request.urlopen(srv.url + "/metrics", timeout=10).read().decode()
    assert health.value.code == 503
    assert _failures(metrics) == {("target", "timeout"): 1.0} and flaky.calls == 3
    (retired,) = app.state.server.loop_engine.retired
    retired.join(10)
    assert not retired.is_alive()
