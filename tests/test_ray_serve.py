"""Scale-out on Ray Serve.

Without Ray (default suite): the `--ray-*` flags map onto the deployment options; the metrics
of several replicas merge into one exposition.

Marked `ray` (`make test-ray`, which installs the ray extra): a local Ray cluster on 127.0.0.1
with 2 CPU replicas of a tiny pool behind Serve's HTTP proxy. Concurrent requests through the
official `openai` client (completions and chat, streamed and not) equal target-only greedy
decoding; /metrics shows both replicas; one replica is killed mid-load and every request still
completes with the exact output (requests in flight on the killed replica fail and are sent
again, as a client would; Serve sends new requests to the survivor and restarts the replica);
`specrouter serve --ray` itself starts, answers and stops cleanly. Everything is shut down.
"""

import argparse
import concurrent.futures as cf
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from fixtures import free_port, load_named_pool

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from specrouter.cli import serve as cli_serve  # noqa: E402
from specrouter.config import SamplingParams  # noqa: E402
from specrouter.engine.engine import Engine  # noqa: E402
from specrouter.models.tokenizer import apply_chat_template  # noqa: E402
from specrouter.server import ServerConfig  # noqa: E402
from specrouter.server.ray_serve import (  # noqa: E402
    REPLICA_HEADER,
    PoolSpec,
    RayServeConfig,
    replica_options,
)

HAVE_RAY = importlib.util.find_spec("ray") is not None  # found, not imported: see start_local_ray


def ray_test(fn):
    """Marked `ray` (not in the default suite); skipped with the reason when ray is absent."""
    skip = pytest.mark.skipif(not HAVE_RAY, reason="ray is not installed: `make test-ray` "
                              "installs the ray extra (pip install 'specrouter[ray]')")
    quiet = pytest.mark.filterwarnings("ignore:Using extra keyword arguments on `Field`")  # ray's
    return pytest.mark.ray(skip(quiet(fn)))


NAMES = ("draft", "mid", "target")
PROMPTS = ["def add(a, b):", "The quick brown fox", "class Point:\n    def __init__(self, x, y):",
           "User: What is the capital of France?\nAssistant:"]
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
RAY_ENV = {"RAY_AUTH_MODE": "disabled",  # no token file written under ~/.ray
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # the node registers 127.0.0.1


def _parser():
    p = argparse.ArgumentParser()
    cli_serve.register(p.add_subparsers(dest="command"))
    return p


# -- no Ray needed ------------------------------------------------------------------------------
def test_ray_flags_map_to_deployment_options():
    a = _parser().parse_args(["serve", "--models", "d", "t", "--ray", "--ray-replicas", "3",
                              "--ray-num-cpus", "2", "--ray-num-gpus", "1", "--max-num-seqs", "6"])
    assert a.ray and a.ray_address is None and not a.ray_detach
    pool_spec, rc = cli_serve.ray_configs(a)
    assert pool_spec == PoolSpec(paths=("d", "t"), device="cuda")  # --ray-num-gpus: the replica loads on CUDA
    assert (rc.num_replicas, rc.num_cpus, rc.num_gpus, rc.threads) == (3, 2.0, 1.0, 2)
    opts = replica_options(rc, ServerConfig(max_num_seqs=6, max_queue=10))
    assert opts["num_replicas"] == 3 and "autoscaling_config" not in opts
    assert opts["ray_actor_options"] == {"num_cpus": 2.0, "num_gpus": 1.0}
    assert opts["max_ongoing_requests"] == 12 and opts["max_queued_requests"] == 10
    # autoscaling: Serve's config passed through as given, replacing the fixed count
    auto = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8}
    a = _parser().parse_args(["serve", "--models", "t", "--ray", "--ray-autoscaling", json.dumps(auto),
                              "--ray-address", "auto", "--ray-num-cpus", "0.5"])
    _, rc = cli_serve.ray_configs(a)
    opts = replica_options(rc, ServerConfig())
    assert opts["autoscaling_config"] == auto and "num_replicas" not in opts
    assert rc.threads == 1 and a.ray_address == "auto"
    for bad in ("[1, 2]", "{not json"):
        with pytest.raises(SystemExit):
            _parser().parse_args(["serve", "--models", "t", "--ray", "--ray-autoscaling", bad])
    with pytest.raises(ValueError):
        RayServeConfig(num_replicas=0)


