"""`specrouter bench --serve`: the real server under concurrent load.

A `specrouter serve` subprocess on 127.0.0.1 (a free port) is driven by the `openai` async client
at each concurrency level with the same mixed request stream (code, prose, chat, extraction),
greedy and at t=0.7, for every system in one run, one system after another per level; router
and plain run `rounds` times per level, alternating which goes first (so neither is always the
first after a level change), and their figures pool the rounds:
- `router`: the adaptive router (no chain in the request), on a `specrouter serve` server;
- `plain`: plain continuous batching of the target on a SECOND server started with the router
  off (`--static --chain target`: no router, no shadow proposals, no router bookkeeping), so the
  router-vs-plain ratio is against what a user would run without SpecRouter's routing;
- `static <chain>`: each static chain of the pool up to 3 levels at draft length `k`; the best
  of them per (temperature, concurrency) in hindsight is reported as `best static`.
Per system and level: throughput (generated tokens / wall time of the level), time to first
token and time per output token (per request: (last - first token time) / (tokens - 1)),
p50 and p99. Greedy outputs are checked identical across systems (exit status 2 otherwise).
The server beside the library (issue 34): on the same prompts, greedy, the bench process runs
the Python API itself (`SpecRouter.generate`, one request at a time, each system on its own pool
view) for the plain chain and the router, and the engine's own continuous batching of the same
requests at concurrency 4 (and 8), PAIRED with the live servers: at concurrency 1 request i goes
to the library, to the server through the `openai` client, through a bare HTTP client
(bench/raw_client.py) and through the bare client not streamed (`stream: false`, "whole") back to
back, in rotating order, over the requests `rounds` times (each round every side afresh); at
c >= 4 a batch of the engine and a level of the server through each client rotate `rounds` times.
The bare client's row is the server's own speed: on 2 cores the `openai` client's CPU (~0.6-1.2
ms a chunk) comes out of the server's share; streamed / whole (both through the bare client) is
the goal "streaming costs nothing extra". The servers run
with the default `--max-num-seqs` (8; more for higher levels), as users start them. Library and
server figures are then taken in the same minutes, so the drift of a shared machine (its speed
varies by +-20% between minutes) cancels; a library run minutes after the servers stopped gave
ratios of 0.84x and 1.10x for the same code. The `library` table puts each library figure beside
its paired server figures.
Output: serve.json, serve.md and serve.png (throughput and p99 latency vs concurrency).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from dataclasses import replace as dataclasses_replace
from pathlib import Path
from typing import TypeVar

from specrouter.bench.paired import describe as describe_pairs
from specrouter.bench.paired import paired
from specrouter.bench.serve_steps import (StepClock, StepKinds, Steps, at_library_step, kinds_markdown, kinds_summary,
                                          server_steps, split)
from specrouter.bench.workloads import CHAT, CODE, EXTRACTION, PROSE

T = TypeVar("T")


@dataclass(frozen=True)
class ServeBenchConfig:
    """What `specrouter bench --serve` runs."""

    models: tuple[str, ...] | None = None  # pool paths (None: the embedded default pool)
    target: str | None = None  # target name or path (None: the largest)
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16)  # concurrent clients per level
    requests: int = 16  # requests per system per level (at least the concurrency)
    max_new_tokens: int = 64
    temperatures: tuple[float, ...] = (0.0, 0.7)
    k: int = 4  # draft length of the static chains
    static_levels: int = 3  # deepest static chain
    threads: int | None = None  # torch threads of the server (None: torch's default)
    dtype: str = "auto"
    out_dir: str = "bench-out/serve"
    plots: bool = True
    seed: int = 0  # request i of a level samples with seed + i
    rounds: int = 2  # router and plain per level, alternating which goes first (statics once)
    startup_timeout: float = 600.0  # seconds for the server to load the pool (and sweep)
    stream_interval: int | None = None  # the servers' --stream-interval (None: `specrouter serve`'s default)
    team_governor: bool = True  # False: the servers run with --no-team-governor (engine/contention.py)
    fresh_rounds: int = 0  # > 0: issue 34's lines on fresh processes every round instead (bench/serve_fresh.py)

    @staticmethod
    def quick_preset(**over) -> "ServeBenchConfig":
        base = dict(concurrency=(1, 2, 4), requests=4, max_new_tokens=16, temperatures=(0.0, 0.7), rounds=1)
        base.update(over)
        return ServeBenchConfig(**base)


@dataclass
class RequestResult:
    text: str
    tokens: int
    ttft: float  # seconds from send to the first content chunk
    tpot: float | None  # seconds per output token after the first
    seconds: float


@dataclass
class LevelResult:
    system: str
    temperature: float
    concurrency: int
    tokens_per_s: float
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float | None
    tpot_p99: float | None
    wall: float = 0.0  # seconds of the level (all its rounds)
    results: list[RequestResult] = field(default_factory=list)


def level_result(system: str, temperature: float, concurrency: int, wall: float,
                 done: list[RequestResult]) -> LevelResult:
    return LevelResult(system=system, temperature=temperature, concurrency=concurrency,
                       tokens_per_s=sum(r.tokens for r in done) / wall,
                       ttft_p50=quantile([r.ttft for r in done], 0.5), ttft_p99=quantile([r.ttft for r in done], 0.99),
                       tpot_p50=quantile([r.tpot for r in done], 0.5), tpot_p99=quantile([r.tpot for r in done], 0.99),
                       wall=wall, results=done)


def pooled(runs: list[LevelResult]) -> LevelResult:
    """One system's rounds at one level as one result: tokens over the summed wall time,
    quantiles over every request."""
    first = runs[0]
    return level_result(first.system, first.temperature, first.concurrency,
                        sum(r.wall for r in runs), [x for r in runs for x in r.results])


# new tokens of each warm-up request (bench/serve_fresh.py `warm`, bench/library_worker.py, `library_level`)
WARM_TOKENS = 4


def prompts(n: int) -> list[tuple[str, bool]]:
    """The mixed stream: (prompt, chat?) alternating code, prose, chat, extraction."""
    kinds = [(CODE, False), (PROSE, False), (CHAT, True), (EXTRACTION, True)]
    out = []
    for i in range(n):
        pool, chat = kinds[i % 4]
        out.append((pool[(i // 4) % len(pool)], chat))
    return out


def quantile(xs: list[float], q: float) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# ---------------------------------------------------------------------------------------------
# the server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cfg: ServeBenchConfig, models: list[str], port: int, log, *, plain: bool = False,
                 name: str = "server", extra: list[str] = ()) -> subprocess.Popen:
    """A `specrouter serve` subprocess; `plain`: the router off (`--static --chain target`);
    `extra`: more `serve` flags (bench/serve_shared.py: `--no-prefix-cache`)."""
    from specrouter.config import ServerConfig

    cmd = [sys.executable, "-m", "specrouter.cli.main", "serve", "--models", *models,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", cfg.dtype,
           # the default flags' batch (8), or more for higher levels: a c=1 run measures the server
           # users start, not one reserved for a single row
           "--max-num-seqs", str(max(ServerConfig().max_num_seqs, *cfg.concurrency)),
           "--max-queue", str(4 * cfg.requests + 64),
           "--log-level", "warning",
           # every (system, temperature, concurrency) sends its own API key: the suffix drafter
           # learns only from the requests that run served, never from another system's outputs
           # of the same prompts (which would make every later run look faster)
           "--suffix-scope", "api-key"]
    if cfg.target:
        cmd += ["--target", cfg.target]
    if plain:
        cmd += ["--static", "--chain", "target"]
    if cfg.stream_interval is not None:
        cmd += ["--stream-interval", str(cfg.stream_interval)]
    if not cfg.team_governor:
        cmd += ["--no-team-governor"]
    cmd += list(extra)
    env = dict(os.environ)
    if cfg.threads:
        env["OMP_NUM_THREADS"] = str(cfg.threads)
    log(f"starting: {' '.join(cmd)}")
    Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
    log_path = Path(cfg.out_dir) / f"{name}.log"
    errors = open(log_path, "w")  # a pipe nobody reads could fill up
    errors.write(f"$ {' '.join(cmd)}\n")
    errors.flush()
    proc = subprocess.Popen(cmd, env=env, stdout=errors, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + cfg.startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text()[-2000:]
            raise RuntimeError(f"the server exited ({proc.returncode}): {tail}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("the server did not become healthy in time")


def stop_servers(procs: list[subprocess.Popen]) -> None:
    """Terminate the bench's servers, then wait for each (killed after 30 s)."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def server_info(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
        return json.loads(r.read())


