"""The GPU check of issue 33: one script, run once on a bare GPU machine (PyTorch, Triton and
transformers installed; no network; only a copy of this repository, not installed), < 5 minutes.

    python benchmarks/gpu_check.py [--out gpu_check.json]          # on the GPU (device auto)
    python benchmarks/gpu_check.py --device cpu --quick            # the same code paths on CPU

What it measures, written as JSON with the device's name (GPU model or CPU model):
1. runner: the target's forward per (batch, tokens) bucket, eager and replayed as a CUDA graph
   (GPU), at a 128-token context; T(t)/T(1) at batch 1 for t = 1..17.
2. invariance: the target's logits bitwise the same for a position computed in one prefill, in
   1-token steps, in (k+1)-token verifies and beside other rows in a ragged batch (graphed and
   eager), and graphed == eager; torch's own kernels (cuBLAS) are checked the same way, as the
   negative control (they are expected NOT to be invariant on a GPU).
3. engine: greedy output and tokens/s of target-only, draft>target (k = 4) and the router, each
   compared token for token with target-only; the engine's per-token time against the raw
   graphed 1-token forward; transformers' `generate` on the same device as the peer.
4. noise_kernel (GPU): seeded sampling's Triton kernel chooses the reference's token on every row, and
   its ms per call against the torch path's (~100 small ops); the engine at t=0.7 as in 3.

The models: the target has random weights in SmolLM2-135M's shape (the real target's GGUF does
not travel); the draft is a controlled-acceptance pair with it: the target's first
`--draft-layers` layers (same embedding, norm and head), while the target's later layers add only
`--noise` times their random output to the residual stream. The draft then agrees with the target
on most tokens (the run reports the acceptance), the target pays its whole 30 layers, and
exactness is still tested (the small perturbation flips some argmaxes).

Each section records its error and the script goes on (a GPU run is precious): the JSON says what
ran. `--quick` shrinks the shapes and counts (the CPU test, tests/test_gpu_check.py, runs that).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # the repository copy, not an installed package

import torch  # noqa: E402

# the SmolLM2-135M shape (config.json of HuggingFaceTB/SmolLM2-135M-Instruct)
TARGET_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)
QUICK_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=6, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=2048, tie_word_embeddings=True)
GOALS = {  # issue 33's GPU goals (checked only where the device is a GPU)
    "T5/T1 <= 1.15": ("t5_over_t1", 1.15, "<="),
    "T17/T1 <= 1.5": ("t17_over_t1", 1.5, "<="),
    "engine per-token time <= 1.3x the raw graphed forward": ("engine_over_raw", 1.3, "<="),
    "router >= 1.5x target-only (controlled pair)": ("router_speedup", 1.5, ">="),
    "faster than transformers generate": ("speedup_vs_hf", 1.0, ">"),
}


# -- models ---------------------------------------------------------------------------------------
def write_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer with `vocab_size` tokens t0..t{V-1} (prompts are token ids; the pool
    only needs every model to share it). t1 is EOS (requests ignore it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1", bos_token="t2",
                            unk_token="t0").save_pretrained(str(out))


def write_pair(root: Path, shape: dict, draft_layers: int, noise: float, seed: int = 0) -> tuple[Path, Path]:
    """(target dir, draft dir): random Llama weights in `shape`; the draft is the target's first
    `draft_layers` layers; the target's later layers write `noise` x their output."""
    from safetensors.torch import save_file

    from specrouter.models.runners.llama import LlamaArchitecture

    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
              "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "rope_theta": 10000.0,
              "torch_dtype": "float32", "bos_token_id": 2, "eos_token_id": 1, **shape}
    g = torch.Generator().manual_seed(seed)
    arch = LlamaArchitecture.from_config(config)
    tensors = {}
    for name, dims in arch.expected_shapes().items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(dims)
        else:
            # layers stronger than the embedding, so the output is not the input token repeated
            tensors[name] = torch.randn(dims, generator=g) * (0.02 if "embed" in name else 0.06)
        layer = int(name.split(".")[1]) if name.startswith("layers.") else -1
        if layer >= draft_layers and ("o_proj" in name or "down_proj" in name):
            tensors[name] *= noise
    out = {}
    for name, layers in (("target", shape["num_hidden_layers"]), ("draft", draft_layers)):
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        keep = {("model." + n if n != "lm_head.weight" else n): t.contiguous() for n, t in tensors.items()
                if not n.startswith("layers.") or int(n.split(".")[1]) < layers}
        save_file(keep, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
        write_tokenizer(d, shape["vocab_size"])
        out[name] = d
    return out["target"], out["draft"]


# -- timing ---------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def min_ms(fn, device: torch.device, iters: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    best = math.inf
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def load_runner(path: Path, device: torch.device, dtype: torch.dtype, kernels: str, graphs: bool,
                slots: int = 8, max_len: int = 512):
    from specrouter.models.runners.llama import load_llama_runner

    runner = load_llama_runner(path, dtype=dtype, device=device, kernels=kernels, num_slots=slots, max_len=max_len)
    if graphs:
        from specrouter.models.runners.triton.graphs import GraphedRunner

        runner = GraphedRunner(runner)
        runner.reserve(slots, max_len)
    return runner


def runner_timings(runner, device, batches, tokens, context: int, iters: int) -> dict:
    """ms per forward of (b rows x t new tokens) at `context` cached positions (rolled back)."""
    from specrouter.models.runners.base import ForwardBatch

    V = runner.vocab_size
    b_max = max(batches)
    slots = [runner.allocate_slot() for _ in range(b_max)]
    g = torch.Generator().manual_seed(1)
    try:
        runner.forward(ForwardBatch.build(slots, [0] * b_max, [torch.randint(0, V, (context,), generator=g).tolist()] * b_max,
                                          [[context - 1]] * b_max))
        out = {}
        for b in batches:
            for t in tokens:
                feed = [torch.randint(0, V, (t,), generator=g).tolist() for _ in range(b)]
                batch = ForwardBatch.build(slots[:b], [context] * b, feed, [list(range(t))] * b)
                out[f"{b}x{t}"] = min_ms(lambda: runner.forward(batch), device, iters)
        return out
    finally:
        for s in slots:
            runner.free_slot(s)


# -- invariance -----------------------------------------------------------------------------------
def invariance(runner, seed: int = 2) -> dict:
    """Whether a position's logits are the same bits in a prefill, in 1-token steps, in 5-token
    verifies and beside other rows (ragged); max |difference| of each."""
    from specrouter.models.runners.base import ForwardBatch

    V = runner.vocab_size
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, V, (48,), generator=g).tolist()
    other = torch.randint(0, V, (40,), generator=g).tolist()
    s = [runner.allocate_slot() for _ in range(3)]
    try:
        whole = runner.forward(ForwardBatch.build([s[0]], [0], [toks], [list(range(48))]))[0].float()  # (48, V)
        runner.forward(ForwardBatch.build([s[1]], [0], [toks[:32]], [[31]]))
        steps = torch.stack([runner.forward(ForwardBatch.build([s[1]], [32 + i], [[toks[32 + i]]], [[0]]))[0, 0]
                             for i in range(16)]).float()
        runner.forward(ForwardBatch.build([s[1]], [0], [toks[:32]], [[31]]))
        verifies = torch.cat([runner.forward(ForwardBatch.build([s[1]], [32 + 5 * i], [toks[32 + 5 * i: 37 + 5 * i]],
                                                                [list(range(5))]))[0] for i in range(3)]).float()
        runner.forward(ForwardBatch.build([s[2]], [0], [other], [[39]]))
        batch = ForwardBatch.build([s[2], s[1]], [40, 32], [[7], toks[32:37]], [[0], list(range(5))])
        ragged = runner.forward(batch)[1].float()  # row 1 verifies 5 beside a 1-token step
    finally:
        for x in s:
            runner.free_slot(x)

    def cmp(a, b):
        return {"bitwise": bool(torch.equal(a, b)), "max_abs_diff": float((a - b).abs().max())}

    res = {"steps_vs_prefill": cmp(steps, whole[32:48]), "verify5_vs_prefill": cmp(verifies, whole[32:47]),
           "ragged_batch_vs_prefill": cmp(ragged, whole[32:37])}
    res["all_bitwise"] = all(v["bitwise"] for v in res.values())
    return res


