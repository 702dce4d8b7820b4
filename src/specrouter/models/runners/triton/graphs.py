"""CUDA-graph replay of the runner's forwards at fixed (batch, tokens) buckets.

A small model's step on a GPU is bound by kernel launches (a 30-layer model issues ~300 a
step), so the Triton path's forward (tensor-driven, see forward.py) is captured once per bucket
(B', T') and replayed: a batch (B, T) is copied into the static inputs of the smallest bucket
with B' >= B and T' >= T, the graph replays, and the logits are sliced back. Padding rows run
one token at position 0 of `pad_slot` (a slot this wrapper holds); padding tokens of a row go to
its scratch row as in any ragged batch. The kernels are batch-invariant, so a row's logits are
the same bits in any bucket as eagerly (benchmarks/gpu_check.py checks it on the GPU).

`GraphedRunner(runner, capture=False)` runs the same padding eagerly (CPU tests of the bucket
logic under Triton's interpreter). A batch beyond the largest bucket runs eagerly. Reserving a
bigger cache reallocates it, so graphs (which hold its addresses) are dropped and re-captured.
"""

from __future__ import annotations

import torch

from specrouter.models.runners.base import ForwardBatch

BATCH_BUCKETS = (1, 2, 4, 8, 16)  # rows
TOKEN_BUCKETS = (1, 2, 3, 5, 9, 17)  # new tokens per row: a step, and verifies of k + 1 (k = 1, 2, 4, 8, 16)


def bucket_of(B: int, T: int, batch_buckets=BATCH_BUCKETS, token_buckets=TOKEN_BUCKETS) -> tuple[int, int] | None:
    """The smallest bucket holding a (B, T) batch, None when none does."""
    b = next((x for x in batch_buckets if x >= B), None)
    t = next((x for x in token_buckets if x >= T), None)
    return None if b is None or t is None else (b, t)


class GraphedRunner:
    """A LlamaRunner on its Triton path whose `forward` replays CUDA graphs per bucket; every
    other attribute is the runner's (slots, reserve, names, ...)."""

    def __init__(self, runner, *, capture: bool | None = None, batch_buckets=BATCH_BUCKETS,
                 token_buckets=TOKEN_BUCKETS):
        if not getattr(runner, "_gpu", False):
            raise ValueError("CUDA graphs replay the runner's Triton path (device cuda or kernels='triton')")
        self.runner = runner
        self.capture = runner.device.type == "cuda" if capture is None else capture
        self.batch_buckets, self.token_buckets = tuple(batch_buckets), tuple(token_buckets)
        self._graphs: dict[tuple[int, int], tuple[object, ForwardBatch, torch.Tensor]] = {}
        self._cache_ptr = None  # the cache the graphs were captured on
        self._mempool = None
        self._buffers: dict[tuple[int, int], torch.Tensor] = {}  # a bucket's packed static inputs
        self.pad_slot: int | None = None
        self.replays = 0  # forwards served from a bucket (tests, the GPU check)

    def __getattr__(self, name):  # everything but forward and reserve is the runner's
        return getattr(self.runner, name)

    def reserve(self, num_slots: int, max_len: int) -> None:
        """The runner's reserve with one slot more: the padding rows' (never one a sequence needs)."""
        self.runner.reserve(num_slots + 1, max_len)

    def _refresh(self) -> bool:
        """Drop graphs captured on a cache that was reallocated; hold a padding slot. False when
        no slot is free for padding (the forward then runs eagerly)."""
        ptr = self.runner._k[0].data_ptr()
        if ptr != self._cache_ptr:
            self._graphs.clear()
            self._cache_ptr, self.pad_slot = ptr, None
        if self.pad_slot is None:
            try:
                self.pad_slot = self.runner.allocate_slot()
            except RuntimeError:
                return False
        return True

    def _static(self, B: int, T: int) -> ForwardBatch:
        """A bucket's static inputs: views into ONE device buffer (slots, starts, num_tokens,
        tokens, logit_positions), so a batch reaches them in one host-to-device copy."""
        dev, pad = self.runner.device, self.pad_slot
        buf = torch.zeros(3 * B + 2 * B * T, dtype=torch.long, device=dev)  # (3B + 2BT,)
        buf[:B] = pad
        buf[2 * B : 3 * B] = T
        self._buffers[(B, T)] = buf
        return ForwardBatch(
            slots=buf[:B], starts=buf[B : 2 * B], num_tokens=buf[2 * B : 3 * B],
            tokens=buf[3 * B : 3 * B + B * T].view(B, T),
            logit_positions=buf[3 * B + B * T :].view(B, T),
            # mirrors for the capture's checks only: every row at position 0 with T tokens
            slots_list=[pad] * B, starts_list=[0] * B, num_tokens_list=[T] * B,
        )

    def _packed(self, batch: ForwardBatch, B2: int, T2: int) -> torch.Tensor:
        """`batch` laid out as a (B2, T2) bucket's buffer, built where the batch lives (the host,
        as the engine builds them: tiny CPU ops): padding rows run one token at position 0 of
        the pad slot (this wrapper's own), so they write and read nothing that is kept; padding
        tokens and positions are 0."""
        B, T = batch.tokens.shape
        G = batch.logit_positions.shape[1]
        out = torch.zeros(3 * B2 + 2 * B2 * T2, dtype=torch.long, device=batch.tokens.device)
        out[:B2] = self.pad_slot
        out[:B] = batch.slots
        out[B2 : B2 + B] = batch.starts
        out[2 * B2 : 3 * B2] = 1
        out[2 * B2 : 2 * B2 + B] = batch.num_tokens
        out[3 * B2 : 3 * B2 + B2 * T2].view(B2, T2)[:B, :T] = batch.tokens
        out[3 * B2 + B2 * T2 :].view(B2, T2)[:B, :G] = batch.logit_positions
        return out

    def _fill(self, static: ForwardBatch, batch: ForwardBatch) -> None:
        """Copy `batch` into the bucket's static inputs (views of one buffer) in one copy."""
        B2, T2 = static.tokens.shape
        self._buffers[(B2, T2)].copy_(self._packed(batch, B2, T2), non_blocking=True)

    def _graph(self, bucket: tuple[int, int]):
        if bucket in self._graphs:
            return self._graphs[bucket]
        static = self._static(*bucket)
        if not self.capture:  # eager padding (CPU tests)
            entry = (None, static, None)
        else:
            runner = self.runner
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: Triton compiles, the allocator settles
                for _ in range(2):
                    runner.forward(static)
            torch.cuda.current_stream().wait_stream(side)
            if self._mempool is None:
                self._mempool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._mempool):
                out = runner.forward(static)  # (B', T', V)
            entry = (graph, static, out)
        self._graphs[bucket] = entry
        return entry

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        runner = self.runner
        B, T = batch.tokens.shape
        bucket = bucket_of(B, T, self.batch_buckets, self.token_buckets)
        too_long = max(s + n for s, n in zip(batch.starts_list, batch.num_tokens_list)) > runner.max_len
        if bucket is None or too_long or batch.parents is not None or not self._refresh():
            return runner.forward(batch)  # eager (the runner raises for a row past max_len)
        graph, static, out = self._graph(bucket)
        self._fill(static, batch)
        if graph is None:
            out = runner.forward(static)
        else:
            graph.replay()
        self.replays += 1
        G = batch.logit_positions.shape[1]
        return out[:B, :G].clone()  # (B, G, V): the static output is overwritten by the next replay

    def forward_with_features(self, batch: ForwardBatch, inputs=None):
        return self.runner.forward_with_features(batch, inputs)
