"""The draft head as a pool level: a `ModelRunner` the executor drafts with and the router weighs
like any neural draft, except that it reads the target's features (models/heads/runner.py).

What differs from a draft model, and where it is handled:
- it only drafts (never verifies: it has no features at a candidate's position), so it can only
  be the FIRST level of a chain, like a model-free drafter (pool.resolve_chain, the router's
  chains), and the pool orders it before the model drafts;
- its input at position p is the target's feature f_p with the token t_{p+1}, so it lags the
  target by one position: the state manager keeps each row's target features
  (state/features.py) and the executor drafts with them (decoding/head_drafting.py);
- `forward` (no features) exists for the cost-profile sweep only: a step's cost does not
  depend on the feature values, so the sweep times the head on zero features.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specrouter.errors import CheckpointError
from specrouter.models.heads.model import HEAD_CONFIG_FILE, HEAD_WEIGHTS_FILE
from specrouter.models.heads.runner import HeadRunner
from specrouter.models.runners.base import ForwardBatch, ModelRunner


def is_head_dir(path: str | Path) -> bool:
    """A saved head folder: head_config.json + head.safetensors (no config.json of its own)."""
    p = Path(path).expanduser()
    return p.is_dir() and (p / HEAD_CONFIG_FILE).is_file() and (p / HEAD_WEIGHTS_FILE).is_file()


class HeadLevel(ModelRunner):
    """A `HeadRunner` behind the `ModelRunner` interface (slots, reserve, cost identity)."""

    is_head = True  # the executor drafts with `step`; the chain puts it first only

    def __init__(self, head: HeadRunner, checkpoint_dir: Path | None = None) -> None:
        self.head = head
        layer = head.layer
        self.name, self.dtype, self.device = head.name, head.dtype, layer.device
        self.vocab_size, self.max_context = layer.vocab_size, layer.max_context
        self.num_params = head.num_params  # what a step touches: fc, the layer, the reduced rows
        self.hidden_size = layer.arch.hidden_size
        self.packs_ragged = layer.packs_ragged
        self.checkpoint_dir = checkpoint_dir

    @property
    def num_slots(self) -> int:  # type: ignore[override]
        return self.head.layer.num_slots

    @property
    def max_len(self) -> int:  # type: ignore[override]
        return self.head.layer.max_len

    def reserve(self, num_slots: int, max_len: int) -> None:
        if num_slots > self.num_slots or max_len > self.max_len:
            self.reallocating()  # the layer reallocates: parked prefix-cache slots are dropped first
        self.head.reserve(num_slots, max_len)

    def kv_bytes_per_position(self) -> int:
        return self.head.layer.kv_bytes_per_position()

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        self.head.layer.copy_slot(src, dst, length)

    def step(self, batch: ForwardBatch, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits (B, G, V), predicted features (B, T, H)): see `HeadRunner.step`."""
        return self.head.step(batch, features.to(self.dtype))

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """A step on zero features (the profile sweep: same cost as a real step)."""
        B, T = batch.tokens.shape
        zeros = torch.zeros(B, T, self.hidden_size, dtype=self.dtype, device=self.device)
        return self.head.step(batch, zeros)[0]


def load_head_level(path: str | Path, target_dir: str | Path, *, name: str | None = None,
                    dtype: torch.dtype = torch.float32, num_slots: int = 1,
                    max_len: int | None = None) -> HeadLevel:
    """The head saved in `path` as a level over the target checkpoint `target_dir`; raises
    CheckpointError when it was trained on a target of another architecture."""
    from specrouter.models.heads.runner import load_head_runner

    if not is_head_dir(path):
        raise CheckpointError(f"{str(path)!r} is not a draft head folder (needs {HEAD_CONFIG_FILE} "
                              f"and {HEAD_WEIGHTS_FILE})")
    runner = load_head_runner(path, target_dir, dtype=dtype, num_slots=num_slots, max_len=max_len)
    if name is not None:
        runner.name = runner.layer.name = name
    return HeadLevel(runner, checkpoint_dir=Path(path).expanduser().resolve())
