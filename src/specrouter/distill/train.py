"""`specrouter distill`: knowledge-distil a small draft model from a target, on CPU.

The student is a small Llama sharing the target's tokenizer and vocabulary, with tied
embeddings initialised from the target's embedding matrix projected onto the principal
directions of the target's final hidden states (the directions its logits are made of; a
tiny student then starts able to express the target's predictions). It is trained to match
the target's next-token distribution at every position, KL(target || student) at
temperature 1, plus (by default, weight 0.5) cross-entropy on the target's argmax, on a corpus
of text the target writes itself plus offline natural text (see `corpus.py`).

Cost decisions, all measured on one CPU core:
- the teacher's distributions are computed once, in bfloat16 (KL to float32 ~1e-3 nats), and
  cached as top-k log-probabilities plus the mass outside the top k; the loss is the KL between
  these (k+1)-bin coarse-grainings, a lower bound of the full KL that keeps its argmax and its
  large terms. A teacher forward costs ~4x a student step, so caching lets every epoch (and
  every student) reuse it.
- the student's vocabulary projection (49k tokens for SmolLM2) is most of a step, so the loss
  is fused with it (`sparse_kl_loss`: logits, loss and both gradients chunk by chunk in
  bfloat16, never a (tokens x vocab) float tensor) and uses a sampled softmax (the batch's
  top-k tokens plus 2048 random ones, importance-weighted): ~5x cheaper.
- small batches (4 rows of <= 256 tokens) learn more per token than large ones at this budget.

The figure of merit is held-out greedy agreement: the fraction of held-out positions where the
student's argmax equals the target's, a proxy of the per-token acceptance of greedy
speculative decoding (reported overall, per kind code / prose / chat and per source).

Files in `out_dir`: the student (config.json, model.safetensors in `save_dtype`, tokenizer
files), `corpus/` (the cached corpus), `checkpoint/` (an HF directory in float32 plus
trainer_state.pt: optimizer, step, rng, history), `recipe.json`, `report.json`.
"""

from __future__ import annotations

import copy
import json
import math
import platform
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from specrouter.distill.corpus import PROMPT_SETS, Corpus, CorpusSpec, build_corpus, load_corpus
from specrouter.distill.evaluate import evaluate, greedy_agreement, step_ms
from specrouter.distill.loss import sparse_kl_loss  # noqa: F401  (part of this module's API)
from specrouter.errors import CheckpointError, SpecRouterError

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "vocab.json", "merges.txt", "tokenizer.model", "generation_config.json",
)
MODEL_KEYS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size")


@dataclass
class DistillReport:
    """Outcome of a `distill` run (also written to out_dir/report.json)."""

    out_dir: str  # the student checkpoint directory
    steps: int  # optimizer steps done in total (all runs of this out_dir)
    start_step: int  # the step this call started from: 0 fresh, > 0 resumed from a checkpoint
    tokens_seen: int  # label positions trained on, in total
    params: int  # student parameters (embedding counted once: it is tied)
    weights_mb: float  # size of the saved weights (save_dtype)
    agreement: float  # held-out greedy agreement with the target, all held-out positions
    agreement_by_kind: dict[str, float]  # code / prose / chat
    agreement_by_source: dict[str, float]  # gen-code, gen-prose, gen-chat, gen-qa, stdlib, docs
    agreement_generated: float  # on text the target wrote itself (what a draft faces)
    # end to end on draft_eval.HELDOUT_PROMPTS: the target's own greedy continuations of a
    # hand-written mixed prompt set (code, prose, chat, extraction); the acceptance proxy
    greedy_agreement: float
    greedy_agreement_by_kind: dict[str, float]
    kl: float  # held-out KL(target || student), nats per position, (k+1)-bin
    eval_tokens: int  # held-out positions evaluated
    target_step_ms: float  # 1-token decode step of the target (fp32, this process's threads)
    student_step_ms: float  # the same for the student
    cost_ratio: float  # target_step_ms / student_step_ms
    wall_time_s: float  # this call, corpus included
    corpus_time_s: float  # this call's corpus building (0 when cached)
    train_time_s: float  # this call's training
    train_tokens_per_s: float  # label positions per second during this call's training
    history: list[dict] = field(default_factory=list)  # [{step, loss, agreement, kl, ...}]

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------------------------
# Models


