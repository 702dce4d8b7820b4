"""The shipped draft assets and their assembly into complete checkpoint directories."""

import json

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
        assert recipe["seed"] == 0 and recipe["steps_done"] > 0
        assert 0.0 <= report["agreement"] <= 1.0


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