# ---------------------------------------------------------------------------------------------
# the clients


def request_body(model: str, cfg: ServeBenchConfig, i: int, prompt: str, chat: bool) -> dict:
    """Request i of the mixed stream, greedy, for the bare client (bench/raw_client.py)."""
    return dict(model=model, max_tokens=cfg.max_new_tokens, temperature=0.0, seed=cfg.seed + i, ignore_eos=True,
                **({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}))


async def one_request(client, model: str, prompt: str, chat: bool, temperature: float, max_tokens: int,
                      seed: int, extra: dict) -> RequestResult:
    t0 = time.perf_counter()
    kw = dict(model=model, max_tokens=max_tokens, temperature=temperature, stream=True, seed=seed,
              extra_body=dict(extra, ignore_eos=True), stream_options={"include_usage": True})
    if chat:
        stream = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw)
    else:
        stream = await client.completions.create(prompt=prompt, **kw)
    first = last = None
    parts, tokens = [], 0
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        piece = c.delta.content if chat else c.text
        if piece:
            now = time.perf_counter()
            first = first if first is not None else now
            last = now
            parts.append(piece)
    end = time.perf_counter()
    ttft = (first if first is not None else end) - t0
    tpot = (last - first) / (tokens - 1) if first is not None and tokens > 1 else None
    return RequestResult("".join(parts), tokens, ttft, tpot, end - t0)


async def at_most(c: int, n: int, job: Callable[[int], Awaitable[T]]) -> list[T]:
    """`await job(i)` for i = 0..n-1 with at most `c` running at once, started in order (c clients,
    each taking the next request when its last one finished): the results in order."""
    out: list = [None] * n
    todo = iter(range(n))  # shared by the workers: one event loop, no two take the same i

    async def worker():
        for i in todo:
            out[i] = await job(i)

    await asyncio.gather(*(worker() for _ in range(c)))
    return out


