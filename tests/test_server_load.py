"""Load: many concurrent streaming clients (AsyncOpenAI) against one server. Every request
completes without error, within a time bound, and its output is identical to the same request
run alone (greedy). Prints throughput and p50/p99 latency."""

import asyncio
import random
import statistics
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from fixtures import _CORPUS  # noqa: E402

from specrouter.config import SamplingParams  # noqa: E402
from specrouter.engine.engine import Engine  # noqa: E402
from specrouter.models.pool import Pool  # noqa: E402
from specrouter.models.tokenizer import apply_chat_template  # noqa: E402
from specrouter.server import ServerConfig, create_app  # noqa: E402
from specrouter.server.live import LiveServer  # noqa: E402

NAMES = ("draft", "mid", "target")
MAX_TOKENS = 32


def load_pool(dirs):
    return Pool.load([dirs[n] for n in NAMES], names=list(NAMES), target="target", dtype="float64")


def make_requests(n: int, seed: int = 0) -> list[dict]:
    """n requests: completions and chat, different prompts, lengths, chains, draft lengths."""
    rng = random.Random(seed)
    lines = [ln for ln in _CORPUS.splitlines() if ln.strip()][:14]
    chains = [None, ["ngram", "mid", "target"], ["draft", "mid", "target"], ["mid", "target"],
              ["target"]]
    out = []
    for i in range(n):
        text = lines[i % len(lines)][: 20 + 7 * (i % 9)]
        pinned = i % 4 == 3  # most requests use the server's defaults; some pin chain and k
        req = {"max_tokens": rng.randint(4, MAX_TOKENS), "chat": i % 3 == 0, "text": text,
               "chain": chains[(i // 4) % len(chains)] if pinned else None,
               "k": rng.randint(1, 5) if pinned else None}
        out.append(req)
    return out


def expected_texts(pool, requests):
    """Each distinct prompt run alone, target-only greedy; a request's text is a prefix of it."""
    tok = pool.tokenizer
    cache = {}
    out = []
    for r in requests:
        key = (r["chat"], r["text"])
        if key not in cache:
            ids = (apply_chat_template(tok, [{"role": "user", "content": r["text"]}]) if r["chat"]
                   else tok(r["text"], add_special_tokens=False)["input_ids"])
            seq = Engine(pool).generate_ids([ids], [SamplingParams(max_new_tokens=MAX_TOKENS)],
                                            chain=("target",))[0]
            cache[key] = seq.output_ids
        ids = cache[key][: r["max_tokens"]]
        out.append(tok.decode(ids, skip_special_tokens=True))
    return out


async def _one(client, r):
    extra = {}
    if r["chain"] is not None:
        extra = {"specrouter_chain": r["chain"], "specrouter_k": r["k"]}
    kw = dict(model="target", max_tokens=r["max_tokens"], temperature=0, stream=True,
              stream_options={"include_usage": True}, extra_body=extra)
    t0 = time.perf_counter()
    parts = []
    finish = usage = None
    if r["chat"]:
        stream = await client.chat.completions.create(
            messages=[{"role": "user", "content": r["text"]}], **kw)
        async for c in stream:
            if c.choices:
                parts.append(c.choices[0].delta.content or "")
                finish = c.choices[0].finish_reason or finish
            usage = c.usage or usage
    else:
        stream = await client.completions.create(prompt=r["text"], **kw)
        async for c in stream:
            if c.choices:
                parts.append(c.choices[0].text)
                finish = c.choices[0].finish_reason or finish
            usage = c.usage or usage
    return "".join(parts), finish, time.perf_counter() - t0, usage.completion_tokens


def run_load(tiny_pool_dirs, clients: int, total: int, time_bound: float):
    requests = make_requests(total)
    expected = expected_texts(load_pool(tiny_pool_dirs), requests)
    app = create_app(load_pool(tiny_pool_dirs),
                     ServerConfig(chain=("ngram", "mid", "target"), k=3, max_num_seqs=16,
                                  max_model_len=192, max_queue=64))
    with LiveServer(app) as srv:
        async def main():
            client = openai.AsyncOpenAI(base_url=srv.base_url, api_key="-", max_retries=0,
                                        timeout=time_bound)
            todo = asyncio.Queue()
            for i in range(total):
                todo.put_nowait(i)
            results = [None] * total

            async def worker():
                while not todo.empty():
                    i = todo.get_nowait()
                    results[i] = await _one(client, requests[i])

            try:
                await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(clients))), time_bound)
            finally:
                await client.close()
            return results

        t0 = time.perf_counter()
        results = asyncio.run(main())
        wall = time.perf_counter() - t0
        engine = app.state.server.engine
        assert engine.state.live() == [] and not engine.running
    for i, (text, finish, _, _) in enumerate(results):
        assert text == expected[i], (i, requests[i])
        assert finish in ("stop", "length")
    lat = sorted(r[2] for r in results)
    tokens = sum(r[3] for r in results)
    p50 = statistics.median(lat)
    p99 = lat[min(len(lat) - 1, int(round(0.99 * (len(lat) - 1))))]
    print(f"\nload: {clients} concurrent streaming clients, {total} requests in {wall:.2f} s: "
          f"{total / wall:.1f} req/s, {tokens / wall:.0f} output tok/s, latency p50 "
          f"{p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms")
    return wall


@pytest.mark.slow  # over ~30 s on a 2-core CI machine: `make test-slow`
def test_load_32_clients_200_requests(tiny_pool_dirs):
    run_load(tiny_pool_dirs, clients=32, total=200, time_bound=90)


@pytest.mark.slow
def test_load_64_clients_600_requests(tiny_pool_dirs):
    run_load(tiny_pool_dirs, clients=64, total=600, time_bound=300)
