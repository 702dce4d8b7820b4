"""The pool: the models loaded for serving, sharing one tokenizer, ordered by cost.

A pool entry is either a neural model (a `ModelRunner`: the native Llama-family runner or the
transformers fallback) or a model-free drafter (`"ngram"`: prompt lookup; `"suffix"`: suffix
decoding over the request and earlier requests, which learns from every finished request). The target is the most expensive
model unless named. Loading checks that every model shares the target's vocabulary.

A feature-level draft head (a folder with head.safetensors + head_config.json, written by
`specrouter distill --head`) is an entry like a model: it loads over the target's checkpoint
(its embedding, final norm and LM-head rows) as a `heads.level.HeadLevel`, drafts only (it is
the first level of its chains, like a model-free drafter) and sits before the model drafts in
the pool order. It needs the target on the native runner (its features).

Names: a model is named by its folder (or its GGUF file's stem); the roles "target" (the
target) and "draft" (the smallest neural draft) are accepted wherever a name is.
`preview_pool` finds the names, order and target without loading any weights (checkpoint
headers only), so chains can be checked before the models load.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from specrouter.config import DEFAULT_HEAD, DEFAULT_POOL, NGRAM, SUFFIX, PoolConfig, check_chain_names
from specrouter.drafters.base import ModelFreeDrafter
from specrouter.errors import ChainError, CheckpointError, DeviceError
from specrouter.models.runners.base import ModelRunner

NATIVE_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral"})
CUDA_GRAPHS_ENV = "SPECROUTER_CUDA_GRAPHS"  # "0": the native runner on CUDA runs eagerly (no graphs)


def _dtype(dtype: str | torch.dtype, device: torch.device | str = "cpu") -> torch.dtype:
    """A dtype name ("auto": see `kernels.auto_dtype`; bfloat16 on a GPU) as a torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto" and torch.device(device).type == "cuda":
        return torch.bfloat16
    if dtype == "auto":
        from specrouter.models.runners.kernels import auto_dtype

        return auto_dtype()
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float64": torch.float64, "fp64": torch.float64,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(table)}")
    return table[dtype]