async def run_level(base_url: str, model: str, cfg: ServeBenchConfig, temperature: float, concurrency: int,
                    system: str, extra: dict, round_: int = 0, key: str | None = None) -> LevelResult:
    from openai import AsyncOpenAI

    # its own learned statistics (--suffix-scope): no round learns from another's outputs
    key = key or f"bench|{system}|t={temperature}|c={concurrency}|round={round_}"
    client = AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=600)
    reqs = prompts(max(cfg.requests, concurrency))

    def request(i: int):
        prompt, chat = reqs[i]
        return one_request(client, model, prompt, chat, temperature, cfg.max_new_tokens, cfg.seed + i, extra)

    t0 = time.perf_counter()
    results = await at_most(concurrency, len(reqs), request)
    wall = time.perf_counter() - t0
    await client.close()
    return level_result(system, temperature, concurrency, wall, [r for r in results if r is not None])


def static_chains(order: list[str], target: str, levels: int, heads=()) -> list[tuple[str, ...]]:
    from specrouter.config import NGRAM, SUFFIX
    from specrouter.router.cost_model import enumerate_chains

    first_only = {NGRAM, SUFFIX, *heads}  # model-free drafters and draft heads: first level only
    return [c for c in enumerate_chains(order, target, levels)
            if len(c) > 1 and not first_only.intersection(c[1:])]


# ---------------------------------------------------------------------------------------------
# the run


def run_serve_bench(cfg: ServeBenchConfig, log=print) -> dict:
    from specrouter.models.default_pool import default_pool_paths

    models = list(cfg.models) if cfg.models else [str(p) for p in default_pool_paths()]
    port, plain_port = free_port(), free_port()
    procs = [start_server(cfg, models, port, log)]
    try:
        procs.append(start_server(cfg, models, plain_port, log, plain=True, name="server-plain"))
        info = server_info(port)
        card = info["data"][0]
        model, order, target = card["id"], card["specrouter"]["pool"], card["specrouter"]["target"]
        systems = {"router": {}, "plain": {}}
        heads = card["specrouter"].get("heads", ())
        for chain in static_chains(order, target, cfg.static_levels, heads):
            systems["static " + ">".join(chain)] = {"specrouter_chain": list(chain), "specrouter_k": cfg.k}
        base = f"http://127.0.0.1:{port}/v1"
        bases = {name: base for name in systems} | {"plain": f"http://127.0.0.1:{plain_port}/v1"}
        for b in set(bases.values()):
            asyncio.run(run_level(b, model, ServeBenchConfig(requests=1, max_new_tokens=4), 0.0, 1, "warm-up", {}))
        levels: list[LevelResult] = []
        # (t, c, system) -> its server's steps by kind over the level's rounds (serve_steps.StepKinds)
        kinds: dict[tuple[float, int, str], StepKinds] = {}
        mismatches = []
        for temperature in cfg.temperatures:
            for c in cfg.concurrency:
                runs: dict[str, list[LevelResult]] = {name: [] for name in systems}
                for r in range(max(1, cfg.rounds)):
                    # round 0: every system; later rounds: router and plain, alternating first
                    names = list(systems) if r == 0 else ("plain", "router") if r % 2 else ("router", "plain")
                    for name in names:
                        before = StepKinds.read(bases[name])
                        lv = asyncio.run(run_level(bases[name], model, cfg, temperature, c, name,
                                                   systems[name], r))
                        key, span = (temperature, c, name), StepKinds.read(bases[name]) - before
                        kinds[key] = kinds.get(key, StepKinds()) + span
                        runs[name].append(lv)
                        steps = kinds_summary(span)["kinds"]
                        log(f"t={temperature} c={c} {name} (round {r + 1}): {lv.tokens_per_s:.1f} tok/s, "
                            f"ttft p50 {lv.ttft_p50 * 1e3:.0f} ms, tpot p99 "
                            f"{(lv.tpot_p99 or 0) * 1e3:.0f} ms; steps " + ", ".join(
                                f"{kind} {x['steps']} ({x['step_ms']:.1f} ms, {x['tokens_per_step']:.2f} tok)"
                                for kind, x in steps.items()))
                levels += [pooled(rs) for rs in runs.values()]
                if temperature == 0.0:
                    ref = runs["plain"][0].results
                    for name, rs in runs.items():
                        for lv in rs:
                            for i, (a, b) in enumerate(zip(ref, lv.results)):
                                if a.text != b.text:
                                    mismatches.append({"system": name, "concurrency": c, "request": i})
        # paired with the servers, while they run (the library table)
        library = library_runs(cfg, models, target, log, servers=bases, model=model) \
            if 0.0 in cfg.temperatures else []
    finally:
        stop_servers(procs)
    if 0.0 in cfg.temperatures:  # the library's greedy texts are the servers' (same prompts)
        served = {(lv.system, lv.concurrency): lv for lv in levels if lv.temperature == 0.0}
        for run in library:
            lv = served.get((run["system"], run["server_concurrency"]))
            others = [run["server_texts"], run["raw_server_texts"], run["whole_server_texts"]] + \
                ([[x.text for x in lv.results]] if lv is not None else [])
            for texts in others:
                for i, (a, b) in enumerate(zip(run["texts"], texts)):
                    if a != b:
                        mismatches.append({"system": f"library {run['name']}", "concurrency": run["concurrency"],
                                           "request": i})
    return summarize(cfg, levels, mismatches, models, library, kinds)


# ---------------------------------------------------------------------------------------------
# the library beside the server