# -- sampling noise -------------------------------------------------------------------------------
def noise_check(device: torch.device, V: int, iters: int) -> dict:
    """Seeded sampling's noise (decoding/noise.py) on the device: the Triton kernel's tokens
    against the materialized reference on the same device (rows at temperatures 0.05..5, flat,
    filtered and top-k rows; 2048 keys on one row), and ms per call against the torch path."""
    from specrouter.decoding import noise

    g = torch.Generator().manual_seed(4)
    N = 136  # 8 rows x 17 positions, the largest verify bucket
    temps = torch.tensor([0.05, 0.3, 0.7, 1.0, 2.0, 5.0])
    s = torch.randn(N, V, generator=g) * 3 / temps[torch.arange(N) % 6][:, None]
    s[5::11] = 0.0  # flat: every block a candidate
    s[7::13, V // 3:] = -math.inf  # filtered
    for i in range(3, N, 17):  # top-k 50
        s[i] = s[i].masked_fill(s[i] < s[i].topk(50).values[-1], -math.inf)
    keys = noise.position_keys(torch.tensor([noise.seed_key(i) for i in range(N)]), torch.arange(N) * 37 + 5)
    s, keys = s.to(device), keys.to(device)
    out = {"kernel": "triton" if noise._use_triton(s) else "cpu"}
    tokens = noise.coupled_argmax(s, keys)
    out["mismatch_vs_reference"] = int((tokens != noise.coupled_argmax_reference(s, keys)).sum())
    many = noise.position_keys(torch.full((2048,), noise.seed_key(7), device=device), torch.arange(2048, device=device))
    row = s[2:3].expand(2048, V).contiguous()  # temperature 0.7
    ref = torch.cat([noise.coupled_argmax_reference(row[i:i + 256], many[i:i + 256]) for i in range(0, 2048, 256)])
    out["mismatch_2048_keys"] = int((noise.coupled_argmax(row, many) != ref).sum())
    for n in (1, 17, N):
        for name, fn in (("dispatched", noise.coupled_argmax), ("torch", noise.coupled_argmax_torch)):
            out[f"{name}_ms_N{n}"] = min_ms(lambda: fn(s[:n], keys[:n]), device, iters)
    return out


# -- engine ---------------------------------------------------------------------------------------
def engine_runs(target: Path, draft: Path, device: str, dtype: str, prompts, max_new: int, cache: Path,
                graphs: bool, temperature: float = 0.0) -> dict:
    from specrouter.config import SamplingParams
    from specrouter.engine.engine import Engine
    from specrouter.models.pool import CUDA_GRAPHS_ENV, Pool
    from specrouter.router.setup import build_router

    os.environ[CUDA_GRAPHS_ENV] = "1" if graphs else "0"
    pool = Pool.load([str(draft), str(target)], target="target", dtype=dtype, device=device, ngram=False, suffix=False)
    # greedy, or seeded sampling (the same seed per request in every system: the output is a
    # function of (seed, position), so every chain must give target-only's tokens)
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True, temperature=temperature,
                            seed=1234 if temperature else None)
    profile_path = cache / f"profiles-{graphs}.json"
    router = build_router(pool, profile_path=profile_path, progress=False)
    systems = {"target-only": (Engine(pool), ("target",), 1),
               "draft>target k=4": (Engine(pool), ("draft", "target"), 4),
               "router": (Engine(pool, router=router), None, 4)}
    out, first = {}, None
    for name, (engine, chain, k) in systems.items():
        engine.generate_ids([prompts[0]], [params], chain=chain, k=k)  # warm-up: compiles, graph captures
        sync(pool.device)
        t0 = time.perf_counter()
        outputs, chains, drafted, accepted, cycles = [], {}, 0, 0, 0
        for p in prompts:  # one request at a time: batch 1, where a verify should cost one step
            seq = engine.generate_ids([p], [params], chain=chain, k=k)[0]
            outputs.append(list(seq.output_ids))
            st = seq.stats
            cycles += st.cycles
            for c, n in st.chains.items():
                chains[c] = chains.get(c, 0) + n
            drafted += sum(v for pair, v in st.drafted.items() if pair.endswith(">target"))
            accepted += sum(v for pair, v in st.accepted.items() if pair.endswith(">target"))
        sync(pool.device)
        wall = time.perf_counter() - t0
        n = sum(len(o) for o in outputs)
        first = outputs if first is None else first
        out[name] = {"tok_s": n / wall, "ms_per_token": 1e3 * wall / n, "tokens": n, "cycles": cycles,
                     "tokens_per_cycle": n / max(cycles, 1), "chains": chains,
                     "target_acceptance": accepted / drafted if drafted else None,
                     "identical_to_target_only": outputs == first, "outputs": outputs}
    try:  # what the router predicted from: the cost profile it measured on this device
        out["router"]["profile"] = json.loads(profile_path.read_text())
    except (OSError, ValueError) as e:
        out["router"]["profile"] = f"unreadable: {e}"
    return out


