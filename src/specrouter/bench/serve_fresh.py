"""`specrouter bench --serve --fresh-rounds N`: issue 34's lines with fresh processes every round.

Why: on this project's VM a process's decode step is a draw, 5-25% off another process's for its
whole life in busy minutes (docs/serving-performance.md, ninth round). The paired run of
`bench/serve.py` keeps one server process and the library in the bench's own process for the
whole run: it interleaves the minutes away but compares ONE draw of each process, and a line
within ~10% of a goal moved across 0.69-1.07 between runs. Here every round starts its own
processes on both sides, the same way (the same interpreter, environment and pool flags): a
`specrouter serve` (default flags; the plain one `--static --chain target`, and for the c=1 router
line one router server per client side, so that each server side's router learns from the same
requests as the library's: `server_of`) and a library worker (`bench/library_worker.py`: `SpecRouter.generate`
one request at a time, and the engine's own continuous batching at c >= 4). In a round the sides
run in rotating order (bench/serve.py's `rotation`): at c=1 request i to the library, to the
server through the `openai` client, through the bare client streamed ("raw") and not streamed
("whole") back to back; at c >= 4 a level (every request, at most c at once) on each side. A
round's ratio of a side is its tokens / wall over the library's (pooled over the round's units),
and each line's verdict is the MEDIAN OF THE PER-ROUND RATIOS: the draw of a round's processes
decides one round, not the line. Every server side is also given at the library's step speed
(bench/serve_steps.py `at_library_step`, per round, then the median); streamed sides report their
chunks and the mean time from an engine commit to the chunk handed to the socket (the server's
`specrouter_stream_delivery_seconds`). Greedy texts of every side are compared with the library's.
Every side also reads what else ran on the machine over it (bench/machine_cpu.py): a round one of
whose sides ran beside another process's CPU (a job outside the CPU lock turned the library's 35 ms
steps into 104 ms ones, and the server's governor dropped to one thread: docs/serving-performance.md,
twelfth round) is run again and listed, not counted; its sides did not share the machine alike.

Output: serve-fresh.json and serve-fresh.md in the out dir (with each process's log).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specrouter.bench.serve import (SIDES, WARM_TOKENS, ServeBenchConfig, at_most, free_port, goal_lines, one_request,
                                    prompts, request_body, rotation, server_info, start_server, stop_servers,
                                    write_json_and_markdown)
from specrouter.bench import machine_cpu
from specrouter.bench.machine_cpu import MachineCpu
from specrouter.bench.serve_steps import Steps, ThreadSteps, at_library_step, histogram_in, metrics_text, split

# a side that ran beside more than this many cores of other processes on average (a job outside the CPU
# lock: the bench's own processes and the machine's background take ~0.03) leaves its round out
CO_TENANT_CORES = 0.25
CO_TENANT_SECONDS = 0.5  # ... and over this many CPU seconds (short spans read whole 10 ms ticks: noisy)
STREAMED = ("server", "raw")  # the server sides whose chunks are counted (stream_delivery_seconds)


@dataclass
class Unit:
    """One side's share of a round: tokens, wall seconds, engine steps, texts, client CPU and (a
    streamed server side) its chunks' commit-to-socket seconds, summed over the round's units."""

    tokens: int = 0
    wall: float = 0.0
    steps: Steps = field(default_factory=Steps)
    units: int = 0
    client_cpu: float = 0.0
    loop_cpu: float | None = None  # CPU seconds of the server's event loop thread (None: not read)
    delivery: Steps = field(default_factory=Steps)  # chunks and their summed commit-to-socket seconds
    threads: ThreadSteps | None = None  # a server side's steps by torch threads, the governor's changes
    machine: MachineCpu | None = None  # the machine's CPU over it: what else ran (bench/machine_cpu.py)
    texts: list[str] = field(default_factory=list)
    # generation requests the side's engine had served before each unit (its warm-up included): the
    # history a router on it had learnt from (`one_round`: equal on every side of a c=1 line)
    seen: list[int] = field(default_factory=list)

    def add(self, tokens: int, wall: float, steps: Steps, texts: list[str], client_cpu: float = 0.0,
            delivery: Steps | None = None, loop_cpu: float | None = None,
            threads: ThreadSteps | None = None, machine: MachineCpu | None = None, seen: int | None = None) -> None:
        if seen is not None:
            self.seen.append(seen)
        self.tokens += tokens
        self.wall += wall
        self.steps += steps
        self.units += 1
        self.client_cpu += client_cpu
        self.delivery += delivery or Steps()
        if loop_cpu is not None:
            self.loop_cpu = (self.loop_cpu or 0.0) + loop_cpu
        if threads is not None:
            self.threads = threads if self.threads is None else self.threads + threads
        if machine is not None:
            self.machine = machine if self.machine is None else self.machine + machine
        self.texts += texts

    @property
    def tps(self) -> float:
        return self.tokens / self.wall if self.wall > 0 else 0.0

    def summary(self) -> dict:
        return {"tokens": self.tokens, "wall": self.wall, "tokens_per_s": self.tps, "units": self.units,
                "seen": list(self.seen),
                **split(self.wall, self.steps, self.units),
                "client_cpu_ms": self.client_cpu / self.units * 1e3 if self.units else None,
                "loop_cpu_ms": self.loop_cpu / self.units * 1e3 if self.units and self.loop_cpu is not None else None,
                "chunks": self.delivery.count,
                "delivery_ms": self.delivery.seconds / self.delivery.count * 1e3 if self.delivery.count else None,
                "threads": self.threads.summary() if self.threads is not None else None,
                # the machine's CPU ms over the side's units, per unit: idle, taken by other processes
                # than the bench's, and by the host (steal: the VM's vCPUs did not run)
                **{f"{k}_ms": getattr(self.machine, k) / self.units * 1e3 if self.machine is not None and self.units
                   else None for k in ("idle", "others", "steal")}}


class Worker:
    """A library worker process (bench/library_worker.py) of one round."""

    def __init__(self, cfg: ServeBenchConfig, models: list[str], log_path: Path):
        spec = {"models": models, "target": cfg.target, "dtype": cfg.dtype, "max_new_tokens": cfg.max_new_tokens}
        env = dict(os.environ)
        if cfg.threads:
            env["OMP_NUM_THREADS"] = str(cfg.threads)
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "specrouter.bench.library_worker", json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env)
        self._ready: dict | None = None

    def ready(self) -> dict:
        """Its first line, once the pool is loaded and warm (read once)."""
        if self._ready is None:
            self._ready = self._read()
        return self._ready

    def ask(self, **cmd) -> dict:
        self.ready()
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the library worker exited ({self.proc.wait()}): see {self.log.name}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"library worker: {reply['error']}")
        return reply

    def stop(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        self.log.close()


async def served(side: str, base: str, model: str, cfg: ServeBenchConfig, reqs: list[tuple[int, str, bool]],
                 c: int, key: str) -> tuple[int, float, list[str]]:
    """`reqs` ((index, prompt, chat)) to the server through a side's client, at most `c` at once:
    (tokens, wall seconds, texts in order)."""
    from openai import AsyncOpenAI

    from specrouter.bench.raw_client import stream_request, whole_request

    client = AsyncOpenAI(base_url=base, api_key=key, max_retries=0, timeout=600) if side == "server" else None

    async def request(j: int) -> tuple[int, str]:
        i, prompt, chat = reqs[j]
        if side == "server":
            r = await one_request(client, model, prompt, chat, 0.0, cfg.max_new_tokens, cfg.seed + i, {})
            return r.tokens, r.text
        if side == "raw":
            text, tokens, _, _ = await stream_request(base, request_body(model, cfg, i, prompt, chat), chat, key)
        else:
            text, tokens, _ = await whole_request(base, request_body(model, cfg, i, prompt, chat), chat, key)
        return tokens, text

    t0 = time.perf_counter()
    out = await at_most(c, len(reqs), request)
    wall = time.perf_counter() - t0
    if client is not None:
        await client.close()
    return sum(x[0] for x in out), wall, [x[1] for x in out]


def loop_cpu_seconds(pid: int) -> float | None:
    """CPU seconds so far of process `pid`'s main thread (a `specrouter serve`'s event loop: the
    engine runs on its own thread), from /proc; None where there is none (not Linux)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def served_requests(text: str) -> int:
    """Generation requests a server answered so far (its /metrics `specrouter_requests_total` on the
    completion endpoints, status 200)."""
    from specrouter.bench.serve_steps import samples

    return int(sum(x.value for x in samples(text) if x.name == "specrouter_requests_total"
                   and x.labels.get("endpoint", "").endswith("completions") and x.labels.get("status") == "200"))


