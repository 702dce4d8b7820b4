"""Micro-benchmark: per-step latency of the native Llama runner vs a naive transformers loop and
llama.cpp (when llama-cpp-python, the `peers` extra, is installed).

Builds random Llama checkpoints with SmolLM2's vocabulary (49152) in a temp dir: ~5M params
(hidden 128, 4 layers), ~50M (hidden 512, 8 layers) and the SmolLM2-135M shape (hidden 576,
30 layers, 9 heads, 3 KV heads, intermediate 1536, tied). For each, after a 128-token prefill,
it times steps of 1 and 5 new tokens (logits at every new token, then rolled back so the
context stays ~128): the native runner (rollback = same start again) against transformers with
a DynamicCache and `crop` (what a naive speculative loop does), in float32 and bfloat16.

With llama-cpp-python, the same random 135M weights and the shipped draft are written as F32
and BF16 GGUFs (bench/peers.py `write_gguf`) and llama.cpp's 1-token step and 5-, 9- and
17-token forwards (logits at every token) are timed the same way, taking turns with the native
runner on its own kernels and on torch's: the issue-12 goal is <= 1.25x llama.cpp's time at the
same precision (issue 26: the 1-token step <= 1.0x), and T(n)/T(1) of each system is printed.

Row scaling (issue 26): on the 135M shape, per kernel path this CPU has (kernels.PATHS: the
native ones and torch's) and precision, T(n) = a forward of n new tokens (logits at every one,
what verifying n-1 drafted tokens costs) for n = 1, 2, 3, 5, 9, 17, 33 (a token tree's budget,
issue 28), printed as T(n)/T(1); the paths take turns. Then GMAC/s of each path's linear per row count on the 135M shapes (qkv, o,
gate|up, down, the LM head) beside torch's own GEMM (MKL/oneDNN: torch.mm float32, F.linear
bfloat16) on the same shapes, which promises no row invariance: timed last, the systems in
turns over `--rounds` rounds, the min kept, with the ratio to torch's sgemm at 8+ rows (issue
26's AVX2 goal) and, beside it, the GMAC/s of the scaling section's whole steps (a linear's own
rate must not read below the step it is part of).

The decoder stack's work sharing (issue 26, a stolen core): `--sections stack` times T(n) of the
bfloat16 135M for each `--schedules` of the native stack's threads (kernels/rowinv.cpp
`set_stack_schedule`), quiet and beside a process busy `--busy` percent of every 10 ms.

    python benchmarks/runner_micro.py [--iters 30] [--threads 2] [--shapes 135M] [--no-transformers]
                                      [--sections steps scaling gemm stack] [--paths avx512bf16 torch]

Not a test: timings depend on the machine and on whoever else shares its cores.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # test fixtures

from fixtures import make_tiny_llama

from specrouter.models.runners.base import ForwardBatch
from specrouter.models.runners.llama import load_llama_runner

CONTEXT = 128
STEP_TOKENS = (1, 5)
PEER_TOKENS = (1, 5, 9, 17)  # steps timed beside llama.cpp (a verification of n - 1 drafted tokens)
SCALING_TOKENS = (1, 2, 3, 5, 9, 17, 33)  # T(n): a verification of n - 1 drafted tokens (33: a tree's nodes)
# the 135M target's linears (out, in) and how many of each a forward runs
LINEARS_135M = {"qkv": (960, 576, 30), "o": (576, 576, 30), "gate|up": (3072, 576, 30),
                "down": (576, 1536, 30), "lm head": (49152, 576, 1)}
SHAPES = {  # name: make_tiny_llama kwargs
    "5M": dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=384),
    "50M": dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1536),
    "135M": dict(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, intermediate_size=1536),
}


def _time_ms(fn, iters: int, warmup: int = 3) -> tuple[float, float]:
    """(median, min) wall ms of `fn`. On shared cores the min is the better estimate of the
    uncontended cost; the median is what a user sees."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times), 1000 * min(times)