def resolved_dtype(dtype: str | torch.dtype, device: torch.device | str = "cpu") -> str:
    """The name of the precision `dtype` stands for on `device` ("auto" resolved), e.g. "bfloat16"."""
    return str(_dtype(dtype, device)).removeprefix("torch.")


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
    device: torch.device | str = "cpu",
) -> ModelRunner:
    """Load one model: the native runner for Llama-family checkpoints (backend "auto" or
    "native"), the transformers fallback for anything else (or backend "hf"), on `device`
    (a torch device or a name, see models/device.py)."""
    from specrouter.models.device import resolve_device

    device = resolve_device(device)
    ckpt = resolve_checkpoint(path)
    dt = _dtype(dtype, device)
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
    kwargs = dict(name=name or default_model_name(ckpt), dtype=dt, num_slots=num_slots, max_len=max_len,
                  device=device)
    if use_native:
        from specrouter.models.runners.llama import load_llama_runner

        runner = load_llama_runner(ckpt, **kwargs)
        if device.type == "cuda" and os.environ.get(CUDA_GRAPHS_ENV, "1") != "0":
            from specrouter.models.runners.triton.graphs import GraphedRunner

            runner = GraphedRunner(runner)  # decode / verify forwards replayed as CUDA graphs
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
    heads: frozenset[str] = frozenset()  # draft heads among the runners (first level only)
    device: torch.device = torch.device("cpu")  # where every model runs and every tensor lives

    @classmethod
    def from_config(cls, config: PoolConfig, progress: bool = False,
                    paths: list[str | Path] | None = None) -> "Pool":
        """Load the pool a `PoolConfig` describes ("default": the embedded pool); `paths`:
        its entries already expanded (`preview_pool(config).paths`)."""
        paths = paths if paths is not None else pool_paths(config, progress=progress)
        return cls.load(paths, target=config.target,
                        names=list(config.names) if config.names else None,
                        backend=config.backend, dtype=config.dtype, ngram=config.ngram,
                        suffix=config.suffix, device=config.device,
                        trust_remote_code=config.trust_remote_code, progress=progress)

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
        device: torch.device | str = "cpu",
    ) -> "Pool":
        """Load `paths` (HF directories or .gguf files; the literals "ngram" and "suffix" add
        those model-free drafters, which `ngram` / `suffix` add anyway when True). `target` is a
        name or a path; default: the model with the most parameters. `device`: "cpu", "cuda",
        "cuda:N" or "auto" (models/device.py); a CUDA device torch cannot use here raises
        DeviceError before any weights load."""
        from specrouter.models.device import resolve_device
        from specrouter.models.tokenizer import (
            check_same_vocabulary,
            eos_token_ids,
            load_tokenizer,
        )

        device = resolve_device(device)
        models, model_free, target_name = _name_entries(paths, names, target, ngram, suffix)
        head_dirs = {n: p for n, p in models.items() if _is_head(p)}
        models = {n: p for n, p in models.items() if n not in head_dirs}
        if not models:
            raise CheckpointError("no models given: a draft head needs its target's path too")
        if head_dirs and device.type != "cpu":
            raise DeviceError(f"draft heads {sorted(head_dirs)} run on the CPU only in this version: "
                              f"leave them out of a pool on {device}")
        runners: dict[str, ModelRunner] = {}
        drafters: dict[str, ModelFreeDrafter] = {}
        tokenizers: dict[str, object] = {}
        items = list(models.items())
        if progress:
            from tqdm.auto import tqdm

            items = tqdm(items, desc="loading models", unit="model")
        for name, ckpt in items:
            runner = load_runner(ckpt, name=name, backend=backend, dtype=dtype,
                                 trust_remote_code=trust_remote_code, device=device)
            runners[name] = runner
            tokenizers[name] = load_tokenizer(runner.checkpoint_dir)
        check_same_vocabulary(tokenizers, {n: r.vocab_size for n, r in runners.items()})
        sizes = {n: r.num_params for n, r in runners.items()}
        if head_dirs:
            target_name = target_name if target_name is not None else max(sizes, key=lambda n: sizes[n])
            runners.update(_load_heads(head_dirs, runners[target_name], dtype))
        if NGRAM in model_free:
            from specrouter.drafters.ngram import NgramDrafter

            drafters[NGRAM] = NgramDrafter()
        if SUFFIX in model_free:
            from specrouter.drafters.suffix import SuffixDrafter

            drafters[SUFFIX] = SuffixDrafter()
        order, target_name = _cost_order(model_free, sizes, target_name, list(head_dirs))
        tok = tokenizers[target_name]
        return cls(
            runners=runners, drafters=drafters, order=order, target=target_name, tokenizer=tok,
            eos_ids=tuple(eos_token_ids(tok, runners[target_name].checkpoint_dir)),
            vocab_width=min(r.vocab_size for r in runners.values()), heads=frozenset(head_dirs),
            device=device,
        )

    def resolve_name(self, name: str) -> str:
        """A pool name for a name or a role ("target", "draft")."""
        return resolve_name(name, self.order, self.target, set(self.drafters), self.heads)

    def validate_chain(self, chain: list[str] | tuple[str, ...]) -> tuple[str, ...]:
        """A chain is pool names (or roles) in increasing cost, ending at the target; a
        model-free drafter or a draft head may only be first. Returns it with roles resolved
        to names."""
        return resolve_chain(chain, self.order, self.target, set(self.drafters), self.heads)

    def with_fresh_drafters(self) -> "Pool":
        """The same models with their own learning drafters (nothing learned yet): a view whose
        suffix statistics are apart from this pool's (benchmarks: each system learns only from
        the requests it served)."""
        import dataclasses

        drafters = {n: d.fresh() for n, d in self.drafters.items()}  # DrafterProtocol.fresh
        return dataclasses.replace(self, drafters=drafters)

    def target_only_view(self, runner: ModelRunner | None = None) -> "Pool":
        """A view of the pool with its target alone (`runner` in its place where given: e.g. the
        target loaded on another kernel path, benchmarks' fastest plain decoding): no drafts, no
        drafters, and so nothing shared with this pool's other runners (a prefix cache of its own
        where the runner is another)."""
        import dataclasses

        runner = self.runners[self.target] if runner is None else runner
        return dataclasses.replace(self, runners={self.target: runner}, drafters={}, order=[self.target],
                                   heads=frozenset())

    def without_drafters(self, names) -> "Pool":
        """A view of the pool without the drafters `names`, model-free ones or draft heads (e.g.
        SpecRouter without the suffix drafter, or without the head, side by side with it); the
        target and the model drafts verify, so they stay."""
        import dataclasses

        drop = set(names) & (set(self.drafters) | set(self.heads))
        return dataclasses.replace(self, drafters={n: d for n, d in self.drafters.items() if n not in drop},
                                   runners={n: r for n, r in self.runners.items() if n not in drop},
                                   heads=self.heads - drop, order=[n for n in self.order if n not in drop])

    @property
    def model_drafts(self) -> list[str]:
        """The neural drafts that can also verify (no target, no draft head), cheapest first."""
        return [n for n in self.order if n in self.runners and n != self.target and n not in self.heads]

    @property
    def default_chain(self) -> tuple[str, ...]:
        """Until the router picks chains: the cheapest neural draft then the target; with no
        neural draft, the n-gram drafter then the target; else plain decoding."""
        models = self.model_drafts or [n for n in self.order if n in self.heads]
        if models:
            return (models[0], self.target)
        if self.drafters:
            return (next(iter(self.drafters)), self.target)
        return (self.target,)


