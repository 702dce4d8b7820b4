"""The logits processors' share of the engine's step time on the default pool (bfloat16), issue
31: two prompts, 64 tokens each (ignore_eos), presence 0.5 + frequency 0.3, plain decoding and
draft>target k=4; the executor's `StepResult.processor_seconds` against the steps' wall time,
and per row-forward (what the router charges).

    python benchmarks/processors_share.py

Not a test: timings depend on the machine and on whoever else shares its cores.
"""
from __future__ import annotations

import time

import torch

from specrouter.models.default_pool import default_pool_paths
from specrouter.models.pool import Pool
from specrouter.config import SamplingParams
from specrouter.decoding import executor as ex
from specrouter.engine.engine import Engine
from specrouter.bench.provenance import describe, provenance


def main() -> None:
    torch.set_num_threads(2)
    print(describe(provenance()))
    pool = Pool.load(default_pool_paths(progress=False), dtype="bfloat16")
    res = []
    orig = ex.ChainExecutor.step

    def step(self, *a, **k):  # records every StepResult
        res.append(orig(self, *a, **k))
        return res[-1]

    ex.ChainExecutor.step = step
    tok = pool.tokenizer
    prompts = [tok.encode("Write a short story about a lighthouse keeper who finds a message in a bottle."),
               tok.encode("Explain how a refrigerator works, step by step, for a curious child.")]
    pen = SamplingParams(max_new_tokens=64, presence_penalty=0.5, frequency_penalty=0.3, ignore_eos=True)
    for chain, k in ((("target",), 0), (("draft", "target"), 4)):
        for rep in range(2):
            res.clear()
            t0 = time.perf_counter()
            Engine(pool).generate_ids(prompts[:1] if rep == 0 else prompts[1:], [pen], chain=chain, k=k or 1)
            wall = sum(r.wall_time for r in res); proc = sum(r.processor_seconds for r in res)
            rows = sum(r.processor_rows for r in res)
            print(f"{'>'.join(chain)} k={k} prompt {rep}: steps {len(res)} wall {wall*1e3:.1f} ms, processors {proc*1e3:.2f} ms "
                  f"({100*proc/wall:.1f}%), {rows} row-forwards, {proc/rows*1e6:.0f} us each")
    print(describe(provenance()))


if __name__ == "__main__":
    main()