def native_steps(path: Path, dtype: torch.dtype, kernels: str = "native",
                 tokens: tuple[int, ...] = STEP_TOKENS, huge: bool = True) -> dict[int, Callable[[], object]]:
    """{new tokens: a step} of each of `tokens` after a CONTEXT-token prefill, each rolled back
    (the same start every time), on the native kernels (the process's path, or the path
    `kernels` names) or on torch's (`kernels="torch"`); huge=False: the weights left on torch's
    4 KiB pages (runners/huge_pages.py)."""
    from specrouter.models.runners import huge_pages

    huge_pages.HUGE_PAGES = huge
    try:
        runner = load_llama_runner(path, dtype=dtype, num_slots=1, max_len=CONTEXT + max(32, max(tokens) + 8),
                                   kernels=kernels)
    finally:
        huge_pages.HUGE_PAGES = True
    prompt = torch.randint(0, runner.vocab_size, (CONTEXT,)).tolist()
    runner.forward(ForwardBatch.build([0], [0], [prompt], [[CONTEXT - 1]]))
    steps = {}
    for t in tokens:
        batch = ForwardBatch.build([0], [CONTEXT], [prompt[:t]], [list(range(t))])
        steps[t] = functools.partial(runner.forward, batch)
    return steps


def time_native(path: Path, dtype: torch.dtype, iters: int) -> dict[int, tuple[float, float]]:
    """{new tokens: (median, min) ms} for steps of 1 and 5 tokens after a CONTEXT-token prefill."""
    return {t: _time_ms(step, iters) for t, step in native_steps(path, dtype).items()}


def time_transformers(path: Path, dtype: torch.dtype, iters: int) -> dict[int, tuple[float, float]]:
    """The same steps through transformers: DynamicCache, then `crop` back to CONTEXT."""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, CONTEXT))
    cache = DynamicCache(config=model.config)
    out = {}
    with torch.inference_mode():
        model(prompt, cache=cache, use_cache=True)
        for t in STEP_TOKENS:
            step = prompt[:, :t]

            def run() -> None:
                model(step, cache=cache, use_cache=True)
                cache.crop(-t)

            out[t] = _time_ms(run, iters)
    return out


def llama_cpp_steps(path: Path, gguf_dtype: str, threads: int,
                    tokens: tuple[int, ...] = STEP_TOKENS) -> dict[int, Callable[[], None]]:
    """llama.cpp on the same weights: a CONTEXT-token prefill, then steps of each of `tokens`
    new tokens (logits at every new token), each rolled back to CONTEXT (n_tokens = CONTEXT)."""
    from llama_cpp import Llama

    from specrouter.bench.peers import cached_gguf

    # made on demand into the cache (never beside the checkpoint: the shipped draft's folder is
    # in the package, and derived files do not belong in the tracked tree)
    gguf = cached_gguf(path, gguf_dtype)
    llm = Llama(model_path=str(gguf), n_ctx=CONTEXT + 32, n_batch=CONTEXT + 32, n_threads=threads,
                n_threads_batch=threads, logits_all=True, verbose=False)
    prompt = torch.randint(0, llm.n_vocab(), (CONTEXT,)).tolist()
    llm.eval(prompt)

    def step(t: int) -> None:
        llm.n_tokens = CONTEXT  # rollback: eval drops the cache past n_tokens
        llm.eval(prompt[:t])

    return {t: functools.partial(step, t) for t in tokens}


DTYPES = {"fp32": (torch.float32, "F32"), "bf16": (torch.bfloat16, "BF16")}  # name: (torch dtype, GGUF type)


def compare_with_llama_cpp(models: dict[str, Path], threads: int, iters: int, rounds: int = 3,
                           dtypes: tuple[str, ...] = tuple(DTYPES), small_pages: bool = False) -> dict:
    """{(model, dtype, tokens): {system: min ms}} for the native runner on its own kernels,
    on torch's kernels (what it ran before them) and llama.cpp on the same weights as a GGUF;
    small_pages: also the native runner with its weights on 4 KiB pages.
    The systems take turns, `rounds` times `iters` steps each, so drift on shared cores hits
    them alike; the min over all rounds is reported."""
    out: dict[tuple[str, str, int], dict[str, float]] = {}
    for model, path in models.items():
        for dt_name in dtypes:
            dt, gguf = DTYPES[dt_name]
            systems = {
                "native": native_steps(path, dt, tokens=PEER_TOKENS),
                "torch kernels": native_steps(path, dt, kernels="torch", tokens=PEER_TOKENS),
                "llama.cpp": llama_cpp_steps(path, gguf, threads, PEER_TOKENS),
            }
            if small_pages:
                systems["native 4K"] = native_steps(path, dt, tokens=PEER_TOKENS, huge=False)
            for t in PEER_TOKENS:
                best = {name: float("inf") for name in systems}
                for _ in range(rounds):
                    for name, steps in systems.items():
                        best[name] = min(best[name], _time_ms(steps[t], iters)[1])
                out[(model, dt_name, t)] = best
                print(f"{model} {dt_name} {t}-token: " + ", ".join(f"{k} {v:.2f} ms" for k, v in best.items()),
                      flush=True)
    return out