def library_runs(cfg: ServeBenchConfig, models: list[str], target: str, log, *, servers: dict[str, str],
                 model: str) -> list[dict]:
    """The Python API on the same greedy requests in this process, PAIRED with the running
    servers (`servers`: system -> base URL): `SpecRouter.generate` one request at a time (plain
    chain, router), request i to the library, to the server with the `openai` client and to the
    server with a bare HTTP client (bench/raw_client.py: the server's own speed, without the
    `openai` client's CPU on the same cores) back to back, in rotating order; and the engine's
    own continuous batching of the requests at each concurrency level >= 4 (plain chain),
    rotating with a level of the plain server through each client, `rounds` times. Each library
    run on its own view of the pool, each server run with its own API key (nothing learned from
    another run's outputs)."""
    import torch
    from openai import AsyncOpenAI

    from specrouter.api import SpecRouter
    from specrouter.config import PoolConfig, RouterConfig, SamplingParams
    from specrouter.models.pool import Pool, preview_pool
    from specrouter.router.setup import build_router
    from specrouter.server.threads import release_omp_team_here

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    pcfg = PoolConfig(models=tuple(models), target=cfg.target, dtype=cfg.dtype)
    preview = preview_pool(pcfg)
    pool = Pool.from_config(pcfg, paths=list(preview.paths))
    sr = SpecRouter(pool)
    reqs_all = prompts(max(cfg.requests, *cfg.concurrency))
    ids_all = [sr.encode(p, chat=chat) for p, chat in reqs_all]
    params = SamplingParams(temperature=0.0, max_new_tokens=cfg.max_new_tokens, ignore_eos=True)
    loop = asyncio.new_event_loop()
    out = []

    clients: dict[tuple[str, str], AsyncOpenAI] = {}

    def served(system: str, key: str, reqs: list[tuple[str, bool]], c: int) -> tuple[float, list[RequestResult]]:
        """Wall time and results of `reqs` sent to the server, at most `c` at once."""
        if c > 1:
            lv = loop.run_until_complete(run_level(servers[system], model, dataclasses_replace(cfg, requests=len(reqs)),
                                                   0.0, c, system, {}, key=key))
            return lv.wall, lv.results
        if (system, key) not in clients:  # one client (and connection) per paired run, as run_level
            clients[system, key] = AsyncOpenAI(base_url=servers[system], api_key=key, max_retries=0, timeout=600)
        client = clients[system, key]
        t0 = time.perf_counter()
        done = [loop.run_until_complete(one_request(client, model, p, chat, 0.0, cfg.max_new_tokens, cfg.seed + i, {}))
                for i, (p, chat) in enumerate(reqs)]
        return time.perf_counter() - t0, done

    def served_raw(system: str, key: str, reqs: list[tuple[str, bool]], c: int,
                   stream: bool = True) -> tuple[float, list[RequestResult]]:
        """`served` through the bare HTTP client (bench/raw_client.py), at most `c` at once;
        `stream=False`: whole responses (`stream: false`)."""
        from specrouter.bench.raw_client import stream_request, whole_request

        async def request(i: int) -> RequestResult:
            p, chat = reqs[i]
            body = request_body(model, cfg, i, p, chat)
            if stream:
                text, tokens, first, seconds = await stream_request(servers[system], body, chat, api_key=key)
            else:
                text, tokens, seconds = await whole_request(servers[system], body, chat, api_key=key)
                first = seconds  # the whole text comes at the end
            return RequestResult(text, tokens, first, None, seconds)

        t0 = time.perf_counter()
        results = loop.run_until_complete(at_most(c, len(reqs), request))
        return time.perf_counter() - t0, results

    def served_whole(system: str, key: str, reqs: list[tuple[str, bool]], c: int) -> tuple[float, list[RequestResult]]:
        return served_raw(system, key, reqs, c, stream=False)

    sides = {"server": served, "raw": served_raw, "whole": served_whole}  # a server side's client

    def measured(into: "Side", fn, system: str, key: str, reqs: list[tuple[str, bool]], c: int,
                 latest: bool = False) -> None:
        """`fn(system, key, reqs, c)` (served / served_raw) into `into`, with the server's engine
        steps over it (its /metrics, read outside the timed region) and the client's CPU."""
        before, cpu = server_steps(servers[system]), time.thread_time()
        wall, res = fn(system, key, reqs, c)
        cpu = time.thread_time() - cpu
        into.add(sum(x.tokens for x in res), wall, [x.text for x in res], server_steps(servers[system]) - before,
                 client_cpu=cpu, latest=latest)

    def one_by_one(name: str, system: str, chain):
        """Request i to every side back to back (rotating order), over the requests `rounds`
        times: at c=1 a request's sides are a pair, and on this VM a pair's ratio spreads by
        +-15-25% (docs/serving-performance.md, ninth round): a median over 8 pairs moved by
        several points between runs. Each round starts every side afresh (the library on a new
        view of the pool, each server side with its own API key): none learns from an earlier
        round's outputs of the same prompts."""
        lib, by = Side(), {who: Side() for who in sides}
        reqs = reqs_all[:cfg.requests]
        for rnd in range(max(1, cfg.rounds)):
            view = pool.with_fresh_drafters()
            router = None if chain else build_router(view, progress=False, config=RouterConfig())
            api = SpecRouter(view, router)
            api.generate(ids_all[0][:8], max_new_tokens=4, chain=chain)  # warm-up
            if api.engine.prefix_cache is not None:  # its parked prompt is request 0's first 8 tokens:
                api.engine.prefix_cache.clear()  # the server (its own API key) cannot hit it
            release_omp_team_here()  # this thread stays idle while the server runs: no second team
            clock = StepClock(api.engine)
            key = f"bench|paired|{name}|{rnd}"
            for i, req in enumerate(reqs):
                for who in rotation(rnd * len(reqs) + i):
                    if who == "library":
                        # from the prompt's text, as the server's wall time includes its tokenizing
                        # and chat template (the same token ids: the greedy texts are compared)
                        before = clock.steps
                        t0 = time.perf_counter()
                        r = api.generate(req[0], chat=req[1], max_new_tokens=cfg.max_new_tokens, chain=chain,
                                         ignore_eos=True)[0]
                        lib.add(len(r.token_ids), time.perf_counter() - t0, [r.text], clock.steps - before)
                        release_omp_team_here()
                    else:
                        measured(by[who], sides[who], system, key + ("" if who == "server" else f"|{who}"), [req], 1)
            clock.close()
        out.append({"name": name, "system": system, "concurrency": 1, "server_concurrency": 1,
                    **lib.fields(""), **sides_fields(by)})
        log(f"library {name}: {lib.tps:.1f} tok/s; paired server {by['server'].tps:.1f} tok/s "
            f"(openai client), {by['raw'].tps:.1f} tok/s (raw HTTP client), {by['whole'].tps:.1f} tok/s (whole)")

    def batched(c: int):
        n_req = max(cfg.requests, c)
        ids = ids_all[:n_req]
        lib, by = Side(), {who: Side() for who in sides}
        cached = 0  # prompt tokens the library's rows read from its prefix cache (0: a fair prefill)
        for r in range(max(1, cfg.rounds)):
            for who in rotation(r):
                if who == "library":
                    seqs, wall, steps = library_level(pool.with_fresh_drafters(), ids, params, c)
                    lib.add(sum(len(s.output_ids) for s in seqs), wall,
                            [sr.tokenizer.decode(s.output_ids, skip_special_tokens=True) for s in seqs],
                            steps, latest=True)
                    cached += sum(s.stats.cached_tokens for s in seqs)
                    release_omp_team_here()
                else:
                    measured(by[who], sides[who], "plain",
                             f"bench|paired|engine c={c}|{r}" + ("" if who == "server" else f"|{who}"),
                             reqs_all[:n_req], c, latest=True)
        out.append({"name": f"engine plain c={c}", "system": "plain", "concurrency": c, "server_concurrency": c,
                    **lib.fields(""), **sides_fields(by),
                    "library_cached_tokens": cached})
        log(f"library engine plain c={c}: {lib.tps:.1f} tok/s; paired server {by['server'].tps:.1f} tok/s "
            f"(openai client), {by['raw'].tps:.1f} tok/s (raw HTTP client), {by['whole'].tps:.1f} tok/s (whole)")

    try:
        if 1 in cfg.concurrency:
            one_by_one("API plain", "plain", (pool.target,))
            if len(pool.order) > 1:
                one_by_one("API router", "router", None)
        for c in cfg.concurrency:
            if c >= 4:
                batched(c)
    finally:
        for client in clients.values():
            loop.run_until_complete(client.close())
        loop.close()
    return out