def measure(into: Unit, side: str, base: str, pid: int, model: str, cfg: ServeBenchConfig, reqs, c: int,
            key: str, ours=lambda: [os.getpid()]) -> None:
    """One unit of a server side into `into`, with the server's steps (by torch threads too) and chunk
    deliveries over it (its /metrics, read outside the timed region), its event loop's CPU (server
    process `pid`), the client's and the machine's (`machine_cpu.over` the processes `ours()`)."""
    before = metrics_text(base)
    loop0 = loop_cpu_seconds(pid)
    cpu = time.thread_time()
    (tokens, wall, texts), machine = machine_cpu.over(lambda: asyncio.run(served(side, base, model, cfg, reqs, c, key)),
                                                    ours)
    cpu = time.thread_time() - cpu
    loop = loop_cpu_seconds(pid)
    after = metrics_text(base)

    def span(name: str) -> Steps:
        return histogram_in(after, name) - histogram_in(before, name)

    into.add(tokens, wall, span("step_seconds"), texts, cpu,
             span("stream_delivery_seconds") if side in STREAMED else None,
             loop - loop0 if loop is not None and loop0 is not None else None,
             ThreadSteps.parse(after) - ThreadSteps.parse(before), machine, served_requests(before))


def warm(base: str, model: str, cfg: ServeBenchConfig, c: int, round_: int) -> None:
    """A server's warm-up at batch size c (the first c mixed prompts, `WARM_TOKENS` tokens a
    request, its own API key: nothing of it is reused by the measured requests). At c=1 it is
    the request the library worker warms each of its APIs with (bench/library_worker.py), so a
    router on either side starts the measured requests from the same history."""
    short = ServeBenchConfig(max_new_tokens=WARM_TOKENS, seed=cfg.seed)
    reqs = [(i, p, chat) for i, (p, chat) in enumerate(prompts(c))]
    asyncio.run(served("raw", base, model, short, reqs, c, f"bench|fresh|warm|{round_}"))


