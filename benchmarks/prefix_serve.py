"""Serving with a shared system prompt, prefix cache on vs off, side by side in one run (issue 29).

Two `specrouter serve` processes on 127.0.0.1 over the same pool, one with the prefix cache
(the default) and one with `--no-prefix-cache`, driven in turn by the `openai` async client:
`--clients` concurrent clients send chat requests that share a system prompt of about
`--system-tokens` tokens (a product's instructions) and differ in the user's question. Rounds
alternate which server goes first; before each round one request with the system prompt warms
the round's API key (the cache is scoped by key with --suffix-scope api-key, so no round reuses
another's work; a production server is warm). Per server: TTFT p50 / p99, throughput (generated
tokens / wall time of the rounds), requests' cached tokens; greedy replies compared across the
two servers (they must be identical).

    PYTHONPATH=src python benchmarks/prefix_serve.py [--clients 8] [--requests 16] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from specrouter.bench.serve import ServeBenchConfig, free_port, quantile, start_server, server_info

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
)
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


async def one(client, model, messages, max_tokens):
    t0 = time.perf_counter()
    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    first, parts, usage = None, [], None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            first = first if first is not None else time.perf_counter()
            parts.append(chunk.choices[0].delta.content)
    end = time.perf_counter()
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return {"text": "".join(parts), "ttft": (first or end) - t0, "tokens": usage.completion_tokens,
            "prompt_tokens": usage.prompt_tokens, "cached_tokens": cached}


async def round_(port, model, key, clients, requests, max_tokens):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=600)
    msgs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
            for i in range(requests)]
    await one(client, model, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello!"}], 4)  # warm
    queue = list(range(requests))
    out = [None] * requests

    async def worker():
        while queue:
            i = queue.pop(0)
            out[i] = await one(client, model, msgs[i], max_tokens)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    wall = time.perf_counter() - t0
    await client.close()
    return out, wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--models", nargs="+", default=None, help="pool (default: the embedded default pool)")
    ap.add_argument("--out", default="bench-out/prefix-serve.json")
    args = ap.parse_args()
    from specrouter.models.default_pool import default_pool_paths

    models = args.models or [str(p) for p in default_pool_paths()]
    servers = {}
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    try:
        for name, extra in (("cache", []), ("no cache", ["--no-prefix-cache"])):
            port = free_port()
            cfg = ServeBenchConfig(concurrency=(args.clients,), requests=args.requests,
                                   out_dir=f"bench-out/prefix-serve-{name.replace(' ', '-')}")
            proc = start_server(cfg, models + ["--max-model-len", "1024", *extra], port, log)
            servers[name] = (proc, port)
        model = server_info(servers["cache"][1])["data"][0]["id"]
        runs = {name: [] for name in servers}
        for r in range(args.rounds):
            for name in (list(servers) if r % 2 == 0 else list(servers)[::-1]):
                res, wall = asyncio.run(round_(servers[name][1], model, f"round-{r}", args.clients, args.requests,
                                               args.max_tokens))
                runs[name].append((res, wall))
                log(f"round {r + 1} {name}: ttft p50 {1e3 * quantile([x['ttft'] for x in res], 0.5):.0f} ms, "
                    f"{sum(x['tokens'] for x in res) / wall:.1f} tok/s")
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)
    summary = {}
    for name, rs in runs.items():
        res = [x for r, _ in rs for x in r]
        wall = sum(w for _, w in rs)
        summary[name] = {"ttft_p50": quantile([x["ttft"] for x in res], 0.5),
                         "ttft_p99": quantile([x["ttft"] for x in res], 0.99),
                         "tokens_per_s": sum(x["tokens"] for x in res) / wall,
                         "prompt_tokens_mean": sum(x["prompt_tokens"] for x in res) / len(res),
                         "cached_tokens_mean": sum(x["cached_tokens"] for x in res) / len(res)}
    identical = all(a["text"] == b["text"] for (ra, _), (rb, _) in zip(runs["cache"], runs["no cache"])
                    for a, b in zip(ra, rb))
    c, n = summary["cache"], summary["no cache"]
    result = {"config": vars(args), "models": models, "servers": summary, "greedy_identical": identical,
              "ttft_p50_ratio": n["ttft_p50"] / c["ttft_p50"],
              "throughput_ratio": c["tokens_per_s"] / n["tokens_per_s"]}
    import os

    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for name, s in summary.items():
        print(f"{name:8s}: TTFT p50 {1e3 * s['ttft_p50']:.0f} ms, p99 {1e3 * s['ttft_p99']:.0f} ms, "
              f"{s['tokens_per_s']:.1f} tok/s, prompt {s['prompt_tokens_mean']:.0f} tokens, "
              f"cached {s['cached_tokens_mean']:.0f}")
    print(f"TTFT p50 {result['ttft_p50_ratio']:.2f}x lower with the cache (goal >= 2x); throughput "
          f"{result['throughput_ratio']:.2f}x (goal >= 1x); greedy replies identical: {identical}")
    return 0 if identical else 2


if __name__ == "__main__":
    sys.exit(main())