def _name_entries(paths: list[str | Path], names, target: str | None, ngram: bool, suffix: bool
                  ) -> tuple[dict[str, Path], list[str], str | None]:
    """A pool's entries checked and named, no weights read: (models: name -> checkpoint, in
    `paths` order; the model-free drafters `ngram` / `suffix` or `paths` turn on, in pool order;
    the target's name, None for the default). Raises CheckpointError with no model, ValueError
    for names not one per path, ChainError for two models of one name or an unknown target."""
    names = list(names) if names else [None] * len(paths)
    if all(str(p) in (NGRAM, SUFFIX) for p in paths):
        raise CheckpointError("no models given: pass at least the target's path")
    if len(names) != len(paths):
        raise ValueError("names and paths must have the same length")
    models: dict[str, Path] = {}
    target_name = None
    for path, name in zip(paths, names):
        if str(path) == NGRAM:
            ngram = True
            continue
        if str(path) == SUFFIX:
            suffix = True
            continue
        ckpt = Path(path).expanduser() if _is_head(path) else resolve_checkpoint(path)
        name = name or default_model_name(ckpt)
        if name in models or name in (NGRAM, SUFFIX):
            raise ChainError(f"two pool models are named {name!r}; pass distinct names")
        models[name] = ckpt
        if target is not None and (str(path) == str(target) or name == target):
            target_name = name
    if target not in (None, "target") and target_name is None:  # "target": the role
        raise ChainError(f"target {target!r} is not one of the pool's models {list(models)}")
    return models, [NGRAM] * ngram + [SUFFIX] * suffix, target_name


def _is_head(path) -> bool:
    from specrouter.models.heads.level import is_head_dir

    return is_head_dir(path)


def _load_heads(head_dirs: dict[str, Path], target: ModelRunner, dtype) -> dict[str, ModelRunner]:
    """The draft heads over the loaded target (its checkpoint, at the pool's dtype)."""
    from specrouter.models.heads.level import load_head_level

    if not hasattr(target, "forward_with_features"):
        raise CheckpointError(f"a draft head needs its target {target.name!r} on the native runner "
                              "(backend auto or native, a Llama-family checkpoint)")
    return {n: load_head_level(p, target.checkpoint_dir, name=n, dtype=_dtype(dtype))
            for n, p in head_dirs.items()}


def _cost_order(model_free: list[str], costs: dict[str, int], target: str | None,
                heads: list[str] = ()) -> tuple[list[str], str]:
    """(order, target): the model-free drafters, the draft heads, the models by increasing
    cost, the target last (None: the costliest model that is not a head)."""
    heads = list(heads)
    target = target if target is not None else max((n for n in costs if n not in heads),
                                                   key=lambda n: costs[n])
    drafts = sorted((n for n in costs if n != target and n not in heads), key=lambda n: costs[n])
    return model_free + heads + drafts + [target], target


def resolve_name(name: str, order: list[str], target: str, model_free: set[str],
                 heads: frozenset[str] = frozenset()) -> str:
    """A pool name for `name`: a name of `order` as is, "target" the target, "draft" the
    smallest neural draft (a model, not a head)."""
    if name in order:
        return name
    if name == "target":
        return target
    if name == "draft":
        drafts = [n for n in order if n != target and n not in model_free and n not in heads]
        if not drafts:
            raise ChainError(f"the pool has no neural draft for the role 'draft' (pool: {order})")
        return drafts[0]
    raise ChainError(f"unknown model {name!r}: the pool has {order} (and the roles 'target', "
                     "'draft')")


