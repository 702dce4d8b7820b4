"""The shipped draft assets and their assembly into complete checkpoint directories."""

import json
import math
import os
import shutil
import struct
from pathlib import Path

import torch
from fixtures import make_tiny_tokenizer

from specrouter.models.default_pool import assemble_draft, shipped_drafts


def test_shipped_draft_is_small_and_documented():
    drafts = shipped_drafts()
    assert drafts, "the package ships at least one distilled draft"
    for d in drafts:
        size = sum(f.stat().st_size for f in d.iterdir())
        assert size <= 25 * 2**20
        recipe = json.loads((d / "recipe.json").read_text())
        report = json.loads((d / "report.json").read_text())
        assert recipe["steps_done"] > 0
        # stage 3 (prompt set v2, corpus seed 3) fine-tuned from stage 2; stages 1-2's recipes and
        # reports ship beside it
        assert recipe["args"]["prompts"] == "v2" and recipe["seed"] == 3
        assert recipe["init_from_recipe"] == json.loads((d / "recipe-stage2.json").read_text())
        for stage in ("stage1", "stage2"):
            assert (d / f"recipe-{stage}.json").is_file() and (d / f"report-{stage}.json").is_file()
        # the shipped weights are the documented model: 11.2M parameters, hidden 192, 4 layers
        config = json.loads((d / "config.json").read_text())
        assert (config["hidden_size"], config["num_hidden_layers"], config["tie_word_embeddings"]) == (192, 4, True)
        assert _safetensors_params(d / "model.safetensors") == report["params"]
        for doc in (README, DRAFTS):  # the README names it, docs/drafts.md gives its figures
            assert f"{report['params'] / 1e6:.1f}M parameters" in doc
            assert f"{report['weights_mb']:.1f} MB bf16" in doc
        # and the held-out agreement figures of docs/drafts.md are this report's
        documented = {
            "agreement_generated": f"**{report['agreement_generated']:.3f} on text the target wrote",
            "agreement": f"{report['agreement']:.3f} with the stdlib-source",
            "greedy_agreement": f"{report['greedy_agreement']:.3f} end to end",
        }
        for key, phrase in documented.items():
            assert phrase in DRAFTS, (key, phrase)
        for kind in ("chat", "code", "prose"):
            assert f"{kind} {report['agreement_by_kind'][kind]:.2f}" in DRAFTS, kind
        for kind in ("code", "prose", "chat", "extraction"):
            assert f"{kind} {report['greedy_agreement_by_kind'][kind]:.2f}" in DRAFTS, kind
        # the held-out end-to-end set (distill/evaluate.py HELDOUT_PROMPTS, session 28) it shipped on
        held = report["end_to_end_held_out"]
        assert f"held-out end-to-end set {held['agreement']:.3f}" in DRAFTS
        assert 0.45 < report["agreement_generated"] < 0.65  # what the draft is shipped for


ROOT = Path(__file__).resolve().parents[1]
README = " ".join((ROOT / "README.md").read_text().split())  # one line
DRAFTS = " ".join((ROOT / "docs/drafts.md").read_text().split())  # the draft's and head's figures


