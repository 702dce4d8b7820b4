"""The pool: the models loaded for serving, sharing one tokenizer, ordered by cost.

A pool entry is either a neural model (a `ModelRunner`: the native Llama-family runner or the
transformers fallback) or a model-free drafter (`"ngram"`: prompt lookup; `"suffix"`: suffix
decoding over the request and earlier requests, which learns from every finished request). The target is the most expensive
model unless named. Loading checks that every model shares the target's vocabulary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from specrouter.decoding.drafters.base import ModelFreeDrafter
from specrouter.errors import ChainError, CheckpointError
from specrouter.models.runners.base import ModelRunner

NATIVE_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral"})
NGRAM = "ngram"
SUFFIX = "suffix"


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float64": torch.float64, "fp64": torch.float64,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(table)}")
    return table[dtype]


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory for `path`: an HF directory as is, a .gguf file converted once
    into the cache (see gguf_convert)."""
    p = Path(path).expanduser()
    if p.suffix == ".gguf":
        from specrouter.models.gguf_convert import convert_gguf

        return convert_gguf(p)
    if not p.exists():
        raise CheckpointError(f"model path {str(p)!r} does not exist")
    if not p.is_dir():
        raise CheckpointError(f"model path {str(p)!r} is neither a checkpoint directory nor a .gguf file")
    if not (p / "config.json").is_file():
        raise CheckpointError(f"{str(p)!r} has no config.json: not a Hugging Face checkpoint directory")
    return p


def default_model_name(ckpt: Path) -> str:
    """A model's pool name: its folder name, or for a converted GGUF the file's stem without
    the quantization suffix (SmolLM2-135M-Instruct.Q4_1.gguf -> SmolLM2-135M-Instruct)."""
    marker = ckpt / "specrouter_gguf.json"
    if marker.is_file():
        try:
            gguf_name = json.loads(marker.read_text())["source"]["gguf_name"]
            return gguf_name.removesuffix(".gguf").split(".")[0]
        except (OSError, ValueError, KeyError):
            pass
    return ckpt.name


def load_runner(
    path: str | Path,
    *,
    name: str | None = None,
    backend: str = "auto",
    dtype: str | torch.dtype = torch.float32,
    num_slots: int = 1,
    max_len: int | None = None,
    trust_remote_code: bool = False,
) -> ModelRunner:
    """Load one model: the native runner for Llama-family checkpoints (backend "auto" or
    "native"), the transformers fallback for anything else (or backend "hf")."""
    ckpt = resolve_checkpoint(path)
    dt = _dtype(dtype)
    try:
        model_type = json.loads((ckpt / "config.json").read_text()).get("model_type")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{ckpt}/config.json is not valid JSON: {e}") from e
    if backend not in ("auto", "native", "hf"):
        raise ValueError(f"backend must be 'auto', 'native' or 'hf', got {backend!r}")
    use_native = backend == "native" or (backend == "auto" and model_type in NATIVE_MODEL_TYPES)
    if backend == "native" and model_type not in NATIVE_MODEL_TYPES:
        raise CheckpointError(
            f"{ckpt}: model_type {model_type!r} is not supported by the native runner "
            f"(supported: {sorted(NATIVE_MODEL_TYPES)}); use backend='hf'"
        )
    kwargs = dict(name=name or default_model_name(ckpt), dtype=dt, num_slots=num_slots, max_len=max_len)
    if use_native:
        from specrouter.models.runners.llama import load_llama_runner

        runner = load_llama_runner(ckpt, **kwargs)
    else:
        from specrouter.models.runners.hf import load_hf_runner

        runner = load_hf_runner(ckpt, trust_remote_code=trust_remote_code, **kwargs)
    runner.checkpoint_dir = ckpt
    return runner