def resolve_chain(chain, order: list[str], target: str, model_free: set[str],
                  heads: frozenset[str] = frozenset()) -> tuple[str, ...]:
    """`chain` with roles resolved, checked against the pool: known names, ending at the target,
    no model twice, a model-free drafter or a draft head only first, at most 4 levels."""
    chain = tuple(chain)
    if not chain:
        raise ChainError("a chain needs at least the target")
    unknown = [m for m in chain if m not in order and m not in ("target", "draft")]
    if unknown:
        raise ChainError(f"unknown model(s) {unknown} in chain; the pool has {order} (and the "
                         "roles 'target', 'draft')")
    chain = tuple(resolve_name(m, order, target, model_free, heads) for m in chain)
    if chain[-1] != target:
        raise ChainError(f"a chain must end at the target {target!r}, got {chain}")
    check_chain_names(chain)  # levels, repeats (a role may name a model given by name too)
    if any(m in model_free for m in chain[1:]):
        raise ChainError(f"a model-free drafter can only be the first level: {chain}")
    if any(m in heads for m in chain[1:]):
        raise ChainError(f"a draft head can only be the first level (it drafts, never verifies): {chain}")
    return chain


def pool_paths(config: PoolConfig, progress: bool = False) -> list[str | Path]:
    """The entries of `config.models` with "default" expanded to the embedded pool (its n-gram
    drafter left out when `config.ngram` is off) and "default-head" to the shipped draft head."""
    paths: list[str | Path] = []
    for m in config.models:
        if m == DEFAULT_POOL:
            from specrouter.models.default_pool import default_pool_paths

            paths += [p for p in default_pool_paths(progress=progress)
                      if (config.ngram or str(p) != NGRAM) and (config.suffix or str(p) != SUFFIX)]
        elif m == DEFAULT_HEAD:
            from specrouter.models.default_pool import shipped_head

            paths.append(shipped_head())
        else:
            paths.append(m)
    return paths


def checkpoint_size(ckpt: Path) -> int:
    """Parameters of a checkpoint from its safetensors headers (no weights read); for other
    formats, the weight files' bytes (only the order of pool models depends on it)."""
    from safetensors import safe_open

    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        return sum(f.stat().st_size for f in ckpt.iterdir() if f.suffix in (".bin", ".pt", ".pth"))
    n = 0
    for f in files:
        try:
            with safe_open(str(f), "pt") as st:
                n += sum(math.prod(st.get_slice(key).get_shape()) for key in st.keys())
        except Exception as e:  # noqa: BLE001 - any unreadable header is a bad checkpoint
            raise CheckpointError(f"{f} is not a readable safetensors file: {e}") from e
    return n


@dataclass(frozen=True)
class PoolPreview:
    """The names, order and target a pool will have, found without loading weights."""

    order: list[str]  # every name, cheapest first, the target last
    target: str
    drafters: frozenset[str]  # model-free drafters
    paths: tuple[str | Path, ...]  # the config's entries, "default" expanded
    heads: frozenset[str] = frozenset()  # draft heads (first level only)

    def validate_chain(self, chain) -> tuple[str, ...]:
        return resolve_chain(chain, self.order, self.target, set(self.drafters), self.heads)


def preview_pool(config: PoolConfig, progress: bool = False) -> PoolPreview:
    """What `Pool.from_config(config)` will load, from paths, folder names and checkpoint
    headers only (a .gguf is converted here, once, as loading would). Raises CheckpointError
    for a missing path, ChainError for two models of one name or an unknown target."""
    paths = pool_paths(config, progress=progress)
    models, model_free, target_name = _name_entries(paths, config.names, config.target,
                                                    config.ngram, config.suffix)
    heads = [n for n, c in models.items() if _is_head(c)]
    order, target_name = _cost_order(model_free, {n: checkpoint_size(c) for n, c in models.items()},
                                     target_name, heads)
    return PoolPreview(order=order, target=target_name,
                       drafters=frozenset(model_free), paths=tuple(paths), heads=frozenset(heads))
