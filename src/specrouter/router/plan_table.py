"""A router's PlanTable: every (chain, k) it evaluated for a row, T_eff and the expectations
(moved out of cost_model.py, lean20: the table the router builds at every decision-cache miss,
`Router.table`, policy.py; the dynamic programme that fills it is cost_model.py's `chain_rows`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PlanTable:
    """Every (chain, k) the router evaluated, for display and metrics. Row i is chains[i]."""

    chains: tuple[tuple[str, ...], ...]  # candidate chains, in the order given
    ks: np.ndarray  # (K,) draft lengths 1..k_max
    t_eff: np.ndarray  # (C, K) predicted seconds per committed target token
    expected_tokens: np.ndarray  # (C, K) expected target tokens committed per cycle
    expected_latency: np.ndarray  # (C, K) expected seconds per cycle

    def format(self, scale: float = 1e3, unit: str = "ms") -> str:
        """One line per chain: its best k, T_eff there and the speed-up over plain decoding
        (when the target-only chain is among the candidates)."""
        plain = [i for i, c in enumerate(self.chains) if len(c) == 1]
        base = float(self.t_eff[plain[0], 0]) if plain else math.nan
        lines = [f"{'chain':<40} {'k':>3} {'T_eff ' + unit:>12} {'tok/cycle':>9} {'speedup':>8}"]
        for i, chain in enumerate(self.chains):
            j = int(np.argmin(self.t_eff[i]))
            k = 0 if len(chain) == 1 else int(self.ks[j])
            t = float(self.t_eff[i, j])
            lines.append(
                f"{' -> '.join(chain):<40} {k:>3} {t * scale:>12.4g} "
                f"{float(self.expected_tokens[i, j]):>9.3f} {base / t:>7.2f}x"
            )
        return "\n".join(lines)
