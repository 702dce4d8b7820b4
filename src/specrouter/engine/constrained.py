"""The engine's side of grammar-constrained rows (decoding/grammar.py): a row's matcher is
built at admission, and before every step each constrained row

1. a complete grammar allows only the end of text: the pool's EOS tokens are stop tokens of a
   constrained row even with ignore_eos, and min_tokens never masks them there (the processors
   never mask the only tokens left: decoding/processors.py). When the mask allows exactly one
   EOS token, the target's masked distribution is one-hot on it, so it is committed without a
   forward (as jump forward, step 3); with several EOS ids the model samples one, as in plain
   decoding; a pool without EOS ends the row with "stop" as soon as the grammar is complete;
2. ends with finish_reason "grammar" and `seq.error` saying why when its grammar reached a dead
   end (no token can continue it: a refused token or an empty mask);
3. commits the tokens its grammar forces, without any forward ("jump forward"): where the mask
   allows exactly one token, the target's masked distribution is one-hot, so greedy and
   sampled plain decoding both produce it. The models see them as pending tokens at their next
   forward (the state manager's catch-up); the row's next cycle starts after them.
"""

from __future__ import annotations

import functools

from specrouter.decoding.field_drafts import FieldDrafter
from specrouter.decoding.grammar import GrammarSpec, RowGrammar, check_grammar
from specrouter.models.pool import Pool
from specrouter.models.tokenizer import text_decoder, text_encoder
from specrouter.state.sequence import Sequence

DEAD_END = "grammar"  # finish_reason of a row whose grammar allows no continuation


def check_spec(pool: Pool, spec: GrammarSpec) -> None:
    """GrammarError (a SamplingParamsError) naming the problem when `spec` does not compile."""
    check_grammar(spec, pool.tokenizer, tuple(pool.eos_ids), pool.vocab_width)


def attach(pool: Pool, seq: Sequence) -> None:
    """Give a constrained row its matcher (at its empty generated output)."""
    spec = seq.params.grammar
    if spec is not None:
        seq.stop_ids = seq.stop_ids | frozenset(pool.eos_ids)  # step 1: a complete grammar ends the row
        seq.grammar = RowGrammar(spec, pool.tokenizer, tuple(pool.eos_ids), pool.vocab_width, seq.stop_ids)
        encode, decode, special = _text_codec(pool.tokenizer)
        seq.grammar.fields = FieldDrafter(encode, decode, seq.tokens[: seq.prompt_len], special)


@functools.lru_cache(maxsize=4)
def _text_codec(tokenizer):
    """A pool's (encode, decode, special token ids) for field drafts."""
    special = frozenset(getattr(tokenizer, "all_special_ids", ()) or ())
    return text_encoder(tokenizer), text_decoder(tokenizer)[0], special


def certain_rate(seq: Sequence) -> float:
    """Grammar-forced tokens (jump forward and certain drafts) per token a model chose, over the
    row's output so far: what the router's cost model widens its verifying forwards by
    (RowContext.certain_rate; 0 for a row without grammar)."""
    if seq.grammar is None:
        return 0.0
    forced = seq.stats.certain + seq.stats.jumped
    return forced / max(1, seq.num_generated - forced)


def before_step(rows: list[Sequence], eos_ids: tuple[int, ...], jump_forward: bool = True) -> None:
    """Steps 1-3 of the module docstring for the constrained `rows` (others untouched); a row
    that ends is marked done (the engine collects it)."""
    eos = frozenset(eos_ids)
    for seq in rows:
        g = seq.grammar
        if g is None or seq.done:
            continue
        generated = seq.output_ids
        g.sync(generated)
        if g.dead_end or (not g.finished and not g.allows_some(generated)):
            seq.done, seq.finish_reason = True, DEAD_END
            seq.error = f"the grammar allows no continuation: {g.error() or 'no token is allowed'}"
            continue
        if g.finished and not (seq.stop_ids & eos):
            seq.done, seq.finish_reason = True, "stop"
            continue
        # rows asking for logprobs take every token from a target forward (its logits)
        if (not jump_forward or seq.params.allowed_token_ids is not None
                or seq.params.logprobs is not None or seq.params.prompt_logprobs is not None):
            continue
        if seq.remaining > 1:
            forced = g.forced_tokens(generated, seq.remaining - 1)  # leave >= 1 for the cycle
            if forced:
                seq.stats.jumped += seq.append(forced)
                generated = seq.output_ids
                g.sync(generated)
        if g.finished and not (seq.stop_ids & eos):  # complete after the forced tokens
            seq.done, seq.finish_reason = True, "stop"
        elif g.finished:  # step 1: the one EOS a complete grammar allows, without a forward
            only = g.allowed(generated, [], 0, 1)[0].nonzero().flatten()  # (n,) allowed ids
            if only.numel() == 1 and int(only[0]) in seq.stop_ids:
                seq.append([int(only[0])])  # the row ends ("stop")
