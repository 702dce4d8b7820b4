"""The Python API: `SpecRouter.from_pretrained([...]).generate(...)`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specrouter.config import SamplingParams
from specrouter.engine.engine import Engine
from specrouter.engine.stats import RequestStats
from specrouter.models.pool import Pool


@dataclass
class GenerationResult:
    """One finished request."""

    text: str  # decoded generated text (prompt excluded, special tokens skipped)
    token_ids: list[int]  # generated token ids (prompt excluded)
    prompt_tokens: int  # prompt length in tokens
    finish_reason: str  # "stop" (stop/EOS token) | "length" (max_new_tokens) | "abort"
    stats: RequestStats  # chain(s) used, acceptance per level, tokens/s


class SpecRouter:
    """A pool of models sharing one tokenizer, served by multi-level speculative decoding.

    >>> sr = SpecRouter.from_pretrained(["ngram", "path/to/draft", "path/to/target"])
    >>> sr.generate("def fib(n):", max_new_tokens=32)[0].text
    """

    def __init__(self, pool: Pool, router=None):
        self.pool = pool
        self.router = router  # None: static chains only (the pool's default chain)
        self.engine = Engine(pool, router=router)

    @classmethod
    def from_pretrained(
        cls,
        paths: list[str | Path],
        target: str | None = None,
        *,
        names: list[str] | None = None,
        backend: str = "auto",
        dtype: str | torch.dtype = "float32",
        ngram: bool = True,
        suffix: bool = True,
        trust_remote_code: bool = False,
        progress: bool = False,
        adaptive: bool = True,
        profile_path: str | Path | None = None,
    ) -> "SpecRouter":
        """Load a pool: HF checkpoint directories or .gguf files, plus the model-free drafters
        "ngram" (prompt lookup) and "suffix" (suffix decoding, learns across requests), both
        added by default (`ngram=False` / `suffix=False` leave them out). `target` (name or path) defaults to the largest
        model. Raises CheckpointError / VocabularyMismatchError with a clear message.

        With `adaptive` (default) the router picks each request's chain and draft length every
        cycle; it needs this machine's cost profile of the pool's models, measured by a short
        sweep the first time (persisted under the cache dir, or `profile_path`)."""
        pool = Pool.load(list(paths), target=target, names=names, backend=backend, dtype=dtype,
                         ngram=ngram, suffix=suffix, trust_remote_code=trust_remote_code,
                         progress=progress)
        router = None
        if adaptive and len(pool.order) > 1:
            from specrouter.router.setup import build_router

            router = build_router(pool, profile_path=profile_path, progress=progress)
        return cls(pool, router)

    @property
    def tokenizer(self):
        return self.pool.tokenizer

    def encode(self, prompt: str | list[int] | list[dict], chat: bool = False) -> list[int]:
        """Token ids of a prompt: text, ids as is, or chat messages through the target's
        chat template (`chat=True` or a list of {"role", "content"} dicts)."""
        from specrouter.models.tokenizer import apply_chat_template

        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            return apply_chat_template(self.tokenizer, prompt)
        if isinstance(prompt, list):
            return list(prompt)
        if chat:
            return apply_chat_template(self.tokenizer, [{"role": "user", "content": prompt}])
        return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]

    def generate(
        self,
        prompts,
        *,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        stop_token_ids: tuple[int, ...] = (),
        seed: int | None = None,
        ignore_eos: bool = False,
        chain: list[str] | tuple[str, ...] | None = None,
        k: int | None = None,
        chat: bool = False,
    ) -> list[GenerationResult]:
        """Generate for one prompt or a batch (text, token ids, or chat message lists).

        `chain` pins the levels (names from `self.pool.order`, ending at the target) and `k`
        the draft length (default 4); without `chain`, the router chooses both per request every
        cycle (or, for a pool loaded with adaptive=False, the pool's default chain). Greedy when
        temperature == 0: the output equals the target's own greedy decoding token for token;
        otherwise it follows the target's (temperature / top-k / top-p processed) distribution.
        """
        single = isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], (int, dict))
        )
        batch = [prompts] if single else list(prompts)
        ids = [self.encode(p, chat=chat) for p in batch]
        params = SamplingParams(
            temperature=temperature,
            top_k=top_k, top_p=top_p, max_new_tokens=max_new_tokens,
            stop_token_ids=tuple(stop_token_ids), ignore_eos=ignore_eos,
        )
        generator = torch.Generator()
        generator.manual_seed(seed if seed is not None else torch.seed())  # row i's sampling seed: draw i of this stream (a batch's rows differ; a call repeats)
        if chain is not None:
            chain = tuple(chain)
        seqs = self.engine.generate_ids(ids, [params] * len(ids), chain=chain,
                                        k=4 if k is None else k, generator=generator)
        return [
            GenerationResult(
                text=self.tokenizer.decode(s.output_ids, skip_special_tokens=True),
                token_ids=s.output_ids, prompt_tokens=s.prompt_len,
                finish_reason=s.finish_reason or "abort", stats=s.stats,
            )
            for s in seqs
        ]