@dataclass
class Side:
    """One side of a paired library run (the library, the server through a client): tokens, wall
    seconds and engine steps summed over its units (requests or rounds), each unit's tok/s (the
    sides' unit u ran back to back: bench/paired.py), its greedy texts (every request's, or the
    latest round's), the client's CPU seconds (a server side)."""

    tokens: int = 0
    wall: float = 0.0
    steps: Steps = field(default_factory=Steps)
    units: int = 0
    client_cpu: float = 0.0
    texts: list[str] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)  # tok/s of each unit, in the order they ran

    def add(self, tokens: int, wall: float, texts: list[str], steps: Steps, client_cpu: float = 0.0,
            latest: bool = False) -> None:
        self.tokens += tokens
        self.wall += wall
        self.steps += steps
        self.units += 1
        self.rates.append(tokens / wall if wall > 0 else 0.0)
        self.client_cpu += client_cpu
        self.texts = list(texts) if latest else self.texts + list(texts)

    @property
    def tps(self) -> float:
        return self.tokens / self.wall

    def fields(self, prefix: str) -> dict:
        """Its entries of a library run's record (`prefix`: "", "server_" or "raw_server_")."""
        out = {f"{prefix}tokens_per_s": self.tps, f"{prefix}wall": self.wall, f"{prefix}texts": self.texts,
               f"{prefix}unit_tps": self.rates,
               **{f"{prefix}{k}": v for k, v in split(self.wall, self.steps, self.units).items()}}
        if not prefix:
            out["tokens"] = self.tokens
        else:
            out[f"{prefix}client_cpu_ms"] = self.client_cpu / self.units * 1e3 if self.units else None
        return out


# the sides of a paired run: the library, the server through the openai client (streamed), through
# the bare client streamed ("raw") and not streamed ("whole"); their fields' prefixes
SIDES = ("library", "server", "raw", "whole")
PREFIX = {"library": "", "server": "server_", "raw": "raw_server_", "whole": "whole_server_"}


def sides_fields(by: dict[str, "Side"]) -> dict:
    """The record entries of a paired run's server sides (each under its PREFIX)."""
    return {k: v for who, side in by.items() for k, v in side.fields(PREFIX[who]).items()}


def rotation(i: int) -> tuple[str, ...]:
    """The order of the paired runs of request i (c = 1) or round r (c >= 4): each side goes
    first in turn."""
    k = i % len(SIDES)
    return SIDES[k:] + SIDES[:k]