def test_ray_detach_needs_an_address(capsys):
    a = _parser().parse_args(["serve", "--models", "t", "--ray", "--ray-detach"])
    if not HAVE_RAY:
        assert cli_serve.cmd_serve(a) == 2 and "ray extra" in capsys.readouterr().err
        return
    assert cli_serve.cmd_serve(a) == 1 and "--ray-address" in capsys.readouterr().err


def test_replica_health_hook():
    """Serve's check_health: a dead engine thread or a target taken out fails it."""
    import asyncio
    from types import SimpleNamespace

    from specrouter.server.ray_serve import SpecRouterReplica

    rep = object.__new__(SpecRouterReplica)  # the hook alone; __init__ needs a Serve replica
    engine = SimpleNamespace(alive=True, error=None)
    rep._srv = SimpleNamespace(loop_engine=engine, target_down=False, pool=SimpleNamespace(target="t"))
    asyncio.run(rep.check_health())
    rep._srv.target_down = True
    with pytest.raises(RuntimeError, match="target model 't'"):
        asyncio.run(rep.check_health())
    engine.alive, engine.error = False, ValueError("boom")
    with pytest.raises(RuntimeError, match="engine thread is not running.*boom"):
        asyncio.run(rep.check_health())


def test_replica_metrics_merge():
    from prometheus_client.parser import text_string_to_metric_families

    from specrouter.server.metrics import ServerMetrics
    from specrouter.server.replica_metrics import render, snapshot

    a, b = ServerMetrics(), ServerMetrics()
    a.requests.labels("/v1/completions", "200").inc(3)
    b.requests.labels("/v1/completions", "200").inc(5)
    b.forward_seconds.labels("target").observe(0.02)
    text = render([snapshot(a.registry, {"replica": "r1", "node": "n1"}),
                   snapshot(b.registry, {"replica": "r2", "node": "n2"})]).decode()
    assert text.count("# TYPE specrouter_requests_total counter") == 1
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    got = {s.labels["replica"]: s.value for s in fams["specrouter_requests"].samples
           if s.name == "specrouter_requests_total"}
    assert got == {"r1": 3.0, "r2": 5.0}
    counts = [s for s in fams["specrouter_forward_seconds"].samples
              if s.name == "specrouter_forward_seconds_count"]
    assert [(s.labels["replica"], s.labels["model"], s.value) for s in counts] == [("r2", "target", 1.0)]


# -- a local Ray cluster ------------------------------------------------------------------------
@ray_test
def test_cli_serve_ray_subprocess(tiny_pool_dirs):
    """`specrouter serve --ray` starts its own local cluster, answers, and stops it on SIGINT.
    First of the `ray` tests: the module's cluster (a fixture) does not exist yet."""
    d = tiny_pool_dirs
    port = free_port()
    env = {**os.environ, **RAY_ENV, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "specrouter.cli.main", "serve", "--ray", "--ray-replicas", "1",
           "--ray-num-cpus", "0.5", "--models", str(d["mid"]), str(d["target"]), "--target",
           "target", "--dtype", "float64", "--port", str(port), "--max-model-len", "128",
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    lines: list[bytes] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, b"")),
                              daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 180
        # up when it says so (every replica running), not when the proxy first answers
        while not any(b"SpecRouter on Ray Serve" in line for line in lines):
            assert proc.poll() is None, b"".join(lines).decode()[-3000:]
            assert time.monotonic() < deadline, "the Ray app did not come up"
            time.sleep(0.5)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as r:
            assert r.status == 200
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0,
                               timeout=60)
        r = client.completions.create(model="target", prompt="def add(a, b):", max_tokens=8,
                                      temperature=0)
        assert r.usage.completion_tokens >= 1
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        reader.join(10)
        proc.stdout.close()
    out = b"".join(lines).decode()
    assert proc.returncode == 0, out[-3000:]
    assert "stopping" in out


