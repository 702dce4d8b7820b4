"""`specrouter bench --serve --workloads shared-prompt`: serving with a shared system prompt, the
prefix cache on vs off, side by side in one run (issue 29).

Two `specrouter serve` processes on 127.0.0.1 over the same pool (bench/serve.py's
`start_server`): one with the prefix cache (the default), one with `--no-prefix-cache`. The
`openai` async client sends, from `clients` concurrent clients, `requests` greedy chat requests
that share a system prompt of ~300 tokens (a product's instructions) and differ in the user's
question. Rounds alternate which server goes first; before each round one request with the
system prompt warms the round's API key (the servers run with `--suffix-scope api-key`, which
also scopes the prefix cache: no round adopts another's work, and a production server is warm).
Per server: TTFT p50 / p99, throughput (generated tokens over the summed wall time of the rounds),
prompt tokens and `usage.prompt_tokens_details.cached_tokens`; the greedy replies of the two
servers are compared (they must be identical). Output: serve-shared.json, serve-shared.md.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from specrouter.bench.serve import (LevelResult, RequestResult, ServeBenchConfig, at_most, free_port, goal_lines,
                                    level_result, pooled, quantile, server_info, start_server, stop_servers,
                                    write_json_and_markdown)

SYSTEM = (
    "You are the support assistant of Nordlicht Outdoor, an online shop for hiking, camping and "
    "climbing gear. Follow these rules in every answer. Be friendly, short and concrete; answer in "
    "at most three sentences unless the customer asks for details. Never invent prices, stock "
    "levels or delivery dates: say that the customer can see them on the product page. Returns are "
    "free within 30 days if the item is unused and in its original packaging; worn shoes and "
    "opened gas cartridges cannot be returned. Repairs of tents and backpacks are free for two "
    "years; the customer sends the item with the repair form from the account page. Orders above "
    "fifty euros ship free inside the European Union; other orders cost five euros. Express "
    "delivery is possible for orders placed before noon on working days. Payment by card, bank "
    "transfer or invoice; invoice only for returning customers. If the customer asks for advice on "
    "equipment, ask about the season, the altitude and how many nights they plan to be out before "
    "recommending anything, and prefer light and durable gear. If the customer is angry, apologise "
    "once, then solve the problem. Never share personal data of other customers. If a question is "
    "not about the shop or outdoor gear, say politely that you can only help with the shop. Gift "
    "cards never expire and can be combined with discount codes, but only one discount code "
    "works per order. Our stores in Hamburg, Munich and Vienna open from nine to seven, Monday "
    "to Saturday. Sign every answer with: Your Nordlicht team."
)  # 304 tokens with SmolLM2's tokenizer
QUESTIONS = [
    "Can I return hiking boots I wore once?", "How much is shipping to Austria?",
    "Which sleeping bag do you recommend for the Alps in October?", "My tent pole broke. What can I do?",
    "Do you accept PayPal?", "Can I still get express delivery today?",
    "What stove should I take for a week in Norway?", "Is invoice payment possible for my first order?",
    "How do I send a backpack for repair?", "Can I return an opened gas cartridge?",
    "What is the best rain jacket for cycling?", "My order has not arrived yet. What should I do?",
    "Which headlamp is good for winter camping?", "Do you ship to Switzerland?",
    "How long do repairs take?", "Can you recommend light trekking poles?",
]
SERVERS = {"cache": [], "no cache": ["--no-prefix-cache"]}  # name: extra `specrouter serve` flags
MAX_MODEL_LEN = 1024  # the system prompt, a question and the reply fit


@dataclass
class SharedResult(RequestResult):
    prompt_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens


def messages(system: str, question: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


async def one_chat(client, model: str, system: str, question: str, max_tokens: int) -> SharedResult:
    """One streamed greedy chat request: its text, TTFT, time per output token and usage."""
    t0 = time.perf_counter()
    stream = await client.chat.completions.create(
        model=model, messages=messages(system, question), max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    first = last = usage = None
    parts = []
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            last = time.perf_counter()
            first = first if first is not None else last
            parts.append(chunk.choices[0].delta.content)
    end = time.perf_counter()
    tokens = usage.completion_tokens if usage else 0
    details = usage.prompt_tokens_details if usage else None
    return SharedResult(
        text="".join(parts), tokens=tokens, ttft=(first if first is not None else end) - t0,
        tpot=(last - first) / (tokens - 1) if first is not None and tokens > 1 else None, seconds=end - t0,
        prompt_tokens=usage.prompt_tokens if usage else 0,
        cached_tokens=(details.cached_tokens or 0) if details is not None else 0)


async def run_round(port: int, model: str, cfg: ServeBenchConfig, clients: int, server: str,
                    round_: int, system: str = SYSTEM) -> LevelResult:
    """`cfg.requests` requests from `clients` concurrent clients under the round's own API key,
    after one warming request with the system prompt."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=f"shared-prompt|round={round_}",
                         max_retries=0, timeout=600)
    await one_chat(client, model, system, "Hello!", 4)  # warm: the system prompt is now cached (cache on)
    t0 = time.perf_counter()
    results = await at_most(clients, max(cfg.requests, clients),
                            lambda i: one_chat(client, model, system, QUESTIONS[i % len(QUESTIONS)], cfg.max_new_tokens))
    wall = time.perf_counter() - t0
    await client.close()
    return level_result(server, 0.0, clients, wall, results)