def library_level(view, ids: list[list[int]], params, concurrency: int) -> tuple[list, float, Steps]:
    """The library side of a level: the engine's own continuous batching of `ids` on `view`'s
    target, at most `concurrency` rows at once, on a new engine warmed at that batch size (the
    server's levels warmed the server's), then its parked prompts dropped: they are the first 8
    tokens of the measured ones, and prefix hits the server's run (its own API key) cannot have
    cut the library's prefill by a fifth (docs/serving-performance.md, fifth round). Returns
    (sequences in order, wall seconds, the engine steps inside)."""
    from specrouter.config import SamplingParams
    from specrouter.engine.engine import Engine

    engine = Engine(view, max_num_seqs=concurrency,
                    max_model_len=max(len(x) for x in ids) + params.max_new_tokens + 16)
    warm = SamplingParams(temperature=0.0, max_new_tokens=WARM_TOKENS, ignore_eos=True)
    engine.generate_ids([x[:8] for x in ids[:concurrency]], [warm] * min(concurrency, len(ids)),
                        chain=(view.target,), k=1)
    if engine.prefix_cache is not None:
        engine.prefix_cache.clear()
    clock = StepClock(engine)
    try:
        t0 = time.perf_counter()
        seqs = continuous_batching(engine, ids, params, concurrency, (view.target,))
        wall = time.perf_counter() - t0
    finally:
        clock.close()
    return seqs, wall, clock.steps


def continuous_batching(engine, ids: list[list[int]], params, concurrency: int, chain) -> list:
    """Every request through `engine` with at most `concurrency` rows running, admitted in order
    as rows finish (what the server does, without the server)."""
    waiting, running, done = list(range(len(ids))), {}, {}
    while waiting or running:
        while waiting and len(running) < concurrency:
            i = waiting.pop(0)
            running[i] = engine.add_request(ids[i], params, chain=chain, k=1)
        engine.step()
        for i, seq in list(running.items()):
            if seq.done:
                done[i] = running.pop(i)
    return [done[i] for i in range(len(ids))]


SPLIT_KEYS = ("step_ms", "steps", "outside_ms", "client_cpu_ms")  # a side's split (bench/serve_steps.py)


def library_rows(levels: list[LevelResult], library: list[dict]) -> list[dict]:
    """Each library run beside the server's figure of the same system, level and prompts."""
    served = {(lv.system, lv.concurrency): lv for lv in levels if lv.temperature == 0.0}
    rows = []
    for run in library:
        lv = served.get((run["system"], run["server_concurrency"]))
        server = run.get("server_tokens_per_s") or (lv.tokens_per_s if lv is not None else None)
        raw, whole = run.get("raw_server_tokens_per_s"), run.get("whole_server_tokens_per_s")
        by_side = split_of(run)
        rows.append({"library": run["name"], "system": run["system"], "concurrency": run["concurrency"],
                     "library_tps": run["tokens_per_s"], "server_tps": server,
                     "server_vs_library": server / run["tokens_per_s"] if server else None,
                     "raw_server_tps": raw, "raw_vs_library": raw / run["tokens_per_s"] if raw else None,
                     # the server's whole responses (bare client, `stream: false`): streamed / whole
                     "whole_server_tps": whole, "whole_vs_library": whole / run["tokens_per_s"] if whole else None,
                     "streamed_vs_whole": raw / whole if raw and whole else None,
                     # the same ratios unit by unit (bench/paired.py): median, range, pairs
                     "paired": {"server": paired(run.get("server_unit_tps", ()), run.get("unit_tps", ())),
                                "raw": paired(run.get("raw_server_unit_tps", ()), run.get("unit_tps", ())),
                                "whole": paired(run.get("whole_server_unit_tps", ()), run.get("unit_tps", ())),
                                "streamed_vs_whole": paired(run.get("raw_server_unit_tps", ()),
                                                            run.get("whole_server_unit_tps", ()))},
                     # prompt tokens the library's batch read from its prefix cache (0: fair)
                     "library_cached_tokens": run.get("library_cached_tokens"),
                     # where the time goes (bench/serve_steps.py): per side, its mean engine step,
                     # steps and ms outside the steps per unit (request at c=1, level at c>=4), and
                     # the client's CPU ms per unit on the same cores
                     "split": by_side,
                     # each server side / the library with its steps at the library's step speed
                     "at_library_step": {side: at_library_step(by_side["library"], by_side[side]) for side in SIDES[1:]}})
    return rows


def split_of(run: dict) -> dict:
    """A library run's split per side (bench/serve_steps.py `split`)."""
    return {side: {k: run.get(PREFIX[side] + k) for k in SPLIT_KEYS} for side in SIDES}


