"""The target's features and greedy labels over a distillation corpus, computed by the native
runner at the engine's precision (`LlamaRunner.forward_with_features`), so the head trains on
the very bits the engine will hand it: a whole row in one forward gives, position by position,
the features of plain 1-token decoding (the kernels are row-invariant).

Cached in a folder of shards (resumable): features (R, T, H) in the runner's dtype and labels
(R, T) int64, the runner's argmax next token at every position (-1 past a row's end). The
labels are what greedy verification by the engine's target compares a draft with; the corpus's
cached top-k (transformers' forward) serves as the soft target of the loss.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from specrouter.distill.corpus import Corpus
from specrouter.errors import SpecRouterError
from specrouter.models.runners.base import ForwardBatch

SHARD_ROWS = 32  # corpus rows per feature shard


@dataclass(frozen=True)
class Features:
    """Per corpus row: the target's pre-norm last-layer output and argmax at every position."""

    features: torch.Tensor  # (R, T, H) runner dtype; garbage past a row's length
    labels: torch.Tensor  # (R, T) int64: argmax of the target's logits at t (-1 past the row)
    dtype: str  # the runner's compute dtype ("bfloat16" on the native kernels)


@torch.no_grad()
def row_features(runner, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One ragged forward of whole rows from position 0 (slots 0..B-1): features (B, T, H) and
    argmax labels (B, T), -1 past each row."""
    B = len(rows)
    T = max(len(r) for r in rows)
    batch = ForwardBatch.build(list(range(B)), [0] * B, rows, [list(range(len(r))) for r in rows])
    logits, feats = runner.forward_with_features(batch)  # (B, T, V), (B, T, H)
    labels = logits.argmax(-1)  # (B, T)
    labels[torch.arange(T)[None, :] >= torch.tensor([len(r) for r in rows])[:, None]] = -1
    return feats.clone(), labels


def compute_features(runner, corpus: Corpus, folder: str | Path, *, batch_rows: int = 4,
                     progress: bool = True) -> Features:
    """Features and labels of every corpus row, cached in `folder` (shards of SHARD_ROWS rows;
    an interrupted run resumes). `runner`: the target's LlamaRunner, with >= batch_rows slots
    and max_len >= the corpus's row length."""
    from tqdm.auto import tqdm

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    R, T = corpus.tokens.shape
    meta = {"rows": R, "seq_len": T, "dtype": str(runner.dtype).removeprefix("torch."),
            "tokens_sum": int(corpus.tokens.sum())}
    meta_path = folder / "meta.json"
    if meta_path.is_file() and json.loads(meta_path.read_text()) != meta:
        raise SpecRouterError(f"{folder} holds features of another corpus or precision: delete it")
    meta_path.write_text(json.dumps(meta))
    todo = [s for s in range(0, R, SHARD_ROWS) if not (folder / f"shard-{s // SHARD_ROWS:05d}.pt").is_file()]
    positions = int(corpus.lengths.sum())
    bar = tqdm(total=positions, unit="tok", desc="features", disable=not progress, dynamic_ncols=True,
               initial=positions - sum(int(corpus.lengths[s : s + SHARD_ROWS].sum()) for s in todo))
    for s in todo:
        feats, labels = [], []
        for b in range(s, min(s + SHARD_ROWS, R), batch_rows):
            rows = [corpus.tokens[r, : int(corpus.lengths[r])].tolist() for r in range(b, min(b + batch_rows, R, s + SHARD_ROWS))]
            f, lab = row_features(runner, rows)
            pad = T - f.shape[1]
            feats.append(torch.nn.functional.pad(f, (0, 0, 0, pad)))
            labels.append(torch.nn.functional.pad(lab, (0, pad), value=-1))
            bar.update(sum(len(r) for r in rows))
        tmp = folder / f"shard-{s // SHARD_ROWS:05d}.pt.tmp"
        torch.save({"features": torch.cat(feats), "labels": torch.cat(labels)}, tmp)
        tmp.rename(folder / f"shard-{s // SHARD_ROWS:05d}.pt")
    bar.close()
    shards = [torch.load(p) for p in sorted(folder.glob("shard-*.pt"))]
    return Features(features=torch.cat([sh["features"] for sh in shards]),
                    labels=torch.cat([sh["labels"] for sh in shards]), dtype=meta["dtype"])