def lines_of(cfg: ServeBenchConfig, with_router: bool) -> list[tuple[str, str, int]]:
    """(line name, system, concurrency) of a round: c=1 plain and router, the engine's batching at
    each c >= 4 (plain)."""
    out = []
    if 1 in cfg.concurrency:
        out.append(("c=1 plain", "plain", 1))
        if with_router:
            out.append(("c=1 router", "router", 1))
    out += [(f"c={c} batched", "plain", c) for c in cfg.concurrency if c >= 4]
    return out


def server_of(system: str, side: str) -> str:
    """The server a side of a c=1 line of `system` runs on: the plain server for every side (it
    learns nothing from its requests), a router server of the side's own (`router-<side>`) for the
    router. One router server for three client sides learnt from three runs of each prompt where
    the library's router learnt from one (eleventh round): each side's router now has the history
    the library's has, the warm-up and this round's earlier requests once each."""
    return system if system == "plain" else f"{system}-{side}"


def one_round(cfg: ServeBenchConfig, models: list[str], r: int, log) -> dict:
    """Round r on fresh processes: line name -> side -> Unit."""
    out_dir = Path(cfg.out_dir)
    worker = Worker(cfg, models, out_dir / f"fresh-r{r}-library.log")  # loads while the servers start
    procs, bases, pids, ports = [], {}, {}, {}

    def ours() -> list[int]:  # the bench's own processes (the bench is the client)
        return [os.getpid(), worker.proc.pid, *(p.pid for p in procs)]

    def serve(names: list[str]) -> None:  # servers started side by side (each waits for its port)
        names = list(dict.fromkeys(names))  # one server a name
        ports.update({n: free_port() for n in names})
        with ThreadPoolExecutor(len(names)) as pool:
            started = {n: pool.submit(start_server, cfg, models, ports[n], log, plain=n == "plain",
                                      name=f"fresh-r{r}-{n}") for n in names}
        failed = None
        for n, f in started.items():
            try:
                procs.append(f.result())
            except Exception as e:  # noqa: BLE001 - the others started: stop them too (finally)
                failed = failed or e
                continue
            bases[n], pids[n] = f"http://127.0.0.1:{ports[n]}/v1", procs[-1].pid
        if failed is not None:
            raise failed

    try:
        with_router = 1 in cfg.concurrency and "router" in worker.ready()["systems"]
        serve(["plain"] + ([server_of("router", side) for side in SIDES[1:]] if with_router else []))
        model = server_info(ports["plain"])["data"][0]["id"]
        lines = lines_of(cfg, with_router)
        for n, base in bases.items():  # each server at the concurrencies of its own lines
            for c in sorted({c for _, s, c in lines if n in (s, *(server_of(s, side) for side in SIDES[1:]))}):
                warm(base, model, cfg, c, r)
        got: dict[str, dict[str, Unit]] = {}
        for name, system, c in lines:
            units = got[name] = {side: Unit() for side in SIDES}
            key = f"bench|fresh|{name}|{r}"
            if c == 1:  # request i to every side back to back, in rotating order
                for i, (p, chat) in enumerate(prompts(cfg.requests)):
                    for side in rotation(r * cfg.requests + i):
                        if side == "library":
                            x, m = machine_cpu.over(lambda: worker.ask(op="one", system=system, prompt=p, chat=chat), ours)
                            units[side].add(x["tokens"], x["wall"], Steps(*x["steps"]), x["texts"], machine=m,
                                            seen=x.get("seen"))
                        else:
                            n = server_of(system, side)
                            measure(units[side], side, bases[n], pids[n], model, cfg, [(i, p, chat)], 1,
                                    f"{key}|{side}", ours)
            else:  # a level on each side, in rotating order
                n = max(cfg.requests, c)
                reqs = [(i, p, chat) for i, (p, chat) in enumerate(prompts(n))]
                for side in rotation(r):
                    if side == "library":
                        x, m = machine_cpu.over(lambda: worker.ask(op="batch", concurrency=c, requests=n), ours)
                        units[side].add(x["tokens"], x["wall"], Steps(*x["steps"]), x["texts"], machine=m)
                    else:
                        measure(units[side], side, bases[system], pids[system], model, cfg, reqs, c,
                                f"{key}|{side}", ours)
            lib = units["library"]
            step = split(lib.wall, lib.steps, 1)["step_ms"]
            log(f"round {r + 1} {name}: library {lib.tps:.1f} tok/s (step {step:.2f} ms); "
                + ", ".join(f"{side} {u.tps / lib.tps:.3f}x (step {split(u.wall, u.steps, 1)['step_ms']:.2f} ms"
                            + (f", {u.threads.summary()['drops']} drops" if u.threads is not None else "")
                            + (f", others {u.machine.others * 1e3:.0f} ms" if u.machine is not None else "") + ")"
                            for side, u in units.items() if side != "library"))
        return got
    finally:
        worker.stop()
        stop_servers(procs)