def summarize(cfg: ServeBenchConfig, levels: list[LevelResult], mismatches: list, models: list[str],
              library: list[dict] | None = None, kinds: dict | None = None) -> dict:
    """The bench's result; `kinds`: (t, c, system) -> StepKinds of that system's server over the
    level (each row then says why: router and plain steps by kind, the router's plans)."""
    rows = []
    kinds = kinds or {}
    for temperature in cfg.temperatures:
        for c in cfg.concurrency:
            here = {lv.system: lv for lv in levels if lv.temperature == temperature and lv.concurrency == c}
            statics = [lv for name, lv in here.items() if name.startswith("static ")]
            best = max(statics, key=lambda lv: lv.tokens_per_s) if statics else None
            router, plain = here["router"], here["plain"]
            rows.append({
                "temperature": temperature, "concurrency": c,
                "router_tps": router.tokens_per_s, "plain_tps": plain.tokens_per_s,
                "best_static": best.system[len("static "):] if best else None,
                "best_static_tps": best.tokens_per_s if best else None,
                "router_vs_plain": router.tokens_per_s / plain.tokens_per_s,
                "router_tpot_p99": router.tpot_p99, "plain_tpot_p99": plain.tpot_p99,
                "router_ttft_p50": router.ttft_p50, "plain_ttft_p50": plain.ttft_p50,
                **{f"{name}_steps": kinds_summary(kinds[temperature, c, name])
                   for name in ("router", "plain") if (temperature, c, name) in kinds},
            })
    ratios = [r["router_vs_plain"] for r in rows]
    low = [r["router_vs_plain"] for r in rows if r["concurrency"] <= 2]
    at4 = [r["router_vs_plain"] for r in rows if r["concurrency"] == 4]
    tpot_ok = all(r["router_tpot_p99"] is None or r["plain_tpot_p99"] is None
                  or r["router_tpot_p99"] <= r["plain_tpot_p99"] for r in rows)
    goals = [
        {"goal": "router >= 0.97x plain at every level (required)", "value": min(ratios), "met": min(ratios) >= 0.97},
        {"goal": ">= 1.3x plain at concurrency 1-2", "value": min(low) if low else None,
         "met": bool(low) and min(low) >= 1.3},
        {"goal": "p99 time per output token no worse than plain", "value": None, "met": tpot_ok},
        {"goal": "moonshot >= 1.15x plain at concurrency 4", "value": min(at4) if at4 else None,
         "met": bool(at4) and min(at4) >= 1.15},
        {"goal": "greedy outputs identical across systems", "value": len(mismatches), "met": not mismatches},
    ]
    lib = library_rows(levels, library or [])

    def ratios(key: str, pair: str, c1: bool | None) -> list[float]:
        """A ratio of every library row (c=1 only, c > 1 only, or all): the median of its paired
        units (bench/paired.py: one stalled unit does not decide it), else the pooled one."""
        out = []
        for r in lib:
            if c1 is not None and (r["concurrency"] == 1) != c1:
                continue
            p = (r.get("paired") or {}).get(pair)
            value = p["median"] if p else r.get(key)
            if value:
                out.append(value)
        return out

    at1, batched = ratios("server_vs_library", "server", True), ratios("server_vs_library", "server", False)
    raw1, raw_b = ratios("raw_vs_library", "raw", True), ratios("raw_vs_library", "raw", False)
    streamed = ratios("streamed_vs_whole", "streamed_vs_whole", None)
    # the server's own cost, plain chain (the same steps on every side; the router's sides choose their chains)
    own = [r["at_library_step"]["raw"] for r in lib
           if r["concurrency"] == 1 and r["system"] == "plain" and (r.get("at_library_step") or {}).get("raw")]
    if at1:
        goals.append({"goal": "server >= 0.95x the Python API at concurrency 1 (greedy; openai client; "
                              "median of paired requests)",
                      "value": min(at1), "met": min(at1) >= 0.95})
    if raw1:
        goals.append({"goal": "server >= 0.95x the Python API at concurrency 1 (greedy; raw HTTP client; "
                              "median of paired requests)",
                      "value": min(raw1), "met": min(raw1) >= 0.95})
    if own:
        goals.append({"goal": "server >= 0.95x the Python API at concurrency 1 at the library's step speed (plain "
                              "chain, raw HTTP client; what the server adds: its extra steps and the time outside them)",
                      "value": min(own), "met": min(own) >= 0.95})
    if batched:
        goals.append({"goal": "server >= 0.95x the engine's own batching at concurrency >= 4 (openai client; median of "
                              "paired rounds)",
                      "value": min(batched), "met": min(batched) >= 0.95})
    if raw_b:
        goals.append({"goal": "server >= 0.95x the engine's own batching at concurrency >= 4 (raw HTTP client; "
                              "median of paired rounds)",
                      "value": min(raw_b), "met": min(raw_b) >= 0.95})
    if streamed:
        goals.append({"goal": "streamed >= 0.95x whole responses (the server through the raw HTTP client; median of "
                              "pairs)",
                      "value": min(streamed), "met": min(streamed) >= 0.95})
    from specrouter.bench.provenance import provenance

    return {"provenance": provenance(), "config": asdict(cfg), "models": models, "load_average": os.getloadavg()[0],
            "cores": os.cpu_count(), "rows": rows, "library": lib, "goals": goals, "mismatches": mismatches,
            "levels": [asdict(lv) for lv in levels]}


def table(caption: str, head: list[str], rows: list[list[str]]) -> list[str]:
    """The lines of a captioned markdown table."""
    return ["", caption, "", "| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |",
            *("| " + " | ".join(row) + " |" for row in rows)]