def available_paths() -> list[str]:
    """The kernel paths this CPU runs (kernels.PATHS minus those it lacks a flag for)."""
    from specrouter.models.runners.kernels import PATHS, rowinv, why_not

    return [p for p in PATHS if p == "torch" or (why_not(p) is None and rowinv() is not None)]


def time_scaling(path: Path, paths: list[str], iters: int, rounds: int = 4) -> dict:
    """{(dtype name, kernel path): {n: min ms}}: T(n) for n in SCALING_TOKENS on each path; each
    round times every n on every path in turn, so drift on shared cores hits T(n) and T(1) alike;
    the min over `rounds` rounds is reported."""
    out: dict[tuple[str, str], dict[int, float]] = {}
    for dt_name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        systems = {p: native_steps(path, dt, kernels=p, tokens=SCALING_TOKENS) for p in paths}
        for _ in range(rounds):
            for n in SCALING_TOKENS:
                for p, steps in systems.items():
                    cell = out.setdefault((dt_name, p), {})
                    cell[n] = min(cell.get(n, float("inf")), _time_ms(steps[n], iters, warmup=1)[1])
        for p in paths:
            row = out[(dt_name, p)]
            print(f"135M {dt_name} {p:>10}: " + ", ".join(f"T({n}) {row[n]:.2f} ms" for n in SCALING_TOKENS),
                  flush=True)
    return out


STACK_TOKENS = (1, 5, 9, 17)
BUSY_LOOP = """
import sys, time
busy, period = float(sys.argv[1]) / 1000, float(sys.argv[2]) / 1000
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < busy:
        pass
    time.sleep(period - busy)
"""


def time_stack(path: Path, schedules: list[str], iters: int, rounds: int, busy: float) -> dict:
    """{(load, schedule): {n: (median, min) ms}}: T(n) of the bfloat16 135M on this process's
    kernel path with the native decoder stack's threads sharing their work by each schedule
    (kernels/rowinv.cpp `set_stack_schedule`: static, dynamic, guided, or ops = one
    fork and join per op), the schedules in turn; quiet, then (busy > 0) beside a process busy
    `busy` percent of every 10 ms (a stolen core: the server's event loop and client share the
    cores with the step's threads)."""
    import subprocess

    from specrouter.models.runners.kernels import rowinv

    ops = rowinv()
    if ops is None:
        return {}
    steps = native_steps(path, torch.bfloat16, tokens=STACK_TOKENS)
    out: dict = {}
    for load in ["quiet"] + ([f"busy {busy:g}%"] if busy > 0 else []):
        proc = None
        if load != "quiet":
            proc = subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(busy / 10), "10"])
        try:
            for _ in range(rounds):
                for n in STACK_TOKENS:
                    for sched in schedules:
                        ops.set_stack_schedule(sched, 1)
                        med, mn = _time_ms(steps[n], iters, warmup=1)
                        old = out.setdefault((load, sched), {}).get(n, (float("inf"), float("inf")))
                        out[(load, sched)][n] = (min(old[0], med), min(old[1], mn))
        finally:
            ops.set_stack_schedule("static", 1)
            if proc is not None:
                proc.kill()
                proc.wait()
    return out


def print_stack(stack: dict) -> None:
    if not stack:
        return
    print("\nthe decoder stack's work sharing (bf16 135M; best median / min ms over rounds; T(n)/T(1) of the mins)")
    for (load, sched), row in stack.items():
        cells = " ".join(f"T({n}) {row[n][0]:6.2f}/{row[n][1]:6.2f}" for n in STACK_TOKENS)
        ratios = " ".join(f"{row[n][1] / row[1][1]:.2f}" for n in STACK_TOKENS)
        print(f"{load:>10} {sched:>7}: {cells} | {ratios}")