def median_of(values: list[float | None]) -> dict | None:
    """The median of per-round values with their range and count (None values left out)."""
    xs = [v for v in values if v is not None]
    return {"median": statistics.median(xs), "lo": min(xs), "hi": max(xs), "n": len(xs)} if xs else None


def summarize_fresh(cfg: ServeBenchConfig, rounds: list[dict], disturbed: list[dict] | None = None) -> dict:
    """Per line: each round's sides (Unit.summary), the per-round ratios and their medians (the
    verdict), the greedy mismatches against the library, issue 34's goals."""
    from specrouter.bench.provenance import provenance

    lines, mismatches = {}, []
    for name in rounds[0]:
        per_round = [{side: u.summary() for side, u in rnd[name].items()} for rnd in rounds]
        ratios = {"server": [], "raw": [], "whole": [], "streamed_vs_whole": [],
                  **{f"{side}_at_library_step": [] for side in SIDES[1:]}}
        for r, sides in enumerate(per_round):
            lib = sides["library"]["tokens_per_s"]
            for side in SIDES[1:]:
                ratios[side].append(sides[side]["tokens_per_s"] / lib if lib else None)
                ratios[f"{side}_at_library_step"].append(at_library_step(sides["library"], sides[side]))
            ratios["streamed_vs_whole"].append(sides["raw"]["tokens_per_s"] / sides["whole"]["tokens_per_s"]
                                               if sides["whole"]["tokens_per_s"] else None)
            ref = rounds[r][name]["library"].texts
            for side in SIDES[1:]:
                bad = [i for i, (a, b) in enumerate(zip(ref, rounds[r][name][side].texts)) if a != b]
                if bad or len(ref) != len(rounds[r][name][side].texts):
                    mismatches.append({"line": name, "round": r, "side": side, "requests": bad})
        lines[name] = {"rounds": per_round, "ratios": ratios, "medians": {k: median_of(v) for k, v in ratios.items()}}
    goals = []

    def goal(text: str, names: list[str], key: str, bar: float) -> None:
        values = [lines[n]["medians"][key]["median"] for n in names if lines[n]["medians"][key]]
        if values:
            goals.append({"goal": text, "value": min(values), "met": min(values) >= bar})

    groups = [([n], f"the Python API at {n}") for n in lines if n.startswith("c=1 ")]
    batched = [n for n in lines if n.endswith(" batched")]
    if batched:
        groups.append((batched, "the engine's batching at c >= 4"))
    for names, what in groups:
        goal(f"server >= 0.95x {what}, raw HTTP client (median of per-round ratios, fresh processes; the verdict: "
             "a bare client, as vLLM's benchmark_serving and SGLang's bench_serving load a server)",
             names, "raw", 0.95)
        goal(f"server >= 0.95x {what}, openai client (median of per-round ratios, fresh processes; the SDK's "
             "own CPU on the same cores is in it: client CPU ms in the tables)",
             names, "server", 0.95)
    goal("streamed >= 0.95x whole, raw HTTP client, every line (median of per-round ratios)", list(lines),
         "streamed_vs_whole", 0.95)
    goals.append({"goal": "greedy server output == the library's (every side, every round)",
                  "value": len(mismatches), "met": not mismatches})
    return {"workload": "fresh", "provenance": provenance(), "config": asdict(cfg),
            "load_average": os.getloadavg()[0], "cores": os.cpu_count(), "rounds": len(rounds), "lines": lines,
            "mismatches": mismatches, "goals": goals, "disturbed_rounds": disturbed or []}


