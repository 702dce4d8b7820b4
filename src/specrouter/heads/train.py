"""`specrouter distill --head`: train an EAGLE-style draft head (models/heads/model.py) on the target's
own features, on CPU, resumable.

Steps: 1. the distillation corpus (distill/corpus.py: text the target writes plus offline text,
with the target's top-k distributions), built once or reused; 2. the target's features and
greedy labels for every row, from the native runner at the engine's precision (features.py);
3. the reduced vocabulary (the `vocab_size` most frequent tokens of the training rows); 4.
training: every step unrolls the head over draft depths 1..`unroll` (its own predicted features
feed the deeper ones, EAGLE-3's training-time test), loss = feature regression + token loss per
depth (loss.py), depth j weighted `depth_decay`^(j-1); 5. held-out evaluation at depths 1..
`eval_depth` against the same for a standalone draft (`compare_draft`), and step costs.

Files in `out_dir`: head.safetensors + head_config.json (the head, `save_dtype`), corpus/ and
features/ (caches, unless other folders are given), checkpoint/ (float32 head + trainer_state.pt),
recipe.json, report.json.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specrouter.distill.corpus import PROMPT_SETS
from specrouter.errors import SpecRouterError
from specrouter.heads.evaluate import (
    DrafterReport,
    draft_row_argmax,
    drafter_report,
    head_predictions,
    head_step_ms,
    native_depth1_agreement,
    target_step_ms,
)
from specrouter.heads.features import SHARD_ROWS, Features, compute_features
from specrouter.heads.loss import depth_loss
from specrouter.models.heads.model import (
    EagleHead,
    HeadConfig,
    frequent_tokens,
    param_count,
    read_head,
    save_head,
)


@dataclass(frozen=True)
class HeadDistillConfig:
    """Everything a head run is (validated; recipe.json's "args")."""

    target: str | Path  # the target, an HF checkpoint directory the native runner loads
    out_dir: str | Path  # head, caches, checkpoints, recipe and report
    vocab_size: int = 8192  # the head's reduced vocabulary: the most frequent training tokens
    steps: int = 600  # optimizer steps in total (a resumed run continues up to this)
    batch_size: int = 4  # corpus rows per step
    lr: float = 1e-3  # peak AdamW learning rate (linear warm-up, cosine decay to lr/10)
    weight_decay: float = 0.0  # AdamW weight decay of the matrices
    warmup_steps: int | None = None  # default 5% of steps
    unroll: int = 2  # draft depths trained per step (1: teacher forcing only)
    depth_decay: float = 0.8  # weight of depth j: depth_decay ** (j - 1)
    feature_weight: float = 1.0  # smooth-L1 feature regression
    token_weight: float = 1.0  # token loss on the reduced vocabulary
    ce_weight: float = 0.5  # share of CE on the target's greedy token in the token loss (rest: soft top-k)
    noise: float = 0.0  # std of Gaussian noise on the normed target features (EAGLE's trick)
    seed: int = 0  # corpus, batch order, noise
    # the corpus (distill/corpus.py), built if `corpus_dir` holds no finished one
    corpus_dir: str | Path | None = None  # default OUT_DIR/corpus
    corpus_tokens: int = 150_000
    generated_fraction: float = 1.0  # recorded only: a head's own corpus is all target-written
    seq_len: int = 256
    teacher_topk: int = 32
    temperature: float = 0.7
    greedy_fraction: float = 0.5
    eval_fraction: float = 0.08
    prompts: str = "v1"  # the corpus's prompt set (distill/corpus.py PROMPT_SETS); v1 built the shipped head
    features_dir: str | Path | None = None  # default OUT_DIR/features
    dtype: str = "auto"  # the runner's precision for features and step costs (auto: the engine's)
    eval_every: int = 100  # steps between quick held-out evaluations (32 rows) in the history
    checkpoint_every: int = 100
    eval_depth: int = 8  # depths of the final evaluation (acceptance length for k = 1..eval_depth)
    compare_draft: str | Path | None = None  # a standalone draft checkpoint evaluated alike
    save_dtype: str = "bfloat16"
    threads: int | None = None
    progress: bool = True
    resume: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "batch_size", "unroll", "eval_every", "checkpoint_every", "eval_depth",
                     "corpus_tokens", "teacher_topk"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpecRouterError(f"invalid head settings: {name} must be an integer >= 1, got {v!r}")
        if not isinstance(self.steps, int) or self.steps < 0:
            raise SpecRouterError(f"invalid head settings: steps must be >= 0, got {self.steps!r}")
        if not self.lr > 0 or self.noise < 0 or not 0 < self.depth_decay <= 1 or not 0 <= self.ce_weight <= 1:
            raise SpecRouterError("invalid head settings: lr > 0, noise >= 0, depth_decay in (0, 1], "
                                  "ce_weight in [0, 1]")
        if self.save_dtype not in ("bfloat16", "float16", "float32"):
            raise SpecRouterError(f"save_dtype must be bfloat16, float16 or float32, got {self.save_dtype!r}")
        if self.prompts not in PROMPT_SETS:
            raise SpecRouterError(f"invalid head settings: prompts must be one of {PROMPT_SETS}, got {self.prompts!r}")

    @property
    def corpus_path(self) -> Path:
        return Path(self.corpus_dir) if self.corpus_dir is not None else Path(self.out_dir) / "corpus"

    @property
    def features_path(self) -> Path:
        return Path(self.features_dir) if self.features_dir is not None else Path(self.out_dir) / "features"

    def args(self) -> dict:
        return {k: str(v) if isinstance(v, Path) else v for k, v in self.__dict__.items()}


@dataclass
class HeadReport:
    """Outcome of a head run (report.json)."""

    out_dir: str
    steps: int
    start_step: int
    tokens_seen: int  # positions trained on (depth 1), all runs
    trained_params: int  # fc + the layer
    head_rows: int  # reduced-vocabulary LM-head parameters (frozen, the target's)
    weights_mb: float  # head.safetensors
    vocab_size: int
    vocab_coverage: float  # share of held-out tokens inside the reduced vocabulary
    label_agreement_with_corpus: float  # the runner's greedy labels vs the corpus's top-1 (held out)
    head: dict  # DrafterReport of the head
    draft: dict | None  # DrafterReport of compare_draft
    target_step_ms: float  # 1-token step of the target, the runner's precision and kernels
    head_step_ms: float  # one draft step of the head, same kernels
    head_cost_ratio: float  # head_step_ms / target_step_ms
    draft_step_ms: float | None
    dtype: str
    corpus_time_s: float
    features_time_s: float
    train_time_s: float
    eval_time_s: float
    wall_time_s: float
    history: list[dict] = field(default_factory=list)


def _load_corpus(cfg: HeadDistillConfig, vocab: int, runner):
    """(corpus, seconds spent building it): a finished corpus in corpus_path (a draft's corpus
    works: its features are then computed), else one the target writes on the native runner,
    features included (heads/generate.py)."""
    from transformers import AutoTokenizer

    from specrouter.distill.corpus import CorpusSpec, load_corpus
    from specrouter.heads.generate import generate_corpus

    t0 = time.time()
    if not (cfg.corpus_path / "done").exists():
        spec = CorpusSpec(target=str(cfg.target), vocab_size=vocab, corpus_tokens=cfg.corpus_tokens,
                          generated_fraction=1.0, seq_len=cfg.seq_len, teacher_topk=cfg.teacher_topk,
                          temperature=cfg.temperature, greedy_fraction=cfg.greedy_fraction,
                          eval_fraction=cfg.eval_fraction, seed=cfg.seed, prompts=cfg.prompts)
        tokenizer = AutoTokenizer.from_pretrained(str(cfg.target))
        generate_corpus(runner, tokenizer, spec, cfg.corpus_path, cfg.features_path, progress=cfg.progress)
    return load_corpus(cfg.corpus_path), time.time() - t0


def _runner_dtype(name: str) -> torch.dtype:
    from specrouter.models.runners.kernels import auto_dtype

    return auto_dtype() if name == "auto" else getattr(torch, name)


def _batch(corpus, feats: Features, head: EagleHead, rows: torch.Tensor):
    """The tensors of one step's rows, trimmed to their longest."""
    T = int(corpus.lengths[rows].max())
    return (corpus.tokens[rows, :T], feats.features[rows, :T].float(), feats.labels[rows, :T],
            corpus.topk_ids[rows, :T].long(), corpus.topk_logp[rows, :T], corpus.lengths[rows])


def train_step_loss(cfg: HeadDistillConfig, head: EagleHead, corpus, feats: Features, rows: torch.Tensor,
                    generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:
    """The loss of one batch over depths 1..unroll (differentiable) and its parts."""
    tokens, f, labels, topk, logp, lengths = _batch(corpus, feats, head, rows)
    T = f.shape[1]
    outs = head.unrolled(f, tokens, levels=cfg.unroll, noise=cfg.noise, generator=generator)
    true_normed = head.norm(f[:, 1:])  # (B, n, H): feature t+1 for position t
    t = torch.arange(T - 1)
    total, weights, parts = 0.0, 0.0, {}
    for j, g in enumerate(outs, start=1):
        # position t predicts token t+2: the corpus labels position t+1 when t+1 <= L-2
        mask = (t[None, :] >= j - 1) & (t[None, :] + 1 <= lengths[:, None] - 2)  # (B, n)
        if not bool(mask.any()):
            continue
        lp = depth_loss(head.norm(g[mask]), true_normed[mask], head.logits(g[mask]),
                        head.vocab_index[topk[:, 1:][mask]], logp[:, 1:][mask],
                        head.vocab_index[labels[:, 1:][mask].clamp(min=0)],
                        feature_weight=cfg.feature_weight, token_weight=cfg.token_weight,
                        ce_weight=cfg.ce_weight)
        w = cfg.depth_decay ** (j - 1)
        total = total + w * lp.total
        weights += w
        parts[j] = {"feature": lp.feature, "token": lp.token, "acc": lp.hits / max(1, lp.positions),
                    "positions": lp.positions}
    return total / max(weights, 1e-9), parts


def _save_checkpoint(out: Path, head: EagleHead, opt, step: int, state: dict) -> None:
    tmp, final = out / "checkpoint.tmp", out / "checkpoint"
    shutil.rmtree(tmp, ignore_errors=True)
    save_head(tmp, head, dtype=torch.float32)
    torch.save({"step": step, "optimizer": opt.state_dict(), "torch_rng": torch.get_rng_state(), **state},
               tmp / "trainer_state.pt")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


def _optimizer(head: EagleHead, cfg: HeadDistillConfig) -> torch.optim.AdamW:
    mats = [p for p in head.params.values() if p.dim() >= 2]
    rest = [p for p in head.params.values() if p.dim() < 2]
    return torch.optim.AdamW([{"params": mats, "weight_decay": cfg.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))


def build_head(cfg: HeadDistillConfig, target_config: dict, tensors: dict, corpus, train_rows: torch.Tensor):
    """(head, optimizer, trainer state or None): the checkpoint when resuming, else a fresh head
    with the reduced vocabulary of the training rows."""
    ckpt = Path(cfg.out_dir) / "checkpoint"
    if cfg.resume and (ckpt / "trainer_state.pt").is_file():
        config, params = read_head(ckpt)
        head = EagleHead(config, tensors, params)
        state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
        opt = _optimizer(head, cfg)
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        return head, opt, state
    V = int(target_config["vocab_size"])
    mask = torch.arange(corpus.tokens.shape[1])[None, :] < corpus.lengths[train_rows][:, None]
    special = tuple(i for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                    for i in ([target_config.get(k)] if not isinstance(target_config.get(k), list)
                              else target_config[k]) if isinstance(i, int))
    ids = frequent_tokens(corpus.tokens[train_rows][mask], V, cfg.vocab_size, special)
    head = EagleHead(HeadConfig(target_config=target_config, vocab_ids=tuple(ids)), tensors)
    return head, _optimizer(head, cfg), None


def train(cfg: HeadDistillConfig, head: EagleHead, opt, corpus, feats: Features, train_rows: torch.Tensor,
          eval_rows: torch.Tensor, state: dict | None, on_checkpoint=None) -> dict:
    """Steps up to cfg.steps from the state's step; returns the progress (step, tokens_seen,
    history, train_time, tokens_this_run)."""
    from tqdm.auto import tqdm

    from specrouter.distill.train import _batch_rows, _lr_at

    prog = {"step": 0, "tokens_seen": 0, "history": [], "tokens_this_run": 0, "train_time": 0.0}
    if state is not None:
        prog.update(step=state["step"], tokens_seen=state["tokens_seen"], history=state["history"])
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, cfg.steps // 20)
    probe = eval_rows[torch.randperm(len(eval_rows), generator=torch.Generator().manual_seed(cfg.seed))[:32]]
    perms: dict = {}
    bar = tqdm(total=cfg.steps, initial=prog["step"], desc="head", unit="step", disable=not cfg.progress,
               dynamic_ncols=True)
    t0 = time.time()
    ema = prog["history"][-1]["loss"] if prog["history"] else None
    head.train()
    while prog["step"] < cfg.steps:
        step = prog["step"]
        rows = _batch_rows(train_rows, step, cfg.batch_size, cfg.seed, perms)
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        loss, parts = train_step_loss(cfg, head, corpus, feats, rows, gen)
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, cfg.steps, warmup, cfg.lr)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        n = parts.get(1, {}).get("positions", 0)
        prog["step"] += 1
        prog["tokens_seen"] += n
        prog["tokens_this_run"] += n
        value = float(loss.detach())
        ema = value if ema is None else 0.95 * ema + 0.05 * value
        tps = prog["tokens_this_run"] / (time.time() - t0)
        bar.set_postfix(loss=f"{ema:.3f}", acc1=f"{parts.get(1, {}).get('acc', 0):.2f}", tok_s=f"{tps:.0f}")
        bar.update(1)
        step = prog["step"]
        if step % cfg.eval_every == 0 or step == cfg.steps:
            head.eval()
            quick = evaluate_head(head, corpus, feats, probe, depth=min(4, cfg.eval_depth))
            head.train()
            prog["history"].append({"step": step, "loss": ema, "agreement": quick.agreement,
                                    "acceptance_length": quick.acceptance_length,
                                    "tokens_seen": prog["tokens_seen"], "tokens_per_s": tps,
                                    "depth_parts": parts})
            bar.write(f"step {step}: loss {ema:.3f}  held-out depth-1 agreement {quick.agreement:.3f}  "
                      f"acceptance length k=4 {quick.acceptance_length.get(4, float('nan')):.2f}  {tps:.0f} tok/s")
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            _save_checkpoint(Path(cfg.out_dir), head, opt, step, {
                "tokens_seen": prog["tokens_seen"], "history": prog["history"]})
            if on_checkpoint is not None:
                on_checkpoint(prog)
    bar.close()
    prog["train_time"] = time.time() - t0
    head.eval()
    return prog


def evaluate_head(head: EagleHead, corpus, feats: Features, rows: torch.Tensor, depth: int) -> DrafterReport:
    """The head on held-out `rows` (heads/evaluate.py)."""
    def preds(r: int) -> torch.Tensor:
        L = int(corpus.lengths[r])
        return head_predictions(head, feats.features[r, :L], corpus.tokens[r, :L], depth)

    return drafter_report(preds, corpus, feats.labels, rows, depth, head=True)


def evaluate_draft(draft_runner, corpus, feats: Features, rows: torch.Tensor, depth: int) -> DrafterReport:
    """A standalone draft runner on held-out `rows`, alike."""
    return drafter_report(lambda r: draft_row_argmax(draft_runner, corpus.tokens[r, : int(corpus.lengths[r])]),
                          corpus, feats.labels, rows, depth, head=False)


def run_head_distill(cfg: HeadDistillConfig) -> HeadReport:
    """The steps of the module docstring."""
    from specrouter.distill.corpus import SOURCE_IDS
    from specrouter.distill.train import _versions
    from specrouter.models.heads.runner import HeadRunner
    from specrouter.models.runners.llama import load_llama_runner, read_checkpoint

    t_start = time.time()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target_config, _arch, tensors = read_checkpoint(cfg.target)
    dtype = _runner_dtype(cfg.dtype)
    target = load_llama_runner(cfg.target, dtype=dtype, num_slots=SHARD_ROWS, max_len=max(cfg.seq_len, 256))
    # 1. corpus (written by the target on the runner, with its features, unless given)
    corpus, corpus_time = _load_corpus(cfg, int(target_config["vocab_size"]), target)
    if corpus.tokens.shape[1] > cfg.seq_len:
        raise SpecRouterError(f"corpus rows are {corpus.tokens.shape[1]} tokens, over seq_len {cfg.seq_len}")
    generated = corpus.source < SOURCE_IDS["stdlib"]
    train_rows = (~corpus.is_eval).nonzero()[:, 0]
    eval_rows = (corpus.is_eval & generated).nonzero()[:, 0]  # held-out target-written rows
    if len(train_rows) == 0 or len(eval_rows) == 0:
        raise SpecRouterError(f"corpus has {len(train_rows)} training and {len(eval_rows)} held-out "
                              "generated rows: raise corpus_tokens")
    # 2. the target's features and labels, at the engine's precision
    t0 = time.time()
    feats = compute_features(target, corpus, cfg.features_path, progress=cfg.progress)
    features_time = time.time() - t0
    # 3-4. the head and training
    head, opt, state = build_head(cfg, target_config, tensors, corpus, train_rows)
    start_step = state["step"] if state else 0

    def write_recipe(prog: dict) -> None:
        recipe = {"args": cfg.args(), "steps_done": prog["step"], "tokens_seen": prog["tokens_seen"],
                  "vocab_size": len(head.config.vocab_ids), "corpus": {"dir": str(cfg.corpus_path),
                  "sources": corpus.composition()}, "features": {"dir": str(cfg.features_path),
                  "dtype": feats.dtype}, "versions": _versions()}
        (out / "recipe.json").write_text(json.dumps(recipe, indent=1, default=str))

    prog = train(cfg, head, opt, corpus, feats, train_rows, eval_rows, state, on_checkpoint=write_recipe)
    write_recipe(prog)
    save_head(out, head, dtype=getattr(torch, cfg.save_dtype))
    # 5. held-out evaluation and step costs
    t_eval = time.time()
    head_rep = evaluate_head(head, corpus, feats, eval_rows, cfg.eval_depth)
    draft_rep, draft_ms = None, None
    if cfg.compare_draft is not None:
        draft = load_llama_runner(cfg.compare_draft, dtype=dtype, max_len=max(cfg.seq_len, 256))
        draft_rep = evaluate_draft(draft, corpus, feats, eval_rows, cfg.eval_depth)
        draft_ms = target_step_ms(draft)
    target_ms = target_step_ms(target)
    head_runner = HeadRunner(head.config, head.head_tensors(), tensors, dtype=dtype, max_len=256)
    head_ms = head_step_ms(head_runner)
    head_rep.extra["native_depth1_agreement"] = native_depth1_agreement(
        head_runner, corpus, feats.features, feats.labels, eval_rows)
    eval_time = time.time() - t_eval
    held = corpus.tokens[eval_rows][torch.arange(corpus.tokens.shape[1])[None, :] < corpus.lengths[eval_rows][:, None]]
    label_mask = corpus.label_mask(eval_rows)
    counts = param_count(head.config)
    report = HeadReport(
        out_dir=str(out), steps=prog["step"], start_step=start_step, tokens_seen=prog["tokens_seen"],
        trained_params=counts["trained"], head_rows=counts["head_rows"],
        weights_mb=round((out / "head.safetensors").stat().st_size / 2**20, 2),
        vocab_size=len(head.config.vocab_ids),
        vocab_coverage=round(float((head.vocab_index[held] >= 0).double().mean()), 4),
        label_agreement_with_corpus=round(float(
            (feats.labels[eval_rows][label_mask] == corpus.topk_ids[eval_rows][label_mask][:, 0].long()).double().mean()), 4),
        head=asdict(head_rep), draft=asdict(draft_rep) if draft_rep else None,
        target_step_ms=round(target_ms, 3), head_step_ms=round(head_ms, 3),
        head_cost_ratio=round(head_ms / target_ms, 4),
        draft_step_ms=round(draft_ms, 3) if draft_ms is not None else None,
        dtype=str(dtype).removeprefix("torch."), corpus_time_s=round(corpus_time, 1),
        features_time_s=round(features_time, 1), train_time_s=round(prog["train_time"], 1),
        eval_time_s=round(eval_time, 1), wall_time_s=round(time.time() - t_start, 1), history=prog["history"])
    (out / "report.json").write_text(json.dumps(asdict(report), indent=1, default=str))
    return report
