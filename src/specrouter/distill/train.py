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

from specrouter.distill.corpus import Corpus, CorpusSpec, build_corpus, load_corpus
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


def distill(
    target: str | Path,
    out_dir: str | Path,
    *,
    hidden_size: int = 192,
    num_layers: int = 4,
    num_heads: int = 3,
    num_kv_heads: int = 3,
    intermediate_size: int | None = None,
    init: str = "output",
    steps: int = 3000,
    batch_size: int = 4,
    seq_len: int = 256,
    lr: float = 3e-3,
    corpus_tokens: int = 300_000,
    seed: int = 0,
    generated_fraction: float = 0.6,
    resume: bool = True,
    threads: int | None = None,
    progress: bool = True,
    greedy_fraction: float = 0.5,
    temperature: float = 0.7,
    teacher_topk: int = 32,
    ce_weight: float = 0.5,
    vocab_sample: int = 2048,
    weight_decay: float = 0.01,
    warmup_steps: int | None = None,
    eval_fraction: float = 0.05,
    eval_every: int = 250,
    checkpoint_every: int = 250,
    corpus_dir: str | Path | None = None,
    extra_corpus_dirs: Sequence[str | Path] = (),
    init_from: str | Path | None = None,
    save_dtype: str = "bfloat16",
    greedy_eval_tokens: int = 96,
    draft_vocab_size: int = 16384,
) -> DistillReport:
    """Distil a small draft model from TARGET into OUT_DIR (CPU; resumable).

    The draft is a Llama with the target's tokenizer and vocabulary and tied embeddings
    initialised from the target's (projected to hidden_size). It learns the target's next-token
    distribution (KL at temperature 1, cached top-k of the target, bf16) on text the target
    generates itself from varied code / prose / chat / Q&A prompts plus Python stdlib sources
    and /usr/share/doc text. Re-running with the same OUT_DIR resumes from the last checkpoint.
    OUT_DIR ends up a complete HF checkpoint of the draft, with recipe.json and report.json.

    Args:
        target: the target model, an HF checkpoint directory or a .gguf file.
        out_dir: where the draft, its corpus cache, checkpoints and reports go.
        hidden_size: draft width (the tied embedding is vocab x hidden_size: most parameters).
        num_layers: draft decoder layers.
        num_heads: attention heads (hidden_size must divide by it).
        num_kv_heads: key/value heads (grouped-query attention).
        intermediate_size: MLP width; default 8/3 * hidden_size rounded up to 64.
        init: "output" (embedding projected on the target's output directions) or
            "embedding" (on the embedding's own principal directions).
        steps: optimizer steps in total (a resumed run continues up to this).
        batch_size: rows (of up to seq_len tokens) per step.
        seq_len: tokens per corpus row.
        lr: peak AdamW learning rate (linear warm-up, cosine decay to lr/10).
        corpus_tokens: labelled positions in the corpus (train + held-out).
        seed: seeds the corpus, the initialisation and the batch order.
        generated_fraction: share of the corpus the target writes itself (rest: stdlib, docs).
        resume: continue from OUT_DIR/checkpoint if present (the corpus cache is always reused).
        threads: torch CPU threads (default: leave torch's setting).
        progress: show progress bars.
        greedy_fraction: share of generated rows decoded greedily (the rest sampled).
        temperature: sampling temperature of the sampled generated rows.
        teacher_topk: k of the cached teacher distributions.
        ce_weight: weight of cross-entropy on the target's argmax (hard labels) mixed into the
            KL loss; it aims the student at greedy agreement.
        vocab_sample: sampled softmax: besides the tokens in the batch's top-k, this many
            random tokens per step (0: the full vocabulary; 2048 is ~5x cheaper per step for
            a 49k vocabulary).
        weight_decay: AdamW weight decay of the matrices (not embeddings, not norms).
        warmup_steps: linear warm-up steps (default 5% of steps).
        eval_fraction: share of prompts / files held out for evaluation.
        eval_every: steps between held-out evaluations (on up to 64 rows) in the history.
        checkpoint_every: steps between checkpoints.
        corpus_dir: a corpus folder to use (and build if absent); default OUT_DIR/corpus.
        extra_corpus_dirs: finished corpora (e.g. built with another seed) whose rows are
            added: their training rows to training, their held-out rows to evaluation.
        init_from: a draft checkpoint of the same shape to start from (a second stage on more
            data) instead of the projected-embedding initialisation; ignored when resuming.
        save_dtype: dtype of the final weights: bfloat16, float16 or float32.
        draft_vocab_size: the draft proposes only this many tokens, the most frequent in the
            training rows (draft_vocab.json; the runner then computes only their logits, ~2.5x
            cheaper for a 49k vocabulary); 0 keeps the full vocabulary.
        greedy_eval_tokens: tokens the target writes per prompt of the final end-to-end
            greedy-agreement evaluation (draft_eval.py); 0 skips it.
    """
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    args = {k: (str(v) if isinstance(v, Path) else v) for k, v in locals().items()
            if k not in ("tqdm", "AutoModelForCausalLM")}
    t_start = time.time()
    if threads is not None:
        torch.set_num_threads(threads)
    if save_dtype not in ("bfloat16", "float16", "float32"):
        raise SpecRouterError(f"save_dtype must be bfloat16, float16 or float32, got {save_dtype!r}")
    target, out = Path(target), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shape = dict(hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                 num_kv_heads=num_kv_heads, intermediate_size=intermediate_size)

    # 1. the target (skipped when corpus and checkpoint exist; needed again only for timing)
    teacher = tokenizer = None
    cdir = Path(corpus_dir) if corpus_dir is not None else out / "corpus"
    ckpt = out / "checkpoint"
    resuming = resume and (ckpt / "trainer_state.pt").is_file()

    def get_teacher():
        nonlocal teacher, tokenizer
        if teacher is None:
            teacher, tokenizer = load_target(target)
        return teacher

    if not (cdir / "done").exists() or not resuming:
        get_teacher()
    vocab = teacher.config.vocab_size if teacher is not None else None
    if vocab is None:
        vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]

    # 2. the corpus, built once (teacher in bfloat16) and cached
    spec = CorpusSpec(
        target=str(target), vocab_size=vocab, corpus_tokens=corpus_tokens,
        generated_fraction=generated_fraction, seq_len=seq_len, teacher_topk=teacher_topk,
        temperature=temperature, greedy_fraction=greedy_fraction, eval_fraction=eval_fraction,
        seed=seed)
    t0 = time.time()
    labeller = None
    if not (cdir / "done").exists():  # a bfloat16 copy: ~2.4x faster, KL to fp32 ~1e-3
        labeller = copy.deepcopy(teacher).to(torch.bfloat16)
    corpus = build_corpus(labeller, tokenizer, cdir, spec, progress=progress)
    if extra_corpus_dirs:
        corpus = Corpus.merge([corpus] + [load_corpus(d, like=spec) for d in extra_corpus_dirs])
        dropped = corpus.decontaminate()  # templated prompts recur across seeds
        if progress and dropped:
            print(f"dropped {dropped} training rows that start like a held-out row")
    corpus_time = time.time() - t0 if labeller is not None else 0.0
    del labeller
    train_rows = (~corpus.is_eval).nonzero()[:, 0]
    eval_rows = corpus.is_eval.nonzero()[:, 0]
    if len(train_rows) == 0 or len(eval_rows) == 0:
        raise SpecRouterError(f"corpus in {cdir} has {len(train_rows)} training and "
                              f"{len(eval_rows)} held-out rows: raise corpus_tokens")
    probe_rows = eval_rows[torch.randperm(len(eval_rows), generator=torch.Generator().manual_seed(seed))[:64]]

    # 3. the student: fresh (projected target embedding) or the checkpoint
    torch.manual_seed(seed)
    history: list[dict] = []
    tokens_seen = step = 0
    if resuming:
        state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
        old = state.get("shape", {})
        if old != shape:
            raise SpecRouterError(f"{ckpt} is a student of shape {old}, not {shape}: pass "
                                  "resume=False to start over, or use another out_dir")
        student = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
        step, tokens_seen, history = state["step"], state["tokens_seen"], state["history"]
        torch.set_rng_state(state["torch_rng"])
    elif init_from is not None:
        student = AutoModelForCausalLM.from_pretrained(str(init_from), dtype=torch.float32)
        got = dict(hidden_size=student.config.hidden_size, num_layers=student.config.num_hidden_layers,
                   num_heads=student.config.num_attention_heads,
                   num_kv_heads=student.config.num_key_value_heads,
                   intermediate_size=student.config.intermediate_size)
        if any(v is not None and got[k] != v for k, v in shape.items()):
            raise SpecRouterError(f"init_from {init_from} has shape {got}, not {shape}")
        state = None
    else:
        pick = torch.randperm(len(train_rows), generator=torch.Generator().manual_seed(seed))[:16]
        sample = corpus.tokens[train_rows[pick], : min(128, seq_len)]  # (16, <=128)
        student = init_student(get_teacher(), init=init, sample_tokens=sample, **shape)
        state = None
    student.train()
    if tokenizer is not None or not (out / "tokenizer.json").is_file():
        get_teacher()
        _copy_tokenizer(target, tokenizer, out)
    decay = [p for n, p in student.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in student.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8)
    if state is not None:
        opt.load_state_dict(state["optimizer"])
    warmup = warmup_steps if warmup_steps is not None else max(1, steps // 20)

    def write_recipe(done: int) -> None:
        recipe = {
            "args": args, "seed": seed, "steps_done": done, "tokens_seen": tokens_seen,
            "student_config": student.config.to_dict(), "shape": shape,
            "corpus": {"dir": str(cdir), "extra_dirs": [str(d) for d in extra_corpus_dirs],
                       "spec": spec.__dict__, "sources": corpus.composition()},
            "init_from": str(init_from) if init_from is not None else None,
            "versions": _versions(),
        }
        (out / "recipe.json").write_text(json.dumps(recipe, indent=1, default=str))

    write_recipe(step)

    # 4. training: bf16 autocast body, fused sparse-KL head in bf16 with float32 master weights
    start_step = step
    t_train, tok_this_run = time.time(), 0
    perms: dict = {}
    bar = tqdm(total=steps, initial=step, desc="distill", unit="step", disable=not progress,
               dynamic_ncols=True)
    loss_ema = history[-1]["loss"] if history else None
    while step < steps:
        rows = _batch_rows(train_rows, step, batch_size, seed, perms)
        T = int(corpus.lengths[rows].max())
        x = corpus.tokens[rows, :T]  # (B, T)
        mask = corpus.label_mask(rows)[:, :T]  # (B, T)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = student.model(input_ids=x).last_hidden_state  # (B, T, d)
        h = hidden[mask].float()  # (N, d)
        n = h.shape[0]
        ids = corpus.topk_ids[rows, :T][mask]  # (N, k) teacher top-k, argmax first
        loss = sparse_kl_loss(h, student.lm_head.weight, ids, corpus.topk_logp[rows, :T][mask],
                              ids[:, 0], ce_weight, vocab_sample=vocab_sample,
                              generator=torch.Generator().manual_seed(seed * 1_000_003 + step)) / n
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, steps, warmup, lr)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += n
        tok_this_run += n
        loss_ema = float(loss.detach()) if loss_ema is None else 0.95 * loss_ema + 0.05 * float(loss.detach())
        tps = tok_this_run / (time.time() - t_train)
        bar.set_postfix(loss=f"{loss_ema:.3f}", tok_s=f"{tps:.0f}")
        bar.update(1)
        if step % eval_every == 0 or step == steps:
            student.eval()
            ev = evaluate(student, corpus, probe_rows)
            student.train()
            history.append({"step": step, "loss": loss_ema, "agreement": ev["agreement"],
                            "agreement_generated": ev["agreement_generated"], "kl": ev["kl"],
                            "tokens_seen": tokens_seen, "tokens_per_s": tps,
                            "elapsed_s": time.time() - t_start})
            bar.write(f"step {step}: loss {loss_ema:.3f}  held-out agreement "
                      f"{ev['agreement']:.3f} (generated {ev['agreement_generated']:.3f})  "
                      f"kl {ev['kl']:.3f}  {tps:.0f} tok/s")
        if step % checkpoint_every == 0 or step == steps:
            _save_checkpoint(out, student, opt, step, {
                "tokens_seen": tokens_seen, "history": history, "shape": shape})
            write_recipe(step)
    bar.close()
    train_time = time.time() - t_train

    # 5. final evaluation on all held-out rows, cost per step, the saved draft
    student.eval()
    ev = evaluate(student, corpus, eval_rows)
    dtype = getattr(torch, save_dtype)
    final = student.to(dtype)
    final.save_pretrained(str(out))
    student.float()
    if draft_vocab_size > 0:
        cfg = student.config
        special = [i for i in (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) if isinstance(i, int)]
        write_draft_vocab(out, corpus, train_rows, eval_rows, draft_vocab_size, cfg.vocab_size, special)
    weights = sum(f.stat().st_size for f in out.glob("*.safetensors")) / 2**20
    target_ms, student_ms = step_ms(get_teacher()), step_ms(student)
    greedy = (greedy_agreement(student, get_teacher(), tokenizer, max_new_tokens=greedy_eval_tokens)
              if greedy_eval_tokens > 0 else None)
    write_recipe(step)
    report = DistillReport(
        out_dir=str(out), steps=step, start_step=start_step, tokens_seen=tokens_seen,
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
        train_tokens_per_s=round(tok_this_run / train_time, 1) if tok_this_run else 0.0,
        history=history,
    )
    (out / "report.json").write_text(json.dumps(report.to_dict(), indent=1))
    return report