def time_gemm(paths: list[str], iters: int, rounds: int = 4) -> dict:
    """{(dtype name, system): {n: GMAC/s}} over the 135M linears (each weighted by how many a
    forward runs): each native path's linear, and torch's GEMM on the same shapes. A cell is
    the sum over the linears of count x the min wall time of one call; every system takes its
    turn at every linear in each of `rounds` rounds (a disturbed moment hits all systems alike
    and the min over rounds drops it). The weights of one linear stay in cache between calls:
    this is the kernels' arithmetic rate, not the weight stream of a step (`step_gmacs`)."""
    import torch.nn.functional as F

    from specrouter.models.runners.linear import NATIVE_BY_PATH, Linear, linear

    g = torch.Generator().manual_seed(0)
    out: dict[tuple[str, str], dict[int, float]] = {}
    for dt_name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        weights = {k: torch.randn(o, i, generator=g).mul_(i**-0.5).to(dt) for k, (o, i, _) in LINEARS_135M.items()}
        systems: dict[str, dict[str, Callable]] = {}
        for p in paths:
            if p == "torch":
                continue
            packed = {k: Linear.pack(w, None, NATIVE_BY_PATH[p][dt]) for k, w in weights.items()}
            systems[p] = {k: functools.partial(linear, w=packed[k]) for k in weights}
        if dt == torch.float32:  # MKL's sgemm on the (in, out) layout
            wt = {k: w.t().contiguous() for k, w in weights.items()}
            systems["torch GEMM"] = {k: functools.partial(lambda x, w: torch.mm(x, w), w=wt[k]) for k in weights}
        else:  # oneDNN's bfloat16 linear as F.linear runs it
            systems["torch GEMM"] = {k: functools.partial(lambda x, w: F.linear(x, w), w=w) for k, w in weights.items()}
        for n in SCALING_TOKENS:
            xs = {k: torch.randn(n, i, generator=g).to(dt) for k, (_, i, _) in LINEARS_135M.items()}
            macs = sum(n * o * i * c for o, i, c in LINEARS_135M.values())
            best = {(name, k): float("inf") for name in systems for k in LINEARS_135M}
            for _ in range(rounds):
                for k in LINEARS_135M:
                    for name, fns in systems.items():
                        ms = _time_ms(functools.partial(fns[k], xs[k]), iters, warmup=2)[1]
                        best[(name, k)] = min(best[(name, k)], ms)
            for name in systems:
                ms = sum(c * best[(name, k)] for k, (_, _, c) in LINEARS_135M.items())
                out.setdefault((dt_name, name), {})[n] = macs / ms / 1e6
    return out


def step_gmacs(scaling: dict) -> dict:
    """{(dtype name, path): {n: GMAC/s}} of whole steps: the 135M linears' multiply-adds at n
    rows over the scaling section's T(n) (attention, norms and the weight stream included), a
    floor the linears' own rate (`time_gemm`) must stay above in the same run."""
    macs1 = sum(o * i * c for o, i, c in LINEARS_135M.values())
    return {key: {n: n * macs1 / ms / 1e6 for n, ms in row.items()} for key, row in scaling.items()}


