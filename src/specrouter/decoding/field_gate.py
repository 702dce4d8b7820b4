"""A row's field drafts gated on what they realise in its request (issue 30, session 25).

A field draft (decoding/field_drafts.py) is offered in place of a model-free drafter's proposal
where the two differ (decoding/certain_drafts.py `preferred`): a bet that the guess is right
where the drafter's copy is wrong. On requests worded as no rule foresaw the bet kept losing (a
guess rejected at its first token where the suffix drafter's copy of the output's own loop would
have been accepted; long guesses widening every verifying forward): docs/structured-output.md
"The fresh held-out set". So each row prices its field drafts the way the router prices a
model-free drafter, on evidence of its own request scored against the tokens the target
committed:

- a **contest** is a cycle's first place where the field draft and the drafter's own proposal
  differ (the tails from there, each as first proposed). The one offered is verified; both are
  scored once the row has committed the tokens at their positions (later cycles'): the tokens
  of each that match what the target committed there. Scored at once (as the router scores a
  shadow proposal, against the step's own tokens), the one not offered could never be credited
  with more than one token past the other's rejection (the committed tokens end there): on
  UNSEEN's SMS list a suffix draft copying the output's own loop lost by one token to guesses it
  beat by up to 16;
- a contest's **gain** is the field draft's matched tokens less the proposal's (committed
  tokens). The extra candidates a longer draft puts in the verifying forward are not charged: a
  price per candidate would be one more machine-specific constant (what a verified position
  costs against a committed token differs by machine; a GPU verifies a wider forward almost
  free), and charging one showed no gain (docs/structured-output.md "Session 25");
- the row's **score** is the decayed sum of its gains (every drafted cycle of the row fades it
  by DECAY, as the router fades a request's unused evidence; a cycle the row decodes plainly
  leaves it as it is), and the gate is open while the score plus PRIOR (the benefit of the
  doubt a request's field drafts start with, in tokens) is positive. A closed gate offers the
  drafter's proposal and still scores the field draft as a shadow, so a request whose guesses
  start paying opens it again, and the decay returns the score toward the prior, where the
  next contest tries again.

Exact whatever it decides: only which candidates are verified changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specrouter.state.sequence import common_prefix_len

PRIOR = 1.0  # tokens of evidence for field drafts before their request's own
DECAY = 0.95  # per drafted cycle of the row: its evidence fades (~20 cycles); the same value as
# RouterConfig.request_hit_decay's default (a separate constant: the gate reads no config)


@dataclass
class Contest:
    """A cycle's first place where the field draft and the drafter's proposal differ."""

    at: int  # position in the row's tokens (prompt included)
    before: list[int]  # the cycle's candidates before it (the contest counts where they were committed)
    fields: list[int]  # the field draft from there
    own: list[int]  # the drafter's proposal from there
    offered: bool  # the field draft is what was verified


@dataclass
class FieldGate:
    """One row's evidence on its field drafts against the drafters' proposals."""

    score: float = 0.0  # decayed sum of the contests' gains (tokens)
    contests: int = 0  # scored
    won: int = 0  # ... where the field draft matched more of the committed tokens
    lost: int = 0  # ... fewer
    closed: int = 0  # contests where the gate was closed (the proposal offered)
    pending: list = field(default_factory=list)  # contests whose positions are not all committed yet

    @property
    def open(self) -> bool:
        return self.score + PRIOR > 0

    def observe(self, contest: Contest | None, tokens: list[int], out: list[int]) -> None:
        """One cycle of the row: the target committed `out` after its tokens `tokens`;
        `contest`: the cycle's, if any. Scores the contests whose positions are committed now."""
        self.score *= DECAY
        if contest is not None:
            self.pending.append(contest)
        if not self.pending:
            return
        committed, left = tokens + out, []
        for c in self.pending:
            if len(committed) < c.at + max(len(c.fields), len(c.own)):
                left.append(c)
            elif committed[c.at - len(c.before): c.at] == c.before:  # (else its place was never reached)
                self._score(c, committed[c.at:])
        self.pending = left

    def _score(self, c: Contest, after: list[int]) -> None:
        f, o = common_prefix_len(c.fields, after), common_prefix_len(c.own, after)
        gain = f - o
        self.score += gain
        self.contests += 1
        self.won += f > o
        self.lost += f < o
        self.closed += not c.offered
