"""The server step by step beside the library, c=1, plain chain, greedy (issue 34).

Plain servers (`specrouter serve --static --chain target`, each a subprocess of this file with a
trace) and `SpecRouter.generate` in this process get the same requests one at a time: request i
goes to every side back to back, in rotating order, `--rounds` times (a drifting machine: compare
only paired units). A server is `SLOTS:HANDOFF`: its `--max-num-seqs` and its engine thread's
hand-off (`written`: wait until the event loop wrote the step's chunks, the default;
`none`: `handoff_wait` 0), and `SLOTS:HANDOFF:slow` detokenizes through transformers' Python
`decode` (a window from the step before: the incremental decoder before the ninth round). Each server is driven by the bare HTTP client streamed (`raw`, arrival
time of every block), not streamed (`whole`) and the `openai` client.

The trace (perf_counter, CLOCK_MONOTONIC: one clock for every process): every `AsyncEngine._step`
(start, end, rows, torch threads, the engine thread's CPU seconds), every `_deliver` (start, end),
the loop's `_put_all`, every SSE chunk handed to the socket (`stream_delivery_seconds`); the
library's steps around `Engine.step`; each process's weights on transparent huge pages.

    python benchmarks/serve_trace.py [--servers 1:written 8:written 8:none] [--clients raw whole openai]
        [--requests 8] [--rounds 2] [--out bench-out/serve-trace]

Per side: tok/s, pooled and median paired ratio to the library (range), median decode step,
the gap between steps (p50), the hand-off (p50) and the commit-to-socket time of a chunk (p50),
ms a request outside the steps, client CPU ms; every greedy text is compared with the library's.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

pc = time.perf_counter


def serve_traced(argv: list[str]) -> int:
    """`specrouter serve argv` with the trace (module docstring), written to $TRACE_OUT at exit."""
    import signal

    import torch

    from specrouter.server import async_engine as ae
    from specrouter.server import metrics as mt

    trace: dict[str, list] = {"step": [], "deliver": [], "put": [], "sse": []}
    step, deliver, put_all = ae.AsyncEngine._step, ae.AsyncEngine._deliver, ae._put_all
    wait = os.environ.get("TRACE_HANDOFF_WAIT")
    if os.environ.get("TRACE_SLOW_DECODE"):  # the decoder before the ninth round (A/B in one run)
        import functools

        from specrouter.models import tokenizer as tk

        tk.text_decoder = lambda tok: (functools.partial(tok.decode, skip_special_tokens=True), False)

    def traced_step(self):
        t0, cpu = pc(), time.thread_time()
        rows = len(self.engine.running)
        out = step(self)
        trace["step"].append((t0, pc(), rows, torch.get_num_threads(), time.thread_time() - cpu))
        return out

    def traced_deliver(self, deliveries):
        t0 = pc()
        if wait is not None:
            self.handoff_wait = float(wait)
        deliver(self, deliveries)
        trace["deliver"].append((t0, pc(), len(deliveries)))

    def traced_put_all(items, loop, done):
        trace["put"].append((pc(), time.thread_time()))
        put_all(items, loop, done)

    class Delivery:  # stream_delivery_seconds, noting when each chunk reached the socket
        def __init__(self, hist):
            self.hist = hist

        def observe(self, v):
            trace["sse"].append((pc(), v, time.thread_time()))
            self.hist.observe(v)

    init = mt.ServerMetrics.__init__

    def traced_init(self, *a, **k):
        init(self, *a, **k)
        self.stream_delivery_seconds = Delivery(self.stream_delivery_seconds)

    ae.AsyncEngine._step, ae.AsyncEngine._deliver, ae._put_all = traced_step, traced_deliver, traced_put_all
    mt.ServerMetrics.__init__ = traced_init

    def dump(*_):
        Path(os.environ["TRACE_OUT"]).write_text(json.dumps(trace))
        os._exit(0)

    # uvicorn restores this handler after its shutdown and raises the signal again
    signal.signal(signal.SIGTERM, dump)
    from specrouter.cli.main import main

    code = main(["serve", *argv])
    dump()
    return code


def huge_pages_mib(pid: int) -> int | None:
    try:
        for line in open(f"/proc/{pid}/smaps_rollup"):
            if line.startswith("AnonHugePages"):
                return int(line.split()[1]) // 1024
    except OSError:
        return None
    return None


async def stream_timed(base: str, body: dict, chat: bool, key: str) -> tuple[str, int, float, list]:
    """A streamed request through a bare HTTP client: (text, tokens, send time, [(arrival, bytes)])."""
    from urllib.parse import urlsplit

    from specrouter.bench.raw_client import dechunk, parse_sse

    url = urlsplit(base)
    path = url.path.rstrip("/") + ("/chat/completions" if chat else "/completions")
    data = json.dumps(dict(body, stream=True, stream_options={"include_usage": True})).encode()
    t0 = pc()
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    writer.write(f"POST {path} HTTP/1.1\r\nHost: {url.hostname}:{url.port}\r\nAuthorization: Bearer {key}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n"
                 .encode() + data)
    await writer.drain()
    buf, arrivals = bytearray(), []
    while block := await reader.read(1 << 16):
        arrivals.append((pc(), len(block)))
        buf += block
    writer.close()
    text, tokens = parse_sse(dechunk(bytes(buf).partition(b"\r\n\r\n")[2]), chat)
    return text, tokens, t0, arrivals


def q(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--servers", nargs="+", default=["1:written", "8:written", "8:none"])
    ap.add_argument("--clients", nargs="+", default=["raw", "whole", "openai"])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default="bench-out/serve-trace")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from specrouter.api import SpecRouter
    from specrouter.bench.paired import describe, paired
    from specrouter.bench.raw_client import whole_request
    from specrouter.bench.serve import free_port, one_request, prompts, stop_servers
    from specrouter.bench.serve_steps import server_steps
    from specrouter.config import PoolConfig
    from specrouter.models.default_pool import default_pool_paths
    from specrouter.models.pool import Pool, preview_pool
    from specrouter.server.threads import release_omp_team_here

    models = [str(p) for p in default_pool_paths()]
    servers = {f"s{n}": spec for n, spec in enumerate(args.servers)}
    ports, procs = {}, {}
    for name, spec in servers.items():
        slots, handoff, *how = spec.split(":")
        ports[name] = free_port()
        env = dict(os.environ, TRACE_OUT=str(out / f"trace-{name}.json"))
        if handoff == "none":
            env["TRACE_HANDOFF_WAIT"] = "0"
        if how == ["slow"]:
            env["TRACE_SLOW_DECODE"] = "1"
        cmd = [sys.executable, __file__, "--serve-traced", "--models", *models, "--host", "127.0.0.1",
               "--port", str(ports[name]), "--max-num-seqs", slots, "--log-level", "warning",
               "--suffix-scope", "api-key", "--static", "--chain", "target"]
        procs[name] = subprocess.Popen(cmd, env=env, stdout=open(out / f"{name}.log", "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        for name, port in ports.items():
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                        break
                except OSError:
                    if procs[name].poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"server {name} did not start: {out / (name + '.log')}") from None
                    time.sleep(0.5)
        base = {name: f"http://127.0.0.1:{port}/v1" for name, port in ports.items()}
        pcfg = PoolConfig(models=tuple(models))
        pool = Pool.from_config(pcfg, paths=list(preview_pool(pcfg).paths))
        api = SpecRouter(pool.with_fresh_drafters())
        chain, reqs, new = (pool.target,), prompts(args.requests), args.max_new_tokens
        api.generate(reqs[0][0][:20], max_new_tokens=4, chain=chain)
        if api.engine.prefix_cache is not None:
            api.engine.prefix_cache.clear()
        release_omp_team_here()
        lib_steps: list[tuple[float, float]] = []
        inner = api.engine.step

        def timed_step():
            t0 = pc()
            r = inner()
            lib_steps.append((t0, pc()))
            return r

        api.engine.step = timed_step
        huge = {"library": huge_pages_mib(os.getpid()), **{n: huge_pages_mib(p.pid) for n, p in procs.items()}}
        from openai import AsyncOpenAI

        loop = asyncio.new_event_loop()
        clients = {n: AsyncOpenAI(base_url=b, api_key="trace|openai", max_retries=0, timeout=600) for n, b in base.items()}

        def body(i: int) -> tuple[bool, dict]:
            p, chat = reqs[i]
            return chat, dict(model="target", max_tokens=new, temperature=0.0, seed=i, ignore_eos=True,
                              **({"messages": [{"role": "user", "content": p}]} if chat else {"prompt": p}))

        for n in base:  # warm-up
            chat, b = body(0)
            loop.run_until_complete(whole_request(base[n], dict(b, max_tokens=4), chat, "warm"))
        sides = ["library"] + [f"{c}@{n}" for c in args.clients for n in servers]
        rec: dict[str, list[dict]] = {s: [] for s in sides}
        for rnd in range(args.rounds):
            for i in range(args.requests):
                k = (rnd * args.requests + i) % len(sides)
                for side in sides[k:] + sides[:k]:
                    chat, b = body(i)
                    if side == "library":
                        n0, t0 = len(lib_steps), pc()
                        r = api.generate(reqs[i][0], chat=chat, max_new_tokens=new, chain=chain, ignore_eos=True)[0]
                        t1 = pc()
                        release_omp_team_here()
                        rec[side].append(dict(i=i, rnd=rnd, t0=t0, t1=t1, tokens=len(r.token_ids), text=r.text,
                                              step_s=sum(e - s for s, e in lib_steps[n0:]), steps=len(lib_steps) - n0))
                        continue
                    client, n = side.split("@")
                    key = f"trace|{side}|{rnd}"
                    before, cpu = server_steps(base[n]), time.thread_time()
                    if client == "raw":
                        text, tokens, t0, arrivals = loop.run_until_complete(stream_timed(base[n], b, chat, key))
                        t1 = arrivals[-1][0]
                    elif client == "whole":
                        t0 = pc()
                        text, tokens, _ = loop.run_until_complete(whole_request(base[n], b, chat, key))
                        t1 = pc()
                    else:
                        t0 = pc()
                        rr = loop.run_until_complete(one_request(clients[n], "target", reqs[i][0], chat, 0.0, new, i, {}))
                        t1, text, tokens = pc(), rr.text, rr.tokens
                    cpu = time.thread_time() - cpu
                    d = server_steps(base[n]) - before
                    rec[side].append(dict(i=i, rnd=rnd, t0=t0, t1=t1, tokens=tokens, text=text, step_s=d.seconds,
                                          steps=d.count, client_cpu=cpu))
            print(f"round {rnd + 1} done {time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.2f}", flush=True)
        for c in clients.values():
            loop.run_until_complete(c.close())
    finally:
        stop_servers(list(procs.values()))
    (out / "runs.json").write_text(json.dumps({"servers": servers, "rec": rec, "library_steps": lib_steps,
                                               "huge_pages_mib": huge, "load": os.getloadavg()}))
    report(out, servers, rec, lib_steps, huge, describe, paired)


def report(out: Path, servers: dict, rec: dict, lib_steps: list, huge: dict, describe, paired) -> None:
    traces = {n: json.loads((out / f"trace-{n}.json").read_text()) for n in servers if (out / f"trace-{n}.json").exists()}
    lib = {(r["i"], r["rnd"]): r for r in rec["library"]}
    lib_rate = {k: r["tokens"] / (r["t1"] - r["t0"]) for k, r in lib.items()}
    lib_tps = sum(r["tokens"] for r in lib.values()) / sum(r["t1"] - r["t0"] for r in lib.values())
    print(f"servers: {servers}; weights on huge pages (MiB): {huge}")
    print("| side | tok/s | pooled x library | paired x library | decode step p50 ms | gap p50 ms | hand-off p50 ms "
          "| commit to socket p50 ms | loop: tokens to chunk, wall / CPU p50 ms | outside ms/req | client CPU ms "
          "| mismatches |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for side, rs in rec.items():
        tps = sum(r["tokens"] for r in rs) / sum(r["t1"] - r["t0"] for r in rs)
        pairs = paired([r["tokens"] / (r["t1"] - r["t0"]) for r in rs], [lib_rate[r["i"], r["rnd"]] for r in rs])
        mism = sum(r["text"] != lib[r["i"], r["rnd"]]["text"] for r in rs)
        outside = statistics.mean(r["t1"] - r["t0"] - r["step_s"] for r in rs) * 1e3
        cpu = statistics.mean(r.get("client_cpu", 0.0) for r in rs) * 1e3
        tr = {"step": lib_steps, "deliver": [], "sse": []} if side == "library" else \
            traces.get(side.split("@")[1], {"step": [], "deliver": [], "sse": []})
        starts = [x[0] for x in tr["step"]]
        steps, gaps, hand, sse, loop_wall, loop_cpu = [], [], [], [], [], []
        for r in rs:
            lo, hi = bisect.bisect_left(starts, r["t0"]), bisect.bisect_right(starts, r["t1"])
            win = tr["step"][lo:hi]
            steps += [(x[1] - x[0]) * 1e3 for x in win[1:]]  # decode steps (the first is the prefill)
            gaps += [(b[0] - a[1]) * 1e3 for a, b in zip(win, win[1:])]
            hand += [(x[1] - x[0]) * 1e3 for x in tr["deliver"] if r["t0"] <= x[0] <= r["t1"]]
            sse += [x[1] * 1e3 for x in tr["sse"] if r["t0"] <= x[0] <= r["t1"]]
            puts = [x for x in tr.get("put", []) if r["t0"] <= x[0] <= r["t1"]]
            written = [x for x in tr["sse"] if r["t0"] <= x[0] <= r["t1"]]
            for p_ in puts:  # the loop's wall and CPU from taking a step's tokens to its chunk written
                j = bisect.bisect_left([w[0] for w in written], p_[0])
                if j < len(written) and written[j][0] - p_[0] < 0.01:
                    loop_wall.append((written[j][0] - p_[0]) * 1e3)
                    loop_cpu.append((written[j][2] - p_[1]) * 1e3)
        print(f"| {side} | {tps:.1f} | {tps / lib_tps:.3f} | {describe(pairs) if side != 'library' else '-'} | "
              f"{q(steps, .5):.2f} | {q(gaps, .5):.3f} | {q(hand, .5):.3f} | {q(sse, .5):.3f} | "
              f"{q(loop_wall, .5):.3f} / {q(loop_cpu, .5):.3f} | {outside:.1f} | "
              f"{cpu:.1f} | {mism} |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-traced":
        sys.exit(serve_traced(sys.argv[2:]))
    main()