def _safetensors_params(path: Path) -> int:
    """Parameter count from a safetensors header (no tensor is loaded)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")


def test_assemble_draft_adds_the_target_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECROUTER_CACHE", str(tmp_path / "cache"))
    target = tmp_path / "target"
    make_tiny_tokenizer(target)
    out = assemble_draft(shipped_drafts()[0], target)
    assert (out / "tokenizer.json").is_file() and (out / "model.safetensors").is_file()
    assert assemble_draft(shipped_drafts()[0], target) == out  # cached: same dir, no copy
    from specrouter.models.pool import load_runner

    r = load_runner(out, dtype=torch.float32)
    assert r.vocab_size == 49152 and r.num_params > 1_000_000


def _asset_copy(root: Path, mtime: float) -> Path:
    """A shipped draft's files in another folder (another checkout, another install) with other
    modification times."""
    src = shipped_drafts()[0]
    dst = root / src.name
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file():
            shutil.copyfile(f, dst / f.name)
            os.utime(dst / f.name, (mtime, mtime))
    return dst


def test_assemble_draft_is_keyed_by_content_not_modification_times(tmp_path, monkeypatch):
    """Two checkouts of the same draft share one cache entry: the second neither re-copies it
    nor removes the folder a process of the first may be loading (the stamp was keyed by mtimes:
    each checkout's process rebuilt it over the other's)."""
    monkeypatch.setenv("SPECROUTER_CACHE", str(tmp_path / "cache"))
    target = tmp_path / "target"
    make_tiny_tokenizer(target)
    out = assemble_draft(_asset_copy(tmp_path / "a", 1_000_000_000), target)
    stamp = (out / ".complete").stat()
    assert assemble_draft(_asset_copy(tmp_path / "b", 1_500_000_000), target) == out
    again = (out / ".complete").stat()
    assert (again.st_ino, again.st_mtime_ns) == (stamp.st_ino, stamp.st_mtime_ns), "re-assembled"
    assert out.name == shipped_drafts()[0].name  # the pool names the draft by its folder
    changed = _asset_copy(tmp_path / "c", 1_000_000_000)
    (changed / "report.json").write_text("{}")
    assert assemble_draft(changed, target) != out and (out / ".complete").is_file()  # new content: its own entry


def test_processes_assembling_a_draft_at_once_all_get_it_complete(tmp_path, monkeypatch):
    """Processes started together (a server and a bench, two tests) assemble the same entry at
    once: each gets a complete folder, none fails on another's half-copied files."""
    import threading

    monkeypatch.setenv("SPECROUTER_CACHE", str(tmp_path / "cache"))
    target = tmp_path / "target"
    make_tiny_tokenizer(target)
    asset = shipped_drafts()[0]
    start, got, errors = threading.Barrier(4), [], []

    def run():
        start.wait()
        try:
            got.append(assemble_draft(asset, target))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(set(got)) == 1 and (got[0] / ".complete").is_file() and (got[0] / "tokenizer.json").is_file()
    assert not list(got[0].parent.glob(".tmp-*")), "temporary folders left behind"


def test_dtype_auto_is_the_fastest_exact_precision_here():
    """"auto" (the default everywhere) is bfloat16 on the native kernels, float32 on torch's."""
    import torch

    from specrouter.config import PoolConfig
    from specrouter.models.pool import _dtype, resolved_dtype
    from specrouter.models.runners.kernels import rowinv

    assert PoolConfig().dtype == "auto"
    want = torch.bfloat16 if rowinv() is not None else torch.float32
    assert _dtype("auto") == want and resolved_dtype("auto") == str(want).removeprefix("torch.")
    assert resolved_dtype("fp32") == "float32"


def test_the_shipped_head_resolves_and_is_documented():
    """The draft head trained here ships in the package (issue 18): the pool entry
    "default-head" is its folder, it is the documented head of the default target, and
    docs/drafts.md's figures are its report's."""
    from specrouter.config import PoolConfig
    from specrouter.models.heads.level import is_head_dir
    from specrouter.models.default_pool import shipped_head
    from specrouter.models.pool import pool_paths

    head = shipped_head()
    assert is_head_dir(head) and sum(f.stat().st_size for f in head.iterdir()) <= 12 * 2**20
    assert pool_paths(PoolConfig(models=("ngram", "default-head"))) == ["ngram", head]
    recipe = json.loads((head / "recipe.json").read_text())
    report = json.loads((head / "report.json").read_text())
    config = json.loads((head / "head_config.json").read_text())
    assert recipe["steps_done"] == report["steps"] > 0 and recipe["args"]["seed"] == 0
    target = config["target_config"]  # SmolLM2-135M, the default target
    assert (target["hidden_size"], target["vocab_size"]) == (576, 49152)
    assert len(config["vocab_ids"]) == report["vocab_size"] == 8192
    assert _safetensors_params(head / "head.safetensors") >= report["trained_params"]
    assert f"head depth-1 agreement **{report['head']['agreement']:.3f}**" in DRAFTS
    assert f"(**{report['head_cost_ratio']:.3f}** of the target's)" in DRAFTS
    assert f"{report['draft']['agreement']:.3f} for the draft shipped then" in DRAFTS  # stage 2
    assert "`default-head`" in README  # the README tells a user it exists
