"""Statistics dataclasses (vLLM style: plain counters with `observe_*` methods).

Conventions: at level j of a chain (j >= 2), `drafted[j]` counts the candidates that reached
level j and `accepted[j]` those it accepted. Acceptance length counts the bonus token:
mean acceptance length = committed tokens / cycles (vLLM's 1 + accepted / cycles).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CycleStats:
    """What one cycle of one chain did, summed over the rows that ran it."""

    chain: tuple[str, ...]  # model names, drafter first, target last
    k: int  # draft length asked of the drafter
    rows: int  # sequences in this cycle
    drafted: list[int]  # per level (index 0 = drafter: tokens proposed; j>=1: candidates reaching level j)
    accepted: list[int]  # per level (index 0 unused = 0; j>=1: candidates level j accepted)
    committed: int  # target tokens committed (before stop-token truncation)
    forward_time: dict[str, float]  # seconds spent in each model's forwards (or proposals)
    forward_tokens: dict[str, int]  # new tokens fed to each model (incl. catch-up)
    wall_time: float  # seconds for the whole cycle
    # per row (index b follows the rows passed to the cycle), for the router
    row_ids: list[int] = field(default_factory=list)  # seq_id of each row
    # per row, greedy cycles whose drafter is a model: the tokens it proposed (its argmax chain),
    # free evidence of how a model-free drafter below it would fare (Engine shadow scoring)
    row_proposal: list[list[int]] = field(default_factory=list)


@dataclass
class RequestStats:
    """Per-request counters, filled cycle by cycle."""

    cycles: int = 0
    generated: int = 0  # tokens appended to the output
    chains: dict[str, int] = field(default_factory=dict)  # "a>b>c" -> cycles run with it
    drafted: dict[str, int] = field(default_factory=dict)  # "drafter>verifier" -> candidates
    accepted: dict[str, int] = field(default_factory=dict)  # "drafter>verifier" -> accepted
    wall_time: float = 0.0  # seconds from the first cycle to completion
    cached_tokens: int = 0  # prompt tokens the target took from the prefix cache (not recomputed)
    first_token_time: float = 0.0  # seconds from add_request to the first committed token (TTFT)
    certain: int = 0  # tokens committed as grammar-forced drafts inside a cycle (certain_drafts.py)
    jumped: int = 0  # tokens committed by jump forward, without a forward (engine/constrained.py)

    def observe_cycle(self, chain: tuple[str, ...], drafted: list[int], accepted: list[int],
                      committed: int) -> None:
        self.cycles += 1
        self.generated += committed
        key = ">".join(chain)
        self.chains[key] = self.chains.get(key, 0) + 1
        for j in range(1, len(chain)):
            pair = f"{chain[j - 1]}>{chain[j]}"
            self.drafted[pair] = self.drafted.get(pair, 0) + drafted[j]
            self.accepted[pair] = self.accepted.get(pair, 0) + accepted[j]

    @property
    def mean_acceptance_length(self) -> float:
        return self.generated / self.cycles if self.cycles else 0.0

    @property
    def acceptance_rates(self) -> dict[str, float]:
        return {p: self.accepted[p] / d for p, d in self.drafted.items() if d}

    @property
    def tokens_per_second(self) -> float:
        return self.generated / self.wall_time if self.wall_time > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "cycles": self.cycles,
            "generated_tokens": self.generated,
            "chains": dict(self.chains),
            "acceptance_rates": {p: round(r, 4) for p, r in self.acceptance_rates.items()},
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "tokens_per_second": round(self.tokens_per_second, 2),
            "wall_time_s": round(self.wall_time, 4),
            "cached_tokens": self.cached_tokens,
            "first_token_s": round(self.first_token_time, 4),
        }