def disturbance(got: dict) -> dict | None:
    """The side of a round (line -> side -> Unit) that ran beside the most CPU of other processes,
    if that was over `CO_TENANT_CORES` on average and `CO_TENANT_SECONDS` in all: {line, side,
    others_cores}; else None."""
    worst = max(((name, side, u.machine.others_cores) for name, sides in got.items() for side, u in sides.items()
                 if u.machine is not None), key=lambda x: x[2], default=None)
    if worst is None or worst[2] <= CO_TENANT_CORES or got[worst[0]][worst[1]].machine.others < CO_TENANT_SECONDS:
        return None
    return {"line": worst[0], "side": worst[1], "others_cores": worst[2]}


def run_fresh_bench(cfg: ServeBenchConfig, log=print) -> dict:
    """`cfg.fresh_rounds` rounds, each on fresh processes (module docstring). A round one of whose
    sides ran beside another process (`disturbance`) is run again, at most `cfg.fresh_rounds` times
    in all: its sides did not share the machine alike. It is listed, not counted."""
    from specrouter.models.default_pool import default_pool_paths

    models = list(cfg.models) if cfg.models else [str(p) for p in default_pool_paths()]
    Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
    want = max(1, cfg.fresh_rounds)
    rounds, disturbed = [], []
    for r in range(2 * want):
        got = one_round(cfg, models, r, log)
        bad = disturbance(got)
        if bad is not None and len(disturbed) < want:
            disturbed.append({"round": r, **bad})
            log(f"round {r + 1} ran beside another process ({bad['others_cores']:.2f} cores during {bad['line']} "
                f"{bad['side']}): run again, not counted")
        else:
            rounds.append(got)
        write_fresh(summarize_fresh(cfg, rounds or [got], disturbed), cfg.out_dir)  # should a later round not end
        if len(rounds) == want:
            break
    return summarize_fresh(cfg, rounds, disturbed)