def print_scaling(scaling: dict, gemm: dict) -> None:
    """The T(n)/T(1) and GMAC/s tables, with issue 26's goals on AVX-512-BF16."""
    goals = {5: 1.3, 9: 1.6, 17: 2.2}
    if scaling:
        print("\nT(n)/T(1) on the 135M shape (a forward of n new tokens, logits at each, context "
              f"{CONTEXT}; min ms; issue 26 goals on AVX-512-BF16 machines (paths amx, avx512bf16) in bf16: "
              + ", ".join(f"T({n})/T(1) <= {g}" for n, g in goals.items()) + ")")
        print(f"{'dtype':>5} {'path':>10} {'T(1) ms':>8} | " + " ".join(f"{f'T({n})/T(1)':>9}" for n in SCALING_TOKENS[1:]))
        for (dt_name, p), row in scaling.items():
            print(f"{dt_name:>5} {p:>10} {row[1]:8.2f} | "
                  + " ".join(f"{row[n] / row[1]:9.2f}" for n in SCALING_TOKENS[1:]))
        for p in ("amx", "avx512bf16"):
            if ("bf16", p) in scaling:
                row = scaling[("bf16", p)]
                print(f"goals ({p} bf16): " + ", ".join(
                    f"T({n})/T(1) {row[n] / row[1]:.2f} {'met' if row[n] / row[1] <= g else 'NOT met'}"
                    for n, g in goals.items()))
    if gemm:
        print("\nGMAC/s over the 135M linears (qkv, o, gate|up, down x30, the LM head), per row count"
              " (torch GEMM: torch.mm fp32 / F.linear bf16, not row-invariant)")
        print(f"{'dtype':>5} {'system':>10} | " + " ".join(f"{f'n={n}':>7}" for n in SCALING_TOKENS))
        for (dt_name, name), row in gemm.items():
            print(f"{dt_name:>5} {name:>10} | " + " ".join(f"{row[n]:7.1f}" for n in SCALING_TOKENS))
        for dt_name in ("bf16", "fp32"):  # issue 26 (AVX2): native at 8+ rows >= 0.9x torch's sgemm
            sgemm = gemm.get(("fp32", "torch GEMM"))
            for (d, name), row in gemm.items():
                if d != dt_name or name == "torch GEMM" or sgemm is None:
                    continue
                print(f"{dt_name} {name} / fp32 torch sgemm: " + ", ".join(
                    f"n={n} {row[n] / sgemm[n]:.2f}x" for n in SCALING_TOKENS if n >= 8))
    if scaling:
        print("\nGMAC/s of whole steps (the linears' multiply-adds over the same run's T(n))")
        for (dt_name, p), row in step_gmacs(scaling).items():
            print(f"{dt_name:>5} {p:>10} | " + " ".join(f"{row[n]:7.1f}" for n in SCALING_TOKENS))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=30, help="timed steps per cell (median reported)")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--no-transformers", action="store_true", help="native runner (and llama.cpp) only")
    ap.add_argument("--sections", nargs="+", default=["steps", "scaling", "gemm"],
                    choices=["steps", "scaling", "gemm", "stack"],
                    help="steps: per shape 1/5-token steps vs transformers and llama.cpp; scaling: T(n)/T(1)"
                         " per kernel path on 135M; gemm: GMAC/s per row count vs torch's GEMM; stack: T(n) per"
                         " work-sharing schedule of the native decoder stack, quiet and with --busy")
    ap.add_argument("--paths", nargs="+", default=None, help="kernel paths for scaling/gemm (default: all this CPU has)")
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES),
                    help="precisions of the steps section and the llama.cpp comparison")
    ap.add_argument("--small-pages", action="store_true",
                    help="llama.cpp comparison: also the native runner with its weights on 4 KiB pages")
    ap.add_argument("--schedules", nargs="+", default=["static", "dynamic", "ops"],
                    help="stack section: the decoder stack's schedules (static, dynamic, guided, ops)")
    ap.add_argument("--busy", type=float, default=10.0,
                    help="stack section: also time beside a process busy this percent of every 10 ms (0: quiet only)")
    ap.add_argument("--no-drafts", action="store_true", help="llama.cpp comparison on the 135M shape only")
    ap.add_argument("--rounds", type=int, default=3,
                    help="llama.cpp comparison and gemm section (at least 2): rounds of turns per cell (more,"
                         " shorter turns track a drifting memory bandwidth better)")
    args = ap.parse_args()
    from specrouter.bench.peers import llama_cpp_missing
    from specrouter.models.runners.linear import kernels

    peer_missing = llama_cpp_missing()
    if peer_missing:
        print(f"llama.cpp columns missing: {peer_missing}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    Cell = tuple[float, float]  # (median, min) ms
    results: dict[tuple[str, str, int], tuple[Cell, Cell]] = {}  # (native, transformers)
    paths = args.paths or available_paths()
    scaling: dict = {}
    stack: dict = {}
    with tempfile.TemporaryDirectory(prefix="specrouter-bench-") as tmp:
        for name in args.shapes:
            kw = SHAPES[name]
            path = make_tiny_llama(
                Path(tmp) / name,
                vocab_size=49152,
                max_position_embeddings=2048,
                with_tokenizer=False,
                **kw,
            )
            if name == "135M" and "scaling" in args.sections:
                scaling = time_scaling(path, paths, max(6, args.iters // 4))
            if name == "135M" and "stack" in args.sections:
                stack = time_stack(path, args.schedules, max(8, args.iters // 2), args.rounds, args.busy)
            if "steps" not in args.sections:
                continue
            n_params = load_llama_runner(path, max_len=8).num_params
            iters = max(8, args.iters // 3) if name == "135M" else args.iters
            for dt_name in args.dtypes:
                dt = DTYPES[dt_name][0]
                nat = time_native(path, dt, iters)
                nan = (float("nan"), float("nan"))
                hf = {t: nan for t in STEP_TOKENS} if args.no_transformers else time_transformers(path, dt, iters)
                for t in STEP_TOKENS:
                    results[(name, dt_name, t)] = (nat[t], hf[t])
                    print(
                        f"{name:>5} ({n_params / 1e6:5.1f}M) {dt_name} {t}-token: median native "
                        f"{nat[t][0]:7.2f} ms, transformers {hf[t][0]:7.2f} ms",
                        flush=True,
                    )
            if name == "135M" and not peer_missing:  # (llama.cpp steps of 1, 5, 9 and 17 tokens)
                from specrouter.models.default_pool import shipped_drafts

                # the shipped draft: the native runner computes only its draft vocabulary's
                # head rows, llama.cpp the whole head (it has no such option)
                drafts = {} if args.no_drafts else {"draft " + d.name[-4:]: d for d in shipped_drafts()}
                peers = compare_with_llama_cpp({"135M shape": path, **drafts}, args.threads, max(4, args.iters // 3),
                                               rounds=args.rounds, dtypes=tuple(args.dtypes),
                                               small_pages=args.small_pages)
    # the GEMM section last: after the steps (the same machine state), in rounds of turns
    gemm = time_gemm(paths, max(6, args.iters // 3), max(2, args.rounds)) if "gemm" in args.sections else {}
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\nms per step, context {CONTEXT}, {args.threads} threads, torch {torch.__version__}, kernels {kernels()}")
    print(f"(load average at the end: {load}; other processes on the cores inflate every number)")
    print(
        f"{'model':>6} {'dtype':>5} {'tokens':>6} | {'native':>8} {'transf.':>8} {'speed-up':>8} |"
        f" {'min nat.':>8} {'min tr.':>8} {'speed-up':>8}"
    )
    for (name, dt_name, t), (nat, hf) in results.items():
        print(
            f"{name:>6} {dt_name:>5} {t:>6} | {nat[0]:8.2f} {hf[0]:8.2f} {hf[0] / nat[0]:7.2f}x |"
            f" {nat[1]:8.2f} {hf[1]:8.2f} {hf[1] / nat[1]:7.2f}x"
        )
    print_scaling(scaling, gemm)
    print_stack(stack)
    if not peer_missing and "steps" in args.sections and "135M" in args.shapes:
        print("\nvs llama.cpp on the same weights (min ms over interleaved rounds; ratio = native / llama.cpp;"
              " issue 12 goal: ratio <= 1.25; issue 26: 1-token <= 1.0x; T(n)/T(1) per system)")
        print(f"{'model':>14} {'dtype':>5} {'tokens':>6} | {'native':>8} {'torch kern.':>11} {'llama.cpp':>9}"
              f" | {'ratio':>6} {'goal':>7} | {'T(n)/T(1) native':>16} {'llama.cpp':>9}")
        for (model, dt_name, t), best in peers.items():
            nat, old, lc = best["native"], best["torch kernels"], best["llama.cpp"]
            one = peers[(model, dt_name, 1)]
            small = f" | 4 KiB pages {best['native 4K']:.2f} ms" if "native 4K" in best else ""
            print(f"{model:>14} {dt_name:>5} {t:>6} | {nat:8.2f} {old:11.2f} {lc:9.2f} | {nat / lc:5.2f}x"
                  f" {'met' if nat <= 1.25 * lc else 'NOT met':>7} | {nat / one['native']:16.2f}"
                  f" {lc / one['llama.cpp']:9.2f}{small}")
    for dt_name in ("fp32", "bf16"):
        if ("5M", dt_name, 1) not in results or ("135M", dt_name, 1) not in results:
            continue
        small, big = results[("5M", dt_name, 1)][0], results[("135M", dt_name, 1)][0]
        print(
            f"native 1-token step, 5M / 135M ({dt_name}): median {small[0] / big[0]:.3f},"
            f" min {small[1] / big[1]:.3f} (goal < {1 / 8:.3f})"
        )

if __name__ == "__main__":
    main()
