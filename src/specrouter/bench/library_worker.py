"""The library side of `specrouter bench --serve --fresh-rounds` in a process of its own (issue 34).

On this project's VM a process's decode step is a draw (docs/serving-performance.md, ninth and
tenth rounds): a library in the bench's process, paired with a server process that lives for the
whole run, compares one draw of each. `bench/serve_fresh.py` starts this worker afresh every round,
the way it starts the server (the same interpreter, environment and pool flags), so every round
is a new draw on both sides. It loads the pool as `bench/serve.py`'s `library_runs` does and
answers one JSON command a line on stdin with one JSON line on stdout:

- `{"op": "one", "system": "plain" | "router", "prompt": str, "chat": bool}`: `SpecRouter.generate`
  of one greedy request, timed from the prompt's text (as a server's wall time includes its
  tokenizing and chat template), the plain chain or the router, each on its own view of the pool
  made at start (it learns from this round's requests only, as a server side with its own key);
- `{"op": "batch", "concurrency": c, "requests": n}`: the engine's own continuous batching of the
  first n mixed prompts (`bench/serve.py`'s `prompts`), at most c rows at once, on a fresh view
  and engine warmed at that batch size (its parked warm-up prompts dropped: a fair prefill),
  timed from the prompts' text to the outputs' text (tokenizing and decoding inside, as a
  server's level and `one` include them; `text_ms` of the reply says how long they took);

each answered with `tokens`, `wall` (seconds), `texts` and `steps` ([count, seconds] of the engine
steps inside, `StepClock`); `one` also with `seen`, the requests that API ran before it (its
warm-up included: the history its router learnt from, as a router server's of the same line). The first line it writes is `{"ready": true}` once the pool is loaded
and warm.

    python -m specrouter.bench.library_worker '{"models": [...], "target": null, "dtype": "auto",
        "max_new_tokens": 64, "seed": 0}'
"""

from __future__ import annotations

import json
import sys
import time


class LibraryWorker:
    """The pool and the library's engines of one round (module docstring)."""

    def __init__(self, spec: dict):
        from specrouter.api import SpecRouter
        from specrouter.bench.serve import WARM_TOKENS, prompts
        from specrouter.config import PoolConfig, RouterConfig, SamplingParams
        from specrouter.models.pool import Pool, preview_pool
        from specrouter.router.setup import build_router

        pcfg = PoolConfig(models=tuple(spec["models"]), target=spec.get("target"), dtype=spec.get("dtype", "auto"))
        self.pool = pool = Pool.from_config(pcfg, paths=list(preview_pool(pcfg).paths))
        self.max_new_tokens = spec["max_new_tokens"]
        self.params = SamplingParams(temperature=0.0, max_new_tokens=self.max_new_tokens, ignore_eos=True)
        self.apis = {}
        (warm_prompt, warm_chat), = prompts(1)
        for system in ("plain", "router"):
            if system == "router" and len(pool.order) < 2:
                continue
            view = pool.with_fresh_drafters()
            router = build_router(view, progress=False, config=RouterConfig()) if system == "router" else None
            api = SpecRouter(view, router)
            chain = (view.target,) if system == "plain" else None
            # warm-up: the request the bench warms a server with at c=1 (serve_fresh.warm), so a
            # router here and the router server's start the measured requests from one history
            api.generate(warm_prompt, chat=warm_chat, max_new_tokens=WARM_TOKENS, chain=chain, ignore_eos=True)
            if api.engine.prefix_cache is not None:  # the measured prompts must not hit it
                api.engine.prefix_cache.clear()
            for drafter in view.drafters.values():  # nor a learning drafter (suffix): a server
                if hasattr(drafter, "clear"):  # side's requests run under their own API key, a
                    drafter.clear()  # tenant the warm-up (its key apart) never fed
            self.apis[system] = (api, chain)
        self.seen = dict.fromkeys(self.apis, 1)  # requests each API has run (the warm-up)
        self.api = self.apis["plain"][0]  # encode and decode (the target's tokenizer)
        for p, chat in prompts(4):  # every kind once: the chat template compiled, as a warmed server's
            self.api.tokenizer.decode(self.api.encode(p, chat=chat), skip_special_tokens=True)

    def one(self, system: str, prompt: str, chat: bool) -> dict:
        from specrouter.bench.serve_steps import StepClock

        api, chain = self.apis[system]
        clock = StepClock(api.engine)
        try:
            t0 = time.perf_counter()
            r = api.generate(prompt, chat=chat, max_new_tokens=self.max_new_tokens, chain=chain, ignore_eos=True)[0]
            wall = time.perf_counter() - t0
        finally:
            clock.close()
        seen, self.seen[system] = self.seen[system], self.seen[system] + 1
        return {"tokens": len(r.token_ids), "wall": wall, "texts": [r.text],
                "steps": [clock.steps.count, clock.steps.seconds], "seen": seen}

    def batch(self, concurrency: int, requests: int) -> dict:
        """The level from the prompts' text to the outputs' text: tokenizing (chat template
        included) and decoding are timed with the engine's batching, as at c=1 (`one`) and as a
        server's level includes them; `text_ms` says how much of `wall` they were."""
        from specrouter.bench.serve import library_level, prompts

        t0 = time.perf_counter()
        ids = [self.api.encode(p, chat=chat) for p, chat in prompts(requests)]
        encode = time.perf_counter() - t0
        seqs, wall, steps = library_level(self.pool.with_fresh_drafters(), ids, self.params, concurrency)
        t0 = time.perf_counter()
        texts = [self.api.tokenizer.decode(s.output_ids, skip_special_tokens=True) for s in seqs]
        decode = time.perf_counter() - t0
        return {"tokens": sum(len(s.output_ids) for s in seqs), "wall": wall + encode + decode,
                "texts": texts, "steps": [steps.count, steps.seconds], "text_ms": (encode + decode) * 1e3}


def main(argv: list[str]) -> int:
    worker = LibraryWorker(json.loads(argv[0]))
    out = sys.stdout
    out.write(json.dumps({"ready": True, "systems": sorted(worker.apis)}) + "\n")
    out.flush()
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "one":
            reply = worker.one(cmd["system"], cmd["prompt"], cmd["chat"])
        elif cmd["op"] == "batch":
            reply = worker.batch(cmd["concurrency"], cmd["requests"])
        else:
            reply = {"error": f"unknown op {cmd['op']!r}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
