"""Log-probabilities in OpenAI's and vLLM's response shapes. The engine computes them
(decoding/logprobs.py: which distribution, and from which logits); this file only writes them.

- chat (`logprobs: true`, `top_logprobs: n`): `choices[i].logprobs.content`, one
  `{token, logprob, bytes, top_logprobs: [n x {token, logprob, bytes}]}` per generated token;
- completions (`logprobs: n`): `choices[i].logprobs` = `{tokens, token_logprobs, top_logprobs,
  text_offset}`; `top_logprobs[j]` maps the text of the n most likely tokens AND of the token
  itself to their logprobs (OpenAI: "up to logprobs + 1 elements"); with `echo` the prompt's
  tokens come first, the first with logprob None (nothing predicts it);
- vLLM's `prompt_logprobs: n` (both endpoints): `choices[i].prompt_logprobs`, None for the
  first prompt token, then `{token id: {logprob, rank, decoded_token}}` for the token and the
  n most likely.
A token's text is `tokenizer.decode([id])` with special tokens kept (a token holding part of a
UTF-8 character decodes to U+FFFD, as in vLLM), or "token_id:{id}" with vLLM's
`return_tokens_as_token_ids`; `bytes` its UTF-8 bytes. A logprob of -inf (a
token the request's filters removed) is written as -9999.0 (JSON has no infinity; vLLM's value).
"""

from __future__ import annotations

import math

from specrouter.decoding.logprobs import TokenLogprob
from specrouter.server.protocol import ChatLogprobs, ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs

FILTERED_LOGPROB = -9999.0  # a -inf logprob on the wire


def wire(logprob: float) -> float:
    return logprob if logprob > -math.inf else FILTERED_LOGPROB


class TokenText:
    """Token id -> its text in logprobs (cached: a vocabulary's tokens recur)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        s = self._cache.get(token)
        if s is None:
            s = self._cache[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return s


class TokenIds:
    """vLLM's `return_tokens_as_token_ids`: a token is named "token_id:{id}" (unambiguous)."""

    def __call__(self, token: int) -> str:
        return f"token_id:{token}"


def chat_logprobs(entries: list[TokenLogprob], text: TokenText) -> ChatLogprobs:
    def item(t: int, lp: float) -> dict:
        s = text(t)
        return {"token": s, "logprob": wire(lp), "bytes": list(s.encode("utf-8"))}

    return ChatLogprobs(content=[
        ChatTokenLogprob(**item(e.token, e.logprob),
                         top_logprobs=[ChatTopLogprob(**item(t, lp)) for t, lp in e.top])
        for e in entries])


class CompletionLogprobWriter:
    """Completions' logprobs of one choice, chunk by chunk (`text_offset` runs on across
    chunks: each token's offset is where its text starts in the choice's whole text)."""

    def __init__(self, text: TokenText):
        self.text = text
        self.offset = 0

    def write(self, entries: list[tuple[int, TokenLogprob | None]]) -> CompletionLogprobs:
        """entries: (token, its TokenLogprob or None for the prompt's first token)."""
        out = CompletionLogprobs()
        for token, e in entries:
            s = self.text(token)
            out.tokens.append(s)
            out.text_offset.append(self.offset)
            self.offset += len(s)
            if e is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(wire(e.logprob))
            top: dict[str, float] = {}
            for t, lp in e.top:  # most likely first: a text shared by two tokens keeps the likelier
                top.setdefault(self.text(t), wire(lp))
            top.setdefault(s, wire(e.logprob))  # the token itself, if not among the n best
            out.top_logprobs.append(top)
        return out


def vllm_prompt_logprobs(entries: list[TokenLogprob], text: TokenText) -> list[dict | None]:
    """vLLM's prompt_logprobs: None (the first prompt token) then one dict per prompt token."""
    out: list[dict | None] = [None]
    for e in entries:
        d = {str(t): {"logprob": wire(lp), "rank": i + 1, "decoded_token": text(t)}
             for i, (t, lp) in enumerate(e.top)}
        d.setdefault(str(e.token), {"logprob": wire(e.logprob), "rank": e.rank,
                                    "decoded_token": text(e.token)})
        out.append(d)
    return out
