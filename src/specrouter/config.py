"""Configuration dataclasses shared by the Python API, the CLI and the server."""

from __future__ import annotations

import math
from dataclasses import dataclass

from specrouter.errors import SamplingParamsError

MAX_DRAFT_LENGTH = 16  # k is searched in 1..MAX_DRAFT_LENGTH by the router


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters, validated on construction.

    temperature == 0 means greedy decoding (the output is the target's argmax, token for token);
    top_k == 0 and top_p == 1.0 disable those filters. The same processed distribution is used
    at every level of a chain, which is what makes speculative sampling lossless.
    """

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1.0 = no nucleus filter
    max_new_tokens: int = 64  # generated tokens per request, stop tokens included
    stop_token_ids: tuple[int, ...] = ()  # generation ends after any of these (EOS is added by the pool)
    seed: int | None = None  # seeds the torch.Generator of a generate() call
    ignore_eos: bool = False  # keep generating past EOS (benchmarks)

    def __post_init__(self) -> None:
        def bad(msg: str) -> SamplingParamsError:
            return SamplingParamsError(f"invalid sampling parameters: {msg}")

        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise bad(f"temperature must be a finite number >= 0, got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise bad(f"top_p must be in (0, 1], got {p!r}")
        m = self.max_new_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise bad(f"max_new_tokens must be an integer >= 1, got {m!r}")
        for tok in self.stop_token_ids:
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise bad(f"stop_token_ids must be non-negative integers, got {tok!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad(f"seed must be an integer or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
