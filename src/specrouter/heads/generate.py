"""A head's corpus, written by the target on the native runner: the same prompts as the draft's
corpus (distill/corpus.py: code, prose, chat, Q&A), continued greedily or sampled in batches of
1-token steps, keeping at every position what the head trains on: the feature, the greedy
label and the top-k log-probabilities, all from the engine's own forward and precision.

Why not the draft corpus's builder: it labels with transformers, whose bfloat16 GEMM is ~5x
slower than its float32 on AVX2-only CPUs (measured here: 10 vs 56 tok/s for a 73 x 64 forward
on 2 contended cores), and its features would then need a second pass of the target; the
native runner decodes a batch of rows at ~1-row cost and hands the features out for free.

Writes a corpus folder that `distill.corpus.load_corpus` reads (spec.json, shard-*.pt, done)
and the matching features folder (heads/features.py's layout), one shard of each per batch;
an interrupted build resumes at the first missing batch (the prompt stream is replayed).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from specrouter.distill.corpus import (
    SOURCE_IDS,
    CorpusSpec,
    _pack,
    _prompt_stream,
    _stop_ids,
)
from specrouter.heads.features import SHARD_ROWS
from specrouter.models.runners.base import ForwardBatch


@torch.no_grad()
def generate_batch(runner, prompts: list[list[int]], greedy: list[bool], *, max_len: int, k: int,
                   temperature: float, stop_ids: set[int], generator: torch.Generator):
    """Continue `prompts` (slots 0..B-1) up to `max_len` tokens or a stop token. Returns per row
    (tokens, top-k ids (L-1, k), top-k logp (L-1, k), features (L, H), labels (L,)): position t's
    feature, greedy label and top-k describe the target after tokens[:t+1]."""
    B = len(prompts)
    rows = [list(p) for p in prompts]
    logits, feats = runner.forward_with_features(
        ForwardBatch.build(list(range(B)), [0] * B, rows, [list(range(len(p))) for p in rows]))
    # per row, per position: features (H,), logits (V,) kept as top-k + argmax
    f_rows = [[feats[b, i].clone() for i in range(len(p))] for b, p in enumerate(rows)]
    lp = torch.log_softmax(logits, -1)  # (B, P, V)
    top = lp.topk(k, -1)
    ids = [[top.indices[b, i] for i in range(len(p))] for b, p in enumerate(rows)]
    logp = [[top.values[b, i] for i in range(len(p))] for b, p in enumerate(rows)]
    active = [True] * B
    while True:
        live = [b for b in range(B) if active[b]]
        for b in live:  # 1. the next token: the argmax, or a sample of the top k at `temperature`
            i_b, lp_b = ids[b][-1], logp[b][-1]
            if greedy[b]:
                nxt = int(i_b[0])
            else:
                nxt = int(i_b[torch.multinomial(torch.softmax(lp_b / temperature, -1), 1, generator=generator)])
            rows[b].append(nxt)
            if nxt in stop_ids or len(rows[b]) >= max_len:
                active[b] = False
        live = [b for b in range(B) if active[b]]
        if not live:
            break
        # 2. one step of the live rows gives their next distribution and feature
        logits, feats = runner.forward_with_features(ForwardBatch.build(
            live, [len(rows[b]) - 1 for b in live], [[rows[b][-1]] for b in live], [[0]] * len(live)))
        top = torch.log_softmax(logits[:, 0], -1).topk(k, -1)
        for j, b in enumerate(live):
            f_rows[b].append(feats[j, 0].clone())
            ids[b].append(top.indices[j])
            logp[b].append(top.values[j])
    out = []
    for b in range(B):
        L = len(rows[b])
        f = torch.stack(f_rows[b][:L])  # the last token has no forward: L - 1 features + pad
        if f.shape[0] < L:
            f = torch.cat([f, torch.zeros(L - f.shape[0], f.shape[1], dtype=f.dtype)])
        lab = torch.stack([i[0] for i in ids[b]])[:L]
        lab = torch.cat([lab, torch.full((L - len(lab),), -1, dtype=lab.dtype)])
        out.append((rows[b], torch.stack(ids[b])[: L - 1].int(), torch.stack(logp[b])[: L - 1].half(), f, lab))
    return out


def generate_corpus(runner, tokenizer, spec: CorpusSpec, corpus_dir: str | Path, features_dir: str | Path,
                    *, progress: bool = True) -> None:
    """Build a target-written corpus of `spec.corpus_tokens` positions with its features (module
    docstring); every row is a generated one (`spec.generated_fraction` is not used)."""
    from tqdm.auto import tqdm

    cdir, fdir = Path(corpus_dir), Path(features_dir)
    if (cdir / "done").exists():
        return
    cdir.mkdir(parents=True, exist_ok=True)
    fdir.mkdir(parents=True, exist_ok=True)
    (cdir / "spec.json").write_text(json.dumps({**spec.__dict__, "generated_fraction": 1.0,
                                                "builder": "heads.generate (native runner)"}, indent=1))
    rng = random.Random(spec.seed)
    prompts = _prompt_stream(tokenizer, spec, rng)
    stop = _stop_ids(tokenizer)
    done = 0
    bar = tqdm(total=spec.corpus_tokens, unit="tok", desc="corpus", disable=not progress, dynamic_ncols=True)
    i = 0
    while done < spec.corpus_tokens:
        batch = [next(prompts) for _ in range(SHARD_ROWS)]
        path = cdir / f"shard-{i:05d}.pt"
        if path.is_file():
            shard = torch.load(path)
        else:
            rows = generate_batch(runner, [b[1] for b in batch], [b[2] for b in batch], max_len=spec.seq_len,
                                  k=spec.teacher_topk, temperature=spec.temperature, stop_ids=stop,
                                  generator=torch.Generator().manual_seed(spec.seed * 100_003 + i))
            shard = _pack([r[:3] for r in rows], spec.seq_len, spec.teacher_topk,
                          [SOURCE_IDS[b[0]] for b in batch], [b[3] for b in batch])
            T, H = spec.seq_len, rows[0][3].shape[1]
            feats = torch.zeros(len(rows), T, H, dtype=rows[0][3].dtype)
            labels = torch.full((len(rows), T), -1, dtype=torch.long)
            for b, r in enumerate(rows):
                feats[b, : len(r[0])], labels[b, : len(r[0])] = r[3], r[4]
            _save(fdir / f"shard-{i:05d}.pt", {"features": feats, "labels": labels})
            _save(path, shard)
        n = int((shard["lengths"] - 1).clamp(min=0).sum())
        done += n
        bar.update(n)
        i += 1
    bar.close()
    (cdir / "done").touch()


def _save(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    tmp.rename(path)
