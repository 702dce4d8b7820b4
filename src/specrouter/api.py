"""The Python API: `SpecRouter.from_pretrained("default").generate(...)`, `.stream(...)`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from specrouter.config import (
    DEFAULT_POOL,
    EngineConfig,
    PoolConfig,
    RouterConfig,
    SamplingParams,
    SpecRouterConfig,
    kv_cache_bytes,
)
from specrouter.decoding.grammar import GrammarSpec
from specrouter.engine.contention import governed
from specrouter.engine.engine import Engine
from specrouter.records.stats import RequestStats
from specrouter.models.device import resolve_device
from specrouter.models.pool import Pool, preview_pool
from specrouter.state.sequence import Sequence


@dataclass
class GenerationResult:
    """One finished request."""

    text: str  # decoded generated text (prompt excluded, special tokens skipped)
    token_ids: list[int]  # generated token ids (prompt excluded)
    prompt_tokens: int  # prompt length in tokens
    finish_reason: str  # "stop" (stop/EOS token, complete grammar) | "length" (max_new_tokens) | "grammar" (dead end) | "abort" | "error" (a model failed on this row: engine.py)
    stats: RequestStats  # chain(s) used, acceptance per level, tokens/s


@dataclass
class StreamChunk:
    """What one cycle committed for a streamed request (`SpecRouter.stream`)."""

    token_ids: list[int]  # target tokens committed by this cycle (one or more)
    text: str  # the text they add (a character split across cycles comes with the later one)
    elapsed: float  # seconds since the request was added (the first chunk's: prefill + one cycle)
    result: GenerationResult | None = None  # set on the last chunk: the whole request


class SpecRouter:
    """A pool of models sharing one tokenizer, served by multi-level speculative decoding.

    >>> sr = SpecRouter.from_pretrained("default")  # the embedded pool; or a list of paths
    >>> sr.generate("def fib(n):", max_new_tokens=32)[0].text
    """

    def __init__(self, pool: Pool, router=None, config: SpecRouterConfig | None = None):
        self.pool = pool
        self.router = router  # None: static chains only (the pool's default chain)
        self.config = config or SpecRouterConfig()
        self.engine = Engine(pool, router=router, prefix_cache=self.config.engine.prefix_cache,
                             kv_cache_bytes=kv_cache_bytes(self.config.engine.kv_cache_gb))
        from specrouter.router.policy import Router

        # token trees: priced by the package Router's cost profile (a router of the protocol alone
        # keeps chains), and only on a CPU pool (the GPU path's Triton attention has no tree mask:
        # its runner refuses a tree batch)
        if isinstance(router, Router) and self.config.engine.trees != "off" and pool.device.type == "cpu":
            from specrouter.engine.tree_policy import TreePolicy

            profile, target = router.profile, pool.target
            drafters = frozenset(m for m in pool.runners if m != target and m not in pool.heads)
            free = frozenset(n for n, d in pool.drafters.items() if d.proposes_trees)
            self.engine.tree_policy = TreePolicy.from_profile(profile, target, drafters, free=free,
                                                              sampled=self.config.engine.trees == "on")

    @classmethod
    def from_config(cls, config: SpecRouterConfig, *, progress: bool = False) -> "SpecRouter":
        """Build from a `SpecRouterConfig` (what every CLI command does). Paths, names, the
        target and a pinned chain are checked before any weights load (checkpoint headers)."""
        if config.pool.threads:
            torch.set_num_threads(config.pool.threads)
        resolve_device(config.pool.device)  # DeviceError before anything loads
        preview = preview_pool(config.pool, progress=progress)
        if config.engine.chain is not None:
            preview.validate_chain(config.engine.chain)
        pool = Pool.from_config(config.pool, progress=progress, paths=list(preview.paths))
        router = None
        if config.engine.routed and len(pool.order) > 1:
            from specrouter.router.setup import build_router

            router = build_router(pool, profile_path=config.pool.profile_path, progress=progress,
                                  config=config.router)
        return cls(pool, router, config)

    @classmethod
    def from_pretrained(
        cls,
        paths: str | Path | list[str | Path] = DEFAULT_POOL,
        target: str | None = None,
        *,
        names: list[str] | None = None,
        backend: str = "auto",
        dtype: str | torch.dtype = "auto",
        ngram: bool = True,
        suffix: bool = True,
        trust_remote_code: bool = False,
        progress: bool = False,
        adaptive: bool = True,
        profile_path: str | Path | None = None,
        threads: int | None = None,
        router_config: RouterConfig | None = None,
        device: str = "auto",
        trees: bool | str = "greedy",
    ) -> "SpecRouter":
        """Load a pool: "default" (the embedded pool: n-gram, the shipped draft,
        SmolLM2-135M-Instruct), or HF checkpoint directories / .gguf files, plus the
        model-free drafters "ngram" (prompt lookup) and "suffix" (suffix decoding, learns
        across requests), both added by default (`ngram=False` / `suffix=False` leave them
        out). `target` (name or path) defaults to the largest
        model. Raises CheckpointError / VocabularyMismatchError with a clear message.

        With `adaptive` (default) the router picks each request's chain and draft length every
        cycle; it needs this machine's cost profile of the pool's models, measured by a short
        sweep the first time (persisted under the cache dir, or `profile_path`).

        `device`: "auto" (the first CUDA GPU when torch sees one, else the CPU), "cpu", "cuda"
        or "cuda:N"; a CUDA device torch cannot use here raises DeviceError before any weights
        load (docs/gpu.md).

        `trees`: which rows the router may give a token tree instead of a chain where it pays
        (`EngineConfig.trees`: "greedy", the default, "on" for sampled rows too, "off";
        docs/trees.md)."""
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")
        models = [paths] if isinstance(paths, (str, Path)) else list(paths)
        pool = PoolConfig(models=tuple(str(p) for p in models), target=target,
                          names=tuple(names) if names else None, backend=backend, dtype=dtype,
                          ngram=ngram, suffix=suffix, threads=threads, device=str(device),
                          trust_remote_code=trust_remote_code,
                          profile_path=str(profile_path) if profile_path is not None else None)
        config = SpecRouterConfig(pool=pool, engine=EngineConfig(adaptive=adaptive, trees=trees),
                                  router=router_config or RouterConfig())
        return cls.from_config(config, progress=progress)

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

    def _request(self, *, max_new_tokens, temperature, top_k, top_p, stop_token_ids, seed,
                 ignore_eos, chain, k, controls=None, json_schema=None, grammar=None
                 ) -> tuple[SamplingParams, torch.Generator, tuple | None, int]:
        params = SamplingParams(
            temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=max_new_tokens,
            stop_token_ids=tuple(stop_token_ids), ignore_eos=ignore_eos,
            grammar=grammar_spec(json_schema, grammar), **(controls or {}),
        )
        generator = torch.Generator()
        # row i's sampling seed: draw i of this stream (a batch's rows differ; a call repeats)
        generator.manual_seed(seed if seed is not None else torch.seed())
        if chain is None:
            chain = self.config.engine.chain
        if k is None:
            k = self.config.engine.k
        return params, generator, tuple(chain) if chain is not None else None, k

    def _result(self, seq: Sequence) -> GenerationResult:
        return GenerationResult(
            text=self.tokenizer.decode(seq.output_ids, skip_special_tokens=True),
            token_ids=seq.output_ids, prompt_tokens=seq.prompt_len,
            finish_reason=seq.finish_reason or "abort", stats=seq.stats,
        )

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
        json_schema: dict | str | type | None = None,
        grammar: str | GrammarSpec | None = None,
        **controls,
    ) -> list[GenerationResult]:
        """Generate for one prompt or a batch (text, token ids, or chat message lists).

        `chain` pins the levels (names from `self.pool.order`, or the roles "ngram", "draft",
        "target"; ending at the target) and `k` the draft length (default 4); without `chain`,
        the router chooses both per request every cycle (or, for a pool loaded with
        adaptive=False, the pool's default chain). Greedy when temperature == 0: the output
        equals the target's own greedy decoding token for token; otherwise it follows the
        target's (temperature / top-k / top-p processed) distribution. `controls`: the other
        sampling controls of `SamplingParams` (min_p, presence_penalty, frequency_penalty,
        repetition_penalty, logit_bias, min_tokens, allowed_token_ids), applied at every level
        of the chain: the output is plain decoding's with the same controls.
        `json_schema` (a dict, its JSON text, or a pydantic model class) or `grammar` (a Lark
        grammar's text, or a `GrammarSpec`) constrains the output (docs/structured-output.md):
        greedy, it equals plain constrained decoding of the target token for token.
        """
        single = isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], (int, dict))
        )
        batch = [prompts] if single else list(prompts)
        ids = [self.encode(p, chat=chat) for p in batch]
        params, generator, chain, k = self._request(
            max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            stop_token_ids=stop_token_ids, seed=seed, ignore_eos=ignore_eos, chain=chain, k=k,
            controls=controls, json_schema=json_schema, grammar=grammar)
        seqs = self.engine.generate_ids(ids, [params] * len(ids), chain=chain, k=k,
                                        generator=generator)
        return [self._result(s) for s in seqs]

    def stream(
        self,
        prompt,
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
        json_schema: dict | str | type | None = None,
        grammar: str | GrammarSpec | None = None,
    ) -> Iterator[StreamChunk]:
        """Generate for one prompt, yielding each cycle's committed tokens as they come (the
        same tokens as `generate`; arguments as there). The last chunk carries `result`.
        Closing the iterator early (break, Ctrl-C) aborts the request."""
        from specrouter.models.tokenizer import IncrementalDecoder

        ids = self.encode(prompt, chat=chat)
        params, generator, chain, k = self._request(
            max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            stop_token_ids=stop_token_ids, seed=seed, ignore_eos=ignore_eos, chain=chain, k=k,
            json_schema=json_schema, grammar=grammar)
        engine = self.engine
        need = engine.check_request(ids, params, chain, k)[1]
        if not engine.running:
            engine.reserve(1, need)
        t0 = time.perf_counter()
        seq = engine.add_request(ids, params, chain=chain, k=k, generator=generator)
        decoder = IncrementalDecoder(self.tokenizer)
        try:
            while not seq.done:
                with governed(enabled=engine.thread_invariant) as timed:  # this thread's torch threads (engine/contention.py)
                    outs = timed(engine.step)
                for out in outs:
                    if out.seq is not seq or not (out.new_token_ids or seq.done):
                        continue
                    text = decoder.add(out.new_token_ids)
                    result = None
                    if seq.done:
                        text += decoder.finish()
                        result = self._result(seq)
                    yield StreamChunk(list(out.new_token_ids), text, time.perf_counter() - t0,
                                      result)
        finally:
            if not seq.done:
                engine.abort(seq.seq_id)


def grammar_spec(json_schema=None, grammar=None) -> GrammarSpec | None:
    """The request's `GrammarSpec` from `generate`'s `json_schema` (dict, JSON text or a pydantic
    model class) or `grammar` (Lark text or a GrammarSpec); at most one of them."""
    from specrouter.decoding.grammar import GrammarError

    if json_schema is not None and grammar is not None:
        raise GrammarError("give json_schema or grammar, not both")
    if json_schema is not None:
        if isinstance(json_schema, type) and hasattr(json_schema, "model_json_schema"):
            json_schema = json_schema.model_json_schema()  # a pydantic model
        return GrammarSpec.json_schema(json_schema)
    if grammar is None or isinstance(grammar, GrammarSpec):
        return grammar
    return GrammarSpec("lark", grammar)
