"""Grammar masks applied only where they change a greedy row's token (session 25, structcost25).

A constrained row's mask is a logits processor (decoding/processors.py): eagerly, every position
of every forward gets its (V,) mask (llguidance's bitmask, unpacked to a (G, V) bool tensor and
applied to the (G, V) logits) before the argmax, about 10 positions a verification forward on a
structured SpecRouter cycle. For a greedy row whose only processor is its grammar, the masked
argmax equals the unmasked one wherever the mask allows the unmasked argmax (masking only sets
refused tokens to -inf: the maximum and the first index holding it stay), so the executor
chooses on the raw logits, reads ONE bit of each position's mask (`RowGrammar.refused`), and
only where that bit refuses the token does it unpack that position's mask, apply it in place
and choose there again with the same kernel. The positions after the row's first rejected
candidate go without their masks at all (session 26, struct26): verification keeps the accepted
candidates and the token at the first rejection, so nothing after it is committed or read. The
tokens are the eager path's at every position up to the first rejection, so the outputs are
(tests/test_lazy_mask.py compares them). (A certain candidate's position, where the grammar
allows one token, still reads its mask: certain candidates are verified like any other, so a
wrong one is caught: tests/test_grammar_certain.py.)

Not lazy (eager masks as before): sampled rows (the whole masked distribution is sampled), rows
with any other processor (penalties, logit_bias, allowed_token_ids, min_tokens) or asking for
logprobs (they read the processed logits).
"""

from __future__ import annotations

import torch

from specrouter.decoding.sampling import SamplingTensors, choose_at


def lazy(w) -> bool:
    """Whether row work `w` (decoding/executor.RowWork) gets its grammar's masks lazily."""
    p = w.seq.params
    return bool(w.processors and p.greedy and w.seq.grammar is not None and p.logprobs is None
                and not p.has_processors_besides_grammar)


def choose_refused(logits: torch.Tensor, work: list, sampling: SamplingTensors, rows: list[int],
                   offset: int, offsets: list[list[int]] | None, tokens: torch.Tensor) -> None:
    """Fix `tokens` (B, G) host int64, chosen on the unmasked `logits` (B, G, V), for the lazy
    rows `rows` (indices into `work`): where a row's grammar refuses its token, mask that
    position of `logits` in place and choose there again. Row b's draft path offset is
    `offsets[b][0]` when given, else `offset` (the executor's `_sample` convention). A row's
    walk ends at its first rejected candidate (`RowGrammar.refused`): the tokens after it stay
    the unmasked argmax, which verification never reads."""
    for b in rows:
        w = work[b]
        o = offsets[b][0] if offsets is not None else offset
        row = tokens[b].tolist()  # `refused` reads each position's token from here as it walks
        for g, allowed in w.seq.grammar.refused(w.seq.output_ids, w.cand, o, row):
            with torch.inference_mode():  # (the forward's logits are inference tensors)
                logits[b, g].masked_fill_(~allowed.to(logits.device), float("-inf"))
            at = logits[b : b + 1, g : g + 1]  # (1, 1, V)
            positions = [] if sampling.all_greedy else [w.start + o + g]
            row[g] = int(choose_at(at, sampling, [w.b], [w.seq.seed_key], positions)[0, 0])
        tokens[b] = torch.tensor(row, dtype=tokens.dtype)