def markdown(result: dict) -> str:
    def f(x, scale=1.0, d=1):
        return "-" if x is None else f"{x * scale:.{d}f}"

    from specrouter.bench.provenance import describe

    prov = result.get("provenance")
    lines = ["# specrouter bench --serve", "",
             f"Provenance: {describe(prov)}." if prov else "Provenance: not recorded.", "",
             f"load average {result['load_average']:.2f} on {result['cores']} cores", "",
             "| t | concurrency | router tok/s | plain tok/s | router / plain | best static (tok/s) | "
             "TTFT p50 router / plain (ms) | TPOT p99 router / plain (ms) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        lines.append(f"| {r['temperature']} | {r['concurrency']} | {f(r['router_tps'])} | {f(r['plain_tps'])} | "
                     f"{r['router_vs_plain']:.2f}x | {r['best_static']} ({f(r['best_static_tps'])}) | "
                     f"{f(r['router_ttft_p50'], 1e3, 0)} / {f(r['plain_ttft_p50'], 1e3, 0)} | "
                     f"{f(r['router_tpot_p99'], 1e3, 0)} / {f(r['plain_tpot_p99'], 1e3, 0)} |")
    lines += kinds_markdown(result["rows"])
    if result.get("library"):
        lines += ["", "The server beside the library (greedy, same prompts, paired: each library run interleaved with "
                      "the server's through the openai client and through a bare HTTP client, bench/raw_client.py; "
                      "plain = the router-off server):", "",
                  "| library run | concurrency | library tok/s | server tok/s (openai client) | server / library | "
                  "server tok/s (raw HTTP client) | raw / library | whole responses tok/s (raw client) | "
                  "streamed (raw) / whole |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in result["library"]:
            ratio = "-" if r["server_vs_library"] is None else f"{r['server_vs_library']:.2f}x"
            raw = "-" if r.get("raw_vs_library") is None else f"{r['raw_vs_library']:.2f}x"
            sw = "-" if r.get("streamed_vs_whole") is None else f"{r['streamed_vs_whole']:.2f}x"
            lines.append(f"| {r['library']} | {r['concurrency']} | {f(r['library_tps'])} | "
                         f"{f(r['server_tps'])} | {ratio} | {f(r.get('raw_server_tps'))} | {raw} | "
                         f"{f(r.get('whole_server_tps'))} | {sw} |")
    if any(r.get("paired") for r in result.get("library") or ()):
        lines += table("The same ratios unit by unit (bench/paired.py; a unit = a request at c=1, a round at c>=4, its "
                       "sides run back to back): median of the paired ratios (lowest-highest, pairs). A pooled ratio "
                       "far from its median, or a wide range, means the machine moved during the run:",
                       ["library run", "server / library (openai)", "raw / library", "whole / library",
                        "streamed / whole"],
                       [[r["library"], *(describe_pairs((r.get("paired") or {}).get(k))
                                         for k in ("server", "raw", "whole", "streamed_vs_whole"))]
                        for r in result["library"]])
    if any(r.get("split") for r in result.get("library") or ()):
        lines += table("Where the time goes (bench/serve_steps.py; per unit = a request at c=1, a level at c>=4): each "
                       "side's mean engine step, steps per unit, ms per unit outside the steps, the client's CPU "
                       "ms per unit (on the same cores), and the side / the library with the side's steps at the "
                       "library's step speed (what the server adds; a step's speed moves between processes here):",
                       ["library run", "side", "step ms", "steps", "outside steps, ms", "client CPU ms",
                        "/ library at its step"],
                       [[r["library"], side, f(x["step_ms"], 1, 2), f(x["steps"], 1, 1), f(x["outside_ms"], 1, 1),
                         f(x["client_cpu_ms"], 1, 1), f((r.get("at_library_step") or {}).get(side), 1, 3)]
                        for r in result["library"] for side, x in (r.get("split") or {}).items()])
    lines += goal_lines(result["goals"])
    return "\n".join(lines) + "\n"


def goal_lines(goals: list[dict], digits: int = 2) -> list[str]:
    """A result's goals as a markdown table (after a blank line): goal, value, met."""
    out = ["", "| goal | value | met |", "| --- | --- | --- |"]
    for g in goals:
        v = "-" if g["value"] is None else (f"{g['value']:.{digits}f}" if isinstance(g["value"], float)
                                            else str(g["value"]))
        out.append(f"| {g['goal']} | {v} | {'yes' if g['met'] else 'no'} |")
    return out


def plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for t in sorted({r["temperature"] for r in result["rows"]}):
        rows = [r for r in result["rows"] if r["temperature"] == t]
        cs = [r["concurrency"] for r in rows]
        for key, label, style in (("router", "router", "-o"), ("plain", "plain", "--s")):
            axes[0].plot(cs, [r[f"{key}_tps"] for r in rows], style, label=f"{label} t={t}")
            axes[1].plot(cs, [(r[f"{key}_tpot_p99"] or 0) * 1e3 for r in rows], style, label=f"{label} t={t}")
        axes[0].plot(cs, [r["best_static_tps"] or 0 for r in rows], ":^", label=f"best static t={t}")
    axes[0].set(xlabel="concurrent clients", ylabel="tokens/s", xscale="log", title="throughput")
    axes[1].set(xlabel="concurrent clients", ylabel="ms", xscale="log", title="p99 time per output token")
    levels = sorted({r["concurrency"] for r in result["rows"]})
    for ax in axes:
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_json_and_markdown(result: dict, out_dir: str | Path, stem: str, text: str) -> list[Path]:
    """`result` as `{stem}.json` and `text` as `{stem}.md` in `out_dir` (made if missing)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json", out / f"{stem}.md"]
    paths[0].write_text(json.dumps(result, indent=1))
    paths[1].write_text(text)
    return paths


def write(result: dict, out_dir: str | Path, plots: bool = True) -> list[Path]:
    out = Path(out_dir)
    paths = write_json_and_markdown(result, out, "serve", markdown(result))
    if plots:
        paths.append(plot(result, out / "serve.png"))
    return paths