@pytest.fixture(scope="module")
def ref_pool(tiny_pool_dirs):
    return load_named_pool(tiny_pool_dirs, NAMES)


@pytest.fixture(scope="module")
def expected(ref_pool):
    """Target-only greedy text of every prompt (completions) and of MESSAGES (chat)."""
    def greedy(ids, n):
        seq = Engine(ref_pool).generate_ids([ids], [SamplingParams(max_new_tokens=n)],
                                            chain=("target",))[0]
        return ref_pool.tokenizer.decode(seq.output_ids, skip_special_tokens=True)

    tok = ref_pool.tokenizer
    out = {p: greedy(tok(p, add_special_tokens=False)["input_ids"], 48) for p in PROMPTS}
    out["chat"] = greedy(apply_chat_template(tok, MESSAGES), 48)
    return out


@pytest.fixture(scope="module")
def cluster(tiny_pool_dirs):
    """2 replicas (0.5 CPU, 1 torch thread each) on a local 2-CPU Ray cluster; shut down after."""
    saved = {k: os.environ.get(k) for k in RAY_ENV}
    os.environ.update(RAY_ENV)
    from specrouter.server.ray_serve import deploy, start_local_ray

    start_local_ray(num_cpus=2, object_store_mb=200)
    import ray
    from ray import serve

    try:
        port = free_port()
        rc = RayServeConfig(num_replicas=2, num_cpus=0.5, torch_threads=1, metrics_push_s=1.0,
                            health_check_period_s=2.0, health_check_timeout_s=10.0)
        deploy(PoolSpec(paths=tuple(str(tiny_pool_dirs[n]) for n in NAMES), names=NAMES,
                        target="target", dtype="float64"),
               ServerConfig(max_num_seqs=4, max_model_len=256), rc, host="127.0.0.1", port=port)
        yield {"url": f"http://127.0.0.1:{port}", "rc": rc, "ray": ray, "serve": serve}
    finally:
        serve.shutdown()
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _client(cluster):
    return openai.OpenAI(base_url=cluster["url"] + "/v1", api_key="-", max_retries=0, timeout=60)


def _one(client, kind: str, prompt: str, max_tokens: int) -> tuple[str, str | None]:
    """One request; (text, replica that answered: None when streamed). Raises if incomplete."""
    if kind == "chat":
        r = client.chat.completions.with_raw_response.create(
            model="target", messages=MESSAGES, max_tokens=max_tokens, temperature=0)
        return r.parse().choices[0].message.content, r.headers.get(REPLICA_HEADER)
    if kind == "chat-stream":
        chunks = list(client.chat.completions.create(model="target", messages=MESSAGES,
                                                     max_tokens=max_tokens, temperature=0, stream=True))
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    elif kind == "stream":
        chunks = list(client.completions.create(model="target", prompt=prompt,
                                                max_tokens=max_tokens, temperature=0, stream=True))
        finish = chunks[-1].choices[0].finish_reason if chunks else None
        text = "".join(c.choices[0].text for c in chunks)
    else:
        r = client.completions.with_raw_response.create(model="target", prompt=prompt,
                                                        max_tokens=max_tokens, temperature=0)
        return r.parse().choices[0].text, r.headers.get(REPLICA_HEADER)
    if finish is None:  # the stream broke off before its last chunk
        raise ConnectionError("incomplete stream")
    return text, None


