"""The fastest plain decoding of the target on this machine: the bench's honest baseline.

SpecRouter runs every model on the process's kernel path (`kernels.kernel_path()`), the path
that verifies k tokens cheapest. That need not be the path with the fastest 1-token step: on a
Sapphire Rapids-class Xeon the `amx` path verifies 17 tokens for ~1.5x a step, but its 1-token
step was measured 10-17% slower than the `avx2` path's (docs/kernels.md). Plain decoding runs
only 1-token steps, so a target-only row on the process's path would be a handicapped baseline.

`fastest_plain_path` loads the target once more on each other kernel path this CPU runs, times
sustained 1-token decoding on each (a run of consecutive steps, the fastest run of a few, in
turns), and returns the fastest path with the target loaded there. A run, not the fastest single
step: single steps once picked a path whose target-only row then decoded 9% slower than the
reference row beside it (docs/benchmarks.md, session 28). The bench then runs its "target-only"
row on that path; target-only on the process's path stays as the greedy reference (bits differ
between paths, so SpecRouter's greedy output is checked against the same path's plain decoding).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

PROBE_CONTEXT = 128  # tokens in the slot while a 1-token step is timed
PROBE_STEPS = 24  # consecutive 1-token steps per path per round, timed as one run
PROBE_ROUNDS = 3  # rounds over every path, in turns (the fastest run counts)
MARGIN = 0.02  # another path must be this much faster per step to replace the process's


@dataclass(frozen=True)
class PlainPath:
    """Where the target decodes plainly fastest: `path`, with the target loaded there in
    `runner` (None when it is the process's path, `process_path`); `step_ms` per path probed."""

    path: str
    process_path: str
    step_ms: dict[str, float] = field(default_factory=dict)
    runner: object | None = None

    def to_json(self) -> dict:
        return {"path": self.path, "process_path": self.process_path,
                "step_ms": {p: round(ms, 3) for p, ms in self.step_ms.items()}}


def one_token_seconds(runner, *, context: int = PROBE_CONTEXT, steps: int = PROBE_STEPS, seed: int = 0) -> float:
    """Seconds per step of sustained plain decoding on `runner`: `steps` consecutive 1-token
    forwards after `context` tokens (the context grows as in decoding; one warm-up step first)."""
    from specrouter.models.runners.base import ForwardBatch

    rng = random.Random(seed)
    vocab = int(runner.vocab_size)
    runner.reserve(max(runner.num_slots, 1), max(runner.max_len, context + steps + 2))
    slot = runner.allocate_slot()
    try:
        prompt = [rng.randrange(vocab) for _ in range(context)]
        runner.forward(ForwardBatch.build([slot], [0], [prompt], [[context - 1]]))
        tokens = [rng.randrange(vocab) for _ in range(steps + 1)]
        runner.forward(ForwardBatch.build([slot], [context], [[tokens[0]]], [[0]]))  # warm-up
        t0 = time.perf_counter()
        for i in range(1, steps + 1):
            runner.forward(ForwardBatch.build([slot], [context + i], [[tokens[i]]], [[0]]))
        return (time.perf_counter() - t0) / steps
    finally:
        runner.free_slot(slot)


def candidate_paths(target) -> list[str]:
    """The kernel paths other than the process's on which `target` could run here: a native
    CPU runner (float32 / bfloat16) and paths whose CPU flags (and OS state) are present (its
    checkpoint to load them from: `fastest_plain_path`'s check)."""
    from specrouter.models.runners.kernels import PATHS, kernel_path, why_not
    from specrouter.models.runners.llama import LlamaRunner

    if not isinstance(target, LlamaRunner) or target.device.type != "cpu" or target._ops is None:
        return []
    here = kernel_path()
    return [p for p in PATHS if p != here and (p == "torch" or not why_not(p))]


def fastest_plain_path(pool, paths: list[str] | None = None, *, margin: float = MARGIN,
                       force: str | None = None, log=print) -> PlainPath | None:
    """The fastest 1-token path of `pool`'s target among the process's and `paths` (default:
    every candidate path); None where the target cannot run on another path (not a native CPU
    runner). Paths that lose are unloaded; the winner's runner is returned for its row.
    `force`: that path wins whatever the timings (tests, reproductions); timed all the same."""
    from specrouter.models.runners.kernels import kernel_path
    from specrouter.models.runners.llama import load_llama_runner

    target = pool.runners[pool.target]
    here = kernel_path()
    paths = candidate_paths(target) if paths is None else [p for p in paths if p != here]
    if force is not None and force != here:
        paths = [force, *(p for p in paths if p != force)]
    if not paths or getattr(target, "checkpoint_dir", None) is None:
        return None
    runners = {here: target}
    for p in paths:
        runners[p] = load_llama_runner(target.checkpoint_dir, name=target.name, dtype=target.dtype,
                                       num_slots=1, max_len=PROBE_CONTEXT + PROBE_STEPS + 2, kernels=p)
        runners[p].checkpoint_dir = target.checkpoint_dir
    seconds = {p: float("inf") for p in runners}
    for _ in range(PROBE_ROUNDS):  # in turns: a machine that slows down slows every path alike
        for p, r in runners.items():
            seconds[p] = min(seconds[p], one_token_seconds(r))
    best = min(seconds, key=seconds.get)
    if seconds[best] > (1 - margin) * seconds[here]:
        best = here  # within the margin: the process's path, no second copy of the weights
    if force is not None:
        best = force
    step_ms = {p: 1e3 * s for p, s in seconds.items()}
    log("plain decoding's 1-token step (sustained) per kernel path: "
        + ", ".join(f"{p} {ms:.2f} ms" for p, ms in sorted(step_ms.items(), key=lambda kv: kv[1]))
        + (f"; target-only runs on {best} (SpecRouter on {here})" if best != here else ""))
    return PlainPath(best, here, step_ms, None if best == here else runners[best])