def hf_generate(target: Path, device: torch.device, dtype: torch.dtype, prompts, max_new: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=dtype, local_files_only=True).to(device).eval()
    kw = dict(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)

    def run(p):
        ids = torch.tensor([p], dtype=torch.long, device=device)
        with torch.inference_mode():
            return model.generate(ids, **kw)[0, len(p):].tolist()

    run(prompts[0])
    sync(device)
    t0 = time.perf_counter()
    outputs = [run(p) for p in prompts]
    sync(device)
    wall = time.perf_counter() - t0
    n = sum(len(o) for o in outputs)
    return {"tok_s": n / wall, "ms_per_token": 1e3 * wall / n, "tokens": n, "outputs": outputs}


# -- main -----------------------------------------------------------------------------------------
def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (CUDA when torch sees it) | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--quick", action="store_true", help="small shapes and counts (the CPU test)")
    p.add_argument("--out", default="gpu_check.json", help="where the JSON goes")
    p.add_argument("--draft-layers", type=int, default=2, help="the draft: the target's first N layers")
    p.add_argument("--noise", type=float, default=0.02, help="how much the target's later layers add")
    p.add_argument("--prompts", type=int, default=None, help="requests per system (default 8; --quick 2)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="per request (default 64; --quick 12)")
    args = p.parse_args(argv)

    from specrouter.models.device import resolve_device

    device = resolve_device(args.device)
    dtype = getattr(torch, args.dtype)
    quick = args.quick
    shape = QUICK_SHAPE if quick else TARGET_SHAPE
    n_prompts = args.prompts or (2 if quick else 8)
    max_new = args.max_new_tokens or (12 if quick else 64)
    gpu = device.type == "cuda"
    kernels = "native"  # the GPU path on CUDA (Triton), the native CPU kernels on CPU
    batches = (1, 4) if quick else (1, 2, 4, 8)
    tokens = (1, 5, 17) if quick else (1, 2, 3, 5, 9, 17)
    iters = 3 if quick else 20
    t_start = time.perf_counter()
    report: dict = {"device": device_name(device), "device_type": device.type, "torch": torch.__version__,
                    "python": platform.python_version(), "dtype": args.dtype, "quick": quick, "shape": shape,
                    "draft_layers": args.draft_layers, "noise": args.noise, "errors": {}}
    for mod in ("triton", "transformers"):
        try:
            report[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            report[mod] = f"missing: {e}"
    out_path = Path(args.out)

    def save():
        report["wall_s"] = time.perf_counter() - t_start
        out_path.write_text(json.dumps(report, indent=1, default=str))

    def section(name, fn):
        t0 = time.perf_counter()
        try:
            report[name] = fn()
        except Exception as e:  # noqa: BLE001 - recorded; the next section still runs
            report["errors"][name] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"
        report.setdefault("section_s", {})[name] = time.perf_counter() - t0
        print(f"[{time.perf_counter() - t_start:6.1f}s] {name}: {'error' if name in report['errors'] else 'done'}",
              file=sys.stderr, flush=True)
        save()

    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        tmp = Path(tmp)
        os.environ.setdefault("SPECROUTER_CACHE", str(tmp / "cache"))
        target, draft = write_pair(tmp / "models", shape, args.draft_layers, args.noise)
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(3, shape["vocab_size"], (32,), generator=g).tolist() for _ in range(n_prompts)]

        def timings():
            res = {"eager": runner_timings(load_runner(target, device, dtype, kernels, False), device, batches,
                                           tokens, 128, iters)}
            if gpu:
                res["graphed"] = runner_timings(load_runner(target, device, dtype, kernels, True), device, batches,
                                                tokens, 128, iters)
            best = res.get("graphed", res["eager"])
            res["t_over_t1_batch1"] = {t: best[f"1x{t}"] / best["1x1"] for t in tokens}
            return res

        section("runner", timings)

        def inv():
            res = {"eager": invariance(load_runner(target, device, dtype, kernels, False))}
            if gpu:
                res["graphed"] = invariance(load_runner(target, device, dtype, kernels, True))
                res["torch_kernels_negative_control"] = invariance(load_runner(target, device, dtype, "torch", False))
            return res

        section("invariance", inv)

        def graphed_equals_eager():
            from specrouter.models.runners.base import ForwardBatch

            a, b = load_runner(target, device, dtype, kernels, False), load_runner(target, device, dtype, kernels, True)
            feeds, wanted = [prompts[0][:7], prompts[0][:3], prompts[0][:5]], [[6], [0, 1, 2], [4]]
            # slots taken from each runner (the graphed one holds its padding slot apart from them)
            x = a.forward(ForwardBatch.build([a.allocate_slot() for _ in feeds], [0] * 3, feeds, wanted))
            y = b.forward(ForwardBatch.build([b.allocate_slot() for _ in feeds], [0] * 3, feeds, wanted))
            same = all(torch.equal(x[i, : len(w)], y[i, : len(w)]) for i, w in enumerate(wanted))  # asked positions
            return {"bitwise": bool(same), "replays": getattr(b, "replays", 0)}

        if gpu:
            section("graphed_vs_eager", graphed_equals_eager)
        if gpu:
            section("noise_kernel", lambda: noise_check(device, shape["vocab_size"], iters))
        section("engine", lambda: engine_runs(target, draft, str(device), args.dtype, prompts, max_new, tmp, graphs=gpu))
        if gpu:
            section("engine_eager", lambda: engine_runs(target, draft, str(device), args.dtype, prompts, max_new, tmp,
                                                        graphs=False))
        section("engine_sampled", lambda: engine_runs(target, draft, str(device), args.dtype, prompts[:4], max_new,
                                                      tmp, graphs=gpu, temperature=0.7))
        section("hf_generate", lambda: hf_generate(target, device, dtype, prompts, max_new))

    # -- summary and goals
    eng, hf, run = report.get("engine", {}), report.get("hf_generate", {}), report.get("runner", {})
    summary = {}
    ratios = run.get("t_over_t1_batch1", {})
    if 5 in ratios:
        summary["t5_over_t1"] = ratios[5]
    if 17 in ratios:
        summary["t17_over_t1"] = ratios[17]
    if "target-only" in eng:
        best = run.get("graphed", run.get("eager", {}))
        if "1x1" in best:
            summary["engine_over_raw"] = eng["target-only"]["ms_per_token"] / best["1x1"]
        summary["router_speedup"] = eng["router"]["tok_s"] / eng["target-only"]["tok_s"]
        summary["draft_speedup"] = eng["draft>target k=4"]["tok_s"] / eng["target-only"]["tok_s"]
        summary["greedy_identical_every_chain"] = all(v["identical_to_target_only"] for v in eng.values())
    if "noise_kernel" in report:  # ("noise" is the controlled pair's perturbation)
        nk = report["noise_kernel"]
        summary["noise_kernel_equals_reference"] = nk["mismatch_vs_reference"] == 0 and nk["mismatch_2048_keys"] == 0
    if "engine_sampled" in report:
        sampled = report["engine_sampled"]
        summary["sampled_identical_every_chain"] = all(v["identical_to_target_only"] for v in sampled.values())
        summary["router_speedup_t07"] = sampled["router"]["tok_s"] / sampled["target-only"]["tok_s"]
    if "target-only" in eng:
        if "tok_s" in hf:
            summary["speedup_vs_hf"] = max(v["tok_s"] for v in eng.values()) / hf["tok_s"]
            t_only = eng["target-only"]["outputs"]
            same = sum(a == b for x, y in zip(t_only, hf["outputs"]) for a, b in zip(x, y))
            summary["hf_token_agreement"] = same / max(1, sum(len(x) for x in t_only))
    report["summary"] = summary
    report["goals"] = {name: ({"value": summary[key], "threshold": thr,
                               "met": bool(summary[key] <= thr if op == "<=" else summary[key] >= thr if op == ">="
                                           else summary[key] > thr)}
                              if key in summary and gpu else {"value": summary.get(key), "met": None,
                                                              "why": "not a GPU run" if not gpu else "not measured"})
                       for name, (key, thr, op) in GOALS.items()}
    save()
    print(json.dumps({"device": report["device"], "summary": summary, "errors": list(report["errors"])}, indent=1))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
