"""What a draft head's catch-up costs after a prefix-cache hit (issue 29: the head's own KV).

The default pool plus the shipped draft head (`default default-head`, bfloat16 on the native
kernels), one engine with the prefix cache, chain (head, target) at k=4: chat requests sharing
bench/serve_shared.py's ~300-token system prompt, one after another (the first parks the
prompt, the others adopt it). The head does not run in a request's first cycle (the target's
prefill gives the first token); its second cycle starts with the head's catch-up over every
position its own KV lacks. Per request: TTFT, and the second and third cycles' head time and
head tokens. With the head's KV parked and adopted, a hit's catch-up feeds only the positions
past the cached prefix.

    PYTHONPATH=src python benchmarks/head_catchup.py [--requests 7] [--max-new-tokens 16]

Not a test: timings depend on the machine and on whoever else shares its cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from specrouter.bench.serve_shared import QUESTIONS, SYSTEM, messages
from specrouter.config import PoolConfig, SamplingParams
from specrouter.engine.engine import Engine
from specrouter.models.pool import Pool


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=7)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    pool = Pool.from_config(PoolConfig(models=("default", "default-head")))
    head = next(n for n, r in pool.runners.items() if getattr(r, "is_head", False))
    tok = pool.tokenizer
    ids = [tok.encode(tok.apply_chat_template(messages(SYSTEM, q), add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False) for q in QUESTIONS[:args.requests]]
    eng = Engine(pool, max_num_seqs=2, max_model_len=1024)
    rows = []
    for i, x in enumerate(ids):
        cycles = []
        eng.on_cycle = cycles.append
        t0 = time.perf_counter()
        seq = eng.add_request(x, SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True),
                              chain=(head, pool.target), k=4)
        first = None
        while not seq.done:
            eng.step()
            if first is None and seq.output_ids:
                first = time.perf_counter() - t0
        c2, c3 = cycles[1], cycles[2]
        rows.append({"ttft": first, "head2": c2.forward_time.get(head, 0.0), "wall2": c2.wall_time,
                     "head3": c3.forward_time.get(head, 0.0)})
        print(f"request {i}: prompt {len(x)}, cached {seq.stats.cached_tokens}, TTFT {1e3 * first:.1f} ms | "
              f"cycle 2: head {1e3 * rows[-1]['head2']:.1f} ms over {c2.forward_tokens.get(head, 0)} tokens, "
              f"wall {1e3 * c2.wall_time:.1f} ms | cycle 3: head {1e3 * rows[-1]['head3']:.1f} ms over "
              f"{c3.forward_tokens.get(head, 0)} tokens", flush=True)
    hits = rows[1:]
    med = lambda key: 1e3 * statistics.median(r[key] for r in hits)  # noqa: E731
    print(f"hits (median): TTFT {med('ttft'):.1f} ms; cycle 2: head {med('head2'):.1f} ms, wall {med('wall2'):.1f} ms;"
          f" cycle 3: head {med('head3'):.1f} ms (load average {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