@dataclass
class Pool:
    """Loaded models by name, cheapest first, the target last."""

    runners: dict[str, ModelRunner]  # neural models
    drafters: dict[str, ModelFreeDrafter]  # model-free drafters
    order: list[str]  # every name, by increasing cost; order[-1] == target
    target: str  # the model whose output is reproduced exactly
    tokenizer: object  # the target's tokenizer (transformers)
    eos_ids: tuple[int, ...]  # token ids that end generation
    vocab_width: int  # common logits width of every model

    @classmethod
    def load(
        cls,
        paths: list[str | Path],
        *,
        target: str | None = None,
        names: list[str] | None = None,
        backend: str = "auto",
        dtype: str | torch.dtype = torch.float32,
        ngram: bool = True,
        suffix: bool = True,
        trust_remote_code: bool = False,
        progress: bool = False,
    ) -> "Pool":
        """Load `paths` (HF directories or .gguf files; the literals "ngram" and "suffix" add
        those model-free drafters, which `ngram` / `suffix` add anyway when True). `target` is a
        name or a path; default: the model with the most parameters."""
        from specrouter.models.tokenizer import (
            check_same_vocabulary,
            eos_token_ids,
            load_tokenizer,
        )

        if not paths:
            raise CheckpointError("no models given: pass at least the target's path")
        names = list(names) if names else [None] * len(paths)
        if len(names) != len(paths):
            raise ValueError("names and paths must have the same length")
        runners: dict[str, ModelRunner] = {}
        drafters: dict[str, ModelFreeDrafter] = {}
        tokenizers: dict[str, object] = {}
        target_name = None
        items = list(zip(paths, names))
        if progress:
            from tqdm.auto import tqdm

            items = tqdm(items, desc="loading models", unit="model")
        for path, name in items:
            if str(path) == NGRAM:
                ngram = True
                continue
            if str(path) == SUFFIX:
                suffix = True
                continue
            runner = load_runner(path, name=name, backend=backend, dtype=dtype,
                                 trust_remote_code=trust_remote_code)
            if runner.name in runners or runner.name in (NGRAM, SUFFIX):
                raise ChainError(f"two pool models are named {runner.name!r}; pass distinct names")
            runners[runner.name] = runner
            tokenizers[runner.name] = load_tokenizer(runner.checkpoint_dir)
            if target is not None and (str(path) == str(target) or runner.name == target):
                target_name = runner.name
        if target is not None and target_name is None:
            raise ChainError(f"target {target!r} is not one of the pool's models {list(runners)}")
        if target_name is None:
            target_name = max(runners, key=lambda n: runners[n].num_params)
        check_same_vocabulary(tokenizers, {n: r.vocab_size for n, r in runners.items()})
        if ngram:
            from specrouter.decoding.drafters.ngram import NgramDrafter

            drafters[NGRAM] = NgramDrafter()
        if suffix:
            from specrouter.decoding.drafters.suffix import SuffixDrafter

            drafters[SUFFIX] = SuffixDrafter()
        order = list(drafters) + sorted(
            (n for n in runners if n != target_name), key=lambda n: runners[n].num_params
        ) + [target_name]
        tok = tokenizers[target_name]
        return cls(
            runners=runners, drafters=drafters, order=order, target=target_name, tokenizer=tok,
            eos_ids=tuple(eos_token_ids(tok, runners[target_name].checkpoint_dir)),
            vocab_width=min(r.vocab_size for r in runners.values()),
        )

    def validate_chain(self, chain: list[str] | tuple[str, ...]) -> tuple[str, ...]:
        """A chain is pool names in increasing cost, ending at the target; a model-free drafter
        may only be first."""
        chain = tuple(chain)
        if not chain:
            raise ChainError("a chain needs at least the target")
        unknown = [m for m in chain if m not in self.runners and m not in self.drafters]
        if unknown:
            raise ChainError(f"unknown model(s) {unknown} in chain; the pool has {self.order}")
        if chain[-1] != self.target:
            raise ChainError(f"a chain must end at the target {self.target!r}, got {chain}")
        if len(set(chain)) != len(chain):
            raise ChainError(f"a model appears twice in chain {chain}")
        if any(m in self.drafters for m in chain[1:]):
            raise ChainError(f"a model-free drafter can only be the first level: {chain}")
        if len(chain) > 4:
            raise ChainError(f"chains have at most 4 levels, got {len(chain)}")
        return chain

    def with_fresh_drafters(self) -> "Pool":
        """The same models with their own learning drafters (nothing learned yet): a view whose
        suffix statistics are apart from this pool's (benchmarks: each system learns only from
        the requests it served)."""
        import dataclasses

        drafters = {n: d.fresh() if hasattr(d, "fresh") else d for n, d in self.drafters.items()}
        return dataclasses.replace(self, drafters=drafters)

    def without_drafters(self, names) -> "Pool":
        """A view of the pool without the model-free drafters `names` (e.g. SpecRouter without
        the suffix drafter, side by side with it)."""
        import dataclasses

        drop = set(names)
        return dataclasses.replace(self, drafters={n: d for n, d in self.drafters.items() if n not in drop},
                                   order=[n for n in self.order if n not in drop])

    @property
    def default_chain(self) -> tuple[str, ...]:
        """Until the router picks chains: the cheapest neural draft then the target; with no
        neural draft, the n-gram drafter then the target; else plain decoding."""
        models = [n for n in self.order if n in self.runners and n != self.target]
        if models:
            return (models[0], self.target)
        if self.drafters:
            return (next(iter(self.drafters)), self.target)
        return (self.target,)