def load_target(target: str | Path, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) of the target: an HF checkpoint directory or a .gguf file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(target)
    if not path.exists():
        raise CheckpointError(f"target {path} does not exist (give an HF checkpoint directory "
                              "or a .gguf file)")
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    folder = path.parent if kwargs else path
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, **kwargs).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(folder), **kwargs)
    return model, tokenizer


def student_config(target_config, *, hidden_size, num_layers, num_heads, num_kv_heads,
                   intermediate_size=None):
    """A LlamaConfig for the student: the target's vocabulary, special ids and RoPE base,
    tied embeddings; intermediate_size defaults to 8/3 * hidden rounded up to 64."""
    from transformers import LlamaConfig

    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise SpecRouterError(f"hidden_size {hidden_size} must be divisible by num_heads "
                              f"{num_heads}, itself divisible by num_kv_heads {num_kv_heads}")
    rope = getattr(target_config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(target_config, "rope_theta", 10000.0))
    return LlamaConfig(
        vocab_size=target_config.vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or -(-8 * hidden_size // 3 // 64) * 64,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=target_config.max_position_embeddings,
        rope_theta=theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=target_config.bos_token_id,
        eos_token_id=target_config.eos_token_id,
        pad_token_id=getattr(target_config, "pad_token_id", None),
    )


@torch.no_grad()
def projected_embedding(embedding: torch.Tensor, dim: int) -> torch.Tensor:
    """The target embedding (V, D) projected onto its top-`dim` principal directions (the
    eigenvectors of E^T E, i.e. a truncated SVD): (V, dim), rows keep most of their geometry.
    If dim > D the extra columns are zero."""
    e = embedding.double()
    eigvals, eigvecs = torch.linalg.eigh(e.T @ e)  # ascending
    basis = eigvecs.flip(-1)[:, : min(dim, e.shape[1])]  # (D, dim)
    out = torch.zeros(e.shape[0], dim, dtype=torch.float64)
    out[:, : basis.shape[1]] = e @ basis
    return out.float()


@torch.no_grad()
def output_basis(target_model, tokens: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-`dim` principal directions (D, dim) of the target's final normed hidden states
    u on `tokens` (B, T), and the RMS of u along each of them (dim,).

    The logits are u @ E^T, so these are the directions the target's predictions live in: on
    SmolLM2-135M, projecting u and E on the top 192 of them keeps the argmax at ~75% of
    positions, while the top 192 principal directions of E itself keep it at ~5%.
    """
    u = target_model.model(input_ids=tokens).last_hidden_state.reshape(-1, target_model.config.hidden_size)
    u = u.double()  # (N, D)
    eigvals, eigvecs = torch.linalg.eigh(u.T @ u)  # ascending
    basis = eigvecs.flip(-1)[:, :dim]
    rms = (u @ basis).pow(2).mean(0).sqrt()
    return basis.float(), rms.float()


def init_student(target_model, *, init: str = "output", sample_tokens: torch.Tensor | None = None,
                 **shape):
    """A fresh student LlamaForCausalLM with tied embeddings initialised from the target's.

    init="output" (needs `sample_tokens` (B, T)): embedding = target embedding projected on
    the principal directions of the target's final hidden states (`output_basis`), so the
    student's output embedding can express the target's logits (its final norm starts at 1:
    the target's scale made the first steps unstable). init="embedding": projected on the
    principal directions of the embedding matrix. Other weights: transformers' random init.
    (Copying thinned target layers was tried: SmolLM2 with any of its layers dropped is no
    better than noise, KL > 10 nats, and it trained no faster, so it is not offered.)
    """
    from transformers import LlamaForCausalLM

    if init not in ("output", "embedding"):
        raise SpecRouterError(f"init must be 'output' or 'embedding', got {init!r}")
    model = LlamaForCausalLM(student_config(target_model.config, **shape))
    target_emb = target_model.get_input_embeddings().weight.float()
    d = shape["hidden_size"]
    with torch.no_grad():
        if init == "embedding" or sample_tokens is None or d >= target_model.config.hidden_size:
            model.get_input_embeddings().weight.copy_(projected_embedding(target_emb, d))
        else:
            basis, rms = output_basis(target_model.float(), sample_tokens, d)
            model.get_input_embeddings().weight.copy_(target_emb @ basis)
    model.tie_weights()
    return model


# ---------------------------------------------------------------------------------------------
# Training


def _batch_rows(train_rows: torch.Tensor, step: int, batch_size: int, seed: int, perms: dict):
    """Rows of `step`: a seeded permutation per epoch, a pure function of the step (so a
    resumed run sees exactly the batches it would have seen)."""
    n = len(train_rows)
    out = []
    for p in range(step * batch_size, (step + 1) * batch_size):
        epoch = p // n
        if epoch not in perms:
            perms.clear()
            perms[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        out.append(int(train_rows[perms[epoch][p % n]]))
    return torch.tensor(out)


def _lr_at(step: int, steps: int, warmup: int, lr: float) -> float:
    """Linear warm-up, then cosine decay to lr / 10."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, steps - warmup))
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def _copy_tokenizer(target: Path, tokenizer, out: Path) -> None:
    folder = target.parent if target.suffix == ".gguf" else target
    copied = [n for n in TOKENIZER_FILES if (folder / n).is_file()]
    for name in copied:
        shutil.copyfile(folder / name, out / name)
    if "tokenizer.json" not in copied:  # e.g. a GGUF target: write the tokenizer it carries
        tokenizer.save_pretrained(str(out))


def write_draft_vocab(out: Path, corpus: Corpus, train_rows: torch.Tensor, eval_rows: torch.Tensor,
                      size: int, vocab: int, always: Sequence[int] = ()) -> dict:
    """OUT/draft_vocab.json: the `size` most frequent tokens of the training rows (ties and
    unseen tokens by id, i.e. BPE merge order) plus `always` (special tokens), with their
    coverage of the held-out rows."""
    from specrouter.models.runners.llama import DRAFT_VOCAB_FILE

    def tokens(rows: torch.Tensor) -> torch.Tensor:
        T = corpus.tokens.shape[1]
        return corpus.tokens[rows][torch.arange(T)[None, :] < corpus.lengths[rows][:, None]]

    count = torch.bincount(tokens(train_rows), minlength=vocab)[:vocab].double()
    order = (count * vocab - torch.arange(vocab, dtype=torch.float64)).argsort(descending=True)
    keep = torch.zeros(vocab, dtype=torch.bool)
    keep[order[: min(size, vocab)]] = True
    keep[[i for i in always if 0 <= i < vocab]] = True
    held = tokens(eval_rows)
    doc = {
        "token_ids": keep.nonzero()[:, 0].tolist(),
        "size": int(keep.sum()),
        "heldout_coverage": round(float(keep[held].double().mean()), 4) if len(held) else None,
        "note": "the draft proposes only these tokens (the most frequent in its training corpus)",
    }
    (out / DRAFT_VOCAB_FILE).write_text(json.dumps(doc))
    return doc


def _versions() -> dict:
    import transformers

    from specrouter import __version__

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "specrouter": __version__}


def _save_checkpoint(out: Path, student, opt, step: int, state: dict) -> None:
    """out/checkpoint: an HF directory (float32) + trainer_state.pt; replaced atomically."""
    tmp, final = out / "checkpoint.tmp", out / "checkpoint"
    shutil.rmtree(tmp, ignore_errors=True)
    student.save_pretrained(str(tmp))
    torch.save({"step": step, "optimizer": opt.state_dict(), "torch_rng": torch.get_rng_state(),
                **state}, tmp / "trainer_state.pt")
    for name in TOKENIZER_FILES:
        if (out / name).is_file():
            shutil.copyfile(out / name, tmp / name)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


@dataclass(frozen=True)
class DistillConfig:
    """Everything a `distill` run is (validated on construction; written to recipe.json as
    "args"). The flags of `specrouter distill` map onto these fields."""

    target: str | Path  # the target model, an HF checkpoint directory or a .gguf file
    out_dir: str | Path  # where the draft, its corpus cache, checkpoints and reports go
    hidden_size: int = 192  # draft width (the tied embedding is vocab x hidden_size: most parameters)
    num_layers: int = 4  # draft decoder layers
    num_heads: int = 3  # attention heads (hidden_size must divide by it)
    num_kv_heads: int = 3  # key/value heads (grouped-query attention)
    intermediate_size: int | None = None  # MLP width; default 8/3 * hidden_size rounded up to 64
    init: str = "output"  # "output": embedding projected on the target's output directions; "embedding": on its own
    steps: int = 3000  # optimizer steps in total (a resumed run continues up to this; 0: corpus only)
    batch_size: int = 4  # rows (of up to seq_len tokens) per step
    seq_len: int = 256  # tokens per corpus row
    lr: float = 3e-3  # peak AdamW learning rate (linear warm-up, cosine decay to lr/10)
    corpus_tokens: int = 300_000  # labelled positions in the corpus (train + held-out)
    seed: int = 0  # seeds the corpus, the initialisation and the batch order
    generated_fraction: float = 0.6  # share of the corpus the target writes itself (rest: stdlib, docs)
    resume: bool = True  # continue from OUT_DIR/checkpoint if present (the corpus cache is always reused)
    threads: int | None = None  # torch CPU threads (default: leave torch's setting)
    progress: bool = True  # show progress bars
    greedy_fraction: float = 0.5  # share of generated rows decoded greedily (the rest sampled)
    temperature: float = 0.7  # sampling temperature of the sampled generated rows
    teacher_topk: int = 32  # k of the cached teacher distributions
    ce_weight: float = 0.5  # weight of cross-entropy on the target's argmax mixed into the KL loss (aims at greedy agreement)
    vocab_sample: int = 2048  # sampled softmax: random tokens per step besides the batch's top-k (0: the full vocabulary)
    weight_decay: float = 0.01  # AdamW weight decay of the matrices (not embeddings, not norms)
    warmup_steps: int | None = None  # linear warm-up steps (default 5% of steps)
    eval_fraction: float = 0.05  # share of prompts / files held out for evaluation
    eval_every: int = 250  # steps between held-out evaluations (on up to 64 rows) in the history
    checkpoint_every: int = 250  # steps between checkpoints
    corpus_dir: str | Path | None = None  # a corpus folder to use (and build if absent); default OUT_DIR/corpus
    extra_corpus_dirs: Sequence[str | Path] = ()  # finished corpora whose rows are added (train to train, held-out to eval)
    init_from: str | Path | None = None  # a draft of the same shape to start from (a second stage); ignored when resuming
    save_dtype: str = "bfloat16"  # dtype of the final weights: bfloat16, float16 or float32
    greedy_eval_tokens: int = 96  # tokens the target writes per prompt of the end-to-end greedy evaluation; 0 skips it
    draft_vocab_size: int = 16384  # the draft proposes only this many tokens, the most frequent in training (0: all)
    prompts: str = "v2"  # the corpus's prompt set (corpus.PROMPT_SETS); "v1" rebuilds the drafts made before v2

    def __post_init__(self) -> None:
        def bad(msg: str) -> SpecRouterError:
            return SpecRouterError(f"invalid distill settings: {msg}")

        if self.save_dtype not in ("bfloat16", "float16", "float32"):
            raise SpecRouterError(f"save_dtype must be bfloat16, float16 or float32, got {self.save_dtype!r}")
        if self.init not in ("output", "embedding"):
            raise SpecRouterError(f"init must be 'output' or 'embedding', got {self.init!r}")
        positive = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "batch_size", "corpus_tokens",
                    "teacher_topk", "eval_every", "checkpoint_every")
        for name in positive:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise bad(f"{name} must be an integer >= 1, got {v!r}")
        for name in ("steps", "vocab_sample", "greedy_eval_tokens", "draft_vocab_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise bad(f"{name} must be an integer >= 0, got {v!r}")
        if self.seq_len < 2:
            raise bad(f"seq_len must be >= 2, got {self.seq_len!r}")
        if not self.lr > 0 or not self.temperature > 0 or self.weight_decay < 0:
            raise bad("lr and temperature must be > 0, weight_decay >= 0")
        for name in ("generated_fraction", "greedy_fraction", "ce_weight"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise bad(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise bad(f"eval_fraction must be in (0, 1), got {self.eval_fraction!r}")
        if self.warmup_steps is not None and self.warmup_steps < 1:
            raise bad(f"warmup_steps must be >= 1 or None, got {self.warmup_steps!r}")
        if self.prompts not in PROMPT_SETS:
            raise bad(f"prompts must be one of {PROMPT_SETS}, got {self.prompts!r}")
        if self.threads is not None and self.threads < 1:
            raise bad(f"threads must be >= 1 or None, got {self.threads!r}")

    @property
    def shape(self) -> dict[str, int | None]:
        """The student's shape (what a resumed or warm-started run must match)."""
        return dict(hidden_size=self.hidden_size, num_layers=self.num_layers, num_heads=self.num_heads,
                    num_kv_heads=self.num_kv_heads, intermediate_size=self.intermediate_size)

    @property
    def corpus_path(self) -> Path:
        return Path(self.corpus_dir) if self.corpus_dir is not None else Path(self.out_dir) / "corpus"

    def corpus_spec(self, vocab_size: int) -> CorpusSpec:
        return CorpusSpec(
            target=str(self.target), vocab_size=vocab_size, corpus_tokens=self.corpus_tokens,
            generated_fraction=self.generated_fraction, seq_len=self.seq_len, teacher_topk=self.teacher_topk,
            temperature=self.temperature, greedy_fraction=self.greedy_fraction,
            eval_fraction=self.eval_fraction, seed=self.seed, prompts=self.prompts)

    def args(self) -> dict:
        """JSON-ready fields (recipe.json's "args")."""
        def plain(v):
            return str(v) if isinstance(v, Path) else v
        return {k: plain(v) for k, v in self.__dict__.items()}


def distill(target: str | Path, out_dir: str | Path, **settings) -> DistillReport:
    """Distil a small draft model from TARGET into OUT_DIR (CPU; resumable): `run_distill` of
    `DistillConfig(target, out_dir, **settings)` (its fields document the settings).

    The draft is a Llama with the target's tokenizer and vocabulary and tied embeddings
    initialised from the target's (projected to hidden_size). It learns the target's next-token
    distribution (KL at temperature 1, cached top-k of the target, bf16) on text the target
    generates itself from varied code / prose / chat / Q&A prompts plus Python stdlib sources
    and /usr/share/doc text. Re-running with the same OUT_DIR resumes from the last checkpoint.
    OUT_DIR ends up a complete HF checkpoint of the draft, with recipe.json and report.json.
    """
    return run_distill(DistillConfig(target=target, out_dir=out_dir, **settings))


class _Teacher:
    """The target, loaded on first use (a resumed run with a cached corpus may never need it)."""

    def __init__(self, path: Path):
        self.path, self.model, self.tokenizer = path, None, None

    def get(self):
        if self.model is None:
            self.model, self.tokenizer = load_target(self.path)
        return self.model


@dataclass
class _Progress:
    """Where training stands: restored from a checkpoint, advanced by `_train`."""

    step: int = 0
    tokens_seen: int = 0
    history: list[dict] = field(default_factory=list)
    tokens_this_run: int = 0  # label positions trained on by this call
    train_time: float = 0.0  # seconds of this call's training


def run_distill(cfg: DistillConfig) -> DistillReport:
    """The steps of a distill run (module docstring): corpus, student, training, report."""
    t_start = time.time()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "checkpoint"
    resuming = cfg.resume and (ckpt / "trainer_state.pt").is_file()
    teacher = _Teacher(Path(cfg.target))
    # 1. the target (skipped when corpus and checkpoint exist; needed again only for timing)
    if not (cfg.corpus_path / "done").exists() or not resuming:
        teacher.get()
    vocab = (teacher.model.config.vocab_size if teacher.model is not None
             else json.loads((ckpt / "config.json").read_text())["vocab_size"])
    # 2. the corpus, built once (teacher in bfloat16) and cached
    spec = cfg.corpus_spec(vocab)
    corpus, corpus_time = _load_corpus(cfg, spec, teacher)
    train_rows = (~corpus.is_eval).nonzero()[:, 0]
    eval_rows = corpus.is_eval.nonzero()[:, 0]
    if len(train_rows) == 0 or len(eval_rows) == 0:
        raise SpecRouterError(f"corpus in {cfg.corpus_path} has {len(train_rows)} training and "
                              f"{len(eval_rows)} held-out rows: raise corpus_tokens")
    # 3. the student: fresh (projected target embedding), warm-started, or the checkpoint
    torch.manual_seed(cfg.seed)
    student, state, progress = _student(cfg, ckpt, resuming, corpus, train_rows, teacher)
    if teacher.tokenizer is not None or not (out / "tokenizer.json").is_file():
        teacher.get()
        _copy_tokenizer(Path(cfg.target), teacher.tokenizer, out)
    opt = _optimizer(student, cfg, state)

    init_recipe = _init_from_recipe(cfg, out, resuming)

    def write_recipe() -> None:
        _write_recipe(cfg, out, progress, student, spec, corpus, init_recipe)

    write_recipe()
    # 4. training
    start_step = progress.step
    _train(cfg, student, opt, corpus, train_rows, eval_rows, progress, t_start, write_recipe)
    # 5. final evaluation on all held-out rows, cost per step, the saved draft
    report = _finish(cfg, out, student, corpus, train_rows, eval_rows, teacher, progress,
                     start_step=start_step, t_start=t_start, corpus_time=corpus_time)
    write_recipe()
    (out / "report.json").write_text(json.dumps(report.to_dict(), indent=1))
    return report


def _load_corpus(cfg: DistillConfig, spec: CorpusSpec, teacher: _Teacher) -> tuple[Corpus, float]:
    """The corpus (built with a bfloat16 copy of the teacher if not cached yet, the extra
    corpora merged in and decontaminated) and the seconds spent building it."""
    cdir = cfg.corpus_path
    t0 = time.time()
    labeller = None
    if not (cdir / "done").exists():  # a bfloat16 copy: ~2.4x faster, KL to fp32 ~1e-3
        labeller = copy.deepcopy(teacher.get()).to(torch.bfloat16)
    corpus = build_corpus(labeller, teacher.tokenizer, cdir, spec, progress=cfg.progress)
    if cfg.extra_corpus_dirs:
        corpus = Corpus.merge([corpus] + [load_corpus(d, like=spec) for d in cfg.extra_corpus_dirs])
        dropped = corpus.decontaminate()  # templated prompts recur across seeds
        if cfg.progress and dropped:
            print(f"dropped {dropped} training rows that start like a held-out row")
    return corpus, (time.time() - t0 if labeller is not None else 0.0)


def _student(cfg: DistillConfig, ckpt: Path, resuming: bool, corpus: Corpus, train_rows: torch.Tensor,
             teacher: _Teacher):
    """(student in training mode, trainer state or None, progress): the checkpoint when
    resuming, `init_from` for a warm start, else a fresh student from the target's embedding."""
    from transformers import AutoModelForCausalLM

    shape = cfg.shape
    state, progress = None, _Progress()
    if resuming:
        state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
        old = state.get("shape", {})
        if old != shape:
            raise SpecRouterError(f"{ckpt} is a student of shape {old}, not {shape}: pass "
                                  "resume=False to start over, or use another out_dir")
        student = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
        progress = _Progress(step=state["step"], tokens_seen=state["tokens_seen"], history=state["history"])
        torch.set_rng_state(state["torch_rng"])
    elif cfg.init_from is not None:
        student = AutoModelForCausalLM.from_pretrained(str(cfg.init_from), dtype=torch.float32)
        c = student.config
        got = dict(hidden_size=c.hidden_size, num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads,
                   num_kv_heads=c.num_key_value_heads, intermediate_size=c.intermediate_size)
        if any(v is not None and got[k] != v for k, v in shape.items()):
            raise SpecRouterError(f"init_from {cfg.init_from} has shape {got}, not {shape}")
    else:
        pick = torch.randperm(len(train_rows), generator=torch.Generator().manual_seed(cfg.seed))[:16]
        sample = corpus.tokens[train_rows[pick], : min(128, cfg.seq_len)]  # (16, <=128)
        student = init_student(teacher.get(), init=cfg.init, sample_tokens=sample, **shape)
    student.train()
    return student, state, progress


def _optimizer(student, cfg: DistillConfig, state: dict | None) -> torch.optim.AdamW:
    """AdamW, weight decay on the matrices only (not embeddings, not norms); a checkpoint's
    state restored."""
    decay = [p for n, p in student.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in student.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    if state is not None:
        opt.load_state_dict(state["optimizer"])
    return opt


def _init_from_recipe(cfg: DistillConfig, out: Path, resuming: bool) -> dict | None:
    """The recipe of the draft a warm start began from (its folder's recipe.json, or its run's
    when it is a run's `checkpoint` folder; None if it has none), read once before training: the
    folder may be overwritten later (a shipped asset replaced by this run's draft). A resumed run
    keeps what its first call recorded."""
    if resuming:
        old = out / "recipe.json"
        return json.loads(old.read_text()).get("init_from_recipe") if old.is_file() else None
    if cfg.init_from is None:
        return None
    folder = Path(cfg.init_from)
    candidates = [folder / "recipe.json"] + ([folder.parent / "recipe.json"] if folder.name == "checkpoint" else [])
    found = next((f for f in candidates if f.is_file()), None)
    return json.loads(found.read_text()) if found is not None else None


def _write_recipe(cfg: DistillConfig, out: Path, progress: _Progress, student, spec: CorpusSpec,
                  corpus: Corpus, init_recipe: dict | None) -> None:
    recipe = {
        "args": cfg.args(), "seed": cfg.seed, "steps_done": progress.step, "tokens_seen": progress.tokens_seen,
        "student_config": student.config.to_dict(), "shape": cfg.shape,
        "corpus": {"dir": str(cfg.corpus_path), "extra_dirs": [str(d) for d in cfg.extra_corpus_dirs],
                   "spec": spec.__dict__, "sources": corpus.composition(),
                   # each extra corpus's own spec (prompt set, seed, size: what rebuilds it)
                   "extra_specs": [json.loads((Path(d) / "spec.json").read_text()) for d in cfg.extra_corpus_dirs]},
        "init_from": str(cfg.init_from) if cfg.init_from is not None else None,
        "init_from_recipe": init_recipe,
        "versions": _versions(),
    }
    (out / "recipe.json").write_text(json.dumps(recipe, indent=1, default=str))


def _train_step(cfg: DistillConfig, student, opt, corpus: Corpus, rows: torch.Tensor, step: int,
                warmup: int) -> tuple[float, int]:
    """One optimizer step on `rows`: bf16 autocast body, fused sparse-KL head in bf16 with
    float32 master weights. Returns (loss per position, positions)."""
    T = int(corpus.lengths[rows].max())
    x = corpus.tokens[rows, :T]  # (B, T)
    mask = corpus.label_mask(rows)[:, :T]  # (B, T)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = student.model(input_ids=x).last_hidden_state  # (B, T, d)
    h = hidden[mask].float()  # (N, d)
    n = h.shape[0]
    ids = corpus.topk_ids[rows, :T][mask]  # (N, k) teacher top-k, argmax first
    loss = sparse_kl_loss(h, student.lm_head.weight, ids, corpus.topk_logp[rows, :T][mask],
                          ids[:, 0], cfg.ce_weight, vocab_sample=cfg.vocab_sample,
                          generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)) / n
    for group in opt.param_groups:
        group["lr"] = _lr_at(step, cfg.steps, warmup, cfg.lr)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach()), n


def _train(cfg: DistillConfig, student, opt, corpus: Corpus, train_rows: torch.Tensor,
           eval_rows: torch.Tensor, progress: _Progress, t_start: float, write_recipe) -> None:
    """Steps up to cfg.steps, a held-out evaluation (64 rows) into the history every
    `eval_every` steps and a checkpoint every `checkpoint_every`."""
    from tqdm.auto import tqdm

    probe_rows = eval_rows[torch.randperm(len(eval_rows), generator=torch.Generator().manual_seed(cfg.seed))[:64]]
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, cfg.steps // 20)
    t_train = time.time()
    perms: dict = {}
    bar = tqdm(total=cfg.steps, initial=progress.step, desc="distill", unit="step", disable=not cfg.progress,
               dynamic_ncols=True)
    history = progress.history
    loss_ema = history[-1]["loss"] if history else None
    while progress.step < cfg.steps:
        rows = _batch_rows(train_rows, progress.step, cfg.batch_size, cfg.seed, perms)
        loss, n = _train_step(cfg, student, opt, corpus, rows, progress.step, warmup)
        progress.step += 1
        progress.tokens_seen += n
        progress.tokens_this_run += n
        step = progress.step
        loss_ema = loss if loss_ema is None else 0.95 * loss_ema + 0.05 * loss
        tps = progress.tokens_this_run / (time.time() - t_train)
        bar.set_postfix(loss=f"{loss_ema:.3f}", tok_s=f"{tps:.0f}")
        bar.update(1)
        if step % cfg.eval_every == 0 or step == cfg.steps:
            student.eval()
            ev = evaluate(student, corpus, probe_rows)
            student.train()
            history.append({"step": step, "loss": loss_ema, "agreement": ev["agreement"],
                            "agreement_generated": ev["agreement_generated"], "kl": ev["kl"],
                            "tokens_seen": progress.tokens_seen, "tokens_per_s": tps,
                            "elapsed_s": time.time() - t_start})
            bar.write(f"step {step}: loss {loss_ema:.3f}  held-out agreement "
                      f"{ev['agreement']:.3f} (generated {ev['agreement_generated']:.3f})  "
                      f"kl {ev['kl']:.3f}  {tps:.0f} tok/s")
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            _save_checkpoint(Path(cfg.out_dir), student, opt, step, {
                "tokens_seen": progress.tokens_seen, "history": history, "shape": cfg.shape})
            write_recipe()
    bar.close()
    progress.train_time = time.time() - t_train


def _finish(cfg: DistillConfig, out: Path, student, corpus: Corpus, train_rows: torch.Tensor,
            eval_rows: torch.Tensor, teacher: _Teacher, progress: _Progress, *, start_step: int,
            t_start: float, corpus_time: float) -> DistillReport:
    """Evaluate on all held-out rows, save the draft (save_dtype, draft_vocab.json), time a
    step of both models, run the end-to-end greedy evaluation: the report."""
    student.eval()
    ev = evaluate(student, corpus, eval_rows)
    student.to(getattr(torch, cfg.save_dtype)).save_pretrained(str(out))
    student.float()
    if cfg.draft_vocab_size > 0:
        c = student.config
        special = [i for i in (c.bos_token_id, c.eos_token_id, c.pad_token_id) if isinstance(i, int)]
        write_draft_vocab(out, corpus, train_rows, eval_rows, cfg.draft_vocab_size, c.vocab_size, special)
    weights = sum(f.stat().st_size for f in out.glob("*.safetensors")) / 2**20
    target_ms, student_ms = step_ms(teacher.get()), step_ms(student)
    greedy = (greedy_agreement(student, teacher.get(), teacher.tokenizer, max_new_tokens=cfg.greedy_eval_tokens)
              if cfg.greedy_eval_tokens > 0 else None)
    train_time = progress.train_time
    return DistillReport(
        out_dir=str(out), steps=progress.step, start_step=start_step, tokens_seen=progress.tokens_seen,
        params=sum(p.numel() for p in student.parameters()), weights_mb=round(weights, 2),
        agreement=ev["agreement"], agreement_by_kind=ev["agreement_by_kind"],
        agreement_by_source=ev["agreement_by_source"],
        agreement_generated=ev["agreement_generated"],
        greedy_agreement=greedy.agreement if greedy else float("nan"),
        greedy_agreement_by_kind=greedy.by_kind if greedy else {}, kl=ev["kl"],
        eval_tokens=ev["eval_tokens"], target_step_ms=round(target_ms, 3),
        student_step_ms=round(student_ms, 3), cost_ratio=round(target_ms / student_ms, 2),
        wall_time_s=round(time.time() - t_start, 1), corpus_time_s=round(corpus_time, 1),
        train_time_s=round(train_time, 1),
        train_tokens_per_s=round(progress.tokens_this_run / train_time, 1) if progress.tokens_this_run else 0.0,
        history=progress.history,
    )