def run_shared_prompt_bench(cfg: ServeBenchConfig, log=print, system: str = SYSTEM) -> dict:
    """Both servers, `cfg.rounds` rounds each (alternating which goes first) at the highest
    concurrency of `cfg.concurrency`, every request with the system prompt `system`; the
    summary dict (see `summarize_shared`)."""
    from specrouter.models.default_pool import default_pool_paths

    models = list(cfg.models) if cfg.models else [str(p) for p in default_pool_paths()]
    clients = max(cfg.concurrency)
    procs, ports = [], {}
    runs: dict[str, list[LevelResult]] = {name: [] for name in SERVERS}
    try:
        for name, extra in SERVERS.items():
            ports[name] = free_port()
            procs.append(start_server(cfg, models, ports[name], log, name=f"server-{name.replace(' ', '-')}",
                                      extra=["--max-model-len", str(MAX_MODEL_LEN), *extra]))
        model = server_info(ports["cache"])["data"][0]["id"]
        for r in range(max(1, cfg.rounds)):
            for name in list(SERVERS) if r % 2 == 0 else list(SERVERS)[::-1]:
                lv = asyncio.run(run_round(ports[name], model, cfg, clients, name, r, system))
                runs[name].append(lv)
                log(f"shared prompt, {clients} clients, {name} (round {r + 1}): ttft p50 "
                    f"{lv.ttft_p50 * 1e3:.0f} ms, {lv.tokens_per_s:.1f} tok/s")
    finally:
        stop_servers(procs)
    return summarize_shared(cfg, models, clients, runs)


def summarize_shared(cfg: ServeBenchConfig, models: list[str], clients: int,
                     runs: dict[str, list[LevelResult]]) -> dict:
    """Per server the pooled rounds; the TTFT and throughput ratios; greedy replies compared
    request by request, round by round; issue 29's serving goals."""
    from specrouter.bench.provenance import provenance

    servers = {}
    for name, rs in runs.items():
        lv = pooled(rs)
        res = lv.results
        servers[name] = {"ttft_p50": lv.ttft_p50, "ttft_p99": lv.ttft_p99, "tpot_p50": lv.tpot_p50,
                         "tokens_per_s": lv.tokens_per_s, "wall": lv.wall, "requests": len(res),
                         "prompt_tokens_mean": sum(x.prompt_tokens for x in res) / len(res),
                         "cached_tokens_mean": sum(x.cached_tokens for x in res) / len(res)}
    mismatches = [{"round": r, "request": i}
                  for r, (a, b) in enumerate(zip(runs["cache"], runs["no cache"]))
                  for i, (x, y) in enumerate(zip(a.results, b.results)) if x.text != y.text]
    on, off = servers["cache"], servers["no cache"]
    ttft_ratio = off["ttft_p50"] / on["ttft_p50"]
    tput_ratio = on["tokens_per_s"] / off["tokens_per_s"]
    goals = [
        {"goal": f"TTFT p50 >= 2x lower with the cache ({clients} clients, shared system prompt)",
         "value": ttft_ratio, "met": ttft_ratio >= 2.0},
        {"goal": "throughput not lower with the cache", "value": tput_ratio, "met": tput_ratio >= 1.0},
        {"goal": "greedy replies identical with the cache on and off", "value": len(mismatches),
         "met": not mismatches},
    ]
    return {"workload": "shared-prompt", "provenance": provenance(), "config": asdict(cfg), "models": models,
            "clients": clients, "load_average": os.getloadavg()[0], "cores": os.cpu_count(),
            "servers": servers, "ttft_p50_ratio": ttft_ratio, "throughput_ratio": tput_ratio,
            "mismatches": mismatches, "goals": goals,
            "rounds": {name: [asdict(lv) for lv in rs] for name, rs in runs.items()}}


def markdown_shared(result: dict) -> str:
    from specrouter.bench.provenance import describe

    prov = result.get("provenance")
    on = result["servers"]["cache"]
    lines = ["# specrouter bench --serve --workloads shared-prompt", "",
             f"Provenance: {describe(prov)}." if prov else "Provenance: not recorded.", "",
             f"load average {result['load_average']:.2f} on {result['cores']} cores; {result['clients']} "
             f"concurrent clients, chat requests sharing a system prompt ({on['prompt_tokens_mean']:.0f} "
             "prompt tokens each on average), greedy", "",
             "| server | TTFT p50 (ms) | TTFT p99 (ms) | tok/s | requests | prompt tokens from the cache (mean) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, s in result["servers"].items():
        label = "prefix cache (default)" if name == "cache" else "`--no-prefix-cache`"
        lines.append(f"| {label} | {s['ttft_p50'] * 1e3:.0f} | {s['ttft_p99'] * 1e3:.0f} | "
                     f"{s['tokens_per_s']:.1f} | {s['requests']} | {s['cached_tokens_mean']:.0f} of "
                     f"{s['prompt_tokens_mean']:.0f} |")
    lines += ["", f"TTFT p50 {result['ttft_p50_ratio']:.2f}x lower with the cache; throughput "
              f"{result['throughput_ratio']:.2f}x.", *goal_lines(result["goals"])]
    return "\n".join(lines) + "\n"


def write_shared(result: dict, out_dir: str | Path) -> list[Path]:
    return write_json_and_markdown(result, out_dir, "serve-shared", markdown_shared(result))
