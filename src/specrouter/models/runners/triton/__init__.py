"""The runner's GPU path: batch-invariant Triton kernels (issue 33).

Exact speculative decoding needs a position's logits to be bitwise the same whether the target
computes it alone or in a batch, in a 1-token step or a (k+1)-token verification. cuBLAS and
PyTorch's attention choose their reduction order by shape (split-K for small M, a KV split count
that follows the batch), so on a GPU the runner runs its own kernels, each with ONE fixed
reduction order whatever the row count (the approach of thinking-machines-lab's batch-invariant
ops, used by vLLM and SGLang):

- `matmul.py`: y = x @ W.T (+ bias) (+ residual) with fixed tiles (BLOCK_M x BLOCK_N, K in
  BLOCK_K steps, in order) and no split-K: a row's outputs are the same MMA sequence at any M.
- `rmsnorm.py`: one program per row, the whole row in one block.
- `attention.py`: one program per (row, head, query); keys in fixed blocks of KV_BLOCK positions
  (a fixed KV split SIZE, not a fixed number of splits), online softmax in float32 in order.
- `forward.py`: the decoder stack on them, driven by tensors only (no host values), so a forward
  can be captured in a CUDA graph (`graphs.py`).
- `noise.py`: seeded sampling's noisy argmax (decoding/noise.py's `coupled_argmax`) in one
  launch, no host sync.

Everything else of the forward (embedding gather, RoPE, SiLU * up, cache writes) is elementwise
and invariant anyway. On CPU the kernels run under Triton's interpreter (`TRITON_INTERPRET=1`):
slow, but the same programs, so CI tests their logic and invariance (tests/test_triton_kernels.py).
"""

from __future__ import annotations

import functools
import os


@functools.cache
def triton_available() -> bool:
    """True when `triton` imports (the `dev` extra installs it on CPU machines; GPU machines
    with PyTorch have it)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install is an absent one
        return False
    return True


def interpreting() -> bool:
    """True when Triton runs its kernels in the interpreter (CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
