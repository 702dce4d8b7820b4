"""A live generation request: its committed tokens, parameters and counters."""

from __future__ import annotations

from collections.abc import Sequence as _Tokens
from dataclasses import dataclass, field

from specrouter.config import SamplingParams
from specrouter.records.routing import RowPlan
from specrouter.records.stats import RequestStats


def common_prefix_len(a: _Tokens[int], b: _Tokens[int]) -> int:
    """How many leading tokens `a` and `b` share: what a model keeps of its speculative tokens
    at commit, and how many of a shadow proposal the target would have accepted."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Sequence:
    """One row of the running batch."""

    seq_id: int  # unique id, also the StateManager key
    tokens: list[int]  # committed tokens: prompt followed by generated ones
    prompt_len: int  # tokens[:prompt_len] is the prompt
    params: SamplingParams  # decoding parameters of this request
    stop_ids: frozenset[int]  # token ids that end generation (EOS unless ignore_eos, + the request's own)
    done: bool = False  # finished: stop token or max_new_tokens
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # why, when finish_reason == "error"
    stats: RequestStats = field(default_factory=RequestStats)
    seed_key: int = 0  # 32-bit key of the row's sampling seed: its noise at position i is a function of (seed_key, i)
    tenant: str | None = None  # whose learned drafter statistics it reads and feeds (None: shared)
    plan: RowPlan | None = None  # the engine's record of its plan (engine.py)
    grammar: object | None = None  # its RowGrammar (decoding/grammar.py) when params.grammar is set
    penalty_memo: object | None = None  # its PenaltyMemo (decoding/processors.py) once a processor ran
    # with params.logprobs: one TokenLogprob (decoding/logprobs.py) per generated token
    logprobs: list | None = None
    # with params.prompt_logprobs: one per prompt token after the first (set at the first cycle)
    prompt_logprobs: list | None = None

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def remaining(self) -> int:
        """Tokens this request may still generate."""
        return self.params.max_new_tokens - self.num_generated

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    def append(self, new_tokens: list[int]) -> int:
        """Append committed tokens, stopping at a stop token or max_new_tokens; returns how
        many were kept and marks the sequence done when it ends."""
        kept = 0
        for tok in new_tokens:
            if self.remaining <= 0:
                break
            self.tokens.append(tok)
            kept += 1
            if tok in self.stop_ids:
                self.done, self.finish_reason = True, "stop"
                return kept
        if self.remaining <= 0:
            self.done, self.finish_reason = True, "length"
        return kept