def markdown_fresh(result: dict) -> str:
    from specrouter.bench.paired import describe
    from specrouter.bench.provenance import describe as describe_provenance

    def f(x, d=1):
        return "-" if x is None else f"{x:.{d}f}"

    prov = result.get("provenance")
    interval = result["config"].get("stream_interval")
    given = ([f"--stream-interval {interval}"] if interval is not None else []) + \
        (["--no-team-governor"] if result["config"].get("team_governor") is False else [])
    flags = " ".join(given) or "default flags"
    lines = ["# specrouter bench --serve --fresh-rounds", "",
             f"Provenance: {describe_provenance(prov)}." if prov else "Provenance: not recorded.", "",
             f"load average {result['load_average']:.2f} on {result['cores']} cores; {result['rounds']} rounds, "
             "each on "
             f"fresh processes (servers with {flags}: a plain one and, for the c=1 router line, a router server "
             "per client side, each learning from the library's history; and a library worker); greedy", "",
             "Median of the per-round ratios (lowest-highest, rounds); [at the library's step speed]:", "",
             "| line | server (openai) / library | raw / library | whole / library | streamed (raw) / whole | "
             "client CPU ms a unit: openai / raw / whole |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, line in result["lines"].items():
        m = line["medians"]
        cells = [describe(m[k]).replace("pairs", "rounds") +
                 (f" [{f(m[k + '_at_library_step']['median'], 3)}]" if m.get(k + "_at_library_step") else "")
                 for k in ("server", "raw", "whole")]
        sw = describe(m["streamed_vs_whole"]).replace("pairs", "rounds")
        cpu = " / ".join(f(statistics.median(x[side]["client_cpu_ms"] for x in line["rounds"]), 0)
                         for side in ("server", "raw", "whole"))
        lines.append(f"| {name} | {' | '.join(cells)} | {sw} | {cpu} |")
    disturbed = result.get("disturbed_rounds") or []
    if disturbed:
        lines += ["", f"Run again, not counted (a side ran beside more than {CO_TENANT_CORES} cores of other "
                      "processes on average): " + "; ".join(
                          f"round {d['round'] + 1} ({d['line']}, {d['side']}: {d['others_cores']:.2f} cores)"
                          for d in disturbed) + "."]
    lines += ["", "Each round's sides: tok/s, mean engine step (ms), steps and ms outside them per unit (a request "
                  "at c=1, a level at c >= 4), the server's event loop CPU ms and the client's CPU ms per unit, SSE "
                  "chunks and their mean commit-to-socket ms; a server side's engine thread: its CPU over its steps' "
                  "wall (what `TeamGovernor` reads), the share of step seconds it ran on fewer torch threads than "
                  "its own count, the governor's drops / restores; the machine's CPU ms per unit, all cores: idle, "
                  "run by other processes than the bench's, stolen by the host (a library side's span includes "
                  "its engine's set-up):", "",
              "| line | round | side | tok/s | step ms | steps | outside ms | loop CPU ms | client CPU ms | chunks | "
              "commit to socket ms | engine CPU / step | fewer threads | drops / restores | idle / others / steal ms |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, line in result["lines"].items():
        for r, sides in enumerate(line["rounds"]):
            for side, x in sides.items():
                t = x.get("threads") or {}
                lines.append(f"| {name} | {r + 1} | {side} | {f(x['tokens_per_s'])} | {f(x['step_ms'], 2)} | "
                             f"{f(x['steps'])} | {f(x['outside_ms'])} | {f(x.get('loop_cpu_ms'))} | "
                             f"{f(x['client_cpu_ms'])} | "
                             f"{x['chunks'] or '-'} | {f(x['delivery_ms'], 3)} | {f(t.get('cpu_share'), 2)} | "
                             f"{f(t['reduced_seconds'] * 100 if t.get('reduced_seconds') is not None else None, 0)}"
                             f"{'%' if t.get('reduced_seconds') is not None else ''} | "
                             f"{str(t['drops']) + ' / ' + str(t['restores']) if t else '-'} | "
                             f"{f(x.get('idle_ms'), 0)} / {f(x.get('others_ms'), 0)} / {f(x.get('steal_ms'), 0)} |")
    lines += goal_lines(result["goals"], digits=3)
    return "\n".join(lines) + "\n"


def write_fresh(result: dict, out_dir: str | Path) -> list[Path]:
    return write_json_and_markdown(result, out_dir, "serve-fresh", markdown_fresh(result))