def _jobs(n: int):
    kinds = ("plain", "stream", "chat", "chat-stream")
    return [(kinds[i % 4], PROMPTS[(i // 4) % len(PROMPTS)]) for i in range(n)]


def _want(expected, kind, prompt):
    return expected["chat"] if kind.startswith("chat") else expected[prompt]


def _metrics(cluster) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(cluster["url"] + "/metrics", timeout=30).read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


@ray_test
def test_replicas_answer_exactly_target_greedy(cluster, expected):
    client = _client(cluster)
    jobs = _jobs(32)
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda j: _one(client, j[0], j[1], 48), jobs))
    wall = time.perf_counter() - t0
    for (kind, prompt), (text, _) in zip(jobs, results):
        assert text == _want(expected, kind, prompt), (kind, prompt)
    served = {rep for _, rep in results if rep}
    print(f"\n32 requests x 48 tokens, 8 concurrent clients, 2 replicas: {wall:.2f} s, "
          f"{32 / wall:.1f} requests/s; non-streamed answered by {sorted(served)}")
    assert len(served) == 2  # both replicas took requests


@ray_test
def test_health_and_metrics_of_every_replica(cluster):
    serve = cluster["serve"]
    status = serve.status().applications[cluster["rc"].app_name]
    assert status.status == "RUNNING"
    assert status.deployments[cluster["rc"].deployment_name].replica_states == {"RUNNING": 2}
    with urllib.request.urlopen(cluster["url"] + "/health", timeout=30) as r:
        assert r.status == 200 and json.loads(r.read())["status"] == "ok"
    deadline = time.monotonic() + 30
    while True:  # the replica not scraped shows up after its next push (every second here)
        fams = _metrics(cluster)
        reqs = {s.labels["replica"] for s in fams["specrouter_requests"].samples
                if s.name == "specrouter_requests_total"}
        if len(reqs) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(reqs) == 2
    assert fams["specrouter_replicas"].samples[0].value == 2
    tokens = {s.labels["replica"]: s.value for s in fams["specrouter_generated_tokens"].samples
              if s.name == "specrouter_generated_tokens_total"}
    assert set(tokens) == reqs and all(v > 0 for v in tokens.values())
    assert all(s.labels["node"] == "127.0.0.1" for s in fams["specrouter_generated_tokens"].samples)


@ray_test
def test_killed_replica_mid_load_every_request_completes(cluster, expected):
    ray, serve, rc = cluster["ray"], cluster["serve"], cluster["rc"]
    client = _client(cluster)
    jobs = _jobs(64)
    done = threading.Semaphore(0)
    failures: list[tuple[int, str]] = []  # (job, what failed), one per failed attempt

    def run(i):
        kind, prompt = jobs[i]
        for _ in range(5):  # what a client does on a 5xx or a broken connection: send it again
            try:
                out = _one(client, kind, prompt, 48)
                done.release()
                return out
            except (openai.APIError, ConnectionError) as e:
                failures.append((i, f"{kind}: {type(e).__name__}"))
                time.sleep(0.2)
        raise AssertionError(f"{kind} {prompt!r} failed 5 times: {failures}")

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(run, i) for i in range(len(jobs))]
        for _ in range(12):  # mid-load: 12 of 64 done, 8 in flight
            assert done.acquire(timeout=120)
        victim = next(rep for f in futures if f.done() for _, rep in [f.result()] if rep)
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].endswith(f"#{victim}")]
        assert len(names) == 1, names
        ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
        killed_at = time.perf_counter() - t0
        results = [f.result(timeout=300) for f in futures]
    wall = time.perf_counter() - t0
    for (kind, prompt), (text, _) in zip(jobs, results):
        assert text == _want(expected, kind, prompt), (kind, prompt)
    after = {rep for _, rep in results[24:] if rep}
    failed_jobs = {i for i, _ in failures}
    print(f"\nkilled replica {victim} at {killed_at:.2f} s; 64 requests done in {wall:.2f} s; "
          f"{len(failed_jobs)} requests failed ({len(failures)} attempts) and were sent again: "
          f"{sorted(what for _, what in failures)}; later requests answered by {sorted(after)}")
    # only requests in flight on the killed replica fail: at most its max_ongoing_requests
    assert len(failed_jobs) <= replica_options(rc, ServerConfig(max_num_seqs=4))["max_ongoing_requests"]

    # Serve replaces the replica; the app is back to 2 running replicas, the victim gone
    deadline = time.monotonic() + 120
    while True:
        states = serve.status().applications[rc.app_name].deployments[rc.deployment_name].replica_states
        if states == {"RUNNING": 2} or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert states == {"RUNNING": 2}
    print(f"2 replicas running again {time.perf_counter() - t0 - killed_at:.1f} s after the kill")
    with cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda j: _one(client, j[0], j[1], 48), jobs[:16]))
    assert [t for t, _ in results] == [_want(expected, k, p) for k, p in jobs[:16]]
    assert victim not in {rep for _, rep in results if rep}
